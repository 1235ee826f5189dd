#include "roles/responses.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace duet {

using ojson = nlohmann::ordered_json;
using nlohmann::json;

namespace {

ApiError bad(std::string param, std::string message) { return bad_request(std::move(param), std::move(message)); }

// What the route does with each field (as kFields in openai.cpp does for chat).
enum class Does : uint8_t { Honour, Ignore, Refuse };
struct FieldRule {
    const char* name;
    Does does;
    const char* why;
};
constexpr FieldRule kFields[] = {
    {"model", Does::Honour, ""},
    {"input", Does::Honour, ""},
    {"instructions", Does::Honour, ""},
    {"max_output_tokens", Does::Honour, ""},
    {"temperature", Does::Honour, ""},
    {"top_p", Does::Honour, ""},
    {"text", Does::Honour, ""},
    {"tools", Does::Honour, ""},
    {"tool_choice", Does::Honour, ""},
    {"parallel_tool_calls", Does::Honour, ""},
    {"stream", Does::Honour, ""},
    {"stream_options", Does::Honour, ""},
    {"store", Does::Honour, ""},
    {"previous_response_id", Does::Honour, ""},
    {"metadata", Does::Honour, ""},
    {"priority", Does::Honour, ""},  // duet (engine/scheduling.h)
    {"timeout", Does::Honour, ""},   // duet
    {"user", Does::Ignore, ""},
    {"safety_identifier", Does::Ignore, ""},
    {"prompt_cache_key", Does::Ignore, ""},
    {"prompt_cache_retention", Does::Ignore, ""},
    {"service_tier", Does::Ignore, ""},
    {"truncation", Does::Refuse, "other than \"disabled\" is not supported: the input must fit the context"},
    {"background", Does::Refuse, "is not supported: responses run while their request is open"},
    {"conversation", Does::Refuse, "is not supported; continue with 'previous_response_id'"},
    {"include", Does::Refuse, "is not supported: there is nothing more to include"},
    {"reasoning", Does::Refuse, "is not supported: this model does not reason"},
    {"prompt", Does::Refuse, "(prompt templates) is not supported"},
    {"max_tool_calls", Does::Refuse, "is not supported so far"},
    {"top_logprobs", Does::Refuse, "is not supported so far"},
};

bool asks_nothing(std::string_view key, const ojson& v) {
    if (v.is_null()) return true;
    if (key == "truncation") return v == "disabled";
    if (key == "background") return v == false;
    if (key == "include") return v.is_array() && v.empty();
    if (key == "top_logprobs") return v == 0;
    return false;
}

// A message item's content: a string, or parts of the given text types.
std::optional<ApiError> read_parts(const ojson& c, size_t i, bool assistant, std::string& out) {
    if (c.is_string()) {
        out = c.get<std::string>();
        return std::nullopt;
    }
    if (!c.is_array()) return bad("input", fmt::format("input[{}].content: a string or an array of text parts", i));
    for (const ojson& p : c) {
        const char* want = assistant ? "output_text" : "input_text";
        if (!p.is_object() || !p.contains("type") || p["type"] != want || !p.contains("text") || !p["text"].is_string())
            return bad("input",
                       fmt::format("input[{}].content: only {} parts are supported ({})", i, want,
                                   p.is_object() && p.contains("type") ? p["type"].dump() : "a part without a type"));
        out += p["text"].get<std::string>();
    }
    return std::nullopt;
}

// input: a string (a user message), or items: messages, function_call and
// function_call_output items.
std::optional<ApiError> read_input(const ojson& in, std::vector<ChatMessage>& out) {
    if (in.is_string()) {
        out.emplace_back("user", in.get<std::string>());
        return std::nullopt;
    }
    if (!in.is_array() || in.empty()) return bad("input", "'input' must be a string or a non-empty array of items");
    for (size_t i = 0; i < in.size(); ++i) {
        const ojson& it = in[i];
        if (!it.is_object()) return bad("input", fmt::format("input[{}]: an item is an object", i));
        const std::string type =
            it.contains("type") && it["type"].is_string() ? it["type"].get<std::string>() : "message";
        if (type == "message") {
            if (!it.contains("role") || !it["role"].is_string())
                return bad("input", fmt::format("input[{}]: a message needs a 'role'", i));
            std::string role = it["role"].get<std::string>();
            if (role == "developer") role = "system";
            if (role != "user" && role != "system" && role != "assistant")
                return bad("input", fmt::format("input[{}]: the role '{}' is not supported (user, system, developer, "
                                                "assistant)",
                                                i, role));
            for (const auto& [k, v] : it.items())
                if (k != "type" && k != "role" && k != "content" && k != "id" && k != "status")
                    return bad("input", fmt::format("input[{}].{} is not supported", i, k));
            ChatMessage m(role, "");
            if (auto e = read_parts(it.value("content", ojson()), i, role == "assistant", m.content)) return e;
            out.push_back(std::move(m));
        } else if (type == "function_call") {
            for (const auto& [k, v] : it.items())
                if (k != "type" && k != "call_id" && k != "name" && k != "arguments" && k != "id" && k != "status")
                    return bad("input", fmt::format("input[{}].{} is not supported", i, k));
            for (const char* k : {"call_id", "name", "arguments"})
                if (!it.contains(k) || !it[k].is_string())
                    return bad("input", fmt::format("input[{}]: a function_call needs a string '{}'", i, k));
            if (!json::parse(it["arguments"].get<std::string>(), nullptr, false).is_object())
                return bad("input", fmt::format("input[{}]: 'arguments' must be a JSON object in a string", i));
            // Calls after an assistant's text, or in a row, are that message's (as a
            // response's output is stored).
            if (out.empty() || out.back().role != "assistant") out.emplace_back("assistant", "");
            out.back().tool_calls.push_back(
                {it["call_id"].get<std::string>(), it["name"].get<std::string>(), it["arguments"].get<std::string>()});
        } else if (type == "function_call_output") {
            for (const auto& [k, v] : it.items())
                if (k != "type" && k != "call_id" && k != "output" && k != "id" && k != "status")
                    return bad("input", fmt::format("input[{}].{} is not supported", i, k));
            if (!it.contains("call_id") || !it["call_id"].is_string())
                return bad("input", fmt::format("input[{}]: a function_call_output needs a string 'call_id'", i));
            ChatMessage m("tool", "");
            const ojson& o = it.value("output", ojson());
            if (o.is_string())
                m.content = o.get<std::string>();
            else if (auto e = read_parts(o, i, false, m.content))
                return e;
            m.tool_call_id = it["call_id"].get<std::string>();
            out.push_back(std::move(m));
        } else {
            return bad("input", fmt::format("input[{}]: items of type '{}' are not supported (message, "
                                            "function_call, function_call_output)",
                                            i, type));
        }
    }
    return std::nullopt;
}

// text.format -> the chat API's response_format.
std::optional<ApiError> read_text(const ojson& t, ojson& chat) {
    if (t.is_null()) return std::nullopt;
    if (!t.is_object()) return bad("text", "'text' must be an object");
    for (const auto& [k, v] : t.items())
        if (k != "format" && !(k == "verbosity" && (v.is_null() || v == "medium")))
            return bad("text", fmt::format("'text.{}' is not supported", k));
    const ojson& f = t.value("format", ojson());
    if (f.is_null()) return std::nullopt;
    if (!f.is_object() || !f.contains("type") || !f["type"].is_string())
        return bad("text", "'text.format' must be an object with a 'type'");
    const std::string type = f["type"].get<std::string>();
    if (type == "text") return std::nullopt;
    if (type == "json_object") {
        chat["response_format"] = {{"type", "json_object"}};
        return std::nullopt;
    }
    if (type != "json_schema")
        return bad("text", fmt::format("'text.format' type '{}' is not one of text, "
                                       "json_object, json_schema",
                                       type));
    ojson js = ojson::object();
    for (const auto& [k, v] : f.items()) {
        if (k == "type") continue;
        if (k != "name" && k != "schema" && k != "strict" && k != "description")
            return bad("text", fmt::format("Unrecognized request argument supplied: text.format.{}", k));
        js[k] = v;
    }
    chat["response_format"] = {{"type", "json_schema"}, {"json_schema", js}};
    return std::nullopt;
}

// tools (Responses' flat function tools) and tool_choice -> the chat API's.
std::optional<ApiError> read_tools(const ojson& body, ojson& chat) {
    if (auto t = body.find("tools"); t != body.end() && !t->is_null()) {
        if (!t->is_array()) return bad("tools", "'tools' must be an array");
        ojson tools = ojson::array();
        for (size_t i = 0; i < t->size(); ++i) {
            const ojson& x = (*t)[i];
            if (!x.is_object() || !x.contains("type") || x["type"] != "function")
                return bad("tools", fmt::format("tools[{}]: the type {} is not supported: this server calls functions "
                                                "('function'), no built-in tools",
                                                i, x.is_object() && x.contains("type") ? x["type"].dump() : "(none)"));
            ojson fn = ojson::object();
            for (const auto& [k, v] : x.items()) {
                if (k == "type") continue;
                if (k != "name" && k != "description" && k != "parameters" && k != "strict")
                    return bad("tools", fmt::format("Unrecognized request argument supplied: tools[{}].{}", i, k));
                fn[k] = v;
            }
            tools.push_back({{"type", "function"}, {"function", fn}});
        }
        if (!tools.empty()) chat["tools"] = std::move(tools);
    }
    if (auto c = body.find("tool_choice"); c != body.end() && !c->is_null()) {
        if (c->is_string()) {
            chat["tool_choice"] = *c;
        } else if (c->is_object() && c->value("type", ojson()) == "function" && c->contains("name") && c->size() == 2) {
            chat["tool_choice"] = {{"type", "function"}, {"function", {{"name", (*c)["name"]}}}};
        } else {
            return bad("tool_choice", fmt::format("'tool_choice' must be none, auto, required or {{\"type\": "
                                                  "\"function\", \"name\": ...}}, got {}",
                                                  c->dump()));
        }
    }
    if (auto p = body.find("parallel_tool_calls"); p != body.end() && !p->is_null()) chat["parallel_tool_calls"] = *p;
    return std::nullopt;
}

}  // namespace

