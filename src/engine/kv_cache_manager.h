// The KV cache manager: the blocks of sequences apart from who computes them.
//
// A pass's blocks are taken before it runs, so that "no room"
// is a planned outcome the scheduler decides on (wait, shrink the pass, pick a
// victim), not an error a worker has to guess the cause of (vLLM's KV cache
// manager apart from its scheduler and model runner). The backends still make room
// themselves when called without it (KvSeq::prepare_append inside forward: a no-op
// once reserve() took the blocks), so single-process callers and tests need nothing.
//
// Prefix caching: over a shared arena (shm KvArena) the manager looks up a prompt's
// leading full blocks in the arena's content-addressed index and publishes the ones
// a pass completes, so later prompts with the same prefix (in any process of the
// instance) take them instead of computing them. Hand-off destinations: blocks
// taken in another arena (a decode worker's, with per-role arenas) before the pass
// that copies into them.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "base/result.h"
#include "kv/kv_pool.h"
#include "kv/shm_kv.h"
#include "model/backend.h"
#include "shm/kv_arena.h"

namespace duet {

// Blocks a sequence must take to append n positions: those past its table, and the
// shared (copy-on-write) blocks the new positions would write into.
int64_t blocks_to_append(const KvPool& pool, const KvSeq& seq, int64_t n);

class KvCacheManager {
public:
    // prefix: the allocator of pool over a shared arena, whose index holds cached
    // blocks (null: no prefix caching; lookups miss, publishing does nothing).
    explicit KvCacheManager(KvPool& pool, ShmBlockAllocator* prefix = nullptr) : pool_(pool), prefix_(prefix) {}
    // Takes every block the entries' new positions need, all or nothing. An Error of
    // kind NoKvBlocks (how many were needed, how many are free) changes nothing; the
    // arena may be shared with other processes, so a reservation that the free count
    // allowed can still find the blocks gone: that too is NoKvBlocks, rolled back.
    Status reserve(std::span<SeqBatch> batch);
    // Gives back the blocks reserve() took past each entry's valid positions (a
    // pass that was then not run, or failed).
    void unreserve(std::span<SeqBatch> batch);
    int32_t free_blocks() const { return pool_.allocator().n_free(); }

    // The longest run of leading blocks of `hashes` (a prompt's full blocks, chained)
    // the index holds, at most max_blocks, each now referenced by this user: a
    // sequence of that many whole blocks of valid tokens (none on a miss).
    KvSeq lookup_prefix(std::span<const shm::BlockHash> hashes, size_t max_blocks);
    // Registers seq's full blocks [published, min(valid_tokens / block, hashes)) in
    // the index (valid_tokens: the positions of seq computed so far). Returns how
    // many of its blocks are published now.
    size_t publish_prefix(const KvSeq& seq, std::span<const shm::BlockHash> hashes, size_t published,
                          int64_t valid_tokens);

    // Blocks for `tokens` positions taken from `dest` (another arena's allocator: a
    // hand-off's destination), all or nothing. Errors: kind NoKvBlocks when it lacks
    // room (nothing taken).
    Result<std::vector<int32_t>> reserve_in(KvBlockAllocator& dest, int64_t tokens) const;
    // Gives back blocks reserve_in took.
    static void release_in(KvBlockAllocator& dest, std::vector<int32_t>& blocks);

private:
    KvPool& pool_;
    ShmBlockAllocator* prefix_;
};

}  // namespace duet
