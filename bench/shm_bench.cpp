#include "bench/shm_bench.h"

#include <dirent.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <x86intrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <new>
#include <thread>
#include <utility>
#include <vector>

#include <boost/interprocess/sync/interprocess_semaphore.hpp>
#include <boost/lockfree/spsc_queue.hpp>
#include <boost/lockfree/stack.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "shm/doorbell.h"
#include "shm/kv_arena.h"
#include "shm/registry.h"
#include "shm/segment.h"
#include "shm/spsc_ring.h"

namespace duet {

namespace {

constexpr uint64_t kRingCap = 4096;        // records: the instance's default (InstanceConfig::ring_capacity)
constexpr uint64_t kRingCapSmall = 1024;   // the earlier default: see bench/RESULTS.md for why it was raised
constexpr uint32_t kMaxBatch = 32;
constexpr uint32_t kArenaBlocks = 32768;   // Boost's array-based stack holds fewer than 65535 nodes
constexpr uint32_t kArenaUsers = 4;
constexpr uint32_t kBlocksPerSample = 64;  // arena: blocks allocated and freed per rdtsc sample
constexpr size_t kMaxSamples = 2'000'000;
constexpr size_t kWarmupSamples = 1000;
constexpr int kMaxWakes = 20000;
constexpr uint64_t kWakeGapNs = 100'000;  // between doorbell pushes: the consumer is asleep again by then
constexpr int64_t kWakeTimeoutNs = 2'000'000'000;
constexpr uint32_t kSegmentLayout = 1;
constexpr uint64_t kSegmentFingerprint = 0x6d68732d68636e62ull;

// The record both rings carry: one cache line, a sequence number the consumer checks.
struct alignas(64) Record64 {
    uint64_t seq;
    uint64_t stamp_ns;  // doorbell: the producer's CLOCK_MONOTONIC before the push
    uint32_t last;      // the producer's final record
    uint32_t pad;
    uint8_t payload[40];
};
static_assert(sizeof(Record64) == 64);

// capacity<N> holds N records, as a duet ring of capacity N.
template <uint64_t N>
using BoostRingN = boost::lockfree::spsc_queue<Record64, boost::lockfree::capacity<N>>;
using BoostRing = BoostRingN<kRingCap>;
using BoostStack = boost::lockfree::stack<int32_t, boost::lockfree::capacity<kArenaBlocks>>;
using BoostSem = boost::interprocess::interprocess_semaphore;

// Shared by the two sides of one measurement, at the start of the payload. Fields
// other than `arrived` and `bell` are written by one side and read by the other
// only after thread join / waitpid, which orders them.
struct Control {
    alignas(64) std::atomic<uint32_t> arrived;
    alignas(64) shm::Doorbell bell;
    alignas(64) std::atomic<uint64_t> t_start_ns;    // ring throughput: the producer's start
    std::atomic<uint64_t> ctx_switches;              // doorbell: the consumer's voluntary switches
    std::atomic<uint64_t> count[2];                  // arena contended: blocks per side
    std::atomic<uint64_t> elapsed_ns[2];
};
static_assert(sizeof(Control) <= 4096 && sizeof(BoostSem) <= 4096);

size_t page_round(size_t n) { return (n + 4095) / 4096 * 4096; }

shm::ArenaConfig arena_config() {
    shm::ArenaConfig c;
    c.n_blocks = kArenaBlocks;
    c.n_users = kArenaUsers;
    return c;
}

// Offsets in the payload.
struct Layout {
    size_t ctl = 0, sem = 0, ring_a = 0, ring_b = 0, samples = 0, arena = 0, total = 0;
};

Layout layout() {
    const size_t ring =
        page_round(std::max(shm::ring_bytes(sizeof(Record64), kRingCap), sizeof(BoostRingN<kRingCap>)));
    const size_t arena = page_round(std::max(shm::KvArena::bytes(arena_config()), sizeof(BoostStack)));
    Layout l;
    l.sem = 4096;
    l.ring_a = 8192;
    l.ring_b = l.ring_a + ring;
    l.samples = l.ring_b + ring;
    l.arena = l.samples + page_round(kMaxWakes * sizeof(uint64_t));
    l.total = l.arena + arena;
    return l;
}

uint64_t now_ns() { return shm::monotonic_ns(); }

// rdtsc: constant and invariant on the machines we run on (constant_tsc, nonstop_tsc);
// converted to ns with a calibration against CLOCK_MONOTONIC over the same run.
uint64_t ticks() {
#if defined(__x86_64__)
    return __rdtsc();
#else
    return now_ns();
#endif
}

void cpu_relax() {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
}

void pin(int cpu) {
    if (cpu < 0) return;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    sched_setaffinity(0, sizeof set, &set);  // 0: the calling thread
}

uint64_t run_ns(const ShmBenchSite& s) { return static_cast<uint64_t>(s.seconds * 1e9); }

// Backs off once in a wait loop; false once the deadline has passed (the peer is
// gone or stuck). On one CPU it yields, so the peer can run.
struct Spin {
    uint64_t deadline_ns;
    bool yield;
    uint32_t n = 0;
    bool operator()() {
        if (yield) sched_yield();
        else cpu_relax();
        return (++n & 1023) != 0 || now_ns() < deadline_ns;
    }
};

Spin spin_for(const ShmBenchSite& s) {
    return Spin{now_ns() + static_cast<uint64_t>((s.seconds * 20 + 5) * 1e9), s.cpu_a == s.cpu_b};
}

// Both sides arrive before either starts its clock.
bool meet(Control& c, Spin& spin) {
    // Pairs with the other side's fetch_add: what each set up before arriving is visible.
    c.arrived.fetch_add(1, std::memory_order_acq_rel);
    // Pairs with the other side's fetch_add.
    while (c.arrived.load(std::memory_order_acquire) < 2)
        if (!spin()) return false;
    return true;
}

Control& control(uint8_t* base) { return *std::launder(reinterpret_cast<Control*>(base + layout().ctl)); }
Control& reset_control(uint8_t* base) { return *new (base + layout().ctl) Control{}; }

// Runs here(base) in this thread on cpu_a and there(base) on cpu_b in a new thread,
// or in a forked child that maps the segment by name (its base is its own mapping).
template <class Here, class There>
Status run_pair(const ShmBenchSite& s, ShmPeer peer, Here&& here, There&& there) {
    if (peer == ShmPeer::Thread) {
        bool there_ok = false;
        std::thread t([&] {
            pin(s.cpu_b);
            there_ok = there(s.base);
        });
        pin(s.cpu_a);
        Status st = here(s.base);
        t.join();
        if (st && !there_ok) return make_error("the peer thread failed");
        return st;
    }
    std::fflush(stdout);
    std::fflush(stderr);
    const pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0) return make_error("fork failed: {}", std::strerror(errno));
    if (pid == 0) {
        // A peer whose parent was killed must not wait for ever (on a semaphore, say).
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent) _exit(1);
        pin(s.cpu_b);
        auto seg = shm::Segment::open(s.segment, kSegmentLayout, kSegmentFingerprint);
        bool ok = seg && there(seg->payload());
        if (!seg) std::fprintf(stderr, "duet: bench peer: %s\n", seg.error().message.c_str());
        _exit(ok ? 0 : 1);  // no destructors, no atexit handlers of the parent's
    }
    pin(s.cpu_a);
    Status st = here(s.base);
    if (!st) kill(pid, SIGKILL);  // it may wait for ever on what we no longer send
    int ws = 0;
    while (waitpid(pid, &ws, 0) < 0 && errno == EINTR) {
    }
    if (st && !(WIFEXITED(ws) && WEXITSTATUS(ws) == 0))
        return make_error("the peer process failed (wait status {:#x})", ws);
    return st;
}

