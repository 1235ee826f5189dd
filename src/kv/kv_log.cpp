#include "kv/kv_log.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include <dirent.h>
#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kv/crc32c.h"
#include "kv/le_bytes.h"

namespace duet {

using le::get;
using le::put;

namespace {

constexpr char kLogMagic[8] = {'D', 'U', 'E', 'T', 'K', 'V', 'L', '\0'};
// Bytes 48..67 hold the KV layout, as in a blob header (kv_layout_put / kv_layout_get).
constexpr size_t kOffVersion = 8, kOffHeaderBytes = 12, kOffModel = 16, kOffTokenizer = 32, kOffReserved0 = 62,
                 kOffFlags = 68, kOffSalt = 72, kOffGeneration = 80, kOffContext = 88,
                 kContextBytes = 32, kOffReserved1 = 120, kOffHeaderCrc = 124;
// Version 3 (192 bytes): the same up to the name, which takes 72 bytes (64 characters
// and at least one NUL), zeros up to the CRC in the last 4 bytes.
constexpr size_t kContextBytesV3 = 72, kOffReservedV3 = 160, kOffHeaderCrcV3 = 188;
constexpr size_t kMaxContextName = 64;

// The name field's size and the CRC's offset of a header of `version`.
size_t context_field_bytes(uint32_t version) { return version >= 3 ? kContextBytesV3 : kContextBytes; }
size_t header_crc_offset(uint32_t version) { return version >= 3 ? kOffHeaderCrcV3 : kOffHeaderCrc; }
// Record header fields.
constexpr size_t kRecType = 4, kRecReserved = 6, kRecSeq = 8, kRecBatch = 16, kRecPayload = 24, kRecPayloadCrc = 32,
                 kRecPrevCrc = 36, kRecReserved2 = 40, kRecHeaderCrc = 44;
constexpr uint64_t kMaxPayload = uint64_t{1} << 40;
const uint8_t kZeros[8] = {};

uint64_t pad8(uint64_t n) { return (8 - (n & 7)) & 7; }

uint32_t record_header_crc(const uint8_t* h, uint64_t salt) {
    return crc32c(h, kRecHeaderCrc, crc32c(&salt, sizeof salt));
}

void record_header_encode(uint8_t* h, LogRecordType type, uint64_t seq, uint64_t batch_seq, uint64_t payload_bytes,
                          uint32_t payload_crc, uint32_t prev_crc, uint64_t salt) {
    std::memset(h, 0, kRecordHeaderBytes);
    put<uint32_t>(h, 0, kRecordMagic);
    put<uint16_t>(h, kRecType, static_cast<uint16_t>(type));
    put<uint64_t>(h, kRecSeq, seq);
    put<uint64_t>(h, kRecBatch, batch_seq);
    put<uint64_t>(h, kRecPayload, payload_bytes);
    put<uint32_t>(h, kRecPayloadCrc, payload_crc);
    put<uint32_t>(h, kRecPrevCrc, prev_crc);
    put<uint32_t>(h, kRecHeaderCrc, record_header_crc(h, salt));
}

// A record header that stands on its own: magic, CRC with this log's salt, zero
// reserved fields, a known type, a payload size in range. Empty when it does.
std::string record_header_problem(const uint8_t* h, uint64_t salt) {
    if (get<uint32_t>(h, 0) != kRecordMagic) return "no record magic";
    if (get<uint32_t>(h, kRecHeaderCrc) != record_header_crc(h, salt)) return "record header CRC mismatch";
    if (get<uint16_t>(h, kRecReserved) != 0 || get<uint32_t>(h, kRecReserved2) != 0) return "reserved fields not zero";
    const uint16_t t = get<uint16_t>(h, kRecType);
    if (t < 1 || t > 3) return fmt::format("unknown record type {}", t);
    if (get<uint64_t>(h, kRecPayload) > kMaxPayload) return "payload size out of range";
    return {};
}

Error errno_error(const char* what, const std::string& path, int e = errno) {
    return make_error(errno_kind(e), "{} {}: {}", what, path, std::strerror(e));
}

uint64_t random_salt() {
    uint64_t s = 0;
    while (s == 0)
        if (::getrandom(&s, sizeof s, 0) != sizeof s) s = 0;
    return s;
}

struct Fd {
    int fd = -1;
    explicit Fd(int f) : fd(f) {}
    ~Fd() {
        if (fd >= 0) ::close(fd);
    }
    int release() { return std::exchange(fd, -1); }
};

bool same_kv_shape(const KvLayout& a, const KvLayout& b) {
    return a.n_layer == b.n_layer && a.n_head_kv == b.n_head_kv && a.head_dim == b.head_dim &&
           a.block_tokens == b.block_tokens && a.dtype == b.dtype;
}

// Bytes of an APPEND payload of n positions.
Result<uint64_t> append_payload_bytes(const KvLayout& l, uint64_t n) {
    auto b = blob_data_bytes(l, n);  // tokens + rows
    if (!b) return b.error();
    return 16 + *b;
}

}  // namespace

const char* log_record_type_name(uint16_t t) {
    switch (t) {
        case 1: return "APPEND";
        case 2: return "TRUNCATE";
        case 3: return "CHECKPOINT";
        default: return "?";
    }
}

Status check_context_name(const std::string& name) {
    if (name.empty() || name.size() > kMaxContextName)
        return make_error("context name '{}': 1 to {} characters of A-Z a-z 0-9 _ . -", name, kMaxContextName);
    for (char c : name)
        if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '.'))
            return make_error("context name '{}': only A-Z a-z 0-9 _ . - are allowed", name);
    return {};
}

