// AVX-512 (F, BW, VL, DQ) + VNNI level.
//
// The quantized products Q4_0, Q4_1 and Q8_0 use vpdpbusd (unsigned byte x
// signed byte, four products summed into each 32-bit lane):
//
// - Weights are read straight from the GGUF rows. Four 32-value blocks (Q4_0,
//   Q4_1) or two (Q8_0) are loaded with one 64-byte load plus a short one, and a
//   word permute (vpermt2w; every block field sits at an even offset) gathers
//   their quants into one register: 128-bit lane k holds block k's 16 nibble
//   bytes (Q4) or 256-bit half k holds block k's 32 bytes (Q8). The same load
//   feeds a word permute that broadcasts each block's f16 scale (and min) to
//   that block's lanes.
// - Activations are repacked once per call into the matching order ("groups"):
//   for Q4, lo[64] = the first 16 quants of 4 blocks, hi[64] = their last 16, so
//   low nibbles meet lo and high nibbles meet hi; scales as 16 floats, one per
//   lane. Signed weights become unsigned by an offset whose correction,
//   -offset * (sum of the lane's 4 activations), is precomputed as the lane's
//   starting value: -8 for Q4_0 nibbles, -128 for Q8_0 bytes (w ^ 0x80 = w + 128).
//
// Reduction order for one (row, token), the same in every tile shape:
//   acc (16 float lanes) = 0
//   for each group g: acc = fma(cvt(int lanes of g), d_w[lane] * d_x[lane], acc)
//   Q4_1 only, after each 4 groups (16 blocks) and after the last group:
//     acc = fma(m_w[16 blocks], s_x[16 blocks], acc)
//   result = reduce_add(acc)
// Tiles (1 row x T tokens) reuse one unpacked weight group across T tokens.
//
// F32/F16/BF16 weights and the K-quants use the AVX2 level's kernels (same
// results as Isa::Avx2).
// GCC 12's AVX-512 headers initialise "undefined" vectors from themselves
// (`__m512 __Y = __Y;`), which -Wmaybe-uninitialized reports once inlined
// (GCC bug 105593, fixed in 13). The warning is about the header, not us.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <immintrin.h>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

#include <algorithm>
#include <type_traits>

#include "kernels_impl.h"

