// Decode's plan for one step: which sequences run with how many positions, or —
// when the arena cannot hold the step — the one action that makes room. A pure
// function over plain views (as plan_prefill and launch_step): the decode worker
// executes the plan and decides nothing itself, and every branch of the KV-shortage
// policy is a row of a table test (tests/decode_scheduler_test.cpp).
//
// A row computes n_tokens positions: 1 for a plain step (the newest output token),
// 1 + k for a verify row (the newest token and k drafted ones, whose logits the pass
// returns for every position; the worker keeps the positions whose draw matched the
// draft and truncates the rest). Drafts are optional work: when the step with them
// does not fit the free blocks, every row falls back to one position before anyone
// is preempted.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "engine/decode_policy.h"

namespace duet {

struct DecodeRowView {
    DecodeSeqView seq;
    int32_t want = 1;        // positions it would compute: 1, or 1 + its drafts
    int64_t need = 0;        // KV blocks those take (blocks_to_append)
    int64_t need_one = 0;    // KV blocks one position takes
    bool fits_arena = true;  // its KV with one more position fits the whole arena
    uint64_t waited_ns = 0;  // alone and short of blocks for this long (0: it was not)
};

struct DecodeArenaView {
    int64_t available = 0;     // blocks a reservation may take now (free and unreferenced cached)
    bool others_hold = false;  // blocks are held elsewhere (prefill, another worker), so waiting can help
};

struct DecodeRow {
    size_t seq = 0;  // index into the active views
    int32_t n_tokens = 1;
};

struct DecodeStep {
    enum class Action {
        Run,            // rows: reserve their blocks and run the pass
        Idle,           // nothing to run
        PreemptParked,  // victim (an index into parked) gives its blocks: swap or recompute
        Preempt,        // victim (an index into active) gives way: swap or recompute
        Wait,           // victim, alone, waits for blocks others hold; the step is tried again
        Fail,           // victim cannot get its blocks: its request fails
    };
    Action action = Action::Idle;
    std::vector<DecodeRow> rows;  // Run: one per active sequence, in order
    size_t victim = SIZE_MAX;
};

// The step over `active` (the batch, in order) and `parked` (hand-offs holding KV
// that wait for a slot). Run when every row's blocks fit `arena.available`: with
// their drafts, else with one position each. Short of blocks, the policy, in order:
//   - a parked sequence of a class no more urgent than the active victim's gives
//     its blocks first (PreemptParked);
//   - with more than one active sequence, pick_decode_victim's gives way (Preempt);
//   - alone, it waits (Wait) while its KV would fit the arena, others hold blocks
//     and it has waited less than kv_wait_ns;
//   - else its request fails (Fail).
DecodeStep plan_decode(std::span<const DecodeRowView> active, std::span<const DecodeSeqView> parked,
                       DecodeArenaView arena, uint64_t kv_wait_ns);

}  // namespace duet
