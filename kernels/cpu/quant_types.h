// Tensor element types as GGUF / ggml number them, with the block layouts of
// the quantized ones. Layouts follow ggml-common.h (see ../shared/FACTS.md).
#pragma once

#include <cstddef>
#include <cstdint>

namespace duet {

enum class DType : uint32_t {
    F32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q4_1 = 3,
    Q5_0 = 6,
    Q5_1 = 7,
    Q8_0 = 8,
    Q8_1 = 9,
    Q2_K = 10,
    Q3_K = 11,
    Q4_K = 12,
    Q5_K = 13,
    Q6_K = 14,
    Q8_K = 15,
    BF16 = 30,
};

inline constexpr int kQK = 32;    // elements per block of Q4_0, Q4_1, Q8_0, Q8_1
inline constexpr int kQKK = 256;  // elements per super-block of the K-quants

struct BlockQ4_0 {
    uint16_t d;  // f16 scale
    uint8_t qs[kQK / 2];
};
struct BlockQ4_1 {
    uint16_t d;  // f16 scale
    uint16_t m;  // f16 minimum
    uint8_t qs[kQK / 2];
};
// Q5_0 / Q5_1: Q4_0 / Q4_1 with a fifth bit per value: bit i of qh (little-endian)
// is the top bit of value i (values 0-15: low nibbles of qs, 16-31: high nibbles).
struct BlockQ5_0 {
    uint16_t d;
    uint8_t qh[4];
    uint8_t qs[kQK / 2];
};
struct BlockQ5_1 {
    uint16_t d;
    uint16_t m;
    uint8_t qh[4];
    uint8_t qs[kQK / 2];
};
struct BlockQ8_0 {
    uint16_t d;
    int8_t qs[kQK];
};
struct BlockQ8_1 {
    uint16_t d;  // f16 scale
    uint16_t s;  // f16 of d * sum(qs)
    int8_t qs[kQK];
};
struct BlockQ4_K {
    uint16_t d;
    uint16_t dmin;
    uint8_t scales[12];  // 8 six-bit scales and 8 six-bit mins, packed
    uint8_t qs[kQKK / 2];
};
// Q5_K: Q4_K's scales and mins, with a fifth bit per value: value l of sub-block j
// (0..7) is its Q4_K nibble | bit j of qh[l] << 4.
struct BlockQ5_K {
    uint16_t d;
    uint16_t dmin;
    uint8_t scales[12];
    uint8_t qh[kQKK / 8];
    uint8_t qs[kQKK / 2];
};
struct BlockQ6_K {
    uint8_t ql[kQKK / 2];
    uint8_t qh[kQKK / 4];
    int8_t scales[kQKK / 16];
    uint16_t d;
};
// Activation side of K-quant dot products (not stored in files).
struct BlockQ8_K {
    float d;
    int8_t qs[kQKK];
    int16_t bsums[kQKK / 16];
};

static_assert(sizeof(BlockQ4_0) == 18);
static_assert(sizeof(BlockQ4_1) == 20);
static_assert(sizeof(BlockQ5_0) == 22);
static_assert(sizeof(BlockQ5_1) == 24);
static_assert(sizeof(BlockQ8_0) == 34);
static_assert(sizeof(BlockQ8_1) == 36);
static_assert(sizeof(BlockQ4_K) == 144);
static_assert(sizeof(BlockQ5_K) == 176);
static_assert(sizeof(BlockQ6_K) == 210);
static_assert(sizeof(BlockQ8_K) == 292);

// Elements per block (1 for plain types); 0 for a type duet does not support.
inline constexpr int64_t dtype_block_elems(DType t) {
    switch (t) {
        case DType::F32: case DType::F16: case DType::BF16: return 1;
        case DType::Q4_0:
        case DType::Q4_1:
        case DType::Q5_0:
        case DType::Q5_1:
        case DType::Q8_0:
        case DType::Q8_1: return kQK;
        case DType::Q4_K:
        case DType::Q5_K:
        case DType::Q6_K:
        case DType::Q8_K: return kQKK;
        default: return 0;
    }
}

// Bytes per block; 0 for a type duet does not support.
inline constexpr size_t dtype_block_bytes(DType t) {
    switch (t) {
        case DType::F32: return 4;
        case DType::F16: case DType::BF16: return 2;
        case DType::Q4_0: return sizeof(BlockQ4_0);
        case DType::Q4_1: return sizeof(BlockQ4_1);
        case DType::Q5_0: return sizeof(BlockQ5_0);
        case DType::Q5_1: return sizeof(BlockQ5_1);
        case DType::Q8_0: return sizeof(BlockQ8_0);
        case DType::Q8_1: return sizeof(BlockQ8_1);
        case DType::Q4_K: return sizeof(BlockQ4_K);
        case DType::Q5_K: return sizeof(BlockQ5_K);
        case DType::Q6_K: return sizeof(BlockQ6_K);
        case DType::Q8_K: return sizeof(BlockQ8_K);
        default: return 0;
    }
}

inline constexpr bool dtype_supported(DType t) { return dtype_block_elems(t) != 0; }

// Bytes of a row of n elements (n must be a multiple of the block size).
inline constexpr size_t dtype_row_bytes(DType t, int64_t n) {
    return static_cast<size_t>(n / dtype_block_elems(t)) * dtype_block_bytes(t);
}

// "Q4_1"; "unknown" for ids duet does not know.
inline constexpr const char* dtype_name(DType t) {
    switch (t) {
        case DType::F32: return "F32";
        case DType::F16: return "F16";
        case DType::Q4_0: return "Q4_0";
        case DType::Q4_1: return "Q4_1";
        case DType::Q5_0: return "Q5_0";
        case DType::Q5_1: return "Q5_1";
        case DType::Q8_0: return "Q8_0";
        case DType::Q8_1: return "Q8_1";
        case DType::Q2_K: return "Q2_K";
        case DType::Q3_K: return "Q3_K";
        case DType::Q4_K: return "Q4_K";
        case DType::Q5_K: return "Q5_K";
        case DType::Q6_K: return "Q6_K";
        case DType::Q8_K: return "Q8_K";
        case DType::BF16: return "BF16";
    }
    return "unknown";
}

}  // namespace duet
