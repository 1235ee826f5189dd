#include "roles/decode_worker.h"

#include "base/log.h"

#include "base/trace.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <optional>
#include <utility>

#include <fmt/format.h>

#include "engine/backends.h"
#include "engine/scheduling.h"
#include "model/fingerprint.h"
#include "roles/claims.h"
#include "roles/sd_notify.h"
#include "roles/worker_stats.h"

namespace duet {

static_assert(kDraftSources == shm::RequestTableHeader::kDraftSources, "a counter for each drafter");

Result<std::unique_ptr<DecodeWorker>> DecodeWorker::create(shm::Instance& inst, const Model& model,
                                                           const WorkerOptions& o) {
    std::unique_ptr<DecodeWorker> w(new DecodeWorker());
    if (Status st = w->init(inst, model, shm::Role::Decode, o); !st) return st.error();
    w->opts_.max_draft = server_draft_tokens(o.max_draft, o.device.cuda);
    for (uint32_t p = 0; p < w->rings_.n_prefill; ++p)
        if (w->rings_.linked(p, o.index)) w->in_.emplace_back(inst.ring(w->rings_.to_decode(p, o.index)));
    worker_stats(inst.registry(), w->self_.slot)
        .max_items.store(static_cast<uint64_t>(std::max(1, o.max_batch)), std::memory_order_relaxed);
    // Always there: a request may ask for drafts where the server's default is off.
    w->drafter_ = std::make_unique<PromptLookupDrafter>();
    if (o.draft_pool_tokens > 0) {
        w->pool_drafts_ = std::make_unique<NgramPool>(static_cast<size_t>(o.draft_pool_tokens));
        worker_stats(inst.registry(), w->self_.slot)
            .draft_pool_bytes.store(w->pool_drafts_->memory_bytes(), std::memory_order_relaxed);
    }
    w->publish_load();
    return w;
}

DecodeWorker::~DecodeWorker() {
    for (Active& a : active_) a.seq.release(*pool_);
    for (Active& a : parked_) a.seq.release(*pool_);
}

bool DecodeWorker::has_work() {
    if (!active_.empty() || !parked_.empty()) return true;
    for (auto& in : in_)
        if (in.readable()) return true;
    return false;
}

void DecodeWorker::publish_load() {
    uint64_t tokens = 0;
    for (const Active& a : active_) tokens += static_cast<uint64_t>(a.seq.n_tokens());
    for (const Active& a : parked_) tokens += static_cast<uint64_t>(a.seq.n_tokens());
    WorkerBase::publish_load(static_cast<uint32_t>(active_.size() + parked_.size()), tokens);
}

void DecodeWorker::finish(std::vector<Active>& from, size_t i, shm::ReqState to) {
    shm::RequestTable& t = inst_->requests();
    Active& a = from[i];
    if (to == shm::ReqState::Finished && a.params.return_kv) {
        // The blocks go back to the client. The rule its reader relies on: a FINISHED
        // return_kv request's table names exactly the blocks the client now holds a
        // reference on (none when it is gone). The table is emptied, then names them
        // all, then each reference moves, before the transition publishes FINISHED.
        const shm::ProcRef client = shm::ProcRef::unpack(t.slot(a.req.slot).client.load(std::memory_order_relaxed));
        const int32_t to_user = inst_->arena(arena_).user_of(client);
        (void)t.reset_blocks(a.req);
        if (to_user >= 0 &&
            t.append_blocks(a.req, a.seq.blocks().data(), static_cast<uint32_t>(a.seq.blocks().size())).ok()) {
            for (int32_t b : a.seq.detach())
                if (!inst_->arena(arena_).transfer(user_, static_cast<uint32_t>(to_user), b)) alloc_->unref(b);
            t.slot(a.req.slot).kv_to.store(client.pack(), std::memory_order_relaxed);  // published by the transition
        }
    }
    // Its blocks, the answer's too, join the prefix cache before they go: a client
    // that sends the conversation back (the next chat turn) finds the answer's KV as
    // it finds the prompt's, instead of computing it again. KV is a function of the
    // tokens alone (the invariance contract), so decode's is what prefill would make.
    // (Not a return_kv request's: its blocks went to its client. Not in an arena of
    // decode's own, kv_split: prefill looks its prompts up in its arena alone.)
    if (to == shm::ReqState::Finished && !a.params.return_kv && opts_.prefix_cache && !inst_->config().kv_split)
        publish_blocks(a);
    // (A recoverer that took this worker for dead may hold the request now: its
    // KV here is released all the same.)
    (void)t.transition(a.req, shm::ReqState::Decoding, to);
    a.seq.release(*pool_);
    forget_grammar(a.req);
    // What the model wrote (a cancelled request's part too) drafts for the next ones.
    if (pool_drafts_ && to != shm::ReqState::Failed && !a.params.no_draft_pool) {
        pool_drafts_->add(a.output);
        worker_stats(inst_->registry(), self_.slot)
            .draft_pool_tokens.store(pool_drafts_->held(), std::memory_order_relaxed);
    }
    from[i] = std::move(from.back());
    from.pop_back();
}

void DecodeWorker::publish_blocks(const Active& a) {
    const auto bt = static_cast<size_t>(pool_->layout().block_tokens);
    const size_t valid = std::min(static_cast<size_t>(a.seq.n_tokens()), a.prompt.size() + a.output.size());
    const size_t full = valid / bt;
    if (full == 0) return;
    std::vector<int32_t> all(a.prompt);
    all.insert(all.end(), a.output.begin(), a.output.end());
    std::vector<shm::BlockHash> hashes;
    hashes.reserve(full);
    shm::BlockHash h;
    for (size_t i = 0; i < full; ++i) {
        h = hasher_.hash(h, all.data() + i * bt, bt, model_->fingerprint(), {});
        hashes.push_back(h);
    }
    (void)kv_->publish_prefix(a.seq, hashes, 0, static_cast<int64_t>(valid));
}

// Preemption by recompute: the sequence's KV is dropped and its request goes back to
// QUEUED with its output so far, owned by its client, which sends it to prefill again
// (CompletionRun::read_choice); prefill computes prompt + output (its re-drive path) and
// the request continues token-identically (the invariance contract: chunking and
// batching never change a sequence's logits; sampling is keyed by seed and position).
// It keeps its place: its prefill deadline counts from its first submission. False
// when the request is no longer ours to move (cancelled meanwhile: it ends as such).
bool DecodeWorker::preempt(std::vector<Active>& from, size_t i) {
    shm::RequestTable& t = inst_->requests();
    Active& a = from[i];
    const shm::ProcRef client = shm::ProcRef::unpack(t.slot(a.req.slot).client.load(std::memory_order_relaxed));
    if (t.cancelled(a.req)) return false;
    // Published by the transition: prefill reads the blob, or computes them all.
    const uint32_t swapped = swap_out(a);
    t.slot(a.req.slot).n_swapped.store(swapped, std::memory_order_relaxed);
    (void)t.reset_blocks(a.req);  // the table names no block of ours past this point
    if (!t.transition(a.req, shm::ReqState::Decoding, shm::ReqState::Queued, client)) {
        if (swapped) ::unlink(swap_path(a.req).c_str());
        return false;
    }
    a.seq.release(*pool_);
    draft_memory_.keep(req_key(a.req), {a.pace, a.odds});
    from[i] = std::move(from.back());
    from.pop_back();
    return true;
}

bool DecodeWorker::end_cancelled(std::vector<Active>& from) {
    bool any = false;
    for (size_t i = 0; i < from.size();) {
        if (inst_->requests().cancelled(from[i].req)) {
            finish(from, i, shm::ReqState::Cancelled);
            any = true;
        } else {
            ++i;
        }
    }
    return any;
}

std::vector<DecodeSeqView> DecodeWorker::views_of(const std::vector<Active>& v) {
    std::vector<DecodeSeqView> out(v.size());
    for (size_t i = 0; i < v.size(); ++i) out[i] = {v[i].admitted, v[i].seq.n_tokens(), v[i].params.class_rank()};
    return out;
}

// New hand-offs join at a step boundary. Every hand-off in the rings is taken (up
// to the batch size again, waiting: parked_), so that one waiting for a slot never
// holds up a more urgent one behind it in its ring. Parked ones join the batch most
// urgent first (class, then first submission); with every slot taken, a parked one
// of a more urgent class takes the slot of a less urgent sequence (pick_slot_victim:
// preempted as for a KV shortage, swapped or recomputed, keeping its place).
bool DecodeWorker::take_handoffs() {
    shm::RequestTable& t = inst_->requests();
    const size_t room = static_cast<size_t>(std::max(1, opts_.max_batch));
    for (size_t r = 0; r < in_.size(); ++r) {
        auto& in = in_[(first_in_ + r) % in_.size()];
        size_t n = 0;
        const WireMsg* m = in.peek(&n);
        size_t used = 0;
        for (; used < n && active_.size() + parked_.size() < 2 * room; ++used) {
            const WireMsg& w = m[used];
            shm::Handoff h{{w.slot, w.gen}, w.attempt, {w.from_slot, w.from_gen}, w.from_user};
            if (!shm::handoff_accept(inst_->arena(arena_), t, h, self_, user_)) continue;
            worker_stats(inst_->registry(), self_.slot).served.fetch_add(1, std::memory_order_relaxed);
            Active a;
            a.req = h.req;
            a.params = request_params(t, h.req.slot);
            const uint32_t np = t.slot(h.req.slot).n_prompt.load(std::memory_order_relaxed);
            a.prompt.assign(t.tokens(h.req.slot), t.tokens(h.req.slot) + np);
            (void)t.read_output(h.req, 0, a.output);
            const uint32_t nb = t.slot(h.req.slot).n_blocks.load(std::memory_order_acquire);
            std::vector<int32_t> blocks(t.blocks(h.req.slot), t.blocks(h.req.slot) + nb);
            alloc_->handed_by(h.from_user, blocks);
            // Every token but the newest output has its KV in the blocks.
            a.seq = KvSeq::adopt(std::move(blocks), static_cast<int64_t>(np + a.output.size()) - 1);
            a.fresh = true;
            // Its order is its first submission's time: a request preempted and back
            // again keeps its place (it is not the newest, so not the next victim).
            a.admitted = t.slot(h.req.slot).submit_ns;
            if (const auto kept = draft_memory_.take(req_key(h.req))) {  // preempted here before: drafting as it was
                a.pace = kept->pace;
                a.odds = kept->odds;
            }
            Result<RequestData> data = read_request_data(t, h.req, a.params);
            if (data) {
                a.data = std::move(data).value();
                // (Prefill ended a request whose outputs complete a stop string: none comes here.)
                bool ended = false;
                a.stops = watch_stops(a.params, a.data, a.output, &ended);
                if (Status st = prepare_grammar(h.req, a.data, a.output); !st) data = st.error();
            }
            parked_.push_back(std::move(a));
            if (!data) {  // honoured or refused: never run without it
                log::error(data.error().message, {request_field(h.req), request_id_field(inst_->requests(), h.req)});
                t.slot(h.req.slot).error_code.store(static_cast<int32_t>(ReqError::Data), std::memory_order_relaxed);
                finish(parked_, parked_.size() - 1, shm::ReqState::Failed);
                inst_->registry().wake(shm::Role::Front);
            }
        }
        in.release(used);
    }
    first_in_ = (first_in_ + 1) % in_.size();
    const bool dropped = end_cancelled(parked_);  // cancelled while they waited: they displace nobody
    while (!parked_.empty()) {
        size_t p = 0;
        for (size_t i = 1; i < parked_.size(); ++i)
            if (parked_[i].params.class_rank() < parked_[p].params.class_rank() ||
                (parked_[i].params.slo_class == parked_[p].params.slo_class &&
                 parked_[i].admitted < parked_[p].admitted))
                p = i;
        if (active_.size() >= room) {
            const size_t v = pick_slot_victim(views_of(active_), parked_[p].params.class_rank());
            if (v == SIZE_MAX) break;  // it waits for a slot to end
            if (!preempt(active_, v)) finish(v, shm::ReqState::Cancelled);  // cancelled meanwhile: leaving anyway
            inst_->registry().wake(shm::Role::Front);
        }
        active_.push_back(std::move(parked_[p]));
        parked_[p] = std::move(parked_.back());
        parked_.pop_back();
    }
    return dropped;
}

uint64_t DecodeWorker::yield_budget() const {
    std::vector<StreamPace> pace;
    const uint64_t now = shm::monotonic_ns();
    for (const Active& a : active_)
        pace.push_back({a.params.itl_target_ns, now - std::min(now, a.first_step_ns),
                        static_cast<uint64_t>(a.output.size() - a.first_step_tokens)});
    return yield_budget_ns(pace, kYieldPace, kYieldMaxNs);
}

// The fastest running prefill worker's measured rate (its WorkerStats work counters),
// once it has kRateEvidenceTokens behind it; 0 before.
double DecodeWorker::prefill_rate() const {
    const shm::Registry& reg = inst_->registry();
    double best = 0;
    for (uint32_t s = 0; s < reg.n_slots(); ++s) {
        if (!reg.running_as(s, shm::Role::Prefill)) continue;
        const OwnPassWork w = own_pass_work(worker_stats(reg, s));
        if (w.busy_ns > 0 && w.tokens >= static_cast<uint64_t>(kRateEvidenceTokens))
            best = std::max(best, static_cast<double>(w.tokens) * 1e9 / static_cast<double>(w.busy_ns));
    }
    return best;
}

// Swap or recompute (choose_preemption): the swap rate is this worker's measured
// writes (an exponential average over swaps; on a GPU the device-to-host copy
// included), 1 GB/s before the first: the order of a page-cache write here, and what
// a first choice needs only roughly (on the CPU swap wins by 50x; on a GPU, whose
// prefill is fast, the measured rates decide, and the first swap measures ours).
uint32_t DecodeWorker::swap_out(Active& a) {
    const int64_t n = a.seq.n_tokens();
    // A request that started from its client's blocks (a context's) is computed again
    // from them: prefill ignores a swap blob for it (take_given), so none is written.
    if (!swap_ || n <= 0 || a.params.given_tokens > 0) return 0;
    const uint64_t bytes = static_cast<uint64_t>(n) * pool_->layout().bytes_per_token();
    const double rate = swap_rate_ > 0 ? swap_rate_ : 1e9;
    if (choose_preemption(bytes, n, rate, prefill_rate()) != PreemptMode::Swap) return 0;
    std::vector<int32_t> tokens = a.prompt;
    tokens.insert(tokens.end(), a.output.begin(), a.output.end());
    const auto t0 = std::chrono::steady_clock::now();
    // GPU KV: the stage reads it on a stream of its own; a copy-on-write copy queued
    // on the backend's stream (a reservation that failed part way) must land first.
    if (swap_stage_) {
        if (Status st = backend_->sync(); !st) {
            log::warning(fmt::format("swap of request {}.{}: {} (it is computed again)", a.req.slot, a.req.gen,
                                     st.error().message),
                         {request_field(a.req), request_id_field(inst_->requests(), a.req)});
            return 0;
        }
    }
    // No fsync: a crash re-drives the request, which then computes its KV again.
    auto h = staged_blob_write(swap_io(), swap_path(a.req), ident_, a.seq, tokens, 0, static_cast<uint64_t>(n), false);
    if (!h) {
        log::warning(fmt::format("swap of request {}.{} failed (it is computed again): {}", a.req.slot, a.req.gen,
                                 h.error().message),
                     {request_field(a.req), request_id_field(inst_->requests(), a.req)});
        return 0;
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double measured = static_cast<double>(bytes) / std::max(s, 1e-6);
    swap_rate_ = swap_rate_ > 0 ? 0.7 * swap_rate_ + 0.3 * measured : measured;
    inst_->requests().swaps().fetch_add(1, std::memory_order_relaxed);
    inst_->requests().swapped_bytes().fetch_add(bytes, std::memory_order_relaxed);
    return static_cast<uint32_t>(n);
}

DecodeStep DecodeWorker::plan_step(int64_t available) {
    const shm::RequestTable& t = inst_->requests();
    const KvBlockAllocator& al = pool_->allocator();
    const int64_t bt = pool_->layout().block_tokens;
    const uint64_t now = shm::monotonic_ns();
    std::vector<DecodeRowView> rows(active_.size());
    std::vector<DraftRowView> proposed(active_.size());
    for (size_t i = 0; i < active_.size(); ++i) {
        Active& a = active_[i];
        a.row.assign(1, a.output.back());
        a.shadow = -1;
        // Drafts only where they can all be kept: within max_tokens (the newest draw
        // counts too) and the slot's token room.
        const size_t made = a.prompt.size() + a.output.size();
        const size_t room =
            std::min<size_t>(a.params.max_tokens > a.output.size() ? a.params.max_tokens - a.output.size() : 0,
                             t.max_tokens() > made ? t.max_tokens() - made : 0);
        const int budget = draft_budget(a.pace, max_draft(a.params));
        const size_t k = std::min<size_t>(static_cast<size_t>(budget), room > 0 ? room - 1 : 0);
        if (k > 0) {
            // The draft of the longer match, its own tokens' at a tie (the likeliest
            // to be copied): the pool is not asked where no match of it could be longer.
            a.row.resize(1 + k);
            const std::span<int32_t> out = std::span(a.row).subspan(1);
            Proposal got = drafter_->draft(a.prompt, a.output, out);
            a.drafted_from = DraftSource::Sequence;
            if (pool_drafts_ && !a.params.no_draft_pool && got.matched < NgramPool::kMaxNgram) {
                pool_scratch_.resize(k);
                const Proposal alt = pool_drafts_->draft(a.prompt, a.output, pool_scratch_);
                if (alt.matched > got.matched) {
                    std::copy_n(pool_scratch_.begin(), alt.tokens, out.begin());
                    got = alt;
                    a.drafted_from = DraftSource::Pool;
                }
            }
            a.row.resize(1 + got.tokens);
        }
        proposed[i] = {static_cast<int>(a.row.size()) - 1, a.odds.accept()};
    }
    // The drafts worth their positions in this pass (trim_drafts); a proposal run
    // not at all is still checked against the token drawn next (DraftOdds).
    std::vector<int> keep(active_.size());
    size_t drafts = 0;
    for (const DraftRowView& v : proposed) drafts += static_cast<size_t>(v.drafts);
    std::vector<double> cost(drafts + 1);
    pass_cost_.costs(std::max<int64_t>(1, static_cast<int64_t>(active_.size())), cost);
    trim_drafts(proposed, cost, keep);
    for (size_t i = 0; i < active_.size(); ++i) {
        Active& a = active_[i];
        if (keep[i] == 0 && a.row.size() > 1) a.shadow = a.row[1];
        a.row.resize(1 + static_cast<size_t>(keep[i]));
        const auto want = static_cast<int32_t>(a.row.size());
        rows[i] = {{a.admitted, a.seq.n_tokens(), a.params.class_rank()},
                   want,
                   blocks_to_append(*pool_, a.seq, want),
                   blocks_to_append(*pool_, a.seq, 1),
                   (a.seq.n_tokens() + 1 + bt - 1) / bt <= al.n_blocks(),
                   a.kv_wait_since ? now - a.kv_wait_since : 0};
    }
    const DecodeArenaView arena{available >= 0 ? available : al.n_available(), al.n_available() < al.n_blocks()};
    return plan_decode(rows, views_of(parked_), arena, kKvWaitNs);
}

// Short of blocks: the decode policy (engine/decode_scheduler.h) named the sequence
// that gives way (the least urgent class, the newest of it), which is preempted, by
// swap or recompute; the rest try again next step. With one sequence left there is
// nobody to give way to: it waits for blocks others hold (prefill gives back those of
// prompts that wait: PrefillWorker::set_aside) if it would fit in the arena, up to
// kKvWaitNs, and then fails. A victim cancelled meanwhile ends as such.
void DecodeWorker::make_room(const DecodeStep& plan) {
    shm::RequestTable& t = inst_->requests();
    using A = DecodeStep::Action;
    if (plan.action == A::PreemptParked) {
        if (!preempt(parked_, plan.victim)) finish(parked_, plan.victim, shm::ReqState::Cancelled);
        publish_load();
    } else if (t.cancelled(active_[plan.victim].req)) {
        finish(plan.victim, shm::ReqState::Cancelled);
    } else if (plan.action == A::Preempt) {
        if (!preempt(active_, plan.victim)) finish(plan.victim, shm::ReqState::Cancelled);
        publish_load();
    } else if (plan.action == A::Wait) {
        Active& a = active_[plan.victim];
        if (a.kv_wait_since == 0) a.kv_wait_since = shm::monotonic_ns();
        usleep(2000);
        return;
    } else {
        t.slot(active_[plan.victim].req.slot)
            .error_code.store(static_cast<int32_t>(ReqError::Decode), std::memory_order_relaxed);
        finish(plan.victim, shm::ReqState::Failed);
    }
    inst_->registry().wake(shm::Role::Front);
}

Finish DecodeWorker::emit(Active& a, const float* rows, const int32_t* picks, bool host, int32_t n) {
    shm::RequestTable& t = inst_->requests();
    const int64_t nv = backend_->n_vocab();
    const int64_t kept_from = a.seq.n_tokens() - n;  // the positions before the row
    Finish f = Finish::None;
    int32_t j = 0, accepted = 0;  // tokens emitted; drafts among them
    bool matched = true, missed = false;  // missed: a draft was not kept
    while (j < n && matched && f == Finish::None) {
        if (!host && picks[j] < 0) {  // the backend's sampler: its constraints left nothing to choose
            log_no_token(a.req);
            return Finish::Failed;
        }
        const Drawn d = draw(rows + static_cast<int64_t>(j) * nv, host ? -1 : picks[j], a.req, a.params, a.data,
                             a.prompt, a.output, a.stops.get());
        if (d.finish == Finish::Failed) return Finish::Failed;  // nothing emitted at this position
        const int32_t next = d.token;
        a.output.push_back(next);
        f = d.finish;
        if (!t.append_output(a.req, &next, 1).ok()) f = Finish::Length;  // no room left in the slot
        ++j;
        // The draft at the next position is kept only if this draw picked it; if not,
        // this draw is its correction and the row ends here.
        matched = j < n && next == a.row[static_cast<size_t>(j)];
        missed = j < n && !matched;
        accepted += matched ? 1 : 0;
    }
    if (n == 1 && a.shadow >= 0 && j == 1) a.odds.seen(a.output.back() == a.shadow ? 1 : 0, 1);
    a.shadow = -1;
    if (n > 1) {
        a.odds.seen(accepted, accepted + (missed ? 1 : 0));
        draft_verified(a.pace, max_draft(a.params), n - 1, accepted);
        const int src = static_cast<int>(a.drafted_from);
        t.verify_rows(src).fetch_add(1, std::memory_order_relaxed);
        t.drafted(src).fetch_add(static_cast<uint64_t>(n - 1), std::memory_order_relaxed);
        t.drafts_accepted(src).fetch_add(static_cast<uint64_t>(accepted), std::memory_order_relaxed);
        shm::ReqSlot& s = t.slot(a.req.slot);
        s.n_drafted.fetch_add(static_cast<uint32_t>(n - 1), std::memory_order_relaxed);
        s.n_draft_kept.fetch_add(static_cast<uint32_t>(accepted), std::memory_order_relaxed);
    }
    // Every token but the newest output keeps its KV: the row's positions up to the
    // last kept token's input.
    if (j < n) a.seq.truncate(*pool_, kept_from + j);
    return f;
}

void DecodeWorker::build_batch(const DecodeStep& plan, std::vector<SeqBatch>& batch) {
    batch.clear();
    for (const DecodeRow& r : plan.rows) {
        Active& a = active_[r.seq];
        a.row.resize(static_cast<size_t>(r.n_tokens));
        batch.push_back(SeqBatch{&a.seq, a.row.data(), r.n_tokens, r.n_tokens > 1});
    }
}

void DecodeWorker::choose_pickers(const DecodeStep& plan, std::span<SeqBatch> batch) {
    samples_.resize(active_.size());
    masks_.resize(active_.size());
    for (size_t k = 0; k < plan.rows.size(); ++k) {
        const DecodeRow& r = plan.rows[k];
        Active& a = active_[r.seq];
        SeqBatch& b = batch[k];
        // Without log-probabilities the backend picks the token (a GPU backend then
        // copies no logits for it): the argmax alone for greedy without penalties or
        // constraints, else the sampler's pick for this request and position under
        // its constraints (bias, min_tokens' bans, its grammar's mask: on a GPU, on
        // the device). The host picks for a verify row, whose every position is
        // drawn in turn, and where the grammar could not be followed (draw() says
        // why and the request fails).
        const SamplingParams& sp = a.params.sampling;
        bool host = r.n_tokens > 1 || a.params.logprobs >= 0;
        TokenConstraints c;
        if (!host) {
            auto got = constraints(a.req, a.params, a.data, a.output);
            host = !got;
            if (got) {
                c = *got;
                if (!c.allowed.empty()) {  // the grammar's mask lasts until its next call: kept for the pass
                    masks_[r.seq].assign(c.allowed.begin(), c.allowed.end());
                    c.allowed = masks_[r.seq];
                }
            }
        }
        b.argmax_only = sp.temperature <= 0.0f && !has_penalties(sp) && c.empty() && !host;
        b.sample = nullptr;
        if (!b.argmax_only && !host) {
            samples_[r.seq] = SampleRequest{&sp, a.prompt, a.output, a.output.size(), c};
            b.sample = &samples_[r.seq];
        }
    }
}

void DecodeWorker::prefetch_grammars() {
    const uint64_t now = shm::monotonic_ns();
    if (now < next_prefetch_ns_) return;
    next_prefetch_ns_ = now + 1'000'000;
    const shm::RequestTable& t = inst_->requests();
    if (prefetched_.size() != t.n_slots()) prefetched_.assign(t.n_slots(), UINT32_MAX);
    for (uint32_t s = 0; s < t.n_slots(); ++s) {
        const shm::ReqRef r = t.current(s);
        if (prefetched_[s] == r.gen || !(t.is(r, shm::ReqState::Queued) || t.is(r, shm::ReqState::Prefilling)))
            continue;
        const RequestParams p = request_params(t, s);
        if (p.data_bytes == 0) {
            prefetched_[s] = r.gen;
            continue;
        }
        // Read while the request is still this one (its data does not change until its
        // slot is reused, and ext_data checks its generation); one that cannot be read
        // now is looked at again at the next scan.
        Result<RequestData> d = read_request_data(t, r, p);
        if (!d || t.current(s).gen != r.gen) continue;
        prefetched_[s] = r.gen;
        if (d->grammar) grammars().prefetch(*d->grammar);
    }
}

Result<bool> DecodeWorker::step() {
    shm::RequestTable& t = inst_->requests();
    prefetch_grammars();
    const uint64_t take0 = trace::active() ? trace::now_ns() : 0;
    const uint64_t served = worker_stats(inst_->registry(), self_.slot).served.load(std::memory_order_relaxed);
    bool dropped = take_handoffs();
    if (take0 != 0 && worker_stats(inst_->registry(), self_.slot).served.load(std::memory_order_relaxed) != served)
        trace::span("decode take", take0, trace::now_ns());  // hand-offs accepted (an idle poll is no range)
    publish_load();  // before the step: what it holds now, for routing while it runs
    dropped = end_cancelled(active_) || dropped;
    if (active_.empty()) {
        publish_load();
        if (dropped) inst_->registry().wake(shm::Role::Front);  // the cancellations are visible
        return false;
    }
    trace::Range step_range("decode step");
    std::optional<trace::Range> phase(std::in_place, "decode plan");
    // The step's blocks first (KvCacheManager). The allocator's count allowed the
    // plan, yet the arena is shared: blocks gone meanwhile make the step planned
    // again with what is there now (drafts go first), then as a shortage (no new
    // block at all); a third miss waits for the next step.
    DecodeStep plan = plan_step();
    std::vector<SeqBatch> batch;
    for (int attempt = 0; plan.action == DecodeStep::Action::Run; ++attempt) {
        build_batch(plan, batch);
        if (kv_->reserve(batch)) break;
        batch.clear();
        if (attempt == 2) {
            usleep(2000);
            return true;
        }
        plan = plan_step(attempt == 0 ? -1 : 0);
    }
    if (plan.action != DecodeStep::Action::Run) {
        make_room(plan);
        return true;
    }
    choose_pickers(plan, batch);  // once the blocks are there (a grammar's mask is made once a step)
    const uint64_t step_ns = shm::monotonic_ns();
    for (Active& a : active_) {
        a.kv_wait_since = 0;
        if (a.fresh) {
            t.slot(a.req.slot).first_step_ns.store(step_ns, std::memory_order_relaxed);
            a.first_step_ns = step_ns;
            a.first_step_tokens = a.output.size();
        }
        a.fresh = false;
    }
    Status st;
    phase.reset();
    {
        yield_to_claim(yield_budget());
        const bool lent = borrow_cores(shm::Role::Prefill);
        const uint64_t t0 = shm::monotonic_ns();
        {
            trace::Range range("decode forward");
            st = backend_->forward_pick(batch, logits_, picks_);
        }
        if (lent) borrowed(t0);
        std::atomic<uint64_t>& avg = worker_stats(inst_->registry(), self_.slot).step_ns;  // C6's cost of a claim
        const uint64_t took = shm::monotonic_ns() - t0, was = avg.load(std::memory_order_relaxed);
        avg.store(was == 0 ? took : (3 * was + took) / 4, std::memory_order_relaxed);
        int64_t positions = 0;
        for (const SeqBatch& b : batch) positions += b.n_tokens;
        if (st) {
            pass_cost_.add(positions, took);
            worker_stats(inst_->registry(), self_.slot)
                .pass_fixed_milli.store(static_cast<uint64_t>(pass_cost_.fixed() * 1000.0 + 0.5),
                                        std::memory_order_relaxed);  // a gauge for /metrics
        }
    }
    if (!st) {
        // Not a shortage: the blocks were taken. The newest request fails and the
        // rest try again next step (a device left unusable ended the process).
        kv_->unreserve(batch);
        log::error(fmt::format("a step of {} sequences failed: {}", batch.size(), st.error().message),
                   {request_field(active_.back().req), request_id_field(inst_->requests(), active_.back().req)});
        t.slot(active_.back().req.slot).error_code.store(static_cast<int32_t>(ReqError::Decode), std::memory_order_relaxed);
        finish(active_.size() - 1, shm::ReqState::Failed);
        inst_->registry().wake(shm::Role::Front);
        return true;
    }
    phase.emplace("decode emit");
    const int64_t nv = backend_->n_vocab();
    std::vector<std::pair<size_t, shm::ReqState>> done;
    int64_t r = 0;  // the pass's output row of the entry
    for (size_t i = 0; i < active_.size(); ++i) {
        const SeqBatch& b = batch[i];
        const bool host = !b.argmax_only && !b.sample;
        const Finish f = emit(active_[i], logits_.data() + r * nv, picks_.data() + r, host, b.n_tokens);
        r += b.output_rows();
        if (f == Finish::Failed) {  // its grammar could not be followed (draw() said why)
            t.slot(active_[i].req.slot)
                .error_code.store(static_cast<int32_t>(ReqError::Data),
                                  std::memory_order_relaxed);  // published by finish
            done.push_back({i, shm::ReqState::Failed});
        } else if (f != Finish::None) {
            t.slot(active_[i].req.slot)
                .end_code.store(static_cast<uint32_t>(f), std::memory_order_relaxed);  // published by finish
            done.push_back({i, shm::ReqState::Finished});
        }
    }
    for (size_t k = done.size(); k-- > 0;) finish(done[k].first, done[k].second);
    publish_load();
    inst_->registry().wake(shm::Role::Front);
    return true;
}

}  // namespace duet
