#include "model/chat_template.h"

#include <array>

namespace duet {

namespace {

constexpr std::array<std::string_view, 4> kNames = {"chatml", "smollm2", "qwen2", "llama3"};

// Written out in SmolLM2-Instruct's tokenizer.chat_template.
constexpr std::string_view kSmolLM2System = "You are a helpful AI assistant named SmolLM, trained by Hugging Face";
// Written out in Qwen2-Instruct's tokenizer.chat_template.
constexpr std::string_view kQwen2System = "You are a helpful assistant.";

std::string names_list() {
    std::string s;
    for (std::string_view n : kNames) {
        if (!s.empty()) s += ", ";
        s += n;
    }
    return s;
}

bool valid_role(std::string_view role) {
    if (role.empty()) return false;
    for (char c : role) {
        bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
        if (!ok) return false;
    }
    return true;
}

// Jinja's `trim` as llama.cpp's built-in llama3 template applies it: ASCII
// whitespace off both ends.
std::string_view trim(std::string_view s) {
    auto ws = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; };
    while (!s.empty() && ws(s.front())) s.remove_prefix(1);
    while (!s.empty() && ws(s.back())) s.remove_suffix(1);
    return s;
}

// A default system message written literally in a ChatML template:
// '<|im_start|>system\n' + text + '<|im_end|>' with no Jinja expression inside.
// The newline may be a real one or the two characters backslash-n (Jinja
// unescapes it in string literals; converters differ in which they store).
std::string find_default_system(std::string_view jinja) {
    for (std::string_view head : {std::string_view("<|im_start|>system\n"), std::string_view("<|im_start|>system\\n")}) {
        for (size_t at = jinja.find(head); at != std::string_view::npos; at = jinja.find(head, at + 1)) {
            size_t begin = at + head.size();
            size_t end = jinja.find("<|im_end|>", begin);
            if (end == std::string_view::npos) continue;
            std::string_view text = jinja.substr(begin, end - begin);
            if (text.empty() || text.find_first_of("{}'\"+\n\\") != std::string_view::npos) continue;
            return std::string(text);
        }
    }
    return {};
}

}  // namespace

std::span<const std::string_view> chat_template_names() { return kNames; }

std::string_view ChatTemplate::name() const {
    switch (format_) {
        case ChatFormat::ChatML: return "chatml";
        case ChatFormat::SmolLM2: return "smollm2";
        case ChatFormat::Qwen2: return "qwen2";
        case ChatFormat::Llama3: return "llama3";
    }
    return "?";
}

Result<ChatTemplate> ChatTemplate::from_name(std::string_view name) {
    if (name == "chatml") return ChatTemplate(ChatFormat::ChatML, "");
    if (name == "smollm2") return ChatTemplate(ChatFormat::SmolLM2, std::string(kSmolLM2System));
    if (name == "qwen2") return ChatTemplate(ChatFormat::Qwen2, std::string(kQwen2System));
    if (name == "llama3") return ChatTemplate(ChatFormat::Llama3, "");
    return make_error("unknown chat template '{}'; the built-in ones are: {}", name, names_list());
}

Result<ChatTemplate> ChatTemplate::detect(std::string_view jinja) {
    if (jinja.find("<|start_header_id|>") != std::string_view::npos &&
        jinja.find("<|end_header_id|>") != std::string_view::npos)
        return ChatTemplate(ChatFormat::Llama3, "");
    if (jinja.find("<|im_start|>") != std::string_view::npos) {
        std::string sys = find_default_system(jinja);
        if (jinja.find("SmolLM") != std::string_view::npos)
            return ChatTemplate(ChatFormat::SmolLM2, sys.empty() ? std::string(kSmolLM2System) : sys);
        if (jinja.find("Qwen") != std::string_view::npos || sys == kQwen2System)
            return ChatTemplate(ChatFormat::Qwen2, sys);
        return ChatTemplate(ChatFormat::ChatML, sys);
    }
    return make_error("the model's chat template is not one duet recognises (it knows ChatML and Llama-3 "
                      "style templates); pass --chat-template NAME with one of: {}", names_list());
}

Result<ChatTemplate> ChatTemplate::from_gguf(const GgufFile& f, std::string_view override_name) {
    if (!override_name.empty()) return from_name(override_name);
    const GgufValue* v = f.find("tokenizer.chat_template");
    if (!v || v->type != GgufType::STRING)
        return make_error("the model file has no tokenizer.chat_template; pass --chat-template NAME with one of: {}",
                          names_list());
    return detect(v->s);
}

Result<std::string> ChatTemplate::apply(std::span<const ChatMessage> messages, bool add_generation_prompt) const {
    if (messages.empty()) return make_error("a chat needs at least one message, got none");
    for (size_t i = 0; i < messages.size(); ++i) {
        std::string_view role = messages[i].role;
        if (!messages[i].tool_calls.empty())
            return make_error(
                "message {} has tool calls, which this template does not write (render them in the "
                "model's tool format first)",
                i);
        if (!valid_role(role))
            return make_error("message {} has role '{}'; a role is a non-empty word of letters, digits, '_' or '-' "
                              "(system, user, assistant, tool, ...)", i, role);
        if (format_ == ChatFormat::Llama3 && role != "system" && role != "user" && role != "assistant" &&
            role != "ipython" && role != "tool")
            return make_error("message {} has role '{}', which the llama3 template does not take "
                              "(system, user, assistant, ipython, tool)", i, role);
    }

    std::string out;
    if (format_ == ChatFormat::Llama3) {
        out += "<|begin_of_text|>";
        for (const ChatMessage& m : messages) {
            out += "<|start_header_id|>";
            out += m.role;
            out += "<|end_header_id|>\n\n";
            out += trim(m.content);
            out += "<|eot_id|>";
        }
        if (add_generation_prompt) out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
        return out;
    }

    if (!default_system_.empty() && messages.front().role != "system") {
        out += "<|im_start|>system\n";
        out += default_system_;
        out += "<|im_end|>\n";
    }
    for (const ChatMessage& m : messages) {
        out += "<|im_start|>";
        out += m.role;
        out += "\n";
        out += m.content;
        out += "<|im_end|>\n";
    }
    if (add_generation_prompt) out += "<|im_start|>assistant\n";
    return out;
}

}  // namespace duet
