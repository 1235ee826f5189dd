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
#include <vector>

#include "base/result.h"
#include "kv/blob.h"
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

// A sequence's KV to and from a blob where the arena may be one this process cannot
// address (a GPU's): a preempted request's swap (roles/decode_worker.cpp). `io` is the
// pool the blob code reads and writes: the arena's own (CPU; stage and mirror null)
// or the mirror's (stage and mirror set: the arena's ids, its allocator).
struct StagedKvIo {
    KvPool* io = nullptr;
    KvStage* stage = nullptr;
    KvMirror* mirror = nullptr;
};
// blob_write of positions [first, first + n) of seq; staged: their blocks pulled
// first (S1), the mirror's pages released after, whatever the outcome. A failed
// pull is the error and no file is written (S3).
Result<BlobHeader> staged_blob_write(const StagedKvIo& kv, const std::string& path, const KvIdentity& id,
                                     const KvSeq& seq, std::span<const int32_t> tokens, uint64_t first, uint64_t n,
                                     bool sync);
// blob_import into seq; staged: seq must be empty (a partial last block would be
// copied from a mirror tile nobody pulled), the blocks read are pushed before it
// returns (S2) and the mirror's pages released after; a failed push is the error,
// the blocks read freed and seq left empty (S3).
Result<BlobImport> staged_blob_import(const StagedKvIo& kv, const std::string& path, const KvIdentity& want,
                                      KvSeq& seq);

// Copies every layer of blocks src[i] of `from` into blocks dst[i] of `to` (host
// memory both, one layout, any block counts; memcpy of merged runs of consecutive
// ids). Errors: plan_layer_copy's (kv/kv_copy.h).
Status copy_host_blocks(const KvPool& from, std::span<const int32_t> src, KvPool& to, std::span<const int32_t> dst);

// A stage through a small bounce pool: a GPU's copies reach the bus's rate only from
// and to page-locked memory, and the mirror (reserved as large as the arena) cannot
// be page-locked whole. The blocks move in chunks of chunk_blocks() through two
// halves of `bounce` (2 x chunk blocks, ids 0 .. 2 x chunk - 1), so that the device
// copy of one chunk runs while the host copy (memcpy, mirror side) of the other does.
// A subclass starts device copies on a half and waits for them.
// Rules (tests/kv_stage_test.cpp runs them with device copies that happen only at
// wait(), and checks each):
// B1. A half's blocks are read (pull: copied into the mirror) only after wait() on
//     the device copy that filled it.
// B2. A half is written again (push: from the mirror; pull: the next device copy into
//     it) only after wait() on the device copy that last used it.
// B3. When pull or push returns, no device copy it started is still running, error
//     or not: nothing writes the bounce pool or the arena after the call.
class BounceKvStage : public KvStage {
public:
    Status pull(std::span<const int32_t> blocks) override;
    Status push(std::span<const int32_t> blocks) override;
    int32_t chunk_blocks() const { return chunk_; }

protected:
    // mirror: the arena's host mirror; bounce: 2 x chunk blocks of the same layout.
    BounceKvStage(KvPool& mirror, KvPool& bounce);
    // Start copying every layer of arena blocks `arena` into bounce blocks `bounce`
    // (start_pull) or of `bounce` into `arena` (start_push) as half `half`'s copy;
    // wait(half) returns when it is done, with its error if it failed. A start that
    // returns an error has left nothing running on that half (it is not waited on).
    virtual Status start_pull(std::span<const int32_t> arena, std::span<const int32_t> bounce, int half) = 0;
    virtual Status start_push(std::span<const int32_t> bounce, std::span<const int32_t> arena, int half) = 0;
    virtual Status wait(int half) = 0;

private:
    std::span<const int32_t> half_ids(int half, size_t n) const;
    KvPool& mirror_;
    KvPool& bounce_;
    int32_t chunk_ = 1;
    std::vector<int32_t> ids_;  // 0 .. 2 x chunk - 1
};

// Blocks per half of a bounce pool for this layout: about `half_bytes` (at least 1).
int32_t bounce_chunk_blocks(const KvLayout& layout, size_t half_bytes = size_t{16} << 20);

// A stage between two host pools of one layout and block count (memcpy, merged
// runs of consecutive ids): for tests, and for any arena in this address space.
class HostKvStage final : public KvStage {
public:
    HostKvStage(KvPool& arena, KvPool& mirror) : arena_(arena), mirror_(mirror) {}
    Status pull(std::span<const int32_t> blocks) override;
    Status push(std::span<const int32_t> blocks) override;

private:
    KvPool& arena_;
    KvPool& mirror_;
};

}  // namespace duet
