// The KV log tests' reference (tests/kv_log_fault_test.cpp, kv_log_crash_test.cpp):
// a deterministic op sequence (APPENDs of 1..40 tokens, occasional TRUNCATEs), the
// token and KV rows each op writes as a pure function of (seed, op index, position,
// layer, K|V, head, dim), and a model of the context after any prefix of ops. What
// recovery returns is checked against this model, never against what the log code
// wrote or read: the model knows nothing of records, CRCs or offsets.
#pragma once

#include "file_bytes.h"
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <initializer_list>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "kv/blob.h"
#include "kv/kv_log.h"
#include "kv/kv_pool.h"

namespace duet::kvtest {

inline uint64_t mix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}
inline uint64_t hash(uint64_t seed, std::initializer_list<uint64_t> v) {
    uint64_t h = mix64(seed);
    for (uint64_t x : v) h = mix64(h ^ x);
    return h;
}

// Scales iteration counts: DUET_STRESS_SCALE=20 for a soak.
inline double stress_scale() {
    const char* s = std::getenv("DUET_STRESS_SCALE");
    const double f = s ? std::atof(s) : 1.0;
    return f > 0 ? f : 1.0;
}

inline KvIdentity test_identity() {
    KvIdentity id;
    for (size_t i = 0; i < id.model.size(); ++i) {
        id.model[i] = static_cast<uint8_t>(0x31 + 7 * i);
        id.tokenizer[i] = static_cast<uint8_t>(0xc5 ^ (3 * i));
    }
    return id;
}

inline KvLayout test_layout(KvDtype dt) {
    KvLayout l;
    l.n_layer = 2;
    l.n_head_kv = 2;
    l.head_dim = 8;
    l.block_tokens = 16;
    l.dtype = dt;
    return l;
}

struct KvOp {
    LogRecordType type = LogRecordType::Append;
    uint64_t index = 0;           // the op's number in its sequence: what its rows are a function of
    uint64_t start = 0, n = 0;    // APPEND: positions [start, start + n)
    uint64_t new_length = 0;      // TRUNCATE
};

// Op `index` of sequence `seed` on a context of `len` positions: mostly an APPEND of
// 1..40 tokens at the end, one in eight a TRUNCATE (always one past max_len, so the
// context stays small).
inline KvOp make_op(uint64_t seed, uint64_t index, uint64_t len, uint64_t max_len = 480) {
    const uint64_t h = hash(seed, {index, 0x6f70});
    KvOp op;
    op.index = index;
    if (len > max_len || (len > 0 && h % 8 == 0)) {
        op.type = LogRecordType::Truncate;
        op.new_length = (h >> 8) % (len > max_len ? len / 2 : len + 1);
    } else {
        op.type = LogRecordType::Append;
        op.start = len;
        op.n = 1 + (h >> 16) % 40;
    }
    return op;
}

inline int32_t token_of(uint64_t seed, uint64_t op, uint64_t pos) {
    return static_cast<int32_t>(hash(seed, {op, pos, 0x746f6b}) % 32000);
}
// One value of row (pos, layer, kv, head) written by op: elem_bytes() bytes at out.
// f16 bit patterns avoid the all-ones exponent (no NaN or infinity).
inline void value_of(const KvLayout& l, uint64_t seed, uint64_t op, uint64_t pos, int layer, int kv, int head, int d,
                     uint8_t* out) {
    const uint64_t h = hash(seed, {op, pos, static_cast<uint64_t>(layer), static_cast<uint64_t>(kv),
                                   static_cast<uint64_t>(head), static_cast<uint64_t>(d)});
    if (l.quantized()) {
        out[0] = static_cast<uint8_t>(h);
    } else {
        uint16_t v = static_cast<uint16_t>(h);
        if ((v & 0x7c00) == 0x7c00) v &= 0xfbff;
        std::memcpy(out, &v, 2);
    }
}
inline float scale_of(uint64_t seed, uint64_t op, uint64_t pos, int layer, int kv, int head) {
    const uint64_t h = hash(seed, {op, pos, static_cast<uint64_t>(layer), static_cast<uint64_t>(kv),
                                   static_cast<uint64_t>(head), 0x7363});
    return 1e-3f * static_cast<float>(1 + h % 4096);
}

