// The KV append log under injected faults (src/kv/KVLOG.md, each test named after
// the rule it breaks): crash images of the unsynced last batch torn at every byte
// and with random 512-byte sectors dropped, a failed fdatasync (poison, then the
// durable state on reopen), ENOSPC (the append fails, the state is kept, later
// appends succeed), short writes (continued, nothing lost), bit flips in the middle
// of the log (refused, files untouched) and in its last record (cut), a real short
// write and EFBIG from RLIMIT_FSIZE through io_uring, group commit from many
// threads, and compaction with its interrupted states.
//
// Every check recovers twice (kv_log_scan without a pool, KvLog::open replaying
// into a fresh pool) and compares with tests/kv_log_model.h: exactly a prefix of
// the appended records, holding every acknowledged one, every token and KV byte
// equal to the model's state after that prefix.
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <functional>
#include <random>
#include <thread>

#include <gtest/gtest.h>

#include "require.h"
#include "time_scale.h"
#include "kv/crc32c.h"
#include "kv_fault_device.h"
#include "kv_log_model.h"

using namespace duet;
using namespace duet::kvtest;

namespace {

template <typename T>
T get(const uint8_t* p, size_t off) {
    T v;
    std::memcpy(&v, p + off, sizeof v);
    return v;
}
template <typename T>
void put(uint8_t* p, size_t off, T v) {
    std::memcpy(p + off, &v, sizeof v);
}

uint64_t pad8(uint64_t n) { return (8 - n % 8) % 8; }

// The documented header CRC: CRC32C over the salt (8 bytes, little-endian) and
// then bytes 0..43 of the record header.
uint32_t header_crc_of(const uint8_t* h, uint64_t salt) {
    uint8_t buf[8 + 44];
    std::memcpy(buf, &salt, 8);
    std::memcpy(buf + 8, h, 44);
    return crc32c(buf, sizeof buf);
}

bool contains(const std::string& s, const char* what) { return s.find(what) != std::string::npos; }

class KvLogFault : public ::testing::TestWithParam<KvDtype> {
protected:
    TempDir tmp;
    FaultLogDevice dev;
    KvLogSync sync{dev};
    // Recovery and what follows it run on a device of their own.
    SyncLogDevice plain;
    KvLogSync plain_sync{plain};

