// The OpenAI API's request and response shapes: parsing and validating a
// /v1/completions or /v1/chat/completions body, and the JSON of responses, stream
// chunks and errors. No I/O here; the front does that.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "engine/drafter.h"
#include "engine/grammar.h"
#include "engine/scheduling.h"

#include "model/chat_template.h"
#include "model/sampler.h"
#include "roles/tool_calls.h"

namespace duet {

struct ApiError {
    int status = 400;
    std::string type = "invalid_request_error";
    std::string message;
    std::string param;  // the offending field, "" if none
    std::string code;   // e.g. "model_not_found", "context_length_exceeded"
    // 429 / 503: when to try again (the Retry-After and retry-after-ms headers); 0: 1 s.
    uint64_t retry_after_ms = 0;
};
// {"error": {"message", "type", "param", "code"}}
std::string error_json(const ApiError& e);
// A 400 invalid_request_error naming param ("": none).
ApiError bad_request(std::string param, std::string message);

struct CompletionRequest {
    bool chat = false;
    std::string model;
    std::string prompt;                 // completions: text, or
    std::vector<int32_t> prompt_ids;    // completions: token ids (OpenAI's array-of-integers prompt)
    std::vector<ChatMessage> messages;  // chat
    int64_t max_tokens = -1;            // -1: until the context is full
    SamplingParams sampling;
    std::vector<std::string> stop;
    bool stream = false;
    bool include_usage = false;
    bool ignore_eos = false;  // vLLM / llama.cpp extension: generate max_tokens whatever the model says
    int64_t min_tokens = 0;   // vLLM extension: no end-of-generation token before this many outputs
    std::vector<std::pair<int32_t, float>> logit_bias;  // (token id, bias in [-100, 100])
    int n = 1;                // choices, each its own request sharing the prompt's cached blocks
    int logprobs = -1;        // -1: none; else log-probabilities with this many top alternatives
    bool echo = false;        // completions: the prompt's text before the output
    int best_of = 0;          // completions: 0 (none) or >= n candidates; the n best are returned
    // duet's scheduling extensions (engine/scheduling.h): "priority" (critical,
    // standard, batch or an integer; else the X-Duet-Priority header, else standard)
    // and "timeout" (seconds; past it the request ends with finish_reason "timeout").
    std::optional<SloClass> priority;
    double timeout_s = 0;  // 0: the server's --request-timeout
    // duet's "speculative" (engine/drafter.h draft_limit): the server's drafting
    // (absent), none ("off"), or paced drafts up to max_draft ("auto"; 0: not given).
    DraftMode draft_mode = DraftMode::Server;
    int max_draft = 0;
    bool draft_pool =
        true;  // "pool": the decode worker's pool of earlier outputs, both ways (RequestParams::no_draft_pool)
    // The grammar the output follows (engine/grammar.h): from response_format
    // (json_object, json_schema), or llama.cpp's json_schema or grammar fields, the
    // one named by grammar_param.
    std::optional<GrammarSpec> grammar;
    std::string grammar_param;
    // Chat: the functions the model may call (roles/tool_calls.h), how, and whether
    // several calls may come in one answer. The front turns them into the rendered
    // tool list and a grammar (tool_choice none: neither).
    std::vector<ToolDef> tools;
    ToolChoice tool_choice;
    bool parallel_tool_calls = true;
    // Whether the messages hold tool calls or tool results (rendered in the tool format).
    bool tool_messages = false;
    // duet's contexts (engine/contexts.h): the context the completion joins, from its
    // route (/v1/contexts/{id}/completions) or a chat body's "context" ("" for none);
    // whether it joins it ("commit", only beside a context); and, for a completion
    // of a context with no prompt, that it continues the context itself (the front
    // moves the context's last token into the prompt once it has the context).
    std::string context;
    bool commit = true;
    bool continues_context = false;
    // The request's class: "priority", else the X-Duet-Priority header, else standard.
    SloClass slo = SloClass::Standard;
    bool calls_tools() const { return !tools.empty() && tool_choice.mode != ToolChoiceMode::None; }
};
inline constexpr int kMaxChoices = 16;
inline constexpr int kMaxTopLogprobs = 20;  // = shm::kMaxTopLogprobs

// Parses and validates a request body. Errors name the parameter and what was
// expected. Every field is honoured, refused with a 400 naming it (tools,
// logit_bias, ...: docs/API.md has the table) or, where OpenAI's service ignores it
// too (user, metadata, ...), ignored; an unknown field is a 400 "Unrecognized
// request argument supplied: NAME", as OpenAI answers.
// What a completion request says beside its body: the context its route names
// (/v1/contexts/{id}/completions; "" for the OpenAI routes) and its X-Duet-Priority
// header ("" when absent).
struct CompletionRoute {
    std::string_view context;
    std::string_view priority;
};
// The whole request, in one pass over the body (parsed once): the body's fields, the
// context and commit (a chat body's "context", or the route's), and the class (the
// body's "priority", else the route's header). What the server's state decides (the
// model it serves, whether contexts are on) is the caller's.
std::variant<CompletionRequest, ApiError> parse_completion(std::string_view body, bool chat,
                                                           const CompletionRoute& route = {});

// The "messages" of a body object (chat completions, contexts) into out: each a
// role and a text content (a string, or text parts); with `tools`, also assistant
// messages' tool_calls and tool messages (role "tool", tool_call_id), which are
// refused otherwise.
std::optional<ApiError> read_chat_messages(const nlohmann::json& body, std::vector<ChatMessage>& out,
                                           bool tools = false);

struct Usage {
    int64_t prompt_tokens = 0, completion_tokens = 0;
    int64_t cached_tokens = 0;  // prompt tokens whose KV came from the prefix cache
    int64_t drafted = 0, drafts_kept = 0;  // decode's drafted tokens for it, and those kept (<= drafted)
};

// One output token's log-probability, with its top alternatives (token texts are
// the tokens' bytes, which may be part of a UTF-8 character).
struct LogprobToken {
    std::string token;
    float logprob = 0;
    std::vector<std::pair<std::string, float>> top;
    int64_t text_offset = 0;  // completions API: where the token starts in the text
};

struct ChoiceText {
    std::string text, finish_reason;
    std::vector<LogprobToken> logprobs;  // used when the request asked for them
    std::vector<ChatToolCall> tool_calls;  // chat with tools: the calls (text is the rest)
    size_t content_at = 0;                 // the calls made before the first text (ToolCallParser::content_at)
};

// A whole (non-streamed) response, choices in index order.
std::string completion_json(const CompletionRequest& r, const std::string& id, int64_t created,
                            const std::string& model, const std::vector<ChoiceText>& choices, const Usage& u);
// One stream chunk of choice `index`: text (may be empty) and a finish reason (""
// while running).
std::string chunk_json(const CompletionRequest& r, const std::string& id, int64_t created, const std::string& model,
                       int index, const std::string& text, const std::string& finish_reason, bool first,
                       const std::vector<LogprobToken>& logprobs = {}, const std::vector<ToolCallDelta>& calls = {});
// The usage chunk sent last when stream_options.include_usage is set.
std::string usage_chunk_json(const CompletionRequest& r, const std::string& id, int64_t created,
                             const std::string& model, const Usage& u);

}  // namespace duet
