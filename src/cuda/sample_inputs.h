// The device sampler's inputs for one row (kernels/cuda/sample.h) from a request's
// sampling parameters: what the CPU sampler derives from them (1 / temperature and
// log(min_p) in float, the draw sample_uniform(seed, position)) and its penalties as
// per-token edits. Built only with DUET_CUDA.
#pragma once

#include <cstdint>
#include <vector>

#include "model/backend.h"
#include "kernels/cuda/sample.h"

namespace duet {

// Row `row` of the logits sampled for s; its penalty edits appended to edits.
cuda::SampleRow sample_row_for(const SampleRequest& s, int32_t row, int64_t n_vocab, std::vector<cuda::SampleEdit>& edits);

}  // namespace duet
