#include "model/chat_turns.h"

#include <algorithm>
#include <string>

namespace duet {

namespace {

// The earlier conversation more() renders new messages after: a system message
// first (so no default system message depends on the new ones) and one exchange.
const std::vector<ChatMessage>& probe() {
    static const std::vector<ChatMessage> p = {
        {"system", "You are a probe."}, {"user", "Hello."}, {"assistant", "Hi."}};
    return p;
}

// Stands for a reply's text in close_reply's render: plain letters, so it is its
// own tokens whatever follows.
constexpr std::string_view kReplyMark = "duetreplymark";

}  // namespace

std::vector<int32_t> ChatTurns::encode(const std::string& text, bool whole) const {
    // As the front tokenizes a chat prompt: special tokens parsed, BOS added unless
    // the template writes it.
    return tok_.encode(text, whole && !tmpl_.includes_bos(), true);
}

Result<std::vector<int32_t>> ChatTurns::start(std::span<const ChatMessage> messages,
                                              bool add_generation_prompt) const {
    auto text = tmpl_.apply(messages, add_generation_prompt);
    if (!text) return make_error(ErrorKind::Invalid, "{}", text.error().message);
    return encode(*text, true);
}

Result<std::vector<int32_t>> ChatTurns::more(std::span<const ChatMessage> messages, bool add_generation_prompt) const {
    if (messages.empty()) return make_error(ErrorKind::Invalid, "no messages to add");
    std::vector<ChatMessage> longer = probe();
    longer.insert(longer.end(), messages.begin(), messages.end());
    auto before = tmpl_.apply(probe(), false);
    auto after = tmpl_.apply(longer, add_generation_prompt);
    if (!after) return make_error(ErrorKind::Invalid, "{}", after.error().message);
    if (!before) return before.error();
    const std::vector<int32_t> a = encode(*before, true), b = encode(*after, true);
    if (b.size() < a.size() || !std::equal(a.begin(), a.end(), b.begin()))
        return make_error(ErrorKind::Invalid,
                          "the chat template '{}' does not extend a conversation with these messages: the tokens of "
                          "the longer conversation do not start with those of the shorter one, so they cannot be "
                          "added to a context turn by turn; send the tokens (\"tokens\") or the text (\"prompt\")",
                          tmpl_.name());
    return std::vector<int32_t>(b.begin() + static_cast<std::ptrdiff_t>(a.size()), b.end());
}

Result<std::vector<int32_t>> ChatTurns::close_reply(std::span<const int32_t> out) const {
    std::vector<ChatMessage> conv = probe();
    conv.push_back({"user", "Again."});
    conv.push_back({"assistant", std::string(kReplyMark)});
    auto text = tmpl_.apply(conv, false);
    if (!text) return text.error();
    const size_t at = text->rfind(kReplyMark);
    if (at == std::string::npos)
        return make_error("the chat template '{}' does not write an assistant message's text", tmpl_.name());
    const std::string closing_text = text->substr(at + kReplyMark.size());
    std::vector<int32_t> closing = encode(closing_text, false);
    const std::vector<int32_t> whole = encode(*text, true);
    if (closing.size() > whole.size() || !std::equal(closing.rbegin(), closing.rend(), whole.rbegin()))
        return make_error(ErrorKind::Invalid,
                          "the chat template '{}' closes an assistant message with text whose tokens depend on the "
                          "reply; a reply cannot join a context",
                          tmpl_.name());
    if (!closing.empty() && !out.empty() && out.back() == closing.front()) closing.erase(closing.begin());
    return closing;
}

}  // namespace duet
