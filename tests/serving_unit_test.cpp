// Unit tests of the serving pieces that need no processes: the OpenAI request
// parser's newer options (n, logprobs, token-id prompts, ignore_eos), the
// log-probability rows workers write, and the /metrics histogram.
#include <unistd.h>

#include <cmath>
#include <set>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "base/histogram.h"
#include "model/cpu_backend.h"
#include "roles/context_api.h"
#include "roles/openai.h"
#include "roles/serving.h"

using namespace duet;
using nlohmann::json;

namespace {

CompletionRequest parse_ok(const std::string& body, bool chat) {
    auto r = parse_completion(body, chat);
    if (auto* e = std::get_if<ApiError>(&r)) ADD_FAILURE() << body << ": " << e->message;
    return std::holds_alternative<CompletionRequest>(r) ? std::get<CompletionRequest>(r) : CompletionRequest{};
}

std::string parse_err(const std::string& body, bool chat) {
    auto r = parse_completion(body, chat);
    if (auto* e = std::get_if<ApiError>(&r)) return e->param;
    ADD_FAILURE() << body << " was accepted";
    return "";
}

// Removes a test's instance segments when the test ends, however it ends.
struct UnlinkInstance {
    std::string name;
    ~UnlinkInstance() { shm::Instance::unlink(name); }
};

// Publishes the first `n` full blocks of `tokens` in arena `a`'s prefix index, as
// its prefill worker `by` would have (chained SHA-256 of the tokens and the model);
// returns their hash chain. Empty when the arena refused a step (the test fails).
std::vector<shm::BlockHash> publish_leading_blocks(shm::Instance& inst, uint32_t a, shm::ProcRef by,
                                                   const std::vector<int32_t>& tokens, uint32_t n,
                                                   uint64_t fingerprint) {
    const uint32_t bt = inst.config().requests.block_tokens;
    auto user = inst.arena(a).join(by);
    std::vector<int32_t> blocks(n);
    if (!user || !inst.arena(a).alloc(*user, static_cast<int32_t>(n), blocks.data())) {
        ADD_FAILURE() << "arena " << a << ": no user or no blocks";
        return {};
    }
    shm::BlockHasher hasher;
    std::vector<shm::BlockHash> chain;
    shm::BlockHash h;
    for (uint32_t b = 0; b < n; ++b) {
        h = hasher.hash(h, tokens.data() + b * bt, bt, fingerprint, {});
        chain.push_back(h);
        if (!inst.arena(a).publish(*user, blocks[b], h)) {
            ADD_FAILURE() << "arena " << a << ": block " << b << " not published";
            return {};
        }
    }
    return chain;
}

}  // namespace

