#include <utility>  // Boost 1.74's asio/awaitable.hpp uses std::exchange without including it

#include "roles/front.h"

#include <time.h>
#include <unistd.h>

#include <boost/asio.hpp>
#include <boost/beast.hpp>
#include <nlohmann/json.hpp>

#include "kv/kv_pool.h"
#include "roles/metrics_text.h"
#include "roles/openai.h"
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

struct Front::Impl {
    asio::io_context io;
    tcp::acceptor acceptor{io};
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
    return fmt::format("cmpl-{:x}{:06x}", static_cast<uint64_t>(time(nullptr)), n.fetch_add(1, std::memory_order_relaxed));  // unique, nothing ordered by it
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
    default:
        return api_error(500, "server_error", "generation failed (out of KV cache or a worker error)");
    }
}

double seconds_between(uint64_t a_ns, uint64_t b_ns) { return static_cast<double>(b_ns - a_ns) * 1e-9; }

awaitable<bool> write_response(beast::tcp_stream& stream, const Request& req, http::status st, std::string body,
                               std::string type, bool retry_after) {
    auto res = make_response(st, std::move(body), req, type.c_str());
    if (retry_after) res.set(http::field::retry_after, "1");
    beast::error_code ec;
    co_await http::async_write(stream, res, asio::redirect_error(use_awaitable, ec));
    co_return !ec;
}

awaitable<bool> write_event(beast::tcp_stream& stream, std::string payload) {
    std::string ev = "data: " + payload + "\n\n";
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
    shm::ReqState seen_state = shm::ReqState::Free;  // as last read
    std::string finish;
    bool first = true, done = false;
    shm::ReqState final_state = shm::ReqState::Free;
    uint64_t last_token_ns = 0;
    std::vector<LogprobToken> lps;  // one per output token, when asked for
    size_t lps_sent = 0;            // streamed so far
    int64_t text_bytes = 0;         // bytes of the tokens so far (text_offset)
    std::vector<LogprobToken> unsent() const { return {lps.begin() + static_cast<std::ptrdiff_t>(lps_sent), lps.end()}; }
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

}  // namespace

// The coroutines that serve one connection; a friend of Front.
struct FrontSession {
    static awaitable<bool> error(Front& f, beast::tcp_stream& stream, const Request& req, ApiError e) {
        f.counters_.errors.fetch_add(1, std::memory_order_relaxed);
        const bool retry = e.status == 429 || e.status == 503;
        co_return co_await write_response(stream, req, status_of(e.status), error_json(e), "application/json", retry);
    }
    static awaitable<void> listen(Front& f);
    static awaitable<void> serve(Front& f, tcp::socket sock);
    static awaitable<bool> handle(Front& f, beast::tcp_stream& stream, Request& req);
    static awaitable<bool> completion(Front& f, beast::tcp_stream& stream, Request& req, bool chat);
    static MetricsSnapshot metrics_snapshot(Front& f);
};

Front::Front(shm::Instance& inst, shm::ProcRef self, const Tokenizer& tok, ChatTemplate tmpl, FrontOptions o)
    : impl_(std::make_unique<Impl>()), inst_(inst), self_(self), tok_(tok), tmpl_(std::move(tmpl)),
      opts_(std::move(o)), router_(inst, /*redrive=*/false) {}

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
    asio::co_spawn(impl_->io, FrontSession::listen(*this), asio::detached);
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
        http::request_parser<http::string_body> parser;
        parser.body_limit(f.opts_.max_body_bytes);
        stream.expires_after(std::chrono::seconds(60));  // a slow or idle client
        beast::error_code ec;
        co_await http::async_read(stream, buf, parser, asio::redirect_error(use_awaitable, ec));
        if (ec == http::error::body_limit) {
            Request dummy;
            ApiError e = api_error(413, "invalid_request_error",
                                   fmt::format("the request body is larger than {} bytes", f.opts_.max_body_bytes));
            auto res = make_response(http::status::payload_too_large, error_json(e), dummy);
            res.keep_alive(false);
            co_await http::async_write(stream, res, asio::redirect_error(use_awaitable, ec));
            break;
        }
        if (ec) break;  // end of stream, timeout, malformed HTTP
        Request req = parser.release();
        stream.expires_never();
        bool ok = co_await handle(f, stream, req);
        if (!ok || !req.keep_alive()) break;
    }
    beast::error_code ec;
    stream.socket().shutdown(tcp::socket::shutdown_send, ec);
}

