// The engine's seams, without a model or processes: the KV cache manager (blocks a
// pass needs, taken before it runs, all or nothing; "no room" an error of its own
// kind) and the decode victim policy.
#include <gtest/gtest.h>

#include <vector>

#include "engine/decode_policy.h"
#include "engine/kv_cache_manager.h"
#include "engine/prefill_scheduler.h"

using namespace duet;

namespace {

std::unique_ptr<KvPool> pool_of(int32_t blocks) {
    KvLayout l;
    l.n_layer = 2;
    l.n_head_kv = 1;
    l.head_dim = 4;
    l.block_tokens = 16;
    return std::move(KvPool::create(l, blocks)).value();
}

std::vector<int32_t> toks(int n) { return std::vector<int32_t>(static_cast<size_t>(n), 1); }

}  // namespace

TEST(KvCacheManager, CountsNewAndCopyOnWriteBlocks) {
    auto pool = pool_of(16);
    KvSeq s;
    EXPECT_EQ(blocks_to_append(*pool, s, 0), 0);
    EXPECT_EQ(blocks_to_append(*pool, s, 1), 1);
    EXPECT_EQ(blocks_to_append(*pool, s, 16), 1);
    EXPECT_EQ(blocks_to_append(*pool, s, 17), 2);
    ASSERT_TRUE(s.prepare_append(*pool, 0, 20).ok());
    s.set_n_tokens(20);
    EXPECT_EQ(blocks_to_append(*pool, s, 12), 0);  // the partial block has room
    EXPECT_EQ(blocks_to_append(*pool, s, 13), 1);
    // A fork shares the partial block: appending writes into it, so it is copied.
    KvSeq f = s.fork(*pool);
    EXPECT_EQ(blocks_to_append(*pool, f, 1), 1);
    EXPECT_EQ(blocks_to_append(*pool, f, 13), 2);
    EXPECT_EQ(blocks_to_append(*pool, f, 0), 0);
    // At a block boundary nothing shared is written.
    KvSeq g;
    ASSERT_TRUE(g.prepare_append(*pool, 0, 32).ok());
    g.set_n_tokens(32);
    KvSeq h = g.fork(*pool);
    EXPECT_EQ(blocks_to_append(*pool, h, 1), 1);
    for (KvSeq* x : {&s, &f, &g, &h}) x->release(*pool);
    EXPECT_EQ(pool->allocator().n_free(), 16);
}

// reserve() takes every entry's blocks before the pass, or none: a shortage is an
// Error of kind NoKvBlocks naming the counts, with the arena as it was.
TEST(KvCacheManager, ReservesAllOrNothingAndSaysNoRoom) {
    auto pool = pool_of(5);
    KvCacheManager m(*pool);
    KvSeq a, b, c;
    auto ta = toks(40), tb = toks(40), tc = toks(40);
    std::vector<SeqBatch> pass = {{&a, ta.data(), 33, false}, {&b, tb.data(), 17, false}};  // 3 + 2 blocks
    ASSERT_TRUE(m.reserve(pass).ok());
    EXPECT_EQ(m.free_blocks(), 0);
    EXPECT_EQ(a.blocks().size(), 3u);
    EXPECT_EQ(a.n_tokens(), 0);  // reserved, not yet valid: the pass sets the length
    // A second reservation finds no room: kind NoKvBlocks, nothing taken.
    std::vector<SeqBatch> more = {{&c, tc.data(), 1, false}};
    Status st = m.reserve(more);
    ASSERT_FALSE(st.ok());
    EXPECT_EQ(st.kind(), ErrorKind::NoKvBlocks);
    EXPECT_NE(st.error().message.find("needs 1 KV blocks, 0 of 5 are free"), std::string::npos) << st.error().message;
    EXPECT_TRUE(c.blocks().empty());
    // unreserve gives back what the positions never written hold.
    m.unreserve(pass);
    EXPECT_EQ(m.free_blocks(), 5);
    EXPECT_TRUE(a.blocks().empty());
    // Reserving again for a pass that already has its blocks takes nothing more.
    ASSERT_TRUE(m.reserve(pass).ok());
    ASSERT_TRUE(m.reserve(pass).ok());
    EXPECT_EQ(m.free_blocks(), 0);
    // Too much at once: refused before anything is allocated.
    m.unreserve(pass);
    std::vector<SeqBatch> big = {{&a, ta.data(), 40, false}, {&b, tb.data(), 40, false}};  // 3 + 3 > 5
    Status s2 = m.reserve(big);
    EXPECT_EQ(s2.kind(), ErrorKind::NoKvBlocks);
    EXPECT_EQ(m.free_blocks(), 5);
    EXPECT_TRUE(a.blocks().empty() && b.blocks().empty());
    for (KvSeq* x : {&a, &b, &c}) x->release(*pool);
}

