// CUDA kernels for the per-token operations of the forward pass, the same math as
// the CPU kernels (kernels/cpu/kernels.h) on device arrays, row-batched. Each
// launcher enqueues on `stream` and returns the launch error (cudaSuccess: queued).
// Activations are f32; weights in bf16 (GGUF weights are dequantized to bf16 at load).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace duet::cuda {

// out[t][:] = bf16 table row ids[t] as f32, for t < n_tok (embedding gather).
cudaError_t embed_bf16(const uint16_t* table, const int32_t* ids, int n_tok, int dim, float* out, cudaStream_t stream);

// y[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w for each of n_rows rows of n values.
cudaError_t rms_norm(const float* x, const float* w, float* y, int n_rows, int n, float eps, cudaStream_t stream);

// Rotary embedding in place over n_tok rows of n_heads x head_dim values; row t at
// position pos[t]; pairs (2i, 2i+1) ("normal") or (i, i + rot_dim/2) (neox) for
// i < rot_dim/2, angle pos * inv_freq[i] (reduced mod 2 pi in double, as on CPU).
cudaError_t rope(float* x, int n_tok, int n_heads, int head_dim, int rot_dim, const int32_t* pos,
                 const float* inv_freq, bool neox, cudaStream_t stream);

// out = silu(gate) * up, n values.
cudaError_t swiglu(const float* gate, const float* up, float* out, int64_t n, cudaStream_t stream);

// x[t][i] += b[i] for n_rows rows of n values (a projection's bias).
cudaError_t add_bias(float* x, const float* b, int n_rows, int n, cudaStream_t stream);

// x[i] += y[i], n values (the residual).
cudaError_t add(float* x, const float* y, int64_t n, cudaStream_t stream);

// out[r][:] = x[rows[r]][:] for r < n_rows, rows of n values.
cudaError_t gather_rows(const float* x, const int32_t* rows, int n_rows, int n, float* out, cudaStream_t stream);

// Byte runs copied by one launch: run i moves bytes[i] bytes from src + src_off[i]
// to dst + dst_off[i]. Passed by value as the kernel's parameters (within their
// 4 KiB), so a list of copies needs no device memory and no upload of its own.
struct ByteRuns {
    static constexpr int kMax = 160;
    int n = 0;
    uint64_t src_off[kMax], dst_off[kMax], bytes[kMax];
};

// The runs of r, each by its own rows of thread blocks (16-byte loads and stores
// where a run's two ends and length allow, else bytes). src and dst are pointers this
// device's kernels can reach: its own memory, or page-locked host memory (mapped
// into the device's address space under unified addressing). No run's destination
// may overlap another run's source or destination. One launch replaces a cudaMemcpyAsync per run: a KV
// copy of fragmented block ids is hundreds of runs a layer (bench/RESULTS.md).
cudaError_t copy_runs(uint8_t* dst, const uint8_t* src, const ByteRuns& r, cudaStream_t stream);

// x[i] = f32(f16(x[i])) (round to nearest even; overflow gives +-inf as on the CPU).
cudaError_t round_f16(float* x, int64_t n, cudaStream_t stream);

// Fused forms, each the same bits as the kernels it replaces (fewer launches per
// layer: a decode step is launch-bound):
// rms_norm then f32_to_bf16 (gemm.h) of the result;
cudaError_t rms_norm_bf16(const float* x, const float* w, uint16_t* y, int n_rows, int n, float eps, cudaStream_t stream);
// add(x, a) then rms_norm_bf16 of x (the residual, then the next norm);
cudaError_t add_rms_norm_bf16(float* x, const float* a, const float* w, uint16_t* y, int n_rows, int n, float eps,
                              cudaStream_t stream);
// swiglu then f32_to_bf16.
cudaError_t swiglu_bf16(const float* gate, const float* up, uint16_t* out, int64_t n, cudaStream_t stream);

}  // namespace duet::cuda

namespace duet::cuda {

// out[r] = the index of the largest of logits[r][0..n_vocab), the lowest index on
// ties (the CPU sampler's greedy pick), for n_rows rows. Sampling with temperature
// stays on the host: the CPU sampler over the row gives the same (seed, position)
// draw on every backend.
cudaError_t argmax_rows(const float* logits, int n_rows, int64_t n_vocab, int32_t* out, cudaStream_t stream);

}  // namespace duet::cuda