std::string context_of_file(const std::string& f) {
    auto strip = [&](const std::string& s, const std::string& suffix, std::string& out) {
        if (s.size() <= suffix.size() || s.compare(s.size() - suffix.size(), suffix.size(), suffix) != 0) return false;
        out = s.substr(0, s.size() - suffix.size());
        return true;
    };
    auto named = [](const std::string& c) { return check_context_name(c).ok() ? c : std::string(); };
    // <c>.<digits>: c, else "".
    auto without_generation = [&](const std::string& s) {
        const size_t dot = s.rfind('.');
        if (dot == std::string::npos || dot + 1 == s.size() ||
            s.find_first_not_of("0123456789", dot + 1) != std::string::npos)
            return std::string();
        return named(s.substr(0, dot));
    };
    std::string stem;
    if (strip(f, ".kvlog", stem) || strip(f, ".kvlog.tmp", stem) || strip(f, ".pin", stem)) return named(stem);
    if (strip(f, ".kvblob", stem)) return without_generation(stem);
    if (const size_t t = f.rfind(".kvblob.tmp."); t != std::string::npos) return without_generation(f.substr(0, t));
    return {};
}

void log_header_encode(const LogHeader& h, uint8_t out[kLogHeaderBytesMax]) {
    const size_t bytes = h.bytes();
    std::memset(out, 0, bytes);
    std::memcpy(out, kLogMagic, 8);
    put<uint32_t>(out, kOffVersion, h.version);
    put<uint32_t>(out, kOffHeaderBytes, static_cast<uint32_t>(bytes));
    std::memcpy(out + kOffModel, h.id.model.data(), 16);
    std::memcpy(out + kOffTokenizer, h.id.tokenizer.data(), 16);
    kv_layout_put(out, h.layout);
    put<uint64_t>(out, kOffSalt, h.salt);
    put<uint64_t>(out, kOffGeneration, h.generation);
    std::memcpy(out + kOffContext, h.context.data(), std::min(h.context.size(), context_field_bytes(h.version) - 1));
    put<uint32_t>(out, header_crc_offset(h.version), crc32c(out, header_crc_offset(h.version)));
}

Result<LogHeader> log_header_decode(const uint8_t* p, size_t n) {
    if (n < kLogHeaderBytes) return make_error("truncated header: {} bytes, a KV log header is {}", n, kLogHeaderBytes);
    if (std::memcmp(p, kLogMagic, 8) != 0) return make_error("magic: not a duet KV log (expected 'DUETKVL')");
    LogHeader h;
    // The version picks the layout (where the CRC is), then the CRC covers it.
    h.version = get<uint32_t>(p, kOffVersion);
    const size_t crc_at = header_crc_offset(h.version);
    if (n < h.bytes()) return make_error("truncated header: {} bytes, a version {} KV log header is {}", n, h.version, h.bytes());
    h.crc = get<uint32_t>(p, crc_at);
    if (const uint32_t c = crc32c(p, crc_at); c != h.crc)
        return make_error("header_crc: stored {:#010x}, computed {:#010x} (the log header is corrupt)", h.crc, c);
    if (h.version < kLogVersionMin || h.version > kLogVersion)
        return make_error("version: the log is format version {}, this build reads versions {} to {}", h.version,
                          kLogVersionMin, kLogVersion);
    if (uint32_t hb = get<uint32_t>(p, kOffHeaderBytes); hb != h.bytes())
        return make_error("header_bytes: {}, expected {}", hb, h.bytes());
    auto lay = kv_layout_get(p);
    if (!lay) return lay.error();
    h.layout = *lay;
    bool reserved_zero = get<uint16_t>(p, kOffReserved0) == 0;
    if (h.version >= 3) {
        for (size_t i = kOffReservedV3; i < kOffHeaderCrcV3; ++i) reserved_zero = reserved_zero && p[i] == 0;
    } else {
        reserved_zero = reserved_zero && get<uint32_t>(p, kOffReserved1) == 0;
    }
    if (!reserved_zero) return make_error("reserved header bytes are not zero");
    if (uint32_t f = get<uint32_t>(p, kOffFlags); f != 0)
        return make_error("flags: {:#x} has bits this build does not know (none are defined)", f);
    std::memcpy(h.id.model.data(), p + kOffModel, 16);
    std::memcpy(h.id.tokenizer.data(), p + kOffTokenizer, 16);
    h.salt = get<uint64_t>(p, kOffSalt);
    h.generation = get<uint64_t>(p, kOffGeneration);
    const size_t field = context_field_bytes(h.version);
    const char* c = reinterpret_cast<const char*>(p + kOffContext);
    h.context.assign(c, strnlen(c, field));
    if (h.context.size() == field) return make_error("context: the name is not NUL-terminated");
    for (size_t i = kOffContext + h.context.size(); i < kOffContext + field; ++i)
        if (p[i] != 0) return make_error("context: bytes after the name's end are not zero");
    if (Status s = check_context_name(h.context); !s) return make_error("context: {}", s.error().message);
    // Names a version 1 or 2 header can hold: 31 characters, no dots.
    if (h.version < 3 && (h.context.size() >= kContextBytes || h.context.find('.') != std::string::npos))
        return make_error("context: '{}' in a version {} header (at most 31 of A-Z a-z 0-9 _ -)", h.context, h.version);
    return h;
}

// ---------------------------------------------------------------------------
// Recovery (KVLOG.md "Recovery rules").

