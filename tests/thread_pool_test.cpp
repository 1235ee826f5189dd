// ThreadPool: every thread runs, barriers separate phases, splits cover ranges.
#include "base/thread_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <set>
#include <thread>

using namespace duet;

TEST(ThreadPool, RunsEveryThreadOnceAndBarriersOrderPhases) {
    for (int n : {1, 2, 3, 5}) {
        ThreadPool pool(n);
        EXPECT_EQ(pool.size(), n);
        std::vector<int> phase1(n, 0), seen(n * n, -1);
        for (int rep = 0; rep < 200; ++rep) {
            pool.run([&](int tid, int nth) {
                ASSERT_EQ(nth, n);
                phase1[tid] = rep;
                pool.barrier();
                // After the barrier every thread sees every phase-1 write.
                for (int t = 0; t < nth; ++t) seen[tid * n + t] = phase1[t];
                pool.barrier();
            });
            for (int v : seen) ASSERT_EQ(v, rep);
        }
    }
}

// The width: a run uses the first width() threads and splits among them; the others
// skip it. Widths change from run to run (a lent core comes and goes), a thread
// that wakes late for a run it skips never runs the next one's work with the wrong
// width, and barriers count the width.
TEST(ThreadPool, TheWidthChangesBetweenRunsAndBarriersCountIt) {
    ThreadPool pool(4);
    std::vector<std::atomic<int>> ran(4);
    for (int rep = 0; rep < 3000; ++rep) {
        const int w = 1 + (rep * 7 + rep / 3) % 4;
        pool.set_width(w);
        ASSERT_EQ(pool.width(), w);
        std::vector<int> phase1(4, -1), seen(16, -1);
        std::atomic<int> calls{0};
        pool.run([&](int tid, int nth) {
            ASSERT_EQ(nth, w);
            ASSERT_LT(tid, w);
            calls.fetch_add(1, std::memory_order_relaxed);
            ran[static_cast<size_t>(tid)].fetch_add(1, std::memory_order_relaxed);
            phase1[static_cast<size_t>(tid)] = rep;
            pool.barrier();
            for (int t = 0; t < nth; ++t) seen[static_cast<size_t>(tid * 4 + t)] = phase1[static_cast<size_t>(t)];
            pool.barrier();
        });
        ASSERT_EQ(calls.load(), w) << "rep " << rep;
        for (int t = 0; t < w; ++t)
            for (int u = 0; u < w; ++u) ASSERT_EQ(seen[static_cast<size_t>(t * 4 + u)], rep);
    }
    for (auto& r : ran) EXPECT_GT(r.load(), 0);
    pool.set_width(0);
    EXPECT_EQ(pool.width(), 1);
    pool.set_width(9);
    EXPECT_EQ(pool.width(), 4);
}

TEST(ThreadPool, OversubscribedPoolStillCompletes) {
    // More threads than this machine has cores: spinning must give way.
    ThreadPool pool(8);
    std::atomic<int> sum{0};
    for (int rep = 0; rep < 50; ++rep) {
        pool.run([&](int tid, int) {
            for (int k = 0; k < 10; ++k) pool.barrier();
            sum.fetch_add(tid, std::memory_order_relaxed);
        });
    }
    EXPECT_EQ(sum.load(), 50 * (0 + 1 + 2 + 3 + 4 + 5 + 6 + 7));
}

// A waiter whose partner takes longer than its spins and yields (20 ms) sleeps on
// the atomic: a late barrier arrival and a late worker still wake it (a lost
// wake-up hangs here), and the phases stay ordered. (Its CPU time is not checked:
// on a loaded machine a yielding waiter uses little too, so such a check could not
// tell the two apart.)
TEST(ThreadPool, ALongWaitSleepsAndIsWoken) {
    ThreadPool pool(3);
    std::vector<int> phase1(3, 0), seen(9, -1);
    for (int rep = 1; rep <= 4; ++rep) {
        const int late = rep % 3;  // each thread late in turn (tid 0 too: run()'s wait)
        pool.run([&](int tid, int nth) {
            if (tid == late) std::this_thread::sleep_for(std::chrono::milliseconds(60));
            phase1[tid] = rep;
            pool.barrier();
            for (int t = 0; t < nth; ++t) seen[tid * 3 + t] = phase1[t];
            if (tid == (late + 1) % 3) std::this_thread::sleep_for(std::chrono::milliseconds(60));
        });
        for (int v : seen) ASSERT_EQ(v, rep);
    }
}

// progress(): one per run and one per barrier passed (not per thread arriving), at
// width 1 and wider (what a worker's watchdog thread reads to see a long pass move).
TEST(ThreadPool, ProgressCountsRunsAndBarriers) {
    ThreadPool pool(3);
    for (int w : {1, 3}) {
        pool.set_width(w);
        const uint64_t p0 = pool.progress();
        pool.run([&](int, int) {
            for (int i = 0; i < 5; ++i) pool.barrier();
        });
        EXPECT_EQ(pool.progress() - p0, 6u) << "width " << w;
    }
}

TEST(ThreadPool, SplitCoversTheRangeInAlignedParts) {
    for (int64_t n : {0, 1, 15, 16, 17, 576, 49152}) {
        for (int nth : {1, 2, 3, 7}) {
            int64_t covered = 0, prev_end = 0;
            for (int t = 0; t < nth; ++t) {
                int64_t b, e;
                ThreadPool::split(n, t, nth, b, e, 16);
                EXPECT_EQ(b, prev_end);
                EXPECT_LE(b, e);
                if (e < n) {
                    EXPECT_EQ(e % 16, 0);
                }
                covered += e - b;
                prev_end = e;
            }
            EXPECT_EQ(covered, n);
        }
    }
}

TEST(ThreadPool, ParsesCpuLists) {
    auto a = parse_cpu_list("0-3,6,8-9");
    ASSERT_TRUE(a.ok());
    EXPECT_EQ(*a, (std::vector<int>{0, 1, 2, 3, 6, 8, 9}));
    EXPECT_FALSE(parse_cpu_list("3-1").ok());
    EXPECT_FALSE(parse_cpu_list("x").ok());
    EXPECT_FALSE(parse_cpu_list("").ok());
    EXPECT_FALSE(parse_cpu_list("-5").ok());
}