struct Summary {
    double mean = 0, p50 = 0, p99 = 0;
};

// Nearest-rank percentiles of ns values.
Summary summarize(std::vector<double>& v) {
    Summary s;
    if (v.empty()) return s;
    std::sort(v.begin(), v.end());
    double sum = 0;
    for (double x : v) sum += x;
    s.mean = sum / static_cast<double>(v.size());
    auto pct = [&](double p) {
        size_t i = static_cast<size_t>(std::ceil(p * static_cast<double>(v.size())));
        return v[std::min(v.size() - 1, i > 0 ? i - 1 : 0)];
    };
    s.p50 = pct(0.50);
    s.p99 = pct(0.99);
    return s;
}

// Converts rdtsc deltas to ns, dropping the warm-up samples.
ShmLatency latency_from_ticks(const std::vector<uint64_t>& t, double ns_per_tick, double per) {
    size_t skip = t.size() > 4 * kWarmupSamples ? kWarmupSamples : 0;
    std::vector<double> ns;
    ns.reserve(t.size() - skip);
    for (size_t i = skip; i < t.size(); ++i) ns.push_back(static_cast<double>(t[i]) * ns_per_tick / per);
    Summary s = summarize(ns);
    ShmLatency r;
    r.mean_ns = s.mean;
    r.p50_ns = s.p50;
    r.p99_ns = s.p99;
    r.samples = ns.size();
    return r;
}

// ---- rings: one interface over duet's endpoints and Boost's queue ----

template <uint64_t N>
struct DuetRingN {
    static Status format(uint8_t* at) { return shm::ring_init(at, sizeof(Record64), N); }
    struct Tx {
        shm::SpscProducer<Record64> p;
        explicit Tx(uint8_t* at) : p(reinterpret_cast<shm::RingHeader*>(at)) {}
        bool push(const Record64& r) { return p.try_push(r); }
        size_t push(const Record64* r, size_t n) { return p.push(r, n); }
    };
    struct Rx {
        shm::SpscConsumer<Record64> c;
        explicit Rx(uint8_t* at) : c(reinterpret_cast<shm::RingHeader*>(at)) {}
        bool pop(Record64& r) { return c.try_pop(r); }
        size_t pop(Record64* r, size_t n) { return c.pop(r, n); }
    };
};

using DuetRing = DuetRingN<kRingCap>;

template <uint64_t N>
struct BoostSpscN {
    using Q = BoostRingN<N>;
    static Status format(uint8_t* at) {
        new (at) Q();
        return {};
    }
    struct Tx {
        Q* q;
        explicit Tx(uint8_t* at) : q(std::launder(reinterpret_cast<Q*>(at))) {}
        bool push(const Record64& r) { return q->push(r); }
        size_t push(const Record64* r, size_t n) { return q->push(r, n); }
    };
    struct Rx {
        Q* q;
        explicit Rx(uint8_t* at) : q(std::launder(reinterpret_cast<Q*>(at))) {}
        bool pop(Record64& r) { return q->pop(r); }
        size_t pop(Record64* r, size_t n) { return q->pop(r, n); }
    };
};
using BoostSpsc = BoostSpscN<kRingCap>;

// A reference for the cache-line transfer rate between two cores: a ring with no
// index lines at all, each slot carrying its own full/empty flag (its seq + 1, 0
// when empty), so the only lines that move are the records themselves. Not a usable
// ring (no batch publication, no cheap emptiness check across many rings); it shows
// how close an index ring is to what moving the records alone costs here.
template <uint64_t N>
struct FloorRingN {
    static Status format(uint8_t* at) {
        std::memset(at, 0, N * sizeof(Record64));
        return {};
    }
    struct Tx {
        Record64* s;
        uint64_t i = 0;
        explicit Tx(uint8_t* at) : s(reinterpret_cast<Record64*>(at)) {}
        bool push(const Record64& r) {
            Record64& d = s[i & (N - 1)];
            std::atomic_ref<uint64_t> flag(d.seq);
            if (flag.load(std::memory_order_acquire) != 0) return false;  // pairs with the consumer's release
            d.stamp_ns = r.stamp_ns;
            d.last = r.last;
            std::memcpy(d.payload, r.payload, sizeof d.payload);
            flag.store(r.seq + 1, std::memory_order_release);  // pairs with the consumer's acquire
            ++i;
            return true;
        }
        size_t push(const Record64* r, size_t n) {
            size_t k = 0;
            while (k < n && push(r[k])) ++k;
            return k;
        }
    };
    struct Rx {
        Record64* s;
        uint64_t i = 0;
        explicit Rx(uint8_t* at) : s(reinterpret_cast<Record64*>(at)) {}
        bool pop(Record64& out) {
            Record64& d = s[i & (N - 1)];
            std::atomic_ref<uint64_t> flag(d.seq);
            uint64_t v = flag.load(std::memory_order_acquire);  // pairs with the producer's release
            if (v == 0) return false;
            out.stamp_ns = d.stamp_ns;
            out.last = d.last;
            std::memcpy(out.payload, d.payload, sizeof out.payload);
            out.seq = v - 1;
            flag.store(0, std::memory_order_release);  // pairs with the producer's acquire
            ++i;
            return true;
        }
        size_t pop(Record64* r, size_t n) {
            size_t k = 0;
            while (k < n && pop(r[k])) ++k;
            return k;
        }
    };
};

