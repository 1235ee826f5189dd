// Kill tests: a victim process runs a random mix of every shm operation (arena
// alloc / ref / unref / publish / cached lookup, request submit and transitions,
// ring push and pop, registry claim) and is SIGKILLed at a random instant, hundreds
// of times, while a survivor process works alongside. After each death the parent
// recovers as the front would (registry, arena, request table) and checks that
// nothing the victim held is left behind; at the end every block is accounted for
// exactly (free + cached + held by the survivor = total), no ring is wedged (a
// last victim runs to completion), the survivor saw every ring record once and in
// order, and the request table is empty.
#include <signal.h>
#include <time.h>

#include <random>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "shm/doorbell.h"
#include "shm/instance.h"
#include "shm_test_util.h"

using namespace duet::shm;
using namespace duet::shm::testing;

namespace {

enum Op : uint32_t { kIdle, kClaim, kJoin, kAlloc, kRef, kUnref, kPublish, kLookup, kSubmit, kTransition, kPush, kPop, kNumOps };
const char* const kOpNames[] = {"idle",    "claim",  "join",   "alloc",      "ref",  "unref",
                                "publish", "lookup", "submit", "transition", "push", "pop"};

struct Control {
    std::atomic<uint32_t> cur_op;     // what the victim is doing now
    std::atomic<uint32_t> stop;       // survivor: 1 pause and report, 2 release and exit
    std::atomic<uint32_t> paused;
    std::atomic<uint64_t> survivor_refs;
    std::atomic<uint64_t> errors;     // invariant violations seen by any child
    std::atomic<uint64_t> survivor_ops;
    std::atomic<uint64_t> ring0_verified;
    std::atomic<uint64_t> victim_clean_ops;
    std::atomic<uint32_t> victim_ready;  // the victim has claimed its slot and joined the arena
};

struct World {
    InstanceConfig cfg;
    Instance inst;
    SegmentGuard ctl_guard{unique_name("killctl")};
    Segment ctl_seg;
    Control* ctl = nullptr;
    std::atomic<uint64_t>* data = nullptr;  // 8 words of content per block

