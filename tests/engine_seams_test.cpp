// The engine's seams, without a model or processes: the KV cache manager (blocks a
// pass needs, taken before it runs, all or nothing; "no room" an error of its own
// kind) and the decode victim policy.
#include <gtest/gtest.h>

#include <vector>

#include "engine/decode_policy.h"
#include "engine/kv_cache_manager.h"

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
        {{{7, 100, 1}}, 0},
        {{{1, 10, 0}, {5, 10, 1}, {3, 900, 1}}, 1},          // not the longest: the latest admitted
        {{{9, 10, 0}, {2, 10, 1}, {4, 10, 1}}, 0},           // wherever it sits in the batch
        {{{4, 10, 0}, {4, 20, 0}}, 1},                        // a tie: the later index
    };
    for (size_t i = 0; i < cases.size(); ++i) EXPECT_EQ(pick_decode_victim(cases[i].seqs), cases[i].victim) << i;
}
