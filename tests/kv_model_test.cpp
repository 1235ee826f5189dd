// Durable KV on the real default model: the fingerprints tell weights and
// tokenizers apart, and KV restored from a blob or replayed from a log gives
// bitwise the same next-token logits as the KV it was saved from, for every dtype.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>

#include <unistd.h>

#include "base/thread_pool.h"
#include "kv/blob.h"
#include "kv/kv_log.h"
#include "model/cpu_backend.h"
#include "model/fingerprint.h"
#include "model/model.h"

using namespace duet;

namespace {

std::vector<uint8_t> model_bytes() {
    std::ifstream in(DUET_MODEL_PATH, std::ios::binary);
    return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {});
}

struct Fps {
    Fp128 model, tokenizer;
};
Fps fps_of(const std::vector<uint8_t>& b) {
    auto f = GgufFile::parse(b.data(), b.size());
    EXPECT_TRUE(f.ok()) << f.error().message;
    return {model_fingerprint(**f), tokenizer_fingerprint(**f)};
}

struct TmpDir {
    std::string path;
    TmpDir() {
        char t[] = "/tmp/duet-kvmodel-XXXXXX";
        path = ::mkdtemp(t);
    }
    ~TmpDir() { std::system(("rm -rf " + path).c_str()); }
};

const Model& model() {
    static std::unique_ptr<Model> m = [] {
        auto r = Model::load(DUET_MODEL_PATH);
        if (!r) {
            ADD_FAILURE() << r.error().message;
            std::abort();
        }
        return std::move(r).value();
    }();
    return *m;
}

std::vector<int32_t> prompt_ids(int n, int salt) {
    std::vector<int32_t> v(n);
    for (int i = 0; i < n; ++i) v[i] = (i * 7919 + salt * 104729 + 17) % 49152;
    return v;
}

}  // namespace

TEST(KvFingerprint, TellsWeightsAndTokenizersApart) {
    const std::vector<uint8_t> orig = model_bytes();
    ASSERT_GT(orig.size(), 1000000u);
    const Fps base = fps_of(orig);
    const Fps again = fps_of(orig);
    EXPECT_EQ(base.model, again.model);
    EXPECT_EQ(base.tokenizer, again.tokenizer);
    EXPECT_NE(base.model, base.tokenizer);

    auto f = GgufFile::parse(orig.data(), orig.size());
    ASSERT_TRUE(f.ok());
    const auto offset_of = [&](const void* p) {
        return static_cast<size_t>(static_cast<const uint8_t*>(p) - orig.data());
    };
    // One byte of a weight (the first byte of a big tensor's last window): another model.
    const GgufTensor* t = (*f)->tensor("blk.7.ffn_down.weight");
    ASSERT_NE(t, nullptr);
    ASSERT_GT(t->nbytes, 65536u);
    {
        std::vector<uint8_t> b = orig;
        b[offset_of(t->data) + t->nbytes - 4096] ^= 0x10;
        const Fps x = fps_of(b);
        EXPECT_NE(x.model, base.model);
        EXPECT_EQ(x.tokenizer, base.tokenizer);
    }
    // One byte of a small tensor (a norm, hashed whole).
    const GgufTensor* norm = (*f)->tensor("blk.3.attn_norm.weight");
    ASSERT_NE(norm, nullptr);
    {
        std::vector<uint8_t> b = orig;
        b[offset_of(norm->data) + norm->nbytes / 2] ^= 0x01;
        EXPECT_NE(fps_of(b).model, base.model);
    }
    // One character of one vocabulary entry: another tokenizer, the same weights.
    const GgufValue* toks = (*f)->find("tokenizer.ggml.tokens");
    ASSERT_NE(toks, nullptr);
    ASSERT_GT(toks->strs.size(), 1000u);
    {
        std::vector<uint8_t> b = orig;
        b[offset_of(toks->strs[1000].data())] ^= 0x01;
        const Fps x = fps_of(b);
        EXPECT_NE(x.tokenizer, base.tokenizer);
        EXPECT_EQ(x.model, base.model);
    }
    // The BOS id (a special-token choice).
    const GgufValue* bos = (*f)->find("tokenizer.ggml.bos_token_id");
    ASSERT_NE(bos, nullptr);
    {
        std::vector<uint8_t> b = orig;
        // The u32 value sits right before the next key's length; find it by value.
        const uint32_t id = static_cast<uint32_t>(bos->u);
        const std::string key = "tokenizer.ggml.bos_token_id";
        const auto kp = std::search(b.begin(), b.end(), key.begin(), key.end());
        ASSERT_NE(kp, b.end());
        const size_t at = static_cast<size_t>(kp - b.begin()) + key.size() + 4;  // past the u32 type
        uint32_t v;
        std::memcpy(&v, b.data() + at, 4);
        ASSERT_EQ(v, id);
        v += 1;
        std::memcpy(b.data() + at, &v, 4);
        EXPECT_NE(fps_of(b).tokenizer, base.tokenizer);
    }
    // A name is not the weights.
    const GgufValue* name = (*f)->find("general.name");
    if (name && !name->s.empty()) {
        std::vector<uint8_t> b = orig;
        b[offset_of(name->s.data())] ^= 0x01;
        const Fps x = fps_of(b);
        EXPECT_EQ(x.model, base.model);
        EXPECT_EQ(x.tokenizer, base.tokenizer);
    }
}

