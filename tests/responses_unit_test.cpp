// The Responses API's pure parts (roles/responses.h): a request read into the chat
// completion it runs as, what is refused, the Response object's output order and
// status, the stream's events against the whole object, and the store's files read
// back after a restart.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>

#include "roles/responses.h"

namespace duet {
namespace {

ResponsesRequest ok(const std::string& body) {
    auto r = parse_responses(body);
    if (auto* e = std::get_if<ApiError>(&r)) ADD_FAILURE() << body << ": " << e->message;
    return std::holds_alternative<ResponsesRequest>(r) ? std::get<ResponsesRequest>(r) : ResponsesRequest{};
}
std::string refused(const std::string& body) {
    auto r = parse_responses(body);
    if (!std::holds_alternative<ApiError>(r)) return "(accepted)";
    return std::get<ApiError>(r).param;
}

TEST(Responses, ARequestBecomesAChatCompletion) {
    ResponsesRequest r = ok(R"({"input": "Hi", "instructions": "Be brief.", "max_output_tokens": 9,
        "temperature": 0.5, "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object",
        "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}}},
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "f"}, "parallel_tool_calls": false, "store": false})");
    ASSERT_EQ(r.input.size(), 1u);
    EXPECT_EQ(r.input[0].role, "user");
    EXPECT_EQ(r.input[0].content, "Hi");
    EXPECT_EQ(*r.instructions, "Be brief.");
    EXPECT_FALSE(r.store);
    EXPECT_EQ(r.chat["max_tokens"], 9);
    EXPECT_EQ(r.chat["temperature"], 0.5);
    // The schema keeps the client's property order.
    EXPECT_EQ(
        r.chat["response_format"].dump(),
        R"({"type":"json_schema","json_schema":{"name":"x","schema":{"type":"object","properties":{"b":{"type":"integer"},"a":{"type":"string"}}}}})");
    EXPECT_EQ(r.chat["tools"].dump(),
              R"([{"type":"function","function":{"name":"f","parameters":{"type":"object"}}}])");
    EXPECT_EQ(r.chat["tool_choice"].dump(), R"({"type":"function","function":{"name":"f"}})");
    EXPECT_EQ(r.chat["parallel_tool_calls"], false);
    // Items: messages (developer as system), calls in a row as one assistant message,
    // their outputs as tool messages.
    r = ok(R"({"input": [{"role": "developer", "content": "D"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed", "content": [{"type": "output_text", "text": "c", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"x\": 1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"}]})");
    ASSERT_EQ(r.input.size(), 4u);
    EXPECT_EQ(r.input[0].role, "system");
    EXPECT_EQ(r.input[1].content, "ab");
    // The assistant's text and the calls after it: one message, as a stored output.
    EXPECT_EQ(r.input[2].role, "assistant");
    EXPECT_EQ(r.input[2].content, "c");
    EXPECT_EQ(r.input[2].tool_calls, (std::vector<ChatToolCall>{{"c1", "f", "{}"}, {"c2", "g", "{\"x\": 1}"}}));
    EXPECT_EQ(r.input[3].role, "tool");
    EXPECT_EQ(r.input[3].tool_call_id, "c1");
    EXPECT_EQ(r.input[3].content, "one");
    // What is shown before the conversation decides whether a continuation reuses KV.
    EXPECT_NE(ok(R"({"input": "x", "instructions": "A"})").shown, ok(R"({"input": "x", "instructions": "B"})").shown);
    EXPECT_EQ(ok(R"({"input": "x", "instructions": "A"})").shown, ok(R"({"input": "y", "instructions": "A"})").shown);
}