std::variant<ResponsesRequest, ApiError> parse_responses(std::string_view body) {
    ojson j = ojson::parse(body, nullptr, false);
    if (j.is_discarded()) return bad("", "the request body is not valid JSON");
    if (!j.is_object()) return bad("", "the request body must be a JSON object");
    for (const auto& [key, v] : j.items()) {
        const FieldRule* rule = nullptr;
        for (const FieldRule& f : kFields)
            if (key == f.name) rule = &f;
        if (!rule) return bad(key, fmt::format("Unrecognized request argument supplied: {}", key));
        if (rule->does == Does::Refuse && !asks_nothing(key, v))
            return bad(key, fmt::format("'{}' {}", key, rule->why));
    }
    ResponsesRequest r;
    r.body = json::parse(body);
    ojson& chat = r.chat;
    chat = ojson::object();
    if (auto m = j.find("model"); m != j.end() && !m->is_null()) {
        if (!m->is_string()) return bad("model", "'model' must be a string");
        r.model = m->get<std::string>();
        chat["model"] = r.model;
    }
    if (!j.contains("input")) return bad("input", "'input' is required");
    if (auto e = read_input(j["input"], r.input)) return *e;
    if (auto i = j.find("instructions"); i != j.end() && !i->is_null()) {
        if (!i->is_string()) return bad("instructions", "'instructions' must be a string");
        r.instructions = i->get<std::string>();
    }
    if (auto m = j.find("max_output_tokens"); m != j.end() && !m->is_null()) chat["max_tokens"] = *m;
    for (const char* k : {"temperature", "top_p", "priority", "timeout"})
        if (auto v = j.find(k); v != j.end() && !v->is_null()) chat[k] = *v;
    if (auto e = read_text(j.value("text", ojson()), chat)) return *e;
    if (auto e = read_tools(j, chat)) return *e;
    for (auto [k, out] : {std::pair<const char*, bool*>{"stream", &r.stream}, {"store", &r.store}}) {
        auto v = j.find(k);
        if (v == j.end() || v->is_null()) continue;
        if (!v->is_boolean()) return bad(k, fmt::format("'{}' must be a boolean", k));
        *out = v->get<bool>();
    }
    chat["stream"] = r.stream;
    if (auto so = j.find("stream_options"); so != j.end() && !so->is_null()) {
        if (!so->is_object()) return bad("stream_options", "'stream_options' must be an object");
        for (const auto& [k, v] : so->items())
            if (k != "include_obfuscation" || v != false)
                return bad("stream_options", fmt::format("'stream_options.{}' is not supported (only "
                                                         "include_obfuscation: false)",
                                                         k));
    }
    if (auto p = j.find("previous_response_id"); p != j.end() && !p->is_null()) {
        if (!p->is_string() || p->get<std::string>().empty())
            return bad("previous_response_id", "'previous_response_id' must be a response's id");
        r.previous_response_id = p->get<std::string>();
    }
    if (auto m = j.find("metadata"); m != j.end() && !m->is_null()) {
        bool ok = m->is_object() && m->size() <= 16;
        for (const auto& [k, v] : ok ? m->items() : ojson::object().items())
            ok = ok && k.size() <= 64 && v.is_string() && v.get<std::string>().size() <= 512;
        if (!ok)
            return bad("metadata",
                       "'metadata' must be at most 16 string values (keys up to 64 characters, "
                       "values up to 512)");
    }
    // What the model is shown before the conversation: a continuation by context
    // needs the same.
    // (The tool list is rendered when calls may be made: tool_choice none shows none.)
    const bool listed = chat.contains("tools") && chat.value("tool_choice", ojson("auto")) != "none";
    r.shown = ojson({{"instructions", r.instructions ? ojson(*r.instructions) : ojson()},
                     {"tools", listed ? chat["tools"] : ojson()}})
                  .dump();
    return r;
}

