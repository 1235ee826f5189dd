// The claim protocol (roles/claims.h, rules C1-C6) between two threads standing for
// a prefill worker and its decode partner over one Registry: what each side sees at
// each step, and the cases a restart, a death or a long pass make.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "roles/claims.h"
#include "roles/worker_stats.h"
#include "shm/doorbell.h"
#include "shm_test_util.h"
#include "time_scale.h"

namespace duet {
namespace {

using shm::ProcRef;
using shm::Registry;
using shm::Role;
constexpr uint64_t kMs = 1'000'000;
// How long a test's claim waits for an answer it expects: claim() returns as soon as
// it comes, so a long wait costs nothing but keeps a slow (sanitized, loaded)
// machine's late wake-up from failing the test.
constexpr uint64_t kAnswer = 10'000 * kMs;

using shm::testing::Mem;

// A registry with a running prefill and decode worker 0 (this process stands for both).
struct Pair {
    Pair() : mem(Registry::bytes(4)) {
        EXPECT_TRUE(Registry::init(mem.p, 4).ok());
        reg = *Registry::attach(mem.p);
        prefill = start(Role::Prefill);
        decode = start(Role::Decode);
        worker_stats(reg, decode.slot).load_items.store(1);  // decode holds a request: it must answer
    }
    ProcRef start(Role r) {
        auto ref = reg.claim(r, -1, getpid(), 0);
        EXPECT_TRUE(ref.ok());
        EXPECT_TRUE(reg.set_running(*ref));
        return *ref;
    }
    Mem mem;
    Registry reg;
    ProcRef prefill, decode;
};

// Decode's loop: yield_to_claim with `budget`, then a step of `step` (2 ms unless
// given; published as the worker's step_ns), while `run`.
struct DecodeLoop {
    DecodeLoop(Pair& p, uint64_t budget, uint64_t step = 2 * kMs) : p_(p), budget_(budget), step_(step), t_([this] {
        loop();
    }) {}
    ~DecodeLoop() { stop(); }
    void stop() {
        run = false;
        if (t_.joinable()) t_.join();
    }
    void loop() {
        while (run) {
            yield_to_claim(p_.reg, p_.decode.slot, 0, budget_, [&] { narrowed.fetch_add(1); });
            stepping = true;
            steps.fetch_add(1);
            worker_stats(p_.reg, p_.decode.slot).step_ns.store(step_);
            std::this_thread::sleep_for(std::chrono::nanoseconds(step_));
            stepping = false;
            std::this_thread::sleep_for(std::chrono::microseconds(100));
        }
    }
    Pair& p_;
    uint64_t budget_, step_;
    std::atomic<bool> run{true}, stepping{false};
    std::atomic<uint64_t> steps{0}, narrowed{0};
    std::thread t_;
};

uint64_t yields(Pair& p) { return worker_stats(p.reg, p.decode.slot).yields.load(); }

// C1-C4: a critical-led claim is answered between steps; decode computes nothing
// until it is withdrawn, then goes on.
TEST(Claims, DecodeStepsAsideForACriticalPassUntilItIsWithdrawn) {
    Pair p;
    DecodeLoop d(p, 0);  // no budget: a critical claim is answered anyway
    ASSERT_TRUE(shm::testing::wait_until([&] { return d.steps.load() >= 3; })) << "decode steps";
    CoreClaims c;
    ASSERT_TRUE(c.claim(p.reg, p.prefill.slot, 0, 0, kAnswer));
    EXPECT_TRUE(c.out());
    EXPECT_EQ(d.narrowed.load(), 1u) << "decode gave back borrowed cores before answering";
    EXPECT_EQ(worker_stats(p.reg, p.prefill.slot).borrows.load(), 1u);
    const uint64_t steps = d.steps.load();
    for (int i = 0; i < 50; ++i) {  // 50 ms of a pass: decode does not step
        EXPECT_FALSE(d.stepping.load());
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    EXPECT_EQ(d.steps.load(), steps);
    c.end(p.reg, p.prefill.slot, 0);
    EXPECT_FALSE(c.out());
    EXPECT_EQ(worker_stats(p.reg, p.prefill.slot).claim.load(), 0u);
    const uint64_t t1 = shm::monotonic_ns();
    while (d.steps.load() == steps && shm::monotonic_ns() - t1 < 1000 * kMs) std::this_thread::yield();
    EXPECT_GT(d.steps.load(), steps) << "decode went back to work when the claim was withdrawn";
    d.stop();
    EXPECT_EQ(yields(p), 1u);
    const uint64_t yielded = worker_stats(p.reg, p.decode.slot).yielded_ns.load();
    EXPECT_GE(yielded, 50 * kMs);
    EXPECT_LT(yielded, kYieldMaxNs);
}

// C2: under back-to-back claims (each made as soon as the last is withdrawn) decode
// still steps once between two answers: a call of yield_to_claim answers one claim.
TEST(Claims, DecodeStepsBetweenTwoClaims) {
    Pair p;
    std::atomic<bool> run{true};
    std::atomic<uint64_t> steps{0};
    std::vector<uint64_t> at_answer;  // decode's steps when it answered each claim
    std::thread decode([&] {
        while (run) {
            yield_to_claim(p.reg, p.decode.slot, 0, 0, [&] { at_answer.push_back(steps.load()); });
            steps.fetch_add(1);  // the step (instant: claims come back to back)
        }
    });
    CoreClaims c;
    for (int i = 0; i < 5; ++i) {
        ASSERT_TRUE(c.claim(p.reg, p.prefill.slot, 0, 0, kAnswer));
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
        c.end(p.reg, p.prefill.slot, 0);
    }
    run = false;
    decode.join();
    ASSERT_EQ(at_answer.size(), 5u);
    for (size_t i = 1; i < at_answer.size(); ++i) EXPECT_GT(at_answer[i], at_answer[i - 1]) << "claim " << i;
    EXPECT_EQ(yields(p), 5u);
}

// C6: a claim announcing a pass longer than decode's budget is declined at once
// (prefill does not wait kClaimWaitNs), and decode does not step aside.
TEST(Claims, APassLongerThanTheBudgetIsDeclined) {
    Pair p;
    DecodeLoop d(p, 10 * kMs);
    ASSERT_TRUE(shm::testing::wait_until([&] { return d.steps.load() >= 2; })) << "decode steps";
    CoreClaims c;
    const uint64_t t0 = shm::monotonic_ns();
    EXPECT_FALSE(c.claim(p.reg, p.prefill.slot, 0, 50 * kMs, kAnswer));
    EXPECT_LT(shm::monotonic_ns() - t0, kAnswer / 2) << "declined, not timed out";
    EXPECT_FALSE(c.out()) << "withdrawn";
    EXPECT_EQ(worker_stats(p.reg, p.decode.slot).claim_ack.load(), c.last_stamp() | kClaimDeclined);
    EXPECT_EQ(worker_stats(p.reg, p.prefill.slot).claims_declined.load(), 1u);
    EXPECT_EQ(worker_stats(p.reg, p.prefill.slot).claims_unanswered.load(), 0u);
    // One within the budget is answered.
    EXPECT_TRUE(c.claim(p.reg, p.prefill.slot, 0, 5 * kMs, kAnswer));
    c.end(p.reg, p.prefill.slot, 0);
    d.stop();
    EXPECT_EQ(yields(p), 1u);
    EXPECT_EQ(d.narrowed.load(), 1u);
}

// C4, C5: decode waits for a C6 claim no longer than yield_limit_ns of the pass it
// announced, then steps on while the claim stays out, answering it only once.
TEST(Claims, DecodeWaitsForAClaimedPassNoLongerThanItsLimit) {
    EXPECT_EQ(yield_limit_ns(0), kYieldMaxNs);
    EXPECT_EQ(yield_limit_ns(40 * kMs), 70 * kMs);  // 40 + 10 + 20
    EXPECT_EQ(yield_limit_ns(10'000 * kMs), kYieldMaxNs);
    Pair p;
    DecodeLoop d(p, 1000 * kMs);
    ASSERT_TRUE(shm::testing::wait_until([&] { return d.steps.load() >= 2; })) << "decode steps";
    CoreClaims c;
    ASSERT_TRUE(c.claim(p.reg, p.prefill.slot, 0, 40 * kMs, kAnswer));
    const uint64_t steps = d.steps.load(), t0 = shm::monotonic_ns();
    while (d.steps.load() < steps + 5 && shm::monotonic_ns() - t0 < 1900 * kMs) std::this_thread::yield();
    EXPECT_GE(d.steps.load(), steps + 5) << "decode stepped again with the claim still out";
    EXPECT_TRUE(c.out());
    d.stop();
    c.end(p.reg, p.prefill.slot, 0);
    EXPECT_EQ(yields(p), 1u) << "the claim was answered once";
    const uint64_t yielded = worker_stats(p.reg, p.decode.slot).yielded_ns.load();
    EXPECT_GE(yielded, 70 * kMs);
    EXPECT_LT(yielded, 1000 * kMs);
}

// C3: prefill waits for the answer of a partner whose steps are longer than
// kClaimWaitNs (a sanitized build on a loaded machine) a step and a half: a fixed
// wait would withdraw nearly every claim before decode ends its step.
TEST(Claims, PrefillWaitsAStepAndAHalfOfASlowPartner) {
    EXPECT_EQ(claim_wait_ns(0), kClaimWaitNs);
    EXPECT_EQ(claim_wait_ns(40 * kMs), kClaimWaitNs);  // 60 + 20 < 100
    EXPECT_EQ(claim_wait_ns(300 * kMs), 470 * kMs);
    EXPECT_EQ(claim_wait_ns(10'000 * kMs), kYieldMaxNs);
    Pair p;
    DecodeLoop d(p, 0, 500 * kMs);
    ASSERT_TRUE(shm::testing::wait_until([&] { return d.steps.load() >= 2; })) << "decode steps";  // step_ns published
    // Claimed at the start of a step: the answer comes about 500 ms later, past kClaimWaitNs.
    const uint64_t at = d.steps.load();
    ASSERT_TRUE(shm::testing::wait_until([&] { return d.steps.load() != at; })) << "decode steps";
    CoreClaims c;
    const uint64_t t0 = shm::monotonic_ns();
    ASSERT_TRUE(c.claim(p.reg, p.prefill.slot, 0, 0)) << "answered within claim_wait_ns of its step";
    EXPECT_GT(shm::monotonic_ns() - t0, kClaimWaitNs) << "the answer came after a fixed wait would have ended";
    c.end(p.reg, p.prefill.slot, 0);
    d.stop();
    EXPECT_EQ(yields(p), 1u);
    EXPECT_EQ(worker_stats(p.reg, p.prefill.slot).claims_unanswered.load(), 0u);
}

// C4: a claimer that dies while decode stands aside does not hold decode for
// kYieldMaxNs.
TEST(Claims, DecodeReturnsWhenTheClaimerDies) {
    Pair p;
    DecodeLoop d(p, 0);
    ASSERT_TRUE(shm::testing::wait_until([&] { return d.steps.load() >= 2; })) << "decode steps";
    CoreClaims c;
    ASSERT_TRUE(c.claim(p.reg, p.prefill.slot, 0, 0, kAnswer));
    const uint64_t steps = d.steps.load();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    ASSERT_TRUE(p.reg.mark_dead(p.prefill));  // its claim word stays set: nobody withdraws it
    const uint64_t t0 = shm::monotonic_ns();
    while (d.steps.load() == steps && shm::monotonic_ns() - t0 < kYieldMaxNs) std::this_thread::yield();
    // Below kYieldMaxNs (2 s), which the loop stops at: a decode that waited its whole
    // yield out fails here, also at the sanitizer runs' scale.
    EXPECT_LT(shm::monotonic_ns() - t0, std::min<uint64_t>(test_time::scaled_ns(500 * kMs), kYieldMaxNs / 2))
        << "decode saw the claimer gone";
    d.stop();
    EXPECT_EQ(yields(p), 1u);
}

// C5: a prefill worker restarted (a new process, in the same slot or another) never
// takes decode's answer to its predecessor's claim for one to its own: with decode
// not answering, its claim goes unanswered.
TEST(Claims, AnAnswerToADeadWorkersClaimDoesNotPassForANewOnes) {
    for (bool same_slot : {true, false}) {
        Pair p;
        CoreClaims old;
        bool answered = false;
        std::thread answer([&] {  // one answer, then decode computes (never answers again)
            answered = shm::testing::wait_until([&] { return yield_to_claim(p.reg, p.decode.slot, 0, 0, [] {}); });
        });
        ASSERT_TRUE(old.claim(p.reg, p.prefill.slot, 0, 0, kAnswer));
        ASSERT_TRUE(p.reg.mark_dead(p.prefill));  // killed mid-pass: the claim is never withdrawn
        answer.join();
        ASSERT_TRUE(answered) << "decode answered the claim";
        ASSERT_EQ(worker_stats(p.reg, p.decode.slot).claim_ack.load(), old.last_stamp());
        ProcRef again;
        if (same_slot) {
            ASSERT_TRUE(p.reg.reclaim(p.prefill));
            again = p.start(Role::Prefill);
            ASSERT_EQ(again.slot, p.prefill.slot);
        } else {
            again = p.start(Role::Prefill);
            ASSERT_NE(again.slot, p.prefill.slot);
        }
        CoreClaims fresh;  // a new process's: its stamps start over
        EXPECT_FALSE(fresh.claim(p.reg, again.slot, 0, 0, 30 * kMs)) << (same_slot ? "same slot" : "another slot");
        EXPECT_GT(fresh.last_stamp(), old.last_stamp());
        EXPECT_FALSE(fresh.out());
        EXPECT_EQ(worker_stats(p.reg, again.slot).claim.load(), 0u) << "withdrawn";
        EXPECT_EQ(worker_stats(p.reg, again.slot).claims_unanswered.load(), 1u);
    }
}

// C3: an idle partner (no request held) lends without answering; without a partner
// there is nothing to claim and nothing to step aside for.
TEST(Claims, AnIdlePartnerLendsAndNoPartnerNoClaim) {
    Pair p;
    worker_stats(p.reg, p.decode.slot).load_items.store(0);
    CoreClaims c;
    EXPECT_TRUE(c.claim(p.reg, p.prefill.slot, 0, 0)) << "idle: no answer needed";
    c.end(p.reg, p.prefill.slot, 0);
    EXPECT_FALSE(c.claim(p.reg, p.prefill.slot, 1, 0)) << "no decode worker 1";
    EXPECT_FALSE(c.out());
    EXPECT_FALSE(yield_to_claim(p.reg, p.decode.slot, 1, 0, [] {})) << "no prefill worker 1";
    EXPECT_EQ(worker_stats(p.reg, p.decode.slot).yield_budget_ns.load(), 0u);
    EXPECT_FALSE(yield_to_claim(p.reg, p.decode.slot, 0, 123, [] {})) << "no claim out";
    EXPECT_EQ(worker_stats(p.reg, p.decode.slot).yield_budget_ns.load(), 123u) << "the budget is published";
}

}  // namespace
}  // namespace duet
