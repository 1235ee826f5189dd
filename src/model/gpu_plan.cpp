#include "model/gpu_plan.h"

#include <algorithm>
#include <set>

#include "model/model.h"

namespace duet {

Result<DeviceArenaPlan> plan_device_arena(const KvLayout& l, uint64_t free_bytes, double fraction, uint64_t weight_bytes,
                                          uint64_t reserve_bytes, uint64_t granularity) {
    if (!(fraction > 0.0 && fraction <= 1.0)) return make_error("KV memory fraction must be in (0, 1], got {}", fraction);
    if (granularity == 0) return make_error("allocation granularity 0");
    DeviceArenaPlan p;
    p.block_bytes = l.block_bytes();
    if (p.block_bytes == 0) return make_error("a KV block of 0 bytes (layout {} layers, {} heads, dim {})", l.n_layer, l.n_head_kv, l.head_dim);
    const double usable = static_cast<double>(free_bytes) * fraction;
    const double need = static_cast<double>(weight_bytes) + static_cast<double>(reserve_bytes);
    const uint64_t budget = usable > need ? static_cast<uint64_t>(usable - need) : 0;
    // Whole granules that fit the budget, then the blocks they hold.
    const uint64_t bytes = budget / granularity * granularity;
    const uint64_t blocks = std::min<uint64_t>(bytes / p.block_bytes, UINT32_MAX);
    if (blocks == 0)
        return make_error("no room for KV: {:.2f} GiB free x {} = {:.2f} GiB, weights {:.2f} GiB, scratch {:.2f} GiB, "
                          "one block {:.2f} MiB",
                          free_bytes / 1073741824.0, fraction, usable / 1073741824.0, weight_bytes / 1073741824.0,
                          reserve_bytes / 1073741824.0, p.block_bytes / 1048576.0);
    p.n_blocks = static_cast<uint32_t>(blocks);
    p.bytes = (blocks * p.block_bytes + granularity - 1) / granularity * granularity;
    return p;
}

uint64_t bf16_weight_bytes(const Model& m) {
    std::set<const GgufTensor*> seen;
    uint64_t bytes = 0;
    auto add = [&](const GgufTensor* t, uint64_t per) {
        if (t && seen.insert(t).second) bytes += static_cast<uint64_t>(t->n_elements()) * per;
    };
    add(&m.tok_embd(), 2);
    add(&m.output(), 2);
    add(&m.output_norm(), 4);
    for (int64_t l = 0; l < m.config().n_layer; ++l) {
        const LayerWeights& w = m.layer(l);
        for (const GgufTensor* t : {w.wq, w.wk, w.wv, w.wo, w.w_gate, w.w_up, w.w_down}) add(t, 2);
        for (const GgufTensor* t : {w.attn_norm, w.ffn_norm, w.bq, w.bk, w.bv}) add(t, 4);
    }
    return bytes;
}

std::vector<int> decode_graph_buckets(int max_batch) {
    std::vector<int> b;
    for (int n : {1, 2, 4})
        if (n < max_batch) b.push_back(n);
    for (int n = 8; n < max_batch; n += 8) b.push_back(n);
    if (max_batch >= 1) b.push_back(max_batch);
    return b;
}

std::vector<int32_t> attention_query_tiles(std::span<const int32_t> query_seq, int tile) {
    std::vector<int32_t> out;
    const int32_t n = static_cast<int32_t>(query_seq.size());
    for (int32_t i = 0; i < n;) {
        int32_t k = 1;
        while (i + k < n && k < tile && query_seq[static_cast<size_t>(i + k)] == query_seq[static_cast<size_t>(i)]) ++k;
        out.push_back(i);
        out.push_back(k);
        i += k;
    }
    return out;
}

int graph_bucket(const std::vector<int>& buckets, int n) {
    auto it = std::lower_bound(buckets.begin(), buckets.end(), n);
    return it == buckets.end() ? -1 : *it;
}

}  // namespace duet
