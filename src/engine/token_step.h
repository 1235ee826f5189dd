// The token path's one step (emit: a token picked under a sequence's rules) and
// where a generation stops: the one rule every path that chooses a token applies
// (prefill's first token, decode's steps, a re-drive that finds its last token
// already written, Engine::generate), and the finish reason it leaves. The worker
// that chose the last token writes it in the request slot (ReqSlot::end_code); the
// front reports it as it is, and adds only what it decides itself (a stop string,
// the request's timeout, a cancellation).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "model/sampler.h"

namespace duet {

enum class Finish : uint8_t {
    None = 0,        // not finished (or, in an older slot, not said)
    Length = 1,      // max_tokens reached, or the context full
    Eog = 2,         // an end-of-generation token, with stop_at_eog
    StopString = 3,  // a stop string (the front's text-level match)
    Timeout = 4,     // the request's timeout (duet's extension)
    Cancelled = 5,   // ended by someone else (duet's extension)
    // Not a finish reason: the request's data (its grammar) could not be honoured at
    // this token, and the request FAILED (ReqError::Data) instead of going on
    // without it.
    Failed = 6,
};

struct StopRules {
    uint64_t max_tokens = 0;  // outputs at most
    bool stop_at_eog = true;
    uint64_t min_tokens = 0;  // outputs before an end-of-generation token may be chosen
};

// Whether output number n_out + 1 may not be an end-of-generation token (min_tokens
// not reached): the picker sets those tokens' logits to -inf before sampling.
bool eog_banned(const StopRules& r, size_t n_out);

// The finish once a token is output number n_out (n_out counts it); eog: the
// token is an end-of-generation one (Tokenizer::is_eog). Eog before Length, so a
// last allowed token that ends the generation says "stop".
Finish check_stop(const StopRules& r, bool eog, size_t n_out);

// A sequence's rules for its next token: when it stops, and what it may be (its
// biases, its bans, a grammar's allowed set: model/sampler.h TokenConstraints, the
// end-of-generation ids banned while eog_banned says so).
struct TokenRules {
    StopRules stop;
    TokenConstraints constraints;
};

struct Emitted {
    int32_t token = -1;
    Finish finish = Finish::None;
};

// The one way a token is decided (prefill's first token, decode's, a verify row's
// positions, Engine::generate and so `duet run`): the backend's pick (picked >= 0,
// made on its device under the same constraints) or the sampler's draw from `row`
// for output number output.size() + 1 under rules.constraints, then check_stop's
// verdict with it as that output; eog: whether a token ends the generation
// (Tokenizer::is_eog). {-1, Failed} when the constraints leave no token. What the
// token then does (its slot write, log-probabilities, a stop string it completes)
// is the caller's.
template <class Eog>
Emitted emit(Sampler& sampler, const float* row, int64_t n_vocab, int32_t picked, const SamplingParams& sampling,
             const TokenRules& rules, std::span<const int32_t> prompt, std::span<const int32_t> output, Eog&& eog) {
    const int32_t t =
        picked >= 0 ? picked : sampler.sample(row, n_vocab, sampling, prompt, output, output.size(), rules.constraints);
    if (t < 0) return {-1, Finish::Failed};
    return {t, check_stop(rules.stop, eog(t), output.size() + 1)};
}

// OpenAI's finish_reason: "stop" (Eog, StopString), "length", and duet's
// "timeout" and "cancelled"; "" for None and Failed.
std::string_view finish_reason(Finish f);

}  // namespace duet
