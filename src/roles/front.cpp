#include <utility>  // Boost 1.74's asio/awaitable.hpp uses std::exchange without including it

#include "roles/front.h"

#include <time.h>
#include <unistd.h>

#include <map>
#include <optional>
#include <variant>

#include <boost/asio.hpp>
#include <boost/beast.hpp>
#include <nlohmann/json.hpp>

#include "kv/kv_pool.h"
#include "roles/context_api.h"
#include "roles/metrics_text.h"
#include "roles/openai.h"
#include "roles/recovery.h"
#include "roles/routing.h"
#include "roles/stop_text.h"
#include "roles/wire.h"
#include "shm/doorbell.h"

namespace duet {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;
using asio::awaitable;
using asio::use_awaitable;
using nlohmann::json;

// A request's coroutine waiting for its slot to change: the notifier thread cancels
// the timer (on the connection's strand) once the slot's output count or state
// differs from what the coroutine last read.
struct Waiter {
    uint32_t slot;
    uint32_t seen_out;
    shm::ReqState seen_state;
    std::shared_ptr<asio::steady_timer> timer;
};

// A request's front record as read back from its slots (parse_front_record).
struct FrontRecord {
    std::string id, xid;
    int64_t created = 0;
    bool chat = false;
    CompletionRequest r;
    size_t prompt_tokens = 0;
    std::vector<shm::ReqRef> refs;
    // A context completion: its context, the context's length when it began, whether
    // it joins the context, whether its KV comes back for that (Completion's fields).
    std::string context;
    size_t context_len = 0;
    bool commit = true;
    bool return_kv = false;
    std::string echo;  // Completion's
    int keep = 1;
};

// A request adopted from a dead front (Front::adopt_orphans), until its client comes
// back for it or the resume window passes.
// Or a stream of this front's whose client disconnected (FrontSession::detach), for
// --resume-grace.
struct Orphan {
    FrontRecord rec;
    uint64_t since_ns = 0;    // adopted, or detached
    uint64_t window_ns = 0;   // how long from since_ns its client may come back
    bool claimed = false;   // a connection is answering it
    bool expiring = false;  // the window passed: cancelled, freed once every choice has ended
    std::vector<uint32_t> attempts;  // each choice's attempt this front last sent (a preempted one is sent again)
};

struct Front::Impl {
    asio::io_context io;
    std::mutex orphans_mu;
    std::map<std::string, Orphan> orphans;  // by response id
    tcp::acceptor acceptor{io};
    asio::thread_pool store{1};  // the contexts' blocking calls (disk, waits for prefill), one at a time
    std::mutex mu;
    std::vector<std::shared_ptr<Waiter>> waiters;

