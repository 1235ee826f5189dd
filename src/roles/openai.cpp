#include "roles/openai.h"

#include <cctype>
#include <cstdlib>
#include <optional>

#include <nlohmann/json.hpp>

#include "roles/json_schema_check.h"

namespace duet {

using nlohmann::json;

ApiError bad_request(std::string param, std::string message) {
    ApiError e;
    e.param = std::move(param);
    e.message = std::move(message);
    return e;
}

namespace {

ApiError bad(std::string param, std::string message) { return bad_request(std::move(param), std::move(message)); }

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

Field read_messages(const json& j, CompletionRequest& r) {
    if (auto e = read_chat_messages(j, r.messages, true)) return e;
    for (const ChatMessage& m : r.messages)
        r.tool_messages = r.tool_messages || m.role == "tool" || !m.tool_calls.empty();
    return std::nullopt;
}

// A message's content: a string, text parts, or null (as "").
std::optional<ApiError> read_content(const json& c, size_t i, std::string& out) {
    if (c.is_string()) {
        out = c.get<std::string>();
    } else if (c.is_array()) {
        for (const json& part : c) {
            if (!part.is_object() || !part.contains("type") || part["type"] != "text" || !part.contains("text") ||
                !part["text"].is_string())
                return bad("messages",
                           fmt::format("messages[{}]: only text content parts ({{\"type\": \"text\", \"text\": "
                                       "...}}) are supported",
                                       i));
            out += part["text"].get<std::string>();
        }
    } else if (!c.is_null()) {
        return bad("messages", fmt::format("messages[{}]: 'content' must be a string or an array of text parts", i));
    }
    return std::nullopt;
}

// An assistant message's tool_calls: [{id, type: "function", function: {name, arguments}}].
std::optional<ApiError> read_message_calls(const json& calls, size_t i, ChatMessage& msg) {
    const auto wrong = [i](std::string what) {
        return bad("messages", fmt::format("messages[{}].tool_calls: {}", i, what));
    };
    if (!calls.is_array()) return wrong("an array of calls");
    for (const json& call : calls) {
        if (!call.is_object()) return wrong("each call is an object");
        for (const auto& [key, v] : call.items())
            if (key != "id" && key != "type" && key != "function")
                return wrong(fmt::format("'{}' is not a field of a call (id, type, function)", key));
        if (call.contains("type") && call["type"] != "function")
            return wrong("only calls of type 'function' are supported");
        const json& fn = call.value("function", json(nullptr));
        if (!call.contains("id") || !call["id"].is_string() || !fn.is_object() || !fn.contains("name") ||
            !fn["name"].is_string() || !fn.contains("arguments") || !fn["arguments"].is_string())
            return wrong("each call needs a string 'id' and a 'function' with string 'name' and 'arguments'");
        for (const auto& [key, v] : fn.items())
            if (key != "name" && key != "arguments")
                return wrong(fmt::format("'function.{}' is not a field of a call (name, arguments)", key));
        // The arguments are written back as the model would write them: one JSON object.
        const json args = json::parse(fn["arguments"].get<std::string>(), nullptr, false);
        if (!args.is_object()) return wrong("a call's 'arguments' must be a JSON object in a string");
        msg.tool_calls.push_back(
            {call["id"].get<std::string>(), fn["name"].get<std::string>(), fn["arguments"].get<std::string>()});
    }
    return std::nullopt;
}

}  // namespace

// Chat: role and content of each message (content parts: only text is understood),
// and with tools the calls and their results.
std::optional<ApiError> read_chat_messages(const json& j, std::vector<ChatMessage>& out, bool tools) {
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
        const bool tool = tools && msg.role == "tool";
        if (msg.role != "system" && msg.role != "user" && msg.role != "assistant" && !tool)
            return bad(
                "messages",
                fmt::format("messages[{}]: the role '{}' is not supported (system, developer, user, assistant{})", i,
                            msg.role, tools ? ", tool" : ""));
        for (const auto& [key, v] : m.items()) {
            if (key == "role" || key == "content" || v.is_null()) continue;
            if (tools && key == "tool_calls" && msg.role == "assistant") continue;
            if (tool && key == "tool_call_id") continue;
            return bad("messages", fmt::format("messages[{}].{} is not supported by this server so far", i, key));
        }
        if (auto e = read_content(m.value("content", json(nullptr)), i, msg.content)) return e;
        if (auto c = m.find("tool_calls"); c != m.end() && !c->is_null())
            if (auto e = read_message_calls(*c, i, msg)) return e;
        if (tool) {
            auto id = m.find("tool_call_id");
            if (id == m.end() || !id->is_string())
                return bad("messages", fmt::format("messages[{}]: a tool message needs a string 'tool_call_id'", i));
            msg.tool_call_id = id->get<std::string>();
        }
        out.push_back(std::move(msg));
    }
    return std::nullopt;
}