    uint64_t seed() const { return 1000 + static_cast<uint64_t>(GetParam()); }
};

std::string dtype_name(const ::testing::TestParamInfo<KvDtype>& i) { return kv_dtype_name(i.param); }

// A record-by-record reading of the file by the documented format, independent of
// kv_log.cpp: magic, seq and batch_seq (one record per commit here), reserved
// fields and padding zero, the salted header CRC, the chain, the payload CRC, and
// each APPEND's tokens and rows in blob order equal to what its op wrote.
void check_format(const std::string& path, const KvExpect& e, uint64_t salt) {
    const std::vector<uint8_t> b = read_file(path);
    ASSERT_GE(b.size(), kLogHeaderBytes);
    // KVLOG.md: a version 3 header is 192 bytes, versions 1 and 2 128; its CRC is its last 4.
    const uint64_t header_bytes = get<uint32_t>(b.data(), 8) >= 3 ? 192 : 128;
    ASSERT_GE(b.size(), header_bytes);
    uint32_t prev = get<uint32_t>(b.data(), header_bytes - 4);
    const KvLayout& l = e.layout;
    const size_t row = static_cast<size_t>(l.head_dim) * l.elem_bytes();
    uint64_t off = header_bytes;
    size_t i = 0;
    while (off < b.size()) {
        ASSERT_LT(i, e.ops.size());
        ASSERT_LE(off + kRecordHeaderBytes, b.size());
        const uint8_t* h = b.data() + off;
        const KvOp& op = e.ops[i];
        EXPECT_EQ(get<uint32_t>(h, 0), kRecordMagic);
        EXPECT_EQ(get<uint16_t>(h, 4), static_cast<uint16_t>(op.type));
        EXPECT_EQ(get<uint16_t>(h, 6), 0);
        EXPECT_EQ(get<uint64_t>(h, 8), i);
        EXPECT_EQ(get<uint64_t>(h, 16), i);
        const uint64_t pb = get<uint64_t>(h, 24);
        EXPECT_EQ(get<uint32_t>(h, 36), prev) << "record " << i << " does not chain";
        EXPECT_EQ(get<uint32_t>(h, 40), 0u);
        EXPECT_EQ(get<uint32_t>(h, 44), header_crc_of(h, salt)) << "record " << i;
        ASSERT_LE(off + kRecordHeaderBytes + pb + pad8(pb), b.size());
        const uint8_t* p = h + kRecordHeaderBytes;
        EXPECT_EQ(get<uint32_t>(h, 32), crc32c(p, pb)) << "record " << i;
        for (uint64_t z = 0; z < pad8(pb); ++z) EXPECT_EQ(p[pb + z], 0) << "padding of record " << i;
        if (op.type == LogRecordType::Truncate) {
            EXPECT_EQ(pb, 8u);
            EXPECT_EQ(get<uint64_t>(p, 0), op.new_length);
        } else {
            EXPECT_EQ(get<uint64_t>(p, 0), op.start);
            EXPECT_EQ(get<uint64_t>(p, 8), op.n);
            const uint64_t n_rows = 2ull * l.n_layer * l.n_head_kv * op.n;
            EXPECT_EQ(pb, 16 + 4 * op.n + n_rows * row + (l.quantized() ? 4 * n_rows : 0));
            for (uint64_t t = 0; t < op.n; ++t)
                EXPECT_EQ(get<int32_t>(p, 16 + 4 * t), token_of(e.seed, op.index, op.start + t));
            const uint8_t* v = p + 16 + 4 * op.n;
            const uint8_t* sc = v + n_rows * row;
            std::vector<uint8_t> want(row);
            for (int layer = 0; layer < l.n_layer; ++layer)
                for (int kv = 0; kv < 2; ++kv)
                    for (int hd = 0; hd < l.n_head_kv; ++hd)
                        for (uint64_t t = 0; t < op.n; ++t) {
                            for (int d = 0; d < l.head_dim; ++d)
                                value_of(l, e.seed, op.index, op.start + t, layer, kv, hd, d,
                                         want.data() + d * l.elem_bytes());
                            EXPECT_EQ(std::memcmp(v, want.data(), row), 0)
                                << "record " << i << " row layer " << layer << " kv " << kv << " head " << hd;
                            v += row;
                            if (l.quantized()) {
                                const float s = get<float>(sc, 0), ws = scale_of(e.seed, op.index, op.start + t, layer, kv, hd);
                                EXPECT_EQ(std::memcmp(&s, &ws, 4), 0);
                                sc += 4;
                            }
                        }
        }
        if (::testing::Test::HasFailure()) return;
        prev = get<uint32_t>(h, 44);
        off += kRecordHeaderBytes + pb + pad8(pb);
        ++i;
    }
    EXPECT_EQ(i, e.ops.size());
}

// The records of a log file: offset, seq, payload size.
struct RawRecord {
    uint64_t off, seq, pb;
};
std::vector<RawRecord> raw_records(const std::vector<uint8_t>& b) {
    std::vector<RawRecord> v;
    for (uint64_t off = get<uint32_t>(b.data(), 8) >= 3 ? 192 : 128; off + kRecordHeaderBytes <= b.size();) {
        const uint64_t pb = get<uint64_t>(b.data(), off + 24);
        v.push_back({off, get<uint64_t>(b.data(), off + 8), pb});
        off += kRecordHeaderBytes + pb + pad8(pb);
    }
    return v;
}

// Rewrites every record's batch_seq as batch_of(seq) says, resealing the header
// CRCs and the chain (a log whose commits hold several records: the one-writer API
// never makes one, group commit of one log's records from several appenders does).
void reseal(std::vector<uint8_t>& b, uint64_t salt, const std::function<uint64_t(uint64_t)>& batch_of) {
    uint32_t prev = get<uint32_t>(b.data(), (get<uint32_t>(b.data(), 8) >= 3 ? 192 : 128) - 4);
    for (const RawRecord& r : raw_records(b)) {
        uint8_t* h = b.data() + r.off;
        ASSERT_EQ(get<uint32_t>(h, 44), header_crc_of(h, salt)) << "the documented header CRC";
        put<uint64_t>(h, 16, batch_of(r.seq));
        put<uint32_t>(h, 36, prev);
        put<uint32_t>(h, 44, header_crc_of(h, salt));
        prev = get<uint32_t>(h, 44);
    }
}

// Tries to recover a log that must be refused: kv_log_scan and KvLog::open fail
// with an error mentioning `why`, the pool is left with every block free, and no
// byte of any file in the directory changes.
void expect_refused(KvLogSync& sync, const std::string& dir, const std::string& ctx, const KvExpect& e,
                    const char* why) {
    const auto before = dir_snapshot(dir);
    auto s = kv_log_scan(dir + "/" + ctx + ".kvlog", &e.id);
    ASSERT_FALSE(s.ok());
    EXPECT_TRUE(contains(s.error().message, why)) << s.error().message;
    auto pool = KvPool::create(e.layout, kPoolBlocks);
    ASSERT_TRUE(pool.ok());
    KvSeq seq;
    auto log = KvLog::open(sync, dir, ctx, e.id, pool->get(), &seq);
    ASSERT_FALSE(log.ok());
    EXPECT_TRUE(contains(log.error().message, why)) << log.error().message;
    EXPECT_TRUE(seq.blocks().empty());
    EXPECT_EQ((*pool)->allocator().n_free(), kPoolBlocks) << "a refused replay left blocks allocated";
    EXPECT_TRUE(dir_snapshot(dir) == before) << "a refused log's files were changed";
}

// Recovers the log at dir/ctx, then goes on with `more` ops on it and recovers again.
void recover_and_continue(KvLogSync& sync, const std::string& dir, const std::string& ctx, const KvExpect& e,
                          KvDtype dt, int more, uint64_t* k) {
    KvWriter w(e.seed, dt, dir, ctx);
    w.e = e;
    Recovered r;
    recover_and_check(sync, dir, ctx, e, r);
    if (::testing::Test::HasFatalFailure()) return;
    *k = r.k;
    if (more == 0) return;
    w.adopt(std::move(r));
    for (int i = 0; i < more; ++i) ASSERT_TRUE(w.step().ok());
    const uint64_t want = w.e.ops.size();
    w.reopen(sync);
    if (::testing::Test::HasFatalFailure()) return;
    EXPECT_EQ(w.e.ops.size(), want) << "records appended after recovery were lost";
}

}  // namespace

INSTANTIATE_TEST_SUITE_P(Dtypes, KvLogFault, ::testing::Values(KvDtype::F16, KvDtype::Int8), dtype_name);

// Without faults: every record is there, in the documented format, and reopening
// (and going on appending) in between changes nothing.
TEST_P(KvLogFault, CleanLogRecoversEveryOpInTheDocumentedFormat) {
    KvWriter w(seed(), GetParam(), tmp.path, "clean");
    ASSERT_TRUE(w.create(sync).ok());
    for (int i = 0; i < 60; ++i) {
        ASSERT_TRUE(w.step().ok()) << "op " << i;
        if (i == 20 || i == 40) {
            ASSERT_NO_FATAL_FAILURE(w.reopen(sync));
            ASSERT_EQ(w.e.ops.size(), static_cast<size_t>(i + 1));
        }
    }
    bool truncated = false;
    for (const KvOp& op : w.e.ops) truncated |= op.type == LogRecordType::Truncate;
    EXPECT_TRUE(truncated) << "the op sequence has no TRUNCATE";
    auto scan = kv_log_scan(w.path(), &w.e.id);
    ASSERT_TRUE(scan.ok());
    EXPECT_FALSE(scan->torn);
    ASSERT_NO_FATAL_FAILURE(check_format(w.path(), w.e, scan->header.salt));
    ASSERT_NO_FATAL_FAILURE(w.reopen(sync));
    EXPECT_EQ(w.e.ops.size(), 60u);
}

