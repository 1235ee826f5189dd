// KV that the code touching it cannot address: a GPU arena, read and written by a
// process that keeps contexts (the front) through host memory.
//
// The mirror is a KvPool over host memory with the arena's layout and the arena's
// block ids (it shares the arena's allocator), whose tiles hold nothing meaningful
// until pulled: every function of kv/ that reads or writes a pool's tiles (blobs,
// KV append logs) runs unchanged on the mirror, between a pull of the blocks it
// reads and a push of the blocks it wrote. The mirror's memory is reserved, not
// committed (MAP_NORESERVE): only the pages of staged blocks are ever touched, and
// release() gives them back after each operation, so the host memory used is that of
// the KV one operation moves.
//
// Rules (tests/contexts_test.cpp, the `Staged` tests, run every context operation
// with the arena's memory unreadable outside the stage's copies):
// S1. Before a tile of the mirror is read, its block was pulled in this operation.
// S2. A block whose tiles were written in the mirror is pushed before anyone else
//     may read it in the arena (before its sequence is published or returned).
// S3. A failed pull or push is the operation's error: nothing half-staged is written
//     to disk, and blocks written in the mirror but not pushed are dropped.
#pragma once

#include <cstdint>
#include <memory>
#include <span>

#include "base/result.h"
#include "kv/kv_pool.h"

namespace duet {

// Copies every layer of whole blocks between an arena and its mirror (same ids).
class KvStage {
public:
    virtual ~KvStage() = default;
    // Arena -> mirror.
    virtual Status pull(std::span<const int32_t> blocks) = 0;
    // Mirror -> arena.
    virtual Status push(std::span<const int32_t> blocks) = 0;
};

// The host mirror of an arena: `layout`, the arena's n_blocks, ids from `allocator`
// (not owned: the arena's, which outlives the mirror).
class KvMirror {
public:
    static Result<std::unique_ptr<KvMirror>> create(const KvLayout& layout, KvBlockAllocator& allocator);
    ~KvMirror();
    KvMirror(const KvMirror&) = delete;
    KvMirror& operator=(const KvMirror&) = delete;

    KvPool& pool() { return *pool_; }
    // The staged pages go back to the system (their contents are lost).
    void release();

private:
    KvMirror() = default;
    void* data_ = nullptr;
    size_t bytes_ = 0;
    std::unique_ptr<KvPool> pool_;
};

// A KvBlockAllocator that forwards to another (a mirror's: the arena's ids and
// references).
class ForwardingBlockAllocator final : public KvBlockAllocator {
public:
    explicit ForwardingBlockAllocator(KvBlockAllocator& to) : to_(to) {}
    int32_t n_blocks() const override { return to_.n_blocks(); }
    int32_t n_free() const override { return to_.n_free(); }
    int32_t n_available() const override { return to_.n_available(); }
    bool alloc(int32_t n, int32_t* out) override { return to_.alloc(n, out); }
    void ref(int32_t block) override { to_.ref(block); }
    void unref(int32_t block) override { to_.unref(block); }
    int32_t refcount(int32_t block) const override { return to_.refcount(block); }

private:
    KvBlockAllocator& to_;
};

// The blocks of `blocks` (a sequence's table) that hold positions [first, first + n).
std::span<const int32_t> blocks_of_positions(std::span<const int32_t> blocks, int32_t block_tokens, uint64_t first,
                                             uint64_t n);

// A stage between two host pools of one layout and block count (memcpy, merged
// runs of consecutive ids): for tests, and for any arena in this address space.
class HostKvStage final : public KvStage {
public:
    HostKvStage(KvPool& arena, KvPool& mirror) : arena_(arena), mirror_(mirror) {}
    Status pull(std::span<const int32_t> blocks) override;
    Status push(std::span<const int32_t> blocks) override;

private:
    Status copy(const KvPool& from, KvPool& to, std::span<const int32_t> blocks);
    KvPool& arena_;
    KvPool& mirror_;
};

}  // namespace duet
