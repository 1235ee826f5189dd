// Paged decode attention on the GPU: one new query token per sequence against the
// sequence's KV in the arena (f16, layout of src/kv/kv_pool.h:
// data[layer][block][K|V][kv_head][token in block][dim]), through its block table.
// GQA: query head h reads KV head h / (n_head / n_head_kv). Long contexts are split
// into chunks of kSplitTokens computed in parallel (online softmax per chunk, then
// one combine), so a single long sequence still fills the GPU.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace duet::cuda {

struct PagedKv {
    const uint16_t* data = nullptr;  // the arena's KV data (f16 bits)
    int n_blocks = 0;                // blocks in the arena (a layer plane holds them all)
    int layer = 0;
    int n_head = 0, n_head_kv = 0, head_dim = 0, block_tokens = 16;
};

inline constexpr int kSplitTokens = 512;

// Scratch the call needs for n_seq sequences of at most max_len tokens.
size_t paged_decode_workspace_bytes(const PagedKv& kv, int n_seq, int max_len);

// out[s][h][:] = softmax(scale * q[s][h] . K[s]) V[s] over the first seq_lens[s]
// tokens of sequence s (block ids in block_tables[s * max_blocks_per_seq + i]).
// head_dim must be 64 or 128 (cudaErrorInvalidValue otherwise); max_len >= every
// seq_lens[s]. q and out: [n_seq][n_head][head_dim] f32.
cudaError_t paged_decode_attention(const float* q, const PagedKv& kv, const int32_t* block_tables,
                                   int max_blocks_per_seq, const int32_t* seq_lens, int n_seq, int max_len,
                                   float scale, float* out, void* workspace, cudaStream_t stream);

}  // namespace duet::cuda
