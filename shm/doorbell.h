// Doorbell: how a consumer that found nothing to do sleeps, and how a producer wakes
// it without a system call when it is awake. One doorbell per consuming process
// serves all the rings it reads. The argument that no wake-up is lost, and the
// Promela model that checks it, are in shm/DOORBELL.md and shm/doorbell.pml.
//
// The word is 0 while the consumer is awake and 1 while it is (about to be) asleep.
// Consumer: word = 1; seq_cst fence; re-check the rings; futex_wait(word, 1).
// Producer: publish; seq_cst fence; if word == 1 and exchange(word, 0) == 1: wake.
#pragma once

#include <atomic>
#include <cstdint>

// ThreadSanitizer does not model fences. Under it, both sides use an acq_rel
// read-modify-write of the word instead (consumer: exchange(1); producer:
// fetch_or(0)): RMWs of one word are totally ordered, and whichever comes second
// reads the first's value with acquire, which gives the same either-or guarantee.
// It is not the default because it makes every producer write the doorbell's cache
// line, where the fence form only reads it while the consumer is awake.
#if defined(__SANITIZE_THREAD__)
#define DUET_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define DUET_TSAN 1
#endif
#endif

namespace duet::shm {

struct Doorbell {
    std::atomic<uint32_t> word;
};
static_assert(sizeof(Doorbell) == 4 && std::atomic<uint32_t>::is_always_lock_free);

// futex(2) on a word in shared memory (no FUTEX_PRIVATE_FLAG: the kernel keys it by
// physical page, so waiters in other processes match). timeout_ns < 0: no timeout.
// Returns false on timeout.
bool futex_wait(std::atomic<uint32_t>* word, uint32_t expected, int64_t timeout_ns);
void futex_wake(std::atomic<uint32_t>* word, int n);
uint64_t monotonic_ns();  // CLOCK_MONOTONIC: one clock for every process of the box

// Producer side, after publishing (the ring's release store of its tail): wakes the
// consumer if it is asleep. Costs one fence and one load when it is awake.
inline bool doorbell_ring(Doorbell& d) {
#ifdef DUET_TSAN
    // Pairs with the consumer's exchange (see above).
    if (d.word.fetch_or(0, std::memory_order_acq_rel) == 0) return false;
#else
    // Pairs with the fence in doorbell_wait: either this load sees word == 1, or the
    // consumer's re-check sees what we published (store-buffering pattern).
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (d.word.load(std::memory_order_relaxed) == 0) return false;
#endif
    // Of several producers, only the one that flips 1 -> 0 makes the system call.
    if (d.word.exchange(0, std::memory_order_relaxed) != 1) return false;
    futex_wake(&d.word, 1);
    return true;
}

// Consumer side: returns true as soon as ready() is true, or false once timeout_ns
// have passed (timeout_ns < 0 waits for ever) — false even if work arrived just
// then, so a caller that had a producer running can tell a lost wake-up from a
// prompt one. Spins for spin_iters checks first, so a busy consumer makes no system
// calls. ready() must only read shared state (ring indices) with acquire loads.
// One waiting thread per doorbell: a second waiter could swallow the first's wake.
template <typename Ready>
bool doorbell_wait(Doorbell& d, Ready&& ready, int spin_iters, int64_t timeout_ns) {
    for (int i = 0; i < spin_iters; ++i) {
        if (ready()) return true;
        __builtin_ia32_pause();
    }
    const uint64_t deadline = timeout_ns < 0 ? 0 : monotonic_ns() + static_cast<uint64_t>(timeout_ns);
    for (;;) {
        if (ready()) return true;
#ifdef DUET_TSAN
        d.word.exchange(1, std::memory_order_acq_rel);  // pairs with the producer's fetch_or
#else
        d.word.store(1, std::memory_order_relaxed);
        // Pairs with the fence in doorbell_ring (see there).
        std::atomic_thread_fence(std::memory_order_seq_cst);
#endif
        if (ready()) {
            d.word.store(0, std::memory_order_relaxed);
            return true;
        }
        // Sleeps only if no producer has flipped the word back to 0 since our store;
        // a producer that did so has woken, or will wake, this futex.
        int64_t left = -1;
        if (timeout_ns >= 0) {
            uint64_t now = monotonic_ns();
            left = now >= deadline ? 0 : static_cast<int64_t>(deadline - now);
        }
        bool woke = left != 0 && futex_wait(&d.word, 1, left);
        d.word.store(0, std::memory_order_relaxed);
        if (!woke) return false;
    }
}

}  // namespace duet::shm