// R1 and W1/W2: a crash with the last commit's write in the page cache and not
// synced. Whatever prefix of it reached the disk (every byte offset), recovery is
// the acknowledged records plus the last one only if it is whole; the log then
// takes appends that survive the next recovery.
TEST_P(KvLogFault, R1TornLastCommitAtEveryByteOffset) {
    for (int last = 0; last < 2; ++last) {  // an APPEND of 7 tokens (payload not a multiple of 8), a TRUNCATE
        tmp.clear();
        FaultLogDevice d;
        KvLogSync s(d);
        KvWriter w(seed() + last, GetParam(), tmp.path, "torn");
        ASSERT_TRUE(w.create(s).ok());
        for (int i = 0; i < 12; ++i) ASSERT_TRUE(w.step().ok());
        KvOp op;
        op.index = w.e.ops.size();
        if (last == 0) {
            op.type = LogRecordType::Append;
            op.start = w.model.len();
            op.n = 7;
        } else {
            op.type = LogRecordType::Truncate;
            op.new_length = w.model.len() / 2;
        }
        d.fault_next(w.path(), {FaultKind::Crash});
        ASSERT_FALSE(w.run(op, /*retracted_on_error=*/false).ok());
        ASSERT_TRUE(d.crashed());
        const auto [lo, hi] = d.unsynced(w.path());
        ASSERT_EQ(lo, w.log->file_bytes());
        const uint64_t len = hi - lo;
        const uint64_t pb = last == 0 ? 16 + 4 * op.n + op.n * w.e.layout.bytes_per_token() : 8;
        ASSERT_EQ(len, kRecordHeaderBytes + pb + pad8(pb));
        if (last == 0) {
            ASSERT_NE(pad8(pb), 0u);
        }
        TempDir img;
        int whole = 0;
        for (uint64_t t = 0; t <= len; ++t) {
            SCOPED_TRACE(testing::Message() << "torn after " << t << " of " << len << " bytes");
            img.clear();
            ASSERT_NO_FATAL_FAILURE(write_file(img.path + "/torn.kvlog", d.image_torn(w.path(), t)));
            // Appending after recovery at a few offsets and wherever only padding is missing.
            const bool go_on = t % 97 == 0 || t + 8 >= len;
            uint64_t k = 0;
            ASSERT_NO_FATAL_FAILURE(recover_and_continue(plain_sync, img.path, "torn", w.e, GetParam(), go_on ? 2 : 0, &k));
            // Whole with its padding, or torn (a record whose padding is cut kept, the
            // next append would land off the 8-byte grid and be lost).
            EXPECT_EQ(k, t == len ? 13u : 12u);
            whole += t == len;
        }
        EXPECT_EQ(whole, 1);
    }
}

// R1: the unsynced last commit with any subset of its 512-byte sectors lost
// (dropped sectors keep their old content; the file's size lost too, or not).
TEST_P(KvLogFault, R1DroppedUnsyncedSectors) {
    KvWriter w(seed(), GetParam(), tmp.path, "sectors");
    ASSERT_TRUE(w.create(sync).ok());
    for (int i = 0; i < 8; ++i) ASSERT_TRUE(w.step().ok());
    KvOp op;
    op.index = w.e.ops.size();
    op.start = w.model.len();
    op.n = 40;
    dev.fault_next(w.path(), {FaultKind::Crash});
    ASSERT_FALSE(w.run(op, false).ok());
    const size_t n_sec = dev.unsynced_sectors(w.path());
    ASSERT_GE(n_sec, 8u);
    std::mt19937_64 rng(seed());
    TempDir img;
    int recovered_last = 0, lost_last = 0;
    const int trials = 160;
    for (int trial = 0; trial < trials; ++trial) {
        SCOPED_TRACE(testing::Message() << "trial " << trial);
        std::vector<bool> keep(n_sec);
        bool all = true;
        for (size_t i = 0; i < n_sec; ++i) {
            keep[i] = trial == 0 || (trial > 1 && rng() % 4 != 0);  // all, none, then mostly kept
            all &= keep[i];
        }
        const bool cut = trial % 2 == 1;
        img.clear();
        ASSERT_NO_FATAL_FAILURE(write_file(img.path + "/sectors.kvlog", dev.image_sectors(w.path(), keep, cut)));
        uint64_t k = 0;
        ASSERT_NO_FATAL_FAILURE(recover_and_continue(plain_sync, img.path, "sectors", w.e, GetParam(),
                                                     trial % 10 == 0 ? 2 : 0, &k));
        if (all) {
            EXPECT_EQ(k, 9u);
        }
        (k == 9 ? recovered_last : lost_last)++;
    }
    EXPECT_GT(recovered_last, 0);
    EXPECT_GT(lost_last, trials / 2);
}

// W6: a failed fdatasync poisons the log; every later call fails and says so;
// reopening gives what is on disk: without the record when the kernel dropped its
// pages, with it when they were written after all.
TEST_P(KvLogFault, W6FsyncFailurePoisonsUntilReopened) {
    for (bool drop : {true, false}) {
        SCOPED_TRACE(drop ? "pages dropped" : "pages kept");
        tmp.clear();
        KvWriter w(seed(), GetParam(), tmp.path, "poison");
        ASSERT_TRUE(w.create(sync).ok());
        for (int i = 0; i < 10; ++i) ASSERT_TRUE(w.step().ok());
        const uint64_t durable_len = w.model.len();
        Fault f{FaultKind::SyncEio};
        f.drop = drop;
        dev.fault_next(w.path(), f);
        KvOp op;  // an APPEND (whatever the next op would be)
        op.index = w.e.ops.size();
        op.start = w.model.len();
        op.n = 9;
        Status st = w.run(op, /*retracted_on_error=*/false);
        ASSERT_FALSE(st.ok());
        EXPECT_TRUE(contains(st.error().message, "fdatasync failed")) << st.error().message;
        EXPECT_TRUE(w.log->poisoned());
        EXPECT_EQ(w.log->n_tokens(), durable_len);
        for (int i = 0; i < 3; ++i) {
            Status again = w.step();
            ASSERT_FALSE(again.ok());
            EXPECT_TRUE(contains(again.error().message, "poisoned")) << again.error().message;
        }
        Status t = w.log->truncate(0);
        EXPECT_FALSE(t.ok());
        Status c = w.log->compact(*w.pool, w.seq, w.model.tokens);
        ASSERT_FALSE(c.ok());
        EXPECT_TRUE(contains(c.error().message, "poisoned")) << c.error().message;
        ASSERT_NO_FATAL_FAILURE(w.reopen(plain_sync));
        EXPECT_EQ(w.e.ops.size(), drop ? 10u : 11u);
        for (int i = 0; i < 5; ++i) ASSERT_TRUE(w.step().ok());
        const size_t n = w.e.ops.size();
        ASSERT_NO_FATAL_FAILURE(w.reopen(plain_sync));
        EXPECT_EQ(w.e.ops.size(), n);
    }
}

