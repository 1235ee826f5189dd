#include "roles/openai.h"

#include <optional>

#include <nlohmann/json.hpp>

namespace duet {

using nlohmann::json;

namespace {

ApiError bad(std::string param, std::string message) {
    ApiError e;
    e.param = std::move(param);
    e.message = std::move(message);
    return e;
}

// Reads an optional number field into out; an error if present with another type or
// outside [lo, hi].
template <typename T>
std::optional<ApiError> number(const json& j, const char* key, T& out, double lo, double hi) {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) return std::nullopt;
    if (!it->is_number()) return bad(key, std::string("'") + key + "' must be a number");
    if constexpr (std::is_integral_v<T>) {
        if (!it->is_number_integer()) return bad(key, std::string("'") + key + "' must be an integer");
    }
    double v = it->get<double>();
    if (v < lo || v > hi)
        return bad(key, fmt::format("'{}' must be between {} and {}, got {}", key, lo, hi, it->dump()));
    out = it->get<T>();
    return std::nullopt;
}

// Each reader below takes its fields from the body into r, or says what is wrong
// with the first bad one. parse_completion runs them in a fixed order, which is
// the order in which errors are reported.
using Field = std::optional<ApiError>;

// An optional boolean field.
Field boolean(const json& j, const char* key, bool& out) {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) return std::nullopt;
    if (!it->is_boolean()) return bad(key, std::string("'") + key + "' must be a boolean");
    out = it->get<bool>();
    return std::nullopt;
}

Field read_model(const json& j, CompletionRequest& r) {
    if (auto it = j.find("model"); it != j.end() && !it->is_null()) {
        if (!it->is_string()) return bad("model", "'model' must be a string");
        r.model = it->get<std::string>();
    }
    return std::nullopt;
}

Field read_messages(const json& j, CompletionRequest& r) { return read_chat_messages(j, r.messages); }

}  // namespace

// Chat: role and content of each message (content parts: only text is understood).
std::optional<ApiError> read_chat_messages(const json& j, std::vector<ChatMessage>& out) {
    auto it = j.find("messages");
    if (it == j.end() || !it->is_array() || it->empty())
        return bad("messages", "'messages' must be a non-empty array of {role, content} objects");
    for (const json& m : *it) {
        if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
            return bad("messages", "each message needs a string 'role'");
        ChatMessage msg;
        msg.role = m["role"].get<std::string>();
        const json& c = m.value("content", json(nullptr));
        if (c.is_string()) {
            msg.content = c.get<std::string>();
        } else if (c.is_array()) {
            for (const json& part : c) {
                if (!part.is_object() || part.value("type", "") != "text" || !part.contains("text") ||
                    !part["text"].is_string())
                    return bad("messages", "only text content parts ({\"type\": \"text\", \"text\": ...}) are supported");
                msg.content += part["text"].get<std::string>();
            }
        } else if (!c.is_null()) {
            return bad("messages", "a message's 'content' must be a string or an array of text parts");
        }
        out.push_back(std::move(msg));
    }
    return std::nullopt;
}

