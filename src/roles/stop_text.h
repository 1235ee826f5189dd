// A choice's text on its way to the client: stop strings cut it, and streaming
// releases only what no stop string could still claim, never splitting a UTF-8
// character (OpenAI's `stop`: the text ends before the first stop string, which is
// not returned). It is fed the detokenized text of each new token: by the front, which
// cuts the text it sends, and by the worker that chooses the tokens, which ends the
// request at the token that completes a stop string (WorkerBase::draw); both feed the
// same pieces, so both find the same one.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "model/tokenizer.h"

namespace duet {

class StopText {
public:
    explicit StopText(std::vector<std::string> stops);
    // Appends generated text (nothing once stopped). True when this made the text
    // contain a stop string, one that ends in `piece`: the text is cut where it begins
    // and stays so. `check` false: appended without looking (a token before
    // min_tokens, as vLLM does); a stop string that ended there is not found later,
    // one that ends in a later piece is, wherever it began.
    bool append(std::string_view piece, bool check = true);
    bool stopped() const { return stopped_; }
    // The text so far, stop strings applied.
    const std::string& text() const { return text_; }
    // The next part to stream, empty if none: everything not yet taken when `all`
    // (the request ended) or stopped; otherwise all but the last (longest stop
    // string's length) bytes, which a stop string arriving later could still start
    // in, backed off to a UTF-8 character boundary.
    std::string take(bool all);
    size_t taken() const { return taken_; }

private:
    std::vector<std::string> stops_;
    size_t hold_ = 0;  // the longest stop string's length
    std::string text_;
    size_t taken_ = 0;  // bytes of text_ already streamed
    bool stopped_ = false;
};

// A choice's stop strings over its tokens: each output's text (a Detokenizer) fed to a
// StopText, looked for from output number min_tokens on (vLLM's rule). The front's
// Choice and the worker that chooses the tokens (WorkerBase::draw) each keep one, so
// the token the worker ends a request at is the one the front cuts the text at.
struct StopWatch {
    StopWatch(const Tokenizer& tok, std::vector<std::string> stops, uint64_t min_tokens)
        : detok(tok), text(std::move(stops)), min_tokens(min_tokens) {}
    // Output number n (from 1) is `token`: true when its text completes a stop string.
    bool push(int32_t token, size_t n) { return text.append(detok.push(token), n >= min_tokens); }
    // The text held back at the end (an unfinished UTF-8 sequence); true as push.
    bool finish() { return text.append(detok.finish()); }
    Detokenizer detok;
    StopText text;
    uint64_t min_tokens = 0;
};

}  // namespace duet
