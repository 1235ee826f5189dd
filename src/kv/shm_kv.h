// The runtime's KV pool on the shared-memory arena: a KvBlockAllocator over a
// shm::KvArena user slot, and ShmKv, which creates an instance's segments (control +
// CPU KV data), registers this process and builds a KvPool whose blocks and data
// live in /dev/shm. `duet run` and `duet bench model` use it.
#pragma once

#include <memory>
#include <string>

#include "base/result.h"
#include "kv/kv_pool.h"
#include "shm/instance.h"

namespace duet {

class ShmBlockAllocator final : public KvBlockAllocator {
public:
    ShmBlockAllocator(shm::KvArena arena, uint32_t user) : arena_(arena), user_(user) {}
    int32_t n_blocks() const override { return static_cast<int32_t>(arena_.n_blocks()); }
    int32_t n_free() const override { return static_cast<int32_t>(arena_.n_free()); }
    int32_t n_available() const override;
    bool alloc(int32_t n, int32_t* out) override;
    void ref(int32_t block) override;
    void unref(int32_t block) override { arena_.unref(user_, block); }
    // For copy-on-write decisions: every reference, except those a hand-off's giver
    // still holds on blocks it handed to us (it never touches them again and drops
    // them once the hand-off settles), so a handed block is written in place.
    int32_t refcount(int32_t block) const override;
    // Blocks handed to us by `giver_user`: its lingering references do not count.
    void handed_by(uint32_t giver_user, const std::vector<int32_t>& blocks);
    uint32_t user() const { return user_; }
    shm::KvArena& arena() { return arena_; }

private:
    shm::KvArena arena_;
    uint32_t user_;
    std::vector<std::pair<int32_t, uint32_t>> handed_;  // (block, giver user), pruned when the giver lets go
};

struct ShmKvOptions {
    std::string instance;       // segment names duet.<instance>[.kv]
    uint64_t model_fingerprint = 0;
    bool huge_pages = true;
    // KV data elsewhere (a GPU's memory, device_name names it): no CPU KV segment.
    void* device_data = nullptr;
    std::string device_name;
};

class ShmKv {
public:
    // Removes leftover segments of dead `duet run` processes (names duet.run-*),
    // creates the instance, registers this process and joins the CPU arena.
    static Result<std::unique_ptr<ShmKv>> create(const KvLayout& layout, int32_t n_blocks, const ShmKvOptions& o);
    ~ShmKv();  // gives the blocks back, leaves the registry, removes the segments

    KvPool& pool() { return *pool_; }
    shm::Instance& instance() { return inst_; }
    shm::ProcRef self() const { return self_; }
    // One line for the log: where the segments are, their sizes and page mode.
    std::string describe() const;

private:
    ShmKv() = default;
    shm::Instance inst_;
    shm::ProcRef self_;
    std::string device_name_;  // where the KV data is when not in /dev/shm
    uint32_t user_ = 0;
    bool joined_ = false;  // user_ is ours only once join() succeeded
    std::unique_ptr<KvPool> pool_;
};

// The scope of default instance names and of start-up sweeps. DUET_SHM_SCOPE=S (1-32
// letters, digits or '_') puts "S." before the default names (S.serve-<pid>,
// S.run-<pid>-<n>), and a sweep looks at scope S's names only. Tests that run side by
// side each set their own scope, so that no start sweeps the segments another test
// left behind on purpose. Unset: "", and a sweep never sees a scoped name (a scope
// holds no '-' nor '.', so "S.serve-" never starts with "serve-").
Result<std::string> shm_scope();

// Unlinks duet.<scope><prefix>* segments (in /dev/shm and /dev/hugepages) that no live
// process has attached, <scope> being shm_scope()'s. Returns how many were removed
// (0 when the scope is not valid: nothing of it can exist).
int remove_stale_segments(const std::string& prefix);

}  // namespace duet
