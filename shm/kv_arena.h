// KV arena metadata for one device: a lock-free pool of fixed-size blocks with
// per-user reference counts, and the prefix index (block hash -> cached block).
// The block data lives elsewhere (a /dev/shm segment on CPU, device memory on a
// GPU); this is only who holds which block.
//
// Ownership is recorded in the same atomic word as the reference count, so there is
// no instant at which a process holds a block that the arena does not attribute to
// it. Each block's 64-bit word holds one count per arena user (a process that
// joined the arena), count_bits wide, plus a CACHED flag:
//
//   bit 63: CACHED — the block's content is registered under its hash in the prefix
//           index; with all counts zero it is evictable, not free.
//   bits [u*count_bits, (u+1)*count_bits): references held by user u.
//
// A block is free exactly when its word is 0. Allocation is one CAS 0 -> one(u);
// ref and unref are fetch_add / fetch_sub of one(u), which only ever change the
// caller's own field (so the caller alone decides whether its field can grow). When
// a user's process dies, recover_user() subtracts that user's field from every word
// and nothing else is needed: a block it had just taken is already in its field.
//
// The free bitmap is an index, not the truth: a set bit means "probably free" (the
// allocator still has to win the CAS on the word), and the one crash window that
// can leave a free block without its bit (between a free's word store and its
// fetch_or) is closed by the sweep that recovery runs.
#pragma once

#include <atomic>
#include <cstdint>
#include <string_view>
#include <vector>

#include "base/result.h"
#include "shm/registry.h"

struct evp_md_st;
struct evp_md_ctx_st;

namespace duet::shm {

inline constexpr uint32_t kArenaMaxUsers = 6;

struct ArenaConfig {
    uint32_t n_blocks = 0;
    uint32_t n_users = 4;        // 1..6 processes may hold references at once
    uint32_t index_capacity = 0; // prefix index entries (power of two); 0: 2 x n_blocks rounded up
};

// 128 bits of SHA-256 over (parent hash, token ids, model fingerprint, salt).
struct BlockHash {
    uint64_t lo = 0, hi = 0;
    friend bool operator==(const BlockHash& a, const BlockHash& b) { return a.lo == b.lo && a.hi == b.hi; }
};
// Hashes blocks with one OpenSSL context reused across calls (one per thread that
// hashes; 149 ns for a 16-token block instead of 431 ns with a fresh context).
class BlockHasher {
public:
    BlockHasher();
    ~BlockHasher();
    BlockHasher(const BlockHasher&) = delete;
    BlockHasher& operator=(const BlockHasher&) = delete;
    BlockHash hash(const BlockHash& parent, const int32_t* tokens, size_t n_tokens, uint64_t model_fingerprint,
                   std::string_view salt);

private:
    evp_md_st* md_;
    evp_md_ctx_st* ctx_;
};
// One-off form (makes a context each call).
BlockHash block_hash(const BlockHash& parent, const int32_t* tokens, size_t n_tokens, uint64_t model_fingerprint,
                     std::string_view salt);

struct BlockMeta {
    std::atomic<uint64_t> word;
    std::atomic<uint64_t> last_use_ns;  // when the last reference of a cached block was dropped
    std::atomic<uint64_t> hash_lo;
    std::atomic<uint64_t> hash_hi;
};

struct alignas(64) ArenaHeader {
    uint32_t magic;
    uint32_t n_blocks;
    uint32_t n_users;
    uint32_t count_bits;
    uint64_t bitmap_words;
    uint64_t index_capacity;
    uint64_t off_blocks, off_bitmap, off_index;  // from the header's address
    alignas(64) std::atomic<uint64_t> users[kArenaMaxUsers];  // ProcRef::pack() of each user slot's holder
    struct alignas(64) Cursor {
        std::atomic<uint64_t> word;  // where this user's next bitmap scan starts (a hint)
    } cursor[kArenaMaxUsers];
};

struct ArenaCensus {
    uint32_t total = 0;
    uint32_t free = 0;    // word == 0
    uint32_t cached = 0;  // no references, content cached
    uint32_t held = 0;    // at least one reference
    uint64_t refs_by_user[kArenaMaxUsers] = {};
};

class KvArena {
public:
    static size_t bytes(const ArenaConfig& c);
    static Status init(void* mem, const ArenaConfig& c);
    static Result<KvArena> attach(void* mem);