namespace {

json usage_json(const Usage& u) {
    return {{"input_tokens", u.prompt_tokens},
            // cache_write_tokens: the input computed (its KV kept for prefixes after it).
            {"input_tokens_details",
             {{"cached_tokens", u.cached_tokens}, {"cache_write_tokens", u.prompt_tokens - u.cached_tokens}}},
            {"output_tokens", u.completion_tokens},
            {"output_tokens_details", {{"reasoning_tokens", 0}}},
            {"total_tokens", u.prompt_tokens + u.completion_tokens}};
}

// An item's status: in_progress while it is written; completed, or incomplete when
// the response was cut.
json message_item(const std::string& id, const std::string& text, const char* status) {
    json content = json::array();
    if (std::string_view(status) != "in_progress" || !text.empty())
        content.push_back(
            {{"type", "output_text"}, {"text", text}, {"annotations", json::array()}, {"logprobs", json::array()}});
    return {{"id", id}, {"type", "message"}, {"status", status}, {"role", "assistant"}, {"content", content}};
}

json call_item(const std::string& id, const ChatToolCall& c, const char* status) {
    const bool done = std::string_view(status) != "in_progress";
    return {{"id", id},        {"type", "function_call"}, {"status", status},
            {"call_id", c.id}, {"name", c.name},          {"arguments", done ? c.arguments : std::string()}};
}

// The Response's status for a chat finish reason: cut by max_output_tokens
// (incomplete), ended by its timeout or cancelled (cancelled), else completed.
const char* status_of(const std::string& finish) {
    if (finish == "length") return "incomplete";
    if (finish == "timeout" || finish == "cancelled") return "cancelled";
    return "completed";
}
const char* item_status(const char* status) {
    return std::string_view(status) == "completed" ? "completed" : "incomplete";
}

std::string msg_id(const std::string& id) { return "msg_" + id.substr(5); }
std::string fc_id(const std::string& id, size_t k) { return fmt::format("fc_{}_{}", id.substr(5), k); }

// The tools as the Response object lists them: every field OpenAI's does, strict
// true (arguments always follow the schema here).
json tools_echo(const json& tools) {
    json out = json::array();
    for (const json& t : tools) {
        json x = t;
        x["strict"] = true;
        if (!x.contains("parameters")) x["parameters"] = nullptr;
        out.push_back(std::move(x));
    }
    return out;
}

}  // namespace

