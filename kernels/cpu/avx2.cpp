// AVX2 + FMA + F16C level. Compiled with -mavx2 -mfma -mf16c only.
//
// Reduction order (what makes matmul batch-invariant): for one (row, token)
// every kernel below runs the same sequence of vector operations whatever the
// tile it sits in; tiles only interleave independent (row, token) chains.
// - F32/F16/BF16 weights: one 8-lane accumulator over k in steps of 8, then
//   hsum(acc) (fixed tree), then the n_in % 8 tail added in order.
// - Q4_0, Q5_0, Q8_0: acc += cvt(int lane sums of block b) * (d_w d_x), block
//   by block; result hsum(acc).
// - Q4_1, Q5_1: the same, plus a scalar sm += m_w s_x per block; result
//   hsum(acc) + sm.
// - Q4_K, Q5_K, Q6_K: exact integer sums per super-block, then the scalar level's
//   own float expression, so these agree bit for bit with Isa::Scalar.
#include <immintrin.h>

#include <algorithm>
#include <cstddef>
#include <type_traits>

#include "kernels/cpu/kernels_impl.h"

namespace duet::cpu::avx2 {

namespace {

// ---------------------------------------------------------------------------
// Small helpers

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

inline int hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
    return _mm_cvtsi128_si32(s);
}

inline float hmax(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

inline __m256 abs_ps(__m256 v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v); }

// half_to_float and float_to_half in one F16C instruction each (same bits;
// see the Fp16 tests).
inline float h2f(uint16_t h) { return _cvtsh_ss(h); }
inline uint16_t f2h(float f) { return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT)); }

// 32 floats times id, rounded to nearest even, to 32 int8 in order; returns the
// four int32 vectors' sum vector (callers that need sums use it).
inline __m256i quant32(const float* x, float id, int8_t* out, __m256i* i32 /* [4] or null */) {
    const __m256 m = _mm256_set1_ps(id);
    const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 0), m));
    const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8), m));
    const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 16), m));
    const __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 24), m));
    // packs works within 128-bit lanes; the permute restores element order.
    const __m256i p01 = _mm256_packs_epi32(i0, i1);
    const __m256i p23 = _mm256_packs_epi32(i2, i3);
    __m256i b = _mm256_packs_epi16(p01, p23);
    b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), b);
    if (i32 != nullptr) {
        i32[0] = i0;
        i32[1] = i1;
        i32[2] = i2;
        i32[3] = i3;
    }
    return _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
}

inline float absmax32(const float* x) {
    __m256 m = abs_ps(_mm256_loadu_ps(x));
    m = _mm256_max_ps(m, abs_ps(_mm256_loadu_ps(x + 8)));
    m = _mm256_max_ps(m, abs_ps(_mm256_loadu_ps(x + 16)));
    m = _mm256_max_ps(m, abs_ps(_mm256_loadu_ps(x + 24)));
    return hmax(m);
}

// exp for float lanes: Cephes-style range reduction and degree-6 polynomial,
// about 2 ulp. Results below 2.5e-38 (x < -86.64, and -inf) are flushed to
// exactly 0; x past ln(FLT_MAX) gives inf; NaN stays NaN.
inline __m256 exp_ps(__m256 x) {
    const __m256 hi = _mm256_set1_ps(88.7228391f);
    const __m256 lo = _mm256_set1_ps(-86.64f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(hi, x);  // operand order keeps NaN inputs NaN
    x = _mm256_max_ps(lo, x);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    // Scale by 2^n, n in [-125, 128], as 2^(n-1) * 2 so that both factors
    // are normal floats.
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(126)), 23);
    p = _mm256_mul_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), _mm256_set1_ps(2.0f));
    return _mm256_andnot_ps(under, p);
}

// Scratch for repacked activations: on the stack when small, else the heap.
class Scratch {
   public:
    explicit Scratch(size_t n) {
        if (n <= sizeof(buf_)) {
            p_ = buf_;
        } else {
            p_ = static_cast<uint8_t*>(std::aligned_alloc(64, (n + 63) & ~size_t{63}));
            if (p_ == nullptr) kernel_fail("matmul: out of memory for activation scratch");
        }
    }
    ~Scratch() {
        if (p_ != buf_) std::free(p_);
    }
    Scratch(const Scratch&) = delete;
    Scratch& operator=(const Scratch&) = delete;
    uint8_t* data() { return p_; }

   private:
    alignas(64) uint8_t buf_[16384];
    uint8_t* p_;
};

