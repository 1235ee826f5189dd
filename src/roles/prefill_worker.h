// The prefill worker (roles/workers.h says what each worker does).
#pragma once

#include "roles/worker_base.h"

namespace duet {

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
        RequestData data;                          // its tables beyond the parameters (logit_bias)
        std::unique_ptr<StopWatch> stops;          // its stop strings (watch_stops), null: none
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
    bool set_aside(Job& j);     // gives back the blocks of a job that is not running (prefill_worker.cpp)
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
    PrefillPlan plan_pass(std::vector<bool>& no_room, int64_t cap = 0);
    int64_t lesser_budget() const;  // a pass not led by a critical request (prefill_pass_ns)
    // C6 (roles/claims.h): for a pass not led by a critical request, how long a pass
    // on the partner's cores may take (0: no claim) and the tokens it computes then.
    struct RiskClaim {
        uint64_t pass_ns = 0;
        int64_t tokens = 0;
    };
    RiskClaim risk_claim() const;
    uint64_t last_critical_ns_ = 0;  // when a critical request was last seen or taken (0: none yet)
    void export_plan(Pass& p) const;  // kv_split: the pass's destinations (plan_pass reserved them)
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
    PrefillScheduler sched_;       // its shortage mode across passes (engine/prefill_scheduler.h)
    shm::BlockHasher hasher_;
};

}  // namespace duet
