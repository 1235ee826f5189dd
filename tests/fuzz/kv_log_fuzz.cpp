// libFuzzer target for KV log recovery (kv_log_scan, KvLog::open): any byte string
// as a log file must be recovered or refused with an Error, never crash or leak a
// block, and the three ways of reading it must agree: without identity or pool,
// with the identity, and replayed into a pool of the header's layout. A log that
// recovers must stay durable: it is opened (its torn tail cut), appended to and
// truncated, and read again, and must then hold exactly its old positions, their
// KV, and the new ones, with no torn tail. Every input runs twice: as it is, and
// with the checksum chain a writer would have put in (kvfuzz::fix_log_crcs), so
// that mutated records reach the record checks, the replay and the durability check.
//   cmake --build build-fuzz --target kv_log_fuzz
//   mkdir -p build-fuzz/corpus-kv-log && cp tests/fuzz/seeds-kv-log/* build-fuzz/corpus-kv-log/
//   build-fuzz/tests/kv_log_fuzz -max_total_time=600 build-fuzz/corpus-kv-log
// The seeds come from tests/kv_gen.cpp (build/tests/kv_gen fuzz-seeds tests/fuzz); the
// checkpoint blob that the seed of context "fz" names is rebuilt here from kv_gen.h.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "kv/kv_log.h"
#include "kv/log_device.h"
#include "kv_fuzz_util.h"
#include "kv_gen.h"

using namespace duet;
using kvfuzz::rows_bytes;
namespace fs = std::filesystem;

