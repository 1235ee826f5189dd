#include "roles/prefill_worker.h"

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
#include <utility>

#include <fmt/format.h>

#include "engine/backends.h"
#include "engine/scheduling.h"
#include "model/fingerprint.h"
#include "roles/claims.h"
#include "roles/sd_notify.h"
#include "roles/worker_stats.h"

namespace duet {

Result<std::unique_ptr<PrefillWorker>> PrefillWorker::create(shm::Instance& inst, const Model& model,
                                                             const WorkerOptions& o) {
    std::unique_ptr<PrefillWorker> w(new PrefillWorker());
    if (Status st = w->init(inst, model, shm::Role::Prefill, o); !st) return st.error();
    const uint32_t p = o.index;
    w->in_ = shm::SpscConsumer<WireMsg>(inst.ring(w->rings_.to_prefill(p)));
    w->redo_ = shm::SpscConsumer<WireMsg>(inst.ring(w->rings_.redrive(p)));
    // out_[d]: the ring to decode d (a GPU pair's prefill has its pair's alone, out_[0]).
    for (uint32_t d = 0; d < w->rings_.n_decode; ++d)
        if (w->rings_.linked(p, d)) w->out_.emplace_back(inst.ring(w->rings_.to_decode(p, d)));
    if (inst.config().kv_split)
        if (Status st = w->join_outlets(); !st) return st.error();
    if (o.pass_interrupt) w->backend_->set_interrupt([self = w.get()] { return self->critical_arrived(); });
    w->publish_load();
    return w;
}

void PrefillWorker::note_arrivals() {
    size_t n = 0;
    in_.refresh();
    (void)in_.peek(&n);
    in_at_ = n;
    redo_.refresh();
    redo_at_ = redo_.consumed() + redo_.backlog();
}

bool PrefillWorker::critical_arrived() {
    if (!interruptible_ || jobs_.size() >= static_cast<size_t>(std::max(1, opts_.max_prefills))) return false;
    const shm::RequestTable& t = inst_->requests();
    const auto critical = [&](const WireMsg& m) {
        return t.is(shm::ReqRef{m.slot, m.gen}, shm::ReqState::Queued) && request_params(t, m.slot).critical();
    };
    size_t n = 0;
    in_.refresh();
    const WireMsg* m = in_.peek(&n);
    for (size_t i = in_at_; i < n; ++i)
        if (critical(m[i])) return true;
    in_at_ = std::max(in_at_, n);
    redo_.refresh();
    m = redo_.peek(&n);
    const uint64_t head = redo_.consumed();
    for (size_t i = redo_at_ > head ? static_cast<size_t>(redo_at_ - head) : 0; i < n; ++i)
        if (critical(m[i])) return true;
    redo_at_ = std::max<uint64_t>(redo_at_, head + n);
    return false;
}

PrefillWorker::~PrefillWorker() {
    for (Pending& p : pending_)
        for (int32_t b : p.blocks) p.alloc->unref(b);
    for (Job& j : jobs_) {
        drop_swap(j);  // still ours: a re-drive computes it
        release(j);
    }
    for (Outlet& o : outlets_) {
        o.gpu.reset();
        inst_->arena(o.arena).leave(o.user);
    }
}

bool PrefillWorker::has_work() { return redo_.readable() || in_.readable() || !jobs_.empty(); }

bool PrefillWorker::follows(size_t k) const {
    const Job& j = jobs_[k];
    if (j.looked_up || j.hashes.empty()) return false;
    for (size_t i = 0; i < jobs_.size(); ++i)
        if (i != k && jobs_[i].looked_up && jobs_[i].hashes.size() >= j.hashes.size() &&
            jobs_[i].hashes[j.hashes.size() - 1] == j.hashes.back() && jobs_[i].published < j.hashes.size())
            return true;  // i has yet to publish the block j would share
    return false;
}

// Tokens still to compute: a follower only what its leader's blocks leave (what the
// router counted when it sent it here).
void PrefillWorker::publish_load() {
    const size_t bt = static_cast<size_t>(pool_->layout().block_tokens);
    uint64_t tokens = 0;
    for (size_t k = 0; k < jobs_.size(); ++k) {
        const Job& j = jobs_[k];
        tokens += follows(k) ? j.all.size() - std::min(j.hashes.size() * bt, j.all.size() - 1) : j.all.size() - j.done;
    }
    WorkerBase::publish_load(static_cast<uint32_t>(jobs_.size()), tokens);
}

void PrefillWorker::settle() {
    shm::RequestTable& t = inst_->requests();
    shm::Registry& reg = inst_->registry();
    for (size_t i = 0; i < pending_.size();) {
        Pending& p = pending_[i];
        if (shm::handoff_settled(t, p.h)) {
            for (int32_t b : p.blocks) p.alloc->unref(b);
            pending_[i] = std::move(pending_.back());
            pending_.pop_back();
            continue;
        }
        // Its decode worker died before taking it: to a live one (a copy left in the
        // dead one's ring loses handoff_accept's exact CAS and is dropped).
        if (!reg.alive(p.to) && decode_running_on(p.arena)) p.to = send_handoff(p.msg, p.arena);
        ++i;
    }
}

// Takes the request a ring message names into this worker's hand (a job), unless
// another worker took it or it was re-driven and sent again: its QUEUED -> PREFILLING
// CAS then fails and the message is simply dropped.
void PrefillWorker::take(const WireMsg& m) {
    shm::RequestTable& t = inst_->requests();
    const int64_t bt = pool_->layout().block_tokens;
    const shm::ReqRef r{m.slot, m.gen};
    // A message for a request another prefill took, or that was re-driven and
    // sent again, loses this CAS and is dropped. Once the CAS is won the request
    // is ours (owner in the state word): if we die from here on, recovery
    // re-drives it, so the message can go.
    if (t.transition(r, shm::ReqState::Queued, shm::ReqState::Prefilling, self_)) {
        shm::ReqSlot& slot = t.slot(r.slot);
        slot.prefill_ns.store(shm::monotonic_ns(), std::memory_order_relaxed);
        worker_stats(inst_->registry(), self_.slot).served.fetch_add(1, std::memory_order_relaxed);
        Job j;
        j.req = r;
        j.params = request_params(t, r.slot);
        auto data = read_request_data(t, r, j.params);
        if (!data) {  // honoured or refused: never run without it
            log::error(data.error().message, {request_field(j.req), request_id_field(inst_->requests(), j.req)});
            j.swapped = slot.n_swapped.load(std::memory_order_relaxed);  // its blob goes too (fail: drop_swap)
            fail(j, ReqError::Data);
            inst_->registry().wake(shm::Role::Front);
            return;
        }
        j.data = std::move(data).value();
        const uint32_t np = slot.n_prompt.load(std::memory_order_relaxed);
        j.prompt.assign(t.tokens(r.slot), t.tokens(r.slot) + np);
        auto no = t.read_output(r, 0, j.output);
        bool stopped = false;  // its outputs complete a stop string
        j.stops = watch_stops(j.params, j.data, j.output, &stopped);
        // Re-driven after its last token was written: it ends as that token said.
        Finish said = !no ? Finish::Length
                      : j.output.empty()
                          ? Finish::None
                          : check_stop(stop_rules(j.params), tok_->is_eog(j.output.back()), j.output.size());
        if (no && stopped && said != Finish::Eog) said = Finish::StopString;
        if (said != Finish::None) {
            slot.end_code.store(static_cast<uint32_t>(said), std::memory_order_relaxed);  // published by the transition
            (void)t.transition(r, shm::ReqState::Prefilling, shm::ReqState::Finished);    // (else not ours: dropped)
            inst_->registry().wake(shm::Role::Front);
        } else {
            // Its grammar compiles on GrammarSet's thread while its prompt is computed,
            // not here, where every other prompt in hand would wait for it; the first
            // token's draw takes it (or waits for the rest of the compile), and one
            // that fails to compile fails the request there (draw: Finish::Failed).
            if (j.data.grammar) grammars().prefetch(*j.data.grammar);
            j.all = j.prompt;
            j.all.insert(j.all.end(), j.output.begin(), j.output.end());
            if (j.params.given_tokens > 0) take_given(j);
            // Preempted by swap: its KV is read back before it runs (swap_in), unless
            // it started from offered blocks or cannot read it here.
            if (const uint32_t sw = slot.n_swapped.load(std::memory_order_relaxed); sw > 0) {
                if (swap_ && j.params.given_tokens == 0 && sw < j.all.size()) {
                    j.swapped = sw;
                } else {
                    ::unlink(swap_path(r).c_str());
                    slot.n_swapped.store(0, std::memory_order_relaxed);
                }
            }
            // Its order key (engine/scheduling.h "Order": earliest deadline first
            // within a class, priority with aging between classes).
            if (j.params.critical()) last_critical_ns_ = shm::monotonic_ns();
            j.submit_ns = slot.submit_ns;
            j.deadline_ns = prefill_order_key(slot.submit_ns, j.params.class_rank(), j.params.ttft_target_ns,
                                              j.all.size(), static_cast<uint64_t>(opts_.deadline_ns_per_token));
            if (opts_.prefix_cache) {
                shm::BlockHash h;
                for (size_t at = 0; at + static_cast<size_t>(bt) <= j.all.size(); at += static_cast<size_t>(bt)) {
                    h = hasher_.hash(h, j.all.data() + at, static_cast<size_t>(bt), model_->fingerprint(), {});
                    j.hashes.push_back(h);
                }
            }
            jobs_.push_back(std::move(j));
        }
    }
}

// The deadline of the request a message of the front's ring names (as take() will
// set it), or 0 when the message is stale (the request is not QUEUED at that
// generation: another worker took it, or it ended): taken at once and dropped.
// A critical one seen here opens the pass cut's window (lesser_budget) even while
// it waits in the ring for room.
uint64_t PrefillWorker::queued_deadline(const WireMsg& m) {
    const shm::RequestTable& t = inst_->requests();
    const shm::ReqRef r{m.slot, m.gen};
    if (!t.is(r, shm::ReqState::Queued)) return 0;
    const shm::ReqSlot& slot = t.slot(r.slot);
    const RequestParams p = request_params(t, r.slot);
    if (p.critical()) last_critical_ns_ = shm::monotonic_ns();
    const uint64_t n = slot.n_prompt.load(std::memory_order_relaxed);
    return std::max<uint64_t>(1, prefill_order_key(slot.submit_ns, p.class_rank(), p.ttft_target_ns, n,
                                                   static_cast<uint64_t>(opts_.deadline_ns_per_token)));
}

// Fills the hand (max_prefills jobs): re-driven requests first, in their order (they
// were admitted before); then the front's, earliest deadline first across every
// message waiting in its ring, not only the oldest (a critical request behind a
// backlog of batch work is taken first). A message taken out of order stays in the
// ring, marked, until the ones before it are taken too: the ring is released only
// up to its first message not taken, so a worker that dies leaves every message it
// had not taken to its successor (and the copies of those it had taken lose their
// CAS there: recovery re-drove them).
bool PrefillWorker::admit() {
    bool any = false;
    const auto room = [&] { return jobs_.size() < static_cast<size_t>(std::max(1, opts_.max_prefills)); };
    while (room()) {
        size_t n = 0;
        const WireMsg* m = redo_.peek(&n);
        if (n == 0) break;
        any = true;
        take(*m);
        redo_.release(1);
    }
    size_t n = 0;
    in_.refresh();  // arrivals since the last look are candidates too
    const WireMsg* m = in_.peek(&n);
    if (in_seen_.size() > n) in_seen_.resize(n);  // (cannot shrink unless released: defensive)
    while (in_seen_.size() < n) in_seen_.push_back(queued_deadline(m[in_seen_.size()]));
    // A ring more than half full is taken in order, oldest first: a message left
    // untaken at its head (a batch request's far deadline) must not pin the ring
    // until the front can no longer send.
    const bool fifo = in_.backlog() * 2 > in_.capacity();
    while (room()) {
        size_t best = n;
        for (size_t i = 0; i < n; ++i) {
            if (in_seen_[i] == kTaken) continue;
            if (in_seen_[i] == 0) {  // stale: dropped
                in_seen_[i] = kTaken;
                any = true;
                continue;
            }
            if (best == n || in_seen_[i] < in_seen_[best]) best = i;
            if (fifo) break;
        }
        if (best == n) break;
        any = true;
        take(m[best]);
        in_seen_[best] = kTaken;
    }
    size_t prefix = 0;
    while (prefix < in_seen_.size() && in_seen_[prefix] == kTaken) ++prefix;
    if (prefix > 0) {
        in_.release(prefix);
        in_seen_.erase(in_seen_.begin(), in_seen_.begin() + static_cast<std::ptrdiff_t>(prefix));
    }
    if (any) publish_load();
    return any;
}

// Takes references on the longest run of this request's leading blocks that the
// prefix index holds; at least the last token is left to compute (its logits
// give the first output token).
void PrefillWorker::lookup_prefix(Job& j) {
    if (j.looked_up) return;  // started from offered blocks
    j.looked_up = true;
    if (j.hashes.empty()) return;
    const size_t max_blocks = (j.all.size() - 1) / static_cast<size_t>(pool_->layout().block_tokens);
    KvSeq cached = kv_->lookup_prefix(j.hashes, max_blocks);
    if (cached.blocks().empty()) return;
    j.done = static_cast<size_t>(cached.n_tokens());
    j.published = cached.blocks().size();
    j.seq = std::move(cached);
    inst_->requests().slot(j.req.slot).n_cached.store(static_cast<uint32_t>(std::min(j.done, j.prompt.size())),
                                                      std::memory_order_relaxed);
}

bool PrefillWorker::take_given(Job& j) {
    shm::RequestTable& t = inst_->requests();
    const uint32_t slot = j.req.slot;
    const int64_t bt = pool_->layout().block_tokens;
    // Acquire pairs with offer_blocks' release: the entries are written.
    const uint32_t nb = t.slot(slot).n_blocks.load(std::memory_order_acquire);
    std::vector<int32_t> blocks(t.blocks(slot), t.blocks(slot) + nb);
    (void)t.reset_blocks(j.req);  // the table is ours to fill from here (complete)
    // At least the last token is computed: its logits give the first output token.
    const int64_t given = std::min<int64_t>(j.params.given_tokens, static_cast<int64_t>(j.all.size()) - 1);
    const uint64_t by = j.params.given_by ? j.params.given_by : t.slot(slot).client.load(std::memory_order_relaxed);
    const int32_t from = alloc_->arena().user_of(shm::ProcRef::unpack(by));
    if (given <= 0 || from < 0 || static_cast<int64_t>(nb) * bt < given) return false;
    blocks.resize(static_cast<size_t>((given + bt - 1) / bt));
    // Our own references: the client keeps its own until the request ends. A block it
    // no longer holds (it cannot, while it waits for us) ends the offer.
    for (size_t k = 0; k < blocks.size(); ++k)
        if (blocks[k] < 0 || static_cast<uint32_t>(blocks[k]) >= alloc_->arena().n_blocks() ||
            !alloc_->arena().share(static_cast<uint32_t>(from), user_, blocks[k])) {
            for (size_t i = 0; i < k; ++i) alloc_->unref(blocks[i]);
            return false;
        }
    j.seq = KvSeq::adopt(std::move(blocks), given);
    j.done = static_cast<size_t>(given);
    j.published = static_cast<size_t>(given / bt);  // the client's full blocks are published already
    j.looked_up = true;
    t.slot(slot).n_cached.store(static_cast<uint32_t>(std::min(j.done, j.prompt.size())), std::memory_order_relaxed);
    return true;
}

// Registers the request's newly completed full blocks in the prefix index.
void PrefillWorker::publish_blocks(Job& j) {
    j.published = kv_->publish_prefix(j.seq, j.hashes, j.published, static_cast<int64_t>(j.done));
}

void PrefillWorker::fail(Job& j, ReqError why) {
    shm::RequestTable& t = inst_->requests();
    drop_swap(j);  // while the slot is still this request's
    t.slot(j.req.slot).error_code.store(static_cast<int32_t>(why), std::memory_order_relaxed);
    (void)t.transition(j.req, shm::ReqState::Prefilling, shm::ReqState::Failed);  // (else not ours: dropped)
    release(j);
}

// keep_kv: the request's blocks (in the slot's block table already) become the
// client's: each of our references moves to its arena user, so the KV outlives this
// request and this process. A client that is gone gets nothing (ours are dropped by
// release()).
bool PrefillWorker::give_kv_to_client(Job& j) {
    const shm::ProcRef client = shm::ProcRef::unpack(inst_->requests().slot(j.req.slot).client.load(std::memory_order_relaxed));
    const int32_t to = alloc_->arena().user_of(client);
    if (to < 0) return false;
    std::vector<int32_t> blocks = j.seq.detach();
    for (int32_t b : blocks)
        if (!alloc_->arena().transfer(user_, static_cast<uint32_t>(to), b)) alloc_->unref(b);
    inst_->requests().slot(j.req.slot).kv_to.store(client.pack(), std::memory_order_relaxed);  // published by the end
    return true;
}

void PrefillWorker::complete(Job& j, const float* logits) {
    shm::RequestTable& t = inst_->requests();
    const shm::ReqRef r = j.req;
    const Drawn drawn = draw(logits, -1, r, j.params, j.data, j.prompt, j.output, j.stops.get());
    if (drawn.finish == Finish::Failed) {
        fail(j, ReqError::Data);
        return;
    }
    const int32_t next = drawn.token;
    // The blocks decode takes: ours (one arena for both: no copy), or, kv_split, the
    // copies the pass made in decode's arena.
    const bool copied = j.outlet >= 0;
    const std::vector<int32_t>& handed = copied ? j.dst : j.seq.blocks();
    Status st = t.append_output(r, &next, 1);
    if (st.ok()) st = t.append_blocks(r, handed.data(), static_cast<uint32_t>(handed.size()));
    if (!st.ok()) {
        fail(j);
    } else if (j.params.keep_kv) {
        give_kv_to_client(j);
        // (Else not ours any more: a recoverer took it.)
        (void)t.transition(r, shm::ReqState::Prefilling,
                           t.cancelled(r) ? shm::ReqState::Cancelled : shm::ReqState::Finished);
        release(j);
    } else if (const Finish f = drawn.finish; f != Finish::None || t.cancelled(r)) {
        t.slot(r.slot).end_code.store(static_cast<uint32_t>(f), std::memory_order_relaxed);  // published below
        // return_kv (the table names our blocks already, appended above): as decode's
        // finish, a FINISHED request's table names exactly what the client holds.
        if (j.params.return_kv && !t.cancelled(r) && (copied || !give_kv_to_client(j))) (void)t.reset_blocks(r);
        // (Else not ours any more: a recoverer took it.)
        (void)t.transition(r, shm::ReqState::Prefilling,
                           t.cancelled(r) ? shm::ReqState::Cancelled : shm::ReqState::Finished);
        release(j);
    } else {
        const uint32_t att = t.attempt(r.slot);
        const uint32_t arena = copied ? outlets_[static_cast<size_t>(j.outlet)].arena : arena_;
        const uint32_t user = copied ? outlets_[static_cast<size_t>(j.outlet)].user : user_;
        KvBlockAllocator* alloc = copied ? outlets_[static_cast<size_t>(j.outlet)].alloc.get() : &pool_->allocator();
        const WireMsg h{r.slot, r.gen, att, self_.slot, self_.gen, user, {}};
        t.slot(r.slot).handoff_ns.store(shm::monotonic_ns(), std::memory_order_relaxed);
        const shm::ProcRef to = send_handoff(h, arena);
        std::vector<int32_t> blocks;
        if (copied) {
            blocks = std::exchange(j.dst, {});
            j.outlet = -1;
            j.seq.release(*pool_);  // ours stay in the prefix cache where published
        } else {
            blocks = j.seq.detach();
        }
        pending_.push_back({shm::Handoff{r, att, self_, user}, std::move(blocks), h, to, arena, alloc});
        forget_grammar(r);  // decode follows it from here
    }
}

// Requests cancelled while being prefilled end here. True if any did.
bool PrefillWorker::drop_cancelled() {
    shm::RequestTable& t = inst_->requests();
    bool dropped = false;
    for (size_t i = 0; i < jobs_.size();) {
        if (t.cancelled(jobs_[i].req)) {
            drop_swap(jobs_[i]);  // while the slot is still this request's
            (void)t.transition(jobs_[i].req, shm::ReqState::Prefilling, shm::ReqState::Cancelled);  // (else not ours)
            release(jobs_[i]);
            jobs_.erase(jobs_.begin() + static_cast<std::ptrdiff_t>(i));
            dropped = true;
        } else {
            ++i;
        }
    }
    return dropped;
}

// The budget of a pass not led by a critical request (engine/scheduling.h,
// pass_cut_tokens): from this worker's measured rate, while critical work is around.
int64_t PrefillWorker::lesser_budget() const {
    const OwnPassWork w = own_pass_work(worker_stats(inst_->registry(), self_.slot));
    return pass_cut_tokens(w.busy_ns, w.tokens, opts_.prefill_pass_ns, last_critical_ns_, shm::monotonic_ns(),
                           opts_.prefill_cut_window_ns);
}

PrefillWorker::RiskClaim PrefillWorker::risk_claim() const {
    if (!opts_.risk_claims || threads_->size() == own_threads_) return {};
    // Critical work around (the pass cut's window): none (C6).
    const uint64_t now = shm::monotonic_ns();
    if (last_critical_ns_ != 0 && (opts_.prefill_cut_window_ns == 0 || now - last_critical_ns_ <= opts_.prefill_cut_window_ns))
        return {};
    const int32_t partner = partner_slot(shm::Role::Decode);
    if (partner < 0) return {};
    const WorkerStats& ps = worker_stats(inst_->registry(), static_cast<uint32_t>(partner));
    if (ps.load_items.load(std::memory_order_relaxed) == 0) return {};  // idle: lent anyway (borrow_cores)
    const WorkerStats& me = worker_stats(inst_->registry(), self_.slot);
    const OwnPassWork own = own_pass_work(me);
    if (own.tokens < static_cast<uint64_t>(kRateEvidenceTokens) || own.busy_ns == 0) return {};
    const double rate = static_cast<double>(own.tokens) * 1e9 / static_cast<double>(own.busy_ns);
    std::vector<PendingPrompt> q;
    for (const Job& j : jobs_) {
        const bool due = j.params.ttft_target_ns > 0 && j.output.empty();  // its first token still to come
        q.push_back({j.deadline_ns, due ? j.submit_ns + j.params.ttft_target_ns : UINT64_MAX,
                     static_cast<int64_t>(j.all.size() - j.done)});
    }
    if (!queue_misses_on_own_cores(std::move(q), now, rate)) return {};
    // As long as decode has time in hand, at most the pass cut (a stream's longest
    // gap), and long enough to be worth a claim (kClaimSteps, kClaimMinTokens).
    // (Three quarters of the budget: decode answers with its budget of a moment
    // later, which shrinks while a step runs.)
    const uint64_t pass_ns = std::min<uint64_t>(ps.yield_budget_ns.load(std::memory_order_relaxed) / 4 * 3,
                                                opts_.prefill_pass_ns > 0 ? opts_.prefill_pass_ns : 250'000'000ull);
    // The tokens it computes then: at the rate of passes with both cores once
    // measured, else at the own one (a shorter pass than the budget allows).
    const uint64_t wb = me.wide_busy_ns.load(std::memory_order_relaxed);
    const uint64_t wt = me.wide_tokens.load(std::memory_order_relaxed);
    const double wide = wt >= static_cast<uint64_t>(kRateEvidenceTokens) && wb > 0
                            ? static_cast<double>(wt) * 1e9 / static_cast<double>(wb)
                            : rate;
    const auto tokens = static_cast<int64_t>(wide * static_cast<double>(pass_ns) / 1e9);
    if (tokens < kClaimMinTokens || pass_ns < kClaimSteps * ps.step_ns.load(std::memory_order_relaxed)) return {};
    return {pass_ns, tokens};
}

// The job's swap blob is not needed any more (read back and computed past, or not
// usable): removed, and the slot says so (a later re-drive computes).
void PrefillWorker::drop_swap(Job& j) {
    if (j.swapped == 0 && j.swap_held == 0) return;  // (the slot may be another request's by now)
    ::unlink(swap_path(j.req).c_str());
    j.swapped = 0;
    j.swap_held = 0;
    inst_->requests().slot(j.req.slot).n_swapped.store(0, std::memory_order_relaxed);
}

// Jobs preempted by swap read their KV back: the blob is checked whole (kv/blob.h)
// before it becomes the job's, and its tokens must be the job's first ones. Short of
// blocks, a job waits (out of the plans) up to kKvWaitNs, then is computed again, as
// it is on any other failure (exact either way: the invariance contract).
bool PrefillWorker::swap_in() {
    bool waiting = false;
    const auto bt = static_cast<size_t>(pool_->layout().block_tokens);
    for (Job& j : jobs_) {
        if (j.swapped == 0) continue;
        const std::string path = swap_path(j.req);
        KvSeq seq;
        // Read only when the whole job fits now: read, then set aside for want of the
        // rest, it would be read again and again.
        const bool room = static_cast<int64_t>((j.all.size() + bt - 1) / bt) <= pool_->allocator().n_available();
        auto im = room ? staged_blob_import(swap_io(), path, ident_, seq)
                       : Result<BlobImport>(make_error(ErrorKind::NoKvBlocks, "no room to read it into"));
        const uint64_t now = shm::monotonic_ns();
        if (!im && im.error().kind == ErrorKind::NoKvBlocks) {
            if (j.swap_wait_since == 0) j.swap_wait_since = now;
            if (now - j.swap_wait_since < kKvWaitNs) {
                waiting = true;
                continue;
            }
        }
        const size_t n = j.swapped;
        j.swap_wait_since = 0;
        if (!im) {
            drop_swap(j);
            log::warning(fmt::format("request {}.{}: its swapped KV: {} (computed again)", j.req.slot, j.req.gen,
                                     im.error().message),
                         {request_field(j.req), request_id_field(inst_->requests(), j.req)});
            continue;
        }
        if (im->tokens.size() != n || seq.n_tokens() != static_cast<int64_t>(n) ||
            !std::equal(im->tokens.begin(), im->tokens.end(), j.all.begin())) {
            log::warning(
                fmt::format("request {}.{}: its swap blob holds other tokens (computed again)", j.req.slot, j.req.gen),
                {request_field(j.req), request_id_field(inst_->requests(), j.req)});
            seq.release(*pool_);
            drop_swap(j);
            continue;
        }
        j.swapped = 0;
        j.seq = std::move(seq);
        j.done = n;
        j.looked_up = true;  // its full blocks are published after its next pass
        j.swap_held = n;     // the blob stays until that pass: set aside before it, it is read again
    }
    return waiting;
}

// The pass's plan (engine/prefill_scheduler.h): earliest deadline first within the
// token budget; a request whose prompt ends in the same full block as an earlier
// one's still being computed waits for it, then takes its blocks from the prefix
// cache (n > 1 choices, or the same prompt sent twice at once). The plan asks for
// each prefix lookup as the budget reaches the job.
// kv_split: a request whose prompt the pass ends goes to a decode worker that keeps
// its KV elsewhere, and the pass copies its blocks there, each layer as soon as it
// is written. Blocks there are reserved for each such request the plan holds; one
// that finds no room may not end in this pass (it waits for a later one: decode
// frees blocks as its sequences finish), and the pass is planned again without it.
// A request holding a reservation that the final plan does not end gives it back.
// no_room: the jobs found without room so far in this step (a second plan, cut for a
// risk claim, does not try them again).
PrefillPlan PrefillWorker::plan_pass(std::vector<bool>& no_room, int64_t cap) {
    std::vector<PrefillJobView> views(jobs_.size());
    no_room.resize(jobs_.size(), false);
    int64_t lesser = lesser_budget();
    if (cap > 0) lesser = lesser > 0 ? std::min(lesser, cap) : cap;
    for (;;) {
        for (size_t k = 0; k < jobs_.size(); ++k)
            views[k] = {jobs_[k].deadline_ns,       static_cast<int64_t>(jobs_[k].all.size() - jobs_[k].done),
                        jobs_[k].looked_up,         follows(k) || jobs_[k].swapped > 0,
                        jobs_[k].params.critical(), !no_room[k]};
        PrefillPlan plan = sched_.plan(views, opts_.prefill_budget, lesser);
        if (plan.lookup >= 0) {
            Job& j = jobs_[static_cast<size_t>(plan.lookup)];
            if (opts_.prefix_cache) lookup_prefix(j);
            j.looked_up = true;
            continue;
        }
        if (outlets_.empty()) return plan;
        std::vector<bool> ends(jobs_.size(), false);
        bool again = false;
        for (const PrefillEntry& e : plan.entries) {
            Job& j = jobs_[e.job];
            ends[e.job] = !j.params.keep_kv && j.done + static_cast<size_t>(e.tokens) == j.all.size();
            if (ends[e.job] && j.outlet < 0 && !reserve_destination(j)) no_room[e.job] = again = true;
        }
        if (again) continue;
        for (size_t k = 0; k < jobs_.size(); ++k)
            if (!ends[k]) release_destination(jobs_[k]);
        return plan;
    }
}

// The pass's destinations (kv_split), as plan_pass reserved them.
void PrefillWorker::export_plan(Pass& p) const {
    for (size_t k : p.jobs) {
        const Job& j = jobs_[k];
        p.exp.dest.push_back(j.outlet);
        p.exp.dst_ids.push_back(j.outlet >= 0 ? j.dst : std::vector<int32_t>{});
    }
    for (const Outlet& o : outlets_) p.exp.dests.push_back(o.dest);  // mapped by now where reserved
}

// Removes jobs_[k] for each k of `which` (indices into jobs_, any order).
void PrefillWorker::erase_jobs(std::vector<size_t> which) {
    std::sort(which.begin(), which.end());
    for (size_t k = which.size(); k-- > 0;) jobs_.erase(jobs_.begin() + static_cast<std::ptrdiff_t>(which[k]));
}

// A job that is not running while prefill is short of KV gives back its blocks (true
// if it held any). Its full blocks were published as each pass ended: they stay in
// the prefix cache, referenced by nobody, where an allocation may evict them; what
// it loses is computed again when it runs (the invariance contract: a prompt
// computed in other chunks has the same KV, so its output does not change). Kept,
// they starved decode: its one remaining sequence has nobody to preempt, found no
// block and failed (seen on 2026-12-03 under ASan, scheduling_e2e's KV pressure).
// Not a job that started from blocks its client offered (a context's KV): the slot's
// table gave them to it once, and they are the client's.
bool PrefillWorker::set_aside(Job& j) {
    if (j.params.given_tokens > 0 || j.seq.blocks().empty()) return false;
    j.seq.release(*pool_);
    j.done = 0;
    j.published = 0;
    j.looked_up = false;  // the next pass that reaches it looks its prefix up again
    if (j.swap_held) j.swapped = std::exchange(j.swap_held, 0);  // its blob is read again
    return true;
}

void PrefillWorker::pass_failed(const Pass& p, const Status& st) {
    // No destination blocks held while a request is not in a pass: they would sit in
    // decode's arena while this one waits for room in ours.
    for (size_t k : p.jobs) release_destination(jobs_[k]);
    if (st.kind() != ErrorKind::NoKvBlocks) {
        // Not a shortage (a device fault, a bad batch): retrying the same pass would
        // fail the same way. Its requests fail; a device left unusable ended the
        // process already (the supervisor re-drives its requests).
        log::error(fmt::format("a pass of {} requests failed: {}", p.jobs.size(), st.error().message));
        for (size_t k : p.jobs) fail(jobs_[k]);
        erase_jobs(p.jobs);
        publish_load();
        inst_->registry().wake(shm::Role::Front);
        return;
    }
    // Out of KV blocks (nothing was taken): the shortage policy decides
    // (engine/prefill_scheduler.h plan_prefill_shortage).
    const auto bt = static_cast<int64_t>(pool_->layout().block_tokens);
    const uint64_t now = shm::monotonic_ns();
    std::vector<PrefillKvView> views(jobs_.size());
    for (size_t k = 0; k < jobs_.size(); ++k) {
        const Job& j = jobs_[k];
        views[k] = {static_cast<int64_t>(j.seq.blocks().size()), (static_cast<int64_t>(j.all.size()) + bt - 1) / bt,
                    j.params.given_tokens == 0, !j.params.keep_kv, j.kv_wait_since ? now - j.kv_wait_since : 0};
    }
    const KvBlockAllocator& a = pool_->allocator();
    const PrefillShortage s = sched_.short_of_blocks(views, p.jobs, {a.n_blocks(), a.n_available()}, kKvWaitNs);
    switch (s.action) {
    case PrefillShortage::Action::Shrink: return;  // the next pass runs the earliest deadline alone
    case PrefillShortage::Action::SetAside:
        for (size_t k : s.jobs) set_aside(jobs_[k]);
        return;
    case PrefillShortage::Action::Wait: {
        // It would fit in the arena, but others hold blocks now (decode's running
        // sequences, which end or give way: DecodeWorker::preempt; a preempted
        // request comes back here). It gives back its own blocks too while it
        // waits: decode's last sequence, with nobody to preempt, may need one.
        Job& j = jobs_[p.jobs.front()];
        if (j.kv_wait_since == 0) j.kv_wait_since = now;
        set_aside(j);
        usleep(2000);
        return;
    }
    case PrefillShortage::Action::Fail:
        // A request that cannot fit even in the whole arena (or waited its limit, or
        // whose client would rather hear now) fails, freeing its blocks.
        fail(jobs_[p.jobs.front()], ReqError::PrefillKv);
        erase_jobs(p.jobs);
        break;
    }
    publish_load();
    inst_->registry().wake(shm::Role::Front);
}

// A pass that ran: its tokens are done, its full blocks published, and requests
// whose prompt it completed sample their first token and are handed off.
void PrefillWorker::pass_done(const Pass& p) {
    sched_.ran();  // it worked: pack again (another shortage shrinks again)
    for (size_t k : p.jobs) jobs_[k].kv_wait_since = 0;
    std::vector<size_t> finished;
    for (size_t i = 0; i < p.jobs.size(); ++i) {
        Job& j = jobs_[p.jobs[i]];
        j.done += static_cast<size_t>(p.batch[i].n_tokens);
        if (j.swap_held) drop_swap(j);
        if (opts_.prefix_cache) publish_blocks(j);
        if (j.done == j.all.size()) {
            complete(j, logits_.data() + static_cast<int64_t>(i) * backend_->n_vocab());
            finished.push_back(p.jobs[i]);
        }
    }
    erase_jobs(finished);
    publish_load();
    if (!finished.empty()) inst_->registry().wake(shm::Role::Front);  // first tokens (or ends) are in the slots
}

// One forward pass over up to prefill_budget tokens of the requests in hand,
// earliest deadline first; requests whose prompt completes are handed off.
Result<bool> PrefillWorker::step() {
    settle();
    if (jobs_.empty()) sched_.ran();
    const uint64_t admit0 = trace::active() ? trace::now_ns() : 0;
    const bool took = !sched_.short_of_kv() && admit();
    if (took && admit0 != 0) trace::span("prefill admit", admit0, trace::now_ns());  // an idle poll is no range
    const bool dropped = drop_cancelled();
    if (jobs_.empty()) {
        if (dropped) publish_load();
        if (dropped || took) inst_->registry().wake(shm::Role::Front);
        return took;
    }
    // Not while short of KV: the job that runs alone then would lose the blocks a
    // blob was read into (set aside), and the next read would take them again.
    const bool swap_waits = !sched_.short_of_kv() && swap_in();
    Pass p;
    std::vector<bool> no_room;
    PrefillPlan plan = plan_pass(no_room);
    // C6: with a prompt at risk on prefill's own cores, a pass claims decode's, cut
    // to fit decode's time in hand.
    RiskClaim risk;
    if (!plan.entries.empty() && !jobs_[plan.entries.front().job].params.critical()) {
        risk = risk_claim();
        if (risk.pass_ns > 0) plan = plan_pass(no_room, risk.tokens);
    }
    for (const PrefillEntry& e : plan.entries) {
        Job& j = jobs_[e.job];
        p.batch.push_back(SeqBatch{&j.seq, j.all.data() + j.done, static_cast<int32_t>(e.tokens), false});
        p.jobs.push_back(e.job);
    }
    if (p.batch.empty()) {
        // Every job waits: for blocks to read its swapped KV into (and no new one is
        // taken meanwhile), for another job's blocks, or (kv_split) for room in a
        // decode arena or for a decode worker to make its arena. Nothing holds
        // destination blocks meanwhile (plan_pass), so waiting cannot starve decode.
        sched_.nothing_to_run(swap_waits);
        usleep(2000);
        return true;
    }
    if (!outlets_.empty()) export_plan(p);
    // The pass's blocks first (KvCacheManager): too few free is a planned outcome.
    Status st = kv_->reserve(p.batch);
    if (st) {
        trace::Range range("prefill pass");
        bool lent = borrow_cores(shm::Role::Decode);
        // C1: a pass led by a critical request holds only critical work.
        if (!lent && jobs_[p.jobs.front()].params.critical())
            lent = claim_cores(0);
        else if (!lent && risk.pass_ns > 0) lent = claim_cores(risk.pass_ns);
        const uint64_t t0 = shm::monotonic_ns();
        // A pass no critical request leads stops for one that arrives meanwhile.
        interruptible_ = opts_.pass_interrupt && !jobs_[p.jobs.front()].params.critical();
        if (interruptible_) note_arrivals();
        st = outlets_.empty() ? backend_->forward(p.batch, logits_) : backend_->forward_export(p.batch, logits_, p.exp);
        interruptible_ = false;
        end_claim();
        if (lent) borrowed(t0);
        if (!st) kv_->unreserve(p.batch);
        if (st) {  // the front's measured prefill rates (WorkerStats work counters), own and wide
            uint64_t tokens = 0;
            for (const SeqBatch& b : p.batch) tokens += static_cast<uint64_t>(b.n_tokens);
            WorkerStats& me = worker_stats(inst_->registry(), self_.slot);
            (lent ? me.wide_busy_ns : me.busy_ns).fetch_add(shm::monotonic_ns() - t0, std::memory_order_relaxed);
            (lent ? me.wide_tokens : me.work_tokens).fetch_add(tokens, std::memory_order_relaxed);
        }
    }
    if (!st && st.kind() == ErrorKind::Interrupted) {
        // Nothing was computed (the batch is as before): the critical request is taken
        // at the next step and goes first; these jobs run again after it.
        for (size_t k : p.jobs) release_destination(jobs_[k]);
        inst_->requests().passes_interrupted().fetch_add(1, std::memory_order_relaxed);
        return true;
    }
    if (st) {
        trace::Range range("prefill pass end");  // blocks published, first tokens sampled and handed off
        pass_done(p);
    } else
        pass_failed(p, st);
    return true;
}

}  // namespace duet
