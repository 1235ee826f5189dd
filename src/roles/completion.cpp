// A completion in the front, in the order it runs (CompletionRun): parse,
// tokenize, admit, follow its choices (streaming if asked), finish and reply; a
// context completion's commit.
#include "roles/front_impl.h"

#include "base/fnv.h"

namespace duet {

// A FINISHED return_kv request's table names exactly the blocks its worker moved to
// its client (decode_worker.cpp, DecodeWorker::finish), positions [0, prompt + output - 1):
// ours when the slot's kv_to names us. (An adopted request's worker may have moved
// them to the dead front, whose recovery drops them: the commit then computes the
// added tokens again.)
void CompletionRun::take_returned_kv() {
    const shm::RequestTable& t = f.inst.requests();
    const uint32_t slot = c.ch[0].ref.slot;
    // Relaxed: written before the transition to FINISHED, whose acquire load we made.
    if (t.slot(slot).kv_to.load(std::memory_order_relaxed) != f.self.pack()) return;
    // Acquire pairs with the worker's release of n_blocks (and the state we saw).
    const uint32_t nb = t.slot(slot).n_blocks.load(std::memory_order_acquire);
    c.returned.svc = f.opts.contexts;
    c.returned.blocks.assign(t.blocks(slot), t.blocks(slot) + nb);
    c.returned.valid = static_cast<int64_t>(c.prompt.size() + c.ch[0].out.size()) - 1;
}

// A context completion's prompt and output join the context (on the store thread).
awaitable<std::optional<ApiError>> CompletionRun::commit_context() {
    std::vector<int32_t> added(c.prompt.begin() + static_cast<std::ptrdiff_t>(c.context_len), c.prompt.end());
    added.insert(added.end(), c.ch[0].out.begin(), c.ch[0].out.end());
    ContextService& svc = *f.opts.contexts;
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
        f.store,
        [&]() -> awaitable<ApiReply> {
            co_return svc.commit(c.context, c.context_len, added, std::move(kv), kv_valid, !c.resumed_id.empty());
        },
        use_awaitable);
    if (reply.status < 400) co_return std::nullopt;
    auto j = nlohmann::json::parse(reply.body, nullptr, false);
    std::string msg = j.is_object() && j.contains("error") ? j["error"].value("message", reply.body) : reply.body;
    co_return api_error(reply.status, "server_error", "the completion was not added to the context: " + msg, "", "");
}