// Restoring is exact: after a blob import or a log replay, the next tokens' logits
// are bitwise those of the sequence that was saved (the model is chunking- and
// batch-invariant, so nothing but the KV bytes could make them differ).
TEST(KvRestore, BlobAndLogGiveBitwiseTheSameLogits) {
    const Model& m = model();
    KvIdentity id{model_fingerprint(m.file()), tokenizer_fingerprint(m.file()), m.config().n_vocab};
    ThreadPool threads(2);
    TmpDir dir;
    for (KvDtype dt : {KvDtype::F16, KvDtype::Int8, KvDtype::Fp8}) {
        SCOPED_TRACE(kv_dtype_name(dt));
        const KvLayout layout = kv_layout(m, dt);
        auto pool = std::move(KvPool::create(layout, 64)).value();
        CpuBackend be(m, *pool, threads, cpu::isa_best());
        const std::vector<int32_t> toks = prompt_ids(83, static_cast<int>(dt) + 1);  // 5 blocks and 3 tokens
        KvSeq orig;
        std::vector<float> logits;
        // Prefilled in two chunks, the second starting mid-block.
        SeqBatch a{&orig, toks.data(), 37, false}, b{&orig, toks.data() + 37, 46, false};
        ASSERT_TRUE(be.forward({&a, 1}, logits).ok());
        ASSERT_TRUE(be.forward({&b, 1}, logits).ok());

        // A blob of the whole sequence, a log of it in three appends and a truncation.
        const std::string blob = dir.path + "/" + kv_dtype_name(dt) + ".kvblob";
        ASSERT_TRUE(blob_write(blob, id, *pool, orig, toks, 0, 83).ok());
        SyncLogDevice dev;
        KvLogSync sync(dev);
        const std::string ctx = std::string("ctx-") + kv_dtype_name(dt);
        {
            auto log = KvLog::create(sync, dir.path, ctx, id, layout);
            ASSERT_TRUE(log.ok()) << log.error().message;
            ASSERT_TRUE((*log)->append(*pool, orig, toks, 0, 21).ok());
            ASSERT_TRUE((*log)->append(*pool, orig, toks, 21, 62).ok());
            ASSERT_TRUE((*log)->truncate(50).ok());
            ASSERT_TRUE((*log)->append(*pool, orig, toks, 50, 33).ok());
            EXPECT_EQ((*log)->n_tokens(), 83u);
        }
        KvSeq from_blob, from_log;
        auto im = blob_import(blob, id, *pool, from_blob);
        ASSERT_TRUE(im.ok()) << im.error().message;
        EXPECT_EQ(im->tokens, toks);
        LogScan scan;
        auto log = KvLog::open(sync, dir.path, ctx, id, pool.get(), &from_log, &scan);
        ASSERT_TRUE(log.ok()) << log.error().message;
        EXPECT_EQ(scan.tokens, toks);
        EXPECT_FALSE(scan.torn);
        ASSERT_EQ(from_log.n_tokens(), 83);

        // Four greedy steps on each: the same logits, bit for bit.
        int32_t next[3];
        std::vector<float> l0, l1, l2;
        const int64_t nv = m.config().n_vocab;
        next[0] = next[1] = next[2] =
            static_cast<int32_t>(std::max_element(logits.begin(), logits.begin() + nv) - logits.begin());
        for (int step = 0; step < 4; ++step) {
            SeqBatch x0{&orig, &next[0], 1, false}, x1{&from_blob, &next[1], 1, false}, x2{&from_log, &next[2], 1, false};
            ASSERT_TRUE(be.forward({&x0, 1}, l0).ok());
            ASSERT_TRUE(be.forward({&x1, 1}, l1).ok());
            ASSERT_TRUE(be.forward({&x2, 1}, l2).ok());
            ASSERT_EQ(0, std::memcmp(l0.data(), l1.data(), nv * sizeof(float))) << "blob, step " << step;
            ASSERT_EQ(0, std::memcmp(l0.data(), l2.data(), nv * sizeof(float))) << "log, step " << step;
            next[0] = next[1] = next[2] = static_cast<int32_t>(std::max_element(l0.begin(), l0.end()) - l0.begin());
        }
        // Compacted, the log restores the same again.
        ASSERT_TRUE((*log)->compact(*pool, orig, toks).ok());
        log->reset();
        KvSeq after;
        auto log2 = KvLog::open(sync, dir.path, ctx, id, pool.get(), &after, &scan);
        ASSERT_TRUE(log2.ok()) << log2.error().message;
        EXPECT_TRUE(scan.has_checkpoint);
        EXPECT_EQ(scan.tokens, toks);
        SeqBatch y{&after, &next[0], 1, false};
        std::vector<float> l3;
        ASSERT_TRUE(be.forward({&y, 1}, l3).ok());
        // `orig` moved on by four tokens: compare against a fresh copy at 83 from the blob.
        KvSeq ref83;
        ASSERT_TRUE(blob_import(blob, id, *pool, ref83).ok());
        SeqBatch z{&ref83, &next[0], 1, false};
        ASSERT_TRUE(be.forward({&z, 1}, l1).ok());
        EXPECT_EQ(0, std::memcmp(l1.data(), l3.data(), nv * sizeof(float)));
        for (KvSeq* s : {&orig, &from_blob, &from_log, &after, &ref83}) s->release(*pool);
        EXPECT_EQ(pool->allocator().n_free(), 64);
    }
}