namespace duet::cpu::avx512 {

namespace {

inline float h2f(uint16_t h) { return _cvtsh_ss(h); }

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
    alignas(64) uint8_t buf_[32768];
    uint8_t* p_;
};

int64_t row_block(size_t row_bytes) {
    const int64_t rb = static_cast<int64_t>((256 * 1024) / std::max<size_t>(row_bytes, 1));
    return std::max<int64_t>(rb, 16);
}

inline __mmask64 bytes_mask(int n) { return n >= 64 ? ~__mmask64{0} : ((__mmask64{1} << n) - 1); }

// ---------------------------------------------------------------------------
// Repacked activations.

// Sixteen 32-value blocks (a "chunk", four groups of four), for Q4_0 and
// Q4_1 weights. Group g of chunk c holds blocks 16c + 4g + k, k = 0..3.
struct alignas(64) XChunk4 {
    int8_t lo[4][64];     // [g][16k + i]: quant i of block 4g + k
    int8_t hi[4][64];     // [g][16k + i]: quant 16 + i of block 4g + k
    int32_t init[4][16];  // Q4_0: [g][4k + j] = -8 * (sum of the 8 quants lane 4k + j meets); Q4_1: 0
    float dx[16];         // [4k + j]: d of block 4j + k (the order the reduction leaves sums in)
    float sx[16];         // Q4_1: s of block 4j + k at [4k + j]; Q4_0: 0
};
static_assert(sizeof(XChunk4) == 896);

// Two blocks, for Q8_0 weights.
struct alignas(64) XGroup2 {
    int8_t q[64];      // block k's 32 quants at [32k, 32k + 32)
    float dx[16];      // lanes 8k..8k+7: block k's scale
    int32_t init[16];  // -128 * (sum of the lane's 4 activations)
};
static_assert(sizeof(XGroup2) == 192);

size_t q4_token_bytes(int64_t nb) { return static_cast<size_t>((nb + 15) / 16) * sizeof(XChunk4); }

template <DType W>
void repack_q4(const void* xrow, int64_t nb, uint8_t* out) {
    using XBlock = std::conditional_t<W == DType::Q4_1, BlockQ8_1, BlockQ8_0>;
    const XBlock* x = static_cast<const XBlock*>(xrow);
    XChunk4* xc = reinterpret_cast<XChunk4*>(out);
    const __m512i ones = _mm512_set1_epi8(1);
    for (int64_t c = 0; c < (nb + 15) / 16; ++c) {
        XChunk4& ch = xc[c];
        for (int g = 0; g < 4; ++g) {
            for (int k = 0; k < 4; ++k) {
                const int64_t b = 16 * c + 4 * g + k;
                __m128i lo = _mm_setzero_si128(), hi = _mm_setzero_si128();
                float d = 0.0f, sum = 0.0f;
                if (b < nb) {
                    lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x[b].qs));
                    hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x[b].qs + 16));
                    d = h2f(x[b].d);
                    if constexpr (W == DType::Q4_1) sum = h2f(x[b].s);
                }
                _mm_store_si128(reinterpret_cast<__m128i*>(ch.lo[g] + 16 * k), lo);
                _mm_store_si128(reinterpret_cast<__m128i*>(ch.hi[g] + 16 * k), hi);
                ch.dx[4 * k + g] = d;
                ch.sx[4 * k + g] = sum;
            }
            __m512i init = _mm512_setzero_si512();
            if constexpr (W == DType::Q4_0) {
                __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, _mm512_load_si512(ch.lo[g]));
                s = _mm512_dpbusd_epi32(s, ones, _mm512_load_si512(ch.hi[g]));
                init = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(s, 3));
            }
            _mm512_store_si512(ch.init[g], init);
        }
    }
}

size_t q8_token_bytes(int64_t nb) { return static_cast<size_t>((nb + 1) / 2) * sizeof(XGroup2); }

void repack_q8(const void* xrow, int64_t nb, uint8_t* out) {
    const BlockQ8_0* x = static_cast<const BlockQ8_0*>(xrow);
    XGroup2* g = reinterpret_cast<XGroup2*>(out);
    const __m512i ones = _mm512_set1_epi8(1);
    for (int64_t pi = 0; pi < (nb + 1) / 2; ++pi) {
        for (int k = 0; k < 2; ++k) {
            const int64_t b = 2 * pi + k;
            __m256i q = _mm256_setzero_si256();
            float d = 0.0f;
            if (b < nb) {
                q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[b].qs));
                d = h2f(x[b].d);
            }
            _mm256_store_si256(reinterpret_cast<__m256i*>(g[pi].q + 32 * k), q);
            _mm256_store_ps(g[pi].dx + 8 * k, _mm256_set1_ps(d));
        }
        const __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, _mm512_load_si512(g[pi].q));
        _mm512_store_si512(g[pi].init, _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(s, 7)));
    }
}

// ---------------------------------------------------------------------------
// Word-permute index vectors (word i of the result takes word idx[i]; indices
// 32..63 select the second source).

inline __m512i idx_words(const uint16_t (&v)[32]) { return _mm512_loadu_si512(v); }

// Q4_1, 20-byte blocks: block k = words 10k..10k+9: d, m, 8 words of quants.
alignas(64) constexpr uint16_t kQ41Qs[32] = {2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 14, 15, 16, 17, 18, 19,
                                             22, 23, 24, 25, 26, 27, 28, 29, 32, 33, 34, 35, 36, 37, 38, 39};