// Decode streams each weight row once from memory; prefetching kPrefetchAhead
// bytes past the current row keeps more cache lines in flight than the
// out-of-order window alone does (see avx512.cpp). Prefetches never fault.
constexpr size_t kPrefetchAhead = 4096;
inline void prefetch_row(const void* row, size_t bytes) {
    const char* p = static_cast<const char*>(row) + kPrefetchAhead;
    for (size_t off = 0; off < bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
}

// Rows per block so that a block of weight rows stays in L2 while every token
// tile passes over it.
int64_t row_block(size_t row_bytes) {
    const int64_t rb = static_cast<int64_t>((256 * 1024) / std::max<size_t>(row_bytes, 1));
    return std::max<int64_t>(rb, 16);
}

// ---------------------------------------------------------------------------
// Float weights: F32, F16, BF16 times F32 activations.

inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }
inline __m256 load8(const uint16_t* w, DType t) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
    if (t == DType::F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline float load1(const void* w, DType t, int64_t k) {
    switch (t) {
        case DType::F32: return static_cast<const float*>(w)[k];
        case DType::F16: return half_to_float(static_cast<const uint16_t*>(w)[k]);
        default: return bf16_to_float(static_cast<const uint16_t*>(w)[k]);
    }
}

// Streamed rows (decode, `prefetch`): each row's line kFloatAheadL2 bytes ahead is
// asked into L2, and kFloatAheadL1 ahead into L1, as the row reaches each 64 bytes
// (spread among its own loads, as avx512.cpp's prefetch_ahead; a burst per row block
// left 8 interleaved rows at 10 GB/s a core on F16, Zen 4). Prefetches never fault
// and change no result.
constexpr size_t kFloatAheadL2 = 12288, kFloatAheadL1 = 1024;

template <int R, int T, bool Prefetch = false>
void float_tile(DType t, const char* w, size_t w_stride, int64_t n, const char* x, size_t x_stride, float* y,
                size_t ldy, int64_t r) {
    const void* wr[R];
    const float* xr[T];
    for (int i = 0; i < R; ++i) wr[i] = w + static_cast<size_t>(r + i) * w_stride;
    for (int j = 0; j < T; ++j) xr[j] = reinterpret_cast<const float*>(x + static_cast<size_t>(j) * x_stride);
    __m256 acc[R][T];
    for (int i = 0; i < R; ++i)
        for (int j = 0; j < T; ++j) acc[i][j] = _mm256_setzero_ps();
    const int64_t n8 = n & ~int64_t{7};
    const int64_t esize = t == DType::F32 ? 4 : 2;
    for (int64_t k = 0; k < n8; k += 8) {
        if constexpr (Prefetch) {
            if ((k * esize) % 64 == 0) {
                for (int i = 0; i < R; ++i) {
                    const char* at = static_cast<const char*>(wr[i]) + k * esize;
                    _mm_prefetch(at + kFloatAheadL2, _MM_HINT_T1);
                    _mm_prefetch(at + kFloatAheadL1, _MM_HINT_T0);
                }
            }
        }
        __m256 xv[T];
        for (int j = 0; j < T; ++j) xv[j] = _mm256_loadu_ps(xr[j] + k);
        for (int i = 0; i < R; ++i) {
            const __m256 wv = t == DType::F32 ? load8(static_cast<const float*>(wr[i]) + k)
                                              : load8(static_cast<const uint16_t*>(wr[i]) + k, t);
            for (int j = 0; j < T; ++j) acc[i][j] = _mm256_fmadd_ps(wv, xv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < R; ++i) {
        for (int j = 0; j < T; ++j) {
            float s = hsum(acc[i][j]);
            for (int64_t k = n8; k < n; ++k) s += load1(wr[i], t, k) * xr[j][k];
            y[static_cast<size_t>(j) * ldy + static_cast<size_t>(r + i)] = s;
        }
    }
}

template <int T>
void float_rows(DType t, const char* w, size_t w_stride, int64_t n, const char* x, size_t x_stride, float* y,
                size_t ldy, int64_t r0, int64_t r1, bool prefetch) {
    constexpr int R = T == 1 ? 8 : 4;
    int64_t r = r0;
    for (; r + R <= r1; r += R) {
        if (prefetch) {
            float_tile<R, T, true>(t, w, w_stride, n, x, x_stride, y, ldy, r);
        } else {
            float_tile<R, T>(t, w, w_stride, n, x, x_stride, y, ldy, r);
        }
    }
    for (; r < r1; ++r) float_tile<1, T>(t, w, w_stride, n, x, x_stride, y, ldy, r);
}

void matmul_float(DType t, const void* w, size_t w_stride, int64_t n, const void* xq, size_t xq_stride, int n_tok,
                  float* y, size_t ldy, int64_t r0, int64_t r1) {
    constexpr int kT = 3;
    const char* wb = static_cast<const char*>(w);
    const char* xb = static_cast<const char*>(xq);
    const bool single_pass = n_tok <= kT;  // decode: weights stream from memory once
    const int64_t rb = single_pass ? r1 - r0 : row_block(w_stride);
    for (int64_t b0 = r0; b0 < r1; b0 += rb) {
        const int64_t b1 = std::min(r1, b0 + rb);
        for (int t0 = 0; t0 < n_tok; t0 += kT) {
            const char* x = xb + static_cast<size_t>(t0) * xq_stride;
            float* yt = y + static_cast<size_t>(t0) * ldy;
            switch (std::min(kT, n_tok - t0)) {
                case 3: float_rows<3>(t, wb, w_stride, n, x, xq_stride, yt, ldy, b0, b1, single_pass); break;
                case 2: float_rows<2>(t, wb, w_stride, n, x, xq_stride, yt, ldy, b0, b1, single_pass); break;
                default: float_rows<1>(t, wb, w_stride, n, x, xq_stride, yt, ldy, b0, b1, single_pass); break;
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 weights, T tokens at a time (T <= kTile). Activation scales
// are converted to float once per call into scratch, block-major per tile of
// tokens: xd[b * kTile + j] (d of token j's block b; and Q8_1's s after them), so
// that for each weight row one pass over its block scales forms every product
// d_w * d_x of the tile with one vector multiply per block (and Q4_1/Q5_1 min terms
// m_w * s_x, summed per token in a vector lane), and the main loop spends per
// (block, token) only the integer dot, a conversion and one FMA. Per (row,
// token) the operations and their order are those of a one-token call.

constexpr int kTile = 8;

inline __m256i ones16() { return _mm256_set1_epi16(1); }

// The types with a block minimum (Q8_1 activations, whose s meets it).
template <DType W>
constexpr bool has_min() {
    return W == DType::Q4_1 || W == DType::Q5_1;
}
inline bool has_min(DType t) { return t == DType::Q4_1 || t == DType::Q5_1; }

template <DType W>
constexpr size_t x_block_bytes() {
    return has_min<W>() ? sizeof(BlockQ8_1) : sizeof(BlockQ8_0);
}
template <DType W>
constexpr size_t w_block_bytes() {
    switch (W) {
        case DType::Q4_0: return sizeof(BlockQ4_0);
        case DType::Q4_1: return sizeof(BlockQ4_1);
        case DType::Q5_0: return sizeof(BlockQ5_0);
        case DType::Q5_1: return sizeof(BlockQ5_1);
        default: return sizeof(BlockQ8_0);
    }
}

// A Q5 block's fifth bits as bytes: byte i is 0x10 where bit i of the
// little-endian 32-bit qh is set, else 0.
inline __m256i q5_high_bits(const uint8_t* qh) {
    uint32_t bits;
    std::memcpy(&bits, qh, 4);
    const __m256i spread = _mm256_shuffle_epi8(  // byte i <- byte i / 8 of qh
        _mm256_set1_epi32(static_cast<int>(bits)), _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2,
                                                                    2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);  // byte i tests bit i % 8
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
}

// 16 bytes of nibbles to 32 bytes, low nibbles first: a broadcast load (no ALU
// work), a shift of the upper half only, a mask.
inline __m256i nibbles32(const uint8_t* qs) {
    const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
    const __m256i shifted = _mm256_srlv_epi32(v, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4));
    return _mm256_and_si256(shifted, _mm256_set1_epi8(0x0F));
}

// The row's per-block scale products for the tile: dd[b * kTile + j] = d_w(b) *
// d_x(j, b), and for Q4_1 the lanes of the returned vector sum m_w(b) * s_x(j, b)
// over the blocks in order (one rounding per product, one per sum, as a scalar
// loop does). Lanes j >= T hold products of the padding (zeros).
template <DType W>
inline __m256 row_scales(const char* wr, int64_t nb, const float* xd, float* dd) {
    __m256 sm = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const float* xb = xd + b * kTile;
        const char* blk = wr + static_cast<size_t>(b) * w_block_bytes<W>();  // d (and m) first in every layout
        if constexpr (has_min<W>()) {
            // d and m (adjacent f16s) in one conversion.
            int32_t dm_bits;
            std::memcpy(&dm_bits, blk, 4);
            const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(dm_bits));
            const __m256 dw = _mm256_broadcastss_ps(dm);
            const __m256 mw = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
            _mm256_store_ps(dd + b * kTile, _mm256_mul_ps(dw, _mm256_load_ps(xb)));
            sm = _mm256_add_ps(sm, _mm256_mul_ps(mw, _mm256_load_ps(xb + nb * kTile)));
        } else {
            uint16_t d;
            std::memcpy(&d, blk, 2);
            _mm256_store_ps(dd + b * kTile, _mm256_mul_ps(_mm256_set1_ps(h2f(d)), _mm256_load_ps(xb)));
        }
    }
    return sm;
}

// One block of one weight row: its 32 values as bytes for maddubs (Q4_1's and
// Q5_1's unsigned values; Q4_0's, Q5_0's and Q8_0's magnitudes, with their signs
// in `sw`) and its scale d_w (and Q4_1's / Q5_1's min m_w).
template <DType W>
inline __m256i weight_block(const char* wr, int64_t b, __m256i* sw, float* dw, float* mw) {
    if constexpr (has_min<W>()) {
        const char* blk = wr + static_cast<size_t>(b) * w_block_bytes<W>();
        // d and m (adjacent f16s) in one conversion.
        int32_t dm_bits;
        std::memcpy(&dm_bits, blk, 4);
        const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(dm_bits));
        *dw = _mm_cvtss_f32(dm);
        *mw = _mm_cvtss_f32(_mm_movehdup_ps(dm));
        if constexpr (W == DType::Q5_1) {
            const BlockQ5_1* q5 = reinterpret_cast<const BlockQ5_1*>(blk);
            return _mm256_or_si256(nibbles32(q5->qs), q5_high_bits(q5->qh));
        } else {
            return nibbles32(reinterpret_cast<const BlockQ4_1*>(blk)->qs);
        }
    } else {
        __m256i wv;
        if constexpr (W == DType::Q4_0) {
            const BlockQ4_0* blk = reinterpret_cast<const BlockQ4_0*>(wr) + b;
            wv = _mm256_sub_epi8(nibbles32(blk->qs), _mm256_set1_epi8(8));
            *dw = h2f(blk->d);
        } else if constexpr (W == DType::Q5_0) {
            const BlockQ5_0* blk = reinterpret_cast<const BlockQ5_0*>(wr) + b;
            wv = _mm256_sub_epi8(_mm256_or_si256(nibbles32(blk->qs), q5_high_bits(blk->qh)), _mm256_set1_epi8(16));
            *dw = h2f(blk->d);
        } else {
            const BlockQ8_0* blk = reinterpret_cast<const BlockQ8_0*>(wr) + b;
            wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk->qs));
            *dw = h2f(blk->d);
        }
        *sw = wv;
        return _mm256_sign_epi8(wv, wv);
    }
}

// The integer dot of a weight block with a token's block, as 8 int32 lanes
// converted to float. Q4_0, Q5_0 and Q8_0 are signed, so |w| * sign(x, w) feeds
// maddubs (at most 2 * 128 * 127 per pair: no saturation); Q4_1's and Q5_1's
// values are unsigned (2 * 31 * 127).
template <DType W>
inline __m256 block_dot(__m256i wv, __m256i sw, const int8_t* xq) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
    const __m256i u = has_min<W>() ? _mm256_maddubs_epi16(wv, xv) : _mm256_maddubs_epi16(wv, _mm256_sign_epi8(xv, sw));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(u, ones16()));
}