json response_json(const ResponsesRequest& r, const std::string& id, int64_t created, const std::string& model,
                   const ResponseOutcome* o) {
    const json& b = r.body;
    auto field = [&](const char* k, json dflt) { return b.contains(k) && !b[k].is_null() ? b[k] : dflt; };
    json out = json::array();
    std::string status = "in_progress";
    json incomplete = nullptr;
    if (o) {
        const char* is = item_status(status_of(o->finish));
        for (size_t k = 0; k <= o->calls.size(); ++k) {
            if (k == o->text_at && !o->text.empty()) out.push_back(message_item(msg_id(id), o->text, is));
            if (k < o->calls.size()) out.push_back(call_item(fc_id(id, k), o->calls[k], is));
        }
        status = status_of(o->finish);
        if (status == "incomplete") incomplete = {{"reason", "max_output_tokens"}};
    }
    json text_format = field("text", json::object());
    if (!text_format.contains("format") || text_format["format"].is_null()) text_format["format"] = {{"type", "text"}};
    json j = {{"id", id},
              {"object", "response"},
              {"created_at", created},
              {"status", status},
              {"error", nullptr},
              {"incomplete_details", incomplete},
              {"instructions", r.instructions ? json(*r.instructions) : json(nullptr)},
              {"max_output_tokens", field("max_output_tokens", nullptr)},
              {"model", model},
              {"output", out},
              {"parallel_tool_calls", field("parallel_tool_calls", true)},
              {"previous_response_id", r.previous_response_id.empty() ? json(nullptr) : json(r.previous_response_id)},
              {"reasoning", {{"effort", nullptr}, {"summary", nullptr}}},
              {"store", r.store},
              {"temperature", field("temperature", 1.0)},
              {"text", text_format},
              {"tool_choice", field("tool_choice", "auto")},
              {"tools", tools_echo(field("tools", json::array()))},
              {"top_p", field("top_p", 1.0)},
              {"truncation", "disabled"},

              {"metadata", field("metadata", json::object())}};
    if (b.contains("user") && b["user"].is_string()) j["user"] = b["user"];
    if (o) j["usage"] = usage_json(o->usage);
    if (o && status == "completed") j["completed_at"] = o->completed_at;
    return j;
}

