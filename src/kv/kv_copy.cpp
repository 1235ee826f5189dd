#include "kv/kv_copy.h"

#include <unordered_set>

namespace duet {

Result<std::vector<CopyRun>> plan_layer_copy(const KvLayout& l, int32_t src_blocks, int32_t dst_blocks,
                                             std::span<const int32_t> src, std::span<const int32_t> dst,
                                             int32_t layer) {
    if (src.size() != dst.size())
        return make_error("KV copy: {} source blocks for {} destination blocks", src.size(), dst.size());
    if (layer < 0 || layer >= l.n_layer) return make_error("KV copy: layer {} of {}", layer, l.n_layer);
    const uint64_t tile = l.tile_bytes();
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

Status append_written_blocks(std::span<const int32_t> blocks, std::span<const int32_t> dst, int64_t from, int64_t n,
                             int32_t block_tokens, std::vector<int32_t>& src_out, std::vector<int32_t>& dst_out) {
    if (n <= 0) return {};
    if (from < 0 || block_tokens <= 0) return make_error("KV copy: positions from {} in blocks of {}", from, block_tokens);
    const int64_t first = from / block_tokens, last = (from + n - 1) / block_tokens;
    if (last >= static_cast<int64_t>(blocks.size()))
        return make_error("KV copy: position {} is past the sequence's {} blocks", from + n - 1, blocks.size());
    if (last >= static_cast<int64_t>(dst.size()))
        return make_error("KV copy: {} destination blocks for positions up to {} (block {})", dst.size(), from + n - 1, last);
    for (int64_t i = first; i <= last; ++i) {
        src_out.push_back(blocks[static_cast<size_t>(i)]);
        dst_out.push_back(dst[static_cast<size_t>(i)]);
    }
    return {};
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

Result<std::vector<std::vector<std::vector<CopyRun>>>> plan_export(const KvLayout& l, int32_t src_blocks,
                                                                   const KvExport& exp, std::span<const ExportSeq> seqs) {
    if (exp.dest.size() != seqs.size() || exp.dst_ids.size() != seqs.size())
        return make_error("KV export: {} destinations and {} block lists for {} sequences", exp.dest.size(),
                          exp.dst_ids.size(), seqs.size());
    std::vector<std::vector<int32_t>> src(exp.dests.size()), dst(exp.dests.size());
    for (size_t s = 0; s < seqs.size(); ++s) {
        const int32_t d = exp.dest[s];
        if (d < 0) continue;
        if (static_cast<size_t>(d) >= exp.dests.size() || !exp.dests[static_cast<size_t>(d)].data)
            return make_error("KV export: sequence {} names destination {} of {}", s, d, exp.dests.size());
        if (Status st = append_written_blocks(seqs[s].blocks, exp.dst_ids[s], 0, seqs[s].n_tokens, l.block_tokens,
                                              src[static_cast<size_t>(d)], dst[static_cast<size_t>(d)]);
            !st)
            return make_error("KV export: sequence {}: {}", s, st.error().message);
    }
    std::vector<std::vector<std::vector<CopyRun>>> out;
    for (size_t d = 0; d < exp.dests.size(); ++d) {
        auto p = plan_copy(l, src_blocks, exp.dests[d].n_blocks, src[d], dst[d]);
        if (!p) return p.error();
        out.push_back(std::move(*p));
    }
    return out;
}

}  // namespace duet