// W5: ENOSPC after any prefix of the record (none, part of the header, part of the
// payload, all but one byte): the append fails, the file is cut back, the context
// keeps its last durable state, and appends succeed again once there is space.
TEST_P(KvLogFault, W5EnospcKeepsTheDurableState) {
    KvWriter w(seed(), GetParam(), tmp.path, "nospace");
    ASSERT_TRUE(w.create(sync).ok());
    for (int i = 0; i < 5; ++i) ASSERT_TRUE(w.step().ok());
    for (uint64_t keep : {uint64_t{0}, uint64_t{1}, uint64_t{47}, uint64_t{48}, uint64_t{300}, uint64_t{1} << 40}) {
        SCOPED_TRACE(testing::Message() << "space for " << keep << " bytes");
        while (w.next_op().type == LogRecordType::Truncate) ASSERT_TRUE(w.step().ok());
        const KvOp op = w.next_op();
        // keep = 2^40 stands for "all but the last byte".
        const uint64_t rec = kRecordHeaderBytes + 16 + 4 * op.n + op.n * w.e.layout.bytes_per_token() +
                             pad8(16 + 4 * op.n + op.n * w.e.layout.bytes_per_token());
        const uint64_t bytes = w.log->file_bytes(), len = w.log->n_tokens();
        const size_t acked = w.e.acked;
        dev.set_space(std::min(keep, rec - 1));
        Status st = w.step();
        ASSERT_FALSE(st.ok());
        EXPECT_TRUE(contains(st.error().message, std::strerror(ENOSPC))) << st.error().message;
        EXPECT_TRUE(contains(st.error().message, "keeps its last durable state")) << st.error().message;
        EXPECT_FALSE(w.log->poisoned());
        EXPECT_EQ(w.log->n_tokens(), len);
        EXPECT_EQ(w.log->file_bytes(), bytes);
        EXPECT_EQ(file_size(w.path()), bytes) << "the failed write was not cut off";
        EXPECT_EQ(w.e.acked, acked);
        // Still no space: fails again the same way.
        dev.set_space(0);
        EXPECT_FALSE(w.step().ok());
        EXPECT_EQ(file_size(w.path()), bytes);
        dev.unlimited_space();
        ASSERT_TRUE(w.step().ok());
        ASSERT_TRUE(w.step().ok());
    }
    // The same through a per-op fault that lets a prefix through.
    dev.fault_next(w.path(), {FaultKind::NoSpace, 100});
    EXPECT_FALSE(w.step().ok());
    ASSERT_TRUE(w.step().ok());
    const size_t n = w.e.ops.size();
    ASSERT_NO_FATAL_FAILURE(w.reopen(plain_sync));
    EXPECT_EQ(w.e.ops.size(), n);
}

// W4: short writes (the device takes k bytes per call, for several k; or once, of
// any length) are continued: every append succeeds and nothing is lost. A device
// that makes no progress at all fails the append like a write error (W5).
TEST_P(KvLogFault, W4ShortWritesAreContinued) {
    KvWriter w(seed(), GetParam(), tmp.path, "short");
    ASSERT_TRUE(w.create(sync).ok());
    for (uint64_t k : {uint64_t{1000}, uint64_t{48}, uint64_t{7}, uint64_t{513}}) {
        dev.set_max_write(k);
        const uint64_t ops0 = dev.ops_seen();
        for (int i = 0; i < 4; ++i) {
            Status s = w.step();
            ASSERT_TRUE(s.ok()) << "max write " << k << ": " << s.error().message;
        }
        EXPECT_GT(dev.ops_seen() - ops0, 4u) << "no write was continued";
    }
    dev.set_max_write(0);
    for (uint64_t keep : {uint64_t{0}, uint64_t{1}, uint64_t{47}, uint64_t{49}, uint64_t{400}}) {
        dev.fault_next(w.path(), {FaultKind::Short, keep});
        ASSERT_TRUE(w.step().ok()) << "one short write of " << keep << " bytes";
    }
    // No progress twice: an I/O error, the state kept.
    const uint64_t bytes = w.log->file_bytes();
    dev.fault_next(w.path(), {FaultKind::Short, 0});
    dev.fault_next(w.path(), {FaultKind::Short, 0});
    KvOp op;
    op.index = w.e.ops.size();
    op.start = w.model.len();
    op.n = 3;
    Status st = w.run(op);
    ASSERT_FALSE(st.ok());
    EXPECT_TRUE(contains(st.error().message, std::strerror(EIO))) << st.error().message;
    EXPECT_FALSE(w.log->poisoned());
    EXPECT_EQ(file_size(w.path()), bytes);
    for (int i = 0; i < 3; ++i) ASSERT_TRUE(w.step().ok());
    const size_t n = w.e.ops.size();
    ASSERT_NO_FATAL_FAILURE(w.reopen(plain_sync));
    EXPECT_EQ(w.e.ops.size(), n);
}

// R2: a bit flipped in any record but the last (its header or its payload), with
// records of later commits after it, is corruption of durable data: refused with
// "mid-log corruption", every file as it was, the pool as it was.
TEST_P(KvLogFault, R2MidLogBitFlipIsRefusedAndFilesUntouched) {
    KvWriter w(seed(), GetParam(), tmp.path, "flip");
    ASSERT_TRUE(w.create(sync).ok());
    for (int i = 0; i < 14; ++i) ASSERT_TRUE(w.step().ok());
    w.log.reset();
    const std::vector<uint8_t> orig = read_file(w.path());
    const auto recs = raw_records(orig);
    ASSERT_EQ(recs.size(), 14u);
    std::mt19937_64 rng(seed());
    for (size_t j = 0; j + 1 < recs.size(); ++j) {
        for (int k = 0; k < 4; ++k) {
            // Two flips in the header, two in the payload.
            const uint64_t span = k < 2 ? kRecordHeaderBytes : recs[j].pb;
            const uint64_t at = recs[j].off + (k < 2 ? 0 : kRecordHeaderBytes) + rng() % span;
            const int bit = static_cast<int>(rng() % 8);
            SCOPED_TRACE(testing::Message() << "record " << j << ", bit " << bit << " of byte " << at);
            std::vector<uint8_t> b = orig;
            b[at] ^= static_cast<uint8_t>(1u << bit);
            ASSERT_NO_FATAL_FAILURE(write_file(w.path(), b));
            ASSERT_NO_FATAL_FAILURE(expect_refused(plain_sync, tmp.path, "flip", w.e, "mid-log corruption"));
        }
    }
    ASSERT_NO_FATAL_FAILURE(write_file(w.path(), orig));
    ASSERT_NO_FATAL_FAILURE(w.reopen(plain_sync));
    EXPECT_EQ(w.e.ops.size(), 14u);
}

