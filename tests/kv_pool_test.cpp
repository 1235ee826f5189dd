// Paged KV pool: block accounting, copy-on-write forks, truncation, layout.
#include "kv/kv_pool.h"

#include <gtest/gtest.h>

using namespace duet;

namespace {

KvLayout small_layout() {
    KvLayout l;
    l.n_layer = 3;
    l.n_head_kv = 2;
    l.head_dim = 4;
    l.block_tokens = 16;
    return l;
}

}  // namespace

TEST(KvPool, LayoutPlanesAreLayerMajor) {
    auto pool = KvPool::create(small_layout(), 5);
    ASSERT_TRUE(pool.ok());
    KvPool& p = **pool;
    const size_t tile = small_layout().tile_elems();  // 2 * 2 heads * 16 * 4 = 256
    EXPECT_EQ(tile, 256u);
    // One layer of all blocks is contiguous: block b+1 follows block b in a layer.
    EXPECT_EQ(p.k(1, 0, 0) - p.k(0, 0, 0), static_cast<ptrdiff_t>(tile));
    EXPECT_EQ(p.k(0, 1, 0) - p.k(0, 0, 0), static_cast<ptrdiff_t>(5 * tile));
    EXPECT_EQ(p.v(0, 0, 0) - p.k(0, 0, 0), static_cast<ptrdiff_t>(tile / 2));
    EXPECT_EQ(p.k(0, 0, 1) - p.k(0, 0, 0), 16 * 4);
    EXPECT_EQ(small_layout().bytes_per_token(), 2u * 2 * 3 * 2 * 4);
}

TEST(KvPool, AppendTruncateAndRelease) {
    auto pool = KvPool::create(small_layout(), 4);
    KvPool& p = **pool;
    KvSeq s;
    ASSERT_TRUE(s.prepare_append(p, 0, 17).ok());
    EXPECT_EQ(s.blocks().size(), 2u);
    s.set_n_tokens(17);
    EXPECT_EQ(p.allocator().n_free(), 2);
    ASSERT_TRUE(s.prepare_append(p, 17, 64).ok());
    EXPECT_EQ(p.allocator().n_free(), 0);
    s.set_n_tokens(64);
    // Out of blocks: an error, and nothing changes.
    Status st = s.prepare_append(p, 64, 65);
    EXPECT_FALSE(st.ok());
    EXPECT_NE(st.error().message.find("full"), std::string::npos);
    EXPECT_EQ(s.blocks().size(), 4u);
    s.truncate(p, 20);
    EXPECT_EQ(s.n_tokens(), 20);
    EXPECT_EQ(s.blocks().size(), 2u);
    EXPECT_EQ(p.allocator().n_free(), 2);
    s.truncate(p, 16);
    EXPECT_EQ(s.blocks().size(), 1u);
    s.release(p);
    EXPECT_EQ(p.allocator().n_free(), 4);
}

TEST(KvPool, ForkSharesBlocksAndCopiesOnWrite) {
    auto pool = KvPool::create(small_layout(), 8);
    KvPool& p = **pool;
    KvSeq a;
    ASSERT_TRUE(a.prepare_append(p, 0, 20).ok());
    a.set_n_tokens(20);
    for (int l = 0; l < 3; ++l) p.k(a.blocks()[1], l, 1)[3 * 4] = static_cast<uint16_t>(100 + l);
    KvSeq b = a.fork(p);
    EXPECT_EQ(b.blocks(), a.blocks());
    EXPECT_EQ(p.allocator().refcount(a.blocks()[0]), 2);
    EXPECT_EQ(p.allocator().n_free(), 6);
    // b appends at 20: block 1 (positions 16..31) is shared, so b gets a copy.
    ASSERT_TRUE(b.prepare_append(p, 20, 21).ok());
    EXPECT_EQ(b.blocks()[0], a.blocks()[0]);
    EXPECT_NE(b.blocks()[1], a.blocks()[1]);
    for (int l = 0; l < 3; ++l) EXPECT_EQ(p.k(b.blocks()[1], l, 1)[3 * 4], 100 + l);
    EXPECT_EQ(p.allocator().refcount(a.blocks()[1]), 1);
    EXPECT_EQ(p.allocator().n_free(), 5);
    a.release(p);
    b.release(p);
    EXPECT_EQ(p.allocator().n_free(), 8);
}

TEST(KvPool, RejectsEmptyPool) { EXPECT_FALSE(KvPool::create(small_layout(), 0).ok()); }