namespace {

struct Scanner {
    int fd;
    std::string path, dir;
    uint64_t size;
    const KvIdentity* want;
    KvPool* pool;
    KvSeq* seq;
    LogScan out;
    // Reads [at, at + n) into p; false on a short read.
    bool read(uint64_t at, void* p, size_t n) {
        return pread_iov(fd, at, std::array{iovec{p, n}}).ok();
    }
    // A record that failed at `off` for `why`: a torn tail unless a valid record of
    // a later commit follows (then an Error: mid-log corruption).
    Status fail_at(uint64_t off, uint64_t failed_seq, const std::string& why) {
        std::vector<uint8_t> buf;
        constexpr size_t kChunk = 1 << 20;
        for (uint64_t base = off + 8; base + kRecordHeaderBytes <= size; base += kChunk) {
            const size_t k = static_cast<size_t>(std::min<uint64_t>(kChunk + kRecordHeaderBytes, size - base));
            buf.resize(k);
            if (!read(base, buf.data(), k)) break;
            for (size_t q = 0; q + kRecordHeaderBytes <= k && q < kChunk; q += 8) {
                const uint8_t* h = buf.data() + q;
                if (get<uint32_t>(h, 0) != kRecordMagic || !record_header_problem(h, out.header.salt).empty()) continue;
                const uint64_t bseq = get<uint64_t>(h, kRecBatch), s = get<uint64_t>(h, kRecSeq);
                if (bseq > failed_seq)
                    return make_error(
                        "{}: record {} at offset {} is bad ({}), but a valid record of a later commit follows at "
                        "offset {} (record {}): mid-log corruption, not a torn tail; the context is refused and its "
                        "files are left untouched for inspection (duet kv inspect {})",
                        path, failed_seq, off, why, base + q, s, path);
            }
        }
        out.torn = true;
        out.torn_reason = fmt::format("record {} at offset {}: {}", failed_seq, off, why);
        return {};
    }

