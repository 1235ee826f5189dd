// UringLogDevice's plan (kv/log_device.h: plan_uring_writes): the rule the KV log's
// durability rests on, tested without a ring or a disk. A crash test cannot see a
// write that is not linked to its datasync, or a datasync dropped: SIGKILL keeps the
// page cache, so everything reads back. What would: a power cut (or a VM's hard
// reset) between the append's acknowledgement and the write-back, which needs a
// machine of its own (dm-flakey or a VM snapshot without the host's cache); see
// src/kv/KVLOG.md.
#include <gtest/gtest.h>
#include <climits>
#include <unistd.h>

#include <cstdio>
#include <set>
#include <vector>

#include "kv/log_device.h"
#include "require.h"

using namespace duet;

namespace {

// An op of `n_iov` buffers of `len` bytes each at `offset` (the plan reads lengths only).
LogWrite op_of(int fd, uint64_t offset, size_t n_iov, size_t len = 7) {
    static char buf[64];
    LogWrite w;
    w.fd = fd;
    w.offset = offset;
    w.iov.assign(n_iov, iovec{buf, len});
    return w;
}

// Checks the chain rule on every wave: each op's steps are contiguous in submission
// order, its writes in order over contiguous offsets covering its buffers, each
// linked to the next (a ring wave) and the last step its datasync, not linked (a link
// from it would cancel the next op's chain when this sync fails).
void expect_chains(const std::vector<LogWrite>& ops, const std::vector<UringWave>& waves, unsigned entries) {
    std::set<uint32_t> seen;
    for (const UringWave& w : waves) {
        if (!w.one_at_a_time) {
            EXPECT_LE(w.steps.size(), entries) << "a wave larger than the ring";
        }
        size_t k = 0;
        while (k < w.steps.size()) {
            const uint32_t op = w.steps[k].op;
            ASSERT_LT(op, ops.size());
            EXPECT_TRUE(seen.insert(op).second) << "op " << op << " planned twice";
            uint64_t off = ops[op].offset, bytes = 0;
            size_t iov = 0;
            uint32_t piece = 0;
            for (; k < w.steps.size() && w.steps[k].kind == UringStep::Kind::Writev; ++k, ++piece) {
                const UringStep& s = w.steps[k];
                EXPECT_EQ(s.op, op) << "another op's write inside op " << op << "'s chain";
                EXPECT_EQ(s.piece, piece);
                EXPECT_EQ(s.first_iov, iov);
                EXPECT_LE(s.n_iov, static_cast<size_t>(IOV_MAX));
                EXPECT_EQ(s.offset, off);
                EXPECT_EQ(s.link, !w.one_at_a_time) << "op " << op << " piece " << piece << ": not linked to the next";
                iov += s.n_iov;
                off += s.bytes;
                bytes += s.bytes;
            }
            EXPECT_EQ(iov, ops[op].iov.size()) << "op " << op << ": every buffer written";
            uint64_t total = 0;
            for (const iovec& v : ops[op].iov) total += v.iov_len;
            EXPECT_EQ(bytes, total);
            ASSERT_LT(k, w.steps.size()) << "op " << op << "'s chain has no sync";
            const UringStep& sync = w.steps[k];
            EXPECT_EQ(sync.kind, UringStep::Kind::Fsync);
            EXPECT_EQ(sync.op, op) << "op " << op << "'s chain ends in another op's sync";
            EXPECT_TRUE(sync.datasync) << "op " << op << ": IORING_FSYNC_DATASYNC";
            EXPECT_FALSE(sync.link) << "op " << op << "'s sync linked to the next chain";
            ++k;
        }
    }
    EXPECT_EQ(seen.size(), ops.size()) << "every op planned";
}

}  // namespace

TEST(LogDevicePlan, EveryWriteIsLinkedToItsOpsDatasync) {
    std::vector<LogWrite> ops = {op_of(3, 0, 1), op_of(4, 4096, 3), op_of(3, 7, 2 * IOV_MAX + 5), op_of(5, 0, 0)};
    const auto waves = plan_uring_writes(ops, 256);
    ASSERT_EQ(waves.size(), 1u) << "one io_uring_enter for a batch that fits";
    EXPECT_FALSE(waves[0].one_at_a_time);
    expect_chains(ops, waves, 256);
    EXPECT_EQ(waves[0].steps.size(), 2u + 2u + 4u + 1u);
}

TEST(LogDevicePlan, BatchesLargerThanTheRingGoInWavesOfWholeChains) {
    std::vector<LogWrite> ops;
    for (int i = 0; i < 100; ++i) ops.push_back(op_of(10 + i % 7, static_cast<uint64_t>(i) * 100, 1 + i % 3));
    const unsigned entries = 16;
    const auto waves = plan_uring_writes(ops, entries);
    EXPECT_GT(waves.size(), 100u / 8);
    for (const UringWave& w : waves) EXPECT_FALSE(w.one_at_a_time);
    expect_chains(ops, waves, entries);
}

TEST(LogDevicePlan, AChainLongerThanTheRingRunsAloneOneStepAtATime) {
    // 5 pieces + a sync on a ring of 4: its writes one after the other, then the sync.
    std::vector<LogWrite> ops = {op_of(3, 0, 1), op_of(4, 0, 4 * IOV_MAX + 1), op_of(5, 0, 1)};
    const auto waves = plan_uring_writes(ops, 4);
    ASSERT_EQ(waves.size(), 3u);
    EXPECT_FALSE(waves[0].one_at_a_time);
    EXPECT_TRUE(waves[1].one_at_a_time);
    EXPECT_EQ(waves[1].steps.size(), 6u);
    EXPECT_FALSE(waves[2].one_at_a_time);
    expect_chains(ops, waves, 4);
}

// The real device on a real file, through the plan: bytes land where asked, synced.
TEST(LogDevicePlan, UringDeviceWritesWhatThePlanSays) {
    auto dev = UringLogDevice::create(8);
    if (!dev.ok()) DUET_SKIP_UNLESS_REQUIRED("io_uring", "io_uring unavailable here: " + dev.error().message);
    char path[] = "/tmp/duet-log-device-XXXXXX";
    const int fd = mkstemp(path);
    ASSERT_GE(fd, 0);
    unlink(path);
    std::vector<char> a(100, 'a'), b(3 * IOV_MAX, 'b');
    LogWrite w1{fd, 0, {iovec{a.data(), a.size()}}};
    LogWrite w2{fd, 100, {}};
    for (size_t i = 0; i < b.size(); ++i) w2.iov.push_back(iovec{&b[i], 1});  // 3 pieces: a chain of 4 on a ring of 8
    std::vector<LogWrite> ops = {w1, w2};
    std::vector<LogWriteResult> out(2);
    (*dev)->write_sync(ops, out);
    EXPECT_EQ(out[0].written, 100u);
    EXPECT_EQ(out[1].written, b.size());
    EXPECT_EQ(out[0].sync_err, 0);
    EXPECT_EQ(out[1].sync_err, 0);
    std::vector<char> back(100 + b.size());
    ASSERT_EQ(pread(fd, back.data(), back.size(), 0), static_cast<ssize_t>(back.size()));
    EXPECT_EQ(std::string(back.begin(), back.begin() + 100), std::string(100, 'a'));
    EXPECT_EQ(std::string(back.begin() + 100, back.end()), std::string(b.size(), 'b'));
    close(fd);
}