// Chunk scales: word 4k + g of the result takes block k's d from group g's
// first 64 bytes (written with mask 0x1111 << g); words 16 + 4k + g its m.
alignas(64) constexpr uint16_t kQ41Dm[32] = {0,  0,  0,  0,  10, 10, 10, 10, 20, 20, 20, 20, 30, 30, 30, 30,
                                             1,  1,  1,  1,  11, 11, 11, 11, 21, 21, 21, 21, 31, 31, 31, 31};
// Q4_0, 18-byte blocks: block k = words 9k..9k+8: d, 8 words of quants.
alignas(64) constexpr uint16_t kQ40Qs[32] = {1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 13, 14, 15, 16, 17,
                                             19, 20, 21, 22, 23, 24, 25, 26, 28, 29, 30, 31, 32, 33, 34, 35};
alignas(64) constexpr uint16_t kQ40Dm[32] = {0, 0, 0, 0, 9, 9, 9, 9, 18, 18, 18, 18, 27, 27, 27, 27,
                                             0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
// Q8_0, 34-byte blocks: block k = words 17k..17k+16: d, 16 words of quants.
alignas(64) constexpr uint16_t kQ80Qs[32] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16,
                                             18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33};
alignas(64) constexpr uint16_t kQ80D[32] = {0, 0, 0, 0, 0, 0, 0, 0, 17, 17, 17, 17, 17, 17, 17, 17,
                                            0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};

// Loads `n` bytes (n <= 64 + tail_max) of a weight group into A (first 64) and
// B (the rest). Full groups use plain loads; a row's last, partial group uses
// masked loads so nothing past the row is touched.
template <int kGroupBytes>
inline void load_group(const uint8_t* p, int n, __m512i* a, __m512i* b) {
    if (n == kGroupBytes) {
        *a = _mm512_loadu_si512(p);
        if constexpr (kGroupBytes == 80) {
            *b = _mm512_zextsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 64)));
        } else if constexpr (kGroupBytes == 72) {
            *b = _mm512_zextsi128_si512(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 64)));
        } else {
            int32_t t;
            std::memcpy(&t, p + 64, 4);
            *b = _mm512_zextsi128_si512(_mm_cvtsi32_si128(t));
        }
    } else {
        *a = _mm512_maskz_loadu_epi8(bytes_mask(n), p);
        *b = _mm512_setzero_si512();  // partial groups never reach byte 64
    }
}

// ---------------------------------------------------------------------------
// Q4_1 x Q8_1, Q4_0 x Q8_0: one row, T tokens.
//
// Per chunk of 16 blocks, each group g gives an int32 vector p_g whose lanes
// 4k..4k+3 sum block 4g + k's products (8 each). Every lane fits in int16
// (|sum| <= 8 * 15 * 127 for Q4_1, 8 * 8 * 127 for Q4_0, with activation
// quants in [-127, 127] as quantize_row makes them), and so does the sum of two
// lanes; so packssdw + pmaddwd(1) add neighbouring lanes exactly:
//   l01 = madd(packs(p0, p1)), l23 = madd(packs(p2, p3)), s = madd(packs(l01, l23))
// leaves block 4j + k's integer dot in lane 4k + j. The float work then runs
// once per 16 blocks: acc = fma(cvt(s), d_w * d_x, acc), acc = fma(m_w, s_x, acc).

template <DType W>
struct Q4Traits {
    static constexpr int kBlockBytes = W == DType::Q4_1 ? 20 : 18;
};

