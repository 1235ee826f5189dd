// libFuzzer target for the KV blob reader (kv/blob.h): any byte string, as a header
// and as a whole file, must be read or refused with an Error, never crash, leak a
// block, touch the sequence it was to extend, or be accepted with a checksum that
// does not match (checked against a bitwise CRC32C, not the ISA-L one under test).
// Each input is imported into pools of the header's shape in all three dtypes (the
// other two convert), continuing a sequence of first_pos positions when it fits.
// Every input runs twice: as it is, and with the CRCs a writer would have put in
// (kvfuzz::fix_blob_crcs), so that mutated fields reach the checks behind them.
//   cmake -S . -B build-fuzz -G Ninja -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DDUET_FUZZ=ON \
//     -DDUET_CUDA=OFF -DDUET_BENCH=OFF
//   cmake --build build-fuzz --target kv_blob_fuzz
//   mkdir -p build-fuzz/corpus-kv-blob
//   build-fuzz/tests/kv_blob_fuzz -max_total_time=600 build-fuzz/corpus-kv-blob tests/fuzz/seeds-kv-blob
// (new inputs go to the first folder; the seeds are only read).
// The seeds come from tests/kv_gen.cpp (build/tests/kv_gen fuzz-seeds tests/fuzz).
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <sys/mman.h>
#include <unistd.h>

#include "kv/blob.h"
#include "kv_fuzz_util.h"
#include "kv_gen.h"

using namespace duet;
using kvfuzz::ref_crc32c;
using kvfuzz::rows_bytes;

