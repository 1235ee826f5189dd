// Tool calls (the OpenAI API's tools, tool_choice, parallel_tool_calls): one
// description per tool format serves all three things a format is used for —
//   render     the tool list, earlier calls and tool results as the plain messages
//              the chat template writes (render_tool_messages);
//   constrain  the output as a grammar (tool_grammar: an xgrammar structural tag),
//              so that a call, once opened, names an offered function and its
//              arguments follow that function's parameter schema;
//   parse      the output back into text and calls, streamed or whole, the same way
//              (ToolCallParser: whole = the concatenation of its streamed parts).
//
// A call is written begin(name) + arguments + end, where arguments is one JSON
// object; parallel calls are joined by the separator. The formats:
//   hermes      ChatML models (SmolLM2, Qwen2): <tool_call>\n{"name": "NAME",
//               "arguments": ARGS}\n</tool_call>, the tools listed as JSON lines
//               in <tools></tools> in the system message, results returned in a
//               user message as <tool_response>...</tool_response>
//   llama3-json Llama 3.x's JSON calls: {"name": "NAME", "parameters": ARGS}, the
//               tools listed in the system message, results as ipython messages.
//               A call has no opening of its own, so with tools offered (auto) text
//               that starts as a call does ({"name": "...) is one.
#pragma once

#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/result.h"
#include "model/chat_template.h"

namespace duet {

// A function the client offers (tools[i].function).
struct ToolDef {
    std::string name;         // [A-Za-z0-9_-]{1,64}, as OpenAI requires
    std::string description;  // "" if none
    std::string parameters;   // a JSON schema of an object, as the client wrote it (its property order kept)
};

enum class ToolChoiceMode : uint8_t {
    Auto,      // the model writes text, calls, or both; a call it opens is constrained
    None,      // no call: the tools are neither shown nor parsed
    Required,  // one call or more (one with parallel_tool_calls false), nothing else
    Named,     // one call of the named function, nothing else
};
struct ToolChoice {
    ToolChoiceMode mode = ToolChoiceMode::Auto;
    std::string name;  // Named
};

enum class ToolFormat : uint8_t { Hermes, Llama3Json };
// The format of a chat template's models (chatml, smollm2, qwen2: hermes; llama3:
// llama3-json).
ToolFormat tool_format_of(ChatFormat f);
std::string_view tool_format_name(ToolFormat f);

// How one format writes a call.
struct ToolSyntax {
    std::string_view trigger;      // the text that opens a call in free text (a prefix of every begin)
    std::string_view name_before;  // begin(name) = name_before + name + name_after
    std::string_view name_after;
    std::string_view end;        // after the arguments
    std::string_view separator;  // between parallel calls
    std::string begin(std::string_view name) const;
};
const ToolSyntax& tool_syntax(ToolFormat f);

// The grammar the output follows (an xgrammar structural tag, as JSON text) for
// tool_choice auto, required or named (not none). parallel false: one call at most.
// content_schema (a JSON schema; the request's response_format): with tool_choice
// auto the output is then either calls alone or content alone that the schema
// takes (no text beside calls); required and named give calls only, so it does not
// apply.
std::string tool_grammar(ToolFormat f, std::span<const ToolDef> tools, const ToolChoice& choice, bool parallel,
                         const std::string* content_schema = nullptr);

// The conversation as the chat template takes it: the tool list added to the system
// message (one is made from default_system when the first message is not a system
// message), each assistant message's calls written in the format after its content,
// and tool messages as the format returns results. tools empty: the tool list is
// left out (tool_choice none), calls and results are still written.
Result<std::vector<ChatMessage>> render_tool_messages(ToolFormat f, std::span<const ToolDef> tools,
                                                      std::span<const ChatMessage> messages,
                                                      std::string_view default_system);

// A call as it is being streamed: the first delta of call `index` has its id and
// name (header); every delta may carry a piece of its arguments.
struct ToolCallDelta {
    int index = 0;
    bool header = false;
    std::string id, name, arguments;
};

// Splits a choice's text into its content and its calls, as the text arrives. Only
// text the format could not still turn into a call is released as content; a call's
// arguments are released as they come. A run of whitespace at the start or right
// after a call is kept back and dropped when a call or the end follows (a whole
// answer of calls has no content, as OpenAI's). Feeding a text in any
// number of pieces gives the same content (concatenated), the same deltas
// (concatenated per call) and the same calls.
class ToolCallParser {
public:
    // names: the functions offered; id_prefix: the calls' ids are id_prefix + index;
    // calls_only: the grammar allows calls and nothing else (tool_choice required or
    // a named function), so text kept back at the end is a call cut short, dropped.
    ToolCallParser(ToolFormat f, std::vector<std::string> names, std::string id_prefix, bool calls_only = false);

    struct Out {
        std::string content;
        std::vector<ToolCallDelta> deltas;  // one per call touched, in call order
    };
    // The next piece of text; terminal: the text has ended. What was kept back is
    // released (the start of a trigger) or dropped (whitespace after a call, a call
    // opened whose name is not whole yet); a call cut short keeps the arguments it has.
    Out feed(std::string_view text, bool terminal);
    const std::vector<ChatToolCall>& calls() const { return calls_; }
    const std::string& content() const { return content_; }  // all released so far
    // How many calls had opened when the first content was released (the content's
    // place among the calls; the calls' count while there is none).
    size_t content_at() const { return content_.empty() ? calls_.size() : content_at_; }

private:
    enum class State : uint8_t { Text, Begin, Args, End };
    void step(char c, Out& out);
    void release(std::string_view s, Out& out);
    void arg(char c, Out& out);
    void close_args(Out& out);
    void back_to_text(char c, Out& out);

    const ToolSyntax* syn_;
    std::vector<std::string> begins_;  // begin(name) of each offered function
    std::vector<std::string> names_;
    std::string id_prefix_;
    bool calls_only_ = false;
    State state_ = State::Text;
    std::string hold_;         // text kept back: a possible trigger or begin, or an end being matched
    // Text at the start or right after a call: whitespace is kept back in hold_ (and
    // dropped if a call or the end follows).
    bool after_call_ = true;
    // The arguments' JSON value being scanned.
    int depth_ = 0;
    bool started_ = false, in_string_ = false, escape_ = false;
    std::vector<ChatToolCall> calls_;
    std::string content_;
    size_t content_at_ = 0;
};

}  // namespace duet
