// Projections on the GPU: weights in bf16 (GGUF weights dequantized at load),
// activations converted to bf16, products accumulated in f32 by cuBLAS.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace duet::cuda {

// y[i] = bf16(x[i]) (round to nearest even), n values.
cudaError_t f32_to_bf16(const float* x, uint16_t* y, int64_t n, cudaStream_t stream);

// One cuBLAS handle (per thread/stream that issues projections).
class Gemm {
public:
    Gemm() = default;
    ~Gemm();
    Gemm(const Gemm&) = delete;
    Gemm& operator=(const Gemm&) = delete;
    // Creates the handle on the current device; false with the reason.
    bool init(std::string* error);
    // A workspace of its own for cuBLAS (bytes at ws, on the device), so products
    // captured into a CUDA graph never allocate.
    bool set_workspace(void* ws, size_t bytes, std::string* error);
    // y[t][r] = sum_k w[r][k] * x[t][k] for r < n_out, t < n_tok: w row-major
    // [n_out][n_in] bf16, x row-major [n_tok][n_in] bf16, y row-major [n_tok][n_out]
    // f32 (leading dimension ldy >= n_out), on `stream`.
    bool linear(const uint16_t* w, int n_out, int n_in, const uint16_t* x, int n_tok, float* y, int ldy,
                cudaStream_t stream, std::string* error);

private:
    void* handle_ = nullptr;  // cublasHandle_t
    // cublasSetStream puts cuBLAS back on its default workspace pool, so the stream
    // is set only when it changes, and the workspace again right after.
    cudaStream_t stream_ = nullptr;
    bool stream_set_ = false;
    void* ws_ = nullptr;
    size_t ws_bytes_ = 0;
};

}  // namespace duet::cuda
