// The front's own parts, shared by its files and by nothing else: Front::Impl (its
// state) and front.cpp (its HTTP routes), completion.cpp (a CompletionRun, from its
// parse to its reply), resume.cpp (front records, detached streams, orphans adopted
// from a dead front), responses_front.cpp (/v1/responses) and front_util.cpp
// (helpers).
#pragma once

#include <utility>  // Boost 1.74's asio/awaitable.hpp uses std::exchange without including it

#include "roles/front.h"

#include <time.h>
#include <unistd.h>

#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <variant>
#include <vector>

#include <boost/asio.hpp>
#include <boost/beast.hpp>
#include <nlohmann/json.hpp>

#include "kv/kv_pool.h"
#include "roles/api_key.h"
#include "roles/context_api.h"
#include "roles/front_admission.h"
#include "roles/metrics_text.h"
#include "roles/openai.h"
#include "roles/recovery.h"
#include "roles/request_data.h"
#include "roles/responses.h"
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
    std::vector<std::string> tool_names;  // the functions offered, when its calls are parsed
    bool tool_calls_only = false;         // tool_choice required or named
};

// A request adopted from a dead front (Front::Impl::adopt_orphans), until its client comes
// back for it or the resume window passes.
// Or a stream of this front's whose client disconnected (CompletionRun::detach), for
// --resume-grace.
struct Orphan {
    FrontRecord rec;
    uint64_t since_ns = 0;           // adopted, or detached
    uint64_t window_ns = 0;          // how long from since_ns its client may come back
    bool claimed = false;            // a connection is answering it
    bool expiring = false;           // the window passed: cancelled, freed once every choice has ended
    std::vector<uint32_t> attempts;  // each choice's attempt this front last sent (a preempted one is sent again)
};

// The front's state, and its work outside any one connection: the notifier thread,
// admission's view of the queue and the arenas, the orphans a resume may claim.
// The connections' coroutines (front.cpp's routes, a CompletionRun) run over it.
struct Front::Impl {
    Impl(shm::Instance& inst, shm::ProcRef self, const Tokenizer& tok, ChatTemplate tmpl, FrontOptions o);
    ~Impl() { stop(); }

    // First: destroyed last, after everything that may post to them.
    asio::io_context io;
    std::mutex orphans_mu;
    std::map<std::string, Orphan> orphans;  // by response id
    tcp::acceptor acceptor{io};
    asio::thread_pool store{1};  // the contexts' blocking calls (disk, waits for prefill), one at a time
    std::mutex mu;
    std::vector<std::shared_ptr<Waiter>> waiters;

    shm::Instance& inst;
    shm::ProcRef self;
    const Tokenizer& tok;
    ChatTemplate tmpl;
    FrontOptions opts;
    ApiKey key;
    uint16_t port = 0;
    std::atomic<bool> draining{false};
    std::atomic<size_t> in_flight{0};
    PrefillRouter router;
    FrontCounters counters;
    std::unique_ptr<ResponseStore> responses;  // opened by start()
    std::vector<std::thread> threads;
    std::thread notifier;
    std::atomic<bool> quit{false};
    std::atomic<uint64_t> loop_alive_ns{0};
    FrontAdmission admission;  // engine/scheduling.h's rules over this front's queue (front_admission.h)

    Status start();
    void stop();
    void cancel_all();
    bool send(shm::ReqRef r) { return router.send(r); }
    // Sends a request decode preempted (QUEUED again, at an attempt other than
    // `sent_attempt`, which it updates) back to prefill.
    void resend_if_preempted(shm::ReqRef r, uint32_t& sent_attempt);
    // Sleeps on this process's doorbell, which prefill and decode ring after writing
    // tokens or changing a request's state; wakes the coroutines whose slots changed.
    void notify_loop();
    // Orphans (resume.cpp): adopted from a dead front, expired, forgotten once
    // answered, released for a slot (Front::release_ended_orphan).
    void adopt_orphans();
    void expire_orphans(uint64_t now);
    void forget_orphan(const std::string& id);
    bool release_ended_orphan();

