// Decode projections straight from GGUF's quantized blocks (Q4_0, Q4_1, Q8_0): y =
// W x for a few tokens, each weight block read once and dequantized in registers,
// against cuBLAS over the bf16 copy (gemm.h), which reads 2 bytes per weight where
// these read 0.56 (Q4_0), 0.63 (Q4_1) or 1.06 (Q8_0). Decode at small batches is
// bound by reading the weights, so this can win there; `duet bench cuda` measures it
// against cuBLAS on the model's own matrices (the backend keeps the bf16 products
// until a GPU run shows the quantized ones faster).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace duet::cuda {

inline constexpr int kQgemvMaxTokens = 8;

// GGUF type numbers (kernels/cpu/quant_types.h DType) this takes.
inline constexpr int kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;
bool qgemv_supports(int gguf_type);

// y[t][r] = sum_k W[r][k] * x[t][k] for r < n_out, t < n_tok (<= kQgemvMaxTokens):
// W row r is n_in / 32 blocks of gguf_type at w + r * row_bytes; x row-major
// [n_tok][n_in] bf16; y row-major [n_tok][ldy] f32. n_in a multiple of 32.
cudaError_t qgemv(int gguf_type, const void* w, size_t row_bytes, int n_out, int n_in, const uint16_t* x, int n_tok,
                  float* y, int ldy, cudaStream_t stream);

}  // namespace duet::cuda
