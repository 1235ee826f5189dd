// The bounce stage (kv/kv_stage.h, BounceKvStage: what a GPU arena's contexts go
// through): every block arrives whole, in chunks through two halves that overlap,
// and rules B1-B3 hold with device copies that run only when waited on.
#include "kv/kv_stage.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>

#include <gtest/gtest.h>

#include "deferred_stage.h"

using namespace duet;
using duet::test::DeferredBounceStage;

namespace {

KvLayout layout(KvDtype dt = KvDtype::F16) {
    KvLayout l;
    l.n_layer = 3;
    l.n_head_kv = 2;
    l.head_dim = 4;
    l.block_tokens = 4;
    l.dtype = dt;
    return l;
}

constexpr int32_t kBlocks = 40;

void fill(KvPool& p, uint32_t seed) {
    std::mt19937 rng(seed);
    auto* b = static_cast<uint8_t*>(p.data());
    const size_t n = p.layout().block_bytes() * static_cast<size_t>(kBlocks);
    for (size_t i = 0; i < n; ++i) b[i] = static_cast<uint8_t>(rng());
}

// What `to` holds after every layer of `blocks` is copied from `from` (same ids),
// computed from the layout (data[layer][block] tiles), not by the code under test.
std::vector<uint8_t> expected(const KvPool& from, const KvPool& to, std::span<const int32_t> blocks) {
    const KvLayout& l = from.layout();
    const size_t tile = l.tile_bytes(), all = l.block_bytes() * static_cast<size_t>(kBlocks);
    std::vector<uint8_t> out(static_cast<const uint8_t*>(to.data()), static_cast<const uint8_t*>(to.data()) + all);
    for (int32_t layer = 0; layer < l.n_layer; ++layer)
        for (int32_t b : blocks) {
            const size_t off = (static_cast<size_t>(layer) * kBlocks + static_cast<size_t>(b)) * tile;
            std::memcpy(out.data() + off, static_cast<const uint8_t*>(from.data()) + off, tile);
        }
    return out;
}

bool same(const KvPool& p, const std::vector<uint8_t>& want) {
    return std::memcmp(p.data(), want.data(), want.size()) == 0;
}

std::vector<std::vector<int32_t>> block_lists() {
    std::mt19937 rng(7);
    std::vector<int32_t> all(kBlocks);
    std::iota(all.begin(), all.end(), 0);
    std::vector<int32_t> shuffled = all;
    std::shuffle(shuffled.begin(), shuffled.end(), rng);
    std::vector<int32_t> reversed(all.rbegin(), all.rend());
    return {{},
            {5},
            {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12},
            {std::vector<int32_t>(shuffled.begin(), shuffled.begin() + 17)},
            reversed,
            {3, 4, 9, 10, 11, 30, 2, 39}};
}

struct Pools {
    std::unique_ptr<KvPool> arena, mirror;
    explicit Pools(KvDtype dt = KvDtype::F16) {
        arena = std::move(KvPool::create(layout(dt), kBlocks)).value();
        mirror = std::move(KvPool::create(layout(dt), kBlocks)).value();
        fill(*arena, 1);
        fill(*mirror, 2);
    }
};

}  // namespace

TEST(BounceStage, PullBringsEveryLayerOfEachBlockAndNothingElse) {
    for (KvDtype dt : {KvDtype::F16, KvDtype::Int8})
        for (int32_t chunk : {1, 2, 3, 5, 64})
            for (const auto& blocks : block_lists()) {
                Pools p(dt);
                const auto want = expected(*p.arena, *p.mirror, blocks);
                auto st = DeferredBounceStage::make(*p.arena, *p.mirror, chunk);
                ASSERT_TRUE(st->pull(blocks).ok());
                EXPECT_TRUE(same(*p.mirror, want)) << "chunk " << chunk << ", " << blocks.size() << " blocks";
                EXPECT_TRUE(st->violations.empty()) << st->violations.front();
                EXPECT_EQ(st->pending(), 0);
                EXPECT_EQ(st->starts, static_cast<int>((blocks.size() + chunk - 1) / chunk));
            }
}

TEST(BounceStage, PushWritesEveryLayerOfEachBlockAndNothingElse) {
    for (KvDtype dt : {KvDtype::F16, KvDtype::Int8})
        for (int32_t chunk : {1, 2, 3, 5, 64})
            for (const auto& blocks : block_lists()) {
                Pools p(dt);
                const auto want = expected(*p.mirror, *p.arena, blocks);
                auto st = DeferredBounceStage::make(*p.arena, *p.mirror, chunk);
                ASSERT_TRUE(st->push(blocks).ok());
                EXPECT_TRUE(same(*p.arena, want)) << "chunk " << chunk << ", " << blocks.size() << " blocks";
                EXPECT_TRUE(st->violations.empty()) << st->violations.front();
                EXPECT_EQ(st->pending(), 0);
            }
}

// The device copy of the next chunk is started before the previous one is waited on
// (and copied on the host): the two halves overlap.
TEST(BounceStage, TheNextChunksCopyStartsBeforeThePreviousIsWaitedOn) {
    Pools p;
    const std::vector<int32_t> blocks = {0, 1, 2, 3, 4, 5, 6, 7, 8};
    auto a = DeferredBounceStage::make(*p.arena, *p.mirror, 3);
    ASSERT_TRUE(a->pull(blocks).ok());
    EXPECT_EQ(a->log, "s0 s1 w0 s0 w1 w0 ");
    auto b = DeferredBounceStage::make(*p.arena, *p.mirror, 3);
    ASSERT_TRUE(b->push(blocks).ok());
    EXPECT_EQ(b->log, "s0 s1 w0 s0 w0 w1 ");  // the last two are waited on together
}

// B3: whichever start or wait fails, the error comes back and no copy is left
// running; B2 holds on the way out.
TEST(BounceStage, AFailedCopyIsTheErrorAndLeavesNothingRunning) {
    const std::vector<int32_t> blocks = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10};  // 4 chunks of 3
    for (bool push : {false, true})
        for (bool fail_wait : {false, true})
            for (int at = 0; at < 4; ++at) {
                Pools p;
                auto st = DeferredBounceStage::make(*p.arena, *p.mirror, 3);
                (fail_wait ? st->fail_wait_at : st->fail_start_at) = at;
                const Status s = push ? st->push(blocks) : st->pull(blocks);
                EXPECT_FALSE(s.ok()) << (push ? "push" : "pull") << (fail_wait ? ", wait " : ", start ") << at;
                EXPECT_NE(s.error().message.find("injected"), std::string::npos) << s.error().message;
                EXPECT_EQ(st->pending(), 0) << st->log;
                EXPECT_TRUE(st->violations.empty()) << st->log;
            }
}

TEST(BounceStage, ChunksAreAboutTheHalfsBytesAndAtLeastOneBlock) {
    const KvLayout l = layout();
    const size_t b = l.block_bytes();  // 3 layers x 2 x 2 heads x 4 tokens x 4 dims x 2 bytes = 384
    EXPECT_EQ(b, 384u);
    EXPECT_EQ(bounce_chunk_blocks(l, 384 * 10), 10);
    EXPECT_EQ(bounce_chunk_blocks(l, 384 * 10 + 383), 10);
    EXPECT_EQ(bounce_chunk_blocks(l, 100), 1);
    EXPECT_EQ(bounce_chunk_blocks(l), (16 << 20) / 384);
}
