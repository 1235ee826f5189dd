#include "roles/front_impl.h"

#include "base/log.h"

#include <set>

#include "roles/worker_stats.h"

namespace duet {

Front::Impl::Impl(shm::Instance& inst, shm::ProcRef self, const Tokenizer& tok, ChatTemplate tmpl, FrontOptions o)
    : inst(inst),
      self(self),
      tok(tok),
      tmpl(std::move(tmpl)),
      opts(std::move(o)),
      key(opts.api_key),
      router(inst, /*redrive=*/false),
      admission(opts.admission) {
    opts.api_key.clear();  // only its digest stays (key)
}

Front::Front(shm::Instance& inst, shm::ProcRef self, const Tokenizer& tok, ChatTemplate tmpl, FrontOptions o)
    : impl_(std::make_unique<Impl>(inst, self, tok, std::move(tmpl), std::move(o))) {}
Front::~Front() = default;  // Impl's destructor stops it
Status Front::start() { return impl_->start(); }
uint16_t Front::port() const { return impl_->port; }
void Front::drain() { impl_->draining.store(true, std::memory_order_relaxed); }  // a flag: orders nothing
void Front::cancel_all() { impl_->cancel_all(); }
void Front::stop() { impl_->stop(); }
size_t Front::in_flight() const { return impl_->in_flight.load(std::memory_order_relaxed); }
uint64_t Front::loop_alive_ns() const { return impl_->loop_alive_ns.load(std::memory_order_relaxed); }
bool Front::send(shm::ReqRef r) { return impl_->send(r); }
FrontCounters& Front::counters() { return impl_->counters; }
PrefillRouter& Front::router() { return impl_->router; }
void Front::set_contexts(ContextService* c) { impl_->opts.contexts = c; }
bool Front::release_ended_orphan() { return impl_->release_ended_orphan(); }

Status Front::Impl::start() {
    beast::error_code ec;
    auto addr = asio::ip::make_address(opts.host, ec);
    if (ec) return make_error("--host {}: {}", opts.host, ec.message());
    tcp::endpoint ep{addr, opts.port};
    acceptor.open(ep.protocol(), ec);
    if (!ec) acceptor.set_option(asio::socket_base::reuse_address(true), ec);
    if (!ec) acceptor.bind(ep, ec);
    if (!ec) acceptor.listen(asio::socket_base::max_listen_connections, ec);
    if (ec) return make_error("cannot listen on {}:{}: {}", opts.host, opts.port, ec.message());
    port = acceptor.local_endpoint().port();
    responses = std::make_unique<ResponseStore>(opts.responses_dir, opts.responses_max);
    std::vector<std::string> skipped;
    if (Status st = responses->open(skipped); !st) return make_error("responses: {}", st.error().message);
    for (const std::string& name : skipped)
        log::warning(fmt::format("responses: {} is not a stored response; left as it is", name));
    // Contexts of responses that were never stored (the process died between the two),
    // or whose record was removed: nothing refers to them.
    if (opts.contexts && !opts.responses_dir.empty()) {
        const std::vector<std::string> kept = responses->ids();
        const std::set<std::string> known(kept.begin(), kept.end());
        size_t swept = 0;
        for (const ContextInfo& i : opts.contexts->store().list())
            if (i.id.rfind("resp_", 0) == 0 && !known.count(i.id) &&
                opts.contexts->handle("DELETE", "/v1/contexts/" + i.id, "", "").status < 400)
                ++swept;
        if (swept) log::notice(fmt::format("responses: {} contexts no stored response refers to, removed", swept));
    }
    if (opts.responses_dir.empty())
        log::info(fmt::format("stored responses are kept in memory (at most {}; --contexts-dir keeps them durable)",
                              opts.responses_max));
    else
        log::info(fmt::format("stored responses are durable contexts ({} read back, at most {})", responses->size(),
                              opts.responses_max));
    adopt_orphans();  // before the first connection: a client may come back at once
    asio::co_spawn(io, listen(*this), asio::detached);
    loop_alive_ns.store(shm::monotonic_ns(), std::memory_order_relaxed);
    asio::co_spawn(io, tick(*this), asio::detached);
    quit.store(false, std::memory_order_relaxed);  // before the notifier thread starts (thread creation orders it)
    notifier = std::thread([this] { notify_loop(); });
    for (int i = 0; i < std::max(1, opts.io_threads); ++i) threads.emplace_back([this] { io.run(); });
    return {};
}

// Sleeps on this process's doorbell, which prefill and decode ring after writing
// tokens or changing a request's state; wakes the coroutines whose slots changed.
// Every 50 ms, sends requests stranded on a dead prefill worker's ring to a live one;
// every 500 ms, adopts the requests of a front whose death was recovered only after
// this one started (the instance's supervisor was down too, and is back).
void Front::Impl::notify_loop() {
    shm::Doorbell& bell = inst.registry().doorbell(self.slot);
    const shm::RequestTable& t = inst.requests();
    uint64_t next_rescue = 0, next_adopt = shm::monotonic_ns() + 500'000'000;
    while (!quit.load(std::memory_order_relaxed)) {
        shm::doorbell_wait(
            bell, [&] { return any_changed(t) || quit.load(std::memory_order_relaxed); }, 64, 2'000'000);
        wake_changed(t);
        if (const uint64_t now = shm::monotonic_ns(); now >= next_rescue) {
            router.resend_stranded();
            expire_orphans(now);
            admission.sample_prefill_work(inst.registry());
            admission.sample_kv(inst, opts.contexts);
            next_rescue = now + 50'000'000;
            if (now >= next_adopt) {
                adopt_orphans();
                next_adopt = now + 500'000'000;
            }
        }
    }
}

void Front::Impl::stop() {
    if (notifier.joinable()) {
        quit.store(true,
                   std::memory_order_relaxed);  // a flag: nothing is published with it; the doorbell wakes the loop
        shm::doorbell_ring(inst.registry().doorbell(self.slot));
        notifier.join();
    }
    io.stop();
    for (std::thread& t : threads) t.join();
    threads.clear();
}

void Front::Impl::cancel_all() {
    shm::RequestTable& t = inst.requests();
    for (uint32_t s = 0; s < t.n_slots(); ++s) {
        shm::ReqState st = t.state(s);
        if (st == shm::ReqState::Queued || st == shm::ReqState::Prefilling || st == shm::ReqState::Decoding)
            t.cancel(t.current(s));
    }
}

// Preempted by decode (DecodeWorker::preempt: recompute or swap): back in QUEUED, ours, at an
// attempt this front has not sent. It goes to prefill again, with its output so far.
void Front::Impl::resend_if_preempted(shm::ReqRef r, uint32_t& sent_attempt) {
    shm::RequestTable& t = inst.requests();
    if (t.current(r.slot).gen != r.gen || t.state(r.slot) != shm::ReqState::Queued ||
        t.owner_slot(r.slot) != static_cast<int32_t>(self.slot) || t.attempt(r.slot) == sent_attempt)
        return;
    sent_attempt = t.attempt(r.slot);
    // Relaxed: written before the transition to QUEUED, whose acquire load state() made.
    if (t.slot(r.slot).n_swapped.load(std::memory_order_relaxed) > 0)
        counters.preempted_swap.fetch_add(1, std::memory_order_relaxed);
    else
        counters.preempted.fetch_add(1, std::memory_order_relaxed);
    (void)send(r);
}

awaitable<void> front_detail::tick(Front::Impl& f) {
    asio::steady_timer timer(co_await asio::this_coro::executor);
    for (;;) {
        f.loop_alive_ns.store(shm::monotonic_ns(),
                              std::memory_order_relaxed);  // a reading for the watchdog; orders nothing
        timer.expires_after(std::chrono::milliseconds(100));
        beast::error_code ec;
        co_await timer.async_wait(asio::redirect_error(use_awaitable, ec));
        if (ec) co_return;
    }
}

awaitable<void> front_detail::listen(Front::Impl& f) {
    for (;;) {
        beast::error_code ec;
        // Each connection on its own strand: the notifier posts to it.
        tcp::socket s =
            co_await f.acceptor.async_accept(asio::make_strand(f.io), asio::redirect_error(use_awaitable, ec));
        if (ec) {
            if (ec == asio::error::operation_aborted) co_return;
            continue;
        }
        auto ex = s.get_executor();
        asio::co_spawn(ex, serve(f, std::move(s)), asio::detached);
    }
}

awaitable<void> front_detail::serve(Front::Impl& f, tcp::socket sock) {
    beast::tcp_stream stream(std::move(sock));
    beast::flat_buffer buf;
    for (;;) {
        // The header first: an import's body (a KV blob, up to max_blob_bytes) is
        // spooled to a file; every other body is read into memory, up to
        // max_body_bytes.
        http::request_parser<http::empty_body> head;
        const uint64_t blob_limit = f.opts.contexts ? f.opts.contexts->max_blob_bytes() : 0;
        head.body_limit(std::max<uint64_t>(f.opts.max_body_bytes, blob_limit));
        stream.expires_after(std::chrono::seconds(60));  // a slow or idle client
        beast::error_code ec;
        co_await http::async_read_header(stream, buf, head, asio::redirect_error(use_awaitable, ec));
        const bool import = !ec && f.opts.contexts && head.get().method() == http::verb::post &&
                            target_path(head.get().target()) == "/v1/contexts/import";
        const uint64_t limit = import ? blob_limit : f.opts.max_body_bytes;
        // (A header whose Content-Length passes the parser's limit is whole: Beast
        // says body_limit right after it.)
        const bool have_head = !ec || ec == http::error::body_limit;
        if (have_head && !open_route(f, target_path(head.get().target())) &&
            !f.key.allows(sv(head.get()[http::field::authorization]))) {
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
awaitable<bool> front_detail::unauthorized(Front::Impl& f, beast::tcp_stream& stream, const Request& req) {
    f.counters.errors.fetch_add(1, std::memory_order_relaxed);
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
awaitable<void> front_detail::too_large(beast::tcp_stream& stream, uint64_t limit) {
    Request dummy;
    ApiError e = api_error(413, "invalid_request_error", fmt::format("the request body is larger than {} bytes", limit));
    auto res = make_response(http::status::payload_too_large, error_json(e), dummy);
    res.keep_alive(false);
    beast::error_code ec;
    co_await http::async_write(stream, res, asio::redirect_error(use_awaitable, ec));
}

// POST /v1/contexts/import?id=...: the body (a KV blob) written to a spool file as
// it arrives, then imported on the store thread, which removes the file.
awaitable<bool> front_detail::import_blob(Front::Impl& f, beast::tcp_stream& stream, beast::flat_buffer& buf,
                                          http::request_parser<http::empty_body>& head, uint64_t limit) {
    ContextService& svc = *f.opts.contexts;
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
        f.store, [&]() -> awaitable<ApiReply> { co_return svc.import_file(query, spool); }, use_awaitable);
    if (reply.status >= 400) f.counters.errors.fetch_add(1, std::memory_order_relaxed);
    const bool ok = co_await write_response(stream, req, status_of(reply.status), std::move(reply.body),
                                            "application/json", reply.status == 429 ? 1000 : 0);
    co_return ok && req.keep_alive();
}

// GET /v1/contexts/{id}/export: the blob written on the store thread, then sent as
// the body; its spool file is removed once open (the open file is what is sent).
awaitable<bool> front_detail::export_blob(Front::Impl& f, beast::tcp_stream& stream, Request& req,
                                          const std::string& id) {
    ContextService& svc = *f.opts.contexts;
    auto file = co_await asio::co_spawn(
        f.store, [&]() -> awaitable<std::variant<std::string, ApiReply>> { co_return svc.export_file(id); },
        use_awaitable);
    if (auto* e = std::get_if<ApiReply>(&file)) {
        f.counters.errors.fetch_add(1, std::memory_order_relaxed);
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
bool front_detail::open_route(const Front::Impl& f, std::string_view path) {
    return path == "/health" || path == "/ready" || path == "/readiness" ||
           (path == "/metrics" && f.opts.public_metrics);
}

awaitable<bool> front_detail::handle(Front::Impl& f, beast::tcp_stream& stream, Request& req) {
    const std::string path = target_path(req.target());
    const bool get = req.method() == http::verb::get, post = req.method() == http::verb::post;
    const std::string js = "application/json";
    if (!open_route(f, path) && !f.key.allows(sv(req[http::field::authorization])))
        co_return co_await unauthorized(f, stream, req);
    if (post && (path == "/v1/completions" || path == "/v1/chat/completions")) {
        // A retry of a request a dead front took (the same X-Request-Id): its answer.
        CompletionRun run(f, stream, req);
        if (auto id = orphan_of_xid(f, std::string(req["X-Request-Id"]))) co_return co_await run.resume(*id, false);
        co_return co_await run.start(path == "/v1/chat/completions");
    }
    if (post && path == "/v1/responses") co_return co_await responses(f, stream, req);
    if ((get || req.method() == http::verb::delete_) && path.rfind("/v1/responses/", 0) == 0 && path.size() > 14)
        co_return co_await stored_response(f, stream, req, path.substr(14));
    if (get && path.rfind("/v1/requests/", 0) == 0 && path.size() > 20 &&
        path.compare(path.size() - 7, 7, "/events") == 0) {
        CompletionRun run(f, stream, req);
        co_return co_await run.resume(path.substr(13, path.size() - 20), true);
    }
    if (path == "/v1/contexts" || path.rfind("/v1/contexts/", 0) == 0) co_return co_await contexts(f, stream, req, path);
    if (get && path == "/health") co_return co_await write_response(stream, req, http::status::ok, std::string(R"({"status":"ok"})"), js, false);
    if (get && (path == "/ready" || path == "/readiness")) {
        // Ready while a worker of each role runs (requests are routed around one being
        // restarted).
        const bool ready = !f.draining.load(std::memory_order_relaxed) && workers_running(f.inst);
        // A worker that failed its golden-logits check is not restarted: say why.
        std::string why;
        if (f.inst.registry().golden_failures() > 0)
            why = "a worker failed its golden-logits check, not restarted: " + f.inst.registry().golden_reason();
        std::string answer = ready ? R"({"status":"ready"})" : R"({"status":"not ready"})";
        if (!why.empty()) answer = json{{"status", ready ? "ready" : "not ready"}, {"reason", why}}.dump();
        co_return co_await write_response(stream, req, ready ? http::status::ok : http::status::service_unavailable,
                                          std::move(answer), js, false);
    }
    if (get && path == "/v1/models") {
        co_return co_await write_response(stream, req, http::status::ok,
                                          models_json(f.opts.model_id, f.inst.config().requests.max_tokens,
                                                      f.tmpl.name(), tool_format_name(tool_format_of(f.tmpl.format()))),
                                          js, false);
    }
    if (get && path == "/metrics")
        co_return co_await write_response(stream, req, http::status::ok, metrics_text(metrics_snapshot(f)),
                                          "text/plain; version=0.0.4", false);
    if (post && (path == "/tokenize" || path == "/detokenize")) {
        auto reply = token_route(f.tok, path, req.body());
        if (auto* e = std::get_if<ApiError>(&reply)) co_return co_await error(f, stream, req, *e);
        co_return co_await write_response(stream, req, http::status::ok, std::move(std::get<std::string>(reply)), js,
                                          false);
    }
    co_return co_await error(f, stream, req, api_error(404, "not_found_error",
                              fmt::format("no route for {} {}", std::string(req.method_string()), path), "", ""));
}

MetricsSnapshot front_detail::metrics_snapshot(Front::Impl& f) {
    const FrontCounters& c = f.counters;
    shm::Instance& inst = f.inst;
    MetricsSnapshot m;
    if (f.opts.contexts) m.contexts = &f.opts.contexts->store().stats();
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
    m.swapped_bytes = f.inst.requests().swapped_bytes().load(std::memory_order_relaxed);
    for (size_t k = 0; k < kSloClasses; ++k) {
        m.class_ttft[k] = &c.class_ttft[k];
        m.class_itl[k] = &c.class_itl[k];
        m.class_done[k] = c.class_done[k].load(std::memory_order_relaxed);
        m.class_met[k] = c.class_met[k].load(std::memory_order_relaxed);
    }
    const FrontAdmission::Snapshot adm = f.admission.snapshot();
    m.queued_tokens = adm.queued;
    m.prefill_rate = adm.rate;
    m.prefill_rate_recent = adm.rate_recent;
    m.prefill_wide_rate = adm.wide_rate;
    m.prefill_wide_rate_recent = adm.wide_rate_recent;
    m.tokens = c.tokens.load(std::memory_order_relaxed);
    m.prompt_tokens = c.prompt_tokens.load(std::memory_order_relaxed);
    m.worker_restarts = inst.requests().worker_restarts().load(std::memory_order_relaxed);
    m.role_changes_to_prefill = inst.requests().role_changes(false).load(std::memory_order_relaxed);
    m.role_changes_to_decode = inst.requests().role_changes(true).load(std::memory_order_relaxed);
    m.passes_interrupted = inst.requests().passes_interrupted().load(std::memory_order_relaxed);
    for (int i = 0; i < kDraftSources; ++i) {
        m.drafted[i] = inst.requests().drafted(i).load(std::memory_order_relaxed);
        m.drafts_accepted[i] = inst.requests().drafts_accepted(i).load(std::memory_order_relaxed);
        m.verify_rows[i] = inst.requests().verify_rows(i).load(std::memory_order_relaxed);
    }
    m.redriven = inst.requests().redriven().load(std::memory_order_relaxed);
    m.golden_failures = inst.registry().golden_failures();
    m.in_flight = f.in_flight.load(std::memory_order_relaxed);
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
            const WorkerStats& ps = worker_stats(reg, static_cast<uint32_t>(s));
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
            w.pass_fixed_milli = ps.pass_fixed_milli.load(std::memory_order_relaxed);
            w.draft_pool_tokens = ps.draft_pool_tokens.load(std::memory_order_relaxed);
            w.draft_pool_bytes = ps.draft_pool_bytes.load(std::memory_order_relaxed);
            w.grammar_compiles = ps.grammar_compiles.load(std::memory_order_relaxed);
            w.grammar_compile_ns = ps.grammar_compile_ns.load(std::memory_order_relaxed);
            w.grammar_ahead = ps.grammar_ahead.load(std::memory_order_relaxed);
            w.grammar_ahead_ns = ps.grammar_ahead_ns.load(std::memory_order_relaxed);
        }
        return w;
    };
    const std::vector<uint64_t> routed = f.router.sent_counts();
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
awaitable<bool> front_detail::contexts(Front::Impl& f, beast::tcp_stream& stream, Request& req,
                                       const std::string& path) {
    if (!f.opts.contexts)
        co_return co_await error(f, stream, req,
                                 api_error(404, "not_found_error",
                                           "contexts are off on this server (duet serve --contexts-dir DIR)", "", ""));
    auto ends = [&](const std::string& tail) {
        return path.size() > 13 + tail.size() && path.compare(path.size() - tail.size(), tail.size(), tail) == 0;
    };
    const std::string completions = "/completions", exported = "/export";
    if (req.method() == http::verb::post && ends(completions)) {
        CompletionRun run(f, stream, req);
        co_return co_await run.start(false, path.substr(13, path.size() - 13 - completions.size()));
    }
    if (req.method() == http::verb::get && ends(exported))
        co_return co_await export_blob(f, stream, req, path.substr(13, path.size() - 13 - exported.size()));
    const std::string query = target_query(req.target());
    const std::string method(req.method_string());
    ContextService& svc = *f.opts.contexts;
    ApiReply reply = co_await asio::co_spawn(
        f.store, [&]() -> awaitable<ApiReply> { co_return svc.handle(method, path, query, req.body()); },
        use_awaitable);
    if (reply.status >= 400) f.counters.errors.fetch_add(1, std::memory_order_relaxed);
    co_return co_await write_response(stream, req, status_of(reply.status), std::move(reply.body), "application/json",
                                      reply.status == 429 ? 1000 : 0);
}

}  // namespace duet
