// Internal to duet_kernels_cpu: the per-ISA entry points that dispatch.cpp
// routes to, and small scalar helpers every level shares.
//
// Each level lives in its own translation unit compiled with its own -m flags.
// Everything defined in this header is `static inline` on purpose: an inline
// function with external linkage compiled in avx512.cpp could be the copy the
// linker keeps for scalar.cpp too, and then a CPU without AVX-512 faults. For the
// same reason the SIMD files avoid out-of-line standard library templates
// (std::vector growth and the like) and allocate scratch with std::malloc.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "kernels/cpu/kernels.h"

namespace duet::cpu {

// ---------------------------------------------------------------------------
// Per-level entry points. Preconditions are checked once in dispatch.cpp.

namespace scalar {
void round_fp16(float* x, int64_t n);
uint64_t read_fold(const void* p, size_t n);
// NEOX pairing is one scalar implementation for every level (it is cheap and so
// gives the same bits everywhere).
void rope_neox(float* x, int n_heads, int head_dim, int rot_dim, int64_t pos, const float* inv_freq);
void quantize_row(DType t, const float* src, void* dst, int64_t n);
void matmul(DType wtype, const void* w, size_t w_stride, int64_t n_in, const void* xq,
            size_t xq_stride, int n_tok, float* y, size_t ldy, int64_t r0, int64_t r1);
void rms_norm(const float* x, const float* w, float* y, int64_t n, float eps);
void rope(float* x, int n_heads, int head_dim, int rot_dim, int64_t pos, const float* inv_freq);
void swiglu(const float* gate, const float* up, float* out, int64_t n);
void add(float* y, const float* x, int64_t n);
void softmax(float* x, int64_t n);
float dot_f32_f16(const float* a, const uint16_t* b, int64_t n);
void axpy_f16(float a, const uint16_t* x, float* y, int64_t n);
void fp32_to_fp16_row(const float* x, uint16_t* y, int64_t n);
void attn_scores_f16(const float* q, const uint16_t* k, size_t stride, int64_t n, int64_t head_dim, float scale,
                     float* scores);
void attn_accum_f16(const float* p, const uint16_t* v, size_t stride, int64_t n, int64_t head_dim, float* out);
void attn_scores_q(KvQuant t, const float* q, const uint8_t* k, const float* k_scale, size_t stride, int64_t n,
                   int64_t head_dim, float scale, float* scores);
void attn_accum_q(KvQuant t, const float* p, const uint8_t* v, const float* v_scale, size_t stride, int64_t n,
                  int64_t head_dim, float* out);
}  // namespace scalar

namespace avx2 {
void round_fp16(float* x, int64_t n);
uint64_t read_fold(const void* p, size_t n);
void quantize_row(DType t, const float* src, void* dst, int64_t n);
void matmul(DType wtype, const void* w, size_t w_stride, int64_t n_in, const void* xq,
            size_t xq_stride, int n_tok, float* y, size_t ldy, int64_t r0, int64_t r1);
void rms_norm(const float* x, const float* w, float* y, int64_t n, float eps);
void rope(float* x, int n_heads, int head_dim, int rot_dim, int64_t pos, const float* inv_freq);
void swiglu(const float* gate, const float* up, float* out, int64_t n);
void add(float* y, const float* x, int64_t n);
void softmax(float* x, int64_t n);
float dot_f32_f16(const float* a, const uint16_t* b, int64_t n);
void axpy_f16(float a, const uint16_t* x, float* y, int64_t n);
void fp32_to_fp16_row(const float* x, uint16_t* y, int64_t n);
void attn_scores_f16(const float* q, const uint16_t* k, size_t stride, int64_t n, int64_t head_dim, float scale,
                     float* scores);
void attn_accum_f16(const float* p, const uint16_t* v, size_t stride, int64_t n, int64_t head_dim, float* out);
void attn_scores_q(KvQuant t, const float* q, const uint8_t* k, const float* k_scale, size_t stride, int64_t n,
                   int64_t head_dim, float scale, float* scores);
void attn_accum_q(KvQuant t, const float* p, const uint8_t* v, const float* v_scale, size_t stride, int64_t n,
                  int64_t head_dim, float* out);
}  // namespace avx2

namespace avx512 {
void round_fp16(float* x, int64_t n);
uint64_t read_fold(const void* p, size_t n);
void quantize_row(DType t, const float* src, void* dst, int64_t n);
void matmul(DType wtype, const void* w, size_t w_stride, int64_t n_in, const void* xq,
            size_t xq_stride, int n_tok, float* y, size_t ldy, int64_t r0, int64_t r1);
void rms_norm(const float* x, const float* w, float* y, int64_t n, float eps);
void rope(float* x, int n_heads, int head_dim, int rot_dim, int64_t pos, const float* inv_freq);
void swiglu(const float* gate, const float* up, float* out, int64_t n);
void add(float* y, const float* x, int64_t n);
void softmax(float* x, int64_t n);
float dot_f32_f16(const float* a, const uint16_t* b, int64_t n);
void axpy_f16(float a, const uint16_t* x, float* y, int64_t n);
void fp32_to_fp16_row(const float* x, uint16_t* y, int64_t n);
void attn_scores_f16(const float* q, const uint16_t* k, size_t stride, int64_t n, int64_t head_dim, float scale,
                     float* scores);
void attn_accum_f16(const float* p, const uint16_t* v, size_t stride, int64_t n, int64_t head_dim, float* out);
void attn_scores_q(KvQuant t, const float* q, const uint8_t* k, const float* k_scale, size_t stride, int64_t n,
                   int64_t head_dim, float scale, float* scores);
void attn_accum_q(KvQuant t, const float* p, const uint8_t* v, const float* v_scale, size_t stride, int64_t n,
                  int64_t head_dim, float* out);
void attn_scores_f16_rows(const float* q, size_t q_stride, size_t q_head, int64_t heads, int64_t rows, const int64_t* n,
                          const uint16_t* k, size_t stride, int64_t head_dim, float scale, float* scores,
                          size_t s_stride);
void attn_accum_f16_rows(const float* p, size_t p_stride, int64_t heads, int64_t rows, const int64_t* n,
                         const uint16_t* v, size_t stride, int64_t head_dim, float* out, size_t out_stride,
                         size_t out_head);
}  // namespace avx512

// The AVX-512 level's quantized products on AMX tiles (amx.cpp): avx512::matmul's
// bits, for passes of 16 tokens or more.
namespace amx {
void matmul(DType wtype, const void* w, size_t w_stride, int64_t n_in, const void* xq, size_t xq_stride, int n_tok,
            float* y, size_t ldy, int64_t r0, int64_t r1);
}  // namespace amx

// ---------------------------------------------------------------------------
// Scalar helpers shared by all levels.

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
}
static inline float f32_from_bits(uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// IEEE binary16 -> binary32, exact. NaNs come out quiet with their payload,
// which is what F16C's vcvtph2ps does, so scalar and SIMD agree bit for bit.
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const uint32_t e = (h >> 10) & 0x1Fu;
    const uint32_t m = h & 0x3FFu;
    if (e == 0x1F) {
        return f32_from_bits(sign | 0x7F800000u | (m ? 0x00400000u | (m << 13) : 0u));
    }
    if (e == 0) {
        // Zero or subnormal: m * 2^-24 is exact in float.
        return f32_from_bits(sign | f32_bits(static_cast<float>(m) * 0x1p-24f));
    }
    return f32_from_bits(sign | ((e + 112u) << 23) | (m << 13));
}