    Status run() {
        uint8_t hb[kLogHeaderBytesMax] = {};
        if (size < kLogHeaderBytes || !read(0, hb, kLogHeaderBytes))
            return make_error("{}: truncated header: {} bytes, a KV log header is {}", path, size, kLogHeaderBytes);
        size_t have = kLogHeaderBytes;
        if (get<uint32_t>(hb, kOffVersion) >= 3 && size >= kLogHeaderBytesV3 &&
            read(kLogHeaderBytes, hb + kLogHeaderBytes, kLogHeaderBytesV3 - kLogHeaderBytes))
            have = kLogHeaderBytesV3;
        auto h = log_header_decode(hb, have);
        if (!h) return make_error("{}: {}", path, h.error().message);
        out.header = *h;
        out.valid_end = h->bytes();
        if (want) {
            BlobHeader as_blob;
            as_blob.id = h->id;
            as_blob.layout = h->layout;
            const KvLayout& arena = pool ? pool->layout() : h->layout;
            if (Status s = blob_check_compatible(as_blob, *want, arena); !s)
                return make_error("{}: {}", path, s.error().message);
        }
        if (pool && pool->layout().dtype != h->layout.dtype)
            return make_error("{}: dtype: the log holds {} KV, this arena {} (export a blob and import it to convert)",
                              path, kv_dtype_name(h->layout.dtype), kv_dtype_name(pool->layout().dtype));
        uint64_t off = h->bytes(), seqno = 0, len = 0, prev_batch = 0;
        uint32_t prev = h->crc;
        out.last_crc = prev;
        out.next_seq = 0;
        // A larger readahead window for the sequential replay. (WILLNEED windows ahead
        // of the reads were tried and lost: 4096 tokens restored warm in 19 ms instead
        // of 12, cold in 62 ms instead of 36, against a 33 ms sequential read floor.)
        ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
        const KvLayout& lay = h->layout;
        while (off < size) {
            uint8_t rh[kRecordHeaderBytes];
            if (size - off < kRecordHeaderBytes)
                return fail_at(off, seqno, fmt::format("a record header cut short ({} of {} bytes)", size - off,
                                                       kRecordHeaderBytes));
            read(off, rh, kRecordHeaderBytes);
            if (std::string p = record_header_problem(rh, h->salt); !p.empty()) return fail_at(off, seqno, p);
            if (get<uint64_t>(rh, kRecSeq) != seqno)
                return fail_at(off, seqno, fmt::format("record number {} where {} was due", get<uint64_t>(rh, kRecSeq), seqno));
            if (get<uint32_t>(rh, kRecPrevCrc) != prev) return fail_at(off, seqno, "does not chain to the record before it");
            // A commit's records share its first record's seq: batch_seq starts a new
            // commit here or continues the previous record's.
            if (const uint64_t bs = get<uint64_t>(rh, kRecBatch); bs != seqno && (seqno == 0 || bs != prev_batch))
                return fail_at(off, seqno, fmt::format("batch_seq {} neither starts a commit nor continues {}", bs, prev_batch));
            prev_batch = get<uint64_t>(rh, kRecBatch);
            LogRecordInfo info;
            info.offset = off;
            info.type = get<uint16_t>(rh, kRecType);
            info.seq = seqno;
            info.batch_seq = get<uint64_t>(rh, kRecBatch);
            info.payload_bytes = get<uint64_t>(rh, kRecPayload);
            const uint32_t pcrc = get<uint32_t>(rh, kRecPayloadCrc);
            const uint64_t pb = info.payload_bytes, body = off + kRecordHeaderBytes;
            if (pb > size - body)
                return fail_at(off, seqno, fmt::format("payload cut short ({} of {} bytes)", size - body, pb));
            // Cut padding is a torn record too: its write never completed, so it was never
            // acknowledged, and keeping it would put the next append at an offset that is
            // not a multiple of 8, where recovery never looks (the append would be lost).
            if (pad8(pb) > size - body - pb)
                return fail_at(off, seqno,
                               fmt::format("padding cut short ({} of {} bytes)", size - body - pb, pad8(pb)));
            const auto payload_crc_ok = [&]() -> Result<bool> {
                auto c = crc32c_file(fd, body, pb);
                if (!c) return c.error();
                return *c == pcrc;
            };
            const auto nonsense = [&](const std::string& what) {
                return make_error("{}: record {} at offset {} ({}) is valid but {}; the context is refused and its "
                                  "files are left untouched",
                                  path, seqno, off, log_record_type_name(info.type), what);
            };
            switch (static_cast<LogRecordType>(info.type)) {
                case LogRecordType::Append: {
                    uint64_t sn[2] = {0, 0};
                    if (pb >= 16) read(body, sn, 16);
                    info.start = sn[0];
                    info.n = sn[1];
                    auto want_pb = append_payload_bytes(lay, sn[1]);
                    // An APPEND before the end is an edit (version 2): it replaces the
                    // positions from its start.
                    const bool shape_ok = pb >= 16 && want_pb && *want_pb == pb && sn[0] <= len;
                    if (shape_ok && pool && sn[0] < len) {
                        // The edit drops positions the state before it holds: checked
                        // whole first, so a torn edit leaves the sequence as it was.
                        auto ok = payload_crc_ok();
                        if (!ok) return ok.error();
                        if (!*ok) return fail_at(off, seqno, "payload CRC mismatch");
                        seq->truncate(*pool, static_cast<int64_t>(sn[0]));
                        out.tokens.resize(sn[0]);
                        len = sn[0];
                    }
                    if (!shape_ok || !pool) {
                        auto ok = payload_crc_ok();
                        if (!ok) return ok.error();
                        if (!*ok) return fail_at(off, seqno, "payload CRC mismatch");
                        if (!shape_ok)
                            return nonsense(pb < 16 || !want_pb || *want_pb != pb
                                                ? fmt::format("its size {} does not hold {} positions", pb, sn[1])
                                                : fmt::format("appends at position {} to a context of {}", sn[0], len));
                        out.tokens.resize(sn[0]);  // an edit drops the positions from its start
                        len = sn[0];
                        const size_t t0 = out.tokens.size();
                        out.tokens.resize(t0 + sn[1]);
                        read(body + 16, out.tokens.data() + t0, sn[1] * 4);
                    } else {
                        // Replay: the rows go straight into the sequence's new blocks.
                        if (Status s = seq->prepare_append(*pool, static_cast<int64_t>(len), static_cast<int64_t>(len + sn[1])); !s)
                            return make_error("{}: replaying record {}: {}", path, seqno, s.error().message);
                        const size_t t0 = out.tokens.size();
                        out.tokens.resize(t0 + sn[1]);
                        auto rows = kv_rows_iov(*pool, seq->blocks(), len, sn[1]);
                        if (!rows) return rows.error();
                        std::vector<iovec> iov;
                        iov.reserve(rows->size() + 1);
                        iov.push_back({out.tokens.data() + t0, sn[1] * 4});
                        iov.insert(iov.end(), rows->begin(), rows->end());
                        Status rd = pread_iov(fd, body + 16, iov);
                        const uint32_t c = crc32c_iov(iov, crc32c(sn, 16));
                        if (!rd || c != pcrc) {
                            seq->truncate(*pool, static_cast<int64_t>(len));
                            out.tokens.resize(t0);
                            return fail_at(off, seqno, "payload CRC mismatch");
                        }
                        seq->set_n_tokens(static_cast<int64_t>(len + sn[1]));
                    }
                    len += sn[1];
                    break;
                }
                case LogRecordType::Truncate: {
                    uint64_t nl = 0;
                    if (pb == 8) read(body, &nl, 8);
                    auto ok = payload_crc_ok();
                    if (!ok) return ok.error();
                    if (!*ok) return fail_at(off, seqno, "payload CRC mismatch");
                    if (pb != 8) return nonsense(fmt::format("its size is {}, not 8", pb));
                    if (nl > len) return nonsense(fmt::format("truncates to {} a context of {}", nl, len));
                    info.n = nl;
                    len = nl;
                    out.tokens.resize(nl);
                    if (pool) seq->truncate(*pool, static_cast<int64_t>(nl));
                    break;
                }
                case LogRecordType::Checkpoint: {
                    std::vector<uint8_t> p(static_cast<size_t>(std::min<uint64_t>(pb, 4096)));
                    if (pb <= 4096) read(body, p.data(), p.size());
                    auto ok = payload_crc_ok();
                    if (!ok) return ok.error();
                    if (!*ok) return fail_at(off, seqno, "payload CRC mismatch");
                    if (pb < 16 || pb > 16 + 255 || get<uint32_t>(p.data(), 12) != pb - 16)
                        return nonsense(fmt::format("its size {} does not hold a blob name", pb));
                    if (seqno != 0) return nonsense("is not the log's first record");
                    info.n = get<uint64_t>(p.data(), 0);
                    const uint32_t blob_crc = get<uint32_t>(p.data(), 8);
                    info.blob.assign(reinterpret_cast<const char*>(p.data() + 16), pb - 16);
                    const std::string want_name =
                        fmt::format("{}.{}.kvblob", h->context, h->generation);
                    if (info.blob != want_name)
                        return nonsense(fmt::format("names blob '{}', expected '{}'", info.blob, want_name));
                    const std::string bp = dir + "/" + info.blob;
                    if (pool) {
                        KvIdentity id = want ? *want : h->id;
                        auto im = blob_import(bp, id, *pool, *seq);
                        if (!im) return nonsense(fmt::format("its checkpoint cannot be read: {}", im.error().message));
                        if (im->converted || im->header.data_crc != blob_crc || im->header.n_tokens != info.n ||
                            im->header.first_pos != 0 || im->header.id.model != h->id.model ||
                            im->header.id.tokenizer != h->id.tokenizer) {
                            seq->release(*pool);
                            return nonsense(fmt::format("its checkpoint {} is not the blob it names (CRC {:#010x}, {} "
                                                        "tokens expected)",
                                                        bp, blob_crc, info.n));
                        }
                        out.tokens = std::move(im->tokens);
                    } else {
                        auto bh = blob_verify_file(bp);
                        if (!bh) return nonsense(fmt::format("its checkpoint {} fails: {}", bp, bh.error().message));
                        if (bh->data_crc != blob_crc || bh->n_tokens != info.n || bh->first_pos != 0 ||
                            !same_kv_shape(bh->layout, lay) || bh->id.model != h->id.model ||
                            bh->id.tokenizer != h->id.tokenizer)
                            return nonsense(fmt::format("its checkpoint {} is not the blob it names", bp));
                        out.tokens.resize(info.n);
                        const int bfd = ::open(bp.c_str(), O_RDONLY | O_CLOEXEC);
                        Fd guard(bfd);
                        if (bfd < 0 || !pread_iov(bfd, kBlobHeaderBytes, std::array{iovec{out.tokens.data(), info.n * 4}}))
                            return nonsense(fmt::format("its checkpoint {} cannot be read", bp));
                    }
                    out.has_checkpoint = true;
                    out.live_checkpoint_gen = h->generation;
                    len = info.n;
                    break;
                }
            }
            prev = get<uint32_t>(rh, kRecHeaderCrc);
            out.records.push_back(std::move(info));
            ++seqno;
            off = body + pb + pad8(pb);
            out.valid_end = off;
            out.last_crc = prev;  // where the next append chains from, even if a torn record follows
            out.next_seq = seqno;
        }
        return {};
    }
};

}  // namespace