// An Error's kind defaults to Other and travels with it.
TEST(ErrorKinds, AreCarriedByStatusAndResult) {
    Status plain = make_error("x {}", 1);
    EXPECT_EQ(plain.kind(), ErrorKind::Other);
    Status dev = make_error(ErrorKind::Device, "CUDA: {}", "boom");
    EXPECT_EQ(dev.kind(), ErrorKind::Device);
    EXPECT_EQ(dev.error().message, "CUDA: boom");
    Result<int> r = make_error(ErrorKind::NoKvBlocks, "none");
    EXPECT_EQ(r.error().kind, ErrorKind::NoKvBlocks);
    // KvSeq::prepare_append's shortage is NoKvBlocks too.
    auto pool = pool_of(1);
    KvSeq s;
    Status p = s.prepare_append(*pool, 0, 17);
    EXPECT_EQ(p.kind(), ErrorKind::NoKvBlocks);
    s.release(*pool);
}

TEST(DecodePolicy, TheNewestGivesWay) {
    struct Case {
        std::vector<DecodeSeqView> seqs;
        size_t victim;
    };
    const std::vector<Case> cases = {
        {{}, SIZE_MAX},
        {{{7, 100}}, 0},
        {{{1, 10}, {5, 10}, {3, 900}}, 1},          // not the longest: the latest admitted
        {{{9, 10}, {2, 10}, {4, 10}}, 0},           // wherever it sits in the batch
        {{{4, 10}, {4, 20}}, 1},                        // a tie: the later index
    };
    for (size_t i = 0; i < cases.size(); ++i) EXPECT_EQ(pick_decode_victim(cases[i].seqs), cases[i].victim) << i;
}

// Classes first: the least urgent class gives way, the newest of it; a more urgent
// sequence is never chosen while a less urgent one runs.
TEST(DecodePolicy, TheLeastUrgentClassGivesWayFirst) {
    struct Case {
        std::vector<DecodeSeqView> seqs;
        size_t victim;
    };
    const std::vector<Case> cases = {
        {{{1, 10, 2}, {5, 10, 1}, {9, 10, 0}}, 0},  // the batch one, though the oldest
        {{{1, 10, 2}, {3, 10, 2}, {9, 10, 1}}, 1},  // of two batch ones, the newer
        {{{8, 10, 0}, {2, 10, 1}}, 1},              // standard before critical
        {{{4, 10, 0}, {6, 10, 0}}, 1},              // one class: the newest, as before
    };
    for (size_t i = 0; i < cases.size(); ++i) EXPECT_EQ(pick_decode_victim(cases[i].seqs), cases[i].victim) << i;
}

// A full batch gives a slot only to a hand-off of a strictly more urgent class: the
// least urgent, newest sequence of a less urgent class; never one of the incoming
// request's class or a more urgent one (no thrash between equals).
TEST(DecodePolicy, AFullBatchGivesASlotOnlyToAMoreUrgentClass) {
    struct Case {
        std::vector<DecodeSeqView> seqs;
        uint32_t incoming;
        size_t victim;
    };
    const std::vector<Case> cases = {
        {{}, 0, SIZE_MAX},
        {{{1, 10, 2}, {5, 10, 1}}, 0, 0},            // critical in: the batch one goes
        {{{1, 10, 2}, {3, 10, 2}}, 1, 1},            // standard in: the newer batch one
        {{{1, 10, 1}, {3, 10, 1}}, 1, SIZE_MAX},     // standard in, standard running: waits
        {{{1, 10, 1}, {3, 10, 0}}, 1, SIZE_MAX},     // standard in, standard and critical running: waits
        {{{1, 10, 0}, {3, 10, 0}}, 0, SIZE_MAX},     // critical among critical: waits
        {{{1, 10, 2}, {3, 10, 0}}, 2, SIZE_MAX},     // batch in: never displaces anyone
        {{{1, 10, 1}, {3, 10, 2}, {2, 10, 2}}, 0, 1},  // the least urgent class, its newest
    };
    for (size_t i = 0; i < cases.size(); ++i)
        EXPECT_EQ(pick_slot_victim(cases[i].seqs, cases[i].incoming), cases[i].victim) << i;
}

