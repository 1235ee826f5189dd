// The device sampler's inputs for one row (kernels/cuda/sample.h) from a request's
// sampling parameters: what the CPU sampler derives from them (1 / temperature and
// log(min_p) in float, the draw sample_uniform(seed, position)), its penalties and
// its constraints' bias and bans as per-token edits (one per token), and its allowed
// bitset. Built only with DUET_CUDA.
#pragma once

#include <cstdint>
#include <vector>

#include "model/backend.h"
#include "kernels/cuda/sample.h"

namespace duet {

// Row `row` of the logits sampled for s; its edits appended to edits, and its
// allowed bitset, if it has one, to masks (n_vocab bits: words the request's lacks
// allow nothing).
cuda::SampleRow sample_row_for(const SampleRequest& s, int32_t row, int64_t n_vocab,
                               std::vector<cuda::SampleEdit>& edits, std::vector<uint32_t>& masks);

}  // namespace duet