// Every field is honoured, refused naming it, or (OpenAI's own bookkeeping) ignored;
// an unknown one is refused with OpenAI's wording. The expected values are OpenAI's
// documented request surface, written out here, not read from the server's table.
TEST(OpenAiParse, EveryFieldIsHonouredOrRefusedNamingIt) {
    const std::string msgs = R"("messages": [{"role": "user", "content": "hi"}])";
    auto err = [](const std::string& body, bool chat) {
        auto r = parse_completion(body, chat);
        if (auto* e = std::get_if<ApiError>(&r)) return *e;
        ADD_FAILURE() << body << " was accepted";
        return ApiError{};
    };
    // Unknown: OpenAI's message, the field as param; in either API.
    ApiError e = err(R"({"prompt": "x", "frobnicate": 1})", false);
    EXPECT_EQ(e.status, 400);
    EXPECT_EQ(e.param, "frobnicate");
    EXPECT_EQ(e.message, "Unrecognized request argument supplied: frobnicate");
    EXPECT_EQ(err("{" + msgs + R"(, "cache_prompt": true})", true).param, "cache_prompt");
    // A field of the other API is unknown here.
    EXPECT_EQ(err("{" + msgs + R"(, "echo": true})", true).param, "echo");
    EXPECT_EQ(err("{" + msgs + R"(, "best_of": 2})", true).param, "best_of");
    EXPECT_EQ(err("{" + msgs + R"(, "suffix": "x"})", true).param, "suffix");
    EXPECT_EQ(err(R"({"prompt": "x", "tools": []})", false).param, "tools");
    EXPECT_EQ(err(R"({"prompt": "x", "max_completion_tokens": 3})", false).param, "max_completion_tokens");
    EXPECT_EQ(err(R"({"prompt": "x", "stream_options": {"include_usage": true, "x": 1}})", false).param,
              "stream_options");
    // Grammars: honoured on both APIs (llama.cpp's fields and response_format), and
    // refused, naming the field, when any part cannot be enforced exactly.
    for (
        const char* body :
        {R"("grammar": "root ::= \"a\"")", R"("json_schema": {"type": "object"})",
         R"("response_format": {"type": "json_object"})",
         R"("response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}})"}) {
        EXPECT_TRUE(parse_ok(std::string("{\"prompt\": \"x\", ") + body + "}", false).grammar) << body;
        EXPECT_TRUE(parse_ok("{" + msgs + ", " + body + "}", true).grammar) << body;
    }
    for (const char* body :
         {R"("grammar": "root ::= ")", R"("grammar": "")", R"("json_schema": {"type": "array", "uniqueItems": true})",
          R"("json_schema": {"$ref": "#/$defs/missing"})",
          R"("json_schema": {"type": "string", "pattern": "a+", "maxLength": 3})",
          R"("json_schema": {"allOf": [{"type": "object"}, {"required": ["a"]}]})",
          R"("response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"not": {}}}})",
          R"("response_format": {"type": "json_schema", "json_schema": {"name": "n"}})",
          R"("response_format": {"type": "json_schema", "json_schema": {"schema": {}, "x": 1}})",
          R"("response_format": {"type": "yaml"})", R"("response_format": {"type": "json_object", "schema": {}})",
          R"("json_schema": {"type": "object", "required": ["a"]})",
          R"("grammar": "root ::= a\na[max_chars=2] ::= \"x\"*")"}) {
        const std::string b = std::string("{\"prompt\": \"x\", ") + body + "}";
        const std::string name = std::string(body).substr(1, std::string(body).find('"', 1) - 1);
        EXPECT_EQ(err(b, false).param, name) << b;
        EXPECT_EQ(err("{" + msgs + ", " + body + "}", true).param, name) << body;
    }
    // A grammar ends the output with an end-of-generation token: what would keep it
    // from ending, or keep it going past the end, is refused with it.
    EXPECT_EQ(err(R"({"prompt": "x", "json_schema": {"type": "integer"}, "ignore_eos": true})", false).param,
              "ignore_eos");
    EXPECT_EQ(err(R"({"prompt": "x", "json_schema": {"type": "integer"}, "min_tokens": 2})", false).param,
              "min_tokens");
    EXPECT_EQ(err(R"({"prompt": "x", "json_schema": {"type": "integer"}, "grammar": "root ::= \"a\""})", false).param,
              "grammar");
    EXPECT_EQ(err(R"({"prompt": "x", "suffix": "end"})", false).param, "suffix");
    for (const char* body :
         {R"("functions": [{"name": "f"}])", R"("function_call": "auto")", R"("modalities": ["text", "audio"])",
          R"("audio": {"voice": "alloy"})", R"("prediction": {"type": "content", "content": "x"})",
          R"("reasoning_effort": "low")", R"("verbosity": "low")", R"("web_search_options": {})"}) {
        const std::string b = "{" + msgs + ", " + body + "}";
        EXPECT_EQ(err(b, true).param, std::string(body).substr(1, std::string(body).find('"', 1) - 1)) << b;
    }
    // ... and taken as absent when they ask for nothing.
    for (const char* body :
         {R"("logit_bias": {})", R"("logit_bias": null)", R"("tools": [])", R"("tool_choice": "none")",
          R"("response_format": {"type": "text"})", R"("modalities": ["text"])", R"("user": "u1")",
          R"("metadata": {"a": "b"})", R"("store": false)", R"("service_tier": "auto")", R"("safety_identifier": "s")",
          R"("prompt_cache_key": "k")"})
        parse_ok("{" + msgs + ", " + body + "}", true);
    parse_ok(R"({"prompt": "x", "suffix": "", "user": "u", "logit_bias": {}})", false);
    // Chat roles: OpenAI's, developer taken as system; tools' roles and other
    // message fields refused.
    EXPECT_EQ(
        parse_ok(R"({"messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]})",
                 true)
            .messages[0]
            .role,
        "system");
    for (
        const char* m :
        {R"({"role": "robot", "content": "x"})", R"({"role": "user", "content": "x", "name": "bob"})",
         R"({"role": "tool", "content": "4"})", R"({"role": "user", "content": "x", "tool_call_id": "c"})",
         R"({"role": "user", "content": "x", "tool_calls": []})", R"({"role": "function", "content": "x"})",
         R"({"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f"}}]})",
         R"({"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "[1]"}}]})",
         R"({"role": "assistant", "tool_calls": [{"id": "c", "type": "custom", "function": {"name": "f", "arguments": "{}"}}]})"})
        EXPECT_EQ(err(std::string(R"({"messages": [)") + m + "]}", true).param, "messages") << m;
    // Tool calls and their results, read back as the client sent them.
    {
        const CompletionRequest r = parse_ok(
            R"({"messages": [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": null, "tool_calls":
                [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 2, \"b\": 3}"}}]},
                {"role": "tool", "content": [{"type": "text", "text": "5"}], "tool_call_id": "c1"}]})",
            true);
        ASSERT_EQ(r.messages.size(), 3u);
        EXPECT_TRUE(r.tool_messages);
        EXPECT_EQ(r.messages[1].tool_calls, (std::vector<ChatToolCall>{{"c1", "add", "{\"a\": 2, \"b\": 3}"}}));
        EXPECT_EQ(r.messages[2].role, "tool");
        EXPECT_EQ(r.messages[2].content, "5");
        EXPECT_EQ(r.messages[2].tool_call_id, "c1");
        EXPECT_FALSE(r.calls_tools());
    }
    // tools: functions with their schemas (property order kept), tool_choice and
    // parallel_tool_calls; what cannot be honoured is a 400 naming it.
    {
        const std::string tool =
            R"({"type": "function", "function": {"name": "get_w", "description": "d", "strict": true, "parameters":
                {"type": "object", "properties": {"z": {"type": "string"}, "a": {"type": "integer"}}}}})";
        CompletionRequest r = parse_ok("{" + msgs + R"(, "tools": [)" + tool + "]}", true);
        ASSERT_EQ(r.tools.size(), 1u);
        EXPECT_EQ(r.tools[0].name, "get_w");
        EXPECT_EQ(r.tools[0].description, "d");
        EXPECT_EQ(r.tools[0].parameters,
                  R"({"type":"object","properties":{"z":{"type":"string"},"a":{"type":"integer"}}})");
        EXPECT_EQ(r.tool_choice.mode, ToolChoiceMode::Auto);
        EXPECT_TRUE(r.parallel_tool_calls);
        EXPECT_TRUE(r.calls_tools());
        r = parse_ok(
            "{" + msgs + R"(, "tools": [)" + tool +
                R"(], "tool_choice": {"type": "function", "function": {"name": "get_w"}}, "parallel_tool_calls": false})",
            true);
        EXPECT_EQ(r.tool_choice.mode, ToolChoiceMode::Named);
        EXPECT_EQ(r.tool_choice.name, "get_w");
        EXPECT_FALSE(r.parallel_tool_calls);
        EXPECT_EQ(
            parse_ok("{" + msgs + R"(, "tools": [)" + tool + R"(], "tool_choice": "required"})", true).tool_choice.mode,
            ToolChoiceMode::Required);
        r = parse_ok("{" + msgs + R"(, "tools": [)" + tool + R"(], "tool_choice": "none"})", true);
        EXPECT_FALSE(r.calls_tools());
        // No parameters: a function of none; {} or properties without a type: an object.
        r = parse_ok("{" + msgs + R"(, "tools": [{"type": "function", "function": {"name": "now"}}]})", true);
        EXPECT_EQ(r.tools[0].parameters, R"({"type":"object","properties":{},"additionalProperties":false})");
        r = parse_ok("{" + msgs + R"(, "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]})",
                     true);
        EXPECT_EQ(r.tools[0].parameters, R"({"type":"object"})");
        r = parse_ok(
            "{" + msgs +
                R"(, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"x": {"type": "integer"}}}}}]})",
            true);
        EXPECT_EQ(r.tools[0].parameters, R"({"properties":{"x":{"type":"integer"}},"type":"object"})");
        // An allOf of object schemas: the one object schema it means (json_schema_check.h).
        r = parse_ok(
            "{" + msgs +
                R"(, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"allOf": [{"type": "object", "properties": {"x": {"type": "integer"}}}, {"properties": {"y": {"type": "string"}}, "required": ["x"]}]}}}]})",
            true);
        EXPECT_EQ(r.tools[0].parameters,
                  R"({"type":"object","properties":{"x":{"type":"integer"},"y":{"type":"string"}},"required":["x"]})");
        // Stop strings could cut a call.
        EXPECT_EQ(err("{" + msgs + R"(, "tools": [)" + tool + R"(], "stop": ["\n"]})", true).param, "stop");
        parse_ok("{" + msgs + R"(, "tools": [)" + tool + R"(], "tool_choice": "none", "stop": ["\n"]})", true);
        // A content part or call whose type is not a string: a 400, not an exception.
        EXPECT_EQ(err(R"({"messages": [{"role": "user", "content": [{"type": 1, "text": "x"}]}]})", true).param,
                  "messages");
        EXPECT_EQ(
            err(R"({"messages": [{"role": "assistant", "tool_calls": [{"id": "a", "type": 1, "function": {"name": "f", "arguments": "{}"}}]}]})",
                true)
                .param,
            "messages");
        // A root of another kind than an object's is refused, naming what is needed.
        EXPECT_EQ(
            err("{" + msgs +
                    R"(, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/$defs/a", "$defs": {"a": {"type": "object"}}}}}]})",
                true)
                .param,
            "tools");
        for (
            const std::string& bad :
            {std::string(R"("tools": [{"type": "web_search"}])"), std::string(R"("tools": {"a": 1})"),
             std::string(R"("tools": [{"type": "function", "function": {"name": "a b"}}])"),
             std::string(
                 R"("tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}])"),
             std::string(R"("tools": [{"type": "function", "function": {"name": "f", "returns": {}}}])"),
             std::string(
                 R"("tools": [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}])"),
             std::string(
                 R"("tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "array", "uniqueItems": true}}}}}])")})
            EXPECT_EQ(err("{" + msgs + ", " + bad + "}", true).param, "tools") << bad;
        for (const std::string& bad :
             {std::string(R"("tool_choice": "auto")"),
              "\"tools\": [" + tool + R"(], "tool_choice": {"type": "function", "function": {"name": "nope"}})",
              "\"tools\": [" + tool + R"(], "tool_choice": "sometimes")"})
            EXPECT_EQ(err("{" + msgs + ", " + bad + "}", true).param, "tool_choice") << bad;
        EXPECT_EQ(err("{" + msgs + R"(, "parallel_tool_calls": true})", true).param, "parallel_tool_calls");
        // A JSON schema for the content is the calls' alternative (roles/tool_calls.h);
        // a GBNF grammar is not.
        EXPECT_TRUE(
            parse_ok("{" + msgs + R"(, "tools": [)" + tool + R"(], "response_format": {"type": "json_object"}})", true)
                .grammar);
        EXPECT_EQ(err("{" + msgs + R"(, "tools": [)" + tool + R"(], "grammar": "root ::= \"x\""})", true).param,
                  "grammar");
        EXPECT_EQ(err("{" + msgs + R"(, "tools": [)" + tool + R"(], "ignore_eos": true})", true).param, "ignore_eos");
        // Not for completions.
        EXPECT_EQ(err(R"({"prompt": "x", "tools": [)" + tool + "]}", false).param, "tools");
    }
    // logit_bias: token ids to numbers in [-100, 100]; the table's size is bounded by
    // the request data (the front checks it, tests/cli/openai_client_test.py).
    EXPECT_EQ(parse_ok(R"({"prompt": "x", "logit_bias": {"1876": -100, "7": 2.5}})", false).logit_bias,
              (std::vector<std::pair<int32_t, float>>{{1876, -100.0f}, {7, 2.5f}}));
    EXPECT_TRUE(parse_ok(R"({"prompt": "x", "logit_bias": {}})", false).logit_bias.empty());
    for (const char* bad : {R"({"a": 1})", R"({"-1": 1})", R"({"1x": 1})", R"({"5": 101})", R"({"5": "1"})", "[1]"})
        EXPECT_EQ(err(std::string(R"({"prompt": "x", "logit_bias": )") + bad + "}", false).param, "logit_bias") << bad;
    std::string many = R"({"prompt": "x", "logit_bias": {)";
    for (int i = 0; i < 17; ++i) many += (i ? ", \"" : "\"") + std::to_string(i) + "\": 1";
    EXPECT_EQ(parse_ok(many + "}}", false).logit_bias.size(), 17u);  // past the old inline 16
    // min_tokens (vLLM's): at most max_tokens; with stop strings too.
    EXPECT_EQ(parse_ok(R"({"prompt": "x", "min_tokens": 5, "max_tokens": 9})", false).min_tokens, 5);
    EXPECT_EQ(parse_ok("{" + msgs + R"(, "min_tokens": 0, "stop": "x"})", true).min_tokens, 0);
    EXPECT_EQ(err(R"({"prompt": "x", "min_tokens": 10, "max_tokens": 9})", false).param, "min_tokens");
    EXPECT_EQ(err(R"({"prompt": "x", "min_tokens": -1})", false).param, "min_tokens");
    EXPECT_EQ(parse_ok(R"({"prompt": "x", "min_tokens": 2, "stop": ["."]})", false).min_tokens, 2);
    // echo and best_of (completions).
    EXPECT_TRUE(parse_ok(R"({"prompt": "x", "echo": true})", false).echo);
    EXPECT_EQ(err(R"({"prompt": "x", "echo": true, "logprobs": 1})", false).param, "echo");
    EXPECT_EQ(err(R"({"prompt": "x", "echo": 1})", false).param, "echo");
    EXPECT_EQ(parse_ok(R"({"prompt": "x", "best_of": 3, "n": 2})", false).best_of, 3);
    EXPECT_EQ(parse_ok(R"({"prompt": "x", "best_of": 2, "n": 2, "stream": true})", false).best_of, 2);
    EXPECT_EQ(err(R"({"prompt": "x", "best_of": 1, "n": 2})", false).param, "best_of");
    EXPECT_EQ(err(R"({"prompt": "x", "best_of": 17})", false).param, "best_of");
    EXPECT_EQ(err(R"({"prompt": "x", "best_of": 3, "stream": true})", false).param, "best_of");
    // speculative (duet's): a mode and, with auto, a depth of 1 to 16; anything else
    // a 400 naming it.
    EXPECT_EQ(parse_ok(R"({"prompt": "x"})", false).draft_mode, DraftMode::Server);
    EXPECT_EQ(parse_ok(R"({"prompt": "x", "speculative": null})", false).draft_mode, DraftMode::Server);
    EXPECT_EQ(parse_ok(R"({"prompt": "x", "speculative": {"mode": "off"}})", false).draft_mode, DraftMode::Off);
    const CompletionRequest spec = parse_ok("{" + msgs + R"(, "speculative": {"mode": "auto", "max_draft": 4}})", true);
    EXPECT_EQ(spec.draft_mode, DraftMode::Auto);
    EXPECT_EQ(spec.max_draft, 4);
    EXPECT_EQ(parse_ok(R"({"prompt": "x", "speculative": {"max_draft": 16}})", false).max_draft, 16);
    EXPECT_EQ(parse_ok(R"({"prompt": "x", "speculative": {}})", false).draft_mode, DraftMode::Auto);
    // "pool": the worker's pool of earlier outputs, on unless false (with any mode:
    // a request that drafts nothing still keeps its output out of the pool).
    EXPECT_TRUE(parse_ok(R"({"prompt": "x"})", false).draft_pool);
    EXPECT_TRUE(parse_ok(R"({"prompt": "x", "speculative": {"pool": true}})", false).draft_pool);
    const CompletionRequest no_pool =
        parse_ok(R"({"prompt": "x", "speculative": {"mode": "off", "pool": false}})", false);
    EXPECT_FALSE(no_pool.draft_pool);
    EXPECT_EQ(no_pool.draft_mode, DraftMode::Off);
    // "pool" alone changes nothing but the pool: the server's drafting stays.
    const CompletionRequest pool_only = parse_ok(R"({"prompt": "x", "speculative": {"pool": false}})", false);
    EXPECT_FALSE(pool_only.draft_pool);
    EXPECT_EQ(pool_only.draft_mode, DraftMode::Server);
    for (const char* bad : {R"("auto")", R"({"mode": "fast"})", R"({"mode": "auto", "max_draft": 0})",
                            R"({"max_draft": 17})", R"({"max_draft": 2.5})", R"({"mode": "off", "max_draft": 2})",
                            R"({"mode": "auto", "depth": 2})", "[1]", R"({"pool": "no"})", R"({"pool": 0})"})
        EXPECT_EQ(err(std::string(R"({"prompt": "x", "speculative": )") + bad + "}", false).param, "speculative")
            << bad;
}

