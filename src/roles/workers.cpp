#include "roles/workers.h"

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

namespace duet {

// How long a request that would fit in the arena waits for KV blocks others hold
// before it fails: prefill's alone in its pass, decode's last sequence (and a
// swapped request's KV waits this long to be read back). Blocks held
// for good (pinned contexts, another decode worker's lone sequence that fills the
// rest) end in the failure rather than a hang.
constexpr uint64_t kKvWaitNs = 30'000'000'000ull;

void fill_logprobs(const float* logits, int64_t n_vocab, int32_t sampled, int top, shm::TokenLogprob* row) {
    float mx = logits[0];
    for (int64_t i = 1; i < n_vocab; ++i) mx = std::max(mx, logits[i]);
    double sum = 0;
    for (int64_t i = 0; i < n_vocab; ++i) sum += std::exp(static_cast<double>(logits[i] - mx));
    const double lse = static_cast<double>(mx) + std::log(sum);
    auto lp = [&](int32_t id) { return static_cast<float>(static_cast<double>(logits[id]) - lse); };
    row[0] = {sampled, lp(sampled)};
    top = std::clamp(top, 0, static_cast<int>(shm::kMaxTopLogprobs));
    std::vector<int32_t> ids(static_cast<size_t>(n_vocab));
    for (int64_t i = 0; i < n_vocab; ++i) ids[static_cast<size_t>(i)] = static_cast<int32_t>(i);
    const auto k = static_cast<ptrdiff_t>(std::min<int64_t>(top, n_vocab));
    std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), [&](int32_t a, int32_t b) {
        return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    });
    for (uint32_t i = 0; i < shm::kMaxTopLogprobs; ++i)
        row[1 + i] = static_cast<ptrdiff_t>(i) < k ? shm::TokenLogprob{ids[i], lp(ids[i])} : shm::TokenLogprob{-1, 0.0f};
}

// ---------------------------------------------------------------- shared

