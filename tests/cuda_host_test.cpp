// The host side of the CUDA backend, in the default suite (any machine, GPU or not):
// device names, cuBLAS opened at run time rather than linked, and the errors a
// missing device gives.
#include <gtest/gtest.h>

#include <cuda_fp8.h>
#include <dlfcn.h>
#include <sys/mman.h>
#include <unistd.h>

#include <limits>

#include "cuda/cuda_arena.h"
#include "cuda/sample_inputs.h"
#include "kernels/cuda/device.h"
#include "engine/engine.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cpu/kernels.h"
#include "model/device_spec.h"
#include "shm/fd_keeper.h"

using namespace duet;

TEST(Device, ParsesCpuAndCudaOrdinals) {
    EXPECT_EQ(parse_device("cpu")->cuda, false);
    EXPECT_EQ(parse_device("")->cuda, false);
    EXPECT_EQ(*parse_device("cuda"), (DeviceSpec{true, 0}));
    EXPECT_EQ(*parse_device("cuda:7"), (DeviceSpec{true, 7}));
    EXPECT_EQ(parse_device("cuda:7")->name(), "cuda:7");
    for (const char* bad : {"gpu", "cuda:", "cuda:-1", "cuda:1x", "cuda:0:1", "CUDA:0", "cuda: 1"}) {
        auto r = parse_device(bad);
        ASSERT_FALSE(r) << bad;
        EXPECT_NE(r.error().message.find("expected cpu, cuda or cuda:N"), std::string::npos) << r.error().message;
    }
}

// The binary does not link cuBLAS (it starts where the CUDA libraries are absent);
// Gemm opens it at first use. Here the toolkit is installed: opening works, and
// without a GPU creating a handle fails with cuBLAS's own status, not a load error.
TEST(Device, CublasIsOpenedAtRunTimeNotLinked) {
    EXPECT_EQ(dlsym(RTLD_DEFAULT, "cublasGemmEx"), nullptr) << "cuBLAS is linked into the test binary";
    cuda::Gemm g;
    std::string err;
    const bool ok = g.init(&err);
    if (cuda::device_count() > 0) {
        EXPECT_TRUE(ok) << err;
    } else {
        EXPECT_FALSE(ok);
        EXPECT_EQ(err.find("cannot open"), std::string::npos) << err;
        EXPECT_EQ(err.find("has no"), std::string::npos) << err;
        EXPECT_NE(err.find("cublasCreate"), std::string::npos) << err;
    }
}

TEST(Device, AMissingCudaDeviceIsAClearError) {
    EngineOptions o;
    o.model_path = DUET_MODEL_PATH;
    o.threads = 1;
    o.n_ctx = 256;
    o.device = "cuda:99";
    auto e = Engine::create(o);
    ASSERT_FALSE(e);
    EXPECT_NE(e.error().message.find("cuda:99: no such device"), std::string::npos) << e.error().message;
    o.device = "tpu";
    e = Engine::create(o);
    ASSERT_FALSE(e);
    EXPECT_NE(e.error().message.find("unknown device 'tpu'"), std::string::npos) << e.error().message;
}