TEST(OpenAiParse, ChoicesLogprobsAndTokenPrompts) {
    EXPECT_EQ(parse_ok(R"({"prompt": "x", "n": 3})", false).n, 3);
    EXPECT_EQ(parse_err(R"({"prompt": "x", "n": 0})", false), "n");
    EXPECT_EQ(parse_err(R"({"prompt": "x", "n": 17})", false), "n");
    EXPECT_EQ(parse_err(R"({"prompt": "x", "n": 1.5})", false), "n");

    EXPECT_EQ(parse_ok(R"({"prompt": "x"})", false).logprobs, -1);
    EXPECT_EQ(parse_ok(R"({"prompt": "x", "logprobs": 0})", false).logprobs, 0);
    EXPECT_EQ(parse_ok(R"({"prompt": "x", "logprobs": 5})", false).logprobs, 5);
    EXPECT_EQ(parse_err(R"({"prompt": "x", "logprobs": 21})", false), "logprobs");
    EXPECT_EQ(parse_err(R"({"prompt": "x", "logprobs": true})", false), "logprobs");
    EXPECT_EQ(parse_err(R"({"prompt": "x", "top_logprobs": 2})", false), "top_logprobs");
    const std::string msgs = R"("messages": [{"role": "user", "content": "hi"}])";
    EXPECT_EQ(parse_ok("{" + msgs + R"(, "logprobs": false})", true).logprobs, -1);
    EXPECT_EQ(parse_ok("{" + msgs + R"(, "logprobs": true})", true).logprobs, 0);
    EXPECT_EQ(parse_ok("{" + msgs + R"(, "logprobs": true, "top_logprobs": 20})", true).logprobs, 20);
    EXPECT_EQ(parse_err("{" + msgs + R"(, "top_logprobs": 2})", true), "top_logprobs");
    EXPECT_EQ(parse_err("{" + msgs + R"(, "logprobs": 3})", true), "logprobs");

    EXPECT_EQ(parse_ok(R"({"prompt": [1, 2, 3]})", false).prompt_ids, (std::vector<int32_t>{1, 2, 3}));
    EXPECT_EQ(parse_ok(R"({"prompt": [[7, 8]]})", false).prompt_ids, (std::vector<int32_t>{7, 8}));
    EXPECT_EQ(parse_err(R"({"prompt": [1, -2]})", false), "prompt");
    EXPECT_EQ(parse_err(R"({"prompt": [1, "a"]})", false), "prompt");
    EXPECT_EQ(parse_err(R"({"prompt": [1.5]})", false), "prompt");
    EXPECT_EQ(parse_err(R"({"prompt": []})", false), "prompt");

    EXPECT_TRUE(parse_ok(R"({"prompt": "x", "ignore_eos": true})", false).ignore_eos);
    EXPECT_EQ(parse_err(R"({"prompt": "x", "ignore_eos": 1})", false), "ignore_eos");
}