Status WorkerBase::init(shm::Instance& inst, const Model& model, shm::Role role, const WorkerOptions& o) {
    inst_ = &inst;
    model_ = &model;
    opts_ = o;
    auto tok = Tokenizer::from_gguf(model.file());
    if (!tok) return tok.error();
    tok_ = std::move(tok).value();
    eog_ids_ = tok_->eog_ids();
    rings_ = ServeRings::of(inst.config());
    const uint32_t n_workers = role == shm::Role::Prefill ? rings_.n_prefill : rings_.n_decode;
    if (o.index >= n_workers)
        return make_error("{} worker {} does not exist: instance {} has {} (0 to {})", shm::role_name(role), o.index,
                          inst.config().name, n_workers, static_cast<int>(n_workers) - 1);
    auto self = inst.registry().claim(role, o.device.cuda ? o.device.index : -1, getpid(), o.index);
    if (!self) return self.error();
    self_ = *self;
    // One process per (role, index): its rings have one consumer and one producer.
    shm::Registry& reg = inst.registry();
    for (uint32_t s = 0; s < reg.n_slots(); ++s) {
        const shm::ProcSlot& ps = reg.slot(s);
        const shm::ProcState st = reg.state(s);
        if (s != self_.slot &&
            (st == shm::ProcState::Starting || st == shm::ProcState::Running || st == shm::ProcState::Leaving) &&
            // Relaxed: written before the slot's state, which reg.state() loaded with acquire.
            ps.role.load(std::memory_order_relaxed) == static_cast<uint32_t>(role) &&
            ps.index.load(std::memory_order_relaxed) == o.index) {
            reg.release(self_);
            self_ = {};
            return make_error("{} worker {} of instance {} is already running (pid {})", shm::role_name(role), o.index,
                              inst.config().name, reg.pid(s));
        }
    }
    reg.slot(self_.slot).numa.store(o.numa, std::memory_order_relaxed);
    arena_ = worker_arena(inst.config(), role, o.index);
    auto user = inst.arena(arena_).join(self_);
    if (!user) return user.error();
    user_ = *user;
    joined_ = true;
    auto alloc = std::make_unique<ShmBlockAllocator>(inst.arena(arena_), user_);
    alloc_ = alloc.get();
    auto dtype = kv_dtype_from(inst.config().kv_dtype);
    if (!dtype) return make_error("instance {}: {}", inst.config().name, dtype.error().message);
    const KvLayout layout = CpuBackend::kv_layout(model, *dtype);
    own_threads_ = std::max(1, o.threads);
    index_ = o.index;
    if (!o.borrow_cpus.empty() && !o.device.cuda && !o.cpus.empty()) {
        // The own threads on their CPUs, then one on each borrowed core; only the own
        // ones run until the other role is idle (borrow_cores).
        std::vector<int> cpus;
        for (int t = 0; t < own_threads_; ++t) cpus.push_back(o.cpus[static_cast<size_t>(t) % o.cpus.size()]);
        cpus.insert(cpus.end(), o.borrow_cpus.begin(), o.borrow_cpus.end());
        threads_ = std::make_unique<ThreadPool>(static_cast<int>(cpus.size()), cpus);
        threads_->set_width(own_threads_);
    } else {
        threads_ = std::make_unique<ThreadPool>(own_threads_, o.cpus);
    }
    const bool kv_on_gpu = inst.config().cpu_kv_bytes == 0;
    if (kv_on_gpu != o.device.cuda)
        return make_error("instance {} keeps its KV {}; this worker was started with --device {}", inst.config().name,
                          kv_on_gpu ? "on a GPU (start workers with --device cuda:N)" : "in /dev/shm (CPU workers)",
                          o.device.name());
    if (o.device.cuda) {
        if (Status st = check_device(o.device); !st) return st;
        const uint64_t bytes = layout.block_bytes() * inst.arena(arena_).n_blocks();
        auto arena = open_shared_kv(inst.config().name, arena_, o.device, bytes);
        if (!arena) return arena.error();
        gpu_kv_ = std::move(arena).value();
        pool_ = std::make_unique<KvPool>(layout, gpu_kv_->data(), std::move(alloc));
    } else {
        pool_ = std::make_unique<KvPool>(layout, inst.cpu_kv_data(arena_), std::move(alloc));
    }
    BackendOptions bo;
    bo.device = o.device;
    bo.isa = o.isa;
    bo.threads = threads_.get();
    bo.max_batch = std::max(1, o.max_batch);
    bo.max_ctx = inst.config().requests.max_tokens;
    bo.cuda_graphs = o.cuda_graphs;
    bo.cuda_qgemv = o.cuda_qgemv;
    bo.share_weights_instance = inst.config().name;  // one copy of the weights per GPU
    auto b = make_backend(model, *pool_, bo);
    if (!b) return b.error();
    if (o.device.cuda) std::fprintf(stderr, "duet %s: %s\n", shm::role_name(role), b->description.c_str());
    backend_ = std::move(b->backend);
    kv_ = std::make_unique<KvCacheManager>(*pool_, alloc_);
    ident_ = {model_fingerprint(model.file()), tokenizer_fingerprint(model.file()), model.config().n_vocab};
    if (!o.swap_dir.empty()) {
        // The launcher made the directory; one this process does not see (units with a
        // private /var/tmp each) is not made here: a blob written where prefill cannot
        // read it would only be lost.
        struct stat st{};
        if (::stat(o.swap_dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
            std::fprintf(stderr, "duet %s: no swap directory %s (preemption recomputes)\n", shm::role_name(role),
                         o.swap_dir.c_str());
        } else if (gpu_kv_) {
            // GPU KV: swapped through the arena's host mirror (reserved, not committed:
            // only a swap's blocks are touched, and released after it) and a stage of
            // two page-locked halves. Without them a victim is computed again.
            auto mirror = KvMirror::create(pool_->layout(), *alloc_);
            auto stage = mirror ? device_kv_stage(*gpu_kv_, (*mirror)->pool())
                                : Result<std::unique_ptr<KvStage>>(mirror.error());
            if (!stage) {
                std::fprintf(stderr, "duet %s: swap of GPU KV: %s (preemption recomputes)\n", shm::role_name(role),
                             stage.error().message.c_str());
            } else {
                swap_mirror_ = std::move(mirror).value();
                swap_stage_ = std::move(stage).value();
                swap_ = true;
            }
        } else {
            swap_ = true;
        }
    }
    if (!o.defer_running) inst.registry().set_running(self_);
    return {};
}

std::string WorkerBase::swap_path(shm::ReqRef r) const {
    return fmt::format("{}/{}.{}.kvblob", opts_.swap_dir, r.slot, r.gen);
}

WorkerBase::~WorkerBase() {
    swap_stage_.reset();  // copies into gpu_kv_, through swap_mirror_ (over pool_'s allocator)
    swap_mirror_.reset();
    kv_.reset();
    backend_.reset();
    pool_.reset();
    gpu_kv_.reset();
    if (inst_ && joined_) inst_->arena(arena_).leave(user_);
    // Requests still in hand (stopped mid-work): keep the registry slot, so that
    // whoever recovers this process (the supervisor, on seeing it exit) finds them
    // and re-drives them; releasing it would leave them owned by nobody.
    if (inst_ && self_.valid() && inst_->requests().owned_by(self_.slot).empty()) inst_->registry().release(self_);
}

int32_t WorkerBase::pick(const float* row, const RequestParams& p, std::span<const int32_t> prompt,
                         std::span<const int32_t> output) {
    const int64_t nv = backend_->n_vocab();
    const bool ban = eog_banned(stop_rules(p), output.size());
    if (ban || p.n_bias > 0) {
        banned_row_.assign(row, row + nv);
        for (uint32_t k = 0; k < std::min(p.n_bias, RequestParams::kMaxLogitBias); ++k)
            if (p.bias[k].token >= 0 && p.bias[k].token < nv)
                banned_row_[static_cast<size_t>(p.bias[k].token)] += p.bias[k].bias;
        if (ban)
            for (int32_t id : eog_ids_)
                if (id < nv) banned_row_[static_cast<size_t>(id)] = -std::numeric_limits<float>::infinity();
        row = banned_row_.data();
    }
    return sampler_.sample(row, nv, p.sampling, prompt, output, output.size());
}

void WorkerBase::publish_load(uint32_t items, uint64_t tokens) {
    shm::ProcSlot& s = inst_->registry().slot(self_.slot);
    s.load_items.store(items, std::memory_order_relaxed);
    s.load_tokens.store(tokens, std::memory_order_relaxed);
}

bool WorkerBase::borrow_cores(shm::Role lender) {
    if (threads_->size() == own_threads_) return false;
    const shm::Registry& reg = inst_->registry();
    // The lender is the other role's worker of the same index (the launcher pairs
    // them: role_launches). Only a running lender lends: one that is starting (a
    // restart loads the model on those cores) or leaving (`--rebalance`: its cores
    // go to a worker of the other role) does not.
    const int32_t s = reg.find_running(lender, static_cast<int32_t>(index_));
    const bool idle = s >= 0 && reg.slot(static_cast<uint32_t>(s)).load_items.load(std::memory_order_relaxed) == 0;
    if (!idle) {
        threads_->set_width(own_threads_);
        return false;
    }
    if (threads_->width() == own_threads_)
        inst_->registry().slot(self_.slot).borrows.fetch_add(1, std::memory_order_relaxed);
    threads_->set_width(threads_->size());
    return true;
}

void WorkerBase::borrowed(uint64_t since_ns) {
    inst_->registry().slot(self_.slot).borrowed_ns.fetch_add(shm::monotonic_ns() - since_ns, std::memory_order_relaxed);
}

OwnPassWork own_pass_work(const shm::ProcSlot& ps) {
    OwnPassWork w{ps.busy_ns.load(std::memory_order_relaxed), ps.work_tokens.load(std::memory_order_relaxed)};
    if (w.tokens < static_cast<uint64_t>(kRateEvidenceTokens)) {
        w.busy_ns += ps.wide_busy_ns.load(std::memory_order_relaxed);
        w.tokens += ps.wide_tokens.load(std::memory_order_relaxed);
    }
    return w;
}

int32_t WorkerBase::partner_slot(shm::Role role) const {
    return inst_->registry().find_running(role, static_cast<int32_t>(index_));
}

// Claims on a busy partner's cores: the rules (C1-C6) are in roles/claims.h.
bool WorkerBase::claim_cores(uint64_t pass_ns) {
    if (threads_->size() == own_threads_) return false;
    if (!claims_.claim(inst_->registry(), self_.slot, index_, pass_ns)) return false;
    threads_->set_width(threads_->size());
    return true;
}

void WorkerBase::end_claim() {
    if (!claims_.out()) return;
    threads_->set_width(own_threads_);
    claims_.end(inst_->registry(), self_.slot, index_);
}

void WorkerBase::yield_to_claim(uint64_t budget_ns) {
    duet::yield_to_claim(inst_->registry(), self_.slot, index_, budget_ns, [&] { threads_->set_width(own_threads_); });
}

Result<GoldenReport> WorkerBase::golden_check(const GoldenRef& ref) {
    return check_golden(*backend_, *pool_, model_->fingerprint(), ref);
}

Status WorkerBase::run(const std::atomic<bool>& stop) {
    shm::Doorbell& bell = inst_->registry().doorbell(self_.slot);
    while (!stop.load(std::memory_order_relaxed)) {
        auto did = step();
        if (!did) return did.error();
        inst_->registry().heartbeat(self_);
        SdNotify::get().watchdog(shm::monotonic_ns());  // from this loop: a wedged step stops it
        // Idle: sleep until a producer rings, or 1 ms (to settle hand-offs, see stop).
        if (!*did) shm::doorbell_wait(bell, [&] { return has_work(); }, 256, 1'000'000);
    }
    return {};
}

// ---------------------------------------------------------------- prefill

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
        return t.is(shm::ReqRef{m.slot, m.gen}, shm::ReqState::Queued) && request_params(t, m.slot).slo_class == 0;
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

Status PrefillWorker::join_outlets() {
    const shm::InstanceConfig& c = inst_->config();
    for (uint32_t d = 0; d < rings_.n_decode; ++d) {
        const uint32_t a = worker_arena(c, shm::Role::Decode, d);
        if (find_outlet(a) >= 0) continue;
        Outlet o;
        o.arena = a;
        auto user = inst_->arena(a).join(self_);
        if (!user) return make_error("KV arena {} (decode worker {}'s): {}", a, d, user.error().message);
        o.user = *user;
        o.alloc = std::make_unique<ShmBlockAllocator>(inst_->arena(a), o.user);
        o.dest.n_blocks = static_cast<int32_t>(inst_->arena(a).n_blocks());
        if (!gpu_instance(c)) o.dest.data = inst_->cpu_kv_data(a);
        outlets_.push_back(std::move(o));
    }
    return {};
}

int32_t PrefillWorker::find_outlet(uint32_t arena) const {
    for (size_t i = 0; i < outlets_.size(); ++i)
        if (outlets_[i].arena == arena) return static_cast<int32_t>(i);
    return -1;
}

void PrefillWorker::release(Job& j) {
    j.seq.release(*pool_);
    release_destination(j);
}

bool PrefillWorker::reserve_destination(Job& j) {
    // The decode workers best first (pick_decode's order); the first whose arena
    // is reachable and has room takes it.
    std::vector<DecodeView> views;
    for (uint32_t k = 0; k < rings_.n_decode; ++k) views.push_back(decode_view(*inst_, k, opts_.numa));
    std::vector<uint32_t> order(views.size());
    for (uint32_t k = 0; k < order.size(); ++k) order[k] = k;
    std::stable_sort(order.begin(), order.end(),
                     [&](uint32_t a, uint32_t b) { return pick_decode({views[b], views[a]}) == 1; });
    for (uint32_t d : order) {
        const uint32_t a = worker_arena(inst_->config(), shm::Role::Decode, d);
        const int32_t oi = find_outlet(a);
        if (oi < 0) continue;
        Outlet& o = outlets_[static_cast<size_t>(oi)];
        if (!o.dest.data) {
            // Made by its decode worker when it starts (not kept yet: later).
            auto m = open_peer_kv(inst_->config().name, a, opts_.device,
                                  pool_->layout().block_bytes() * inst_->arena(a).n_blocks());
            if (!m) {
                if (!o.said && m.error().message.find("not kept") == std::string::npos)
                    std::fprintf(stderr, "duet prefill: %s\n", m.error().message.c_str());
                o.said = true;
                continue;
            }
            o.gpu = std::move(m).value();
            o.dest.data = o.gpu->data();
            o.dest.device = o.gpu->device();
            o.dest.peer = o.gpu->peer();
            if (!o.dest.peer)
                std::fprintf(stderr, "duet prefill: cuda:%d cannot reach cuda:%d by peer access: hand-offs there are "
                                     "staged through host memory\n", opts_.device.index, o.dest.device);
        }
        auto got = kv_->reserve_in(*o.alloc, static_cast<int64_t>(j.all.size()));
        if (!got) continue;  // full: decode frees as it finishes
        j.outlet = oi;
        j.dst = std::move(got).value();
        return true;
    }
    return false;
}

void PrefillWorker::release_destination(Job& j) {
    if (j.outlet >= 0) KvCacheManager::release_in(*outlets_[static_cast<size_t>(j.outlet)].alloc, j.dst);
    j.dst.clear();
    j.outlet = -1;
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

bool PrefillWorker::hands_to(uint32_t d, uint32_t arena) const {
    return rings_.linked(opts_.index, d) && worker_arena(inst_->config(), shm::Role::Decode, d) == arena;
}

bool PrefillWorker::decode_running_on(uint32_t arena) const {
    for (uint32_t d = 0; d < rings_.n_decode; ++d)
        if (hands_to(d, arena) && inst_->registry().find_running(shm::Role::Decode, static_cast<int32_t>(d)) >= 0)
            return true;
    return false;
}

shm::ProcRef PrefillWorker::send_handoff(const WireMsg& m, uint32_t arena) {
    trace::Range range("handoff");
    shm::Registry& reg = inst_->registry();
    // The decode workers whose arena holds the blocks (a GPU pair's own, decode's
    // arena the KV was copied into, or the one host arena): the one with room and
    // the least work.
    std::vector<uint32_t> cand;
    std::vector<DecodeView> views;
    for (uint32_t k = 0; k < rings_.n_decode; ++k)
        if (hands_to(k, arena)) {
            cand.push_back(k);
            views.push_back(decode_view(*inst_, k, opts_.numa));
        }
    const uint32_t d = cand.at(pick_decode(views));
    const int32_t s = reg.find_running(shm::Role::Decode, static_cast<int32_t>(d));
    auto& ring = out_[rings_.paired ? 0 : d];
    while (!ring.try_push(m)) usleep(50);  // decode drains it every step
    reg.wake(shm::Role::Decode, static_cast<int32_t>(d));
    return s < 0 ? shm::ProcRef{} : reg.current(static_cast<uint32_t>(s));
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
        inst_->registry().slot(self_.slot).served.fetch_add(1, std::memory_order_relaxed);
        Job j;
        j.req = r;
        j.params = request_params(t, r.slot);
        const uint32_t np = slot.n_prompt.load(std::memory_order_relaxed);
        j.prompt.assign(t.tokens(r.slot), t.tokens(r.slot) + np);
        auto no = t.read_output(r, 0, j.output);
        // Re-driven after its last token was written: it ends as that token said.
        const Finish said = !no ? Finish::Length
                            : j.output.empty()
                                ? Finish::None
                                : check_stop(stop_rules(j.params), tok_->is_eog(j.output.back()), j.output.size());
        if (said != Finish::None) {
            slot.end_code.store(static_cast<uint32_t>(said), std::memory_order_relaxed);  // published by the transition
            t.transition(r, shm::ReqState::Prefilling, shm::ReqState::Finished);
            inst_->registry().wake(shm::Role::Front);
        } else {
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
            if (j.params.slo_class == 0) last_critical_ns_ = shm::monotonic_ns();
            j.submit_ns = slot.submit_ns;
            j.deadline_ns = prefill_order_key(slot.submit_ns, j.params.slo_class, j.params.ttft_target_ns, j.all.size(),
                                              static_cast<uint64_t>(opts_.deadline_ns_per_token));
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
    if (p.slo_class == 0) last_critical_ns_ = shm::monotonic_ns();
    const uint64_t n = slot.n_prompt.load(std::memory_order_relaxed);
    return std::max<uint64_t>(1, prefill_order_key(slot.submit_ns, p.slo_class, p.ttft_target_ns, n,
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
    t.transition(j.req, shm::ReqState::Prefilling, shm::ReqState::Failed);
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
    const int32_t next = pick(logits, j.params, j.prompt, j.output);
    if (j.params.logprobs >= 0 && j.prompt.size() + j.output.size() < t.max_tokens())
        fill_logprobs(logits, backend_->n_vocab(), next, j.params.logprobs,
                      t.logprobs(r.slot, static_cast<uint32_t>(j.output.size())));
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
        t.transition(r, shm::ReqState::Prefilling, t.cancelled(r) ? shm::ReqState::Cancelled : shm::ReqState::Finished);
        release(j);
    } else if (const Finish f = check_stop(stop_rules(j.params), tok_->is_eog(next), j.output.size() + 1);
               f != Finish::None || t.cancelled(r)) {
        t.slot(r.slot).end_code.store(static_cast<uint32_t>(f), std::memory_order_relaxed);  // published below
        // return_kv (the table names our blocks already, appended above): as decode's
        // finish, a FINISHED request's table names exactly what the client holds.
        if (j.params.return_kv && !t.cancelled(r) && (copied || !give_kv_to_client(j))) (void)t.reset_blocks(r);
        t.transition(r, shm::ReqState::Prefilling, t.cancelled(r) ? shm::ReqState::Cancelled : shm::ReqState::Finished);
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
    }
}

// Requests cancelled while being prefilled end here. True if any did.
bool PrefillWorker::drop_cancelled() {
    shm::RequestTable& t = inst_->requests();
    bool dropped = false;
    for (size_t i = 0; i < jobs_.size();) {
        if (t.cancelled(jobs_[i].req)) {
            drop_swap(jobs_[i]);  // while the slot is still this request's
            t.transition(jobs_[i].req, shm::ReqState::Prefilling, shm::ReqState::Cancelled);
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
    const OwnPassWork w = own_pass_work(inst_->registry().slot(self_.slot));
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
    const shm::ProcSlot& ps = inst_->registry().slot(static_cast<uint32_t>(partner));
    if (ps.load_items.load(std::memory_order_relaxed) == 0) return {};  // idle: lent anyway (borrow_cores)
    const shm::ProcSlot& me = inst_->registry().slot(self_.slot);
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
            std::fprintf(stderr, "duet prefill: request %u.%u: its swapped KV: %s (computed again)\n", j.req.slot,
                         j.req.gen, im.error().message.c_str());
            continue;
        }
        if (im->tokens.size() != n || seq.n_tokens() != static_cast<int64_t>(n) ||
            !std::equal(im->tokens.begin(), im->tokens.end(), j.all.begin())) {
            std::fprintf(stderr, "duet prefill: request %u.%u: its swap blob holds other tokens (computed again)\n",
                         j.req.slot, j.req.gen);
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
PrefillPlan PrefillWorker::plan_pass(int64_t cap) {
    std::vector<PrefillJobView> views(jobs_.size());
    int64_t lesser = lesser_budget();
    if (cap > 0) lesser = lesser > 0 ? std::min(lesser, cap) : cap;
    for (;;) {
        for (size_t k = 0; k < jobs_.size(); ++k)
            views[k] = {jobs_[k].deadline_ns, static_cast<int64_t>(jobs_[k].all.size() - jobs_[k].done),
                        jobs_[k].looked_up, follows(k) || jobs_[k].swapped > 0, jobs_[k].params.slo_class == 0};
        PrefillPlan plan = plan_prefill(views, opts_.prefill_budget, kv_short_, lesser);
        if (plan.lookup < 0) return plan;
        Job& j = jobs_[static_cast<size_t>(plan.lookup)];
        if (opts_.prefix_cache) lookup_prefix(j);
        j.looked_up = true;
    }
}

// kv_split: a request whose prompt this pass ends goes to a decode worker that keeps
// its KV elsewhere; the pass copies its blocks there, each layer as soon as it is
// written. One that finds no room there is taken out of the pass, to wait for a
// later one.
void PrefillWorker::reserve_destinations(Pass& p) {
    for (size_t i = 0; i < p.batch.size();) {
        Job& j = jobs_[p.jobs[i]];
        if (j.params.keep_kv || j.done + static_cast<size_t>(p.batch[i].n_tokens) < j.all.size()) {
            p.exp.dest.push_back(-1);
            p.exp.dst_ids.emplace_back();
            ++i;
        } else if (reserve_destination(j)) {
            p.exp.dest.push_back(j.outlet);
            p.exp.dst_ids.push_back(j.dst);
            ++i;
        } else {
            p.batch.erase(p.batch.begin() + static_cast<std::ptrdiff_t>(i));
            p.jobs.erase(p.jobs.begin() + static_cast<std::ptrdiff_t>(i));
        }
    }
    for (const Outlet& o : outlets_) p.exp.dests.push_back(o.dest);  // mapped by now where reserved
}

// Removes jobs_[k] for each k of `which` (indices into jobs_, any order).
void PrefillWorker::erase_jobs(std::vector<size_t> which) {
    std::sort(which.begin(), which.end());
    for (size_t k = which.size(); k-- > 0;) jobs_.erase(jobs_.begin() + static_cast<std::ptrdiff_t>(which[k]));
}

// A pass that did not run: nothing it reserved is held any more.
// Whether a request whose pass alone found no KV blocks waits for them rather than
// failing: it fits the whole arena, others hold blocks now, it is not a context's
// computation (the context store answers that failure by evicting idle contexts,
// ContextStore::compute: waiting would wait on it), and it has waited less than
// kKvWaitNs (blocks held for good, by pinned contexts say, end in the failure).
bool PrefillWorker::waits_for_kv(Job& j) {
    const auto bt = static_cast<size_t>(pool_->layout().block_tokens);
    const KvBlockAllocator& a = pool_->allocator();
    const uint64_t now = shm::monotonic_ns();
    // Blocks this worker's other jobs hold: they are not freed by waiting (they do
    // not run while this one waits), so only the rest of the arena counts.
    int64_t mine = 0;
    for (const Job& o : jobs_)
        if (&o != &j) mine += static_cast<int64_t>(o.seq.blocks().size());
    if (j.params.keep_kv || static_cast<int64_t>((j.all.size() + bt - 1) / bt) > a.n_blocks() - mine ||
        a.n_available() >= a.n_blocks())
        return false;
    if (j.kv_wait_since == 0) j.kv_wait_since = now;
    return now - j.kv_wait_since < kKvWaitNs;
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
        std::fprintf(stderr, "duet prefill: a pass of %zu requests failed: %s\n", p.jobs.size(),
                     st.error().message.c_str());
        for (size_t k : p.jobs) fail(jobs_[k]);
        erase_jobs(p.jobs);
    } else if (p.batch.size() > 1) {
        // Out of KV blocks (nothing was taken). With several requests in the pass, run
        // the next pass with the earliest-deadline one alone, taking no new ones.
        kv_short_ = true;
        return;
    } else {
        // Alone in its pass and still short. First the jobs set aside (partly computed
        // prompts not in this pass) give back their blocks, and it tries again.
        Job& j = jobs_[p.jobs.front()];
        bool freed = false;
        for (Job& o : jobs_)
            if (&o != &j) freed |= set_aside(o);
        if (freed) {
            kv_short_ = true;
            return;
        }
        if (waits_for_kv(j)) {
            // It would fit in the arena, but others hold blocks now (decode's running
            // sequences, which end or give way: DecodeWorker::preempt; a preempted
            // request comes back here). It gives back its own blocks too while it
            // waits: decode's last sequence, with nobody to preempt, may need one.
            set_aside(j);
            kv_short_ = true;
            usleep(2000);
            return;
        }

        // A request that cannot fit even in the whole arena fails (freeing its blocks).
        fail(j, ReqError::PrefillKv);
        erase_jobs(p.jobs);
    }
    publish_load();
    inst_->registry().wake(shm::Role::Front);
}

// A pass that ran: its tokens are done, its full blocks published, and requests
// whose prompt it completed sample their first token and are handed off.
void PrefillWorker::pass_done(const Pass& p) {
    kv_short_ = false;  // it worked: pack again (another shortage shrinks again)
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
    if (jobs_.empty()) kv_short_ = false;
    const bool took = !kv_short_ && admit();
    const bool dropped = drop_cancelled();
    if (jobs_.empty()) {
        if (dropped) publish_load();
        if (dropped || took) inst_->registry().wake(shm::Role::Front);
        return took;
    }
    // Not while short of KV: the job that runs alone then would lose the blocks a
    // blob was read into (set aside), and the next read would take them again.
    const bool swap_waits = !kv_short_ && swap_in();
    Pass p;
    PrefillPlan plan = plan_pass();
    // C6: with a prompt at risk on prefill's own cores, a pass claims decode's, cut
    // to fit decode's time in hand.
    RiskClaim risk;
    if (!plan.entries.empty() && jobs_[plan.entries.front().job].params.slo_class != 0) {
        risk = risk_claim();
        if (risk.pass_ns > 0) plan = plan_pass(risk.tokens);
    }
    for (const PrefillEntry& e : plan.entries) {
        Job& j = jobs_[e.job];
        p.batch.push_back(SeqBatch{&j.seq, j.all.data() + j.done, static_cast<int32_t>(e.tokens), false});
        p.jobs.push_back(e.job);
    }
    if (p.batch.empty()) {
        // Every job waits: for blocks to read its swapped KV into (and no new one is
        // taken meanwhile), or for another job's blocks.
        kv_short_ = swap_waits;
        usleep(2000);
        return true;
    }
    if (!outlets_.empty()) {
        reserve_destinations(p);
        if (p.batch.empty()) {
            // Every one waits for room in a decode arena (decode frees blocks as its
            // sequences finish) or for a decode worker to make its arena. Nothing
            // holds destination blocks meanwhile (a failed pass releases them), so
            // waiting cannot starve decode.
            kv_short_ = false;
            usleep(2000);
            return true;
        }
    }
    // The pass's blocks first (KvCacheManager): too few free is a planned outcome.
    Status st = kv_->reserve(p.batch);
    if (st) {
        trace::Range range("prefill pass");
        bool lent = borrow_cores(shm::Role::Decode);
        // C1: a pass led by a critical request holds only critical work.
        if (!lent && jobs_[p.jobs.front()].params.slo_class == 0) lent = claim_cores(0);
        else if (!lent && risk.pass_ns > 0) lent = claim_cores(risk.pass_ns);
        const uint64_t t0 = shm::monotonic_ns();
        // A pass no critical request leads stops for one that arrives meanwhile.
        interruptible_ = opts_.pass_interrupt && jobs_[p.jobs.front()].params.slo_class != 0;
        if (interruptible_) note_arrivals();
        st = outlets_.empty() ? backend_->forward(p.batch, logits_) : backend_->forward_export(p.batch, logits_, p.exp);
        interruptible_ = false;
        end_claim();
        if (lent) borrowed(t0);
        if (!st) kv_->unreserve(p.batch);
        if (st) {  // the front's measured prefill rates (ProcSlot work counters), own and wide
            uint64_t tokens = 0;
            for (const SeqBatch& b : p.batch) tokens += static_cast<uint64_t>(b.n_tokens);
            shm::ProcSlot& me = inst_->registry().slot(self_.slot);
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
    if (st) pass_done(p);
    else pass_failed(p, st);
    return true;
}

// ---------------------------------------------------------------- decode

Result<std::unique_ptr<DecodeWorker>> DecodeWorker::create(shm::Instance& inst, const Model& model,
                                                           const WorkerOptions& o) {
    std::unique_ptr<DecodeWorker> w(new DecodeWorker());
    if (Status st = w->init(inst, model, shm::Role::Decode, o); !st) return st.error();
    for (uint32_t p = 0; p < w->rings_.n_prefill; ++p)
        if (w->rings_.linked(p, o.index)) w->in_.emplace_back(inst.ring(w->rings_.to_decode(p, o.index)));
    inst.registry().slot(w->self_.slot).max_items.store(static_cast<uint32_t>(std::max(1, o.max_batch)),
                                                         std::memory_order_relaxed);
    if (o.max_draft > 0) w->drafter_ = std::make_unique<PromptLookupDrafter>();
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
    t.transition(a.req, shm::ReqState::Decoding, to);
    a.seq.release(*pool_);
    from[i] = std::move(from.back());
    from.pop_back();
}

// Preemption by recompute: the sequence's KV is dropped and its request goes back to
// QUEUED with its output so far, owned by its client, which sends it to prefill again
// (FrontSession::read_choice); prefill computes prompt + output (its re-drive path) and
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
    for (size_t i = 0; i < v.size(); ++i) out[i] = {v[i].admitted, v[i].seq.n_tokens(), v[i].params.slo_class};
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
            inst_->registry().slot(self_.slot).served.fetch_add(1, std::memory_order_relaxed);
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
            parked_.push_back(std::move(a));
        }
        in.release(used);
    }
    first_in_ = (first_in_ + 1) % in_.size();
    const bool dropped = end_cancelled(parked_);  // cancelled while they waited: they displace nobody
    while (!parked_.empty()) {
        size_t p = 0;
        for (size_t i = 1; i < parked_.size(); ++i)
            if (parked_[i].params.slo_class < parked_[p].params.slo_class ||
                (parked_[i].params.slo_class == parked_[p].params.slo_class && parked_[i].admitted < parked_[p].admitted))
                p = i;
        if (active_.size() >= room) {
            const size_t v = pick_slot_victim(views_of(active_), parked_[p].params.slo_class);
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

// The fastest running prefill worker's measured rate (its ProcSlot work counters),
// once it has kRateEvidenceTokens behind it; 0 before.
double DecodeWorker::prefill_rate() const {
    const shm::Registry& reg = inst_->registry();
    double best = 0;
    for (uint32_t s = 0; s < reg.n_slots(); ++s) {
        if (!reg.running_as(s, shm::Role::Prefill)) continue;
        const OwnPassWork w = own_pass_work(reg.slot(s));
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
            std::fprintf(stderr, "duet decode: swap of request %u.%u: %s (it is computed again)\n", a.req.slot,
                         a.req.gen, st.error().message.c_str());
            return 0;
        }
    }
    // No fsync: a crash re-drives the request, which then computes its KV again.
    auto h = staged_blob_write(swap_io(), swap_path(a.req), ident_, a.seq, tokens, 0, static_cast<uint64_t>(n), false);
    if (!h) {
        std::fprintf(stderr, "duet decode: swap of request %u.%u failed (it is computed again): %s\n", a.req.slot,
                     a.req.gen, h.error().message.c_str());
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
    for (size_t i = 0; i < active_.size(); ++i) {
        Active& a = active_[i];
        a.row.assign(1, a.output.back());
        // Drafts only where they can all be kept: within max_tokens (the newest draw
        // counts too) and the slot's token room.
        const size_t made = a.prompt.size() + a.output.size();
        const size_t room =
            std::min<size_t>(a.params.max_tokens > a.output.size() ? a.params.max_tokens - a.output.size() : 0,
                             t.max_tokens() > made ? t.max_tokens() - made : 0);
        const size_t k = std::min<size_t>(static_cast<size_t>(std::max(0, opts_.max_draft)), room > 0 ? room - 1 : 0);
        if (drafter_ && k > 0) {
            a.row.resize(1 + k);
            a.row.resize(1 + drafter_->propose(a.prompt, a.output, std::span(a.row).subspan(1)));
        }
        const auto want = static_cast<int32_t>(a.row.size());
        rows[i] = {{a.admitted, a.seq.n_tokens(), a.params.slo_class},
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
    int32_t j = 0;  // tokens emitted
    bool matched = true;
    while (j < n && matched && f == Finish::None) {
        const float* row = rows + static_cast<int64_t>(j) * nv;
        const int32_t next = host ? pick(row, a.params, a.prompt, a.output) : picks[j];
        if (a.params.logprobs >= 0 && a.prompt.size() + a.output.size() < t.max_tokens())
            fill_logprobs(row, nv, next, a.params.logprobs,
                          t.logprobs(a.req.slot, static_cast<uint32_t>(a.output.size())));
        a.output.push_back(next);
        f = check_stop(stop_rules(a.params), tok_->is_eog(next), a.output.size());
        if (!t.append_output(a.req, &next, 1).ok()) f = Finish::Length;  // no room left in the slot
        ++j;
        // The draft at the next position is kept only if this draw picked it; if not,
        // this draw is its correction and the row ends here.
        matched = j < n && next == a.row[static_cast<size_t>(j)];
    }
    if (n > 1) {
        t.drafted().fetch_add(static_cast<uint64_t>(n - 1), std::memory_order_relaxed);
        t.drafts_accepted().fetch_add(static_cast<uint64_t>(j - 1), std::memory_order_relaxed);
    }
    // Every token but the newest output keeps its KV: the row's positions up to the
    // last kept token's input.
    if (j < n) a.seq.truncate(*pool_, kept_from + j);
    return f;
}

Result<bool> DecodeWorker::step() {
    shm::RequestTable& t = inst_->requests();
    bool dropped = take_handoffs();
    publish_load();  // before the step: what it holds now, for routing while it runs
    dropped = end_cancelled(active_) || dropped;
    if (active_.empty()) {
        publish_load();
        if (dropped) inst_->registry().wake(shm::Role::Front);  // the cancellations are visible
        return false;
    }
    // The step's blocks first (KvCacheManager). The allocator's count allowed it, yet
    // the arena is shared: blocks gone meanwhile are a shortage, planned as one.
    DecodeStep plan = plan_step();
    std::vector<SeqBatch> batch;
    if (plan.action == DecodeStep::Action::Run) {
        samples_.resize(active_.size());
        for (const DecodeRow& r : plan.rows) {
            Active& a = active_[r.seq];
            a.row.resize(static_cast<size_t>(r.n_tokens));
            // Without log-probabilities the backend picks the token (a GPU backend then
            // copies no logits for it): the argmax alone for greedy without penalties,
            // else the sampler's pick for this request and position. The host picks
            // for a bias, while min_tokens bans end-of-generation tokens (pick()), and
            // for a verify row, whose every position is drawn in turn.
            const SamplingParams& sp = a.params.sampling;
            const bool host = r.n_tokens > 1 || a.params.logprobs >= 0 || a.params.n_bias > 0 ||
                              eog_banned(stop_rules(a.params), a.output.size());
            const bool argmax_only = sp.temperature <= 0.0f && !has_penalties(sp) && !host;
            SeqBatch b{&a.seq, a.row.data(), r.n_tokens, r.n_tokens > 1, argmax_only};
            if (!argmax_only && !host) {
                samples_[r.seq] = SampleRequest{&sp, a.prompt, a.output, a.output.size()};
                b.sample = &samples_[r.seq];
            }
            batch.push_back(b);
        }
        if (!kv_->reserve(batch)) {
            batch.clear();
            plan = plan_step(0);
        }
    }
    if (plan.action != DecodeStep::Action::Run) {
        make_room(plan);
        return true;
    }
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
    {
        yield_to_claim(yield_budget());
        trace::Range range("decode step");
        const bool lent = borrow_cores(shm::Role::Prefill);
        const uint64_t t0 = shm::monotonic_ns();
        st = backend_->forward_pick(batch, logits_, picks_);
        if (lent) borrowed(t0);
        std::atomic<uint64_t>& avg = inst_->registry().slot(self_.slot).step_ns;  // C6's cost of a claim
        const uint64_t took = shm::monotonic_ns() - t0, was = avg.load(std::memory_order_relaxed);
        avg.store(was == 0 ? took : (3 * was + took) / 4, std::memory_order_relaxed);
    }
    if (!st) {
        // Not a shortage: the blocks were taken. The newest request fails and the
        // rest try again next step (a device left unusable ended the process).
        kv_->unreserve(batch);
        std::fprintf(stderr, "duet decode: a step of %zu sequences failed: %s\n", batch.size(), st.error().message.c_str());
        t.slot(active_.back().req.slot).error_code.store(static_cast<int32_t>(ReqError::Decode), std::memory_order_relaxed);
        finish(active_.size() - 1, shm::ReqState::Failed);
        inst_->registry().wake(shm::Role::Front);
        return true;
    }
    const int64_t nv = backend_->n_vocab();
    std::vector<size_t> done;
    int64_t r = 0;  // the pass's output row of the entry
    for (size_t i = 0; i < active_.size(); ++i) {
        const SeqBatch& b = batch[i];
        const bool host = !b.argmax_only && !b.sample;
        const Finish f = emit(active_[i], logits_.data() + r * nv, picks_.data() + r, host, b.n_tokens);
        r += b.output_rows();
        if (f != Finish::None) {
            t.slot(active_[i].req.slot)
                .end_code.store(static_cast<uint32_t>(f), std::memory_order_relaxed);  // published by finish
            done.push_back(i);
        }
    }
    for (size_t k = done.size(); k-- > 0;) finish(done[k], shm::ReqState::Finished);
    publish_load();
    inst_->registry().wake(shm::Role::Front);
    return true;
}

}  // namespace duet