awaitable<bool> CompletionRun::start(bool chat, std::string context, ResponseRun* resp) {
    c.chat = chat;
    c.resp = resp;
    c.arrived = shm::monotonic_ns();
    c.context = std::move(context);
    c.xid = std::string(req["X-Request-Id"]);
    if (c.xid.size() > 200)
        co_return co_await error(f, stream, req,
                                 api_error(400, "invalid_request_error", "X-Request-Id: at most 200 characters", "", ""));
    // The whole request (parse_completion: one pass over the body, with the route's
    // context and the priority header), then what the server's state decides.
    if (auto e = parse()) co_return co_await error(f, stream, req, *e);
    if (!c.context.empty()) {
        if (!f.opts.contexts)
            co_return co_await error(
                f, stream, req,
                api_error(404, "not_found_error", "contexts are off on this server (duet serve --contexts-dir DIR)",
                          "context"));
        ContextService& svc = *f.opts.contexts;
        auto kv = co_await asio::co_spawn(
            f.store, [&]() -> awaitable<std::variant<ContextKv, ApiReply>> { co_return svc.lease(c.context); },
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
        // No prompt: the completion continues the context itself, its last token
        // moved into the prompt.
        if (c.r.continues_context) {
            if (c.context_tokens.empty())
                co_return co_await error(f, stream, req,
                                         api_error(400, "invalid_request_error",
                                                   "'prompt' is required: the context is empty, there is nothing to "
                                                   "continue",
                                                   "prompt", ""));
            c.r.prompt_ids = {c.context_tokens.back()};
            c.context_tokens.pop_back();
        }
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
    if (auto e = tokenize_prompt()) co_return co_await error(f, stream, req, *e);
    if (c.r.echo) c.echo = c.r.prompt_ids.empty() ? c.r.prompt : f.tok.decode(c.prompt, false);
    if (!c.context_tokens.empty()) c.prompt.insert(c.prompt.begin(), c.context_tokens.begin(), c.context_tokens.end());
    auto params = request_params_of();
    if (auto* e = std::get_if<ApiError>(&params)) co_return co_await error(f, stream, req, *e);
    if (f.opts.contexts) {
        // Idle contexts never make a request fail for KV: they give way first (their
        // KV is on disk), as many as this request's choices may take at most.
        const auto bt = static_cast<uint64_t>(f.inst.config().requests.block_tokens);
        const uint64_t tokens = c.prompt.size() + std::get<RequestParams>(params).max_tokens;
        const uint64_t need = (tokens + bt - 1) / bt * static_cast<uint64_t>(c.r.n);
        ContextService& svc = *f.opts.contexts;
        if (!svc.has_room(need))
            co_await asio::co_spawn(
                f.store,
                [&]() -> awaitable<void> {
                    svc.make_room(need, c.context);
                    co_return;
                },
                use_awaitable);
    }
    c.id = c.resp ? c.resp->id : request_id();
    c.created = c.resp ? c.resp->created : static_cast<int64_t>(time(nullptr));
    if (auto e = admit(std::get<RequestParams>(params))) co_return co_await error(f, stream, req, *e);
    if (c.r.stream) co_await write_stream_head(stream, req, c);
    if (c.r.stream && c.resp && !c.client_gone) {
        c.resp->events.emplace(c.resp->rr, c.id, c.created, f.opts.model_id);
        for (const nlohmann::json& ev : c.resp->events->start())
            if (!co_await write_typed_event(stream, ev)) c.client_gone = true;
    }
    co_await follow();
    co_return co_await end_completion();
}

// Once every choice has ended (follow): a context completion's KV taken back and its
// tokens committed, then the reply. True: the connection may serve another request.
awaitable<bool> CompletionRun::end_completion() {
    if (c.detached) co_return false;  // an orphan now (detach): expire_orphans or a resume ends it
    if (c.return_kv && c.ch[0].final_state == shm::ReqState::Finished) take_returned_kv();
    // finish frees the request's slots before the commit: the commit computes the
    // closing tokens through a request of its own, and with every slot held by
    // completions waiting for the store thread a commit holding its own would find
    // none (and wait on them while they wait on it). The price: a front that dies
    // during the commit leaves nothing to resume; its client's stream ends without
    // [DONE] and the context holds the completion or not (the commit is one durable
    // step).
    // A stream stays resumable for --resume-grace after it ended: its last events may
    // never reach the client (the front killed before it wrote them, or the client's
    // connection closed with them unread).
    const bool keep = c.r.stream && keep_as_orphan();
    Outcome o = finish(keep);
    std::optional<ApiError> commit_error;
    if (!c.context.empty() && c.commit && !o.failed && !c.client_gone)
        commit_error = co_await commit_context();  // before the reply ends: acknowledged means durable
    if (c.resp && !commit_error && !o.failed && !c.client_gone) commit_error = co_await store_response(o);
    if (!c.resumed_id.empty() && !keep) f.forget_orphan(c.resumed_id);  // kept: its entry was replaced
    if (commit_error) {
        if (!c.r.stream) co_return co_await error(f, stream, req, *commit_error);
        if (c.resp && c.resp->events)
            co_await write_typed_event(stream, c.resp->events->error(*commit_error));
        else
            co_await write_event(stream, error_json(*commit_error));
        co_return false;
    }
    co_return co_await reply(o);
}

// The request body, and the model it names.
std::optional<ApiError> CompletionRun::parse() {
    if (f.draining.load(std::memory_order_relaxed))
        return api_error(503, "server_error", "the server is shutting down", "", "");
    const auto priority = req["X-Duet-Priority"];
    auto parsed = parse_completion(req.body(), c.chat, {c.context, std::string_view(priority.data(), priority.size())});
    if (auto* e = std::get_if<ApiError>(&parsed)) return *e;
    c.r = std::move(std::get<CompletionRequest>(parsed));
    c.context = c.r.context;
    c.commit = c.r.commit;
    c.cls = c.r.slo;
    if (!c.r.model.empty() && c.r.model != f.opts.model_id)
        return api_error(404, "invalid_request_error",
                         fmt::format("the model '{}' does not exist; this server has '{}'", c.r.model, f.opts.model_id),
                         "model", "model_not_found");
    // (A response's context holds its tool list from its first turn: responses_front.cpp.)
    if ((c.r.calls_tools() || c.r.tool_messages) && !c.context.empty() && !c.resp)
        return api_error(400, "invalid_request_error",
                         "tools, tool calls and tool messages are not supported in a context's completions so far",
                         c.r.calls_tools() ? "tools" : "messages");
    if (c.r.calls_tools()) {
        // The calls' grammar, in the model's format: a call, once opened, names an
        // offered function and its arguments follow that function's schema. With a
        // response_format, the content that schema takes is the alternative to calls.
        const ToolFormat tf = tool_format_of(f.tmpl.format());
        std::optional<std::string> content;
        if (c.r.grammar)
            // (json_object: any object. A structural tag's schemas are strict, where an
            // object without additionalProperties takes none: engine/grammar.cpp kAnyObject.)
            content = c.r.grammar->kind == GrammarKind::JsonObject
                          ? std::string(R"({"type": "object", "additionalProperties": true})")
                          : c.r.grammar->source;
        c.r.grammar = GrammarSpec{
            GrammarKind::StructuralTag,
            tool_grammar(tf, c.r.tools, c.r.tool_choice, c.r.parallel_tool_calls, content ? &*content : nullptr)};
        c.r.grammar_param = "tools";
        if (Status st = check_grammar(*c.r.grammar); !st)
            return api_error(400, "invalid_request_error", "tools: " + st.error().message, "tools", "");
    }
    return std::nullopt;
}

ToolCallParser front_detail::tool_parser(const std::string& completion_id, size_t index, ToolFormat f,
                                         const std::vector<std::string>& names, bool calls_only) {
    Fnv h;
    h.add(completion_id.data(), completion_id.size());
    return ToolCallParser(f, names, fmt::format("call_{:012x}_{}_", h.h & 0xffffffffffffull, index), calls_only);
}

// The prompt's tokens: the chat template's text, token ids as given, or the text.
std::optional<ApiError> CompletionRun::tokenize_prompt() {
    CompletionRequest& r = c.r;
    // Tools: their list (with the conversation's first turn), earlier calls and
    // results, in the model's tool format.
    std::vector<ChatMessage> rendered;
    std::span<const ChatMessage> msgs = r.messages;
    if (c.chat && (r.calls_tools() || r.tool_messages)) {
        const bool list = r.calls_tools() && c.context_len == 0;
        auto m = render_tool_messages(tool_format_of(f.tmpl.format()),
                                      list ? std::span<const ToolDef>(r.tools) : std::span<const ToolDef>(), r.messages,
                                      f.tmpl.default_system());
        if (!m) return api_error(400, "invalid_request_error", m.error().message, "messages", "");
        rendered = std::move(m).value();
        msgs = rendered;
    }
    if (c.chat && !c.context.empty()) {
        // The messages added to the context's conversation, the assistant's turn opened.
        auto ids = f.opts.contexts->turns().extend(c.context_len, msgs, true);
        if (!ids) return api_error(400, "invalid_request_error", ids.error().message, "messages", "");
        c.prompt = std::move(ids).value();
    } else if (c.chat) {
        auto text = f.tmpl.apply(msgs, true);
        if (!text) return api_error(400, "invalid_request_error", text.error().message, "messages", "");
        c.prompt = f.tok.encode(*text, !f.tmpl.includes_bos(), true);
    } else if (!r.prompt_ids.empty()) {
        for (int32_t id : r.prompt_ids)
            if (id >= f.tok.n_vocab())
                return api_error(400, "invalid_request_error",
                                 fmt::format("token id {} is outside the vocabulary [0, {})", id, f.tok.n_vocab()),
                                 "prompt", "");
        c.prompt = std::move(r.prompt_ids);
    } else {
        c.prompt = f.tok.encode(r.prompt, true, false);
    }
    return std::nullopt;
}

// What the workers read from each choice's slot; the prompt and max_tokens must fit
// the context.
std::variant<RequestParams, ApiError> CompletionRun::request_params_of() {
    const CompletionRequest& r = c.r;
    const int64_t n_ctx = f.inst.config().requests.max_tokens;
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
    // Its prompt's KV, and with a second token the first one's position, fit one
    // decode arena whole, or it can never run: prefill or decode would fail it after
    // computing its prompt. (Every arena has the same number of blocks, serve_plan:
    // the largest is the one.)
    {
        const shm::InstanceConfig& cfg = f.inst.config();
        const int64_t bt = std::max<int64_t>(1, cfg.requests.block_tokens);
        int64_t most = 0;
        for (const uint32_t a : decode_arenas(cfg))
            most = std::max<int64_t>(most, static_cast<int64_t>(f.inst.arena(a).n_blocks()));
        const int64_t positions = static_cast<int64_t>(c.prompt.size()) + (params.max_tokens > 1 ? 1 : 0);
        if (most > 0 && positions > most * bt)
            return api_error(400, "invalid_request_error",
                             fmt::format("the prompt ({} tokens){} takes {} positions of KV; this server's KV cache "
                                         "holds at most {} for one sequence ({} blocks of {})",
                                         c.prompt.size(), params.max_tokens > 1 ? " and a second token" : "", positions,
                                         most * bt, most, bt),
                             c.chat ? "messages" : "prompt", "context_length_exceeded");
    }
    params.stop_at_eog = r.ignore_eos ? 0 : 1;
    params.min_tokens = static_cast<uint32_t>(r.min_tokens);
    params.draft_mode = r.draft_mode;
    params.max_draft = static_cast<uint8_t>(r.max_draft);
    params.no_draft_pool = r.draft_pool ? 0 : 1;
    RequestData data;
    for (const auto& [id, bias] : r.logit_bias) {
        if (id >= f.tok.n_vocab())
            return api_error(
                400, "invalid_request_error",
                fmt::format("logit_bias: token id {} is outside the vocabulary [0, {})", id, f.tok.n_vocab()),
                "logit_bias", "");
        data.bias.push_back({id, bias});
    }
    params.n_bias = static_cast<uint32_t>(data.bias.size());
    data.grammar = r.grammar;
    data.stops = r.stop;  // the worker ends the request at the token that completes one
    if (!data.empty()) {
        c.data = encode_request_data(data);
        const size_t bytes = c.data.size(), bound = f.inst.requests().ext_bytes();
        if (bytes > bound) {  // named by its largest part
            size_t stop_bytes = 0;
            for (const std::string& x : data.stops) stop_bytes += 4 + x.size();
            const size_t grammar_bytes = r.grammar ? r.grammar->source.size() : 0, bias_bytes = data.bias.size() * 8;
            const bool grammar = grammar_bytes >= bias_bytes && grammar_bytes >= stop_bytes;
            const bool stop = !grammar && stop_bytes >= bias_bytes;
            const std::string param = grammar ? r.grammar_param : stop ? "stop" : "logit_bias";
            const std::string what = grammar ? fmt::format("{} bytes of grammar", grammar_bytes)
                                     : stop  ? fmt::format("{} stop strings of {} bytes", data.stops.size(),
                                                           stop_bytes - 4 * data.stops.size())
                                             : fmt::format("{} entries", data.bias.size());
            return api_error(400, "invalid_request_error",
                             fmt::format("{}: {} take {} bytes of request data with the rest; this server holds at "
                                         "most {} bytes per request",
                                         param, what, bytes, bound),
                             param, "request_data_too_large");
        }
        params.data_bytes = static_cast<uint32_t>(bytes);
    }
    params.logprobs = c.ranked() ? std::max(r.logprobs, 0) : r.logprobs;  // best_of ranks by them
    return params;
}

// One request per choice; choice i samples with its own seed, so choices differ
// unless decoding is greedy. Sent after all are in: the later ones then find the
// first one's prompt blocks in the prefix cache (prefill waits for them).
std::optional<ApiError> CompletionRun::admit(RequestParams params) {
    shm::RequestTable& t = f.inst.requests();
    // Admission (engine/scheduling.h A1/A2), before any slot or KV is taken. The work
    // is what prefill will compute: each choice's prompt (the n choices share cached
    // blocks, but each is its own request), less a context's offered KV.
    const auto given = static_cast<int64_t>(c.lease.blocks.empty() ? 0 : std::min<int64_t>(c.lease.valid, static_cast<int64_t>(c.prompt.size())));
    const auto prompt_tokens = (static_cast<int64_t>(c.prompt.size()) - given) * std::max(1, c.r.n);
    const AdmissionDecision d =
        f.admission.admit(c.cls, prompt_tokens, static_cast<int64_t>(c.prompt.size()),
                          RetryMemory::key(c.cls, c.prompt.data(), c.prompt.size()), c.queue_at);
    if (!d.admit) {
        (d.refusal == Refusal::Queue ? f.counters.rejected_queue
         : d.refusal == Refusal::Kv  ? f.counters.rejected_kv
                                     : f.counters.rejected_ttft)
            .fetch_add(1, std::memory_order_relaxed);
        return f.admission.refusal_error(c.cls, d);
    }
    c.queued = prompt_tokens;
    params.slo_class = c.cls;
    params.ttft_target_ns = f.admission.options().slo.of(c.cls).ttft_ns;
    params.itl_target_ns = f.admission.options().slo.of(c.cls).itl_ns;
    c.ch =
        std::vector<Choice>(static_cast<size_t>(c.r.n), Choice(f.tok, c.r.stop, static_cast<uint64_t>(c.r.min_tokens)));
    if (c.r.calls_tools()) {
        std::vector<std::string> names;
        for (const ToolDef& d : c.r.tools) names.push_back(d.name);
        for (size_t i = 0; i < c.ch.size(); ++i)
            c.ch[i].tools = tool_parser(c.id, i, tool_format_of(f.tmpl.format()), names,
                                        c.r.tool_choice.mode != ToolChoiceMode::Auto);
    }
    // A context completion: prefill starts from the context's leased blocks.
    const bool offer = !c.lease.blocks.empty() && c.ch.size() == 1;
    if (offer) {
        params.given_tokens = static_cast<uint32_t>(std::min<int64_t>(c.lease.valid, c.prompt.size()));
        params.given_by = f.self.pack();
    }
    // Its KV comes back to join the context (one shared arena: the context's).
    c.return_kv = !c.context.empty() && c.commit && c.ch.size() == 1 && !f.inst.config().kv_split;
    params.return_kv = c.return_kv ? 1 : 0;
    // Computed where the context's blocks are (offered from there, returned there).
    if (!c.context.empty()) params.bind_arena(kContextArena);
    for (size_t i = 0; i < c.ch.size(); ++i) {
        params.sampling.seed = c.r.sampling.seed + 0x9E3779B97F4A7C15ull * i;
        auto sub = t.submit(f.self, c.prompt.data(), static_cast<uint32_t>(c.prompt.size()), &params, sizeof params);
        while (!sub && f.release_ended_orphan())  // a slot kept for a resume gives way
            sub = t.submit(f.self, c.prompt.data(), static_cast<uint32_t>(c.prompt.size()), &params, sizeof params);
        // A failed offer leaves the table empty: prefill then looks the prefix up.
        if (sub && offer)
            (void)t.offer_blocks(*sub, c.lease.blocks.data(), static_cast<uint32_t>(c.lease.blocks.size()));
        if (!sub) {
            for (size_t k = 0; k < i; ++k) {  // not sent yet: nobody else knows them, the CASes hold
                (void)t.transition(c.ch[k].ref, shm::ReqState::Queued, shm::ReqState::Cancelled);
                (void)t.transition(c.ch[k].ref, shm::ReqState::Cancelled, shm::ReqState::Free);
            }
            f.counters.rejected_busy.fetch_add(1, std::memory_order_relaxed);
            f.admission.left(c.cls, std::exchange(c.queued, 0), c.queue_at);
            return api_error(429, "rate_limit_error", "the server is at capacity; retry shortly", "", "");
        }
        c.ch[i].ref = *sub;
        c.ch[i].attempt = t.attempt(sub->slot);
        // Its data before anyone sees the request (set_ext_data fails only for a
        // size checked in request_params_of, or a slot no longer ours: neither here).
        if (!c.data.empty()) (void)t.set_ext_data(*sub, c.data.data(), static_cast<uint32_t>(c.data.size()));
    }
    // Resumable after a front restart (a context's completion too: the front that
    // resumes it commits it): the record goes in before any worker sees the request.
    // (Not a response: its answer's shape and its store are not in the record.)
    if (!c.resp) {
        const std::string rec = front_record_json(c);
        for (const Choice& ch : c.ch) (void)t.set_front_data(ch.ref, rec.data(), static_cast<uint32_t>(rec.size()));
    }
    f.counters.requests.fetch_add(1, std::memory_order_relaxed);
    f.counters.prompt_tokens.fetch_add(c.prompt.size() * c.ch.size(), std::memory_order_relaxed);
    f.in_flight.fetch_add(1, std::memory_order_relaxed);  // a count for the drain and /metrics; orders nothing
    for (const Choice& ch : c.ch) f.send(ch.ref);
    f.counters.admit.observe(seconds_between(c.arrived, shm::monotonic_ns()));
    return std::nullopt;
}

// Until every choice has ended: reads each one's new tokens, streams them if asked,
// and sleeps until a slot changes. A client that closed its connection is seen at
// once, not at the second write after it (a write to a closed socket succeeds
// once): its stream is kept for a resume from then, and a request that does not
// stream is cancelled then, not computed to its end for nobody.
awaitable<void> CompletionRun::follow() {
    // The request's own "timeout", else the server's; from its arrival.
    c.deadline = c.arrived + (c.r.timeout_s > 0 ? static_cast<uint64_t>(c.r.timeout_s * 1e9)
                                                : static_cast<uint64_t>(f.opts.request_timeout_s) * 1000000000ull);
    auto timer = std::make_shared<asio::steady_timer>(stream.get_executor());
    for (;;) {
        if (!c.client_gone && peer_closed(stream)) c.client_gone = true;
        bool all_done = true;
        for (size_t ci = 0; ci < c.ch.size(); ++ci) {
            Choice& ch = c.ch[ci];
            if (ch.done) continue;
            const ChoiceStep step = read_choice(ch);
            if (c.r.stream && !c.client_gone) co_await stream_choice(ci, step);
            if (c.client_gone && !step.terminal && detach()) co_return;  // its client may come back
            if (!settle_choice(ch, step)) all_done = false;
        }
        if (all_done) break;
        co_await wait_for_change(timer);
    }
}

// The choice's state and new tokens: latency histograms, log-probs, and its text
// with the stop strings applied (a stop string cancels the request).
ChoiceStep CompletionRun::read_choice(Choice& ch) {
    shm::RequestTable& t = f.inst.requests();
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
            f.counters.ttft.observe(seconds_between(c.arrived, step.seen_ns));
            if (c.first_ns == 0) {
                c.first_ns = step.seen_ns;
                f.counters.class_ttft[static_cast<size_t>(c.cls)].observe(seconds_between(c.arrived, step.seen_ns));
            }
            if (c.queued > 0)  // prefill is done with the prompt: it leaves the queue
                f.admission.left(c.cls, std::exchange(c.queued, 0), c.queue_at);
        } else {  // several tokens at once share the gap
            const double gap = seconds_between(ch.last_token_ns, step.seen_ns) / static_cast<double>(ch.out.size() - before);
            for (size_t i = before; i < ch.out.size(); ++i) {
                f.counters.itl.observe(gap);
                f.counters.class_itl[static_cast<size_t>(c.cls)].observe(gap);
            }
            f.admission.observe_itl(gap);  // A3's time per token
            c.gap_sum += gap * static_cast<double>(ch.out.size() - before);
            c.gaps += static_cast<int64_t>(ch.out.size() - before);
        }
        ch.last_token_ns = step.seen_ns;
        if (c.r.logprobs >= 0 || c.ranked())
            read_logprobs(t, f.tok, ch, std::max(c.r.logprobs, 0), before, ch.out.size());
    }
    if (ch.feed(before, step.terminal)) {
        ch.finish = finish_reason(Finish::StopString);
        if (!step.terminal) ch.cancel(t);
    }
    return step;
}