// The whole request in one pass: a context (a chat body's, or the route's) and its
// commit, a context completion without a prompt, and the class from the body's
// priority or the route's header.
TEST(OpenAiParse, ContextCommitAndClassComeWithTheBody) {
    auto with = [](const std::string& body, bool chat, CompletionRoute route) {
        auto r = parse_completion(body, chat, route);
        if (auto* e = std::get_if<ApiError>(&r)) {
            CompletionRequest failed;
            failed.model = "error: " + e->param;
            return failed;
        }
        return std::get<CompletionRequest>(r);
    };
    const std::string msgs = R"("messages": [{"role": "user", "content": "hi"}])";
    CompletionRequest r = with("{" + msgs + R"(, "context": "c1", "commit": false})", true, {});
    EXPECT_EQ(r.context, "c1");
    EXPECT_FALSE(r.commit);
    r = with("{" + msgs + "}", true, {});
    EXPECT_EQ(r.context, "");
    EXPECT_TRUE(r.commit);
    EXPECT_EQ(with("{" + msgs + R"(, "commit": false})", true, {}).model, "error: commit")
        << "commit without a context";
    EXPECT_EQ(with("{" + msgs + R"(, "context": ""})", true, {}).model, "error: context");
    EXPECT_EQ(with("{" + msgs + R"(, "context": "c1", "commit": "no"})", true, {}).model, "error: commit");
    EXPECT_EQ(with(R"({"prompt": "x", "context": "c1"})", false, {}).model, "error: context")
        << "a completion's context is its route's";
    // The route's context: the body may leave the prompt out (the context continues).
    r = with(R"({"max_tokens": 2, "commit": false})", false, {"doc", ""});
    EXPECT_EQ(r.context, "doc");
    EXPECT_FALSE(r.commit);
    EXPECT_TRUE(r.continues_context);
    EXPECT_TRUE(with(R"({"prompt": ""})", false, {"doc", ""}).continues_context);
    r = with(R"({"prompt": "more"})", false, {"doc", ""});
    EXPECT_FALSE(r.continues_context);
    EXPECT_EQ(r.prompt, "more");
    EXPECT_EQ(with(R"({"max_tokens": 2})", false, {}).model, "error: prompt") << "no context: a prompt is required";
    // The class: the body's priority, else the header, else standard.
    EXPECT_EQ(with(R"({"prompt": "x"})", false, {}).slo, SloClass::Standard);
    EXPECT_EQ(with(R"({"prompt": "x"})", false, {"", "batch"}).slo, SloClass::Batch);
    EXPECT_EQ(with(R"({"prompt": "x", "priority": "critical"})", false, {"", "batch"}).slo, SloClass::Critical);
    EXPECT_EQ(with(R"({"prompt": "x"})", false, {"", "urgent"}).model, "error: ") << "a bad header";
}

TEST(OpenAiJson, LogprobsInBothApis) {
    LogprobToken t{"He", -0.5f, {{"He", -0.5f}, {"Hi", -1.25f}}, 0};
    LogprobToken u{"llo", -0.25f, {{"llo", -0.25f}, {"y", -2.0f}}, 2};
    CompletionRequest chat;
    chat.chat = true;
    chat.logprobs = 2;
    json c = json::parse(completion_json(chat, "id", 0, "m", {{"Hello", "stop", {t, u}, {}}}, {}));
    const json& content = c["choices"][0]["logprobs"]["content"];
    ASSERT_EQ(content.size(), 2u);
    // OpenAI's schema requires both (nullable): message.refusal, logprobs.refusal.
    ASSERT_TRUE(c["choices"][0]["message"].contains("refusal"));
    EXPECT_TRUE(c["choices"][0]["message"]["refusal"].is_null());
    ASSERT_TRUE(c["choices"][0]["logprobs"].contains("refusal"));
    EXPECT_TRUE(c["choices"][0]["logprobs"]["refusal"].is_null());
    EXPECT_EQ(content[0]["token"], "He");
    EXPECT_EQ(content[0]["bytes"], json({72, 101}));
    EXPECT_EQ(content[1]["top_logprobs"][1]["token"], "y");
    EXPECT_FLOAT_EQ(content[1]["top_logprobs"][1]["logprob"].get<float>(), -2.0f);

    CompletionRequest comp;
    comp.logprobs = 2;
    json k = json::parse(chunk_json(comp, "id", 0, "m", 1, "Hello", "", false, {t, u}));
    const json& lp = k["choices"][0]["logprobs"];
    EXPECT_EQ(k["choices"][0]["index"], 1);
    EXPECT_EQ(lp["tokens"], json({"He", "llo"}));
    EXPECT_EQ(lp["text_offset"], json({0, 2}));
    EXPECT_FLOAT_EQ(lp["top_logprobs"][0]["Hi"].get<float>(), -1.25f);
    comp.logprobs = -1;
    EXPECT_TRUE(json::parse(chunk_json(comp, "id", 0, "m", 0, "x", "", false))["choices"][0]["logprobs"].is_null());
}

TEST(Logprobs, RowsAreTheLogSoftmaxSampledFirstThenTheTop) {
    const std::vector<float> logits = {1.0f, 3.0f, -2.0f, 3.0f, 0.5f, 2.5f};
    double sum = 0;
    for (float x : logits) sum += std::exp(static_cast<double>(x));
    auto want = [&](int id) { return static_cast<double>(logits[id]) - std::log(sum); };
    shm::TokenLogprob row[shm::kLogprobRow];
    fill_logprobs(logits.data(), static_cast<int64_t>(logits.size()), 4, 3, row);
    EXPECT_EQ(row[0].id, 4);
    EXPECT_NEAR(row[0].logprob, want(4), 1e-6);
    // Most likely first; a tie goes to the lower id.
    EXPECT_EQ(row[1].id, 1);
    EXPECT_EQ(row[2].id, 3);
    EXPECT_EQ(row[3].id, 5);
    for (int i = 1; i <= 3; ++i) EXPECT_NEAR(row[i].logprob, want(row[i].id), 1e-6);
    for (uint32_t i = 4; i < shm::kLogprobRow; ++i) EXPECT_EQ(row[i].id, -1);
    fill_logprobs(logits.data(), static_cast<int64_t>(logits.size()), 0, 100, row);  // more than the vocabulary
    EXPECT_EQ(row[6].id, 2);
    EXPECT_EQ(row[7].id, -1);
}

TEST(Histogram, QuantilesAndPrometheusText) {
    Histogram h;
    EXPECT_TRUE(std::isnan(h.quantile(0.5)));
    for (int i = 0; i < 90; ++i) h.observe(30e-6);  // bucket (20 µs, 50 µs]
    for (int i = 0; i < 10; ++i) h.observe(3.0);    // bucket (2 s, 5 s]
    h.observe(1000);                                // past every bound
    EXPECT_EQ(h.count(), 101u);
    const double p50 = h.quantile(0.5);
    EXPECT_GT(p50, 20e-6);
    EXPECT_LE(p50, 50e-6);
    EXPECT_GT(h.quantile(0.95), 2.0);
    EXPECT_LE(h.quantile(0.95), 5.0);
    EXPECT_EQ(h.quantile(1.0), 100.0);
    const std::string text = h.prometheus("x_seconds", "help");
    EXPECT_NE(text.find("# TYPE x_seconds histogram\n"), std::string::npos);
    EXPECT_NE(text.find("x_seconds_bucket{le=\"2e-05\"} 0\n"), std::string::npos) << text;
    EXPECT_NE(text.find("x_seconds_bucket{le=\"5e-05\"} 90\n"), std::string::npos) << text;
    EXPECT_NE(text.find("x_seconds_bucket{le=\"5\"} 100\n"), std::string::npos) << text;
    EXPECT_NE(text.find("x_seconds_bucket{le=\"+Inf\"} 101\n"), std::string::npos) << text;
    EXPECT_NE(text.find("x_seconds_count 101\n"), std::string::npos);
}

