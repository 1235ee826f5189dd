// The prefill and decode workers: each is one process's loop over the shared
// instance. Prefill takes QUEUED requests (prompt + any output already produced,
// so a re-driven request continues where it stopped), runs the forward pass in
// chunks, samples the next token and hands the request and its KV blocks to
// decode (shm/handoff.h: no copy, no crash window). Decode runs every request it
// holds one token per step in one batched forward pass (continuous batching: a new
// request joins at the next step boundary), until end of generation, max_tokens or
// cancel. Output tokens go into the request slot; sampling is keyed by (seed,
// output index), so a re-driven stream is the same stream.
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
#include "roles/routing.h"
#include "roles/wire.h"
#include "shm/handoff.h"

namespace duet {

struct WorkerOptions {
    uint32_t index = 0;  // which of its role's workers (its rings follow from it)
    int numa = -1;       // the NUMA node of its CPUs, for routing (-1: not known)
    int threads = 1;
    std::vector<int> cpus;
    cpu::Isa isa = cpu::Isa::Scalar;
    // Prefill: tokens per forward pass, shared by the requests packed into it.
    int64_t prefill_budget = 512;
    // A pass not led by a critical request takes at most the tokens this worker
    // computes in this long at its measured rate (its ProcSlot work counters; at
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
    // (rule C6, workers.cpp) while no critical work is around (prefill_cut_window_ns);
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
    // the same with any value. 0: off.
    int max_draft = 0;
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
OwnPassWork own_pass_work(const shm::ProcSlot& ps);

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
    virtual bool has_work() = 0;
    // Load gauges in this process's registry slot, for routing.
    void publish_load(uint32_t items, uint64_t tokens);
    // A request's next token from its logits row on the host: the sampler's pick for
    // its position, after its logit_bias is added and, while its min_tokens is not
    // reached, end-of-generation tokens banned (engine/token_step.h eog_banned). The
    // row is not changed.
    int32_t pick(const float* row, const RequestParams& p, std::span<const int32_t> prompt,
                 std::span<const int32_t> output);
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
    std::vector<int32_t> eog_ids_;   // tok_->eog_ids(): banned while min_tokens is not reached
    std::vector<float> banned_row_;  // pick()'s copy of a row with them banned
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

class PrefillWorker final : public WorkerBase {
public:
    static Result<std::unique_ptr<PrefillWorker>> create(shm::Instance& inst, const Model& model,
                                                         const WorkerOptions& o);
    ~PrefillWorker();
    // Settles finished hand-offs, takes queued requests and runs one forward pass
    // over the ones the plan packs into it (engine/prefill_scheduler.h); false when
    // there was nothing to do.
    Result<bool> step() override;

private:
    bool has_work() override;
    struct Pending {
        shm::Handoff h;
        std::vector<int32_t> blocks;
        WireMsg msg;
        shm::ProcRef to;  // the decode process it was sent to (invalid: none was running)
        uint32_t arena = 0;               // where the blocks are
        KvBlockAllocator* alloc = nullptr;  // our references there
    };
    // kv_split: a decode arena this worker hands off into. Its blocks for a request
    // are taken when the pass that ends the prompt is planned; the pass copies every
    // block of the request there (Backend::forward_export), and the hand-off names
    // them, from our user in that arena.
    struct Outlet {
        uint32_t arena = 0;
        uint32_t user = 0;
        std::unique_ptr<ShmBlockAllocator> alloc;
        std::unique_ptr<DeviceKvMemory> gpu;  // mapped here (GPU instances), once its decode worker made it
        KvDest dest;                         // data null until reachable
        bool said = false;                   // an error mapping it was printed
    };
    // A request being prefilled.
    struct Job {
        shm::ReqRef req;
        RequestParams params;
        std::vector<int32_t> prompt, output, all;  // all: prompt + output already produced (re-drive)
        std::vector<shm::BlockHash> hashes;        // of all's full blocks, chained
        KvSeq seq;
        size_t done = 0;  // tokens of `all` with KV in seq
        uint64_t deadline_ns = 0;
        uint64_t submit_ns = 0;  // its first submission (its TTFT deadline: + params.ttft_target_ns)
        bool looked_up = false;  // prefix cache consulted
        size_t published = 0;    // full blocks registered in the prefix index
        int32_t outlet = -1;         // kv_split: where its KV goes (outlets_)
        std::vector<int32_t> dst;    // kv_split: its blocks there
        uint64_t kv_wait_since = 0;  // waiting alone for KV blocks others hold, since (0: not)
        uint32_t swapped = 0;        // positions decode swapped out, to read back before it runs (0: none)
        uint32_t swap_held = 0;      // read back (done), its blob kept until the job's next pass ran
        uint64_t swap_wait_since = 0;  // waiting for blocks to read them into, since
    };
    void drop_swap(Job& j);
    // Reads the swapped KV of jobs that have some back (blocks permitting): true if
    // any job still waits for blocks to read its KV into.
    bool swap_in();
    // Drops the blocks of hand-offs decode took (or that were re-driven); sends again
    // those whose decode worker died before taking them.
    void settle();
    bool waits_for_kv(Job& j);  // after a pass of j alone found no KV blocks (workers.cpp)
    bool set_aside(Job& j);     // gives back the blocks of a job that is not running (workers.cpp)
    // Sends a hand-off to the decode worker with room and the least work; the ref of
    // the process it went to (invalid if no decode worker runs: it waits in the ring
    // of the one being restarted).
    shm::ProcRef send_handoff(const WireMsg& m, uint32_t arena);
    // Whether decode worker d takes our hand-offs of blocks in `arena` (its ring is
    // linked to us and its KV arena is that one).
    bool hands_to(uint32_t d, uint32_t arena) const;
    // Whether a decode worker taking our hand-offs of blocks in `arena` is running.
    bool decode_running_on(uint32_t arena) const;
    // kv_split: joins the decode arenas as a user of each.
    Status join_outlets();
    // The index in outlets_ of `arena`'s outlet, or -1.
    int32_t find_outlet(uint32_t arena) const;
    // kv_split: blocks for every token of j in a decode worker's arena (the one
    // with room and the least work); false when none can take it now (its arena full,
    // or not made yet), to try again at a later pass.
    bool reserve_destination(Job& j);
    // One pass: its entries (batch[i] computes jobs_[jobs[i]]) and, kv_split, where
    // each entry's KV is copied.
    struct Pass {
        std::vector<SeqBatch> batch;
        std::vector<size_t> jobs;
        KvExport exp;
    };
    bool give_kv_to_client(Job& j);  // false: the client is gone (nothing given)
    bool drop_cancelled();
    // cap > 0: a pass not led by a critical request takes at most cap tokens.
    PrefillPlan plan_pass(int64_t cap = 0);
    int64_t lesser_budget() const;  // a pass not led by a critical request (prefill_pass_ns)
    // C6 (roles/claims.h): for a pass not led by a critical request, how long a pass
    // on the partner's cores may take (0: no claim) and the tokens it computes then.
    struct RiskClaim {
        uint64_t pass_ns = 0;
        int64_t tokens = 0;
    };
    RiskClaim risk_claim() const;
    uint64_t last_critical_ns_ = 0;  // when a critical request was last seen or taken (0: none yet)
    void reserve_destinations(Pass& p);
    void erase_jobs(std::vector<size_t> which);
    void pass_failed(const Pass& p, const Status& st);
    void pass_done(const Pass& p);
    // Drops everything j holds: its blocks here and, kv_split, there.
    void release(Job& j);
    void release_destination(Job& j);
    // Whether job k waits for another job's blocks (its prompt ends in a full block
    // another job in hand has yet to publish).
    bool follows(size_t k) const;
    // Takes queued requests while there is room; false if the ring was empty.
    bool admit();
    // Backend::set_interrupt's check (WorkerOptions::pass_interrupt), from a backend
    // thread while step() waits in forward: during a pass that may be stopped, a
    // critical request arrived in either ring since it began (messages past in_at_ /
    // redo_at_; each looked at once) and there is room to take it.
    bool critical_arrived();
    void note_arrivals();  // in_at_ / redo_at_: what the rings hold as the pass begins
    bool interruptible_ = false;
    size_t in_at_ = 0;      // the front ring's readable messages (peek order)
    uint64_t redo_at_ = 0;  // the launcher ring's records published (consumed + backlog)
    void lookup_prefix(Job& j);
    // The blocks the client offered (RequestParams::given_tokens): true when j starts
    // from them (our own references taken, the slot's table emptied).
    bool take_given(Job& j);
    void publish_blocks(Job& j);
    // Samples the first token and hands the request to decode (or ends it).
    void complete(Job& j, const float* logits);
    void fail(Job& j, ReqError why = ReqError::Prefill);
    void publish_load();
    shm::SpscConsumer<WireMsg> in_;     // from the front
    shm::SpscConsumer<WireMsg> redo_;   // from the launcher: re-driven requests
    // The front ring's readable messages (from its read position): each one's deadline
    // (PrefillWorker::admit), or kTaken once taken or dropped.
    static constexpr uint64_t kTaken = UINT64_MAX;
    std::vector<uint64_t> in_seen_;
    void take(const WireMsg& m);
    uint64_t queued_deadline(const WireMsg& m);
    std::vector<shm::SpscProducer<WireMsg>> out_;  // to each decode worker
    std::vector<Pending> pending_;
    std::vector<Job> jobs_;
    std::vector<Outlet> outlets_;  // kv_split: one per decode arena
    bool kv_short_ = false;  // the last packed pass ran out of KV blocks
    shm::BlockHasher hasher_;
};

class DecodeWorker final : public WorkerBase {
public:
    static Result<std::unique_ptr<DecodeWorker>> create(shm::Instance& inst, const Model& model,
                                                        const WorkerOptions& o);
    ~DecodeWorker();
    // Takes new hand-offs and runs one decode step over every request it holds;
    // false when it holds none.
    Result<bool> step() override;
    size_t active() const { return active_.size(); }

private:
    bool has_work() override;
    struct Active {
        shm::ReqRef req;
        KvSeq seq;
        RequestParams params;
        std::vector<int32_t> prompt, output;
        bool fresh = false;  // not yet in a step
        uint64_t admitted = 0;  // its first submission's time (DecodeSeqView::admitted)
        uint64_t kv_wait_since = 0;  // alone and waiting for a KV block others hold, since (0: not)
        uint64_t first_step_ns = 0;   // its pace since (yield_budget_ns): when its first step here began
        size_t first_step_tokens = 0;  // and its output tokens then
        std::vector<int32_t> row;      // the step's input: the newest output token, then its drafts
    };
    uint64_t yield_budget() const;  // over active_ (engine/scheduling.h yield_budget_ns)
    // from[i] (active_ or parked_) ends in state `to`.
    void finish(std::vector<Active>& from, size_t i, shm::ReqState to);
    void finish(size_t i, shm::ReqState to) { finish(active_, i, to); }
    // Writes a's KV to its swap blob when that is cheaper than recomputing it: the
    // positions written (0: it will be computed again).
    uint32_t swap_out(Active& a);
    double swap_rate_ = 0;      // bytes/s of this worker's swap writes (0: none measured yet)
    double prefill_rate() const;  // tokens/s of the fastest prefill worker (0: not known yet)
    // Preemption by swap or recompute of from[i] (active_ or parked_; workers.cpp).
    bool preempt(std::vector<Active>& from, size_t i);
    // The rings' hand-offs into parked_, parked_ into the batch (workers.cpp); true
    // when parked requests found cancelled were ended.
    bool take_handoffs();
    bool end_cancelled(std::vector<Active>& from);  // from's cancelled requests ended; true if any
    static std::vector<DecodeSeqView> views_of(const std::vector<Active>& v);  // for the decode policy
    // The step's plan (engine/decode_scheduler.h) over active_ and parked_, each
    // Active's row filled with its input (drafts included); available: the blocks a
    // reservation may take (-1: the allocator's count now).
    DecodeStep plan_step(int64_t available = -1);
    // Carries out a plan that is not Run (one preemption, a wait or a failure).
    void make_room(const DecodeStep& plan);
    // Takes the tokens of a's row (of n positions) from the pass's rows at `rows`:
    // each drawn as plain decoding draws it, a draft kept while it matches, the rest
    // of the row's KV dropped. The Finish that ends it, or None.
    Finish emit(Active& a, const float* rows, const int32_t* picks, bool host, int32_t n);
    std::unique_ptr<Drafter> drafter_;  // null: no drafts (WorkerOptions::max_draft 0)
    void publish_load();
    std::vector<shm::SpscConsumer<WireMsg>> in_;  // from each prefill worker
    size_t first_in_ = 0;  // the ring taken from first at the next step (round robin: none starves)
    std::vector<Active> active_;
    // Hand-offs taken from the rings that wait for a batch slot (they hold their KV),
    // so a more urgent one behind them in a ring is not held up; they join the batch
    // most urgent first.
    std::vector<Active> parked_;
};

}  // namespace duet
