// GGUF reader: every value type, alignment, the real model (values cross-checked
// with the Python `gguf` package's reader), and rejection of truncated, corrupt and
// unsupported files without crashing.
#include "model/gguf.h"

#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <random>

#include "gguf_writer.h"

using duet::GgufFile;
using duet::GgufType;
using duet::test::GgufWriter;

namespace {

std::vector<uint8_t> f32_bytes(std::vector<float> v) {
    std::vector<uint8_t> b(v.size() * 4);
    std::memcpy(b.data(), v.data(), b.size());
    return b;
}

GgufWriter all_types_file() {
    GgufWriter w;
    w.kv_u8("t.u8", 200);
    w.kv_i8("t.i8", -100);
    w.kv_u16("t.u16", 60000);
    w.kv_i16("t.i16", -30000);
    w.kv_u32("t.u32", 4000000000u);
    w.kv_i32("t.i32", -2000000000);
    w.kv_f32("t.f32", 1.5f);
    w.kv_bool("t.bool", true);
    w.kv_str("t.str", "héllo");
    w.kv_u64("t.u64", 1ull << 40);
    w.kv_i64("t.i64", -(1ll << 40));
    w.kv_f64("t.f64", -2.25);
    w.kv_arr_str("t.arr_str", {"a", "", "ccc"});
    w.kv_arr<int32_t>("t.arr_i32", 5, {1, -2, 3});
    w.kv_arr<float>("t.arr_f32", 6, {0.5f, 1.5f});
    w.tensor("vec", 0, {4}, f32_bytes({1, 2, 3, 4}));
    w.tensor("mat", 0, {2, 3}, f32_bytes({1, 2, 3, 4, 5, 6}));
    return w;
}

}  // namespace

TEST(Gguf, ParsesEveryValueType) {
    auto bytes = all_types_file().build();
    auto f = GgufFile::parse(bytes.data(), bytes.size());
    ASSERT_TRUE(f.ok()) << f.error().message;
    const GgufFile& g = **f;
    EXPECT_EQ(g.version(), 3u);
    EXPECT_EQ(*g.get_int("t.u8"), 200);
    EXPECT_EQ(*g.get_int("t.i8"), -100);
    EXPECT_EQ(*g.get_int("t.u16"), 60000);
    EXPECT_EQ(*g.get_int("t.i16"), -30000);
    EXPECT_EQ(*g.get_int("t.u32"), 4000000000ll);
    EXPECT_EQ(*g.get_int("t.i32"), -2000000000);
    EXPECT_EQ(*g.get_float("t.f32"), 1.5);
    EXPECT_EQ(*g.get_bool("t.bool"), true);
    EXPECT_EQ(*g.get_string("t.str"), "héllo");
    EXPECT_EQ(*g.get_int("t.u64"), 1ll << 40);
    EXPECT_EQ(*g.get_int("t.i64"), -(1ll << 40));
    EXPECT_EQ(*g.get_float("t.f64"), -2.25);
    const auto* as = g.find("t.arr_str");
    ASSERT_NE(as, nullptr);
    ASSERT_EQ(as->strs.size(), 3u);
    EXPECT_EQ(as->strs[2], "ccc");
    EXPECT_EQ(as->strs[1], "");
    const auto* ai = g.find("t.arr_i32");
    ASSERT_EQ(ai->count, 3u);
    EXPECT_EQ(ai->elem_int(1), -2);
    EXPECT_EQ(g.find("t.arr_f32")->elem_float(1), 1.5);
    // Ints of any width are accepted as ints; wrong types are errors naming the key.
    EXPECT_FALSE(g.get_int("t.str").ok());
    EXPECT_NE(g.get_int("t.str").error().message.find("t.str"), std::string::npos);
    EXPECT_FALSE(g.get_string("missing").ok());
    EXPECT_EQ(*g.get_int_or("missing", 7), 7);

    ASSERT_EQ(g.tensors().size(), 2u);
    const auto* mat = g.tensor("mat");
    ASSERT_NE(mat, nullptr);
    EXPECT_EQ(mat->ne[0], 2);
    EXPECT_EQ(mat->ne[1], 3);
    EXPECT_EQ(mat->nbytes, 24u);
    float v5;
    std::memcpy(&v5, mat->data + 16, 4);
    EXPECT_EQ(v5, 5.0f);
    EXPECT_EQ(g.data_offset() % 32, 0u);
}