// Loads group g of chunk c (fewer blocks at the end of a row), splits the
// nibbles, and merges the group's scales (and mins) into dm.
template <DType W>
inline void q4_load_group(const uint8_t* wr, int64_t c, int g, int64_t nbc, const __m512i& idx_qs,
                          const __m512i& idx_dm, const __m512i& m4, __m512i* lo, __m512i* hi, __m512i* dm) {
    constexpr int kBB = Q4Traits<W>::kBlockBytes;
    const int nbytes = static_cast<int>(std::min<int64_t>(4, nbc - 4 * g)) * kBB;
    __m512i a, b;
    load_group<4 * kBB>(wr + (16 * c + 4 * g) * kBB, nbytes, &a, &b);
    const __m512i qs = _mm512_permutex2var_epi16(a, idx_qs, b);
    *lo = _mm512_and_si512(qs, m4);
    *hi = _mm512_and_si512(_mm512_srli_epi16(qs, 4), m4);
    const __mmask32 mask = W == DType::Q4_1 ? (0x11111111u << g) : (0x1111u << g);
    *dm = _mm512_mask_permutexvar_epi16(*dm, mask, idx_dm, a);
}

template <DType W>
inline __m512i q4_group_dot(const __m512i& lo, const __m512i& hi, const XChunk4& x, int g) {
    __m512i p = W == DType::Q4_0 ? _mm512_load_si512(x.init[g]) : _mm512_setzero_si512();
    p = _mm512_dpbusd_epi32(p, lo, _mm512_load_si512(x.lo[g]));
    return _mm512_dpbusd_epi32(p, hi, _mm512_load_si512(x.hi[g]));
}

inline __m512i pair_sum(const __m512i& a, const __m512i& b) {
    return _mm512_madd_epi16(_mm512_packs_epi32(a, b), _mm512_set1_epi16(1));
}

template <DType W, int T>
__attribute__((noinline)) void q4_rows(const char* w, size_t w_stride, int64_t nb, const uint8_t* xp,
                                       size_t xp_stride, float* y, size_t ldy, int64_t r0, int64_t r1) {
    constexpr bool kQ41 = W == DType::Q4_1;
    const int64_t nc = (nb + 15) / 16;
    const __m512i idx_qs = idx_words(kQ41 ? kQ41Qs : kQ40Qs);
    const __m512i idx_dm = idx_words(kQ41 ? kQ41Dm : kQ40Dm);
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const __m512i zero = _mm512_setzero_si512();
    const XChunk4* xc[T];
    for (int j = 0; j < T; ++j) xc[j] = reinterpret_cast<const XChunk4*>(xp + static_cast<size_t>(j) * xp_stride);
    for (int64_t r = r0; r < r1; ++r) {
        const uint8_t* wr = reinterpret_cast<const uint8_t*>(w + static_cast<size_t>(r) * w_stride);
        __m512 acc[T];
        for (int j = 0; j < T; ++j) acc[j] = _mm512_setzero_ps();
        for (int64_t c = 0; c < nc; ++c) {
            const int64_t nbc = std::min<int64_t>(16, nb - 16 * c);
            const int ng = static_cast<int>((nbc + 3) / 4);
            __m512i dm = zero, lo, hi;
            __m512i l01[T], l23[T];
            q4_load_group<W>(wr, c, 0, nbc, idx_qs, idx_dm, m4, &lo, &hi, &dm);
            for (int j = 0; j < T; ++j) l01[j] = q4_group_dot<W>(lo, hi, xc[j][c], 0);
            if (ng > 1) {
                q4_load_group<W>(wr, c, 1, nbc, idx_qs, idx_dm, m4, &lo, &hi, &dm);
                for (int j = 0; j < T; ++j) l01[j] = pair_sum(l01[j], q4_group_dot<W>(lo, hi, xc[j][c], 1));
            } else {
                for (int j = 0; j < T; ++j) l01[j] = pair_sum(l01[j], zero);
            }
            if (ng > 2) {
                q4_load_group<W>(wr, c, 2, nbc, idx_qs, idx_dm, m4, &lo, &hi, &dm);
                for (int j = 0; j < T; ++j) l23[j] = q4_group_dot<W>(lo, hi, xc[j][c], 2);
                if (ng > 3) {
                    q4_load_group<W>(wr, c, 3, nbc, idx_qs, idx_dm, m4, &lo, &hi, &dm);
                    for (int j = 0; j < T; ++j) l23[j] = pair_sum(l23[j], q4_group_dot<W>(lo, hi, xc[j][c], 3));
                } else {
                    for (int j = 0; j < T; ++j) l23[j] = pair_sum(l23[j], zero);
                }
            } else {
                for (int j = 0; j < T; ++j) l23[j] = zero;
            }
            const __m512 dw = _mm512_cvtph_ps(_mm512_castsi512_si256(dm));
            [[maybe_unused]] __m512 mw;
            if constexpr (kQ41) mw = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(dm, 1));
            for (int j = 0; j < T; ++j) {
                const __m512 s = _mm512_cvtepi32_ps(pair_sum(l01[j], l23[j]));
                acc[j] = _mm512_fmadd_ps(s, _mm512_mul_ps(dw, _mm512_load_ps(xc[j][c].dx)), acc[j]);
                if constexpr (kQ41) acc[j] = _mm512_fmadd_ps(mw, _mm512_load_ps(xc[j][c].sx), acc[j]);
            }
        }
        for (int j = 0; j < T; ++j) y[static_cast<size_t>(j) * ldy + static_cast<size_t>(r)] = _mm512_reduce_add_ps(acc[j]);
    }
}