// Swap or recompute, by cost: 2 x bytes over the swap rate against tokens over the
// prefill rate (the figures of the CPU here and of a fast GPU, worked by hand).
TEST(DecodePolicy, AVictimIsSwappedWhenCopyingItsKvBackCostsLessThanComputingIt) {
    const uint64_t kv_per_token = 23040;  // the default model, f16: 30 layers x 2 x 3 heads x 64 x 2 bytes
    // CPU: 256 tokens are 5.9 MB; at 1 GB/s, 11.8 ms against 569 ms at 450 tokens/s.
    EXPECT_EQ(choose_preemption(256 * kv_per_token, 256, 1e9, 450), PreemptMode::Swap);
    // A GPU at 60,000 tokens/s: 4.3 ms of recompute against 11.8 ms of swap at 1 GB/s,
    // and 2.4 ms of swap at 5 GB/s.
    EXPECT_EQ(choose_preemption(256 * kv_per_token, 256, 1e9, 60000), PreemptMode::Recompute);
    EXPECT_EQ(choose_preemption(256 * kv_per_token, 256, 5e9, 60000), PreemptMode::Swap);
    // A tie recomputes (nothing on disk to clean up).
    EXPECT_EQ(choose_preemption(1000, 1, 2000, 1), PreemptMode::Recompute);
    // Swap off (or impossible here): recompute; the prefill rate not measured yet: swap.
    EXPECT_EQ(choose_preemption(256 * kv_per_token, 256, 0, 450), PreemptMode::Recompute);
    EXPECT_EQ(choose_preemption(256 * kv_per_token, 256, 1e9, 0), PreemptMode::Swap);
    EXPECT_EQ(choose_preemption(0, 0, 1e9, 450), PreemptMode::Recompute);  // nothing to keep
}

namespace {

PrefillJobView job(uint64_t deadline, int64_t remaining, bool looked_up = true, bool follows = false) {
    return {deadline, remaining, looked_up, follows};
}
// A job whose prompt may not end in this pass (kv_split: no room where it goes).
PrefillJobView no_end(uint64_t deadline, int64_t remaining) {
    PrefillJobView v = job(deadline, remaining);
    v.may_end = false;
    return v;
}

}  // namespace

// The prefill plan: earliest deadline first (ties in arrival order), the budget
// shared in that order, followers left out, one request after a shortage, and a
// prefix lookup asked for exactly when the budget reaches a job not yet looked up.
// Prefill's KV-shortage policy, each branch a row: the expected action written out
// from the policy's statement (engine/prefill_scheduler.h).
TEST(PrefillScheduler, ShortageTable) {
    using A = PrefillShortage::Action;
    constexpr uint64_t kWait = 1000;
    // held, need, own blocks, client waits, waited
    const PrefillKvView idle{0, 4, true, true, 0}, holding{3, 4, true, true, 0}, given{3, 4, false, true, 0};
    struct Case {
        const char* what;
        std::vector<PrefillKvView> jobs;
        std::vector<size_t> pass;
        PrefillArenaView arena;
        A action;
        std::vector<size_t> set_aside;
    };
    // clang-format off
    const std::vector<Case> cases = {
        {"several in the pass: shrink to one", {idle, idle, idle}, {0, 2}, {10, 0}, A::Shrink, {}},
        {"alone, others hold blocks: they give them back", {holding, idle, holding}, {1}, {10, 0}, A::SetAside, {0, 2}},
        {"alone, the only holder is itself: nothing to set aside", {holding}, {0}, {10, 0}, A::Wait, {}},
        {"alone, others hold their client's blocks only: kept", {given, idle}, {1}, {10, 0}, A::Wait, {}},
        {"alone, it waited its limit", {{0, 4, true, true, kWait}}, {0}, {10, 0}, A::Fail, {}},
        {"alone, just short of its limit", {{0, 4, true, true, kWait - 1}}, {0}, {10, 0}, A::Wait, {}},
        {"alone, bigger than the arena", {{0, 11, true, true, 0}}, {0}, {10, 0}, A::Fail, {}},
        {"alone, bigger than what others' kept blocks leave", {given, {0, 8, true, true, 0}}, {1}, {10, 0}, A::Fail, {}},
        {"alone, fits beside them exactly", {given, {0, 7, true, true, 0}}, {1}, {10, 0}, A::Wait, {}},
        {"alone, nobody else holds a block: waiting cannot help", {idle}, {0}, {10, 10}, A::Fail, {}},
        {"alone, a context's computation: its store evicts instead", {{0, 4, true, false, 0}}, {0}, {10, 0}, A::Fail, {}},
    };
    // clang-format on
    for (const Case& c : cases) {
        const PrefillShortage s = plan_prefill_shortage(c.jobs, c.pass, c.arena, kWait);
        EXPECT_EQ(s.action, c.action) << c.what;
        EXPECT_EQ(s.jobs, c.set_aside) << c.what;
    }
}