// T <= 4 tokens, one row: the scale products inline (a pass over the row's
// scales first costs more than it saves; several rows interleaved ran slower on
// a Zen 1 core). Per (row, token): acc = fma(dot_b, d_w * d_x, acc) block by
// block, then hsum (+ Q4_1's sum of m_w * s_x, added block by block).
template <int T, DType W>
void q32_row_inline(const char* w, size_t w_stride, int64_t nb, const int8_t* const* xq, const float* xd, float* y,
                    size_t ldy, int64_t r, bool prefetch) {
    constexpr size_t xblk = x_block_bytes<W>();
    const char* wr = w + static_cast<size_t>(r) * w_stride;
    if (prefetch) prefetch_row(wr, static_cast<size_t>(nb) * w_block_bytes<W>());
    __m256 acc[T];
    float sm[T];
    for (int j = 0; j < T; ++j) {
        acc[j] = _mm256_setzero_ps();
        sm[j] = 0.0f;
    }
    for (int64_t b = 0; b < nb; ++b) {
        __m256i sw = _mm256_setzero_si256();
        float dw, mw = 0.0f;
        const __m256i wv = weight_block<W>(wr, b, &sw, &dw, &mw);
        for (int j = 0; j < T; ++j) {
            const float d = dw * xd[b * kTile + j];
            if constexpr (has_min<W>()) sm[j] += mw * xd[(nb + b) * kTile + j];
            acc[j] = _mm256_fmadd_ps(block_dot<W>(wv, sw, xq[j] + b * xblk), _mm256_set1_ps(d), acc[j]);
        }
    }
    for (int j = 0; j < T; ++j) {
        const float v = hsum(acc[j]);
        y[static_cast<size_t>(j) * ldy + static_cast<size_t>(r)] = has_min<W>() ? v + sm[j] : v;
    }
}

// T > 4 tokens, one row at a time: one pass over the row's block scales first
// forms every d_w * d_x of the tile (row_scales), so the main loop is the
// integer dot, a conversion and one FMA per (block, token). The same operations
// per (row, token) as q32_row_inline's.
template <int T, DType W>
void q32_row_prepass(const char* w, size_t w_stride, int64_t nb, const int8_t* const* xq, const float* xd, float* dd,
                     float* y, size_t ldy, int64_t r, bool prefetch) {
    constexpr size_t xblk = x_block_bytes<W>();
    const char* wr = w + static_cast<size_t>(r) * w_stride;
    if (prefetch) prefetch_row(wr, static_cast<size_t>(nb) * w_block_bytes<W>());
    alignas(32) float sm[kTile];
    _mm256_store_ps(sm, row_scales<W>(wr, nb, xd, dd));
    __m256 acc[T];
    for (int j = 0; j < T; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        __m256i sw = _mm256_setzero_si256();
        float dw, mw;
        const __m256i wv = weight_block<W>(wr, b, &sw, &dw, &mw);
        const float* ddb = dd + b * kTile;
        for (int j = 0; j < T; ++j)
            acc[j] = _mm256_fmadd_ps(block_dot<W>(wv, sw, xq[j] + b * xblk), _mm256_broadcast_ss(ddb + j), acc[j]);
    }
    for (int j = 0; j < T; ++j) {
        const float v = hsum(acc[j]);
        y[static_cast<size_t>(j) * ldy + static_cast<size_t>(r)] = has_min<W>() ? v + sm[j] : v;
    }
}

// Rows [r0, r1) against T tokens of Q8_0 (Q8_1 for Q4_1 and Q5_1) activations.
template <int T, DType W>
void q32_rows(const char* w, size_t w_stride, int64_t nb, const char* x, size_t x_stride, const float* xd, float* dd,
              float* y, size_t ldy, int64_t r0, int64_t r1, bool prefetch) {
    constexpr size_t xoff = has_min<W>() ? offsetof(BlockQ8_1, qs) : offsetof(BlockQ8_0, qs);
    const int8_t* xq[T];
    for (int j = 0; j < T; ++j) xq[j] = reinterpret_cast<const int8_t*>(x + static_cast<size_t>(j) * x_stride + xoff);
    for (int64_t r = r0; r < r1; ++r) {
        if constexpr (T > 4)
            q32_row_prepass<T, W>(w, w_stride, nb, xq, xd, dd, y, ldy, r, prefetch);
        else
            q32_row_inline<T, W>(w, w_stride, nb, xq, xd, y, ldy, r, prefetch);
    }
}

template <int T>
void q_rows(DType t, const char* w, size_t w_stride, int64_t nb, const char* x, size_t x_stride, const float* xd,
            float* dd, float* y, size_t ldy, int64_t r0, int64_t r1, bool prefetch) {
    switch (t) {
        case DType::Q4_1:
            q32_rows<T, DType::Q4_1>(w, w_stride, nb, x, x_stride, xd, dd, y, ldy, r0, r1, prefetch);
            return;
        case DType::Q4_0:
            q32_rows<T, DType::Q4_0>(w, w_stride, nb, x, x_stride, xd, dd, y, ldy, r0, r1, prefetch);
            return;
        case DType::Q5_0:
            q32_rows<T, DType::Q5_0>(w, w_stride, nb, x, x_stride, xd, dd, y, ldy, r0, r1, prefetch);
            return;
        case DType::Q5_1:
            q32_rows<T, DType::Q5_1>(w, w_stride, nb, x, x_stride, xd, dd, y, ldy, r0, r1, prefetch);
            return;
        default: q32_rows<T, DType::Q8_0>(w, w_stride, nb, x, x_stride, xd, dd, y, ldy, r0, r1, prefetch); return;
    }
}

