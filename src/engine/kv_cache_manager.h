// The KV cache manager: a pass's blocks are taken before it runs, so that "no room"
// is a planned outcome the scheduler decides on (wait, shrink the pass, pick a
// victim), not an error a worker has to guess the cause of (vLLM's KV cache
// manager apart from its scheduler and model runner). The backends still make room
// themselves when called without it (KvSeq::prepare_append inside forward: a no-op
// once reserve() took the blocks), so single-process callers and tests need nothing.
#pragma once

#include <cstdint>
#include <span>

#include "base/result.h"
#include "kv/kv_pool.h"
#include "model/backend.h"

namespace duet {

// Blocks a sequence must take to append n positions: those past its table, and the
// shared (copy-on-write) blocks the new positions would write into.
int64_t blocks_to_append(const KvPool& pool, const KvSeq& seq, int64_t n);

class KvCacheManager {
public:
    explicit KvCacheManager(KvPool& pool) : pool_(pool) {}
    // Takes every block the entries' new positions need, all or nothing. An Error of
    // kind NoKvBlocks (how many were needed, how many are free) changes nothing; the
    // arena may be shared with other processes, so a reservation that the free count
    // allowed can still find the blocks gone: that too is NoKvBlocks, rolled back.
    Status reserve(std::span<SeqBatch> batch);
    // Gives back the blocks reserve() took past each entry's valid positions (a
    // pass that was then not run, or failed).
    void unreserve(std::span<SeqBatch> batch);
    int32_t free_blocks() const { return pool_.allocator().n_free(); }

private:
    KvPool& pool_;
};

}  // namespace duet