// R1: a bit flipped in the last record is a torn tail: cut there (the file ends
// at the record before), and appends after it survive the next recovery.
TEST_P(KvLogFault, R1BitFlipInTheLastRecordIsCut) {
    KvWriter w(seed(), GetParam(), tmp.path, "last");
    ASSERT_TRUE(w.create(sync).ok());
    for (int i = 0; i < 9; ++i) ASSERT_TRUE(w.step().ok());
    w.log.reset();
    const std::vector<uint8_t> orig = read_file(w.path());
    const auto recs = raw_records(orig);
    ASSERT_EQ(recs.size(), 9u);
    const RawRecord last = recs.back();
    KvExpect e = w.e;
    e.acked = 8;
    std::mt19937_64 rng(seed());
    TempDir img;
    for (int k = 0; k < 24; ++k) {
        const uint64_t at = last.off + rng() % (kRecordHeaderBytes + last.pb);
        SCOPED_TRACE(testing::Message() << "bit flip at byte " << at);
        std::vector<uint8_t> b = orig;
        b[at] ^= static_cast<uint8_t>(1u << (rng() % 8));
        img.clear();
        ASSERT_NO_FATAL_FAILURE(write_file(img.path + "/last.kvlog", b));
        uint64_t got = 0;
        ASSERT_NO_FATAL_FAILURE(recover_and_continue(plain_sync, img.path, "last", e, GetParam(), k % 6 == 0 ? 2 : 0, &got));
        EXPECT_EQ(got, 8u);
        if (k % 6 != 0) {
            EXPECT_EQ(file_size(img.path + "/last.kvlog"), last.off);
        }
    }
}

// R2's other half: records after a bad one that belong to its own commit (a commit
// of several records: unsynced pages persist in any order) make it a torn tail, not
// corruption; one record of a later commit after it does.
TEST_P(KvLogFault, R2RecordsOfTheBadRecordsOwnCommitAreATornTail) {
    KvWriter w(seed(), GetParam(), tmp.path, "batch");
    ASSERT_TRUE(w.create(sync).ok());
    for (int i = 0; i < 10; ++i) ASSERT_TRUE(w.step().ok());
    w.log.reset();
    auto scan = kv_log_scan(w.path(), &w.e.id);
    ASSERT_TRUE(scan.ok());
    const uint64_t salt = scan->header.salt;
    const std::vector<uint8_t> orig = read_file(w.path());
    const auto recs = raw_records(orig);
    ASSERT_EQ(recs.size(), 10u);
    // Records 7, 8, 9 as one commit (batch_seq 7).
    std::vector<uint8_t> one = orig;
    ASSERT_NO_FATAL_FAILURE(reseal(one, salt, [](uint64_t s) { return s >= 7 ? 7 : s; }));
    TempDir img;
    ASSERT_NO_FATAL_FAILURE(write_file(img.path + "/batch.kvlog", one));
    uint64_t k = 0;
    ASSERT_NO_FATAL_FAILURE(recover_and_continue(plain_sync, img.path, "batch", w.e, GetParam(), 0, &k));
    EXPECT_EQ(k, 10u) << "the resealed log is valid as it is";
    KvExpect e = w.e;
    e.acked = 7;
    for (size_t bad : {size_t{7}, size_t{8}}) {
        std::vector<uint8_t> b = one;
        b[recs[bad].off + kRecordHeaderBytes + recs[bad].pb / 2] ^= 0x10;
        img.clear();
        ASSERT_NO_FATAL_FAILURE(write_file(img.path + "/batch.kvlog", b));
        ASSERT_NO_FATAL_FAILURE(recover_and_continue(plain_sync, img.path, "batch", e, GetParam(), 2, &k));
        EXPECT_EQ(k, bad);
    }
    // Records 7 and 8 one commit, 9 a later one: a bad 7 is corruption.
    std::vector<uint8_t> two = orig;
    ASSERT_NO_FATAL_FAILURE(reseal(two, salt, [](uint64_t s) { return s == 8 ? 7 : s; }));
    two[recs[7].off + kRecordHeaderBytes + 3] ^= 0x01;
    img.clear();
    ASSERT_NO_FATAL_FAILURE(write_file(img.path + "/batch.kvlog", two));
    ASSERT_NO_FATAL_FAILURE(expect_refused(plain_sync, img.path, "batch", e, "mid-log corruption"));
}

// R4: a bad file header is refused, and the file left as it is.
TEST_P(KvLogFault, R4BadFileHeaderIsRefused) {
    KvWriter w(seed(), GetParam(), tmp.path, "head");
    ASSERT_TRUE(w.create(sync).ok());
    for (int i = 0; i < 3; ++i) ASSERT_TRUE(w.step().ok());
    w.log.reset();
    const std::vector<uint8_t> orig = read_file(w.path());
    for (size_t at : {size_t{0}, size_t{9}, size_t{50}, size_t{75}, size_t{100}, size_t{126}}) {
        std::vector<uint8_t> b = orig;
        b[at] ^= 0x04;
        ASSERT_NO_FATAL_FAILURE(write_file(w.path(), b));
        ASSERT_NO_FATAL_FAILURE(expect_refused(plain_sync, tmp.path, "head", w.e, w.path().c_str()));
    }
    std::vector<uint8_t> cut(orig.begin(), orig.begin() + 100);
    ASSERT_NO_FATAL_FAILURE(write_file(w.path(), cut));
    ASSERT_NO_FATAL_FAILURE(expect_refused(plain_sync, tmp.path, "head", w.e, "truncated header"));
}