    // The waiters (Waiter): a coroutine's, added before it sleeps.
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

namespace front_detail {

using Request = http::request<http::string_body>;

// Helpers of the front's files (front_util.cpp), built outside the coroutines where
// they make JSON or aggregates: GCC 12 miscompiles braced aggregates of string
// literals inside a coroutine body ("array used as initializer").
http::response<http::string_body> make_response(http::status st, std::string body, const Request& req,
                                                const char* type = "application/json");
http::status status_of(int code);
std::string_view sv(beast::string_view s);
// A request target's path, without the query; and its query, without the '?'.
std::string target_path(beast::string_view target);
std::string target_query(beast::string_view target);
ApiError api_error(int status, std::string type, std::string message, std::string param = {}, std::string code = {});
std::string request_id();
// /v1/models: the model, its context, its chat template and the format its tool
// calls are rendered and parsed in (roles/tool_calls.h).
std::string models_json(const std::string& id, uint32_t max_len, std::string_view chat_template,
                        std::string_view tool_format);
std::string tokens_json(const std::vector<int32_t>& ids);
std::string text_json(const std::string& text);
ApiError failure(int32_t code);  // a failed request's error (its ReqError code)
double seconds_between(uint64_t a_ns, uint64_t b_ns);
// retry_after_ms > 0: Retry-After (whole seconds, rounded up) and retry-after-ms,
// both of which the openai client honours.
awaitable<bool> write_response(beast::tcp_stream& stream, const Request& req, http::status st, std::string body,
                               std::string type, uint64_t retry_after_ms);
// One SSE event; `id` (when not empty) is what a client sends back as Last-Event-ID
// to resume the stream after a front restart (GET /v1/requests/{id}/events).
awaitable<bool> write_event(beast::tcp_stream& stream, std::string payload, const std::string& id = {});
// One SSE event of a /v1/responses stream: "event: <its type>" and its JSON.
awaitable<bool> write_typed_event(beast::tcp_stream& stream, const nlohmann::json& ev);
// Whether the client has closed (or reset) its connection, asked without waiting:
// bytes it sent ahead (a pipelined request) are not an end. A client that shuts
// down only its sending side reads as gone too, as in uvicorn and others.
bool peer_closed(beast::tcp_stream& stream);

// One choice of a completion: its request and what the front has made of its tokens.
struct Choice {
    Choice(const Tokenizer& tok, std::vector<std::string> stops, uint64_t min_tokens)
        : watch(tok, std::move(stops), min_tokens) {}
    shm::ReqRef ref;
    // The generated text, stop strings applied (as the worker applies them), and what
    // was streamed (watch.text).
    StopWatch watch;
    std::vector<int32_t> out;
    uint32_t have = 0;                               // output tokens read
    uint32_t attempt = 0;                            // the request's attempt this front last sent
    uint32_t sent_have = 0;                          // `have` when its last event was written (the event id)
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
        if (watch.text.stopped()) return false;
        for (size_t i = from; i < out.size(); ++i) {
            if (!watch.push(out[i], i + 1)) continue;
            kept = i + 1;
            out.resize(kept);
            if (lps.size() > kept) lps.resize(kept);
            return true;
        }
        return terminal && watch.finish();
    }
    // Chat with tools: splits the text into content and calls (roles/tool_calls.h).
    std::optional<ToolCallParser> tools;
    // The next part to stream (StopText::take), split into content and call deltas.
    struct Piece {
        std::string text;
        std::vector<ToolCallDelta> calls;
    };
    Piece take(bool terminal) {
        Piece p{watch.text.take(terminal), {}};
        if (tools) {
            ToolCallParser::Out o = tools->feed(p.text, terminal);
            p.text = std::move(o.content);
            p.calls = std::move(o.deltas);
        }
        return p;
    }
    // Its finish reason as the client sees it: an answer of calls that ended by
    // itself ends with "tool_calls".
    std::string reason() const { return tools && !tools->calls().empty() && finish == "stop" ? "tool_calls" : finish; }
    int64_t text_bytes = 0;  // bytes of the tokens so far (text_offset)
    std::vector<LogprobToken> unsent() const {
        if (lps_sent >= lps.size()) return {};
        return {lps.begin() + static_cast<std::ptrdiff_t>(lps_sent), lps.end()};
    }
    // Asks the worker to stop; a request no worker has taken yet is cancelled here.
    void cancel(shm::RequestTable& t) const {
        t.cancel(ref);
        // (Not queued any more: the worker holding it sees the cancel flag.)
        (void)t.transition(ref, shm::ReqState::Queued, shm::ReqState::Cancelled);
    }
};

static_assert(kMaxTopLogprobs == static_cast<int>(shm::kMaxTopLogprobs));

// A /v1/responses request running as a chat completion (responses_front.cpp): what
// was asked, its id, the conversation it stores, and its stream's events.
struct ResponseRun {
    ResponsesRequest rr;
    std::string id;
    int64_t created = 0;
    std::vector<ChatMessage> convo;  // the conversation through its input (instructions apart)
    bool own_context = false;        // its completion commits to a context of its id
    std::optional<ResponseEvents> events;
    int64_t completed_at = 0;  // when it ended (response_outcome sets it)
};

// One completion while it runs: what was asked, its prompt, its choices (a request
// slot each), and how its response goes.
struct Completion {
    CompletionRequest r;
    bool chat = false;
    ResponseRun* resp = nullptr;  // a /v1/responses request: answered as a Response
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
    std::vector<uint8_t> data;  // its request data (roles/request_data.h), encoded; empty: none
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
    std::multimap<uint64_t, int64_t>::iterator
        queue_at{};  // its place in the queue while queued > 0 (FrontAdmission::QueueAt)
    uint64_t first_ns = 0;
    double gap_sum = 0;
    int64_t gaps = 0;
    std::string xid;         // the client's X-Request-Id ("": none)
    std::string resumed_id;  // an orphan (adopted or detached) resumed: to forget when it ends
    // Event id: each choice's output tokens read when its last event was written.
    std::string event_id() const {
        std::string e;
        for (const Choice& x : ch) e += (e.empty() ? "" : ".") + std::to_string(x.sent_have);
        return e;
    }
};

// A completion's choices once all have ended.
struct Outcome {
    Usage u;
    bool failed = false;
    int32_t error_code = 0;  // of a failed choice
    std::vector<ChoiceText> texts;
};

// What one look at a choice's slot found.
struct ChoiceStep {
    shm::ReqState st = shm::ReqState::Free;
    bool terminal = false;
    uint64_t seen_ns = 0;
};

// Choice `index`'s tool-call parser (chat with tools; the names of r.tools, or those
// a front record kept): its calls' ids are call_<hash of the completion's id>_<index>_<n>,
// the same after a front restart.
ToolCallParser tool_parser(const std::string& completion_id, size_t index, ToolFormat f,
                           const std::vector<std::string>& names, bool calls_only);

// Turns the log-probability rows of output tokens [from, to) into API entries.
void read_logprobs(const shm::RequestTable& t, const Tokenizer& tok, Choice& c, int top, size_t from, size_t to);
// What a restarted front needs to answer a request's client again, kept in the
// request's slots (resume.cpp).
std::string front_record_json(const Completion& c);
std::optional<FrontRecord> parse_front_record(const std::string& text);
// best_of: the `keep` choices with the highest mean log-probability per token (an
// empty one scores 0), best first; equal scores keep their order.
void keep_best(std::vector<ChoiceText>& texts, size_t keep);
// /tokenize and /detokenize: the response body, or what is wrong with the request.
std::variant<std::string, ApiError> token_route(const Tokenizer& tok, const std::string& path, const std::string& body);
awaitable<void> write_stream_head(beast::tcp_stream& stream, const Request& req, Completion& c);

}  // namespace front_detail

