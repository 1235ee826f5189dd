// Tool calls (roles/tool_calls.h): the parser splits text into content and calls
// whatever the pieces it arrives in; the rendered conversation is the format's text
// written out by hand here; the calls' grammar accepts exactly the calls the
// tool_choice allows (xgrammar's matcher fed the text, byte by byte).
#include <gtest/gtest.h>
#include <xgrammar/xgrammar.h>

#include <string>
#include <vector>

#include "engine/grammar.h"
#include "roles/tool_calls.h"

namespace duet {
namespace {

const std::vector<ToolDef>& tools() {
    static const std::vector<ToolDef> t = {
        {"add", "Adds two integers",
         R"({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]})"},
        {"get_weather", "",
         R"({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": false})"}};
    return t;
}

std::vector<std::string> names() { return {"add", "get_weather"}; }

struct Parsed {
    std::string content;
    std::vector<ChatToolCall> calls;
    std::vector<std::string> streamed_args;  // per call: its deltas' arguments concatenated
    std::vector<std::string> streamed_names;
};

// Feeds text in pieces of at most `piece` bytes (0: whole), the last one terminal.
Parsed parse(ToolFormat f, const std::string& text, size_t piece) {
    ToolCallParser p(f, names(), "call_x_");
    Parsed out;
    auto take = [&](const ToolCallParser::Out& o) {
        out.content += o.content;
        for (const ToolCallDelta& d : o.deltas) {
            if (d.header) {
                EXPECT_EQ(d.index, static_cast<int>(out.streamed_args.size()));
                EXPECT_EQ(d.id, "call_x_" + std::to_string(d.index));
                out.streamed_args.emplace_back();
                out.streamed_names.push_back(d.name);
            }
            EXPECT_LT(static_cast<size_t>(d.index), out.streamed_args.size());
            out.streamed_args.at(static_cast<size_t>(d.index)) += d.arguments;
        }
    };
    if (piece == 0) {
        take(p.feed(text, true));
    } else {
        for (size_t at = 0; at < text.size(); at += piece) take(p.feed(text.substr(at, piece), false));
        take(p.feed("", true));
    }
    out.calls = p.calls();
    EXPECT_EQ(out.content, p.content());
    return out;
}

// Every way of feeding it (whole, byte by byte, pieces of 2..7, and every split in
// two) gives the same content, calls and streamed calls.
Parsed parse_all_ways(ToolFormat f, const std::string& text) {
    const Parsed whole = parse(f, text, 0);
    EXPECT_EQ(whole.streamed_args.size(), whole.calls.size());
    for (size_t i = 0; i < whole.calls.size(); ++i) {
        EXPECT_EQ(whole.streamed_args[i], whole.calls[i].arguments);
        EXPECT_EQ(whole.streamed_names[i], whole.calls[i].name);
    }
    for (size_t piece = 1; piece <= 7; ++piece) {
        const Parsed p = parse(f, text, piece);
        EXPECT_EQ(p.content, whole.content) << "pieces of " << piece << ": " << text;
        EXPECT_EQ(p.calls, whole.calls) << "pieces of " << piece << ": " << text;
        EXPECT_EQ(p.streamed_args, whole.streamed_args) << "pieces of " << piece;
    }
    for (size_t cut = 0; cut <= text.size(); ++cut) {
        ToolCallParser p(f, names(), "call_x_");
        std::string content = p.feed(text.substr(0, cut), false).content;
        content += p.feed(text.substr(cut), true).content;
        EXPECT_EQ(content, whole.content) << "split at " << cut << ": " << text;
        EXPECT_EQ(p.calls(), whole.calls) << "split at " << cut << ": " << text;
    }
    return whole;
}

ChatToolCall call(std::string id, std::string name, std::string args) {
    return {std::move(id), std::move(name), std::move(args)};
}

TEST(ToolCalls, HermesTextAndCallsAreSplitWhateverThePieces) {
    const ToolFormat h = ToolFormat::Hermes;
    // Text alone, including what looks like the start of a call but is not one.
    EXPECT_EQ(parse_all_ways(h, "Just text, <b>bold</b> and <tool_cal").content,
              "Just text, <b>bold</b> and <tool_cal");
    EXPECT_TRUE(parse_all_ways(h, "plain").calls.empty());
    // Text, then a call whose string argument holds braces, quotes and the end marker's
    // characters.
    Parsed p = parse_all_ways(
        h, "Sure.\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": \"}\\\"{[\"}}\n</tool_call>");
    EXPECT_EQ(p.content, "Sure.\n");
    EXPECT_EQ(p.calls, (std::vector<ChatToolCall>{call("call_x_0", "add", "{\"a\": 1, \"b\": \"}\\\"{[\"}")}));
    // Two calls separated by whitespace (dropped), nested objects, empty arguments.
    p = parse_all_ways(h,
                       "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": {\"n\": [1, {\"x\": 2}]}}}\n"
                       "</tool_call>\n  \n<tool_call>\n{\"name\": \"add\", \"arguments\": {}}\n</tool_call>\n");
    EXPECT_EQ(p.content, "");
    EXPECT_EQ(p.calls,
              (std::vector<ChatToolCall>{call("call_x_0", "get_weather", "{\"city\": {\"n\": [1, {\"x\": 2}]}}"),
                                         call("call_x_1", "add", "{}")}));
    // Text after a call keeps the whitespace before it.
    p = parse_all_ways(h, "<tool_call>\n{\"name\": \"add\", \"arguments\": {}}\n</tool_call>\n Done.");
    EXPECT_EQ(p.content, "\n Done.");
    EXPECT_EQ(p.calls.size(), 1u);
    // Whitespace first: text if text follows, dropped if a call or the end does.
    EXPECT_EQ(parse_all_ways(h, "  Hi").content, "  Hi");
    EXPECT_EQ(parse_all_ways(h, " \n ").content, "");
    p = parse_all_ways(h, "\n\n<tool_call>\n{\"name\": \"add\", \"arguments\": {}}\n</tool_call>");
    EXPECT_EQ(p.content, "");
    EXPECT_EQ(p.calls.size(), 1u);
    // After a call, a trigger's start at the end is text with its whitespace.
    EXPECT_EQ(parse_all_ways(h, "<tool_call>\n{\"name\": \"add\", \"arguments\": {}}\n</tool_call>\n<t").content,
              "\n<t");
    // A call cut short (max_tokens) keeps the arguments it has; one cut before its name
    // was whole is dropped; a trigger's start is text.
    p = parse_all_ways(h, "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1");
    EXPECT_EQ(p.content, "");
    EXPECT_EQ(p.calls, (std::vector<ChatToolCall>{call("call_x_0", "add", "{\"a\": 1")}));
    p = parse_all_ways(h, "x <tool_call>\n{\"name\": \"ad");
    EXPECT_EQ(p.content, "x ");
    EXPECT_TRUE(p.calls.empty());
    p = parse_all_ways(h, "x <tool_ca");
    EXPECT_EQ(p.content, "x <tool_ca");
    // Where only calls are allowed (required, named), what is kept back at the end is a
    // call cut short: dropped, not text.
    const std::string cut = "<tool_call>\n{\"name\": \"add\", \"arguments\": {}}\n</tool_call>\n<tool_ca";
    ToolCallParser only(h, names(), "c", true), free(h, names(), "c", false);
    EXPECT_EQ(only.feed(cut, true).content, "");
    EXPECT_EQ(free.feed(cut, true).content, "\n<tool_ca");
    EXPECT_EQ(only.calls(), free.calls());
    EXPECT_EQ(only.calls().size(), 1u);
    // A function nobody offered is text.
    p = parse_all_ways(h, "<tool_call>\n{\"name\": \"rm\", \"arguments\": {}}\n</tool_call>");
    EXPECT_EQ(p.content, "<tool_call>\n{\"name\": \"rm\", \"arguments\": {}}\n</tool_call>");
    EXPECT_TRUE(p.calls.empty());
}

TEST(ToolCalls, Llama3JsonCallsAreSplitWhateverThePieces) {
    const ToolFormat l = ToolFormat::Llama3Json;
    Parsed p = parse_all_ways(l, "{\"name\": \"add\", \"parameters\": {\"a\": {\"b\": \"}}\"}}}");
    EXPECT_EQ(p.content, "");
    EXPECT_EQ(p.calls, (std::vector<ChatToolCall>{call("call_x_0", "add", "{\"a\": {\"b\": \"}}\"}}")}));
    p = parse_all_ways(l,
                       "{\"name\": \"add\", \"parameters\": {}}\n{\"name\": \"get_weather\", \"parameters\": "
                       "{\"city\": \"Oslo\"}}");
    EXPECT_EQ(p.calls, (std::vector<ChatToolCall>{call("call_x_0", "add", "{}"),
                                                  call("call_x_1", "get_weather", "{\"city\": \"Oslo\"}")}));
    EXPECT_EQ(parse_all_ways(l, "a {\"x\": 1} b").content, "a {\"x\": 1} b");
}

TEST(ToolCalls, HermesRenderingWritesToolsCallsAndResults) {
    std::vector<ChatMessage> msgs = {{"user", "What is 2+3?"}, {"assistant", ""}, {"tool", "5"}, {"tool", "ok"}};
    msgs[1].tool_calls = {call("c1", "add", "{\"a\": 2, \"b\": 3}"), call("c2", "get_weather", "{\"city\": \"Rome\"}")};
    msgs[2].tool_call_id = "c1";
    msgs[3].tool_call_id = "c2";
    auto r = render_tool_messages(ToolFormat::Hermes, std::span<const ToolDef>(tools()).first(1), msgs, "Be kind.");
    ASSERT_TRUE(r) << r.error().message;
    ASSERT_EQ(r->size(), 4u);
    EXPECT_EQ((*r)[0].role, "system");
    const std::string& sys = (*r)[0].content;
    EXPECT_EQ(sys.rfind("Be kind.\n\n# Tools\n", 0), 0u) << sys;
    EXPECT_NE(sys.find("<tools>\n{\"type\":\"function\",\"function\":{\"name\":\"add\",\"description\":\"Adds two "
                       "integers\",\"parameters\":{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"},"
                       "\"b\":{\"type\":\"integer\"}},\"required\":[\"a\",\"b\"]}}}\n</tools>"),
              std::string::npos)
        << sys;
    EXPECT_EQ(sys.find("get_weather"), std::string::npos);
    EXPECT_EQ((*r)[1].role, "user");
    EXPECT_EQ((*r)[2].role, "assistant");
    EXPECT_EQ((*r)[2].content,
              "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 2, \"b\": 3}}\n</tool_call>\n"
              "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call>");
    EXPECT_TRUE((*r)[2].tool_calls.empty());
    EXPECT_EQ((*r)[3].role, "user");
    EXPECT_EQ((*r)[3].content, "<tool_response>\n5\n</tool_response>\n<tool_response>\nok\n</tool_response>");
    // A system message of the client's keeps its text first; no tools: no list.
    std::vector<ChatMessage> with_sys = {{"system", "S"}, {"user", "u"}};
    r = render_tool_messages(ToolFormat::Hermes, tools(), with_sys, "Be kind.");
    ASSERT_TRUE(r);
    EXPECT_EQ((*r)[0].content.rfind("S\n\n# Tools\n", 0), 0u);
    EXPECT_EQ(r->size(), 2u);
    r = render_tool_messages(ToolFormat::Hermes, {}, with_sys, "Be kind.");
    ASSERT_TRUE(r);
    EXPECT_EQ((*r)[0].content, "S");
    // The chat template refuses calls it was not given rendered.
    auto t = ChatTemplate::from_name("chatml");
    ASSERT_TRUE(t);
    EXPECT_FALSE(t->apply(msgs, true));
}

TEST(ToolCalls, Llama3RenderingWritesCallsAsJsonAndResultsAsIpython) {
    std::vector<ChatMessage> msgs = {{"user", "Add"}, {"assistant", "Calling."}, {"tool", "5"}};
    msgs[1].tool_calls = {call("c1", "add", "{\"a\": 2, \"b\": 3}")};
    auto r = render_tool_messages(ToolFormat::Llama3Json, tools(), msgs, "");
    ASSERT_TRUE(r);
    ASSERT_EQ(r->size(), 4u);
    EXPECT_EQ((*r)[0].role, "system");
    EXPECT_NE((*r)[0].content.find("{\"type\":\"function\",\"function\":{\"name\":\"get_weather\""), std::string::npos);
    EXPECT_EQ((*r)[2].content, "Calling.\n{\"name\": \"add\", \"parameters\": {\"a\": 2, \"b\": 3}}");
    EXPECT_EQ((*r)[3].role, "ipython");
    EXPECT_EQ((*r)[3].content, "5");
}

// The grammar over a byte vocabulary (256 bytes and an end token): whether it takes
// the text, then whether it may end there.
struct Verdict {
    bool takes = false, ends = false;
};
Verdict run(const std::string& grammar, const std::string& text) {
    std::vector<std::string> v;
    for (int b = 0; b < 256; ++b) v.emplace_back(1, static_cast<char>(b));
    v.emplace_back();
    xgrammar::TokenizerInfo info(v, xgrammar::VocabType::RAW, 257, std::vector<int32_t>{256}, false);
    xgrammar::GrammarCompiler compiler(info, 1, false);
    xgrammar::GrammarMatcher m(compiler.CompileStructuralTag(grammar));
    Verdict out;
    out.takes = true;
    for (unsigned char c : text)
        if (!m.AcceptToken(c)) {
            out.takes = false;
            return out;
        }
    out.ends = m.AcceptToken(256);
    return out;
}

TEST(ToolCalls, TheGrammarTakesTheCallsTheChoiceAllowsAndNoOthers) {
    const ToolSyntax& s = tool_syntax(ToolFormat::Hermes);
    const std::string add = s.begin("add") + "{\"a\": 1, \"b\": 2}" + std::string(s.end);
    const std::string weather = s.begin("get_weather") + "{\"city\": \"Oslo\"}" + std::string(s.end);
    const ToolChoice autoc{ToolChoiceMode::Auto, ""}, required{ToolChoiceMode::Required, ""},
        named{ToolChoiceMode::Named, "get_weather"};
    for (bool parallel : {true, false}) {
        const std::string g = tool_grammar(ToolFormat::Hermes, tools(), required, parallel);
        ASSERT_TRUE(check_grammar(GrammarSpec{GrammarKind::StructuralTag, g})) << g;
        EXPECT_TRUE(run(g, add).ends);
        EXPECT_TRUE(run(g, weather).ends);
        EXPECT_FALSE(run(g, "Hi" + add).takes);                                          // nothing but calls
        EXPECT_FALSE(run(g, s.begin("rm")).takes);                                       // only offered functions
        EXPECT_FALSE(run(g, s.begin("add") + "{\"a\": 1}" + std::string(s.end)).takes);  // b is required
        EXPECT_FALSE(run(g, s.begin("get_weather") + "{\"city\": 3}").takes);            // city is a string
        EXPECT_FALSE(run(g, "").ends);                                                   // at least one call
        const Verdict two = run(g, add + "\n" + weather);
        EXPECT_EQ(two.takes && two.ends, parallel);
    }
    for (bool parallel : {true, false}) {  // a named function is called once
        const std::string n = tool_grammar(ToolFormat::Hermes, tools(), named, parallel);
        EXPECT_TRUE(run(n, weather).ends);
        EXPECT_FALSE(run(n, add).takes);
        EXPECT_FALSE(run(n, weather + "\n" + weather).takes && run(n, weather + "\n" + weather).ends);
    }
    for (bool parallel : {true, false}) {
        const std::string a = tool_grammar(ToolFormat::Hermes, tools(), autoc, parallel);
        EXPECT_TRUE(run(a, "Just text.").ends);
        EXPECT_TRUE(run(a, "Let me add.\n" + add).ends);
        EXPECT_FALSE(run(a, "Let me add.\n" + s.begin("rm")).takes);  // an opened call is constrained
        EXPECT_FALSE(run(a, "x <tool_call>\nhello").takes);
        const Verdict two = run(a, add + "\n" + weather);
        EXPECT_EQ(two.takes && two.ends, parallel);
    }
    // tool_choice auto with a response_format: calls alone, or content the schema
    // takes alone.
    const std::string schema = R"({"type": "object", "properties": {"answer": {"type": "integer"}},
                                   "required": ["answer"], "additionalProperties": false})";
    const std::string any_object = R"({"type": "object", "additionalProperties": true})";  // as completion.cpp
    for (bool parallel : {true, false}) {
        const std::string a = tool_grammar(ToolFormat::Hermes, tools(), autoc, parallel, &schema);
        ASSERT_TRUE(check_grammar(GrammarSpec{GrammarKind::StructuralTag, a})) << a;
        EXPECT_TRUE(run(a, add).ends);
        EXPECT_TRUE(run(a, "{\"answer\": 42}").ends);
        EXPECT_FALSE(run(a, "{\"answer\": \"x\"}").takes);  // the schema's type
        EXPECT_FALSE(run(a, "Just text.").takes);           // no free text
        EXPECT_FALSE(run(a, "Let me add.\n" + add).takes);  // nor text beside calls
        const Verdict both = run(a, "{\"answer\": 42}\n" + add);
        EXPECT_FALSE(both.takes && both.ends);  // content or calls, not both
        const Verdict two = run(a, add + "\n" + weather);
        EXPECT_EQ(two.takes && two.ends, parallel);
        EXPECT_FALSE(run(a, s.begin("rm")).takes);
        const std::string o = tool_grammar(ToolFormat::Hermes, tools(), autoc, parallel, &any_object);
        ASSERT_TRUE(check_grammar(GrammarSpec{GrammarKind::StructuralTag, o})) << o;
        EXPECT_TRUE(run(o, "{\"x\": [1, \"y\"]}").ends);
        EXPECT_FALSE(run(o, "[1]").takes);
    }
    // Required and named give calls only: the content schema does not apply.
    EXPECT_EQ(tool_grammar(ToolFormat::Hermes, tools(), required, true, &schema),
              tool_grammar(ToolFormat::Hermes, tools(), required, true));
    // Llama 3's JSON calls.
    const ToolSyntax& l = tool_syntax(ToolFormat::Llama3Json);
    const std::string g = tool_grammar(ToolFormat::Llama3Json, tools(), required, false);
    EXPECT_TRUE(run(g, l.begin("add") + "{\"a\": 1, \"b\": 2}" + std::string(l.end)).ends);
    EXPECT_EQ(l.begin("add") + "{}" + std::string(l.end), "{\"name\": \"add\", \"parameters\": {}}");
    EXPECT_FALSE(run(g, l.begin("add") + "{\"a\": 1}").ends);
}

}  // namespace
}  // namespace duet