void matmul_q32(DType t, const void* w, size_t w_stride, int64_t n_in, const void* xq, size_t xq_stride, int n_tok,
                float* y, size_t ldy, int64_t r0, int64_t r1) {
    const int64_t nb = n_in / kQK;
    const int per_tok = has_min(t) ? 2 : 1;  // scales per block per token
    const int n_tiles = (n_tok + kTile - 1) / kTile;
    const size_t tile_floats = static_cast<size_t>(nb) * kTile * per_tok;
    // The tiles' activation scales, then one row's scale products (dd).
    Scratch scratch((static_cast<size_t>(n_tiles) * tile_floats + static_cast<size_t>(nb) * kTile) * sizeof(float));
    float* xf = reinterpret_cast<float*>(scratch.data());
    float* dd = xf + static_cast<size_t>(n_tiles) * tile_floats;
    std::fill(xf, xf + static_cast<size_t>(n_tiles) * tile_floats, 0.0f);
    const char* xb = static_cast<const char*>(xq);
    for (int j = 0; j < n_tok; ++j) {
        float* f = xf + static_cast<size_t>(j / kTile) * tile_floats + j % kTile;
        if (has_min(t)) {
            const BlockQ8_1* xr = reinterpret_cast<const BlockQ8_1*>(xb + static_cast<size_t>(j) * xq_stride);
            for (int64_t b = 0; b < nb; ++b) {
                f[b * kTile] = h2f(xr[b].d);
                f[(nb + b) * kTile] = h2f(xr[b].s);
            }
        } else {
            const BlockQ8_0* xr = reinterpret_cast<const BlockQ8_0*>(xb + static_cast<size_t>(j) * xq_stride);
            for (int64_t b = 0; b < nb; ++b) f[b * kTile] = h2f(xr[b].d);
        }
    }
    const char* wb = static_cast<const char*>(w);
    const bool single_pass = n_tok <= kTile;  // decode: weights stream from memory once
    const int64_t rb = single_pass ? r1 - r0 : row_block(w_stride);
    for (int64_t b0 = r0; b0 < r1; b0 += rb) {
        const int64_t b1 = std::min(r1, b0 + rb);
        for (int t0 = 0; t0 < n_tok; t0 += kTile) {
            const char* x = xb + static_cast<size_t>(t0) * xq_stride;
            const float* f = xf + static_cast<size_t>(t0 / kTile) * tile_floats;
            float* yt = y + static_cast<size_t>(t0) * ldy;
            switch (std::min(kTile, n_tok - t0)) {
                case 8: q_rows<8>(t, wb, w_stride, nb, x, xq_stride, f, dd, yt, ldy, b0, b1, single_pass); break;
                case 7: q_rows<7>(t, wb, w_stride, nb, x, xq_stride, f, dd, yt, ldy, b0, b1, single_pass); break;
                case 6: q_rows<6>(t, wb, w_stride, nb, x, xq_stride, f, dd, yt, ldy, b0, b1, single_pass); break;
                case 5: q_rows<5>(t, wb, w_stride, nb, x, xq_stride, f, dd, yt, ldy, b0, b1, single_pass); break;
                case 4: q_rows<4>(t, wb, w_stride, nb, x, xq_stride, f, dd, yt, ldy, b0, b1, single_pass); break;
                case 3: q_rows<3>(t, wb, w_stride, nb, x, xq_stride, f, dd, yt, ldy, b0, b1, single_pass); break;
                case 2: q_rows<2>(t, wb, w_stride, nb, x, xq_stride, f, dd, yt, ldy, b0, b1, single_pass); break;
                default: q_rows<1>(t, wb, w_stride, nb, x, xq_stride, f, dd, yt, ldy, b0, b1, single_pass); break;
            }
        }
    }
}

// ---------------------------------------------------------------------------
// K-quants. Integer sums per super-block are exact; the float step is the
// scalar level's expression, so results equal Isa::Scalar's bit for bit.

inline int hsum128_i32(__m128i s) {
    s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
    return _mm_cvtsi128_si32(s);
}

// Q4_K or Q5_K (Blk) x Q8_K, T tokens: each super-block's values, scales and mins
// are unpacked once for the T tokens. Per (row, token) the integer sums are exact
// and the float step is the scalar level's expression, super-block by super-block,
// so every tile (and Isa::Scalar) gives the same bits.
template <class Blk, int T>
void q45_k_rows(const char* w, size_t w_stride, int64_t nb, const char* x, size_t x_stride, float* y, size_t ldy,
                int64_t r0, int64_t r1, bool prefetch) {
    constexpr bool kFive = std::is_same_v<Blk, BlockQ5_K>;
    const BlockQ8_K* xr[T];
    for (int j = 0; j < T; ++j) xr[j] = reinterpret_cast<const BlockQ8_K*>(x + static_cast<size_t>(j) * x_stride);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i m16 = _mm256_set1_epi8(0x10);
    for (int64_t r = r0; r < r1; ++r) {
        const Blk* wr = reinterpret_cast<const Blk*>(w + static_cast<size_t>(r) * w_stride);
        if (prefetch) prefetch_row(wr, static_cast<size_t>(nb) * sizeof(Blk));
        float s[T];
        for (int j = 0; j < T; ++j) s[j] = 0.0f;
        for (int64_t b = 0; b < nb; ++b) {
            alignas(8) uint8_t sc[8], mn[8];
            q4k_scales_mins(wr[b].scales, sc, mn);
            __m256i acc[T];
            for (int j = 0; j < T; ++j) acc[j] = _mm256_setzero_si256();
            __m256i qh = _mm256_setzero_si256();  // Q5_K: qh >> 2c, bits 0 and 1 for chunk c
            if constexpr (kFive) qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr[b].qh));
            for (int c = 0; c < 4; ++c) {
                const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr[b].qs + 32 * c));
                __m256i lo = _mm256_and_si256(q, m4);
                __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
                if constexpr (kFive) {
                    // Word shifts keep each byte's bit in its byte once masked to 0x10.
                    lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(qh, 4), m16));
                    hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(qh, 3), m16));
                    qh = _mm256_srli_epi16(qh, 2);
                }
                const __m256i s0 = _mm256_set1_epi16(static_cast<int16_t>(sc[2 * c]));
                const __m256i s1 = _mm256_set1_epi16(static_cast<int16_t>(sc[2 * c + 1]));
                for (int j = 0; j < T; ++j) {
                    const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr[j][b].qs + 64 * c));
                    const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr[j][b].qs + 64 * c + 32));
                    // maddubs pairs are at most 2 * 31 * 128; times a 6-bit scale in madd.
                    const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, x0), s0);
                    const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, x1), s1);
                    acc[j] = _mm256_add_epi32(acc[j], _mm256_add_epi32(p0, p1));
                }
            }
            // sum_j mn_j * (bsums[2j] + bsums[2j + 1]): pair sums (each at most
            // 32 * 128 in magnitude) times the mins, exact in 32 bits.
            const __m128i mins = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn)));
            const float dw = half_to_float(wr[b].d), dmw = half_to_float(wr[b].dmin);
            for (int j = 0; j < T; ++j) {
                const __m128i b0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(xr[j][b].bsums));
                const __m128i b1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(xr[j][b].bsums + 8));
                const int summ = hsum128_i32(_mm_madd_epi16(mins, _mm_hadd_epi16(b0, b1)));
                const int sumi = hsum_i32(acc[j]);
                const float d = dw * xr[j][b].d;
                const float dm = dmw * xr[j][b].d;
                s[j] += d * static_cast<float>(sumi) - dm * static_cast<float>(summ);
            }
        }
        for (int j = 0; j < T; ++j) y[static_cast<size_t>(j) * ldy + static_cast<size_t>(r)] = s[j];
    }
}