namespace {

// Completions: a string, an array of one string, or token ids.
// duet's contexts: the route's context, or a chat body's "context"; "commit" only
// where a context is named.
Field read_context(const json& j, const CompletionRoute& route, CompletionRequest& r) {
    r.context = std::string(route.context);
    if (auto it = j.find("context"); it != j.end() && !it->is_null()) {
        if (!it->is_string() || it->get<std::string>().empty()) return bad("context", "context: a context's id");
        r.context = it->get<std::string>();
    }
    if (auto it = j.find("commit"); it != j.end() && !it->is_null()) {
        if (r.context.empty()) return bad("commit", "'commit' is for a context's completions: name a 'context'");
        if (!it->is_boolean()) return bad("commit", "commit: a boolean");
        r.commit = it->get<bool>();
    }
    return std::nullopt;
}

Field read_prompt(const json& j, CompletionRequest& r) {
    auto it = j.find("prompt");
    // A context's completion without a prompt continues the context itself.
    if (!r.context.empty() && (it == j.end() || it->is_null() || *it == "" || (it->is_array() && it->empty()))) {
        r.continues_context = true;
        return std::nullopt;
    }
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

// min_tokens (vLLM's): no end-of-generation token before this many outputs, and stop
// strings looked for from output number min_tokens on (vLLM's rule: one that ends in
// an earlier output's text does not stop it).
Field read_min_tokens(const json& j, CompletionRequest& r) {
    if (auto e = number<int64_t>(j, "min_tokens", r.min_tokens, 0, 1e9)) return *e;
    if (r.max_tokens >= 0 && r.min_tokens > r.max_tokens)
        return bad("min_tokens",
                   fmt::format("'min_tokens' ({}) must not exceed 'max_tokens' ({})", r.min_tokens, r.max_tokens));
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

// speculative (duet's extension, engine/drafter.h): {"mode": "auto" | "off",
// "max_draft": 1..16, "pool": true | false}. Drafts never change the output; they
// change its speed.
Field read_speculative(const json& j, CompletionRequest& r) {
    auto it = j.find("speculative");
    if (it == j.end() || it->is_null()) return std::nullopt;
    if (!it->is_object())
        return bad("speculative",
                   R"('speculative' must be an object: {"mode": "auto" or "off", "max_draft": k, "pool": bool})");
    for (const auto& [key, v] : it->items())
        if (key != "mode" && key != "max_draft" && key != "pool")
            return bad("speculative", fmt::format("Unrecognized request argument supplied: speculative.{}", key));
    const auto mode = it->find("mode");
    if (mode != it->end() && !(mode->is_string() && (*mode == "auto" || *mode == "off")))
        return bad("speculative", "'speculative.mode' must be \"auto\" or \"off\"");
    const bool off = mode != it->end() && *mode == "off";
    // Without a mode: auto ({} or a max_draft asks for drafts), except that "pool"
    // alone leaves the server's drafting as it is (a GPU server's off stays off).
    const bool pool_only = mode == it->end() && it->size() == 1 && it->contains("pool");
    r.draft_mode = off ? DraftMode::Off : pool_only ? DraftMode::Server : DraftMode::Auto;
    if (const auto k = it->find("max_draft"); k != it->end() && !k->is_null()) {
        if (off) return bad("speculative", "'speculative.max_draft' cannot be used with mode \"off\"");
        if (!k->is_number_integer() || k->get<int64_t>() < 1 || k->get<int64_t>() > kMaxDraftTokens)
            return bad("speculative",
                       fmt::format("'speculative.max_draft' must be an integer from 1 to {}", kMaxDraftTokens));
        r.max_draft = k->get<int>();
    }
    if (const auto p = it->find("pool"); p != it->end() && !p->is_null()) {
        if (!p->is_boolean()) return bad("speculative", "'speculative.pool' must be a boolean");
        r.draft_pool = p->get<bool>();
    }
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

// tools: [{type: "function", function: {name, description, parameters, strict}}]
// (o: the body with its keys in the client's order, for the parameters' property
// order), tool_choice and parallel_tool_calls.
Field read_tools(const nlohmann::ordered_json& o, CompletionRequest& r) {
    using ojson = nlohmann::ordered_json;
    auto it = o.find("tools");
    if (it != o.end() && !it->is_null()) {
        if (!it->is_array()) return bad("tools", "'tools' must be an array of {type: \"function\", function} objects");
        for (size_t i = 0; i < it->size(); ++i) {
            const ojson& t = (*it)[i];
            const auto wrong = [i](std::string what) { return bad("tools", fmt::format("tools[{}]: {}", i, what)); };
            if (!t.is_object()) return wrong("a tool is an object");
            for (const auto& [key, v] : t.items())
                if (key != "type" && key != "function")
                    return wrong(fmt::format("Unrecognized request argument supplied: tools[{}].{}", i, key));
            if (!t.contains("type") || t["type"] != "function")
                return wrong(fmt::format("the type {} is not supported: this server calls functions ('function')",
                                         t.contains("type") ? t["type"].dump() : "(none)"));
            if (!t.contains("function") || !t["function"].is_object()) return wrong("'function' must be an object");
            const ojson& fn = t["function"];
            for (const auto& [key, v] : fn.items())
                if (key != "name" && key != "description" && key != "parameters" && key != "strict")
                    return wrong(fmt::format("Unrecognized request argument supplied: tools[{}].function.{}", i, key));
            ToolDef d;
            const ojson& name = fn.value("name", ojson());
            if (!name.is_string()) return wrong("'function.name' must be a string");
            d.name = name.get<std::string>();
            bool ok = !d.name.empty() && d.name.size() <= 64;
            for (char c : d.name) ok = ok && (std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-');
            if (!ok) return wrong(fmt::format("the name '{}' must be 1 to 64 of a-z, A-Z, 0-9, '_' and '-'", d.name));
            for (const ToolDef& other : r.tools)
                if (other.name == d.name) return wrong(fmt::format("a second function named '{}'", d.name));
            if (auto dsc = fn.find("description"); dsc != fn.end() && !dsc->is_null()) {
                if (!dsc->is_string()) return wrong("'function.description' must be a string");
                d.description = dsc->get<std::string>();
            }
            if (auto st = fn.find("strict"); st != fn.end() && !st->is_null() && !st->is_boolean())
                return wrong("'function.strict' must be a boolean");
            // No parameters: a function of none.
            ojson params = ojson::parse(R"({"type": "object", "properties": {}, "additionalProperties": false})");
            if (auto p = fn.find("parameters"); p != fn.end() && !p->is_null()) params = *p;
            // Arguments are a JSON object in every format: {} (which clients send for
            // "any arguments") and a schema of properties without a type are ones of
            // an object.
            if (params.is_object() && !params.contains("type") && (params.empty() || params.contains("properties")))
                params["type"] = "object";
            // An allOf of object schemas at the root is an object's schema once merged.
            const bool all_of = params.is_object() && params.contains("allOf");
            if (!all_of && (!params.is_object() || params.value("type", ojson()) != "object"))
                return wrong("'function.parameters' must be a JSON schema with \"type\": \"object\" at its root");
            if (auto e = unsupported_schema_keyword(json::parse(params.dump())))
                return wrong(fmt::format("function.parameters: {}", *e));
            if (auto e = merge_object_all_of(params)) return wrong(fmt::format("function.parameters: {}", *e));
            if (params.value("type", ojson()) != "object")
                return wrong("'function.parameters' must be a JSON schema with \"type\": \"object\" at its root");
            d.parameters = params.dump();
            if (Status st = check_grammar(GrammarSpec{GrammarKind::JsonSchema, d.parameters}); !st)
                return wrong(fmt::format("function.parameters: {}", st.error().message));
            r.tools.push_back(std::move(d));
        }
    }
    r.tool_choice.mode = r.tools.empty() ? ToolChoiceMode::None : ToolChoiceMode::Auto;
    if (auto c = o.find("tool_choice"); c != o.end() && !c->is_null()) {
        if (*c == "none") {
            r.tool_choice.mode = ToolChoiceMode::None;
        } else if (r.tools.empty()) {
            return bad("tool_choice", "'tool_choice' is only allowed when 'tools' are given");
        } else if (*c == "auto") {
            r.tool_choice.mode = ToolChoiceMode::Auto;
        } else if (*c == "required") {
            r.tool_choice.mode = ToolChoiceMode::Required;
        } else if (c->is_object() && c->value("type", ojson()) == "function" && c->contains("function") &&
                   (*c)["function"].is_object() && (*c)["function"].value("name", ojson()).is_string() &&
                   c->size() == 2 && (*c)["function"].size() == 1) {
            r.tool_choice.mode = ToolChoiceMode::Named;
            r.tool_choice.name = (*c)["function"]["name"].get<std::string>();
            bool known = false;
            for (const ToolDef& d : r.tools) known = known || d.name == r.tool_choice.name;
            if (!known)
                return bad("tool_choice",
                           fmt::format("'tool_choice' names '{}', which is not one of the tools", r.tool_choice.name));
        } else {
            return bad("tool_choice", fmt::format("'tool_choice' must be none, auto, required or {{\"type\": "
                                                  "\"function\", \"function\": {{\"name\": ...}}}}, got {}",
                                                  c->dump()));
        }
    }
    if (auto p = o.find("parallel_tool_calls"); p != o.end() && !p->is_null()) {
        if (!p->is_boolean()) return bad("parallel_tool_calls", "'parallel_tool_calls' must be a boolean");
        if (r.tools.empty())
            return bad("parallel_tool_calls", "'parallel_tool_calls' is only allowed when 'tools' are given");
        r.parallel_tool_calls = p->get<bool>();
    }
    if (r.calls_tools()) {
        // One grammar per request: the calls' (the front makes it in the model's
        // format), which takes a JSON schema for the content (response_format) as the
        // alternative to calls; a GBNF grammar it cannot take.
        if (r.grammar && r.grammar->kind != GrammarKind::JsonSchema && r.grammar->kind != GrammarKind::JsonObject)
            return bad(r.grammar_param, fmt::format("'{}' cannot be used with 'tools' so far (unless 'tool_choice' "
                                                    "is none)",
                                                    r.grammar_param));
        if (r.ignore_eos) return bad("ignore_eos", "'ignore_eos' cannot be used with 'tools'");
        // A stop string could cut a call's opening or its arguments (hermes' opening
        // holds a newline; llama3-json's arguments end with a brace).
        if (!r.stop.empty()) return bad("stop", "'stop' cannot be used with 'tools' so far");
        if (r.min_tokens > 0) return bad("min_tokens", "'min_tokens' cannot be used with 'tools'");
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
    {"priority", kBoth, Does::Honour, ""},     // duet (engine/scheduling.h)
    {"timeout", kBoth, Does::Honour, ""},      // duet
    {"speculative", kBoth, Does::Honour, ""},  // duet (engine/drafter.h)
    {"context", kChat, Does::Honour, ""},      // duet (engine/contexts.h; a context's route names its own)
    {"commit", kBoth, Does::Honour, ""},       // duet, beside a context
    {"user", kBoth, Does::Ignore, ""},
    {"safety_identifier", kChat, Does::Ignore, ""},
    {"prompt_cache_key", kChat, Does::Ignore, ""},  // a cache hint: duet's prefix cache needs none
    {"metadata", kChat, Does::Ignore, ""},
    {"store", kChat, Does::Ignore, ""},
    {"service_tier", kChat, Does::Ignore, ""},
    {"suffix", kCompletions, Does::Refuse, "needs an infill template, which this model's has not"},
    {"tools", kChat, Does::Honour, ""},
    {"tool_choice", kChat, Does::Honour, ""},
    {"parallel_tool_calls", kChat, Does::Honour, ""},
    {"functions", kChat, Does::Refuse, "is deprecated; send 'tools' instead"},
    {"function_call", kChat, Does::Refuse, "is deprecated; send 'tool_choice' instead"},
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
    if (key == "modalities") return v == json::array({"text"});
    if (key == "functions") return v.is_array() && v.empty();
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

std::variant<CompletionRequest, ApiError> parse_completion(std::string_view body, bool chat,
                                                           const CompletionRoute& route) {
    // Parsed once, in the client's key order (ordered_json: a schema's properties and
    // a function's parameters are the order its output writes them in, where json
    // sorts them), and read through a copy of the tree as json.
    const auto o = nlohmann::ordered_json::parse(body, nullptr, false);
    if (o.is_discarded()) return bad("", "the request body is not valid JSON");
    if (!o.is_object()) return bad("", "the request body must be a JSON object");
    const json j = o;
    if (auto e = check_fields(j, chat)) return *e;
    CompletionRequest r;
    r.chat = chat;
    if (auto e = read_context(j, route, r)) return *e;
    if (auto e = read_model(j, r)) return *e;
    if (auto e = chat ? read_messages(j, r) : read_prompt(j, r)) return *e;
    for (auto read : {read_sampling, read_stop, read_min_tokens, read_logit_bias, read_stream, read_choices,
                      read_echo_best_of, read_scheduling, read_speculative, read_grammar})
        if (auto e = read(j, r)) return *e;
    // The class: the body's "priority", else the route's header, else standard.
    if (r.priority) {
        r.slo = *r.priority;
    } else if (!route.priority.empty()) {
        auto cls = parse_priority(route.priority);
        if (!cls) return bad("", "X-Duet-Priority: " + cls.error().message);
        r.slo = *cls;
    }
    if (chat && (j.contains("tools") || j.contains("tool_choice") || j.contains("parallel_tool_calls")))
        if (auto e = read_tools(o, r)) return *e;
    if (r.grammar && r.grammar->kind == GrammarKind::JsonSchema) {
        // The schema as the client wrote it: its properties in their order.
        static const std::vector<const char*> kTop = {"json_schema"},
                                              kNested = {"response_format", "json_schema", "schema"};
        const nlohmann::ordered_json* s = &o;
        for (const char* k : r.grammar_param == "json_schema" ? kTop : kNested)
            if (s->is_object() && s->contains(k)) s = &(*s)[k];
        if (s != &o) {
            nlohmann::ordered_json schema = *s;
            if (auto e = merge_object_all_of(schema))
                return bad(r.grammar_param, fmt::format("{}: {}", r.grammar_param, *e));
            r.grammar->source = schema.dump();
        }
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
    // completion_tokens_details: drafted tokens the verify rows kept (they are among
    // the completion's tokens) and those they rejected (computed, not in it; unlike
    // OpenAI's predicted outputs, not counted in completion_tokens).
    return {
        {"prompt_tokens", u.prompt_tokens},
        {"completion_tokens", u.completion_tokens},
        {"total_tokens", u.prompt_tokens + u.completion_tokens},
        {"prompt_tokens_details", {{"cached_tokens", u.cached_tokens}}},
        {"completion_tokens_details",
         {{"accepted_prediction_tokens", u.drafts_kept}, {"rejected_prediction_tokens", u.drafted - u.drafts_kept}}}};
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
        if (r.chat) {
            const ChoiceText& c = choices[i];
            // With calls, an empty text is no content (null), as OpenAI answers.
            choice["message"] = {{"role", "assistant"},
                                 {"content", c.tool_calls.empty() || !c.text.empty() ? json(c.text) : json(nullptr)},
                                 {"refusal", nullptr}};
            if (!c.tool_calls.empty()) {
                json calls = json::array();
                for (const ChatToolCall& t : c.tool_calls)
                    calls.push_back({{"id", t.id},
                                     {"type", "function"},
                                     {"function", {{"name", t.name}, {"arguments", t.arguments}}}});
                choice["message"]["tool_calls"] = std::move(calls);
            }
        } else {
            choice["text"] = choices[i].text;
        }
        j["choices"].push_back(std::move(choice));
    }
    j["usage"] = usage(u);
    return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string chunk_json(const CompletionRequest& r, const std::string& id, int64_t created, const std::string& model,
                       int index, const std::string& text, const std::string& finish_reason, bool first,
                       const std::vector<LogprobToken>& logprobs, const std::vector<ToolCallDelta>& calls) {
    json j = base(r, id, created, model, true);
    json choice = {{"index", index},
                   {"finish_reason", finish_reason.empty() ? json(nullptr) : json(finish_reason)},
                   {"logprobs", logprobs_json(r, logprobs)}};
    if (r.chat) {
        json delta = json::object();
        if (first) delta["role"] = "assistant";
        if (!text.empty() || first) delta["content"] = text;
        if (!calls.empty()) {
            // A call's first delta has its id, type and name; every one a piece of its
            // arguments (concatenated: the whole response's).
            json list = json::array();
            for (const ToolCallDelta& d : calls) {
                json e = {{"index", d.index}};
                if (d.header) {
                    e["id"] = d.id;
                    e["type"] = "function";
                    e["function"] = {{"name", d.name}, {"arguments", d.arguments}};
                } else {
                    e["function"] = {{"arguments", d.arguments}};
                }
                list.push_back(std::move(e));
            }
            delta["tool_calls"] = std::move(list);
        }
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