// The shortage mode: entered by a pass short of blocks (unless its request fails),
// planning one job at a time; left by a pass that ran or by nothing to do.
TEST(PrefillScheduler, TheShortageModeIsEnteredAndLeft) {
    const std::vector<PrefillJobView> jobs = {{10, 8, true, false, false}, {5, 8, true, false, false}};
    PrefillScheduler s;
    EXPECT_FALSE(s.short_of_kv());
    EXPECT_EQ(s.plan(jobs, 64).entries.size(), 2u);
    const std::vector<PrefillKvView> kv = {{0, 1, true, true, 0}, {0, 1, true, true, 0}};
    const std::vector<size_t> both = {0, 1}, lone = {1};
    EXPECT_EQ(s.short_of_blocks(kv, both, {10, 0}, 1000).action, PrefillShortage::Action::Shrink);
    EXPECT_TRUE(s.short_of_kv());
    const PrefillPlan p = s.plan(jobs, 64);
    ASSERT_EQ(p.entries.size(), 1u);
    EXPECT_EQ(p.entries.front().job, 1u) << "the earliest deadline alone";
    s.ran();
    EXPECT_FALSE(s.short_of_kv());
    s.nothing_to_run(true);  // waiting for blocks to read a swapped request into
    EXPECT_TRUE(s.short_of_kv());
    s.nothing_to_run(false);
    EXPECT_FALSE(s.short_of_kv());
    // A failure leaves the mode as it was.
    const std::vector<PrefillKvView> huge = {{0, 1, true, true, 0}, {0, 99, true, true, 0}};
    EXPECT_EQ(s.short_of_blocks(huge, lone, {10, 0}, 1000).action, PrefillShortage::Action::Fail);
    EXPECT_FALSE(s.short_of_kv());
}

TEST(PrefillScheduler, PacksTheBudgetByDeadline) {
    struct Case {
        const char* what;
        std::vector<PrefillJobView> jobs;
        int64_t budget;
        bool one;
        int64_t lookup;
        std::vector<PrefillEntry> entries;
    };
    const std::vector<Case> cases = {
        {"nothing", {}, 512, false, -1, {}},
        {"one short", {job(5, 100)}, 512, false, -1, {{0, 100}}},
        {"one long is chunked", {job(5, 2000)}, 512, false, -1, {{0, 512}}},
        {"deadline order", {job(30, 100), job(10, 100), job(20, 100)}, 512, false, -1, {{1, 100}, {2, 100}, {0, 100}}},
        {"budget runs out mid-job", {job(1, 300), job(2, 300), job(3, 300)}, 512, false, -1, {{0, 300}, {1, 212}}},
        {"ties keep arrival order", {job(7, 10), job(7, 20), job(7, 30)}, 512, false, -1, {{0, 10}, {1, 20}, {2, 30}}},
        {"a follower waits", {job(1, 100), job(2, 100, false, true), job(3, 50)}, 512, false, -1, {{0, 100}, {2, 50}}},
        {"after a shortage, one at a time", {job(2, 100), job(1, 100)}, 512, true, -1, {{1, 100}}},
        {"a lookup when the budget reaches the job", {job(1, 100), job(2, 100, false)}, 512, false, 1, {}},
        {"no lookup past the budget", {job(1, 600), job(2, 100, false)}, 512, false, -1, {{0, 512}}},
        {"no lookup past a shortage's one", {job(1, 100), job(2, 100, false)}, 512, true, -1, {{0, 100}}},
        {"a follower is not looked up", {job(1, 100), job(2, 100, false, true)}, 512, false, -1, {{0, 100}}},
        {"zero budget", {job(1, 100)}, 0, false, -1, {}},
        {"one that may not end is left out", {no_end(1, 100), job(2, 100)}, 512, false, -1, {{1, 100}}},
        {"its budget goes to the next", {no_end(1, 300), job(2, 400)}, 512, false, -1, {{1, 400}}},
        {"one that may not end is chunked", {no_end(1, 600), job(2, 100)}, 512, false, -1, {{0, 512}}},
        {"left out where the budget would end it",
         {job(1, 412), no_end(2, 100), job(3, 50)},
         512,
         false,
         -1,
         {{0, 412}, {2, 50}}},
        {"ends it not, budget cut short", {job(1, 412), no_end(2, 101)}, 512, false, -1, {{0, 412}, {1, 100}}},
        {"after a shortage, the next may run", {no_end(1, 100), job(2, 100)}, 512, true, -1, {{1, 100}}},
    };
    for (const Case& c : cases) {
        const PrefillPlan p = plan_prefill(c.jobs, c.budget, c.one);
        EXPECT_EQ(p.lookup, c.lookup) << c.what;
        EXPECT_EQ(p.entries, c.entries) << c.what;
    }
}