TEST(Gguf, HonoursGeneralAlignment) {
    GgufWriter w;
    w.kv_u32("general.alignment", 64);
    w.tensor("a", 0, {3}, f32_bytes({1, 2, 3}));
    w.tensor("b", 0, {2}, f32_bytes({7, 8}));
    auto bytes = w.build(64);
    auto f = GgufFile::parse(bytes.data(), bytes.size());
    ASSERT_TRUE(f.ok()) << f.error().message;
    EXPECT_EQ((*f)->alignment(), 64u);
    EXPECT_EQ((*f)->data_offset() % 64, 0u);
    EXPECT_EQ((*f)->tensor("b")->offset, 64u);
    float b0;
    std::memcpy(&b0, (*f)->tensor("b")->data, 4);
    EXPECT_EQ(b0, 7.0f);

    GgufWriter bad;
    bad.kv_u32("general.alignment", 48);
    auto bb = bad.build();
    EXPECT_FALSE(GgufFile::parse(bb.data(), bb.size()).ok());
}

TEST(Gguf, EveryTruncationIsAnErrorNotACrash) {
    auto bytes = all_types_file().build();
    for (size_t n = 0; n < bytes.size(); ++n) {
        // Cut at every length; the data section ends with padding, so only cuts
        // that remove needed bytes must fail.
        std::vector<uint8_t> cut(bytes.begin(), bytes.begin() + n);
        auto f = GgufFile::parse(cut.data(), cut.size());
        if (n < bytes.size() - 8) {
            EXPECT_FALSE(f.ok()) << "accepted a file cut at " << n << " of " << bytes.size();
            if (!f.ok()) {
                EXPECT_FALSE(f.error().message.empty());
            }
        }
    }
}

TEST(Gguf, RandomCorruptionNeverCrashes) {
    auto bytes = all_types_file().build();
    std::mt19937 rng(1234);
    int rejected = 0;
    for (int iter = 0; iter < 20000; ++iter) {
        auto b = bytes;
        int flips = 1 + static_cast<int>(rng() % 4);
        for (int k = 0; k < flips; ++k) b[rng() % b.size()] ^= static_cast<uint8_t>(1u << (rng() % 8));
        auto f = GgufFile::parse(b.data(), b.size());
        if (!f.ok()) {
            ++rejected;
        } else {
            // Whatever parsed must have in-bounds tensor data.
            for (const auto& t : (*f)->tensors()) {
                EXPECT_GE(t.data, b.data());
                EXPECT_LE(t.data + t.nbytes, b.data() + b.size());
            }
        }
    }
    EXPECT_GT(rejected, 100);
}

TEST(Gguf, ErrorsNameWhatIsWrong) {
    {
        std::vector<uint8_t> b = {'G', 'G', 'U', 'X', 3, 0, 0, 0};
        auto f = GgufFile::parse(b.data(), b.size());
        ASSERT_FALSE(f.ok());
        EXPECT_NE(f.error().message.find("not a GGUF file"), std::string::npos);
    }
    {
        GgufWriter w(7);
        auto b = w.build();
        auto f = GgufFile::parse(b.data(), b.size());
        ASSERT_FALSE(f.ok());
        EXPECT_NE(f.error().message.find("version 7"), std::string::npos);
    }
    {
        GgufWriter w;
        w.tensor("blk.0.weird", 10 /* Q2_K */, {256}, std::vector<uint8_t>(84));
        auto b = w.build();
        auto f = GgufFile::parse(b.data(), b.size());
        ASSERT_FALSE(f.ok());
        EXPECT_NE(f.error().message.find("blk.0.weird"), std::string::npos) << f.error().message;
        EXPECT_NE(f.error().message.find("Q2_K"), std::string::npos) << f.error().message;
    }
    {
        GgufWriter w;
        w.tensor("x", 2 /* Q4_0 */, {33}, std::vector<uint8_t>(36));
        auto b = w.build();
        auto f = GgufFile::parse(b.data(), b.size());
        ASSERT_FALSE(f.ok());
        EXPECT_NE(f.error().message.find("multiple"), std::string::npos) << f.error().message;
    }
    {
        GgufWriter w;
        w.kv_u32("dup", 1);
        w.kv_u32("dup", 2);
        auto b = w.build();
        auto f = GgufFile::parse(b.data(), b.size());
        ASSERT_FALSE(f.ok());
        EXPECT_NE(f.error().message.find("duplicate"), std::string::npos);
    }
    {
        // An array claiming more strings than the file could hold.
        GgufWriter w;
        w.kv_arr_str("a", {"x"});
        auto b = w.build();
        // count field sits after "GGUF", version, counts (24 bytes), key (8+1), type (4), elem type (4)
        uint64_t huge = 1ull << 60;
        std::memcpy(b.data() + 24 + 9 + 4 + 4, &huge, 8);
        auto f = GgufFile::parse(b.data(), b.size());
        ASSERT_FALSE(f.ok());
        EXPECT_NE(f.error().message.find("'a'"), std::string::npos) << f.error().message;
    }
    EXPECT_FALSE(GgufFile::open("/nonexistent/model.gguf").ok());
}

