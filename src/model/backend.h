// The compute backend interface: one forward pass over a batch of sequences, each
// at its own position with any number of new tokens, so prefill chunks and decode
// steps share one path.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "base/result.h"
#include "kv/kv_copy.h"
#include "kv/kv_pool.h"
#include "model/sampler.h"

namespace duet {

class Model;

// What sampling a sequence's next token needs (Sampler::sample's arguments but the row).
struct SampleRequest {
    const SamplingParams* params = nullptr;
    std::span<const int32_t> prompt, output;  // the request's tokens so far (penalties)
    uint64_t index = 0;                        // the output position being sampled
    TokenConstraints constraints{};            // bias, bans, allowed tokens (empty: none)
};

// One sequence's share of a batch: tokens at positions [kv->n_tokens(),
// kv->n_tokens() + n_tokens). On success the KV of those positions is in the
// sequence's blocks and kv->n_tokens() has advanced.
struct SeqBatch {
    KvSeq* kv = nullptr;
    const int32_t* tokens = nullptr;
    int32_t n_tokens = 0;
    bool all_logits = false;  // logits for every token; otherwise only the last
    // Only the argmax of this sequence's row is wanted (greedy sampling without
    // penalties or log-probabilities): through forward_pick, a backend may leave
    // the row out of `logits` (its values are then unspecified) and give the argmax
    // alone. A GPU backend saves copying n_vocab floats per row to the host.
    bool argmax_only = false;
    // Sample this sequence's next token in the pass: through forward_pick, the pick
    // of its (last) row is the token Sampler::sample gives for this request, and the
    // backend may leave the row out of `logits` (a GPU backend samples on the device).
    const SampleRequest* sample = nullptr;

    // Logit rows this entry has in a pass's output.
    int64_t output_rows() const { return n_tokens == 0 ? 0 : (all_logits ? n_tokens : 1); }
};

class Backend {
public:
    virtual ~Backend() = default;
    // logits receives, in batch order, n_tokens rows per sequence with all_logits
    // and one row otherwise; each row holds n_vocab floats. A sequence's logits do
    // not depend on the rest of the batch nor on how its tokens were chunked.
    virtual Status forward(std::span<SeqBatch> batch, std::vector<float>& logits) = 0;
    // forward(), also giving a pick for every output row: the sampled token for the
    // row of an entry with `sample` (Sampler::sample under its constraints; -1 where
    // they leave nothing to choose), else the index of the row's largest logit, the
    // lowest on ties (the sampler's greedy pick). Rows of argmax_only or sample
    // entries may be left out of `logits`. The default computes the picks from
    // forward's logits on the host.
    virtual Status forward_pick(std::span<SeqBatch> batch, std::vector<float>& logits, std::vector<int32_t>& picks);
    // forward(), also copying every block of the exported sequences into other
    // arenas (kv_copy.h KvExport: a hand-off to a decode worker that keeps its KV
    // elsewhere); returns once everything has landed. On error nothing is exported
    // and the batch is as before. The default: an error (the backend cannot).
    virtual Status forward_export(std::span<SeqBatch> batch, std::vector<float>& logits, const KvExport& exp);
    virtual int64_t n_vocab() const = 0;
    // A check between layers: when `stop` returns true, the pass in progress ends
    // there and forward returns ErrorKind::Interrupted with the batch as before the
    // call (no position appended; KV rows written for the stopped positions lie past
    // each sequence's end, to be written again). Consulted only in the first half of
    // a pass's layers (at most half of it is computed for nothing), from one of the
    // backend's threads while the caller waits in forward. Empty: never. The default
    // ignores it (the CUDA backend's passes are short and run as queued kernels).
    virtual void set_interrupt(std::function<bool()> stop) { (void)stop; }
    // Returns once everything this backend queued on its device (copy-on-write block
    // copies included) has finished: before another stream reads its KV (a swap's
    // pull). The CPU backend queues nothing.
    virtual Status sync() { return {}; }

protected:
    Sampler host_sampler_;  // forward_pick's host sampling
};

// The KV layout a model needs (its layers, KV heads and head size), values stored as
// dtype, block_tokens positions a block: what every backend's cache and every arena
// of its serving instance are made with.
KvLayout kv_layout(const Model& model, KvDtype dtype = KvDtype::F16, int32_t block_tokens = 16);

}  // namespace duet
