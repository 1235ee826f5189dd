// A response that outlives its connection or its front: front records in the
// request slots, streams kept for a client that left or that may not have read their
// end (--resume-grace), and requests adopted from a dead front, answered again
// (resume).
#include "base/log.h"
#include "roles/front_impl.h"

namespace duet {

namespace front_detail {

// What a restarted front needs to answer a request's client again, kept in the
// request's slots (shm::ReqFrontRecord, JSON): the response's id and creation time,
// how its chunks are made, and every choice's slot.
std::string front_record_json(const Completion& c) {
    json slots = json::array();
    for (const Choice& ch : c.ch) slots.push_back({ch.ref.slot, ch.ref.gen});
    json names = json::array();  // its calls are parsed (tools)
    if (c.r.calls_tools())
        for (const ToolDef& d : c.r.tools) names.push_back(d.name);
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
                {"min_tokens", c.r.min_tokens},
                {"prompt_tokens", c.prompt.size()},
                {"slots", slots},
                {"context", c.context},
                {"context_len", c.context_len},
                {"commit", c.commit},
                {"return_kv", c.return_kv},
                {"echo", c.echo},
                {"keep", c.keep},
                {"tool_names", names},
                {"tool_calls_only", c.r.tool_choice.mode != ToolChoiceMode::Auto}}
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
        f.r.min_tokens = j.value("min_tokens", int64_t{0});
        f.prompt_tokens = j.at("prompt_tokens").get<size_t>();
        for (const json& s : j.at("slots")) f.refs.push_back(shm::ReqRef{s.at(0).get<uint32_t>(), s.at(1).get<uint32_t>()});
        f.r.n = static_cast<int>(f.refs.size());
        f.context = j.value("context", std::string());
        f.context_len = j.value("context_len", size_t{0});
        f.commit = j.value("commit", true);
        f.return_kv = j.value("return_kv", false);
        f.echo = j.value("echo", std::string());
        f.keep = std::clamp(j.value("keep", f.r.n), 1, f.r.n);
        f.tool_names = j.value("tool_names", std::vector<std::string>());
        f.tool_calls_only = j.value("tool_calls_only", false);
        if (f.refs.empty()) return std::nullopt;
        return f;
    } catch (const std::exception&) {
        return std::nullopt;
    }
}

}  // namespace front_detail

// A stream kept for its client after it left or after the stream ended, as an
// orphan of this front's own for --resume-grace: a client that comes back
// (Last-Event-ID) gets the rest exactly as if the front had died. An SSE client
// reconnects after any lost connection and cannot tell which side dropped it, nor
// whether the end was written before: a front SIGKILLed just after the client closed
// would otherwise have cancelled the request first (then its resume was cut short, or
// answered 404), and one SIGKILLed between freeing an ended stream's slots and
// writing its last events (or after writing them into a connection the client had
// already closed) left nothing to resume (404). False: not resumable (no grace, no
// front record, not a stream, or a context's or a response's: their commit belongs to
// the connection that asked).
bool CompletionRun::keep_as_orphan() {
    if (!c.r.stream || f.opts.resume_grace_ns == 0 || c.ch.empty() || !c.context.empty() || c.resp) return false;
    shm::RequestTable& t = f.inst.requests();
    auto rec = t.front_data(c.ch[0].ref);
    if (!rec) return false;
    auto fr = parse_front_record(*rec);
    if (!fr) return false;
    Orphan o;
    o.rec = std::move(*fr);
    o.since_ns = shm::monotonic_ns();
    o.window_ns = f.opts.resume_grace_ns;
    for (const Choice& ch : c.ch) o.attempts.push_back(ch.attempt);
    std::lock_guard<std::mutex> lock(f.orphans_mu);
    f.orphans.insert_or_assign(c.id, std::move(o));  // a resumed orphan's entry is replaced, unclaimed
    return true;
}