// A front that died leaves requests nobody will read: the launcher's sweep cancels
// the running ones (a queued one at once, a prefilling or decoding one through its
// cancel flag, which its worker obeys) and frees the ended ones; another front's
// requests are left alone.
TEST(Orphans, ADeadFrontsRequestsAreCancelledAndFreed) {
    shm::InstanceConfig c;
    c.name = fmt::format("orphans-{}", getpid());
    c.registry_slots = 8;
    c.n_rings = 3;
    c.ring_capacity = 64;
    c.requests.n_slots = 8;
    c.requests.max_tokens = 64;
    c.arenas.push_back(shm::ArenaConfig{64, 4, 0});
    c.cpu_kv_bytes = 1 << 16;
    auto inst = shm::Instance::create(c);
    ASSERT_TRUE(inst.ok()) << inst.error().message;
    shm::Registry& reg = inst->registry();
    shm::RequestTable& t = inst->requests();
    auto dead = reg.claim(shm::Role::Front, -1, getpid());
    auto live = reg.claim(shm::Role::Front, -1, getpid());
    auto worker = reg.claim(shm::Role::Prefill, -1, getpid());
    ASSERT_TRUE(dead.ok() && live.ok() && worker.ok());
    for (auto r : {*dead, *live, *worker}) reg.set_running(r);
    const int32_t prompt[2] = {1, 2};
    auto submit = [&](shm::ProcRef by) {
        auto r = t.submit(by, prompt, 2, nullptr, 0);
        EXPECT_TRUE(r.ok());
        return *r;
    };
    const shm::ReqRef queued = submit(*dead), running = submit(*dead), ended = submit(*dead), other = submit(*live);
    ASSERT_TRUE(t.transition(running, shm::ReqState::Queued, shm::ReqState::Prefilling, *worker));
    ASSERT_TRUE(t.transition(ended, shm::ReqState::Queued, shm::ReqState::Prefilling, *worker));
    ASSERT_TRUE(t.transition(ended, shm::ReqState::Prefilling, shm::ReqState::Finished));

    EXPECT_EQ(sweep_orphans(*inst), 0u) << "its front is alive";
    ASSERT_TRUE(reg.release(*dead));
    EXPECT_EQ(sweep_orphans(*inst), 3u);
    EXPECT_TRUE(t.is(queued, shm::ReqState::Cancelled));
    EXPECT_TRUE(t.is(running, shm::ReqState::Prefilling));
    EXPECT_TRUE(t.cancelled(running)) << "its worker drops it at the next step";
    EXPECT_EQ(t.state(ended.slot), shm::ReqState::Free);
    EXPECT_TRUE(t.is(other, shm::ReqState::Queued)) << "a live front's request";
    // The worker obeys the cancel; the next sweep frees both.
    ASSERT_TRUE(t.transition(running, shm::ReqState::Prefilling, shm::ReqState::Cancelled));
    EXPECT_EQ(sweep_orphans(*inst), 2u);
    EXPECT_EQ(t.state(queued.slot), shm::ReqState::Free);
    EXPECT_EQ(t.state(running.slot), shm::ReqState::Free);
    EXPECT_TRUE(t.is(other, shm::ReqState::Queued));
    shm::Instance::unlink(c.name);
}

// Ring layout: every (role, worker) pair has its own ring, none shared, all within
// the count the instance is made with.
TEST(Routing, RingsOfSeveralWorkersAreDistinct) {
    for (uint32_t np = 1; np <= 3; ++np)
        for (uint32_t nd = 1; nd <= 3; ++nd) {
            const ServeRings r{np, nd};
            std::vector<int> seen(r.count(), 0);
            for (uint32_t p = 0; p < np; ++p) {
                ++seen.at(r.to_prefill(p));
                ++seen.at(r.redrive(p));
                for (uint32_t d = 0; d < nd; ++d) ++seen.at(r.to_decode(p, d));
            }
            for (uint32_t i = 0; i < r.count(); ++i) EXPECT_EQ(seen[i], 1) << np << "x" << nd << " ring " << i;
        }
    // GPU pairs: one to_decode ring per pair, 3 P rings in all.
    for (uint32_t n = 1; n <= 8; ++n) {
        const ServeRings r{n, n, true};
        EXPECT_EQ(r.count(), 3 * n);
        std::vector<int> seen(r.count(), 0);
        for (uint32_t p = 0; p < n; ++p) {
            ++seen.at(r.to_prefill(p));
            ++seen.at(r.redrive(p));
            ++seen.at(r.to_decode(p, p));
            for (uint32_t d = 0; d < n; ++d) EXPECT_EQ(r.linked(p, d), p == d);
        }
        for (uint32_t i = 0; i < r.count(); ++i) EXPECT_EQ(seen[i], 1) << n << " pairs, ring " << i;
    }
}

TEST(Routing, PrefillGoesToTheShortestQueueUnlessACachedPrefixSavesMore) {
    // Nothing cached: the least work ahead; ties to the lowest index.
    EXPECT_EQ(pick_prefill({{true, 900, 100}, {true, 300, 100}, {true, 500, 100}}), 1u);
    EXPECT_EQ(pick_prefill({{true, 0, 100}, {true, 0, 100}}), 0u);
    // Worker 0 is computing this prompt's 1000-token prefix: 40 tokens left there.
    // Busy by 600 tokens, it still wins (600 + 2*40 < 0 + 2*1040)...
    EXPECT_EQ(pick_prefill({{true, 600, 40}, {true, 0, 1040}}), 0u);
    // ... but not when it is busier than the compute the prefix saves, twice over.
    EXPECT_EQ(pick_prefill({{true, 2100, 40}, {true, 0, 1040}}), 1u);
    // A worker being restarted is chosen only when none runs.
    EXPECT_EQ(pick_prefill({{false, 0, 10}, {true, 5000, 10}}), 1u);
    EXPECT_EQ(pick_prefill({{false, 300, 10}, {false, 100, 10}}), 1u);
}

TEST(Routing, DecodeGoesToARunningWorkerWithRoomThenTheSmallestBatch) {
    // {running, items, max_items, tokens}
    EXPECT_EQ(pick_decode({{true, 5, 64, 100}, {true, 3, 64, 900}}), 1u);     // fewer sequences
    EXPECT_EQ(pick_decode({{true, 3, 64, 900}, {true, 3, 64, 100}}), 1u);     // then fewer tokens
    EXPECT_EQ(pick_decode({{true, 8, 8, 10}, {true, 30, 64, 5000}}), 1u);     // a full batch last
    EXPECT_EQ(pick_decode({{false, 0, 0, 0}, {true, 30, 64, 5000}}), 1u);    // a dead one last
    EXPECT_EQ(pick_decode({{true, 2, 0, 0}, {true, 1, 0, 0}}), 1u);           // batch size not known yet
    // On prefill's NUMA node first (where the KV pages it wrote are), unless full.
    EXPECT_EQ(pick_decode({{true, 1, 64, 10, false}, {true, 9, 64, 900, true}}), 1u);
    EXPECT_EQ(pick_decode({{true, 1, 64, 10, false}, {true, 64, 64, 900, true}}), 0u);
}

