// FNV-1a, 64 bits: a fingerprint of bytes (an instance's configuration, a prompt A1
// refused), never a security boundary.
#pragma once

#include <cstddef>
#include <cstdint>

namespace duet {

struct Fnv {
    uint64_t h = 1469598103934665603ull;
    void add(const void* p, size_t n) {
        const auto* b = static_cast<const uint8_t*>(p);
        for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
    }
    template <typename T>
    void add(const T& v) {
        add(&v, sizeof v);
    }
};

}  // namespace duet