template <class Tx>
bool push_all(Tx& tx, Record64* buf, uint32_t n, Spin& spin) {
    if (n == 1) {
        while (!tx.push(buf[0]))
            if (!spin()) return false;
        return true;
    }
    for (size_t done = 0; done < n;) {
        size_t k = tx.push(buf + done, n - done);
        done += k;
        if (k == 0 && !spin()) return false;
    }
    return true;
}

// Producer: batches of `batch` records for run_ns, then one marked last.
template <class Tx>
bool produce(Tx& tx, uint32_t batch, uint64_t run, Control& ctl, Spin& spin) {
    Record64 buf[kMaxBatch] = {};
    const uint64_t t0 = now_ns();
    ctl.t_start_ns.store(t0, std::memory_order_relaxed);  // read after join / waitpid
    uint64_t seq = 0;
    for (bool last = false; !last; seq += batch) {
        if ((seq & 1023) < batch) last = now_ns() - t0 >= run;  // the clock every ~1024 records
        for (uint32_t i = 0; i < batch; ++i) buf[i].seq = seq + i;
        buf[batch - 1].last = last;
        if (!push_all(tx, buf, batch, spin)) return false;
    }
    return true;
}

// Consumer: checks every sequence number; returns how many records arrived.
template <class Rx>
Result<uint64_t> consume(Rx& rx, uint32_t batch, Spin& spin, uint64_t* t_end) {
    Record64 buf[kMaxBatch];
    uint64_t expect = 0;
    for (;;) {
        size_t k = batch == 1 ? (rx.pop(buf[0]) ? 1 : 0) : rx.pop(buf, batch);
        if (k == 0) {
            if (!spin()) return make_error("ring: no record after record {} before the deadline: the producer stopped", expect);
            continue;
        }
        for (size_t i = 0; i < k; ++i) {
            if (buf[i].seq != expect)
                return make_error("ring: record {} arrived where {} was expected: records were lost or reordered",
                                  buf[i].seq, expect);
            ++expect;
            if (buf[i].last) {
                *t_end = now_ns();
                return expect;
            }
        }
    }
}

template <class Ring>
Result<ShmRate> ring_throughput(const ShmBenchSite& s, ShmPeer peer, uint32_t batch) {
    const Layout l = layout();
    Control& ctl = reset_control(s.base);
    if (Status st = Ring::format(s.base + l.ring_a); !st) return st.error();
    uint64_t count = 0, t_end = 0;
    Status st = run_pair(
        s, peer,
        [&](uint8_t* base) -> Status {
            typename Ring::Rx rx(base + l.ring_a);
            Spin spin = spin_for(s);
            if (!meet(control(base), spin)) return make_error("ring throughput: the producer did not start");
            auto n = consume(rx, batch, spin, &t_end);
            if (!n) return n.error();
            count = *n;
            return {};
        },
        [&](uint8_t* base) -> bool {
            typename Ring::Tx tx(base + l.ring_a);
            Spin spin = spin_for(s);
            return meet(control(base), spin) && produce(tx, batch, run_ns(s), control(base), spin);
        });
    if (!st) return st.error();
    ShmRate r;
    r.count = count;
    r.per_s = static_cast<double>(count) / (static_cast<double>(t_end - ctl.t_start_ns.load(std::memory_order_relaxed)) * 1e-9);
    return r;
}

template <class Ring>
Result<ShmLatency> ring_round_trip(const ShmBenchSite& s, ShmPeer peer) {
    const Layout l = layout();
    reset_control(s.base);
    if (Status st = Ring::format(s.base + l.ring_a); !st) return st.error();
    if (Status st = Ring::format(s.base + l.ring_b); !st) return st.error();
    std::vector<uint64_t> dt;
    dt.reserve(1 << 20);
    double ns_per_tick = 1;
    Status st = run_pair(
        s, peer,
        [&](uint8_t* base) -> Status {
            typename Ring::Tx tx(base + l.ring_a);
            typename Ring::Rx rx(base + l.ring_b);
            Spin spin = spin_for(s);
            if (!meet(control(base), spin)) return make_error("round trip: the peer did not start");
            Record64 out{}, in{};
            const uint64_t ns0 = now_ns(), tk0 = ticks(), stop = ns0 + run_ns(s);
            for (uint64_t i = 0;; ++i) {
                out.seq = i;
                const uint64_t t0 = ticks();
                while (!tx.push(out))
                    if (!spin()) return make_error("round trip: ring A stayed full");
                while (!rx.pop(in))
                    if (!spin()) return make_error("round trip: no answer to record {}", i);
                const uint64_t t1 = ticks();
                if (in.seq != i) return make_error("round trip: sent {}, got {} back", i, in.seq);
                dt.push_back(t1 - t0);
                if (dt.size() >= kMaxSamples || ((i & 255) == 255 && now_ns() >= stop)) break;
            }
            const uint64_t ns1 = now_ns(), tk1 = ticks();
            ns_per_tick = static_cast<double>(ns1 - ns0) / static_cast<double>(tk1 - tk0);
            out.last = 1;
            while (!tx.push(out))
                if (!spin()) return make_error("round trip: ring A stayed full");
            return {};
        },
        [&](uint8_t* base) -> bool {
            typename Ring::Rx rx(base + l.ring_a);
            typename Ring::Tx tx(base + l.ring_b);
            Spin spin = spin_for(s);
            if (!meet(control(base), spin)) return false;
            Record64 r;
            for (;;) {
                while (!rx.pop(r))
                    if (!spin()) return false;
                if (r.last) return true;
                while (!tx.push(r))
                    if (!spin()) return false;
            }
        });
    if (!st) return st.error();
    return latency_from_ticks(dt, ns_per_tick, 1);
}

// ---- doorbell ----

void busy_wait_ns(uint64_t ns) {
    const uint64_t t = now_ns();
    while (now_ns() - t < ns) cpu_relax();
}

uint64_t voluntary_switches() {
    rusage ru{};
    getrusage(RUSAGE_THREAD, &ru);
    return static_cast<uint64_t>(ru.ru_nvcsw);
}

ShmLatency wake_summary(const uint64_t* lat, const std::vector<uint8_t>& counted) {
    std::vector<double> ns;
    for (size_t i = 0; i < counted.size(); ++i)
        if (counted[i]) ns.push_back(static_cast<double>(lat[i]));
    Summary s = summarize(ns);
    ShmLatency r;
    r.mean_ns = s.mean;
    r.p50_ns = s.p50;
    r.p99_ns = s.p99;
    r.samples = ns.size();
    return r;
}

