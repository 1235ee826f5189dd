// GPU tests (ctest label `gpu`): skipped, not passed, where no GPU is present.
#include <cuda_runtime.h>
#include <signal.h>

#include <algorithm>
#include <functional>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/cuda/attention.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cpu/kernels.h"
#include "kv/kv_pool.h"
#include "model/gpu_plan.h"
#include "model/sampler.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/qgemv.h"
#include "kernels/cuda/sample.h"
#include "cuda/sample_inputs.h"
#include "cuda/cuda_kv_io.h"
#include "shm/fd_keeper.h"
#include "shm_test_util.h"
#include "kernels/cuda/vmm.h"

bool have_gpu();

TEST(Cuda, KernelLaunchesAndComputes) {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device on this machine";
    // In a child, like every CUDA use before the fork()s of the test below, so the
    // binary can also be run directly (ctest runs each test in a process of its own).
    pid_t pid = duet::shm::testing::fork_run([] {
        std::string err;
        if (duet::cuda::smoke_test(0, &err)) return 0;
        std::fprintf(stderr, "%s on %s\n", err.c_str(), duet::cuda::device_name(0).c_str());
        return 1;
    });
    EXPECT_EQ(duet::shm::testing::wait_exit(pid), 0);
}

// Without a GPU every test here is skipped. The probe runs in a child: a process that
// has initialized CUDA cannot hand it to children it forks later.
bool have_gpu() {
    static const int n = [] {
        pid_t pid = duet::shm::testing::fork_run([] {
            if (duet::cuda::device_count() > 0) return 0;
            int n = 0;
            const cudaError_t e = cudaGetDeviceCount(&n);  // why not (an old driver, say), for the log
            std::fprintf(stderr, "CUDA: no usable device (%s)\n", cudaGetErrorString(e));
            return 1;
        });
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

// The per-token kernels against the CPU's scalar kernels on random inputs and
// ragged shapes. (ctest runs each test in a process of its own, so this process's
// CUDA context never meets the fork()s of the test above.)
namespace {

template <typename T>
struct DeviceBuf {
    T* p = nullptr;
    explicit DeviceBuf(const std::vector<T>& h) {
        cudaMalloc(&p, std::max<size_t>(1, h.size()) * sizeof(T));
        cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice);
    }
    ~DeviceBuf() { cudaFree(p); }
    std::vector<T> get(size_t n) const {
        std::vector<T> h(n);
        cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost);
        return h;
    }
};

std::vector<float> randoms(size_t n, uint32_t seed, float scale = 1.0f) {
    std::mt19937 g(seed);
    std::normal_distribution<float> d(0.0f, scale);
    std::vector<float> v(n);
    for (float& x : v) x = d(g);
    return v;
}

// Attention in float64, the reference of the kernels: out[i][h][:] = softmax(scale *
// q[i][h] . K) V over the first visible[i] tokens of query i's sequence, where
// at(i, hkv, p, is_v, d) is value d of K (or V) of its token p in KV head hkv; query
// head h reads KV head h / group. q and out: [n_query][n_head][head_dim].
template <class At>
std::vector<float> reference_attention(const std::vector<float>& q, int n_query, int n_head, int group, int head_dim,
                                       float scale, const std::vector<int32_t>& visible, At at) {
    std::vector<float> out(q.size());
    for (int i = 0; i < n_query; ++i)
        for (int h = 0; h < n_head; ++h) {
            const int hkv = h / group;
            const float* qi = &q[(static_cast<size_t>(i) * n_head + h) * head_dim];
            std::vector<double> sc(static_cast<size_t>(visible[i]));
            double mx = -1e300, sum = 0;
            for (int p = 0; p < visible[i]; ++p) {
                double dot = 0;
                for (int d = 0; d < head_dim; ++d) dot += qi[d] * at(i, hkv, p, false, d);
                mx = std::max(mx, sc[p] = dot * scale);
            }
            for (double& x : sc) sum += (x = std::exp(x - mx));
            for (int d = 0; d < head_dim; ++d) {
                double o = 0;
                for (int p = 0; p < visible[i]; ++p) o += sc[p] * at(i, hkv, p, true, d);
                out[(static_cast<size_t>(i) * n_head + h) * head_dim + d] = static_cast<float>(o / sum);
            }
        }
    return out;
}

void expect_close(const std::vector<float>& got, const std::vector<float>& want, float rel, float abs, const char* what) {
    ASSERT_EQ(got.size(), want.size());
    size_t bad = 0;
    for (size_t i = 0; i < got.size(); ++i)
        if (!(std::fabs(got[i] - want[i]) <= abs + rel * std::fabs(want[i])) && bad++ < 5)
            ADD_FAILURE() << what << "[" << i << "] = " << got[i] << ", CPU " << want[i];
    EXPECT_EQ(bad, 0u) << what;
}

}  // namespace

