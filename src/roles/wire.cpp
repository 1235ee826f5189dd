#include "roles/wire.h"

#include <algorithm>

#include <nlohmann/json.hpp>

#include "model/backend.h"

namespace duet {

shm::InstanceConfig serve_instance_config(const ServeLayout& l, const Model& model) {
    KvLayout kv = kv_layout(model, l.kv_dtype);
    const uint64_t block_bytes = kv.block_bytes();
    uint64_t blocks = l.n_blocks;
    if (blocks == 0) {
        blocks = static_cast<uint64_t>(l.n_requests) * static_cast<uint64_t>((l.n_ctx + kv.block_tokens - 1) / kv.block_tokens);
        // 8 GiB of host KV at most, shared by the per-role arenas.
        blocks = std::min<uint64_t>(blocks, (8ull << 30) / block_bytes / (l.n_gpus == 0 && l.kv_split ? 2 : 1));
    }
    shm::InstanceConfig c;
    c.name = l.instance;
    c.user_protocol = kServingProtocol;
    const bool split_gpus = l.n_gpus > 0 && l.kv_split;
    const uint32_t n_prefill = l.n_gpus && !split_gpus ? l.n_gpus : l.n_prefill;
    const uint32_t n_decode = l.n_gpus && !split_gpus ? l.n_gpus : l.n_decode;
    // Indices (rings) per role: with role changes, room for all workers but one in each.
    const bool spares = l.rebalance && l.n_gpus == 0 && !l.kv_split;
    const uint32_t slots_prefill = spares ? n_prefill + n_decode - 1 : n_prefill;
    const uint32_t slots_decode = spares ? n_prefill + n_decode - 1 : n_decode;
    c.kv_split = l.kv_split;
    c.kv_dtype = static_cast<uint32_t>(l.kv_dtype);
    // Every worker, the front, the launcher, and room for processes being replaced.
    c.registry_slots = std::max<uint32_t>(16, 2 * (n_prefill + n_decode) + 4);
    c.prefill_workers = slots_prefill;
    c.decode_workers = slots_decode;
    c.requests.n_slots = l.n_requests;
    c.requests.max_tokens = static_cast<uint32_t>(l.n_ctx);
    c.requests.block_tokens = static_cast<uint32_t>(kv.block_tokens);
    // Every worker writing an arena is one of its users (a dead one's user is
    // recovered before it is restarted); fewer users leave more bits for each one's
    // reference counts. With kv_split every prefill worker also writes the decode
    // arenas it hands off into.
    const auto b32 = static_cast<uint32_t>(blocks);
    if (l.n_gpus == 0) {
        const uint32_t front = l.contexts ? 1 : 0;  // the front's context store, in arena 0
        if (!l.kv_split) {
            c.arenas.push_back(shm::ArenaConfig{b32, n_prefill + n_decode + front, 0});
        } else {
            c.arenas.push_back(shm::ArenaConfig{b32, n_prefill + front, 0});
            c.arenas.push_back(shm::ArenaConfig{b32, n_prefill + n_decode, 0});
        }
        c.cpu_kv_bytes = block_bytes * blocks * c.arenas.size();
    } else if (!l.kv_split) {
        // One arena per GPU, used by that GPU's pair (and arena 0 by the front's
        // context store, kContextArena: its requests go to GPU 0's pair).
        for (uint32_t g = 0; g < l.n_gpus; ++g)
            c.arenas.push_back(shm::ArenaConfig{b32, 2u + (g == 0 && l.contexts ? 1u : 0u), 0});
        c.cpu_kv_bytes = 0;
    } else {
        for (uint32_t p = 0; p < n_prefill; ++p) c.arenas.push_back(shm::ArenaConfig{b32, 1, 0});
        for (uint32_t d = 0; d < n_decode; ++d) c.arenas.push_back(shm::ArenaConfig{b32, n_prefill + 1, 0});
        c.cpu_kv_bytes = 0;
    }
    // Each context's record in the front's table (shm/context_table.h): one per context
    // at --contexts-max, two more so a replacing put always finds a free slot.
    if (l.contexts) c.contexts = {l.contexts_max + 2, static_cast<uint32_t>(l.n_ctx)};
    c.n_rings = ServeRings::of(c).count();
    c.model_fingerprint = model.fingerprint();
    return c;
}

Status check_worker_counts(int n_prefill, int n_decode) {
    if (n_prefill < 1 || n_decode < 1 || n_prefill + n_decode > static_cast<int>(kMaxServeWorkers))
        return make_error("{} prefill + {} decode workers: at least one of each, and at most {} in all (they share one KV arena)",
                          n_prefill, n_decode, kMaxServeWorkers);
    return {};
}

Status check_gpu_count(int n_gpus) {
    if (n_gpus < 1 || n_gpus > static_cast<int>(kMaxServeGpus))
        return make_error("{} GPUs: one instance serves on 1 to {}", n_gpus, kMaxServeGpus);
    return {};
}

Status check_instance_workers(const shm::InstanceConfig& c) {
    const uint32_t P = c.prefill_workers, D = c.decode_workers;
    if (!gpu_instance(c)) {
        // Indices, not processes: with role changes (ServeLayout::rebalance) each role
        // has up to kMaxServeWorkers - 1 of them, most of them spares; the arena's user
        // count bounds the processes.
        if (P < 1 || D < 1 || P >= kMaxServeWorkers || D >= kMaxServeWorkers)
            return make_error("{} prefill and {} decode worker indices: 1 to {} of each", P, D, kMaxServeWorkers - 1);
        if (c.arenas.size() != (c.kv_split ? 2u : 1u))
            return make_error("{} host KV arenas: {}", c.arenas.size(), c.kv_split ? "one per role" : "one");
        return {};
    }
    if (Status st = check_gpu_count(static_cast<int>(c.arenas.size())); !st) return st;
    if (c.kv_split) {
        if (P < 1 || D < 1 || P + D != c.arenas.size())
            return make_error("{} prefill and {} decode workers on {} GPUs: each GPU runs one role, at least one GPU per role",
                              P, D, c.arenas.size());
    } else if (P != c.arenas.size() || D != c.arenas.size()) {
        return make_error("{} prefill and {} decode workers on {} GPUs: a pair per GPU", P, D, c.arenas.size());
    }
    return {};
}

log::Field request_field(shm::ReqRef r) { return {"DUET_REQUEST", fmt::format("{}.{}", r.slot, r.gen)}; }

log::Field request_id_field(const shm::RequestTable& t, shm::ReqRef r) {
    std::string id;
    if (const auto rec = t.front_data(r)) {  // JSON (roles/front_impl.h FrontRecord); the id alone is read
        const nlohmann::json j = nlohmann::json::parse(*rec, nullptr, false);
        if (j.is_object() && j.contains("id") && j["id"].is_string()) id = j["id"].get<std::string>();
    }
    return {"DUET_REQUEST_ID", std::move(id)};
}

}  // namespace duet
