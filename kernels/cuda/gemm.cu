#include "gemm.h"

#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <algorithm>

namespace duet::cuda {

namespace {

__global__ void f32_to_bf16_kernel(const float* x, __nv_bfloat16* y, int64_t n) {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x)
        y[i] = __float2bfloat16_rn(x[i]);
}

bool ok(cublasStatus_t s, const char* what, std::string* error) {
    if (s == CUBLAS_STATUS_SUCCESS) return true;
    if (error) *error = std::string(what) + ": " + cublasGetStatusString(s);
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
    if (handle_) cublasDestroy(static_cast<cublasHandle_t>(handle_));
}

bool Gemm::init(std::string* error) {
    cublasHandle_t h = nullptr;
    if (!ok(cublasCreate(&h), "cublasCreate", error)) return false;
    handle_ = h;
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
    if (!ok(cublasSetStream(h, stream), "cublasSetStream", error)) return false;
    // Column-major view: W is [n_in x n_out] (lda n_in), X is [n_in x n_tok], Y is
    // [n_out x n_tok] (ldc ldy): Y = W^T X.
    const float one = 1.0f, zero = 0.0f;
    return ok(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, n_out, n_tok, n_in, &one, w, CUDA_R_16BF, n_in, x, CUDA_R_16BF,
                           n_in, &zero, y, CUDA_R_32F, ldy, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
              "cublasGemmEx", error);
}

}  // namespace duet::cuda