namespace {

// Completions: a string, an array of one string, or token ids.
Field read_prompt(const json& j, CompletionRequest& r) {
    auto it = j.find("prompt");
    if (it == j.end()) return bad("prompt", "'prompt' is required");
    if (it->is_string()) {
        r.prompt = it->get<std::string>();
    } else if (it->is_array() && it->size() == 1 && (*it)[0].is_string()) {
        r.prompt = (*it)[0].get<std::string>();
    } else if (it->is_array() && !it->empty() && ((*it)[0].is_number() || (*it)[0].is_array())) {
        // Token ids: [1, 2, 3], or one such array inside another.
        const json& ids = (*it)[0].is_array() && it->size() == 1 ? (*it)[0] : *it;
        for (const json& x : ids) {
            if (!x.is_number_integer() || x.get<int64_t>() < 0 || x.get<int64_t>() > INT32_MAX)
                return bad("prompt", "a token-id prompt must be an array of non-negative integers");
            r.prompt_ids.push_back(x.get<int32_t>());
        }
    } else {
        return bad("prompt", "'prompt' must be a string, an array of one string, or an array of token ids");
    }
    if (r.prompt.empty() && r.prompt_ids.empty()) return bad("prompt", "'prompt' is empty");
    return std::nullopt;
}

// max_tokens and the sampling parameters.
Field read_sampling(const json& j, CompletionRequest& r) {
    // max_completion_tokens (chat) takes precedence over the older max_tokens.
    for (const char* key : {"max_tokens", "max_completion_tokens"})
        if (auto e = number<int64_t>(j, key, r.max_tokens, 1, 1e9)) return *e;
    if (!r.chat && !j.contains("max_tokens")) r.max_tokens = 16;  // the completions API's documented default
    SamplingParams& s = r.sampling;
    if (auto e = number<float>(j, "temperature", s.temperature, 0, 2)) return *e;
    if (auto e = number<float>(j, "top_p", s.top_p, 0, 1)) return *e;
    if (auto e = number<int32_t>(j, "top_k", s.top_k, 0, 1e6)) return *e;
    if (auto e = number<float>(j, "min_p", s.min_p, 0, 1)) return *e;
    if (auto e = number<float>(j, "presence_penalty", s.presence_penalty, -2, 2)) return *e;
    if (auto e = number<float>(j, "frequency_penalty", s.frequency_penalty, -2, 2)) return *e;
    if (auto e = number<float>(j, "repetition_penalty", s.repetition_penalty, 0.01, 10)) return *e;
    if (auto it = j.find("seed"); it != j.end() && !it->is_null()) {
        if (!it->is_number_integer()) return bad("seed", "'seed' must be an integer");
        s.seed = static_cast<uint64_t>(it->get<int64_t>());
    }
    if (s.top_p == 0) return bad("top_p", "'top_p' must be greater than 0");
    if (Status st = s.validate(); !st) return bad("", st.error().message);
    return std::nullopt;
}

Field read_stop(const json& j, CompletionRequest& r) {
    auto it = j.find("stop");
    if (it == j.end() || it->is_null()) return std::nullopt;
    if (it->is_string()) {
        r.stop.push_back(it->get<std::string>());
    } else if (it->is_array() && it->size() <= 4) {
        for (const json& x : *it) {
            if (!x.is_string()) return bad("stop", "'stop' must be a string or an array of up to 4 strings");
            r.stop.push_back(x.get<std::string>());
        }
    } else {
        return bad("stop", "'stop' must be a string or an array of up to 4 strings");
    }
    for (const std::string& x : r.stop)
        if (x.empty()) return bad("stop", "stop strings must not be empty");
    return std::nullopt;
}

// stream, ignore_eos, stream_options.include_usage.
Field read_stream(const json& j, CompletionRequest& r) {
    if (auto e = boolean(j, "stream", r.stream)) return e;
    if (auto e = boolean(j, "ignore_eos", r.ignore_eos)) return e;
    if (auto it = j.find("stream_options"); it != j.end() && !it->is_null()) {
        if (!it->is_object()) return bad("stream_options", "'stream_options' must be an object");
        if (auto u = it->find("include_usage"); u != it->end()) {
            if (!u->is_boolean()) return bad("stream_options", "'stream_options.include_usage' must be a boolean");
            r.include_usage = u->get<bool>();
        }
    }
    return std::nullopt;
}

// n, and logprobs: chat's boolean with top_logprobs, or the completions API's count.
Field read_choices(const json& j, CompletionRequest& r) {
    if (auto it = j.find("n"); it != j.end() && !it->is_null()) {
        if (!it->is_number_integer() || it->get<int64_t>() < 1 || it->get<int64_t>() > kMaxChoices)
            return bad("n", fmt::format("'n' must be an integer from 1 to {}", kMaxChoices));
        r.n = it->get<int>();
    }
    if (auto it = j.find("logprobs"); it != j.end() && !it->is_null()) {
        if (r.chat) {
            if (!it->is_boolean()) return bad("logprobs", "'logprobs' must be a boolean");
            if (it->get<bool>()) r.logprobs = 0;
        } else {
            if (!it->is_number_integer() || it->get<int64_t>() < 0 || it->get<int64_t>() > kMaxTopLogprobs)
                return bad("logprobs", fmt::format("'logprobs' must be an integer from 0 to {}", kMaxTopLogprobs));
            r.logprobs = it->get<int>();
        }
    }
    if (auto it = j.find("top_logprobs"); it != j.end() && !it->is_null()) {
        if (!r.chat) return bad("top_logprobs", "'top_logprobs' belongs to chat completions; use 'logprobs': N here");
        if (!it->is_number_integer() || it->get<int64_t>() < 0 || it->get<int64_t>() > kMaxTopLogprobs)
            return bad("top_logprobs", fmt::format("'top_logprobs' must be an integer from 0 to {}", kMaxTopLogprobs));
        if (r.logprobs < 0) return bad("top_logprobs", "'top_logprobs' needs 'logprobs': true");
        r.logprobs = it->get<int>();
    }
    return std::nullopt;
}

// priority and timeout (duet's extensions, engine/scheduling.h).
Field read_scheduling(const json& j, CompletionRequest& r) {
    if (auto it = j.find("priority"); it != j.end() && !it->is_null()) {
        std::string v;
        if (it->is_string()) v = it->get<std::string>();
        else if (it->is_number_integer()) v = std::to_string(it->get<int64_t>());
        auto c = parse_priority(v);
        if (!it->is_string() && !it->is_number_integer()) c = make_error(ErrorKind::Invalid, "");
        if (!c) return bad("priority", "'priority' must be critical, standard, batch or an integer (lower is more urgent)");
        r.priority = *c;
    }
    if (auto e = number<double>(j, "timeout", r.timeout_s, 0.001, 86400)) return *e;
    return std::nullopt;
}

// Options this server does not implement are errors, never ignored.
Field refuse_unsupported(const json& j) {
    for (const char* key : {"tools", "functions", "response_format"}) {
        auto it = j.find(key);
        if (it == j.end() || it->is_null() || (it->is_boolean() && !it->get<bool>())) continue;
        return bad(key, fmt::format("'{}' is not supported by this server so far", key));
    }
    return std::nullopt;
}

}  // namespace