// The worker's loop over the plan: look up what it asks for, refresh, plan again.
// A lookup that finds cached blocks lowers the job's need; the plan then packs
// the budget with what is left.
TEST(PrefillScheduler, LookupsAsTheBudgetReachesThem) {
    std::vector<PrefillJobView> jobs = {job(1, 300, false), job(2, 400, false), job(3, 100, false)};
    const std::vector<int64_t> cached = {0, 320, 0};  // what each lookup finds
    std::vector<size_t> looked;
    PrefillPlan p;
    for (;;) {
        p = plan_prefill(jobs, 512, false);
        if (p.lookup < 0) break;
        const size_t k = static_cast<size_t>(p.lookup);
        looked.push_back(k);
        jobs[k].looked_up = true;
        jobs[k].remaining -= cached[k];
    }
    EXPECT_EQ(looked, (std::vector<size_t>{0, 1, 2}));
    EXPECT_EQ(p.entries, (std::vector<PrefillEntry>{{0, 300}, {1, 80}, {2, 100}}));
}

// ---------------------------------------------------------------- prefix cache, destinations

namespace {

// A KV pool over a real shm KvArena (in plain memory), joined by one user, and the
// arena itself for a second user.
struct SharedPool {
    std::vector<uint8_t> arena_mem, data;
    shm::KvArena arena;
    ShmBlockAllocator* alloc = nullptr;
    std::unique_ptr<KvPool> pool;

    explicit SharedPool(uint32_t n_blocks) {
        shm::ArenaConfig c;
        c.n_blocks = n_blocks;
        arena_mem.resize(shm::KvArena::bytes(c) + 64);
        void* mem = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(arena_mem.data()) + 63) & ~uintptr_t{63});
        EXPECT_TRUE(shm::KvArena::init(mem, c).ok());
        arena = *shm::KvArena::attach(mem);
        const uint32_t user = *arena.join(shm::ProcRef{1, 1});
        KvLayout l;
        l.n_layer = 1;
        l.n_head_kv = 1;
        l.head_dim = 4;
        l.block_tokens = 16;
        data.resize(l.block_bytes() * n_blocks);
        auto a = std::make_unique<ShmBlockAllocator>(arena, user);
        alloc = a.get();
        pool = std::make_unique<KvPool>(l, data.data(), std::move(a));
    }
};

shm::BlockHash h(uint64_t v) { return {v, ~v}; }

}  // namespace