// Q6_K x Q8_K, T tokens: each half super-block's 6-bit values are assembled once
// for the T tokens. The integer sum is sum q6 * q8 * scale - 32 * sum scale * bsums
// (exact); the float step is the scalar level's.
template <int T>
void q6_k_rows(const char* w, size_t w_stride, int64_t nb, const char* x, size_t x_stride, float* y, size_t ldy,
               int64_t r0, int64_t r1, bool prefetch) {
    const BlockQ8_K* xr[T];
    for (int j = 0; j < T; ++j) xr[j] = reinterpret_cast<const BlockQ8_K*>(x + static_cast<size_t>(j) * x_stride);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i m30 = _mm256_set1_epi8(0x30);
    for (int64_t r = r0; r < r1; ++r) {
        const BlockQ6_K* wr = reinterpret_cast<const BlockQ6_K*>(w + static_cast<size_t>(r) * w_stride);
        if (prefetch) prefetch_row(wr, static_cast<size_t>(nb) * sizeof(BlockQ6_K));
        float s[T];
        for (int j = 0; j < T; ++j) s[j] = 0.0f;
        for (int64_t b = 0; b < nb; ++b) {
            __m256i acc[T];
            for (int j = 0; j < T; ++j) acc[j] = _mm256_setzero_si256();
            for (int h = 0; h < 2; ++h) {
                const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr[b].ql + 64 * h));
                const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr[b].ql + 64 * h + 32));
                const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr[b].qh + 32 * h));
                __m256i q[4];
                q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30));
                q[1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30));
                q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(qh, m30));
                q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                       _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30));
                for (int k = 0; k < 4; ++k) {
                    const int8_t* sc = wr[b].scales + 8 * h + 2 * k;
                    // First 16 values use sc[0], next 16 sc[1]; maddubs pairs <= 2*63*127.
                    const __m256i scv = _mm256_set_m128i(_mm_set1_epi16(sc[1]), _mm_set1_epi16(sc[0]));
                    for (int j = 0; j < T; ++j) {
                        const __m256i xv =
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr[j][b].qs + 128 * h + 32 * k));
                        acc[j] = _mm256_add_epi32(acc[j], _mm256_madd_epi16(_mm256_maddubs_epi16(q[k], xv), scv));
                    }
                }
            }
            // sum_g scale_g * bsums_g over the 16 groups, exact in 32 bits.
            const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr[b].scales));
            const __m128i sc_lo = _mm_cvtepi8_epi16(sc8), sc_hi = _mm_cvtepi8_epi16(_mm_srli_si128(sc8, 8));
            const float dw = half_to_float(wr[b].d);
            for (int j = 0; j < T; ++j) {
                const __m128i b0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(xr[j][b].bsums));
                const __m128i b1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(xr[j][b].bsums + 8));
                const int corr = hsum128_i32(_mm_add_epi32(_mm_madd_epi16(sc_lo, b0), _mm_madd_epi16(sc_hi, b1)));
                const int sumi = hsum_i32(acc[j]) - 32 * corr;
                s[j] += (dw * xr[j][b].d) * static_cast<float>(sumi);
            }
        }
        for (int j = 0; j < T; ++j) y[static_cast<size_t>(j) * ldy + static_cast<size_t>(r)] = s[j];
    }
}

// One token (decode). q45_k_rows<Blk, 1> and q6_k_rows<1> built each scale
// vector from a general register (two or three operations per 32 values) and
// reduced a super-block's integer sums one by one, and the rows ran at 50-60%
// of what a Q4_0 row streams at. These splat the scales from one register
// (vpshufb), reduce two super-blocks' sums together and run their float steps
// in the lanes of one vector: each lane the scalar level's operations for its
// super-block, added to the row's sum in order, so the bits stay Isa::Scalar's.
// Rows are prefetched as the float rows are (kFloatAheadL2 / kFloatAheadL1).

inline void prefetch_spread(const void* blk, size_t bytes) {
    const char* p = static_cast<const char*>(blk);
    for (size_t o = 0; o < bytes; o += 64) {
        _mm_prefetch(p + o + kFloatAheadL2, _MM_HINT_T1);
        _mm_prefetch(p + o + kFloatAheadL1, _MM_HINT_T0);
    }
}

// vpshufb controls: every word of the result takes word j (of its 128-bit lane).
inline __m256i splat_word(int lo, int hi) {
    return _mm256_setr_m128i(_mm_set1_epi16(static_cast<int16_t>(0x0101 * (2 * lo) + 0x0100)),
                             _mm_set1_epi16(static_cast<int16_t>(0x0101 * (2 * hi) + 0x0100)));
}

// [sum a, sum b, sum c, sum d] of four 4-lane vectors (exact).
inline __m128i totals4(const __m128i& a, const __m128i& b, const __m128i& c, const __m128i& d) {
    return _mm_hadd_epi32(_mm_hadd_epi32(a, b), _mm_hadd_epi32(c, d));
}

inline __m128i fold256(const __m256i& v) {
    return _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
}

// A Q4_K / Q5_K super-block's two integer sums, 4 lanes each: sum_j sc_j S_j and
// sum_j mn_j X_j.
template <class Blk>
inline void q45k_block_t1(const Blk& B, const BlockQ8_K& X, const __m256i* splat, __m128i* si, __m128i* mi) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m16 = _mm256_set1_epi8(0x10);
    alignas(8) uint8_t sc[8], mn[8];
    q4k_scales_mins(B.scales, sc, mn);
    const __m256i scw =
        _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc))));
    __m256i qh = _mm256_setzero_si256();
    if constexpr (std::is_same_v<Blk, BlockQ5_K>) qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(B.qh));
    __m256i acc = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(B.qs + 32 * c));
        __m256i lo = _mm256_and_si256(q, m4);
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
        if constexpr (std::is_same_v<Blk, BlockQ5_K>) {
            lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(qh, 4), m16));
            hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(qh, 3), m16));
            qh = _mm256_srli_epi16(qh, 2);
        }
        const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(X.qs + 64 * c));
        const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(X.qs + 64 * c + 32));
        // maddubs pairs are at most 2 * 31 * 128; times a 6-bit scale in madd.
        const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, x0), _mm256_shuffle_epi8(scw, splat[2 * c]));
        const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, x1), _mm256_shuffle_epi8(scw, splat[2 * c + 1]));
        acc = _mm256_add_epi32(acc, _mm256_add_epi32(p0, p1));
    }
    const __m128i b0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(X.bsums));
    const __m128i b1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(X.bsums + 8));
    *si = fold256(acc);
    *mi = _mm_madd_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn))),
                         _mm_hadd_epi16(b0, b1));
}

// The two super-blocks' float steps: s += d w_0 - dm m_0, then s += d w_1 - dm m_1
// (t = [sumi_0, sumi_1, summ_0, summ_1]).
inline float q45k_pair_float(float s, const __m128i& t, uint16_t d0, uint16_t dmin0, uint16_t d1, uint16_t dmin1,
                             float xd0, float xd1) {
    const __m128 dw =
        _mm_cvtph_ps(_mm_setr_epi16(static_cast<int16_t>(d0), static_cast<int16_t>(d1), static_cast<int16_t>(dmin0),
                                    static_cast<int16_t>(dmin1), 0, 0, 0, 0));
    const __m128 prod = _mm_mul_ps(_mm_mul_ps(dw, _mm_setr_ps(xd0, xd1, xd0, xd1)), _mm_cvtepi32_ps(t));
    const __m128 v = _mm_sub_ps(prod, _mm_movehl_ps(prod, prod));  // lanes 0, 1
    s += _mm_cvtss_f32(v);
    s += _mm_cvtss_f32(_mm_movehdup_ps(v));
    return s;
}

