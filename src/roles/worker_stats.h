// A serving worker's gauges and counters, kept in its process slot's opaque role
// page (shm::Registry::role_page): written by the worker itself, read by whoever
// routes work to it (the front, a prefill worker choosing a decode worker), by the
// claims on a partner's cores (src/roles/claims.h) and by /metrics. shm/ knows
// nothing of these fields; their shape is part of the serving protocol
// (kServingProtocol, src/roles/wire.h), which every process of an instance shares.
#pragma once

#include <atomic>
#include <cstdint>
#include <type_traits>

#include "shm/registry.h"

namespace duet {

struct WorkerStats {
    // Load gauges, written with the heartbeat. Meaning by role: prefill: requests in
    // hand / tokens they still have to prefill; decode: sequences held / tokens they
    // hold.
    std::atomic<uint64_t> load_items;
    std::atomic<uint64_t> load_tokens;
    std::atomic<uint64_t> max_items;  // the most load_items it takes (decode: its batch); set once at start
    std::atomic<uint64_t> served;     // requests it has taken since it started (prefill: admitted; decode: accepted)
    // Work counters, written after each pass, read by the front (admission's measured
    // rate: engine/scheduling.h). Prefill: nanoseconds spent in forward passes and the
    // prompt tokens those passes computed, since it started.
    std::atomic<uint64_t> busy_ns;
    std::atomic<uint64_t> work_tokens;
    // Cores lent by the other role (WorkerOptions::borrow_cpus): how many times this
    // process took them, and how long it computed with them.
    std::atomic<uint64_t> borrows;
    std::atomic<uint64_t> borrowed_ns;
    // Prefill: passes computed with the other role's cores as well (lent while it was
    // idle, or yielded to a claim): their time and tokens, apart from busy_ns and
    // work_tokens (which count passes on the worker's own cores alone), so that the
    // front measures both rates (engine/scheduling.h, admission_rates).
    std::atomic<uint64_t> wide_busy_ns;
    std::atomic<uint64_t> wide_tokens;
    // Prefill: its claims that computed on its own cores alone: declined by decode
    // (C6), or withdrawn unanswered (C3).
    std::atomic<uint64_t> claims_declined;
    std::atomic<uint64_t> claims_unanswered;
    // Grammars it compiled (engine/grammar.h GrammarSet::Stats), and their time: in
    // its serving thread (a step or pass waited for them, or for one compiled ahead
    // to end) and ahead (decode: for requests still in prefill, in the background).
    std::atomic<uint64_t> grammar_compiles;
    std::atomic<uint64_t> grammar_compile_ns;
    std::atomic<uint64_t> grammar_ahead;
    std::atomic<uint64_t> grammar_ahead_ns;
    // The claim on a busy partner's cores (the rules are in src/roles/claims.h), on a
    // line of its own. Prefill: claim, the stamp of the claim it holds (0: none), and
    // claim_pass_ns, how long the claiming pass should take (0: led by a critical
    // request). Decode: claim_ack, the stamp of the claim it answered last (with
    // kClaimDeclined set: not stepping aside); yield_budget_ns, how long it may step
    // aside for a pass not led by a critical request (engine/scheduling.h); yields and
    // yielded_ns, how many times and how long it stepped aside; step_ns, its steps'
    // time, a moving average (C6's cost of a claim).
    alignas(64) std::atomic<uint64_t> claim;
    std::atomic<uint64_t> claim_pass_ns;
    std::atomic<uint64_t> claim_ack;
    std::atomic<uint64_t> yield_budget_ns;
    std::atomic<uint64_t> yields;
    std::atomic<uint64_t> yielded_ns;
    std::atomic<uint64_t> step_ns;
    // Decode: its passes' fixed cost in positions as it weighs drafts (engine/drafter.h
    // PassCostModel::fixed), in thousandths; 0 until its first pass.
    std::atomic<uint64_t> pass_fixed_milli;
    // Decode: its draft pool (engine/drafter.h NgramPool): the tokens it holds now
    // and its memory, fixed when the worker starts (0: no pool).
    std::atomic<uint64_t> draft_pool_tokens;
    std::atomic<uint64_t> draft_pool_bytes;
};
static_assert(std::is_standard_layout_v<WorkerStats>);
static_assert(sizeof(WorkerStats) <= sizeof(shm::ProcSlot::role_page) && alignof(WorkerStats) <= 64);

// The stats of the process in registry slot `slot` (any generation: zero after its
// claim until the worker writes them).
inline WorkerStats& worker_stats(const shm::Registry& reg, uint32_t slot) {
    return *reinterpret_cast<WorkerStats*>(reg.role_page(slot));
}

}  // namespace duet