TEST(Routing, PrefixAffinityFindsTheLongestSharedLeadingBlocks) {
    std::vector<int32_t> a(100), b(100);
    for (int i = 0; i < 100; ++i) a[i] = b[i] = 1000 + i;
    b[40] = 7;  // b shares a's first two 16-token blocks, not the third
    const auto ka = PrefixAffinity::block_keys(a.data(), a.size(), 16);
    const auto kb = PrefixAffinity::block_keys(b.data(), b.size(), 16);
    ASSERT_EQ(ka.size(), 6u);  // full blocks only
    EXPECT_EQ(PrefixAffinity::block_keys(a.data(), 15, 16).size(), 0u);
    EXPECT_EQ(ka[0], kb[0]);
    EXPECT_EQ(ka[1], kb[1]);
    for (size_t i = 2; i < ka.size(); ++i) EXPECT_NE(ka[i], kb[i]) << "keys are chained: block " << i;
    // The same block at another position is another key.
    EXPECT_NE(PrefixAffinity::block_keys(a.data() + 16, 16, 16)[0], ka[1]);

    // Requests being prefilled (slot numbers here): a match counts only while its
    // request is; after that its blocks are in the prefix index, every worker's alike.
    std::set<uint32_t> live_slots;
    auto live = [&](shm::ReqRef r) { return live_slots.count(r.slot) > 0; };
    PrefixAffinity aff;
    EXPECT_EQ(aff.find(kb, live).worker, -1);
    live_slots = {1, 2};
    aff.note(ka, 1, {1, 1}, live);
    PrefixAffinity::Match m = aff.find(kb, live);
    EXPECT_EQ(m.worker, 1);
    EXPECT_EQ(m.blocks, 2u);
    aff.note(kb, 0, {2, 1}, live);  // b's own blocks; the two shared ones now point at worker 0
    m = aff.find(ka, live);
    EXPECT_EQ(m.worker, 1);
    EXPECT_EQ(m.blocks, 6u);
    EXPECT_EQ(aff.find(std::vector<uint64_t>{ka[0], ka[1]}, live).worker, 0);
    // a's request is handed off: its blocks favour nobody; b's shared ones still do.
    live_slots = {2};
    m = aff.find(ka, live);
    EXPECT_EQ(m.worker, 0);
    EXPECT_EQ(m.blocks, 2u);
    live_slots.clear();
    EXPECT_EQ(aff.find(ka, live).worker, -1);
    // Bounded: past kMaxKeys, entries of finished requests go, then everything.
    std::vector<uint64_t> many(PrefixAffinity::kMaxKeys - 4);
    for (size_t i = 0; i < many.size(); ++i) many[i] = 0x5000000 + i;
    live_slots = {3};
    aff.note(many, 1, {3, 1}, live);
    EXPECT_EQ(aff.size(), many.size()) << "a's and b's entries (finished) went first";
    live_slots = {3, 4};
    aff.note(kb, 0, {4, 1}, live);
    EXPECT_LE(aff.size(), PrefixAffinity::kMaxKeys);
    EXPECT_EQ(aff.find(kb, live).worker, 0);
}

// GPU serving's instance: a prefill and a decode worker per GPU, each pair with its
// GPU's arena and handing off only within the pair; CPU serving keeps one arena that
// every worker shares and hands off to any decode worker.
TEST(GpuServing, AnInstancePairsAPrefillAndADecodeWorkerPerGpu) {
    auto model = Model::load(DUET_MODEL_PATH);
    ASSERT_TRUE(model.ok()) << model.error().message;
    ServeLayout l;
    l.instance = fmt::format("gpu-pairs-{}", getpid());
    l.n_requests = 8;
    l.n_ctx = 256;
    l.n_gpus = 3;
    l.n_prefill = 5;  // ignored on GPUs: the pairs decide
    shm::InstanceConfig c = serve_instance_config(l, **model);
    EXPECT_TRUE(gpu_instance(c));
    EXPECT_EQ(c.cpu_kv_bytes, 0u);
    ASSERT_EQ(c.arenas.size(), 3u);
    for (const shm::ArenaConfig& a : c.arenas) {
        EXPECT_EQ(a.n_users, 2u);
        EXPECT_EQ(a.n_blocks, c.arenas[0].n_blocks);
    }
    EXPECT_EQ(c.prefill_workers, 3u);
    EXPECT_EQ(c.decode_workers, 3u);
    EXPECT_GE(c.registry_slots, 2u * 6 + 2) << "every worker, the front and the launcher";
    EXPECT_EQ(c.n_rings, 9u) << "a to_prefill, a redrive and a to_decode ring per pair";
    EXPECT_TRUE(ServeRings::of(c).paired);
    EXPECT_TRUE(check_instance_workers(c).ok());
    for (uint32_t i = 0; i < 3; ++i) {
        EXPECT_EQ(worker_arena(c, shm::Role::Prefill, i), i);
        EXPECT_EQ(worker_arena(c, shm::Role::Decode, i), i);
        EXPECT_EQ(handoff_partner(c, i), static_cast<int32_t>(i));
    }
    EXPECT_EQ(decode_arenas(c), (std::vector<uint32_t>{0, 1, 2})) << "a pair's arena on each GPU";
    auto inst = shm::Instance::create(c);
    ASSERT_TRUE(inst.ok()) << inst.error().message;
    EXPECT_EQ(inst->n_arenas(), 3u);
    shm::Instance::unlink(c.name);
    // A config whose workers are not pairs is refused.
    shm::InstanceConfig bad = c;
    bad.prefill_workers = 2;
    auto st = check_instance_workers(bad);
    ASSERT_FALSE(st.ok());
    EXPECT_NE(st.error().message.find("a pair per GPU"), std::string::npos) << st.error().message;
    EXPECT_FALSE(check_gpu_count(0).ok());
    EXPECT_FALSE(check_gpu_count(static_cast<int>(kMaxServeGpus) + 1).ok());
    // Contexts on one GPU: the front's context store is a third user of its arena
    // (ContextService::open joins it beside the pair).
    ServeLayout one = l;
    one.n_gpus = 1;
    one.contexts = true;
    one.contexts_max = 4;
    shm::InstanceConfig oc = serve_instance_config(one, **model);
    ASSERT_EQ(oc.arenas.size(), 1u);
    EXPECT_EQ(oc.arenas[0].n_users, 3u);
    EXPECT_EQ(oc.contexts.n_slots, 6u);

    // CPU serving: one arena, any decode worker.
    ServeLayout cl = l;
    cl.n_gpus = 0;
    cl.n_prefill = 2;
    cl.n_decode = 3;
    shm::InstanceConfig cc = serve_instance_config(cl, **model);
    EXPECT_FALSE(gpu_instance(cc));
    ASSERT_EQ(cc.arenas.size(), 1u);
    EXPECT_EQ(cc.arenas[0].n_users, 5u);
    EXPECT_TRUE(check_instance_workers(cc).ok());
    EXPECT_EQ(worker_arena(cc, shm::Role::Prefill, 1), 0u);
    EXPECT_EQ(worker_arena(cc, shm::Role::Decode, 2), 0u);
    EXPECT_EQ(decode_arenas(cc), (std::vector<uint32_t>{0}));
    EXPECT_EQ(handoff_partner(cc, 1), -1);
    EXPECT_FALSE(cc.kv_split);
    // Workers that change role (--rebalance): indices and rings for all workers but one
    // in each role, the arena's users for the processes (a leaving worker's user is
    // returned before its successor joins).
    ServeLayout rl = cl;
    rl.rebalance = true;
    shm::InstanceConfig rc = serve_instance_config(rl, **model);
    EXPECT_EQ(rc.prefill_workers, 4u);
    EXPECT_EQ(rc.decode_workers, 4u);
    EXPECT_EQ(rc.arenas[0].n_users, 5u);
    EXPECT_EQ(rc.n_rings, 2u * 4 + 4 * 4);
    EXPECT_TRUE(check_instance_workers(rc).ok()) << check_instance_workers(rc).error().message;
    rl.n_prefill = 4;  // 7 workers (plan_serve refuses them): 6 indices each, past what one arena attributes
    rc = serve_instance_config(rl, **model);
    EXPECT_FALSE(check_instance_workers(rc).ok());
}

