// Single-producer single-consumer ring of fixed-size records in shared memory.
//
// Layout (position independent): a 256-byte header with the producer's and the
// consumer's indices on cache lines of their own, then capacity records, then one
// cache line of padding so the last record never shares a line with what follows.
// Indices are 64-bit and only grow (no wrap in the life of the machine); slot =
// index & mask.
//
// Each side keeps its own index and a cached copy of the other side's index in
// private memory (the endpoint objects), and reads the other side's shared index
// only when its cached copy says the ring is full (producer) or empty (consumer).
//
// Crash behaviour: a producer that dies before its release store of tail published
// nothing; one that dies after published whole records. A consumer that dies
// before its store of head leaves the records for its successor. The shared
// indices are the whole state, so a restarted endpoint attaches and continues
// where its predecessor's last store left off; no ring can be wedged by a death.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "base/result.h"

namespace duet::shm {

inline constexpr uint32_t kRingMagic = 0x676e6972;  // "ring"
inline constexpr size_t kCacheLine = 64;

struct RingHeader {
    uint32_t magic;
    uint32_t record_bytes;
    uint64_t capacity;  // power of two
    uint64_t mask;
    uint8_t pad0_[kCacheLine - 24];
    alignas(kCacheLine) std::atomic<uint64_t> head;  // next index to read; written by the consumer
    uint8_t pad1_[kCacheLine - 8];
    alignas(kCacheLine) std::atomic<uint64_t> tail;  // next index to write; written by the producer
    uint8_t pad2_[kCacheLine - 8];
    uint8_t pad3_[kCacheLine];  // records start a line further on
};
static_assert(sizeof(RingHeader) == 4 * kCacheLine);
static_assert(std::atomic<uint64_t>::is_always_lock_free);

// Bytes a ring of `capacity` records of `record_bytes` needs (a multiple of 64).
size_t ring_bytes(uint32_t record_bytes, uint64_t capacity);
// Formats a ring at mem (64-byte aligned, ring_bytes() long). capacity: a power of two.
Status ring_init(void* mem, uint32_t record_bytes, uint64_t capacity);
// Checks that mem holds a ring of records of record_bytes.
Status ring_check(const void* mem, uint32_t record_bytes);

inline uint8_t* ring_records(RingHeader* h) { return reinterpret_cast<uint8_t*>(h) + sizeof(RingHeader); }

// Records published and not yet released, for gauges (a snapshot: either side may
// move on at once).
inline uint64_t ring_occupancy(const RingHeader* h) {
    const uint64_t head = h->head.load(std::memory_order_acquire);
    const uint64_t tail = h->tail.load(std::memory_order_acquire);
    return tail >= head ? tail - head : 0;
}

// An endpoint of the wrong record type would write past the ring into whatever
// follows it in the segment: refuse loudly (a build mismatch, caught at attach).
inline RingHeader* ring_checked(RingHeader* h, size_t record_bytes) {
    if (h->magic != kRingMagic || h->record_bytes != record_bytes) {
        std::fprintf(stderr, "duet: ring at %p holds %u-byte records (magic %#x); this endpoint uses %zu\n",
                     static_cast<void*>(h), h->record_bytes, h->magic, record_bytes);
        std::abort();
    }
    return h;
}

// Producer endpoint; T is the record type (trivially copyable, sizeof(T) == record_bytes).
// Endpoints are cache-line aligned: two of them side by side in one process (a
// thread per side) would otherwise share a line of private indices.
template <typename T>
class alignas(kCacheLine) SpscProducer {
    static_assert(std::is_trivially_copyable_v<T>);

public:
    SpscProducer() = default;
    explicit SpscProducer(RingHeader* h)
        : h_(ring_checked(h, sizeof(T))), recs_(reinterpret_cast<T*>(ring_records(h))), mask_(h->mask), cap_(h->capacity) {
        tail_ = h_->tail.load(std::memory_order_relaxed);  // ours alone: a restart continues here
        // Pairs with the consumer's release store of head.
        head_cache_ = h_->head.load(std::memory_order_acquire);
    }

    bool try_push(const T& r) {
        if (tail_ - head_cache_ == cap_) {
            // Pairs with the consumer's release store of head: its reads of these slots are done.
            head_cache_ = h_->head.load(std::memory_order_acquire);
            if (tail_ - head_cache_ == cap_) return false;
        }
        recs_[tail_ & mask_] = r;
        ++tail_;
        // Pairs with the consumer's acquire load of tail: the record is visible first.
        h_->tail.store(tail_, std::memory_order_release);
        return true;
    }

