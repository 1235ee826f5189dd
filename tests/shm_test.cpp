// Unit tests of the shared-memory substrate, one structure at a time, in one process
// (the multi-thread, multi-process and kill tests are in shm_stress_test.cpp and
// shm_kill_test.cpp).
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <set>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "shm/doorbell.h"
#include "shm/instance.h"
#include "shm/kv_arena.h"
#include "shm/registry.h"
#include "shm/request_table.h"
#include "shm/segment.h"
#include "shm/spsc_ring.h"

#include "shm_test_util.h"
#include "time_scale.h"

using namespace duet::shm;

namespace {

std::string unique_name(const char* what) {
    static std::atomic<int> n{0};
    return std::string("duet-test-") + what + "-" + std::to_string(getpid()) + "-" + std::to_string(n++);
}

struct Unlinker {
    std::string name;
    ~Unlinker() { (void)Segment::unlink(name); }
};

// Aligned process-local memory for structures tested without a segment.
using duet::shm::testing::Mem;

SegmentOptions opts(size_t bytes, uint64_t fp = 42) {
    SegmentOptions o;
    o.payload_bytes = bytes;
    o.layout_version = 7;
    o.config_fingerprint = fp;
    return o;
}

}  // namespace

// ---------------------------------------------------------------- segment

TEST(Segment, CreateOpenShareMemoryWithMode0600) {
    std::string name = unique_name("seg");
    Unlinker u{name};
    auto a = Segment::create(name, opts(10000));
    ASSERT_TRUE(a.ok()) << a.error().message;
    EXPECT_EQ(a->path(), "/dev/shm/" + name);
    EXPECT_GE(a->payload_bytes(), 10000u);
    EXPECT_EQ(a->header().creator_pid, getpid());
    struct stat st {};
    ASSERT_EQ(stat(a->path().c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600u);

    auto b = Segment::open(name, 7, 42);
    ASSERT_TRUE(b.ok()) << b.error().message;
    std::strcpy(reinterpret_cast<char*>(a->payload()), "hello");
    EXPECT_STREQ(reinterpret_cast<const char*>(b->payload()), "hello");
    EXPECT_TRUE(Segment::in_use(name));
}

TEST(Segment, RefusesOtherLayoutVersionOrFingerprintNamingBoth) {
    std::string name = unique_name("seg");
    Unlinker u{name};
    auto a = Segment::create(name, opts(100, 0x1234));
    ASSERT_TRUE(a.ok());
    auto v = Segment::open(name, 8, 0x1234);
    ASSERT_FALSE(v.ok());
    EXPECT_NE(v.error().message.find("layout version 7"), std::string::npos) << v.error().message;
    EXPECT_NE(v.error().message.find("expects 8"), std::string::npos) << v.error().message;
    auto f = Segment::open(name, 7, 0x9999);
    ASSERT_FALSE(f.ok());
    EXPECT_NE(f.error().message.find("0x0000000000001234"), std::string::npos) << f.error().message;
    EXPECT_NE(f.error().message.find("0x0000000000009999"), std::string::npos) << f.error().message;
}

TEST(Segment, RefusesToReplaceALiveSegment) {
    std::string name = unique_name("seg");
    Unlinker u{name};
    auto a = Segment::create(name, opts(100));
    ASSERT_TRUE(a.ok());
    auto b = Segment::create(name, opts(100));
    ASSERT_FALSE(b.ok());
    EXPECT_NE(b.error().message.find("in use by a live instance"), std::string::npos) << b.error().message;
    EXPECT_NE(b.error().message.find(std::to_string(getpid())), std::string::npos) << b.error().message;
}

TEST(Segment, StaleSegmentOfADeadProcessIsReplacedNotReused) {
    std::string name = unique_name("seg");
    Unlinker u{name};
    pid_t child = fork();
    if (child == 0) {
        auto s = Segment::create(name, opts(100));
        if (!s.ok()) _exit(1);
        std::strcpy(reinterpret_cast<char*>(s->payload()), "old");
        _exit(0);  // dies attached: the segment stays, with no live user
    }
    int status = 0;
    waitpid(child, &status, 0);
    ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    struct stat st {};
    ASSERT_EQ(stat(("/dev/shm/" + name).c_str(), &st), 0) << "the dead creator's segment should still exist";
    EXPECT_FALSE(Segment::in_use(name));

    auto o = Segment::open(name, 7, 42);
    ASSERT_FALSE(o.ok());
    EXPECT_NE(o.error().message.find("stale"), std::string::npos) << o.error().message;

    auto s = Segment::create(name, opts(100));
    ASSERT_TRUE(s.ok()) << s.error().message;
    EXPECT_TRUE(s->replaced_stale());
    EXPECT_EQ(s->header().creator_pid, getpid());
    EXPECT_STREQ(reinterpret_cast<const char*>(s->payload()), "") << "old contents must not be reused";
}

TEST(Segment, RefusesSegmentsOfOtherUsersOrWritableByOthers) {
    std::string name = unique_name("seg");
    Unlinker u{name};
    {
        auto a = Segment::create(name, opts(100));
        ASSERT_TRUE(a.ok());
        ASSERT_EQ(chmod(a->path().c_str(), 0666), 0);
        auto b = Segment::open(name, 7, 42);
        ASSERT_FALSE(b.ok());
        EXPECT_NE(b.error().message.find("writable by other users"), std::string::npos) << b.error().message;
    }
    if (geteuid() != 0) GTEST_SKIP() << "the other-owner case needs root to chown";
    std::string path = "/dev/shm/" + name;
    ASSERT_EQ(chmod(path.c_str(), 0600), 0);
    ASSERT_EQ(chown(path.c_str(), 65534, 65534), 0);
    auto c = Segment::create(name, opts(100));
    ASSERT_FALSE(c.ok()) << "a stale segment of another user is neither reused nor removed";
    EXPECT_NE(c.error().message.find("belongs to uid 65534"), std::string::npos) << c.error().message;
    auto d = Segment::open(name, 7, 42);
    ASSERT_FALSE(d.ok());
    EXPECT_NE(d.error().message.find("belongs to uid 65534"), std::string::npos) << d.error().message;
}

TEST(Segment, HalfMadeTemporariesOfDeadCreatorsAreRemoved) {
    std::string name = unique_name("seg");
    Unlinker u{name};
    std::string tmp = "/dev/shm/." + name + ".tmp.999999";
    int fd = ::open(tmp.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(ftruncate(fd, 1 << 20), 0);
    ::close(fd);
    auto a = Segment::create(name, opts(100));
    ASSERT_TRUE(a.ok()) << a.error().message;
    struct stat st {};
    EXPECT_NE(stat(tmp.c_str(), &st), 0) << tmp << " should be gone";
    auto r = Segment::remove_if_stale(name);
    ASSERT_TRUE(r.ok());
    EXPECT_FALSE(*r) << "live: not removed";
}

TEST(Segment, RejectsBadNamesAndReportsMissing) {
    EXPECT_FALSE(Segment::create("../etc/passwd", opts(10)).ok());
    EXPECT_FALSE(Segment::create("", opts(10)).ok());
    auto m = Segment::open(unique_name("missing"), 7, 42);
    ASSERT_FALSE(m.ok());
    EXPECT_NE(m.error().message.find("no shared-memory segment"), std::string::npos);
}

TEST(Segment, PageModeIsReported) {
    std::string name = unique_name("seg");
    Unlinker u{name};
    auto a = Segment::create(name, opts(1 << 20));
    ASSERT_TRUE(a.ok());
    // Whatever this machine gives, the name is one of the three.
    std::string m = page_mode_name(a->page_mode());
    EXPECT_TRUE(m == "4 KiB pages" || m == "transparent huge pages" || m == "hugetlbfs 2 MiB pages") << m;
}

// ---------------------------------------------------------------- registry

TEST(Registry, ClaimBumpsGenerationAndStaleRefsLose) {
    Mem m(Registry::bytes(4));
    ASSERT_TRUE(Registry::init(m.p, 4).ok());
    auto reg = Registry::attach(m.p);
    ASSERT_TRUE(reg.ok());
    auto a = reg->claim(Role::Prefill, 0, getpid());
    ASSERT_TRUE(a.ok());
    EXPECT_EQ(reg->state(a->slot), ProcState::Starting);
    EXPECT_EQ(reg->find_running(Role::Prefill), -1) << "STARTING is not running yet";
    EXPECT_TRUE(reg->set_running(*a));
    EXPECT_TRUE(reg->alive(*a));
    EXPECT_EQ(reg->find_running(Role::Prefill), static_cast<int32_t>(a->slot));
    EXPECT_EQ(reg->find_running(Role::Decode), -1);
    EXPECT_TRUE(reg->release(*a));
    EXPECT_FALSE(reg->alive(*a));
    auto b = reg->claim(Role::Decode, 0, getpid());
    ASSERT_TRUE(b.ok());
    EXPECT_EQ(b->slot, a->slot);
    EXPECT_EQ(b->gen, a->gen + 1);
    // The old generation can no longer act on the slot.
    EXPECT_FALSE(reg->mark_dead(*a));
    EXPECT_FALSE(reg->release(*a));
    EXPECT_TRUE(reg->alive(*b));
    EXPECT_TRUE(reg->mark_dead(*b));
    EXPECT_FALSE(reg->mark_dead(*b)) << "only one observer makes the change";
    EXPECT_EQ(reg->state(b->slot), ProcState::Dead);
    auto c = reg->claim(Role::Front, -1, getpid());
    ASSERT_TRUE(c.ok());
    EXPECT_NE(c->slot, b->slot) << "a dead slot is not reused before it is reclaimed";
    EXPECT_TRUE(reg->reclaim(*b));
    EXPECT_EQ(reg->state(b->slot), ProcState::Free);
}

// The role page is its user's alone: whatever the last process of a slot left there
// is gone when the slot is claimed again, and it does not touch its neighbours.
TEST(Registry, ARoleStartsWithAZeroedPageOfItsOwn) {
    Mem m(Registry::bytes(2));
    ASSERT_TRUE(Registry::init(m.p, 2).ok());
    auto reg = Registry::attach(m.p);
    ASSERT_TRUE(reg.ok());
    auto a = reg->claim(Role::Prefill, -1, getpid());
    auto n = reg->claim(Role::Decode, -1, getpid());
    ASSERT_TRUE(a.ok() && n.ok());
    for (size_t w = 0; w < kRolePageWords; ++w) {
        reg->role_page(a->slot)[w].store(0x1111 + w);
        reg->role_page(n->slot)[w].store(0x2222 + w);
    }
    EXPECT_EQ(reinterpret_cast<uintptr_t>(reg->role_page(a->slot)) % 64, 0u);
    EXPECT_EQ(reg->pid(a->slot), getpid()) << "the page does not overwrite the identity";
    EXPECT_EQ(reg->slot(a->slot).doorbell.word.load(), 0u) << "nor the doorbell";
    ASSERT_TRUE(reg->release(*a));
    auto b = reg->claim(Role::Decode, -1, getpid());
    ASSERT_TRUE(b.ok());
    ASSERT_EQ(b->slot, a->slot);
    for (size_t w = 0; w < kRolePageWords; ++w) {
        EXPECT_EQ(reg->role_page(b->slot)[w].load(), 0u) << "word " << w;
        EXPECT_EQ(reg->role_page(n->slot)[w].load(), 0x2222 + w) << "word " << w;
    }
}

TEST(Registry, FullRegistryIsAnError) {
    Mem m(Registry::bytes(2));
    ASSERT_TRUE(Registry::init(m.p, 2).ok());
    auto reg = Registry::attach(m.p);
    ASSERT_TRUE(reg->claim(Role::Tool, -1, getpid()).ok());
    ASSERT_TRUE(reg->claim(Role::Tool, -1, getpid()).ok());
    auto c = reg->claim(Role::Tool, -1, getpid());
    ASSERT_FALSE(c.ok());
    EXPECT_NE(c.error().message.find("2 process registry slots"), std::string::npos);
}

TEST(Registry, ProcessStartTicksTellPidsApartAndZombiesAreDead) {
    EXPECT_GT(process_start_ticks(getpid()), 0u);
    EXPECT_EQ(process_start_ticks(0x3fffffff), 0u);
    pid_t child = fork();
    if (child == 0) _exit(0);
    // Not reaped yet: a zombie, whose /proc entry still shows its start time.
    for (int i = 0; i < 1000 && process_start_ticks(child) != 0; ++i) usleep(1000);
    EXPECT_EQ(process_start_ticks(child), 0u) << "a zombie counts as dead";
    waitpid(child, nullptr, 0);
}

TEST(Registry, LivenessMonitorReportsADeathWithinMilliseconds) {
    Mem m(Registry::bytes(4));
    ASSERT_TRUE(Registry::init(m.p, 4).ok());
    auto reg = Registry::attach(m.p);
    int pipefd[2];
    ASSERT_EQ(pipe(pipefd), 0);
    pid_t child = fork();
    if (child == 0) {
        char c;
        (void)!read(pipefd[0], &c, 1);
        _exit(0);
    }
    auto r = reg->claim(Role::Decode, 0, child);
    ASSERT_TRUE(r.ok());
    LivenessMonitor mon;
    ASSERT_TRUE(mon.watch(*reg, *r).ok());
    EXPECT_TRUE(mon.wait(20).empty()) << "the child is alive";
    uint64_t t0 = monotonic_ns();
    kill(child, SIGKILL);
    auto dead = mon.wait(5000);
    uint64_t dt = monotonic_ns() - t0;
    ASSERT_EQ(dead.size(), 1u);
    EXPECT_EQ(dead[0], *r);
    EXPECT_LT(dt, duet::test_time::scaled_ns(100'000'000u)) << "death reported after " << dt / 1e6 << " ms";
    std::printf("death reported %.1f us after kill()\n", dt / 1e3);
    waitpid(child, nullptr, 0);
    close(pipefd[0]);
    close(pipefd[1]);
}

TEST(Registry, SweepFindsProcessesThatDiedUnwatched) {
    Mem m(Registry::bytes(4));
    ASSERT_TRUE(Registry::init(m.p, 4).ok());
    auto reg = Registry::attach(m.p);
    pid_t child = fork();
    if (child == 0) _exit(0);
    waitpid(child, nullptr, 0);
    auto dead = reg->claim(Role::Prefill, 0, child);  // registered, then (already) gone
    auto live = reg->claim(Role::Front, -1, getpid());
    ASSERT_TRUE(dead.ok() && live.ok());
    auto swept = reg->sweep_dead();
    ASSERT_EQ(swept.size(), 1u);
    EXPECT_EQ(swept[0], *dead);
    EXPECT_TRUE(reg->alive(*live));
    // Also the monitor, watching after the fact, reports it at once.
    LivenessMonitor mon;
    ASSERT_TRUE(reg->reclaim(*dead));
    auto again = reg->claim(Role::Prefill, 0, child);
    ASSERT_TRUE(mon.watch(*reg, *again).ok());
    auto d = mon.wait(1000);
    ASSERT_EQ(d.size(), 1u);
    EXPECT_EQ(d[0], *again);
}

// ---------------------------------------------------------------- ring

struct Rec64 {
    uint64_t seq;
    uint64_t payload[7];
};
static_assert(sizeof(Rec64) == 64);

TEST(SpscRing, LayoutKeepsIndicesOnTheirOwnLines) {
    EXPECT_EQ(offsetof(RingHeader, head) % 64, 0u);
    EXPECT_EQ(offsetof(RingHeader, tail) % 64, 0u);
    EXPECT_NE(offsetof(RingHeader, head) / 64, offsetof(RingHeader, tail) / 64);
    EXPECT_EQ(ring_bytes(64, 8) % 64, 0u);
    EXPECT_GE(ring_bytes(64, 8), sizeof(RingHeader) + 8 * 64 + 64);
}

TEST(SpscRing, RejectsBadCapacityAndRecordSize) {
    Mem m(ring_bytes(64, 16));
    EXPECT_FALSE(ring_init(m.p, 64, 12).ok());
    EXPECT_FALSE(ring_init(m.p, 64, 1).ok());
    ASSERT_TRUE(ring_init(m.p, 64, 16).ok());
    EXPECT_TRUE(ring_check(m.p, 64).ok());
    EXPECT_FALSE(ring_check(m.p, 128).ok());
}

TEST(SpscRing, FifoFullEmptyAndWrap) {
    Mem m(ring_bytes(64, 8));
    ASSERT_TRUE(ring_init(m.p, 64, 8).ok());
    auto* h = reinterpret_cast<RingHeader*>(m.p);
    SpscProducer<Rec64> p(h);
    SpscConsumer<Rec64> c(h);
    Rec64 r{};
    EXPECT_FALSE(c.try_pop(r));
    uint64_t next_in = 0, next_out = 0;
    for (int round = 0; round < 50; ++round) {
        int n = 1 + round % 8;
        for (int i = 0; i < n; ++i) {
            Rec64 x{next_in, {next_in * 3}};
            ASSERT_TRUE(p.try_push(x));
            ++next_in;
        }
        for (int i = 0; i < n; ++i) {
            ASSERT_TRUE(c.try_pop(r));
            EXPECT_EQ(r.seq, next_out);
            EXPECT_EQ(r.payload[0], next_out * 3);
            ++next_out;
        }
    }
    for (int i = 0; i < 8; ++i) ASSERT_TRUE(p.try_push(Rec64{static_cast<uint64_t>(i), {}}));
    EXPECT_FALSE(p.try_push(Rec64{}));
    ASSERT_TRUE(c.try_pop(r));
    EXPECT_TRUE(p.try_push(Rec64{}));
}

TEST(SpscRing, BatchPushPopAndPeekRelease) {
    Mem m(ring_bytes(64, 16));
    ASSERT_TRUE(ring_init(m.p, 64, 16).ok());
    auto* h = reinterpret_cast<RingHeader*>(m.p);
    SpscProducer<Rec64> p(h);
    SpscConsumer<Rec64> c(h);
    std::vector<Rec64> in(20), out(20);
    for (uint64_t i = 0; i < 20; ++i) in[i].seq = i;
    EXPECT_EQ(p.push(in.data(), 20), 16u) << "only the capacity fits";
    EXPECT_EQ(c.pop(out.data(), 5), 5u);
    for (uint64_t i = 0; i < 5; ++i) EXPECT_EQ(out[i].seq, i);
    EXPECT_EQ(p.push(in.data() + 16, 4), 4u);
    // peek() gives contiguous records up to the ring's end; release() frees them.
    size_t n = 0;
    const Rec64* q = c.peek(&n);
    ASSERT_EQ(n, 11u);  // slots 5..15
    EXPECT_EQ(q[0].seq, 5u);
    c.release(n);
    q = c.peek(&n);
    ASSERT_EQ(n, 4u);  // wrapped: slots 0..3 hold 16..19
    EXPECT_EQ(q[0].seq, 16u);
    EXPECT_EQ(q[3].seq, 19u);
    c.release(4);
    EXPECT_FALSE(c.readable());
}

// peek() shows what was published when the consumer last looked at the tail;
// refresh() looks again, so a consumer that keeps records in the ring while it
// takes later ones (prefill's admission) sees new arrivals too.
TEST(SpscRing, RefreshShowsRecordsPublishedAfterAPeek) {
    Mem m(ring_bytes(64, 16));
    ASSERT_TRUE(ring_init(m.p, 64, 16).ok());
    auto* h = reinterpret_cast<RingHeader*>(m.p);
    SpscProducer<Rec64> p(h);
    SpscConsumer<Rec64> c(h);
    std::vector<Rec64> in(6);
    for (uint64_t i = 0; i < 6; ++i) in[i].seq = i;
    EXPECT_EQ(p.push(in.data(), 3), 3u);
    size_t n = 0;
    c.peek(&n);
    EXPECT_EQ(n, 3u);
    EXPECT_EQ(p.push(in.data() + 3, 3), 3u);
    c.peek(&n);
    EXPECT_EQ(n, 3u) << "not looked at the tail again: the cache says 3";
    EXPECT_EQ(c.backlog(), 3u);
    c.refresh();
    const Rec64* q = c.peek(&n);
    ASSERT_EQ(n, 6u);
    EXPECT_EQ(q[5].seq, 5u);
    EXPECT_EQ(c.backlog(), 6u);
    EXPECT_EQ(c.capacity(), 16u);
}

TEST(SpscRing, ARestartedEndpointContinuesFromTheSharedIndices) {
    Mem m(ring_bytes(64, 8));
    ASSERT_TRUE(ring_init(m.p, 64, 8).ok());
    auto* h = reinterpret_cast<RingHeader*>(m.p);
    {
        SpscProducer<Rec64> p(h);
        for (uint64_t i = 0; i < 5; ++i) ASSERT_TRUE(p.try_push(Rec64{i, {}}));
    }
    {
        SpscConsumer<Rec64> c(h);
        Rec64 r;
        ASSERT_TRUE(c.try_pop(r));
        EXPECT_EQ(r.seq, 0u);
        size_t n;
        c.peek(&n);  // looked at, not released: stays for the successor
        EXPECT_EQ(n, 4u);
    }
    SpscProducer<Rec64> p2(h);
    EXPECT_EQ(p2.published(), 5u);
    ASSERT_TRUE(p2.try_push(Rec64{5, {}}));
    SpscConsumer<Rec64> c2(h);
    for (uint64_t i = 1; i <= 5; ++i) {
        Rec64 r;
        ASSERT_TRUE(c2.try_pop(r));
        EXPECT_EQ(r.seq, i);
    }
}

// ---------------------------------------------------------------- doorbell

TEST(Doorbell, RingWithoutSleeperMakesNoWakeAndWaitReturnsWhenReady) {
    Doorbell d{};
    EXPECT_FALSE(doorbell_ring(d)) << "an awake consumer costs the producer no system call";
    bool ready = true;
    EXPECT_TRUE(doorbell_wait(d, [&] { return ready; }, 0, -1));
    ready = false;
    uint64_t t0 = monotonic_ns();
    EXPECT_FALSE(doorbell_wait(d, [&] { return ready; }, 10, 20'000'000));
    EXPECT_GE(monotonic_ns() - t0, 15'000'000u) << "slept until the timeout";
    EXPECT_EQ(d.word.load(), 0u);
}

TEST(Doorbell, SleepingConsumerIsWokenByARing) {
    Mem m(ring_bytes(64, 64));
    ASSERT_TRUE(ring_init(m.p, 64, 64).ok());
    auto* h = reinterpret_cast<RingHeader*>(m.p);
    Doorbell d{};
    std::atomic<int> got{0};
    std::thread consumer([&] {
        SpscConsumer<Rec64> c(h);
        for (int i = 0; i < 200; ++i) {
            ASSERT_TRUE(doorbell_wait(d, [&] { return c.readable(); }, 0, 5'000'000'000));
            Rec64 r;
            ASSERT_TRUE(c.try_pop(r));
            ASSERT_EQ(r.seq, static_cast<uint64_t>(i));
            got.fetch_add(1);
        }
    });
    SpscProducer<Rec64> p(h);
    int wakes = 0;
    for (int i = 0; i < 200; ++i) {
        // Give the consumer time to fall asleep on some iterations, not on others.
        if (i % 2 == 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
        ASSERT_TRUE(p.try_push(Rec64{static_cast<uint64_t>(i), {}}));
        wakes += doorbell_ring(d);
    }
    consumer.join();
    EXPECT_EQ(got.load(), 200);
    EXPECT_GT(wakes, 0) << "the consumer never slept: the test did not exercise the futex path";
}

// ---------------------------------------------------------------- KV arena

class Arena : public ::testing::Test {
protected:
    void make(uint32_t n_blocks, uint32_t n_users = 4) {
        ArenaConfig c;
        c.n_blocks = n_blocks;
        c.n_users = n_users;
        mem = std::make_unique<Mem>(KvArena::bytes(c));
        ASSERT_TRUE(KvArena::init(mem->p, c).ok());
        auto a = KvArena::attach(mem->p);
        ASSERT_TRUE(a.ok());
        arena = *a;
    }
    std::unique_ptr<Mem> mem;
    KvArena arena;
};

TEST_F(Arena, AllocIsAllOrNothingAndFreeReturns) {
    make(100);
    auto u = arena.join(ProcRef{1, 1});
    ASSERT_TRUE(u.ok());
    EXPECT_EQ(arena.n_free(), 100u);
    std::vector<int32_t> b(100);
    ASSERT_TRUE(arena.alloc(*u, 60, b.data()));
    std::set<int32_t> seen(b.begin(), b.begin() + 60);
    EXPECT_EQ(seen.size(), 60u);
    EXPECT_EQ(arena.n_free(), 40u);
    EXPECT_FALSE(arena.alloc(*u, 41, b.data() + 60)) << "41 > 40 free";
    EXPECT_EQ(arena.n_free(), 40u) << "a failed alloc takes nothing";
    ASSERT_TRUE(arena.alloc(*u, 40, b.data() + 60));
    EXPECT_EQ(arena.n_free(), 0u);
    arena.unref(*u, b.data(), 100);
    EXPECT_EQ(arena.n_free(), 100u);
    ArenaCensus c = arena.census();
    EXPECT_EQ(c.free, 100u);
    EXPECT_EQ(c.held, 0u);
}

TEST_F(Arena, RefcountsArePerUserAndTheLastUnrefFrees) {
    make(8);
    auto a = arena.join(ProcRef{1, 1});
    auto b = arena.join(ProcRef{2, 1});
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_NE(*a, *b);
    int32_t blk;
    ASSERT_TRUE(arena.alloc(*a, 1, &blk));
    ASSERT_TRUE(arena.ref(*b, blk));
    ASSERT_TRUE(arena.ref(*b, blk));
    EXPECT_EQ(arena.refcount(blk), 3u);
    EXPECT_EQ(arena.refs_of(*a, blk), 1u);
    EXPECT_EQ(arena.refs_of(*b, blk), 2u);
    arena.unref(*a, blk);
    EXPECT_EQ(arena.n_free(), 7u);
    arena.unref(*b, blk);
    arena.unref(*b, blk);
    EXPECT_EQ(arena.n_free(), 8u);
    EXPECT_EQ(arena.user_of(ProcRef{2, 1}), static_cast<int32_t>(*b));
    EXPECT_EQ(arena.user_of(ProcRef{2, 2}), -1) << "another generation is another process";
}

TEST_F(Arena, PerUserCountSaturatesInsteadOfOverflowingIntoANeighbour) {
    make(4, 6);  // 10 bits per user: at most 1023
    auto u = arena.join(ProcRef{1, 1});
    auto v = arena.join(ProcRef{2, 1});
    int32_t blk;
    ASSERT_TRUE(arena.alloc(*u, 1, &blk));
    for (int i = 1; i < 1023; ++i) ASSERT_TRUE(arena.ref(*u, blk));
    EXPECT_FALSE(arena.ref(*u, blk));
    EXPECT_EQ(arena.refs_of(*u, blk), 1023u);
    EXPECT_EQ(arena.refs_of(*v, blk), 0u);
}

TEST_F(Arena, RecoverUserReturnsEverythingADeadUserHeld) {
    make(64);
    auto dead = arena.join(ProcRef{3, 1});
    auto live = arena.join(ProcRef{4, 1});
    std::vector<int32_t> d(20), l(10);
    ASSERT_TRUE(arena.alloc(*dead, 20, d.data()));
    ASSERT_TRUE(arena.alloc(*live, 10, l.data()));
    ASSERT_TRUE(arena.ref(*dead, l[0]));  // shares one of live's blocks
    ASSERT_TRUE(arena.ref(*live, d[0]));  // and live shares one of its
    EXPECT_EQ(arena.recover_user(*dead), 21u);
    ArenaCensus c = arena.census();
    EXPECT_EQ(c.held, 11u);  // live's 10 + d[0]
    EXPECT_EQ(c.free, 53u);
    EXPECT_EQ(c.refs_by_user[*dead], 0u);
    EXPECT_EQ(c.refs_by_user[*live], 11u);
    EXPECT_EQ(arena.n_free(), 53u);
    EXPECT_EQ(arena.user_of(ProcRef{3, 1}), -1) << "the slot is free again";
    auto again = arena.join(ProcRef{3, 2});
    ASSERT_TRUE(again.ok());
}

TEST_F(Arena, JoiningTwiceGivesTheSameSlot) {
    make(8);
    auto a = arena.join(ProcRef{5, 2});
    auto b = arena.join(ProcRef{5, 2});
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(*a, *b);
}

TEST_F(Arena, RecoveryIsIdempotent) {
    make(16);
    auto dead = arena.join(ProcRef{3, 1});
    auto live = arena.join(ProcRef{4, 1});
    int32_t b[4];
    ASSERT_TRUE(arena.alloc(*dead, 4, b));
    ASSERT_TRUE(arena.ref(*dead, b[0]));
    ASSERT_TRUE(arena.share(*dead, *live, b[1]));
    // Two recoverers (or one resuming after another died) drop each reference once.
    EXPECT_EQ(arena.recover_user(*dead), 5u);
    EXPECT_EQ(arena.recover_user(*dead), 0u);
    ArenaCensus c = arena.census();
    EXPECT_EQ(c.refs_by_user[*live], 1u);
    EXPECT_EQ(c.held, 1u);
    EXPECT_EQ(c.free, 15u);
}

TEST_F(Arena, ShareAndTransferNeedTheGiverToStillHoldTheBlock) {
    make(8);
    auto p = arena.join(ProcRef{1, 1});  // prefill
    auto d = arena.join(ProcRef{2, 1});  // decode
    int32_t b;
    ASSERT_TRUE(arena.alloc(*p, 1, &b));
    EXPECT_TRUE(arena.transfer(*p, *d, b));
    EXPECT_EQ(arena.refs_of(*p, b), 0u);
    EXPECT_EQ(arena.refs_of(*d, b), 1u);
    EXPECT_FALSE(arena.transfer(*p, *d, b)) << "prefill no longer holds it";
    EXPECT_FALSE(arena.share(*p, *d, b));
    EXPECT_TRUE(arena.share(*d, *p, b));
    EXPECT_EQ(arena.refcount(b), 2u);
    // The giver died and was recovered, the block freed and taken by someone else: a
    // late hand-off must not make the receiver co-own the new holder's block.
    auto other = arena.join(ProcRef{3, 1});
    arena.unref(*p, b);
    arena.recover_user(*d);
    int32_t again;
    ASSERT_TRUE(arena.alloc(*other, 1, &again));
    ASSERT_EQ(again, b);
    EXPECT_FALSE(arena.share(*d, *p, b));
    EXPECT_EQ(arena.refcount(b), 1u);
}

TEST_F(Arena, DroppingAReferenceNotHeldAborts) {
    make(4);
    auto u = arena.join(ProcRef{1, 1});
    auto v = arena.join(ProcRef{2, 1});
    int32_t b;
    ASSERT_TRUE(arena.alloc(*v, 1, &b));
    GTEST_FLAG_SET(death_test_style, "threadsafe");  // sanitizer runtimes run threads of their own
    EXPECT_DEATH(arena.unref(*u, b), "does not hold");
    EXPECT_EQ(arena.refs_of(*v, b), 1u);
}

TEST_F(Arena, UserSlotsRunOut) {
    make(4, 2);
    ASSERT_TRUE(arena.join(ProcRef{1, 1}).ok());
    ASSERT_TRUE(arena.join(ProcRef{2, 1}).ok());
    auto c = arena.join(ProcRef{3, 1});
    ASSERT_FALSE(c.ok());
    EXPECT_NE(c.error().message.find("2 KV arena user slots"), std::string::npos);
}

TEST(BlockHash, ChainsParentTokensModelAndSalt) {
    int32_t t[16];
    for (int i = 0; i < 16; ++i) t[i] = i * 7;
    BlockHash root{};
    BlockHash h = block_hash(root, t, 16, 99, "");
    EXPECT_EQ(h, block_hash(root, t, 16, 99, ""));
    t[15] ^= 1;
    EXPECT_FALSE(h == block_hash(root, t, 16, 99, ""));
    t[15] ^= 1;
    EXPECT_FALSE(h == block_hash(root, t, 16, 98, "")) << "model fingerprint";
    EXPECT_FALSE(h == block_hash(root, t, 16, 99, "tenant")) << "salt";
    EXPECT_FALSE(h == block_hash(h, t, 16, 99, "")) << "parent";
    EXPECT_FALSE(h == block_hash(root, t, 15, 99, "")) << "length";
}

TEST(BlockHash, MatchesPythonHashlib) {
    if (system("python3 -c 'import hashlib' >/dev/null 2>&1") != 0) GTEST_SKIP() << "python3 not available";
    int32_t t[16];
    for (int i = 0; i < 16; ++i) t[i] = i * 7 - 50;
    BlockHash parent{0x0123456789abcdefull, 0xfedcba9876543210ull};
    BlockHash h = block_hash(parent, t, 16, 0xdeadbeefcafef00dull, "salt!");
    FILE* f = popen(
        "python3 -c \"import hashlib,struct;"
        "b=struct.pack('<QQQQ',0x0123456789abcdef,0xfedcba9876543210,0xdeadbeefcafef00d,5)+b'salt!'"
        "+struct.pack('<Q',16)+struct.pack('<16i',*[i*7-50 for i in range(16)]);"
        "d=hashlib.sha256(b).digest();print(struct.unpack('<QQ',d[:16])[0],struct.unpack('<QQ',d[:16])[1])\"",
        "r");
    ASSERT_NE(f, nullptr);
    unsigned long long lo = 0, hi = 0;
    ASSERT_EQ(fscanf(f, "%llu %llu", &lo, &hi), 2);
    pclose(f);
    EXPECT_EQ(h.lo, lo);
    EXPECT_EQ(h.hi, hi);
}

TEST_F(Arena, PrefixCacheHitsKeepsZeroRefBlocksAndEvictsLruFirst) {
    make(4);
    auto u = arena.join(ProcRef{1, 1});
    int32_t t[16] = {};
    BlockHash h[4];
    int32_t b[4];
    ASSERT_TRUE(arena.alloc(*u, 4, b));
    for (int i = 0; i < 4; ++i) {
        t[0] = i;
        h[i] = block_hash(BlockHash{}, t, 16, 1, "");
        ASSERT_TRUE(arena.publish(*u, b[i], h[i]));
    }
    // Drop references in the order 2, 0, 3, 1: that is the LRU order.
    for (int i : {2, 0, 3, 1}) {
        arena.unref(*u, b[i]);
        std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    ArenaCensus c = arena.census();
    EXPECT_EQ(c.cached, 4u);
    EXPECT_EQ(c.free, 0u);
    EXPECT_EQ(arena.n_free(), 0u);
    // A hit takes a reference and refreshes nothing else.
    EXPECT_EQ(arena.acquire_cached(*u, h[3]), b[3]);
    EXPECT_EQ(arena.refcount(b[3]), 1u);
    // Two allocations under pressure evict the two least recently used: 2, then 0.
    int32_t got[2];
    ASSERT_TRUE(arena.alloc(*u, 2, got));
    EXPECT_EQ(got[0], b[2]);
    EXPECT_EQ(got[1], b[0]);
    EXPECT_EQ(arena.acquire_cached(*u, h[2]), -1) << "evicted";
    EXPECT_EQ(arena.acquire_cached(*u, h[0]), -1) << "evicted";
    EXPECT_EQ(arena.acquire_cached(*u, h[1]), b[1]);
    EXPECT_FALSE(arena.cached(got[0]));
    // A held block is never evicted: nothing left to evict.
    int32_t x;
    EXPECT_FALSE(arena.alloc(*u, 1, &x));
}

TEST_F(Arena, PublishingTheSameContentTwiceKeepsOneCopy) {
    make(8);
    auto u = arena.join(ProcRef{1, 1});
    int32_t b[2];
    ASSERT_TRUE(arena.alloc(*u, 2, b));
    BlockHash h{1, 2};
    EXPECT_TRUE(arena.publish(*u, b[0], h));
    EXPECT_FALSE(arena.publish(*u, b[1], h));
    EXPECT_FALSE(arena.cached(b[1]));
    EXPECT_EQ(arena.refcount(b[0]), 1u) << "the duplicate check leaves no reference behind";
}

// ---------------------------------------------------------------- request table

class Requests : public ::testing::Test {
protected:
    void SetUp() override {
        RequestTableConfig c;
        c.n_slots = 4;
        c.max_tokens = 64;
        mem = std::make_unique<Mem>(RequestTable::bytes(c));
        ASSERT_TRUE(RequestTable::init(mem->p, c).ok());
        table = *RequestTable::attach(mem->p);
    }
    std::unique_ptr<Mem> mem;
    RequestTable table;
    ProcRef front{0, 1}, worker{1, 1};
};

TEST_F(Requests, LifecycleByCasAndGenerations) {
    int32_t prompt[3] = {5, 6, 7};
    uint8_t params[16] = {1, 2, 3};
    auto r = table.submit(front, prompt, 3, params, sizeof params);
    ASSERT_TRUE(r.ok());
    EXPECT_TRUE(table.is(*r, ReqState::Queued));
    EXPECT_EQ(table.owner_slot(r->slot), 0);
    EXPECT_EQ(table.slot(r->slot).params[2], 3);
    EXPECT_EQ(table.tokens(r->slot)[2], 7);
    EXPECT_FALSE(table.transition(*r, ReqState::Queued, ReqState::Decoding)) << "not an allowed transition";
    EXPECT_TRUE(table.transition(*r, ReqState::Queued, ReqState::Prefilling, worker));
    EXPECT_FALSE(table.transition(*r, ReqState::Queued, ReqState::Prefilling, worker)) << "lost race";
    EXPECT_EQ(table.owner_slot(r->slot), 1);
    int32_t out[2] = {100, 101};
    ASSERT_TRUE(table.append_output(*r, out, 2).ok());
    EXPECT_TRUE(table.transition(*r, ReqState::Prefilling, ReqState::Decoding));
    ASSERT_TRUE(table.append_output(*r, out, 1).ok());
    std::vector<int32_t> got;
    EXPECT_EQ(*table.read_output(*r, 0, got), 3u);
    EXPECT_EQ(got, (std::vector<int32_t>{100, 101, 100}));
    EXPECT_TRUE(table.transition(*r, ReqState::Decoding, ReqState::Finished));
    EXPECT_TRUE(table.transition(*r, ReqState::Finished, ReqState::Free));
    EXPECT_EQ(table.owner_slot(r->slot), -1);
    // Reuse: the new request has a new generation; the old ref acts on nothing.
    ReqRef old = *r;
    auto r2 = table.submit(front, prompt, 1, nullptr, 0);
    ASSERT_TRUE(r2.ok());
    if (r2->slot == old.slot) {
        EXPECT_EQ(r2->gen, old.gen + 1);
    }
    EXPECT_FALSE(table.transition(old, ReqState::Queued, ReqState::Prefilling, worker));
    table.cancel(old);
    EXPECT_FALSE(table.cancelled(*r2)) << "a stale cancel does not touch the new request";
    table.cancel(*r2);
    EXPECT_TRUE(table.cancelled(*r2));
    EXPECT_FALSE(table.append_output(old, out, 1).ok());
}

TEST_F(Requests, BadInputIsAClearErrorAndFullTableSaysRetry) {
    int32_t p[65] = {};
    EXPECT_FALSE(table.submit(front, p, 0, nullptr, 0).ok());
    auto big = table.submit(front, p, 65, nullptr, 0);
    ASSERT_FALSE(big.ok());
    EXPECT_NE(big.error().message.find("65 tokens"), std::string::npos);
    EXPECT_FALSE(table.submit(front, p, 1, p, kReqParamBytes + 1).ok());
    for (int i = 0; i < 4; ++i) ASSERT_TRUE(table.submit(front, p, 60, nullptr, 0).ok());
    auto full = table.submit(front, p, 1, nullptr, 0);
    ASSERT_FALSE(full.ok());
    EXPECT_NE(full.error().message.find("retry"), std::string::npos);
    // A request cannot outgrow its slot.
    ReqRef r = table.current(0);
    ASSERT_TRUE(table.transition(r, ReqState::Queued, ReqState::Prefilling, worker));
    int32_t out[5] = {};
    EXPECT_FALSE(table.append_output(r, out, 5).ok());
    EXPECT_TRUE(table.append_output(r, out, 4).ok());
}

TEST_F(Requests, OwnedByFindsADeadWorkersRequestsForReDrive) {
    int32_t p[2] = {1, 2};
    auto a = table.submit(front, p, 2, nullptr, 0);
    auto b = table.submit(front, p, 2, nullptr, 0);
    ASSERT_TRUE(table.transition(*a, ReqState::Queued, ReqState::Prefilling, worker));
    ASSERT_TRUE(table.transition(*a, ReqState::Prefilling, ReqState::Decoding));
    auto mine = table.owned_by(worker.slot);
    ASSERT_EQ(mine.size(), 1u);
    EXPECT_EQ(mine[0], *a);
    EXPECT_EQ(table.owned_by(front.slot).size(), 1u);  // b, still queued by the front
    // Re-driven by the front, which becomes the owner: no request is ever ownerless.
    EXPECT_TRUE(table.transition(*a, ReqState::Decoding, ReqState::Queued, front));
    EXPECT_EQ(table.owner_slot(a->slot), 0);
    EXPECT_TRUE(table.owned_by(worker.slot).empty());
    (void)b;
}

// Recovery takes a dead worker's requests with adopt(): one that a live process
// took after the scan (a decode committing the dead prefill's hand-off) must stay
// the live one's, or recovery re-drives a request that is still being decoded.
TEST_F(Requests, AdoptTakesARequestOnlyFromTheOwnerItNames) {
    const ProcRef decode{2, 1};
    int32_t p[2] = {1, 2};
    auto r = table.submit(front, p, 2, nullptr, 0);
    ASSERT_TRUE(table.transition(*r, ReqState::Queued, ReqState::Prefilling, worker));
    int32_t b[2] = {10, 11};
    ASSERT_TRUE(table.append_blocks(*r, b, 2).ok());
    const uint32_t att = table.attempt(r->slot);
    ASSERT_TRUE(table.commit(*r, att, ReqState::Prefilling, worker, ReqState::Decoding, decode));
    EXPECT_FALSE(table.adopt(*r, worker, front)) << "the worker no longer owns it";
    EXPECT_TRUE(table.is_with(*r, att, ReqState::Decoding, decode));
    EXPECT_EQ(table.slot(r->slot).n_blocks.load(), 2u);
    EXPECT_TRUE(table.adopt(*r, decode, front));
    EXPECT_TRUE(table.is_with(*r, att, ReqState::Decoding, front)) << "state and attempt kept";
    EXPECT_FALSE(table.adopt(*r, decode, worker)) << "nor from an owner that was";
}

TEST_F(Requests, AReservationOfADeadSubmitterIsFoundAndUndone) {
    auto r = table.reserve(worker);  // the submitter "dies" here, before queue()
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(table.state(r->slot), ReqState::Free);
    auto owned = table.owned_by(worker.slot);
    ASSERT_EQ(owned.size(), 1u);
    EXPECT_EQ(owned[0], *r);
    // Nobody else takes a reserved slot.
    int32_t p[1] = {1};
    for (int i = 0; i < 3; ++i) ASSERT_TRUE(table.submit(front, p, 1, nullptr, 0).ok());
    EXPECT_FALSE(table.submit(front, p, 1, nullptr, 0).ok()) << "3 free + 1 reserved of 4";
    EXPECT_TRUE(table.unreserve(*r));
    EXPECT_FALSE(table.unreserve(*r));
    EXPECT_TRUE(table.owned_by(worker.slot).empty());
    auto again = table.submit(front, p, 1, nullptr, 0);
    ASSERT_TRUE(again.ok());
    EXPECT_EQ(again->slot, r->slot);
    EXPECT_FALSE(table.queue(*r, p, 1, nullptr, 0).ok()) << "the old reservation is gone";
}

// A submitter offers blocks whose KV the prompt's first positions have: only while
// the request is queued; the worker that takes it reads them and empties the table.
TEST_F(Requests, OfferedBlocksWhileQueued) {
    int32_t p[3] = {1, 2, 3};
    auto r = table.submit(front, p, 3, nullptr, 0);
    ASSERT_TRUE(r.ok());
    int32_t offered[2] = {7, 9};
    ASSERT_TRUE(table.offer_blocks(*r, offered, 2).ok());
    EXPECT_EQ(table.slot(r->slot).n_blocks.load(), 2u);
    EXPECT_EQ(table.blocks(r->slot)[1], 9);
    ASSERT_TRUE(table.offer_blocks(*r, offered, 1).ok()) << "an offer replaces the last";
    EXPECT_EQ(table.slot(r->slot).n_blocks.load(), 1u);
    ASSERT_TRUE(table.transition(*r, ReqState::Queued, ReqState::Prefilling, worker));
    EXPECT_FALSE(table.offer_blocks(*r, offered, 2).ok()) << "a running request takes no offer";
    ASSERT_TRUE(table.reset_blocks(*r).ok());
    EXPECT_EQ(table.slot(r->slot).n_blocks.load(), 0u);
    ReqRef stale = *r;
    stale.gen += 1;
    EXPECT_FALSE(table.offer_blocks(stale, offered, 1).ok()) << "another generation";
    std::vector<int32_t> many(table.max_blocks() + 1, 1);
    auto r2 = table.submit(front, p, 3, nullptr, 0);
    EXPECT_FALSE(table.offer_blocks(*r2, many.data(), static_cast<uint32_t>(many.size())).ok());
}

TEST_F(Requests, AdoptCancelBlocksAndReadsAfterReuse) {
    int32_t p[2] = {1, 2};
    auto r = table.submit(front, p, 2, nullptr, 0);
    ASSERT_TRUE(table.transition(*r, ReqState::Queued, ReqState::Prefilling, worker));
    int32_t b1[2] = {10, 11}, b2[1] = {12};
    EXPECT_TRUE(table.append_blocks(*r, b1, 2).ok());
    EXPECT_TRUE(table.append_blocks(*r, b2, 1).ok());
    EXPECT_EQ(table.slot(r->slot).n_blocks.load(), 3u);
    EXPECT_EQ(table.blocks(r->slot)[2], 12);
    int32_t t[1] = {42};
    ASSERT_TRUE(table.append_output(*r, t, 1).ok());
    ASSERT_TRUE(table.transition(*r, ReqState::Prefilling, ReqState::Finished));
    EXPECT_FALSE(table.append_blocks(*r, b2, 1).ok()) << "a finished request takes no blocks";
    // The worker died: the front adopts the finished request so its client can read it.
    EXPECT_TRUE(table.adopt(*r, worker, front));
    EXPECT_EQ(table.owner_slot(r->slot), 0);
    std::vector<int32_t> got;
    EXPECT_EQ(*table.read_output(*r, 0, got), 1u);
    ASSERT_TRUE(table.transition(*r, ReqState::Finished, ReqState::Free));
    // Reused: reads of the old request fail instead of returning the new one's tokens.
    ReqRef old = *r;
    std::vector<ReqRef> mine;
    for (int i = 0; i < 4; ++i) mine.push_back(*table.submit(front, p, 2, nullptr, 0));
    got.clear();
    EXPECT_FALSE(table.read_output(old, 0, got).ok());
    EXPECT_TRUE(got.empty());
    EXPECT_FALSE(table.adopt(old, front, worker));
    // A late cancel of an older generation never replaces a newer one's.
    ReqRef now = table.current(old.slot);
    table.cancel(now);
    table.cancel(old);
    EXPECT_TRUE(table.cancelled(now));
}

TEST(ReqState, OnlyTheDocumentedTransitionsAreAllowed) {
    using S = ReqState;
    std::set<std::pair<int, int>> allowed = {
        {1, 2}, {1, 5}, {1, 6}, {2, 3}, {2, 4}, {2, 5}, {2, 6}, {2, 1}, {3, 4}, {3, 5}, {3, 6}, {3, 1},
        {4, 0}, {5, 0}, {6, 0}};
    for (int f = 0; f <= 6; ++f)
        for (int t = 0; t <= 6; ++t)
            EXPECT_EQ(req_transition_allowed(static_cast<S>(f), static_cast<S>(t)), allowed.count({f, t}) == 1)
                << req_state_name(static_cast<S>(f)) << " -> " << req_state_name(static_cast<S>(t));
}

// ---------------------------------------------------------------- instance

TEST(Instance, CreateOpenAndConfigMismatch) {
    InstanceConfig c;
    c.name = unique_name("inst");
    c.registry_slots = 8;
    c.n_rings = 4;
    c.ring_capacity = 64;
    c.requests.n_slots = 8;
    c.requests.max_tokens = 256;
    c.arenas.push_back(ArenaConfig{128, 4, 0});
    c.cpu_kv_bytes = 1 << 20;
    c.user_protocol = 3;  // kept, for a tool that attaches by name
    auto a = Instance::create(c);
    ASSERT_TRUE(a.ok()) << a.error().message;
    auto b = Instance::open(c);
    ASSERT_TRUE(b.ok()) << b.error().message;
    auto me = a->registry().claim(Role::Tool, -1, getpid());
    ASSERT_TRUE(me.ok());
    EXPECT_TRUE(b->registry().alive(*me)) << "both views see one registry";
    auto u = b->arena(0).join(*me);
    ASSERT_TRUE(u.ok());
    int32_t blk;
    ASSERT_TRUE(b->arena(0).alloc(*u, 1, &blk));
    EXPECT_EQ(a->arena(0).refcount(blk), 1u);
    a->cpu_kv_data()[100] = 7;
    EXPECT_EQ(b->cpu_kv_data()[100], 7);
    SpscProducer<Rec64> p(a->ring(3));
    SpscConsumer<Rec64> q(b->ring(3));
    ASSERT_TRUE(p.try_push(Rec64{9, {}}));
    Rec64 r;
    ASSERT_TRUE(q.try_pop(r));
    EXPECT_EQ(r.seq, 9u);

    // A tool attaches by name alone and reads the same configuration.
    auto t = Instance::attach(c.name);
    ASSERT_TRUE(t.ok()) << t.error().message;
    EXPECT_EQ(t->config().fingerprint(), c.fingerprint());
    EXPECT_EQ(t->config().arenas.size(), 1u);
    EXPECT_EQ(t->arena(0).refcount(blk), 1u);
    EXPECT_FALSE(Instance::attach(unique_name("none")).ok());

    InstanceConfig other = c;
    other.requests.n_slots = 9;
    auto bad = Instance::open(other);
    ASSERT_FALSE(bad.ok());
    EXPECT_NE(bad.error().message.find("config fingerprint"), std::string::npos) << bad.error().message;
    // The users' protocol (the shape of the bytes shm keeps for them) is part of it.
    InstanceConfig users = c;
    users.user_protocol = c.user_protocol + 1;
    EXPECT_FALSE(Instance::open(users).ok());
    Instance::unlink(c.name);
}

// A request's own data: readable for exactly the request it was written for, by
// every process (the bytes are in the table); up to ext_bytes() and the bound named
// past it; the last slot's bytes do not run past the table; gone once the slot is
// reused, without being freed.
TEST_F(Requests, RequestDataBelongsToItsRequestAlone) {
    int32_t prompt[2] = {5, 6};
    EXPECT_EQ(table.ext_bytes(), RequestTableConfig{}.ext_bytes);
    std::vector<ReqRef> all;
    for (uint32_t i = 0; i < 4; ++i) {
        auto r = table.submit(front, prompt, 2, nullptr, 0);
        ASSERT_TRUE(r.ok());
        all.push_back(*r);
    }
    EXPECT_FALSE(table.ext_data(all[0]).has_value()) << "none written yet";
    // Each slot's data at its full size, with a pattern of its own: none overlaps
    // another's or the front records (written too), and the last one fits the table.
    const std::string rec(kReqFrontBytes - 24, 'r');
    for (uint32_t i = 0; i < 4; ++i) {
        std::vector<uint8_t> d(table.ext_bytes());
        for (size_t k = 0; k < d.size(); ++k) d[k] = static_cast<uint8_t>(k * 7 + i * 31);
        ASSERT_TRUE(table.set_ext_data(all[i], d.data(), static_cast<uint32_t>(d.size())).ok());
        ASSERT_TRUE(table.set_front_data(all[i], rec.data(), static_cast<uint32_t>(rec.size())).ok());
    }
    for (uint32_t i = 0; i < 4; ++i) {
        auto got = table.ext_data(all[i]);
        ASSERT_TRUE(got.has_value());
        ASSERT_EQ(got->size(), table.ext_bytes());
        for (size_t k = 0; k < got->size(); k += 997) EXPECT_EQ((*got)[k], static_cast<uint8_t>(k * 7 + i * 31)) << i;
        EXPECT_EQ(*table.front_data(all[i]), rec);
    }
    const std::vector<uint8_t> small = {1, 2, 3};
    ASSERT_TRUE(table.set_ext_data(all[1], small.data(), 3).ok());
    EXPECT_EQ(*table.ext_data(all[1]), small);
    EXPECT_FALSE(table.ext_data(ReqRef{all[1].slot, all[1].gen + 1}).has_value()) << "another generation's";
    std::vector<uint8_t> huge(table.ext_bytes() + 1u, 9);
    duet::Status st = table.set_ext_data(all[1], huge.data(), static_cast<uint32_t>(huge.size()));
    ASSERT_FALSE(st.ok());
    EXPECT_NE(st.error().message.find(std::to_string(table.ext_bytes())), std::string::npos) << st.error().message;
    EXPECT_EQ(*table.ext_data(all[1]), small) << "refused data changes nothing";

    // Ended and freed, the slot taken again: the old data names nobody.
    ASSERT_TRUE(table.transition(all[1], ReqState::Queued, ReqState::Cancelled));
    ASSERT_TRUE(table.transition(all[1], ReqState::Cancelled, ReqState::Free));
    auto again = table.submit(front, prompt, 2, nullptr, 0);
    ASSERT_TRUE(again.ok());
    ASSERT_EQ(again->slot, all[1].slot);
    EXPECT_FALSE(table.ext_data(*again).has_value()) << "the reused slot's old data is not the new request's";
    EXPECT_FALSE(table.ext_data(all[1]).has_value()) << "nor the old request's any more";
    EXPECT_FALSE(table.set_ext_data(all[1], small.data(), 3).ok()) << "a request gone takes no data";
}

// The front record of a request (what a restarted front answers its client from):
// readable for exactly the request it was written for, gone once the slot is reused,
// too long refused; set_client hands the request to another front.
TEST_F(Requests, FrontRecordBelongsToItsRequestAlone) {
    int32_t prompt[2] = {5, 6};
    auto r = table.submit(front, prompt, 2, nullptr, 0);
    ASSERT_TRUE(r.ok());
    EXPECT_FALSE(table.front_data(*r).has_value()) << "no record written yet";
    const std::string rec = R"({"id":"cmpl-1","stop":["\n\n"]})";
    ASSERT_TRUE(table.set_front_data(*r, rec.data(), static_cast<uint32_t>(rec.size())).ok());
    ASSERT_TRUE(table.front_data(*r).has_value());
    EXPECT_EQ(*table.front_data(*r), rec);
    EXPECT_FALSE(table.front_data(ReqRef{r->slot, r->gen + 1}).has_value()) << "another generation's";
    const std::string huge(kReqFrontBytes, 'x');
    EXPECT_FALSE(table.set_front_data(*r, huge.data(), static_cast<uint32_t>(huge.size())).ok());
    EXPECT_EQ(*table.front_data(*r), rec) << "a refused record changes nothing";

    ProcRef other_front{2, 1};
    EXPECT_TRUE(table.set_client(*r, other_front));
    EXPECT_EQ(table.slot(r->slot).client.load(), other_front.pack());
    EXPECT_EQ(table.front_record(r->slot).orphaned_ns.load(), 0u);

    // Ended and freed, the slot taken again: the old record names nobody.
    ASSERT_TRUE(table.transition(*r, ReqState::Queued, ReqState::Cancelled));
    ASSERT_TRUE(table.transition(*r, ReqState::Cancelled, ReqState::Free));
    EXPECT_FALSE(table.set_client(*r, front)) << "a free slot has no client to change";
    ReqRef again{};
    for (int i = 0; i < 4; ++i) {  // until the same slot comes round
        auto q = table.submit(front, prompt, 2, nullptr, 0);
        ASSERT_TRUE(q.ok());
        if (q->slot == r->slot) {
            again = *q;
            break;
        }
    }
    ASSERT_EQ(again.slot, r->slot);
    EXPECT_FALSE(table.front_data(again).has_value()) << "the reused slot's old record is not the new request's";
    EXPECT_FALSE(table.front_data(*r).has_value()) << "nor the old request's any more (it is gone)";
}