    World() {
        cfg.name = unique_name("kill");
        cfg.registry_slots = 8;
        cfg.n_rings = 2;
        cfg.ring_capacity = 256;
        cfg.ring_record_bytes = 64;
        cfg.requests.n_slots = 16;
        cfg.requests.max_tokens = 64;
        cfg.arenas.push_back(ArenaConfig{128, 4, 0});
        auto in = Instance::create(cfg);
        if (!in.ok()) std::abort();
        inst = std::move(*in);
        SegmentOptions o;
        o.payload_bytes = 4096 + 64 * 128;
        auto s = Segment::create(ctl_guard.name, o);
        if (!s.ok()) std::abort();
        ctl_seg = std::move(*s);
        ctl = new (ctl_seg.payload()) Control{};
        data = reinterpret_cast<std::atomic<uint64_t>*>(ctl_seg.payload() + 4096);
    }
    ~World() { Instance::unlink(cfg.name); }
};

BlockHash key_hash(uint64_t key) { return BlockHash{mix64(key), mix64(key + 7)}; }

// The victim: never returns when clean_ops == 0 (it is killed); otherwise runs that
// many operations, releases everything and exits.
int victim(World& w, uint64_t seed, uint64_t clean_ops) {
    Control& c = *w.ctl;
    Registry& reg = w.inst.registry();
    KvArena arena = w.inst.arena(0);
    RequestTable req = w.inst.requests();
    c.cur_op.store(kClaim, std::memory_order_relaxed);
    auto me = reg.claim(Role::Tool, -1, getpid());
    if (!me.ok()) return 3;
    reg.set_running(*me);
    c.cur_op.store(kJoin, std::memory_order_relaxed);
    auto u = arena.join(*me);
    if (!u.ok()) return 4;
    c.victim_ready.store(1, std::memory_order_relaxed);
    SpscProducer<CheckedRec> out(w.inst.ring(0));
    SpscConsumer<CheckedRec> in(w.inst.ring(1));
    Doorbell& survivor_bell = reg.doorbell(0);
    std::mt19937_64 rng(seed);
    std::vector<int32_t> held;
    std::vector<ReqRef> mine;
    int32_t prompt[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    for (uint64_t it = 0; clean_ops == 0 || it < clean_ops; ++it) {
        uint64_t r = rng();
        uint64_t kind = r % 11;
        if (held.size() > 48) kind = 2;  // keep the victim's holdings bounded
        switch (kind) {
        case 0:
        case 10: {
            c.cur_op.store(kAlloc, std::memory_order_relaxed);
            int32_t b[4];
            uint32_t n = 1 + (r >> 8) % 4;
            if (arena.alloc(*u, n, b)) held.insert(held.end(), b, b + n);
            break;
        }
        case 1:
            c.cur_op.store(kRef, std::memory_order_relaxed);
            if (!held.empty()) {
                int32_t b = held[(r >> 8) % held.size()];
                if (arena.ref(*u, b)) held.push_back(b);
            }
            break;
        case 2:
            c.cur_op.store(kUnref, std::memory_order_relaxed);
            if (!held.empty()) {
                size_t i = (r >> 8) % held.size();
                arena.unref(*u, held[i]);
                held[i] = held.back();
                held.pop_back();
            }
            break;
        case 3:
            c.cur_op.store(kPublish, std::memory_order_relaxed);
            if (!held.empty()) {
                int32_t b = held[(r >> 8) % held.size()];
                if (arena.refcount(b) == 1 && !arena.cached(b)) {  // ours alone: content can be written
                    BlockHash h = key_hash((r >> 16) % 32);
                    for (int k = 0; k < 8; ++k) w.data[8 * b + k].store(mix64(h.lo + k), std::memory_order_relaxed);
                    arena.publish(*u, b, h);
                }
            }
            break;
        case 4: {
            c.cur_op.store(kLookup, std::memory_order_relaxed);
            BlockHash h = key_hash((r >> 8) % 32);
            int32_t b = arena.acquire_cached(*u, h);
            if (b >= 0) {
                for (int k = 0; k < 8; ++k)
                    if (w.data[8 * b + k].load(std::memory_order_relaxed) != mix64(h.lo + k)) c.errors.fetch_add(1);
                held.push_back(b);
            }
            break;
        }
        case 5:
            c.cur_op.store(kSubmit, std::memory_order_relaxed);
            if (mine.size() < 4) {
                auto q = req.submit(*me, prompt, 8, nullptr, 0);
                if (q.ok()) mine.push_back(*q);
            }
            break;
        case 6:
            c.cur_op.store(kTransition, std::memory_order_relaxed);
            if (!mine.empty()) {
                size_t i = (r >> 8) % mine.size();
                ReqRef q = mine[i];
                ReqState s = req.state(q.slot);
                static const ReqState next[] = {ReqState::Free,     ReqState::Prefilling, ReqState::Decoding,
                                                ReqState::Finished, ReqState::Free,       ReqState::Free,
                                                ReqState::Free};
                ReqState to = next[static_cast<int>(s)];
                if (s == ReqState::Decoding) {
                    int32_t t = static_cast<int32_t>(r);
                    (void)req.append_output(q, &t, 1);
                }
                (void)req.transition(q, s, to, *me);
                if (to == ReqState::Free) {
                    mine[i] = mine.back();
                    mine.pop_back();
                }
            }
            break;
        case 7:
        case 8: {
            c.cur_op.store(kPush, std::memory_order_relaxed);
            CheckedRec batch[4];
            uint64_t seq = out.published();
            uint32_t n = 1 + (r >> 8) % 4;
            for (uint32_t i = 0; i < n; ++i) batch[i] = CheckedRec::make(seq + i);
            if (out.push(batch, n)) doorbell_ring(survivor_bell);
            break;
        }
        default: {
            c.cur_op.store(kPop, std::memory_order_relaxed);
            size_t n = 0;
            const CheckedRec* q = in.peek(&n);
            n = std::min<size_t>(n, 4);
            for (size_t i = 0; i < n; ++i)
                if (!q[i].valid(in.consumed() + i)) c.errors.fetch_add(1);
            in.release(n);
        }
        }
        c.cur_op.store(kIdle, std::memory_order_relaxed);
    }
    // A clean exit: give everything back.
    for (int32_t b : held) arena.unref(*u, b);
    for (ReqRef q : mine) {
        ReqState s = req.state(q.slot);
        if (s == ReqState::Queued || s == ReqState::Prefilling || s == ReqState::Decoding)
            (void)req.transition(q, s, ReqState::Cancelled);
        s = req.state(q.slot);
        (void)req.transition(q, s, ReqState::Free);
    }
    arena.leave(*u);
    reg.release(*me);
    c.victim_clean_ops.store(clean_ops);
    return 0;
}

// The survivor: registry slot 0, arena user of its own; consumes ring 0 (verifying
// every record), produces ring 1, and allocates / looks up blocks, until told to stop.
int survivor(World& w) {
    Control& c = *w.ctl;
    Registry& reg = w.inst.registry();
    KvArena arena = w.inst.arena(0);
    auto me = reg.claim(Role::Tool, -1, getpid());
    if (!me.ok() || me->slot != 0) return 3;
    reg.set_running(*me);
    auto u = arena.join(*me);
    if (!u.ok()) return 4;
    SpscConsumer<CheckedRec> in(w.inst.ring(0));
    SpscProducer<CheckedRec> out(w.inst.ring(1));
    std::mt19937_64 rng(99);
    std::vector<int32_t> held;
    auto drain = [&] {
        size_t n = 0;
        const CheckedRec* q = in.peek(&n);
        for (size_t i = 0; i < n; ++i)
            if (!q[i].valid(in.consumed() + i)) c.errors.fetch_add(1);
        in.release(n);
        return n;
    };
    while (c.stop.load(std::memory_order_acquire) == 0) {  // pairs with the parent's release store
        uint64_t r = rng();
        drain();
        CheckedRec rec = CheckedRec::make(out.published());
        out.try_push(rec);
        if (r % 3 == 0 && held.size() < 16) {
            int32_t b[2];
            if (arena.alloc(*u, 2, b)) held.insert(held.end(), b, b + 2);
        } else if (r % 3 == 1 && !held.empty()) {
            arena.unref(*u, held.back());
            held.pop_back();
        } else {
            BlockHash h = key_hash((r >> 8) % 32);
            int32_t b = arena.acquire_cached(*u, h);
            if (b >= 0) {
                for (int k = 0; k < 8; ++k)
                    if (w.data[8 * b + k].load(std::memory_order_relaxed) != mix64(h.lo + k)) c.errors.fetch_add(1);
                held.push_back(b);
            }
        }
        c.survivor_ops.fetch_add(1, std::memory_order_relaxed);
        if (!in.readable()) doorbell_wait(reg.doorbell(0), [&] { return in.readable(); }, 32, 200'000);
    }
    c.survivor_refs.store(held.size());
    // Release pairs with the parent's acquire load of paused: survivor_refs is set.
    c.paused.store(1, std::memory_order_release);
    while (c.stop.load(std::memory_order_acquire) != 2) std::this_thread::sleep_for(std::chrono::microseconds(100));
    while (drain()) {
    }
    c.ring0_verified.store(in.consumed());
    for (int32_t b : held) arena.unref(*u, b);
    arena.leave(*u);
    reg.release(*me);
    return 0;
}

// What the front does when a worker dies: Instance::recover(), then (as the front
// that now owns them) cancel and free the requests it was handed. Every tenth time
// a recoverer process is started first and SIGKILLed part-way, and the front
// resumes from Registry::dead_slots(): recovery must be idempotent.
void recover(World& w, pid_t pid, ProcRef front, bool redrive, std::mt19937_64& rng, RecoveryReport* total,
             int* interrupted) {
    Registry& reg = w.inst.registry();
    RequestTable& req = w.inst.requests();
    std::vector<ProcRef> dead;
    for (uint32_t s = 0; s < reg.n_slots(); ++s)
        if (reg.pid(s) == pid && reg.state(s) != ProcState::Free) dead.push_back(reg.current(s));
    if (!dead.empty() && rng() % 10 == 0) {
        ProcRef d = dead[0];
        pid_t rec = fork_run([&] { return w.inst.recover(d, front, redrive).ok() ? 0 : 1; });
        std::this_thread::sleep_for(std::chrono::microseconds(rng() % 300));
        kill(rec, SIGKILL);
        wait_exit(rec);
        ++*interrupted;
        // What a restarted front does: mark the deaths nobody saw, then recover every
        // slot left DEAD (including one whose recovery was cut short).
        reg.sweep_dead();
        dead = reg.dead_slots();
    }
    for (ProcRef d : dead) {
        auto r = w.inst.recover(d, front, redrive);
        ASSERT_TRUE(r.ok()) << r.error().message;
        *total += *r;
        auto again = w.inst.recover(d, front, redrive);  // a second recoverer finds nothing
        ASSERT_TRUE(again.ok());
        EXPECT_EQ(again->refs_dropped + again->redriven + again->failed + again->adopted + again->unreserved, 0u);
        EXPECT_TRUE(req.owned_by(d.slot).empty());
        EXPECT_EQ(w.inst.arena(0).user_of(d), -1);
        EXPECT_EQ(reg.state(d.slot), ProcState::Free);
    }
    EXPECT_TRUE(reg.dead_slots().empty());
    // The front serves or drops what it was handed; here it drops everything.
    for (ReqRef q : req.owned_by(front.slot)) {
        ReqState st = req.state(q.slot);
        if (st == ReqState::Queued) {
            ASSERT_TRUE(req.transition(q, st, ReqState::Cancelled));
            st = ReqState::Cancelled;
        }
        ASSERT_TRUE(req.transition(q, st, ReqState::Free)) << req_state_name(st);
    }
}

}  // namespace

TEST(ShmKill, RandomSigkillsLoseNothing) {
    World w;
    pid_t surv = fork_run([&] { return survivor(w); });
    ChildReaper reaper{{&surv}};
    ASSERT_TRUE(wait_until([&] { return w.inst.registry().state(0) == ProcState::Running; })) << "the survivor started";
    auto front = w.inst.registry().claim(Role::Front, -1, getpid());
    ASSERT_TRUE(front.ok());
    w.inst.registry().set_running(*front);

    // At least min_kills, and on until every operation of interest has been hit a few
    // times (a slow build, e.g. under a sanitizer, spends longer starting up).
    const int min_kills = static_cast<int>(scaled(300));
    const int max_kills = 4 * min_kills;
    const Op wanted[] = {kAlloc, kUnref, kPush, kPop, kTransition, kSubmit};
    std::mt19937_64 rng(12345);
    uint64_t at_op[kNumOps] = {};
    RecoveryReport total;
    int interrupted = 0;
    auto covered = [&] {
        for (Op o : wanted)
            if (at_op[o] < 3) return false;
        return true;
    };
    int kills = 0;
    for (int k = 0; k < max_kills && (k < min_kills || !covered()); ++k, ++kills) {
        w.ctl->victim_ready.store(0);
        pid_t v = fork_run([&, k] { return victim(w, 1000 + k, 0); });
        if (k % 5 != 0) {  // mostly in the steady state; every fifth at start-up (claim, join)
            for (int i = 0; i < 20000 && !w.ctl->victim_ready.load(); ++i)
                std::this_thread::sleep_for(std::chrono::microseconds(50));
        }
        std::this_thread::sleep_for(std::chrono::microseconds(rng() % 2000));
        kill(v, SIGKILL);
        ASSERT_EQ(wait_exit(v), 128 + SIGKILL) << "victim " << k << " exited on its own";
        ++at_op[w.ctl->cur_op.load()];
        recover(w, v, *front, k % 2 == 0, rng, &total, &interrupted);
        if (::testing::Test::HasFatalFailure()) return;
        ASSERT_EQ(w.ctl->errors.load(), 0u) << "after kill " << k;
    }
    std::string hist;
    for (uint32_t o = 0; o < kNumOps; ++o) hist += std::string(kOpNames[o]) + "=" + std::to_string(at_op[o]) + " ";
    std::printf("%d kills; killed inside: %s\nrecovery dropped %llu references, re-drove %u requests, failed %u, "
                "adopted %u, undid %u half-made submissions; %d recoverers killed part-way\n",
                kills, hist.c_str(), static_cast<unsigned long long>(total.refs_dropped), total.redriven, total.failed,
                total.adopted, total.unreserved, interrupted);
    // Kills landed inside each kind of operation (the victim marks the one it is in).
    for (Op o : wanted) EXPECT_GE(at_op[o], 3u) << kOpNames[o];
    EXPECT_GT(total.refs_dropped, 0u);
    EXPECT_GT(total.redriven, 0u);
    EXPECT_GT(total.failed, 0u);
    EXPECT_GT(interrupted, 0);

    // No ring is wedged, nothing is stuck: one more victim runs to completion.
    pid_t last = fork_run([&] { return victim(w, 7, 20000); });
    EXPECT_EQ(wait_exit(last), 0);
    EXPECT_EQ(w.ctl->victim_clean_ops.load(), 20000u);

    // Pause the survivor and account for every block exactly.
    w.ctl->stop.store(1, std::memory_order_release);  // pairs with the survivor's acquire
    // Acquire pairs with the survivor's release store of paused.
    ASSERT_TRUE(wait_until([&] { return w.ctl->paused.load(std::memory_order_acquire) != 0; })) << "the survivor paused";
    KvArena& arena = w.inst.arena(0);
    ArenaCensus c = arena.census();
    int32_t su = arena.user_of(w.inst.registry().current(0));
    ASSERT_GE(su, 0);
    EXPECT_EQ(c.free + c.cached + c.held, c.total);
    EXPECT_EQ(c.refs_by_user[su], w.ctl->survivor_refs.load()) << "the survivor's references, exactly";
    for (uint32_t u = 0; u < kArenaMaxUsers; ++u)
        if (static_cast<int32_t>(u) != su) {
            EXPECT_EQ(c.refs_by_user[u], 0u) << "user " << u;
        }
    EXPECT_EQ(arena.unindexed_free(), 0u);
    EXPECT_GT(w.ctl->survivor_ops.load(), 0u);

    w.ctl->stop.store(2, std::memory_order_release);
    EXPECT_EQ(wait_exit(surv), 0);
    surv = 0;
    c = arena.census();
    EXPECT_EQ(c.held, 0u);
    EXPECT_EQ(c.free + c.cached, c.total);
    EXPECT_EQ(arena.unindexed_free(), 0u);
    // Every record the victims published was seen by the survivor, once, in order.
    EXPECT_EQ(w.ctl->ring0_verified.load(), w.inst.ring(0)->tail.load());
    EXPECT_EQ(w.ctl->errors.load(), 0u);
    for (uint32_t s = 0; s < w.inst.requests().n_slots(); ++s)
        EXPECT_EQ(w.inst.requests().state(s), ReqState::Free) << "request slot " << s;
    for (uint32_t s = 0; s < w.inst.registry().n_slots(); ++s)
        if (s != front->slot) {
            EXPECT_EQ(w.inst.registry().state(s), ProcState::Free) << "registry slot " << s;
        }
}