// Q8_0 x Q8_0: one row, T tokens; groups of two blocks.
template <int T>
__attribute__((noinline)) void q8_rows(const char* w, size_t w_stride, int64_t nb, const uint8_t* xp, size_t xp_stride, float* y, size_t ldy,
             int64_t r0, int64_t r1) {
    const int64_t np = (nb + 1) / 2;
    const __m512i idx_qs = idx_words(kQ80Qs);
    const __m512i idx_d = idx_words(kQ80D);
    const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
    const XGroup2* xg[T];
    for (int j = 0; j < T; ++j) xg[j] = reinterpret_cast<const XGroup2*>(xp + static_cast<size_t>(j) * xp_stride);
    for (int64_t r = r0; r < r1; ++r) {
        const uint8_t* wr = reinterpret_cast<const uint8_t*>(w + static_cast<size_t>(r) * w_stride);
        __m512 acc[T];
        for (int j = 0; j < T; ++j) acc[j] = _mm512_setzero_ps();
        for (int64_t pi = 0; pi < np; ++pi) {
            const int nbytes = static_cast<int>(std::min<int64_t>(2, nb - 2 * pi)) * 34;
            __m512i a, b;
            load_group<68>(wr + pi * 68, nbytes, &a, &b);
            const __m512i wq = _mm512_xor_si512(_mm512_permutex2var_epi16(a, idx_qs, b), bias);
            const __m512 dw = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi16(idx_d, a)));
            for (int j = 0; j < T; ++j) {
                const XGroup2& x = xg[j][pi];
                const __m512i dp = _mm512_dpbusd_epi32(_mm512_load_si512(x.init), wq, _mm512_load_si512(x.q));
                acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dp), _mm512_mul_ps(dw, _mm512_load_ps(x.dx)), acc[j]);
            }
        }
        for (int j = 0; j < T; ++j) y[static_cast<size_t>(j) * ldy + static_cast<size_t>(r)] = _mm512_reduce_add_ps(acc[j]);
    }
}

template <int T>
void rows_dispatch(DType t, const char* w, size_t w_stride, int64_t nb, const uint8_t* xp, size_t xp_stride, float* y,
                   size_t ldy, int64_t r0, int64_t r1) {
    switch (t) {
        case DType::Q4_1: q4_rows<DType::Q4_1, T>(w, w_stride, nb, xp, xp_stride, y, ldy, r0, r1); return;
        case DType::Q4_0: q4_rows<DType::Q4_0, T>(w, w_stride, nb, xp, xp_stride, y, ldy, r0, r1); return;
        default: q8_rows<T>(w, w_stride, nb, xp, xp_stride, y, ldy, r0, r1); return;
    }
}