awaitable<bool> FrontSession::handle(Front& f, beast::tcp_stream& stream, Request& req) {
    std::string path(req.target());
    if (auto q = path.find('?'); q != std::string::npos) path.resize(q);
    const bool get = req.method() == http::verb::get, post = req.method() == http::verb::post;
    const std::string js = "application/json";
    if (post && (path == "/v1/completions" || path == "/v1/chat/completions"))
        co_return co_await completion(f, stream, req, path == "/v1/chat/completions");
    if (get && path == "/health") co_return co_await write_response(stream, req, http::status::ok, std::string(R"({"status":"ok"})"), js, false);
    if (get && (path == "/ready" || path == "/readiness")) {
        // Ready while a worker of each role runs (requests are routed around one being
        // restarted).
        const bool ready = !f.draining_.load(std::memory_order_relaxed) && workers_running(f.inst_, /*all=*/false);
        co_return co_await write_response(stream, req, ready ? http::status::ok : http::status::service_unavailable,
                                          std::string(ready ? R"({"status":"ready"})" : R"({"status":"not ready"})"), js, false);
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
        json j = json::parse(req.body(), nullptr, false);
        if (j.is_discarded() || !j.is_object())
            co_return co_await error(f, stream, req, api_error(400, "invalid_request_error", "the request body is not a JSON object", "", ""));
        if (path == "/tokenize") {
            if (!j.contains("prompt") || !j["prompt"].is_string())
                co_return co_await error(f, stream, req, api_error(400, "invalid_request_error", "'prompt' must be a string", "prompt", ""));
            bool add_special = j.value("add_special_tokens", true);
            auto ids = f.tok_.encode(j["prompt"].get<std::string>(), add_special, false);
            co_return co_await write_response(stream, req, http::status::ok, tokens_json(ids), js, false);
        }
        if (!j.contains("tokens") || !j["tokens"].is_array())
            co_return co_await error(f, stream, req, api_error(400, "invalid_request_error", "'tokens' must be an array", "tokens", ""));
        std::vector<int32_t> ids;
        for (const json& x : j["tokens"]) {
            if (!x.is_number_integer() || x.get<int64_t>() < 0 || x.get<int64_t>() >= f.tok_.n_vocab())
                co_return co_await error(f, stream, req, api_error(400, "invalid_request_error",
                                          fmt::format("token ids must be integers in [0, {})", f.tok_.n_vocab()),
                                          "tokens", ""));
            ids.push_back(x.get<int32_t>());
        }
        co_return co_await write_response(stream, req, http::status::ok, text_json(f.tok_.decode(ids, false)), js,
                                          false);
    }
    co_return co_await error(f, stream, req, api_error(404, "not_found_error",
                              fmt::format("no route for {} {}", std::string(req.method_string()), path), "", ""));
}

