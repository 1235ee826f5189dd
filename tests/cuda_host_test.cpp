// The host side of the CUDA backend, in the default suite (any machine, GPU or not):
// device names, cuBLAS opened at run time rather than linked, and the errors a
// missing device gives.
#include <gtest/gtest.h>

#include <dlfcn.h>

#include "device.h"
#include "engine/engine.h"
#include "gemm.h"
#include "model/device_spec.h"

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