using namespace front_detail;  // the front's files only include this header

namespace front_detail {

// The routes of one connection (front.cpp, responses_front.cpp, resume.cpp), over the
// front's state.
inline awaitable<bool> error(Front::Impl& f, beast::tcp_stream& stream, const Request& req, ApiError e) {
    f.counters.errors.fetch_add(1, std::memory_order_relaxed);
    const uint64_t retry = e.status == 429 || e.status == 503 ? (e.retry_after_ms ? e.retry_after_ms : 1000) : 0;
    co_return co_await write_response(stream, req, status_of(e.status), error_json(e), "application/json", retry);
}
awaitable<void> listen(Front::Impl& f);
awaitable<void> tick(Front::Impl& f);
awaitable<void> serve(Front::Impl& f, tcp::socket sock);
awaitable<void> too_large(beast::tcp_stream& stream, uint64_t limit);
awaitable<bool> unauthorized(Front::Impl& f, beast::tcp_stream& stream, const Request& req);
bool open_route(const Front::Impl& f, std::string_view path);
awaitable<bool> import_blob(Front::Impl& f, beast::tcp_stream& stream, beast::flat_buffer& buf,
                            http::request_parser<http::empty_body>& head, uint64_t limit);
awaitable<bool> export_blob(Front::Impl& f, beast::tcp_stream& stream, Request& req, const std::string& id);
awaitable<bool> handle(Front::Impl& f, beast::tcp_stream& stream, Request& req);
MetricsSnapshot metrics_snapshot(Front::Impl& f);
// /v1/responses (responses_front.cpp): POST runs one (as a chat completion, on a
// context with --contexts-dir); GET and DELETE a stored one.
awaitable<bool> responses(Front::Impl& f, beast::tcp_stream& stream, Request& req);
awaitable<bool> stored_response(Front::Impl& f, beast::tcp_stream& stream, Request& req, const std::string& id);
ResponseOutcome response_outcome(const Completion& c, const Outcome& o);
awaitable<bool> contexts(Front::Impl& f, beast::tcp_stream& stream, Request& req, const std::string& path);
// The orphan a retry with this X-Request-Id resumes, if any.
std::optional<std::string> orphan_of_xid(Front::Impl& f, const std::string& xid);

}  // namespace front_detail