// The context after a prefix of ops: its tokens, and which op wrote each position
// (a position's KV is a function of that op and the position).
struct KvModel {
    uint64_t seed = 0;
    std::vector<int32_t> tokens;
    std::vector<uint64_t> writer;

    uint64_t len() const { return tokens.size(); }
    void apply(const KvOp& op) {
        if (op.type == LogRecordType::Truncate) {
            tokens.resize(op.new_length);
            writer.resize(op.new_length);
            return;
        }
        for (uint64_t p = op.start; p < op.start + op.n; ++p) {
            tokens.push_back(token_of(seed, op.index, p));
            writer.push_back(op.index);
        }
    }
};
inline KvModel model_after(uint64_t seed, std::span<const KvOp> ops) {
    KvModel m;
    m.seed = seed;
    for (const KvOp& op : ops) m.apply(op);
    return m;
}

// Writes op's tokens' rows (positions [start, start + n)) into seq, which holds start positions.
inline Status fill_rows(KvPool& pool, KvSeq& seq, uint64_t seed, const KvOp& op) {
    const KvLayout& l = pool.layout();
    if (Status s = seq.prepare_append(pool, static_cast<int64_t>(op.start), static_cast<int64_t>(op.start + op.n)); !s)
        return s;
    const size_t row = static_cast<size_t>(l.head_dim) * l.elem_bytes();
    for (uint64_t p = op.start; p < op.start + op.n; ++p) {
        const int32_t blk = seq.blocks()[p / l.block_tokens];
        const uint64_t t = p % l.block_tokens;
        for (int layer = 0; layer < l.n_layer; ++layer)
            for (int kv = 0; kv < 2; ++kv)
                for (int h = 0; h < l.n_head_kv; ++h) {
                    uint8_t* r = (kv == 0 ? pool.k(blk, layer, h) : pool.v(blk, layer, h)) + t * row;
                    for (int d = 0; d < l.head_dim; ++d)
                        value_of(l, seed, op.index, p, layer, kv, h, d, r + d * l.elem_bytes());
                    if (l.quantized())
                        (kv == 0 ? pool.k_scales(blk, layer, h) : pool.v_scales(blk, layer, h))[t] =
                            scale_of(seed, op.index, p, layer, kv, h);
                }
    }
    seq.set_n_tokens(static_cast<int64_t>(op.start + op.n));
    return {};
}

// Every token and KV byte (values, and scales when quantized) of seq against the model.
inline ::testing::AssertionResult kv_matches(const KvModel& m, const KvPool& pool, const KvSeq& seq) {
    const KvLayout& l = pool.layout();
    if (static_cast<uint64_t>(seq.n_tokens()) != m.len())
        return ::testing::AssertionFailure() << "the sequence holds " << seq.n_tokens() << " positions, the model "
                                             << m.len();
    const size_t row = static_cast<size_t>(l.head_dim) * l.elem_bytes();
    std::vector<uint8_t> want(row);
    for (uint64_t p = 0; p < m.len(); ++p) {
        const int32_t blk = seq.blocks()[p / l.block_tokens];
        const uint64_t t = p % l.block_tokens;
        for (int layer = 0; layer < l.n_layer; ++layer)
            for (int kv = 0; kv < 2; ++kv)
                for (int h = 0; h < l.n_head_kv; ++h) {
                    const uint8_t* r = (kv == 0 ? pool.k(blk, layer, h) : pool.v(blk, layer, h)) + t * row;
                    for (int d = 0; d < l.head_dim; ++d)
                        value_of(l, m.seed, m.writer[p], p, layer, kv, h, d, want.data() + d * l.elem_bytes());
                    if (std::memcmp(r, want.data(), row) != 0)
                        return ::testing::AssertionFailure() << "KV row of position " << p << " layer " << layer
                                                             << (kv ? " V" : " K") << " head " << h
                                                             << " differs from op " << m.writer[p] << "'s";
                    if (l.quantized()) {
                        const float s = (kv == 0 ? pool.k_scales(blk, layer, h) : pool.v_scales(blk, layer, h))[t];
                        const float ws = scale_of(m.seed, m.writer[p], p, layer, kv, h);
                        if (std::memcmp(&s, &ws, 4) != 0)
                            return ::testing::AssertionFailure() << "scale of position " << p << " layer " << layer
                                                                 << (kv ? " V" : " K") << " head " << h << ": " << s
                                                                 << ", op " << m.writer[p] << " wrote " << ws;
                    }
                }
    }
    return ::testing::AssertionSuccess();
}

