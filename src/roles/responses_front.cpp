// /v1/responses in the front (roles/responses.h): a response runs as a chat
// completion (a CompletionRun, answered as a Response), on a context of its
// own when stored with --contexts-dir, so that previous_response_id continues from
// the stored KV; GET and DELETE /v1/responses/{id}.
#include "roles/front_impl.h"

#include <atomic>

namespace duet {

namespace {

std::string response_id() {
    static std::atomic<uint64_t> n{0};
    // The pid too, as request_id: unique across a restarted front.
    return fmt::format("resp_{:x}{:x}x{:x}", static_cast<uint64_t>(time(nullptr)), static_cast<uint32_t>(getpid()),
                       n.fetch_add(1, std::memory_order_relaxed));
}

// The assistant message a finished response adds to its conversation: its text and
// its calls, but a call cut short (max_output_tokens), whose arguments are not a
// JSON object, which a later turn could not send back.
ChatMessage output_message(const ResponseOutcome& o) {
    ChatMessage m("assistant", o.text);
    for (const ChatToolCall& c : o.calls)
        if (nlohmann::json::parse(c.arguments, nullptr, false).is_object()) m.tool_calls.push_back(c);
    return m;
}

// JSON bodies are built outside the coroutines (GCC 12 and braced initializers there:
// front_impl.h).
std::string id_body(const std::string& id) { return nlohmann::json{{"id", id}}.dump(); }
std::string deleted_body(const std::string& id) {
    return nlohmann::json{{"id", id}, {"object", "response"}, {"deleted", true}}.dump();
}
std::string chat_body(const nlohmann::ordered_json& base, const std::vector<ChatMessage>& send,
                      const std::string& context, bool commit) {
    nlohmann::ordered_json chat = base;
    chat["messages"] = nlohmann::ordered_json::parse(messages_json(send).dump());
    if (!context.empty()) {
        chat["context"] = context;
        chat["commit"] = commit;
    }
    return chat.dump();
}

// A chat parse's error, naming the Responses field it came from.
ApiError responses_error(ApiError e) {
    static const std::pair<const char*, const char*> kNames[] = {
        {"max_tokens", "max_output_tokens"}, {"response_format", "text"}, {"messages", "input"}};
    for (const auto& [chat, resp] : kNames)
        if (e.param == chat) {
            e.param = resp;
            if (e.message.find(chat) != std::string::npos)
                e.message += fmt::format(" ('{}' as the chat API names it)", chat);
        }
    return e;
}

ApiError context_error(const ApiReply& r, const std::string& what) {
    auto j = nlohmann::json::parse(r.body, nullptr, false);
    const std::string msg = j.is_object() && j.contains("error") ? j["error"].value("message", r.body) : r.body;
    return api_error(r.status >= 500 || r.status == 429 ? r.status : 500, "server_error", what + ": " + msg, "", "");
}

}  // namespace

ResponseOutcome front_detail::response_outcome(const Completion& c, const Outcome& o) {
    ResponseOutcome ro;
    // When it ended: once (the stored object, the reply and the stream's last event agree).
    if (c.resp->completed_at == 0) c.resp->completed_at = static_cast<int64_t>(time(nullptr));
    ro.completed_at = c.resp->completed_at;
    if (!o.texts.empty()) {
        ro.text = o.texts[0].text;
        ro.calls = o.texts[0].tool_calls;
        ro.text_at = std::min(o.texts[0].content_at, ro.calls.size());
        ro.finish = o.texts[0].finish_reason;
    }
    ro.usage = o.u;
    return ro;
}

awaitable<bool> front_detail::responses(Front::Impl& f, beast::tcp_stream& stream, Request& req) {
    if (f.draining.load(std::memory_order_relaxed))
        co_return co_await error(f, stream, req, api_error(503, "server_error", "the server is shutting down", "", ""));
    auto parsed = parse_responses(req.body());
    if (auto* e = std::get_if<ApiError>(&parsed)) co_return co_await error(f, stream, req, *e);
    ResponseRun run;
    run.rr = std::move(std::get<ResponsesRequest>(parsed));
    ResponsesRequest& rr = run.rr;
    ResponseStore& store = *f.responses;
    std::optional<StoredResponse> prev;
    if (!rr.previous_response_id.empty()) {
        prev = store.get(rr.previous_response_id);
        if (!prev)
            co_return co_await error(
                f, stream, req,
                api_error(404, "invalid_request_error",
                          fmt::format("Previous response with id '{}' not found (stored responses are kept up to "
                                      "--responses-max, {}{})",
                                      rr.previous_response_id, f.opts.responses_max,
                                      store.durable() ? "" : ", in memory: --contexts-dir keeps them across restarts"),
                          "previous_response_id", "previous_response_not_found"));
    }
    run.id = response_id();
    run.created = static_cast<int64_t>(time(nullptr));
    if (prev) run.convo = prev->history;
    run.convo.insert(run.convo.end(), rr.input.begin(), rr.input.end());

    // What the completion is sent: the new input on the previous response's context
    // (forked for this one when it is stored), or the whole conversation, on a new
    // context of its own when stored durably, else as it is.
    ContextService* svc = store.durable() ? f.opts.contexts : nullptr;
    // The whole conversation, as rendered anew; checked as the chat completion will
    // read it before any context is touched (its errors name the Responses field).
    std::vector<ChatMessage> whole;
    if (rr.instructions) whole.emplace_back("system", *rr.instructions);
    whole.insert(whole.end(), run.convo.begin(), run.convo.end());
    {
        auto check = parse_completion(chat_body(rr.chat, whole, "", false), true);
        if (auto* e = std::get_if<ApiError>(&check)) co_return co_await error(f, stream, req, responses_error(*e));
    }
    std::vector<ChatMessage> send;
    std::string context;
    bool commit = false;
    // Continued from the previous response's context: it has one (still), and the
    // new request shows the model what it showed.
    bool continues = svc && prev && prev->context && prev->shown == rr.shown;
    if (continues) {
        const std::string path = "/v1/contexts/" + prev->id;
        ApiReply r = co_await asio::co_spawn(
            f.store, [&]() -> awaitable<ApiReply> { co_return svc->handle("GET", path, "", ""); }, use_awaitable);
        continues = r.status == 200;
    }
    std::string ctx_method, ctx_path, ctx_body;  // the context call before the completion, if any
    if (continues) {
        send = rr.input;
        if (rr.store) {
            ctx_method = "POST", ctx_path = "/v1/contexts/" + prev->id + "/fork", ctx_body = id_body(run.id);
            context = run.id;
            commit = true;
        } else {
            context = prev->id;  // read, not changed
        }
    } else {
        send = whole;
        if (svc && rr.store) {
            ctx_method = "POST", ctx_path = "/v1/contexts", ctx_body = id_body(run.id);
            context = run.id;
            commit = true;
        }
    }
    if (!ctx_path.empty()) {
        ApiReply r = co_await asio::co_spawn(
            f.store, [&]() -> awaitable<ApiReply> { co_return svc->handle(ctx_method, ctx_path, "", ctx_body); },
            use_awaitable);
        if (r.status == 404 && continues) {
            // The previous context went since it was looked at (deleted, pushed out):
            // the conversation is rendered anew on a new context.
            send = whole;
            r = co_await asio::co_spawn(
                f.store, [&]() -> awaitable<ApiReply> { co_return svc->handle("POST", "/v1/contexts", "", ctx_body); },
                use_awaitable);
        }
        if (r.status >= 400) co_return co_await error(f, stream, req, context_error(r, "storing the response"));
    }
    run.own_context = commit;
    req.body() = chat_body(rr.chat, send, context, commit);
    bool keep = false;
    {  // its lease and returned KV are dropped as it ends, before its context goes
        CompletionRun completion(f, stream, req);
        keep = co_await completion.start(true, "", &run);
    }
    // Not stored (it failed, or its client left): its context goes too.
    if (run.own_context && !store.get(run.id)) {
        const std::string path = "/v1/contexts/" + run.id;
        (void)co_await asio::co_spawn(
            f.store, [&]() -> awaitable<ApiReply> { co_return svc->handle("DELETE", path, "", ""); }, use_awaitable);
    }
    co_return keep;
}

awaitable<std::optional<ApiError>> CompletionRun::store_response(const Outcome& o) {
    ResponseRun& run = *c.resp;
    if (!run.rr.store) co_return std::nullopt;
    StoredResponse s;
    s.id = run.id;
    const ResponseOutcome ro = response_outcome(c, o);
    s.response = response_json(run.rr, run.id, run.created, f.opts.model_id, &ro);
    s.history = run.convo;
    s.history.push_back(output_message(ro));
    s.shown = run.rr.shown;
    s.context = run.own_context;
    ResponseStore& store = *f.responses;
    ContextService* svc = store.durable() ? f.opts.contexts : nullptr;
    // On the store thread: a file written and synced, and the contexts of responses
    // it pushed out removed.
    auto done = co_await asio::co_spawn(
        f.store,
        [&]() -> awaitable<std::optional<ApiError>> {
            auto gone = store.put(s);
            if (!gone)
                co_return api_error(gone.error().kind == ErrorKind::NoSpace ? 507 : 500, "server_error",
                                    "the response was not stored: " + gone.error().message, "", "");
            if (svc)
                for (const std::string& id : *gone) (void)svc->handle("DELETE", "/v1/contexts/" + id, "", "");
            co_return std::nullopt;
        },
        use_awaitable);
    co_return done;
}

awaitable<bool> front_detail::stored_response(Front::Impl& f, beast::tcp_stream& stream, Request& req,
                                              const std::string& id) {
    ResponseStore& store = *f.responses;
    if (const std::string q = target_query(req.target()); !q.empty())
        co_return co_await error(f, stream, req,
                                 api_error(400, "invalid_request_error",
                                           fmt::format("query parameters ({}) are not supported here", q), "", ""));
    std::optional<StoredResponse> r = store.get(id);
    if (!r)
        co_return co_await error(
            f, stream, req,
            api_error(404, "invalid_request_error", fmt::format("Response with id '{}' not found.", id), "", ""));
    if (req.method() == http::verb::get)
        co_return co_await write_response(stream, req, http::status::ok,
                                          r->response.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace),
                                          "application/json", 0);
    ContextService* svc = store.durable() ? f.opts.contexts : nullptr;
    const bool removed = co_await asio::co_spawn(
        f.store,
        [&]() -> awaitable<bool> {
            const bool gone = store.remove(id);
            if (gone && svc && r->context) (void)svc->handle("DELETE", "/v1/contexts/" + id, "", "");
            co_return gone;
        },
        use_awaitable);
    if (!removed)
        co_return co_await error(
            f, stream, req,
            api_error(404, "invalid_request_error", fmt::format("Response with id '{}' not found.", id), "", ""));
    co_return co_await write_response(stream, req, http::status::ok, deleted_body(id), "application/json", 0);
}

}  // namespace duet