Result<ShmLatency> doorbell_duet(const ShmBenchSite& s, int wakes) {
    const Layout l = layout();
    Control& ctl = reset_control(s.base);
    if (Status st = DuetRing::format(s.base + l.ring_a); !st) return st.error();
    std::memset(s.base + l.samples, 0, kMaxWakes * sizeof(uint64_t));
    std::vector<uint8_t> woke(static_cast<size_t>(wakes));
    Status st = run_pair(
        s, ShmPeer::Process,
        [&](uint8_t* base) -> Status {
            DuetRing::Tx tx(base + l.ring_a);
            Control& c = control(base);
            Spin spin = spin_for(s);
            if (!meet(c, spin)) return make_error("doorbell: the consumer did not start");
            Record64 r{};
            for (int i = 0; i < wakes; ++i) {
                busy_wait_ns(kWakeGapNs);
                r.seq = static_cast<uint64_t>(i);
                r.last = i + 1 == wakes;
                r.stamp_ns = now_ns();
                if (!push_all(tx, &r, 1, spin)) return make_error("doorbell: the ring stayed full");
                woke[static_cast<size_t>(i)] = shm::doorbell_ring(c.bell);
            }
            return {};
        },
        [&](uint8_t* base) -> bool {
            DuetRing::Rx rx(base + l.ring_a);
            Control& c = control(base);
            auto* lat = reinterpret_cast<uint64_t*>(base + l.samples);
            const uint64_t sw0 = voluntary_switches();
            Spin spin = spin_for(s);
            if (!meet(c, spin)) return false;
            auto ready = [&] { return rx.c.readable(); };
            for (uint64_t expect = 0;; ++expect) {
                // No spinning: the consumer goes to sleep as soon as the ring is empty.
                if (!shm::doorbell_wait(c.bell, ready, 0, kWakeTimeoutNs)) return false;
                const uint64_t t = now_ns();
                Record64 r;
                if (!rx.pop(r) || r.seq != expect) return false;
                lat[expect] = t - r.stamp_ns;
                if (r.last) break;
            }
            c.ctx_switches.store(voluntary_switches() - sw0, std::memory_order_relaxed);
            return true;
        });
    if (!st) return st.error();
    ShmLatency r = wake_summary(reinterpret_cast<const uint64_t*>(s.base + l.samples), woke);
    r.slept = r.samples;
    r.ctx_switches = ctl.ctx_switches.load(std::memory_order_relaxed);
    return r;
}

// Boost's way to block a consumer across processes: an interprocess_semaphore (a
// process-shared POSIX semaphore) posted once per record.
Result<ShmLatency> doorbell_boost(const ShmBenchSite& s, int wakes) {
    const Layout l = layout();
    Control& ctl = reset_control(s.base);
    if (Status st = BoostSpsc::format(s.base + l.ring_a); !st) return st.error();
    auto* sem = new (s.base + l.sem) BoostSem(0);
    std::memset(s.base + l.samples, 0, kMaxWakes * sizeof(uint64_t));
    Status st = run_pair(
        s, ShmPeer::Process,
        [&](uint8_t* base) -> Status {
            BoostSpsc::Tx tx(base + l.ring_a);
            auto* sm = std::launder(reinterpret_cast<BoostSem*>(base + l.sem));
            Spin spin = spin_for(s);
            if (!meet(control(base), spin)) return make_error("doorbell: the consumer did not start");
            Record64 r{};
            for (int i = 0; i < wakes; ++i) {
                busy_wait_ns(kWakeGapNs);
                r.seq = static_cast<uint64_t>(i);
                r.last = i + 1 == wakes;
                r.stamp_ns = now_ns();
                if (!push_all(tx, &r, 1, spin)) return make_error("doorbell: the ring stayed full");
                sm->post();
            }
            return {};
        },
        [&](uint8_t* base) -> bool {
            BoostSpsc::Rx rx(base + l.ring_a);
            auto* sm = std::launder(reinterpret_cast<BoostSem*>(base + l.sem));
            Control& c = control(base);
            auto* lat = reinterpret_cast<uint64_t*>(base + l.samples);
            const uint64_t sw0 = voluntary_switches();
            Spin spin = spin_for(s);
            if (!meet(c, spin)) return false;
            for (uint64_t expect = 0;; ++expect) {
                sm->wait();
                const uint64_t t = now_ns();
                Record64 r;
                if (!rx.pop(r) || r.seq != expect) return false;
                lat[expect] = t - r.stamp_ns;
                if (r.last) break;
            }
            c.ctx_switches.store(voluntary_switches() - sw0, std::memory_order_relaxed);
            return true;
        });
    sem->~BoostSem();
    if (!st) return st.error();
    ShmLatency r = wake_summary(reinterpret_cast<const uint64_t*>(s.base + l.samples),
                                std::vector<uint8_t>(static_cast<size_t>(wakes), 1));
    r.ctx_switches = ctl.ctx_switches.load(std::memory_order_relaxed);
    return r;
}

// ---- arena ----

// alloc(batch) + free of those blocks, as duet's KvArena or Boost's stack of free ids.
class ArenaOps {
public:
    // Formats the pool at `at` (before any peer starts).
    static Status format(ShmImpl impl, uint8_t* at) {
        if (impl == ShmImpl::Duet) return shm::KvArena::init(at, arena_config());
        auto* st = new (at) BoostStack();
        for (uint32_t b = 0; b < kArenaBlocks; ++b)
            if (!st->bounded_push(static_cast<int32_t>(b))) return make_error("Boost stack: push {} failed", b);
        return {};
    }

    // Attaches to the pool at `at` as user `who`.
    static Result<ArenaOps> attach(ShmImpl impl, uint8_t* at, uint32_t who) {
        ArenaOps o;
        o.impl_ = impl;
        if (impl == ShmImpl::Boost) {
            o.stack_ = std::launder(reinterpret_cast<BoostStack*>(at));
            return o;
        }
        auto a = shm::KvArena::attach(at);
        if (!a) return a.error();
        o.arena_ = std::move(*a);
        auto u = o.arena_.join(shm::ProcRef{who, 1});
        if (!u) return u.error();
        o.user_ = *u;
        return o;
    }

