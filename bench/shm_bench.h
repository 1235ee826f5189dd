// `duet bench shm`: the shared-memory substrate (rings, doorbell, KV arena) measured
// against Boost doing the same work in the same run, on the same two CPUs.
//
// Every measurement runs in a real /dev/shm segment. The measuring side runs in the
// calling thread, pinned to cpu_a; its peer is a thread pinned to cpu_b, or a forked
// process pinned to cpu_b that maps the segment again by name (so at another address:
// whatever crosses processes must be position independent, Boost's objects included).
// Boost's objects are placement-new'ed into the segment: spsc_queue and stack with a
// compile-time capacity hold their storage inline and no pointers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "base/result.h"

namespace duet {

struct ShmBenchOptions {
    double seconds = 0.25;  // length of each timed run
    int reps = 3;           // runs per ring throughput figure, duet and Boost alternating; the median is kept
    int wakes = 2000;       // doorbell wake-ups per implementation
    bool json = false;
};

// Where measurements run: a mapped segment and the two CPUs.
struct ShmBenchSite {
    std::string segment;      // segment name: a peer process maps it by this name
    uint8_t* base = nullptr;  // this process's mapping of the segment's payload
    size_t bytes = 0;         // payload bytes (at least shm_bench_bytes())
    int cpu_a = -1;           // the measuring side's CPU; -1: not pinned
    int cpu_b = -1;           // its peer's CPU
    double seconds = 0.25;    // length of each timed run
};

enum class ShmImpl { Duet, Boost };
enum class ShmPeer { Thread, Process };

// Payload bytes a site needs.
size_t shm_bench_bytes();

struct ShmRate {
    double per_s = 0;    // records (ring) or alloc+free pairs (arena) per second, all sides together
    double ns_per = 0;   // arena: one side's mean time per pair (or per block in batches)
    uint64_t count = 0;  // records or pairs measured
};

struct ShmLatency {
    double mean_ns = 0, p50_ns = 0, p99_ns = 0;
    uint64_t samples = 0;
    uint64_t slept = 0;         // doorbell: wakes that took the FUTEX_WAKE path (duet only)
    uint64_t ctx_switches = 0;  // doorbell: the consumer's voluntary context switches (sleeps)
};

// 64-byte records from producer (peer) to consumer (measuring side), one at a time
// (batch 1: try_push/try_pop, Boost's push/pop of one) or batch at a time
// (push(n)/pop(n) on both). The consumer checks every sequence number.
// capacity: 1024 (the instance's default) or 4096 records, the same for Boost.
Result<ShmRate> bench_ring_throughput(const ShmBenchSite& s, ShmImpl impl, ShmPeer peer, uint32_t batch,
                                      uint64_t capacity = 1024);
// Ping-pong over two rings, one record in flight; per round trip, timed with rdtsc.
Result<ShmLatency> bench_ring_round_trip(const ShmBenchSite& s, ShmImpl impl, ShmPeer peer);
// A consumer process asleep (duet: doorbell_wait with no spinning; Boost: an
// interprocess_semaphore) is sent one record every ~100 us; latency from the
// producer's timestamp before its push to the consumer running again, on
// CLOCK_MONOTONIC (comparable across CPUs).
Result<ShmLatency> bench_doorbell_wake(const ShmBenchSite& s, ShmImpl impl, int wakes);
// One thread: alloc(batch) then free of those blocks (Boost: lockfree::stack of free
// block ids, pop then push), timed with rdtsc per 64 blocks; the figures are ns per
// block (one alloc and one free).
Result<ShmLatency> bench_arena_single(const ShmBenchSite& s, ShmImpl impl, uint32_t batch);
// Two processes, each its own arena user, alloc(batch)+free in a loop for the same
// window; per_s: blocks allocated and freed per second by both; ns_per: per block,
// one process's view.
Result<ShmRate> bench_arena_contended(const ShmBenchSite& s, ShmImpl impl, uint32_t batch);

// The whole set: prints the table (or one JSON object with --json); 0 when it ran.
int cmd_bench_shm(const ShmBenchOptions& o);

}  // namespace duet