// ---------------------------------------------------------------------------
// Files.

// A directory under /tmp, removed with everything in it.
struct TempDir {
    std::string path;
    TempDir() {
        char t[] = "/tmp/duet-kvlog-XXXXXX";
        if (!::mkdtemp(t)) std::abort();
        path = t;
    }
    ~TempDir() {
        std::error_code ec;
        std::filesystem::remove_all(path, ec);
    }
    TempDir(const TempDir&) = delete;
    TempDir& operator=(const TempDir&) = delete;
    // Removes every file in it.
    void clear() const {
        std::error_code ec;
        for (const auto& e : std::filesystem::directory_iterator(path, ec)) std::filesystem::remove_all(e.path(), ec);
    }
};

inline std::vector<uint8_t> read_file(const std::string& path) { return read_file_bytes(path); }
inline void write_file(const std::string& path, std::span<const uint8_t> b) {
    const int fd = ::open(path.c_str(), O_CREAT | O_TRUNC | O_WRONLY | O_CLOEXEC, 0600);
    ASSERT_GE(fd, 0) << path << ": " << std::strerror(errno);
    size_t put = 0;
    while (put < b.size()) {
        const ssize_t r = ::pwrite(fd, b.data() + put, b.size() - put, static_cast<off_t>(put));
        ASSERT_GT(r, 0) << path << ": " << std::strerror(errno);
        put += static_cast<size_t>(r);
    }
    ::close(fd);
}
inline uint64_t file_size(const std::string& path) {
    struct stat st {};
    return ::stat(path.c_str(), &st) == 0 ? static_cast<uint64_t>(st.st_size) : 0;
}
// Every file of a directory by name, with its bytes.
inline std::map<std::string, std::vector<uint8_t>> dir_snapshot(const std::string& dir) {
    std::map<std::string, std::vector<uint8_t>> m;
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(dir, ec))
        m[e.path().filename().string()] = read_file(e.path().string());
    return m;
}
inline std::vector<std::string> dir_names(const std::string& dir) {
    std::vector<std::string> v;
    for (const auto& [name, bytes] : dir_snapshot(dir)) v.push_back(name);
    return v;
}

// ---------------------------------------------------------------------------
// A context written through a KvLog, and what recovery of it must give.

// What the log may hold: the ops whose records were handed to it, in order (a
// record cut off again by a failed write is not among them), of which the first
// `acked` were acknowledged; after a compaction, record 0 is a checkpoint of the
// state after the first cp_ops ops and the later records are ops[cp_ops...].
struct KvExpect {
    uint64_t seed = 0;
    KvLayout layout;
    KvIdentity id = test_identity();
    std::vector<KvOp> ops;
    size_t acked = 0;
    std::optional<uint64_t> cp_ops;
    uint64_t generation = 0;
};