    static bool changed(const shm::RequestTable& t, const Waiter& w) {
        return t.slot(w.slot).n_output.load(std::memory_order_acquire) != w.seen_out || t.state(w.slot) != w.seen_state;
    }
    void add(std::shared_ptr<Waiter> w) {
        std::lock_guard<std::mutex> lock(mu);
        waiters.push_back(std::move(w));
    }
    void remove(const std::shared_ptr<Waiter>& w) {
        std::lock_guard<std::mutex> lock(mu);
        auto it = std::find(waiters.begin(), waiters.end(), w);
        if (it != waiters.end()) {
            *it = std::move(waiters.back());
            waiters.pop_back();
        }
    }
    bool any_changed(const shm::RequestTable& t) {
        std::lock_guard<std::mutex> lock(mu);
        for (const auto& w : waiters)
            if (changed(t, *w)) return true;
        return false;
    }
    // Wakes (and forgets) every waiter whose slot changed.
    void wake_changed(const shm::RequestTable& t) {
        std::lock_guard<std::mutex> lock(mu);
        for (size_t i = 0; i < waiters.size();) {
            if (changed(t, *waiters[i])) {
                asio::post(waiters[i]->timer->get_executor(), [tm = waiters[i]->timer] { tm->cancel(); });
                waiters[i] = std::move(waiters.back());
                waiters.pop_back();
            } else {
                ++i;
            }
        }
    }
};

namespace {

using Request = http::request<http::string_body>;

http::response<http::string_body> make_response(http::status st, std::string body, const Request& req,
                                                const char* type = "application/json") {
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
ApiError api_error(int status, std::string type, std::string message, std::string param = {}, std::string code = {}) {
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
std::string models_json(const std::string& id, uint32_t max_len) {
    json j = {{"object", "list"},
              {"data", json::array({{{"id", id},
                                     {"object", "model"},
                                     {"created", 0},
                                     {"owned_by", "duet"},
                                     {"max_model_len", max_len}}})}};
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
awaitable<bool> write_event(beast::tcp_stream& stream, std::string payload, const std::string& id = {}) {
    std::string ev = (id.empty() ? std::string() : "id: " + id + "\n") + "data: " + payload + "\n\n";
    beast::error_code ec;
    co_await asio::async_write(stream, http::make_chunk(asio::buffer(ev)), asio::redirect_error(use_awaitable, ec));
    co_return !ec;
}

// One choice of a completion: its request and what the front has made of its tokens.
struct Choice {
    Choice(const Tokenizer& tok, std::vector<std::string> stops) : detok(tok), stream(std::move(stops)) {}
    shm::ReqRef ref;
    Detokenizer detok;
    StopText stream;  // the generated text, stop strings applied, and what was streamed
    std::vector<int32_t> out;
    uint32_t have = 0;                             // output tokens read
    uint32_t attempt = 0;                          // the request's attempt this front last sent
    uint32_t sent_have = 0;                        // `have` when its last event was written (the event id)
    shm::ReqState seen_state = shm::ReqState::Free;  // as last read
    std::string finish;
    bool first = true, done = false;
    shm::ReqState final_state = shm::ReqState::Free;
    uint64_t last_token_ns = 0;
    std::vector<LogprobToken> lps;  // one per output token, when asked for
    size_t lps_sent = 0;            // streamed so far
    // Once a stop string ended it: the output tokens it keeps, those up to the one
    // that completed the stop string. Tokens the worker made past it (it had not
    // seen the cancel yet; a verify row makes several at once) are not part of the
    // response: not in its log-probs, usage or context, whatever the timing.
    size_t kept = SIZE_MAX;
    // Feeds out[from, out.size()) to the text and its stop strings (terminal: no
    // more tokens come); true when a stop string ended it now.
    bool feed(size_t from, bool terminal) {
        if (stream.stopped()) return false;
        for (size_t i = from; i < out.size(); ++i) {
            if (!stream.append(detok.push(out[i]))) continue;
            kept = i + 1;
            out.resize(kept);
            if (lps.size() > kept) lps.resize(kept);
            return true;
        }
        return terminal && stream.append(detok.finish());
    }
    int64_t text_bytes = 0;         // bytes of the tokens so far (text_offset)
    std::vector<LogprobToken> unsent() const {
        if (lps_sent >= lps.size()) return {};
        return {lps.begin() + static_cast<std::ptrdiff_t>(lps_sent), lps.end()};
    }
    // Asks the worker to stop; a request no worker has taken yet is cancelled here.
    void cancel(shm::RequestTable& t) const {
        t.cancel(ref);
        t.transition(ref, shm::ReqState::Queued, shm::ReqState::Cancelled);
    }
};

static_assert(kMaxTopLogprobs == static_cast<int>(shm::kMaxTopLogprobs));

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

// One completion while it runs: what was asked, its prompt, its choices (a request
// slot each), and how its response goes.
struct Completion {
    CompletionRequest r;
    bool chat = false;
    // /v1/contexts/{id}/completions: the context's tokens go before the prompt, and
    // (commit) the prompt and the output join the context before the reply ends.
    std::string context;
    std::vector<int32_t> context_tokens;  // put before the prompt
    size_t context_len = 0;               // the context's length when the completion began
    // Blocks of the context's arena this completion holds a reference on, dropped
    // when it ends: `lease`, the context's own, leased for the completion (prefill
    // starts from them, RequestParams::given_tokens; every choice has ended, and so
    // prefill took its own references or none, by the time they are dropped); and
    // `returned`, the completion's KV given back by its worker (return_kv), which the
    // commit hands to the context instead.
    struct Held {
        ContextService* svc = nullptr;
        std::vector<int32_t> blocks;
        int64_t valid = 0;  // positions they hold
        Held() = default;
        Held(const Held&) = delete;
        Held& operator=(const Held&) = delete;
        ~Held() {
            if (svc) svc->release(blocks);
        }
    } lease, returned;
    bool return_kv = false;
    bool commit = true;
    // "echo": the prompt's text, put before each choice's output. "best_of": r.n
    // candidates run, and the `keep` with the highest mean log-probability per token
    // are the reply (keep == r.n: no ranking).
    std::string echo;
    int keep = 1;
    bool ranked() const { return keep < r.n; }
    uint64_t arrived = 0;  // the body read
    std::vector<int32_t> prompt;
    std::vector<Choice> ch;
    std::string id;
    int64_t created = 0;
    uint64_t deadline = 0;  // past it, a choice still running is cancelled ("timeout")
    bool timed_out = false;
    bool client_gone = false;
    bool detached = false;  // its client left; it runs on as an orphan for --resume-grace
    // Scheduling (engine/scheduling.h): its class; the prompt tokens it holds in the
    // front's queue (until its first token, or its end); its first token and gaps.
    SloClass cls = SloClass::Standard;
    int64_t queued = 0;
    std::multimap<uint64_t, int64_t>::iterator queue_at{};  // its place in the queue while queued > 0 (Front::QueueAt)
    uint64_t first_ns = 0;
    double gap_sum = 0;
    int64_t gaps = 0;
    std::string xid;          // the client's X-Request-Id ("": none)
    std::string resumed_id;   // an orphan (adopted or detached) resumed: to forget when it ends
    // Event id: each choice's output tokens read when its last event was written.
    std::string event_id() const {
        std::string e;
        for (const Choice& x : ch) e += (e.empty() ? "" : ".") + std::to_string(x.sent_have);
        return e;
    }
};

// What a restarted front needs to answer a request's client again, kept in the
// request's slots (shm::ReqFrontRecord, JSON): the response's id and creation time,
// how its chunks are made, and every choice's slot.
std::string front_record_json(const Completion& c) {
    json slots = json::array();
    for (const Choice& ch : c.ch) slots.push_back({ch.ref.slot, ch.ref.gen});
    return json{{"v", 1},
                {"id", c.id},
                {"xid", c.xid},
                {"created", c.created},
                {"chat", c.chat},
                {"stream", c.r.stream},
                {"include_usage", c.r.include_usage},
                {"ignore_eos", c.r.ignore_eos},
                {"logprobs", c.r.logprobs},
                {"stop", c.r.stop},
                {"prompt_tokens", c.prompt.size()},
                {"slots", slots},
                {"context", c.context},
                {"context_len", c.context_len},
                {"commit", c.commit},
                {"return_kv", c.return_kv},
                {"echo", c.echo},
                {"keep", c.keep}}
        .dump();
}

std::optional<FrontRecord> parse_front_record(const std::string& text) {
    json j = json::parse(text, nullptr, false);
    if (!j.is_object() || j.value("v", 0) != 1) return std::nullopt;
    try {
        FrontRecord f;
        f.id = j.at("id").get<std::string>();
        f.xid = j.at("xid").get<std::string>();
        f.created = j.at("created").get<int64_t>();
        f.chat = j.at("chat").get<bool>();
        f.r.chat = f.chat;
        f.r.stream = j.at("stream").get<bool>();
        f.r.include_usage = j.at("include_usage").get<bool>();
        f.r.ignore_eos = j.at("ignore_eos").get<bool>();
        f.r.logprobs = j.at("logprobs").get<int>();
        f.r.stop = j.at("stop").get<std::vector<std::string>>();
        f.prompt_tokens = j.at("prompt_tokens").get<size_t>();
        for (const json& s : j.at("slots")) f.refs.push_back(shm::ReqRef{s.at(0).get<uint32_t>(), s.at(1).get<uint32_t>()});
        f.r.n = static_cast<int>(f.refs.size());
        f.context = j.value("context", std::string());
        f.context_len = j.value("context_len", size_t{0});
        f.commit = j.value("commit", true);
        f.return_kv = j.value("return_kv", false);
        f.echo = j.value("echo", std::string());
        f.keep = std::clamp(j.value("keep", f.r.n), 1, f.r.n);
        if (f.refs.empty()) return std::nullopt;
        return f;
    } catch (const std::exception&) {
        return std::nullopt;
    }
}

// A completion's choices once all have ended.
struct Outcome {
    Usage u;
    bool failed = false;
    int32_t error_code = 0;  // of a failed choice
    std::vector<ChoiceText> texts;
};

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

// What one look at a choice's slot found.
struct ChoiceStep {
    shm::ReqState st = shm::ReqState::Free;
    bool terminal = false;
    uint64_t seen_ns = 0;
};

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

}  // namespace

// The coroutines that serve one connection, and the steps of a completion; a friend
// of Front.
struct FrontSession {
    static awaitable<bool> error(Front& f, beast::tcp_stream& stream, const Request& req, ApiError e) {
        f.counters_.errors.fetch_add(1, std::memory_order_relaxed);
        const uint64_t retry = e.status == 429 || e.status == 503 ? (e.retry_after_ms ? e.retry_after_ms : 1000) : 0;
        co_return co_await write_response(stream, req, status_of(e.status), error_json(e), "application/json", retry);
    }
    static awaitable<void> listen(Front& f);
    static awaitable<void> tick(Front& f);
    static awaitable<void> serve(Front& f, tcp::socket sock);
    static awaitable<void> too_large(beast::tcp_stream& stream, uint64_t limit);
    static awaitable<bool> unauthorized(Front& f, beast::tcp_stream& stream, const Request& req);
    static bool open_route(const Front& f, std::string_view path);
    static awaitable<bool> import_blob(Front& f, beast::tcp_stream& stream, beast::flat_buffer& buf,
                                       http::request_parser<http::empty_body>& head, uint64_t limit);
    static awaitable<bool> export_blob(Front& f, beast::tcp_stream& stream, Request& req, const std::string& id);
    static awaitable<bool> handle(Front& f, beast::tcp_stream& stream, Request& req);
    static MetricsSnapshot metrics_snapshot(Front& f);

    // A completion, in the order it runs: parse and check the request, tokenize its
    // prompt, put its choices in the request table and send them to prefill, follow
    // them (streaming if asked) until all end, account for them, and reply.
    static awaitable<bool> completion(Front& f, beast::tcp_stream& stream, Request& req, bool chat,
                                      std::string context = "");
    static awaitable<bool> contexts(Front& f, beast::tcp_stream& stream, Request& req, const std::string& path);
    static awaitable<std::optional<ApiError>> commit_context(Front& f, Completion& c);
    static awaitable<bool> end_completion(Front& f, beast::tcp_stream& stream, Request& req, Completion& c);
    static bool detach(Front& f, Completion& c);
    static void take_returned_kv(Front& f, Completion& c);
    static std::optional<ApiError> parse(Front& f, const Request& req, Completion& c);
    static std::optional<ApiError> tokenize_prompt(Front& f, Completion& c);
    static std::variant<RequestParams, ApiError> request_params_of(Front& f, const Completion& c);
    static std::optional<ApiError> admit(Front& f, Completion& c, RequestParams params);
    static awaitable<void> follow(Front& f, beast::tcp_stream& stream, Completion& c);
    static ChoiceStep read_choice(Front& f, Completion& c, Choice& ch);
    static awaitable<void> stream_choice(Front& f, beast::tcp_stream& stream, Completion& c, size_t ci,
                                         const ChoiceStep& step);
    static bool settle_choice(Front& f, Completion& c, Choice& ch, const ChoiceStep& step);
    static awaitable<void> wait_for_change(Front& f, Completion& c, const std::shared_ptr<asio::steady_timer>& timer);
    static Outcome finish(Front& f, Completion& c);
    static awaitable<bool> reply_stream(Front& f, beast::tcp_stream& stream, Completion& c, const Outcome& o);
    static awaitable<bool> reply(Front& f, beast::tcp_stream& stream, const Request& req, Completion& c,
                                 const Outcome& o);
    // A request adopted from a dead front, answered again: GET /v1/requests/{id}/events
    // (an SSE stream from Last-Event-ID on), or a retry with the same X-Request-Id (the
    // whole answer, as first asked).
    static awaitable<bool> resume(Front& f, beast::tcp_stream& stream, Request& req, const std::string& id,
                                  bool events);
    static std::optional<std::string> orphan_of_xid(Front& f, const std::string& xid);
};

Front::Front(shm::Instance& inst, shm::ProcRef self, const Tokenizer& tok, ChatTemplate tmpl, FrontOptions o)
    : impl_(std::make_unique<Impl>()), inst_(inst), self_(self), tok_(tok), tmpl_(std::move(tmpl)),
      opts_(std::move(o)), key_(opts_.api_key), router_(inst, /*redrive=*/false) {
    opts_.api_key.clear();  // only its digest stays (key_)
    admission_ = AdmissionControl(opts_.admission);
}

AdmissionDecision Front::admit_tokens(SloClass c, int64_t tokens, int64_t prompt_length, uint64_t key, QueueAt& at) {
    std::lock_guard<std::mutex> lock(sched_mu_);
    const uint64_t now = shm::monotonic_ns();
    const bool returning = retries_.returning(key, now);
    const double n = prefill_workers_;
    const MeasuredRate r = admission_rate(c, {prefill_rate_.rate() * n, prefill_rate_.recent() * n},
                                          {prefill_wide_rate_.rate() * n, prefill_wide_rate_.recent() * n});
    AdmissionDecision d = admission_.decide(c, tokens, queue_, r.best, r.recent, &kv_, returning);
    if (d.admit && tokens > 0) {  // (none: a context's KV covers the prompt; it never leaves)
        queue_.pending[static_cast<size_t>(c)] += tokens;
        // Prefill's order key as the worker will compute it (from the whole prompt's
        // length, and the table's submit time, a moment later: the order among these
        // is the same).
        const uint64_t ttft = admission_.options().slo.of(c).ttft_ns;
        at = queue_.prompts.emplace(prefill_order_key(now, static_cast<uint32_t>(c), ttft,
                                                      static_cast<uint64_t>(prompt_length), kDeadlineNsPerToken),
                                    tokens);
    }
    retries_.judged(key, now, returning, d);
    return d;
}

void Front::queue_left(SloClass c, int64_t tokens, QueueAt at) {
    std::lock_guard<std::mutex> lock(sched_mu_);
    queue_.pending[static_cast<size_t>(c)] -= tokens;
    queue_.prompts.erase(at);
}

void Front::sample_prefill_work() {
    shm::Registry& reg = inst_.registry();
    std::lock_guard<std::mutex> lock(sched_mu_);
    work_seen_.resize(reg.n_slots(), {0, 0, 0, 0, 0});
    uint32_t running = 0;
    for (uint32_t s = 0; s < reg.n_slots(); ++s) {
        if (!reg.running_as(s, shm::Role::Prefill)) continue;
        const shm::ProcSlot& ps = reg.slot(s);
        ++running;
        // Two counters read one after the other: a pass's time may be seen before its
        // tokens; the next reading has them (a window holds many readings).
        const std::array<uint64_t, 4> now = {
            ps.busy_ns.load(std::memory_order_relaxed), ps.work_tokens.load(std::memory_order_relaxed),
            ps.wide_busy_ns.load(std::memory_order_relaxed), ps.wide_tokens.load(std::memory_order_relaxed)};
        std::array<uint64_t, 5>& seen = work_seen_[s];
        const uint64_t gen = reg.current(s).gen;
        if (seen[0] != gen) seen = {gen, 0, 0, 0, 0};  // a new process here: its counters started at 0
        for (size_t k = 0; k < 2; ++k) {
            const uint64_t busy = now[2 * k], tokens = now[2 * k + 1];
            if (busy >= seen[1 + 2 * k] && tokens >= seen[2 + 2 * k])
                (k == 0 ? prefill_rate_ : prefill_wide_rate_)
                    .add(busy - seen[1 + 2 * k], static_cast<int64_t>(tokens - seen[2 + 2 * k]));
            seen[1 + 2 * k] = busy;
            seen[2 + 2 * k] = tokens;
        }
    }
    prefill_workers_ = std::max<uint32_t>(1, running);
}

void Front::sample_kv() {
    KvView v;
    const shm::InstanceConfig& cfg = inst_.config();
    const int32_t ctx_user = opts_.contexts ? opts_.contexts->arena_user() : -1;
    // The decode workers' arenas: where admitted requests hold blocks until they end
    // (a prefill-only arena, kv_split, only while their prompts are computed).
    for (const uint32_t a : decode_arenas(cfg)) {
        const shm::ArenaCensus c = inst_.arena(a).census();
        int64_t held = c.held;
        // Idle contexts give way to requests (ContextService::make_room): their blocks
        // are not the arena's load. (References, not blocks: a block a context shares
        // with a request counts for neither, an underestimate of a few blocks.)
        if (a == kContextArena && ctx_user >= 0)
            held -= std::min<int64_t>(held, static_cast<int64_t>(c.refs_by_user[static_cast<size_t>(ctx_user)]));
        v.used += held;
        v.total += c.total;
    }
    const shm::RequestTable& t = inst_.requests();
    const double itl = itl_s_.load(std::memory_order_relaxed);
    const uint64_t per_token_ns = static_cast<uint64_t>((itl > 0 ? itl : 0.05) * 1e9);
    const int64_t bt = std::max<int64_t>(1, cfg.requests.block_tokens);
    for (uint32_t s = 0; s < t.n_slots(); ++s) {
        if (t.state(s) != shm::ReqState::Decoding) continue;
        const shm::ReqSlot& r = t.slot(s);
        const int64_t out = r.n_output.load(std::memory_order_relaxed);
        const int64_t tokens = r.n_prompt.load(std::memory_order_relaxed) + out;
        const int64_t left = std::max<int64_t>(0, static_cast<int64_t>(request_params(t, s).max_tokens) - out);
        v.running.push_back({(tokens + bt - 1) / bt, static_cast<uint64_t>(left) * per_token_ns});
    }
    std::lock_guard<std::mutex> lock(sched_mu_);
    kv_ = std::move(v);
}

Front::~Front() { stop(); }

Status Front::start() {
    beast::error_code ec;
    auto addr = asio::ip::make_address(opts_.host, ec);
    if (ec) return make_error("--host {}: {}", opts_.host, ec.message());
    tcp::endpoint ep{addr, opts_.port};
    impl_->acceptor.open(ep.protocol(), ec);
    if (!ec) impl_->acceptor.set_option(asio::socket_base::reuse_address(true), ec);
    if (!ec) impl_->acceptor.bind(ep, ec);
    if (!ec) impl_->acceptor.listen(asio::socket_base::max_listen_connections, ec);
    if (ec) return make_error("cannot listen on {}:{}: {}", opts_.host, opts_.port, ec.message());
    port_ = impl_->acceptor.local_endpoint().port();
    adopt_orphans();  // before the first connection: a client may come back at once
    asio::co_spawn(impl_->io, FrontSession::listen(*this), asio::detached);
    loop_alive_ns_.store(shm::monotonic_ns(), std::memory_order_relaxed);
    asio::co_spawn(impl_->io, FrontSession::tick(*this), asio::detached);
    quit_.store(false, std::memory_order_relaxed);  // before the notifier thread starts (thread creation orders it)
    notifier_ = std::thread([this] { notify_loop(); });
    for (int i = 0; i < std::max(1, opts_.io_threads); ++i) threads_.emplace_back([this] { impl_->io.run(); });
    return {};
}

// Sleeps on this process's doorbell, which prefill and decode ring after writing
// tokens or changing a request's state; wakes the coroutines whose slots changed.
// Every 50 ms, sends requests stranded on a dead prefill worker's ring to a live one.
void Front::notify_loop() {
    shm::Doorbell& bell = inst_.registry().doorbell(self_.slot);
    const shm::RequestTable& t = inst_.requests();
    uint64_t next_rescue = 0;
    while (!quit_.load(std::memory_order_relaxed)) {
        shm::doorbell_wait(bell, [&] { return impl_->any_changed(t) || quit_.load(std::memory_order_relaxed); }, 64,
                           2'000'000);
        impl_->wake_changed(t);
        if (const uint64_t now = shm::monotonic_ns(); now >= next_rescue) {
            router_.resend_stranded();
            expire_orphans(now);
            sample_prefill_work();
            sample_kv();
            next_rescue = now + 50'000'000;
        }
    }
}

void Front::stop() {
    if (notifier_.joinable()) {
        quit_.store(true, std::memory_order_relaxed);  // a flag: nothing is published with it; the doorbell wakes the loop
        shm::doorbell_ring(inst_.registry().doorbell(self_.slot));
        notifier_.join();
    }
    impl_->io.stop();
    for (std::thread& t : threads_) t.join();
    threads_.clear();
}

void Front::cancel_all() {
    shm::RequestTable& t = inst_.requests();
    for (uint32_t s = 0; s < t.n_slots(); ++s) {
        shm::ReqState st = t.state(s);
        if (st == shm::ReqState::Queued || st == shm::ReqState::Prefilling || st == shm::ReqState::Decoding)
            t.cancel(t.current(s));
    }
}

bool Front::send(shm::ReqRef r) { return router_.send(r); }

// Preempted by decode (DecodeWorker::preempt: recompute or swap): back in QUEUED, ours, at an
// attempt this front has not sent. It goes to prefill again, with its output so far.
void Front::resend_if_preempted(shm::ReqRef r, uint32_t& sent_attempt) {
    shm::RequestTable& t = inst_.requests();
    if (t.current(r.slot).gen != r.gen || t.state(r.slot) != shm::ReqState::Queued ||
        t.owner_slot(r.slot) != static_cast<int32_t>(self_.slot) || t.attempt(r.slot) == sent_attempt)
        return;
    sent_attempt = t.attempt(r.slot);
    // Relaxed: written before the transition to QUEUED, whose acquire load state() made.
    if (t.slot(r.slot).n_swapped.load(std::memory_order_relaxed) > 0)
        counters_.preempted_swap.fetch_add(1, std::memory_order_relaxed);
    else
        counters_.preempted.fetch_add(1, std::memory_order_relaxed);
    (void)send(r);
}

awaitable<void> FrontSession::tick(Front& f) {
    asio::steady_timer timer(co_await asio::this_coro::executor);
    for (;;) {
        f.loop_alive_ns_.store(shm::monotonic_ns(), std::memory_order_relaxed);  // a reading for the watchdog; orders nothing
        timer.expires_after(std::chrono::milliseconds(100));
        beast::error_code ec;
        co_await timer.async_wait(asio::redirect_error(use_awaitable, ec));
        if (ec) co_return;
    }
}

awaitable<void> FrontSession::listen(Front& f) {
    for (;;) {
        beast::error_code ec;
        // Each connection on its own strand: the notifier posts to it.
        tcp::socket s = co_await f.impl_->acceptor.async_accept(asio::make_strand(f.impl_->io),
                                                                 asio::redirect_error(use_awaitable, ec));
        if (ec) {
            if (ec == asio::error::operation_aborted) co_return;
            continue;
        }
        auto ex = s.get_executor();
        asio::co_spawn(ex, serve(f, std::move(s)), asio::detached);
    }
}

awaitable<void> FrontSession::serve(Front& f, tcp::socket sock) {
    beast::tcp_stream stream(std::move(sock));
    beast::flat_buffer buf;
    for (;;) {
        // The header first: an import's body (a KV blob, up to max_blob_bytes) is
        // spooled to a file; every other body is read into memory, up to
        // max_body_bytes.
        http::request_parser<http::empty_body> head;
        const uint64_t blob_limit = f.opts_.contexts ? f.opts_.contexts->max_blob_bytes() : 0;
        head.body_limit(std::max<uint64_t>(f.opts_.max_body_bytes, blob_limit));
        stream.expires_after(std::chrono::seconds(60));  // a slow or idle client
        beast::error_code ec;
        co_await http::async_read_header(stream, buf, head, asio::redirect_error(use_awaitable, ec));
        const bool import = !ec && f.opts_.contexts && head.get().method() == http::verb::post &&
                            target_path(head.get().target()) == "/v1/contexts/import";
        const uint64_t limit = import ? blob_limit : f.opts_.max_body_bytes;
        // (A header whose Content-Length passes the parser's limit is whole: Beast
        // says body_limit right after it.)
        const bool have_head = !ec || ec == http::error::body_limit;
        if (have_head && !open_route(f, target_path(head.get().target())) &&
            !f.key_.allows(sv(head.get()[http::field::authorization]))) {
            // Refused from its header, before any limit on its body is told or the body
            // read; the connection closes (the body is not read).
            Request dummy;
            dummy.version(head.get().version());
            dummy.keep_alive(false);
            co_await unauthorized(f, stream, dummy);
            break;
        }
        if (!ec && head.content_length() && *head.content_length() > limit) ec = http::error::body_limit;
        if (ec == http::error::body_limit) {
            co_await too_large(stream, limit);
            break;
        }
        if (ec) break;  // end of stream, timeout, malformed HTTP
        // "Expect: 100-continue" (curl sends it with bodies over 1 KiB): the client
        // waits for a go-ahead before sending the body, a second without one.
        if (beast::iequals(head.get()[http::field::expect], "100-continue")) {
            http::response<http::empty_body> go{http::status::continue_, head.get().version()};
            co_await http::async_write(stream, go, asio::redirect_error(use_awaitable, ec));
            if (ec) break;
        }
        if (import) {
            const bool ok = co_await import_blob(f, stream, buf, head, limit);
            if (!ok) break;
            continue;
        }
        http::request_parser<http::string_body> parser{std::move(head)};
        parser.body_limit(limit);  // a chunked body is counted as it comes
        co_await http::async_read(stream, buf, parser, asio::redirect_error(use_awaitable, ec));
        if (ec == http::error::body_limit) {
            co_await too_large(stream, limit);
            break;
        }
        if (ec) break;
        Request req = parser.release();
        stream.expires_never();
        bool ok = co_await handle(f, stream, req);
        if (!ok || !req.keep_alive()) break;
    }
    beast::error_code ec;
    stream.socket().shutdown(tcp::socket::shutdown_send, ec);
}

// 401 in OpenAI's error JSON, with the challenge (RFC 6750).
awaitable<bool> FrontSession::unauthorized(Front& f, beast::tcp_stream& stream, const Request& req) {
    f.counters_.errors.fetch_add(1, std::memory_order_relaxed);
    ApiError e = api_error(401, "invalid_request_error",
                           "a valid API key is required: send \"Authorization: Bearer <key>\" (duet serve --api-key, "
                           "DUET_API_KEY)",
                           "", "invalid_api_key");
    auto res = make_response(http::status::unauthorized, error_json(e), req);
    res.set(http::field::www_authenticate, "Bearer");
    beast::error_code ec;
    co_await http::async_write(stream, res, asio::redirect_error(use_awaitable, ec));
    co_return !ec && req.keep_alive();
}

// 413, and the connection closes (the rest of the body is not read).
awaitable<void> FrontSession::too_large(beast::tcp_stream& stream, uint64_t limit) {
    Request dummy;
    ApiError e = api_error(413, "invalid_request_error", fmt::format("the request body is larger than {} bytes", limit));
    auto res = make_response(http::status::payload_too_large, error_json(e), dummy);
    res.keep_alive(false);
    beast::error_code ec;
    co_await http::async_write(stream, res, asio::redirect_error(use_awaitable, ec));
}

// POST /v1/contexts/import?id=...: the body (a KV blob) written to a spool file as
// it arrives, then imported on the store thread, which removes the file.
awaitable<bool> FrontSession::import_blob(Front& f, beast::tcp_stream& stream, beast::flat_buffer& buf,
                                          http::request_parser<http::empty_body>& head, uint64_t limit) {
    ContextService& svc = *f.opts_.contexts;
    const std::string spool = svc.spool_path();
    http::request_parser<http::file_body> parser{std::move(head)};
    parser.body_limit(limit);
    beast::error_code ec;
    parser.get().body().open(spool.c_str(), beast::file_mode::write, ec);
    if (ec) {
        Request dummy;
        co_await error(f, stream, dummy,
                       api_error(500, "server_error", fmt::format("{}: cannot spool the blob: {}", spool, ec.message())));
        co_return false;
    }
    co_await http::async_read(stream, buf, parser, asio::redirect_error(use_awaitable, ec));
    parser.get().body().close();
    if (ec) {
        ::unlink(spool.c_str());
        if (ec == http::error::body_limit) co_await too_large(stream, limit);
        co_return false;
    }
    stream.expires_never();
    Request req;  // the reply's version and keep-alive
    req.version(parser.get().version());
    req.keep_alive(parser.get().keep_alive());
    const std::string query = target_query(parser.get().target());
    ApiReply reply = co_await asio::co_spawn(
        f.impl_->store, [&]() -> awaitable<ApiReply> { co_return svc.import_file(query, spool); }, use_awaitable);
    if (reply.status >= 400) f.counters_.errors.fetch_add(1, std::memory_order_relaxed);
    const bool ok = co_await write_response(stream, req, status_of(reply.status), std::move(reply.body),
                                            "application/json", reply.status == 429 ? 1000 : 0);
    co_return ok && req.keep_alive();
}

// GET /v1/contexts/{id}/export: the blob written on the store thread, then sent as
// the body; its spool file is removed once open (the open file is what is sent).
awaitable<bool> FrontSession::export_blob(Front& f, beast::tcp_stream& stream, Request& req, const std::string& id) {
    ContextService& svc = *f.opts_.contexts;
    auto file = co_await asio::co_spawn(
        f.impl_->store, [&]() -> awaitable<std::variant<std::string, ApiReply>> { co_return svc.export_file(id); },
        use_awaitable);
    if (auto* e = std::get_if<ApiReply>(&file)) {
        f.counters_.errors.fetch_add(1, std::memory_order_relaxed);
        co_return co_await write_response(stream, req, status_of(e->status), std::move(e->body), "application/json",
                                          e->status == 429 ? 1000 : 0);
    }
    const std::string& path = std::get<std::string>(file);
    http::response<http::file_body> res{http::status::ok, req.version()};
    beast::error_code ec;
    res.body().open(path.c_str(), beast::file_mode::scan, ec);
    ::unlink(path.c_str());
    if (ec)
        co_return co_await error(f, stream, req,
                                 api_error(500, "server_error", fmt::format("{}: {}", path, ec.message())));
    res.set(http::field::server, "duet");
    res.set(http::field::content_type, "application/octet-stream");
    res.set(http::field::content_disposition, fmt::format("attachment; filename=\"{}.kvblob\"", id));
    res.keep_alive(req.keep_alive());
    res.prepare_payload();
    co_await http::async_write(stream, res, asio::redirect_error(use_awaitable, ec));
    co_return !ec;
}

// Liveness and readiness are open (probes carry no key); /metrics with
// --public-metrics; everything else asks for the key when there is one.
bool FrontSession::open_route(const Front& f, std::string_view path) {
    return path == "/health" || path == "/ready" || path == "/readiness" || (path == "/metrics" && f.opts_.public_metrics);
}

awaitable<bool> FrontSession::handle(Front& f, beast::tcp_stream& stream, Request& req) {
    const std::string path = target_path(req.target());
    const bool get = req.method() == http::verb::get, post = req.method() == http::verb::post;
    const std::string js = "application/json";
    if (!open_route(f, path) && !f.key_.allows(sv(req[http::field::authorization])))
        co_return co_await unauthorized(f, stream, req);
    if (post && (path == "/v1/completions" || path == "/v1/chat/completions")) {
        // A retry of a request a dead front took (the same X-Request-Id): its answer.
        if (auto id = orphan_of_xid(f, std::string(req["X-Request-Id"]))) co_return co_await resume(f, stream, req, *id, false);
        co_return co_await completion(f, stream, req, path == "/v1/chat/completions");
    }
    if (get && path.rfind("/v1/requests/", 0) == 0 && path.size() > 20 && path.compare(path.size() - 7, 7, "/events") == 0)
        co_return co_await resume(f, stream, req, path.substr(13, path.size() - 20), true);
    if (path == "/v1/contexts" || path.rfind("/v1/contexts/", 0) == 0) co_return co_await contexts(f, stream, req, path);
    if (get && path == "/health") co_return co_await write_response(stream, req, http::status::ok, std::string(R"({"status":"ok"})"), js, false);
    if (get && (path == "/ready" || path == "/readiness")) {
        // Ready while a worker of each role runs (requests are routed around one being
        // restarted).
        const bool ready = !f.draining_.load(std::memory_order_relaxed) && workers_running(f.inst_);
        // A worker that failed its golden-logits check is not restarted: say why.
        std::string why;
        if (f.inst_.registry().golden_failures() > 0)
            why = "a worker failed its golden-logits check, not restarted: " + f.inst_.registry().golden_reason();
        std::string answer = ready ? R"({"status":"ready"})" : R"({"status":"not ready"})";
        if (!why.empty()) answer = json{{"status", ready ? "ready" : "not ready"}, {"reason", why}}.dump();
        co_return co_await write_response(stream, req, ready ? http::status::ok : http::status::service_unavailable,
                                          std::move(answer), js, false);
    }
    if (get && path == "/v1/models") {
        co_return co_await write_response(stream, req, http::status::ok,
                                          models_json(f.opts_.model_id, f.inst_.config().requests.max_tokens), js,
                                          false);
    }
    if (get && path == "/metrics")
        co_return co_await write_response(stream, req, http::status::ok, metrics_text(metrics_snapshot(f)),
                                          "text/plain; version=0.0.4", false);
    if (post && (path == "/tokenize" || path == "/detokenize")) {
        auto reply = token_route(f.tok_, path, req.body());
        if (auto* e = std::get_if<ApiError>(&reply)) co_return co_await error(f, stream, req, *e);
        co_return co_await write_response(stream, req, http::status::ok, std::move(std::get<std::string>(reply)), js,
                                          false);
    }
    co_return co_await error(f, stream, req, api_error(404, "not_found_error",
                              fmt::format("no route for {} {}", std::string(req.method_string()), path), "", ""));
}

MetricsSnapshot FrontSession::metrics_snapshot(Front& f) {
    const FrontCounters& c = f.counters_;
    shm::Instance& inst = f.inst_;
    MetricsSnapshot m;
    if (f.opts_.contexts) m.contexts = &f.opts_.contexts->store().stats();
    // Relaxed: counters for display, no order among them.
    m.requests = c.requests.load(std::memory_order_relaxed);
    m.errors = c.errors.load(std::memory_order_relaxed);
    m.finished = c.finished.load(std::memory_order_relaxed);
    m.cancelled = c.cancelled.load(std::memory_order_relaxed);
    m.failed = c.failed.load(std::memory_order_relaxed);
    m.rejected_busy = c.rejected_busy.load(std::memory_order_relaxed);
    m.scheduling = true;
    m.rejected_ttft = c.rejected_ttft.load(std::memory_order_relaxed);
    m.rejected_queue = c.rejected_queue.load(std::memory_order_relaxed);
    m.rejected_kv = c.rejected_kv.load(std::memory_order_relaxed);
    m.timeouts = c.timeouts.load(std::memory_order_relaxed);
    m.preempted = c.preempted.load(std::memory_order_relaxed);
    m.preempted_swap = c.preempted_swap.load(std::memory_order_relaxed);
    m.swapped_bytes = f.inst_.requests().swapped_bytes().load(std::memory_order_relaxed);
    for (size_t k = 0; k < kSloClasses; ++k) {
        m.class_ttft[k] = &c.class_ttft[k];
        m.class_itl[k] = &c.class_itl[k];
        m.class_done[k] = c.class_done[k].load(std::memory_order_relaxed);
        m.class_met[k] = c.class_met[k].load(std::memory_order_relaxed);
    }
    {
        std::lock_guard<std::mutex> lock(f.sched_mu_);
        m.queued_tokens = f.queue_.pending;
        m.prefill_rate = f.prefill_rate_.rate() * f.prefill_workers_;
        m.prefill_rate_recent = f.prefill_rate_.recent() * f.prefill_workers_;
        m.prefill_wide_rate = f.prefill_wide_rate_.rate() * f.prefill_workers_;
        m.prefill_wide_rate_recent = f.prefill_wide_rate_.recent() * f.prefill_workers_;
    }
    m.tokens = c.tokens.load(std::memory_order_relaxed);
    m.prompt_tokens = c.prompt_tokens.load(std::memory_order_relaxed);
    m.worker_restarts = inst.requests().worker_restarts().load(std::memory_order_relaxed);
    m.role_changes_to_prefill = inst.requests().role_changes(false).load(std::memory_order_relaxed);
    m.role_changes_to_decode = inst.requests().role_changes(true).load(std::memory_order_relaxed);
    m.passes_interrupted = inst.requests().passes_interrupted().load(std::memory_order_relaxed);
    m.drafted = inst.requests().drafted().load(std::memory_order_relaxed);
    m.drafts_accepted = inst.requests().drafts_accepted().load(std::memory_order_relaxed);
    m.redriven = inst.requests().redriven().load(std::memory_order_relaxed);
    m.golden_failures = inst.registry().golden_failures();
    m.in_flight = f.in_flight();
    for (size_t k = 0; k < inst.n_arenas(); ++k) {  // every arena (one per GPU on a GPU instance)
        const shm::ArenaCensus one = inst.arena(k).census();
        m.arenas.push_back({one.free, one.cached, one.held});
    }
    const auto dtype = kv_dtype_from(inst.config().kv_dtype);
    m.kv_dtype = dtype ? kv_dtype_name(*dtype) : "unknown";
    m.block_tokens = inst.config().requests.block_tokens;
    const ServeRings rings = ServeRings::of(inst.config());
    shm::Registry& reg = inst.registry();
    auto worker = [&](shm::Role role, uint32_t i, uint64_t queued) {
        MetricsSnapshot::Worker w;
        w.queued = queued;
        // Up while a process works for it (running, or leaving its role: it still
        // finishes what it holds); an index the launcher has no worker at is left out.
        const int32_t s = reg.find_working(role, static_cast<int32_t>(i));
        w.spare = s < 0 && queued == 0 && !reg.assigned(role, i);
        if (s >= 0) {
            const shm::ProcSlot& ps = reg.slot(static_cast<uint32_t>(s));
            w.up = true;
            w.items = ps.load_items.load(std::memory_order_relaxed);
            w.tokens = ps.load_tokens.load(std::memory_order_relaxed);
            w.served = ps.served.load(std::memory_order_relaxed);
            w.borrows = ps.borrows.load(std::memory_order_relaxed);
            w.borrowed_ns = ps.borrowed_ns.load(std::memory_order_relaxed);
            w.yields = ps.yields.load(std::memory_order_relaxed);
            w.yielded_ns = ps.yielded_ns.load(std::memory_order_relaxed);
            w.claims_declined = ps.claims_declined.load(std::memory_order_relaxed);
            w.claims_unanswered = ps.claims_unanswered.load(std::memory_order_relaxed);
        }
        return w;
    };
    const std::vector<uint64_t> routed = f.router_.sent_counts();
    for (uint32_t p = 0; p < rings.n_prefill; ++p) {
        m.prefill.push_back(worker(shm::Role::Prefill, p, queued_for_prefill(inst, p)));
        m.prefill.back().routed = p < routed.size() ? routed[p] : 0;
    }
    for (uint32_t d = 0; d < rings.n_decode; ++d) m.decode.push_back(worker(shm::Role::Decode, d, queued_for_decode(inst, d)));
    m.ttft = &c.ttft, m.itl = &c.itl, m.e2e = &c.e2e;
    m.queue = &c.queue, m.prefill_time = &c.prefill, m.handoff = &c.handoff;
    m.admit = &c.admit, m.stream_event = &c.stream_event;
    return m;
}

// /v1/contexts routes: on the store thread (ContextService blocks), then back here
// to write the reply.
awaitable<bool> FrontSession::contexts(Front& f, beast::tcp_stream& stream, Request& req, const std::string& path) {
    if (!f.opts_.contexts)
        co_return co_await error(f, stream, req,
                                 api_error(404, "not_found_error",
                                           "contexts are off on this server (duet serve --contexts-dir DIR)", "", ""));
    auto ends = [&](const std::string& tail) {
        return path.size() > 13 + tail.size() && path.compare(path.size() - tail.size(), tail.size(), tail) == 0;
    };
    const std::string completions = "/completions", exported = "/export";
    if (req.method() == http::verb::post && ends(completions))
        co_return co_await completion(f, stream, req, false, path.substr(13, path.size() - 13 - completions.size()));
    if (req.method() == http::verb::get && ends(exported))
        co_return co_await export_blob(f, stream, req, path.substr(13, path.size() - 13 - exported.size()));
    const std::string query = target_query(req.target());
    const std::string method(req.method_string());
    ContextService& svc = *f.opts_.contexts;
    ApiReply reply = co_await asio::co_spawn(
        f.impl_->store,
        [&]() -> awaitable<ApiReply> { co_return svc.handle(method, path, query, req.body()); }, use_awaitable);
    if (reply.status >= 400) f.counters_.errors.fetch_add(1, std::memory_order_relaxed);
    co_return co_await write_response(stream, req, status_of(reply.status), std::move(reply.body), "application/json",
                                      reply.status == 429 ? 1000 : 0);
}

// A FINISHED return_kv request's table names exactly the blocks its worker moved to
// its client (decode_worker.cpp, DecodeWorker::finish), positions [0, prompt + output - 1):
// ours when the slot's kv_to names us. (An adopted request's worker may have moved
// them to the dead front, whose recovery drops them: the commit then computes the
// added tokens again.)
void FrontSession::take_returned_kv(Front& f, Completion& c) {
    const shm::RequestTable& t = f.inst_.requests();
    const uint32_t slot = c.ch[0].ref.slot;
    // Relaxed: written before the transition to FINISHED, whose acquire load we made.
    if (t.slot(slot).kv_to.load(std::memory_order_relaxed) != f.self_.pack()) return;
    // Acquire pairs with the worker's release of n_blocks (and the state we saw).
    const uint32_t nb = t.slot(slot).n_blocks.load(std::memory_order_acquire);
    c.returned.svc = f.opts_.contexts;
    c.returned.blocks.assign(t.blocks(slot), t.blocks(slot) + nb);
    c.returned.valid = static_cast<int64_t>(c.prompt.size() + c.ch[0].out.size()) - 1;
}

// A context completion's prompt and output join the context (on the store thread).
awaitable<std::optional<ApiError>> FrontSession::commit_context(Front& f, Completion& c) {
    std::vector<int32_t> added(c.prompt.begin() + static_cast<std::ptrdiff_t>(c.context_len), c.prompt.end());
    added.insert(added.end(), c.ch[0].out.begin(), c.ch[0].out.end());
    ContextService& svc = *f.opts_.contexts;
    if (c.chat) {
        // The reply ends as the template ends an assistant message, so the next turn's
        // messages follow it as in a whole render of the conversation.
        auto close = svc.turns().close_reply(c.ch[0].out);
        if (!close) co_return api_error(500, "server_error", close.error().message, "", "");
        added.insert(added.end(), close->begin(), close->end());
    }
    // The returned blocks go to the context (or are dropped by the commit).
    std::vector<int32_t> kv = std::exchange(c.returned.blocks, {});
    const int64_t kv_valid = c.returned.valid;
    ApiReply reply = co_await asio::co_spawn(
        f.impl_->store,
        [&]() -> awaitable<ApiReply> {
            co_return svc.commit(c.context, c.context_len, added, std::move(kv), kv_valid, !c.resumed_id.empty());
        },
        use_awaitable);
    if (reply.status < 400) co_return std::nullopt;
    auto j = nlohmann::json::parse(reply.body, nullptr, false);
    std::string msg = j.is_object() && j.contains("error") ? j["error"].value("message", reply.body) : reply.body;
    co_return api_error(reply.status, "server_error", "the completion was not added to the context: " + msg, "", "");
}

awaitable<bool> FrontSession::completion(Front& f, beast::tcp_stream& stream, Request& req, bool chat,
                                         std::string context) {
    Completion c;
    c.chat = chat;
    c.arrived = shm::monotonic_ns();
    c.context = std::move(context);
    c.xid = std::string(req["X-Request-Id"]);
    if (c.xid.size() > 200)
        co_return co_await error(f, stream, req,
                                 api_error(400, "invalid_request_error", "X-Request-Id: at most 200 characters", "", ""));
    // The contexts API's own fields, taken out of the body before the OpenAI parse:
    // "context" (chat completions; the openai client's extra_body) names the context
    // the messages join, "commit" says whether the completion joins it. (A plain
    // completion has neither: its body is parsed once, by parse.)
    nlohmann::json body;
    if (chat || !c.context.empty()) body = nlohmann::json::parse(req.body(), nullptr, false);
    bool edited = false;
    if (chat && body.is_object() && body.contains("context") && !body["context"].is_null()) {
        if (!body["context"].is_string() || body["context"].get<std::string>().empty())
            co_return co_await error(f, stream, req,
                                     api_error(400, "invalid_request_error", "context: a context's id", "context"));
        if (!f.opts_.contexts)
            co_return co_await error(f, stream, req,
                                     api_error(404, "not_found_error",
                                               "contexts are off on this server (duet serve --contexts-dir DIR)",
                                               "context"));
        c.context = body["context"].get<std::string>();
        body.erase("context");
        edited = true;
    }
    if (!c.context.empty()) {
        if (body.is_object() && body.contains("commit")) {
            if (!body["commit"].is_boolean())
                co_return co_await error(f, stream, req,
                                         api_error(400, "invalid_request_error", "commit: a boolean", "commit", ""));
            c.commit = body["commit"].get<bool>();
            body.erase("commit");
            edited = true;
        }
        ContextService& svc = *f.opts_.contexts;
        auto kv = co_await asio::co_spawn(
            f.impl_->store, [&]() -> awaitable<std::variant<ContextKv, ApiReply>> { co_return svc.lease(c.context); },
            use_awaitable);
        if (auto* e = std::get_if<ApiReply>(&kv))
            co_return co_await write_response(stream, req, status_of(e->status), std::move(e->body),
                                              "application/json", false);
        ContextKv& got = std::get<ContextKv>(kv);
        c.lease.svc = &svc;
        c.lease.blocks = std::move(got.blocks);
        c.lease.valid = got.valid;
        c.context_tokens = std::move(got.tokens);
        c.context_len = c.context_tokens.size();
        // No prompt: the completion continues the context itself. The OpenAI parse
        // wants a prompt: the context's last token is moved into it.
        const bool no_prompt = !chat && body.is_object() && (!body.contains("prompt") || body["prompt"] == "" ||
                                                    (body["prompt"].is_array() && body["prompt"].empty()));
        if (no_prompt && !c.context_tokens.empty()) {
            body["prompt"] = nlohmann::json::array({c.context_tokens.back()});
            c.context_tokens.pop_back();
            edited = true;
        }
    }
    if (edited) req.body() = body.dump();
    if (auto e = parse(f, req, c)) co_return co_await error(f, stream, req, *e);
    // Its class: the body's "priority", else the X-Duet-Priority header, else standard.
    if (c.r.priority) {
        c.cls = *c.r.priority;
    } else if (const auto h = req["X-Duet-Priority"]; !h.empty()) {
        auto cls = parse_priority(std::string_view(h.data(), h.size()));
        if (!cls) co_return co_await error(f, stream, req, api_error(400, "invalid_request_error",
                                                                     "X-Duet-Priority: " + cls.error().message, "", ""));
        c.cls = *cls;
    }
    if (!c.context.empty() && c.r.n != 1)
        co_return co_await error(f, stream, req,
                                 api_error(400, "invalid_request_error", "n: a context completion has one choice", "n", ""));
    if (!c.context.empty() && (c.r.best_of > 1 || c.r.echo))
        co_return co_await error(
            f, stream, req,
            api_error(400, "invalid_request_error",
                      fmt::format("{}: not for a context completion", c.r.echo ? "echo" : "best_of"),
                      c.r.echo ? "echo" : "best_of", ""));
    c.keep = c.r.n;
    c.r.n = std::max(c.r.n, c.r.best_of);  // best_of's candidates, each a choice
    if (auto e = tokenize_prompt(f, c)) co_return co_await error(f, stream, req, *e);
    if (c.r.echo) c.echo = c.r.prompt_ids.empty() ? c.r.prompt : f.tok_.decode(c.prompt, false);
    if (!c.context_tokens.empty()) c.prompt.insert(c.prompt.begin(), c.context_tokens.begin(), c.context_tokens.end());
    auto params = request_params_of(f, c);
    if (auto* e = std::get_if<ApiError>(&params)) co_return co_await error(f, stream, req, *e);
    if (f.opts_.contexts) {
        // Idle contexts never make a request fail for KV: they give way first (their
        // KV is on disk), as many as this request's choices may take at most.
        const auto bt = static_cast<uint64_t>(f.inst_.config().requests.block_tokens);
        const uint64_t tokens = c.prompt.size() + std::get<RequestParams>(params).max_tokens;
        const uint64_t need = (tokens + bt - 1) / bt * static_cast<uint64_t>(c.r.n);
        ContextService& svc = *f.opts_.contexts;
        if (!svc.has_room(need))
            co_await asio::co_spawn(
                f.impl_->store, [&]() -> awaitable<void> { svc.make_room(need, c.context); co_return; },
                use_awaitable);
    }
    c.id = request_id();
    c.created = static_cast<int64_t>(time(nullptr));
    if (auto e = admit(f, c, std::get<RequestParams>(params))) co_return co_await error(f, stream, req, *e);
    if (c.r.stream) co_await write_stream_head(stream, req, c);
    co_await follow(f, stream, c);
    co_return co_await end_completion(f, stream, req, c);
}

// Once every choice has ended (follow): a context completion's KV taken back and its
// tokens committed, then the reply. True: the connection may serve another request.
awaitable<bool> FrontSession::end_completion(Front& f, beast::tcp_stream& stream, Request& req, Completion& c) {
    if (c.detached) co_return false;  // an orphan now (detach): expire_orphans or a resume ends it
    if (c.return_kv && c.ch[0].final_state == shm::ReqState::Finished) take_returned_kv(f, c);
    // finish frees the request's slots before the commit: the commit computes the
    // closing tokens through a request of its own, and with every slot held by
    // completions waiting for the store thread a commit holding its own would find
    // none (and wait on them while they wait on it). The price: a front that dies
    // during the commit leaves nothing to resume; its client's stream ends without
    // [DONE] and the context holds the completion or not (the commit is one durable
    // step).
    Outcome o = finish(f, c);
    std::optional<ApiError> commit_error;
    if (!c.context.empty() && c.commit && !o.failed && !c.client_gone)
        commit_error = co_await commit_context(f, c);  // before the reply ends: acknowledged means durable
    if (!c.resumed_id.empty()) f.forget_orphan(c.resumed_id);
    if (commit_error) {
        if (!c.r.stream) co_return co_await error(f, stream, req, *commit_error);
        co_await write_event(stream, error_json(*commit_error));
        co_return false;
    }
    co_return co_await reply(f, stream, req, c, o);
}

// The request body, and the model it names.
std::optional<ApiError> FrontSession::parse(Front& f, const Request& req, Completion& c) {
    if (f.draining_.load(std::memory_order_relaxed)) return api_error(503, "server_error", "the server is shutting down", "", "");
    auto parsed = parse_completion(req.body(), c.chat);
    if (auto* e = std::get_if<ApiError>(&parsed)) return *e;
    c.r = std::move(std::get<CompletionRequest>(parsed));
    if (!c.r.model.empty() && c.r.model != f.opts_.model_id)
        return api_error(404, "invalid_request_error",
                         fmt::format("the model '{}' does not exist; this server has '{}'", c.r.model, f.opts_.model_id),
                         "model", "model_not_found");
    return std::nullopt;
}

// The prompt's tokens: the chat template's text, token ids as given, or the text.
std::optional<ApiError> FrontSession::tokenize_prompt(Front& f, Completion& c) {
    CompletionRequest& r = c.r;
    if (c.chat && !c.context.empty()) {
        // The messages added to the context's conversation, the assistant's turn opened.
        auto ids = f.opts_.contexts->turns().extend(c.context_len, r.messages, true);
        if (!ids) return api_error(400, "invalid_request_error", ids.error().message, "messages", "");
        c.prompt = std::move(ids).value();
    } else if (c.chat) {
        auto text = f.tmpl_.apply(r.messages, true);
        if (!text) return api_error(400, "invalid_request_error", text.error().message, "messages", "");
        c.prompt = f.tok_.encode(*text, !f.tmpl_.includes_bos(), true);
    } else if (!r.prompt_ids.empty()) {
        for (int32_t id : r.prompt_ids)
            if (id >= f.tok_.n_vocab())
                return api_error(400, "invalid_request_error",
                                 fmt::format("token id {} is outside the vocabulary [0, {})", id, f.tok_.n_vocab()),
                                 "prompt", "");
        c.prompt = std::move(r.prompt_ids);
    } else {
        c.prompt = f.tok_.encode(r.prompt, true, false);
    }
    return std::nullopt;
}

// What the workers read from each choice's slot; the prompt and max_tokens must fit
// the context.
std::variant<RequestParams, ApiError> FrontSession::request_params_of(Front& f, const Completion& c) {
    const CompletionRequest& r = c.r;
    const int64_t n_ctx = f.inst_.config().requests.max_tokens;
    const int64_t room = n_ctx - static_cast<int64_t>(c.prompt.size());
    if (room < 1)
        return api_error(400, "invalid_request_error",
                         fmt::format("the prompt has {} tokens; this model's context is {} tokens", c.prompt.size(), n_ctx),
                         c.chat ? "messages" : "prompt", "context_length_exceeded");
    if (r.max_tokens > room)
        return api_error(400, "invalid_request_error",
                         fmt::format("the prompt ({} tokens) plus max_tokens ({}) exceed the context of {} tokens",
                                     c.prompt.size(), r.max_tokens, n_ctx),
                         "max_tokens", "context_length_exceeded");
    RequestParams params;
    params.sampling = r.sampling;
    params.max_tokens = static_cast<uint32_t>(r.max_tokens < 0 ? room : r.max_tokens);
    params.stop_at_eog = r.ignore_eos ? 0 : 1;
    params.min_tokens = static_cast<uint32_t>(r.min_tokens);
    static_assert(kMaxLogitBias == RequestParams::kMaxLogitBias);
    for (const auto& [id, bias] : r.logit_bias) {
        if (id >= f.tok_.n_vocab())
            return api_error(
                400, "invalid_request_error",
                fmt::format("logit_bias: token id {} is outside the vocabulary [0, {})", id, f.tok_.n_vocab()),
                "logit_bias", "");
        params.bias[params.n_bias++] = RequestParams::Bias{id, bias};
    }
    params.logprobs = c.ranked() ? std::max(r.logprobs, 0) : r.logprobs;  // best_of ranks by them
    return params;
}

// One request per choice; choice i samples with its own seed, so choices differ
// unless decoding is greedy. Sent after all are in: the later ones then find the
// first one's prompt blocks in the prefix cache (prefill waits for them).
std::optional<ApiError> FrontSession::admit(Front& f, Completion& c, RequestParams params) {
    shm::RequestTable& t = f.inst_.requests();
    // Admission (engine/scheduling.h A1/A2), before any slot or KV is taken. The work
    // is what prefill will compute: each choice's prompt (the n choices share cached
    // blocks, but each is its own request), less a context's offered KV.
    const auto given = static_cast<int64_t>(c.lease.blocks.empty() ? 0 : std::min<int64_t>(c.lease.valid, static_cast<int64_t>(c.prompt.size())));
    const auto prompt_tokens = (static_cast<int64_t>(c.prompt.size()) - given) * std::max(1, c.r.n);
    const AdmissionDecision d =
        f.admit_tokens(c.cls, prompt_tokens, static_cast<int64_t>(c.prompt.size()),
                       RetryMemory::key(c.cls, c.prompt.data(), c.prompt.size()), c.queue_at);
    if (!d.admit) {
        (d.reason == "queue" ? f.counters_.rejected_queue
         : d.reason == "kv"  ? f.counters_.rejected_kv
                             : f.counters_.rejected_ttft)
            .fetch_add(1, std::memory_order_relaxed);
        std::string msg = d.reason == "queue"
                              ? fmt::format("the server's prefill queue is full ({} class); retry in {} ms",
                                            slo_class_name(c.cls), d.retry_after_ms)
                          : d.reason == "kv"
                              ? fmt::format("the server's KV cache is full ({} class: critical requests only until "
                                            "running ones end); retry in {} ms",
                                            slo_class_name(c.cls), d.retry_after_ms)
                              : fmt::format("a first token within the {} class's {} ms is not possible now "
                                            "(predicted {} ms); retry in {} ms",
                                            slo_class_name(c.cls), f.opts_.admission.slo.of(c.cls).ttft_ns / 1000000,
                                            d.predicted_ttft_ns / 1000000, d.retry_after_ms);
        ApiError e = api_error(429, "rate_limit_error", msg, "",
                               d.reason == "queue" ? "queue_full" : d.reason == "kv" ? "kv_full" : "slo_unreachable");
        e.retry_after_ms = d.retry_after_ms;
        return e;
    }
    c.queued = prompt_tokens;
    params.slo_class = static_cast<uint32_t>(c.cls);
    params.ttft_target_ns = f.opts_.admission.slo.of(c.cls).ttft_ns;
    params.itl_target_ns = f.opts_.admission.slo.of(c.cls).itl_ns;
    c.ch = std::vector<Choice>(static_cast<size_t>(c.r.n), Choice(f.tok_, c.r.stop));
    // A context completion: prefill starts from the context's leased blocks.
    const bool offer = !c.lease.blocks.empty() && c.ch.size() == 1;
    if (offer) {
        params.given_tokens = static_cast<uint32_t>(std::min<int64_t>(c.lease.valid, c.prompt.size()));
        params.given_by = f.self_.pack();
    }
    // Its KV comes back to join the context (one shared arena: the context's).
    c.return_kv = !c.context.empty() && c.commit && c.ch.size() == 1 && !f.inst_.config().kv_split;
    params.return_kv = c.return_kv ? 1 : 0;
    // Computed where the context's blocks are (offered from there, returned there).
    if (!c.context.empty()) params.bind_arena(kContextArena);
    for (size_t i = 0; i < c.ch.size(); ++i) {
        params.sampling.seed = c.r.sampling.seed + 0x9E3779B97F4A7C15ull * i;
        auto sub = t.submit(f.self_, c.prompt.data(), static_cast<uint32_t>(c.prompt.size()), &params, sizeof params);
        // A failed offer leaves the table empty: prefill then looks the prefix up.
        if (sub && offer)
            (void)t.offer_blocks(*sub, c.lease.blocks.data(), static_cast<uint32_t>(c.lease.blocks.size()));
        if (!sub) {
            for (size_t k = 0; k < i; ++k) {  // not sent yet: nobody else knows them
                t.transition(c.ch[k].ref, shm::ReqState::Queued, shm::ReqState::Cancelled);
                t.transition(c.ch[k].ref, shm::ReqState::Cancelled, shm::ReqState::Free);
            }
            f.counters_.rejected_busy.fetch_add(1, std::memory_order_relaxed);
            f.queue_left(c.cls, std::exchange(c.queued, 0), c.queue_at);
            return api_error(429, "rate_limit_error", "the server is at capacity; retry shortly", "", "");
        }
        c.ch[i].ref = *sub;
        c.ch[i].attempt = t.attempt(sub->slot);
    }
    // Resumable after a front restart (a context's completion too: the front that
    // resumes it commits it): the record goes in before any worker sees the request.
    const std::string rec = front_record_json(c);
    for (const Choice& ch : c.ch) (void)t.set_front_data(ch.ref, rec.data(), static_cast<uint32_t>(rec.size()));
    f.counters_.requests.fetch_add(1, std::memory_order_relaxed);
    f.counters_.prompt_tokens.fetch_add(c.prompt.size() * c.ch.size(), std::memory_order_relaxed);
    f.in_flight_.fetch_add(1, std::memory_order_relaxed);  // a count for the drain and /metrics; orders nothing
    for (const Choice& ch : c.ch) f.send(ch.ref);
    f.counters_.admit.observe(seconds_between(c.arrived, shm::monotonic_ns()));
    return std::nullopt;
}

// Until every choice has ended: reads each one's new tokens, streams them if asked,
// and sleeps until a slot changes.
awaitable<void> FrontSession::follow(Front& f, beast::tcp_stream& stream, Completion& c) {
    // The request's own "timeout", else the server's; from its arrival.
    c.deadline = c.arrived + (c.r.timeout_s > 0 ? static_cast<uint64_t>(c.r.timeout_s * 1e9)
                                                 : static_cast<uint64_t>(f.opts_.request_timeout_s) * 1000000000ull);
    auto timer = std::make_shared<asio::steady_timer>(stream.get_executor());
    for (;;) {
        bool all_done = true;
        for (size_t ci = 0; ci < c.ch.size(); ++ci) {
            Choice& ch = c.ch[ci];
            if (ch.done) continue;
            const ChoiceStep step = read_choice(f, c, ch);
            if (c.r.stream && !c.client_gone) co_await stream_choice(f, stream, c, ci, step);
            if (c.client_gone && !step.terminal && detach(f, c)) co_return;  // its client may come back
            if (!settle_choice(f, c, ch, step)) all_done = false;
        }
        if (all_done) break;
        co_await wait_for_change(f, c, timer);
    }
}

// The choice's state and new tokens: latency histograms, log-probs, and its text
// with the stop strings applied (a stop string cancels the request).
ChoiceStep FrontSession::read_choice(Front& f, Completion& c, Choice& ch) {
    shm::RequestTable& t = f.inst_.requests();
    ChoiceStep step;
    step.st = t.state(ch.ref.slot);
    ch.seen_state = step.st;
    step.terminal = step.st == shm::ReqState::Finished || step.st == shm::ReqState::Failed ||
                    step.st == shm::ReqState::Cancelled;
    f.resend_if_preempted(ch.ref, ch.attempt);
    const size_t before = ch.out.size();
    if (auto n = t.read_output(ch.ref, ch.have, ch.out)) ch.have = *n;
    if (ch.out.size() > ch.kept) ch.out.resize(ch.kept);
    step.seen_ns = shm::monotonic_ns();
    if (ch.out.size() > before) {
        if (ch.last_token_ns == 0) {
            f.counters_.ttft.observe(seconds_between(c.arrived, step.seen_ns));
            if (c.first_ns == 0) {
                c.first_ns = step.seen_ns;
                f.counters_.class_ttft[static_cast<size_t>(c.cls)].observe(seconds_between(c.arrived, step.seen_ns));
            }
            if (c.queued > 0)  // prefill is done with the prompt: it leaves the queue
                f.queue_left(c.cls, std::exchange(c.queued, 0), c.queue_at);
        } else {  // several tokens at once share the gap
            const double gap = seconds_between(ch.last_token_ns, step.seen_ns) / static_cast<double>(ch.out.size() - before);
            for (size_t i = before; i < ch.out.size(); ++i) {
                f.counters_.itl.observe(gap);
                f.counters_.class_itl[static_cast<size_t>(c.cls)].observe(gap);
            }
            // A3's time per token: an average over recent gaps (a racy update loses
            // one gap at most).
            const double was = f.itl_s_.load(std::memory_order_relaxed);
            f.itl_s_.store(was > 0 ? 0.95 * was + 0.05 * gap : gap, std::memory_order_relaxed);
            c.gap_sum += gap * static_cast<double>(ch.out.size() - before);
            c.gaps += static_cast<int64_t>(ch.out.size() - before);
        }
        ch.last_token_ns = step.seen_ns;
        if (c.r.logprobs >= 0 || c.ranked())
            read_logprobs(t, f.tok_, ch, std::max(c.r.logprobs, 0), before, ch.out.size());
    }
    if (ch.feed(before, step.terminal)) {
        ch.finish = finish_reason(Finish::StopString);
        if (!step.terminal) ch.cancel(t);
    }
    return step;
}

// Streams what choice ci may release now (its first event even if empty).
awaitable<void> FrontSession::stream_choice(Front& f, beast::tcp_stream& stream, Completion& c, size_t ci,
                                            const ChoiceStep& step) {
    Choice& ch = c.ch[ci];
    std::string piece = ch.stream.take(step.terminal);
    if (piece.empty() && !ch.first) co_return;
    if (ch.first) piece.insert(0, c.echo);
    ch.sent_have = ch.have;
    if (!co_await write_event(stream, chunk_json(c.r, c.id, c.created, f.opts_.model_id, static_cast<int>(ci), piece, "",
                                                 ch.first, ch.unsent()),
                              c.event_id()))
        c.client_gone = true;
    ch.lps_sent = ch.lps.size();
    ch.first = false;
    f.counters_.stream_event.observe(seconds_between(step.seen_ns, shm::monotonic_ns()));
}

// Cancels the choice if its client left or its time ran out, and marks it done once
// it has ended (a failed one stops the others: the response is an error). Returns
// whether it is done.
bool FrontSession::settle_choice(Front& f, Completion& c, Choice& ch, const ChoiceStep& step) {
    shm::RequestTable& t = f.inst_.requests();
    if (c.client_gone && !step.terminal) ch.cancel(t);
    if (!step.terminal) {
        if (shm::monotonic_ns() > c.deadline) {
            c.timed_out = true;
            ch.cancel(t);
        }
        return false;
    }
    ch.done = true;
    ch.final_state = step.st;
    if (step.st == shm::ReqState::Failed)
        for (const Choice& o : c.ch)
            if (!o.done) o.cancel(t);
    return true;
}

// Sleeps until the notifier sees a slot change (or 20 ms pass: deadlines,
// recoveries). Re-checked after registering, so no change is missed.
awaitable<void> FrontSession::wait_for_change(Front& f, Completion& c, const std::shared_ptr<asio::steady_timer>& timer) {
    const shm::RequestTable& t = f.inst_.requests();
    std::vector<std::shared_ptr<Waiter>> waiting;
    bool changed = false;
    for (const Choice& ch : c.ch)
        if (!ch.done) {
            waiting.push_back(std::make_shared<Waiter>(Waiter{ch.ref.slot, ch.have, ch.seen_state, timer}));
            f.impl_->add(waiting.back());
            changed = changed || Front::Impl::changed(t, *waiting.back());
        }
    if (!changed) {
        timer->expires_after(std::chrono::milliseconds(20));
        beast::error_code ec;
        co_await timer->async_wait(asio::redirect_error(use_awaitable, ec));
    }
    for (const auto& w : waiting) f.impl_->remove(w);
}

// Every choice has ended: the phase histograms, finish reasons, usage and the
// counters; the slots go back to FREE.
Outcome FrontSession::finish(Front& f, Completion& c) {
    shm::RequestTable& t = f.inst_.requests();
    Outcome o;
    o.u = Usage{static_cast<int64_t>(c.prompt.size()), 0, 0};
    for (Choice& ch : c.ch) {
        const shm::ReqSlot& s = t.slot(ch.ref.slot);
        const uint64_t q = s.prefill_ns.load(std::memory_order_relaxed), h = s.handoff_ns.load(std::memory_order_relaxed),
                       d = s.first_step_ns.load(std::memory_order_relaxed);
        f.counters_.e2e.observe(seconds_between(c.arrived, shm::monotonic_ns()));
        if (q >= s.submit_ns && q != 0) f.counters_.queue.observe(seconds_between(s.submit_ns, q));
        if (h >= q && q != 0 && h != 0) f.counters_.prefill.observe(seconds_between(q, h));
        if (d >= h && h != 0 && d != 0) f.counters_.handoff.observe(seconds_between(h, d));
        o.u.cached_tokens += s.n_cached.load(std::memory_order_relaxed);
        if (ch.finish.empty() && ch.final_state == shm::ReqState::Cancelled && c.timed_out) {
            ch.finish = finish_reason(Finish::Timeout);  // duet's extension: ended by its "timeout"
            f.counters_.timeouts.fetch_add(1, std::memory_order_relaxed);
        }
        if (ch.finish.empty()) {
            // As the worker that chose its last token says (engine/token_step.h); one
            // that ended without choosing (a slot past its room) was cut: "length".
            const auto said = static_cast<Finish>(s.end_code.load(std::memory_order_relaxed));
            if (ch.final_state == shm::ReqState::Finished)
                ch.finish = finish_reason(said == Finish::None ? Finish::Length : said);
            else if (ch.final_state == shm::ReqState::Cancelled)  // duet's extension: ended by someone else (a
                ch.finish = finish_reason(Finish::Cancelled);     // stop string or the timeout say so)
        }
        o.u.completion_tokens += static_cast<int64_t>(ch.out.size());
        f.counters_.tokens.fetch_add(ch.out.size(), std::memory_order_relaxed);
        if (ch.final_state == shm::ReqState::Failed) {
            o.failed = true;
            o.error_code = t.slot(ch.ref.slot).error_code.load(std::memory_order_relaxed);
        }
        t.transition(ch.ref, ch.final_state, shm::ReqState::Free);
        // A stream's closing chunk still sends the logprobs not streamed yet (unsent):
        // keep them; a whole reply takes them.
        o.texts.push_back(
            {(c.r.stream ? "" : c.echo) + ch.stream.text(), ch.finish, c.r.stream ? ch.lps : std::move(ch.lps)});
    }
    if (c.ranked()) keep_best(o.texts, static_cast<size_t>(c.keep));
    o.u.cached_tokens = std::min<int64_t>(o.u.cached_tokens, o.u.prompt_tokens);  // one prompt, however many choices
    if (o.failed) f.counters_.failed.fetch_add(1, std::memory_order_relaxed);
    else if (c.ch[0].final_state == shm::ReqState::Cancelled) f.counters_.cancelled.fetch_add(1, std::memory_order_relaxed);
    else f.counters_.finished.fetch_add(1, std::memory_order_relaxed);
    // Ended without a first token: its prompt leaves the queue unmeasured.
    if (c.queued > 0) f.queue_left(c.cls, std::exchange(c.queued, 0), c.queue_at);
    // SLO attainment: a completion that ended without failing meets its class's
    // targets when its first token came within the TTFT target and its tokens, on
    // average, within the ITL target.
    if (!o.failed && c.first_ns != 0) {
        const size_t k = static_cast<size_t>(c.cls);
        const SloTarget& target = f.opts_.admission.slo.of(c.cls);
        const bool met = c.first_ns - c.arrived <= target.ttft_ns &&
                         (c.gaps == 0 || c.gap_sum / static_cast<double>(c.gaps) <= static_cast<double>(target.itl_ns) / 1e9);
        f.counters_.class_done[k].fetch_add(1, std::memory_order_relaxed);
        if (met) f.counters_.class_met[k].fetch_add(1, std::memory_order_relaxed);
    }
    f.in_flight_.fetch_sub(1, std::memory_order_relaxed);
    return o;
}

// A completion's answer once every choice has ended: the stream's last events, or
// the whole response (or its error).
awaitable<bool> FrontSession::reply(Front& f, beast::tcp_stream& stream, const Request& req, Completion& c,
                                    const Outcome& o) {
    if (c.r.stream) co_return co_await reply_stream(f, stream, c, o);
    if (o.failed) co_return co_await error(f, stream, req, failure(o.error_code));
    auto res = make_response(http::status::ok, completion_json(c.r, c.id, c.created, f.opts_.model_id, o.texts, o.u), req);
    beast::error_code ec;
    co_await http::async_write(stream, res, asio::redirect_error(use_awaitable, ec));
    co_return !ec;
}

// The stream's last events: each choice's rest and finish reason (or the error),
// usage if asked, [DONE], and the last chunk.
awaitable<bool> FrontSession::reply_stream(Front& f, beast::tcp_stream& stream, Completion& c, const Outcome& o) {
    if (c.client_gone) co_return false;
    bool ok = true;
    if (o.failed) {
        ok = co_await write_event(stream, error_json(failure(o.error_code)));
    } else {
        for (Choice& ch : c.ch) ch.sent_have = ch.have;
        for (size_t ci = 0; ok && ci < c.ch.size(); ++ci)
            ok = co_await write_event(stream,
                                      chunk_json(c.r, c.id, c.created, f.opts_.model_id, static_cast<int>(ci),
                                                 c.ch[ci].stream.take(true), c.ch[ci].finish, false, c.ch[ci].unsent()),
                                      c.event_id());
        if (ok && c.r.include_usage)
            ok = co_await write_event(stream, usage_chunk_json(c.r, c.id, c.created, f.opts_.model_id, o.u));
    }
    if (ok) ok = co_await write_event(stream, "[DONE]");
    if (!ok) co_return false;
    beast::error_code ec;
    co_await asio::async_write(stream, http::make_chunk_last(), asio::redirect_error(use_awaitable, ec));
    co_return !ec;
}

// A stream whose client disconnected before it ended: instead of cancelling it, this
// front keeps it as an orphan of its own for --resume-grace, so that a client that
// comes back (Last-Event-ID) gets the rest exactly as if the front had died: an SSE
// client reconnects after any lost connection and cannot tell which side dropped it,
// and a front SIGKILLed just after the client closed would otherwise have cancelled
// the request first (then its resume was cut short, or answered 404). False: not
// resumable (no grace, no front record, or not a stream); the caller cancels it.
bool FrontSession::detach(Front& f, Completion& c) {
    // A context completion is not kept: its commit belongs to the connection that asked.
    if (!c.r.stream || f.opts_.resume_grace_ns == 0 || c.ch.empty() || !c.context.empty()) return false;
    shm::RequestTable& t = f.inst_.requests();
    auto rec = t.front_data(c.ch[0].ref);
    if (!rec) return false;
    auto fr = parse_front_record(*rec);
    if (!fr) return false;
    Orphan o;
    o.rec = std::move(*fr);
    o.since_ns = shm::monotonic_ns();
    o.window_ns = f.opts_.resume_grace_ns;
    for (const Choice& ch : c.ch) o.attempts.push_back(ch.attempt);
    {
        std::lock_guard<std::mutex> lock(f.impl_->orphans_mu);
        f.impl_->orphans.insert_or_assign(c.id, std::move(o));  // a resumed orphan's entry is replaced, unclaimed
    }
    // It leaves the connection: the queue and in-flight counts as when it ends.
    if (c.queued > 0) f.queue_left(c.cls, std::exchange(c.queued, 0), c.queue_at);
    f.in_flight_.fetch_sub(1, std::memory_order_relaxed);
    c.detached = true;
    return true;
}

std::optional<std::string> FrontSession::orphan_of_xid(Front& f, const std::string& xid) {
    if (xid.empty()) return std::nullopt;
    std::lock_guard<std::mutex> lock(f.impl_->orphans_mu);
    for (const auto& [id, o] : f.impl_->orphans)
        if (o.rec.xid == xid) return id;
    return std::nullopt;
}

awaitable<bool> FrontSession::resume(Front& f, beast::tcp_stream& stream, Request& req, const std::string& id,
                                     bool events) {
    std::optional<FrontRecord> fr;
    std::vector<uint32_t> attempts;  // each choice's attempt this front last sent
    bool busy = false;
    {
        std::lock_guard<std::mutex> lock(f.impl_->orphans_mu);
        auto it = f.impl_->orphans.find(id);
        if (it != f.impl_->orphans.end() && !it->second.expiring) {
            busy = it->second.claimed;
            if (!busy) {
                it->second.claimed = true;
                fr = it->second.rec;
                attempts = it->second.attempts;
            }
        }
    }
    if (busy)
        co_return co_await error(f, stream, req,
                                 api_error(409, "invalid_request_error",
                                           fmt::format("request '{}' is being answered on another connection", id)));
    if (!fr)
        co_return co_await error(f, stream, req,
                                 api_error(404, "not_found_error",
                                           fmt::format("no request '{}' to resume: resumable are the requests of a front "
                                                       "that died, for {} s after it, and streams whose client "
                                                       "disconnected, for {} s after it",
                                                       id, f.opts_.resume_window_ns / 1000000000ull,
                                                       f.opts_.resume_grace_ns / 1000000000ull),
                                           "", "request_not_found"));
    auto unclaim = [&](bool forget) {
        std::lock_guard<std::mutex> lock(f.impl_->orphans_mu);
        auto it = f.impl_->orphans.find(id);
        if (it == f.impl_->orphans.end()) return;
        if (forget) f.impl_->orphans.erase(it);
        else it->second.claimed = false;
    };
    shm::RequestTable& t = f.inst_.requests();
    Completion c;
    c.r = fr->r;
    c.chat = fr->chat;
    c.id = fr->id;
    c.xid = fr->xid;
    c.created = fr->created;
    c.resumed_id = id;
    c.arrived = shm::monotonic_ns();
    c.context = fr->context;
    c.context_len = fr->context_len;
    c.commit = fr->commit;
    c.return_kv = fr->return_kv;
    c.echo = fr->echo;
    c.keep = fr->keep;
    if (events && c.ranked()) {
        unclaim(false);
        co_return co_await error(f, stream, req,
                                 api_error(400, "invalid_request_error",
                                           fmt::format("request '{}' has 'best_of' greater than 'n': it cannot be "
                                                       "streamed; resume it without Accept: text/event-stream",
                                                       id),
                                           "best_of", ""));
    }
    // The prompt as the slot holds it (the commit adds its tokens past context_len).
    {
        const uint32_t s0 = fr->refs[0].slot;
        const uint32_t np = std::min<uint32_t>(t.slot(s0).n_prompt.load(std::memory_order_relaxed), t.max_tokens());
        c.prompt.assign(t.tokens(s0), t.tokens(s0) + np);
        if (c.prompt.size() != fr->prompt_tokens || c.context_len > c.prompt.size()) {
            unclaim(false);
            co_return co_await error(f, stream, req,
                                     api_error(500, "server_error",
                                               fmt::format("request '{}': its slot no longer holds its prompt", id)));
        }
    }
    if (events) c.r.stream = true;
    // Last-Event-ID: each choice's output tokens covered by the last event the client
    // got ("12", or "12.9" for two choices); none: from the start.
    std::vector<uint32_t> from(fr->refs.size(), 0);
    const std::string last(req["Last-Event-ID"]);
    if (!last.empty()) {
        size_t i = 0, at = 0;
        bool ok = true;
        for (; ok && i < from.size(); ++i) {
            const size_t dot = std::min(last.find('.', at), last.size());
            const std::string part = last.substr(at, dot - at);
            ok = !part.empty() && part.size() <= 9 && part.find_first_not_of("0123456789") == std::string::npos;
            if (ok) from[i] = static_cast<uint32_t>(std::stoul(part));
            at = dot + 1;
            if (dot == last.size() && i + 1 < from.size()) ok = false;
        }
        if (!ok || at <= last.size()) {
            unclaim(false);
            co_return co_await error(f, stream, req,
                                     api_error(400, "invalid_request_error",
                                               fmt::format("Last-Event-ID '{}': one output count per choice ({}), "
                                                           "as the stream's event ids",
                                                           last, from.size())));
        }
    }
    const uint64_t now = shm::monotonic_ns();
    for (size_t i = 0; i < fr->refs.size(); ++i) {
        Choice ch(f.tok_, c.r.stop);
        ch.ref = fr->refs[i];
        // The attempt sent last (by adoption, or again by expire_orphans): a later one
        // found QUEUED was preempted, and read_choice sends it.
        ch.attempt = i < attempts.size() ? attempts[i] : t.attempt(ch.ref.slot);
        std::vector<int32_t> out;
        auto n = t.read_output(ch.ref, 0, out);
        if (!n || from[i] > out.size()) {
            unclaim(false);
            co_return co_await error(f, stream, req,
                                     api_error(400, "invalid_request_error",
                                               fmt::format("Last-Event-ID '{}' is past what choice {} has produced", last, i)));
        }
        // The state the stream was in when its last event was written: its tokens
        // read, their text and log-probs made and sent.
        out.resize(from[i]);
        ch.out = std::move(out);
        ch.have = from[i];
        if (c.r.logprobs >= 0 || c.ranked()) read_logprobs(t, f.tok_, ch, std::max(c.r.logprobs, 0), 0, ch.out.size());
        if (ch.feed(0, false)) ch.finish = finish_reason(Finish::StopString);
        (void)ch.stream.take(false);
        ch.lps_sent = ch.lps.size();
        ch.sent_have = ch.have;
        ch.first = last.empty();
        ch.last_token_ns = now;  // no time to first token for an adopted request
        c.ch.push_back(std::move(ch));
    }
    for (Choice& ch : c.ch)
        if (!ch.finish.empty()) ch.cancel(t);  // its stop string is in what was sent
    f.in_flight_.fetch_add(1, std::memory_order_relaxed);
    if (c.r.stream) co_await write_stream_head(stream, req, c);
    co_await follow(f, stream, c);
    co_return co_await end_completion(f, stream, req, c);  // forgets the orphan
}

void Front::forget_orphan(const std::string& id) {
    std::lock_guard<std::mutex> lock(impl_->orphans_mu);
    impl_->orphans.erase(id);
}

// Requests of a dead front with a front record: this process answers them from now
// on (their client comes back, or the window passes). QUEUED ones are sent again (a
// prefill worker drops a copy whose request it already took).
void Front::adopt_orphans() {
    shm::RequestTable& t = inst_.requests();
    const shm::Registry& reg = inst_.registry();
    std::vector<shm::ReqRef> queued;
    size_t n = 0;
    {
        std::lock_guard<std::mutex> lock(impl_->orphans_mu);
        const uint64_t now = shm::monotonic_ns();
        for (uint32_t s = 0; s < t.n_slots(); ++s) {
            if (t.state(s) == shm::ReqState::Free) continue;
            const uint64_t client = t.slot(s).client.load(std::memory_order_acquire);
            if (client == 0 || client == self_.pack() || reg.alive(shm::ProcRef::unpack(client))) continue;
            auto rec = t.front_data(t.current(s));
            if (!rec) continue;
            auto fr = parse_front_record(*rec);
            if (!fr || impl_->orphans.count(fr->id)) continue;
            // A context completion is answered by a front that can commit it; one
            // without contexts leaves it to the launcher's sweep.
            if (!fr->context.empty() && !opts_.contexts) continue;
            for (shm::ReqRef r : fr->refs)
                if (t.set_client(r, self_) && t.state(r.slot) == shm::ReqState::Queued) queued.push_back(r);
            Orphan o;
            o.since_ns = now;
            o.window_ns = opts_.resume_window_ns;
            for (shm::ReqRef r : fr->refs) o.attempts.push_back(t.attempt(r.slot));
            const std::string id = fr->id;
            o.rec = std::move(*fr);
            impl_->orphans.emplace(id, std::move(o));
            ++n;
        }
    }
    for (shm::ReqRef r : queued) (void)send(r);
    if (n) std::fprintf(stderr, "duet front: adopted %zu requests of a front that died (resumable for %llu s)\n", n,
                        static_cast<unsigned long long>(opts_.resume_window_ns / 1000000000ull));
}

// Orphans nobody came back for within the window: cancelled, then freed once ended.
void Front::expire_orphans(uint64_t now) {
    shm::RequestTable& t = inst_.requests();
    std::lock_guard<std::mutex> lock(impl_->orphans_mu);
    for (auto it = impl_->orphans.begin(); it != impl_->orphans.end();) {
        Orphan& o = it->second;
        if (!o.claimed && !o.expiring)  // nobody follows it: a preempted choice is sent again here
            for (size_t i = 0; i < o.rec.refs.size() && i < o.attempts.size(); ++i)
                resend_if_preempted(o.rec.refs[i], o.attempts[i]);
        if (o.claimed || (!o.expiring && now - o.since_ns < o.window_ns)) {
            ++it;
            continue;
        }
        bool ended = true, cancelled = false;
        for (shm::ReqRef r : o.rec.refs) {
            if (t.current(r.slot).gen != r.gen) continue;
            const shm::ReqState st = t.state(r.slot);
            if (st == shm::ReqState::Free) continue;
            if (st == shm::ReqState::Finished || st == shm::ReqState::Failed || st == shm::ReqState::Cancelled) {
                // A context completion's KV that came back to us: nobody commits it.
                if (st == shm::ReqState::Finished && o.rec.return_kv && opts_.contexts &&
                    t.slot(r.slot).kv_to.load(std::memory_order_relaxed) == self_.pack()) {
                    const uint32_t nb = t.slot(r.slot).n_blocks.load(std::memory_order_acquire);
                    opts_.contexts->release(std::span<const int32_t>(t.blocks(r.slot), nb));
                }
                t.transition(r, st, shm::ReqState::Free);
                continue;
            }
            if (!o.expiring) {
                t.cancel(r);
                t.transition(r, shm::ReqState::Queued, shm::ReqState::Cancelled);
                cancelled = true;
            }
            ended = false;
        }
        if (cancelled) counters_.cancelled.fetch_add(1, std::memory_order_relaxed);  // its client never came back
        o.expiring = true;
        it = ended ? impl_->orphans.erase(it) : std::next(it);
    }
}

}  // namespace duet