ResponseEvents::ResponseEvents(const ResponsesRequest& r, std::string id, int64_t created, std::string model)
    : r_(r), id_(std::move(id)), model_(std::move(model)), created_(created) {}

json ResponseEvents::ev(std::string type, json fields) {
    fields["type"] = std::move(type);
    fields["sequence_number"] = seq_++;
    return fields;
}

std::vector<json> ResponseEvents::start() {
    const json resp = response_json(r_, id_, created_, model_, nullptr);
    return {ev("response.created", {{"response", resp}}), ev("response.in_progress", {{"response", resp}})};
}

std::vector<json> ResponseEvents::piece(const std::string& text, const std::vector<ToolCallDelta>& calls,
                                        size_t text_at) {
    std::vector<json> out;
    auto open_message = [&] {
        message_index_ = next_index_++;
        out.push_back(ev("response.output_item.added",
                         {{"output_index", message_index_}, {"item", message_item(msg_id(id_), "", "in_progress")}}));
        out.push_back(ev(
            "response.content_part.added",
            {{"item_id", msg_id(id_)},
             {"output_index", message_index_},
             {"content_index", 0},
             {"part",
              {{"type", "output_text"}, {"text", ""}, {"annotations", json::array()}, {"logprobs", json::array()}}}}));
    };
    for (const ToolCallDelta& d : calls) {
        if (d.header) {
            if (message_index_ < 0 && !text.empty() && static_cast<size_t>(d.index) >= text_at) open_message();
            call_index_.push_back(next_index_++);
            calls_.push_back({d.id, d.name, ""});
            out.push_back(ev("response.output_item.added", {{"output_index", call_index_.back()},
                                                            {"item", call_item(fc_id(id_, static_cast<size_t>(d.index)),
                                                                               calls_.back(), "in_progress")}}));
        }
        if (!d.arguments.empty()) {
            const size_t k = static_cast<size_t>(d.index);
            calls_[k].arguments += d.arguments;
            out.push_back(ev("response.function_call_arguments.delta",
                             {{"item_id", fc_id(id_, k)}, {"output_index", call_index_[k]}, {"delta", d.arguments}}));
        }
    }
    if (!text.empty()) {
        if (message_index_ < 0) open_message();
        text_ += text;
        out.push_back(ev("response.output_text.delta", {{"item_id", msg_id(id_)},
                                                        {"output_index", message_index_},
                                                        {"content_index", 0},
                                                        {"delta", text},
                                                        {"logprobs", json::array()}}));
    }
    return out;
}

