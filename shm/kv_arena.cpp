#include "shm/kv_arena.h"

#include <openssl/evp.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>

namespace duet::shm {

namespace {

constexpr uint32_t kArenaMagic = 0x616e7261;  // "arna"
constexpr uint64_t kCached = 1ull << 63;
// Prefix index entries: 0 empty, kTomb erased, otherwise block id + 1.
constexpr uint32_t kEmpty = 0;
constexpr uint32_t kTomb = 0xffffffffu;
// Probes per index operation. Tombstones are only reused by inserts, so a long-lived
// index fills with them; a bound keeps every lookup O(1) (and a prompt crafted to
// collide cannot make lookups scan the table). Past it, a block is cached but only
// reachable by eviction.
constexpr uint64_t kMaxProbe = 64;
// Blocks evicted beyond the need per scan of the block metadata (they become free),
// so a steady state with every idle block cached does not scan on every allocation.
constexpr uint32_t kEvictBatch = 32;

size_t align64(size_t x) { return (x + 63) / 64 * 64; }

uint64_t round_pow2(uint64_t x) {
    uint64_t p = 1;
    while (p < x) p <<= 1;
    return p;
}

uint64_t index_capacity(const ArenaConfig& c) {
    return c.index_capacity ? c.index_capacity : round_pow2(std::max<uint64_t>(2ull * c.n_blocks, 16));
}

}  // namespace

BlockHasher::BlockHasher() : md_(EVP_MD_fetch(nullptr, "SHA256", nullptr)), ctx_(EVP_MD_CTX_new()) {
    if (!md_ || !ctx_) {
        std::fprintf(stderr, "duet: OpenSSL has no SHA-256\n");
        std::abort();
    }
}

BlockHasher::~BlockHasher() {
    EVP_MD_CTX_free(ctx_);
    EVP_MD_free(md_);
}

BlockHash BlockHasher::hash(const BlockHash& parent, const int32_t* tokens, size_t n_tokens,
                            uint64_t model_fingerprint, std::string_view salt) {
    // Length-prefixed fields, so no two different inputs share a byte string:
    // parent (16), fingerprint (8), salt length (8), salt, token count (8), tokens.
    const uint64_t ns = salt.size(), n = n_tokens;
    EVP_DigestInit_ex(ctx_, md_, nullptr);
    EVP_DigestUpdate(ctx_, &parent.lo, 8);
    EVP_DigestUpdate(ctx_, &parent.hi, 8);
    EVP_DigestUpdate(ctx_, &model_fingerprint, 8);
    EVP_DigestUpdate(ctx_, &ns, 8);
    EVP_DigestUpdate(ctx_, salt.data(), salt.size());
    EVP_DigestUpdate(ctx_, &n, 8);
    EVP_DigestUpdate(ctx_, tokens, n_tokens * sizeof(int32_t));
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned int md_len = 0;
    EVP_DigestFinal_ex(ctx_, md, &md_len);
    BlockHash h;
    std::memcpy(&h.lo, md, 8);
    std::memcpy(&h.hi, md + 8, 8);
    return h;
}

BlockHash block_hash(const BlockHash& parent, const int32_t* tokens, size_t n_tokens, uint64_t model_fingerprint,
                     std::string_view salt) {
    BlockHasher h;
    return h.hash(parent, tokens, n_tokens, model_fingerprint, salt);
}

size_t KvArena::bytes(const ArenaConfig& c) {
    size_t words = (c.n_blocks + 63) / 64;
    return align64(sizeof(ArenaHeader)) + align64(sizeof(BlockMeta) * c.n_blocks) + align64(8 * words) +
           align64(4 * index_capacity(c));
}

Status KvArena::init(void* mem, const ArenaConfig& c) {
    if (c.n_blocks == 0 || c.n_blocks >= (1u << 31) - 1)
        return make_error("KV arena needs 1 to 2^31-2 blocks, got {}", c.n_blocks);
    if (c.n_users == 0 || c.n_users > kArenaMaxUsers)
        return make_error("KV arena supports 1 to {} users, got {}", kArenaMaxUsers, c.n_users);
    uint64_t cap = index_capacity(c);
    if ((cap & (cap - 1)) != 0 || cap < c.n_blocks)
        return make_error("prefix index capacity must be a power of two >= the block count, got {}", cap);
    std::memset(mem, 0, bytes(c));
    auto* h = new (mem) ArenaHeader{};
    h->n_blocks = c.n_blocks;
    h->n_users = c.n_users;
    h->count_bits = 60 / c.n_users;
    h->bitmap_words = (c.n_blocks + 63) / 64;
    h->index_capacity = cap;
    h->off_blocks = align64(sizeof(ArenaHeader));
    h->off_bitmap = h->off_blocks + align64(sizeof(BlockMeta) * c.n_blocks);
    h->off_index = h->off_bitmap + align64(8 * h->bitmap_words);
    auto* bits = reinterpret_cast<std::atomic<uint64_t>*>(static_cast<uint8_t*>(mem) + h->off_bitmap);
    for (uint64_t w = 0; w < h->bitmap_words; ++w) {
        uint64_t n = std::min<uint64_t>(64, c.n_blocks - w * 64);
        bits[w].store(n == 64 ? ~0ull : (1ull << n) - 1, std::memory_order_relaxed);
    }
    h->magic = kArenaMagic;  // published with the segment (its magic's release store)
    return {};
}

Result<KvArena> KvArena::attach(void* mem) {
    KvArena a;
    a.h_ = static_cast<ArenaHeader*>(mem);
    if (a.h_->magic != kArenaMagic) return make_error("not a KV arena (magic {:#x})", a.h_->magic);
    auto* base = static_cast<uint8_t*>(mem);
    a.blocks_ = reinterpret_cast<BlockMeta*>(base + a.h_->off_blocks);
    a.bits_ = reinterpret_cast<std::atomic<uint64_t>*>(base + a.h_->off_bitmap);
    a.index_ = reinterpret_cast<std::atomic<uint32_t>*>(base + a.h_->off_index);
    return a;
}

Result<uint32_t> KvArena::join(ProcRef who) {
    if (int32_t u = user_of(who); u >= 0) return static_cast<uint32_t>(u);
    for (uint32_t u = 0; u < h_->n_users; ++u) {
        uint64_t expect = 0;
        // acq_rel: pairs with the release in recover_user()/leave() that emptied the
        // slot (its counts are all zero by then).
        if (h_->users[u].compare_exchange_strong(expect, who.pack(), std::memory_order_acq_rel,
                                                 std::memory_order_relaxed)) {
            // Start this process's scan in its own part of the bitmap, so users that
            // allocate at once do not take (and free) the same blocks and bitmap word.
            h_->cursor[u].word.store(static_cast<uint64_t>(u) * h_->bitmap_words / h_->n_users,
                                     std::memory_order_relaxed);
            return u;
        }
    }
    return make_error("all {} KV arena user slots are taken", h_->n_users);
}

int32_t KvArena::user_of(ProcRef who) const {
    for (uint32_t u = 0; u < h_->n_users; ++u)
        if (h_->users[u].load(std::memory_order_relaxed) == who.pack()) return static_cast<int32_t>(u);
    return -1;
}

ProcRef KvArena::holder(uint32_t user) const {
    return ProcRef::unpack(h_->users[user].load(std::memory_order_relaxed));
}

void KvArena::leave(uint32_t user) { recover_user(user); }

void KvArena::mark_free(int32_t b) {
    // Relaxed: the bit is a hint; the word's CAS decides ownership.
    bits_[b / 64].fetch_or(1ull << (b % 64), std::memory_order_relaxed);
}

// w: the block's word after dropping references.
void KvArena::after_drop(int32_t b, uint64_t w) {
    if ((w & counts_mask()) != 0) return;
    if (w & kCached)
        blocks_[b].last_use_ns.store(monotonic_ns(), std::memory_order_relaxed);
    else
        mark_free(b);
}

bool KvArena::alloc(uint32_t user, uint32_t n, int32_t* out) {
    uint32_t got = 0;
    const uint64_t words = h_->bitmap_words;
    const uint64_t mine = one(user);
    std::atomic<uint64_t>& cursor = h_->cursor[user].word;  // a hint: relaxed
    uint64_t wi = cursor.load(std::memory_order_relaxed) % words;
    for (uint64_t scanned = 0; scanned < words && got < n; ++scanned) {
        uint64_t bits = bits_[wi].load(std::memory_order_relaxed);
        while (bits && got < n) {
            int bit = __builtin_ctzll(bits);
            bits &= bits - 1;
            int32_t b = static_cast<int32_t>(wi * 64 + bit);
            uint64_t expect = 0;
            // Acquire pairs with the release of the unref that freed the block: its
            // previous holders' accesses are done. The word now names us.
            if (!blocks_[b].word.compare_exchange_strong(expect, mine, std::memory_order_acquire,
                                                         std::memory_order_relaxed))
                continue;
            bits_[wi].fetch_and(~(1ull << bit), std::memory_order_relaxed);  // a hint (see header)
            out[got++] = b;
        }
        if (got < n) wi = (wi + 1) % words;
    }
    cursor.store(wi, std::memory_order_relaxed);
    if (got < n) got += evict_into(user, n - got, out + got);
    if (got < n) {
        unref(user, out, got);
        return false;
    }
    return true;
}

bool KvArena::ref(uint32_t user, int32_t b) {
    // Only this user changes its own field, so the check cannot race with an increment.
    if ((blocks_[b].word.load(std::memory_order_relaxed) & field(user)) == field(user)) return false;
    blocks_[b].word.fetch_add(one(user), std::memory_order_relaxed);  // the block is held: no ordering to give
    return true;
}

void KvArena::unref(uint32_t user, int32_t b) {
    // Release pairs with the acquire of the CAS that next allocates or evicts the
    // block: our accesses to its data happen before its next holder's.
    uint64_t old = blocks_[b].word.fetch_sub(one(user), std::memory_order_acq_rel);
    if ((old & field(user)) == 0) {
        // The subtraction borrowed from the next user's field (or CACHED): undo it and
        // stop before anyone acts on the corrupted word.
        blocks_[b].word.fetch_add(one(user), std::memory_order_relaxed);
        std::fprintf(stderr, "duet: KV arena: user %u dropped a reference to block %d it does not hold\n", user, b);
        std::abort();
    }
    after_drop(b, old - one(user));
}

bool KvArena::share(uint32_t from, uint32_t to, int32_t b) {
    std::atomic<uint64_t>& word = blocks_[b].word;
    uint64_t w = word.load(std::memory_order_relaxed);
    for (;;) {
        if ((w & field(from)) == 0 || (w & field(to)) == field(to)) return false;
        // acq_rel, as transfer(): one more RMW in the word's release sequence.
        if (word.compare_exchange_weak(w, w + one(to), std::memory_order_acq_rel, std::memory_order_relaxed))
            return true;
    }
}

bool KvArena::transfer(uint32_t from, uint32_t to, int32_t b) {
    if (from == to) return refs_of(from, b) > 0;
    std::atomic<uint64_t>& word = blocks_[b].word;
    uint64_t w = word.load(std::memory_order_relaxed);
    for (;;) {
        if ((w & field(from)) == 0 || (w & field(to)) == field(to)) return false;
        // acq_rel: the giver's accesses happen before the receiver's.
        if (word.compare_exchange_weak(w, w - one(from) + one(to), std::memory_order_acq_rel,
                                       std::memory_order_relaxed))
            return true;
    }
}

void KvArena::unref(uint32_t user, const int32_t* b, uint32_t n) {
    for (uint32_t i = 0; i < n; ++i) unref(user, b[i]);
}

uint32_t KvArena::refcount(int32_t b) const {
    uint64_t w = blocks_[b].word.load(std::memory_order_relaxed);
    uint32_t total = 0;
    for (uint32_t u = 0; u < h_->n_users; ++u) total += static_cast<uint32_t>((w & field(u)) >> (u * h_->count_bits));
    return total;
}

uint32_t KvArena::refs_of(uint32_t user, int32_t b) const {
    return static_cast<uint32_t>((blocks_[b].word.load(std::memory_order_relaxed) & field(user)) >>
                                 (user * h_->count_bits));
}

bool KvArena::cached(int32_t b) const { return blocks_[b].word.load(std::memory_order_relaxed) & kCached; }

uint32_t KvArena::n_free() const {
    uint32_t n = 0;
    for (uint64_t w = 0; w < h_->bitmap_words; ++w)
        n += static_cast<uint32_t>(__builtin_popcountll(bits_[w].load(std::memory_order_relaxed)));
    return n;
}

uint32_t KvArena::evict_into(uint32_t user, uint32_t n, int32_t* out) {
    struct Cand {
        uint64_t t;
        int32_t b;
    };
    std::vector<Cand> cands;
    for (uint32_t b = 0; b < h_->n_blocks; ++b)
        if (blocks_[b].word.load(std::memory_order_relaxed) == kCached)
            cands.push_back({blocks_[b].last_use_ns.load(std::memory_order_relaxed), static_cast<int32_t>(b)});
    std::sort(cands.begin(), cands.end(), [](const Cand& a, const Cand& b) { return a.t < b.t || (a.t == b.t && a.b < b.b); });
    uint32_t got = 0, extra = 0;
    const uint32_t extra_max = std::min<uint32_t>(kEvictBatch, h_->n_blocks / 64);  // at most 1/64 of the cache
    for (const Cand& c : cands) {
        if (got == n && extra >= extra_max) break;
        uint64_t expect = kCached;
        // Acquire pairs with the release of the unref that left it unreferenced. The
        // CAS clears CACHED and names us in one step: a reader racing for the block
        // either got its reference first (we fail) or fails its own CAS.
        if (!blocks_[c.b].word.compare_exchange_strong(expect, one(user), std::memory_order_acquire,
                                                       std::memory_order_relaxed))
            continue;
        index_erase(c.b, blocks_[c.b].hash_lo.load(std::memory_order_relaxed));
        if (got < n) {
            out[got++] = c.b;
        } else {
            ++extra;
            unref(user, c.b);  // evicted ahead of need: free for the next allocations
        }
    }
    return got;
}

void KvArena::index_erase(int32_t b, uint64_t hash_lo) {
    const uint64_t mask = h_->index_capacity - 1;
    for (uint64_t i = 0; i <= mask && i < kMaxProbe; ++i) {
        std::atomic<uint32_t>& e = index_[(hash_lo + i) & mask];
        uint32_t v = e.load(std::memory_order_relaxed);
        if (v == kEmpty) return;
        if (v == static_cast<uint32_t>(b) + 1) {
            e.compare_exchange_strong(v, kTomb, std::memory_order_relaxed);  // entries are hints; the word decides
            return;
        }
    }
}

bool KvArena::publish(uint32_t user, int32_t b, const BlockHash& h) {
    if (refs_of(user, b) == 0 || cached(b)) return false;
    if (int32_t dup = acquire_cached(user, h); dup >= 0) {
        unref(user, dup);
        return false;
    }
    BlockMeta& m = blocks_[b];
    m.hash_lo.store(h.lo, std::memory_order_relaxed);
    m.hash_hi.store(h.hi, std::memory_order_relaxed);
    // Release pairs with acquire_cached()'s acquire CAS on the word: the hash and the
    // block's data (written by the caller before publish) are visible to a reader
    // that takes a reference while CACHED is set.
    m.word.fetch_or(kCached, std::memory_order_release);
    const uint64_t mask = h_->index_capacity - 1;
    for (uint64_t i = 0; i <= mask && i < kMaxProbe; ++i) {
        std::atomic<uint32_t>& e = index_[(h.lo + i) & mask];
        uint32_t v = e.load(std::memory_order_relaxed);
        if (v == static_cast<uint32_t>(b) + 1) return true;
        if (v != kEmpty && v != kTomb) continue;
        if (e.compare_exchange_strong(v, static_cast<uint32_t>(b) + 1, std::memory_order_relaxed)) return true;
    }
    return true;  // no room within the probe bound: cached, but only reachable by eviction
}

int32_t KvArena::acquire_cached(uint32_t user, const BlockHash& h) {
    const uint64_t mask = h_->index_capacity - 1;
    for (uint64_t i = 0; i <= mask && i < kMaxProbe; ++i) {
        uint32_t v = index_[(h.lo + i) & mask].load(std::memory_order_relaxed);
        if (v == kEmpty) return -1;
        if (v == kTomb) continue;
        int32_t b = static_cast<int32_t>(v - 1);
        BlockMeta& m = blocks_[b];
        if (m.hash_lo.load(std::memory_order_relaxed) != h.lo || m.hash_hi.load(std::memory_order_relaxed) != h.hi)
            continue;
        uint64_t w = m.word.load(std::memory_order_relaxed);
        bool got = false;
        while ((w & kCached) && (w & field(user)) != field(user)) {
            // Acquire pairs with publish()'s release: the data is complete.
            if (m.word.compare_exchange_weak(w, w + one(user), std::memory_order_acquire, std::memory_order_relaxed)) {
                got = true;
                break;
            }
        }
        if (!got) continue;
        // The block may have been evicted and republished between the hash check and
        // the CAS; with our reference held it cannot change again, so check once more.
        if (m.hash_lo.load(std::memory_order_relaxed) == h.lo && m.hash_hi.load(std::memory_order_relaxed) == h.hi)
            return b;
        unref(user, b);
    }
    return -1;
}

bool KvArena::has_cached(const BlockHash& h) const {
    const uint64_t mask = h_->index_capacity - 1;
    for (uint64_t i = 0; i <= mask && i < kMaxProbe; ++i) {
        const uint32_t v = index_[(h.lo + i) & mask].load(std::memory_order_relaxed);
        if (v == kEmpty) return false;
        if (v == kTomb) continue;
        const BlockMeta& m = blocks_[v - 1];
        if (m.hash_lo.load(std::memory_order_relaxed) == h.lo && m.hash_hi.load(std::memory_order_relaxed) == h.hi &&
            (m.word.load(std::memory_order_relaxed) & kCached))
            return true;
    }
    return false;
}

uint64_t KvArena::recover_user(uint32_t user) {
    uint64_t dropped = 0;
    const uint32_t shift = user * h_->count_bits;
    for (uint32_t b = 0; b < h_->n_blocks; ++b) {
        std::atomic<uint64_t>& word = blocks_[b].word;
        uint64_t w = word.load(std::memory_order_relaxed);
        // A CAS, not a fetch_sub of what we read: a second recoverer (or one resuming
        // after a recoverer died) finds the field already clear and does nothing.
        for (uint64_t c; (c = w & field(user)) != 0;) {
            // acq_rel: as unref().
            if (word.compare_exchange_weak(w, w - c, std::memory_order_acq_rel, std::memory_order_relaxed)) {
                dropped += c >> shift;
                after_drop(static_cast<int32_t>(b), w - c);
                break;
            }
        }
    }
    // A process that died between a free's word store and its bit store left a free
    // block out of the index: put every free block's bit back (idempotent).
    for (uint32_t b = 0; b < h_->n_blocks; ++b)
        if (blocks_[b].word.load(std::memory_order_relaxed) == 0)
            if (!(bits_[b / 64].load(std::memory_order_relaxed) & (1ull << (b % 64)))) mark_free(static_cast<int32_t>(b));
    // Pairs with join()'s acq_rel CAS: the next holder sees a clean slot.
    h_->users[user].store(0, std::memory_order_release);
    return dropped;
}

uint32_t KvArena::unindexed_free() const {
    uint32_t n = 0;
    for (uint32_t b = 0; b < h_->n_blocks; ++b)
        if (blocks_[b].word.load(std::memory_order_relaxed) == 0 &&
            !(bits_[b / 64].load(std::memory_order_relaxed) & (1ull << (b % 64))))
            ++n;
    return n;
}

ArenaCensus KvArena::census() const {
    ArenaCensus c;
    c.total = h_->n_blocks;
    for (uint32_t b = 0; b < h_->n_blocks; ++b) {
        uint64_t w = blocks_[b].word.load(std::memory_order_relaxed);
        if (w == 0) ++c.free;
        else if ((w & counts_mask()) == 0) ++c.cached;
        else ++c.held;
        for (uint32_t u = 0; u < h_->n_users; ++u) c.refs_by_user[u] += (w & field(u)) >> (u * h_->count_bits);
    }
    return c;
}

}  // namespace duet::shm
