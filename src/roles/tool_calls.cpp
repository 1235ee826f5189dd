#include "roles/tool_calls.h"

#include <nlohmann/json.hpp>

#include "engine/grammar.h"

namespace duet {

using ojson = nlohmann::ordered_json;

namespace {

// Whitespace between JSON tokens of the arguments, as for response_format schemas
// (engine/grammar.cpp): free, at most this many in a row.
constexpr int kMaxWhitespace = 16;

constexpr ToolSyntax kHermes{"<tool_call>", "<tool_call>\n{\"name\": \"", "\", \"arguments\": ", "}\n</tool_call>",
                             "\n"};
constexpr ToolSyntax kLlama3{"{\"name\": \"", "{\"name\": \"", "\", \"parameters\": ", "}", "\n"};

bool is_space(char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }

// A tool as the tool list shows it: {"type": "function", "function": {...}}, its
// parameters in the client's order.
std::string tool_line(const ToolDef& t) {
    ojson fn = ojson::object();
    fn["name"] = t.name;
    if (!t.description.empty()) fn["description"] = t.description;
    fn["parameters"] = ojson::parse(t.parameters);
    ojson line = ojson::object();
    line["type"] = "function";
    line["function"] = std::move(fn);
    return line.dump();
}

std::string tools_block(ToolFormat f, std::span<const ToolDef> tools) {
    std::string lines;
    for (const ToolDef& t : tools) lines += tool_line(t) + "\n";
    if (f == ToolFormat::Hermes)
        return "# Tools\n\nYou may call one or more functions to answer. They are listed inside <tools></tools>, one "
               "JSON object per line:\n<tools>\n" +
               lines +
               "</tools>\n\nTo call a function, write its name and its arguments as a JSON object inside "
               "<tool_call></tool_call> tags:\n<tool_call>\n{\"name\": <function name>, \"arguments\": <arguments "
               "as a JSON object>}\n</tool_call>";
    return "You have access to the functions below. To call one, answer with only a JSON object of the form "
           "{\"name\": <function name>, \"parameters\": <arguments as a JSON object>}, and nothing else.\n\n" +
           lines;
}

// Calls as the model writes them, joined by the separator.
std::string calls_text(const ToolSyntax& syn, std::span<const ChatToolCall> calls) {
    std::string out;
    for (size_t i = 0; i < calls.size(); ++i) {
        if (i) out += syn.separator;
        out += syn.begin(calls[i].name);
        out += calls[i].arguments;
        out += syn.end;
    }
    return out;
}

}  // namespace

ToolFormat tool_format_of(ChatFormat f) {
    return f == ChatFormat::Llama3 ? ToolFormat::Llama3Json : ToolFormat::Hermes;
}

std::string_view tool_format_name(ToolFormat f) { return f == ToolFormat::Hermes ? "hermes" : "llama3-json"; }

std::string ToolSyntax::begin(std::string_view name) const {
    std::string s(name_before);
    s += name;
    s += name_after;
    return s;
}

const ToolSyntax& tool_syntax(ToolFormat f) { return f == ToolFormat::Hermes ? kHermes : kLlama3; }

std::string tool_grammar(ToolFormat f, std::span<const ToolDef> tools, const ToolChoice& choice, bool parallel,
                         const std::string* content_schema) {
    const ToolSyntax& syn = tool_syntax(f);
    ojson tags = ojson::array();
    for (const ToolDef& t : tools) {
        if (choice.mode == ToolChoiceMode::Named && t.name != choice.name) continue;
        ojson content = ojson::object();
        content["type"] = "json_schema";
        content["json_schema"] = ojson::parse(t.parameters);
        content["max_whitespace_cnt"] = kMaxWhitespace;
        ojson tag = ojson::object();
        tag["type"] = "tag";
        tag["begin"] = syn.begin(t.name);
        tag["content"] = std::move(content);
        tag["end"] = std::string(syn.end);
        tags.push_back(std::move(tag));
    }
    ojson format = ojson::object();
    if (choice.mode == ToolChoiceMode::Auto && content_schema) {
        // Calls (at least one), or the content the schema takes: one or the other.
        ojson calls = ojson::object();
        calls["type"] = "tags_with_separator";
        calls["tags"] = std::move(tags);
        calls["separator"] = std::string(syn.separator);
        calls["at_least_one"] = true;
        calls["stop_after_first"] = !parallel;
        ojson content = ojson::object();
        content["type"] = "json_schema";
        content["json_schema"] = ojson::parse(*content_schema);
        content["max_whitespace_cnt"] = kMaxWhitespace;
        format["type"] = "or";
        format["elements"] = ojson::array({std::move(calls), std::move(content)});
    } else if (choice.mode == ToolChoiceMode::Auto) {
        // Free text until the trigger; then one of the calls.
        format["type"] = "triggered_tags";
        format["triggers"] = ojson::array({std::string(syn.trigger)});
        format["tags"] = std::move(tags);
        format["at_least_one"] = false;
        format["stop_after_first"] = !parallel;
    } else {
        // Calls only, separated; a named function is called once.
        format["type"] = "tags_with_separator";
        format["tags"] = std::move(tags);
        format["separator"] = std::string(syn.separator);
        format["at_least_one"] = true;
        format["stop_after_first"] = !parallel || choice.mode == ToolChoiceMode::Named;
    }
    ojson st = ojson::object();
    st["type"] = "structural_tag";
    st["format"] = std::move(format);
    return st.dump();
}

Result<std::vector<ChatMessage>> render_tool_messages(ToolFormat f, std::span<const ToolDef> tools,
                                                      std::span<const ChatMessage> messages,
                                                      std::string_view default_system) {
    const ToolSyntax& syn = tool_syntax(f);
    std::vector<ChatMessage> out;
    if (!tools.empty()) {
        const std::string block = tools_block(f, tools);
        ChatMessage sys{"system", std::string(default_system)};
        if (!messages.empty() && messages.front().role == "system") sys.content = messages.front().content;
        sys.content += sys.content.empty() ? block : "\n\n" + block;
        out.push_back(std::move(sys));
        if (!messages.empty() && messages.front().role == "system") messages = messages.subspan(1);
    }
    for (size_t i = 0; i < messages.size(); ++i) {
        const ChatMessage& m = messages[i];
        if (m.role == "tool") {
            // hermes: consecutive results go in one user message; llama3: ipython messages.
            if (f == ToolFormat::Llama3Json) {
                out.push_back({"ipython", m.content});
                continue;
            }
            std::string text = "<tool_response>\n" + m.content + "\n</tool_response>";
            if (i > 0 && messages[i - 1].role == "tool" && !out.empty())
                out.back().content += "\n" + text;
            else
                out.push_back({"user", std::move(text)});
            continue;
        }
        if (!m.tool_calls.empty()) {
            if (m.role != "assistant") return make_error("message {}: only an assistant message has tool calls", i);
            std::string text = m.content;
            if (!text.empty()) text += syn.separator;
            text += calls_text(syn, m.tool_calls);
            out.push_back({m.role, std::move(text)});
            continue;
        }
        out.push_back({m.role, m.content});
    }
    return out;
}

ToolCallParser::ToolCallParser(ToolFormat f, std::vector<std::string> names, std::string id_prefix, bool calls_only)
    : syn_(&tool_syntax(f)), names_(std::move(names)), id_prefix_(std::move(id_prefix)), calls_only_(calls_only) {
    for (const std::string& n : names_) begins_.push_back(syn_->begin(n));
}

void ToolCallParser::release(std::string_view s, Out& out) {
    if (content_.empty() && !s.empty()) content_at_ = calls_.size();
    out.content += s;
    content_ += s;
}

ToolCallParser::Out ToolCallParser::feed(std::string_view text, bool terminal) {
    Out out;
    for (char c : text) step(c, out);
    if (terminal) {
        switch (state_) {
            case State::Text: {  // a trigger's start is text; whitespace alone after a call (or first) is not
                bool blank = after_call_;
                for (char h : hold_) blank = blank && is_space(h);
                if (!calls_only_ && !blank) release(hold_, out);
                break;
            }
            case State::Begin:  // a call cut short before its name was whole: no call, and not text
            case State::Args:   // cut short: the call keeps the arguments it has
            case State::End: break;
        }
        hold_.clear();
        state_ = State::Text;
        after_call_ = true;
    }
    return out;
}

void ToolCallParser::step(char c, Out& out) {
    switch (state_) {
        case State::Text: {
            hold_ += c;
            size_t ws = 0;  // right after a call: its leading whitespace waits for what follows
            if (after_call_)
                while (ws < hold_.size() && is_space(hold_[ws])) ++ws;
            const std::string_view rest = std::string_view(hold_).substr(ws);
            if (after_call_ && syn_->trigger.substr(0, rest.size()) == rest) {
                if (rest.size() == syn_->trigger.size()) {  // another call: the whitespace is dropped
                    hold_.erase(0, ws);
                    after_call_ = false;
                    state_ = State::Begin;
                }
                return;
            }
            if (after_call_) {  // text follows the call: its whitespace is text too
                release(std::string_view(hold_).substr(0, ws), out);
                hold_.erase(0, ws);
                after_call_ = false;
            }
            // Keep back the longest end of the held text that could still begin the
            // trigger; release the rest.
            size_t cut = 0;
            while (cut < hold_.size() &&
                   syn_->trigger.substr(0, hold_.size() - cut) != std::string_view(hold_).substr(cut))
                ++cut;
            if (cut) {
                release(std::string_view(hold_).substr(0, cut), out);
                hold_.erase(0, cut);
            }
            if (hold_.size() == syn_->trigger.size()) state_ = State::Begin;  // hold_ == trigger
            return;
        }
        case State::Begin: {
            hold_ += c;
            for (size_t k = 0; k < begins_.size(); ++k) {
                if (begins_[k] == hold_) {  // a call of names_[k] opens
                    ToolCallDelta d;
                    d.index = static_cast<int>(calls_.size());
                    d.header = true;
                    d.id = id_prefix_ + std::to_string(calls_.size());
                    d.name = names_[k];
                    calls_.push_back({d.id, d.name, ""});
                    out.deltas.push_back(std::move(d));
                    hold_.clear();
                    state_ = State::Args;
                    depth_ = 0;
                    started_ = in_string_ = escape_ = false;
                    return;
                }
            }
            for (const std::string& b : begins_)
                if (b.size() > hold_.size() && b.compare(0, hold_.size(), hold_) == 0) return;  // may still open one
            // Not a call of any offered function (output not made under the grammar).
            back_to_text(c, out);
            return;
        }
        case State::Args: arg(c, out); return;
        case State::End: {
            hold_ += c;
            if (hold_ == syn_->end) {
                hold_.clear();
                state_ = State::Text;
                after_call_ = true;
                return;
            }
            if (syn_->end.substr(0, hold_.size()) == hold_) return;
            // Something else after the arguments.
            back_to_text(c, out);
            return;
        }
    }
}

// What was held (ending with c) is text after all: released, and c read again as
// text (it may start a trigger).
void ToolCallParser::back_to_text(char c, Out& out) {
    state_ = State::Text;
    std::string held = std::exchange(hold_, {});
    held.pop_back();
    release(held, out);
    step(c, out);
}

// One character of a call's arguments (a JSON value): appended to the call and to
// its delta; the value's end moves to the end marker.
void ToolCallParser::arg(char c, Out& out) {
    if (!started_ && !is_space(c)) started_ = true;
    bool ends = false, belongs = true;
    if (started_) {
        if (in_string_) {
            if (escape_)
                escape_ = false;
            else if (c == '\\')
                escape_ = true;
            else if (c == '"') {
                in_string_ = false;
                ends = depth_ == 0;
            }
        } else if (c == '"') {
            in_string_ = true;
        } else if (c == '{' || c == '[') {
            ++depth_;
        } else if (c == '}' || c == ']') {
            if (depth_ == 0)
                belongs = false;  // a scalar's end: this is past the value
            else
                ends = --depth_ == 0;
        } else if (depth_ == 0 && (is_space(c) || c == ',')) {
            belongs = false;  // the end of a scalar value
        }
    }
    if (belongs) {
        calls_.back().arguments += c;
        if (out.deltas.empty() || out.deltas.back().index + 1 != static_cast<int>(calls_.size())) {
            ToolCallDelta d;
            d.index = static_cast<int>(calls_.size()) - 1;
            out.deltas.push_back(std::move(d));
        }
        out.deltas.back().arguments += c;
    }
    if (ends || !belongs) close_args(out);
    if (!belongs) step(c, out);
}

void ToolCallParser::close_args(Out&) {
    state_ = State::End;
    hold_.clear();
}

}  // namespace duet
