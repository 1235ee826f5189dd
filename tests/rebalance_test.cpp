// Workers that change role (src/roles/rebalance.h): the rules R1-R3 and R5 of the
// pure policy, and the registry's LEAVING state that R4 stands on.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdlib>
#include <memory>
#include <vector>

#include "roles/rebalance.h"
#include "shm/registry.h"

using namespace duet;

namespace {

constexpr uint64_t kMs = 1'000'000ull;

// Samples every 50 ms over [from, to) ms: prefill and decode each with `running`
// workers, of which busy_p / busy_d are busy.
void feed(Rebalancer& r, uint64_t from_ms, uint64_t to_ms, RoleSample p, RoleSample d) {
    for (uint64_t t = from_ms; t < to_ms; t += 50) r.observe(t * kMs, p, d);
}

Rebalancer two_seconds() { return Rebalancer(RebalanceOptions{2000 * kMs, 0.9, 0.25}); }

// A registry of n slots in aligned heap memory (ProcSlot is cache-line aligned).
struct HeapRegistry {
    explicit HeapRegistry(uint32_t n)
        : mem(std::aligned_alloc(64, (shm::Registry::bytes(n) + 63) / 64 * 64), &std::free) {
        EXPECT_TRUE(shm::Registry::init(mem.get(), n).ok());
        auto r = shm::Registry::attach(mem.get());
        EXPECT_TRUE(r.ok());
        reg = *r;
    }
    std::unique_ptr<void, decltype(&std::free)> mem;
    shm::Registry reg;
};

}  // namespace

// R1: no decision before a whole window of evidence, however lopsided.
TEST(Rebalance, R1NothingMovesBeforeAWholeWindow) {
    Rebalancer r = two_seconds();
    feed(r, 0, 1950, {2, 0}, {1, 1});
    EXPECT_FALSE(r.decide()) << "1.95 s of samples in a 2 s window";
    feed(r, 1950, 2050, {2, 0}, {1, 1});
    ASSERT_TRUE(r.decide());
    EXPECT_EQ(*r.decide(), shm::Role::Prefill) << "decode busy, prefill idle: a prefill worker moves";
    EXPECT_DOUBLE_EQ(r.utilization(shm::Role::Decode), 1.0);
    EXPECT_DOUBLE_EQ(r.utilization(shm::Role::Prefill), 0.0);
}

// R2: both thresholds, both ways; and the window forgets what is older than it.
TEST(Rebalance, R2MovesOnlyBetweenABusyAndAnIdleRole) {
    {  // prefill busy, decode idle: a decode worker moves
        Rebalancer r = two_seconds();
        feed(r, 0, 3000, {1, 1}, {2, 0});
        ASSERT_TRUE(r.decide());
        EXPECT_EQ(*r.decide(), shm::Role::Decode);
    }
    {  // decode at 85% (under 0.9): nothing moves (hysteresis band)
        Rebalancer r = two_seconds();
        for (uint64_t t = 0; t < 3000; t += 50) r.observe(t * kMs, {2, 0}, {1, (t / 50) % 20 < 17 ? 1u : 0u});
        EXPECT_NEAR(r.utilization(shm::Role::Decode), 0.85, 0.03);
        EXPECT_FALSE(r.decide());
    }
    {  // decode busy but prefill at 50% of its workers busy (over 0.25): nothing moves
        Rebalancer r = two_seconds();
        feed(r, 0, 3000, {2, 1}, {1, 1});
        EXPECT_FALSE(r.decide());
    }
    {  // both busy: nothing moves
        Rebalancer r = two_seconds();
        feed(r, 0, 3000, {2, 2}, {2, 2});
        EXPECT_FALSE(r.decide());
    }
    {  // a burst longer ago than the window does not count
        Rebalancer r = two_seconds();
        feed(r, 0, 2000, {2, 2}, {1, 1});
        feed(r, 2000, 4200, {2, 0}, {1, 1});
        ASSERT_TRUE(r.decide()) << "prefill's busy seconds are older than the window";
        EXPECT_LE(r.utilization(shm::Role::Prefill), 0.25);
    }
}

// R3: a role's last running worker never leaves it.
TEST(Rebalance, R3TheLastWorkerOfARoleStays) {
    Rebalancer r = two_seconds();
    feed(r, 0, 3000, {1, 0}, {1, 1});
    EXPECT_FALSE(r.decide()) << "one prefill worker: it stays, however idle";
    feed(r, 3000, 6000, {1, 1}, {1, 0});
    EXPECT_FALSE(r.decide()) << "one decode worker: it stays";
}

// R5: after a change (reset), a whole new window before the next one.
TEST(Rebalance, R5AChangeStartsTheEvidenceAgain) {
    Rebalancer r = two_seconds();
    feed(r, 0, 3000, {2, 0}, {1, 1});
    ASSERT_TRUE(r.decide());
    r.reset();
    EXPECT_FALSE(r.decide());
    EXPECT_LT(r.utilization(shm::Role::Decode), 0) << "no samples";
    feed(r, 3000, 4900, {2, 0}, {1, 1});
    EXPECT_FALSE(r.decide()) << "1.9 s since the change";
    feed(r, 4900, 5100, {2, 0}, {1, 1});
    EXPECT_TRUE(r.decide());
}