// One completion, from its request to its reply, on the connection that asked: a
// completion or chat completion, a context's completion, a /v1/responses request
// (run as a chat completion), or a request a client came back for (resume). Its
// steps are its members, in the order they run; `c` is what they share.
class CompletionRun {
public:
    CompletionRun(Front::Impl& f, beast::tcp_stream& stream, Request& req) : f(f), stream(stream), req(req) {}
    CompletionRun(const CompletionRun&) = delete;
    CompletionRun& operator=(const CompletionRun&) = delete;

    // A new completion: parse and check the request, tokenize its prompt, put its
    // choices in the request table and send them to prefill, follow them (streaming
    // if asked) until all end, account for them, and reply. True: the connection may
    // serve another request.
    awaitable<bool> start(bool chat, std::string context = "", ResponseRun* resp = nullptr);
    // A request adopted from a dead front, or a stream kept for --resume-grace (an
    // orphan), answered again: GET /v1/requests/{id}/events (events: an SSE stream
    // from Last-Event-ID on), or a retry with the same X-Request-Id (the whole
    // answer, as first asked). In resume.cpp.
    awaitable<bool> resume(const std::string& id, bool events);

private:
    std::optional<ApiError> parse();
    std::optional<ApiError> tokenize_prompt();
    // Its parameters, and its request data (c.data) when it has some.
    std::variant<RequestParams, ApiError> request_params_of();
    std::optional<ApiError> admit(RequestParams params);
    awaitable<void> follow();
    ChoiceStep read_choice(Choice& ch);
    awaitable<void> stream_choice(size_t ci, const ChoiceStep& step);
    bool settle_choice(Choice& ch, const ChoiceStep& step);
    awaitable<void> wait_for_change(const std::shared_ptr<asio::steady_timer>& timer);
    // Once every choice has ended: the commit or the store, then the reply.
    awaitable<bool> end_completion();
    void take_returned_kv();
    awaitable<std::optional<ApiError>> commit_context();
    // A finished response stored (before its reply: acknowledged means stored); the
    // error when it could not be (responses_front.cpp).
    awaitable<std::optional<ApiError>> store_response(const Outcome& o);
    // Accounts for the ended choices; frees their slots unless `keep` (kept for a
    // resume: keep_as_orphan).
    Outcome finish(bool keep = false);
    awaitable<bool> reply(const Outcome& o);
    awaitable<bool> reply_stream(const Outcome& o);
    // Kept for a resume (resume.cpp): at its end, or when its client left.
    bool keep_as_orphan();
    bool detach();

    Front::Impl& f;
    beast::tcp_stream& stream;
    Request& req;
    Completion c;
};

}  // namespace duet
