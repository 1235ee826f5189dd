// Host-side planning for the CUDA backend, checkable without a GPU: how many KV
// blocks a device arena holds, and the batch sizes decode steps are captured as
// CUDA graphs for.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "base/result.h"
#include "kv/kv_pool.h"

namespace duet {

struct DeviceArenaPlan {
    uint32_t n_blocks = 0;
    uint64_t bytes = 0;        // what to allocate: n_blocks blocks rounded up to the granularity
    uint64_t block_bytes = 0;  // one block, every layer
};

// The KV arena for a device with free_bytes free: `fraction` of it, less the
// model's weights and a scratch reserve, in whole blocks, the allocation rounded up
// to the VMM granularity without passing the budget. An error that names the
// figures when not even one block fits.
Result<DeviceArenaPlan> plan_device_arena(const KvLayout& l, uint64_t free_bytes, double fraction, uint64_t weight_bytes,
                                          uint64_t reserve_bytes, uint64_t granularity);

// The bytes of the model's weights as the CUDA backend holds them: every matrix and
// the embedding in bf16 (a tied output head once), norms and biases in f32.
uint64_t bf16_weight_bytes(const class Model& m);

// Decode steps run as CUDA graphs captured for these batch sizes (1, 2, 4, 8, then
// every 8 up to max_batch, and max_batch itself); a step of n sequences replays the
// smallest bucket >= n with the extra rows idle.
std::vector<int> decode_graph_buckets(int max_batch);
// Query tiles for the tiled prefill attention (kernels/cuda/attention.h
// paged_attention_prefill): runs of at most `tile` consecutive queries of one
// sequence, as (first query, count) pairs, flattened. A packed batch holds each
// sequence's queries consecutively at consecutive positions, so a run of one
// sequence's rows is such a tile.
std::vector<int32_t> attention_query_tiles(std::span<const int32_t> query_seq, int tile);

// The bucket for a step of n sequences, or -1 when n is past the largest (run
// eagerly, without a graph).
int graph_bucket(const std::vector<int>& buckets, int n);

}  // namespace duet
