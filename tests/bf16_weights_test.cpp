// Every tensor of the default model dequantized to bf16 for the GPU backend equals
// gguf-py's dequantization rounded to bf16 (tests/fixtures/bf16_weights.json, made
// by scripts/make-bf16-reference.py: an implementation independent of duet's
// kernels), bit for bit, by SHA-256 of the whole tensor.
#include "model/bf16_weights.h"
#include "model/gpu_plan.h"
#include "model/model.h"

#include <openssl/evp.h>

#include <fstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

using namespace duet;

namespace {

std::string sha256_hex(const std::vector<uint16_t>& v) {
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned int len = 0;
    EVP_Digest(v.data(), v.size() * sizeof(uint16_t), md, &len, EVP_sha256(), nullptr);  // x86: little-endian already
    std::string hex;
    for (unsigned int i = 0; i < len; ++i) hex += fmt::format("{:02x}", md[i]);
    return hex;
}

}  // namespace

TEST(Bf16Weights, EveryTensorOfTheModelEqualsGgufPy) {
    std::ifstream in(std::string(DUET_FIXTURES) + "/bf16_weights.json");
    ASSERT_TRUE(in) << "missing fixture bf16_weights.json";
    const nlohmann::json ref = nlohmann::json::parse(in);
    auto file = GgufFile::open(DUET_MODEL_PATH);
    ASSERT_TRUE(file.ok()) << file.error().message;
    ASSERT_EQ((*file)->tensors().size(), ref["tensors"].size());
    size_t checked = 0;
    for (const GgufTensor& t : (*file)->tensors()) {
        const std::string name(t.name);
        ASSERT_TRUE(ref["tensors"].contains(name)) << name;
        const auto& r = ref["tensors"][name];
        auto b = dequantize_bf16(t);
        ASSERT_TRUE(b.ok()) << b.error().message;
        ASSERT_EQ(b->size(), r["n"].get<size_t>()) << name;
        if (sha256_hex(*b) != r["sha256"].get<std::string>()) {
            for (const auto& s : r["samples"])
                EXPECT_EQ((*b)[s[0].get<size_t>()], s[1].get<uint16_t>()) << name << " element " << s[0];
            ADD_FAILURE() << name << " (" << r["type"] << "): bf16 values differ from gguf-py's";
        }
        ++checked;
    }
    EXPECT_EQ(checked, 272u);

    GgufTensor bad = (*file)->tensors().front();
    bad.nbytes /= 2;
    auto short_data = dequantize_bf16(bad);
    ASSERT_FALSE(short_data.ok());
    EXPECT_NE(short_data.error().message.find("bytes of data"), std::string::npos) << short_data.error().message;
}

// What the CUDA backend holds of the default model (the launcher sizes GPU KV arenas
// by it): from the hyper-parameters, matrices and the tied embedding in bf16, the
// norms in f32.
TEST(Bf16Weights, TheBackendsBytesFollowFromTheHyperparameters) {
    auto m = duet::Model::load(DUET_MODEL_PATH);
    ASSERT_TRUE(m.ok()) << m.error().message;
    const duet::ModelConfig& c = (*m)->config();
    ASSERT_TRUE(c.tied_output);
    const uint64_t E = c.n_embd, Q = c.n_head * c.head_dim, KV = c.n_head_kv * c.head_dim, F = c.n_ff, L = c.n_layer;
    const uint64_t matrices = L * (E * Q + 2 * E * KV + Q * E + 3 * E * F) + static_cast<uint64_t>(c.n_vocab) * E;
    const uint64_t norms = (2 * L + 1) * E;
    EXPECT_EQ(duet::bf16_weight_bytes(**m), 2 * matrices + 4 * norms);
    EXPECT_EQ(duet::bf16_weight_bytes(**m), 269100288u);  // SmolLM2-135M: 134.5 M parameters
}