    // Pushes up to n records with one publication; returns how many fit.
    size_t push(const T* r, size_t n) {
        uint64_t room = cap_ - (tail_ - head_cache_);
        if (room < n) {
            // Pairs with the consumer's release store of head.
            head_cache_ = h_->head.load(std::memory_order_acquire);
            room = cap_ - (tail_ - head_cache_);
        }
        if (n > room) n = room;
        for (size_t i = 0; i < n; ++i) recs_[(tail_ + i) & mask_] = r[i];
        tail_ += n;
        // Pairs with the consumer's acquire load of tail.
        if (n) h_->tail.store(tail_, std::memory_order_release);
        return n;
    }

    uint64_t published() const { return tail_; }
    RingHeader* header() const { return h_; }

private:
    RingHeader* h_ = nullptr;
    T* recs_ = nullptr;
    uint64_t mask_ = 0, cap_ = 0;
    uint64_t tail_ = 0, head_cache_ = 0;
};

// Consumer endpoint.
template <typename T>
class alignas(kCacheLine) SpscConsumer {
    static_assert(std::is_trivially_copyable_v<T>);

public:
    SpscConsumer() = default;
    explicit SpscConsumer(RingHeader* h)
        : h_(ring_checked(h, sizeof(T))), recs_(reinterpret_cast<const T*>(ring_records(h))), mask_(h->mask), cap_(h->capacity) {
        head_ = h_->head.load(std::memory_order_relaxed);  // ours alone
        // Pairs with the producer's release store of tail.
        tail_cache_ = h_->tail.load(std::memory_order_acquire);
    }

    // True when a record is waiting (reads the shared tail when the cache says empty).
    bool readable() {
        if (head_ != tail_cache_) return true;
        // Pairs with the producer's release store of tail.
        tail_cache_ = h_->tail.load(std::memory_order_acquire);
        return head_ != tail_cache_;
    }

    bool try_pop(T& out) {
        if (!readable()) return false;
        out = recs_[head_ & mask_];
        ++head_;
        // Pairs with the producer's acquire load of head: our read of the slot is done.
        h_->head.store(head_, std::memory_order_release);
        return true;
    }

    // Pops up to n records with one release of their slots.
    size_t pop(T* out, size_t n) {
        uint64_t avail = tail_cache_ - head_;
        if (avail < n) {
            // Pairs with the producer's release store of tail.
            tail_cache_ = h_->tail.load(std::memory_order_acquire);
            avail = tail_cache_ - head_;
        }
        if (n > avail) n = avail;
        for (size_t i = 0; i < n; ++i) out[i] = recs_[(head_ + i) & mask_];
        head_ += n;
        // Pairs with the producer's acquire load of head.
        if (n) h_->head.store(head_, std::memory_order_release);
        return n;
    }

    // Reloads the producer's tail, so that records published since the last look
    // are seen by peek() (readable() reloads it only once everything seen is read).
    void refresh() {
        // Pairs with the producer's release store of tail.
        tail_cache_ = h_->tail.load(std::memory_order_acquire);
    }
    // Records waiting, as of the last look at the tail; and the ring's size.
    uint64_t backlog() const { return tail_cache_ - head_; }
    uint64_t capacity() const { return cap_; }

    // Zero-copy: the next readable records in place (contiguous, up to the ring's
    // end), valid until release(). Records stay in the ring until released, so a
    // consumer that dies while handling them leaves them to its successor.
    const T* peek(size_t* n) {
        readable();
        uint64_t avail = tail_cache_ - head_;
        uint64_t to_end = cap_ - (head_ & mask_);
        *n = static_cast<size_t>(avail < to_end ? avail : to_end);
        return recs_ + (head_ & mask_);
    }
    void release(size_t n) {
        head_ += n;
        // Pairs with the producer's acquire load of head.
        h_->head.store(head_, std::memory_order_release);
    }

    uint64_t consumed() const { return head_; }
    RingHeader* header() const { return h_; }

private:
    RingHeader* h_ = nullptr;
    const T* recs_ = nullptr;
    uint64_t mask_ = 0, cap_ = 0;
    uint64_t head_ = 0, tail_cache_ = 0;
};

}  // namespace duet::shm
