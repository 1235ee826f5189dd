#include "roles/worker_base.h"

#include <chrono>
#include <thread>

#include "base/log.h"

#include <bit>

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
    const auto other = [&]() -> int32_t {
        for (uint32_t s = 0; s < reg.n_slots(); ++s) {
            const shm::ProcSlot& ps = reg.slot(s);
            const shm::ProcState st = reg.state(s);
            if (s != self_.slot &&
                (st == shm::ProcState::Starting || st == shm::ProcState::Running || st == shm::ProcState::Leaving ||
                 st == shm::ProcState::Dead) &&
                // Relaxed: written before the slot's state, which reg.state() loaded with acquire.
                ps.role.load(std::memory_order_relaxed) == static_cast<uint32_t>(role) &&
                ps.index.load(std::memory_order_relaxed) == o.index)
                return static_cast<int32_t>(s);
        }
        return -1;
    };
    // A predecessor that died is recovered by the instance's supervisor within
    // milliseconds, or once a supervisor runs again (one that died too is restarted
    // by its unit and takes the instance over): this worker waits for that, as its
    // rings must not have two consumers, but not for a live one.
    int32_t prev = other();
    for (int i = 0; i < 1500 && prev >= 0 && !reg.process_running(reg.current(static_cast<uint32_t>(prev))); ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        prev = other();
    }
    if (prev >= 0) {
        const bool running = reg.process_running(reg.current(static_cast<uint32_t>(prev)));
        reg.release(self_);
        self_ = {};
        return make_error("{} worker {} of instance {} {} (pid {})", shm::role_name(role), o.index, inst.config().name,
                          running ? "is already running" : "died, and no supervisor recovered it within 15 s",
                          reg.pid(static_cast<uint32_t>(prev)));
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
    const KvLayout layout = kv_layout(model, *dtype);
    own_threads_ = std::max(1, o.threads);
    index_ = o.index;
    role_ = role;
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
    if (o.device.cuda) log::info(b->description);
    backend_ = std::move(b->backend);
    kv_ = std::make_unique<KvCacheManager>(*pool_, alloc_);
    ident_ = {model_fingerprint(model.file()), tokenizer_fingerprint(model.file()), model.config().n_vocab};
    if (!o.swap_dir.empty()) {
        // The launcher made the directory; one this process does not see (units with a
        // private /var/tmp each) is not made here: a blob written where prefill cannot
        // read it would only be lost.
        struct stat st{};
        if (::stat(o.swap_dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
            log::warning(fmt::format("no swap directory {} (preemption recomputes)", o.swap_dir));
        } else if (gpu_kv_) {
            // GPU KV: swapped through the arena's host mirror (reserved, not committed:
            // only a swap's blocks are touched, and released after it) and a stage of
            // two page-locked halves. Without them a victim is computed again.
            auto mirror = KvMirror::create(pool_->layout(), *alloc_);
            auto stage = mirror ? device_kv_stage(*gpu_kv_, (*mirror)->pool())
                                : Result<std::unique_ptr<KvStage>>(mirror.error());
            if (!stage) {
                log::warning(fmt::format("swap of GPU KV: {} (preemption recomputes)", stage.error().message));
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

GrammarSet& WorkerBase::grammars() {
    if (!grammars_) grammars_ = std::make_unique<GrammarSet>(*tok_, static_cast<int32_t>(backend_->n_vocab()));
    return *grammars_;
}

Status WorkerBase::prepare_grammar(shm::ReqRef r, const RequestData& d, std::span<const int32_t> output) {
    if (!d.grammar) return {};
    auto mask = grammars().allowed(req_key(r), *d.grammar, output);
    if (!mask) return make_error("request {}.{}: {}", r.slot, r.gen, mask.error().message);
    return {};
}

void WorkerBase::forget_grammar(shm::ReqRef r) {
    if (grammars_) grammars_->forget(req_key(r));
}

Result<TokenConstraints> WorkerBase::constraints(shm::ReqRef r, const RequestParams& p, const RequestData& d,
                                                 std::span<const int32_t> output) {
    TokenConstraints c;
    c.bias = d.bias;
    if (eog_banned(stop_rules(p), output.size())) c.banned = eog_ids_;
    if (d.grammar) {
        auto mask = grammars().allowed(req_key(r), *d.grammar, output);
        if (!mask) return mask.error();
        c.allowed = *mask;
    }
    return c;
}

void WorkerBase::log_no_token(shm::ReqRef r, std::string_view why) const {
    log::error(fmt::format("request {}.{}: {}", r.slot, r.gen, why),
               {request_field(r), request_id_field(inst_->requests(), r)});
}

WorkerBase::Drawn WorkerBase::draw(const float* row, int32_t picked, shm::ReqRef r, const RequestParams& p,
                                   const RequestData& d, std::span<const int32_t> prompt,
                                   std::span<const int32_t> output, StopWatch* stops) {
    const shm::RequestTable& t = inst_->requests();
    TokenRules rules{stop_rules(p), {}};
    if (picked < 0) {  // the host picks: under the request's constraints
        auto c = constraints(r, p, d, output);
        if (!c) {
            log_no_token(r, c.error().message);
            return {-1, Finish::Failed};
        }
        rules.constraints = *c;
    }
    const Emitted e = emit(sampler_, row, backend_->n_vocab(), picked, p.sampling, rules, prompt, output,
                           [&](int32_t x) { return tok_->is_eog(x); });
    if (e.finish == Finish::Failed) {
        log_no_token(r);  // its bias or bans left no token its grammar allows
        return {-1, Finish::Failed};
    }
    if (p.logprobs >= 0 && prompt.size() + output.size() < t.max_tokens())
        fill_logprobs(row, backend_->n_vocab(), e.token, p.logprobs,
                      t.logprobs(r.slot, static_cast<uint32_t>(output.size())));
    Finish f = e.finish;
    if (stops && stops->push(e.token, output.size() + 1) && f != Finish::Eog) f = Finish::StopString;
    return {e.token, f};
}

std::unique_ptr<StopWatch> WorkerBase::watch_stops(const RequestParams& p, const RequestData& d,
                                                   std::span<const int32_t> output, bool* ended) const {
    *ended = false;
    if (d.stops.empty()) return nullptr;
    auto w = std::make_unique<StopWatch>(*tok_, d.stops, p.min_tokens);
    for (size_t i = 0; i < output.size(); ++i) *ended = w->push(output[i], i + 1) || *ended;
    return w;
}

void WorkerBase::publish_load(uint32_t items, uint64_t tokens) {
    WorkerStats& s = worker_stats(inst_->registry(), self_.slot);
    s.load_items.store(items, std::memory_order_relaxed);
    s.load_tokens.store(tokens, std::memory_order_relaxed);
    if (grammars_) {
        const GrammarSet::Stats g = grammars_->stats();
        s.grammar_compiles.store(g.compiles, std::memory_order_relaxed);
        s.grammar_compile_ns.store(g.compile_ns, std::memory_order_relaxed);
        s.grammar_ahead.store(g.ahead, std::memory_order_relaxed);
        s.grammar_ahead_ns.store(g.ahead_ns, std::memory_order_relaxed);
    }
}

bool WorkerBase::borrow_cores(shm::Role lender) {
    if (threads_->size() == own_threads_) return false;
    const shm::Registry& reg = inst_->registry();
    // The lender is the other role's worker of the same index (the launcher pairs
    // them: role_launches). Only a running lender lends: one that is starting (a
    // restart loads the model on those cores) or leaving (`--rebalance`: its cores
    // go to a worker of the other role) does not.
    const int32_t s = reg.find_running(lender, static_cast<int32_t>(index_));
    const bool idle =
        s >= 0 && worker_stats(reg, static_cast<uint32_t>(s)).load_items.load(std::memory_order_relaxed) == 0;
    if (!idle) {
        threads_->set_width(own_threads_);
        return false;
    }
    if (threads_->width() == own_threads_)
        worker_stats(inst_->registry(), self_.slot).borrows.fetch_add(1, std::memory_order_relaxed);
    threads_->set_width(threads_->size());
    return true;
}

void WorkerBase::borrowed(uint64_t since_ns) {
    worker_stats(inst_->registry(), self_.slot)
        .borrowed_ns.fetch_add(shm::monotonic_ns() - since_ns, std::memory_order_relaxed);
}

OwnPassWork own_pass_work(const WorkerStats& ps) {
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

// systemd's watchdog (WatchdogSec=) is told this worker lives while its loop turns or
// its pass computes: a pass may be longer than the watchdog's period (a big prompt on
// a slow or crowded CPU; a pass of a 512-token budget on an 8B model at 4 tokens/s
// is two minutes) and is alive as long as its layers go by (ThreadPool::progress); a
// step wedged in a wait (nothing computed, the loop not turning) stops the pings,
// and systemd kills and restarts the worker.
void WorkerBase::watch_liveness(const std::atomic<bool>& done) {
    const uint64_t period_ns = SdNotify::get().watchdog_usec() * 1000 / 4;
    uint64_t seen_turns = ~0ull, seen_progress = ~0ull, next = 0;
    while (!done.load(std::memory_order_relaxed)) {
        const uint64_t now = shm::monotonic_ns();
        if (now >= next) {
            const uint64_t t = turns_.load(std::memory_order_relaxed), p = threads_ ? threads_->progress() : 0;
            if (t != seen_turns || p != seen_progress) SdNotify::get().watchdog(now);
            seen_turns = t;
            seen_progress = p;
            next = now + period_ns;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
}

Status WorkerBase::run(const std::atomic<bool>& stop) {
    shm::Doorbell& bell = inst_->registry().doorbell(self_.slot);
    std::atomic<bool> done{false};
    std::thread dog;
    if (SdNotify::get().watchdog_usec() > 0) dog = std::thread([&] { watch_liveness(done); });
    Status out;
    while (!stop.load(std::memory_order_relaxed)) {
        auto did = step();
        if (!did) {
            out = did.error();
            break;
        }
        inst_->registry().heartbeat(self_);
        alive();
        // Idle: sleep until a producer rings, or 1 ms (to settle hand-offs, see stop).
        if (!*did) shm::doorbell_wait(bell, [&] { return has_work(); }, 256, 1'000'000);
    }
    done.store(true, std::memory_order_relaxed);
    if (dog.joinable()) dog.join();
    return out;
}

}  // namespace duet