TEST(Responses, WhatCannotBeHonouredIsRefusedNamingIt) {
    EXPECT_EQ(refused(R"({})"), "input");
    EXPECT_EQ(refused(R"({"input": []})"), "input");
    EXPECT_EQ(refused(R"({"input": "x", "frobnicate": 1})"), "frobnicate");
    EXPECT_EQ(refused(R"({"input": "x", "background": true})"), "background");
    EXPECT_EQ(refused(R"({"input": "x", "truncation": "auto"})"), "truncation");
    EXPECT_EQ(refused(R"({"input": "x", "reasoning": {"effort": "low"}})"), "reasoning");
    EXPECT_EQ(refused(R"({"input": "x", "include": ["reasoning.encrypted_content"]})"), "include");
    EXPECT_EQ(refused(R"({"input": "x", "tools": [{"type": "web_search"}]})"), "tools");
    EXPECT_EQ(refused(R"({"input": "x", "tools": [{"type": "function", "name": "f", "returns": 1}]})"), "tools");
    EXPECT_EQ(refused(R"({"input": "x", "tool_choice": {"type": "file_search"}})"), "tool_choice");
    EXPECT_EQ(refused(R"({"input": "x", "text": {"format": {"type": "yaml"}}})"), "text");
    EXPECT_EQ(refused(R"({"input": [{"type": "input_image", "image_url": "u"}]})"), "input");
    EXPECT_EQ(refused(R"({"input": [{"role": "user", "content": [{"type": "input_image"}]}]})"), "input");
    EXPECT_EQ(refused(R"({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]})"),
              "input");
    EXPECT_EQ(refused(R"({"input": "x", "stream_options": {"include_obfuscation": true}})"), "stream_options");
    EXPECT_EQ(refused(R"({"input": "x", "metadata": {"k": 1}})"), "metadata");
    EXPECT_EQ(refused(R"({"input": "x", "store": "yes"})"), "store");
    EXPECT_EQ(
        refused(R"({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "x": 1}]})"),
        "input");
    EXPECT_EQ(refused(R"({"input": [{"type": "function_call_output", "call_id": "c", "output": "o", "x": 1}]})"),
              "input");
    // Asking for nothing is not refused; OpenAI's bookkeeping is ignored.
    ok(R"({"input": "x", "background": false, "truncation": "disabled", "include": [], "reasoning": null,
        "user": "u", "safety_identifier": "s", "prompt_cache_key": "k", "service_tier": "auto",
        "stream_options": {"include_obfuscation": false}, "metadata": {"k": "v"}})");
}

TEST(Responses, TheObjectListsTextAndCallsInTheOrderTheyCame) {
    const ResponsesRequest r = ok(R"({"input": "x", "metadata": {"k": "v"}})");
    ResponseOutcome o;
    o.text = "Let me check.";
    o.calls = {{"call_a", "f", "{}"}, {"call_b", "g", "{\"x\": 1}"}};
    o.text_at = 1;  // one call came before the text
    o.finish = "tool_calls";
    o.usage = Usage{10, 5, 4};
    const nlohmann::json j = response_json(r, "resp_1", 100, "m", &o);
    ASSERT_EQ(j["output"].size(), 3u);
    EXPECT_EQ(j["output"][0]["type"], "function_call");
    EXPECT_EQ(j["output"][0]["call_id"], "call_a");
    EXPECT_EQ(j["output"][1]["type"], "message");
    EXPECT_EQ(j["output"][1]["content"][0]["text"], "Let me check.");
    EXPECT_EQ(j["output"][2]["arguments"], "{\"x\": 1}");
    EXPECT_EQ(j["status"], "completed");
    EXPECT_EQ(j["metadata"]["k"], "v");
    EXPECT_EQ(j["usage"]["input_tokens_details"]["cached_tokens"], 4);
    EXPECT_EQ(j["usage"]["input_tokens_details"]["cache_write_tokens"], 6);
    EXPECT_EQ(j["usage"]["total_tokens"], 15);
    o.finish = "length";
    const nlohmann::json cut = response_json(r, "resp_1", 100, "m", &o);
    EXPECT_EQ(cut["status"], "incomplete");
    EXPECT_EQ(cut["incomplete_details"]["reason"], "max_output_tokens");
    EXPECT_EQ(cut["output"][0]["status"], "incomplete");
    EXPECT_FALSE(cut.contains("completed_at"));
    o.finish = "timeout";  // duet's timeout, or cancelled
    EXPECT_EQ(response_json(r, "resp_1", 100, "m", &o)["status"], "cancelled");
    o.finish = "stop";
    o.completed_at = 123;
    EXPECT_EQ(response_json(r, "resp_1", 100, "m", &o)["completed_at"], 123);
    EXPECT_FALSE(response_json(r, "resp_1", 100, "m", nullptr).contains("usage"));  // in progress
}

