// Where a generation stops: the one rule every path that chooses a token applies
// (prefill's first token, decode's steps, a re-drive that finds its last token
// already written, Engine::generate), and the finish reason it leaves. The worker
// that chose the last token writes it in the request slot (ReqSlot::end_code); the
// front reports it as it is, and adds only what it decides itself (a stop string,
// the request's timeout, a cancellation).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

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

// OpenAI's finish_reason: "stop" (Eog, StopString), "length", and duet's
// "timeout" and "cancelled"; "" for None and Failed.
std::string_view finish_reason(Finish f);

}  // namespace duet
