// The Responses API (POST /v1/responses, GET and DELETE /v1/responses/{id}): its
// request read into the chat completion it runs as, its answer written as a
// Response object or as the documented stream of events, and the store of
// responses that previous_response_id continues.
//
// A response runs as a chat completion: instructions become a system message, input
// items become messages (function_call items an assistant's tool calls,
// function_call_output items tool messages), text.format becomes response_format,
// tools (Responses' flat function tools) the chat API's. With --contexts-dir a
// stored response is a durable context (roles/context_api.h) holding the whole
// conversation's KV: previous_response_id forks it and prefills only the new input,
// across restarts and crashes of every process. Without, stored responses are kept
// in memory (their conversation re-rendered: the prefix cache spares what it can).
// Nothing in this file does I/O but ResponseStore's files.
#pragma once

#include <cstdint>
#include <list>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "roles/openai.h"

namespace duet {

struct ResponsesRequest {
    nlohmann::json body;  // the request as sent (its fields echoed in the Response object)
    std::string model;
    std::vector<ChatMessage> input;  // the new items, as chat messages
    std::optional<std::string> instructions;
    bool stream = false;
    bool store = true;
    std::string previous_response_id;
    // The chat completion body it runs as, without its messages (the route adds them);
    // in the client's key order (a schema's properties keep theirs).
    nlohmann::ordered_json chat;
    // What the model is shown before the conversation: instructions and the tools
    // (their JSON). A stored response continues by its context only when the new
    // request has the same.
    std::string shown;
};

// Parses and validates a /v1/responses body; every field is honoured, ignored as
// OpenAI's service does (user, safety_identifier, prompt_cache_key, service_tier),
// or refused with a 400 naming it (background, conversation, reasoning, built-in
// tools, ...; docs/API.md).
std::variant<ResponsesRequest, ApiError> parse_responses(std::string_view body);

// What a finished response produced.
struct ResponseOutcome {
    std::string text;
    std::vector<ChatToolCall> calls;
    size_t text_at = 0;  // where the message item goes among the calls (calls before it)
    std::string finish;  // the chat finish reason (length: incomplete; timeout, cancelled: cancelled)
    Usage usage;
    int64_t completed_at = 0;
};

// The Response object: in progress (o null) or finished.
nlohmann::json response_json(const ResponsesRequest& r, const std::string& id, int64_t created,
                             const std::string& model, const ResponseOutcome* o);

// The events of a streamed response, in order, each {"type", ..., "sequence_number"}.
class ResponseEvents {
public:
    ResponseEvents(const ResponsesRequest& r, std::string id, int64_t created, std::string model);
    std::vector<nlohmann::json> start();  // response.created, response.in_progress
    // New text (content) and call deltas; text_at: the calls opened before the first
    // content (ToolCallParser::content_at), where the message item goes among them.
    std::vector<nlohmann::json> piece(const std::string& text, const std::vector<ToolCallDelta>& calls, size_t text_at);
    // The items' done events and response.completed (or .incomplete).
    std::vector<nlohmann::json> finish(const ResponseOutcome& o);
    // An "error" event: the response failed (where a chat stream sends its error).
    nlohmann::json error(const ApiError& e);

private:
    nlohmann::json ev(std::string type, nlohmann::json fields);
    const ResponsesRequest& r_;
    std::string id_, model_;
    int64_t created_;
    int64_t seq_ = 0;
    int message_index_ = -1;       // the message item's output index (-1: none yet)
    std::vector<int> call_index_;  // each call's output index
    int next_index_ = 0;
    std::string text_;
    std::vector<ChatToolCall> calls_;
};

// A stored response: its object, the conversation through it (instructions not
// included) and what it showed the model; `context`: it has a context of its id.
struct StoredResponse {
    std::string id;
    nlohmann::json response;
    std::vector<ChatMessage> history;
    std::string shown;
    bool context = false;
};

// Stored responses, at most `max`, the least recently used forgotten first. With a
// directory, each is a file there (written whole: a temporary file, fsync, rename),
// read back at open; without, they live in memory. Thread-safe.
class ResponseStore {
public:
    ResponseStore(std::string dir, size_t max);
    // Reads the directory's responses (the ones that do not parse are skipped, named).
    Status open(std::vector<std::string>& skipped);
    std::optional<StoredResponse> get(const std::string& id);
    // Stores r; returns the ids forgotten to make room (their contexts to remove).
    Result<std::vector<std::string>> put(const StoredResponse& r);
    bool remove(const std::string& id);
    std::vector<std::string> ids();  // most recently used first
    bool durable() const { return !dir_.empty(); }
    size_t size();

private:
    std::string path_of(const std::string& id) const;
    std::string dir_;
    size_t max_;
    std::mutex mu_;
    std::list<std::string> lru_;  // most recently used first
    std::map<std::string, std::pair<StoredResponse, std::list<std::string>::iterator>> by_id_;
};

nlohmann::json messages_json(const std::vector<ChatMessage>& msgs);
std::vector<ChatMessage> messages_of(const nlohmann::json& j);

}  // namespace duet