    bool pair(uint32_t n) {
        if (impl_ == ShmImpl::Duet) {
            if (!arena_.alloc(user_, n, ids_)) return false;
            arena_.unref(user_, ids_, n);
        } else {
            // One at a time both ways: Boost 1.74's range push does not compile for a
            // stack with a compile-time capacity (node handles are 16-bit indices there).
            for (uint32_t i = 0; i < n; ++i)
                if (!stack_->pop(ids_[i])) return false;
            for (uint32_t i = 0; i < n; ++i)
                if (!stack_->bounded_push(ids_[i])) return false;
        }
        sink_ ^= ids_[0];
        return true;
    }

    // After all users are done: every block is free again.
    Status check_all_free() {
        if (impl_ == ShmImpl::Duet) {
            shm::ArenaCensus c = arena_.census();
            if (c.free != c.total || arena_.n_free() != c.total)
                return make_error("arena: {} of {} blocks free after the run ({} in the free index)", c.free, c.total,
                                  arena_.n_free());
            return {};
        }
        uint32_t n = 0;
        int32_t b;
        while (stack_->pop(b)) ++n;
        if (n != kArenaBlocks) return make_error("Boost stack: {} of {} ids back after the run", n, kArenaBlocks);
        return {};
    }

    int32_t sink() const { return sink_; }

private:
    ShmImpl impl_ = ShmImpl::Duet;
    shm::KvArena arena_;
    uint32_t user_ = 0;
    BoostStack* stack_ = nullptr;
    int32_t ids_[kMaxBatch] = {};
    int32_t sink_ = 0;
};

}  // namespace

size_t shm_bench_bytes() { return layout().total; }

Result<ShmRate> bench_ring_throughput(const ShmBenchSite& s, ShmImpl impl, ShmPeer peer, uint32_t batch,
                                      uint64_t capacity) {
    if (batch < 1 || batch > kMaxBatch) return make_error("ring batch must be 1..{}, got {}", kMaxBatch, batch);
    const bool duet = impl == ShmImpl::Duet;
    if (capacity == kRingCap)
        return duet ? ring_throughput<DuetRing>(s, peer, batch) : ring_throughput<BoostSpsc>(s, peer, batch);
    if (capacity == kRingCapSmall)
        return duet ? ring_throughput<DuetRingN<kRingCapSmall>>(s, peer, batch)
                    : ring_throughput<BoostSpscN<kRingCapSmall>>(s, peer, batch);
    return make_error("ring capacity must be {} or {}, got {}", kRingCap, kRingCapSmall, capacity);
}

Result<ShmLatency> bench_ring_round_trip(const ShmBenchSite& s, ShmImpl impl, ShmPeer peer) {
    return impl == ShmImpl::Duet ? ring_round_trip<DuetRing>(s, peer) : ring_round_trip<BoostSpsc>(s, peer);
}

Result<ShmLatency> bench_doorbell_wake(const ShmBenchSite& s, ShmImpl impl, int wakes) {
    if (wakes < 1 || wakes > kMaxWakes) return make_error("doorbell wakes must be 1..{}, got {}", kMaxWakes, wakes);
    return impl == ShmImpl::Duet ? doorbell_duet(s, wakes) : doorbell_boost(s, wakes);
}

Result<ShmLatency> bench_arena_single(const ShmBenchSite& s, ShmImpl impl, uint32_t batch) {
    if (batch < 1 || batch > kMaxBatch || kBlocksPerSample % batch != 0)
        return make_error("arena batch must divide {} and be at most {}, got {}", kBlocksPerSample, kMaxBatch, batch);
    const Layout l = layout();
    if (Status st = ArenaOps::format(impl, s.base + l.arena); !st) return st.error();
    auto ops = ArenaOps::attach(impl, s.base + l.arena, 0);
    if (!ops) return ops.error();
    pin(s.cpu_a);
    const uint32_t per_sample = kBlocksPerSample / batch;
    for (int i = 0; i < 10000; ++i)
        if (!ops->pair(batch)) return make_error("arena: alloc failed with every block free");
    std::vector<uint64_t> dt;
    dt.reserve(1 << 18);
    const uint64_t ns0 = now_ns(), tk0 = ticks(), stop = ns0 + run_ns(s);
    do {
        for (int j = 0; j < 256; ++j) {
            const uint64_t t0 = ticks();
            for (uint32_t k = 0; k < per_sample; ++k)
                if (!ops->pair(batch)) return make_error("arena: alloc failed with every block free");
            dt.push_back(ticks() - t0);
        }
    } while (now_ns() < stop && dt.size() < kMaxSamples);
    const uint64_t ns1 = now_ns(), tk1 = ticks();
    if (Status st = ops->check_all_free(); !st) return st.error();
    if (ops->sink() == -1) std::fputc(' ', stderr);  // keeps the ids observable
    return latency_from_ticks(dt, static_cast<double>(ns1 - ns0) / static_cast<double>(tk1 - tk0), kBlocksPerSample);
}

Result<ShmRate> bench_arena_contended(const ShmBenchSite& s, ShmImpl impl, uint32_t batch) {
    if (batch < 1 || batch > kMaxBatch) return make_error("arena batch must be 1..{}, got {}", kMaxBatch, batch);
    const Layout l = layout();
    Control& ctl = reset_control(s.base);
    if (Status st = ArenaOps::format(impl, s.base + l.arena); !st) return st.error();
    // Each side: its own user, alloc+free for the same window after both arrived.
    auto side = [&](uint8_t* base, uint32_t who) -> Status {
        auto ops = ArenaOps::attach(impl, base + l.arena, who);
        if (!ops) return ops.error();
        Control& c = control(base);
        Spin spin = spin_for(s);
        if (!meet(c, spin)) return make_error("arena: the other process did not start");
        const uint64_t t0 = now_ns(), stop = t0 + run_ns(s);
        uint64_t n = 0, t = t0;
        do {
            for (int j = 0; j < 64; ++j)
                if (!ops->pair(batch)) return make_error("arena: alloc of {} failed with at most {} held", batch, 2 * batch);
            n += 64ull * batch;
        } while ((t = now_ns()) < stop);
        c.count[who].store(n, std::memory_order_relaxed);  // read after waitpid
        c.elapsed_ns[who].store(t - t0, std::memory_order_relaxed);
        if (ops->sink() == -1) std::fputc(' ', stderr);
        return {};
    };
    Status st = run_pair(
        s, ShmPeer::Process, [&](uint8_t* base) { return side(base, 0); },
        [&](uint8_t* base) {
            Status r = side(base, 1);
            if (!r) std::fprintf(stderr, "duet: bench peer: %s\n", r.error().message.c_str());
            return r.ok();
        });
    if (!st) return st.error();
    auto ops = ArenaOps::attach(impl, s.base + l.arena, 2);
    if (!ops) return ops.error();
    if (Status c = ops->check_all_free(); !c) return c.error();
    ShmRate r;
    for (int i = 0; i < 2; ++i) {
        const double n = static_cast<double>(ctl.count[i].load(std::memory_order_relaxed));
        const double dt = static_cast<double>(ctl.elapsed_ns[i].load(std::memory_order_relaxed));
        r.count += static_cast<uint64_t>(n);
        r.per_s += n / (dt * 1e-9);
        r.ns_per += dt / n / 2;
    }
    return r;
}

