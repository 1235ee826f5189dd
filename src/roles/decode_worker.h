// The decode worker (roles/workers.h says what each worker does).
#pragma once

#include "roles/worker_base.h"

namespace duet {

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
        RequestData data;  // its tables beyond the parameters (logit_bias)
        std::unique_ptr<StopWatch> stops;  // its stop strings (watch_stops), null: none
        std::vector<int32_t> prompt, output;
        bool fresh = false;  // not yet in a step
        uint64_t admitted = 0;  // its first submission's time (DecodeSeqView::admitted)
        uint64_t kv_wait_since = 0;  // alone and waiting for a KV block others hold, since (0: not)
        uint64_t first_step_ns = 0;   // its pace since (yield_budget_ns): when its first step here began
        size_t first_step_tokens = 0;  // and its output tokens then
        std::vector<int32_t> row;      // the step's input: the newest output token, then its drafts
        DraftPace pace;                // how many tokens it drafts next (engine/drafter.h)
        DraftSource drafted_from = DraftSource::Sequence;  // where the row's drafts came from
        DraftOdds odds;                                    // how its drafts fare (trim_drafts weighs them by it)
        int32_t shadow = -1;  // the first draft of a proposal trimmed away: checked against the next token
    };
    uint64_t yield_budget() const;  // over active_ (engine/scheduling.h yield_budget_ns)
    // from[i] (active_ or parked_) ends in state `to`.
    void finish(std::vector<Active>& from, size_t i, shm::ReqState to);
    void finish(size_t i, shm::ReqState to) { finish(active_, i, to); }
    // Registers the full blocks of a finished sequence (prompt and answer) in the
    // arena's prefix index, as prefill does for the prompt's.
    void publish_blocks(const Active& a);
    shm::BlockHasher hasher_;
    // Writes a's KV to its swap blob when that is cheaper than recomputing it: the
    // positions written (0: it will be computed again).
    uint32_t swap_out(Active& a);
    double swap_rate_ = 0;      // bytes/s of this worker's swap writes (0: none measured yet)
    double prefill_rate() const;  // tokens/s of the fastest prefill worker (0: not known yet)
    // Preemption by swap or recompute of from[i] (active_ or parked_; decode_worker.cpp).
    bool preempt(std::vector<Active>& from, size_t i);
    // The rings' hand-offs into parked_, parked_ into the batch (decode_worker.cpp); true
    // when parked requests found cancelled were ended.
    bool take_handoffs();
    bool end_cancelled(std::vector<Active>& from);  // from's cancelled requests ended; true if any
    // The grammars of requests on their way (queued or in prefill), compiled ahead on
    // GrammarSet's background thread, so that taking such a request does not stall
    // the step of every other stream while its grammar compiles (each worker process
    // compiles its own). At most once a millisecond; prefetched_: the generation of
    // each request slot looked at (a request is looked at once).
    void prefetch_grammars();
    std::vector<uint32_t> prefetched_;
    uint64_t next_prefetch_ns_ = 0;
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
    // The step's batch for a Run plan: each row's input.
    void build_batch(const DecodeStep& plan, std::vector<SeqBatch>& batch);
    // Who picks each row's tokens (the backend: argmax or its sampler under the
    // request's constraints; or the host), for the batch build_batch made of plan.
    void choose_pickers(const DecodeStep& plan, std::span<SeqBatch> batch);
    std::vector<std::vector<uint32_t>> masks_;  // per active sequence: its grammar's mask for the pass
    std::unique_ptr<Drafter> drafter_;
    // The draft records (pace, odds) of the sequences it preempted, back with them
    // when they return here (preempt keeps, take_handoffs takes).
    DraftMemory draft_memory_;
    // The outputs this worker finished, a corpus for the drafts of every sequence
    // (WorkerOptions::draft_pool_tokens; null: none).
    std::unique_ptr<NgramPool> pool_drafts_;
    std::vector<int32_t> pool_scratch_;  // its draft, before it is chosen
    // What this worker's passes cost by their positions (trim_drafts' `cost`):
    // measured on the passes it runs.
    PassCostModel pass_cost_;
    // The most tokens a request drafts per step: its "speculative" over the server's
    // WorkerOptions::max_draft (engine/drafter.h draft_limit).
    int max_draft(const RequestParams& p) const { return draft_limit(p.draft_mode, p.max_draft, opts_.max_draft); }
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
