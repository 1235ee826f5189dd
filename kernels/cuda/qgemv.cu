#include "kernels/cuda/qgemv.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace duet::cuda {

namespace {

constexpr int kWarps = 4;  // rows per block: one warp per output row

template <int TYPE>
struct Block;
template <>
struct Block<kQ4_0> {
    static constexpr int kBytes = 18;
};
template <>
struct Block<kQ4_1> {
    static constexpr int kBytes = 20;
};
template <>
struct Block<kQ8_0> {
    static constexpr int kBytes = 34;
};

__device__ inline float f16(const uint8_t* p) {
    __half_raw h;
    h.x = static_cast<unsigned short>(p[0] | (p[1] << 8));
    return __half2float(__half(h));
}

// The 32 weights of one block: w[j] for j < 32 (GGUF's order: the low nibbles of
// qs[0..15] are weights 0..15, the high nibbles 16..31).
template <int TYPE>
__device__ inline void dequant(const uint8_t* b, float* w) {
    if constexpr (TYPE == kQ8_0) {
        const float d = f16(b);
        for (int j = 0; j < 32; ++j) w[j] = d * static_cast<float>(static_cast<int8_t>(b[2 + j]));
    } else {
        const float d = f16(b);
        const float m = TYPE == kQ4_1 ? f16(b + 2) : 0.0f;
        const uint8_t* qs = b + (TYPE == kQ4_1 ? 4 : 2);
        for (int j = 0; j < 16; ++j) {
            const int lo = qs[j] & 15, hi = qs[j] >> 4;
            if constexpr (TYPE == kQ4_1) {
                w[j] = d * static_cast<float>(lo) + m;
                w[j + 16] = d * static_cast<float>(hi) + m;
            } else {
                w[j] = d * static_cast<float>(lo - 8);
                w[j + 16] = d * static_cast<float>(hi - 8);
            }
        }
    }
}

// A warp per output row; lane i takes blocks i, i + 32, ... of the row, dequantizes
// each once and multiplies it with every token's 32 activations.
template <int TYPE, int NT>
__global__ void qgemv_kernel(const uint8_t* w, size_t row_bytes, int n_out, int n_in, const __nv_bfloat16* x, float* y,
                             int ldy) {
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * kWarps + (threadIdx.x >> 5);
    if (r >= n_out) return;
    const uint8_t* row = w + static_cast<size_t>(r) * row_bytes;
    const int nb = n_in / 32;
    float acc[NT];
    for (int t = 0; t < NT; ++t) acc[t] = 0.0f;
    for (int b = lane; b < nb; b += 32) {
        float wv[32];
        dequant<TYPE>(row + static_cast<size_t>(b) * Block<TYPE>::kBytes, wv);
        for (int t = 0; t < NT; ++t) {
            const __nv_bfloat162* xt = reinterpret_cast<const __nv_bfloat162*>(x + static_cast<size_t>(t) * n_in + b * 32);
            float s = 0.0f;
            for (int j = 0; j < 16; ++j) {
                const float2 xv = __bfloat1622float2(xt[j]);
                s += wv[2 * j] * xv.x + wv[2 * j + 1] * xv.y;
            }
            acc[t] += s;
        }
    }
    for (int t = 0; t < NT; ++t) {
        float v = acc[t];
        for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
        if (lane == 0) y[static_cast<size_t>(t) * ldy + r] = v;
    }
}

template <int TYPE>
cudaError_t launch(const void* w, size_t row_bytes, int n_out, int n_in, const uint16_t* x, int n_tok, float* y, int ldy,
                   cudaStream_t stream) {
    const dim3 grid(static_cast<unsigned>((n_out + kWarps - 1) / kWarps));
    const auto* wb = static_cast<const uint8_t*>(w);
    const auto* xb = reinterpret_cast<const __nv_bfloat16*>(x);
    switch (n_tok) {
#define DUET_QGEMV_CASE(N)                                                                                   \
    case N: qgemv_kernel<TYPE, N><<<grid, 32 * kWarps, 0, stream>>>(wb, row_bytes, n_out, n_in, xb, y, ldy); \
        break;
        DUET_QGEMV_CASE(1)
        DUET_QGEMV_CASE(2)
        DUET_QGEMV_CASE(3)
        DUET_QGEMV_CASE(4)
        DUET_QGEMV_CASE(5)
        DUET_QGEMV_CASE(6)
        DUET_QGEMV_CASE(7)
        DUET_QGEMV_CASE(8)
#undef DUET_QGEMV_CASE
    default: return cudaErrorInvalidValue;
    }
    return cudaGetLastError();
}

}  // namespace

bool qgemv_supports(int gguf_type) { return gguf_type == kQ4_0 || gguf_type == kQ4_1 || gguf_type == kQ8_0; }

cudaError_t qgemv(int gguf_type, const void* w, size_t row_bytes, int n_out, int n_in, const uint16_t* x, int n_tok,
                  float* y, int ldy, cudaStream_t stream) {
    if (n_out <= 0 || n_tok <= 0) return cudaSuccess;
    if (n_in <= 0 || n_in % 32 != 0 || n_tok > kQgemvMaxTokens || ldy < n_out) return cudaErrorInvalidValue;
    switch (gguf_type) {
    case kQ4_0: return launch<kQ4_0>(w, row_bytes, n_out, n_in, x, n_tok, y, ldy, stream);
    case kQ4_1: return launch<kQ4_1>(w, row_bytes, n_out, n_in, x, n_tok, y, ldy, stream);
    case kQ8_0: return launch<kQ8_0>(w, row_bytes, n_out, n_in, x, n_tok, y, ldy, stream);
    default: return cudaErrorInvalidValue;
    }
}

}  // namespace duet::cuda
