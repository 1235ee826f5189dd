#include "kv/kv_copy.h"

#include <unordered_set>

namespace duet {

Result<std::vector<CopyRun>> plan_layer_copy(const KvLayout& l, int32_t src_blocks, int32_t dst_blocks,
                                             std::span<const int32_t> src, std::span<const int32_t> dst,
                                             int32_t layer) {
    if (src.size() != dst.size())
        return make_error("KV copy: {} source blocks for {} destination blocks", src.size(), dst.size());
    if (layer < 0 || layer >= l.n_layer) return make_error("KV copy: layer {} of {}", layer, l.n_layer);
    const uint64_t tile = l.tile_elems() * sizeof(uint16_t);
    std::unordered_set<int32_t> seen;
    std::vector<CopyRun> runs;
    for (size_t i = 0; i < src.size(); ++i) {
        if (src[i] < 0 || src[i] >= src_blocks)
            return make_error("KV copy: source block {} of an arena of {}", src[i], src_blocks);
        if (dst[i] < 0 || dst[i] >= dst_blocks)
            return make_error("KV copy: destination block {} of an arena of {}", dst[i], dst_blocks);
        if (!seen.insert(dst[i]).second) return make_error("KV copy: destination block {} named twice", dst[i]);
        const uint64_t s = (static_cast<uint64_t>(layer) * static_cast<uint64_t>(src_blocks) + static_cast<uint64_t>(src[i])) * tile;
        const uint64_t d = (static_cast<uint64_t>(layer) * static_cast<uint64_t>(dst_blocks) + static_cast<uint64_t>(dst[i])) * tile;
        if (!runs.empty() && runs.back().src + runs.back().bytes == s && runs.back().dst + runs.back().bytes == d)
            runs.back().bytes += tile;
        else
            runs.push_back({s, d, tile});
    }
    return runs;
}

Result<std::vector<std::vector<CopyRun>>> plan_copy(const KvLayout& l, int32_t src_blocks, int32_t dst_blocks,
                                                    std::span<const int32_t> src, std::span<const int32_t> dst) {
    std::vector<std::vector<CopyRun>> plan;
    for (int32_t layer = 0; layer < l.n_layer; ++layer) {
        auto p = plan_layer_copy(l, src_blocks, dst_blocks, src, dst, layer);
        if (!p) return p.error();
        plan.push_back(std::move(*p));
    }
    return plan;
}

}  // namespace duet