namespace {

constexpr int32_t kPoolBlocks = 12;
constexpr size_t kMaxPoolBytes = 4u << 20;
int g_fd = -1, g_fd_at = -1;  // memfds: the input as a file, and at offset kAt behind junk
constexpr uint64_t kAt = 13;

// IEEE half and OCP e4m3 ("fn": 0x7f / 0xff NaN, no infinities) decoded from their
// definitions.
float ref_f16(uint16_t b) {
    const int e = (b >> 10) & 31, m = b & 1023;
    const float v = e == 0 ? std::ldexp(static_cast<float>(m), -24)
                  : e == 31 ? (m ? NAN : INFINITY)
                            : std::ldexp(static_cast<float>(1024 + m), e - 25);
    return b & 0x8000 ? -v : v;
}
float ref_e4m3(uint8_t b) {
    const int e = (b >> 3) & 15, m = b & 7;
    if (e == 15 && m == 7) return NAN;
    const float v = e == 0 ? std::ldexp(static_cast<float>(m), -9) : std::ldexp(static_cast<float>(8 + m), e - 10);
    return b & 0x80 ? -v : v;
}

// A quantized blob imported into an f16 arena: every value must be its row's scale
// times its decoded byte, rounded to f16 (half an ulp: 2^-11 relative, 2^-25 among
// subnormals; beyond 65520, infinity). got: the arena's rows in blob order.
void check_dequantized(const BlobHeader& h, const uint8_t* data, const std::vector<uint8_t>& got) {
    const uint64_t dim = static_cast<uint64_t>(h.layout.head_dim);
    const uint64_t n_rows = 2 * static_cast<uint64_t>(h.layout.n_layer) * h.layout.n_head_kv * h.n_tokens;
    const uint8_t* vals = data + kBlobHeaderBytes + 4 * h.n_tokens;
    const uint8_t* scales = vals + n_rows * dim;
    KV_FUZZ_CHECK(got.size() == n_rows * dim * 2, "f16 rows");
    for (uint64_t r = 0; r < n_rows; ++r) {
        float s;
        std::memcpy(&s, scales + 4 * r, 4);
        for (uint64_t d = 0; d < dim; ++d) {
            const uint8_t q = vals[r * dim + d];
            const float x = s * (h.layout.dtype == KvDtype::Int8 ? static_cast<float>(static_cast<int8_t>(q)) : ref_e4m3(q));
            uint16_t bits;
            std::memcpy(&bits, got.data() + 2 * (r * dim + d), 2);
            const float a = ref_f16(bits);
            const bool ok = std::isnan(x)              ? std::isnan(a)
                            : std::fabs(x) >= 65520.0f ? std::isinf(a) && std::signbit(a) == std::signbit(x)
                                                       : std::fabs(a - x) <= std::fmax(std::fabs(x) * 0x1p-11f, 0x1p-25f);
            KV_FUZZ_CHECK(ok, fmt::format("row {} dim {}: scale {} x byte {:#04x} = {}, the arena holds {}", r, d, s, q,
                                          x, a));
        }
    }
}

// Imports the input (the file fd holds from offset `at`) into a fresh pool of
// `arena` and checks the outcome. Returns whether the import succeeded.
bool import_into(int fd, uint64_t at, const uint8_t* data, size_t size, const BlobHeader& h, bool verified,
                 const KvLayout& arena) {
    auto pool_r = KvPool::create(arena, kPoolBlocks);
    KV_FUZZ_CHECK(pool_r.ok(), "pool");
    KvPool& pool = **pool_r;
    const uint64_t bt = static_cast<uint64_t>(arena.block_tokens);
    // The sequence the blob continues: first_pos positions of kv_gen's contents
    // when they fit in half the pool (otherwise empty, and the import must refuse).
    KvSeq seq;
    std::vector<int32_t> prefix_tokens;
    if (h.first_pos <= kPoolBlocks / 2 * bt) {
        Status s = kvgen::append(pool, seq, prefix_tokens, h.first_pos);
        KV_FUZZ_CHECK(s.ok(), "prefix");
    }
    const std::vector<int32_t> blocks_before = seq.blocks();
    const int64_t len_before = seq.n_tokens();
    const std::vector<uint8_t> prefix_before = rows_bytes(pool, seq, 0, static_cast<uint64_t>(len_before));
    const int32_t free_before = pool.allocator().n_free();

    KvIdentity want = kvgen::identity();
    want.n_vocab = kvgen::kVocab;
    auto im = blob_import_fd(fd, at, at + size, want, pool, seq);
    const bool same_dtype = arena.dtype == h.layout.dtype;
    if (!im) {
        KV_FUZZ_CHECK(seq.blocks() == blocks_before && seq.n_tokens() == len_before,
                      "a refused import changed the sequence: " + im.error().message);
        KV_FUZZ_CHECK(pool.allocator().n_free() == free_before,
                      fmt::format("a refused import leaked {} blocks: {}", free_before - pool.allocator().n_free(),
                                  im.error().message));
        KV_FUZZ_CHECK(rows_bytes(pool, seq, 0, static_cast<uint64_t>(len_before)) == prefix_before,
                      "a refused import wrote into the sequence's blocks: " + im.error().message);
        // What verify accepted, that fits this sequence and pool, must be imported.
        const bool tokens_ok = verified && [&] {  // verified: the file holds the tokens
            for (uint64_t i = 0; i < h.n_tokens; ++i) {
                int32_t t;
                std::memcpy(&t, data + kBlobHeaderBytes + 4 * i, 4);
                if (t < 0 || t >= kvgen::kVocab) return false;
            }
            return true;
        }();
        const uint64_t need = (h.first_pos + h.n_tokens + bt - 1) / bt + 1;
        KV_FUZZ_CHECK(!(verified && h.id.model == want.model && h.id.tokenizer == want.tokenizer &&
                        static_cast<uint64_t>(len_before) == h.first_pos && tokens_ok && need <= kPoolBlocks),
                      "a verified blob that fits was refused: " + im.error().message);
    } else {
        KV_FUZZ_CHECK(verified, "import accepted a blob that verify refused");
        KV_FUZZ_CHECK(size == kBlobHeaderBytes + h.data_bytes, "import accepted a file of the wrong size");
        KV_FUZZ_CHECK(ref_crc32c(data + kBlobHeaderBytes, size - kBlobHeaderBytes) == h.data_crc,
                      "import accepted data whose CRC does not match");
        KV_FUZZ_CHECK(static_cast<uint64_t>(seq.n_tokens()) == h.first_pos + h.n_tokens, "length after import");
        KV_FUZZ_CHECK(im->tokens.size() == h.n_tokens &&
                          (h.n_tokens == 0 || std::memcmp(im->tokens.data(), data + kBlobHeaderBytes, 4 * h.n_tokens) == 0),
                      "tokens");
        for (int32_t t : im->tokens) KV_FUZZ_CHECK(t >= 0 && t < kvgen::kVocab, "a token outside the vocabulary");
        KV_FUZZ_CHECK(rows_bytes(pool, seq, 0, h.first_pos) == prefix_before, "the prefix changed");
        KV_FUZZ_CHECK(im->converted == !same_dtype, "converted");
        if (same_dtype) {
            const std::vector<uint8_t> got = rows_bytes(pool, seq, h.first_pos, h.n_tokens);
            const uint8_t* want_rows = data + kBlobHeaderBytes + 4 * h.n_tokens;
            KV_FUZZ_CHECK(got.size() == size - kBlobHeaderBytes - 4 * h.n_tokens &&
                              (got.empty() || std::memcmp(got.data(), want_rows, got.size()) == 0),
                          "the arena rows are not the blob's");
        } else if (arena.dtype == KvDtype::F16) {
            check_dequantized(h, data, rows_bytes(pool, seq, h.first_pos, h.n_tokens));
        }
    }
    seq.release(pool);
    KV_FUZZ_CHECK(pool.allocator().n_free() == kPoolBlocks, "blocks still held after release");
    return im.ok();
}

void one_input(const uint8_t* data, size_t size) {
    auto h = blob_header_decode(data, size);
    if (h) {
        KV_FUZZ_CHECK(size >= kBlobHeaderBytes, "decoded a short header");
        uint32_t stored;
        std::memcpy(&stored, data + 124, 4);
        KV_FUZZ_CHECK(ref_crc32c(data, 124) == stored, "decoded a header whose CRC does not match");
        uint8_t again[kBlobHeaderBytes];
        blob_header_encode(*h, again);
        KV_FUZZ_CHECK(std::memcmp(again, data, kBlobHeaderBytes) == 0, "decode then encode changed the header");
        auto bytes = blob_data_bytes(h->layout, h->n_tokens);
        KV_FUZZ_CHECK(bytes.ok() && *bytes == h->data_bytes, "data_bytes");
    }

    kvfuzz::write_all(g_fd, data, size);
    static const uint8_t junk[kAt] = {'D', 'U', 'E', 'T', 'K', 'V', 'B', 0, 1, 2, 3, 4, 5};
    kvfuzz::write_all(g_fd_at, junk, kAt);
    if (size) {
        size_t done = 0;
        while (done < size) {
            const ssize_t w = ::pwrite(g_fd_at, data + done, size - done, static_cast<off_t>(kAt + done));
            KV_FUZZ_CHECK(w > 0, "pwrite");
            done += static_cast<size_t>(w);
        }
    }
    auto v = blob_verify_file("/proc/self/fd/" + std::to_string(g_fd));
    if (v) {
        KV_FUZZ_CHECK(h.ok(), "verify accepted a header that decode refused");
        KV_FUZZ_CHECK(size == kBlobHeaderBytes + v->data_bytes, "verify accepted a file of the wrong size");
        KV_FUZZ_CHECK(ref_crc32c(data + kBlobHeaderBytes, size - kBlobHeaderBytes) == v->data_crc,
                      "verify accepted data whose CRC does not match");
    } else if (h && size == kBlobHeaderBytes + h->data_bytes) {
        KV_FUZZ_CHECK(ref_crc32c(data + kBlobHeaderBytes, size - kBlobHeaderBytes) != h->data_crc,
                      "verify refused a blob whose data matches its CRC: " + v.error().message);
    }
    if (!h) return;

    for (KvDtype dt : {KvDtype::F16, KvDtype::Int8, KvDtype::Fp8}) {
        KvLayout arena = h->layout;
        arena.dtype = dt;
        if (arena.block_bytes() * kPoolBlocks > kMaxPoolBytes) continue;
        // KvPool puts a tile's f32 scales right after its values: an int8 / fp8 arena
        // whose values_bytes is not a multiple of 4 has misaligned scales (no model
        // has such a shape; a pool limitation, not the blob reader's).
        if (arena.quantized() && arena.values_bytes() % 4 != 0) continue;
        const bool ok = import_into(g_fd, 0, data, size, *h, v.ok(), arena);
        // The same file behind kAt bytes of junk, read from offset kAt: the same outcome.
        if (dt == h->layout.dtype)
            KV_FUZZ_CHECK(import_into(g_fd_at, kAt, data, size, *h, v.ok(), arena) == ok, "import at an offset");
    }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
    g_fd = ::memfd_create("kv_blob_fuzz", MFD_CLOEXEC);
    g_fd_at = ::memfd_create("kv_blob_fuzz_at", MFD_CLOEXEC);
    KV_FUZZ_CHECK(g_fd >= 0 && g_fd_at >= 0, "memfd_create");
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    one_input(data, size);
    // The same bytes with the checksums a writer would have put in: the checks
    // behind the CRCs see the mutated fields too.
    std::vector<uint8_t> fixed(data, data + size);
    kvfuzz::fix_blob_crcs(fixed);
    if (size >= 128 && std::memcmp(fixed.data(), data, size) != 0) one_input(fixed.data(), fixed.size());
    return 0;
}
