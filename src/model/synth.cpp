#include "model/synth.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>

#include "kernels/cpu/kernels.h"

namespace duet {

namespace {

constexpr uint64_t kAlign = 32;  // GGUF's default general.alignment

// GGUF value types (the format's numbering).
enum : uint32_t { kU32 = 4, kI32 = 5, kF32 = 6, kBool = 7, kStr = 8, kArr = 9 };

class Bytes {
public:
    template <typename T>
    void put(T v) {
        const auto* p = reinterpret_cast<const uint8_t*>(&v);
        b_.insert(b_.end(), p, p + sizeof v);
    }
    void str(std::string_view s) {
        put(static_cast<uint64_t>(s.size()));
        b_.insert(b_.end(), s.begin(), s.end());
    }
    void kv_u32(std::string_view k, uint32_t v) { key(k, kU32), put(v); }
    void kv_f32(std::string_view k, float v) { key(k, kF32), put(v); }
    void kv_bool(std::string_view k, bool v) { key(k, kBool), put(static_cast<uint8_t>(v)); }
    void kv_str(std::string_view k, std::string_view v) { key(k, kStr), str(v); }
    void kv_strs(std::string_view k, const std::vector<std::string>& v) {
        key(k, kArr);
        put(kStr);
        put(static_cast<uint64_t>(v.size()));
        for (const std::string& s : v) str(s);
    }
    void kv_i32s(std::string_view k, const std::vector<int32_t>& v) {
        key(k, kArr);
        put(kI32);
        put(static_cast<uint64_t>(v.size()));
        for (int32_t x : v) put(x);
    }
    uint64_t n_kv = 0;
    std::vector<uint8_t>& bytes() { return b_; }

private:
    void key(std::string_view k, uint32_t type) {
        str(k);
        put(type);
        ++n_kv;
    }
    std::vector<uint8_t> b_;
};

using Tensor = SynthTensor;

std::vector<Tensor> tensors_of(const SynthOptions& o) {
    const SynthShape& s = o.shape;
    const int64_t hd = s.n_embd / s.n_head, q = s.n_head * hd, kv = s.n_head_kv * hd;
    const int64_t layers = o.layers >= 0 ? o.layers : s.n_layer;
    const auto inv = [](int64_t n) { return static_cast<float>(1.0 / std::sqrt(static_cast<double>(n))); };
    std::vector<Tensor> t;
    t.push_back({"token_embd.weight", o.type, s.n_embd, s.n_vocab, 1.0f});
    for (int64_t l = 0; l < layers; ++l) {
        const std::string p = "blk." + std::to_string(l) + ".";
        t.push_back({p + "attn_norm.weight", DType::F32, s.n_embd, 1, 0});
        t.push_back({p + "attn_q.weight", o.type, s.n_embd, q, inv(s.n_embd)});
        t.push_back({p + "attn_k.weight", o.type, s.n_embd, kv, inv(s.n_embd)});
        t.push_back({p + "attn_v.weight", o.type, s.n_embd, kv, inv(s.n_embd)});
        t.push_back({p + "attn_output.weight", o.type, q, s.n_embd, inv(q)});
        t.push_back({p + "ffn_norm.weight", DType::F32, s.n_embd, 1, 0});
        t.push_back({p + "ffn_gate.weight", o.type, s.n_embd, s.n_ff, inv(s.n_embd)});
        t.push_back({p + "ffn_up.weight", o.type, s.n_embd, s.n_ff, inv(s.n_embd)});
        t.push_back({p + "ffn_down.weight", o.type, s.n_ff, s.n_embd, inv(s.n_ff)});
    }
    t.push_back({"output_norm.weight", DType::F32, s.n_embd, 1, 0});
    if (!s.tied) t.push_back({"output.weight", o.type, s.n_embd, s.n_vocab, inv(s.n_embd)});
    return t;
}

// GPT-2's byte-to-character map: the byte tokens' texts in a byte-level vocabulary.
std::string byte_token(int b) {
    int cp = b;
    if (!((b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255))) {
        int n = 0;  // the rank of b among the bytes that are remapped
        for (int x = 0; x < b; ++x)
            if (!((x >= 33 && x <= 126) || (x >= 161 && x <= 172) || (x >= 174 && x <= 255))) ++n;
        cp = 256 + n;
    }
    std::string s;
    if (cp < 0x80) {
        s += static_cast<char>(cp);
    } else {
        s += static_cast<char>(0xC0 | (cp >> 6));
        s += static_cast<char>(0x80 | (cp & 0x3F));
    }
    return s;
}

Bytes header(const SynthOptions& o, const std::vector<Tensor>& ts) {
    const SynthShape& s = o.shape;
    Bytes kv;
    const std::string arch = "llama";
    kv.kv_str("general.architecture", arch);
    kv.kv_str("general.name",
              "synthetic " + s.name + " (" + dtype_name(o.type) + ", seed " + std::to_string(o.seed) + ")");
    kv.kv_u32("general.alignment", static_cast<uint32_t>(kAlign));
    kv.kv_u32(arch + ".context_length", static_cast<uint32_t>(s.n_ctx_train));
    kv.kv_u32(arch + ".embedding_length", static_cast<uint32_t>(s.n_embd));
    kv.kv_u32(arch + ".block_count", static_cast<uint32_t>(o.layers >= 0 ? o.layers : s.n_layer));
    kv.kv_u32(arch + ".feed_forward_length", static_cast<uint32_t>(s.n_ff));
    kv.kv_u32(arch + ".attention.head_count", static_cast<uint32_t>(s.n_head));
    kv.kv_u32(arch + ".attention.head_count_kv", static_cast<uint32_t>(s.n_head_kv));
    kv.kv_f32(arch + ".rope.freq_base", static_cast<float>(s.rope_base));
    kv.kv_f32(arch + ".attention.layer_norm_rms_epsilon", s.rms_eps);
    kv.kv_u32(arch + ".vocab_size", static_cast<uint32_t>(s.n_vocab));
    std::vector<std::string> tokens;
    std::vector<int32_t> types;
    for (int b = 0; b < 256; ++b) tokens.push_back(byte_token(b)), types.push_back(1);
    for (int64_t i = 256; i < s.n_vocab - 2; ++i)
        tokens.push_back("<|synth_" + std::to_string(i) + "|>"), types.push_back(1);
    tokens.push_back("<|begin_of_text|>"), types.push_back(3);
    tokens.push_back("<|end_of_text|>"), types.push_back(3);
    kv.kv_str("tokenizer.ggml.model", "gpt2");
    kv.kv_str("tokenizer.ggml.pre", "llama-bpe");
    kv.kv_strs("tokenizer.ggml.tokens", tokens);
    kv.kv_i32s("tokenizer.ggml.token_type", types);
    kv.kv_strs("tokenizer.ggml.merges", {});
    kv.kv_u32("tokenizer.ggml.bos_token_id", static_cast<uint32_t>(s.n_vocab - 2));
    kv.kv_u32("tokenizer.ggml.eos_token_id", static_cast<uint32_t>(s.n_vocab - 1));
    kv.kv_bool("tokenizer.ggml.add_bos_token", true);

    Bytes out;
    out.put(uint32_t{0x46554747});  // "GGUF"
    out.put(uint32_t{3});
    out.put(static_cast<uint64_t>(ts.size()));
    out.put(kv.n_kv);
    out.bytes().insert(out.bytes().end(), kv.bytes().begin(), kv.bytes().end());
    uint64_t off = 0;
    for (const Tensor& t : ts) {
        out.str(t.name);
        out.put(uint32_t{t.rows == 1 ? 1u : 2u});
        out.put(static_cast<uint64_t>(t.cols));
        if (t.rows != 1) out.put(static_cast<uint64_t>(t.rows));
        out.put(static_cast<uint32_t>(t.type));
        out.put(off);
        off += (t.bytes() + kAlign - 1) / kAlign * kAlign;
    }
    while (out.bytes().size() % kAlign) out.bytes().push_back(0);
    return out;
}

// xorshift64*: fast, seeded, the same on every machine.
struct Rng {
    uint64_t s;
    uint64_t next() {
        s ^= s >> 12, s ^= s << 25, s ^= s >> 27;
        return s * 0x2545F4914F6CDD1Dull;
    }
    float uniform() { return static_cast<float>(next() >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f; }  // [-1, 1)
};

// One row of t's values: uniform with standard deviation t.sigma (a norm: 1), in
// t's encoding. Quantized blocks: random codes, scales giving that spread.
void fill_row(const Tensor& t, Rng& r, uint8_t* out) {
    const float a = t.sigma * std::sqrt(3.0f);  // uniform on [-a, a]: standard deviation sigma
    auto f16 = [](float x) { return cpu::fp32_to_fp16(x); };
    auto fill_codes = [&](uint8_t* p, size_t n) {
        for (size_t i = 0; i < n; i += 8) {
            const uint64_t v = r.next();
            std::memcpy(p + i, &v, std::min<size_t>(8, n - i));
        }
    };
    const int64_t nb = t.cols / dtype_block_elems(t.type);
    switch (t.type) {
        case DType::F32:
            for (int64_t i = 0; i < t.cols; ++i) {
                const float v = t.rows == 1 ? 1.0f : a * r.uniform();
                std::memcpy(out + 4 * i, &v, 4);
            }
            break;
        case DType::F16:
        case DType::BF16:
            for (int64_t i = 0; i < t.cols; ++i) {
                const float v = a * r.uniform();
                uint32_t bits;
                std::memcpy(&bits, &v, 4);
                const uint16_t h = t.type == DType::F16 ? f16(v) : static_cast<uint16_t>((bits + 0x8000u) >> 16);
                std::memcpy(out + 2 * i, &h, 2);
            }
            break;
        case DType::Q4_0:  // d * (q - 8), q uniform in 0..15: standard deviation 4.6 d
            for (int64_t b = 0; b < nb; ++b) {
                auto* blk = reinterpret_cast<BlockQ4_0*>(out) + b;
                blk->d = f16(t.sigma / 4.6f);
                fill_codes(blk->qs, sizeof blk->qs);
            }
            break;
        case DType::Q4_1:  // d * q + m, centred
            for (int64_t b = 0; b < nb; ++b) {
                auto* blk = reinterpret_cast<BlockQ4_1*>(out) + b;
                blk->d = f16(t.sigma / 4.6f);
                blk->m = f16(-7.5f * t.sigma / 4.6f);
                fill_codes(blk->qs, sizeof blk->qs);
            }
            break;
        case DType::Q8_0:  // d * q, q uniform in -128..127: standard deviation 74 d
            for (int64_t b = 0; b < nb; ++b) {
                auto* blk = reinterpret_cast<BlockQ8_0*>(out) + b;
                blk->d = f16(t.sigma / 74.0f);
                fill_codes(reinterpret_cast<uint8_t*>(blk->qs), sizeof blk->qs);
            }
            break;
        case DType::Q4_K:  // 6-bit scales and mins of 33 (first half) and 1, 2 (second half)
            for (int64_t b = 0; b < nb; ++b) {
                auto* blk = reinterpret_cast<BlockQ4_K*>(out) + b;
                blk->d = f16(t.sigma / (4.6f * 17.0f));
                blk->dmin = f16(7.5f * t.sigma / (4.6f * 17.0f));
                std::memset(blk->scales, 0x21, sizeof blk->scales);
                fill_codes(blk->qs, sizeof blk->qs);
            }
            break;
        case DType::Q5_0:  // d * (q - 16), q uniform in 0..31: standard deviation 9.2 d
            for (int64_t b = 0; b < nb; ++b) {
                auto* blk = reinterpret_cast<BlockQ5_0*>(out) + b;
                blk->d = f16(t.sigma / 9.2f);
                fill_codes(blk->qh, sizeof blk->qh);
                fill_codes(blk->qs, sizeof blk->qs);
            }
            break;
        case DType::Q5_1:  // d * q + m, centred
            for (int64_t b = 0; b < nb; ++b) {
                auto* blk = reinterpret_cast<BlockQ5_1*>(out) + b;
                blk->d = f16(t.sigma / 9.2f);
                blk->m = f16(-15.5f * t.sigma / 9.2f);
                fill_codes(blk->qh, sizeof blk->qh);
                fill_codes(blk->qs, sizeof blk->qs);
            }
            break;
        case DType::Q5_K:  // Q4_K's scales and mins; 5-bit codes (standard deviation 9.2, mean 15.5)
            for (int64_t b = 0; b < nb; ++b) {
                auto* blk = reinterpret_cast<BlockQ5_K*>(out) + b;
                blk->d = f16(t.sigma / (9.2f * 17.0f));
                blk->dmin = f16(15.5f * t.sigma / (9.2f * 17.0f));
                std::memset(blk->scales, 0x21, sizeof blk->scales);
                fill_codes(blk->qh, sizeof blk->qh);
                fill_codes(blk->qs, sizeof blk->qs);
            }
            break;
        case DType::Q6_K:  // d * scale * (q - 32), scale 16: standard deviation 18.5 * 16 d
            for (int64_t b = 0; b < nb; ++b) {
                auto* blk = reinterpret_cast<BlockQ6_K*>(out) + b;
                fill_codes(blk->ql, sizeof blk->ql);
                fill_codes(blk->qh, sizeof blk->qh);
                std::memset(blk->scales, 16, sizeof blk->scales);
                blk->d = f16(t.sigma / (18.5f * 16.0f));
            }
            break;
        default: break;  // refused before (write_synth_model)
    }
}

}  // namespace

std::optional<SynthShape> synth_shape(std::string_view name) {
    // Meta's Llama 3 configs (8B, 70B) with Llama 3.1's 128K context (the same
    // shapes; its RoPE scaling factors change no cost, and are left out); the
    // default model's; and a tiny one for tests.
    if (name == "llama3-8b") return SynthShape{"llama3-8b", 128256, 4096, 32, 14336, 32, 8, 131072, 500000.0, 1e-5f};
    if (name == "llama3-70b") return SynthShape{"llama3-70b", 128256, 8192, 80, 28672, 64, 8, 131072, 500000.0, 1e-5f};
    if (name == "smollm2-135m")
        return SynthShape{"smollm2-135m", 49152, 576, 30, 1536, 9, 3, 8192, 100000.0, 1e-5f, true};
    if (name == "tiny") return SynthShape{"tiny", 512, 256, 2, 512, 4, 2, 2048, 10000.0, 1e-5f};
    return std::nullopt;
}

std::vector<SynthTensor> synth_tensors(const SynthOptions& o) { return tensors_of(o); }

std::vector<std::string> synth_shape_names() { return {"llama3-8b", "llama3-70b", "smollm2-135m", "tiny"}; }

uint64_t synth_model_bytes(const SynthOptions& o) {
    const auto ts = tensors_of(o);
    uint64_t n = header(o, ts).bytes().size();
    for (const Tensor& t : ts) n += (t.bytes() + kAlign - 1) / kAlign * kAlign;
    return n;
}

Status write_synth_model(const std::string& path, const SynthOptions& o) {
    const SynthShape& s = o.shape;
    if (!dtype_supported(o.type) || o.type == DType::Q8_1 || o.type == DType::Q8_K)
        return make_error("synthetic model: weights of type {} are not something duet reads", dtype_name(o.type));
    if (s.n_head <= 0 || s.n_embd % s.n_head != 0 || s.n_head % std::max<int64_t>(1, s.n_head_kv) != 0 ||
        s.n_vocab < 258)
        return make_error("synthetic model: shape {} is not a model", s.name);
    const auto ts = tensors_of(o);
    for (const Tensor& t : ts)
        if (t.cols % dtype_block_elems(t.type) != 0)
            return make_error("synthetic model: {} has rows of {} values, not whole {} blocks of {}", t.name, t.cols,
                              dtype_name(t.type), dtype_block_elems(t.type));
    std::unique_ptr<FILE, int (*)(FILE*)> f(std::fopen(path.c_str(), "wb"), &std::fclose);
    if (!f) return make_error("synthetic model: cannot write {}: {}", path, std::strerror(errno));
    Bytes h = header(o, ts);
    auto write = [&](const void* p, size_t n) { return std::fwrite(p, 1, n, f.get()) == n; };
    if (!write(h.bytes().data(), h.bytes().size())) return make_error("synthetic model: writing {} failed", path);
    std::vector<uint8_t> row;
    const uint8_t zeros[kAlign] = {};
    for (size_t i = 0; i < ts.size(); ++i) {
        const Tensor& t = ts[i];
        Rng r{(o.seed + 1) * 0x9E3779B97F4A7C15ull ^ (i + 1) * 0xD1B54A32D192ED03ull};
        row.resize(dtype_row_bytes(t.type, t.cols));
        for (int64_t k = 0; k < t.rows; ++k) {
            fill_row(t, r, row.data());
            if (!write(row.data(), row.size())) return make_error("synthetic model: writing {} failed", path);
        }
        const uint64_t pad = (kAlign - t.bytes() % kAlign) % kAlign;
        if (pad && !write(zeros, pad)) return make_error("synthetic model: writing {} failed", path);
    }
    if (std::fflush(f.get()) != 0) return make_error("synthetic model: writing {} failed", path);
    return {};
}

}  // namespace duet