Result<LogScan> kv_log_scan(const std::string& path, const KvIdentity* want, KvPool* pool, KvSeq* seq) {
    if (pool && (!seq || seq->n_tokens() != 0 || !seq->blocks().empty()))
        return make_error("kv_log_scan: replay needs an empty sequence");
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return errno_error("open", path);
    Fd guard(fd);
    struct stat st {};
    if (::fstat(fd, &st) != 0) return errno_error("stat", path);
    const size_t slash = path.rfind('/');
    Scanner s{fd, path, slash == std::string::npos ? "." : path.substr(0, slash), static_cast<uint64_t>(st.st_size),
              want, pool, seq, {}};
    s.out.file_size = s.size;
    s.out.valid_end = kLogHeaderBytes;  // run() moves it past the header it reads
    Status r = s.run();
    if (!r) {
        if (pool) seq->release(*pool);
        return r.error();
    }
    return std::move(s.out);
}

// ---------------------------------------------------------------------------
// Group commit.

struct KvLogSync::Pending {
    KvLog* log = nullptr;
    LogRecordType type = LogRecordType::Append;
    std::vector<iovec> payload;
    uint64_t payload_bytes = 0;
    uint32_t payload_crc = 0;
    uint64_t start = 0;       // APPEND: where it must land
    uint64_t new_length = 0;  // the context's length after the record
    uint8_t header[kRecordHeaderBytes] = {};
    Status status;
    bool done = false;
};

Status KvLogSync::submit(Pending& p) {
    std::unique_lock lk(mu_);
    queue_.push_back(&p);
    while (!p.done) {
        if (leader_) {
            cv_.wait(lk);
            continue;
        }
        leader_ = true;
        std::vector<Pending*> batch;
        if (group_) {
            batch.swap(queue_);
        } else {
            batch.push_back(queue_.front());
            queue_.erase(queue_.begin());
        }
        lk.unlock();
        commit(batch);
        lk.lock();
        for (Pending* q : batch) q->done = true;
        leader_ = false;
        cv_.notify_all();
    }
    return p.status;
}