template <class Blk>
void q45k_rows_t1(const char* w, size_t w_stride, int64_t nb, const BlockQ8_K* x, float* y, int64_t r0, int64_t r1) {
    __m256i splat[8];
    for (int j = 0; j < 8; ++j) splat[j] = splat_word(j, j);
    for (int64_t r = r0; r < r1; ++r) {
        const Blk* wr = reinterpret_cast<const Blk*>(w + static_cast<size_t>(r) * w_stride);
        float s = 0.0f;
        int64_t b = 0;
        for (; b + 2 <= nb; b += 2) {
            prefetch_spread(&wr[b], 2 * sizeof(Blk));
            __m128i si0, mi0, si1, mi1;
            q45k_block_t1<Blk>(wr[b], x[b], splat, &si0, &mi0);
            q45k_block_t1<Blk>(wr[b + 1], x[b + 1], splat, &si1, &mi1);
            s = q45k_pair_float(s, totals4(si0, si1, mi0, mi1), wr[b].d, wr[b].dmin, wr[b + 1].d, wr[b + 1].dmin,
                                x[b].d, x[b + 1].d);
        }
        for (; b < nb; ++b) {
            __m128i si, mi;
            q45k_block_t1<Blk>(wr[b], x[b], splat, &si, &mi);
            const __m128i t = totals4(si, mi, si, mi);  // [sumi, summ, ...]
            const float d = half_to_float(wr[b].d) * x[b].d;
            const float dm = half_to_float(wr[b].dmin) * x[b].d;
            s += d * static_cast<float>(_mm_cvtsi128_si32(t)) - dm * static_cast<float>(_mm_extract_epi32(t, 1));
        }
        y[r] = s;
    }
}

// A Q6_K super-block's two integer sums, 4 lanes each: sum_g sc_g sum q6 q8 and
// sum_g sc_g bsums_g.
inline void q6k_block_t1(const BlockQ6_K& B, const BlockQ8_K& X, const __m256i* splat, __m128i* si, __m128i* ci) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(B.scales)));
    // Scales 8h..8h+7 in both 128-bit lanes: half h's q[k] takes 8h + 2k (first 16 values), 8h + 2k + 1.
    const __m256i sch2[2] = {_mm256_permute4x64_epi64(sc16, 0x44), _mm256_permute4x64_epi64(sc16, 0xEE)};
    __m256i acc = _mm256_setzero_si256();
    for (int h = 0; h < 2; ++h) {
        const __m256i sch = sch2[h];
        const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(B.ql + 64 * h));
        const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(B.ql + 64 * h + 32));
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(B.qh + 32 * h));
        __m256i q[4];
        q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30));
        q[1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30));
        q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(qh, m30));
        q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                               _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30));
        for (int k = 0; k < 4; ++k) {
            const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(X.qs + 128 * h + 32 * k));
            // maddubs pairs <= 2 * 63 * 127, times an 8-bit scale.
            acc = _mm256_add_epi32(
                acc, _mm256_madd_epi16(_mm256_maddubs_epi16(q[k], xv), _mm256_shuffle_epi8(sch, splat[k])));
        }
    }
    const __m256i corr = _mm256_madd_epi16(sc16, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(X.bsums)));
    *si = fold256(acc);
    *ci = fold256(corr);
}

void q6k_rows_t1(const char* w, size_t w_stride, int64_t nb, const BlockQ8_K* x, float* y, int64_t r0, int64_t r1) {
    __m256i splat[4];
    for (int k = 0; k < 4; ++k) splat[k] = splat_word(2 * k, 2 * k + 1);
    for (int64_t r = r0; r < r1; ++r) {
        const BlockQ6_K* wr = reinterpret_cast<const BlockQ6_K*>(w + static_cast<size_t>(r) * w_stride);
        float s = 0.0f;
        int64_t b = 0;
        for (; b + 2 <= nb; b += 2) {
            prefetch_spread(&wr[b], 2 * sizeof(BlockQ6_K));
            __m128i si0, ci0, si1, ci1;
            q6k_block_t1(wr[b], x[b], splat, &si0, &ci0);
            q6k_block_t1(wr[b + 1], x[b + 1], splat, &si1, &ci1);
            const __m128i t = totals4(si0, si1, ci0, ci1);
            const __m128i sumi = _mm_sub_epi32(t, _mm_slli_epi32(_mm_unpackhi_epi64(t, t), 5));  // lanes 0, 1
            const __m128 dw = _mm_cvtph_ps(
                _mm_setr_epi16(static_cast<int16_t>(wr[b].d), static_cast<int16_t>(wr[b + 1].d), 0, 0, 0, 0, 0, 0));
            const __m128 v =
                _mm_mul_ps(_mm_mul_ps(dw, _mm_setr_ps(x[b].d, x[b + 1].d, 0.0f, 0.0f)), _mm_cvtepi32_ps(sumi));
            s += _mm_cvtss_f32(v);
            s += _mm_cvtss_f32(_mm_movehdup_ps(v));
        }
        for (; b < nb; ++b) {
            __m128i si, ci;
            q6k_block_t1(wr[b], x[b], splat, &si, &ci);
            const __m128i t = totals4(si, ci, si, ci);
            const int sumi = _mm_cvtsi128_si32(t) - 32 * _mm_extract_epi32(t, 1);
            s += (half_to_float(wr[b].d) * x[b].d) * static_cast<float>(sumi);
        }
        y[r] = s;
    }
}

template <int T>
void k_rows(DType t, const char* w, size_t w_stride, int64_t nb, const char* x, size_t x_stride, float* y, size_t ldy,
            int64_t r0, int64_t r1, bool prefetch) {
    if (t == DType::Q4_K)
        q45_k_rows<BlockQ4_K, T>(w, w_stride, nb, x, x_stride, y, ldy, r0, r1, prefetch);
    else if (t == DType::Q5_K)
        q45_k_rows<BlockQ5_K, T>(w, w_stride, nb, x, x_stride, y, ldy, r0, r1, prefetch);
    else
        q6_k_rows<T>(w, w_stride, nb, x, x_stride, y, ldy, r0, r1, prefetch);
}

void matmul_k(DType t, const void* w, size_t w_stride, int64_t n_in, const void* xq, size_t xq_stride, int n_tok,
              float* y, size_t ldy, int64_t r0, int64_t r1) {
    constexpr int kT = 4;
    const int64_t nb = n_in / kQKK;
    const char* wb = static_cast<const char*>(w);
    const char* xb = static_cast<const char*>(xq);
    if (n_tok == 1) {
        const BlockQ8_K* x = static_cast<const BlockQ8_K*>(xq);
        switch (t) {
            case DType::Q4_K: q45k_rows_t1<BlockQ4_K>(wb, w_stride, nb, x, y, r0, r1); return;
            case DType::Q5_K: q45k_rows_t1<BlockQ5_K>(wb, w_stride, nb, x, y, r0, r1); return;
            default: q6k_rows_t1(wb, w_stride, nb, x, y, r0, r1); return;
        }
    }
    const bool single_pass = n_tok <= kT;  // decode: weights stream from memory once
    const int64_t rb = single_pass ? r1 - r0 : row_block(w_stride);
    for (int64_t b0 = r0; b0 < r1; b0 += rb) {
        const int64_t b1 = std::min(r1, b0 + rb);
        for (int t0 = 0; t0 < n_tok; t0 += kT) {
            const char* x = xb + static_cast<size_t>(t0) * xq_stride;
            float* yt = y + static_cast<size_t>(t0) * ldy;
            switch (std::min(kT, n_tok - t0)) {
                case 4: k_rows<4>(t, wb, w_stride, nb, x, xq_stride, yt, ldy, b0, b1, single_pass); break;
                case 3: k_rows<3>(t, wb, w_stride, nb, x, xq_stride, yt, ldy, b0, b1, single_pass); break;
                case 2: k_rows<2>(t, wb, w_stride, nb, x, xq_stride, yt, ldy, b0, b1, single_pass); break;
                default: k_rows<1>(t, wb, w_stride, nb, x, xq_stride, yt, ldy, b0, b1, single_pass); break;
            }
        }
    }
}

}  // namespace