void matmul_q32(DType t, const void* w, size_t w_stride, int64_t n_in, const void* xq, size_t xq_stride, int n_tok,
                float* y, size_t ldy, int64_t r0, int64_t r1) {
    constexpr int kT = 8;
    const int64_t nb = n_in / kQK;
    const size_t tok_bytes = t == DType::Q8_0 ? q8_token_bytes(nb) : q4_token_bytes(nb);
    Scratch scratch(static_cast<size_t>(n_tok) * tok_bytes);
    uint8_t* xp = scratch.data();
    const char* xb = static_cast<const char*>(xq);
    for (int j = 0; j < n_tok; ++j) {
        const void* xr = xb + static_cast<size_t>(j) * xq_stride;
        uint8_t* out = xp + static_cast<size_t>(j) * tok_bytes;
        switch (t) {
            case DType::Q4_1: repack_q4<DType::Q4_1>(xr, nb, out); break;
            case DType::Q4_0: repack_q4<DType::Q4_0>(xr, nb, out); break;
            default: repack_q8(xr, nb, out); break;
        }
    }
    const char* wb = static_cast<const char*>(w);
    const int64_t rb = n_tok <= kT ? r1 - r0 : row_block(w_stride);
    for (int64_t b0 = r0; b0 < r1; b0 += rb) {
        const int64_t b1 = std::min(r1, b0 + rb);
        for (int t0 = 0; t0 < n_tok; t0 += kT) {
            const uint8_t* x = xp + static_cast<size_t>(t0) * tok_bytes;
            float* yt = y + static_cast<size_t>(t0) * ldy;
            switch (std::min(kT, n_tok - t0)) {
                case 8: rows_dispatch<8>(t, wb, w_stride, nb, x, tok_bytes, yt, ldy, b0, b1); break;
                case 7: rows_dispatch<7>(t, wb, w_stride, nb, x, tok_bytes, yt, ldy, b0, b1); break;
                case 6: rows_dispatch<6>(t, wb, w_stride, nb, x, tok_bytes, yt, ldy, b0, b1); break;
                case 5: rows_dispatch<5>(t, wb, w_stride, nb, x, tok_bytes, yt, ldy, b0, b1); break;
                case 4: rows_dispatch<4>(t, wb, w_stride, nb, x, tok_bytes, yt, ldy, b0, b1); break;
                case 3: rows_dispatch<3>(t, wb, w_stride, nb, x, tok_bytes, yt, ldy, b0, b1); break;
                case 2: rows_dispatch<2>(t, wb, w_stride, nb, x, tok_bytes, yt, ldy, b0, b1); break;
                default: rows_dispatch<1>(t, wb, w_stride, nb, x, tok_bytes, yt, ldy, b0, b1); break;
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Float helpers.

inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? __mmask16{0xFFFF} : static_cast<__mmask16>((1u << n) - 1); }

// exp for float lanes; see avx2.cpp's exp_ps (same constants and ranges).
inline __m512 exp_ps(__m512 x) {
    const __m512 hi = _mm512_set1_ps(88.7228391f);
    const __m512 lo = _mm512_set1_ps(-86.64f);
    const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_min_ps(hi, x);
    x = _mm512_max_ps(lo, x);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(126)), 23);
    p = _mm512_mul_ps(_mm512_mul_ps(p, _mm512_castsi512_ps(e)), _mm512_set1_ps(2.0f));
    return _mm512_mask_mov_ps(p, under, _mm512_setzero_ps());
}

// 32 floats times id to int8 (ties to even), stored in order; returns the two
// int32 vectors.
inline void quant32(const float* x, float id, int8_t* out, __m512i* i0, __m512i* i1) {
    const __m512 m = _mm512_set1_ps(id);
    *i0 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x), m));
    *i1 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + 16), m));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtsepi32_epi8(*i0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), _mm512_cvtsepi32_epi8(*i1));
}