TEST(CudaOps, RmsNormSwigluEmbedRopeArgmaxMatchTheCpu) {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device on this machine";
    namespace cpu = duet::cpu;
    // RMSNorm: ragged row counts and widths, including one that is not a multiple of 32.
    for (auto [rows, n] : {std::pair{1, 576}, std::pair{7, 1536}, std::pair{3, 100}}) {
        auto x = randoms(static_cast<size_t>(rows) * n, 1 + rows, 3.0f), w = randoms(static_cast<size_t>(n), 2);
        std::vector<float> want(x.size());
        for (int r = 0; r < rows; ++r) cpu::rms_norm(cpu::Isa::Scalar, &x[r * n], w.data(), &want[r * n], n, 1e-5f);
        DeviceBuf<float> dx(x), dw(w), dy(std::vector<float>(x.size()));
        ASSERT_EQ(duet::cuda::rms_norm(dx.p, dw.p, dy.p, rows, n, 1e-5f, nullptr), cudaSuccess);
        expect_close(dy.get(x.size()), want, 1e-6f, 1e-6f, "rms_norm");
    }
    // SwiGLU.
    {
        auto g = randoms(10007, 3, 4.0f), u = randoms(10007, 4);
        std::vector<float> want(g.size());
        cpu::swiglu(cpu::Isa::Scalar, g.data(), u.data(), want.data(), static_cast<int64_t>(g.size()));
        DeviceBuf<float> dg(g), du(u), dout(std::vector<float>(g.size()));
        ASSERT_EQ(duet::cuda::swiglu(dg.p, du.p, dout.p, static_cast<int64_t>(g.size()), nullptr), cudaSuccess);
        expect_close(dout.get(g.size()), want, 2e-6f, 1e-7f, "swiglu");
    }
    // Embedding rows from a bf16 table, ids repeated and out of order.
    {
        const int vocab = 50, dim = 72;
        auto t = randoms(static_cast<size_t>(vocab) * dim, 5);
        std::vector<uint16_t> tb(t.size());
        for (size_t i = 0; i < t.size(); ++i) tb[i] = cpu::fp32_to_bf16(t[i]);
        const std::vector<int32_t> ids = {7, 0, 49, 7, 13};
        std::vector<float> want;
        for (int32_t id : ids)
            for (int i = 0; i < dim; ++i) want.push_back(cpu::bf16_to_fp32(tb[static_cast<size_t>(id) * dim + i]));
        DeviceBuf<uint16_t> dt(tb);
        DeviceBuf<int32_t> di(ids);
        DeviceBuf<float> dout(std::vector<float>(want.size()));
        ASSERT_EQ(duet::cuda::embed_bf16(dt.p, di.p, static_cast<int>(ids.size()), dim, dout.p, nullptr), cudaSuccess);
        expect_close(dout.get(want.size()), want, 0.0f, 0.0f, "embed_bf16");
    }
    // RoPE, both pairings, partial rotary, positions up to 8191 (angles reduced in double).
    for (bool neox : {false, true}) {
        const int n_tok = 5, n_heads = 3, head_dim = 64, rot_dim = 48;
        const std::vector<int32_t> pos = {0, 1, 17, 4000, 8191};
        std::vector<float> inv(rot_dim / 2);
        for (int i = 0; i < rot_dim / 2; ++i) inv[i] = std::pow(10000.0f, -2.0f * i / rot_dim);
        auto x = randoms(static_cast<size_t>(n_tok) * n_heads * head_dim, 6);
        std::vector<float> want = x;
        for (int t = 0; t < n_tok; ++t) {
            float* row = &want[static_cast<size_t>(t) * n_heads * head_dim];
            if (neox)
                cpu::rope_neox(cpu::Isa::Scalar, row, n_heads, head_dim, rot_dim, pos[t], inv.data());
            else
                cpu::rope(cpu::Isa::Scalar, row, n_heads, head_dim, rot_dim, pos[t], inv.data());
        }
        DeviceBuf<float> dx(x), dinv(inv);
        DeviceBuf<int32_t> dpos(pos);
        ASSERT_EQ(duet::cuda::rope(dx.p, n_tok, n_heads, head_dim, rot_dim, dpos.p, dinv.p, neox, nullptr), cudaSuccess);
        expect_close(dx.get(x.size()), want, 1e-5f, 1e-5f, neox ? "rope_neox" : "rope");
    }
    // Greedy picks: the CPU sampler's (lowest index among equal maxima), rows of the
    // model's vocabulary size, ties planted across threads' strides.
    {
        const int rows = 6;
        const int64_t vocab = 49152;
        auto l = randoms(static_cast<size_t>(rows) * vocab, 31, 2.0f);
        l[1 * vocab + 40000] = l[1 * vocab + 7] = 50.0f;     // tie: 7 wins
        l[2 * vocab + 255] = l[2 * vocab + 256] = 60.0f;    // adjacent threads: 255 wins
        l[3 * vocab + vocab - 1] = 70.0f;                   // the last entry
        l[4 * vocab + 0] = 80.0f;                           // the first entry
        for (int64_t i = 0; i < vocab; ++i) l[5 * vocab + i] = -1.0f;  // all equal: 0
        std::vector<int32_t> want(rows);
        duet::Sampler sampler;
        duet::SamplingParams greedy;
        greedy.temperature = 0.0f;
        for (int r = 0; r < rows; ++r) want[r] = sampler.sample(&l[r * vocab], vocab, greedy, {}, {}, 0);
        EXPECT_EQ(want[1], 7);
        EXPECT_EQ(want[2], 255);
        DeviceBuf<float> dl(l);
        DeviceBuf<int32_t> dout(std::vector<int32_t>(static_cast<size_t>(rows), 0));
        ASSERT_EQ(duet::cuda::argmax_rows(dl.p, rows, vocab, dout.p, nullptr), cudaSuccess);
        EXPECT_EQ(dout.get(rows), want);
    }
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// Paged decode attention against a float64 reference on the CPU: GQA (9 query heads
// on 3 KV heads, as SmolLM2), shuffled block tables, ragged lengths from 1 token to
// several split chunks, both head sizes; f16 KV in the arena's layer-plane layout.
// Byte runs copied by one launch (copy_runs) or by queue_runs, which splits a long
// list of small aligned runs into launches and otherwise (odd alignment, pageable
// memory) copies run by run: every run lands as a memcpy of it would, and bytes
// outside the runs are untouched. A 3 MiB run fills the grid's 64 rows and loops.
TEST(CudaOps, CopyRunsMoveEachRunAsAMemcpy) {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device on this machine";
    const size_t n = size_t{8} << 20;
    std::mt19937 g(17);
    std::vector<uint8_t> src_h(n), dst0(n);
    for (auto& b : src_h) b = static_cast<uint8_t>(g());
    for (auto& b : dst0) b = static_cast<uint8_t>(g());
    // Runs with disjoint destinations: 400 slots of 16 KiB, each run within its slot;
    // sources anywhere. `aligned`: 16-byte multiples, some of 12 KiB, one empty;
    // `mixed`: every third one at odd offsets and lengths.
    auto make = [&](bool odd) {
        std::vector<duet::CopyRun> runs;
        for (int i = 0; i < 400; ++i) {
            const bool al = !odd || i % 3 != 0;
            const uint64_t len = i == 5 ? 0 : !al ? 1 + g() % 2000 : i % 50 == 7 ? 12288 : 16 * (1 + g() % 128);
            const uint64_t dst = static_cast<uint64_t>(i) * 16384 + (al ? 0 : g() % 40);
            const uint64_t src = al ? 16 * (g() % ((n - len) / 16)) : g() % (n - len);
            runs.push_back({src, dst, len});
        }
        return runs;
    };
    auto expect = [&](const std::vector<duet::CopyRun>& runs) {
        std::vector<uint8_t> w = dst0;
        for (const auto& r : runs)
            std::copy_n(src_h.begin() + static_cast<ptrdiff_t>(r.src), r.bytes, w.begin() + static_cast<ptrdiff_t>(r.dst));
        return w;
    };
    const auto aligned = make(false), mixed = make(true);
    const auto want = expect(aligned), want_mixed = expect(mixed);
    DeviceBuf<uint8_t> dsrc(src_h);
    uint8_t* pinned = nullptr;
    ASSERT_EQ(cudaMallocHost(reinterpret_cast<void**>(&pinned), n), cudaSuccess);
    // One launch of kMax runs, device to device: kMax - 1 of the mixed list (odd ones
    // take the byte loop) and one of 3 MiB into the buffer's last 4 MiB.
    {
        DeviceBuf<uint8_t> ddst(dst0);
        std::vector<duet::CopyRun> runs(mixed.begin(), mixed.begin() + duet::cuda::ByteRuns::kMax - 1);
        runs.push_back({16 * 4097, n - (size_t{4} << 20), size_t{3} << 20});
        duet::cuda::ByteRuns b;
        b.n = static_cast<int>(runs.size());
        for (int i = 0; i < b.n; ++i) {
            b.src_off[i] = runs[static_cast<size_t>(i)].src;
            b.dst_off[i] = runs[static_cast<size_t>(i)].dst;
            b.bytes[i] = runs[static_cast<size_t>(i)].bytes;
        }
        ASSERT_EQ(duet::cuda::copy_runs(ddst.p, dsrc.p, b, nullptr), cudaSuccess);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        EXPECT_TRUE(ddst.get(n) == expect(runs)) << "copy_runs, device to device";
        b.n = duet::cuda::ByteRuns::kMax + 1;
        EXPECT_NE(duet::cuda::copy_runs(ddst.p, dsrc.p, b, nullptr), cudaSuccess) << "more runs than a launch holds";
        cudaGetLastError();
    }
    // queue_runs: the aligned list (400 runs: three launches) into device memory,
    // into page-locked memory and back from it; the mixed list and pageable memory
    // run by run.
    {
        bool kernel = false;
        DeviceBuf<uint8_t> ddst(dst0);
        ASSERT_TRUE(duet::queue_runs(ddst.p, dsrc.p, aligned, nullptr, &kernel).ok());
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        EXPECT_TRUE(kernel) << "small aligned runs between device buffers go by launches";
        EXPECT_TRUE(ddst.get(n) == want) << "queue_runs, device to device";
        std::copy(dst0.begin(), dst0.end(), pinned);
        ASSERT_TRUE(duet::queue_runs(pinned, dsrc.p, aligned, nullptr, &kernel).ok());
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        EXPECT_TRUE(kernel) << "page-locked memory is reached by the kernel";
        EXPECT_TRUE(std::equal(want.begin(), want.end(), pinned)) << "queue_runs, device to page-locked host";
        std::copy(src_h.begin(), src_h.end(), pinned);
        DeviceBuf<uint8_t> back(dst0);
        ASSERT_TRUE(duet::queue_runs(back.p, pinned, aligned, nullptr, &kernel).ok());
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        EXPECT_TRUE(kernel);
        EXPECT_TRUE(back.get(n) == want) << "queue_runs, page-locked host to device";
        DeviceBuf<uint8_t> odd(dst0);
        ASSERT_TRUE(duet::queue_runs(odd.p, dsrc.p, mixed, nullptr, &kernel).ok());
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        EXPECT_FALSE(kernel) << "runs at odd offsets go one by one";
        EXPECT_TRUE(odd.get(n) == want_mixed) << "queue_runs, odd runs";
        std::vector<uint8_t> pageable = dst0;
        ASSERT_TRUE(duet::queue_runs(pageable.data(), dsrc.p, aligned, nullptr, &kernel).ok());
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        EXPECT_FALSE(kernel) << "pageable memory is not reached by a kernel";
        EXPECT_TRUE(pageable == want) << "queue_runs, device to pageable host";
    }
    cudaFreeHost(pinned);
}

TEST(CudaAttention, PagedDecodeMatchesTheReference) {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device on this machine";
    namespace cpu = duet::cpu;
    for (int head_dim : {64, 128}) {
        duet::cuda::PagedKv kv;
        kv.n_head = 9;
        kv.n_head_kv = 3;
        kv.head_dim = head_dim;
        kv.block_tokens = 16;
        kv.n_blocks = 300;
        const int n_layer = 2;
        kv.layer = 1;
        const std::vector<int32_t> lens = {1, 17, 700, 1300};
        const int n_seq = static_cast<int>(lens.size()), max_len = 1300, max_blocks = (max_len + 15) / 16;
        const size_t tile = 2ull * kv.n_head_kv * kv.block_tokens * head_dim;
        auto vals = randoms(tile * kv.n_blocks * n_layer, 11 + head_dim);
        std::vector<uint16_t> data(vals.size());
        for (size_t i = 0; i < vals.size(); ++i) data[i] = cpu::fp32_to_fp16(vals[i]);
        // Every sequence's blocks distinct, in shuffled order.
        std::vector<int32_t> ids(kv.n_blocks);
        for (int i = 0; i < kv.n_blocks; ++i) ids[i] = i;
        std::shuffle(ids.begin(), ids.end(), std::mt19937(3));
        std::vector<int32_t> tables(static_cast<size_t>(n_seq) * max_blocks, -1);
        size_t next = 0;
        for (int s = 0; s < n_seq; ++s)
            for (int b = 0; b < (lens[s] + 15) / 16; ++b) tables[static_cast<size_t>(s) * max_blocks + b] = ids[next++];
        ASSERT_LE(next, ids.size());
        auto q = randoms(static_cast<size_t>(n_seq) * kv.n_head * head_dim, 12);
        const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
        const std::vector<float> want = reference_attention(
            q, n_seq, kv.n_head, kv.n_head / kv.n_head_kv, head_dim, scale, lens, [&](int s, int hkv, int t, bool v, int d) {
                const int32_t blk = tables[static_cast<size_t>(s) * max_blocks + t / 16];
                const size_t off = (static_cast<size_t>(kv.layer) * kv.n_blocks + blk) * tile + (v ? tile / 2 : 0) +
                                   (static_cast<size_t>(hkv) * 16 + t % 16) * head_dim + d;
                return static_cast<double>(cpu::fp16_to_fp32(data[off]));
            });
        DeviceBuf<uint16_t> dkv(data);
        DeviceBuf<int32_t> dtab(tables), dlen(lens);
        DeviceBuf<float> dq(q), dout(std::vector<float>(q.size()));
        DeviceBuf<uint8_t> ws(std::vector<uint8_t>(duet::cuda::paged_attention_workspace_bytes(kv, n_seq, max_len)));
        kv.data = dkv.p;
        ASSERT_EQ(duet::cuda::paged_attention(dq.p, kv, dtab.p, max_blocks, nullptr, dlen.p, n_seq, max_len, scale,
                                              dout.p, ws.p, nullptr),
                  cudaSuccess);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        expect_close(dout.get(q.size()), want, 1e-4f, 1e-5f, head_dim == 64 ? "attention hd64" : "attention hd128");
    }
    duet::cuda::PagedKv odd;
    odd.n_head = 4;
    odd.n_head_kv = 2;
    odd.head_dim = 96;
    EXPECT_EQ(duet::cuda::paged_attention(nullptr, odd, nullptr, 1, nullptr, nullptr, 1, 1, 1.0f, nullptr, nullptr, nullptr),
              cudaErrorInvalidValue);
}

// The fused kernels give exactly the bits of the kernels they replace: norm + bf16,
// residual add + norm + bf16, SwiGLU + bf16, RoPE on q and k + q's f16 rounding + KV
// append (normal and neox pairing, a padding row).
TEST(CudaOps, FusedKernelsGiveTheUnfusedBits) {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device on this machine";
    namespace cu = duet::cuda;
    const int rows = 5, n = 576;
    auto x = randoms(static_cast<size_t>(rows) * n, 61, 3.0f), a = randoms(x.size(), 62), w = randoms(n, 63);
    {
        DeviceBuf<float> dx(x), dw(w), dy(std::vector<float>(x.size()));
        DeviceBuf<uint16_t> want(std::vector<uint16_t>(x.size())), got(std::vector<uint16_t>(x.size()));
        ASSERT_EQ(cu::rms_norm(dx.p, dw.p, dy.p, rows, n, 1e-5f, nullptr), cudaSuccess);
        ASSERT_EQ(cu::f32_to_bf16(dy.p, want.p, static_cast<int64_t>(x.size()), nullptr), cudaSuccess);
        ASSERT_EQ(cu::rms_norm_bf16(dx.p, dw.p, got.p, rows, n, 1e-5f, nullptr), cudaSuccess);
        EXPECT_EQ(got.get(x.size()), want.get(x.size())) << "rms_norm_bf16";
    }
    {
        DeviceBuf<float> dx1(x), dx2(x), da(a), dw(w), dy(std::vector<float>(x.size()));
        DeviceBuf<uint16_t> want(std::vector<uint16_t>(x.size())), got(std::vector<uint16_t>(x.size()));
        ASSERT_EQ(cu::add(dx1.p, da.p, static_cast<int64_t>(x.size()), nullptr), cudaSuccess);
        ASSERT_EQ(cu::rms_norm(dx1.p, dw.p, dy.p, rows, n, 1e-5f, nullptr), cudaSuccess);
        ASSERT_EQ(cu::f32_to_bf16(dy.p, want.p, static_cast<int64_t>(x.size()), nullptr), cudaSuccess);
        ASSERT_EQ(cu::add_rms_norm_bf16(dx2.p, da.p, dw.p, got.p, rows, n, 1e-5f, nullptr), cudaSuccess);
        EXPECT_EQ(got.get(x.size()), want.get(x.size())) << "add_rms_norm_bf16";
        EXPECT_EQ(dx2.get(x.size()), dx1.get(x.size())) << "the residual sum";
    }
    {
        auto g = randoms(10007, 64, 4.0f), u = randoms(10007, 65);
        DeviceBuf<float> dg(g), du(u), dh(std::vector<float>(g.size()));
        DeviceBuf<uint16_t> want(std::vector<uint16_t>(g.size())), got(std::vector<uint16_t>(g.size()));
        ASSERT_EQ(cu::swiglu(dg.p, du.p, dh.p, static_cast<int64_t>(g.size()), nullptr), cudaSuccess);
        ASSERT_EQ(cu::f32_to_bf16(dh.p, want.p, static_cast<int64_t>(g.size()), nullptr), cudaSuccess);
        ASSERT_EQ(cu::swiglu_bf16(dg.p, du.p, got.p, static_cast<int64_t>(g.size()), nullptr), cudaSuccess);
        EXPECT_EQ(got.get(g.size()), want.get(g.size())) << "swiglu_bf16";
    }
    for (bool neox : {false, true}) {
        cu::PagedKv kv;
        kv.n_head = 9;
        kv.n_head_kv = 3;
        kv.head_dim = 64;
        kv.block_tokens = 16;
        kv.n_blocks = 8;
        kv.layer = 1;
        const int n_tok = 4, Q = kv.n_head * kv.head_dim, KV = kv.n_head_kv * kv.head_dim, rot = 48;
        auto q = randoms(static_cast<size_t>(n_tok) * Q, 66), k = randoms(static_cast<size_t>(n_tok) * KV, 67),
             v = randoms(static_cast<size_t>(n_tok) * KV, 68), inv = randoms(rot / 2, 69, 0.1f);
        const std::vector<int32_t> pos = {0, 17, 4095, 100000}, tb = {3, 5, -1, 0}, to = {0, 15, 2, 9};
        const size_t arena = 2ull * kv.n_head_kv * kv.block_tokens * kv.head_dim * kv.n_blocks * 2;  // two layers
        DeviceBuf<float> q1(q), q2(q), k1(k), k2(k), dv(v), dinv(inv);
        DeviceBuf<int32_t> dpos(pos), dtb(tb), dto(to);
        DeviceBuf<uint16_t> a1{std::vector<uint16_t>(arena)}, a2{std::vector<uint16_t>(arena)};
        kv.data = a1.p;
        ASSERT_EQ(cu::rope(q1.p, n_tok, kv.n_head, kv.head_dim, rot, dpos.p, dinv.p, neox, nullptr), cudaSuccess);
        ASSERT_EQ(cu::rope(k1.p, n_tok, kv.n_head_kv, kv.head_dim, rot, dpos.p, dinv.p, neox, nullptr), cudaSuccess);
        ASSERT_EQ(cu::round_f16(q1.p, static_cast<int64_t>(q.size()), nullptr), cudaSuccess);
        ASSERT_EQ(cu::kv_append(k1.p, dv.p, n_tok, dtb.p, dto.p, kv, nullptr), cudaSuccess);
        kv.data = a2.p;
        ASSERT_EQ(cu::qk_rope_kv_append(q2.p, k2.p, dv.p, n_tok, dpos.p, dinv.p, rot, neox, dtb.p, dto.p, kv, nullptr),
                  cudaSuccess);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        EXPECT_EQ(q2.get(q.size()), q1.get(q.size())) << "q, neox " << neox;
        EXPECT_EQ(k2.get(k.size()), k1.get(k.size())) << "k, neox " << neox;
        EXPECT_EQ(a2.get(arena), a1.get(arena)) << "the arena, neox " << neox;
    }
}

// A prefill chunk of two sequences packed in one batch: K/V of the chunk appended to
// the arena (f16, round to nearest even, as the CPU's fp32_to_fp16), then each query
// token attends causally to its sequence's earlier tokens (already in the arena)
// and the chunk's tokens up to itself. Against a float64 reference.
TEST(CudaAttention, PrefillChunksAppendKvAndAttendCausally) {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device on this machine";
    namespace cpu = duet::cpu;
    duet::cuda::PagedKv kv;
    kv.n_head = 9;
    kv.n_head_kv = 3;
    kv.head_dim = 64;
    kv.block_tokens = 16;
    kv.n_blocks = 64;
    kv.layer = 0;
    const size_t tile = 2ull * kv.n_head_kv * kv.block_tokens * kv.head_dim;
    const int row = kv.n_head_kv * kv.head_dim;
    // Sequence 0: 40 tokens already there, a chunk of 30; sequence 1: 0 there, 21 new.
    const std::vector<int> past = {40, 0}, chunk = {30, 21};
    const int max_blocks = 8;
    std::vector<int32_t> tables = {5, 9, 2, 33, 7, 1, 60, 61, 12, 40, 3, 0, 0, 0, 0, 0};
    auto vals = randoms(tile * kv.n_blocks, 21);
    std::vector<uint16_t> data(vals.size());
    for (size_t i = 0; i < vals.size(); ++i) data[i] = cpu::fp32_to_fp16(vals[i]);
    std::vector<int32_t> qseq, visible, tblock, toff;
    for (int s = 0; s < 2; ++s)
        for (int i = 0; i < chunk[s]; ++i) {
            const int pos = past[s] + i;
            qseq.push_back(s);
            visible.push_back(pos + 1);
            tblock.push_back(tables[static_cast<size_t>(s) * max_blocks + pos / 16]);
            toff.push_back(pos % 16);
        }
    const int n_tok = static_cast<int>(qseq.size());
    auto k = randoms(static_cast<size_t>(n_tok) * row, 22), v = randoms(static_cast<size_t>(n_tok) * row, 23);
    auto q = randoms(static_cast<size_t>(n_tok) * kv.n_head * kv.head_dim, 24);
    // The reference arena after the append.
    std::vector<uint16_t> ref = data;
    for (int t = 0; t < n_tok; ++t)
        for (int i = 0; i < row; ++i) {
            const size_t at = static_cast<size_t>(tblock[t]) * tile +
                              (static_cast<size_t>(i / kv.head_dim) * 16 + toff[t]) * kv.head_dim + i % kv.head_dim;
            ref[at] = cpu::fp32_to_fp16(k[static_cast<size_t>(t) * row + i]);
            ref[tile / 2 + at] = cpu::fp32_to_fp16(v[static_cast<size_t>(t) * row + i]);
        }
    const float scale = 0.125f;
    const std::vector<float> want = reference_attention(
        q, n_tok, kv.n_head, 3, kv.head_dim, scale, visible, [&](int t, int hkv, int p, bool val, int d) {
            const size_t off = static_cast<size_t>(tables[static_cast<size_t>(qseq[t]) * max_blocks + p / 16]) * tile +
                               (val ? tile / 2 : 0) + (static_cast<size_t>(hkv) * 16 + p % 16) * kv.head_dim + d;
            return static_cast<double>(cpu::fp16_to_fp32(ref[off]));
        });
    DeviceBuf<uint16_t> dkv(data);
    DeviceBuf<int32_t> dtab(tables), dqseq(qseq), dvis(visible), dtb(tblock), dto(toff);
    DeviceBuf<float> dk(k), dv(v), dq(q), dout(std::vector<float>(q.size()));
    const int max_len = 70;
    DeviceBuf<uint8_t> ws(std::vector<uint8_t>(duet::cuda::paged_attention_workspace_bytes(kv, n_tok, max_len)));
    kv.data = dkv.p;
    ASSERT_EQ(duet::cuda::kv_append(dk.p, dv.p, n_tok, dtb.p, dto.p, kv, nullptr), cudaSuccess);
    ASSERT_EQ(duet::cuda::paged_attention(dq.p, kv, dtab.p, max_blocks, dqseq.p, dvis.p, n_tok, max_len, scale, dout.p,
                                          ws.p, nullptr),
              cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(dkv.get(ref.size()), ref) << "the appended KV differs from the CPU's f16 rounding (or touched other rows)";
    expect_close(dout.get(q.size()), want, 1e-4f, 1e-5f, "prefill attention");

    // The tiled prefill kernel on the same queries (tiles of at most 16 rows of one
    // sequence: 16 + 14 for sequence 0, 16 + 5 for sequence 1), the same answer.
    const std::vector<int32_t> tiles = duet::attention_query_tiles(qseq, duet::cuda::kPrefillTile);
    ASSERT_EQ(tiles, (std::vector<int32_t>{0, 16, 16, 14, 30, 16, 46, 5}));
    DeviceBuf<int32_t> dtiles(tiles);
    DeviceBuf<float> dout2(std::vector<float>(q.size()));
    ASSERT_EQ(duet::cuda::paged_attention_prefill(dq.p, kv, dtab.p, max_blocks, dqseq.p, dvis.p, dtiles.p,
                                                  static_cast<int>(tiles.size() / 2), scale, dout2.p, nullptr),
              cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    expect_close(dout2.get(q.size()), want, 1e-4f, 1e-5f, "tiled prefill attention");
}

// Quantized KV (int8, fp8 e4m3; a scale per token and head row), in the layout of
// src/kv/kv_pool.h: a chunk of two sequences appended on the GPU writes exactly the
// bytes and scales the CPU's quantize_kv_row writes into a host KvPool of the same
// layout (nothing else touched; a padding row skipped), and the decode kernel and the
// tiled prefill kernel attend over it like a float64 reference over the dequantized
// rows, with the same shuffled tables and GQA as above.
TEST(CudaAttention, QuantizedKvAppendsTheCpuBytesAndAttends) {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device on this machine";
    namespace cpu = duet::cpu;
    for (duet::KvDtype dt : {duet::KvDtype::Int8, duet::KvDtype::Fp8}) {
        const char* name = duet::kv_dtype_name(dt);
        const cpu::KvQuant qt = dt == duet::KvDtype::Int8 ? cpu::KvQuant::Int8 : cpu::KvQuant::Fp8;
        duet::KvLayout l;
        l.n_layer = 2;
        l.n_head_kv = 3;
        l.head_dim = 64;
        l.block_tokens = 16;
        l.dtype = dt;
        const int n_blocks = 64, layer = 1;
        auto host = duet::KvPool::create(l, n_blocks);
        ASSERT_TRUE(host.ok());
        duet::KvPool& pool = **host;
        // Every row of both layers holds a quantized random row to start with.
        std::mt19937 g(5);
        std::normal_distribution<float> nd(0.0f, 1.5f);
        std::vector<float> r(64);
        for (int li = 0; li < 2; ++li)
            for (int b = 0; b < n_blocks; ++b)
                for (int h = 0; h < 3; ++h)
                    for (int t = 0; t < 16; ++t) {
                        for (float& x : r) x = nd(g);
                        pool.k_scales(b, li, h)[t] = cpu::quantize_kv_row(qt, r.data(), 64, pool.k(b, li, h) + t * 64);
                        for (float& x : r) x = nd(g);
                        pool.v_scales(b, li, h)[t] = cpu::quantize_kv_row(qt, r.data(), 64, pool.v(b, li, h) + t * 64);
                    }
        const size_t bytes = l.block_bytes() * n_blocks;
        const auto* hp = static_cast<const uint8_t*>(pool.data());
        DeviceBuf<uint8_t> dkv(std::vector<uint8_t>(hp, hp + bytes));
        duet::cuda::PagedKv kv;
        kv.data = dkv.p;
        kv.dtype = static_cast<int>(dt);
        kv.n_blocks = n_blocks;
        kv.layer = layer;
        kv.n_head = 9;
        kv.n_head_kv = 3;
        kv.head_dim = 64;
        kv.block_tokens = 16;
        // Sequence 0: 40 tokens there, a chunk of 30; sequence 1: 21 new; one padding row.
        const std::vector<int> past = {40, 0}, chunk = {30, 21};
        const int max_blocks = 8, row = 3 * 64;
        const std::vector<int32_t> tables = {5, 9, 2, 33, 7, 1, 60, 61, 12, 40, 3, 0, 0, 0, 0, 0};
        std::vector<int32_t> qseq, visible, tblock, toff;
        for (int s = 0; s < 2; ++s)
            for (int i = 0; i < chunk[s]; ++i) {
                const int pos = past[s] + i;
                qseq.push_back(s);
                visible.push_back(pos + 1);
                tblock.push_back(tables[static_cast<size_t>(s) * max_blocks + pos / 16]);
                toff.push_back(pos % 16);
            }
        const int n_q = static_cast<int>(qseq.size());
        tblock.push_back(-1);  // a padding row: appends nothing
        toff.push_back(0);
        const int n_tok = n_q + 1;
        auto k = randoms(static_cast<size_t>(n_tok) * row, 71, 2.0f), v = randoms(static_cast<size_t>(n_tok) * row, 72);
        k[5] = 0.0f;  // rows with a zero and an outlier, a row of values too small to scale
        k[row + 7] = 40.0f;
        for (int d = 0; d < 64; ++d) k[static_cast<size_t>(2 * row + 64 + d)] = d == 3 ? 1e-38f : 0.0f;
        for (int t = 0; t < n_q; ++t)
            for (int h = 0; h < 3; ++h) {
                const float* kr = &k[static_cast<size_t>(t) * row + h * 64];
                const float* vr = &v[static_cast<size_t>(t) * row + h * 64];
                pool.k_scales(tblock[t], layer, h)[toff[t]] = cpu::quantize_kv_row(qt, kr, 64, pool.k(tblock[t], layer, h) + toff[t] * 64);
                pool.v_scales(tblock[t], layer, h)[toff[t]] = cpu::quantize_kv_row(qt, vr, 64, pool.v(tblock[t], layer, h) + toff[t] * 64);
            }
        DeviceBuf<int32_t> dtab(tables), dqseq(qseq), dvis(visible), dtb(tblock), dto(toff);
        DeviceBuf<float> dk(k), dv(v);
        ASSERT_EQ(duet::cuda::kv_append(dk.p, dv.p, n_tok, dtb.p, dto.p, kv, nullptr), cudaSuccess);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        EXPECT_EQ(dkv.get(bytes), std::vector<uint8_t>(hp, hp + bytes)) << name << ": the arena differs from the CPU's";

        auto q = randoms(static_cast<size_t>(n_q) * 9 * 64, 73);
        const float scale = 0.125f;
        auto dec = [&](uint8_t b) {
            return qt == cpu::KvQuant::Int8 ? static_cast<double>(static_cast<int8_t>(b)) : double{cpu::fp8_e4m3_to_fp32(b)};
        };
        const std::vector<float> want =
            reference_attention(q, n_q, 9, 3, 64, scale, visible, [&](int t, int hkv, int p, bool val, int d) {
                const int32_t b = tables[static_cast<size_t>(qseq[t]) * max_blocks + p / 16];
                const int slot = p % 16;
                return val ? pool.v_scales(b, layer, hkv)[slot] * dec(pool.v(b, layer, hkv)[slot * 64 + d])
                           : pool.k_scales(b, layer, hkv)[slot] * dec(pool.k(b, layer, hkv)[slot * 64 + d]);
            });
        DeviceBuf<float> dq(q), dout(std::vector<float>(q.size())), dout2(std::vector<float>(q.size()));
        const int max_len = 70;
        DeviceBuf<uint8_t> ws(std::vector<uint8_t>(duet::cuda::paged_attention_workspace_bytes(kv, n_q, max_len)));
        ASSERT_EQ(duet::cuda::paged_attention(dq.p, kv, dtab.p, max_blocks, dqseq.p, dvis.p, n_q, max_len, scale, dout.p,
                                              ws.p, nullptr),
                  cudaSuccess);
        const std::vector<int32_t> tiles = duet::attention_query_tiles(qseq, duet::cuda::kPrefillTile);
        DeviceBuf<int32_t> dtiles(tiles);
        ASSERT_EQ(duet::cuda::paged_attention_prefill(dq.p, kv, dtab.p, max_blocks, dqseq.p, dvis.p, dtiles.p,
                                                      static_cast<int>(tiles.size() / 2), scale, dout2.p, nullptr),
                  cudaSuccess);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        expect_close(dout.get(q.size()), want, 1e-4f, 1e-5f, name);
        expect_close(dout2.get(q.size()), want, 1e-4f, 1e-5f, name);
    }
    duet::cuda::PagedKv bad;
    bad.n_head = 4;
    bad.n_head_kv = 2;
    bad.head_dim = 64;
    bad.dtype = 3;
    EXPECT_EQ(duet::cuda::paged_attention(nullptr, bad, nullptr, 1, nullptr, nullptr, 1, 1, 1.0f, nullptr, nullptr, nullptr),
              cudaErrorInvalidValue);
}

// Device sampling against the CPU sampler on the same rows: every combination of
// temperature (greedy with penalties included), top-k, top-p, min-p and penalties,
// over peaked, flat (all tied) and partly -inf rows of the model's vocabulary size,
// four (seed, position) draws each: the same token every time, except on rows whose
// candidates need more sorting than the kernel does (a top-p prefix of more than
// kSampleMaxSorted tokens, found here by sorting the whole row; top_k 5000), which
// come back -1, for the host. DUET_CUDA_TEST_QUICK=1 (under compute-sanitizer):
// one draw each over the peaked and the tied rows.
TEST(CudaSample, PicksTheCpuSamplersTokens) {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device on this machine";
    namespace cu = duet::cuda;
    const bool quick = std::getenv("DUET_CUDA_TEST_QUICK") != nullptr;
    const uint64_t draws = quick ? 1 : 4;
    const int64_t nv = 49152;
    std::vector<std::vector<float>> bases;
    bases.push_back(randoms(nv, 81, 3.0f));  // broad
    {
        auto l = randoms(nv, 82, 1.0f);  // peaked: a few clear winners
        for (int i = 0; i < 8; ++i) l[static_cast<size_t>(i * 6007 + 11)] += 12.0f - i;
        bases.push_back(l);
    }
    bases.push_back(std::vector<float>(nv, 0.5f));  // all tied: ids decide
    {
        auto l = randoms(nv, 83, 2.0f);  // half of it -inf
        for (int64_t i = 0; i < nv; i += 2) l[static_cast<size_t>(i)] = -INFINITY;
        bases.push_back(l);
    }
    std::vector<duet::SamplingParams> params;
    for (float t : {0.0f, 0.7f, 1.0f, 1.5f})
        for (int k : {0, 1, 40, 1000})
            for (float tp : {1.0f, 0.9f, 0.5f})
                for (float mp : {0.0f, 0.05f})
                    for (bool pen : {false, true}) {
                        duet::SamplingParams p;
                        p.temperature = t;
                        p.top_k = k;
                        p.top_p = tp;
                        p.min_p = mp;
                        if (pen) {
                            p.repetition_penalty = 1.3f;
                            p.frequency_penalty = 0.4f;
                            p.presence_penalty = 0.2f;
                        }
                        if (t == 0.0f && (k != 0 || tp != 1.0f || mp != 0.0f)) continue;  // greedy ignores filters
                        params.push_back(p);
                    }
    const std::vector<int32_t> prompt = {11, 6018, 12024, 5, 5, 48000}, output = {12024, 11, 11, 777};
    std::vector<float> logits;
    std::vector<cu::SampleRow> rows;
    std::vector<cu::SampleEdit> edits;
    std::vector<uint32_t> masks;
    std::vector<duet::SampleRequest> reqs;
    std::vector<duet::SamplingParams> keep;  // stable storage for the requests' params
    if (quick) bases = {bases[1], bases[2]};
    keep.reserve(params.size() * bases.size() * (draws + 5) + 2);
    std::vector<int32_t> want;
    duet::Sampler cpu;
    // How many of the best candidates a top-p cut keeps (the whole row sorted).
    auto top_p_prefix = [&](const std::vector<float>& base, const duet::SamplingParams& p) -> int64_t {
        std::vector<float> l = base;
        std::vector<duet::PenaltyEdit> pe;
        duet::penalty_edits(p, nv, prompt, output, pe);
        for (const auto& e : pe) {
            float& x = l[static_cast<size_t>(e.token)];
            if (e.rep) x = x > 0 ? x / p.repetition_penalty : x * p.repetition_penalty;
            x -= e.sub;
        }
        const float inv = 1.0f / p.temperature;
        for (float& x : l) x *= inv;
        std::vector<float> sorted_l = l;
        std::sort(sorted_l.begin(), sorted_l.end(), std::greater<float>());
        int64_t n = p.top_k > 0 && p.top_k < nv ? p.top_k : nv;
        double sum = 0, cum = 0;
        for (int64_t i = 0; i < n; ++i) sum += std::exp(static_cast<double>(sorted_l[i] - sorted_l[0]));
        for (int64_t i = 0; i < n; ++i)
            if ((cum += std::exp(static_cast<double>(sorted_l[i] - sorted_l[0])) / sum) >= p.top_p) return i + 1;
        return n;
    };
    for (size_t b = 0; b < bases.size(); ++b)
        for (const duet::SamplingParams& p0 : params)
            for (uint64_t d = 0; d < draws; ++d) {
                keep.push_back(p0);
                keep.back().seed = 1000 * b + d;
                const duet::SampleRequest r{&keep.back(), prompt, output, 3 + d};
                const int32_t row = static_cast<int32_t>(logits.size() / nv);
                logits.insert(logits.end(), bases[b].begin(), bases[b].end());
                rows.push_back(duet::sample_row_for(r, row, nv, edits, masks));
                const bool host = p0.temperature > 0 && p0.top_p < 1.0f && (p0.top_k == 0 || p0.top_k > cu::kSampleMaxSorted) &&
                                  top_p_prefix(bases[b], keep.back()) > cu::kSampleMaxSorted;
                want.push_back(host ? -1 : cpu.sample(bases[b].data(), nv, *r.params, r.prompt, r.output, r.index));
            }
    // Constrained rows (a request's logit_bias, min_tokens' bans, a grammar's bitset):
    // against the CPU sampler under the same constraints, over every base and
    // parameter set, with no bitset, a dense one, a sparse one (1 in 16), one of 20
    // tokens (fewer than a top-k of 40, the usual grammar state) and one that allows
    // nothing (-1 from both). The biases are small enough that the mask, the bans and
    // the sampling decide, not one forced token. Top-p without top-k only under the
    // sparse bitsets (a wider one may need more sorting than the kernel does).
    std::vector<duet::TokenBias> bias = {{6018, 4.0f}, {11, -100.0f}, {48000, 2.5f}, {6018, 1.5f}, {30000, 3.0f}};
    const std::vector<int32_t> banned = {0, 2, 777};
    std::vector<std::vector<uint32_t>> allowed(4, std::vector<uint32_t>(static_cast<size_t>((nv + 31) / 32)));
    {
        std::mt19937 rng(84);
        for (auto& w : allowed[0]) w = ~static_cast<uint32_t>(rng() & rng());                 // most tokens
        for (auto& w : allowed[1]) w = static_cast<uint32_t>(rng() & rng() & rng() & rng());  // 1 in 16
        for (int i = 0; i < 20; ++i) {  // 20 tokens, the bias's among them
            const uint32_t t = i < 3 ? std::vector<uint32_t>{6018, 48000, 30000}[static_cast<size_t>(i)]
                                     : static_cast<uint32_t>(rng() % static_cast<uint32_t>(nv));
            allowed[2][t / 32] |= 1u << (t % 32);
        }
        // allowed[3]: nothing.
    }
    for (size_t b = 0; b < bases.size(); ++b)
        for (size_t pi = 0; pi < params.size(); pi += quick ? 7 : 1) {
            const duet::SamplingParams& p0 = params[pi];
            for (int variant = 0; variant < 5; ++variant) {
                if (p0.top_p < 1.0f && p0.top_k == 0 && variant < 2) continue;
                keep.push_back(p0);
                keep.back().seed = 5000 + 10 * b + static_cast<uint64_t>(variant);
                duet::SampleRequest r{&keep.back(), prompt, output, 2};
                r.constraints.bias = bias;
                if (variant != 1) r.constraints.banned = banned;
                if (variant >= 1) r.constraints.allowed = allowed[static_cast<size_t>(variant - 1)];
                const int32_t row = static_cast<int32_t>(logits.size() / nv);
                logits.insert(logits.end(), bases[b].begin(), bases[b].end());
                rows.push_back(duet::sample_row_for(r, row, nv, edits, masks));
                want.push_back(cpu.sample(bases[b].data(), nv, *r.params, r.prompt, r.output, r.index, r.constraints));
            }
        }
    // The two rows left to the host.
    for (const auto& [k, tp] : {std::pair<int, float>{5000, 1.0f}, {0, 0.999f}}) {
        keep.push_back({});
        keep.back().top_k = k;
        keep.back().top_p = tp;
        const duet::SampleRequest r{&keep.back(), {}, {}, 0};
        const int32_t row = static_cast<int32_t>(logits.size() / nv);
        const std::vector<float> tied(nv, 0.5f);
        logits.insert(logits.end(), tied.begin(), tied.end());
        rows.push_back(duet::sample_row_for(r, row, nv, edits, masks));
        want.push_back(-1);
    }
    const int n = static_cast<int>(rows.size());
    DeviceBuf<float> dl(logits);
    DeviceBuf<cu::SampleRow> drows(rows);
    DeviceBuf<cu::SampleEdit> dedits(edits);
    DeviceBuf<uint32_t> dmasks(masks);
    DeviceBuf<int32_t> dpicks(std::vector<int32_t>(static_cast<size_t>(n), -7));
    DeviceBuf<uint8_t> ws(std::vector<uint8_t>(cu::sample_workspace_bytes(n, nv)));
    ASSERT_EQ(cu::sample_rows(dl.p, nv, drows.p, n, dedits.p, dmasks.p, dpicks.p, ws.p, nullptr), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<int32_t> got = dpicks.get(static_cast<size_t>(n));
    int bad = 0;
    for (int i = 0; i < n; ++i)
        if (got[i] != want[i] && bad++ < 10) {
            const duet::SamplingParams& p = keep[static_cast<size_t>(i)];
            ADD_FAILURE() << "row " << i << " (t " << p.temperature << " top_k " << p.top_k << " top_p " << p.top_p
                          << " min_p " << p.min_p << " rep " << p.repetition_penalty << " seed " << p.seed << "): GPU "
                          << got[i] << ", CPU " << want[i];
        }
    EXPECT_EQ(bad, 0) << "of " << n << " rows";
    const auto left = std::count(want.begin(), want.end(), -1);
    std::fprintf(stderr, "%d rows sampled, %ld left to the host\n", n, static_cast<long>(left));
    // The logits are left as they were.
    EXPECT_EQ(dl.get(logits.size()), logits);
}

// Projections: bf16 weights and activations, f32 accumulation, against a float64
// product of the same bf16 values; ragged sizes (a decode step of 1 token, a batch
// of 7, a prefill chunk of 300), SmolLM2's widths.
TEST(CudaGemm, Bf16LinearMatchesTheReference) {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device on this machine";
    namespace cpu = duet::cpu;
    duet::cuda::Gemm gemm;
    std::string err;
    ASSERT_TRUE(gemm.init(&err)) << err;
    for (auto [n_out, n_in, n_tok] : {std::tuple{576, 576, 1}, std::tuple{1536, 576, 7}, std::tuple{576, 1536, 300}}) {
        auto wf = randoms(static_cast<size_t>(n_out) * n_in, 41, 0.05f), xf = randoms(static_cast<size_t>(n_tok) * n_in, 42);
        std::vector<uint16_t> w(wf.size());
        for (size_t i = 0; i < wf.size(); ++i) w[i] = cpu::fp32_to_bf16(wf[i]);
        std::vector<uint16_t> xb(xf.size());
        for (size_t i = 0; i < xf.size(); ++i) xb[i] = cpu::fp32_to_bf16(xf[i]);
        std::vector<float> want(static_cast<size_t>(n_tok) * n_out), bound(want.size());
        for (int t = 0; t < n_tok; ++t)
            for (int r = 0; r < n_out; ++r) {
                double acc = 0, mag = 0;
                for (int k = 0; k < n_in; ++k) {
                    const double p = static_cast<double>(cpu::bf16_to_fp32(w[static_cast<size_t>(r) * n_in + k])) *
                                     cpu::bf16_to_fp32(xb[static_cast<size_t>(t) * n_in + k]);
                    acc += p;
                    mag += std::fabs(p);
                }
                want[static_cast<size_t>(t) * n_out + r] = static_cast<float>(acc);
                bound[static_cast<size_t>(t) * n_out + r] = static_cast<float>(1e-5 * mag + 1e-6);  // f32 accumulation
            }
        DeviceBuf<uint16_t> dw(w), dxb(std::vector<uint16_t>(xf.size()));
        DeviceBuf<float> dx(xf), dy(std::vector<float>(want.size()));
        ASSERT_EQ(duet::cuda::f32_to_bf16(dx.p, dxb.p, static_cast<int64_t>(xf.size()), nullptr), cudaSuccess);
        EXPECT_EQ(dxb.get(xb.size()), xb) << "activation rounding differs from the CPU's fp32_to_bf16";
        ASSERT_TRUE(gemm.linear(dw.p, n_out, n_in, dxb.p, n_tok, dy.p, n_out, nullptr, &err)) << err;
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        const std::vector<float> got = dy.get(want.size());
        size_t bad = 0;
        for (size_t i = 0; i < got.size(); ++i)
            if (!(std::fabs(got[i] - want[i]) <= bound[i]) && bad++ < 5)
                ADD_FAILURE() << n_out << "x" << n_in << "x" << n_tok << " [" << i << "] " << got[i] << " vs " << want[i];
        EXPECT_EQ(bad, 0u);
    }
}

// The quantized GEMV (decode projections from GGUF blocks: Q4_0, Q4_1, Q8_0) against
// float64 over the blocks' dequantized weights (the CPU's dequantize_row) and the
// bf16 activations, 1 to 8 tokens, the model's shapes (rows not a multiple of the
// block of warps included); bad shapes refused.
TEST(CudaGemm, QuantizedGemvMatchesTheReference) {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device on this machine";
    namespace cpu = duet::cpu;
    for (duet::DType type : {duet::DType::Q4_0, duet::DType::Q4_1, duet::DType::Q8_0})
        for (auto [n_out, n_in, n_tok] : {std::tuple{576, 576, 1}, std::tuple{1535, 576, 8}, std::tuple{577, 1536, 3}}) {
            auto wf = randoms(static_cast<size_t>(n_out) * n_in, 51, 0.05f), xf = randoms(static_cast<size_t>(n_tok) * n_in, 52);
            const size_t row_bytes = static_cast<size_t>(n_in) / 32 * duet::dtype_block_bytes(type);
            std::vector<uint8_t> w(row_bytes * n_out);
            std::vector<float> wd(wf.size());
            for (int r = 0; r < n_out; ++r) {
                cpu::quantize_row(cpu::Isa::Scalar, type, &wf[static_cast<size_t>(r) * n_in], &w[r * row_bytes], n_in);
                cpu::dequantize_row(type, &w[r * row_bytes], &wd[static_cast<size_t>(r) * n_in], n_in);
            }
            std::vector<uint16_t> xb(xf.size());
            for (size_t i = 0; i < xf.size(); ++i) xb[i] = cpu::fp32_to_bf16(xf[i]);
            std::vector<float> want(static_cast<size_t>(n_tok) * n_out), bound(want.size());
            for (int t = 0; t < n_tok; ++t)
                for (int r = 0; r < n_out; ++r) {
                    double acc = 0, mag = 0;
                    for (int k = 0; k < n_in; ++k) {
                        const double p = static_cast<double>(wd[static_cast<size_t>(r) * n_in + k]) *
                                         cpu::bf16_to_fp32(xb[static_cast<size_t>(t) * n_in + k]);
                        acc += p;
                        mag += std::fabs(p);
                    }
                    want[static_cast<size_t>(t) * n_out + r] = static_cast<float>(acc);
                    bound[static_cast<size_t>(t) * n_out + r] = static_cast<float>(1e-5 * mag + 1e-6);
                }
            DeviceBuf<uint8_t> dw(w);
            DeviceBuf<uint16_t> dx(xb);
            DeviceBuf<float> dy(std::vector<float>(want.size()));
            ASSERT_EQ(duet::cuda::qgemv(static_cast<int>(type), dw.p, row_bytes, n_out, n_in, dx.p, n_tok, dy.p, n_out, nullptr),
                      cudaSuccess);
            ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
            const std::vector<float> got = dy.get(want.size());
            size_t bad = 0;
            for (size_t i = 0; i < got.size(); ++i)
                if (!(std::fabs(got[i] - want[i]) <= bound[i]) && bad++ < 5)
                    ADD_FAILURE() << "type " << static_cast<int>(type) << " " << n_out << "x" << n_in << "x" << n_tok << " ["
                                  << i << "] " << got[i] << " vs " << want[i];
            EXPECT_EQ(bad, 0u);
        }
    EXPECT_EQ(duet::cuda::qgemv(duet::cuda::kQ4_1, nullptr, 20, 4, 33, nullptr, 1, nullptr, 4, nullptr), cudaErrorInvalidValue);
    EXPECT_EQ(duet::cuda::qgemv(duet::cuda::kQ4_1, nullptr, 20, 4, 32, nullptr, 9, nullptr, 4, nullptr), cudaErrorInvalidValue);
    EXPECT_EQ(duet::cuda::qgemv(12, nullptr, 20, 4, 32, nullptr, 1, nullptr, 4, nullptr), cudaErrorInvalidValue);
    EXPECT_FALSE(duet::cuda::qgemv_supports(12));
}