// ---------------------------------------------------------------------------
// Quantizers. Activation types reproduce scalar.cpp bit for bit: the same scalar
// scale arithmetic, one IEEE multiply per value, and vcvtps2dq's ties-to-even.

void quantize_row(DType t, const float* src, void* dst, int64_t n) {
    switch (t) {
        case DType::F32: std::memcpy(dst, src, static_cast<size_t>(n) * 4); return;
        case DType::F16: fp32_to_fp16_row(src, static_cast<uint16_t*>(dst), n); return;
        case DType::BF16: {
            uint16_t* out = static_cast<uint16_t*>(dst);
            int64_t i = 0;
            for (; i + 16 <= n; i += 16) {
                __m256i r[2];
                for (int h = 0; h < 2; ++h) {
                    const __m256 f = _mm256_loadu_ps(src + i + 8 * h);
                    const __m256i v = _mm256_castps_si256(f);
                    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(v, 16), _mm256_set1_epi32(1));
                    const __m256i rn = _mm256_srli_epi32(_mm256_add_epi32(v, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
                    const __m256i qn = _mm256_or_si256(_mm256_srli_epi32(v, 16), _mm256_set1_epi32(0x40));
                    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
                    r[h] = _mm256_blendv_epi8(rn, qn, nan);
                }
                const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(r[0], r[1]), 0xD8);
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), p);
            }
            for (; i < n; ++i) out[i] = float_to_bf16(src[i]);
            return;
        }
        case DType::Q8_0: {
            BlockQ8_0* y = static_cast<BlockQ8_0*>(dst);
            for (int64_t b = 0; b < n / kQK; ++b, src += kQK) {
                const float amax = absmax32(src);
                const float d = amax / 127.0f;
                const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
                y[b].d = f2h(d);
                quant32(src, id, y[b].qs, nullptr);
            }
            return;
        }
        case DType::Q8_1: {
            BlockQ8_1* y = static_cast<BlockQ8_1*>(dst);
            for (int64_t b = 0; b < n / kQK; ++b, src += kQK) {
                const float amax = absmax32(src);
                const float d = amax / 127.0f;
                const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
                const int sum = hsum_i32(quant32(src, id, y[b].qs, nullptr));
                y[b].d = f2h(d);
                y[b].s = f2h(d * static_cast<float>(sum));
            }
            return;
        }
        case DType::Q8_K: {
            BlockQ8_K* y = static_cast<BlockQ8_K*>(dst);
            for (int64_t b = 0; b < n / kQKK; ++b, src += kQKK) {
                float amax = 0.0f;
                for (int c = 0; c < kQKK / 32; ++c) amax = std::max(amax, absmax32(src + 32 * c));
                if (amax == 0.0f) {
                    std::memset(&y[b], 0, sizeof(BlockQ8_K));
                    continue;
                }
                const float iscale = 127.0f / amax;
                for (int c = 0; c < kQKK / 32; ++c) {
                    __m256i v[4];
                    quant32(src + 32 * c, iscale, y[b].qs + 32 * c, v);
                    y[b].bsums[2 * c] = static_cast<int16_t>(hsum_i32(_mm256_add_epi32(v[0], v[1])));
                    y[b].bsums[2 * c + 1] = static_cast<int16_t>(hsum_i32(_mm256_add_epi32(v[2], v[3])));
                }
                y[b].d = 1.0f / iscale;
            }
            return;
        }
        default:
            // Weight types (Q4_0, Q4_1) are only quantized to build tests.
            scalar::quantize_row(t, src, dst, n);
            return;
    }
}

void matmul(DType wtype, const void* w, size_t w_stride, int64_t n_in, const void* xq, size_t xq_stride,
            int n_tok, float* y, size_t ldy, int64_t r0, int64_t r1) {
    switch (wtype) {
        case DType::F32: case DType::F16: case DType::BF16:
            matmul_float(wtype, w, w_stride, n_in, xq, xq_stride, n_tok, y, ldy, r0, r1);
            return;
        case DType::Q4_0:
        case DType::Q4_1:
        case DType::Q5_0:
        case DType::Q5_1:
        case DType::Q8_0: matmul_q32(wtype, w, w_stride, n_in, xq, xq_stride, n_tok, y, ldy, r0, r1); return;
        case DType::Q4_K:
        case DType::Q5_K:
        case DType::Q6_K: matmul_k(wtype, w, w_stride, n_in, xq, xq_stride, n_tok, y, ldy, r0, r1); return;
        default: kernel_fail("matmul: unsupported weight type");
    }
}

// ---------------------------------------------------------------------------
// Float row ops.

void rms_norm(const float* x, const float* w, float* y, int64_t n, float eps) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
        a0 = _mm256_fmadd_ps(v0, v0, a0);
        a1 = _mm256_fmadd_ps(v1, v1, a1);
    }
    float ss = hsum(_mm256_add_ps(a0, a1));
    for (; i < n; ++i) ss += x[i] * x[i];
    const float scale = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
    const __m256 sv = _mm256_set1_ps(scale);
    i = 0;
    for (; i + 8 <= n; i += 8) {
        _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), sv), _mm256_loadu_ps(w + i)));
    }
    for (; i < n; ++i) y[i] = x[i] * scale * w[i];
}

// Bit-identical to the scalar level: the same products, added in the same
// pairs (x*c + (-(y*s)) is x*c - y*s exactly).
void rope(float* x, int n_heads, int head_dim, int rot_dim, int64_t pos, const float* inv_freq) {
    alignas(32) float c[512], s[512], cc[1024], ss[1024];
    for (int i0 = 0; i0 < rot_dim / 2; i0 += 512) {
        const int m = std::min(512, rot_dim / 2 - i0);
        rope_angles(pos, inv_freq + i0, m, c, s);
        for (int i = 0; i < m; ++i) {
            cc[2 * i] = c[i];
            cc[2 * i + 1] = c[i];
            ss[2 * i] = -s[i];
            ss[2 * i + 1] = s[i];
        }
        for (int h = 0; h < n_heads; ++h) {
            float* v = x + static_cast<int64_t>(h) * head_dim + 2 * i0;
            int k = 0;
            for (; k + 8 <= 2 * m; k += 8) {
                const __m256 a = _mm256_loadu_ps(v + k);
                const __m256 sw = _mm256_permute_ps(a, 0xB1);  // swap each pair
                const __m256 r = _mm256_add_ps(_mm256_mul_ps(a, _mm256_load_ps(cc + k)),
                                               _mm256_mul_ps(sw, _mm256_load_ps(ss + k)));
                _mm256_storeu_ps(v + k, r);
            }
            for (int i = k / 2; i < m; ++i) {
                const float a = v[2 * i], b = v[2 * i + 1];
                v[2 * i] = a * c[i] - b * s[i];
                v[2 * i + 1] = a * s[i] + b * c[i];
            }
        }
    }
}

void swiglu(const float* gate, const float* up, float* out, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 e = exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), g));
        const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
    }
    for (; i < n; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

void add(float* y, const float* x, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_add_ps(_mm256_loadu_ps(y + i), _mm256_loadu_ps(x + i)));
    for (; i < n; ++i) y[i] += x[i];
}