namespace {

constexpr size_t kMaxPoolBytes = 8u << 20;
std::string g_dir, g_open_dir, g_path;  // the scanned log (next to the checkpoint blob); where it is reopened
int g_fd = -1;

uint64_t pad8(uint64_t n) { return (8 - (n & 7)) & 7; }

// What any recovered scan must satisfy on its own.
void check_scan(const LogScan& s, size_t size) {
    KV_FUZZ_CHECK(s.file_size == size, "file_size");
    uint64_t off = s.header.bytes(), len = 0;
    for (size_t i = 0; i < s.records.size(); ++i) {
        const LogRecordInfo& r = s.records[i];
        KV_FUZZ_CHECK(r.offset == off, fmt::format("record {} at {}, expected at {}", i, r.offset, off));
        KV_FUZZ_CHECK(r.seq == i, "record numbers");
        off += kRecordHeaderBytes + r.payload_bytes + pad8(r.payload_bytes);
        if (r.type == static_cast<uint16_t>(LogRecordType::Append)) {
            // Version 2: an APPEND may start before the end (an edit), never after it.
            KV_FUZZ_CHECK(r.start <= len, "an APPEND past the end");
            len = r.start + r.n;
        } else if (r.type == static_cast<uint16_t>(LogRecordType::Truncate)) {
            KV_FUZZ_CHECK(r.n <= len, "a TRUNCATE beyond the end");
            len = r.n;
        } else {
            KV_FUZZ_CHECK(r.type == static_cast<uint16_t>(LogRecordType::Checkpoint) && i == 0,
                          "a record type or a CHECKPOINT not first");
            len = r.n;
        }
    }
    KV_FUZZ_CHECK(off <= size, fmt::format("the valid records end at {}, after the file's {} bytes", off, size));
    KV_FUZZ_CHECK(s.valid_end == off, fmt::format("valid_end {}, the records end at {}", s.valid_end, off));
    KV_FUZZ_CHECK(s.torn == (off < size), fmt::format("torn {} with records ending at {} of {}", s.torn, off, size));
    KV_FUZZ_CHECK(s.n_tokens() == len, fmt::format("{} tokens, the records make {}", s.n_tokens(), len));
    KV_FUZZ_CHECK(s.next_seq == s.records.size(), "next_seq");
}

// R2's test, redone from kv_log.h's record layout: the largest batch_seq of the
// record headers that stand on their own (magic, CRC32C of the salt and bytes
// 0..43, zero reserved fields, a known type, a payload under 2^40) at 8-aligned
// offsets in [from, size); -1 when there is none.
int64_t max_batch_after(const uint8_t* data, size_t size, uint64_t from) {
    int64_t best = -1;
    for (uint64_t q = from; q + kRecordHeaderBytes <= size; q += 8) {
        const uint8_t* h = data + q;
        uint32_t magic, crc, res2;
        uint16_t type, res;
        uint64_t batch, pb;
        std::memcpy(&magic, h, 4);
        std::memcpy(&type, h + 4, 2);
        std::memcpy(&res, h + 6, 2);
        std::memcpy(&batch, h + 16, 8);
        std::memcpy(&pb, h + 24, 8);
        std::memcpy(&res2, h + 40, 4);
        std::memcpy(&crc, h + 44, 4);
        if (magic != kRecordMagic || res != 0 || res2 != 0 || type < 1 || type > 3 || pb > (uint64_t{1} << 40))
            continue;
        if (crc != kvfuzz::ref_crc32c(h, 44, kvfuzz::ref_crc32c(data + 72, 8))) continue;
        best = std::max(best, static_cast<int64_t>(batch));
    }
    return best;
}

void check_same(const LogScan& a, const LogScan& b, const char* what) {
    bool same = a.records.size() == b.records.size() && a.tokens == b.tokens && a.valid_end == b.valid_end &&
                a.torn == b.torn && a.last_crc == b.last_crc && a.has_checkpoint == b.has_checkpoint;
    for (size_t i = 0; same && i < a.records.size(); ++i)
        same = a.records[i].offset == b.records[i].offset && a.records[i].type == b.records[i].type &&
               a.records[i].n == b.records[i].n && a.records[i].blob == b.records[i].blob;
    KV_FUZZ_CHECK(same, fmt::format("{}: the scans differ ({} vs {} records, end {} vs {})", what, a.records.size(),
                                    b.records.size(), a.valid_end, b.valid_end));
}

// Open (cutting the torn tail), append and truncate, reopen: nothing of the
// recovered state may be lost and the new records must be there.
void check_durable(const uint8_t* data, size_t size, const LogScan& scan, KvPool& pool,
                   const std::vector<uint8_t>& rows, const KvIdentity& want) {
    const std::string& ctx = scan.header.context;
    const std::string path = g_open_dir + "/" + ctx + ".kvlog";
    {
        const int fd = ::open(path.c_str(), O_CREAT | O_TRUNC | O_WRONLY | O_CLOEXEC, 0600);
        KV_FUZZ_CHECK(fd >= 0, path);
        kvfuzz::write_all(fd, data, size);
        ::close(fd);
    }
    if (scan.has_checkpoint) {
        const std::string blob = scan.records[0].blob;
        fs::copy_file(g_dir + "/" + blob, g_open_dir + "/" + blob, fs::copy_options::overwrite_existing);
    }
    const int32_t n_free = pool.allocator().n_free();
    SyncLogDevice dev;
    KvLogSync sync(dev);
    KvSeq seq;
    LogScan got;
    auto log = KvLog::open(sync, g_open_dir, ctx, want, &pool, &seq, &got);
    KV_FUZZ_CHECK(log.ok(), "a log that scans did not open: " + (log ? std::string() : log.error().message));
    const uint64_t n = scan.n_tokens();
    KV_FUZZ_CHECK(got.tokens == scan.tokens && static_cast<uint64_t>(seq.n_tokens()) == n, "open: tokens");
    KV_FUZZ_CHECK(rows_bytes(pool, seq, 0, n) == rows, "open: the KV differs from the scan's");
    std::vector<int32_t> tokens = scan.tokens;
    const uint64_t k = 1 + size % 3;
    Status s = kvgen::append(pool, seq, tokens, k);
    KV_FUZZ_CHECK(s.ok(), "pool room for the append");
    s = (*log)->append(pool, seq, tokens, n, k);
    KV_FUZZ_CHECK(s.ok(), "append: " + (s ? std::string() : s.error().message));
    const bool cut = size % 2 == 1;
    if (cut) {
        s = (*log)->truncate(n + k - 1);
        KV_FUZZ_CHECK(s.ok(), "truncate");
        seq.truncate(pool, static_cast<int64_t>(n + k - 1));
        tokens.resize(n + k - 1);
    }
    const std::vector<uint8_t> rows_after = rows_bytes(pool, seq, 0, tokens.size());
    log->reset();
    seq.release(pool);

    auto again = kv_log_scan(path, &want, &pool, &seq);
    KV_FUZZ_CHECK(again.ok(), "after open and append: " + (again ? std::string() : again.error().message));
    KV_FUZZ_CHECK(!again->torn && again->valid_end == again->file_size,
                  "a torn tail after open and append: " + again->torn_reason);
    KV_FUZZ_CHECK(again->records.size() == scan.records.size() + (cut ? 2 : 1), "records after the append");
    KV_FUZZ_CHECK(again->tokens == tokens, "tokens after the append");
    KV_FUZZ_CHECK(rows_bytes(pool, seq, 0, tokens.size()) == rows_after, "KV after the append");
    seq.release(pool);
    KV_FUZZ_CHECK(pool.allocator().n_free() == n_free, "blocks leaked by open, append and scan");
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(g_open_dir, ec)) fs::remove(e.path(), ec);
}

