// Conversations kept as token sequences (contexts, /v1/contexts and
// /v1/chat/completions with "context"): the tokens that start a conversation, the
// tokens that continue one already rendered with more messages, and the tokens that
// close an assistant reply the model generated.
//
// The rule a context's chat rests on: the tokens of a conversation rendered whole
// equal the tokens of its first part followed by the tokens added for the rest, so
// that a context built turn by turn holds what one render of the whole conversation
// would give. It holds for the templates duet knows when each message is rendered
// on its own (ChatML, Llama 3); continue() checks it on every call, by rendering a
// fixed earlier conversation with and without the new messages, and refuses, saying
// why, when the longer render's tokens do not start with the shorter one's (a
// template that rewrites earlier turns, or a tokenization that merges across the
// boundary).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "base/result.h"
#include "model/chat_template.h"
#include "model/tokenizer.h"

namespace duet {

class ChatTurns {
public:
    ChatTurns(const ChatTemplate& tmpl, const Tokenizer& tok) : tmpl_(tmpl), tok_(tok) {}

    // The tokens of `messages` as a whole conversation (BOS, the template's default
    // system message): a context's first messages.
    Result<std::vector<int32_t>> start(std::span<const ChatMessage> messages, bool add_generation_prompt) const;
    // The tokens that follow a rendered conversation when `messages` are added to it
    // (and, with add_generation_prompt, the assistant's turn opened).
    Result<std::vector<int32_t>> more(std::span<const ChatMessage> messages, bool add_generation_prompt) const;
    // start() for an empty context, more() for one that has tokens.
    Result<std::vector<int32_t>> extend(size_t context_tokens, std::span<const ChatMessage> messages,
                                        bool add_generation_prompt) const {
        return context_tokens == 0 ? start(messages, add_generation_prompt) : more(messages, add_generation_prompt);
    }
    // What follows a reply the model generated (`out`, opened by a generation
    // prompt) so that the conversation ends as the template ends an assistant
    // message: the template's closing tokens, less the first one when the reply
    // already ends with it (the end-of-turn token that stopped generation). ChatML:
    // "<|im_end|>\n", so "\n" after a reply that ended with <|im_end|>.
    Result<std::vector<int32_t>> close_reply(std::span<const int32_t> out) const;

private:
    std::vector<int32_t> encode(const std::string& text, bool whole) const;
    const ChatTemplate& tmpl_;
    const Tokenizer& tok_;
};

}  // namespace duet