void KvLogSync::commit(std::vector<Pending*>& batch) {
    // Per log, in arrival order: its records of this batch.
    struct Group {
        KvLog* log;
        std::vector<Pending*> items;
        // The log's state after these records, applied once they are durable.
        uint64_t bytes = 0, n_tokens = 0;
        uint32_t last_crc = 0;
    };
    std::vector<Group> groups;
    for (Pending* p : batch) {
        auto it = std::find_if(groups.begin(), groups.end(), [&](const Group& g) { return g.log == p->log; });
        if (it == groups.end()) {
            groups.push_back({p->log, {}, 0, 0, 0});
            it = groups.end() - 1;
        }
        it->items.push_back(p);
    }
    std::vector<LogWrite> ops;
    std::vector<size_t> op_group;
    for (size_t gi = 0; gi < groups.size(); ++gi) {
        Group& g = groups[gi];
        KvLog& log = *g.log;
        std::vector<Pending*> ok;
        uint64_t len = log.n_tokens_;
        for (Pending* p : g.items) {
            if (log.poisoned_) {
                p->status = make_error("{}", log.poison_reason_);
            } else if (p->type == LogRecordType::Append && p->start > len) {
                p->status = make_error("{}: an append at position {} to a context of {} positions", log.path_,
                                       p->start, len);
            } else if (p->type == LogRecordType::Truncate && p->new_length > len) {
                p->status = make_error("{}: a truncation to {} of a context of {} positions", log.path_,
                                       p->new_length, len);
            } else {
                ok.push_back(p);
                len = p->new_length;
            }
        }
        g.items = ok;
        if (ok.empty()) continue;
        LogWrite w;
        w.fd = log.fd_;
        w.offset = log.size_;
        uint32_t prev = log.prev_crc_;
        const uint64_t batch_seq = log.next_seq_;
        for (size_t k = 0; k < ok.size(); ++k) {
            Pending& p = *ok[k];
            record_header_encode(p.header, p.type, batch_seq + k, batch_seq, p.payload_bytes, p.payload_crc, prev,
                                 log.header_.salt);
            prev = get<uint32_t>(p.header, kRecHeaderCrc);
            w.iov.push_back({p.header, kRecordHeaderBytes});
            w.iov.insert(w.iov.end(), p.payload.begin(), p.payload.end());
            if (uint64_t pad = pad8(p.payload_bytes)) w.iov.push_back({const_cast<uint8_t*>(kZeros), pad});
            g.bytes += kRecordHeaderBytes + p.payload_bytes + pad8(p.payload_bytes);
        }
        g.n_tokens = len;
        g.last_crc = prev;
        ops.push_back(std::move(w));
        op_group.push_back(gi);
    }
    std::vector<LogWriteResult> res(ops.size());
    dev_.write_sync(ops, res);
    // Short writes: the link chain broke after `written` bytes and the sync was
    // cancelled. Write the rest (and sync) again until done or an error.
    std::vector<uint64_t> done_bytes(ops.size(), 0);
    // No cap on the rounds: each one either makes progress or ends the op with an
    // error (no progress twice), so the loop ends; a cap would misreport a slow but
    // working device as a failed fdatasync and poison the log with the write uncut.
    for (int round = 0;; ++round) {
        std::vector<LogWrite> again;
        std::vector<size_t> which;
        for (size_t i = 0; i < ops.size(); ++i) {
            done_bytes[i] += res[i].written;
            const uint64_t total = groups[op_group[i]].bytes;
            if (res[i].write_err == 0 && done_bytes[i] < total) {
                if (res[i].written == 0 && round > 0) {
                    res[i].write_err = EIO;  // no progress and no error: give up
                    continue;
                }
                LogWrite w;
                w.fd = ops[i].fd;
                w.offset = ops[i].offset + done_bytes[i];
                uint64_t skip = done_bytes[i];
                for (const iovec& v : ops[i].iov) {
                    if (skip >= v.iov_len) {
                        skip -= v.iov_len;
                        continue;
                    }
                    w.iov.push_back({static_cast<uint8_t*>(v.iov_base) + skip, v.iov_len - skip});
                    skip = 0;
                }
                again.push_back(std::move(w));
                which.push_back(i);
            } else {
                res[i].written = 0;  // counted
            }
        }
        if (again.empty()) break;
        std::vector<LogWriteResult> r2(again.size());
        dev_.write_sync(again, r2);
        for (size_t k = 0; k < which.size(); ++k) res[which[k]] = r2[k];
    }
    for (size_t i = 0; i < ops.size(); ++i) {
        Group& g = groups[op_group[i]];
        KvLog& log = *g.log;
        Status st;
        if (res[i].write_err != 0) {
            // The batch is not durable: cut what it wrote so the file ends at the
            // last durable record again, and say the state kept.
            const int e = res[i].write_err;
            bool cut = ::ftruncate(log.fd_, static_cast<off_t>(log.size_)) == 0 && ::fdatasync(log.fd_) == 0;
            st = make_error(errno_kind(e),
                            "{}: writing {} bytes at offset {}: {}; the context keeps its last durable state ({} "
                            "positions)",
                            log.path_, g.bytes, log.size_, std::strerror(e), log.n_tokens_);
            if (!cut) {
                std::lock_guard lk(mu_);
                log.poisoned_ = true;
                log.poison_reason_ = fmt::format(
                    "{}: the log is poisoned: a failed write could not be cut off ({}); reopen the context from disk",
                    log.path_, std::strerror(errno));
            }
        } else if (res[i].sync_err != 0) {
            // fsyncgate: after a failed fdatasync the kernel may have dropped the
            // pages it could not write and a retried sync can "succeed" with them
            // gone. Nothing of this log is trusted until it is read back from disk.
            std::lock_guard lk(mu_);
            log.poisoned_ = true;
            log.poison_reason_ = fmt::format(
                "{}: fdatasync failed ({}); the log is poisoned until the context is reopened from disk", log.path_,
                std::strerror(res[i].sync_err));
            st = make_error("{}", log.poison_reason_);
        } else {
            std::lock_guard lk(mu_);
            log.size_ += g.bytes;
            log.next_seq_ += g.items.size();
            log.prev_crc_ = g.last_crc;
            log.n_tokens_ = g.n_tokens;
        }
        for (Pending* p : g.items) p->status = st;
    }
}

// ---------------------------------------------------------------------------
// KvLog.

