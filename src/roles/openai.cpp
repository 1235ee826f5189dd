#include "roles/openai.h"

#include <cstdlib>
#include <optional>

#include <nlohmann/json.hpp>

#include "roles/json_schema_check.h"

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
        const size_t i = out.size();
        ChatMessage msg;
        msg.role = m["role"].get<std::string>();
        // OpenAI's newer name for the system role (its o-series models take it so).
        if (msg.role == "developer") msg.role = "system";
        if (msg.role != "system" && msg.role != "user" && msg.role != "assistant")
            return bad(
                "messages",
                fmt::format("messages[{}]: the role '{}' is not supported (system, developer, user, assistant){}", i,
                            msg.role, msg.role == "tool" || msg.role == "function" ? "; tools are not so far" : ""));
        for (const auto& [key, v] : m.items())
            if (key != "role" && key != "content" && !v.is_null())
                return bad("messages", fmt::format("messages[{}].{} is not supported by this server so far", i, key));
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

// min_tokens (vLLM's): no end-of-generation token before this many outputs.
Field read_min_tokens(const json& j, CompletionRequest& r) {
    if (auto e = number<int64_t>(j, "min_tokens", r.min_tokens, 0, 1e9)) return *e;
    if (r.max_tokens >= 0 && r.min_tokens > r.max_tokens)
        return bad("min_tokens",
                   fmt::format("'min_tokens' ({}) must not exceed 'max_tokens' ({})", r.min_tokens, r.max_tokens));
    // vLLM holds stop strings back until min_tokens too; duet's stop strings are
    // matched by the front, which does not count tokens in the text: refused.
    if (r.min_tokens > 0 && !r.stop.empty())
        return bad("min_tokens", "'min_tokens' with 'stop' strings is not supported by this server so far");
    return std::nullopt;
}

// logit_bias: {"token id": bias in [-100, 100]} (the front checks the ids against the
// vocabulary, and the table's size against the request data's bound).
Field read_logit_bias(const json& j, CompletionRequest& r) {
    auto it = j.find("logit_bias");
    if (it == j.end() || it->is_null()) return std::nullopt;
    if (!it->is_object()) return bad("logit_bias", "'logit_bias' must be an object of token ids to biases");
    for (const auto& [key, v] : it->items()) {
        char* end = nullptr;
        const long long id = std::strtoll(key.c_str(), &end, 10);
        if (key.empty() || *end != '\0' || id < 0 || id > INT32_MAX)
            return bad("logit_bias", fmt::format("'logit_bias' key '{}' is not a token id", key));
        if (!v.is_number() || v.get<double>() < -100 || v.get<double>() > 100)
            return bad("logit_bias", fmt::format("'logit_bias' of token {} must be a number from -100 to 100", key));
        r.logit_bias.emplace_back(static_cast<int32_t>(id), v.get<float>());
    }
    return std::nullopt;
}

