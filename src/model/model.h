// A Llama-family decoder model (Llama 2/3, SmolLM2, Mistral, Qwen2) loaded from
// GGUF: hyper-parameters from the file's metadata and views of its weights in
// the file's memory mapping.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "base/result.h"
#include "model/gguf.h"

namespace duet {

struct ModelConfig {
    std::string arch;  // "llama" or "qwen2"
    std::string name;
    int64_t n_vocab = 0;
    int64_t n_ctx_train = 0;
    int64_t n_embd = 0;
    int64_t n_layer = 0;
    int64_t n_ff = 0;
    int64_t n_head = 0;
    int64_t n_head_kv = 0;
    int64_t head_dim = 0;  // n_embd / n_head unless the file says otherwise
    int64_t rot_dim = 0;   // rotary dimensions per head (<= head_dim)
    double rope_base = 10000.0;
    double rms_eps = 1e-5;
    bool tied_output = false;  // output head reuses token_embd
    bool qkv_bias = false;
    // RoPE pairing. llama.cpp's converter permutes the q/k rows of llama-arch
    // models so that consecutive values (x[2i], x[2i+1]) pair up ("normal"); it
    // leaves qwen2's alone, which pair x[i] with x[i + rot_dim/2] ("neox").
    bool rope_neox = false;
};

struct LayerWeights {
    const GgufTensor* attn_norm = nullptr;
    const GgufTensor* wq = nullptr;
    const GgufTensor* wk = nullptr;
    const GgufTensor* wv = nullptr;
    const GgufTensor* wo = nullptr;
    const GgufTensor* bq = nullptr;  // qwen2 only
    const GgufTensor* bk = nullptr;
    const GgufTensor* bv = nullptr;
    const GgufTensor* ffn_norm = nullptr;
    const GgufTensor* w_gate = nullptr;
    const GgufTensor* w_up = nullptr;
    const GgufTensor* w_down = nullptr;
};

class Model {
public:
    static Result<std::unique_ptr<Model>> load(const std::string& path);

    const ModelConfig& config() const { return cfg_; }
    const GgufFile& file() const { return *file_; }
    const GgufTensor& tok_embd() const { return *tok_embd_; }
    const GgufTensor& output_norm() const { return *output_norm_; }
    const GgufTensor& output() const { return *output_; }
    const LayerWeights& layer(int64_t l) const { return layers_[l]; }
    // Per rotary pair i: pos * inv_freq[i] is the angle (rope_freqs factors applied).
    const std::vector<float>& rope_inv_freq() const { return inv_freq_; }
    // Bytes of weights read for one generated token (all matrices + one embedding row).
    size_t weight_bytes_per_token() const;
    // SHA-256-free identity of the model: hash of the tensor table and metadata.
    uint64_t fingerprint() const { return fingerprint_; }

private:
    Model() = default;
    Status init();

    std::unique_ptr<GgufFile> file_;
    ModelConfig cfg_;
    const GgufTensor* tok_embd_ = nullptr;
    const GgufTensor* output_norm_ = nullptr;
    const GgufTensor* output_ = nullptr;
    std::vector<LayerWeights> layers_;
    std::vector<float> inv_freq_;
    uint64_t fingerprint_ = 0;
};

}  // namespace duet