// A stream whose client disconnected before it ended: kept instead of cancelled
// (keep_as_orphan). False: the caller cancels it.
bool CompletionRun::detach() {
    if (!keep_as_orphan()) return false;
    // It leaves the connection: the queue and in-flight counts as when it ends.
    if (c.queued > 0) f.admission.left(c.cls, std::exchange(c.queued, 0), c.queue_at);
    f.in_flight.fetch_sub(1, std::memory_order_relaxed);
    c.detached = true;
    return true;
}

std::optional<std::string> front_detail::orphan_of_xid(Front::Impl& f, const std::string& xid) {
    if (xid.empty()) return std::nullopt;
    std::lock_guard<std::mutex> lock(f.orphans_mu);
    for (const auto& [id, o] : f.orphans)
        if (o.rec.xid == xid) return id;
    return std::nullopt;
}

awaitable<bool> CompletionRun::resume(const std::string& id, bool events) {
    std::optional<FrontRecord> fr;
    std::vector<uint32_t> attempts;  // each choice's attempt this front last sent
    bool busy = false;
    {
        std::lock_guard<std::mutex> lock(f.orphans_mu);
        auto it = f.orphans.find(id);
        if (it != f.orphans.end() && !it->second.expiring) {
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
        co_return co_await error(
            f, stream, req,
            api_error(404, "not_found_error",
                      fmt::format("no request '{}' to resume: resumable are the requests of a front "
                                  "that died, for {} s after it, and streams, for {} s after "
                                  "their client disconnected or they ended",
                                  id, f.opts.resume_window_ns / 1000000000ull, f.opts.resume_grace_ns / 1000000000ull),
                      "", "request_not_found"));
    auto unclaim = [&](bool forget) {
        std::lock_guard<std::mutex> lock(f.orphans_mu);
        auto it = f.orphans.find(id);
        if (it == f.orphans.end()) return;
        if (forget)
            f.orphans.erase(it);
        else
            it->second.claimed = false;
    };
    shm::RequestTable& t = f.inst.requests();
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
        Choice ch(f.tok, c.r.stop, static_cast<uint64_t>(c.r.min_tokens));
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
        if (c.r.logprobs >= 0 || c.ranked()) read_logprobs(t, f.tok, ch, std::max(c.r.logprobs, 0), 0, ch.out.size());
        if (ch.feed(0, false)) ch.finish = finish_reason(Finish::StopString);
        if (!fr->tool_names.empty())
            ch.tools = tool_parser(c.id, i, tool_format_of(f.tmpl.format()), fr->tool_names, fr->tool_calls_only);
        // Streamed: what was sent, through the calls' parser too; whole: the parser
        // takes the whole text at the end (finish).
        if (c.r.stream)
            (void)ch.take(false);
        else
            (void)ch.watch.text.take(false);
        ch.lps_sent = ch.lps.size();
        ch.sent_have = ch.have;
        ch.first = last.empty();
        ch.last_token_ns = now;  // no time to first token for an adopted request
        c.ch.push_back(std::move(ch));
    }
    for (Choice& ch : c.ch)
        if (!ch.finish.empty()) ch.cancel(t);  // its stop string is in what was sent
    f.in_flight.fetch_add(1, std::memory_order_relaxed);
    if (c.r.stream) co_await write_stream_head(stream, req, c);
    co_await follow();
    co_return co_await end_completion();  // forgets the orphan
}

void Front::Impl::forget_orphan(const std::string& id) {
    std::lock_guard<std::mutex> lock(orphans_mu);
    orphans.erase(id);
}

// Kept streams hold their slots only while nobody else needs one: a submit that found
// none frees the one kept longest whose choices have all ended and that no connection
// is answering (its client, if it comes back, gets 404 as after the grace). Adopted
// streams of a dead front too, not its context completions.
bool Front::Impl::release_ended_orphan() {
    shm::RequestTable& t = inst.requests();
    std::lock_guard<std::mutex> lock(orphans_mu);
    auto oldest = orphans.end();
    for (auto it = orphans.begin(); it != orphans.end(); ++it) {
        const Orphan& o = it->second;
        // A context completion adopted from a dead front waits for its client's commit.
        if (o.claimed || !o.rec.context.empty() || (oldest != orphans.end() && o.since_ns >= oldest->second.since_ns))
            continue;
        bool ended = true;
        for (shm::ReqRef r : o.rec.refs) {
            const shm::ReqState st = t.state(r.slot);
            ended = ended && (t.current(r.slot).gen != r.gen || st == shm::ReqState::Finished ||
                              st == shm::ReqState::Failed || st == shm::ReqState::Cancelled);
        }
        if (ended) oldest = it;
    }
    if (oldest == orphans.end()) return false;
    for (shm::ReqRef r : oldest->second.rec.refs)
        if (t.current(r.slot).gen == r.gen) (void)t.transition(r, t.state(r.slot), shm::ReqState::Free);
    orphans.erase(oldest);
    return true;
}

// Requests of a dead front with a front record: this process answers them from now
// on (their client comes back, or the window passes). QUEUED ones are sent again (a
// prefill worker drops a copy whose request it already took).
void Front::Impl::adopt_orphans() {
    shm::RequestTable& t = inst.requests();
    const shm::Registry& reg = inst.registry();
    std::vector<shm::ReqRef> queued;
    size_t n = 0;
    {
        std::lock_guard<std::mutex> lock(orphans_mu);
        const uint64_t now = shm::monotonic_ns();
        for (uint32_t s = 0; s < t.n_slots(); ++s) {
            if (t.state(s) == shm::ReqState::Free) continue;
            const uint64_t client = t.slot(s).client.load(std::memory_order_acquire);
            if (client == 0 || client == self.pack() || reg.alive(shm::ProcRef::unpack(client))) continue;
            auto rec = t.front_data(t.current(s));
            if (!rec) continue;
            auto fr = parse_front_record(*rec);
            if (!fr || orphans.count(fr->id)) continue;
            // A context completion is answered by a front that can commit it; one
            // without contexts leaves it to the launcher's sweep.
            if (!fr->context.empty() && !opts.contexts) continue;
            for (shm::ReqRef r : fr->refs)
                if (t.set_client(r, self) && t.state(r.slot) == shm::ReqState::Queued) queued.push_back(r);
            Orphan o;
            o.since_ns = now;
            o.window_ns = opts.resume_window_ns;
            for (shm::ReqRef r : fr->refs) o.attempts.push_back(t.attempt(r.slot));
            const std::string id = fr->id;
            o.rec = std::move(*fr);
            orphans.emplace(id, std::move(o));
            ++n;
        }
    }
    for (shm::ReqRef r : queued) (void)send(r);
    if (n)
        log::notice(fmt::format("adopted {} requests of a front that died (resumable for {} s)", n,
                                opts.resume_window_ns / 1000000000ull));
}

// Orphans nobody came back for within the window: cancelled, then freed once ended.
void Front::Impl::expire_orphans(uint64_t now) {
    shm::RequestTable& t = inst.requests();
    std::lock_guard<std::mutex> lock(orphans_mu);
    for (auto it = orphans.begin(); it != orphans.end();) {
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
                if (st == shm::ReqState::Finished && o.rec.return_kv && opts.contexts &&
                    t.slot(r.slot).kv_to.load(std::memory_order_relaxed) == self.pack()) {
                    const uint32_t nb = t.slot(r.slot).n_blocks.load(std::memory_order_acquire);
                    opts.contexts->release(std::span<const int32_t>(t.blocks(r.slot), nb));
                }
                (void)t.transition(r, st, shm::ReqState::Free);  // ended: the front's alone
                continue;
            }
            if (!o.expiring) {
                t.cancel(r);
                // (Not queued any more: the worker holding it sees the cancel flag.)
                (void)t.transition(r, shm::ReqState::Queued, shm::ReqState::Cancelled);
                cancelled = true;
            }
            ended = false;
        }
        if (cancelled) counters.cancelled.fetch_add(1, std::memory_order_relaxed);  // its client never came back
        o.expiring = true;
        it = ended ? orphans.erase(it) : std::next(it);
    }
}

}  // namespace duet
