// One duet instance's shared memory: the control segment /dev/shm/duet.<name>
// (header, process registry, rings, request table, one KV arena's metadata and
// prefix index per device) and, for the CPU device, the KV data segment
// /dev/shm/duet.<name>.kv (GPU arenas keep their data in device memory).
//
// Every process of the instance attaches with the same InstanceConfig; its
// fingerprint is in the segment header, so a process built or configured
// differently refuses to attach and says which values differ.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "base/result.h"
#include "shm/context_table.h"
#include "shm/kv_arena.h"
#include "shm/registry.h"
#include "shm/request_table.h"
#include "shm/segment.h"
#include "shm/spsc_ring.h"

namespace duet::shm {

// Bumped whenever any structure in the control segment changes shape. 2: phase
// times in request slots; 3: clients, serving counters; 4: worker indices and load
// gauges; 5: per-role KV arenas; 6: KV dtype; 7: front records; 8: golden failures;
// 9: context table; 10: work counters in process slots; 11: where a request's KV
// went (kv_to); 12: borrowed cores in process slots; 13: claims on a partner's
// cores, wide work counters; 14: claims declined and unanswered; 15: LEAVING
// workers, role changes; 16: interrupted prefill passes (request table header of
// 128 bytes); 17: end codes in request slots; 18: draft counters; 19: request data
// (ReqExtHeader); 20: process slots keep identity and an opaque role page (the
// serving counters left for src/roles/worker_stats.h), the users' protocol in the
// configuration; 21: per-request draft counts in request slots; 22: draft counters by source;
// 23: role pages of four lines.
inline constexpr uint32_t kLayoutVersion = 23;

inline constexpr uint32_t kMaxArenas = 16;

struct InstanceConfig {
    std::string name;                 // segments are duet.<name> and duet.<name>.kv
    uint32_t registry_slots = 32;
    uint32_t n_rings = 16;
    uint32_t ring_capacity = 4096;    // 256 KiB of 64-byte records: see bench/RESULTS.md for why not 1024
    uint32_t ring_record_bytes = 64;
    RequestTableConfig requests;
    // One per device (or per role and device, kv_split). With cpu_kv_bytes > 0 every
    // arena is in host memory: their data lie back to back in the KV data segment,
    // each taking its share of blocks.
    std::vector<ArenaConfig> arenas;
    uint64_t cpu_kv_bytes = 0;        // size of the CPU KV data segment (0: none)
    uint64_t model_fingerprint = 0;
    // How many prefill and decode workers serve on this instance (their rings and
    // registry indices follow from these; src/roles/wire.h). 0: not a serving instance.
    uint32_t prefill_workers = 0, decode_workers = 0;
    // Prefill and decode workers keep their KV in arenas of their own (different
    // GPUs, or per-role host arenas): a hand-off copies the request's blocks. One
    // name for the concept in code; `duet serve --kv-arenas per-role` sets it.
    bool kv_split = false;
    // How the arenas store KV values (src/kv/kv_pool.h KvDtype: 0 f16, 1 int8, 2 fp8);
    // every process attached reads its KV layout from here.
    uint32_t kv_dtype = 0;
    bool huge_pages = true;
    // The front's contexts that outlive it (shm/context_table.h); n_slots 0: none.
    ContextTableConfig contexts;
    // The version of what the instance's users keep in its opaque bytes (request
    // parameters and data, process role pages), which shm/ does not read: the serving
    // roles' kServingProtocol (src/roles/wire.h). Part of the fingerprint, so that a
    // process built with another shape of those bytes refuses to attach.
    uint32_t user_protocol = 0;

    // FNV-1a over every field that shapes the segments.
    uint64_t fingerprint() const;
};

// What Instance::recover() did.
struct RecoveryReport {
    uint64_t refs_dropped = 0;  // KV block references, all arenas
    uint32_t redriven = 0;      // running requests sent back to QUEUED
    uint32_t failed = 0;        // running requests marked FAILED
    uint32_t adopted = 0;       // queued or finished requests now owned by the recoverer
    uint32_t unreserved = 0;    // reservations of a submission the dead process never finished

    RecoveryReport& operator+=(const RecoveryReport& o) {
        refs_dropped += o.refs_dropped;
        redriven += o.redriven;
        failed += o.failed;
        adopted += o.adopted;
        unreserved += o.unreserved;
        return *this;
    }
};

class Instance {
public:
    // Creates both segments (replacing stale ones, refusing live ones).
    static Result<Instance> create(const InstanceConfig& c);
    // Attaches to a live instance made with the same configuration.
    static Result<Instance> open(const InstanceConfig& c);
    // Attaches to a live instance by name alone, taking its configuration from the
    // control segment (for tools: `duet shm status`).
    static Result<Instance> attach(const std::string& name);
    // Removes both names (the creator does this at a clean shutdown).
    static void unlink(const std::string& name);

    const InstanceConfig& config() const { return cfg_; }
    Registry& registry() { return registry_; }
    RequestTable& requests() { return requests_; }
    KvArena& arena(size_t device) { return arenas_[device]; }
    size_t n_arenas() const { return arenas_.size(); }
    RingHeader* ring(uint32_t i) const;
    // The context table (present() only when config().contexts.n_slots > 0).
    ContextTable& contexts() { return contexts_; }
    // The data of host arena `arena` in the KV data segment (cpu_kv_bytes > 0).
    uint8_t* cpu_kv_data(size_t arena = 0) const;
    const Segment& control_segment() const { return seg_; }

    // Everything the front does when a process of the instance has died: marks its
    // registry slot DEAD (if nobody has), returns every KV block reference it held in
    // every arena, undoes a half-made submission, hands its requests to `by` (running
    // ones back to QUEUED with an empty block table when redrive, else FAILED;
    // queued and finished ones adopted so their clients can still read them), then
    // frees the registry slot. Idempotent: a second recoverer, or one resuming after
    // a recoverer died (Registry::dead_slots()), finds nothing left to do. An error
    // if `dead` is still alive by its pid. With `fail_code`, a running request for
    // which it returns nonzero is FAILED with that code in its error_code (opaque
    // here: the serving layer's) instead of being re-driven.
    Result<RecoveryReport> recover(ProcRef dead, ProcRef by, bool redrive,
                                   const std::function<int32_t(ReqRef)>& fail_code = {});
    const Segment& kv_segment() const { return kv_seg_; }

private:
    Status map_sections();

    InstanceConfig cfg_;
    Segment seg_;
    Segment kv_seg_;
    Registry registry_;
    RequestTable requests_;
    std::vector<KvArena> arenas_;
    ContextTable contexts_;
    std::vector<uint64_t> ring_off_;
};

}  // namespace duet::shm
