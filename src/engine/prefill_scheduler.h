// Prefill's scheduling policy: which requests go into the next forward pass and
// how many of their tokens, as a pure function over plain views (table-tested
// without a model or processes; the worker keeps the rings, the request table and
// the hand-offs). Earliest deadline first; a request whose prompt ends in a full
// block that another request in hand is still computing waits for it (then takes
// the block from the prefix cache); the token budget is shared in deadline order;
// after a KV shortage, one request at a time. A pass led by an urgent (critical)
// request takes only urgent ones: a pass costs a fixed part plus a part per token,
// and padding it with other classes' tokens would delay the critical first tokens
// by their share.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace duet {

struct PrefillJobView {
    uint64_t deadline_ns = 0;
    int64_t remaining = 0;   // tokens still to compute (final once looked_up)
    bool looked_up = false;  // the prefix cache was consulted (it may lower remaining)
    bool follows = false;    // waits for another job's blocks (PrefillWorker::follows)
    bool urgent = false;     // of the critical class (engine/scheduling.h)
    // false: its prompt may not end in this pass, which then leaves it out where it
    // would (kv_split: the decode arena it goes to has no room for it now).
    bool may_end = true;
};

struct PrefillEntry {
    size_t job = 0;
    int64_t tokens = 0;
    friend bool operator==(const PrefillEntry&, const PrefillEntry&) = default;
};

struct PrefillPlan {
    // A job the plan reached that must consult the prefix cache first: look it up,
    // refresh the views, and plan again (a lookup changes what it and the jobs that
    // follow it need; only jobs the budget reaches are looked up, as late as that).
    int64_t lookup = -1;
    std::vector<PrefillEntry> entries;  // in deadline order
};

// A job that may not end (may_end false) is left out of a pass that would end its
// prompt, and its share of the budget goes to the jobs after it.
// budget: tokens in the pass; one_at_a_time: the previous pass ran out of KV blocks
// (only one job runs until a pass succeeds: the earliest deadline, or the earliest
// that may run); lesser_budget: the budget of a pass not led by an urgent job (<= 0:
// budget), so that an urgent request arriving meanwhile waits for a short pass
// (PrefillWorker: --prefill-pass-ms).
PrefillPlan plan_prefill(std::span<const PrefillJobView> jobs, int64_t budget, bool one_at_a_time,
                         int64_t lesser_budget = 0);

// A job in hand, as the KV-shortage policy sees it.
struct PrefillKvView {
    int64_t held = 0;          // blocks its KV holds now
    int64_t need = 0;          // blocks its whole prompt (and output so far) takes
    bool own_blocks = true;    // false: they are its client's (a context's offered KV): never set aside
    bool client_waits = true;  // false: a context's computation, whose store answers a failure by evicting
    uint64_t waited_ns = 0;    // alone and short for this long (0: it was not)
};

// The arena, for that policy.
struct PrefillArenaView {
    int64_t blocks = 0;     // all of them
    int64_t available = 0;  // free, and cached ones nobody holds
};

// What a pass that found too few KV blocks (it took none) leads to:
//   Shrink    several jobs were in it: the next pass runs the earliest deadline alone
//             (and no new job is taken) until a pass succeeds;
//   SetAside  alone, and jobs not in the pass hold blocks of their own: they give
//             them back (`jobs`) and it tries again (their KV is computed again when
//             they run: exact, by the invariance contract);
//   Wait      alone, it would fit the arena beside what the other jobs hold, others
//             hold blocks now, its client waits, and it has waited less than
//             kv_wait_ns: it gives back its own blocks too (decode's last sequence
//             may need one) and tries again in a moment;
//   Fail      otherwise: the request fails (PrefillKv).
struct PrefillShortage {
    enum class Action { Shrink, SetAside, Wait, Fail };
    Action action = Action::Shrink;
    std::vector<size_t> jobs;  // SetAside: the jobs that give back their blocks
};
PrefillShortage plan_prefill_shortage(std::span<const PrefillKvView> jobs, std::span<const size_t> pass,
                                      PrefillArenaView arena, uint64_t kv_wait_ns);

// Prefill's scheduling state across passes: the shortage mode (one job at a time,
// no new ones) that a pass short of KV blocks enters and a pass that ran leaves.
// The worker asks it for each pass's plan and tells it each pass's outcome; it
// never edits a plan (a fact that changes one, such as a lookup's cached blocks or
// no room where a prompt's KV goes, is put in the views and the pass planned again).
class PrefillScheduler {
public:
    // The next pass's plan (plan_prefill in the current mode).
    PrefillPlan plan(std::span<const PrefillJobView> jobs, int64_t budget, int64_t lesser_budget = 0) const {
        return plan_prefill(jobs, budget, short_, lesser_budget);
    }
    // In the shortage mode: one job at a time, and no new jobs taken.
    bool short_of_kv() const { return short_; }
    // A pass ran, or there is nothing to run: pack again.
    void ran() { short_ = false; }
    // No pass could be made: every job waits, for blocks to read a swapped request
    // back into (the mode holds: no new jobs meanwhile) or for something else.
    void nothing_to_run(bool waiting_for_blocks) { short_ = waiting_for_blocks; }
    // A pass found too few blocks: the policy's action (plan_prefill_shortage); the
    // mode holds unless the request fails.
    PrefillShortage short_of_blocks(std::span<const PrefillKvView> jobs, std::span<const size_t> pass,
                                    PrefillArenaView arena, uint64_t kv_wait_ns) {
        PrefillShortage s = plan_prefill_shortage(jobs, pass, arena, kv_wait_ns);
        if (s.action != PrefillShortage::Action::Fail) short_ = true;
        return s;
    }

private:
    bool short_ = false;
};

}  // namespace duet
