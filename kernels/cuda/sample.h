// Token sampling on the GPU: the CPU sampler's picks (src/model/sampler.h) without
// copying the logits to the host. Per row: its constraints (the tokens an allowed
// bitset lacks -inf, then a bias or ban added per token: model/sampler.h
// TokenConstraints, token_adds), the penalties, both as one list of per-token edits
// (src/model/sampler.h penalty_edits, made on the host), temperature, top-k,
// top-p, min-p, then the draw u (sample_uniform(seed, position), made on the host:
// the same u as the CPU's). The candidates are ordered as the CPU orders them (best
// first, ties to the lower id, once top-k or top-p sorted them; by id otherwise), so
// the draw lands on the CPU's token; sums are taken in double, in another order than
// the CPU's, so a pick can differ only where u falls within rounding (about 1e-15 of
// the total) of a boundary between two tokens.
//
// A row whose candidates must be sorted beyond kSampleMaxSorted (a top_k above it,
// or a top_p whose mass needs more of the best tokens), or whose every logit is -inf
// once edited (its constraints leave nothing to choose), is not sampled here: its
// pick is -1 and the caller samples it on the host from its logits (which says -1
// again for nothing to choose).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace duet::cuda {

inline constexpr int kSampleMaxSorted = 4096;

struct SampleRow {
    int32_t row = 0;       // the logits row
    float inv_temp = 0;    // 1 / temperature; 0: greedy (the largest penalized logit, lowest id on ties)
    int32_t top_k = 0;     // 0: off
    float top_p = 1.0f;    // 1: off
    float log_min_p = 0;   // std::log(min_p) in float; used when min_p > 0
    int32_t min_p_on = 0;
    float rep = 1.0f;      // the repetition penalty
    int32_t edit_begin = 0, edit_count = 0;  // its edits in the edits array
    int32_t mask_begin = -1;  // its allowed bitset's first word in the masks array (n_vocab bits); -1: none
    double u = 0;          // the uniform draw in [0, 1)
};

// One token's edit, applied after the mask: logit = rep(logit + add) - sub, where
// rep divides a positive logit by the row's repetition penalty and multiplies a
// negative one (when rep is set), add is left out when 0, and an add of -inf (a
// ban) sets the logit to -inf (model/sampler.h apply_token_add).
struct SampleEdit {
    int32_t token;
    int32_t rep;
    float sub;
    float add;
};

// Bytes of device scratch sample_rows needs for n_rows rows of n_vocab logits.
size_t sample_workspace_bytes(int n_rows, int64_t n_vocab);

// picks[i] = the token the CPU sampler picks for rows[i] (or -1: sample it on the
// host), for n_rows rows of logits (each n_vocab floats; not modified). masks: the
// rows' allowed bitsets (null when no row has one).
cudaError_t sample_rows(const float* logits, int64_t n_vocab, const SampleRow* rows, int n_rows,
                        const SampleEdit* edits, const uint32_t* masks, int32_t* picks, void* workspace,
                        cudaStream_t stream);

}  // namespace duet::cuda