// ---- the command ----

namespace {

enum class Goal { None, RatioAtLeast, RatioAtMost, DuetBelow };

struct Figure {
    std::string key;    // JSON key
    std::string label;  // table row
    std::string unit;   // "/s" or "ns"
    double duet = 0, boost = 0;
    Goal goal = Goal::None;
    double goal_value = 0;

    double ratio() const { return boost > 0 ? duet / boost : 0; }
    bool has_goal() const { return goal != Goal::None; }
    bool pass() const {
        switch (goal) {
        case Goal::RatioAtLeast: return ratio() >= goal_value;
        case Goal::RatioAtMost: return ratio() <= goal_value;
        case Goal::DuetBelow: return duet < goal_value;
        case Goal::None: break;
        }
        return true;
    }
    std::string target() const {
        switch (goal) {
        case Goal::RatioAtLeast: return fmt::format(">= {:.1f}x Boost", goal_value);
        case Goal::RatioAtMost: return fmt::format("<= {:.1f}x Boost", goal_value);
        case Goal::DuetBelow: return fmt::format("< {:.0f} ns", goal_value);
        case Goal::None: break;
        }
        return "";
    }
};

double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0 : v[v.size() / 2];
}

struct Extra {
    double floor_proc_one = 0, floor_proc_batch32 = 0;  // records/s of FloorRingN (the line reference)
    uint64_t doorbell_wakes = 0, doorbell_futex_wakes = 0, doorbell_duet_sleeps = 0, doorbell_boost_sleeps = 0;
    uint64_t rtt_samples_thread = 0, rtt_samples_proc = 0;
};

void add_figure(std::vector<Figure>& figs, std::string key, std::string label, std::string unit, double d, double b,
                Goal g = Goal::None, double gv = 0) {
    figs.push_back(Figure{std::move(key), std::move(label), std::move(unit), d, b, g, gv});
}

// Ring throughput: reps runs of each, duet and Boost alternating, median kept.
Status ring_figures(const ShmBenchSite& s, const ShmBenchOptions& o, std::vector<Figure>& figs) {
    struct RingRow {
        ShmPeer peer;
        uint32_t batch;
        uint64_t cap;
    };
    for (RingRow row : {RingRow{ShmPeer::Thread, 1, kRingCap}, RingRow{ShmPeer::Thread, 32, kRingCap},
                        RingRow{ShmPeer::Process, 1, kRingCap}, RingRow{ShmPeer::Process, 32, kRingCap},
                        RingRow{ShmPeer::Process, 1, kRingCapSmall}, RingRow{ShmPeer::Process, 32, kRingCapSmall}}) {
        std::vector<double> d, b;
        for (int r = 0; r < o.reps; ++r) {
            auto rd = bench_ring_throughput(s, ShmImpl::Duet, row.peer, row.batch, row.cap);
            if (!rd) return rd.error();
            auto rb = bench_ring_throughput(s, ShmImpl::Boost, row.peer, row.batch, row.cap);
            if (!rb) return rb.error();
            d.push_back(rd->per_s);
            b.push_back(rb->per_s);
        }
        const bool proc = row.peer == ShmPeer::Process;
        std::string key = fmt::format("ring_{}{}{}_msgs_per_s", proc ? "proc" : "thread",
                                      row.cap != kRingCap ? fmt::format("_cap{}", row.cap) : "",
                                      row.batch > 1 ? "_batch32" : "");
        std::string label = fmt::format("ring {}, {}{}", proc ? "2 processes" : "2 threads",
                                        row.batch > 1 ? "push/pop 32 at a time" : "push/pop one",
                                        row.cap != kRingCap ? fmt::format(", cap {}", row.cap) : "");
        // The target is for the instance's rings (capacity kRingCap) across processes.
        add_figure(figs, key, label, "/s", median(d), median(b),
            proc && row.cap == kRingCap ? Goal::RatioAtLeast : Goal::None, 1.5);
    }
    return {};
}

// The line-transfer reference across processes, for the same record and capacity.
Status floor_figures(const ShmBenchSite& s, const ShmBenchOptions& o, Extra& x) {
    for (uint32_t batch : {1u, 32u}) {
        std::vector<double> f;
        for (int r = 0; r < o.reps; ++r) {
            auto rf = ring_throughput<FloorRingN<kRingCap>>(s, ShmPeer::Process, batch);
            if (!rf) return rf.error();
            f.push_back(rf->per_s);
        }
        (batch == 1 ? x.floor_proc_one : x.floor_proc_batch32) = median(f);
    }
    return {};
}

Status round_trip_figures(const ShmBenchSite& s, std::vector<Figure>& figs, Extra& x) {
    for (ShmPeer peer : {ShmPeer::Thread, ShmPeer::Process}) {
        const bool proc = peer == ShmPeer::Process;
        auto d = bench_ring_round_trip(s, ShmImpl::Duet, peer);
        if (!d) return d.error();
        auto b = bench_ring_round_trip(s, ShmImpl::Boost, peer);
        if (!b) return b.error();
        const char* k = proc ? "proc" : "thread";
        const char* w = proc ? "2 processes" : "2 threads";
        add_figure(figs, fmt::format("ring_{}_rtt_p50_ns", k), fmt::format("round trip {}, p50", w), "ns", d->p50_ns,
            b->p50_ns, proc ? Goal::RatioAtMost : Goal::None, 1.0);
        add_figure(figs, fmt::format("ring_{}_rtt_p99_ns", k), fmt::format("round trip {}, p99", w), "ns", d->p99_ns,
            b->p99_ns);
        add_figure(figs, fmt::format("ring_{}_rtt_mean_ns", k), fmt::format("round trip {}, mean", w), "ns", d->mean_ns,
            b->mean_ns);
        (proc ? x.rtt_samples_proc : x.rtt_samples_thread) = d->samples;
    }
    return {};
}