// Per-role KV arenas. CPU: one host arena for the prefill workers and one for the
// decode workers (which every prefill worker also writes, copying its hand-offs),
// back to back in the KV data segment. GPUs: prefill alone on the first GPUs, decode
// alone on the others, an arena each; any prefill hands off to any decode worker.
TEST(GpuServing, PerRoleArenasSplitTheKvAndHandOffToAnyDecodeWorker) {
    auto model = Model::load(DUET_MODEL_PATH);
    ASSERT_TRUE(model.ok()) << model.error().message;
    ServeLayout l;
    l.instance = fmt::format("split-{}", getpid());
    l.n_requests = 8;
    l.n_ctx = 256;
    l.n_prefill = 2;
    l.n_decode = 3;
    l.kv_split = true;
    shm::InstanceConfig c = serve_instance_config(l, **model);
    EXPECT_FALSE(gpu_instance(c));
    EXPECT_TRUE(c.kv_split);
    ASSERT_EQ(c.arenas.size(), 2u);
    EXPECT_EQ(c.arenas[0].n_users, 2u) << "the prefill workers";
    EXPECT_EQ(c.arenas[1].n_users, 5u) << "the decode workers, and every prefill worker handing off into it";
    EXPECT_EQ(c.arenas[0].n_blocks, c.arenas[1].n_blocks);
    const uint64_t block_bytes = kv_layout(**model).block_bytes();
    EXPECT_EQ(c.cpu_kv_bytes, 2 * block_bytes * c.arenas[0].n_blocks);
    EXPECT_FALSE(ServeRings::of(c).paired);
    EXPECT_EQ(c.n_rings, 2u * 2 + 2 * 3);
    EXPECT_TRUE(check_instance_workers(c).ok());
    for (uint32_t i = 0; i < 2; ++i) EXPECT_EQ(worker_arena(c, shm::Role::Prefill, i), 0u);
    for (uint32_t i = 0; i < 3; ++i) EXPECT_EQ(worker_arena(c, shm::Role::Decode, i), 1u);
    EXPECT_EQ(decode_arenas(c), (std::vector<uint32_t>{1})) << "A3 watches decode's arena, not prefill's";
    EXPECT_EQ(handoff_partner(c, 1), -1);
    {
        auto inst = shm::Instance::create(c);
        ASSERT_TRUE(inst.ok()) << inst.error().message;
        ASSERT_EQ(inst->n_arenas(), 2u);
        // Arena 1's data follows arena 0's, both inside the segment.
        EXPECT_EQ(inst->cpu_kv_data(1) - inst->cpu_kv_data(0),
                  static_cast<ptrdiff_t>(block_bytes * c.arenas[0].n_blocks));
        EXPECT_EQ(inst->cpu_kv_data(1) + block_bytes * c.arenas[1].n_blocks,
                  inst->cpu_kv_data(0) + c.cpu_kv_bytes);
        // Another process sees the split (stored configuration).
        auto seen = shm::Instance::attach(c.name);
        ASSERT_TRUE(seen.ok()) << seen.error().message;
        EXPECT_TRUE(seen->config().kv_split);
        EXPECT_EQ(seen->config().fingerprint(), c.fingerprint());
        shm::Instance::unlink(c.name);
    }
    shm::InstanceConfig shared = c;
    shared.kv_split = false;
    EXPECT_NE(shared.fingerprint(), c.fingerprint()) << "a process configured without the split refuses to attach";
    EXPECT_FALSE(check_instance_workers(shared).ok()) << "two host arenas without the split";

    // GPUs: 2 prefill GPUs, 3 decode GPUs.
    ServeLayout g = l;
    g.n_gpus = 5;
    shm::InstanceConfig gc = serve_instance_config(g, **model);
    EXPECT_TRUE(gpu_instance(gc));
    EXPECT_EQ(gc.cpu_kv_bytes, 0u);
    ASSERT_EQ(gc.arenas.size(), 5u);
    EXPECT_EQ(gc.prefill_workers, 2u);
    EXPECT_EQ(gc.decode_workers, 3u);
    for (uint32_t a = 0; a < 2; ++a) EXPECT_EQ(gc.arenas[a].n_users, 1u);
    for (uint32_t a = 2; a < 5; ++a) EXPECT_EQ(gc.arenas[a].n_users, 3u);
    EXPECT_FALSE(ServeRings::of(gc).paired);
    EXPECT_EQ(gc.n_rings, 2u * 2 + 2 * 3);
    EXPECT_TRUE(check_instance_workers(gc).ok());
    for (uint32_t i = 0; i < 2; ++i) EXPECT_EQ(worker_arena(gc, shm::Role::Prefill, i), i);
    for (uint32_t i = 0; i < 3; ++i) EXPECT_EQ(worker_arena(gc, shm::Role::Decode, i), 2 + i);
    EXPECT_EQ(decode_arenas(gc), (std::vector<uint32_t>{2, 3, 4}));
    EXPECT_EQ(handoff_partner(gc, 0), -1);
    shm::InstanceConfig bad = gc;
    bad.decode_workers = 4;
    auto st = check_instance_workers(bad);
    ASSERT_FALSE(st.ok());
    EXPECT_NE(st.error().message.find("each GPU runs one role"), std::string::npos) << st.error().message;
}

// GPU pairs: a prompt whose leading blocks one pair's arena caches goes to that pair
// (its prefill would compute only the rest); a prompt nobody caches goes to the
// shortest queue.
TEST(GpuServing, APromptGoesToThePairWhoseArenaCachesIt) {
    auto model = Model::load(DUET_MODEL_PATH);
    ASSERT_TRUE(model.ok()) << model.error().message;
    ServeLayout l;
    l.instance = fmt::format("gpu-route-{}", getpid());
    l.n_requests = 8;
    l.n_ctx = 256;
    l.n_gpus = 2;
    auto inst = shm::Instance::create(serve_instance_config(l, **model));
    ASSERT_TRUE(inst.ok()) << inst.error().message;
    UnlinkInstance unlink{l.instance};
    shm::Registry& reg = inst->registry();
    shm::RequestTable& t = inst->requests();
    auto front = reg.claim(shm::Role::Front, -1, getpid());
    auto p1 = reg.claim(shm::Role::Prefill, -1, getpid(), 1);
    ASSERT_TRUE(front.ok() && p1.ok());
    // Pair 1's prefill has published the first 4 blocks of `cached` in arena 1.
    const uint32_t bt = inst->config().requests.block_tokens;
    std::vector<int32_t> cached(4 * bt + 5), other(4 * bt + 5);
    for (size_t i = 0; i < cached.size(); ++i) {
        cached[i] = static_cast<int32_t>(100 + i);
        other[i] = static_cast<int32_t>(9000 + i);
    }
    std::vector<shm::BlockHash> chain = publish_leading_blocks(*inst, 1, *p1, cached, 4, (*model)->fingerprint());
    ASSERT_EQ(chain.size(), 4u);
    EXPECT_EQ(cached_prefix_blocks(inst->arena(1), chain), 4u);
    EXPECT_EQ(cached_prefix_blocks(inst->arena(0), chain), 0u);
    chain[2].lo ^= 1;  // a different third block: only the leading run counts
    EXPECT_EQ(cached_prefix_blocks(inst->arena(1), chain), 2u);

    PrefillRouter router(*inst, /*redrive=*/false);
    auto r1 = t.submit(*front, cached.data(), static_cast<uint32_t>(cached.size()), nullptr, 0);
    ASSERT_TRUE(r1.ok());
    ASSERT_TRUE(router.send(*r1));
    EXPECT_EQ(router.sent_counts(), (std::vector<uint64_t>{0, 1})) << "the cached prompt goes to pair 1";
    auto r2 = t.submit(*front, other.data(), static_cast<uint32_t>(other.size()), nullptr, 0);
    ASSERT_TRUE(r2.ok());
    ASSERT_TRUE(router.send(*r2));
    EXPECT_EQ(router.sent_counts(), (std::vector<uint64_t>{1, 1})) << "an uncached one to the shorter queue";

    // A pair serves only with both halves up: with pair 0 whole and pair 1's decode
    // worker down, even the cached prompt goes to pair 0; once it is up, to pair 1.
    auto p0 = reg.claim(shm::Role::Prefill, -1, getpid(), 0);
    auto d0 = reg.claim(shm::Role::Decode, -1, getpid(), 0);
    ASSERT_TRUE(p0.ok() && d0.ok());
    for (shm::ProcRef r : {*p0, *d0, *p1}) reg.set_running(r);
    auto r3 = t.submit(*front, cached.data(), static_cast<uint32_t>(cached.size()), nullptr, 0);
    ASSERT_TRUE(r3.ok());
    ASSERT_TRUE(router.send(*r3));
    EXPECT_EQ(router.sent_counts(), (std::vector<uint64_t>{2, 1})) << "pair 1 has no decode worker";
    auto d1 = reg.claim(shm::Role::Decode, -1, getpid(), 1);
    ASSERT_TRUE(d1.ok());
    reg.set_running(*d1);
    auto r4 = t.submit(*front, cached.data(), static_cast<uint32_t>(cached.size()), nullptr, 0);
    ASSERT_TRUE(r4.ok());
    ASSERT_TRUE(router.send(*r4));
    EXPECT_EQ(router.sent_counts(), (std::vector<uint64_t>{2, 2})) << "pair 1 whole again: the cached prompt goes there";
}