namespace {

// Writes a log file (header, and one CHECKPOINT record when blob_name is given) at
// tmp, fsynced; returns its fd (open for writing) and the state after it.
struct NewLog {
    int fd = -1;
    uint64_t size = 0;
    uint32_t last_crc = 0;
    uint64_t next_seq = 0;
};
Result<NewLog> write_new_log(const std::string& tmp, LogHeader& h, const std::string& blob_name, uint64_t n_tokens,
                             uint32_t blob_crc) {
    ::unlink(tmp.c_str());  // a leftover of an interrupted create or compaction: never a valid state
    const int fd = ::open(tmp.c_str(), O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0600);
    if (fd < 0) return errno_error("create", tmp);
    Fd guard(fd);
    uint8_t hb[kLogHeaderBytesMax];
    h.version = kLogVersion;  // a new file (create, compaction) is written in the current format
    log_header_encode(h, hb);
    h.crc = get<uint32_t>(hb, header_crc_offset(h.version));
    std::vector<iovec> iov{{hb, h.bytes()}};
    NewLog nl;
    nl.size = h.bytes();
    nl.last_crc = h.crc;
    uint8_t rh[kRecordHeaderBytes];
    std::vector<uint8_t> payload;
    if (!blob_name.empty()) {
        payload.resize(16 + blob_name.size());
        put<uint64_t>(payload.data(), 0, n_tokens);
        put<uint32_t>(payload.data(), 8, blob_crc);
        put<uint32_t>(payload.data(), 12, static_cast<uint32_t>(blob_name.size()));
        std::memcpy(payload.data() + 16, blob_name.data(), blob_name.size());
        record_header_encode(rh, LogRecordType::Checkpoint, 0, 0, payload.size(), crc32c(payload.data(), payload.size()),
                             h.crc, h.salt);
        iov.push_back({rh, kRecordHeaderBytes});
        iov.push_back({payload.data(), payload.size()});
        if (uint64_t pad = pad8(payload.size())) iov.push_back({const_cast<uint8_t*>(kZeros), pad});
        nl.size += kRecordHeaderBytes + payload.size() + pad8(payload.size());
        nl.last_crc = get<uint32_t>(rh, kRecHeaderCrc);
        nl.next_seq = 1;
    }
    // A failed write (a full disk) leaves no half-written file behind.
    if (Status s = pwrite_iov(fd, 0, iov); !s) {
        ::unlink(tmp.c_str());
        return make_error(s.error().kind, "{}: {}", tmp, s.error().message);
    }
    if (::fsync(fd) != 0) {
        const int e = errno;
        ::unlink(tmp.c_str());
        return errno_error("fsync", tmp, e);
    }
    nl.fd = guard.release();
    return nl;
}

// Removes <dir>/<context>.<g>.kvblob for every g but `keep` (0: keep none) and the
// log's temporary file: leftovers of an interrupted compaction or create.
void remove_leftovers(const std::string& dir, const std::string& context, uint64_t keep) {
    DIR* d = ::opendir(dir.c_str());
    if (!d) return;
    const std::string prefix = context + ".";
    bool removed = false;
    while (dirent* e = ::readdir(d)) {
        const std::string name = e->d_name;
        // This context's files only: with dots in names, "a.b.3.kvblob" starts with
        // "a." but is context a.b's.
        if (name.rfind(prefix, 0) != 0 || context_of_file(name) != context) continue;
        const std::string rest = name.substr(prefix.size());
        const bool tmp = rest.rfind("kvlog.tmp", 0) == 0;
        bool stale_blob = false;
        if (rest.size() > 7 && rest.substr(rest.size() - 7) == ".kvblob") {
            const std::string g = rest.substr(0, rest.size() - 7);
            stale_blob = !g.empty() && g.find_first_not_of("0123456789") == std::string::npos &&
                         std::strtoull(g.c_str(), nullptr, 10) != keep;
        }
        const bool blob_tmp = rest.find(".kvblob.tmp.") != std::string::npos;
        if (tmp || stale_blob || blob_tmp) {
            ::unlink((dir + "/" + name).c_str());
            removed = true;
        }
    }
    ::closedir(d);
    if (removed) (void)fsync_dir_of(dir + "/x");
}

}  // namespace

Result<std::unique_ptr<KvLog>> KvLog::create(KvLogSync& sync, const std::string& dir, const std::string& context,
                                             const KvIdentity& id, const KvLayout& layout, const KvLogOptions& o) {
    if (Status s = check_context_name(context); !s) return s.error();
    std::unique_ptr<KvLog> log(new KvLog());
    log->sync_ = &sync;
    log->opts_ = o;
    log->dir_ = dir;
    log->path_ = dir + "/" + context + ".kvlog";
    log->header_.id = id;
    log->header_.layout = layout;
    log->header_.salt = random_salt();
    log->header_.context = context;
    const std::string tmp = log->path_ + ".tmp";
    auto nl = write_new_log(tmp, log->header_, {}, 0, 0);
    if (!nl) return nl.error();
    // RENAME_NOREPLACE: an existing context's log is never replaced by an empty one.
    if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, log->path_.c_str(), RENAME_NOREPLACE) != 0) {
        const int e = errno;
        ::close(nl->fd);
        ::unlink(tmp.c_str());
        if (e == EEXIST) return make_error("{}: the context's log exists already", log->path_);
        return errno_error("rename to", log->path_, e);
    }
    if (Status s = fsync_dir_of(log->path_); !s) {
        ::close(nl->fd);
        return s.error();
    }
    log->fd_ = nl->fd;
    log->size_ = nl->size;
    log->prev_crc_ = nl->last_crc;
    log->next_seq_ = nl->next_seq;
    return log;
}

