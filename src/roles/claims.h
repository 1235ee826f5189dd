#pragma once

#include <cstdint>
#include <functional>

#include "shm/registry.h"

namespace duet {

// Claims on a busy partner's cores. Lent cores (WorkerBase::borrow_cores) come
// only while the partner is idle; a critical
// prompt arriving while decode streams run would get prefill's own cores alone, and
// two such prompts close together could not both meet a 1 s target on one core
// (bench/RESULTS.md "Overload"). So a pass led by a critical request claims the
// partner's cores, and decode steps aside for it. The rules:
//   C1. Prefill claims for a pass led by a critical request (or, under C6, for
//       prompts at risk; a critical-led
//       pass holds only critical work: plan_prefill), only with cores to borrow
//       (WorkerOptions::borrow_cpus), and only from a partner (decode worker of its
//       index) that holds requests: an idle one lends them anyway.
//   C2. Decode steps aside only between steps (before its next one: a step follows
//       every time it stepped aside): under a stream of critical prompts its
//       sequences still move one token per critical pass.
//   C3. Prefill computes with the partner's cores only once the partner has
//       acknowledged this claim (claim_ack == its stamp) or holds no request;
//       otherwise after claim_wait_ns (a step and a half of the partner's, at least
//       kClaimWaitNs: decode answers only between steps) it withdraws the claim and
//       computes on its own cores. Two processes never compute on one core at once but for the time an
//       idle partner takes a new request's first step (borrow_cores' bound).
//   C4. The claim is withdrawn as soon as the pass ends (CoreClaims::end), and the
//       partner's doorbell rung. Decode returns to work when the claim it stepped
//       aside for is withdrawn, when the claiming process is not running any more,
//       or after kYieldMaxNs whatever happens (for a C6 claim, after a quarter
//       more than the pass it announced, plus kYieldSlackNs, counted from its
//       answer). The exception to C3: a pass that runs longer than that computes
//       on decode's cores while decode steps again, until it ends. Chosen so: the
//       streams' inter-token target, which the claim was sized to keep, comes
//       first; a critical pass (up to kYieldMaxNs) is rarely that long.
//   C5. Every claim has its own stamp, the clock's monotonic_ns (or one more than
//       the process's last stamp): stamps only grow, across processes too, so an
//       answer to a claim already withdrawn, this process's or a prefill worker's
//       before a restart, never passes for one to the next claim; decode answers
//       each claim once.
//   C6. A pass not led by a critical request claims only when a prompt in hand
//       would miss its TTFT deadline on prefill's own cores, computed in order
//       (queue_misses_on_own_cores; a prompt without a TTFT target, a context's,
//       or a re-driven one whose first token was given has no deadline, but its
//       tokens are in the queue), the
//       partner has published time in hand (yield_budget_ns: every stream it holds
//       stays within its class's inter-token target on average), and the pass is
//       cut to fit it (at most the pass cut, --prefill-pass-ms). Decode checks the
//       claim's pass_ns against its budget when it answers, and declines
//       (kClaimDeclined) when the budget is smaller by then: prefill computes on its
//       own cores at once. And only for a pass of at least kClaimSteps of decode's
//       steps (WorkerStats step_ns): a claim costs prefill up to a step waiting for
//       the answer and decode's step after it (C2); and of at least
//       kClaimMinTokens at the wide rate. And not while critical work is
//       around (within --prefill-cut-window of the last critical request): under
//       2-3x load these claims cost critical requests their target (at 2x, 17-18
//       of 19 met with them in three runs, 18-19 without in two; bench/RESULTS.md
//       "Overload"), and a critical pass that finds decode just back from one
//       waits for its step.
// Prefill's side is CoreClaims (WorkerBase::claim_cores and end_claim around a
// pass), decode's yield_to_claim (WorkerBase::yield_to_claim before each step); the
// protocol runs through the two workers' WorkerStats (claim, claim_pass_ns,
// claim_ack, yield_budget_ns) and decode's doorbell.
// A claim only moves time between the roles: the kernels' results do not depend on
// the thread count (the invariance contract), so no output changes.
inline constexpr uint64_t kClaimWaitNs = 100'000'000;  // C3: at least; a few decode steps of a full batch here
inline constexpr uint64_t kYieldMaxNs = 2'000'000'000;  // C4: more than the longest critical pass
inline constexpr uint64_t kYieldSlackNs = 20'000'000;   // C4: beyond a C6 pass's 5/4 (a slow pass's wake-up)
inline constexpr uint64_t kClaimDeclined = 1ull << 63;  // C6: in claim_ack, with the stamp
inline constexpr uint64_t kClaimSteps = 4;              // C6: a claimed pass is at least this many decode steps
// C6: and computes at least this many tokens: fewer, and the pass is mostly its
// fixed part (every weight read once); its length in time is kClaimSteps' to judge.
// (64, as first set, with decode's yield budget capped at kYieldMaxNs, so a pass of
// at most 1.5 s, ruled claims out wherever passes compute under 43 tokens a second:
// under ASan on the loaded CI machine, 18-40, lend_cores_e2e saw no claim at all;
// so would a large model on CPU.)
inline constexpr int64_t kClaimMinTokens = 16;

// C4: how long decode waits for a claim announcing `pass_ns` (0: a critical-led
// pass, of no announced length) to be withdrawn.
uint64_t yield_limit_ns(uint64_t pass_ns);

// C3: how long prefill waits for the answer of a partner whose steps take `step_ns`
// (WorkerStats step_ns, a moving average): a step and a half plus kYieldSlackNs, at
// least kClaimWaitNs, at most kYieldMaxNs. (A fixed wait shorter than a step, as
// under a sanitizer on a loaded machine, would see most claims go unanswered.)
uint64_t claim_wait_ns(uint64_t step_ns);

// Prefill worker `index`'s claims (the process in `self_slot`) on the cores of its
// partner, the running decode worker of the same index.
class CoreClaims {
public:
    // Claims them for a pass of about pass_ns (0: led by a critical request) and
    // waits for the answer (C3, at most wait_ns; 0: claim_wait_ns of the partner's
    // step_ns). True: the pass computes with them (the partner answered, or holds no
    // request; WorkerStats::borrows counts it) and end() follows the pass. False: no
    // partner, or the claim was declined (WorkerStats::claims_declined counts it), not
    // answered in time (claims_unanswered) or the partner stopped running: withdrawn
    // already.
    bool claim(shm::Registry& reg, uint32_t self_slot, uint32_t index, uint64_t pass_ns, uint64_t wait_ns = 0);
    // Withdraws the claim out, if any, and rings the partner (C4).
    void end(shm::Registry& reg, uint32_t self_slot, uint32_t index);
    bool out() const { return out_; }
    uint64_t last_stamp() const { return stamp_; }

private:
    uint64_t stamp_ = 0;  // the last claim's (C5)
    bool out_ = false;
};

// Decode worker `index`'s side (the process in `self_slot`), before each step (the
// caller steps after every call: C2 rests on it), with
// its yield budget (engine/scheduling.h yield_budget_ns), which it publishes: steps
// aside for its partner's claim not answered yet (C2, C5, C6). `narrow` runs
// before the answer (the worker gives back cores it borrowed). True when it
// stepped aside (WorkerStats yields and yielded_ns count it).
bool yield_to_claim(shm::Registry& reg, uint32_t self_slot, uint32_t index, uint64_t budget_ns,
                    const std::function<void()>& narrow);

}  // namespace duet