// The shared GPU KV arena's host side (src/cuda/cuda_arena.h), checkable without a
// GPU: it is found through the launcher's fd keeper, and what the keeper holds must
// be an arena of this device and of at least the size this process needs. A memfd
// stands in for the exported allocation.
namespace {

std::string arena_test_instance(const char* what) { return fmt::format("cuda-host-{}-{}", what, getpid()); }

int fake_allocation() {
    const int fd = memfd_create("fake-gpu-arena", MFD_CLOEXEC);
    if (fd >= 0 && ftruncate(fd, 4096) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

}  // namespace

TEST(SharedKvArena, WithoutTheLaunchersFdKeeperItSaysSo) {
    auto a = SharedKvArena::open(arena_test_instance("nokeeper"), 0, 0, 4096);
    ASSERT_FALSE(a);
    EXPECT_NE(a.error().message.find("fd keeper"), std::string::npos) << a.error().message;
}

TEST(SharedKvArena, AKeptArenaOfAnotherDeviceOrTooSmallIsRefused) {
    const std::string inst = arena_test_instance("mismatch");
    auto keeper = shm::FdKeeper::start(inst);
    ASSERT_TRUE(keeper) << keeper.error().message;
    const int fd = fake_allocation();
    ASSERT_GE(fd, 0);
    // What fd_put hands back is the caller's to close.
    auto put = [&](int device, const char* meta) {
        auto k = shm::fd_put(inst, kv_arena_key(device), fd, meta);
        ASSERT_TRUE(k) << k.error().message;
        close(k->fd);
    };
    // Arena 0 is kept as one made on device 1; a worker of device 0 maps arena 0 (a
    // worker started with another GPU than its pair's): refused.
    put(0, "device=1 bytes=4096");
    auto a = SharedKvArena::open(inst, 0, 0, 4096);
    ASSERT_FALSE(a);
    EXPECT_NE(a.error().message.find("4096 bytes on cuda:1; this process needs 4096 bytes on cuda:0"), std::string::npos)
        << a.error().message;
    // Right device, too small.
    put(2, "device=2 bytes=4096");
    a = SharedKvArena::open(inst, 2, 2, 8192);
    ASSERT_FALSE(a);
    EXPECT_NE(a.error().message.find("needs 8192 bytes on cuda:2"), std::string::npos) << a.error().message;
    // Not an arena's metadata at all.
    put(3, "bytes=4096");
    a = SharedKvArena::open(inst, 3, 3, 4096);
    ASSERT_FALSE(a);
    EXPECT_NE(a.error().message.find("malformed metadata 'bytes=4096'"), std::string::npos) << a.error().message;
    // A legacy IPC handle that is not 64 bytes of hex.
    put(4, "device=4 bytes=4096 ipc=zz");
    a = SharedKvArena::open(inst, 4, 4, 4096);
    ASSERT_FALSE(a);
    EXPECT_NE(a.error().message.find("malformed metadata"), std::string::npos) << a.error().message;
    // A well-formed one is opened with CUDA (which, without a GPU, says so).
    if (cuda::device_count() == 0) {
        put(6, ("device=6 bytes=4096 ipc=" + std::string(128, '0')).c_str());
        a = SharedKvArena::open(inst, 6, 6, 4096);
        ASSERT_FALSE(a);
        EXPECT_EQ(a.error().message.find("malformed"), std::string::npos) << a.error().message;
        EXPECT_NE(a.error().message.find("cuda:6"), std::string::npos) << a.error().message;
    }
    close(fd);
    EXPECT_EQ(kv_arena_key(5), "kv.arena.5");
}

TEST(SharedKvArena, NobodyHasMadeItAndThereIsNoDeviceToMakeItOn) {
    if (cuda::device_count() > 99) GTEST_SKIP() << "a machine with 100 GPUs";
    const std::string inst = arena_test_instance("nodevice");
    auto keeper = shm::FdKeeper::start(inst);
    ASSERT_TRUE(keeper) << keeper.error().message;
    auto a = SharedKvArena::open(inst, 0, 99, 4096);
    ASSERT_FALSE(a);
    EXPECT_NE(a.error().message.find("cuda:99: no such device"), std::string::npos) << a.error().message;
    EXPECT_EQ((*keeper)->size(), 0u) << "nothing deposited";
}

// The fp8 KV cache: the CPU's e4m3 conversions (kernels/cpu) give the same bytes and
// values as CUDA's own (cuda_fp8.h, whose host implementation is the device
// intrinsics' reference), so KV written on either side reads the same on the other.
TEST(Device, Fp8ConversionsAreCudas) {
    for (unsigned b = 0; b < 256; ++b) {
        const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(b), __NV_E4M3);
        const float want = __half2float(__half(h)), got = cpu::fp8_e4m3_to_fp32(static_cast<uint8_t>(b));
        if (std::isnan(want))
            EXPECT_TRUE(std::isnan(got)) << b;
        else
            EXPECT_EQ(got, want) << b;
    }
    // Every float whose top 20 bits vary (all exponents, signs and the 11 mantissa
    // bits around e4m3's rounding points), plus the float right above each one.
    for (uint32_t hi = 0; hi < (1u << 20); ++hi) {
        for (uint32_t lo : {0u, 1u, 0x7FFu, 0x800u, 0xFFFu}) {
            const uint32_t u = (hi << 12) | lo;
            float f;
            std::memcpy(&f, &u, 4);
            const auto want = static_cast<uint8_t>(__nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E4M3));
            const uint8_t got = cpu::fp32_to_fp8_e4m3(f);
            if (std::isnan(f)) {
                ASSERT_EQ(got & 0x7F, 0x7F) << f;
                ASSERT_EQ(want & 0x7F, 0x7F) << f;
            } else {
                ASSERT_EQ(got, want) << std::hexfloat << f;
            }
        }
    }
}

