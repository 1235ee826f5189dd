// GPU tests (ctest label `gpu`): skipped, not passed, where no GPU is present.
#include <cuda_runtime.h>
#include <signal.h>

#include <cstdio>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "device.h"
#include "shm/fd_keeper.h"
#include "shm_test_util.h"
#include "vmm.h"

bool have_gpu();

TEST(Cuda, KernelLaunchesAndComputes) {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device on this machine";
    std::string err;
    EXPECT_TRUE(duet::cuda::smoke_test(0, &err)) << err << " on " << duet::cuda::device_name(0);
}

// Without a GPU every test here is skipped. The probe runs in a child: a process that
// has initialized CUDA cannot hand it to children it forks later.
bool have_gpu() {
    static const int n = [] {
        pid_t pid = duet::shm::testing::fork_run([] { return duet::cuda::device_count() > 0 ? 0 : 1; });
        return duet::shm::testing::wait_exit(pid) == 0 ? 1 : 0;
    }();
    return n == 1;
}

// Two (three) processes on one GPU share device memory through the fd keeper: the
// creator writes a pattern and is killed; a second process maps the allocation,
// finds the pattern and writes another; a third finds that one. The memory lives on
// while anybody holds it (the keeper's fd).
TEST(CudaVmm, ProcessesShareAnAllocationThatOutlivesItsCreator) {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device on this machine";
    using namespace duet::shm::testing;
    const std::string inst = unique_name("vmm");
    auto keeper = duet::shm::FdKeeper::start(inst);
    ASSERT_TRUE(keeper.ok()) << keeper.error().message;
    constexpr size_t kWant = 48u << 20;
    auto check = [&](uint8_t expect, uint8_t write) {
        auto kept = duet::shm::fd_get(inst, "kv.0");
        if (!kept.ok()) return 10;
        const size_t bytes = std::stoull(kept->meta);
        duet::cuda::SharedMapping m;
        std::string err;
        if (!duet::cuda::vmm_map(kept->fd, bytes, 0, {}, &m, &err)) {
            std::fprintf(stderr, "%s\n", err.c_str());
            return 11;
        }
        std::vector<uint8_t> h(bytes);
        if (cudaMemcpy(h.data(), m.ptr, bytes, cudaMemcpyDeviceToHost) != cudaSuccess) return 12;
        for (size_t i = 0; i < bytes; i += 997)
            if (h[i] != expect) return 13;
        if (cudaMemset(m.ptr, write, bytes) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess) return 14;
        duet::cuda::vmm_unmap(m);
        return 0;
    };
    pid_t creator = fork_run([&] {
        duet::cuda::SharedAllocation a;
        std::string err;
        if (!duet::cuda::vmm_create(0, kWant, &a, &err)) {
            std::fprintf(stderr, "%s\n", err.c_str());
            return 2;
        }
        duet::cuda::SharedMapping m;
        if (!duet::cuda::vmm_map(a.fd, a.bytes, 0, {}, &m, &err)) return 3;
        if (cudaMemset(m.ptr, 0x3c, a.bytes) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess) return 4;
        if (!duet::shm::fd_put(inst, "kv.0", a.fd, std::to_string(a.bytes)).ok()) return 5;
        raise(SIGKILL);
        return 6;
    });
    EXPECT_EQ(wait_exit(creator), 128 + SIGKILL);
    pid_t second = fork_run([&] { return check(0x3c, 0xa5); });
    EXPECT_EQ(wait_exit(second), 0);
    pid_t third = fork_run([&] { return check(0xa5, 0); });
    EXPECT_EQ(wait_exit(third), 0);
}
