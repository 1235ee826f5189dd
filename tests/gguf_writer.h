// Builds GGUF files in memory for tests: the format written out field by field
// from the spec (../shared/FACTS.md), independent of the reader under test.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace duet::test {

class GgufWriter {
public:
    explicit GgufWriter(uint32_t version = 3, bool u32_counts = false) : version_(version), u32_counts_(u32_counts) {}

    void kv_u8(const std::string& k, uint8_t v) { key(k, 0); put(v); ++n_kv_; }
    void kv_i8(const std::string& k, int8_t v) { key(k, 1); put(v); ++n_kv_; }
    void kv_u16(const std::string& k, uint16_t v) { key(k, 2); put(v); ++n_kv_; }
    void kv_i16(const std::string& k, int16_t v) { key(k, 3); put(v); ++n_kv_; }
    void kv_u32(const std::string& k, uint32_t v) { key(k, 4); put(v); ++n_kv_; }
    void kv_i32(const std::string& k, int32_t v) { key(k, 5); put(v); ++n_kv_; }
    void kv_f32(const std::string& k, float v) { key(k, 6); put(v); ++n_kv_; }
    void kv_bool(const std::string& k, bool v) { key(k, 7); put(static_cast<uint8_t>(v)); ++n_kv_; }
    void kv_str(const std::string& k, const std::string& v) { key(k, 8); str(v); ++n_kv_; }
    void kv_u64(const std::string& k, uint64_t v) { key(k, 10); put(v); ++n_kv_; }
    void kv_i64(const std::string& k, int64_t v) { key(k, 11); put(v); ++n_kv_; }
    void kv_f64(const std::string& k, double v) { key(k, 12); put(v); ++n_kv_; }
    void kv_arr_str(const std::string& k, const std::vector<std::string>& v) {
        key(k, 9);
        put(uint32_t{8});
        put(static_cast<uint64_t>(v.size()));
        for (const auto& s : v) str(s);
        ++n_kv_;
    }
    template <typename T>
    void kv_arr(const std::string& k, uint32_t elem_type, const std::vector<T>& v) {
        key(k, 9);
        put(elem_type);
        put(static_cast<uint64_t>(v.size()));
        for (const T& x : v) put(x);
        ++n_kv_;
    }

    // A tensor with raw data bytes; offsets are assigned at alignment.
    void tensor(const std::string& name, uint32_t type, std::vector<uint64_t> ne, std::vector<uint8_t> data) {
        tensors_.push_back({name, type, std::move(ne), std::move(data)});
    }

    std::vector<uint8_t> build(size_t alignment = 32) const {
        std::vector<uint8_t> out;
        auto app = [&](const void* p, size_t n) {
            const auto* b = static_cast<const uint8_t*>(p);
            out.insert(out.end(), b, b + n);
        };
        app("GGUF", 4);
        app(&version_, 4);
        uint64_t nt = tensors_.size(), nk = n_kv_;
        if (u32_counts_) {
            // GGUF v1 style 32-bit counts are not valid v2/v3; kept for negative tests.
            uint32_t a = static_cast<uint32_t>(nt), b = static_cast<uint32_t>(nk);
            app(&a, 4);
            app(&b, 4);
        } else {
            app(&nt, 8);
            app(&nk, 8);
        }
        out.insert(out.end(), kv_.begin(), kv_.end());
        uint64_t off = 0;
        std::vector<uint64_t> offs;
        for (const auto& t : tensors_) {
            uint64_t len = t.name.size();
            app(&len, 8);
            app(t.name.data(), t.name.size());
            uint32_t nd = static_cast<uint32_t>(t.ne.size());
            app(&nd, 4);
            for (uint64_t x : t.ne) app(&x, 8);
            app(&t.type, 4);
            app(&off, 8);
            offs.push_back(off);
            off += (t.data.size() + alignment - 1) / alignment * alignment;
        }
        while (out.size() % alignment) out.push_back(0);
        for (size_t i = 0; i < tensors_.size(); ++i) {
            out.insert(out.end(), tensors_[i].data.begin(), tensors_[i].data.end());
            while ((out.size()) % alignment) out.push_back(0);
        }
        return out;
    }

private:
    struct T {
        std::string name;
        uint32_t type;
        std::vector<uint64_t> ne;
        std::vector<uint8_t> data;
    };
    template <typename V>
    void put(V v) {
        const auto* b = reinterpret_cast<const uint8_t*>(&v);
        kv_.insert(kv_.end(), b, b + sizeof(V));
    }
    void str(const std::string& s) {
        put(static_cast<uint64_t>(s.size()));
        kv_.insert(kv_.end(), s.begin(), s.end());
    }
    void key(const std::string& k, uint32_t type) {
        str(k);
        put(type);
    }

    uint32_t version_;
    bool u32_counts_;
    uint64_t n_kv_ = 0;
    std::vector<uint8_t> kv_;
    std::vector<T> tensors_;
};

}  // namespace duet::test
