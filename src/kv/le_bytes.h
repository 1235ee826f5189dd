// Fixed-size little-endian fields at byte offsets of the on-disk headers (blob.h,
// kv_log.h): memcpy, so any offset is fine. The formats are little-endian and so
// is every machine duet builds for (blob.cpp asserts it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace duet::le {

template <typename T>
void put(uint8_t* p, size_t off, T v) {
    std::memcpy(p + off, &v, sizeof v);
}
template <typename T>
T get(const uint8_t* p, size_t off) {
    T v;
    std::memcpy(&v, p + off, sizeof v);
    return v;
}

}  // namespace duet::le