// IEEE binary32 -> binary16, round to nearest even; overflow goes to infinity;
// NaNs come out quiet with the top of their payload (as vcvtps2ph does).
// Assumes the FPU is in its default round-to-nearest mode.
static inline uint16_t float_to_half(float f) {
    const uint32_t x = f32_bits(f);
    const uint32_t sign = (x >> 16) & 0x8000u;
    const uint32_t ax = x & 0x7FFFFFFFu;
    if (ax > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((ax >> 13) & 0x3FFu));
    if (ax >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520 rounds to inf
    if (ax < 0x38800000u) {
        // Below the smallest normal half (2^-14): adding 0.5f, whose ulp is
        // 2^-24, rounds |f| to a multiple of 2^-24 (nearest even); the low bits
        // of the sum are then the half's subnormal mantissa (0x400 when it
        // rounds up to the smallest normal, which is also the right encoding).
        const float t = f32_from_bits(ax) + 0.5f;
        return static_cast<uint16_t>(sign | (f32_bits(t) - 0x3F000000u));
    }
    const uint32_t odd = (ax >> 13) & 1u;
    const uint32_t r = ax + 0xC8000FFFu + odd;  // rebias exponent (-112 << 23), round half even
    return static_cast<uint16_t>(sign | (r >> 13));
}

static inline float bf16_to_float(uint16_t h) { return f32_from_bits(static_cast<uint32_t>(h) << 16); }

// Round to nearest even; NaNs stay NaN (quiet).
static inline uint16_t float_to_bf16(float f) {
    const uint32_t x = f32_bits(f);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((x >> 16) | 0x0040u);
    return static_cast<uint16_t>((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

// Nearest integer, ties to even, for |v| < 2^22 (the same rounding as
// vcvtps2dq under the default MXCSR), so scalar and SIMD quantizers agree.
static inline int round_even(float v) {
    const float t = v + 12582912.0f;  // 1.5 * 2^23: the sum's low mantissa bits are the integer
    return static_cast<int>(f32_bits(t) & 0x007FFFFFu) - 0x00400000;
}

// Q4_K: the j-th (0..7) 6-bit scale and min of a super-block, from its 12
// packed bytes. Bytes 0-3: scales 0-3 (low 6 bits), top 2 bits = high bits of
// scales 4-7; bytes 4-7: mins 0-3, top 2 bits = high bits of mins 4-7;
// bytes 8-11: low nibble = low 4 bits of scale 4-7, high nibble = of min 4-7.
static inline void q4k_scale_min(int j, const uint8_t* s, int* sc, int* mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

// The AVX-512 level's accumulator lanes for 32-value blocks: lane l of a chunk's
// 16-lane float accumulator takes block q4_lane_block(l) (Q4_0, Q4_1, Q5_0, Q5_1)
// or q8_lane_block(l) (Q8_0) of each chunk of 16 (avx512.cpp; amx.cpp keeps them).
static inline constexpr int q4_lane_block(int lane) { return 4 * (lane % 4) + lane / 4; }
static inline constexpr int q8_lane_block(int lane) { return 8 * (lane / 8) + 2 * (lane % 4) + (lane / 4) % 2; }

// The 8 six-bit scales and the 8 six-bit mins of a Q4_K super-block, all at once:
// the packing q4k_scale_min unpacks one at a time, as four 32-bit word operations
// (byte k of each word is sub-block k's or k + 4's value). Every level's K-quant
// kernels use it.
static inline void q4k_scales_mins(const uint8_t* s, uint8_t* sc, uint8_t* mn) {
    uint32_t w0, w1, w2;
    std::memcpy(&w0, s, 4);
    std::memcpy(&w1, s + 4, 4);
    std::memcpy(&w2, s + 8, 4);
    const uint32_t lo6 = 0x3F3F3F3Fu, lo4 = 0x0F0F0F0Fu, lo2 = 0x03030303u;
    const uint32_t sc03 = w0 & lo6, mn03 = w1 & lo6;
    const uint32_t sc47 = (w2 & lo4) | (((w0 >> 6) & lo2) << 4);
    const uint32_t mn47 = ((w2 >> 4) & lo4) | (((w1 >> 6) & lo2) << 4);
    std::memcpy(sc, &sc03, 4);
    std::memcpy(sc + 4, &sc47, 4);
    std::memcpy(mn, &mn03, 4);
    std::memcpy(mn + 4, &mn47, 4);
}

// cos and sin of pos * inv_freq[i] for i < half. The angle is formed and
// reduced to [-pi, pi] in double (pos can be large), then sin/cos are taken in
// float. Every level uses this one function, so rope angles agree across levels.
static inline void rope_angles(int64_t pos, const float* inv_freq, int half, float* c, float* s) {
    constexpr double kTwoPi = 6.283185307179586476925286766559;
    for (int i = 0; i < half; ++i) {
        double th = static_cast<double>(pos) * static_cast<double>(inv_freq[i]);
        th -= kTwoPi * std::nearbyint(th / kTwoPi);
        const float t = static_cast<float>(th);
        c[i] = std::cos(t);
        s[i] = std::sin(t);
    }
}

// e4m3 bytes to float, every byte (scalar.cpp); SIMD levels gather from it.
extern const float kFp8E4M3[256];

static inline float kv_decode(KvQuant t, uint8_t b) {
    return t == KvQuant::Int8 ? static_cast<float>(static_cast<int8_t>(b)) : kFp8E4M3[b];
}

[[noreturn]] static inline void kernel_fail(const char* what) {
    std::fprintf(stderr, "duet kernels: %s\n", what);
    std::abort();
}

}  // namespace duet::cpu
