// Process registry: one slot per process of an instance (role, device, pid,
// generation, state, heartbeat, doorbell), and a liveness monitor on pidfds.
//
// A slot's state and generation share one atomic word, so "is (slot, gen) alive"
// is one load, and every transition is a compare-and-swap that names the
// generation it expects: a message or reference from an earlier generation of a
// slot can never act on its successor. The generation is bumped at every claim.
//
// Slot life: FREE -claim-> STARTING -> RUNNING -release-> FREE (clean exit)
//                                  \-> DEAD (process died; set by whoever saw it)
//            DEAD -reclaimed(after its resources are returned)-> FREE
//            RUNNING <-> LEAVING (a worker being retired: still alive and working
//                       off what it holds, no longer given work; `duet serve`'s
//                       role changes, roles/rebalance.h); LEAVING -> FREE or DEAD
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "base/result.h"
#include "shm/doorbell.h"

namespace duet::shm {

enum class ProcState : uint32_t { Free = 0, Starting = 1, Running = 2, Dead = 3, Leaving = 4 };
enum class Role : uint32_t { None = 0, Launcher = 1, Front = 2, Prefill = 3, Decode = 4, Runner = 5, Tool = 6 };
const char* role_name(Role r);
const char* proc_state_name(ProcState s);

// (slot, generation): how every cross-process reference names a process. Packed in
// 64 bits so it can be stored and compared atomically; 0 is "nobody" (generations
// start at 1).
struct ProcRef {
    uint32_t slot = 0;
    uint32_t gen = 0;
    uint64_t pack() const { return (static_cast<uint64_t>(gen) << 32) | slot; }
    static ProcRef unpack(uint64_t v) { return {static_cast<uint32_t>(v), static_cast<uint32_t>(v >> 32)}; }
    bool valid() const { return gen != 0; }
    friend bool operator==(ProcRef a, ProcRef b) { return a.slot == b.slot && a.gen == b.gen; }
};

// The opaque page of a process slot: its user's own fields (the serving roles'
// load gauges and work counters: src/roles/worker_stats.h), zeroed by each claim.
// Words, so that a claim zeroes them with atomic stores while others still read.
inline constexpr size_t kRolePageWords = 32;

struct alignas(64) ProcSlot {
    std::atomic<uint64_t> state_gen;  // (pid << 32) | (generation << 8) | ProcState
    std::atomic<uint32_t> role;
    std::atomic<uint32_t> index;  // which of its role's processes (what that means is its role's business)
    std::atomic<int32_t> device;  // -1: CPU
    std::atomic<int32_t> numa;    // the NUMA node of its CPUs (-1: not known); set once at start
    std::atomic<uint64_t> start_ticks;   // (/proc/<pid>/stat starttime << 24) | its generation: tells a reused pid apart
    std::atomic<uint64_t> heartbeat_ns;  // CLOCK_MONOTONIC, the same clock in every process
    // Written and read by the process's role alone (Registry::role_page); four lines.
    alignas(64) std::atomic<uint64_t> role_page[kRolePageWords];
    alignas(64) Doorbell doorbell;  // wakes this process; on a line of its own
};
static_assert(sizeof(ProcSlot) == 384);

struct RegistryHeader {
    uint32_t magic;
    uint32_t n_slots;
    // Workers whose golden-logits check failed (they exit and are not restarted),
    // and the first one's reason (golden_reason_len bytes, published with release):
    // what the front's /ready and /metrics say.
    std::atomic<uint32_t> golden_failures;
    std::atomic<uint32_t> golden_reason_len;
    char golden_reason[232];
    // The worker indices of each role ([0] prefill, [1] decode) the launcher runs a
    // worker at, one bit each (0: not said; every index then counts). With role
    // changes some indices are spares: /metrics reports only these.
    std::atomic<uint32_t> assigned[2];
};
static_assert(sizeof(RegistryHeader) == 256);

// starttime (field 22 of /proc/<pid>/stat), 0 when the process does not exist or
// is a zombie (dead, not yet reaped).
uint64_t process_start_ticks(pid_t pid);

class Registry {
public:
    static size_t bytes(uint32_t n_slots);
    static Status init(void* mem, uint32_t n_slots);
    static Result<Registry> attach(void* mem);

    uint32_t n_slots() const { return hdr_->n_slots; }
    ProcSlot& slot(uint32_t i) const { return slots_[i]; }
    // Slot i's opaque page (kRolePageWords words, 64-byte aligned), zero at each claim.
    std::atomic<uint64_t>* role_page(uint32_t i) const { return slots_[i].role_page; }

