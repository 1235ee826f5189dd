#include "model/model.h"

#include <cmath>
#include <cstring>

namespace duet {

namespace {

uint64_t fnv1a(uint64_t h, const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    for (size_t i = 0; i < n; ++i) {
        h ^= b[i];
        h *= 0x100000001b3ull;
    }
    return h;
}

// Checks that tensor `name` exists with shape [ne0, ne1] (ne1 = 1 for vectors).
Result<const GgufTensor*> need(const GgufFile& f, const std::string& name, int64_t ne0, int64_t ne1) {
    const GgufTensor* t = f.tensor(name);
    if (!t) return make_error("tensor '{}' is missing", name);
    if (t->ne[0] != ne0 || t->ne[1] != ne1 || t->ne[2] != 1 || t->ne[3] != 1)
        return make_error("tensor '{}' has shape [{}, {}, {}, {}], expected [{}, {}]", name, t->ne[0], t->ne[1],
                          t->ne[2], t->ne[3], ne0, ne1);
    return t;
}

Status need_f32(const GgufTensor* t) {
    if (t->type != DType::F32) return make_error("tensor '{}' should be F32, found {}", t->name, dtype_name(t->type));
    return {};
}

}  // namespace

Result<std::unique_ptr<Model>> Model::load(const std::string& path) {
    auto f = GgufFile::open(path);
    if (!f) return f.error();
    std::unique_ptr<Model> m(new Model());
    m->file_ = std::move(f).value();
    if (Status s = m->init(); !s) return make_error("{}: {}", path, s.error().message);
    return m;
}

Status Model::init() {
    const GgufFile& f = *file_;
    auto arch = f.get_string("general.architecture");
    if (!arch) return arch.error();
    cfg_.arch = std::string(*arch);
    if (cfg_.arch != "llama" && cfg_.arch != "qwen2")
        return make_error("architecture '{}' is not supported (supported: llama, qwen2)", cfg_.arch);
    cfg_.name = std::string(f.get_string("general.name").ok() ? *f.get_string("general.name") : "");
    const std::string a = cfg_.arch + ".";

#define DUET_GET(dst, getter, key)              \
    do {                                        \
        auto r_ = f.getter(a + key);            \
        if (!r_) return r_.error();             \
        dst = *r_;                              \
    } while (0)
    DUET_GET(cfg_.n_ctx_train, get_int, "context_length");
    DUET_GET(cfg_.n_embd, get_int, "embedding_length");
    DUET_GET(cfg_.n_layer, get_int, "block_count");
    DUET_GET(cfg_.n_ff, get_int, "feed_forward_length");
    DUET_GET(cfg_.n_head, get_int, "attention.head_count");
    DUET_GET(cfg_.rms_eps, get_float, "attention.layer_norm_rms_epsilon");
#undef DUET_GET
    auto n_head_kv = f.get_int_or(a + "attention.head_count_kv", cfg_.n_head);
    if (!n_head_kv) return n_head_kv.error();
    cfg_.n_head_kv = *n_head_kv;
    auto rope_base = f.get_float_or(a + "rope.freq_base", 10000.0);
    if (!rope_base) return rope_base.error();
    cfg_.rope_base = *rope_base;

    if (cfg_.n_embd <= 0 || cfg_.n_layer <= 0 || cfg_.n_head <= 0 || cfg_.n_head_kv <= 0 || cfg_.n_ff <= 0 ||
        cfg_.n_layer > 1024 || cfg_.n_embd > (1 << 20))
        return make_error("implausible hyper-parameters: n_embd {}, n_layer {}, n_head {}, n_head_kv {}, n_ff {}",
                          cfg_.n_embd, cfg_.n_layer, cfg_.n_head, cfg_.n_head_kv, cfg_.n_ff);
    if (cfg_.n_head % cfg_.n_head_kv != 0)
        return make_error("head_count {} is not a multiple of head_count_kv {}", cfg_.n_head, cfg_.n_head_kv);
    auto key_len = f.get_int_or(a + "attention.key_length", cfg_.n_embd / cfg_.n_head);
    if (!key_len) return key_len.error();
    cfg_.head_dim = *key_len;
    auto val_len = f.get_int_or(a + "attention.value_length", cfg_.head_dim);
    if (!val_len) return val_len.error();
    if (*val_len != cfg_.head_dim)
        return make_error("key_length {} != value_length {} is not supported", cfg_.head_dim, *val_len);
    auto rot = f.get_int_or(a + "rope.dimension_count", cfg_.head_dim);
    if (!rot) return rot.error();
    cfg_.rot_dim = *rot;
    if (cfg_.head_dim % 2 != 0 || cfg_.rot_dim % 2 != 0 || cfg_.rot_dim > cfg_.head_dim || cfg_.rot_dim <= 0)
        return make_error("rope dimension {} does not fit head size {}", cfg_.rot_dim, cfg_.head_dim);
    if (const GgufValue* rs = f.find(a + "rope.scaling.type")) {
        if (rs->type == GgufType::STRING && rs->s != "none" && rs->s != "llama3")
            return make_error("rope scaling '{}' is not supported", rs->s);
    }

    const int64_t E = cfg_.n_embd, H = cfg_.head_dim, Q = cfg_.n_head * H, KV = cfg_.n_head_kv * H, F = cfg_.n_ff;

    tok_embd_ = f.tensor("token_embd.weight");
    if (!tok_embd_) return make_error("tensor 'token_embd.weight' is missing");
    if (tok_embd_->ne[0] != E || tok_embd_->n_dims != 2)
        return make_error("token_embd.weight has row length {}, expected n_embd {}", tok_embd_->ne[0], E);
    cfg_.n_vocab = tok_embd_->ne[1];
    auto nv = f.get_int_or(a + "vocab_size", cfg_.n_vocab);
    if (!nv) return nv.error();
    if (*nv != cfg_.n_vocab)
        return make_error("vocab_size {} disagrees with token_embd.weight rows {}", *nv, cfg_.n_vocab);

    auto on = need(f, "output_norm.weight", E, 1);
    if (!on) return on.error();
    output_norm_ = *on;
    if (Status s = need_f32(output_norm_); !s) return s;
    if (f.tensor("output.weight")) {
        auto o = need(f, "output.weight", E, cfg_.n_vocab);
        if (!o) return o.error();
        output_ = *o;
    } else {
        output_ = tok_embd_;
        cfg_.tied_output = true;
    }

    cfg_.qkv_bias = f.tensor("blk.0.attn_q.bias") != nullptr;
    cfg_.rope_neox = cfg_.arch == "qwen2";
    layers_.resize(cfg_.n_layer);
    for (int64_t l = 0; l < cfg_.n_layer; ++l) {
        LayerWeights& w = layers_[l];
        const std::string p = "blk." + std::to_string(l) + ".";
        struct Want {
            const GgufTensor** dst;
            const char* name;
            int64_t ne0, ne1;
        };
        std::vector<Want> wants = {
            {&w.attn_norm, "attn_norm.weight", E, 1}, {&w.wq, "attn_q.weight", E, Q},
            {&w.wk, "attn_k.weight", E, KV},          {&w.wv, "attn_v.weight", E, KV},
            {&w.wo, "attn_output.weight", Q, E},      {&w.ffn_norm, "ffn_norm.weight", E, 1},
            {&w.w_gate, "ffn_gate.weight", E, F},     {&w.w_up, "ffn_up.weight", E, F},
            {&w.w_down, "ffn_down.weight", F, E},
        };
        if (cfg_.qkv_bias) {
            wants.push_back({&w.bq, "attn_q.bias", Q, 1});
            wants.push_back({&w.bk, "attn_k.bias", KV, 1});
            wants.push_back({&w.bv, "attn_v.bias", KV, 1});
        }
        for (const Want& x : wants) {
            auto t = need(f, p + x.name, x.ne0, x.ne1);
            if (!t) return t.error();
            *x.dst = *t;
        }
        for (const GgufTensor* t : {w.attn_norm, w.ffn_norm, w.bq, w.bk, w.bv})
            if (t)
                if (Status s = need_f32(t); !s) return s;
    }

    // inv_freq[i] = base^(-2i/rot_dim), divided by the optional rope_freqs factors
    // (Llama 3.1 long-context scaling stores them as a tensor).
    const int64_t n_pairs = cfg_.rot_dim / 2;
    inv_freq_.resize(n_pairs);
    const GgufTensor* factors = f.tensor("rope_freqs.weight");
    if (factors && (factors->type != DType::F32 || factors->ne[0] != n_pairs))
        return make_error("rope_freqs.weight should be F32 with {} values", n_pairs);
    for (int64_t i = 0; i < n_pairs; ++i) {
        double inv = std::pow(cfg_.rope_base, -2.0 * static_cast<double>(i) / static_cast<double>(cfg_.rot_dim));
        if (factors) {
            float fac;
            std::memcpy(&fac, factors->data + 4 * i, 4);
            inv /= fac;
        }
        inv_freq_[i] = static_cast<float>(inv);
    }

    uint64_t h = 0xcbf29ce484222325ull;
    for (const GgufTensor& t : f.tensors()) {
        h = fnv1a(h, t.name.data(), t.name.size());
        h = fnv1a(h, &t.type, sizeof(t.type));
        h = fnv1a(h, t.ne, sizeof(t.ne));
        h = fnv1a(h, t.data, std::min<size_t>(t.nbytes, 256));
    }
    fingerprint_ = h;
    return {};
}

size_t Model::weight_bytes_per_token() const {
    size_t n = output_->nbytes + tok_embd_->row_bytes();
    for (const LayerWeights& w : layers_)
        for (const GgufTensor* t : {w.wq, w.wk, w.wv, w.wo, w.w_gate, w.w_up, w.w_down}) n += t->nbytes;
    return n;
}

}  // namespace duet