TEST(KvCacheManager, PublishedPrefixBlocksAreFoundByTheNextPrompt) {
    SharedPool sp(8);
    KvCacheManager m(*sp.pool, sp.alloc);
    // A 40-token prompt computed in one pass: blocks 0 and 1 are full, 2 is not.
    KvSeq a;
    auto ta = toks(40);
    std::vector<SeqBatch> pass = {{&a, ta.data(), 40, false}};
    ASSERT_TRUE(m.reserve(pass).ok());
    const std::vector<shm::BlockHash> hashes = {h(1), h(2)};  // of the prompt's full blocks
    EXPECT_EQ(m.publish_prefix(a, hashes, 0, 20), 1u) << "20 valid tokens: one full block";
    EXPECT_EQ(m.publish_prefix(a, hashes, 1, 40), 2u);
    EXPECT_EQ(m.publish_prefix(a, hashes, 2, 40), 2u) << "nothing more to publish";

    // The same prefix: both blocks, as a sequence of 32 valid tokens, sharing a's.
    KvSeq b = m.lookup_prefix(hashes, 8);
    ASSERT_EQ(b.blocks().size(), 2u);
    EXPECT_EQ(b.n_tokens(), 32);
    EXPECT_EQ(b.blocks()[0], a.blocks()[0]);
    EXPECT_EQ(b.blocks()[1], a.blocks()[1]);
    EXPECT_EQ(sp.alloc->refcount(a.blocks()[0]), 2) << "referenced by both sequences";
    // At most max_blocks (a prompt keeps its last token to compute).
    KvSeq c = m.lookup_prefix(hashes, 1);
    EXPECT_EQ(c.blocks().size(), 1u);
    // Another prefix: the chain breaks at its first block.
    const std::vector<shm::BlockHash> other = {h(7), h(2)};
    EXPECT_TRUE(m.lookup_prefix(other, 8).blocks().empty()) << "hashes are chained: block 2 alone is no match";
    // Without an index nothing is cached.
    KvCacheManager plain(*sp.pool);
    EXPECT_TRUE(plain.lookup_prefix(hashes, 8).blocks().empty());
    EXPECT_EQ(plain.publish_prefix(a, hashes, 0, 40), 0u);
    for (KvSeq* x : {&a, &b, &c}) x->release(*sp.pool);
    EXPECT_EQ(sp.arena.n_free(), 6u) << "the two published blocks stay cached with no reference";
    KvSeq d = m.lookup_prefix(hashes, 8);
    EXPECT_EQ(d.blocks().size(), 2u) << "and are still found";
    d.release(*sp.pool);
    std::vector<int32_t> all(8);
    EXPECT_TRUE(sp.alloc->alloc(8, all.data())) << "cached blocks are evicted when the arena needs them";
}

// An arena whose blocks are all cached (published, then released by every
// sequence) still serves passes: the reservation and the sequence's allocation
// count cached blocks no one holds, which the allocator evicts. They once counted
// only free blocks, so a full prefix cache refused every request.
TEST(KvCacheManager, CachedBlocksServeAReservationWhenNoneIsFree) {
    SharedPool sp(4);
    KvCacheManager m(*sp.pool, sp.alloc);
    KvSeq a;
    auto ta = toks(64);
    std::vector<SeqBatch> pass = {{&a, ta.data(), 64, false}};
    ASSERT_TRUE(m.reserve(pass).ok());
    const std::vector<shm::BlockHash> hashes = {h(11), h(12), h(13), h(14)};
    EXPECT_EQ(m.publish_prefix(a, hashes, 0, 64), 4u);
    a.release(*sp.pool);
    ASSERT_EQ(sp.arena.n_free(), 0u) << "every block cached, none free";
    KvSeq b;
    auto tb = toks(48);
    std::vector<SeqBatch> next = {{&b, tb.data(), 48, false}};
    Status st = m.reserve(next);
    ASSERT_TRUE(st.ok()) << st.error().message;
    EXPECT_EQ(b.blocks().size(), 3u);
    KvSeq left = m.lookup_prefix(hashes, 4);
    EXPECT_LE(left.blocks().size(), 1u) << "three of the four cached blocks were evicted";
    left.release(*sp.pool);
    // More than free + cached: still refused, nothing taken.
    KvSeq c;
    std::vector<SeqBatch> big = {{&c, tb.data(), 32, false}};
    Status s2 = m.reserve(big);
    EXPECT_EQ(s2.kind(), ErrorKind::NoKvBlocks);
    EXPECT_TRUE(c.blocks().empty());
    b.release(*sp.pool);
}

TEST(KvCacheManager, DestinationBlocksAreAllOrNothing) {
    SharedPool here(4), there(3);
    KvCacheManager m(*here.pool, here.alloc);
    auto got = m.reserve_in(*there.alloc, 33);  // 3 blocks of 16
    ASSERT_TRUE(got.ok()) << got.error().message;
    EXPECT_EQ(got->size(), 3u);
    EXPECT_EQ(there.alloc->n_free(), 0);
    auto more = m.reserve_in(*there.alloc, 1);
    ASSERT_FALSE(more.ok());
    EXPECT_EQ(more.error().kind, ErrorKind::NoKvBlocks);
    EXPECT_NE(more.error().message.find("needs 1 KV blocks there, 0 of 3 are free"), std::string::npos)
        << more.error().message;
    KvCacheManager::release_in(*there.alloc, *got);
    EXPECT_TRUE(got->empty());
    EXPECT_EQ(there.alloc->n_free(), 3);
    EXPECT_EQ(here.alloc->n_free(), 4) << "nothing taken here";
}
