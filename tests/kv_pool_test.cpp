// Paged KV pool: block accounting, copy-on-write forks, truncation, layout; copy
// plans between arenas.
#include "kv/kv_pool.h"

#include <algorithm>
#include <cstring>

#include <gtest/gtest.h>

#include "kv/kv_copy.h"

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
    const size_t tile = small_layout().tile_bytes();  // 2 * 2 heads * 16 * 4 values * 2 bytes = 512
    EXPECT_EQ(tile, 512u);
    // One layer of all blocks is contiguous: block b+1 follows block b in a layer.
    EXPECT_EQ(p.k(1, 0, 0) - p.k(0, 0, 0), static_cast<ptrdiff_t>(tile));
    EXPECT_EQ(p.k(0, 1, 0) - p.k(0, 0, 0), static_cast<ptrdiff_t>(5 * tile));
    EXPECT_EQ(p.v(0, 0, 0) - p.k(0, 0, 0), static_cast<ptrdiff_t>(tile / 2));
    EXPECT_EQ(p.k(0, 0, 1) - p.k(0, 0, 0), 16 * 4 * 2);
    EXPECT_EQ(small_layout().bytes_per_token(), 2u * 2 * 3 * 2 * 4);
}

// Quantized tiles: K values, V values (a byte each), then K's and V's f32 scales,
// one per (head, token) row.
TEST(KvPool, QuantizedTilesCarryAScalePerRow) {
    KvLayout l = small_layout();
    l.head_dim = 64;
    l.dtype = KvDtype::Int8;
    // Per tile: 2 x (2 heads x 16 tokens x 64 values) bytes + 2 x (2 x 16) f32 scales.
    EXPECT_EQ(l.tile_bytes(), 2u * 2048 + 2u * 128);
    KvLayout f16 = l;
    f16.dtype = KvDtype::F16;
    EXPECT_EQ(f16.tile_bytes(), 8192u);
    EXPECT_EQ(l.bytes_per_token(), 3u * 4352 / 16);
    auto pool = KvPool::create(l, 5);
    ASSERT_TRUE(pool.ok());
    KvPool& p = **pool;
    const auto at = [&](const void* x) { return static_cast<const uint8_t*>(x) - static_cast<const uint8_t*>(p.data()); };
    EXPECT_EQ(at(p.k(0, 0, 1)), 16 * 64);
    EXPECT_EQ(at(p.v(0, 0, 0)), 2048);
    EXPECT_EQ(at(p.k(2, 1, 1)), (5 + 2) * 4352 + 1024);
    EXPECT_EQ(at(p.k_scales(0, 0, 0)), 4096);
    EXPECT_EQ(at(p.k_scales(0, 0, 1)), 4096 + 16 * 4);
    EXPECT_EQ(at(p.v_scales(0, 0, 0)), 4096 + 32 * 4);
    EXPECT_EQ(at(p.v_scales(3, 2, 1)), (10 + 3) * 4352 + 4096 + 48 * 4);
    EXPECT_EQ(l.tile_bytes() % 64, 0u) << "tiles stay cache-line aligned";
}

TEST(KvPool, DtypeNamesRoundTrip) {
    for (KvDtype t : {KvDtype::F16, KvDtype::Int8, KvDtype::Fp8}) {
        auto back = parse_kv_dtype(kv_dtype_name(t));
        ASSERT_TRUE(back.ok());
        EXPECT_EQ(*back, t);
        EXPECT_EQ(*kv_dtype_from(static_cast<uint32_t>(t)), t);
    }
    auto bad = parse_kv_dtype("int4");
    ASSERT_FALSE(bad.ok());
    EXPECT_NE(bad.error().message.find("f16, int8 or fp8"), std::string::npos) << bad.error().message;
    EXPECT_FALSE(kv_dtype_from(3).ok());
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
    for (int l = 0; l < 3; ++l) p.k16(a.blocks()[1], l, 1)[3 * 4] = static_cast<uint16_t>(100 + l);
    KvSeq b = a.fork(p);
    EXPECT_EQ(b.blocks(), a.blocks());
    EXPECT_EQ(p.allocator().refcount(a.blocks()[0]), 2);
    EXPECT_EQ(p.allocator().n_free(), 6);
    // b appends at 20: block 1 (positions 16..31) is shared, so b gets a copy.
    ASSERT_TRUE(b.prepare_append(p, 20, 21).ok());
    EXPECT_EQ(b.blocks()[0], a.blocks()[0]);
    EXPECT_NE(b.blocks()[1], a.blocks()[1]);
    for (int l = 0; l < 3; ++l) EXPECT_EQ(p.k16(b.blocks()[1], l, 1)[3 * 4], 100 + l);
    EXPECT_EQ(p.allocator().refcount(a.blocks()[1]), 1);
    EXPECT_EQ(p.allocator().n_free(), 5);
    a.release(p);
    b.release(p);
    EXPECT_EQ(p.allocator().n_free(), 8);
}

