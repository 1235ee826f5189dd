#include "shm/spsc_ring.h"

#include <new>

namespace duet::shm {

size_t ring_bytes(uint32_t record_bytes, uint64_t capacity) {
    size_t b = sizeof(RingHeader) + static_cast<size_t>(record_bytes) * capacity + kCacheLine;
    return (b + kCacheLine - 1) / kCacheLine * kCacheLine;
}

Status ring_init(void* mem, uint32_t record_bytes, uint64_t capacity) {
    if (capacity < 2 || (capacity & (capacity - 1)) != 0)
        return make_error("ring capacity must be a power of two >= 2, got {}", capacity);
    if (record_bytes == 0) return make_error("ring records must have a size");
    if (reinterpret_cast<uintptr_t>(mem) % kCacheLine != 0) return make_error("ring memory must be 64-byte aligned");
    std::memset(mem, 0, ring_bytes(record_bytes, capacity));
    auto* h = new (mem) RingHeader{};
    h->record_bytes = record_bytes;
    h->capacity = capacity;
    h->mask = capacity - 1;
    h->head.store(0, std::memory_order_relaxed);
    h->tail.store(0, std::memory_order_relaxed);
    h->magic = kRingMagic;  // published with the segment (its magic's release store)
    return {};
}

Status ring_check(const void* mem, uint32_t record_bytes) {
    auto* h = static_cast<const RingHeader*>(mem);
    if (h->magic != kRingMagic) return make_error("not a ring (magic {:#x})", h->magic);
    if (h->record_bytes != record_bytes)
        return make_error("ring holds {}-byte records, expected {}", h->record_bytes, record_bytes);
    if (h->capacity < 2 || (h->capacity & h->mask) != 0 || h->mask != h->capacity - 1)
        return make_error("ring has a bad capacity {}", h->capacity);
    return {};
}

}  // namespace duet::shm
