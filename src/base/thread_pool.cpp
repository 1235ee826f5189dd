#include "base/thread_pool.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <string>

#if defined(__x86_64__)
#include <immintrin.h>
#define DUET_PAUSE() _mm_pause()
#else
#define DUET_PAUSE() ((void)0)
#endif

namespace duet {

namespace {

constexpr int kSpinBeforeWait = 1 << 14;
// How long a waiter past its spins yields before it sleeps.
constexpr auto kYieldBeforeSleep = std::chrono::milliseconds(20);

// Returns once a.load() != old: spins, then yields (a descheduled partner thread
// needs a core), then sleeps on a (the writer notifies). A waiter that only yielded
// stayed runnable and, on a core shared with another busy process's threads, kept
// the core its own partner needed: passes of 1 s took minutes (serve_e2e beside
// contexts_e2e under ASan on 2 cores: prefill's heartbeat 41 s old with 2 s of CPU
// used). Sleeping only past 2 ms of yields keeps a pass's barriers as fast as
// before (a futex wake-up costs tens of microseconds).
template <typename T>
void await_change(const std::atomic<T>& a, T old) {
    for (int i = 0; i < kSpinBeforeWait; ++i) {
        // acquire: pairs with the writer's release, publishing what it wrote before.
        if (a.load(std::memory_order_acquire) != old) return;
        DUET_PAUSE();
    }
    const auto t0 = std::chrono::steady_clock::now();
    while (a.load(std::memory_order_acquire) == old) {
        if (std::chrono::steady_clock::now() - t0 < kYieldBeforeSleep)
            std::this_thread::yield();
        else
            a.wait(old, std::memory_order_acquire);
    }
}

void pin_to(std::thread::native_handle_type h, int cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    pthread_setaffinity_np(h, sizeof(set), &set);  // best effort: a cgroup may forbid it
}

}  // namespace

ThreadPool::ThreadPool(int n_threads, std::vector<int> cpus)
    : n_(std::clamp(n_threads, 1, static_cast<int>(kJobStep) - 1)), width_(n_) {
    if (!cpus.empty()) pin_to(pthread_self(), cpus[0]);
    for (int t = 1; t < n_; ++t) {
        threads_.emplace_back([this, t] { worker(t); });
        if (!cpus.empty()) pin_to(threads_.back().native_handle(), cpus[t % cpus.size()]);
    }
}

ThreadPool::~ThreadPool() {
    stop_.store(true, std::memory_order_relaxed);
    // release: pairs with the acquire load of job_ in worker(), which then sees stop_.
    job_.fetch_add(kJobStep, std::memory_order_release);
    job_.notify_all();
    for (auto& t : threads_) t.join();
}

void ThreadPool::worker(int tid) {
    uint32_t seen = 0;
    bool skipped = false;
    for (;;) {
        uint32_t j;
        // A thread past the last job's width sleeps at once: it is pinned to a core
        // lent by another role, which needs that core while it is not lent.
        int spins = skipped ? kSpinBeforeWait : 0;
        // acquire: pairs with the release increment in run(), publishing fn_.
        while ((j = job_.load(std::memory_order_acquire)) == seen) {
            if (++spins < kSpinBeforeWait) {
                DUET_PAUSE();
            } else {
                job_.wait(seen, std::memory_order_acquire);
            }
        }
        seen = j;
        if (stop_.load(std::memory_order_relaxed)) return;
        const int w = static_cast<int>(j & (kJobStep - 1));  // this job's width
        skipped = tid >= w;
        if (skipped) continue;  // not in this run: run() waits for the others only
        (*fn_)(tid, w);
        // release: pairs with the acquire load in run(), publishing this thread's writes.
        done_.fetch_add(1, std::memory_order_release);
        done_.notify_one();  // run() may sleep on it (no system call unless it does)
    }
}

void ThreadPool::run(const std::function<void(int, int)>& fn) {
    const int w = width_;
    tick();
    if (w == 1) {
        fn(0, 1);
        return;
    }
    fn_ = &fn;
    done_.store(0, std::memory_order_relaxed);
    // release: pairs with the acquire load of job_ in worker(), publishing fn_ and done_.
    // The new value: the next job number, with this job's width in the low bits.
    uint32_t j = job_.load(std::memory_order_relaxed);
    job_.store(((j & ~(kJobStep - 1)) + kJobStep) | static_cast<uint32_t>(w), std::memory_order_release);
    job_.notify_all();
    fn(0, w);
    // acquire (in await_change): pairs with each worker's release increment of done_.
    for (int d; (d = done_.load(std::memory_order_acquire)) != w - 1;) await_change(done_, d);
}

void ThreadPool::barrier() {
    const int w = width_;
    if (w == 1) {
        tick();
        return;
    }
    // acquire: pairs with the release store of the phase by the last arriver.
    uint32_t phase = barrier_phase_.load(std::memory_order_acquire);
    // acq_rel: orders this thread's writes before the arrival and sees the others'.
    if (barrier_count_.fetch_add(1, std::memory_order_acq_rel) == w - 1) {
        barrier_count_.store(0, std::memory_order_relaxed);
        tick();
        // release: pairs with the acquire loads of waiters below.
        barrier_phase_.store(phase + 1, std::memory_order_release);
        barrier_phase_.notify_all();  // waiters past their yields sleep (await_change)
        return;
    }
    // acquire (in await_change): pairs with the release store of the last arriver.
    await_change(barrier_phase_, phase);
}

void ThreadPool::split(int64_t n, int tid, int nth, int64_t& begin, int64_t& end, int64_t align) {
    int64_t units = (n + align - 1) / align;
    int64_t b = units * tid / nth;
    int64_t e = units * (tid + 1) / nth;
    begin = std::min(n, b * align);
    end = std::min(n, e * align);
}

Result<std::vector<int>> parse_cpu_list(const std::string& s) {
    std::vector<int> out;
    size_t i = 0;
    while (i < s.size()) {
        size_t j = s.find(',', i);
        if (j == std::string::npos) j = s.size();
        std::string part = s.substr(i, j - i);
        size_t dash = part.find('-');
        try {
            if (dash == std::string::npos) {
                out.push_back(std::stoi(part));
            } else {
                int a = std::stoi(part.substr(0, dash)), b = std::stoi(part.substr(dash + 1));
                if (b < a || b - a > 4096) return make_error("bad CPU range '{}' in '{}'", part, s);
                for (int c = a; c <= b; ++c) out.push_back(c);
            }
        } catch (...) {
            return make_error("bad CPU list '{}': expected e.g. 0-3,6", s);
        }
        i = j + 1;
    }
    for (int c : out)
        if (c < 0 || c >= CPU_SETSIZE) return make_error("CPU id {} in '{}' is out of range", c, s);
    if (out.empty()) return make_error("empty CPU list");
    return out;
}

}  // namespace duet
