// Token sampling: greedy, temperature, top-k, top-p, min-p, and repetition /
// frequency / presence penalties.
//
// The random draw for output token i of a request depends only on (seed, i), so
// a request gives the same tokens whatever batch it runs in, and a request
// re-driven after a worker crash continues the same stream.
//
// Order of operations (vLLM's, OpenAI semantics): penalties on the raw logits,
// then temperature, then top-k, top-p and min-p filters on the tempered
// distribution, then one draw. temperature 0 is greedy (ties: lowest id).
#pragma once

#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "base/result.h"

namespace duet {

struct SamplingParams {
    float temperature = 1.0f;        // 0: greedy
    int32_t top_k = 0;               // 0: off
    float top_p = 1.0f;              // 1: off
    float min_p = 0.0f;              // 0: off
    float repetition_penalty = 1.0f; // 1: off; over prompt and output tokens
    float frequency_penalty = 0.0f;  // over output tokens
    float presence_penalty = 0.0f;   // over output tokens
    uint64_t seed = 0;

    // An Error naming the parameter and its allowed range.
    Status validate() const;
};

// A uniform draw in [0, 1) for output token `index` of a request with `seed`.
double sample_uniform(uint64_t seed, uint64_t index);

// The penalties of a request as per-token edits of its logits, one entry per
// distinct token they touch: logit = (rep ? (logit > 0 ? logit / r : logit * r) :
// logit) - sub, r the repetition penalty. The CPU sampler applies these, and a GPU
// sampler gets the same list, so both see the same penalized logits.
struct PenaltyEdit {
    int32_t token;
    int32_t rep;  // 1: the repetition penalty applies (the token is in the prompt or output)
    float sub;    // frequency_penalty * count + presence_penalty for output tokens, else 0
};
bool has_penalties(const SamplingParams& p);
void penalty_edits(const SamplingParams& p, int64_t n_vocab, std::span<const int32_t> prompt,
                   std::span<const int32_t> output, std::vector<PenaltyEdit>& out);

// A bias on one token's logit (OpenAI's logit_bias).
struct TokenBias {
    int32_t token = 0;
    float bias = 0;
    friend bool operator==(const TokenBias&, const TokenBias&) = default;
};

// What a request allows its next token to be, applied to the raw logits before the
// penalties and the sampler's own steps, the same on the CPU and on a GPU (a GPU
// sampler gets token_adds' list and the same bitset). Ids outside the vocabulary are
// ignored.
struct TokenConstraints {
    std::span<const TokenBias> bias;    // added to these tokens' logits
    std::span<const int32_t> banned;    // these may not be picked (min_tokens' end-of-generation tokens)
    std::span<const uint32_t> allowed;  // empty: every token; else bit t % 32 of word t / 32 set: t may be picked
    bool empty() const { return bias.empty() && banned.empty() && allowed.empty(); }
};

// Bans, in a row of n logits, every token the bitset (as TokenConstraints::allowed,
// non-empty; a grammar's GrammarSet::allowed) does not allow: its logit becomes
// -inf. Returns how many allowed tokens keep a logit above -inf (0: nothing can be
// chosen). Word by word: a word of none allowed is filled, one of all allowed is left.
int64_t apply_token_mask(float* row, int64_t n, std::span<const uint32_t> bits);

// The bias and bans as one edit per token, in id order: a token's biases summed in
// list order (a float sum, then added once), a banned token's add -inf, which sets
// its logit to -inf (whatever the logit was). The CPU sampler applies these to the
// raw logits (apply_token_add); a GPU sampler merges them into its edits.
struct TokenAdd {
    int32_t token;
    float add;
};
void token_adds(const TokenConstraints& c, int64_t n_vocab, std::vector<TokenAdd>& out);
// A logit after a TokenAdd: -inf for a ban, x + add otherwise (x itself for add 0).
inline float apply_token_add(float x, float add) {
    return add == -std::numeric_limits<float>::infinity() ? add : add != 0.0f ? x + add : x;
}

class Sampler {
public:
    // Picks a token from logits[n_vocab]. prompt and output are the request's
    // tokens so far (for penalties); index is the output position being sampled.
    int32_t sample(const float* logits, int64_t n_vocab, const SamplingParams& p,
                   std::span<const int32_t> prompt, std::span<const int32_t> output, uint64_t index);
    // The same pick under constraints: the tokens `allowed` lacks set to -inf, then
    // token_adds' additions, then sample() as above (penalties on the results). -1:
    // no token is left above -inf (nothing can be chosen). The logits are not changed.
    int32_t sample(const float* logits, int64_t n_vocab, const SamplingParams& p, std::span<const int32_t> prompt,
                   std::span<const int32_t> output, uint64_t index, const TokenConstraints& c);

private:
    struct Cand {
        float logit;
        int32_t id;
    };
    std::vector<Cand> cand_;
    std::vector<float> work_;
    std::vector<PenaltyEdit> edits_;
    std::vector<float> constrained_;  // the row under constraints
    std::vector<TokenAdd> adds_;
};

}  // namespace duet
