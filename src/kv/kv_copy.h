// Planning KV copies between two arenas (prefill's and decode's on different GPUs,
// or a host staging buffer): which byte ranges move, layer by layer, so each layer
// can be copied as soon as prefill has written it, overlapping the next layers'
// compute (DESIGN.md, "One request, end to end"). In the arena layout a layer's
// tiles are one plane, data[layer][block][K|V][head][token][dim], so blocks with
// consecutive ids on both sides are one contiguous range: those merge into one copy.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "base/result.h"
#include "kv/kv_pool.h"

namespace duet {

struct CopyRun {
    uint64_t src = 0, dst = 0;  // byte offsets into each arena's data
    uint64_t bytes = 0;
    friend bool operator==(const CopyRun&, const CopyRun&) = default;
};

// The copies that move layer `layer` of blocks src[i] (of an arena with src_blocks
// blocks) into blocks dst[i] (of one with dst_blocks), in order, consecutive ids
// merged. Errors: lists of different lengths, ids or a layer out of range, a
// destination block named twice (two sources would race for it).
Result<std::vector<CopyRun>> plan_layer_copy(const KvLayout& l, int32_t src_blocks, int32_t dst_blocks,
                                             std::span<const int32_t> src, std::span<const int32_t> dst,
                                             int32_t layer);

// The blocks a pass writes for one sequence, paired with where they go: positions
// [from, from + n) fall in blocks from / block_tokens to (from + n - 1) / block_tokens
// of `blocks`, each going to the same-numbered entry of `dst`. Appended to src_out
// and dst_out; nothing for n == 0. Errors: a position beyond `blocks` or `dst`.
Status append_written_blocks(std::span<const int32_t> blocks, std::span<const int32_t> dst, int64_t from, int64_t n,
                             int32_t block_tokens, std::vector<int32_t>& src_out, std::vector<int32_t>& dst_out);

// A pass's KV copy into other arenas (a hand-off to a decode worker whose arena is
// not the one prefill writes: another GPU's, or the other role's host arena). After
// Backend::forward_export returns, every block of each exported sequence (as it
// stands after the pass: the blocks of earlier chunks and of a cached prefix too)
// is also in its destination blocks, every layer. A GPU backend copies each layer as
// soon as the pass has written it, overlapping the next layers' compute.
struct KvDest {
    void* data = nullptr;  // the arena's data, in the KvPool layout, reachable by the backend
    int32_t n_blocks = 0;
    // A GPU backend: the GPU the memory is on (-1: the backend's own), and whether
    // the backend's GPU reaches it by peer access (else copies are staged by the
    // driver through host memory).
    int device = -1;
    bool peer = true;
};
struct KvExport {
    std::vector<KvDest> dests;
    // Per batch entry: its index in dests (-1: not exported), and the destination
    // block of each of the sequence's blocks as they stand after the pass.
    std::vector<int32_t> dest;
    std::vector<std::vector<int32_t>> dst_ids;
};

// One exported sequence after the pass: its blocks and its length.
struct ExportSeq {
    std::span<const int32_t> blocks;
    int64_t n_tokens = 0;
};
// The copies of an export: per destination (exp.dests), per layer (layer 0 first).
// Errors: per-entry lists of the wrong length, a destination index out of range or
// without data, too few destination blocks, and plan_layer_copy's.
Result<std::vector<std::vector<std::vector<CopyRun>>>> plan_export(const KvLayout& l, int32_t src_blocks,
                                                                   const KvExport& exp, std::span<const ExportSeq> seqs);

// Every layer's plan, layer 0 first (what a hand-off between GPUs issues, one layer
// at a time, after prefill finishes that layer).
Result<std::vector<std::vector<CopyRun>>> plan_copy(const KvLayout& l, int32_t src_blocks, int32_t dst_blocks,
                                                    std::span<const int32_t> src, std::span<const int32_t> dst);

}  // namespace duet