MetricsSnapshot FrontSession::metrics_snapshot(Front& f) {
    const FrontCounters& c = f.counters_;
    shm::Instance& inst = f.inst_;
    MetricsSnapshot m;
    // Relaxed: counters for display, no order among them.
    m.requests = c.requests.load(std::memory_order_relaxed);
    m.errors = c.errors.load(std::memory_order_relaxed);
    m.finished = c.finished.load(std::memory_order_relaxed);
    m.cancelled = c.cancelled.load(std::memory_order_relaxed);
    m.failed = c.failed.load(std::memory_order_relaxed);
    m.rejected_busy = c.rejected_busy.load(std::memory_order_relaxed);
    m.tokens = c.tokens.load(std::memory_order_relaxed);
    m.prompt_tokens = c.prompt_tokens.load(std::memory_order_relaxed);
    m.worker_restarts = inst.requests().worker_restarts().load(std::memory_order_relaxed);
    m.redriven = inst.requests().redriven().load(std::memory_order_relaxed);
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
        if (const int32_t s = reg.find_running(role, static_cast<int32_t>(i)); s >= 0) {
            const shm::ProcSlot& ps = reg.slot(static_cast<uint32_t>(s));
            w.up = true;
            w.items = ps.load_items.load(std::memory_order_relaxed);
            w.tokens = ps.load_tokens.load(std::memory_order_relaxed);
            w.served = ps.served.load(std::memory_order_relaxed);
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

awaitable<bool> FrontSession::completion(Front& f, beast::tcp_stream& stream, Request& req, bool chat) {
    beast::error_code ec;
    const uint64_t arrived = shm::monotonic_ns();
    if (f.draining_.load(std::memory_order_relaxed)) co_return co_await error(f, stream, req, api_error(503, "server_error", "the server is shutting down", "", ""));
    auto parsed = parse_completion(req.body(), chat);
    if (auto* e = std::get_if<ApiError>(&parsed)) co_return co_await error(f, stream, req, *e);
    CompletionRequest& r = std::get<CompletionRequest>(parsed);
    if (!r.model.empty() && r.model != f.opts_.model_id)
        co_return co_await error(f, stream, req, api_error(404, "invalid_request_error",
                                       fmt::format("the model '{}' does not exist; this server has '{}'", r.model,
                                                   f.opts_.model_id),
                                       "model", "model_not_found"));
    std::vector<int32_t> prompt;
    if (chat) {
        auto text = f.tmpl_.apply(r.messages, true);
        if (!text) co_return co_await error(f, stream, req, api_error(400, "invalid_request_error", text.error().message, "messages", ""));
        prompt = f.tok_.encode(*text, !f.tmpl_.includes_bos(), true);
    } else if (!r.prompt_ids.empty()) {
        for (int32_t id : r.prompt_ids)
            if (id >= f.tok_.n_vocab())
                co_return co_await error(f, stream, req, api_error(400, "invalid_request_error",
                                               fmt::format("token id {} is outside the vocabulary [0, {})", id,
                                                           f.tok_.n_vocab()),
                                               "prompt", ""));
        prompt = std::move(r.prompt_ids);
    } else {
        prompt = f.tok_.encode(r.prompt, true, false);
    }
    const int64_t n_ctx = f.inst_.config().requests.max_tokens;
    const int64_t room = n_ctx - static_cast<int64_t>(prompt.size());
    if (room < 1)
        co_return co_await error(f, stream, req, api_error(400, "invalid_request_error",
                                       fmt::format("the prompt has {} tokens; this model's context is {} tokens",
                                                   prompt.size(), n_ctx),
                                       chat ? "messages" : "prompt", "context_length_exceeded"));
    if (r.max_tokens > room)
        co_return co_await error(f, stream, req, api_error(400, "invalid_request_error",
                                       fmt::format("the prompt ({} tokens) plus max_tokens ({}) exceed the context "
                                                   "of {} tokens",
                                                   prompt.size(), r.max_tokens, n_ctx),
                                       "max_tokens", "context_length_exceeded"));
    RequestParams params;
    params.sampling = r.sampling;
    params.max_tokens = static_cast<uint32_t>(r.max_tokens < 0 ? room : r.max_tokens);
    params.stop_at_eog = r.ignore_eos ? 0 : 1;
    params.logprobs = r.logprobs;
    shm::RequestTable& t = f.inst_.requests();
    // One request per choice; choice i samples with its own seed, so choices differ
    // unless decoding is greedy. Sent after all are in: the later ones then find the
    // first one's prompt blocks in the prefix cache (prefill waits for them).
    std::vector<Choice> ch(static_cast<size_t>(r.n), Choice(f.tok_, r.stop));
    for (size_t i = 0; i < ch.size(); ++i) {
        params.sampling.seed = r.sampling.seed + 0x9E3779B97F4A7C15ull * i;
        auto sub = t.submit(f.self_, prompt.data(), static_cast<uint32_t>(prompt.size()), &params, sizeof params);
        if (!sub) {
            for (size_t k = 0; k < i; ++k) {  // not sent yet: nobody else knows them
                t.transition(ch[k].ref, shm::ReqState::Queued, shm::ReqState::Cancelled);
                t.transition(ch[k].ref, shm::ReqState::Cancelled, shm::ReqState::Free);
            }
            f.counters_.rejected_busy.fetch_add(1, std::memory_order_relaxed);
            co_return co_await error(f, stream, req, api_error(429, "rate_limit_error", "the server is at capacity; retry shortly", "", ""));
        }
        ch[i].ref = *sub;
    }
    f.counters_.requests.fetch_add(1, std::memory_order_relaxed);
    f.counters_.prompt_tokens.fetch_add(prompt.size() * ch.size(), std::memory_order_relaxed);
    f.in_flight_.fetch_add(1, std::memory_order_relaxed);  // a count for the drain and /metrics; orders nothing
    for (const Choice& c : ch) f.send(c.ref);
    f.counters_.admit.observe(seconds_between(arrived, shm::monotonic_ns()));

    const std::string id = request_id();
    const int64_t created = static_cast<int64_t>(time(nullptr));
    bool client_gone = false;
    auto timer = std::make_shared<asio::steady_timer>(stream.get_executor());
    if (r.stream) {
        http::response<http::empty_body> head{http::status::ok, req.version()};
        head.set(http::field::server, "duet");
        head.set(http::field::content_type, "text/event-stream");
        head.set(http::field::cache_control, "no-cache");
        head.keep_alive(req.keep_alive());
        head.chunked(true);
        http::response_serializer<http::empty_body> sr{head};
        co_await http::async_write_header(stream, sr, asio::redirect_error(use_awaitable, ec));
        client_gone = static_cast<bool>(ec);
    }
    const uint64_t deadline = shm::monotonic_ns() + static_cast<uint64_t>(f.opts_.request_timeout_s) * 1000000000ull;
    std::vector<std::shared_ptr<Waiter>> waiting;
    for (;;) {
        bool all_done = true;
        for (size_t ci = 0; ci < ch.size(); ++ci) {
            Choice& c = ch[ci];
            if (c.done) continue;
            const shm::ReqState st = t.state(c.ref.slot);
            c.seen_state = st;
            const bool terminal =
                st == shm::ReqState::Finished || st == shm::ReqState::Failed || st == shm::ReqState::Cancelled;
            const size_t before = c.out.size();
            if (auto n = t.read_output(c.ref, c.have, c.out)) c.have = *n;
            const uint64_t seen_ns = shm::monotonic_ns();
            if (c.out.size() > before) {
                if (c.last_token_ns == 0) {
                    f.counters_.ttft.observe(seconds_between(arrived, seen_ns));
                } else {  // several tokens at once share the gap
                    const double gap = seconds_between(c.last_token_ns, seen_ns) / static_cast<double>(c.out.size() - before);
                    for (size_t i = before; i < c.out.size(); ++i) f.counters_.itl.observe(gap);
                }
                c.last_token_ns = seen_ns;
                if (r.logprobs >= 0) read_logprobs(t, f.tok_, c, r.logprobs, before, c.out.size());
            }
            if (!c.stream.stopped()) {
                std::string piece;
                for (size_t i = before; i < c.out.size(); ++i) piece += c.detok.push(c.out[i]);
                if (terminal) piece += c.detok.finish();
                if (c.stream.append(piece)) {
                    c.finish = "stop";
                    if (!terminal) c.cancel(t);
                }
            }
            if (r.stream && !client_gone) {
                std::string piece = c.stream.take(terminal);
                if (!piece.empty() || c.first) {
                    if (!co_await write_event(stream, chunk_json(r, id, created, f.opts_.model_id, static_cast<int>(ci),
                                                                  piece, "", c.first, c.unsent())))
                        client_gone = true;
                    c.lps_sent = c.lps.size();
                    c.first = false;
                    f.counters_.stream_event.observe(seconds_between(seen_ns, shm::monotonic_ns()));
                }
            }
            if (client_gone && !terminal) c.cancel(t);
            if (terminal) {
                c.done = true;
                c.final_state = st;
                if (st == shm::ReqState::Failed)  // the response is an error: stop the other choices
                    for (const Choice& o : ch)
                        if (!o.done) o.cancel(t);
            } else {
                all_done = false;
                if (shm::monotonic_ns() > deadline) c.cancel(t);
            }
        }
        if (all_done) break;
        // Sleep until the notifier sees a slot change (or 20 ms pass: deadlines,
        // recoveries). Re-checked after registering, so no change is missed.
        waiting.clear();
        bool changed = false;
        for (const Choice& c : ch)
            if (!c.done) {
                waiting.push_back(std::make_shared<Waiter>(Waiter{c.ref.slot, c.have, c.seen_state, timer}));
                f.impl_->add(waiting.back());
                changed = changed || Front::Impl::changed(t, *waiting.back());
            }
        if (!changed) {
            timer->expires_after(std::chrono::milliseconds(20));
            co_await timer->async_wait(asio::redirect_error(use_awaitable, ec));
        }
        for (const auto& w : waiting) f.impl_->remove(w);
    }
    Usage u{static_cast<int64_t>(prompt.size()), 0, 0};
    bool failed = false;
    int32_t error_code = 0;
    std::vector<ChoiceText> texts;
    for (Choice& c : ch) {
        const shm::ReqSlot& s = t.slot(c.ref.slot);
        const uint64_t q = s.prefill_ns.load(std::memory_order_relaxed), h = s.handoff_ns.load(std::memory_order_relaxed),
                       d = s.first_step_ns.load(std::memory_order_relaxed);
        f.counters_.e2e.observe(seconds_between(arrived, shm::monotonic_ns()));
        if (q >= s.submit_ns && q != 0) f.counters_.queue.observe(seconds_between(s.submit_ns, q));
        if (h >= q && q != 0 && h != 0) f.counters_.prefill.observe(seconds_between(q, h));
        if (d >= h && h != 0 && d != 0) f.counters_.handoff.observe(seconds_between(h, d));
        u.cached_tokens += s.n_cached.load(std::memory_order_relaxed);
        if (c.finish.empty()) {
            if (c.final_state == shm::ReqState::Finished)
                c.finish = (!r.ignore_eos && !c.out.empty() && f.tok_.is_eog(c.out.back())) ? "stop" : "length";
            else if (c.final_state == shm::ReqState::Cancelled)
                c.finish = "stop";
        }
        u.completion_tokens += static_cast<int64_t>(c.out.size());
        f.counters_.tokens.fetch_add(c.out.size(), std::memory_order_relaxed);
        if (c.final_state == shm::ReqState::Failed) {
            failed = true;
            error_code = t.slot(c.ref.slot).error_code.load(std::memory_order_relaxed);
        }
        t.transition(c.ref, c.final_state, shm::ReqState::Free);
        texts.push_back({c.stream.text(), c.finish, std::move(c.lps)});
    }
    u.cached_tokens = std::min<int64_t>(u.cached_tokens, u.prompt_tokens);  // one prompt, however many choices
    if (failed) f.counters_.failed.fetch_add(1, std::memory_order_relaxed);
    else if (ch[0].final_state == shm::ReqState::Cancelled) f.counters_.cancelled.fetch_add(1, std::memory_order_relaxed);
    else f.counters_.finished.fetch_add(1, std::memory_order_relaxed);
    f.in_flight_.fetch_sub(1, std::memory_order_relaxed);

    if (r.stream) {
        if (client_gone) co_return false;
        bool ok = true;
        if (failed) {
            ok = co_await write_event(stream, error_json(failure(error_code)));
        } else {
            for (size_t ci = 0; ok && ci < ch.size(); ++ci)
                ok = co_await write_event(stream, chunk_json(r, id, created, f.opts_.model_id, static_cast<int>(ci),
                                                             ch[ci].stream.take(true), ch[ci].finish, false,
                                                             ch[ci].unsent()));
            if (ok && r.include_usage) ok = co_await write_event(stream, usage_chunk_json(r, id, created, f.opts_.model_id, u));
        }
        if (ok) ok = co_await write_event(stream, "[DONE]");
        if (!ok) co_return false;
        co_await asio::async_write(stream, http::make_chunk_last(), asio::redirect_error(use_awaitable, ec));
        co_return !ec;
    }
    if (failed) co_return co_await error(f, stream, req, failure(error_code));
    auto res = make_response(http::status::ok, completion_json(r, id, created, f.opts_.model_id, texts, u), req);
    co_await http::async_write(stream, res, asio::redirect_error(use_awaitable, ec));
    co_return !ec;
}

}  // namespace duet
