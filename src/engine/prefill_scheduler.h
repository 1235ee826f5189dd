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

// budget: tokens in the pass; one_at_a_time: the previous pass ran out of KV blocks
// (only the earliest deadline runs until a pass succeeds); lesser_budget: the budget
// of a pass not led by an urgent job (<= 0: budget), so that an urgent request
// arriving meanwhile waits for a short pass (PrefillWorker: --prefill-pass-ms).
PrefillPlan plan_prefill(std::span<const PrefillJobView> jobs, int64_t budget, bool one_at_a_time,
                         int64_t lesser_budget = 0);

}  // namespace duet
