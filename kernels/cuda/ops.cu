#include "kernels/cuda/ops.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "kernels/cuda/rope_math.cuh"

namespace duet::cuda {

namespace {

__device__ inline float bf16_to_f32(uint16_t h) { return __uint_as_float(static_cast<uint32_t>(h) << 16); }

__global__ void embed_bf16_kernel(const uint16_t* table, const int32_t* ids, int dim, float* out) {
    const int t = blockIdx.x;
    const uint16_t* row = table + static_cast<int64_t>(ids[t]) * dim;
    float* o = out + static_cast<int64_t>(t) * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) o[i] = bf16_to_f32(row[i]);
}

// The row's scale 1 / sqrt(mean(x^2) + eps) from each thread's partial sum of
// squares (in double, as the CPU kernel), the same for every thread of the block.
__device__ float block_rms_scale(double ss, int n, float eps) {
    for (int off = 16; off > 0; off >>= 1) ss += __shfl_down_sync(0xffffffffu, ss, off);
    __shared__ double warp_sums[32];
    __shared__ float scale;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) warp_sums[warp] = ss;
    __syncthreads();
    if (threadIdx.x == 0) {
        double total = 0.0;
        for (int k = 0; k < (blockDim.x + 31) / 32; ++k) total += warp_sums[k];
        scale = static_cast<float>(1.0 / sqrt(total / static_cast<double>(n) + static_cast<double>(eps)));
    }
    __syncthreads();
    return scale;
}

__device__ inline void store(float* y, float v) { *y = v; }
__device__ inline void store(__nv_bfloat16* y, float v) { *y = __float2bfloat16_rn(v); }

// One block per row (256 threads, each a stride of the row): sum of squares, scale;
// the result in f32, or rounded to bf16 (a projection's input) in the same pass.
template <typename Out>
__global__ void rms_norm_kernel(const float* x, const float* w, Out* y, int n, float eps) {
    const float* xr = x + static_cast<int64_t>(blockIdx.x) * n;
    Out* yr = y + static_cast<int64_t>(blockIdx.x) * n;
    double ss = 0.0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss += static_cast<double>(xr[i]) * xr[i];
    const float scale = block_rms_scale(ss, n, eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) store(yr + i, xr[i] * scale * w[i]);
}

// x += a (the residual), then rms_norm_bf16 of the sum: each thread adds, and sums
// the squares of, the same stride of the row as rms_norm_kernel would.
__global__ void add_rms_norm_bf16_kernel(float* x, const float* a, const float* w, __nv_bfloat16* y, int n, float eps) {
    float* xr = x + static_cast<int64_t>(blockIdx.x) * n;
    const float* ar = a + static_cast<int64_t>(blockIdx.x) * n;
    __nv_bfloat16* yr = y + static_cast<int64_t>(blockIdx.x) * n;
    double ss = 0.0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = xr[i] + ar[i];
        xr[i] = v;
        ss += static_cast<double>(v) * v;
    }
    const float scale = block_rms_scale(ss, n, eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) store(yr + i, xr[i] * scale * w[i]);
}

// Grid: (token, head); threads over the rot_dim / 2 pairs.
__global__ void rope_kernel(float* x, int n_heads, int head_dim, int rot_dim, const int32_t* pos,
                            const float* inv_freq, bool neox) {
    const int t = blockIdx.x, h = blockIdx.y, half = rot_dim / 2;
    float* v = x + (static_cast<int64_t>(t) * n_heads + h) * head_dim;
    const double p = static_cast<double>(pos[t]);
    for (int i = threadIdx.x; i < half; i += blockDim.x) detail::rope_pair(v, i, half, p, inv_freq, neox);
}

// out = silu(gate) * up, in f32 or rounded to bf16.
template <typename Out>
__global__ void swiglu_kernel(const float* gate, const float* up, Out* out, int64_t n) {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const float g = gate[i];
        store(out + i, g / (1.0f + expf(-g)) * up[i]);
    }
}

__global__ void add_bias_kernel(float* x, const float* b, int n) {
    float* row = x + static_cast<int64_t>(blockIdx.x) * n;
    for (int i = threadIdx.x; i < n; i += blockDim.x) row[i] += b[i];
}