// A recovered context: the state and the log that KvLog::open returned.
struct Recovered {
    uint64_t k = 0;  // ops whose effect it holds: the recovered records are ops[0, k) (folded as the checkpoint says)
    LogScan scan;    // kv_log_scan without a pool
    LogScan replay;  // what KvLog::open found
    std::unique_ptr<KvPool> pool;
    KvSeq seq;
    std::unique_ptr<KvLog> log;
    KvModel model;
    Recovered() = default;
    Recovered(Recovered&&) = default;
    Recovered& operator=(Recovered&&) = default;
    ~Recovered() {
        log.reset();
        if (pool) seq.release(*pool);
    }
};

constexpr int32_t kPoolBlocks = 160;

// Recovers <dir>/<ctx>.kvlog twice: kv_log_scan without a pool, then KvLog::open
// replaying into a fresh pool and sequence. Both must find the same records: exactly
// ops[0, k) for some k with acked <= k <= ops.size() (record by record: type,
// position, count, seq number), the tokens of the model after those k ops, and
// (replayed) every KV byte of it. After open the file ends where the valid records
// do, and no leftover file of the context remains.
inline void recover_and_check(KvLogSync& sync, const std::string& dir, const std::string& ctx, const KvExpect& e,
                              Recovered& out) {
    const std::string path = dir + "/" + ctx + ".kvlog";
    auto scan = kv_log_scan(path, &e.id);
    ASSERT_TRUE(scan.ok()) << scan.error().message;
    const LogScan& s = *scan;
    EXPECT_EQ(s.header.generation, e.generation);
    size_t first = 0;
    uint64_t base = 0;
    if (e.cp_ops) {
        ASSERT_TRUE(s.has_checkpoint);
        ASSERT_FALSE(s.records.empty());
        ASSERT_EQ(s.records[0].type, static_cast<uint16_t>(LogRecordType::Checkpoint));
        base = *e.cp_ops;
        ASSERT_LE(base, e.ops.size());
        EXPECT_EQ(s.records[0].n, model_after(e.seed, std::span(e.ops).first(base)).len());
        first = 1;
    } else {
        ASSERT_FALSE(s.has_checkpoint);
    }
    const uint64_t k = base + (s.records.size() - first);
    ASSERT_LE(k, e.ops.size()) << "more records than were ever appended";
    ASSERT_GE(k, e.acked) << "an acknowledged record is lost (" << s.records.size() << " records recovered; "
                          << (s.torn ? s.torn_reason : std::string("no torn tail")) << ")";
    for (size_t i = first; i < s.records.size(); ++i) {
        const LogRecordInfo& r = s.records[i];
        const KvOp& op = e.ops[base + i - first];
        ASSERT_EQ(r.seq, i);
        ASSERT_EQ(r.type, static_cast<uint16_t>(op.type)) << "record " << i;
        if (op.type == LogRecordType::Append) {
            ASSERT_EQ(r.start, op.start) << "record " << i;
            ASSERT_EQ(r.n, op.n) << "record " << i;
        } else {
            ASSERT_EQ(r.n, op.new_length) << "record " << i;
        }
    }
    out.k = k;
    out.model = model_after(e.seed, std::span(e.ops).first(k));
    ASSERT_EQ(s.tokens, out.model.tokens);
    out.scan = std::move(*scan);

    auto pool = KvPool::create(e.layout, kPoolBlocks);
    ASSERT_TRUE(pool.ok()) << pool.error().message;
    out.pool = std::move(*pool);
    auto log = KvLog::open(sync, dir, ctx, e.id, out.pool.get(), &out.seq, &out.replay);
    ASSERT_TRUE(log.ok()) << log.error().message;
    out.log = std::move(*log);
    ASSERT_EQ(out.replay.records.size(), out.scan.records.size());
    ASSERT_EQ(out.replay.tokens, out.model.tokens);
    ASSERT_EQ(out.log->n_tokens(), out.model.len());
    ASSERT_TRUE(kv_matches(out.model, *out.pool, out.seq));
    EXPECT_EQ(file_size(path), out.replay.valid_end);
    EXPECT_EQ(out.log->file_bytes(), out.replay.valid_end);
    EXPECT_FALSE(out.log->poisoned());
    for (const std::string& name : dir_names(dir)) {
        if (name.rfind(ctx + ".", 0) != 0) continue;
        const bool live_blob = e.cp_ops && name == ctx + "." + std::to_string(e.generation) + ".kvblob";
        EXPECT_TRUE(name == ctx + ".kvlog" || live_blob) << "leftover " << name << " not removed by open";
    }
}

