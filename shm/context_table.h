// Context table: the records of an instance's contexts that must outlive the front
// process that keeps them (DESIGN.md "Contexts": the front owns the contexts table,
// in shm). Each record is a context's id, its acknowledged tokens, its pin and its
// creation time; the context's KV is not here (it is in the arena, a spill blob, or
// computed again from the tokens, exactly: the invariance contract).
//
// One process writes the table at a time (the front that claimed it); the segment
// is held by the instance's long-lived processes, so the table survives the
// writer's death and the next front adopts what it finds.
//
// Rules (tests/shm_context_table_test.cpp breaks each):
// T1. A put is atomic across the writer's death at any instant: the table holds the
//     record as it was before the put or as the put wrote it, never a mix. A put
//     writes a free slot whole (state WRITING), publishes it LIVE with a release
//     store, and only then frees the slot of the record it replaces. Recovery frees
//     WRITING slots (never published) and, when two LIVE slots hold one id (death
//     between the publish and the free), keeps the one with the higher generation.
// T2. An erase is one release store (LIVE -> FREE).
// T3. One writer: claim() takes the table for a process while the previous claimant
//     no longer runs (by the registry: pid and start time), and recovers it.
// T4. Sizes are fixed at creation: n_slots records of at most max_tokens tokens. A
//     put past them is refused (Limit / Invalid) and changes nothing; the store
//     sizes the table so that cannot happen (--contexts-max + 2 slots, --ctx tokens).
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "base/result.h"
#include "shm/registry.h"

namespace duet::shm {

struct ContextTableConfig {
    uint32_t n_slots = 0;     // 0: no table
    uint32_t max_tokens = 0;  // tokens per record
};

inline constexpr uint32_t kContextIdBytes = 64;

struct ContextRecord {
    std::string id;
    std::vector<int32_t> tokens;
    bool pinned = false;
    uint64_t created_ns = 0;  // CLOCK_REALTIME
};

enum class ContextSlotState : uint32_t { Free = 0, Writing = 1, Live = 2 };

struct alignas(64) ContextSlotHead {
    std::atomic<uint32_t> state;  // ContextSlotState
    uint32_t n_tokens;
    uint64_t gen;  // larger: newer (a put's record replaces the one it had)
    uint64_t created_ns;
    uint32_t flags;  // bit 0: pinned
    uint32_t id_len;
    char id[kContextIdBytes];
};
static_assert(sizeof(ContextSlotHead) == 128);

struct alignas(64) ContextTableHeader {
    uint32_t magic;
    uint32_t n_slots;
    uint32_t max_tokens;
    uint32_t slot_bytes;
    std::atomic<uint64_t> owner;     // ProcRef::pack() of the writer, 0: none
    std::atomic<uint64_t> next_gen;  // written by the owner only
};

class ContextTable {
public:
    static size_t bytes(const ContextTableConfig& c);
    static Status init(void* mem, const ContextTableConfig& c);
    static Result<ContextTable> attach(void* mem);

    uint32_t n_slots() const { return hdr_ ? hdr_->n_slots : 0; }
    uint32_t max_tokens() const { return hdr_ ? hdr_->max_tokens : 0; }
    bool present() const { return hdr_ != nullptr; }

    // T3: takes the table for `by` when nobody holds it or its holder no longer runs
    // (reg.process_running), then recovers it (T1) and indexes its records. An error
    // naming the holder's pid otherwise.
    Status claim(ProcRef by, const Registry& reg);
    // Gives the table up (a clean exit); the records stay.
    void release(ProcRef by);

    // The claimant's operations (not thread-safe: the store serializes them).
    // Every live record, oldest first.
    std::vector<ContextRecord> records() const;
    // Inserts or replaces the record of r.id (T1). Limit: no free slot; Invalid: the
    // id or the tokens do not fit. Nothing changes on an error.
    Status put(const ContextRecord& r);
    // Removes the record of id, if any (T2).
    void erase(const std::string& id);
    size_t live() const { return index_.size(); }

    // Any process: the slot's state (tests and tools).
    ContextSlotState state(uint32_t slot) const;

private:
    ContextSlotHead& head(uint32_t slot) const;
    int32_t* tokens(uint32_t slot) const;
    void recover();

    ContextTableHeader* hdr_ = nullptr;
    uint8_t* slots_ = nullptr;
    // The claimant's index: id -> live slot, and the free slots.
    std::map<std::string, uint32_t> index_;
    std::vector<uint32_t> free_;
};

}  // namespace duet::shm