    uint32_t n_blocks() const { return h_->n_blocks; }
    uint32_t n_users() const { return h_->n_users; }

    // Takes a user slot for process `who`; its references are counted there. A
    // process that already holds one gets the same slot back.
    Result<uint32_t> join(ProcRef who);
    // The user slot held by `who`, or -1.
    int32_t user_of(ProcRef who) const;
    ProcRef holder(uint32_t user) const;
    // Returns every reference user holds (as recover_user) and frees the slot.
    void leave(uint32_t user);

    // Takes n blocks (all or nothing) with one reference each for user; evicts cached
    // blocks, least recently used first, when there are not enough free ones.
    bool alloc(uint32_t user, uint32_t n, int32_t* out);
    // Adds a reference to a block that the caller (user) already holds. False if
    // user's count for it is at its maximum (2^count_bits - 1).
    bool ref(uint32_t user, int32_t b);
    // Hand-off between processes: gives `to` a reference to b only while `from` still
    // holds one (one CAS), so a block whose holder died and was recovered (and maybe
    // reallocated) is never co-owned by mistake. False if from holds none (or to's
    // count is at its maximum).
    bool share(uint32_t from, uint32_t to, int32_t b);
    // Moves one of from's references to `to` in one CAS; false as share().
    bool transfer(uint32_t from, uint32_t to, int32_t b);
    // Drops one of user's references; the block is free (or, if cached, evictable)
    // when no references remain. Dropping a reference the user does not hold is a
    // bug that would corrupt another user's count: it aborts with a message.
    void unref(uint32_t user, int32_t b);
    void unref(uint32_t user, const int32_t* b, uint32_t n);

    uint32_t refcount(int32_t b) const;
    uint32_t refs_of(uint32_t user, int32_t b) const;
    bool cached(int32_t b) const;
    // Blocks whose free bit is set: a hint (a recovery sweep racing a free can leave a
    // bit set on a held block; it clears when that block is freed and taken again).
    uint32_t n_free() const;

    // Prefix cache. publish(): user holds b and its content is final; registers it
    // under h. False if another block already caches h (then b stays uncached).
    bool publish(uint32_t user, int32_t b, const BlockHash& h);
    // A cached block holding h, with a new reference for user; -1 when none.
    int32_t acquire_cached(uint32_t user, const BlockHash& h);
    // Whether a block holding h is cached now, taking nothing: a hint for routing (it
    // may be evicted the next moment).
    bool has_cached(const BlockHash& h) const;

    // After user's process died: drops every reference it held (including a block it
    // had just taken), puts blocks left free back in the free index, and frees the
    // user slot. Must not run while that process may still be live. Idempotent and
    // safe to run from two recoverers at once or to resume after a recoverer died
    // (each block's field is cleared by a CAS). Returns the references it dropped.
    uint64_t recover_user(uint32_t user);

    // Counts every block's state (exact when no operation is in flight).
    ArenaCensus census() const;
    // Free blocks whose free bit is clear, i.e. lost to the allocator (must be 0 when
    // no operation is in flight and every dead user has been recovered).
    uint32_t unindexed_free() const;

private:
    uint64_t one(uint32_t u) const { return 1ull << (u * h_->count_bits); }
    uint64_t field(uint32_t u) const { return ((1ull << h_->count_bits) - 1) << (u * h_->count_bits); }
    uint64_t counts_mask() const { return (1ull << (h_->n_users * h_->count_bits)) - 1; }
    void mark_free(int32_t b);
    void after_drop(int32_t b, uint64_t w);
    uint32_t evict_into(uint32_t user, uint32_t n, int32_t* out);
    void index_erase(int32_t b, uint64_t hash_lo);

    ArenaHeader* h_ = nullptr;
    BlockMeta* blocks_ = nullptr;
    std::atomic<uint64_t>* bits_ = nullptr;
    std::atomic<uint32_t>* index_ = nullptr;
};

}  // namespace duet::shm