void one_input(const uint8_t* data, size_t size) {
    kvfuzz::write_all(g_fd, data, size);
    KvIdentity want = kvgen::identity();

    auto plain = kv_log_scan(g_path);
    auto with_id = kv_log_scan(g_path, &want);
    if (plain) {
        check_scan(*plain, size);
        // A torn tail is cut: no record of a later commit than the failed one may follow.
        if (plain->torn)
            KV_FUZZ_CHECK(max_batch_after(data, size, plain->valid_end + 8) <= static_cast<int64_t>(plain->records.size()),
                          "a torn tail hides a record of a later commit (mid-log corruption): " + plain->torn_reason);
    }
    if (with_id) {
        KV_FUZZ_CHECK(plain.ok(), "the identity made a log valid");
        check_same(*plain, *with_id, "identity");
    } else if (plain) {
        KV_FUZZ_CHECK(plain->header.id.model != want.model || plain->header.id.tokenizer != want.tokenizer,
                      "the identity matches and still refused: " + with_id.error().message);
    }

    auto h = log_header_decode(data, size);
    KV_FUZZ_CHECK(h.ok() || !plain.ok(), "a scan without a header");
    if (!h) return;
    // Replay into a pool of the log's layout with room for every position the file
    // could hold at once (the checkpoint's and one per APPEND payload's bytes) and
    // for the durability check's append.
    const KvLayout& lay = h->layout;
    const uint64_t per_token = 4 + static_cast<uint64_t>(lay.bytes_per_token());
    const uint64_t max_tokens = kvgen::kCheckpointTokens + size / per_token + 4;
    const uint64_t blocks = max_tokens / static_cast<uint64_t>(lay.block_tokens) + 2;
    if (lay.block_bytes() * blocks > kMaxPoolBytes) return;
    if (lay.quantized() && lay.values_bytes() % 4 != 0) return;  // KvPool's scales would be misaligned
    auto pool_r = KvPool::create(lay, static_cast<int32_t>(blocks));
    KV_FUZZ_CHECK(pool_r.ok(), "pool");
    KvPool& pool = **pool_r;
    KvSeq seq;
    auto replay = kv_log_scan(g_path, &want, &pool, &seq);
    if (!replay) {
        KV_FUZZ_CHECK(seq.blocks().empty() && seq.n_tokens() == 0, "a refused replay left blocks in the sequence");
        KV_FUZZ_CHECK(pool.allocator().n_free() == static_cast<int32_t>(blocks),
                      "a refused replay leaked blocks: " + replay.error().message);
        KV_FUZZ_CHECK(!with_id.ok(), "the scan recovered, the replay refused: " + replay.error().message);
        return;
    }
    KV_FUZZ_CHECK(with_id.ok(), "the replay recovered, the scan refused: " + with_id.error().message);
    check_same(*with_id, *replay, "replay");
    KV_FUZZ_CHECK(static_cast<uint64_t>(seq.n_tokens()) == replay->n_tokens(), "replayed length");
    const std::vector<uint8_t> rows = rows_bytes(pool, seq, 0, replay->n_tokens());
    seq.release(pool);
    KV_FUZZ_CHECK(pool.allocator().n_free() == static_cast<int32_t>(blocks), "blocks held after release");
    check_durable(data, size, *replay, pool, rows, want);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
    g_dir = kvfuzz::scratch_dir("kv_log_fuzz");
    g_open_dir = kvfuzz::scratch_dir("kv_log_fuzz_open");
    Status s = kvgen::write_checkpoint_blob(g_dir);
    KV_FUZZ_CHECK(s.ok(), s ? "" : s.error().message);
    g_path = g_dir + "/input.kvlog";
    g_fd = ::open(g_path.c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0600);
    KV_FUZZ_CHECK(g_fd >= 0, g_path);
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    one_input(data, size);
    // The same bytes with the checksums a writer would have put in: the checks
    // behind the CRCs see the mutated fields too.
    std::vector<uint8_t> fixed(data, data + size);
    kvfuzz::fix_log_crcs(fixed);
    if (size >= 128 && std::memcmp(fixed.data(), data, size) != 0) one_input(fixed.data(), fixed.size());
    return 0;
}
