// GPU tests (ctest label `gpu`): skipped, not passed, where no GPU is present.
#include <gtest/gtest.h>

#include "device.h"

TEST(Cuda, KernelLaunchesAndComputes) {
    if (duet::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device on this machine";
    std::string err;
    EXPECT_TRUE(duet::cuda::smoke_test(0, &err)) << err << " on " << duet::cuda::device_name(0);
}
