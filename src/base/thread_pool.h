// A fixed team of threads that run one function together (SPMD, as ggml does):
// run(fn) calls fn(tid, n_threads) on every thread, the caller being tid 0, and
// returns when all have finished. Inside fn, barrier() separates phases, so a
// whole forward pass costs one dispatch plus one barrier per phase instead of a
// dispatch per operation.
//
// Workers spin briefly waiting for work, then block on an atomic wait (a futex),
// so an idle engine uses no CPU; run()'s wait for the workers and barrier() do the
// same, so that a thread whose partner is descheduled sleeps instead of holding a
// core. Threads can be pinned to given CPUs.
//
// The width: how many of the threads a run() uses (set_width, between runs; all by
// default). Threads past it skip the run, so a pool can hold threads pinned to
// cores it only sometimes has (cores another role lends while it is idle): the
// work is split among the width, and the kernels' results do not depend on it
// (they split by output rows and heads, never a reduction across threads:
// Model.LogitsAreBitwiseIndependentOfThreadCount).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

#include "base/result.h"

namespace duet {

class ThreadPool {
public:
    // n_threads >= 1. cpus: CPU ids to pin thread i to cpus[i % size]; empty = no pinning.
    explicit ThreadPool(int n_threads, std::vector<int> cpus = {});
    ~ThreadPool();
    ThreadPool(const ThreadPool&) = delete;
    ThreadPool& operator=(const ThreadPool&) = delete;

    int size() const { return n_; }
    // The threads the next runs use: 1..size() (clamped); not during a run.
    void set_width(int w) { width_ = w < 1 ? 1 : (w > n_ ? n_ : w); }
    int width() const { return width_; }

    // Runs fn(tid, n) on the first width() threads (n = width()); not reentrant.
    void run(const std::function<void(int tid, int n)>& fn);

    // All threads of the current run() wait here until every one has arrived.
    void barrier();

    // Counts runs started and barriers passed (at any width): work moving forward,
    // read by another thread (a worker's watchdog: a long pass is alive while this
    // moves, a wedged one is not).
    uint64_t progress() const { return progress_.load(std::memory_order_relaxed); }

    // [begin, end) share of thread tid when n items are split into nth parts,
    // optionally in multiples of `align` items.
    static void split(int64_t n, int tid, int nth, int64_t& begin, int64_t& end, int64_t align = 1);

private:
    void worker(int tid);

    int n_;
    int width_;  // the caller's (set_width); each job carries its own copy in job_
    std::vector<std::thread> threads_;
    const std::function<void(int, int)>* fn_ = nullptr;
    // Bumped by run() to start a job (by kJobStep: its low bits are the job's width,
    // so a worker that looks late reads the width of the job it sees, never the
    // next one's); workers wait for it to change.
    static constexpr uint32_t kJobStep = 1u << 12;
    alignas(64) std::atomic<uint32_t> job_{0};
    alignas(64) std::atomic<int> done_{0};
    alignas(64) std::atomic<int> barrier_count_{0};
    alignas(64) std::atomic<uint32_t> barrier_phase_{0};
    std::atomic<bool> stop_{false};
    // Written by one thread at a time: run()'s caller, or a barrier's last arriver.
    std::atomic<uint64_t> progress_{0};
    void tick() { progress_.store(progress_.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed); }
};

// Parses a CPU list such as "0-3,6,8-9".
Result<std::vector<int>> parse_cpu_list(const std::string& s);

}  // namespace duet