// A context's request (RequestParams::bind_arena: the blocks the front offers and
// takes back are kContextArena's) goes to that arena's pair only: not to the pair
// whose arena caches its prompt, not to a shorter queue, not when its pair is down
// (it waits there, also when stranded requests are moved), and a re-drive keeps it.
TEST(GpuServing, AContextsRequestGoesToItsArenasPairOnly) {
    auto model = Model::load(DUET_MODEL_PATH);
    ASSERT_TRUE(model.ok()) << model.error().message;
    ServeLayout l;
    l.instance = fmt::format("gpu-bound-{}", getpid());
    l.n_requests = 16;
    l.n_ctx = 256;
    l.n_gpus = 3;
    l.contexts = true;
    l.contexts_max = 4;
    shm::InstanceConfig cfg = serve_instance_config(l, **model);
    EXPECT_EQ(cfg.arenas[kContextArena].n_users, 3u) << "the pair and the front's context store";
    for (uint32_t a = 0; a < cfg.arenas.size(); ++a) {
        if (a != kContextArena) {
            EXPECT_EQ(cfg.arenas[a].n_users, 2u) << a;
        }
    }
    auto inst = shm::Instance::create(cfg);
    ASSERT_TRUE(inst.ok()) << inst.error().message;
    UnlinkInstance unlink{l.instance};
    shm::Registry& reg = inst->registry();
    shm::RequestTable& t = inst->requests();
    auto front = reg.claim(shm::Role::Front, -1, getpid());
    ASSERT_TRUE(front.ok());
    std::vector<shm::ProcRef> pre(3), dec(3);
    for (int32_t i = 0; i < 3; ++i) {
        auto p = reg.claim(shm::Role::Prefill, -1, getpid(), i);
        auto d = reg.claim(shm::Role::Decode, -1, getpid(), i);
        ASSERT_TRUE(p.ok() && d.ok());
        pre[static_cast<size_t>(i)] = *p;
        dec[static_cast<size_t>(i)] = *d;
        reg.set_running(*p);
        reg.set_running(*d);
    }
    // Pair 1's arena caches the prompt's first 4 blocks.
    const uint32_t bt = cfg.requests.block_tokens;
    std::vector<int32_t> prompt(4 * bt + 5);
    for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>(300 + i);
    ASSERT_EQ(publish_leading_blocks(*inst, 1, pre[1], prompt, 4, (*model)->fingerprint()).size(), 4u);
    RequestParams bound;
    bound.bind_arena(kContextArena);
    EXPECT_EQ(bound.bound_arena(), static_cast<int32_t>(kContextArena));
    EXPECT_EQ(RequestParams{}.bound_arena(), -1) << "default parameters bind nothing";
    auto submit = [&](const RequestParams* p) {
        auto r = t.submit(*front, prompt.data(), static_cast<uint32_t>(prompt.size()), p, p ? sizeof *p : 0);
        EXPECT_TRUE(r.ok());
        return *r;
    };
    PrefillRouter router(*inst, /*redrive=*/false);
    // Pair 0 gets a queue of its own first: three unbound prompts it would take (no
    // cache anywhere for these).
    std::vector<int32_t> other(6 * bt);
    for (size_t i = 0; i < other.size(); ++i) other[i] = static_cast<int32_t>(7000 + i);
    auto o = t.submit(*front, other.data(), static_cast<uint32_t>(other.size()), nullptr, 0);
    ASSERT_TRUE(o.ok());
    ASSERT_TRUE(router.send(*o));
    EXPECT_EQ(router.sent_counts(), (std::vector<uint64_t>{1, 0, 0}));
    // Unbound, the prompt goes to pair 1 (its arena caches it); bound, to pair 0,
    // though pair 0 has a queue and pair 2 none.
    ASSERT_TRUE(router.send(submit(nullptr)));
    EXPECT_EQ(router.sent_counts(), (std::vector<uint64_t>{1, 1, 0}));
    const shm::ReqRef b1 = submit(&bound);
    ASSERT_TRUE(router.send(b1));
    EXPECT_EQ(router.sent_counts(), (std::vector<uint64_t>{2, 1, 0})) << "bound to kContextArena's pair";
    // Pair 0's decode worker is down: its pair does not serve, yet a bound request
    // still goes there (to wait for it); an unbound one does not.
    reg.release(dec[0]);
    const shm::ReqRef b2 = submit(&bound);
    ASSERT_TRUE(router.send(b2));
    EXPECT_EQ(router.sent_counts(), (std::vector<uint64_t>{3, 1, 0}));
    auto o2 = t.submit(*front, other.data(), static_cast<uint32_t>(other.size()), nullptr, 0);
    ASSERT_TRUE(o2.ok());
    ASSERT_TRUE(router.send(*o2));
    EXPECT_EQ(router.sent_counts()[0], 3u) << "an unbound request avoids the pair that cannot serve";
    // Prefill 0 dies with them all queued: stranded requests move to a running
    // worker, bound ones stay for prefill 0's restart.
    reg.release(pre[0]);
    EXPECT_EQ(router.resend_stranded(), 1u) << "the unbound one only";
    const std::vector<uint64_t> moved = router.sent_counts();
    EXPECT_EQ(moved[0], 3u);
    EXPECT_EQ(moved[1] + moved[2], 3u);
    // The launcher's re-drive of a bound request: to pair 0 again, its restart.
    PrefillRouter redrive(*inst, /*redrive=*/true);
    ASSERT_TRUE(redrive.send(b1));
    EXPECT_EQ(redrive.sent_counts(), (std::vector<uint64_t>{1, 0, 0}));
    // Bound to an arena no prefill worker computes in: refused at once (computed
    // elsewhere, its offered blocks would name another arena's).
    RequestParams nowhere;
    nowhere.bind_arena(7);
    const shm::ReqRef lost = submit(&nowhere);
    EXPECT_FALSE(router.send(lost));
    EXPECT_TRUE(t.is(lost, shm::ReqState::Failed));
    EXPECT_EQ(t.slot(lost.slot).error_code.load(), static_cast<int32_t>(ReqError::NoWorker));
    // Eligibility in pick_prefill itself: the ineligible never win; none eligible
    // means all are.
    std::vector<PrefillView> v(3);
    v[0] = {false, 900, 900, true};
    v[1] = {true, 0, 10, false};
    v[2] = {true, 5, 10, false};
    EXPECT_EQ(pick_prefill(v), 0u);
    v[0].eligible = false;
    EXPECT_EQ(pick_prefill(v), 1u) << "none eligible: all are";
    v[2].eligible = true;
    EXPECT_EQ(pick_prefill(v), 2u);
}
