#include "roles/recovery.h"

namespace duet {

void fail_in_flight(shm::Instance& inst, ReqError why) {
    shm::RequestTable& t = inst.requests();
    for (uint32_t s = 0; s < t.n_slots(); ++s) {
        const shm::ReqRef r = t.current(s);
        for (shm::ReqState from : {shm::ReqState::Queued, shm::ReqState::Prefilling, shm::ReqState::Decoding}) {
            if (t.state(s) != from) continue;
            t.slot(s).error_code.store(static_cast<int32_t>(why), std::memory_order_relaxed);
            (void)t.transition(r, from, shm::ReqState::Failed);  // (moved meanwhile: its mover ends it)
        }
    }
    inst.registry().wake(shm::Role::Front);
}

uint32_t sweep_orphans(shm::Instance& inst, uint64_t resume_window_ns) {
    shm::RequestTable& t = inst.requests();
    shm::Registry& reg = inst.registry();
    uint32_t n = 0;
    const uint64_t now = shm::monotonic_ns();
    for (uint32_t s = 0; s < t.n_slots(); ++s) {
        const shm::ReqState st = t.state(s);
        if (st == shm::ReqState::Free) continue;
        const uint64_t c = t.slot(s).client.load(std::memory_order_relaxed);
        if (c == 0 || reg.alive(shm::ProcRef::unpack(c))) continue;
        const shm::ReqRef r = t.current(s);
        if (t.front_data(r)) {  // resumable: a new front may adopt it within the window
            std::atomic<uint64_t>& since = t.front_record(s).orphaned_ns;
            uint64_t seen = since.load(std::memory_order_relaxed);
            if (seen == 0 && since.compare_exchange_strong(seen, now, std::memory_order_relaxed)) seen = now;
            if (now - seen < resume_window_ns) continue;
            if (t.slot(s).client.load(std::memory_order_acquire) != c) continue;  // adopted meanwhile
        }
        switch (st) {
        case shm::ReqState::Queued:  // no worker has it: cancel it here (a message for it is dropped)
            n += t.transition(r, st, shm::ReqState::Cancelled);
            break;
        case shm::ReqState::Prefilling:
        case shm::ReqState::Decoding:  // its worker drops it at its next step
            if (!t.cancelled(r)) {
                t.cancel(r);
                ++n;
            }
            break;
        default:  // FINISHED, FAILED, CANCELLED: nobody will read it
            n += t.transition(r, st, shm::ReqState::Free);
        }
    }
    return n;
}

}  // namespace duet
