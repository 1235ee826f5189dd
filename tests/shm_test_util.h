// Helpers shared by the shm stress and kill tests.
#pragma once

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <vector>
#include <string>

#include <chrono>
#include <thread>

#include "shm/segment.h"
#include "time_scale.h"

namespace duet::shm::testing {

// Page-aligned heap memory standing in for a segment's payload (a registry, a ring).
struct Mem {
    explicit Mem(size_t n) : bytes(n), p(static_cast<uint8_t*>(std::aligned_alloc(4096, (n + 4095) / 4096 * 4096))) {}
    ~Mem() { std::free(p); }
    Mem(const Mem&) = delete;
    Mem& operator=(const Mem&) = delete;
    size_t bytes;
    uint8_t* p;
};

// Waits (yielding) until pred() holds, at most limit_ms (widened by DUET_TIME_SCALE):
// whether it held. A test asserts it, so that a lost wake-up fails the test instead
// of spinning until ctest's timeout.
template <typename Pred>
inline bool wait_until(Pred pred, uint64_t limit_ms = 30'000) {
    const auto end = std::chrono::steady_clock::now() +
                     std::chrono::milliseconds(static_cast<int64_t>(duet::test_time::scaled_ns(limit_ms * 1'000'000) / 1'000'000));
    while (!pred()) {
        if (std::chrono::steady_clock::now() > end) return false;
        std::this_thread::yield();
    }
    return true;
}

inline std::string unique_name(const char* what) {
    static std::atomic<int> n{0};
    return std::string("duet-test-") + what + "-" + std::to_string(getpid()) + "-" + std::to_string(n++);
}

// Scales iteration counts: DUET_STRESS_SCALE=10 for a soak.
inline uint64_t scaled(uint64_t n) {
    const char* s = std::getenv("DUET_STRESS_SCALE");
    double f = s ? std::atof(s) : 1.0;
    if (f <= 0) f = 1.0;
    return static_cast<uint64_t>(static_cast<double>(n) * f);
}

inline uint64_t mix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

// A 64-byte record whose payload is a function of its sequence number.
struct CheckedRec {
    uint64_t seq;
    uint64_t v[6];
    uint64_t sum;
    static CheckedRec make(uint64_t seq) {
        CheckedRec r{};
        r.seq = seq;
        r.sum = seq;
        for (int i = 0; i < 6; ++i) {
            r.v[i] = mix64(seq * 8 + i);
            r.sum ^= r.v[i];
        }
        return r;
    }
    bool valid(uint64_t expect_seq) const {
        if (seq != expect_seq) return false;
        uint64_t s = seq;
        for (int i = 0; i < 6; ++i) {
            if (v[i] != mix64(seq * 8 + i)) return false;
            s ^= v[i];
        }
        return s == sum;
    }
};
static_assert(sizeof(CheckedRec) == 64);

// Runs fn in a child process; the child exits with fn's return value.
// The child dies with the test process (a failed assertion that aborts it would
// otherwise leave its workers running, holding the test's output pipe open).
inline pid_t fork_run(const std::function<int()>& fn) {
    pid_t pid = fork();
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        _exit(fn());
    }
    return pid;
}

// Waits for pid; returns its exit code, or 128 + signal.
inline int wait_exit(pid_t pid) {
    int status = 0;
    if (waitpid(pid, &status, 0) != pid) return -1;
    if (WIFEXITED(status)) return WEXITSTATUS(status);
    if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
    return -1;
}

// SIGKILLs and reaps the children whose pids these variables hold (0: none) when a
// test ends early, so a failed assertion never leaves a worker running.
struct ChildReaper {
    std::vector<pid_t*> pids;
    ~ChildReaper() {
        for (pid_t* p : pids)
            if (*p > 0 && kill(*p, SIGKILL) == 0) wait_exit(*p);
    }
};

struct SegmentGuard {
    std::string name;
    ~SegmentGuard() { (void)Segment::unlink(name); }
};

}  // namespace duet::shm::testing