// The device sampler's per-row inputs are what the CPU sampler derives from the same
// parameters: 1 / temperature (0: greedy), log(min_p) only when min_p is on, the
// (seed, position) draw, the penalty edits appended after the earlier rows'.
TEST(Device, SampleRowsCarryTheCpuSamplersDerivedParameters) {
    SamplingParams p;
    p.temperature = 0.7f;
    p.top_k = 20;
    p.top_p = 0.9f;
    p.min_p = 0.05f;
    p.repetition_penalty = 1.2f;
    p.seed = 99;
    const std::vector<int32_t> prompt = {4, 8}, output = {8, 15};
    std::vector<cuda::SampleEdit> edits = {{1, 1, 0.5f, 0.0f}};  // an earlier row's
    std::vector<uint32_t> masks;
    const cuda::SampleRow r = sample_row_for(SampleRequest{&p, prompt, output, 6}, 3, 100, edits, masks);
    EXPECT_EQ(r.row, 3);
    EXPECT_EQ(r.inv_temp, 1.0f / 0.7f);
    EXPECT_EQ(r.top_k, 20);
    EXPECT_EQ(r.top_p, 0.9f);
    EXPECT_EQ(r.min_p_on, 1);
    EXPECT_EQ(r.log_min_p, std::log(0.05f));
    EXPECT_EQ(r.rep, 1.2f);
    EXPECT_EQ(r.u, sample_uniform(99, 6));
    EXPECT_NE(r.u, sample_uniform(99, 7));
    std::vector<PenaltyEdit> want;
    penalty_edits(p, 100, prompt, output, want);
    ASSERT_EQ(r.edit_begin, 1);
    ASSERT_EQ(r.edit_count, static_cast<int32_t>(want.size()));
    ASSERT_EQ(edits.size(), 1 + want.size());
    for (size_t i = 0; i < want.size(); ++i) {
        EXPECT_EQ(edits[1 + i].token, want[i].token);
        EXPECT_EQ(edits[1 + i].rep, want[i].rep);
        EXPECT_EQ(edits[1 + i].sub, want[i].sub);
    }
    p.temperature = 0;
    p.min_p = 0;
    const cuda::SampleRow g = sample_row_for(SampleRequest{&p, {}, {}, 0}, 0, 100, edits, masks);
    EXPECT_EQ(g.inv_temp, 0.0f) << "greedy";
    EXPECT_EQ(g.min_p_on, 0);
    EXPECT_EQ(r.mask_begin, -1);
    EXPECT_EQ(g.mask_begin, -1);
    EXPECT_TRUE(masks.empty()) << "no constraints, no bitset";
}

// A row's constraints reach the device sampler as the CPU applies them: one edit per
// token in id order, a penalized token's edit carrying its bias (token_adds' sum, or
// -inf where banned) beside its penalties, a token with a bias alone an edit with
// no penalty; the allowed bitset appended after the earlier rows' and widened to
// n_vocab bits with words that allow nothing.
TEST(Device, SampleRowsCarryTheConstraintsAsEditsAndABitset) {
    SamplingParams p;
    p.temperature = 0.8f;
    p.repetition_penalty = 1.2f;
    p.frequency_penalty = 0.5f;
    const std::vector<int32_t> prompt = {4, 8}, output = {8, 15};
    const std::vector<TokenBias> bias = {{15, 2.0f}, {50, -1.0f}, {50, -0.5f}, {3, 9.0f}, {120, 1.0f}};
    const std::vector<int32_t> banned = {99, 8};
    const std::vector<uint32_t> allowed = {0xF0F0F0F0u, 0x1u};   // 2 of the 4 words of 100 tokens
    std::vector<cuda::SampleEdit> edits = {{1, 1, 0.5f, 0.0f}};  // an earlier row's
    std::vector<uint32_t> masks = {7u};                          // an earlier row's word
    SampleRequest s{&p, prompt, output, 2};
    s.constraints = TokenConstraints{bias, banned, allowed};
    const cuda::SampleRow r = sample_row_for(s, 1, 100, edits, masks);
    constexpr float kBanned = -std::numeric_limits<float>::infinity();
    struct Want {
        int32_t token, rep;
        float sub, add;
    };
    const float out_sub = 0.5f * 1;  // 8 and 15 once each in the output, no presence penalty
    const std::vector<Want> want = {{3, 0, 0.0f, 9.0f},     {4, 1, 0.0f, 0.0f},   {8, 1, out_sub, kBanned},
                                    {15, 1, out_sub, 2.0f}, {50, 0, 0.0f, -1.5f}, {99, 0, 0.0f, kBanned}};
    ASSERT_EQ(r.edit_begin, 1);
    ASSERT_EQ(r.edit_count, static_cast<int32_t>(want.size()));
    for (size_t i = 0; i < want.size(); ++i) {
        const cuda::SampleEdit& e = edits[1 + i];
        EXPECT_EQ(e.token, want[i].token) << i;
        EXPECT_EQ(e.rep, want[i].rep) << i;
        EXPECT_EQ(e.sub, want[i].sub) << i;
        EXPECT_EQ(e.add, want[i].add) << i;
    }
    ASSERT_EQ(r.mask_begin, 1);
    EXPECT_EQ(masks, (std::vector<uint32_t>{7u, 0xF0F0F0F0u, 0x1u, 0u, 0u}));
}