void softmax(float* x, int64_t n) {
    __m256 mv = _mm256_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(x + i));
    float mx = hmax(mv);
    for (; i < n; ++i) mx = std::max(mx, x[i]);
    if (mx == -INFINITY) {
        for (i = 0; i < n; ++i) x[i] = 0.0f;
        return;
    }
    const __m256 m = _mm256_set1_ps(mx);
    __m256 sv = _mm256_setzero_ps();
    for (i = 0; i + 8 <= n; i += 8) {
        const __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), m));
        _mm256_storeu_ps(x + i, e);
        sv = _mm256_add_ps(sv, e);
    }
    float sum = hsum(sv);
    for (; i < n; ++i) {
        x[i] = std::exp(x[i] - mx);
        sum += x[i];
    }
    const __m256 inv = _mm256_set1_ps(1.0f / sum);
    for (i = 0; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), inv));
    for (; i < n; ++i) x[i] *= 1.0f / sum;
}

namespace {

// The attention helpers of both KV kinds (f16; int8 / fp8 bytes) over one loop each.
// load(e) gives 8 values of a row from element e as floats, value(e) one of them.

// sum_i a[i] * row[i]: two accumulators of 8, the tail in scalar.
template <class Load, class Value>
float dot_row(const float* a, int64_t n, Load load, Value value) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load(i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), load(i + 8), s1);
    }
    float s = hsum(_mm256_add_ps(s0, s1));
    for (; i < n; ++i) s += a[i] * value(i);
    return s;
}

// out += coef(j) * row j for j = 0, 1, ..., n - 1 in order (load(j, e) and
// value(j, e) read row j); out stays in registers across the rows, 32 values at a
// time; each element sees the same fma (or, in the tail, mul and add) sequence as
// one axpy per row.
template <class Coef, class Load, class Value>
void accum_rows(int64_t n, int64_t head_dim, float* out, Coef coef, Load load, Value value) {
    int64_t i = 0;
    for (; i + 32 <= head_dim; i += 32) {
        __m256 o0 = _mm256_loadu_ps(out + i), o1 = _mm256_loadu_ps(out + i + 8);
        __m256 o2 = _mm256_loadu_ps(out + i + 16), o3 = _mm256_loadu_ps(out + i + 24);
        for (int64_t j = 0; j < n; ++j) {
            const __m256 a = _mm256_set1_ps(coef(j));
            o0 = _mm256_fmadd_ps(a, load(j, i), o0);
            o1 = _mm256_fmadd_ps(a, load(j, i + 8), o1);
            o2 = _mm256_fmadd_ps(a, load(j, i + 16), o2);
            o3 = _mm256_fmadd_ps(a, load(j, i + 24), o3);
        }
        _mm256_storeu_ps(out + i, o0);
        _mm256_storeu_ps(out + i + 8, o1);
        _mm256_storeu_ps(out + i + 16, o2);
        _mm256_storeu_ps(out + i + 24, o3);
    }
    for (; i + 8 <= head_dim; i += 8) {
        __m256 o = _mm256_loadu_ps(out + i);
        for (int64_t j = 0; j < n; ++j) o = _mm256_fmadd_ps(_mm256_set1_ps(coef(j)), load(j, i), o);
        _mm256_storeu_ps(out + i, o);
    }
    for (; i < head_dim; ++i)
        for (int64_t j = 0; j < n; ++j) out[i] += coef(j) * value(j, i);
}

// 8 quantized KV values as floats (unscaled). e4m3 through f16: its bits shifted
// into an f16's (sign to bit 15, exponent and mantissa to bits 7-13) read 2^-8 times
// the value, subnormals included, exactly; the NaN byte is not written by
// quantize_kv_row for finite rows.
inline __m256 load8_kv(KvQuant t, const uint8_t* p) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    if (t == KvQuant::Int8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    const __m128i w = _mm_cvtepu8_epi16(b);
    const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8),
                                   _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7F)), 7));
    return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
}

}  // namespace

float dot_f32_f16(const float* a, const uint16_t* b, int64_t n) {
    return dot_row(a, n, [&](int64_t e) { return load8(b + e, DType::F16); }, [&](int64_t e) { return half_to_float(b[e]); });
}

void axpy_f16(float a, const uint16_t* x, float* y, int64_t n) {
    const __m256 av = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, load8(x + i, DType::F16), _mm256_loadu_ps(y + i)));
    }
    for (; i < n; ++i) y[i] += a * half_to_float(x[i]);
}

void fp32_to_fp16_row(const float* x, uint16_t* y, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(y + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    }
    for (; i < n; ++i) y[i] = float_to_half(x[i]);
}

void attn_scores_f16(const float* q, const uint16_t* k, size_t stride, int64_t n, int64_t head_dim, float scale,
                     float* scores) {
    for (int64_t j = 0; j < n; ++j) scores[j] = scale * dot_f32_f16(q, k + static_cast<size_t>(j) * stride, head_dim);
}

// Each element sees the same fma (or, in the tail, mul and add) sequence as axpy_f16.
void attn_accum_f16(const float* p, const uint16_t* v, size_t stride, int64_t n, int64_t head_dim, float* out) {
    auto row = [&](int64_t j) { return v + static_cast<size_t>(j) * stride; };
    accum_rows(
        n, head_dim, out, [&](int64_t j) { return p[j]; },
        [&](int64_t j, int64_t e) { return load8(row(j) + e, DType::F16); },
        [&](int64_t j, int64_t e) { return half_to_float(row(j)[e]); });
}

void attn_scores_q(KvQuant t, const float* q, const uint8_t* k, const float* k_scale, size_t stride, int64_t n,
                   int64_t head_dim, float scale, float* scores) {
    for (int64_t j = 0; j < n; ++j) {
        const uint8_t* kj = k + static_cast<size_t>(j) * stride;
        const float d = dot_row(q, head_dim, [&](int64_t e) { return load8_kv(t, kj + e); },
                                [&](int64_t e) { return kv_decode(t, kj[e]); });
        scores[j] = scale * (k_scale[j] * d);
    }
}

void attn_accum_q(KvQuant t, const float* p, const uint8_t* v, const float* v_scale, size_t stride, int64_t n,
                  int64_t head_dim, float* out) {
    auto row = [&](int64_t j) { return v + static_cast<size_t>(j) * stride; };
    accum_rows(
        n, head_dim, out, [&](int64_t j) { return p[j] * v_scale[j]; },
        [&](int64_t j, int64_t e) { return load8_kv(t, row(j) + e); },
        [&](int64_t j, int64_t e) { return kv_decode(t, row(j)[e]); });
}

uint64_t read_fold(const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    size_t i = 0;
    for (; i + 128 <= n; i += 128) {
        a0 = _mm256_xor_si256(a0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + i)));
        a1 = _mm256_xor_si256(a1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + i + 32)));
        a2 = _mm256_xor_si256(a2, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + i + 64)));
        a3 = _mm256_xor_si256(a3, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + i + 96)));
    }
    __m256i a = _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3));
    uint64_t r = static_cast<uint64_t>(_mm256_extract_epi64(a, 0)) ^ static_cast<uint64_t>(_mm256_extract_epi64(a, 1)) ^
                 static_cast<uint64_t>(_mm256_extract_epi64(a, 2)) ^ static_cast<uint64_t>(_mm256_extract_epi64(a, 3));
    for (; i < n; ++i) r ^= b[i];
    return r;
}

void round_fp16(float* x, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT);
        _mm256_storeu_ps(x + i, _mm256_cvtph_ps(h));
    }
    for (; i < n; ++i) x[i] = h2f(f2h(x[i]));
}

}  // namespace duet::cpu::avx2