// Values below were read from the same file with the Python `gguf` package
// (gguf.GGUFReader), not with duet.
TEST(Gguf, RealModelMatchesPythonGgufReader) {
    auto f = GgufFile::open(DUET_MODEL_PATH);
    ASSERT_TRUE(f.ok()) << f.error().message;
    const GgufFile& g = **f;
    EXPECT_EQ(g.version(), 3u);
    EXPECT_EQ(g.metadata().size(), 33u);
    EXPECT_EQ(g.tensors().size(), 272u);
    EXPECT_EQ(*g.get_string("general.architecture"), "llama");
    EXPECT_EQ(*g.get_int("llama.block_count"), 30);
    EXPECT_EQ(*g.get_int("llama.embedding_length"), 576);
    EXPECT_EQ(*g.get_int("llama.feed_forward_length"), 1536);
    EXPECT_EQ(*g.get_int("llama.attention.head_count"), 9);
    EXPECT_EQ(*g.get_int("llama.attention.head_count_kv"), 3);
    EXPECT_EQ(*g.get_float("llama.rope.freq_base"), 100000.0);
    EXPECT_EQ(*g.get_int("llama.context_length"), 8192);
    EXPECT_EQ(*g.get_string("tokenizer.ggml.pre"), "smollm");
    EXPECT_EQ(g.find("tokenizer.ggml.tokens")->strs.size(), 49152u);
    EXPECT_EQ(g.find("tokenizer.ggml.merges")->strs.size(), 48900u);
    EXPECT_EQ(*g.get_bool("tokenizer.ggml.add_bos_token"), false);
    const auto* emb = g.tensor("token_embd.weight");
    ASSERT_NE(emb, nullptr);
    EXPECT_EQ(emb->type, duet::DType::Q8_0);
    EXPECT_EQ(emb->ne[0], 576);
    EXPECT_EQ(emb->ne[1], 49152);
    const auto* down = g.tensor("blk.0.ffn_down.weight");
    ASSERT_NE(down, nullptr);
    EXPECT_EQ(down->type, duet::DType::Q4_1);
    EXPECT_EQ(down->ne[0], 1536);
    EXPECT_EQ(down->ne[1], 576);
    EXPECT_EQ(g.tensor("output.weight"), nullptr);  // tied to token_embd
}

TEST(Gguf, RealModelHeaderCorruptionNeverCrashes) {
    auto f = GgufFile::open(DUET_MODEL_PATH);
    ASSERT_TRUE(f.ok());
    // The metadata and tensor table: flip bits there and reparse from memory.
    const size_t head = (*f)->data_offset();
    std::ifstream in(DUET_MODEL_PATH, std::ios::binary);
    std::vector<uint8_t> b(head + 4096);
    in.read(reinterpret_cast<char*>(b.data()), static_cast<std::streamsize>(b.size()));
    // A file cut after its first 4 KiB of tensor data is refused as it is: every
    // tensor must lie inside the file.
    auto whole = GgufFile::parse(b.data(), b.size());
    ASSERT_FALSE(whole.ok()) << "the tensor data is cut off";
    std::mt19937 rng(99);
    int accepted = 0;
    for (int iter = 0; iter < 300; ++iter) {
        auto c = b;
        c[rng() % head] ^= static_cast<uint8_t>(1u << (rng() % 8));
        auto g = GgufFile::parse(c.data(), c.size());
        if (!g.ok()) {
            EXPECT_FALSE(g.error().message.empty()) << "a refusal says why";
            continue;
        }
        // Accepted (a flip that shrank the tensor table, say): then every tensor it
        // names lies inside the bytes it was given.
        ++accepted;
        for (const duet::GgufTensor& t : (*g)->tensors()) {
            ASSERT_GE(t.data, c.data()) << t.name;
            ASSERT_LE(t.data + t.nbytes, c.data() + c.size()) << t.name;
        }
    }
    EXPECT_LT(accepted, 300) << "the flips reach the parser";
}