// The writer side: an in-memory context (pool, sequence, tokens) whose ops go to a
// KvLog, and the expectations they create.
struct KvWriter {
    KvExpect e;
    std::string dir, ctx;
    std::unique_ptr<KvPool> pool;
    KvSeq seq;
    KvModel model;  // what seq holds
    std::unique_ptr<KvLog> log;

    KvWriter(uint64_t seed, KvDtype dt, std::string d, std::string c) : dir(std::move(d)), ctx(std::move(c)) {
        e.seed = seed;
        e.layout = test_layout(dt);
        model.seed = seed;
        auto p = KvPool::create(e.layout, kPoolBlocks);
        if (!p) std::abort();
        pool = std::move(*p);
    }
    ~KvWriter() {
        log.reset();
        seq.release(*pool);
    }
    std::string path() const { return dir + "/" + ctx + ".kvlog"; }

    Status create(KvLogSync& sync, const KvLogOptions& o = {}) {
        auto l = KvLog::create(sync, dir, ctx, e.id, e.layout, o);
        if (!l) return l.error();
        log = std::move(*l);
        return {};
    }
    KvOp next_op() const { return make_op(e.seed, e.ops.size(), model.len()); }

    // Runs the next op on the log. On success it is acknowledged. On an Error the
    // in-memory context is as before; `retracted` says the log cut the record off
    // again (a failed write), otherwise (a failed sync) it may be on disk.
    Status step(bool retracted_on_error = true) { return run(next_op(), retracted_on_error); }
    Status run(const KvOp& op, bool retracted_on_error = true) {
        e.ops.push_back(op);
        Status st;
        if (op.type == LogRecordType::Append) {
            if (Status s = fill_rows(*pool, seq, e.seed, op); !s) {
                e.ops.pop_back();
                return s;
            }
            KvModel next = model;
            next.apply(op);
            st = log->append(*pool, seq, next.tokens, op.start, op.n);
            if (st) {
                model = std::move(next);
            } else {
                seq.truncate(*pool, static_cast<int64_t>(op.start));
            }
        } else {
            st = log->truncate(op.new_length);
            if (st) {
                seq.truncate(*pool, static_cast<int64_t>(op.new_length));
                model.apply(op);
            }
        }
        if (st)
            e.acked = e.ops.size();
        else if (retracted_on_error)
            e.ops.pop_back();
        return st;
    }
    Status compact() {
        if (Status s = log->compact(*pool, seq, model.tokens); !s) return s;
        e.cp_ops = e.ops.size();
        e.generation = log->header().generation;
        return {};
    }

    // Closes the log and takes over what recovery of it gives (recover_and_check):
    // the recovered state is the writer's from here on.
    void reopen(KvLogSync& sync) {
        log.reset();
        seq.release(*pool);
        Recovered r;
        recover_and_check(sync, dir, ctx, e, r);
        if (::testing::Test::HasFatalFailure()) return;
        adopt(std::move(r));
    }
    void adopt(Recovered&& r) {
        log.reset();
        seq.release(*pool);
        e.ops.resize(r.k);
        e.acked = r.k;
        pool = std::move(r.pool);
        seq = std::move(r.seq);
        model = std::move(r.model);
        log = std::move(r.log);
    }
};

}  // namespace duet::kvtest
