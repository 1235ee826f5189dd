// What the prefill and decode workers share (WorkerBase): registration, the arena
// user, a KV pool over the instance's KV data, the backend, cores lent between
// roles, host sampling; and their options (WorkerOptions).
#pragma once


#include <atomic>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "base/thread_pool.h"
#include "engine/backends.h"
#include "engine/decode_policy.h"
#include "engine/decode_scheduler.h"
#include "engine/drafter.h"
#include "engine/golden.h"
#include "engine/kv_cache_manager.h"
#include "engine/prefill_scheduler.h"
#include "engine/scheduling.h"
#include "kernels/cpu/kernels.h"
#include "kv/blob.h"
#include "kv/shm_kv.h"
#include "model/cpu_backend.h"
#include "model/device_spec.h"
#include "model/tokenizer.h"
#include "roles/claims.h"
#include "roles/request_data.h"
#include "roles/routing.h"
#include "roles/stop_text.h"
#include "roles/wire.h"
#include "roles/worker_stats.h"
#include "shm/handoff.h"

namespace duet {

// How long a request that would fit in the arena waits for KV blocks others hold
// before it fails: prefill's alone in its pass, decode's last sequence (and a
// swapped request's KV waits this long to be read back). Blocks held
// for good (pinned contexts, another decode worker's lone sequence that fills the
// rest) end in the failure rather than a hang.
inline constexpr uint64_t kKvWaitNs = 30'000'000'000ull;

struct WorkerOptions {
    uint32_t index = 0;  // which of its role's workers (its rings follow from it)
    int numa = -1;       // the NUMA node of its CPUs, for routing (-1: not known)
    int threads = 1;
    std::vector<int> cpus;
    cpu::Isa isa = cpu::Isa::Scalar;
    // Prefill: tokens per forward pass, shared by the requests packed into it.
    int64_t prefill_budget = 512;
    // A pass not led by a critical request takes at most the tokens this worker
    // computes in this long at its measured rate (its WorkerStats work counters; at
    // least 64): a critical request arriving meanwhile waits for the pass in flight,
    // and at 512 tokens on one core that was 1.1 s of its 1 s target. 0: not cut.
    uint64_t prefill_pass_ns = 250'000'000;
    // The cut only within this long of the last critical request taken (0: always).
    uint64_t prefill_cut_window_ns = 60'000'000'000ull;
    // Prefill: requests being prefilled at once (taken from the queue, scheduled by
    // deadline within the token budget).
    int max_prefills = 16;
    // Prefill: a request's deadline is its submit time + this per token to prefill;
    // earliest deadline first (short prompts overtake long ones that arrived about
    // as early, and nothing waits for ever).
    int64_t deadline_ns_per_token = kDeadlineNsPerToken;
    bool prefix_cache = true;
    // Prefill, with borrow_cpus: passes claim decode's cores for prompts at risk
    // (rule C6, prefill_worker.cpp) while no critical work is around (prefill_cut_window_ns);
    // false: only for critical ones.
    bool risk_claims = true;
    // Prefill: a critical request arriving in its rings while a pass that no critical
    // request leads is computed stops that pass between layers, within its first
    // half (Backend::set_interrupt): the pass is computed again later, exactly (the
    // invariance contract); the critical one goes first. Each arrival stops at most
    // one pass, so work that is not critical loses at most half a pass per critical
    // request sent here. (The CUDA backend does not stop: its passes are short.)
    bool pass_interrupt = true;
    // Decode: sequences in one step; hand-offs beyond it wait in the rings (and
    // routing sends them to a decode worker with room).
    int max_batch = 256;
    // Decode: up to this many drafted tokens per sequence and step (prompt lookup,
    // engine/drafter.h), checked in the step's pass as a verify row; the output is
    // the same with any value. 0: off; kDraftTokensUnset: the device's default
    // (engine/drafter.h server_draft_tokens: on for the CPU, off for a GPU).
    int max_draft = kDraftTokensUnset;
    // Decode: the tokens of finished outputs kept as a corpus for every sequence's
    // drafts (engine/drafter.h NgramPool; its memory: 36 bytes a token). 0: none.
    int64_t draft_pool_tokens = kDefaultDraftPoolTokens;
    // Where it computes: the CPU (KV in the instance's /dev/shm segment) or a GPU
    // (KV in the instance's shared device arena on it).
    DeviceSpec device;
    bool cuda_graphs = true;
    bool cuda_qgemv = false;  // CudaBackendOptions::quantized_gemv
    // Stay STARTING in the registry (no work routed to it, not counted ready) until
    // mark_running(): `duet prefill|decode` runs the golden check first.
    bool defer_running = false;
    // Preemption by swap: decode writes a victim's KV here as a blob
    // (ReqSlot::n_swapped) when that costs less than computing it again
    // (choose_preemption), and prefill reads it back. GPU KV goes through a host
    // mirror of the arena and page-locked memory (kv/kv_stage.h staged_blob_write /
    // staged_blob_import): device -> pinned host -> disk, and back. The same directory for every
    // worker of an instance, made by the launcher (a worker that does not find it
    // recomputes). "": recompute only.
    std::string swap_dir;
    // Cores the other role's worker of the same index lends while it is idle (CPU
    // serving; the launcher pairs prefill i with decode i): the pool gets a thread
    // pinned to each, used (ThreadPool::set_width) for the steps or passes that start
    // while that worker holds no request, and given back at the next one after it
    // takes one: within one decode step (prefill's cores) or one prefill pass
    // (decode's). The kernels' results do not depend on the thread count. Empty: none.
    std::vector<int> borrow_cpus;
};

// A prefill worker's pass time and tokens for its rate on its own cores (the pass
// cut; decode's swap-or-recompute choice): the passes on its own cores alone, or
// with those computed on lent cores too while the former are under
// kRateEvidenceTokens (a worker whose partner was always idle has only wide passes).
struct OwnPassWork {
    uint64_t busy_ns = 0, tokens = 0;
};
OwnPassWork own_pass_work(const WorkerStats& ps);

// A request's key in a worker's per-request tables (its grammar matchers).
inline uint64_t req_key(shm::ReqRef r) { return (static_cast<uint64_t>(r.gen) << 32) | r.slot; }

// What both workers share: registration, the arena user, a KV pool over the
// instance's KV data, the backend.
class WorkerBase {
public:
    virtual ~WorkerBase();
    shm::ProcRef self() const { return self_; }
    // Loops on step() until *stop, sleeping on this process's doorbell when idle.
    Status run(const std::atomic<bool>& stop);
    // The golden-logits check (engine/golden.h) on this worker's own backend and KV
    // arena, before it takes work; the blocks it takes are released.
    Result<GoldenReport> golden_check(const GoldenRef& ref);
    // STARTING -> RUNNING in the registry (WorkerOptions::defer_running).
    void mark_running() { inst_->registry().set_running(self_); }
    virtual Result<bool> step() = 0;

protected:
    Status init(shm::Instance& inst, const Model& model, shm::Role role, const WorkerOptions& o);
    // run()'s watchdog thread: WATCHDOG=1 while the loop turns (alive()) or the pool
    // computes, until `done`.
    void watch_liveness(const std::atomic<bool>& done);
    // The loop turned, or a step waits on something that is moving (a decode worker's
    // ring it hands off to): not wedged.
    void alive() { turns_.fetch_add(1, std::memory_order_relaxed); }
    std::atomic<uint64_t> turns_{0};
    virtual bool has_work() = 0;
    // Load gauges in this process's registry slot, for routing.
    void publish_load(uint32_t items, uint64_t tokens);
    // What request r allows its next token to be after `output`: its logit_bias,
    // end-of-generation tokens banned while its min_tokens is not reached
    // (engine/token_step.h eog_banned), and with a grammar the tokens it allows next
    // (engine/grammar.h; the matcher brought to the output). The bitset holds until
    // the next call for any request (the grammars' one buffer), the rest while the
    // request's data does. Error: its grammar could not be followed.
    Result<TokenConstraints> constraints(shm::ReqRef r, const RequestParams& p, const RequestData& d,
                                         std::span<const int32_t> output);
    // Logs why request r has no next token: its grammar's error, or (the default)
    // that its constraints left nothing to choose.
    void log_no_token(shm::ReqRef r,
                      std::string_view why = "no token is left that its grammar, bias and bans allow") const;
    // Before a request with a grammar runs here: its grammar compiled (or found in the
    // cache) and its matcher brought to the output so far, so that a grammar this
    // worker cannot follow fails the request when it is taken, and the compile time is
    // spent then, not inside a step. forget_grammar() when it leaves.
    Status prepare_grammar(shm::ReqRef r, const RequestData& d, std::span<const int32_t> output);
    void forget_grammar(shm::ReqRef r);
    GrammarSet& grammars();
    // A request's next token, for prefill's first token and each of decode's: the
    // token path's one step (engine/token_step.h emit: the backend's pick when
    // picked >= 0, else the sampler's under the request's TokenRules, stop_rules and
    // constraints()), its log-probabilities into request r's slot when asked, and a
    // stop string it completes. Appending it is the caller's (its slot write comes
    // with blocks or drafts). Finish::Failed (token -1): nothing could be chosen
    // (its grammar could not be followed, or its bias left no token it allows;
    // logged); the caller fails the request (ReqError::Data).
    struct Drawn {
        int32_t token;
        Finish finish;
    };
    // `stops`: the request's (watch_stops), which a token completing a stop string ends
    // (Finish::StopString, unless it is an end-of-generation token).
    Drawn draw(const float* row, int32_t picked, shm::ReqRef r, const RequestParams& p, const RequestData& d,
               std::span<const int32_t> prompt, std::span<const int32_t> output, StopWatch* stops);
    // A request's stop strings (d.stops; null: none) with its outputs so far replayed;
    // *ended: a stop string is complete in them already (re-driven after the token
    // that completed it was written: it ends as that token said).
    std::unique_ptr<StopWatch> watch_stops(const RequestParams& p, const RequestData& d,
                                           std::span<const int32_t> output, bool* ended) const;
    // Before a step or pass: the pool's width, with the borrowed cores while the
    // running worker of `lender` with this one's index holds no request
    // (WorkerOptions::borrow_cpus). True when this one runs with them (the caller
    // counts its time: borrowed()).
    bool borrow_cores(shm::Role lender);
    void borrowed(uint64_t since_ns);
    // Claims on a busy partner's cores, for passes led by a critical request or by
    // a prompt at risk (the rules, C1-C6, are in roles/claims.h).
    // Prefill: claim_cores(pass_ns) before such a pass (pass_ns: how long it should
    // take, 0 for a critical-led one; true: the pool runs with the partner's cores;
    // end_claim() after it, whatever happened). Decode: yield_to_claim(budget)
    // before each step, with its yield budget (engine/scheduling.h yield_budget_ns).
    bool claim_cores(uint64_t pass_ns);
    void end_claim();
    void yield_to_claim(uint64_t budget_ns);
    // The running worker of `role` with this one's index (the partner), or -1.
    int32_t partner_slot(shm::Role role) const;
    CoreClaims claims_;  // prefill's
    int own_threads_ = 1;
    uint32_t index_ = 0;  // WorkerOptions::index
    shm::Role role_ = shm::Role::Prefill;
    ServeRings rings_;