// R4's ground: a LEAVING worker is alive (recovery and duplicate checks see it) but
// no router finds it (find_running, wake); it can come back (stay_after_all) or end.
TEST(Rebalance, LeavingWorkersAreAliveAndPassedOver) {
    HeapRegistry heap(8);
    shm::Registry* reg = &heap.reg;
    auto p0 = reg->claim(shm::Role::Prefill, -1, getpid(), 0);
    auto p1 = reg->claim(shm::Role::Prefill, -1, getpid(), 1);
    ASSERT_TRUE(p0.ok() && p1.ok());
    EXPECT_FALSE(reg->set_leaving(*p1)) << "only a RUNNING worker leaves";
    ASSERT_TRUE(reg->set_running(*p0) && reg->set_running(*p1));
    ASSERT_TRUE(reg->set_leaving(*p1));
    EXPECT_EQ(reg->state(p1->slot), shm::ProcState::Leaving);
    EXPECT_STREQ(shm::proc_state_name(shm::ProcState::Leaving), "leaving");
    EXPECT_TRUE(reg->alive(*p1));
    EXPECT_LT(reg->find_running(shm::Role::Prefill, 1), 0) << "routers pass it over";
    EXPECT_EQ(reg->find_working(shm::Role::Prefill, 1), static_cast<int32_t>(p1->slot)) << "/metrics: up";
    EXPECT_EQ(reg->find_running(shm::Role::Prefill), static_cast<int32_t>(p0->slot));
    EXPECT_FALSE(reg->set_running(*p1)) << "not STARTING";
    ASSERT_TRUE(reg->stay_after_all(*p1));
    EXPECT_EQ(reg->find_running(shm::Role::Prefill, 1), static_cast<int32_t>(p1->slot));
    EXPECT_FALSE(reg->stay_after_all(*p1)) << "RUNNING already";
    ASSERT_TRUE(reg->set_leaving(*p1));
    EXPECT_TRUE(reg->release(*p1)) << "a clean exit while leaving";
    EXPECT_FALSE(reg->alive(*p1));
    ASSERT_TRUE(reg->set_leaving(*p0));
    EXPECT_TRUE(reg->mark_dead(*p0)) << "a death while leaving: recovered as any";
}

// /metrics leaves out the indices the launcher assigned no worker (the spares).
TEST(Rebalance, AssignedIndicesAreTheLaunchersWord) {
    HeapRegistry heap(4);
    shm::Registry* reg = &heap.reg;
    EXPECT_TRUE(reg->assigned(shm::Role::Decode, 3)) << "never said: every index counts";
    reg->set_assigned(shm::Role::Decode, 0, true);
    reg->set_assigned(shm::Role::Prefill, 1, true);
    EXPECT_TRUE(reg->assigned(shm::Role::Decode, 0));
    EXPECT_FALSE(reg->assigned(shm::Role::Decode, 1));
    EXPECT_TRUE(reg->assigned(shm::Role::Prefill, 1));
    EXPECT_FALSE(reg->assigned(shm::Role::Prefill, 0)) << "each role its own word";
    reg->set_assigned(shm::Role::Decode, 1, true);
    reg->set_assigned(shm::Role::Decode, 0, false);
    EXPECT_FALSE(reg->assigned(shm::Role::Decode, 0));
    EXPECT_TRUE(reg->assigned(shm::Role::Decode, 1));
}

// R3-R5 for the worker that leaves, each sample until it goes.
TEST(Rebalance, ALeavingWorkerGoesOnlyWhenQuietAndNotTheLast) {
    const uint64_t t0 = 1000 * kMs;
    LeaveInputs in;
    in.now_ns = in.since_ns = t0;
    // R4: it holds work: wait, and the quiet time starts only when it holds none.
    in.holds_work = true;
    LeaveStep s = leave_step(in);
    EXPECT_EQ(s.action, LeaveAction::Wait);
    EXPECT_EQ(s.quiet_since_ns, 0u);
    in.holds_work = false;
    in.now_ns = t0 + 50 * kMs;
    s = leave_step(in);
    EXPECT_EQ(s.action, LeaveAction::Wait);
    EXPECT_EQ(s.quiet_since_ns, t0 + 50 * kMs);
    in.quiet_since_ns = s.quiet_since_ns;
    in.now_ns = t0 + 249 * kMs;
    EXPECT_EQ(leave_step(in).action, LeaveAction::Wait) << "199 ms quiet";
    in.now_ns = t0 + 250 * kMs;
    EXPECT_EQ(leave_step(in).action, LeaveAction::Retire) << "200 ms quiet";
    // Work again resets the quiet time.
    in.holds_work = true;
    s = leave_step(in);
    EXPECT_EQ(s.action, LeaveAction::Wait);
    EXPECT_EQ(s.quiet_since_ns, 0u);
    // Still working past the timeout: it stays.
    in.now_ns = t0 + Rebalancer::kLeaveTimeoutNs + 1;
    EXPECT_EQ(leave_step(in).action, LeaveAction::Stay);
    // R3 again: the role's other workers died meanwhile: it stays, however quiet.
    in = {};
    in.now_ns = t0 + 500 * kMs, in.since_ns = t0, in.quiet_since_ns = t0;
    ASSERT_EQ(leave_step(in).action, LeaveAction::Retire);
    in.others_running = false;
    EXPECT_EQ(leave_step(in).action, LeaveAction::Stay);
    // A drain: it stays.
    in.others_running = true;
    in.draining = true;
    EXPECT_EQ(leave_step(in).action, LeaveAction::Stay);
    // It died (no longer LEAVING): the change is dropped, whatever else holds.
    in.still_leaving = false;
    EXPECT_EQ(leave_step(in).action, LeaveAction::Drop);
}
