// Weights for the GPU backend: a GGUF tensor dequantized to bf16 (round to nearest
// even), the form cuBLAS multiplies (kernels/cuda/gemm.h). Done on the host at load.
#pragma once

#include <cstdint>
#include <vector>

#include "base/result.h"
#include "model/gguf.h"

namespace duet {

// Every element of t in bf16, row by row (ne[0] contiguous). Errors: a type the
// kernels cannot dequantize, or data shorter than its shape.
Result<std::vector<uint16_t>> dequantize_bf16(const GgufTensor& t);

}  // namespace duet
