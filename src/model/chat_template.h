// Chat templates: a list of messages -> the prompt text a model was trained on.
//
// duet does not run Jinja. It knows a few formats and recognises a model's
// `tokenizer.chat_template` by distinctive substrings, or takes a format by name
// (`--chat-template NAME`):
//
//   chatml   <|im_start|>{role}\n{content}<|im_end|>\n ... ; generation prompt
//            <|im_start|>assistant\n
//   smollm2  chatml, and when the first message is not a system message the
//            system message "You are a helpful AI assistant named SmolLM,
//            trained by Hugging Face" goes first (SmolLM2-Instruct's template)
//   qwen2    chatml with Qwen2-Instruct's default system message "You are a
//            helpful assistant."; when detected from a template, the default
//            system message written in that template (e.g. Qwen2.5's "You are
//            Qwen, created by Alibaba Cloud. ...") or none
//   llama3   <|begin_of_text|> then <|start_header_id|>{role}<|end_header_id|>\n\n
//            {content, whitespace-trimmed}<|eot_id|> ... ; generation prompt
//            <|start_header_id|>assistant<|end_header_id|>\n\n
//
// The output is text with the special tokens written out: tokenize it with
// parse_special = true, and with add_special = false when includes_bos() (the
// Llama-3 text already starts with <|begin_of_text|>). Message contents are not
// escaped: a content holding "<|im_end|>" becomes that token when tokenized with
// parse_special (llama.cpp and HF behave the same way).
#pragma once

#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/result.h"
#include "model/gguf.h"

namespace duet {

// A function call an assistant message made (the OpenAI API's tool_calls): the
// arguments are JSON text, as the model wrote them.
struct ChatToolCall {
    std::string id, name, arguments;
    friend bool operator==(const ChatToolCall&, const ChatToolCall&) = default;
};

struct ChatMessage {
    ChatMessage() = default;
    ChatMessage(std::string r, std::string c) : role(std::move(r)), content(std::move(c)) {}
    std::string role;
    std::string content;
    // An assistant's calls, and a tool message's answer to one: the templates here
    // do not write them (apply() refuses them); roles/tool_calls.h renders them into
    // plain messages in the model's tool format first.
    std::vector<ChatToolCall> tool_calls;
    std::string tool_call_id;
};

enum class ChatFormat { ChatML, SmolLM2, Qwen2, Llama3 };

class ChatTemplate {
public:
    // One of chat_template_names().
    static Result<ChatTemplate> from_name(std::string_view name);
    // Recognises a Jinja chat template (a model's tokenizer.chat_template).
    static Result<ChatTemplate> detect(std::string_view jinja);
    // override_name if not empty, else detect() on the file's
    // tokenizer.chat_template.
    static Result<ChatTemplate> from_gguf(const GgufFile& f, std::string_view override_name = {});

    // Errors on an empty list, on a message with tool calls (render them first:
    // roles/tool_calls.h), and on a role that is empty or not made of [A-Za-z0-9_-]. ChatML formats pass any such role
    // through (e.g. "tool"); Llama-3 takes system, user, assistant, ipython and tool.
    Result<std::string> apply(std::span<const ChatMessage> messages, bool add_generation_prompt) const;

    ChatFormat format() const { return format_; }
    std::string_view name() const;
    // The system message put first when the conversation has none ("" = none).
    const std::string& default_system() const { return default_system_; }
    bool includes_bos() const { return format_ == ChatFormat::Llama3; }

private:
    ChatTemplate(ChatFormat f, std::string default_system)
        : format_(f), default_system_(std::move(default_system)) {}

    ChatFormat format_;
    std::string default_system_;
};

// The names from_name() takes, for help texts and error messages.
std::span<const std::string_view> chat_template_names();

}  // namespace duet