inline float absmax32(const float* x) {
    const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(x));
    const __m512 b = _mm512_abs_ps(_mm512_loadu_ps(x + 16));
    return _mm512_reduce_max_ps(_mm512_max_ps(a, b));
}

}  // namespace

// ---------------------------------------------------------------------------

void quantize_row(DType t, const float* src, void* dst, int64_t n) {
    switch (t) {
        case DType::F16: fp32_to_fp16_row(src, static_cast<uint16_t*>(dst), n); return;
        case DType::Q8_0: {
            BlockQ8_0* y = static_cast<BlockQ8_0*>(dst);
            for (int64_t b = 0; b < n / kQK; ++b, src += kQK) {
                const float amax = absmax32(src);
                const float d = amax / 127.0f;
                const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
                __m512i i0, i1;
                quant32(src, id, y[b].qs, &i0, &i1);
                y[b].d = float_to_half(d);
            }
            return;
        }
        case DType::Q8_1: {
            BlockQ8_1* y = static_cast<BlockQ8_1*>(dst);
            for (int64_t b = 0; b < n / kQK; ++b, src += kQK) {
                const float amax = absmax32(src);
                const float d = amax / 127.0f;
                const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
                __m512i i0, i1;
                quant32(src, id, y[b].qs, &i0, &i1);
                const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
                y[b].d = float_to_half(d);
                y[b].s = float_to_half(d * static_cast<float>(sum));
            }
            return;
        }
        case DType::Q8_K: {
            BlockQ8_K* y = static_cast<BlockQ8_K*>(dst);
            for (int64_t b = 0; b < n / kQKK; ++b, src += kQKK) {
                __m512 m = _mm512_setzero_ps();
                for (int c = 0; c < kQKK / 16; ++c) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(src + 16 * c)));
                const float amax = _mm512_reduce_max_ps(m);
                if (amax == 0.0f) {
                    std::memset(&y[b], 0, sizeof(BlockQ8_K));
                    continue;
                }
                const float iscale = 127.0f / amax;
                for (int c = 0; c < kQKK / 32; ++c) {
                    __m512i i0, i1;
                    quant32(src + 32 * c, iscale, y[b].qs + 32 * c, &i0, &i1);
                    y[b].bsums[2 * c] = static_cast<int16_t>(_mm512_reduce_add_epi32(i0));
                    y[b].bsums[2 * c + 1] = static_cast<int16_t>(_mm512_reduce_add_epi32(i1));
                }
                y[b].d = 1.0f / iscale;
            }
            return;
        }
        default:
            avx2::quantize_row(t, src, dst, n);
            return;
    }
}

void matmul(DType wtype, const void* w, size_t w_stride, int64_t n_in, const void* xq, size_t xq_stride,
            int n_tok, float* y, size_t ldy, int64_t r0, int64_t r1) {
    switch (wtype) {
        case DType::Q4_0: case DType::Q4_1: case DType::Q8_0:
            matmul_q32(wtype, w, w_stride, n_in, xq, xq_stride, n_tok, y, ldy, r0, r1);
            return;
        default:
            avx2::matmul(wtype, w, w_stride, n_in, xq, xq_stride, n_tok, y, ldy, r0, r1);
            return;
    }
}

void rms_norm(const float* x, const float* w, float* y, int64_t n, float eps) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        const __m512 v0 = _mm512_loadu_ps(x + i), v1 = _mm512_loadu_ps(x + i + 16);
        a0 = _mm512_fmadd_ps(v0, v0, a0);
        a1 = _mm512_fmadd_ps(v1, v1, a1);
    }
    for (; i < n; i += 16) {
        const __m512 v = _mm512_maskz_loadu_ps(tail_mask(n - i), x + i);
        a0 = _mm512_fmadd_ps(v, v, a0);
    }
    const float ss = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    const __m512 sv = _mm512_set1_ps(1.0f / std::sqrt(ss / static_cast<float>(n) + eps));
    for (i = 0; i < n; i += 16) {
        const __mmask16 k = tail_mask(n - i);
        const __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, x + i), sv), _mm512_maskz_loadu_ps(k, w + i));
        _mm512_mask_storeu_ps(y + i, k, v);
    }
}