json ResponseEvents::error(const ApiError& e) {
    return ev("error", {{"code", e.code.empty() ? json(nullptr) : json(e.code)},
                        {"message", e.message},
                        {"param", e.param.empty() ? json(nullptr) : json(e.param)}});
}

std::vector<json> ResponseEvents::finish(const ResponseOutcome& o) {
    std::vector<json> out;
    // The items' ends, in output order.
    const int n = next_index_;
    for (int idx = 0; idx < n; ++idx) {
        if (idx == message_index_) {
            const json part = {
                {"type", "output_text"}, {"text", text_}, {"annotations", json::array()}, {"logprobs", json::array()}};
            out.push_back(ev("response.output_text.done", {{"item_id", msg_id(id_)},
                                                           {"output_index", idx},
                                                           {"content_index", 0},
                                                           {"text", text_},
                                                           {"logprobs", json::array()}}));
            out.push_back(ev("response.content_part.done",
                             {{"item_id", msg_id(id_)}, {"output_index", idx}, {"content_index", 0}, {"part", part}}));
            out.push_back(ev(
                "response.output_item.done",
                {{"output_index", idx}, {"item", message_item(msg_id(id_), text_, item_status(status_of(o.finish)))}}));
            continue;
        }
        for (size_t k = 0; k < call_index_.size(); ++k) {
            if (call_index_[k] != idx) continue;
            out.push_back(ev("response.function_call_arguments.done", {{"item_id", fc_id(id_, k)},
                                                                       {"output_index", idx},
                                                                       {"name", calls_[k].name},
                                                                       {"arguments", calls_[k].arguments}}));
            out.push_back(ev("response.output_item.done",
                             {{"output_index", idx},
                              {"item", call_item(fc_id(id_, k), calls_[k], item_status(status_of(o.finish)))}}));
        }
    }
    const json resp = response_json(r_, id_, created_, model_, &o);
    out.push_back(
        ev(resp["status"] == "completed" ? "response.completed" : "response.incomplete", {{"response", resp}}));
    return out;
}

json messages_json(const std::vector<ChatMessage>& msgs) {
    json a = json::array();
    for (const ChatMessage& m : msgs) {
        json x = {{"role", m.role}, {"content", m.content}};
        if (!m.tool_calls.empty()) {
            json calls = json::array();
            for (const ChatToolCall& c : m.tool_calls)
                calls.push_back(
                    {{"id", c.id}, {"type", "function"}, {"function", {{"name", c.name}, {"arguments", c.arguments}}}});
            x["tool_calls"] = std::move(calls);
        }
        if (!m.tool_call_id.empty()) x["tool_call_id"] = m.tool_call_id;
        a.push_back(std::move(x));
    }
    return a;
}

std::vector<ChatMessage> messages_of(const json& j) {
    std::vector<ChatMessage> out;
    for (const json& x : j) {
        ChatMessage m(x.value("role", ""), x.value("content", ""));
        for (const json& c : x.value("tool_calls", json::array()))
            m.tool_calls.push_back(
                {c.value("id", ""), c["function"].value("name", ""), c["function"].value("arguments", "")});
        m.tool_call_id = x.value("tool_call_id", "");
        out.push_back(std::move(m));
    }
    return out;
}

ResponseStore::ResponseStore(std::string dir, size_t max) : dir_(std::move(dir)), max_(std::max<size_t>(max, 1)) {}

std::string ResponseStore::path_of(const std::string& id) const { return dir_ + "/" + id + ".json"; }

namespace {
// A file's directory synced: a rename or unlink in it is durable.
void sync_dir(const std::string& path) {
    const std::string dir = std::filesystem::path(path).parent_path().string();
    const int d = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (d >= 0) {
        (void)::fsync(d);
        ::close(d);
    }
}

json record_json(const StoredResponse& r) {
    return {{"v", 1},
            {"response", r.response},
            {"history", messages_json(r.history)},
            {"shown", r.shown},
            {"context", r.context}};
}
// Writes path whole: a temporary file, fsync, rename, fsync of the directory.
Status write_whole(const std::string& path, const std::string& text) {
    const std::string tmp = path + ".tmp";
    const int fd = ::open(tmp.c_str(), O_CREAT | O_TRUNC | O_WRONLY | O_CLOEXEC, 0600);
    if (fd < 0) return make_error(errno_kind(errno), "creating a response file: {}", std::strerror(errno));
    size_t at = 0;
    while (at < text.size()) {
        const ssize_t n = ::write(fd, text.data() + at, text.size() - at);
        if (n <= 0) {
            const int e = errno;
            ::close(fd);
            ::unlink(tmp.c_str());
            return make_error(errno_kind(e), "writing a response file: {}", std::strerror(e));
        }
        at += static_cast<size_t>(n);
    }
    const bool synced = ::fsync(fd) == 0;
    const int e = errno;
    ::close(fd);  // (always: a failed fsync must not leak it)
    if (!synced || ::rename(tmp.c_str(), path.c_str()) != 0) {
        const int err = synced ? errno : e;
        ::unlink(tmp.c_str());
        return make_error(errno_kind(err), "storing a response file: {}", std::strerror(err));
    }
    sync_dir(path);
    return {};
}
}  // namespace