    shm::Instance* inst_ = nullptr;
    const Model* model_ = nullptr;
    shm::ProcRef self_;
    uint32_t arena_ = 0;  // which of the instance's KV arenas (its GPU's, or the CPU's)
    uint32_t user_ = 0;
    bool joined_ = false;
    ShmBlockAllocator* alloc_ = nullptr;  // owned by pool_
    std::unique_ptr<KvPool> pool_;
    std::unique_ptr<ThreadPool> threads_;
    std::unique_ptr<DeviceKvMemory> gpu_kv_;  // the KV data, on a GPU
    std::unique_ptr<Backend> backend_;
    std::unique_ptr<KvCacheManager> kv_;  // takes each pass's blocks before it runs
    std::unique_ptr<Tokenizer> tok_;
    Sampler sampler_;
    std::vector<int32_t> eog_ids_;          // tok_->eog_ids(): banned while min_tokens is not reached
    std::unique_ptr<GrammarSet> grammars_;  // made at the first request with a grammar
    std::vector<float> logits_;
    std::vector<int32_t> picks_;          // per output row, from forward_pick
    std::vector<SampleRequest> samples_;  // the step's rows the backend samples
    WorkerOptions opts_;
    KvIdentity ident_;        // the model and tokenizer a swapped blob must belong to
    bool swap_ = false;       // preemption by swap here (WorkerOptions::swap_dir)
    std::string swap_path(shm::ReqRef r) const;  // the blob of request r's swapped KV
    // GPU KV: the arena's host mirror and the stage to it, for swaps (null on CPU).
    std::unique_ptr<KvMirror> swap_mirror_;
    std::unique_ptr<KvStage> swap_stage_;
    StagedKvIo swap_io() const { return {swap_mirror_ ? &swap_mirror_->pool() : pool_.get(), swap_stage_.get(), swap_mirror_.get()}; }
};

}  // namespace duet