// response_format (json_object, json_schema), or llama.cpp's json_schema (a schema)
// or grammar (GBNF, as xgrammar's EBNF reads it): the grammar the output follows.
// A schema's keywords must all be honoured (roles/json_schema_check.h), and the
// grammar must be one xgrammar enforces exactly (engine/grammar.h check_grammar, in
// parse_completion once the schema is in the client's order).
Field read_grammar(const json& j, CompletionRequest& r) {
    const char* param = nullptr;
    GrammarSpec g;
    if (auto it = j.find("response_format"); it != j.end() && !it->is_null()) {
        if (!it->is_object() || !it->contains("type") || !(*it)["type"].is_string())
            return bad("response_format", "'response_format' must be an object with a 'type'");
        const std::string type = (*it)["type"].get<std::string>();
        for (const auto& [key, v] : it->items())
            if (key != "type" && !(key == "json_schema" && type == "json_schema"))
                return bad("response_format",
                           fmt::format("Unrecognized request argument supplied: response_format.{}", key));
        if (type == "text") return std::nullopt;
        if (type == "json_object") {
            g.kind = GrammarKind::JsonObject;
        } else if (type == "json_schema") {
            auto js = it->find("json_schema");
            if (js == it->end() || !js->is_object())
                return bad("response_format", "'response_format.json_schema' must be an object");
            for (const auto& [key, v] : js->items()) {
                if (key != "name" && key != "schema" && key != "strict" && key != "description")
                    return bad(
                        "response_format",
                        fmt::format("Unrecognized request argument supplied: response_format.json_schema.{}", key));
                if ((key == "name" || key == "description") && !v.is_string())
                    return bad("response_format",
                               fmt::format("'response_format.json_schema.{}' must be a string", key));
                if (key == "strict" && !v.is_boolean() && !v.is_null())
                    return bad("response_format", "'response_format.json_schema.strict' must be a boolean");
            }
            auto schema = js->find("schema");
            if (schema == js->end() || !(schema->is_object() || schema->is_boolean()))
                return bad("response_format", "'response_format.json_schema.schema' must be a JSON schema object");
            if (auto e = unsupported_schema_keyword(*schema))
                return bad("response_format", fmt::format("response_format.json_schema.schema: {}", *e));
            g.kind = GrammarKind::JsonSchema;
            g.source = schema->dump();
        } else {
            return bad("response_format", fmt::format("'response_format' type '{}' is not one of text, json_object, "
                                                      "json_schema",
                                                      type));
        }
        param = "response_format";
    }
    if (auto it = j.find("json_schema"); it != j.end() && !it->is_null()) {
        if (param) return bad("json_schema", "'json_schema' and 'response_format' cannot both be given");
        if (!it->is_object() && !it->is_boolean())
            return bad("json_schema", "'json_schema' must be a JSON schema object");
        if (auto e = unsupported_schema_keyword(*it)) return bad("json_schema", fmt::format("json_schema: {}", *e));
        g.kind = GrammarKind::JsonSchema;
        g.source = it->dump();
        param = "json_schema";
    }
    if (auto it = j.find("grammar"); it != j.end() && !it->is_null()) {
        if (param) return bad("grammar", fmt::format("'grammar' and '{}' cannot both be given", param));
        if (!it->is_string() || it->get<std::string>().empty())
            return bad("grammar", "'grammar' must be a grammar (GBNF) in a string");
        g.kind = GrammarKind::Ebnf;
        g.source = it->get<std::string>();
        param = "grammar";
    }
    if (!param) return std::nullopt;
    // The grammar ends the output with an end-of-generation token; these would keep
    // it going past the grammar's end, or stop it from ending.
    if (r.ignore_eos) return bad("ignore_eos", fmt::format("'ignore_eos' cannot be used with '{}'", param));
    if (r.min_tokens > 0) return bad("min_tokens", fmt::format("'min_tokens' cannot be used with '{}'", param));
    r.grammar = std::move(g);  // checked by parse_completion, in the client's order
    r.grammar_param = param;
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

// echo (completions) and best_of (completions: candidates of which the n with the
// highest mean log-probability per token are returned; not streamed).
Field read_echo_best_of(const json& j, CompletionRequest& r) {
    if (auto e = boolean(j, "echo", r.echo)) return e;
    if (r.echo && r.logprobs >= 0)
        return bad("echo",
                   "'echo' with 'logprobs' needs the prompt tokens' log-probabilities, which this server does "
                   "not compute; ask for one or the other");
    if (auto it = j.find("best_of"); it != j.end() && !it->is_null()) {
        if (!it->is_number_integer() || it->get<int64_t>() < 1 || it->get<int64_t>() > kMaxChoices)
            return bad("best_of", fmt::format("'best_of' must be an integer from 1 to {}", kMaxChoices));
        r.best_of = it->get<int>();
        if (r.best_of < r.n)
            return bad("best_of", fmt::format("'best_of' ({}) must be at least 'n' ({})", r.best_of, r.n));
        if (r.best_of > r.n && r.stream) return bad("best_of", "'best_of' greater than 'n' cannot be streamed");
    }
    return std::nullopt;
}

// What the server does with each field of a body. Honoured: read above. Ignored:
// bookkeeping of OpenAI's own service that changes no output there either. Refused:
// a 400 naming it whenever it asks for something (any value but null, and the few
// values that ask for nothing: an empty logit_bias, response_format text, ...).
enum class Does : uint8_t { Honour, Ignore, Refuse };
enum : uint8_t { kCompletions = 1, kChat = 2, kBoth = 3 };
struct FieldRule {
    const char* name;
    uint8_t apis;
    Does does;
    const char* why;  // Refuse: the reason in the 400
};
constexpr FieldRule kFields[] = {
    {"model", kBoth, Does::Honour, ""},
    {"prompt", kCompletions, Does::Honour, ""},
    {"messages", kChat, Does::Honour, ""},
    {"max_tokens", kBoth, Does::Honour, ""},
    {"max_completion_tokens", kChat, Does::Honour, ""},
    {"temperature", kBoth, Does::Honour, ""},
    {"top_p", kBoth, Does::Honour, ""},
    {"top_k", kBoth, Does::Honour, ""},               // vLLM, llama.cpp
    {"min_p", kBoth, Does::Honour, ""},               // vLLM, llama.cpp
    {"repetition_penalty", kBoth, Does::Honour, ""},  // vLLM
    {"presence_penalty", kBoth, Does::Honour, ""},
    {"frequency_penalty", kBoth, Does::Honour, ""},
    {"seed", kBoth, Does::Honour, ""},
    {"stop", kBoth, Does::Honour, ""},
    {"stream", kBoth, Does::Honour, ""},
    {"stream_options", kBoth, Does::Honour, ""},
    {"ignore_eos", kBoth, Does::Honour, ""},  // vLLM, llama.cpp
    {"min_tokens", kBoth, Does::Honour, ""},  // vLLM
    {"logit_bias", kBoth, Does::Honour, ""},
    {"n", kBoth, Does::Honour, ""},
    {"logprobs", kBoth, Does::Honour, ""},
    {"top_logprobs", kChat, Does::Honour, ""},
    {"echo", kCompletions, Does::Honour, ""},
    {"best_of", kCompletions, Does::Honour, ""},
    {"priority", kBoth, Does::Honour, ""},  // duet (engine/scheduling.h)
    {"timeout", kBoth, Does::Honour, ""},   // duet
    {"user", kBoth, Does::Ignore, ""},
    {"safety_identifier", kChat, Does::Ignore, ""},
    {"prompt_cache_key", kChat, Does::Ignore, ""},  // a cache hint: duet's prefix cache needs none
    {"metadata", kChat, Does::Ignore, ""},
    {"store", kChat, Does::Ignore, ""},
    {"service_tier", kChat, Does::Ignore, ""},
    {"suffix", kCompletions, Does::Refuse, "needs an infill template, which this model's has not"},
    {"tools", kChat, Does::Refuse, "is not supported by this server so far"},
    {"tool_choice", kChat, Does::Refuse, "is not supported by this server so far"},
    {"parallel_tool_calls", kChat, Does::Refuse, "is only allowed when 'tools' are given"},
    {"functions", kChat, Does::Refuse, "is not supported by this server so far"},
    {"function_call", kChat, Does::Refuse, "is not supported by this server so far"},
    {"response_format", kBoth, Does::Honour, ""},
    {"grammar", kBoth, Does::Honour, ""},      // llama.cpp (GBNF)
    {"json_schema", kBoth, Does::Honour, ""},  // llama.cpp
    {"modalities", kChat, Does::Refuse, "other than [\"text\"] is not supported: this model writes text"},
    {"audio", kChat, Does::Refuse, "is not supported: this model writes text"},
    {"prediction", kChat, Does::Refuse, "is not supported by this server so far"},
    {"reasoning_effort", kChat, Does::Refuse, "is not supported: this model does not reason"},
    {"verbosity", kChat, Does::Refuse, "is not supported by this server so far"},
    {"web_search_options", kChat, Does::Refuse, "is not supported: this server does not search the web"},
};

// A refused field's values that ask for nothing, and are taken as its absence.
bool asks_nothing(std::string_view key, const json& v) {
    if (v.is_null()) return true;
    if (key == "suffix") return v.is_string() && v.get<std::string>().empty();
    if (key == "tool_choice") return v == "none";
    if (key == "modalities") return v == json::array({"text"});
    if (key == "tools" || key == "functions") return v.is_array() && v.empty();
    return false;
}

// Every field of the body is one the server honours, or ignores as OpenAI does; a
// refused one that asks for something, or an unknown one, is a 400 naming it.
Field check_fields(const json& j, bool chat) {
    const uint8_t api = chat ? kChat : kCompletions;
    for (const auto& [key, v] : j.items()) {
        const FieldRule* rule = nullptr;
        for (const FieldRule& f : kFields)
            if (key == f.name && (f.apis & api)) rule = &f;
        if (!rule) return bad(key, fmt::format("Unrecognized request argument supplied: {}", key));
        if (rule->does == Does::Refuse && !asks_nothing(key, v))
            return bad(key, fmt::format("'{}' {}", key, rule->why));
    }
    if (auto it = j.find("stream_options"); it != j.end() && it->is_object())
        for (const auto& [key, v] : it->items())
            if (key != "include_usage")
                return bad("stream_options",
                           fmt::format("Unrecognized request argument supplied: stream_options.{}", key));
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
    if (auto e = check_fields(j, chat)) return *e;
    CompletionRequest r;
    r.chat = chat;
    if (auto e = read_model(j, r)) return *e;
    if (auto e = chat ? read_messages(j, r) : read_prompt(j, r)) return *e;
    for (auto read : {read_sampling, read_stop, read_min_tokens, read_logit_bias, read_stream, read_choices,
                      read_echo_best_of, read_scheduling, read_grammar})
        if (auto e = read(j, r)) return *e;
    if (r.grammar && r.grammar->kind == GrammarKind::JsonSchema) {
        // The schema as the client wrote it: its properties in their order, which is
        // the order the output writes them in (json sorts keys; ordered_json keeps them).
        const auto o = nlohmann::ordered_json::parse(body, nullptr, false);
        static const std::vector<const char*> kTop = {"json_schema"},
                                              kNested = {"response_format", "json_schema", "schema"};
        const nlohmann::ordered_json* s = &o;
        for (const char* k : r.grammar_param == "json_schema" ? kTop : kNested)
            if (s->is_object() && s->contains(k)) s = &(*s)[k];
        if (s != &o) r.grammar->source = s->dump();
    }
    // The grammar the workers will compile, checked as they will compile it.
    if (r.grammar)
        if (Status st = check_grammar(*r.grammar); !st)
            return bad(r.grammar_param, fmt::format("{}: {}", r.grammar_param, st.error().message));
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
        return {{"content", content}, {"refusal", nullptr}};  // both required (nullable) by OpenAI's schema
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
        // refusal: required (nullable) by OpenAI's schema; this server never refuses in text.
        if (r.chat)
            choice["message"] = {{"role", "assistant"}, {"content", choices[i].text}, {"refusal", nullptr}};
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