// Same products and pairings as the scalar level, so bit-identical to it.
void rope(float* x, int n_heads, int head_dim, int rot_dim, int64_t pos, const float* inv_freq) {
    alignas(64) float c[512], s[512], cc[1024], ss[1024];
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
            for (int k = 0; k < 2 * m; k += 16) {
                const __mmask16 km = tail_mask(2 * m - k);
                const __m512 a = _mm512_maskz_loadu_ps(km, v + k);
                const __m512 sw = _mm512_permute_ps(a, 0xB1);
                const __m512 r = _mm512_add_ps(_mm512_mul_ps(a, _mm512_maskz_loadu_ps(km, cc + k)),
                                               _mm512_mul_ps(sw, _mm512_maskz_loadu_ps(km, ss + k)));
                _mm512_mask_storeu_ps(v + k, km, r);
            }
        }
    }
}

void swiglu(const float* gate, const float* up, float* out, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = tail_mask(n - i);
        const __m512 g = _mm512_maskz_loadu_ps(k, gate + i);
        const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g));
        const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
        _mm512_mask_storeu_ps(out + i, k, _mm512_mul_ps(silu, _mm512_maskz_loadu_ps(k, up + i)));
    }
}

void add(float* y, const float* x, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = tail_mask(n - i);
        _mm512_mask_storeu_ps(y + i, k, _mm512_add_ps(_mm512_maskz_loadu_ps(k, y + i), _mm512_maskz_loadu_ps(k, x + i)));
    }
}

void softmax(float* x, int64_t n) {
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (int64_t i = 0; i < n; i += 16) mv = _mm512_max_ps(mv, _mm512_mask_loadu_ps(mv, tail_mask(n - i), x + i));
    const float mx = _mm512_reduce_max_ps(mv);
    if (mx == -INFINITY) {
        for (int64_t i = 0; i < n; ++i) x[i] = 0.0f;
        return;
    }
    const __m512 m = _mm512_set1_ps(mx);
    __m512 sv = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = tail_mask(n - i);
        const __m512 e = _mm512_maskz_mov_ps(k, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), m)));
        _mm512_mask_storeu_ps(x + i, k, e);
        sv = _mm512_add_ps(sv, e);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sv));
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = tail_mask(n - i);
        _mm512_mask_storeu_ps(x + i, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, x + i), inv));
    }
}

float dot_f32_f16(const float* a, const uint16_t* b, int64_t n) {
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i),
                             _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + i))), s0);
        s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16),
                             _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + i + 16))), s1);
    }
    for (; i < n; i += 16) {
        const __mmask16 k = tail_mask(n - i);
        s0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, a + i), _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, b + i)), s0);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
}

void axpy_f16(float a, const uint16_t* x, float* y, int64_t n) {
    const __m512 av = _mm512_set1_ps(a);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = tail_mask(n - i);
        const __m512 xv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, x + i));
        _mm512_mask_storeu_ps(y + i, k, _mm512_fmadd_ps(av, xv, _mm512_maskz_loadu_ps(k, y + i)));
    }
}

void fp32_to_fp16_row(const float* x, uint16_t* y, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = tail_mask(n - i);
        const __m256i h = _mm512_cvtps_ph(_mm512_maskz_loadu_ps(k, x + i), _MM_FROUND_TO_NEAREST_INT);
        _mm256_mask_storeu_epi16(y + i, k, h);
    }
}

}  // namespace duet::cpu::avx512
