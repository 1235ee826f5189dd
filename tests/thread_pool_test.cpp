// ThreadPool: every thread runs, barriers separate phases, splits cover ranges.
#include "base/thread_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <set>

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