__global__ void add_kernel(float* x, const float* y, int64_t n) {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x)
        x[i] += y[i];
}

__global__ void gather_rows_kernel(const float* x, const int32_t* rows, int n, float* out) {
    const float* src = x + static_cast<int64_t>(rows[blockIdx.x]) * n;
    float* dst = out + static_cast<int64_t>(blockIdx.x) * n;
    for (int i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}

__global__ void round_f16_kernel(float* x, int64_t n) {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x)
        x[i] = __half2float(__float2half_rn(x[i]));
}

int grid_for(int64_t n) { return static_cast<int>(std::min<int64_t>((n + 255) / 256, 65535)); }

// One block per row: each thread scans a stride (ascending, so its first maximum
// wins), then a tree of (value, index) pairs keeps the larger value, the lower index
// on ties. Rows are expected free of NaN.
__global__ void argmax_kernel(const float* logits, int64_t n, int32_t* out) {
    const float* row = logits + static_cast<int64_t>(blockIdx.x) * n;
    float best = -INFINITY;
    int64_t at = -1;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
        if (at < 0 || row[i] > best) {
            best = row[i];
            at = i;
        }
    __shared__ float sv[256];
    __shared__ int64_t si[256];
    sv[threadIdx.x] = best;
    si[threadIdx.x] = at;
    __syncthreads();
    for (int w = blockDim.x / 2; w > 0; w >>= 1) {
        if (threadIdx.x < w) {
            const float ov = sv[threadIdx.x + w], mv = sv[threadIdx.x];
            const int64_t oi = si[threadIdx.x + w], mi = si[threadIdx.x];
            if (oi >= 0 && (mi < 0 || ov > mv || (ov == mv && oi < mi))) {
                sv[threadIdx.x] = ov;
                si[threadIdx.x] = oi;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) out[blockIdx.x] = static_cast<int32_t>(si[0]);
}

}  // namespace

cudaError_t argmax_rows(const float* logits, int n_rows, int64_t n_vocab, int32_t* out, cudaStream_t stream) {
    if (n_rows <= 0 || n_vocab <= 0) return cudaSuccess;
    argmax_kernel<<<n_rows, 256, 0, stream>>>(logits, n_vocab, out);
    return cudaGetLastError();
}

cudaError_t embed_bf16(const uint16_t* table, const int32_t* ids, int n_tok, int dim, float* out, cudaStream_t stream) {
    if (n_tok <= 0) return cudaSuccess;
    embed_bf16_kernel<<<n_tok, 256, 0, stream>>>(table, ids, dim, out);
    return cudaGetLastError();
}

cudaError_t rms_norm(const float* x, const float* w, float* y, int n_rows, int n, float eps, cudaStream_t stream) {
    if (n_rows <= 0) return cudaSuccess;
    rms_norm_kernel<<<n_rows, 256, 0, stream>>>(x, w, y, n, eps);
    return cudaGetLastError();
}

cudaError_t rope(float* x, int n_tok, int n_heads, int head_dim, int rot_dim, const int32_t* pos,
                 const float* inv_freq, bool neox, cudaStream_t stream) {
    if (n_tok <= 0 || n_heads <= 0 || rot_dim < 2) return cudaSuccess;
    rope_kernel<<<dim3(static_cast<unsigned>(n_tok), static_cast<unsigned>(n_heads)), 64, 0, stream>>>(
        x, n_heads, head_dim, rot_dim, pos, inv_freq, neox);
    return cudaGetLastError();
}

cudaError_t swiglu(const float* gate, const float* up, float* out, int64_t n, cudaStream_t stream) {
    if (n <= 0) return cudaSuccess;
    swiglu_kernel<<<grid_for(n), 256, 0, stream>>>(gate, up, out, n);
    return cudaGetLastError();
}

cudaError_t add_bias(float* x, const float* b, int n_rows, int n, cudaStream_t stream) {
    if (n_rows <= 0 || n <= 0) return cudaSuccess;
    add_bias_kernel<<<n_rows, 256, 0, stream>>>(x, b, n);
    return cudaGetLastError();
}

cudaError_t add(float* x, const float* y, int64_t n, cudaStream_t stream) {
    if (n <= 0) return cudaSuccess;
    add_kernel<<<grid_for(n), 256, 0, stream>>>(x, y, n);
    return cudaGetLastError();
}

// Block (x, y): run x, its y-th share of the run's 16-byte words (or bytes).
__global__ void copy_runs_kernel(uint8_t* dst, const uint8_t* src, ByteRuns r) {
    const int i = blockIdx.x;
    const uint8_t* s = src + r.src_off[i];
    uint8_t* d = dst + r.dst_off[i];
    const uint64_t n = r.bytes[i];
    const uint64_t stride = static_cast<uint64_t>(gridDim.y) * blockDim.x;
    const uint64_t first = static_cast<uint64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
    if (((reinterpret_cast<uintptr_t>(s) | reinterpret_cast<uintptr_t>(d) | n) & 15) == 0) {
        const uint4* s4 = reinterpret_cast<const uint4*>(s);
        uint4* d4 = reinterpret_cast<uint4*>(d);
        for (uint64_t w = first; w < n / 16; w += stride) d4[w] = s4[w];
    } else {
        for (uint64_t b = first; b < n; b += stride) d[b] = s[b];
    }
}

cudaError_t copy_runs(uint8_t* dst, const uint8_t* src, const ByteRuns& r, cudaStream_t stream) {
    if (r.n <= 0) return cudaSuccess;
    if (r.n > ByteRuns::kMax) return cudaErrorInvalidValue;
    uint64_t most = 0;
    for (int i = 0; i < r.n; ++i) most = r.bytes[i] > most ? r.bytes[i] : most;
    constexpr int kThreads = 256;
    // Enough rows for the longest run at 4 words a thread, at most 64 (a run of
    // contiguous blocks can be a whole layer's; the grid then loops).
    const uint64_t rows = (most + 16ull * kThreads * 4 - 1) / (16ull * kThreads * 4);
    const dim3 grid(static_cast<unsigned>(r.n), static_cast<unsigned>(rows < 1 ? 1 : rows > 64 ? 64 : rows));
    copy_runs_kernel<<<grid, kThreads, 0, stream>>>(dst, src, r);
    return cudaGetLastError();
}

cudaError_t gather_rows(const float* x, const int32_t* rows, int n_rows, int n, float* out, cudaStream_t stream) {
    if (n_rows <= 0 || n <= 0) return cudaSuccess;
    gather_rows_kernel<<<n_rows, 256, 0, stream>>>(x, rows, n, out);
    return cudaGetLastError();
}

cudaError_t round_f16(float* x, int64_t n, cudaStream_t stream) {
    if (n <= 0) return cudaSuccess;
    round_f16_kernel<<<grid_for(n), 256, 0, stream>>>(x, n);
    return cudaGetLastError();
}

cudaError_t rms_norm_bf16(const float* x, const float* w, uint16_t* y, int n_rows, int n, float eps, cudaStream_t stream) {
    if (n_rows <= 0) return cudaSuccess;
    rms_norm_kernel<<<n_rows, 256, 0, stream>>>(x, w, reinterpret_cast<__nv_bfloat16*>(y), n, eps);
    return cudaGetLastError();
}

cudaError_t add_rms_norm_bf16(float* x, const float* a, const float* w, uint16_t* y, int n_rows, int n, float eps,
                              cudaStream_t stream) {
    if (n_rows <= 0) return cudaSuccess;
    add_rms_norm_bf16_kernel<<<n_rows, 256, 0, stream>>>(x, a, w, reinterpret_cast<__nv_bfloat16*>(y), n, eps);
    return cudaGetLastError();
}

cudaError_t swiglu_bf16(const float* gate, const float* up, uint16_t* out, int64_t n, cudaStream_t stream) {
    if (n <= 0) return cudaSuccess;
    swiglu_kernel<<<grid_for(n), 256, 0, stream>>>(gate, up, reinterpret_cast<__nv_bfloat16*>(out), n);
    return cudaGetLastError();
}

}  // namespace duet::cuda
