#include "roles/claims.h"

#include <unistd.h>

#include <algorithm>

#include "roles/worker_stats.h"
#include "shm/doorbell.h"

namespace duet {

uint64_t yield_limit_ns(uint64_t pass_ns) {
    return pass_ns == 0 ? kYieldMaxNs : std::min(kYieldMaxNs, pass_ns + pass_ns / 4 + kYieldSlackNs);
}

uint64_t claim_wait_ns(uint64_t step_ns) {
    return std::clamp(step_ns + step_ns / 2 + kYieldSlackNs, kClaimWaitNs, kYieldMaxNs);
}

bool CoreClaims::claim(shm::Registry& reg, uint32_t self_slot, uint32_t index, uint64_t pass_ns, uint64_t wait_ns) {
    const int32_t partner = reg.find_running(shm::Role::Decode, static_cast<int32_t>(index));
    if (partner < 0) return false;
    const WorkerStats& ps = worker_stats(reg, static_cast<uint32_t>(partner));
    WorkerStats& me = worker_stats(reg, self_slot);
    const uint64_t stamp = stamp_ = std::max(stamp_ + 1, shm::monotonic_ns());  // C5
    me.claim_pass_ns.store(pass_ns, std::memory_order_relaxed);  // published by the claim's release
    me.claim.store(stamp, std::memory_order_release);
    out_ = true;
    reg.wake(shm::Role::Decode, static_cast<int32_t>(index));
    if (wait_ns == 0) wait_ns = claim_wait_ns(ps.step_ns.load(std::memory_order_relaxed));
    const uint64_t until = shm::monotonic_ns() + wait_ns;
    for (;;) {
        const uint64_t ack = ps.claim_ack.load(std::memory_order_acquire);
        if (ack == (stamp | kClaimDeclined)) {
            me.claims_declined.fetch_add(1, std::memory_order_relaxed);
            break;
        }
        if (ack == stamp || ps.load_items.load(std::memory_order_relaxed) == 0) {
            me.borrows.fetch_add(1, std::memory_order_relaxed);
            return true;
        }
        if (!reg.running_as(static_cast<uint32_t>(partner), shm::Role::Decode)) break;
        if (shm::monotonic_ns() >= until) {
            me.claims_unanswered.fetch_add(1, std::memory_order_relaxed);
            break;
        }
        usleep(200);
    }
    end(reg, self_slot, index);
    return false;
}

void CoreClaims::end(shm::Registry& reg, uint32_t self_slot, uint32_t index) {
    if (!out_) return;
    out_ = false;
    worker_stats(reg, self_slot).claim.store(0, std::memory_order_release);
    reg.wake(shm::Role::Decode, static_cast<int32_t>(index));
}

bool yield_to_claim(shm::Registry& reg, uint32_t self_slot, uint32_t index, uint64_t budget_ns,
                    const std::function<void()>& narrow) {
    WorkerStats& me = worker_stats(reg, self_slot);
    me.yield_budget_ns.store(budget_ns, std::memory_order_relaxed);
    const int32_t partner = reg.find_running(shm::Role::Prefill, static_cast<int32_t>(index));
    if (partner < 0) return false;
    const WorkerStats& ps = worker_stats(reg, static_cast<uint32_t>(partner));
    const uint64_t stamp = ps.claim.load(std::memory_order_acquire);
    if (stamp == 0 || (me.claim_ack.load(std::memory_order_relaxed) & ~kClaimDeclined) == stamp) return false;  // C5
    const uint64_t pass_ns = ps.claim_pass_ns.load(std::memory_order_relaxed);
    // (A new claim between the two loads: its pass_ns may not be the stamp's; the
    // next step looks again.)
    if (ps.claim.load(std::memory_order_acquire) != stamp) return false;
    if (pass_ns > budget_ns) {  // C6
        me.claim_ack.store(stamp | kClaimDeclined, std::memory_order_release);
        return false;
    }
    // Our borrowed cores first (the claimer runs on them), then the acknowledgement.
    narrow();
    const uint64_t t0 = shm::monotonic_ns(), limit = yield_limit_ns(pass_ns);
    me.claim_ack.store(stamp, std::memory_order_release);
    shm::Doorbell& bell = reg.doorbell(self_slot);
    for (;;) {
        const uint64_t now = shm::monotonic_ns();
        if (now - t0 >= limit || !reg.running_as(static_cast<uint32_t>(partner), shm::Role::Prefill)) break;
        // CoreClaims::end rings this doorbell; so do producers of our other work (the
        // wait only ends early and looks again). 10 ms slices: C4's liveness checks.
        if (shm::doorbell_wait(bell, [&] { return ps.claim.load(std::memory_order_acquire) != stamp; }, 0,
                               static_cast<int64_t>(std::min<uint64_t>(10'000'000, limit - (now - t0)))))
            break;
    }
    me.yields.fetch_add(1, std::memory_order_relaxed);
    me.yielded_ns.fetch_add(shm::monotonic_ns() - t0, std::memory_order_relaxed);
    return true;
}

}  // namespace duet