// W8 / R5: compaction folds the log into a checkpoint blob; reopening gives the same
// state (and the same after more appends and a second compaction, whose old blob
// is gone); should_compact says when.
TEST_P(KvLogFault, W8CompactionKeepsTheState) {
    KvLogOptions o;
    o.compact_min_bytes = 16 << 10;
    KvWriter w(seed(), GetParam(), tmp.path, "compact");
    ASSERT_TRUE(w.create(sync, o).ok());
    int steps = 0;
    while (!w.log->should_compact()) {
        ASSERT_TRUE(w.step().ok());
        ASSERT_LT(++steps, 400) << "should_compact never became true";
    }
    EXPECT_GT(w.log->file_bytes(), o.compact_min_bytes);
    ASSERT_TRUE(w.compact().ok());
    EXPECT_FALSE(w.log->should_compact());
    EXPECT_EQ(w.log->header().generation, 1u);
    EXPECT_EQ(w.log->n_tokens(), w.model.len());
    ASSERT_NO_FATAL_FAILURE(w.reopen(sync));
    EXPECT_EQ(dir_names(tmp.path), (std::vector<std::string>{"compact.1.kvblob", "compact.kvlog"}));
    for (int i = 0; i < 20; ++i) ASSERT_TRUE(w.step().ok());
    ASSERT_NO_FATAL_FAILURE(w.reopen(sync));
    ASSERT_TRUE(w.compact().ok());
    EXPECT_EQ(dir_names(tmp.path), (std::vector<std::string>{"compact.2.kvblob", "compact.kvlog"}));
    for (int i = 0; i < 10; ++i) ASSERT_TRUE(w.step().ok());
    const size_t n = w.e.ops.size();
    ASSERT_NO_FATAL_FAILURE(w.reopen(sync));
    EXPECT_EQ(w.e.ops.size(), n);
    // A torn tail after the checkpoint record: cut like any other.
    dev.fault_next(w.path(), {FaultKind::Crash});
    ASSERT_FALSE(w.step(false).ok());
    TempDir img;
    const auto [lo, hi] = dev.unsynced(w.path());
    ASSERT_NO_FATAL_FAILURE(write_file(img.path + "/compact.kvlog", dev.image_torn(w.path(), (hi - lo) / 2)));
    ASSERT_NO_FATAL_FAILURE(write_file(img.path + "/compact.2.kvblob", read_file(tmp.path + "/compact.2.kvblob")));
    uint64_t k = 0;
    ASSERT_NO_FATAL_FAILURE(recover_and_continue(plain_sync, img.path, "compact", w.e, GetParam(), 2, &k));
    EXPECT_EQ(k, n);
}

// R5 / W8: the states an interrupted compaction leaves. Before the new log's rename
// (the new blob, the new log's temporary file, a blob temporary): the old log with
// its blob, the leftovers removed. After it, before the old blob's removal: the new
// log, the old blob removed. Another context's files in the directory are untouched.
TEST_P(KvLogFault, R5InterruptedCompactionLeftoversAreRemoved) {
    KvWriter other(seed() + 7, GetParam(), tmp.path, "other");
    ASSERT_TRUE(other.create(sync).ok());
    for (int i = 0; i < 6; ++i) ASSERT_TRUE(other.step().ok());
    ASSERT_TRUE(other.compact().ok());
    ASSERT_TRUE(other.step().ok());
    KvWriter w(seed(), GetParam(), tmp.path, "ctx");
    ASSERT_TRUE(w.create(sync).ok());
    for (int i = 0; i < 12; ++i) ASSERT_TRUE(w.step().ok());
    ASSERT_TRUE(w.compact().ok());
    for (int i = 0; i < 5; ++i) ASSERT_TRUE(w.step().ok());
    const std::string dir = tmp.path;
    // Crash during the second compaction, before the rename of the new log.
    {
        auto bh = blob_write(dir + "/ctx.2.kvblob", w.e.id, *w.pool, w.seq, w.model.tokens, 0, w.model.len());
        ASSERT_TRUE(bh.ok()) << bh.error().message;
    }
    ASSERT_NO_FATAL_FAILURE(write_file(dir + "/ctx.kvlog.tmp", read_file(w.path())));
    ASSERT_NO_FATAL_FAILURE(write_file(dir + "/ctx.2.kvblob.tmp.4242", std::vector<uint8_t>(300, 0xab)));
    ASSERT_NO_FATAL_FAILURE(write_file(dir + "/ctx.7.kvblob", std::vector<uint8_t>(10, 1)));
    auto others = [&] {
        auto snap = dir_snapshot(dir);
        std::erase_if(snap, [](const auto& kv) { return kv.first.rfind("other.", 0) != 0; });
        return snap;
    };
    const auto other_files = others();
    ASSERT_EQ(other_files.size(), 2u);
    ASSERT_NO_FATAL_FAILURE(w.reopen(sync));
    EXPECT_EQ(w.log->header().generation, 1u);
    EXPECT_EQ(dir_names(dir),
              (std::vector<std::string>{"ctx.1.kvblob", "ctx.kvlog", "other.1.kvblob", "other.kvlog"}));
    EXPECT_TRUE(others() == other_files);
    // Crash after the rename, before the old blob is removed.
    const std::vector<uint8_t> gen1 = read_file(dir + "/ctx.1.kvblob");
    ASSERT_TRUE(w.compact().ok());
    ASSERT_NO_FATAL_FAILURE(write_file(dir + "/ctx.1.kvblob", gen1));
    ASSERT_TRUE(w.step().ok());
    ASSERT_NO_FATAL_FAILURE(w.reopen(sync));
    EXPECT_EQ(w.log->header().generation, 2u);
    EXPECT_EQ(dir_names(dir),
              (std::vector<std::string>{"ctx.2.kvblob", "ctx.kvlog", "other.1.kvblob", "other.kvlog"}));
    EXPECT_TRUE(others() == other_files);
    ASSERT_NO_FATAL_FAILURE(other.reopen(sync));
}

// ---------------------------------------------------------------------------
// Group commit (W3): several threads, one log each, one KvLogSync.

