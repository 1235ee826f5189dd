// Stress tests of the shm structures: many threads, then many processes (fork), with
// millions of checksummed ring records and racing arena / prefix-cache / request-table
// operations. Every check is against an invariant that a lost, duplicated or
// reordered record, a double allocation, or a torn publication would break.
// DUET_STRESS_SCALE multiplies the iteration counts (a soak: label soak).
#include <sched.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "shm/doorbell.h"
#include "shm/kv_arena.h"
#include "shm/request_table.h"
#include "shm/segment.h"
#include "shm/spsc_ring.h"
#include "shm_test_util.h"

using namespace duet::shm;
using namespace duet::shm::testing;

namespace {

// A segment laid out for the ring tests: a doorbell line, then n rings.
struct RingSet {
    static constexpr uint64_t kCap = 1024;
    Segment seg;
    SegmentGuard guard;
    uint32_t n;
    static size_t stride() { return ring_bytes(sizeof(CheckedRec), kCap); }
    explicit RingSet(uint32_t n_rings) : guard{unique_name("rings")}, n(n_rings) {
        SegmentOptions o;
        o.payload_bytes = 4096 + stride() * n + 4096;
        o.layout_version = 1;
        auto s = Segment::create(guard.name, o);
        if (!s.ok()) std::abort();
        seg = std::move(*s);
        for (uint32_t i = 0; i < n; ++i)
            if (!ring_init(ring(i), sizeof(CheckedRec), kCap).ok()) std::abort();
    }
    Doorbell& bell() { return *reinterpret_cast<Doorbell*>(seg.payload()); }
    std::atomic<uint64_t>& result(int i) { return reinterpret_cast<std::atomic<uint64_t>*>(seg.payload() + 64)[i]; }
    RingHeader* ring(uint32_t i) { return reinterpret_cast<RingHeader*>(seg.payload() + 4096 + stride() * i); }
};

// Producer: n records, mixing single pushes, batches and short pauses (so the
// consumer sometimes sleeps), ringing the doorbell after each publication.
void produce(RingHeader* h, Doorbell& bell, uint64_t n, uint64_t seed) {
    SpscProducer<CheckedRec> p(h);
    std::mt19937_64 rng(seed);
    CheckedRec batch[32];
    uint64_t seq = p.published();
    const uint64_t end = seq + n;
    while (seq < end) {
        uint64_t r = rng();
        if (r % 3 == 0) {
            if (p.try_push(CheckedRec::make(seq))) {
                ++seq;
                doorbell_ring(bell);
            }
        } else {
            size_t k = std::min<uint64_t>(1 + r % 32, end - seq);
            for (size_t i = 0; i < k; ++i) batch[i] = CheckedRec::make(seq + i);
            size_t pushed = p.push(batch, k);
            seq += pushed;
            if (pushed) doorbell_ring(bell);
        }
        if (r % 4096 == 0) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
}

// Consumer of several rings with one doorbell; returns the number of bad records
// (wrong sequence or checksum) plus lost wake-ups, and counts waits that slept.
uint64_t consume(std::vector<RingHeader*> rings, Doorbell& bell, uint64_t per_ring, uint64_t* sleeps) {
    std::vector<SpscConsumer<CheckedRec>> cs;
    for (RingHeader* h : rings) cs.emplace_back(h);
    uint64_t bad = 0, done = 0;
    std::vector<uint64_t> next(rings.size(), 0);
    CheckedRec buf[16];
    uint64_t iter = 0;
    while (done < per_ring * rings.size()) {
        bool any = false;
        for (size_t i = 0; i < cs.size(); ++i) {
            auto& c = cs[i];
            size_t n = 0;
            switch (iter++ % 3) {
            case 0: {
                CheckedRec r;
                n = c.try_pop(r) ? 1 : 0;
                if (n) bad += !r.valid(next[i]);
                break;
            }
            case 1:
                n = c.pop(buf, 16);
                for (size_t k = 0; k < n; ++k) bad += !buf[k].valid(next[i] + k);
                break;
            default: {
                const CheckedRec* q = c.peek(&n);
                for (size_t k = 0; k < n; ++k) bad += !q[k].valid(next[i] + k);
                c.release(n);
            }
            }
            next[i] += n;
            done += n;
            any |= n > 0;
        }
        if (!any) {
            bool slept = false;
            // The producers are still publishing, so a wait that times out (2 s) is a
            // lost wake-up: counted as a bad record.
            bad += !doorbell_wait(
                bell,
                [&] {
                    for (auto& c : cs)
                        if (c.readable()) return true;
                    slept = true;
                    return false;
                },
                64, 2'000'000'000);
            *sleeps += slept;
        }
    }
    for (size_t i = 0; i < cs.size(); ++i) bad += cs[i].consumed() != per_ring;
    return bad;
}

}  // namespace

TEST(ShmStress, RingTwoThreadsMillionsOfRecords) {
    RingSet rs(1);
    const uint64_t n = scaled(4'000'000);
    uint64_t sleeps = 0, bad = 0;
    std::thread c([&] { bad = consume({rs.ring(0)}, rs.bell(), n, &sleeps); });
    produce(rs.ring(0), rs.bell(), n, 1);
    c.join();
    EXPECT_EQ(bad, 0u);
    EXPECT_EQ(rs.ring(0)->tail.load(), n);
    EXPECT_EQ(rs.ring(0)->head.load(), n);
}

TEST(ShmStress, RingsAcrossProcessesTwoProducersOneDoorbell) {
    RingSet rs(2);
    const uint64_t n = scaled(2'000'000);
    pid_t consumer = fork_run([&] {
        uint64_t sleeps = 0;
        uint64_t bad = consume({rs.ring(0), rs.ring(1)}, rs.bell(), n, &sleeps);
        rs.result(0).store(bad);
        rs.result(1).store(sleeps);
        return bad == 0 ? 0 : 1;
    });
    pid_t p0 = fork_run([&] {
        produce(rs.ring(0), rs.bell(), n, 2);
        return 0;
    });
    pid_t p1 = fork_run([&] {
        produce(rs.ring(1), rs.bell(), n, 3);
        return 0;
    });
    EXPECT_EQ(wait_exit(p0), 0);
    EXPECT_EQ(wait_exit(p1), 0);
    EXPECT_EQ(wait_exit(consumer), 0) << rs.result(0).load() << " bad records";
    EXPECT_EQ(rs.ring(0)->head.load(), n);
    EXPECT_EQ(rs.ring(1)->head.load(), n);
    std::printf("consumer slept %llu times on the doorbell\n", static_cast<unsigned long long>(rs.result(1).load()));
}

// ---------------------------------------------------------------- arena

namespace {

// An arena segment plus per-block test data: an exclusivity tag and 8 words of
// "KV" content that a publisher derives from the block hash.
struct ArenaSet {
    SegmentGuard guard{unique_name("arena")};
    Segment seg;
    ArenaConfig cfg;
    size_t data_off = 0, tag_off = 0;
    ArenaSet(uint32_t n_blocks, uint32_t n_users) {
        cfg.n_blocks = n_blocks;
        cfg.n_users = n_users;
        data_off = (KvArena::bytes(cfg) + 4095) / 4096 * 4096;
        tag_off = data_off + 64ull * n_blocks;
        SegmentOptions o;
        o.payload_bytes = tag_off + 4ull * n_blocks + 4096;
        o.layout_version = 1;
        auto s = Segment::create(guard.name, o);
        if (!s.ok() || !KvArena::init(s->payload(), cfg).ok()) std::abort();
        seg = std::move(*s);
    }
    KvArena view() { return *KvArena::attach(seg.payload()); }
    std::atomic<uint64_t>* data(int32_t b) { return reinterpret_cast<std::atomic<uint64_t>*>(seg.payload() + data_off) + 8 * b; }
    std::atomic<uint32_t>& tag(int32_t b) { return reinterpret_cast<std::atomic<uint32_t>*>(seg.payload() + tag_off)[b]; }
    std::atomic<uint64_t>& errors() { return *reinterpret_cast<std::atomic<uint64_t>*>(seg.payload() + tag_off + 4ull * cfg.n_blocks + 64); }
};

BlockHash key_hash(uint64_t key) { return BlockHash{mix64(key), mix64(key + 1)}; }

// One arena user's random workload: allocate (exclusive: tag check), write content,
// publish into the prefix cache or drop, look cached keys up and verify content,
// hold a few references, release. Returns the number of violated invariants.
uint64_t arena_worker(ArenaSet& as, uint32_t me, uint64_t iters, uint64_t seed) {
    KvArena a = as.view();
    auto u = a.join(ProcRef{me, 1});
    if (!u.ok()) return 1000000;
    std::mt19937_64 rng(seed);
    std::vector<int32_t> held;  // references we hold, exclusive or shared
    std::vector<bool> excl;
    uint64_t bad = 0;
    const uint32_t tagv = me + 1;
    for (uint64_t it = 0; it < iters; ++it) {
        uint64_t r = rng();
        switch (r % 4) {
        case 0:
        case 1: {  // allocate a batch
            int32_t b[8];
            uint32_t n = 1 + (r >> 8) % 8;
            if (!a.alloc(*u, n, b)) break;
            for (uint32_t i = 0; i < n; ++i) {
                if (as.tag(b[i]).exchange(tagv) != 0) ++bad;  // someone else holds it
                held.push_back(b[i]);
                excl.push_back(true);
            }
            break;
        }
        case 2: {  // look up a cached key; verify its content
            uint64_t key = (r >> 8) % 64;
            BlockHash h = key_hash(key);
            int32_t b = a.acquire_cached(*u, h);
            if (b < 0) break;
            for (int k = 0; k < 8; ++k) bad += as.data(b)[k].load(std::memory_order_relaxed) != mix64(h.lo + k);
            held.push_back(b);
            excl.push_back(false);
            break;
        }
        default: {  // release one, publishing it first if exclusive (half the time)
            if (held.empty()) break;
            size_t i = (r >> 8) % held.size();
            int32_t b = held[i];
            if (excl[i]) {
                if (as.tag(b).exchange(0) != tagv) ++bad;
                if ((r >> 20) & 1) {
                    BlockHash h = key_hash((r >> 24) % 64);
                    for (int k = 0; k < 8; ++k) as.data(b)[k].store(mix64(h.lo + k), std::memory_order_relaxed);
                    a.publish(*u, b, h);
                }
            }
            a.unref(*u, b);
            held[i] = held.back();
            held.pop_back();
            excl[i] = excl.back();
            excl.pop_back();
        }
        }
        if (held.size() > 24) {  // keep the arena under pressure, not exhausted
            for (size_t i = 0; i < held.size(); ++i) {
                if (excl[i] && as.tag(held[i]).exchange(0) != tagv) ++bad;
                a.unref(*u, held[i]);
            }
            held.clear();
            excl.clear();
        }
    }
    for (size_t i = 0; i < held.size(); ++i) {
        if (excl[i] && as.tag(held[i]).exchange(0) != tagv) ++bad;
        a.unref(*u, held[i]);
    }
    a.leave(*u);
    return bad;
}

void expect_quiescent_arena(ArenaSet& as) {
    KvArena a = as.view();
    ArenaCensus c = a.census();
    EXPECT_EQ(c.held, 0u);
    EXPECT_EQ(c.free + c.cached, c.total);
    EXPECT_GT(c.cached, 0u) << "the workload should leave cached blocks";
    EXPECT_EQ(a.unindexed_free(), 0u) << "free blocks missing from the free index";
    for (uint32_t u = 0; u < kArenaMaxUsers; ++u) EXPECT_EQ(c.refs_by_user[u], 0u);
}

}  // namespace

TEST(ShmStress, ArenaAndPrefixCacheFourThreads) {
    ArenaSet as(96, 4);  // small: eviction and contention on every block
    std::vector<std::thread> ts;
    std::vector<uint64_t> bad(4);
    for (uint32_t t = 0; t < 4; ++t)
        ts.emplace_back([&, t] { bad[t] = arena_worker(as, t, scaled(200'000), 10 + t); });
    for (auto& t : ts) t.join();
    for (uint32_t t = 0; t < 4; ++t) EXPECT_EQ(bad[t], 0u) << "thread " << t;
    expect_quiescent_arena(as);
}

TEST(ShmStress, ArenaAndPrefixCacheFourProcesses) {
    ArenaSet as(96, 4);
    std::vector<pid_t> ps;
    for (uint32_t t = 0; t < 4; ++t)
        ps.push_back(fork_run([&, t] {
            uint64_t b = arena_worker(as, t, scaled(200'000), 20 + t);
            as.errors().fetch_add(b);
            return b == 0 ? 0 : 1;
        }));
    for (pid_t p : ps) EXPECT_EQ(wait_exit(p), 0);
    EXPECT_EQ(as.errors().load(), 0u);
    expect_quiescent_arena(as);
}

// ---------------------------------------------------------------- request table

TEST(ShmStress, RequestTableRacingTransitionsHappenExactlyOnce) {
    RequestTableConfig cfg;
    cfg.n_slots = 16;
    cfg.max_tokens = 64;
    std::vector<uint8_t> mem(RequestTable::bytes(cfg) + 64);
    void* p = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(mem.data()) + 63) / 64 * 64);
    ASSERT_TRUE(RequestTable::init(p, cfg).ok());
    const uint64_t iters = scaled(100'000);
    struct Event {
        uint32_t slot, gen;
        ReqState from, to;
    };
    std::vector<std::vector<Event>> logs(4);
    std::vector<std::thread> ts;
    for (uint32_t t = 0; t < 4; ++t)
        ts.emplace_back([&, t] {
            RequestTable tab = *RequestTable::attach(p);
            std::mt19937_64 rng(t);
            ProcRef me{t, 1};
            int32_t prompt[4] = {1, 2, 3, 4};
            static const std::pair<ReqState, ReqState> moves[] = {
                {ReqState::Queued, ReqState::Prefilling},   {ReqState::Prefilling, ReqState::Decoding},
                {ReqState::Decoding, ReqState::Finished},   {ReqState::Decoding, ReqState::Queued},
                {ReqState::Queued, ReqState::Cancelled},    {ReqState::Prefilling, ReqState::Failed},
                {ReqState::Finished, ReqState::Free},       {ReqState::Cancelled, ReqState::Free},
                {ReqState::Failed, ReqState::Free},         {ReqState::Decoding, ReqState::Finished},
                {ReqState::Finished, ReqState::Free},       {ReqState::Prefilling, ReqState::Decoding}};
            for (uint64_t i = 0; i < iters; ++i) {
                uint64_t r = rng();
                if (r % 5 == 0) {
                    auto q = tab.submit(me, prompt, 4, nullptr, 0);
                    if (q.ok()) logs[t].push_back({q->slot, q->gen, ReqState::Free, ReqState::Queued});
                    continue;
                }
                ReqRef ref = tab.current(static_cast<uint32_t>((r >> 8) % cfg.n_slots));
                auto [from, to] = moves[(r >> 16) % std::size(moves)];
                if (tab.transition(ref, from, to, me)) logs[t].push_back({ref.slot, ref.gen, from, to});
            }
        });
    for (auto& t : ts) t.join();
    // Per request (slot, gen): the transitions, ordered by following from -> to,
    // must form one chain from FREE, each state left at most once.
    std::map<std::pair<uint32_t, uint32_t>, std::vector<Event>> by_req;
    size_t total = 0;
    for (auto& l : logs)
        for (auto& e : l) {
            by_req[{e.slot, e.gen}].push_back(e);
            ++total;
        }
    EXPECT_GT(total, iters / 10);
    // Each request is one token moving along its transitions: every state is left at
    // most as often as it was entered, and the token is in exactly one place at the
    // end (a state, or FREE again). A transition that happened twice breaks this.
    for (auto& [k, evs] : by_req) {
        std::map<ReqState, int> leaves, enters;
        for (auto& e : evs) {
            ++leaves[e.from];
            ++enters[e.to];
        }
        EXPECT_EQ(leaves[ReqState::Free], 1) << "slot " << k.first << " gen " << k.second;
        int open = 0;
        for (int s = 1; s <= 6; ++s) {
            auto st = static_cast<ReqState>(s);
            EXPECT_LE(leaves[st], enters[st]) << req_state_name(st) << " (slot " << k.first << " gen " << k.second << ")";
            open += enters[st] - leaves[st];
        }
        EXPECT_EQ(open + enters[ReqState::Free], 1) << "slot " << k.first << " gen " << k.second;
    }
}
