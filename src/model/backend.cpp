#include "model/backend.h"

#include "model/model.h"

namespace duet {

Status Backend::forward_pick(std::span<SeqBatch> batch, std::vector<float>& logits, std::vector<int32_t>& picks) {
    if (Status st = forward(batch, logits); !st) return st;
    const int64_t nv = n_vocab();
    const size_t rows = nv > 0 ? logits.size() / static_cast<size_t>(nv) : 0;
    picks.resize(rows);
    for (size_t r = 0; r < rows; ++r) {
        const float* row = logits.data() + r * static_cast<size_t>(nv);
        int64_t best = 0;
        for (int64_t t = 1; t < nv; ++t)
            if (row[t] > row[best]) best = t;  // first of equals: the lowest id
        picks[r] = static_cast<int32_t>(best);
    }
    size_t r = 0;
    for (const SeqBatch& b : batch) {
        r += static_cast<size_t>(b.output_rows());
        if (b.sample && b.n_tokens > 0) {
            const SampleRequest& s = *b.sample;
            picks[r - 1] = host_sampler_.sample(logits.data() + (r - 1) * static_cast<size_t>(nv), nv, *s.params,
                                                s.prompt, s.output, s.index, s.constraints);
        }
    }
    return {};
}

Status Backend::forward_export(std::span<SeqBatch>, std::vector<float>&, const KvExport&) {
    return make_error("this backend cannot copy KV into another arena");
}

KvLayout kv_layout(const Model& model, KvDtype dtype, int32_t block_tokens) {
    const ModelConfig& c = model.config();
    KvLayout l;
    l.n_layer = static_cast<int32_t>(c.n_layer);
    l.n_head_kv = static_cast<int32_t>(c.n_head_kv);
    l.head_dim = static_cast<int32_t>(c.head_dim);
    l.block_tokens = block_tokens;
    l.dtype = dtype;
    return l;
}

}  // namespace duet