namespace {

// Counts what reaches the device: calls, ops, the most ops in one call; sleeps in
// each call so that appenders queue up behind the leader.
class CountingDevice final : public LogDevice {
public:
    CountingDevice(LogDevice& inner, std::chrono::microseconds delay) : inner_(inner), delay_(delay) {}
    void write_sync(std::span<const LogWrite> ops, std::span<LogWriteResult> out) override {
        calls.fetch_add(1, std::memory_order_relaxed);
        n_ops.fetch_add(ops.size(), std::memory_order_relaxed);
        uint64_t m = max_ops.load(std::memory_order_relaxed);
        while (ops.size() > m && !max_ops.compare_exchange_weak(m, ops.size(), std::memory_order_relaxed)) {}
        // The first call is long (50 ms, widened by DUET_TIME_SCALE): every other
        // thread is running by then and queues behind it, so grouping does not hang
        // on how a loaded 2-core machine schedules the threads.
        std::this_thread::sleep_for(calls.load(std::memory_order_relaxed) == 1
                                        ? std::chrono::microseconds(test_time::scaled_ns(50'000'000) / 1000)
                                        : delay_);
        inner_.write_sync(ops, out);
    }
    std::atomic<uint64_t> calls{0}, n_ops{0}, max_ops{0};

private:
    LogDevice& inner_;
    std::chrono::microseconds delay_;
};

struct ThreadResult {
    std::string error;
    int failed = 0;
    bool poisoned = false;
};

// Steps w on its own thread until `ops` are acknowledged; a failed step is retried
// (as the same op) unless the log is poisoned, then the thread stops.
void append_loop(KvWriter& w, int ops, ThreadResult& r) {
    for (int tries = 0; w.e.acked < static_cast<size_t>(ops); ++tries) {
        if (tries == 2 * ops) {
            r.error = "too many failed appends";
            return;
        }
        Status s = w.step();
        if (s) continue;
        ++r.failed;
        if (w.log->poisoned()) {
            r.poisoned = true;
            return;
        }
    }
}

}  // namespace

TEST(KvLogGroupCommit, W3ManyThreadsShareSyncsAndLoseNothing) {
    auto uring = UringLogDevice::create();
    if (!uring) DUET_SKIP_UNLESS_REQUIRED("io_uring", "io_uring unavailable here: " + uring.error().message);
    for (bool group : {true, false}) {
        SCOPED_TRACE(group ? "group commit" : "one sync per append");
        TempDir tmp;
        CountingDevice counting(**uring, std::chrono::microseconds(500));
        KvLogSync sync(counting, group);
        constexpr int kThreads = 6, kOps = 80;
        std::vector<std::unique_ptr<KvWriter>> ws;
        for (int t = 0; t < kThreads; ++t) {
            ws.push_back(std::make_unique<KvWriter>(50 + t, t % 2 ? KvDtype::Int8 : KvDtype::F16, tmp.path,
                                                    "ctx" + std::to_string(t)));
            ASSERT_TRUE(ws.back()->create(sync).ok());
        }
        std::vector<ThreadResult> res(kThreads);
        std::vector<std::thread> th;
        for (int t = 0; t < kThreads; ++t) th.emplace_back([&, t] { append_loop(*ws[t], kOps, res[t]); });
        for (auto& x : th) x.join();
        for (int t = 0; t < kThreads; ++t) {
            EXPECT_EQ(res[t].error, "");
            EXPECT_EQ(res[t].failed, 0);
            EXPECT_EQ(ws[t]->e.acked, static_cast<size_t>(kOps));
        }
        EXPECT_EQ(counting.n_ops.load(), uint64_t{kThreads} * kOps);
        if (group)
            EXPECT_GE(counting.max_ops.load(), 2u) << "no two logs' appends ever shared a batch";
        else
            EXPECT_EQ(counting.max_ops.load(), 1u);
        std::printf("%s: %d appends in %llu device calls (at most %llu logs in one)\n", group ? "group" : "single",
                    kThreads * kOps, static_cast<unsigned long long>(counting.calls.load()),
                    static_cast<unsigned long long>(counting.max_ops.load()));
        SyncLogDevice plain;
        KvLogSync plain_sync(plain);
        for (int t = 0; t < kThreads; ++t) {
            ASSERT_NO_FATAL_FAILURE(ws[t]->reopen(plain_sync));
            EXPECT_EQ(ws[t]->e.ops.size(), static_cast<size_t>(kOps));
        }
    }
}

// A fault in one log's commit stays in that log: ENOSPC fails its append (and the
// retry succeeds), a failed sync poisons it alone; the other logs of the same
// batches go on.
TEST(KvLogGroupCommit, W3OneLogsFaultStaysInThatLog) {
    TempDir tmp;
    FaultLogDevice fault;
    CountingDevice counting(fault, std::chrono::microseconds(300));
    KvLogSync sync(counting);
    constexpr int kThreads = 4, kOps = 40;
    std::vector<std::unique_ptr<KvWriter>> ws;
    for (int t = 0; t < kThreads; ++t) {
        ws.push_back(std::make_unique<KvWriter>(70 + t, KvDtype::F16, tmp.path, "ctx" + std::to_string(t)));
        ASSERT_TRUE(ws.back()->create(sync).ok());
    }
    for (int i = 0; i < 3; ++i) fault.fault_next(ws[1]->path(), {FaultKind::NoSpace, 64});
    fault.fault_next(ws[2]->path(), {});
    fault.fault_next(ws[2]->path(), {});
    fault.fault_next(ws[2]->path(), {FaultKind::SyncEio});
    std::vector<ThreadResult> res(kThreads);
    std::vector<std::thread> th;
    for (int t = 0; t < kThreads; ++t) th.emplace_back([&, t] { append_loop(*ws[t], kOps, res[t]); });
    for (auto& x : th) x.join();
    EXPECT_EQ(res[0].failed, 0);
    EXPECT_EQ(res[3].failed, 0);
    EXPECT_EQ(res[1].failed, 3) << "each ENOSPC fails one try";
    EXPECT_EQ(ws[1]->e.acked, static_cast<size_t>(kOps));
    EXPECT_EQ(res[2].failed, 1);
    EXPECT_TRUE(res[2].poisoned);
    EXPECT_FALSE(res[1].poisoned);
    EXPECT_EQ(ws[2]->e.acked, 2u);
    SyncLogDevice plain;
    KvLogSync plain_sync(plain);
    for (int t = 0; t < kThreads; ++t) {
        ASSERT_NO_FATAL_FAILURE(ws[t]->reopen(plain_sync));
        EXPECT_EQ(ws[t]->e.ops.size(), t == 2 ? 2u : static_cast<size_t>(kOps)) << "log " << t;
    }
}

