#include "model/fingerprint.h"

#include <algorithm>
#include <cstring>
#include <string_view>

#include <openssl/evp.h>

namespace duet {

namespace {

class Sha {
public:
    Sha() : ctx_(EVP_MD_CTX_new()) { EVP_DigestInit_ex(ctx_, EVP_sha256(), nullptr); }
    ~Sha() { EVP_MD_CTX_free(ctx_); }
    Sha(const Sha&) = delete;
    Sha& operator=(const Sha&) = delete;
    void add(const void* p, size_t n) { EVP_DigestUpdate(ctx_, p, n); }
    template <typename T>
    void add_val(T v) {
        add(&v, sizeof v);
    }
    void add_str(std::string_view s) {
        add_val<uint64_t>(s.size());
        add(s.data(), s.size());
    }
    Fp128 done() {
        uint8_t md[32];
        unsigned len = 0;
        EVP_DigestFinal_ex(ctx_, md, &len);
        Fp128 f;
        std::memcpy(f.data(), md, f.size());
        return f;
    }

private:
    EVP_MD_CTX* ctx_;
};

size_t gguf_elem_bytes(GgufType t) {
    switch (t) {
        case GgufType::U8: case GgufType::I8: case GgufType::BOOL: return 1;
        case GgufType::U16: case GgufType::I16: return 2;
        case GgufType::U32: case GgufType::I32: case GgufType::F32: return 4;
        default: return 8;
    }
}

// A value's type and content, canonically (scalars widened as the reader keeps them).
void add_value(Sha& h, const GgufValue& v) {
    h.add_val<uint32_t>(static_cast<uint32_t>(v.type));
    switch (v.type) {
        case GgufType::STRING: h.add_str(v.s); break;
        case GgufType::ARRAY:
            h.add_val<uint32_t>(static_cast<uint32_t>(v.elem_type));
            h.add_val<uint64_t>(v.count);
            if (v.elem_type == GgufType::STRING)
                for (std::string_view s : v.strs) h.add_str(s);
            else if (v.elems)
                h.add(v.elems, v.count * gguf_elem_bytes(v.elem_type));
            break;
        case GgufType::F32: case GgufType::F64: h.add_val<double>(v.f); break;
        default: h.add_val<uint64_t>(v.u); h.add_val<int64_t>(v.i); break;
    }
}

bool starts_with(std::string_view s, std::string_view p) { return s.substr(0, p.size()) == p; }

}  // namespace

Fp128 model_fingerprint(const GgufFile& f) {
    Sha h;
    h.add_str("duet model fingerprint v1");
    for (const auto& [key, v] : f.metadata()) {
        if (starts_with(key, "tokenizer.")) continue;
        if (starts_with(key, "general.") && key != "general.architecture") continue;
        h.add_str(key);
        add_value(h, v);
    }
    constexpr size_t kWhole = 64 << 10, kWindow = 4 << 10, kWindows = 16;
    for (const GgufTensor& t : f.tensors()) {
        h.add_str(t.name);
        h.add_val<uint32_t>(static_cast<uint32_t>(t.type));
        h.add(t.ne, sizeof t.ne);
        h.add_val<uint64_t>(t.offset);
        h.add_val<uint64_t>(t.nbytes);
        if (t.nbytes <= kWhole) {
            h.add(t.data, t.nbytes);
        } else {
            for (size_t w = 0; w < kWindows; ++w) {
                const size_t at = (t.nbytes - kWindow) * w / (kWindows - 1);
                h.add(t.data + at, kWindow);
            }
        }
    }
    return h.done();
}

Fp128 tokenizer_fingerprint(const GgufFile& f) {
    Sha h;
    h.add_str("duet tokenizer fingerprint v1");
    h.add_val<uint32_t>(kTokenizerImplVersion);
    // Sorted by key: the order keys were written in does not change tokenization.
    std::vector<const std::pair<std::string_view, GgufValue>*> keys;
    for (const auto& kv : f.metadata())
        if (starts_with(kv.first, "tokenizer.") && !starts_with(kv.first, "tokenizer.chat_template")) keys.push_back(&kv);
    std::sort(keys.begin(), keys.end(), [](auto* a, auto* b) { return a->first < b->first; });
    for (const auto* kv : keys) {
        h.add_str(kv->first);
        add_value(h, kv->second);
    }
    return h.done();
}

}  // namespace duet