TEST(KvPool, RejectsEmptyPool) { EXPECT_FALSE(KvPool::create(small_layout(), 0).ok()); }

// Copy plans between two arenas of different sizes: executed with memcpy, every
// tile of the named blocks lands in its destination block, layer by layer, nothing
// else is touched, and consecutive ids merge into one run.
TEST(KvCopy, LayerPlansMoveExactlyTheNamedBlocks) {
    KvLayout l;
    l.n_layer = 3;
    l.n_head_kv = 2;
    l.head_dim = 8;
    l.block_tokens = 4;
    auto src = KvPool::create(l, 12);
    auto dst = KvPool::create(l, 10);
    ASSERT_TRUE(src.ok() && dst.ok());
    const size_t tile = l.tile_bytes() / 2;  // f16 values
    uint16_t* s = (*src)->k16(0, 0, 0);
    uint16_t* d = (*dst)->k16(0, 0, 0);
    for (size_t i = 0; i < tile * 12 * 3; ++i) s[i] = static_cast<uint16_t>(i * 7 + 1);
    std::fill(d, d + tile * 10 * 3, 0);
    const std::vector<int32_t> from = {3, 4, 5, 9}, to = {0, 1, 7, 8};
    auto plan = plan_copy(l, 12, 10, from, to);
    ASSERT_TRUE(plan.ok()) << plan.error().message;
    ASSERT_EQ(plan->size(), 3u);
    const uint64_t tb = tile * sizeof(uint16_t);
    // Layer 1: 3,4 -> 0,1 is one run; 5 -> 7 and 9 -> 8 are not consecutive on both sides.
    const std::vector<CopyRun> want1 = {{(12 + 3) * tb, (10 + 0) * tb, 2 * tb}, {(12 + 5) * tb, (10 + 7) * tb, tb},
                                        {(12 + 9) * tb, (10 + 8) * tb, tb}};
    EXPECT_EQ((*plan)[1], want1);
    for (const auto& layer : *plan)
        for (const CopyRun& r : layer)
            std::memcpy(reinterpret_cast<uint8_t*>(d) + r.dst, reinterpret_cast<const uint8_t*>(s) + r.src, r.bytes);
    for (int32_t layer = 0; layer < 3; ++layer)
        for (int32_t b = 0; b < 10; ++b) {
            const auto it = std::find(to.begin(), to.end(), b);
            for (int32_t h = 0; h < 2; ++h)
                for (size_t e = 0; e < static_cast<size_t>(l.block_tokens * l.head_dim); ++e) {
                    const uint16_t got_k = (*dst)->k16(b, layer, h)[e], got_v = (*dst)->v16(b, layer, h)[e];
                    if (it == to.end()) {
                        ASSERT_EQ(got_k | got_v, 0) << "block " << b << " was not to be touched";
                    } else {
                        const int32_t sb = from[static_cast<size_t>(it - to.begin())];
                        ASSERT_EQ(got_k, (*src)->k16(sb, layer, h)[e]) << "layer " << layer << " block " << b;
                        ASSERT_EQ(got_v, (*src)->v16(sb, layer, h)[e]) << "layer " << layer << " block " << b;
                    }
                }
        }
    // A long run of consecutive ids is one copy per layer.
    std::vector<int32_t> a(8), z(8);
    for (int i = 0; i < 8; ++i) a[i] = 2 + i, z[i] = i;
    auto one = plan_layer_copy(l, 12, 10, a, z, 2);
    ASSERT_TRUE(one.ok());
    EXPECT_EQ(one->size(), 1u);
    EXPECT_EQ((*one)[0].bytes, 8 * tb);
}

TEST(KvCopy, BadPlansAreRefused) {
    KvLayout l;
    l.n_layer = 2;
    l.n_head_kv = 1;
    l.head_dim = 4;
    const std::vector<int32_t> two = {0, 1}, one = {0}, dup = {3, 3}, big = {0, 10};
    auto msg = [&](std::span<const int32_t> s, std::span<const int32_t> d, int32_t layer) {
        auto p = plan_layer_copy(l, 10, 10, s, d, layer);
        return p.ok() ? std::string("accepted") : p.error().message;
    };
    EXPECT_NE(msg(two, one, 0).find("2 source blocks for 1 destination"), std::string::npos);
    EXPECT_NE(msg(two, dup, 0).find("destination block 3 named twice"), std::string::npos);
    EXPECT_NE(msg(big, two, 0).find("source block 10 of an arena of 10"), std::string::npos);
    EXPECT_NE(msg(two, big, 0).find("destination block 10"), std::string::npos);
    EXPECT_NE(msg(two, two, 2).find("layer 2 of 2"), std::string::npos);
    EXPECT_EQ(msg(two, two, 1), "accepted");
}

