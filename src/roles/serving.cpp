#include "roles/serving.h"

#include <unistd.h>

#include <algorithm>

#include "model/cpu_backend.h"
#include "shm/doorbell.h"

namespace duet {

shm::InstanceConfig serve_instance_config(const ServeLayout& l, const Model& model) {
    KvLayout kv = CpuBackend::kv_layout(model);
    const uint64_t block_bytes = kv.tile_elems() * sizeof(uint16_t) * static_cast<uint64_t>(kv.n_layer);
    uint64_t blocks = l.n_blocks;
    if (blocks == 0) {
        blocks = static_cast<uint64_t>(l.n_requests) * static_cast<uint64_t>((l.n_ctx + kv.block_tokens - 1) / kv.block_tokens);
        blocks = std::min<uint64_t>(blocks, (8ull << 30) / block_bytes);
    }
    shm::InstanceConfig c;
    c.name = l.instance;
    c.registry_slots = 16;
    c.n_rings = 3;
    c.requests.n_slots = l.n_requests;
    c.requests.max_tokens = static_cast<uint32_t>(l.n_ctx);
    c.requests.block_tokens = static_cast<uint32_t>(kv.block_tokens);
    c.arenas.push_back(shm::ArenaConfig{static_cast<uint32_t>(blocks), 4, 0});
    c.cpu_kv_bytes = block_bytes * blocks;
    c.model_fingerprint = model.fingerprint();
    return c;
}

bool send_to_prefill(shm::Instance& inst, shm::SpscProducer<WireMsg>& ring, shm::ReqRef r) {
    const WireMsg m{r.slot, r.gen, 0, 0, 0, 0, {}};
    const uint64_t give_up = shm::monotonic_ns() + 2'000'000'000ull;
    bool sent = false;
    while (!(sent = ring.try_push(m)) && shm::monotonic_ns() < give_up) usleep(100);  // prefill drains it every step
    inst.registry().wake(shm::Role::Prefill);
    if (!sent) {
        shm::RequestTable& t = inst.requests();
        t.slot(r.slot).error_code.store(static_cast<int32_t>(ReqError::NotSent), std::memory_order_relaxed);
        t.transition(r, shm::ReqState::Queued, shm::ReqState::Failed);
    }
    return sent;
}

void fail_in_flight(shm::Instance& inst, ReqError why) {
    shm::RequestTable& t = inst.requests();
    for (uint32_t s = 0; s < t.n_slots(); ++s) {
        const shm::ReqRef r = t.current(s);
        for (shm::ReqState from : {shm::ReqState::Queued, shm::ReqState::Prefilling, shm::ReqState::Decoding}) {
            if (t.state(s) != from) continue;
            t.slot(s).error_code.store(static_cast<int32_t>(why), std::memory_order_relaxed);
            t.transition(r, from, shm::ReqState::Failed);
        }
    }
    inst.registry().wake(shm::Role::Front);
}

uint32_t sweep_orphans(shm::Instance& inst) {
    shm::RequestTable& t = inst.requests();
    shm::Registry& reg = inst.registry();
    uint32_t n = 0;
    for (uint32_t s = 0; s < t.n_slots(); ++s) {
        const shm::ReqState st = t.state(s);
        if (st == shm::ReqState::Free) continue;
        const uint64_t c = t.slot(s).client.load(std::memory_order_relaxed);
        if (c == 0 || reg.alive(shm::ProcRef::unpack(c))) continue;
        const shm::ReqRef r = t.current(s);
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