    // Claims a FREE slot for process pid (STARTING, new generation), as worker `index`
    // of its role; its role page starts at zero. (Which processes may hold which
    // index is the roles' business: see WorkerBase::init.)
    Result<ProcRef> claim(Role role, int32_t device, pid_t pid, uint32_t index = 0);
    // STARTING -> RUNNING.
    bool set_running(ProcRef r);
    // RUNNING -> LEAVING: whoever routes work (find_running, wake) passes it over
    // from now on; the process itself goes on (it finishes what it holds and drains
    // its rings). LEAVING -> RUNNING again: stay_after_all.
    bool set_leaving(ProcRef r);
    bool stay_after_all(ProcRef r);
    // A clean exit: any live state of this generation -> FREE.
    bool release(ProcRef r);
    // Any live state of this generation -> DEAD. True if this call made the change.
    bool mark_dead(ProcRef r);
    // DEAD -> FREE once whatever the dead process held has been returned.
    bool reclaim(ProcRef r);

    ProcState state(uint32_t slot) const;
    // Whether slot is RUNNING with this role (and worker index, when index >= 0).
    bool running_as(uint32_t slot, Role role, int32_t index = -1) const;
    // The first RUNNING slot with this role (and worker index, when index >= 0), or -1.
    int32_t find_running(Role role, int32_t index = -1) const;
    // Rings the doorbell of every running process of `role` (only worker `index`'s
    // when index >= 0): after publishing something it consumes.
    void wake(Role role, int32_t index = -1);
    // RegistryHeader::assigned: set by the launcher as it starts and retires workers.
    void set_assigned(Role role, uint32_t index, bool on);
    // Whether the launcher runs a worker at this index (true when it never said).
    bool assigned(Role role, uint32_t index) const;
    // The first live slot (RUNNING or LEAVING: a process that works) with this role
    // and index, or -1 (what /metrics calls up).
    int32_t find_working(Role role, int32_t index) const;
    ProcRef current(uint32_t slot) const;  // the slot's generation now
    pid_t pid(uint32_t slot) const;        // the process that claimed it last
    bool alive(ProcRef r) const;           // STARTING, RUNNING or LEAVING at this generation
    // Whether the process that claimed r still runs, by the OS: its pid exists, is
    // not a zombie, and has the start time recorded at the claim.
    bool process_running(ProcRef r) const;
    void heartbeat(ProcRef r) const;
    Doorbell& doorbell(uint32_t slot) const { return slots_[slot].doorbell; }

    // Checks every live slot's pid against the OS (exists and is not a zombie, same
    // start time) and marks the dead ones DEAD; returns them. For a process that
    // starts after others died unseen (no monitor was running).
    std::vector<ProcRef> sweep_dead();
    // Slots left DEAD: deaths whose recovery has not finished (its recoverer may have
    // died too). Recovery is idempotent, so a new recoverer simply runs it again.
    std::vector<ProcRef> dead_slots() const;

private:
    RegistryHeader* hdr_ = nullptr;

public:
    // A worker's golden-logits check failed: counted, and the first reason kept
    // (truncated to 239 bytes).
    void note_golden_failure(std::string_view reason);
    uint32_t golden_failures() const { return hdr_->golden_failures.load(std::memory_order_acquire); }
    std::string golden_reason() const;

private:
    ProcSlot* slots_ = nullptr;
};

// Watches processes through pidfds: poll() reports an exit within the scheduler's
// wake-up latency (microseconds), with no heartbeat timeouts to tune. Process-local.
class LivenessMonitor {
public:
    LivenessMonitor() = default;
    ~LivenessMonitor();
    LivenessMonitor(const LivenessMonitor&) = delete;
    LivenessMonitor& operator=(const LivenessMonitor&) = delete;

    // Starts watching the process in registry slot r. A process already gone (or a
    // pid now used by another process) is reported by the next wait().
    Status watch(const Registry& reg, ProcRef r);
    void unwatch(ProcRef r);
    // Waits up to timeout_ms (-1: for ever) and returns the watched processes that
    // have exited, no longer watched.
    std::vector<ProcRef> wait(int timeout_ms);
    size_t size() const { return items_.size(); }

private:
    struct Item {
        ProcRef ref;
        int pidfd;  // -1: already known dead
    };
    std::vector<Item> items_;
};

}  // namespace duet::shm