Status doorbell_figures(const ShmBenchSite& s, const ShmBenchOptions& o, std::vector<Figure>& figs, Extra& x) {
    auto d = bench_doorbell_wake(s, ShmImpl::Duet, o.wakes);
    if (!d) return d.error();
    auto b = bench_doorbell_wake(s, ShmImpl::Boost, o.wakes);
    if (!b) return b.error();
    add_figure(figs, "doorbell_wake_p50_ns", "wake a sleeping consumer process, p50", "ns", d->p50_ns, b->p50_ns);
    add_figure(figs, "doorbell_wake_p99_ns", "wake a sleeping consumer process, p99", "ns", d->p99_ns, b->p99_ns);
    x.doorbell_wakes = static_cast<uint64_t>(o.wakes);
    x.doorbell_futex_wakes = d->slept;
    x.doorbell_duet_sleeps = d->ctx_switches;
    x.doorbell_boost_sleeps = b->ctx_switches;
    return {};
}

// The arena in one thread, then in two processes.
Status arena_figures(const ShmBenchSite& s, std::vector<Figure>& figs) {
    for (uint32_t batch : {1u, 16u}) {
        auto d = bench_arena_single(s, ShmImpl::Duet, batch);
        if (!d) return d.error();
        auto b = bench_arena_single(s, ShmImpl::Boost, batch);
        if (!b) return b.error();
        if (batch == 1) {
            add_figure(figs, "arena_pair_p50_ns", "arena alloc+free, 1 thread, p50", "ns", d->p50_ns, b->p50_ns,
                Goal::DuetBelow, 50);
            add_figure(figs, "arena_pair_p99_ns", "arena alloc+free, 1 thread, p99", "ns", d->p99_ns, b->p99_ns);
        } else {
            add_figure(figs, "arena_batch16_p50_ns_per_block", "arena alloc(16)+free, 1 thread, p50 per block", "ns",
                d->p50_ns, b->p50_ns);
        }
    }
    for (uint32_t batch : {1u, 16u}) {
        auto d = bench_arena_contended(s, ShmImpl::Duet, batch);
        if (!d) return d.error();
        auto b = bench_arena_contended(s, ShmImpl::Boost, batch);
        if (!b) return b.error();
        if (batch == 1) {
            add_figure(figs, "arena_proc_pairs_per_s", "arena alloc+free, 2 processes, total", "/s", d->per_s, b->per_s);
            add_figure(figs, "arena_proc_pair_ns", "arena alloc+free, 2 processes, per pair", "ns", d->ns_per, b->ns_per);
        } else {
            add_figure(figs, "arena_proc_batch16_blocks_per_s", "arena alloc(16)+free, 2 processes, blocks", "/s", d->per_s,
                b->per_s);
        }
    }
    return {};
}

Status run_all(const ShmBenchSite& s, const ShmBenchOptions& o, std::vector<Figure>& figs, Extra& x) {
    if (Status st = ring_figures(s, o, figs); !st) return st;
    if (Status st = floor_figures(s, o, x); !st) return st;
    if (Status st = round_trip_figures(s, figs, x); !st) return st;
    if (Status st = doorbell_figures(s, o, figs, x); !st) return st;
    return arena_figures(s, figs);
}

std::string value_str(const Figure& f, double v) {
    if (f.unit == "/s") return fmt::format("{:.2f} M/s", v / 1e6);
    return fmt::format("{:.1f} ns", v);
}

// Segments of earlier runs that were killed before they could unlink theirs.
void remove_stale_bench_segments() {
    DIR* d = opendir("/dev/shm");
    if (!d) return;
    std::vector<std::string> stale;
    while (dirent* e = readdir(d)) {
        std::string n = e->d_name;
        if (n.rfind("duet-bench-", 0) == 0 && !shm::Segment::in_use(n)) stale.push_back(n);
    }
    closedir(d);
    for (const std::string& n : stale) (void)shm::Segment::unlink(n);
}

std::string cpu_model() {
    FILE* f = std::fopen("/proc/cpuinfo", "r");
    if (!f) return "";
    char line[512];
    std::string m;
    while (std::fgets(line, sizeof line, f))
        if (std::strncmp(line, "model name", 10) == 0) {
            const char* c = std::strchr(line, ':');
            m = c ? c + 2 : line;
            if (!m.empty() && m.back() == '\n') m.pop_back();
            break;
        }
    std::fclose(f);
    return m;
}

// Where the run happened, for the report.
struct Setup {
    size_t cpus = 0;  // CPUs in this process's affinity mask
    std::string segment_path;
    const char* pages = "";  // the segment's page mode
};

nlohmann::ordered_json shm_json(const ShmBenchSite& s, const ShmBenchOptions& o, const Setup& setup,
                                const std::vector<Figure>& figs, const Extra& x) {
    nlohmann::ordered_json j;
    j["setup"] = {
        {"cpu_model", cpu_model()},
        {"cpus", setup.cpus},
        {"cpu_measuring", s.cpu_a},
        {"cpu_peer", s.cpu_b},
        {"one_cpu", s.cpu_a == s.cpu_b},
        {"segment", setup.segment_path},
        {"pages", setup.pages},
        {"seconds_per_run", o.seconds},
        {"reps", o.reps},
        {"ring_capacity", kRingCap},
        {"record_bytes", sizeof(Record64)},
        {"arena_blocks", kArenaBlocks},
        {"ratio", "duet / boost"},
    };
    for (const Figure& f : figs) {
        nlohmann::ordered_json e = {{"duet", f.duet}, {"boost", f.boost}, {"ratio", f.ratio()},
                                    {"unit", f.unit == "/s" ? "per_s" : "ns"}};
        e["target"] = f.has_goal() ? nlohmann::ordered_json(f.target()) : nlohmann::ordered_json(nullptr);
        e["pass"] = f.has_goal() ? nlohmann::ordered_json(f.pass()) : nlohmann::ordered_json(nullptr);
        j[f.key] = e;
    }
    auto fig = [&](const char* key) {
        for (const Figure& f : figs)
            if (f.key == key) return f;
        return Figure{};
    };
    const Figure one = fig("ring_proc_msgs_per_s"), b32 = fig("ring_proc_batch32_msgs_per_s");
    j["ring_line_reference"] = {{"proc_one_msgs_per_s", x.floor_proc_one},
                       {"proc_batch32_msgs_per_s", x.floor_proc_batch32},
                       {"duet_one_of_reference", one.duet / x.floor_proc_one},
                       {"boost_one_of_reference", one.boost / x.floor_proc_one},
                       {"duet_batch32_of_reference", b32.duet / x.floor_proc_batch32},
                       {"boost_batch32_of_reference", b32.boost / x.floor_proc_batch32}};
    j["doorbell_check"] = {{"wakes", x.doorbell_wakes},
                           {"duet_futex_wakes", x.doorbell_futex_wakes},
                           {"duet_consumer_sleeps", x.doorbell_duet_sleeps},
                           {"boost_consumer_sleeps", x.doorbell_boost_sleeps}};
    return j;
}