// What a pass exports: the blocks its new positions fall in, paired with the
// destination's same-numbered blocks.
TEST(KvCopy, APassExportsTheBlocksItWrites) {
    const std::vector<int32_t> blocks = {40, 41, 7, 9, 3};
    const std::vector<int32_t> dst = {100, 101, 102, 103, 104};
    std::vector<int32_t> s, d;
    // Positions 20..47 with 16-token blocks: blocks 1 and 2.
    ASSERT_TRUE(append_written_blocks(blocks, dst, 20, 28, 16, s, d).ok());
    EXPECT_EQ(s, (std::vector<int32_t>{41, 7}));
    EXPECT_EQ(d, (std::vector<int32_t>{101, 102}));
    // Appends: one more token at 48 (block 3); nothing for n == 0.
    ASSERT_TRUE(append_written_blocks(blocks, dst, 48, 1, 16, s, d).ok());
    ASSERT_TRUE(append_written_blocks(blocks, dst, 60, 0, 16, s, d).ok());
    EXPECT_EQ(s, (std::vector<int32_t>{41, 7, 9}));
    EXPECT_EQ(d, (std::vector<int32_t>{101, 102, 103}));
    // A whole prompt from 0: every block it covers, the partial last one included.
    s.clear();
    d.clear();
    ASSERT_TRUE(append_written_blocks(blocks, dst, 0, 65, 16, s, d).ok());
    EXPECT_EQ(s, blocks);
    EXPECT_EQ(d, dst);
    // Past the sequence's blocks, or the destination's.
    auto r = append_written_blocks(blocks, dst, 70, 20, 16, s, d);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.error().message.find("past the sequence's 5 blocks"), std::string::npos) << r.error().message;
    r = append_written_blocks(blocks, std::vector<int32_t>{1, 2}, 20, 28, 16, s, d);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.error().message.find("2 destination blocks"), std::string::npos) << r.error().message;
}

// An export's plan: per destination, per layer, every block of each exported
// sequence (from position 0, the partial last block included) to its destination
// block; entries with destination -1 copy nothing; bad exports are refused.
TEST(KvCopy, AnExportPlansEverySequenceBlockPerDestination) {
    KvLayout l;
    l.n_layer = 2;
    l.n_head_kv = 1;
    l.head_dim = 4;
    l.block_tokens = 16;
    const uint64_t tile = l.tile_bytes();
    const std::vector<int32_t> a = {3, 4, 9}, b = {7}, c = {1, 2};
    KvExport exp;
    uint16_t d0[1], d1[1];
    exp.dests = {KvDest{d0, 8}, KvDest{d1, 4}};
    exp.dest = {1, -1, 0};
    exp.dst_ids = {{2, 3, 0}, {}, {5, 6}};
    // a: 40 tokens (3 blocks) to destination 1; b not exported; c: 17 tokens to 0.
    const std::vector<ExportSeq> seqs = {{a, 40}, {b, 10}, {c, 17}};
    auto p = plan_export(l, 10, exp, seqs);
    ASSERT_TRUE(p.ok()) << p.error().message;
    ASSERT_EQ(p->size(), 2u);
    for (size_t d = 0; d < 2; ++d) ASSERT_EQ((*p)[d].size(), 2u) << "a plan per layer";
    for (uint64_t layer = 0; layer < 2; ++layer) {
        // Destination 1 (4 blocks): 3,4 -> 2,3 merge into one run; 9 -> 0.
        const std::vector<CopyRun> want1 = {{(layer * 10 + 3) * tile, (layer * 4 + 2) * tile, 2 * tile},
                                            {(layer * 10 + 9) * tile, (layer * 4 + 0) * tile, tile}};
        EXPECT_EQ((*p)[1][layer], want1) << "layer " << layer;
        // Destination 0 (8 blocks): 1,2 -> 5,6, one run.
        const std::vector<CopyRun> want0 = {{(layer * 10 + 1) * tile, (layer * 8 + 5) * tile, 2 * tile}};
        EXPECT_EQ((*p)[0][layer], want0) << "layer " << layer;
    }
    auto refused = [&](KvExport x, const std::string& why) {
        auto r = plan_export(l, 10, x, seqs);
        ASSERT_FALSE(r.ok()) << why;
        EXPECT_NE(r.error().message.find(why), std::string::npos) << r.error().message;
    };
    KvExport x = exp;
    x.dest.pop_back();
    refused(x, "2 destinations and 3 block lists for 3 sequences");
    x = exp;
    x.dest[0] = 2;
    refused(x, "sequence 0 names destination 2 of 2");
    x = exp;
    x.dests[1].data = nullptr;
    refused(x, "sequence 0 names destination 1 of 2");
    x = exp;
    x.dst_ids[0] = {2, 3};
    refused(x, "2 destination blocks");
    x = exp;
    x.dst_ids[2] = {5, 8};
    refused(x, "destination block 8 of an arena of 8");
    x = exp;
    x.dest[2] = 1;
    x.dst_ids[2] = {1, 3};
    refused(x, "twice");
}