std::string error_json(const ApiError& e) {
    json j = {{"error",
               {{"message", e.message},
                {"type", e.type},
                {"param", e.param.empty() ? json(nullptr) : json(e.param)},
                {"code", e.code.empty() ? json(nullptr) : json(e.code)}}}};
    return j.dump();
}

std::variant<CompletionRequest, ApiError> parse_completion(std::string_view body, bool chat) {
    json j = json::parse(body, nullptr, false);
    if (j.is_discarded()) return bad("", "the request body is not valid JSON");
    if (!j.is_object()) return bad("", "the request body must be a JSON object");
    CompletionRequest r;
    r.chat = chat;
    if (auto e = read_model(j, r)) return *e;
    if (auto e = chat ? read_messages(j, r) : read_prompt(j, r)) return *e;
    for (auto read : {read_sampling, read_stop, read_stream, read_choices, read_scheduling})
        if (auto e = read(j, r)) return *e;
    if (auto e = refuse_unsupported(j)) return *e;
    return r;
}

namespace {
json base(const CompletionRequest& r, const std::string& id, int64_t created, const std::string& model, bool chunk) {
    return {{"id", id},
            {"object", r.chat ? (chunk ? "chat.completion.chunk" : "chat.completion") : "text_completion"},
            {"created", created},
            {"model", model}};
}
json usage(const Usage& u) {
    return {{"prompt_tokens", u.prompt_tokens},
            {"completion_tokens", u.completion_tokens},
            {"total_tokens", u.prompt_tokens + u.completion_tokens},
            {"prompt_tokens_details", {{"cached_tokens", u.cached_tokens}}}};
}
json bytes_of(const std::string& s) {
    json b = json::array();
    for (unsigned char c : s) b.push_back(c);
    return b;
}

// The choice's "logprobs" member: chat's {"content": [...]}, or the completions
// API's parallel arrays.
json logprobs_json(const CompletionRequest& r, const std::vector<LogprobToken>& lps) {
    if (r.logprobs < 0) return nullptr;
    if (r.chat) {
        json content = json::array();
        for (const LogprobToken& t : lps) {
            json top = json::array();
            for (const auto& [tok, lp] : t.top) top.push_back({{"token", tok}, {"logprob", lp}, {"bytes", bytes_of(tok)}});
            content.push_back({{"token", t.token}, {"logprob", t.logprob}, {"bytes", bytes_of(t.token)}, {"top_logprobs", top}});
        }
        return {{"content", content}};
    }
    json tokens = json::array(), token_lps = json::array(), tops = json::array(), offsets = json::array();
    for (const LogprobToken& t : lps) {
        tokens.push_back(t.token);
        token_lps.push_back(t.logprob);
        json top = json::object();
        for (const auto& [tok, lp] : t.top) top[tok] = lp;
        tops.push_back(std::move(top));
        offsets.push_back(t.text_offset);
    }
    return {{"tokens", tokens}, {"token_logprobs", token_lps}, {"top_logprobs", tops}, {"text_offset", offsets}};
}
}  // namespace

std::string completion_json(const CompletionRequest& r, const std::string& id, int64_t created,
                            const std::string& model, const std::vector<ChoiceText>& choices, const Usage& u) {
    json j = base(r, id, created, model, false);
    j["choices"] = json::array();
    for (size_t i = 0; i < choices.size(); ++i) {
        json choice = {{"index", i},
                       {"finish_reason", choices[i].finish_reason},
                       {"logprobs", logprobs_json(r, choices[i].logprobs)}};
        if (r.chat) choice["message"] = {{"role", "assistant"}, {"content", choices[i].text}};
        else choice["text"] = choices[i].text;
        j["choices"].push_back(std::move(choice));
    }
    j["usage"] = usage(u);
    return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string chunk_json(const CompletionRequest& r, const std::string& id, int64_t created, const std::string& model,
                       int index, const std::string& text, const std::string& finish_reason, bool first,
                       const std::vector<LogprobToken>& logprobs) {
    json j = base(r, id, created, model, true);
    json choice = {{"index", index},
                   {"finish_reason", finish_reason.empty() ? json(nullptr) : json(finish_reason)},
                   {"logprobs", logprobs_json(r, logprobs)}};
    if (r.chat) {
        json delta = json::object();
        if (first) delta["role"] = "assistant";
        if (!text.empty() || first) delta["content"] = text;
        choice["delta"] = delta;
    } else {
        choice["text"] = text;
    }
    j["choices"] = json::array({choice});
    if (r.include_usage) j["usage"] = nullptr;
    return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string usage_chunk_json(const CompletionRequest& r, const std::string& id, int64_t created,
                             const std::string& model, const Usage& u) {
    json j = base(r, id, created, model, true);
    j["choices"] = json::array();
    j["usage"] = usage(u);
    return j.dump();
}

}  // namespace duet
