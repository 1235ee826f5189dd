// Host-side planning for the CUDA backend: device arena sizing and decode graph
// buckets (no GPU needed).
#include "model/gpu_plan.h"

#include <gtest/gtest.h>

using namespace duet;

namespace {
KvLayout smollm2() {  // SmolLM2-135M: 30 layers, 3 KV heads of 64, 16-token blocks
    KvLayout l;
    l.n_layer = 30;
    l.n_head_kv = 3;
    l.head_dim = 64;
    l.block_tokens = 16;
    return l;
}
}  // namespace

TEST(GpuPlan, ArenaTakesWholeBlocksWithinTheBudget) {
    const KvLayout l = smollm2();
    const uint64_t block = 2ull * 3 * 16 * 64 * 2 * 30;  // K and V, f16, every layer
    const uint64_t gran = 2ull << 20;
    // An H200's 141 GiB, 90% for the engine, 0.3 GiB of weights, 1 GiB scratch.
    auto p = plan_device_arena(l, 141ull << 30, 0.9, 300ull << 20, 1ull << 30, gran);
    ASSERT_TRUE(p.ok()) << p.error().message;
    EXPECT_EQ(p->block_bytes, block);
    const double budget = (141.0 * 0.9 - 1.0) * 1073741824.0 - 300.0 * 1048576.0;
    EXPECT_LE(static_cast<double>(p->bytes), budget);
    EXPECT_GT(static_cast<double>(p->bytes), budget - static_cast<double>(gran + block));
    EXPECT_EQ(p->bytes % gran, 0u);
    EXPECT_GE(p->bytes, uint64_t{p->n_blocks} * block);
    EXPECT_LT(p->bytes - uint64_t{p->n_blocks} * block, gran);
    // Not even one block: an error with the figures.
    auto none = plan_device_arena(l, 1ull << 30, 0.5, 600ull << 20, 0, gran);
    ASSERT_FALSE(none.ok());
    EXPECT_NE(none.error().message.find("no room for KV"), std::string::npos) << none.error().message;
    EXPECT_FALSE(plan_device_arena(l, 1ull << 30, 1.5, 0, 0, gran).ok());
    EXPECT_FALSE(plan_device_arena(l, 1ull << 30, 0.5, 0, 0, 0).ok());
}

TEST(GpuPlan, DecodeGraphBucketsCoverEveryBatch) {
    const std::vector<int> b = decode_graph_buckets(64);
    EXPECT_EQ(b, (std::vector<int>{1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64}));
    EXPECT_EQ(decode_graph_buckets(1), std::vector<int>{1});
    EXPECT_EQ(decode_graph_buckets(6), (std::vector<int>{1, 2, 4, 6}));
    EXPECT_EQ(decode_graph_buckets(20), (std::vector<int>{1, 2, 4, 8, 16, 20}));
    for (int n = 1; n <= 64; ++n) {
        const int g = graph_bucket(b, n);
        EXPECT_GE(g, n);
        EXPECT_LT(g - n, 8) << "at most 7 idle rows";
    }
    EXPECT_EQ(graph_bucket(b, 3), 4);
    EXPECT_EQ(graph_bucket(b, 65), -1) << "past the largest: eager";
}

// Tiles for the tiled prefill attention: runs of at most `tile` rows of one sequence.
TEST(GpuPlan, AttentionQueryTilesNeverMixSequences) {
    const std::vector<int32_t> seq = {0, 0, 0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 2, 2};
    EXPECT_EQ(attention_query_tiles(seq, 4), (std::vector<int32_t>{0, 4, 4, 1, 5, 2, 7, 4, 11, 3}));
    EXPECT_EQ(attention_query_tiles(seq, 16), (std::vector<int32_t>{0, 5, 5, 2, 7, 7}));
    EXPECT_EQ(attention_query_tiles(std::vector<int32_t>{}, 16), std::vector<int32_t>{});
    // Decode-like (one row per sequence): a tile each.
    EXPECT_EQ(attention_query_tiles(std::vector<int32_t>{0, 1, 2}, 16), (std::vector<int32_t>{0, 1, 1, 1, 2, 1}));
}