// The table: a row per figure, the line reference under the two process rings.
void print_shm_table(const ShmBenchSite& s, const ShmBenchOptions& o, const Setup& setup,
                     const std::vector<Figure>& figs, const Extra& x) {
    fmt::print("duet bench shm | {} | {} CPUs | measuring side on CPU {}, peer on CPU {} | {} | {:.2f} s per run\n",
               cpu_model(), setup.cpus, s.cpu_a, s.cpu_b, setup.pages, o.seconds);
    if (s.cpu_a == s.cpu_b)
        fmt::print("only one CPU is available: both sides share it and waits yield; cross-core figures do not apply\n");
    fmt::print("\n{:<52} {:>12} {:>12} {:>10} {:>16} {:>6}\n", "figure", "duet", "Boost", "duet/Boost", "target",
               "result");
    for (const Figure& f : figs)
        fmt::print("{:<52} {:>12} {:>12} {:>10.2f} {:>16} {:>6}\n", f.label, value_str(f, f.duet),
                   value_str(f, f.boost), f.ratio(), f.target(), f.has_goal() ? (f.pass() ? "pass" : "MISS") : "");
    for (const Figure& f : figs) {
        if (f.key == "ring_proc_msgs_per_s" || f.key == "ring_proc_batch32_msgs_per_s") {
            const double fl = f.key == "ring_proc_msgs_per_s" ? x.floor_proc_one : x.floor_proc_batch32;
            fmt::print("{:<52} {:>12} {:>12} {:>10}   duet {:.0f}%, Boost {:.0f}% of it\n",
                       fmt::format("  line reference (flag ring), {}", f.key == "ring_proc_msgs_per_s" ? "one" : "32"),
                       value_str(f, fl), "", "", 100 * f.duet / fl, 100 * f.boost / fl);
        }
    }
}

// What each figure measures, with this run's sample counts.
void print_shm_notes(const ShmBenchOptions& o, const Setup& setup, const Extra& x) {
    fmt::print(
        "\nratio: duet / Boost (higher is better for /s, lower for ns).\n"
        "line reference: the same records between the same two processes through slots that carry their own "
        "full/empty flag, so only record lines move (no index lines): about what moving the records alone costs here.\n"
        "ring: 64-byte records, capacity {} unless stated (Boost: spsc_queue capacity<{}>), in {}; throughput is the median of {} "
        "runs, duet and Boost alternating; the consumer checks every sequence number.\n"
        "round trip: one record in flight over two rings, rdtsc per round trip (calibrated against CLOCK_MONOTONIC), "
        "{} (threads) and {} (processes) samples after {} warm-up.\n"
        "doorbell: a record every {} us to a consumer process with no spinning; latency from the producer's "
        "CLOCK_MONOTONIC stamp before the push to the consumer running again. duet: {} of {} wakes took the "
        "FUTEX_WAKE path, consumer slept {} times; Boost (interprocess_semaphore): consumer slept {} times.\n"
        "arena: duet KvArena of {} blocks, {} users; Boost: lockfree::stack<int32_t, capacity<{}>> of free block ids "
        "(no reference counts or ownership). One thread: rdtsc per {} blocks allocated and freed, percentiles over "
        "those samples. Two processes: each its own user, for the same window.\n",
        kRingCap, kRingCap, setup.segment_path, o.reps, x.rtt_samples_thread, x.rtt_samples_proc, kWarmupSamples,
        kWakeGapNs / 1000, x.doorbell_futex_wakes, x.doorbell_wakes, x.doorbell_duet_sleeps, x.doorbell_boost_sleeps,
        kArenaBlocks, kArenaUsers, kArenaBlocks, kBlocksPerSample);
}

}  // namespace

int cmd_bench_shm(const ShmBenchOptions& o) {
    if (o.seconds <= 0 || o.reps < 1 || o.wakes < 1 || o.wakes > kMaxWakes) {
        std::fprintf(stderr, "duet: bench shm: --seconds must be > 0, --reps >= 1, --wakes 1..%d\n", kMaxWakes);
        return 2;
    }
    cpu_set_t orig;
    CPU_ZERO(&orig);
    if (sched_getaffinity(0, sizeof orig, &orig) != 0) {
        std::fprintf(stderr, "duet: bench shm: sched_getaffinity: %s\n", std::strerror(errno));
        return 1;
    }
    std::vector<int> cpus;
    for (int c = 0; c < CPU_SETSIZE; ++c)
        if (CPU_ISSET(c, &orig)) cpus.push_back(c);
    ShmBenchSite s;
    s.cpu_a = cpus.empty() ? -1 : cpus[0];
    s.cpu_b = cpus.size() > 1 ? cpus[1] : s.cpu_a;
    s.seconds = o.seconds;
    s.segment = fmt::format("duet-bench-{}", getpid());
    remove_stale_bench_segments();

    shm::SegmentOptions so;
    so.payload_bytes = shm_bench_bytes();
    so.layout_version = kSegmentLayout;
    so.config_fingerprint = kSegmentFingerprint;
    auto seg = shm::Segment::create(s.segment, so);
    if (!seg) {
        std::fprintf(stderr, "duet: bench shm: %s\n", seg.error().message.c_str());
        return 1;
    }
    s.base = seg->payload();
    s.bytes = seg->payload_bytes();

    std::vector<Figure> figs;
    Extra x;
    Status st = run_all(s, o, figs, x);
    const Setup setup{cpus.size(), seg->path(), shm::page_mode_name(seg->page_mode())};
    (void)shm::Segment::unlink(s.segment);
    sched_setaffinity(0, sizeof orig, &orig);
    if (!st) {
        std::fprintf(stderr, "duet: bench shm: %s\n", st.error().message.c_str());
        return 1;
    }
    if (o.json) {
        std::printf("%s\n", shm_json(s, o, setup, figs, x).dump().c_str());
        return 0;
    }
    print_shm_table(s, o, setup, figs, x);
    print_shm_notes(o, setup, x);
    return 0;
}

}  // namespace duet
