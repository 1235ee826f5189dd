// The OpenAI API's request and response shapes: parsing and validating a
// /v1/completions or /v1/chat/completions body, and the JSON of responses, stream
// chunks and errors. No I/O here; the front does that.
#pragma once

#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "model/chat_template.h"
#include "model/sampler.h"

namespace duet {

struct ApiError {
    int status = 400;
    std::string type = "invalid_request_error";
    std::string message;
    std::string param;  // the offending field, "" if none
    std::string code;   // e.g. "model_not_found", "context_length_exceeded"
};
// {"error": {"message", "type", "param", "code"}}
std::string error_json(const ApiError& e);

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
};

// Parses and validates a request body. Errors name the parameter and what was
// expected; unsupported options (n > 1, logprobs) are errors, never ignored.
std::variant<CompletionRequest, ApiError> parse_completion(std::string_view body, bool chat);

struct Usage {
    int64_t prompt_tokens = 0, completion_tokens = 0;
};

// A whole (non-streamed) response.
std::string completion_json(const CompletionRequest& r, const std::string& id, int64_t created,
                            const std::string& model, const std::string& text, const std::string& finish_reason,
                            const Usage& u);
// One stream chunk: text (may be empty) and a finish reason ("" while running).
std::string chunk_json(const CompletionRequest& r, const std::string& id, int64_t created, const std::string& model,
                       const std::string& text, const std::string& finish_reason, bool first);
// The usage chunk sent last when stream_options.include_usage is set.
std::string usage_chunk_json(const CompletionRequest& r, const std::string& id, int64_t created,
                             const std::string& model, const Usage& u);

}  // namespace duet
