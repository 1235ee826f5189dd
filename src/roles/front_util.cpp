// The front's helpers (declared in front_impl.h).
#include "roles/front_impl.h"
#include "roles/restart_policy.h"

#include <sys/socket.h>

#include <cerrno>

namespace duet {

namespace front_detail {

http::response<http::string_body> make_response(http::status st, std::string body, const Request& req,
                                                const char* type) {
    http::response<http::string_body> res{st, req.version()};
    res.set(http::field::server, "duet");
    res.set(http::field::content_type, type);
    res.keep_alive(req.keep_alive());
    res.body() = std::move(body);
    res.prepare_payload();
    return res;
}

http::status status_of(int code) { return static_cast<http::status>(code); }

std::string_view sv(beast::string_view s) { return {s.data(), s.size()}; }

// A request target's path, without the query; and its query, without the '?'.
std::string target_path(beast::string_view target) {
    std::string path(target);
    if (auto q = path.find('?'); q != std::string::npos) path.resize(q);
    return path;
}

std::string target_query(beast::string_view target) {
    const auto q = target.find('?');
    return q == beast::string_view::npos ? "" : std::string(target.substr(q + 1));
}

// Built outside the coroutines: GCC 12 miscompiles braced aggregates of string
// literals inside a coroutine body ("array used as initializer").
ApiError api_error(int status, std::string type, std::string message, std::string param, std::string code) {
    ApiError e;
    e.status = status;
    e.type = std::move(type);
    e.message = std::move(message);
    e.param = std::move(param);
    e.code = std::move(code);
    return e;
}

std::string request_id() {
    static std::atomic<uint64_t> n{0};
    // The pid too: a restarted front must not reuse the id of a request it adopted.
    return fmt::format("cmpl-{:x}{:x}x{:x}", static_cast<uint64_t>(time(nullptr)), static_cast<uint32_t>(getpid()),
                       n.fetch_add(1, std::memory_order_relaxed));  // unique, nothing ordered by it
}

// JSON bodies are built outside the coroutines (see api_error).
std::string models_json(const std::string& id, uint32_t max_len, std::string_view chat_template,
                        std::string_view tool_format) {
    json j = {{"object", "list"},
              {"data", json::array({{{"id", id},
                                     {"object", "model"},
                                     {"created", 0},
                                     {"owned_by", "duet"},
                                     {"max_model_len", max_len},
                                     {"chat_template", chat_template},
                                     {"tool_format", tool_format}}})}};
    return j.dump();
}

std::string tokens_json(const std::vector<int32_t>& ids) { return json({{"tokens", ids}, {"count", ids.size()}}).dump(); }

std::string text_json(const std::string& text) {
    return json({{"prompt", text}}).dump(-1, ' ', false, json::error_handler_t::replace);
}

ApiError failure(int32_t code) {
    switch (static_cast<ReqError>(code)) {
    case ReqError::NoWorker:
        return api_error(503, "server_error", "a worker process died and could not be restarted; the server is stopping");
    case ReqError::NotSent:
        return api_error(503, "server_error", "the prefill queue is not moving (prefill worker unavailable)");
    case ReqError::Decode:
        return api_error(500, "server_error", "decode ran out of KV cache for this request");
    case ReqError::PrefillKv:
        return api_error(503, "server_error", "prefill ran out of KV cache for this request; retry shortly");
    case ReqError::Data:
        return api_error(500, "server_error", "the request's data (logit_bias) was missing or damaged in the server");
    case ReqError::Poison:
        return api_error(500, "server_error",
                         fmt::format("the worker computing this request died {} times in a row while it made no "
                                     "progress; it is not tried again (other requests are served)",
                                     kPoisonDeaths));
    default:
        return api_error(500, "server_error", "generation failed (out of KV cache or a worker error)");
    }
}

double seconds_between(uint64_t a_ns, uint64_t b_ns) { return static_cast<double>(b_ns - a_ns) * 1e-9; }

// retry_after_ms > 0: Retry-After (whole seconds, rounded up) and retry-after-ms,
// both of which the openai client honours.
awaitable<bool> write_response(beast::tcp_stream& stream, const Request& req, http::status st, std::string body,
                               std::string type, uint64_t retry_after_ms) {
    auto res = make_response(st, std::move(body), req, type.c_str());
    if (retry_after_ms > 0) {
        res.set(http::field::retry_after, std::to_string(retry_after_seconds(retry_after_ms)));
        res.set("retry-after-ms", std::to_string(retry_after_ms));
    }
    beast::error_code ec;
    co_await http::async_write(stream, res, asio::redirect_error(use_awaitable, ec));
    co_return !ec;
}

// One SSE event; `id` (when not empty) is what a client sends back as Last-Event-ID
// to resume the stream after a front restart (GET /v1/requests/{id}/events).
awaitable<bool> write_event(beast::tcp_stream& stream, std::string payload, const std::string& id) {
    std::string ev = (id.empty() ? std::string() : "id: " + id + "\n") + "data: " + payload + "\n\n";
    beast::error_code ec;
    co_await asio::async_write(stream, http::make_chunk(asio::buffer(ev)), asio::redirect_error(use_awaitable, ec));
    co_return !ec;
}

awaitable<bool> write_typed_event(beast::tcp_stream& stream, const nlohmann::json& ev) {
    std::string text = "event: " + ev.value("type", std::string()) +
                       "\ndata: " + ev.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n\n";
    beast::error_code ec;
    co_await asio::async_write(stream, http::make_chunk(asio::buffer(text)), asio::redirect_error(use_awaitable, ec));
    co_return !ec;
}

// Turns the log-probability rows of output tokens [from, to) into API entries.
void read_logprobs(const shm::RequestTable& t, const Tokenizer& tok, Choice& c, int top, size_t from, size_t to) {
    for (size_t i = from; i < to; ++i) {
        const shm::TokenLogprob* row = t.logprobs(c.ref.slot, static_cast<uint32_t>(i));
        LogprobToken lt;
        lt.token = std::string(tok.piece(row[0].id));
        lt.logprob = row[0].logprob;
        for (int k = 0; k < top && row[1 + k].id >= 0; ++k)
            lt.top.emplace_back(std::string(tok.piece(row[1 + k].id)), row[1 + k].logprob);
        lt.text_offset = c.text_bytes;
        c.text_bytes += static_cast<int64_t>(lt.token.size());
        c.lps.push_back(std::move(lt));
    }
}

// best_of: the `keep` choices with the highest mean log-probability per token (an
// empty one scores 0), best first; equal scores keep their order.
void keep_best(std::vector<ChoiceText>& texts, size_t keep) {
    auto score = [](const ChoiceText& x) {
        double sum = 0;
        for (const LogprobToken& t : x.logprobs) sum += t.logprob;
        return x.logprobs.empty() ? 0.0 : sum / static_cast<double>(x.logprobs.size());
    };
    std::stable_sort(texts.begin(), texts.end(),
                     [&](const ChoiceText& a, const ChoiceText& b) { return score(a) > score(b); });
    texts.resize(std::min(keep, texts.size()));
}

// /tokenize and /detokenize: the response body, or what is wrong with the request.
std::variant<std::string, ApiError> token_route(const Tokenizer& tok, const std::string& path, const std::string& body) {
    json j = json::parse(body, nullptr, false);
    if (j.is_discarded() || !j.is_object())
        return api_error(400, "invalid_request_error", "the request body is not a JSON object", "", "");
    if (path == "/tokenize") {
        if (!j.contains("prompt") || !j["prompt"].is_string())
            return api_error(400, "invalid_request_error", "'prompt' must be a string", "prompt", "");
        for (const char* key : {"add_special_tokens", "parse_special"})
            if (j.contains(key) && !j[key].is_boolean())
                return api_error(400, "invalid_request_error", fmt::format("'{}' must be a boolean", key), key, "");
        const bool add_special = j.value("add_special_tokens", true);
        // parse_special: "<|im_start|>" and the like become their special tokens (as a
        // chat template's text is tokenized); by default they are text.
        const bool parse_special = j.value("parse_special", false);
        return tokens_json(tok.encode(j["prompt"].get<std::string>(), add_special, parse_special));
    }
    if (!j.contains("tokens") || !j["tokens"].is_array())
        return api_error(400, "invalid_request_error", "'tokens' must be an array", "tokens", "");
    std::vector<int32_t> ids;
    for (const json& x : j["tokens"]) {
        if (!x.is_number_integer() || x.get<int64_t>() < 0 || x.get<int64_t>() >= tok.n_vocab())
            return api_error(400, "invalid_request_error", fmt::format("token ids must be integers in [0, {})", tok.n_vocab()),
                             "tokens", "");
        ids.push_back(x.get<int32_t>());
    }
    return text_json(tok.decode(ids, false));
}

bool peer_closed(beast::tcp_stream& stream) {
    char b;
    const ssize_t n = ::recv(stream.socket().native_handle(), &b, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n == 0) return true;
    return n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR;
}

awaitable<void> write_stream_head(beast::tcp_stream& stream, const Request& req, Completion& c) {
    http::response<http::empty_body> head{http::status::ok, req.version()};
    head.set(http::field::server, "duet");
    head.set(http::field::content_type, "text/event-stream");
    head.set(http::field::cache_control, "no-cache");
    head.keep_alive(req.keep_alive());
    head.chunked(true);
    http::response_serializer<http::empty_body> sr{head};
    beast::error_code ec;
    co_await http::async_write_header(stream, sr, asio::redirect_error(use_awaitable, ec));
    c.client_gone = static_cast<bool>(ec);
}

}  // namespace front_detail

}  // namespace duet
