#include "kernels/cuda/gemm.h"

#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <dlfcn.h>

#include <algorithm>
#include <mutex>

namespace duet::cuda {

namespace {

// cuBLAS is opened at first use (dlopen), not linked: a duet built with CUDA starts,
// and serves on CPU, on a machine without the CUDA libraries.
struct Cublas {
    cublasStatus_t (*create)(cublasHandle_t*) = nullptr;
    cublasStatus_t (*destroy)(cublasHandle_t) = nullptr;
    cublasStatus_t (*set_stream)(cublasHandle_t, cudaStream_t) = nullptr;
    cublasStatus_t (*set_workspace)(cublasHandle_t, void*, size_t) = nullptr;
    cublasStatus_t (*gemm_ex)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int, const void*,
                              const void*, cudaDataType, int, const void*, cudaDataType, int, const void*, void*,
                              cudaDataType, int, cublasComputeType_t, cublasGemmAlgo_t) = nullptr;
    const char* (*status_string)(cublasStatus_t) = nullptr;
    std::string error;  // why it could not be opened
};

#define DUET_STR2(x) #x
#define DUET_STR(x) DUET_STR2(x)

const Cublas& cublas() {
    static Cublas c;
    static std::once_flag once;
    std::call_once(once, [] {
        const std::string soname = "libcublas.so." DUET_STR(CUBLAS_VER_MAJOR);
        void* lib = dlopen(soname.c_str(), RTLD_NOW | RTLD_LOCAL);
#ifdef DUET_CUBLAS_DIR
        if (!lib) lib = dlopen((std::string(DUET_CUBLAS_DIR) + "/" + soname).c_str(), RTLD_NOW | RTLD_LOCAL);
#endif
        if (!lib) {
            c.error = "cannot open " + soname + ": " + dlerror();
            return;
        }
        auto sym = [&](auto& fn, const char* name) {
            fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
            if (!fn && c.error.empty()) c.error = soname + " has no " + name;
        };
        sym(c.create, "cublasCreate_v2");
        sym(c.destroy, "cublasDestroy_v2");
        sym(c.set_stream, "cublasSetStream_v2");
        sym(c.set_workspace, "cublasSetWorkspace_v2");
        sym(c.gemm_ex, "cublasGemmEx");
        sym(c.status_string, "cublasGetStatusString");
    });
    return c;
}

__global__ void f32_to_bf16_kernel(const float* x, __nv_bfloat16* y, int64_t n) {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x)
        y[i] = __float2bfloat16_rn(x[i]);
}

bool ok(cublasStatus_t s, const char* what, std::string* error) {
    if (s == CUBLAS_STATUS_SUCCESS) return true;
    if (error) *error = std::string(what) + ": " + cublas().status_string(s);
    return false;
}

}  // namespace

cudaError_t f32_to_bf16(const float* x, uint16_t* y, int64_t n, cudaStream_t stream) {
    if (n <= 0) return cudaSuccess;
    const int blocks = static_cast<int>(std::min<int64_t>((n + 255) / 256, 65535));
    f32_to_bf16_kernel<<<blocks, 256, 0, stream>>>(x, reinterpret_cast<__nv_bfloat16*>(y), n);
    return cudaGetLastError();
}

Gemm::~Gemm() {
    if (handle_) cublas().destroy(static_cast<cublasHandle_t>(handle_));
}

bool Gemm::init(std::string* error) {
    const Cublas& cb = cublas();
    if (!cb.error.empty()) {
        if (error) *error = cb.error;
        return false;
    }
    cublasHandle_t h = nullptr;
    if (!ok(cb.create(&h), "cublasCreate", error)) return false;
    handle_ = h;
    return true;
}

bool Gemm::set_workspace(void* ws, size_t bytes, std::string* error) {
    auto h = static_cast<cublasHandle_t>(handle_);
    if (!h) {
        if (error) *error = "Gemm::set_workspace before init";
        return false;
    }
    if (!ok(cublas().set_workspace(h, ws, bytes), "cublasSetWorkspace", error)) return false;
    ws_ = ws;
    ws_bytes_ = bytes;
    return true;
}

bool Gemm::linear(const uint16_t* w, int n_out, int n_in, const uint16_t* x, int n_tok, float* y, int ldy,
                  cudaStream_t stream, std::string* error) {
    if (n_out <= 0 || n_tok <= 0) return true;
    auto h = static_cast<cublasHandle_t>(handle_);
    if (!h) {
        if (error) *error = "Gemm::linear before init";
        return false;
    }
    if (!stream_set_ || stream != stream_) {
        if (!ok(cublas().set_stream(h, stream), "cublasSetStream", error)) return false;
        if (ws_ && !ok(cublas().set_workspace(h, ws_, ws_bytes_), "cublasSetWorkspace", error)) return false;
        stream_ = stream;
        stream_set_ = true;
    }
    // Column-major view: W is [n_in x n_out] (lda n_in), X is [n_in x n_tok], Y is
    // [n_out x n_tok] (ldc ldy): Y = W^T X.
    const float one = 1.0f, zero = 0.0f;
    return ok(cublas().gemm_ex(h, CUBLAS_OP_T, CUBLAS_OP_N, n_out, n_tok, n_in, &one, w, CUDA_R_16BF, n_in, x, CUDA_R_16BF,
                           n_in, &zero, y, CUDA_R_32F, ldy, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
              "cublasGemmEx", error);
}

}  // namespace duet::cuda
