// Synthetic models (model/synth.h): the named shapes have the published parameter
// counts of the models they stand for; every weight type's file reads back through
// duet's own GGUF reader and model loader with the shape asked for, runs a forward
// pass to finite logits, and tokenizes any bytes. (tests/cli/synth_gguf_test.py
// reads the file with the `gguf` package.)
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <string>

#include "engine/engine.h"
#include "model/gguf.h"
#include "model/synth.h"
#include "model/tokenizer.h"

namespace duet {
namespace {

int64_t parameters(const SynthOptions& o) {
    int64_t n = 0;
    for (const SynthTensor& t : synth_tensors(o)) n += t.cols * t.rows;
    return n;
}

TEST(Synth, ShapesHaveTheirModelsPublishedParameterCounts) {
    // Meta's model cards: Llama 3 8B 8,030,261,248 and 70B 70,553,706,496 parameters;
    // Hugging Face's SmolLM2-135M: 134,515,008 (its output head tied).
    SynthOptions o;
    o.shape = *synth_shape("llama3-8b");
    EXPECT_EQ(parameters(o), 8'030'261'248);
    o.shape = *synth_shape("llama3-70b");
    EXPECT_EQ(parameters(o), 70'553'706'496);
    o.shape = *synth_shape("smollm2-135m");
    EXPECT_EQ(parameters(o), 134'515'008);
    // A slice: the layers asked for, the rest as before.
    o.shape = *synth_shape("llama3-70b");
    o.layers = 2;
    EXPECT_EQ(parameters(o),
              128256ll * 8192 * 2 + 8192 + 2 * (8192 * 2 + 8192ll * (8192 + 1024 + 1024 + 8192) + 3 * 8192ll * 28672));
    EXPECT_FALSE(synth_shape("gpt-5").has_value());
}

TEST(Synth, EveryTypeReadsBackRunsAndTokenizes) {
    const std::string dir = ::testing::TempDir();
    for (DType type : {DType::BF16, DType::F16, DType::F32, DType::Q4_0, DType::Q4_1, DType::Q5_0, DType::Q5_1,
                       DType::Q8_0, DType::Q4_K, DType::Q5_K, DType::Q6_K}) {
        SCOPED_TRACE(dtype_name(type));
        SynthOptions o;
        o.shape = *synth_shape("tiny");
        o.type = type;
        o.seed = 7;
        const std::string path = dir + "/synth-" + dtype_name(type) + "-" + std::to_string(getpid()) + ".gguf";
        ASSERT_TRUE(write_synth_model(path, o).ok());
        auto f = GgufFile::open(path);
        ASSERT_TRUE(f.ok()) << f.error().message;
        EXPECT_EQ((*f)->file_size(), synth_model_bytes(o));
        const auto want = synth_tensors(o);
        ASSERT_EQ((*f)->tensors().size(), want.size());
        for (size_t i = 0; i < want.size(); ++i) {
            const GgufTensor& t = (*f)->tensors()[i];
            EXPECT_EQ(t.name, want[i].name);
            EXPECT_EQ(t.type, want[i].type) << t.name;
            EXPECT_EQ(t.ne[0], want[i].cols) << t.name;
            EXPECT_EQ(t.ne[1], want[i].rows) << t.name;
        }
        EngineOptions eo;
        eo.model_path = path;
        eo.threads = 1;
        eo.n_ctx = 64;
        auto e = Engine::create(eo);
        ASSERT_TRUE(e.ok()) << e.error().message;
        const ModelConfig& c = (*e)->model().config();
        EXPECT_EQ(c.arch, "llama");
        EXPECT_EQ(c.n_layer, 2);
        EXPECT_EQ(c.n_embd, 256);
        EXPECT_EQ(c.n_head, 4);
        EXPECT_EQ(c.n_head_kv, 2);
        EXPECT_EQ(c.n_vocab, 512);
        const Tokenizer& tok = (*e)->tokenizer();
        const std::string text = "any text: h\xc3\xa9llo \xe2\x98\x83 \x01~";  // UTF-8: decode makes text
        const auto ids = tok.encode(text, false, false);
        EXPECT_EQ(ids.size(), text.size()) << "one token per byte (no merges)";
        EXPECT_EQ(tok.decode(ids, false), text);
        KvSeq seq;
        std::vector<float> logits;
        SeqBatch b{&seq, ids.data(), static_cast<int32_t>(ids.size()), true};
        ASSERT_TRUE((*e)->backend().forward({&b, 1}, logits).ok());
        ASSERT_EQ(logits.size(), ids.size() * 512);
        size_t finite = 0;
        double sum_sq = 0;
        for (float x : logits) {
            finite += std::isfinite(x) ? 1 : 0;
            sum_sq += static_cast<double>(x) * x;
        }
        EXPECT_EQ(finite, logits.size());
        EXPECT_GT(sum_sq, 0.0) << "logits that are not all zero";
        seq.release((*e)->pool());
        std::remove(path.c_str());
    }
}

}  // namespace
}  // namespace duet