Status ResponseStore::open(std::vector<std::string>& skipped) {
    if (dir_.empty()) return {};
    std::error_code ec;
    std::filesystem::create_directories(dir_, ec);
    if (ec) return make_error("{}: {}", dir_, ec.message());
    std::vector<std::pair<int64_t, StoredResponse>> found;
    for (const auto& e : std::filesystem::directory_iterator(dir_, ec)) {
        const std::string name = e.path().filename().string();
        if (name.size() > 4 && name.compare(name.size() - 4, 4, ".tmp") == 0) {
            std::filesystem::remove(e.path(), ec);  // a write that did not finish
            continue;
        }
        if (name.size() < 6 || name.compare(name.size() - 5, 5, ".json") != 0) continue;
        std::ifstream in(e.path());
        std::stringstream ss;
        ss << in.rdbuf();
        const json j = json::parse(ss.str(), nullptr, false);
        if (!j.is_object() || j.value("v", 0) != 1 || !j.contains("response") || !j["response"].contains("id")) {
            skipped.push_back(name);
            continue;
        }
        StoredResponse r;
        r.response = j["response"];
        r.id = r.response["id"].get<std::string>();
        r.history = messages_of(j.value("history", json::array()));
        r.shown = j.value("shown", "");
        r.context = j.value("context", false);
        found.emplace_back(r.response.value("created_at", int64_t{0}), std::move(r));
    }
    std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [t, r] : found) {
        const std::string id = r.id;  // (not r.id: the pair below is made, moving r, before the key is)
        lru_.push_back(id);
        by_id_.emplace(id, std::make_pair(std::move(r), std::prev(lru_.end())));
    }
    return {};
}

std::optional<StoredResponse> ResponseStore::get(const std::string& id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = by_id_.find(id);
    if (it == by_id_.end()) return std::nullopt;
    lru_.splice(lru_.begin(), lru_, it->second.second);
    return it->second.first;
}

Result<std::vector<std::string>> ResponseStore::put(const StoredResponse& r) {
    if (!dir_.empty())
        if (Status st = write_whole(path_of(r.id), record_json(r).dump(-1, ' ', false, json::error_handler_t::replace));
            !st)
            return st.error();
    std::vector<std::string> gone;
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = by_id_.find(r.id); it != by_id_.end()) {
        lru_.erase(it->second.second);
        by_id_.erase(it);
    }
    lru_.push_front(r.id);
    by_id_.emplace(r.id, std::make_pair(r, lru_.begin()));
    while (lru_.size() > max_) {
        const std::string old = lru_.back();
        lru_.pop_back();
        by_id_.erase(old);
        if (!dir_.empty()) ::unlink(path_of(old).c_str());
        gone.push_back(old);
    }
    if (!dir_.empty() && !gone.empty()) sync_dir(path_of(r.id));
    return gone;
}

bool ResponseStore::remove(const std::string& id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = by_id_.find(id);
    if (it == by_id_.end()) return false;
    lru_.erase(it->second.second);
    by_id_.erase(it);
    if (!dir_.empty()) {
        ::unlink(path_of(id).c_str());
        sync_dir(path_of(id));
    }
    return true;
}

std::vector<std::string> ResponseStore::ids() {
    std::lock_guard<std::mutex> lock(mu_);
    return {lru_.begin(), lru_.end()};
}

size_t ResponseStore::size() {
    std::lock_guard<std::mutex> lock(mu_);
    return by_id_.size();
}

}  // namespace duet