// Streams what choice ci may release now (its first event even if empty).
awaitable<void> CompletionRun::stream_choice(size_t ci, const ChoiceStep& step) {
    Choice& ch = c.ch[ci];
    Choice::Piece piece = ch.take(step.terminal);
    if (c.resp) {  // a response's events
        if (!c.resp->events) co_return;
        for (const nlohmann::json& ev :
             c.resp->events->piece(piece.text, piece.calls, ch.tools ? ch.tools->content_at() : 0))
            if (!co_await write_typed_event(stream, ev)) c.client_gone = true;
        ch.sent_have = ch.have;
        ch.first = false;
        co_return;
    }
    if (piece.text.empty() && piece.calls.empty() && !ch.first) co_return;
    if (ch.first) piece.text.insert(0, c.echo);
    ch.sent_have = ch.have;
    if (!co_await write_event(stream,
                              chunk_json(c.r, c.id, c.created, f.opts.model_id, static_cast<int>(ci), piece.text, "",
                                         ch.first, ch.unsent(), piece.calls),
                              c.event_id()))
        c.client_gone = true;
    ch.lps_sent = ch.lps.size();
    ch.first = false;
    f.counters.stream_event.observe(seconds_between(step.seen_ns, shm::monotonic_ns()));
}

// Cancels the choice if its client left or its time ran out, and marks it done once
// it has ended (a failed one stops the others: the response is an error). Returns
// whether it is done.
bool CompletionRun::settle_choice(Choice& ch, const ChoiceStep& step) {
    shm::RequestTable& t = f.inst.requests();
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
awaitable<void> CompletionRun::wait_for_change(const std::shared_ptr<asio::steady_timer>& timer) {
    const shm::RequestTable& t = f.inst.requests();
    std::vector<std::shared_ptr<Waiter>> waiting;
    bool changed = false;
    for (const Choice& ch : c.ch)
        if (!ch.done) {
            waiting.push_back(std::make_shared<Waiter>(Waiter{ch.ref.slot, ch.have, ch.seen_state, timer}));
            f.add(waiting.back());
            changed = changed || Front::Impl::changed(t, *waiting.back());
        }
    if (!changed) {
        timer->expires_after(std::chrono::milliseconds(20));
        beast::error_code ec;
        co_await timer->async_wait(asio::redirect_error(use_awaitable, ec));
    }
    for (const auto& w : waiting) f.remove(w);
}

// Every choice has ended: the phase histograms, finish reasons, usage and the
// counters; the slots go back to FREE.
Outcome CompletionRun::finish(bool keep) {
    shm::RequestTable& t = f.inst.requests();
    Outcome o;
    o.u = Usage{static_cast<int64_t>(c.prompt.size()), 0, 0};
    for (Choice& ch : c.ch) {
        const shm::ReqSlot& s = t.slot(ch.ref.slot);
        const uint64_t q = s.prefill_ns.load(std::memory_order_relaxed), h = s.handoff_ns.load(std::memory_order_relaxed),
                       d = s.first_step_ns.load(std::memory_order_relaxed);
        f.counters.e2e.observe(seconds_between(c.arrived, shm::monotonic_ns()));
        if (q >= s.submit_ns && q != 0) f.counters.queue.observe(seconds_between(s.submit_ns, q));
        if (h >= q && q != 0 && h != 0) f.counters.prefill.observe(seconds_between(q, h));
        if (d >= h && h != 0 && d != 0) f.counters.handoff.observe(seconds_between(h, d));
        o.u.cached_tokens += s.n_cached.load(std::memory_order_relaxed);
        {
            const int64_t drafted = s.n_drafted.load(std::memory_order_relaxed);
            const int64_t kept = s.n_draft_kept.load(std::memory_order_relaxed);
            o.u.drafted += drafted;
            o.u.drafts_kept += std::min(kept, drafted);
        }
        if (ch.finish.empty() && ch.final_state == shm::ReqState::Cancelled && c.timed_out) {
            ch.finish = finish_reason(Finish::Timeout);  // duet's extension: ended by its "timeout"
            f.counters.timeouts.fetch_add(1, std::memory_order_relaxed);
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
        f.counters.tokens.fetch_add(ch.out.size(), std::memory_order_relaxed);
        if (ch.final_state == shm::ReqState::Failed) {
            o.failed = true;
            o.error_code = t.slot(ch.ref.slot).error_code.load(std::memory_order_relaxed);
        }
        if (!keep) (void)t.transition(ch.ref, ch.final_state, shm::ReqState::Free);  // ended: the front's alone
        // A stream's closing chunk still sends the logprobs not streamed yet (unsent):
        // keep them; a whole reply takes them.
        o.texts.push_back({(c.r.stream ? "" : c.echo) + ch.watch.text.text(),
                           ch.finish,
                           c.r.stream ? ch.lps : std::move(ch.lps),
                           {}});
        if (ch.tools && !c.r.stream) {  // the whole text split as a stream of it would be
            o.texts.back().text = ch.tools->feed(o.texts.back().text, true).content;
            o.texts.back().tool_calls = ch.tools->calls();
            o.texts.back().content_at = ch.tools->content_at();
            o.texts.back().finish_reason = ch.reason();
        } else if (ch.tools) {  // streamed: what its parser will have made once fed the rest
            ToolCallParser whole = *ch.tools;
            whole.feed(std::string_view(ch.watch.text.text()).substr(ch.watch.text.taken()), true);
            o.texts.back().text = whole.content();
            o.texts.back().tool_calls = whole.calls();
            o.texts.back().content_at = whole.content_at();
            if (!whole.calls().empty() && ch.finish == "stop") o.texts.back().finish_reason = "tool_calls";
        }
    }
    if (c.ranked()) keep_best(o.texts, static_cast<size_t>(c.keep));
    o.u.cached_tokens = std::min<int64_t>(o.u.cached_tokens, o.u.prompt_tokens);  // one prompt, however many choices
    if (o.failed)
        f.counters.failed.fetch_add(1, std::memory_order_relaxed);
    else if (c.ch[0].final_state == shm::ReqState::Cancelled)
        f.counters.cancelled.fetch_add(1, std::memory_order_relaxed);
    else
        f.counters.finished.fetch_add(1, std::memory_order_relaxed);
    // Ended without a first token: its prompt leaves the queue unmeasured.
    if (c.queued > 0) f.admission.left(c.cls, std::exchange(c.queued, 0), c.queue_at);
    // SLO attainment: a completion that ended without failing meets its class's
    // targets when its first token came within the TTFT target and its tokens, on
    // average, within the ITL target.
    if (!o.failed && c.first_ns != 0) {
        const size_t k = static_cast<size_t>(c.cls);
        const SloTarget& target = f.admission.options().slo.of(c.cls);
        const bool met = c.first_ns - c.arrived <= target.ttft_ns &&
                         (c.gaps == 0 || c.gap_sum / static_cast<double>(c.gaps) <= static_cast<double>(target.itl_ns) / 1e9);
        f.counters.class_done[k].fetch_add(1, std::memory_order_relaxed);
        if (met) f.counters.class_met[k].fetch_add(1, std::memory_order_relaxed);
    }
    f.in_flight.fetch_sub(1, std::memory_order_relaxed);
    return o;
}

// A completion's answer once every choice has ended: the stream's last events, or
// the whole response (or its error).
awaitable<bool> CompletionRun::reply(const Outcome& o) {
    if (c.r.stream) co_return co_await reply_stream(o);
    if (o.failed) co_return co_await error(f, stream, req, failure(o.error_code));
    std::string body;
    if (c.resp) {
        const ResponseOutcome ro = response_outcome(c, o);
        body = response_json(c.resp->rr, c.id, c.created, f.opts.model_id, &ro)
                   .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    } else {
        body = completion_json(c.r, c.id, c.created, f.opts.model_id, o.texts, o.u);
    }
    auto res = make_response(http::status::ok, std::move(body), req);
    beast::error_code ec;
    co_await http::async_write(stream, res, asio::redirect_error(use_awaitable, ec));
    co_return !ec;
}

// The stream's last events: each choice's rest and finish reason (or the error),
// usage if asked, [DONE], and the last chunk.
awaitable<bool> CompletionRun::reply_stream(const Outcome& o) {
    if (c.client_gone) co_return false;
    bool ok = true;
    if (o.failed && c.resp) {  // a Responses stream's error event, and its end
        if (co_await write_typed_event(stream, c.resp->events->error(failure(o.error_code)))) {
            beast::error_code ec;
            co_await asio::async_write(stream, http::make_chunk_last(), asio::redirect_error(use_awaitable, ec));
        }
        co_return false;
    } else if (o.failed) {
        ok = co_await write_event(stream, error_json(failure(o.error_code)));
    } else if (c.resp) {  // the rest, the items' ends, response.completed
        Choice::Piece piece = c.ch[0].take(true);
        std::vector<nlohmann::json> evs =
            c.resp->events->piece(piece.text, piece.calls, c.ch[0].tools ? c.ch[0].tools->content_at() : 0);
        const ResponseOutcome ro = response_outcome(c, o);
        for (nlohmann::json& ev : c.resp->events->finish(ro)) evs.push_back(std::move(ev));
        for (size_t i = 0; ok && i < evs.size(); ++i) ok = co_await write_typed_event(stream, evs[i]);
        if (!ok) co_return false;
        beast::error_code ec;
        co_await asio::async_write(stream, http::make_chunk_last(), asio::redirect_error(use_awaitable, ec));
        co_return !ec;
    } else {
        for (Choice& ch : c.ch) ch.sent_have = ch.have;
        for (size_t ci = 0; ok && ci < c.ch.size(); ++ci) {
            Choice::Piece piece = c.ch[ci].take(true);
            ok = co_await write_event(stream,
                                      chunk_json(c.r, c.id, c.created, f.opts.model_id, static_cast<int>(ci),
                                                 piece.text, c.ch[ci].reason(), false, c.ch[ci].unsent(), piece.calls),
                                      c.event_id());
        }
        if (ok && c.r.include_usage)
            ok = co_await write_event(stream, usage_chunk_json(c.r, c.id, c.created, f.opts.model_id, o.u));
    }
    if (ok) ok = co_await write_event(stream, "[DONE]");
    if (!ok) co_return false;
    beast::error_code ec;
    co_await asio::async_write(stream, http::make_chunk_last(), asio::redirect_error(use_awaitable, ec));
    co_return !ec;
}

}  // namespace duet
