// The compute backend interface: one forward pass over a batch of sequences, each
// at its own position with any number of new tokens, so prefill chunks and decode
// steps share one path.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "base/result.h"
#include "kv/kv_pool.h"

namespace duet {

// One sequence's share of a batch: tokens at positions [kv->n_tokens(),
// kv->n_tokens() + n_tokens). On success the KV of those positions is in the
// sequence's blocks and kv->n_tokens() has advanced.
struct SeqBatch {
    KvSeq* kv = nullptr;
    const int32_t* tokens = nullptr;
    int32_t n_tokens = 0;
    bool all_logits = false;  // logits for every token; otherwise only the last
};

class Backend {
public:
    virtual ~Backend() = default;
    // logits receives, in batch order, n_tokens rows per sequence with all_logits
    // and one row otherwise; each row holds n_vocab floats. A sequence's logits do
    // not depend on the rest of the batch nor on how its tokens were chunked.
    virtual Status forward(std::span<SeqBatch> batch, std::vector<float>& logits) = 0;
    virtual int64_t n_vocab() const = 0;
};

}  // namespace duet
