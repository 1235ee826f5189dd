// Paged attention on the GPU: query tokens against their sequence's KV in the arena
// (layout of src/kv/kv_pool.h: per (layer, block) tile, [K|V][kv_head][token in
// block][dim] values, f16 or int8 / fp8 e4m3 bytes, then for those the [K|V][kv_head]
// [token in block] f32 scales), through the sequence's block table. Decode: one query per sequence
// over all its tokens. Prefill: a packed batch of chunks of several sequences, each
// query token over its sequence's tokens up to its own position (causal; the chunk's
// KV appended first). GQA: query head h reads KV head h / (n_head / n_head_kv). Long
// contexts are split into chunks of kSplitTokens computed in parallel (online
// softmax per chunk, then one combine), so a single long sequence still fills the GPU.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace duet::cuda {

// KV value types (src/kv/kv_pool.h KvDtype's numbers).
inline constexpr int kKvF16 = 0, kKvInt8 = 1, kKvFp8 = 2;

struct PagedKv {
    const void* data = nullptr;      // the arena's KV data
    int dtype = kKvF16;
    int n_blocks = 0;                // blocks in the arena (a layer plane holds them all)
    int layer = 0;
    int n_head = 0, n_head_kv = 0, head_dim = 0, block_tokens = 16;
};

inline constexpr int kSplitTokens = 512;

// Scratch the call needs for n_query queries of at most max_len visible tokens.
size_t paged_attention_workspace_bytes(const PagedKv& kv, int n_query, int max_len);

// out[i][h][:] = softmax(scale * q[i][h] . K) V over the first visible[i] tokens of
// sequence seq = query_seq ? query_seq[i] : i, whose block ids are
// block_tables[seq * max_blocks_per_seq + j]. head_dim must be 64 or 128
// (cudaErrorInvalidValue otherwise); max_len >= every visible[i]. q and out:
// [n_query][n_head][head_dim] f32.
cudaError_t paged_attention(const float* q, const PagedKv& kv, const int32_t* block_tables, int max_blocks_per_seq,
                            const int32_t* query_seq, const int32_t* visible, int n_query, int max_len, float scale,
                            float* out, void* workspace, cudaStream_t stream);

// Prefill attention, tiled: the queries come in tiles (tiles[2i] the first query,
// tiles[2i + 1] how many, at most kPrefillTile) of consecutive positions of one
// sequence each (src/model/gpu_plan.h attention_query_tiles makes them). K and V of
// every 16 tokens are loaded into shared memory once per tile and used by all its
// queries (the per-query kernel above reads them once per query: 16x the traffic in
// a long prefill). Same result as paged_attention for those queries, up to the order
// of the online softmax's steps (no split into chunks here); no workspace.
inline constexpr int kPrefillTile = 16;
cudaError_t paged_attention_prefill(const float* q, const PagedKv& kv, const int32_t* block_tables, int max_blocks_per_seq,
                                    const int32_t* query_seq, const int32_t* visible, const int32_t* tiles, int n_tiles,
                                    float scale, float* out, cudaStream_t stream);

// RoPE on the q rows (n_head heads) and k rows (kv.n_head_kv heads) of n_tok tokens
// at positions pos, q then rounded to f16, and K (rotated) and V appended as by
// kv_append: ops.h's rope (twice) + round_f16 + kv_append in one launch,
// the same bits.
cudaError_t qk_rope_kv_append(float* q, float* k, const float* v, int n_tok, const int32_t* pos, const float* inv_freq,
                              int rot_dim, bool neox, const int32_t* token_block, const int32_t* token_offset,
                              const PagedKv& kv, cudaStream_t stream);

// Appends K and V rows of n_tok tokens (each [n_head_kv][head_dim] f32, K after
// RoPE) to the arena: as f16 (round to nearest even), or quantized, each head's row
// with its own scale (the same bits as kernels/cpu quantize_kv_row): token t goes to block
// token_block[t], row token_offset[t] of layer kv.layer; a token with block -1 is
// skipped (the idle rows of a decode step replayed from a CUDA graph). The arena is
// written through kv.data.
cudaError_t kv_append(const float* k, const float* v, int n_tok, const int32_t* token_block,
                          const int32_t* token_offset, const PagedKv& kv, cudaStream_t stream);

}  // namespace duet::cuda