Result<std::unique_ptr<KvLog>> KvLog::open(KvLogSync& sync, const std::string& dir, const std::string& context,
                                           const KvIdentity& want, KvPool* pool, KvSeq* seq, LogScan* scan_out,
                                           const KvLogOptions& o) {
    if (Status s = check_context_name(context); !s) return s.error();
    const std::string path = dir + "/" + context + ".kvlog";
    auto scan = kv_log_scan(path, &want, pool, seq);
    if (!scan) return scan.error();
    if (scan->header.context != context) {
        if (pool) seq->release(*pool);
        return make_error("{}: the log says it is context '{}'", path, scan->header.context);
    }
    const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
    if (fd < 0) {
        if (pool) seq->release(*pool);
        return errno_error("open", path);
    }
    if (scan->torn) {
        // Cut the torn tail before anything is appended after it, durably: a new
        // record must never sit behind bytes that could be read as a record.
        if (::ftruncate(fd, static_cast<off_t>(scan->valid_end)) != 0 || ::fdatasync(fd) != 0) {
            const int e = errno;
            ::close(fd);
            if (pool) seq->release(*pool);
            return errno_error("cutting the torn tail of", path, e);
        }
    }
    remove_leftovers(dir, context, scan->has_checkpoint ? scan->live_checkpoint_gen : 0);
    std::unique_ptr<KvLog> log(new KvLog());
    log->sync_ = &sync;
    log->opts_ = o;
    log->dir_ = dir;
    log->path_ = path;
    log->header_ = scan->header;
    log->fd_ = fd;
    log->size_ = scan->valid_end;
    log->next_seq_ = scan->next_seq;
    log->prev_crc_ = scan->last_crc;
    log->n_tokens_ = scan->n_tokens();
    if (scan_out) *scan_out = std::move(*scan);
    return log;
}

KvLog::~KvLog() {
    if (fd_ >= 0) ::close(fd_);
}

Status KvLog::enqueue(LogRecordType type, std::vector<iovec> payload, uint64_t new_length, uint64_t start) {
    KvLogSync::Pending p;
    p.log = this;
    p.type = type;
    p.payload = std::move(payload);
    for (const iovec& v : p.payload) p.payload_bytes += v.iov_len;
    p.payload_crc = crc32c_iov(p.payload);  // on the caller's thread, before the commit
    p.new_length = new_length;
    p.start = start;
    return sync_->submit(p);
}

Status KvLog::append(KvPool& pool, const KvSeq& seq, std::span<const int32_t> tokens, uint64_t start, uint64_t n) {
    if (!same_kv_shape(pool.layout(), header_.layout))
        return make_error("{}: the arena's KV layout is not the log's", path_);
    if (start + n > static_cast<uint64_t>(seq.n_tokens()) || start + n > tokens.size())
        return make_error("{}: positions [{}, {}) are beyond the sequence ({} positions)", path_, start, start + n,
                          seq.n_tokens());
    if (n == 0) return {};
    auto rows = kv_rows_iov(pool, seq.blocks(), start, n);
    if (!rows) return rows.error();
    uint64_t sn[2] = {start, n};
    std::vector<iovec> iov;
    iov.reserve(rows->size() + 2);
    iov.push_back({sn, 16});
    iov.push_back({const_cast<int32_t*>(tokens.data() + start), n * 4});
    iov.insert(iov.end(), rows->begin(), rows->end());
    return enqueue(LogRecordType::Append, std::move(iov), start + n, start);
}

Status KvLog::truncate(uint64_t new_length) {
    uint64_t nl = new_length;
    return enqueue(LogRecordType::Truncate, {{&nl, 8}}, new_length, 0);
}

Status KvLog::compact(KvPool& pool, const KvSeq& seq, std::span<const int32_t> tokens) {
    if (poisoned()) return make_error("{}", poison_reason_);
    const uint64_t n = n_tokens();
    LogHeader nh = header_;
    nh.generation = header_.generation + 1;
    nh.salt = random_salt();
    const std::string blob_name = fmt::format("{}.{}.kvblob", nh.context, nh.generation);
    const std::string blob_path = dir_ + "/" + blob_name;
    auto bh = blob_write(blob_path, header_.id, pool, seq, tokens, 0, n);
    if (!bh) return bh.error();
    const std::string tmp = path_ + ".tmp";
    auto nl = write_new_log(tmp, nh, blob_name, n, bh->data_crc);
    if (!nl) {
        ::unlink(blob_path.c_str());
        return nl.error();
    }
    if (::rename(tmp.c_str(), path_.c_str()) != 0) {
        const int e = errno;
        ::close(nl->fd);
        ::unlink(tmp.c_str());
        ::unlink(blob_path.c_str());
        return errno_error("rename to", path_, e);
    }
    // If this fails the rename may or may not be durable: either log is valid (the
    // old blob is still there), so go on with the new one, whose files exist.
    (void)fsync_dir_of(path_);
    const uint64_t old_gen = header_.generation;
    {
        std::lock_guard lk(sync_->mu_);
        ::close(fd_);
        fd_ = nl->fd;
        header_ = nh;
        size_ = nl->size;
        prev_crc_ = nl->last_crc;
        next_seq_ = nl->next_seq;
        n_tokens_ = n;
    }
    if (old_gen > 0) {
        ::unlink(fmt::format("{}/{}.{}.kvblob", dir_, nh.context, old_gen).c_str());
        (void)fsync_dir_of(path_);
    }
    return {};
}

bool KvLog::should_compact() const {
    std::lock_guard lk(sync_->mu_);
    const double live = static_cast<double>(n_tokens_) * static_cast<double>(header_.layout.bytes_per_token() + 4);
    return size_ > opts_.compact_min_bytes && static_cast<double>(size_) > opts_.compact_factor * live;
}

uint64_t KvLog::n_tokens() const {
    std::lock_guard lk(sync_->mu_);
    return n_tokens_;
}
uint64_t KvLog::file_bytes() const {
    std::lock_guard lk(sync_->mu_);
    return size_;
}
bool KvLog::poisoned() const {
    std::lock_guard lk(sync_->mu_);
    return poisoned_;
}

}  // namespace duet
