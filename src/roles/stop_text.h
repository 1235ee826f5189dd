// A choice's text on its way to the client: stop strings cut it, and streaming
// releases only what no stop string could still claim, never splitting a UTF-8
// character (OpenAI's `stop`: the text ends before the first stop string, which is
// not returned). It is fed the detokenized text of each new token: by the front, which
// cuts the text it sends, and by the worker that chooses the tokens, which ends the
// request at the token that completes a stop string (WorkerBase::draw); both feed the
// same pieces, so both find the same one.
#pragma once

#include <string>
#include <string_view>
#include <vector>

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

}  // namespace duet