// ---------------------------------------------------------------------------
// A real short write and EFBIG: RLIMIT_FSIZE in a forked child (SIGXFSZ ignored),
// through UringLogDevice. The kernel cuts the write at the limit, io_uring
// completes it short and cancels the linked fsync, the committer writes the rest
// and gets EFBIG: the append fails, the file is cut back, the context keeps its
// state; with the limit raised the same append succeeds. The parent recovers.

namespace {

// Keeps what the device reported for each op.
class RecordingDevice final : public LogDevice {
public:
    explicit RecordingDevice(LogDevice& inner) : inner_(inner) {}
    void write_sync(std::span<const LogWrite> ops, std::span<LogWriteResult> out) override {
        inner_.write_sync(ops, out);
        for (size_t i = 0; i < ops.size(); ++i) {
            uint64_t n = 0;
            for (const iovec& v : ops[i].iov) n += v.iov_len;
            seen.push_back({n, out[i]});
        }
    }
    struct Op {
        uint64_t requested;
        LogWriteResult r;
    };
    std::vector<Op> seen;

private:
    LogDevice& inner_;
};

// The child: "ok <ops>" on fd, or what it found wrong (exit 1).
int efbig_child(const std::string& dir, int fd, uint64_t seed) {
    auto fail = [&](std::string m) {
        (void)!::write(fd, m.data(), m.size());
        return 1;
    };
    ::signal(SIGXFSZ, SIG_IGN);
    auto uring = UringLogDevice::create();
    if (!uring) return fail("io_uring: " + uring.error().message);
    RecordingDevice rec(**uring);
    KvLogSync sync(rec);
    KvWriter w(seed, KvDtype::F16, dir, "fsize");
    if (!w.create(sync)) return fail("create failed");
    for (int i = 0; i < 6; ++i)
        if (!w.step()) return fail("an append below the limit failed");
    rlimit lim{};
    ::getrlimit(RLIMIT_FSIZE, &lim);
    for (uint64_t cut : {uint64_t{0}, uint64_t{1}, uint64_t{48}, uint64_t{777}}) {
        KvOp op = w.next_op();
        if (op.type == LogRecordType::Truncate) {
            if (!w.step()) return fail("a truncate failed");
            op = w.next_op();
        }
        const uint64_t bytes = w.log->file_bytes(), len = w.log->n_tokens();
        rlimit low = lim;
        low.rlim_cur = bytes + cut;
        if (::setrlimit(RLIMIT_FSIZE, &low) != 0) return fail("setrlimit failed");
        rec.seen.clear();
        Status st = w.step();
        if (::setrlimit(RLIMIT_FSIZE, &lim) != 0) return fail("setrlimit back failed");
        if (st) return fail(fmt::format("an append past RLIMIT_FSIZE (+{}) succeeded", cut));
        if (!contains(st.error().message, std::strerror(EFBIG)))
            return fail("the error does not say EFBIG: " + st.error().message);
        if (w.log->poisoned()) return fail("a failed write poisoned the log");
        // What io_uring reported: the write cut at the limit and its sync cancelled,
        // then EFBIG for the rest; at the limit already, EFBIG at once.
        const auto& sn = rec.seen;
        const bool as_expected =
            cut == 0 ? sn.size() == 1 && sn[0].r.write_err == EFBIG && sn[0].r.written == 0
                     : sn.size() == 2 && sn[0].r.write_err == 0 && sn[0].r.written == cut &&
                           sn[0].r.sync_err == ECANCELED && sn[0].requested > cut && sn[1].r.write_err == EFBIG &&
                           sn[1].r.written == 0 && sn[1].requested == sn[0].requested - cut;
        if (!as_expected) {
            std::string m = fmt::format("at +{}, the device reported:", cut);
            for (const auto& o : sn)
                m += fmt::format(" [{} requested, {} written, write_err {}, sync_err {}]", o.requested, o.r.written,
                                 o.r.write_err, o.r.sync_err);
            return fail(m);
        }
        if (w.log->n_tokens() != len || w.log->file_bytes() != bytes || file_size(w.path()) != bytes)
            return fail(fmt::format("after EFBIG at +{}: {} tokens (was {}), {} bytes in the file (was {})", cut,
                                    w.log->n_tokens(), len, file_size(w.path()), bytes));
        if (!w.step()) return fail("the append failed again with the limit raised");
    }
    for (int i = 0; i < 4; ++i)
        if (!w.step()) return fail("an append after the faults failed");
    const std::string done = fmt::format("ok {}", w.e.ops.size());
    (void)!::write(fd, done.data(), done.size());
    return 0;
}

}  // namespace

TEST(KvLogRealDevice, W4W5RlimitFsizeShortWriteThenEfbig) {
    auto uring = UringLogDevice::create();
    if (!uring) DUET_SKIP_UNLESS_REQUIRED("io_uring", "io_uring unavailable here: " + uring.error().message);
    uring->reset();
    TempDir tmp;
    int p[2];
    ASSERT_EQ(::pipe(p), 0);
    const uint64_t seed = 4711;
    const pid_t pid = ::fork();
    if (pid == 0) {
        ::close(p[0]);
        const int rc = efbig_child(tmp.path, p[1], seed);
        ::close(p[1]);
        ::_exit(rc);
    }
    ::close(p[1]);
    std::string msg;
    char buf[512];
    for (ssize_t r; (r = ::read(p[0], buf, sizeof buf)) > 0;) msg.append(buf, static_cast<size_t>(r));
    ::close(p[0]);
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child: " << msg;
    ASSERT_EQ(msg.rfind("ok ", 0), 0u) << msg;
    const size_t n = std::stoul(msg.substr(3));
    // The child's ops are the sequence's first n (failed ones retried as the same op).
    KvExpect e;
    e.seed = seed;
    e.layout = test_layout(KvDtype::F16);
    KvModel m;
    m.seed = seed;
    for (size_t i = 0; i < n; ++i) {
        e.ops.push_back(make_op(seed, i, m.len()));
        m.apply(e.ops.back());
    }
    e.acked = n;
    SyncLogDevice plain;
    KvLogSync sync(plain);
    Recovered r;
    ASSERT_NO_FATAL_FAILURE(recover_and_check(sync, tmp.path, "fsize", e, r));
    EXPECT_EQ(r.k, n);
    EXPECT_FALSE(r.scan.torn);
}