TEST(Responses, AStreamsEventsAddUpToTheWholeObject) {
    const ResponsesRequest r = ok(R"({"input": "x"})");
    ResponseEvents e(r, "resp_9", 7, "m");
    std::vector<nlohmann::json> evs = e.start();
    auto add = [&](std::vector<nlohmann::json> more) { evs.insert(evs.end(), more.begin(), more.end()); };
    ToolCallDelta head;
    head.index = 0;
    head.header = true;
    head.id = "call_0";
    head.name = "f";
    head.arguments = "{\"a\"";
    add(e.piece("", {head}, 1));
    ToolCallDelta rest;
    rest.index = 0;
    rest.arguments = ": 1}";
    add(e.piece("Done", {rest}, 1));  // the text came after the call
    add(e.piece(".", {}, 1));
    ResponseOutcome o;
    o.text = "Done.";
    o.calls = {{"call_0", "f", "{\"a\": 1}"}};
    o.text_at = 1;
    o.finish = "stop";
    add(e.finish(o));
    std::vector<std::string> types;
    for (size_t i = 0; i < evs.size(); ++i) {
        EXPECT_EQ(evs[i]["sequence_number"], i);
        types.push_back(evs[i]["type"]);
    }
    EXPECT_EQ(types, (std::vector<std::string>{
                         "response.created", "response.in_progress", "response.output_item.added",
                         "response.function_call_arguments.delta", "response.function_call_arguments.delta",
                         "response.output_item.added", "response.content_part.added", "response.output_text.delta",
                         "response.output_text.delta", "response.function_call_arguments.done",
                         "response.output_item.done", "response.output_text.done", "response.content_part.done",
                         "response.output_item.done", "response.completed"}));
    EXPECT_EQ(evs[2]["item"]["type"], "function_call");
    EXPECT_EQ(evs[2]["output_index"], 0);
    EXPECT_EQ(evs[5]["output_index"], 1);  // the message after the call, as in the whole object
    EXPECT_EQ(evs.back()["response"], response_json(r, "resp_9", 7, "m", &o));
    ApiError err;
    err.message = "no worker";
    const nlohmann::json failed = e.error(err);
    EXPECT_EQ(failed["type"], "error");
    EXPECT_EQ(failed["message"], "no worker");
    EXPECT_EQ(failed["sequence_number"], evs.size());
}

TEST(Responses, TheStoreReadsBackWhatItKeptAndForgetsTheLeastRecentlyUsed) {
    const std::string dir = testing::TempDir() + "/duet-responses-" + std::to_string(getpid());
    std::filesystem::remove_all(dir);
    auto stored = [](const std::string& id, int64_t t) {
        StoredResponse s;
        s.id = id;
        s.response = {{"id", id}, {"created_at", t}};
        s.history = {ChatMessage("user", "q " + id), ChatMessage("assistant", "a")};
        s.history.back().tool_calls = {{"c", "f", "{}"}};
        s.shown = "shown";
        s.context = true;
        return s;
    };
    {
        ResponseStore st(dir, 3);
        std::vector<std::string> skipped;
        ASSERT_TRUE(st.open(skipped));
        for (int i = 0; i < 3; ++i) ASSERT_TRUE(st.put(stored("r" + std::to_string(i), i)));
        ASSERT_TRUE(st.get("r0"));  // used: r1 is now the least recently used
        auto gone = st.put(stored("r3", 3));
        ASSERT_TRUE(gone);
        EXPECT_EQ(*gone, std::vector<std::string>{"r1"});
        EXPECT_FALSE(st.get("r1"));
        EXPECT_TRUE(st.remove("r2"));
        EXPECT_FALSE(st.remove("r2"));
    }
    ResponseStore again(dir, 3);  // a restart
    std::vector<std::string> skipped;
    ASSERT_TRUE(again.open(skipped));
    EXPECT_EQ(again.size(), 2u);
    auto r0 = again.get("r0");
    ASSERT_TRUE(r0);
    EXPECT_EQ(r0->response["created_at"], 0);
    EXPECT_EQ(r0->history.size(), 2u);
    EXPECT_EQ(r0->history[1].tool_calls, (std::vector<ChatToolCall>{{"c", "f", "{}"}}));
    EXPECT_EQ(r0->shown, "shown");
    EXPECT_TRUE(r0->context);
    EXPECT_TRUE(again.get("r3"));
    EXPECT_FALSE(again.get("r2"));
    std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace duet
