// What the GPU suites share: whether this machine has a CUDA device (probed in a
// forked child, so the parent never makes a CUDA context), and running a test body
// in a child (CUDA state never leaks between tests; the child's gtest failures print
// there and make its exit code non-zero).
#pragma once

#include <gtest/gtest.h>

#include "kernels/cuda/device.h"
#include "require.h"
#include "shm_test_util.h"

namespace duet::testing {

// Where DUET_REQUIRE names gpu, no GPU fails the calling test (its skip follows a
// failure).
inline bool have_gpu() {
    static const int n = [] {
        pid_t pid = shm::testing::fork_run([] { return cuda::device_count() > 0 ? 0 : 1; });
        return shm::testing::wait_exit(pid) == 0 ? 1 : 0;
    }();
    if (n != 1 && test_require::required("gpu")) ADD_FAILURE() << "DUET_REQUIRE names gpu: no CUDA device here";
    return n == 1;
}

// Runs body in a child; the test fails when any expectation there failed.
template <typename F>
void in_child(F body) {
    pid_t pid = shm::testing::fork_run([&] {
        body();
        return ::testing::Test::HasFailure() ? 1 : 0;
    });
    EXPECT_EQ(shm::testing::wait_exit(pid), 0) << "see the child's failures above";
}

}  // namespace duet::testing
