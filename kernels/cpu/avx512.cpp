// AVX-512 (F, BW, VL, DQ) + VNNI level.
//
// The quantized products Q4_0, Q4_1 and Q8_0 use vpdpbusd (unsigned byte x
// signed byte, four products summed into each 32-bit lane):
//
// - Weights are read straight from the GGUF rows. Q4: four 32-value blocks come
//   from one 64-byte load plus a 16-byte one, and a permute gathers their
//   nibbles so that 128-bit lane k holds block k's 16 bytes: a dword permute
//   (vpermt2d) for Q4_1, whose 20-byte blocks keep every field dword-aligned,
//   a word permute (vpermt2w, twice the cost) for Q4_0's 18-byte ones. Q8_0:
//   two blocks' 32 quant bytes fill the two 256-bit halves. Masked word
//   permutes of the same loads collect the blocks' f16 scales (and mins).
// - Activations are repacked once per call into the matching order: for Q4,
//   lo[64] = the first 16 quants of 4 blocks, hi[64] = their last 16, so low
//   nibbles meet lo and high nibbles meet hi. Signed weights become unsigned by
//   an offset whose correction, -offset * (sum of the lane's activations), is
//   precomputed as the lane's starting value: -8 for Q4_0 nibbles, -128 for Q8_0
//   bytes (w ^ 0x80 = w + 128).
//
// Reduction order for one (row, token), the same in every tile shape:
// - Per full chunk of 16 blocks: the 16 blocks' exact integer dots land in the
//   16 lanes of one vector (see q4_chunk_full and q8_chunk_full for the lane order),
//   then acc = fma(cvt(dots), d_w * d_x, acc) and, Q4_1 only,
//   acc = fma(m_w, s_x, acc).
// - The rest of the row: Q4 with 3-15 blocks left, as a chunk whose missing
//   blocks are zero; Q8_0, pair by pair, per lane.
// - The result is hsum(acc), a fixed tree (hsum16 computes the same 16 at once),
//   except that a Q4 row with 1-2 blocks left (a "short tail", as SmolLM2's 576
//   = 16 + 2 blocks) ends as hsum(acc) + (v_0 + v_1), one float v_t per tail
//   block (see q4_tails8); decode gathers 8 rows' tails into one chunk.
// Passes of 2-3 tokens take a row's sums for all their tokens at once
// (q4_rows, q8_rows); of four or more, tiles (one row x up to 8 tokens, see
// "Tiles" below): the same numbers, with each weight chunk transposed once.
// Decode (one pass over the rows) prefetches rows ahead (see prefetch_ahead).
//
// Q5_0 / Q5_1 run Q4's tiles with a fifth bit, for every token count (see
// "Q5_0 / Q5_1" below). The K-quants have kernels of their own: rows for 1-3
// tokens, tiles of 4-5 tokens, and lane tiles (one token per lane) of 6-8 and
// 16 (see "K-quants" below; every level gives the scalar level's bits for
// them). F32/F16/BF16 weights use the AVX2 level's kernels (same results as
// Isa::Avx2).

#include "kernels/cpu/immintrin_avx512.h"

#include <algorithm>
#include <type_traits>
#include <vector>

#include "kernels/cpu/kernels_impl.h"

namespace duet::cpu::avx512 {

namespace {

inline float h2f(uint16_t h) { return _cvtsh_ss(h); }
// float_to_half in one F16C instruction (same bits; see the Fp16 tests).
inline uint16_t f2h(float f) { return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT)); }

// Sum of 16 lanes with a pinned tree: (l + l+8), then + 4, + 2, + 1. Not
// _mm512_reduce_add_ps, whose association is left to the compiler.
inline float hsum(__m512 v) {
    const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    s4 = _mm_add_ss(s4, _mm_movehdup_ps(s4));
    return _mm_cvtss_f32(s4);
}

// The stages of hsum16 / hsum8, each adding the lanes of two registers' rows in
// hsum's pairings:
// lanes 0-7: row a's l + (l+8); lanes 8-15: row b's.
inline __m512 add_halves(const __m512& a, const __m512& b) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
}
// From two add_halves results (rows r, r+1 and r+2, r+3): 128-bit lane k = row r + k, l + (l+4).
inline __m512 add_quarters(const __m512& a, const __m512& b) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
}
// Within each 128-bit lane: [a: l0+l2, l1+l3, b: l0+l2, l1+l3].
inline __m512 add_pairs(const __m512& a, const __m512& b) {
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xEE));
}
// Within each 128-bit lane: [a: l0+l1, l2+l3, b: l0+l1, l2+l3].
inline __m512 add_neighbours(const __m512& a, const __m512& b) {
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
}

// hsum of 16 vectors at once (lane i = hsum(v[i]) bit for bit): the same
// pairings, (l, l+8), (l, l+4), (l, l+2), (l, l+1), done across registers.
inline __m512 hsum16(const __m512* v) {
    __m512 u[8], w[4], z[2];
    for (int i = 0; i < 8; ++i) u[i] = add_halves(v[2 * i], v[2 * i + 1]);
    for (int i = 0; i < 4; ++i) w[i] = add_quarters(u[2 * i], u[2 * i + 1]);  // 128-bit lane k: row 4i + k
    for (int i = 0; i < 2; ++i) z[i] = add_pairs(w[2 * i], w[2 * i + 1]);     // lane k: rows 8i + k, 8i + 4 + k
    // lane 4k + m: row 4m + k; permute to row order.
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, add_neighbours(z[0], z[1]));
}

// hsum of 8 vectors at once (lane i < 8 = hsum(v[i]) bit for bit; lanes 8-15
// repeat them): hsum16's pairings for half as many rows.
inline __m512 hsum8(const __m512* v) {
    __m512 u[4], w[2];
    for (int i = 0; i < 4; ++i) u[i] = add_halves(v[2 * i], v[2 * i + 1]);
    for (int i = 0; i < 2; ++i) w[i] = add_quarters(u[2 * i], u[2 * i + 1]);  // 128-bit lane k: row 4i + k
    const __m512 z = add_pairs(w[0], w[1]);                                   // lane k: rows k, 4 + k
    // 128-bit lane k: rows k, 4 + k, k, 4 + k; permute to row order.
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 4, 8, 12, 1, 5, 9, 13);
    return _mm512_permutexvar_ps(order, add_neighbours(z, z));
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
    alignas(64) uint8_t buf_[32768];
    uint8_t* p_;
};

int64_t row_block(size_t row_bytes) {
    const int64_t rb = static_cast<int64_t>((256 * 1024) / std::max<size_t>(row_bytes, 1));
    return std::max<int64_t>(rb, 16);
}

inline __mmask64 bytes_mask(int n) { return n >= 64 ? ~__mmask64{0} : ((__mmask64{1} << n) - 1); }

// Decode streams each weight row once from memory (from L3 on the build
// machine, where the whole model fits). With compute between the loads, the
// out-of-order window holds few cache lines in flight and a core falls well
// short of the rate a plain read gets. So decode prefetches: for each 64 bytes
// of a row's work (a group of Q4 blocks, a pair of Q8_0 blocks), the line
// kPrefetchL2 ahead into L2 and the line kPrefetchL1 ahead into L1, issued among
// the row's own instructions (prefetch_ahead); and a call first starts its
// rows' first kPrefetchL2 bytes on their way (prefetch_start, before the
// activations' repack, which then overlaps the wait). Lines past the call's
// last row are not fetched (row_prefetch): past it lie another thread's rows or
// another tensor (GGUF order is not execution order).
// bench_kernels L3Decode/avx512/threads:2 (Q4_1 / Q8_0 kernel rate over
// read_fold's, interleaved A/B runs on the build machine): one burst per row of
// L1 prefetches 4 KiB ahead, which this replaced, 0.69-0.73 / 0.84-0.88; bursts
// into L2 and L1, clamped, 0.74-0.79 / 0.95-1.0; spread as now 0.78-0.85 /
// 1.02-1.11 (read_fold issues no prefetches). kPrefetchL2 of 8-16 KiB measure
// the same, 4 KiB and 32 KiB 5-10% lower; without the L1 prefetch Q8_0 loses 4%.
constexpr uintptr_t kPrefetchL2 = 12288;
constexpr uintptr_t kPrefetchL1 = 1024;

// How far ahead a row's prefetches reach: kPrefetchL2 / kPrefetchL1 where their
// lines stay inside the call's rows, which end at byte last (0: no
// prefetching), else 0. A prefetch at distance 0 asks for the line the row is
// about to read, which costs nothing: no branch per prefetch (a Q8_0 decode
// spent a fifth of its instructions testing the two flags per 64 bytes).
struct RowPrefetch {
    uintptr_t l2 = 0, l1 = 0;
};
inline RowPrefetch row_prefetch(const uint8_t* row, size_t bytes, uintptr_t last) {
    const uintptr_t end = reinterpret_cast<uintptr_t>(row) + bytes;
    return {last != 0 && end + kPrefetchL2 <= last + 1 ? kPrefetchL2 : 0,
            last != 0 && end + kPrefetchL1 <= last + 1 ? kPrefetchL1 : 0};
}

// always_inline: GCC's pure-const pass deems a function of prefetches alone
// const, and a call to a const function whose result is unused is deleted
// where the early inliner has not inlined it (the K-quant lane tiles lost all
// their prefetches that way, an 8-sequence pass 76 -> 90 ms).
inline __attribute__((always_inline)) void prefetch_ahead(const uint8_t* p, RowPrefetch pf) {
    _mm_prefetch(reinterpret_cast<const char*>(p + pf.l2), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(p + pf.l1), _MM_HINT_T0);
}

// A row all of whose prefetched lines lie inside the call's rows (every row of
// a decode call but those in its last kPrefetchL2 bytes) prefetches at the two
// constant distances: an immediate displacement, no register per distance.
// With RowPrefetch's distances in registers for every row, the Intel AMX host's
// one-token products ran slower (bench_kernels Decode/avx512, mean of three
// alternated runs: Q4_1 576x1536 61.3 against 53.6 us, Q8_0 576x49152 3063
// against 2791 us; SmolLM2 tg128 2 threads 306 against 339 tokens/s).
// RowPrefetch is kept for the rows near a call's end, for the lane tiles'
// 16-lane rows and for tile_row.
struct PfAhead {};
inline __attribute__((always_inline)) void prefetch_ahead(const uint8_t* p, PfAhead) {
    _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchL2), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchL1), _MM_HINT_T0);
}

// f(PfAhead{}) where both of the row's prefetches stay inside the call's rows
// (kPrefetchL1 < kPrefetchL2), else f(row_prefetch(...)): a row's work is
// instantiated for both, and the choice is made once per row.
template <class F>
inline __attribute__((always_inline)) void with_row_prefetch(const uint8_t* row, size_t bytes, uintptr_t last, F&& f) {
    const RowPrefetch pf = row_prefetch(row, bytes, last);
    if (pf.l2 != 0) {
        f(PfAhead{});
    } else {
        f(pf);
    }
}

// prefetch_ahead for bytes [from, to) of a row (the part its chunks do not cover).
template <class Pf>
inline __attribute__((always_inline)) void prefetch_ahead_rest(const uint8_t* row, size_t from, size_t to, Pf pf) {
    for (size_t off = from; off < to; off += 64) prefetch_ahead(row + off, pf);
}

// The lines the rows before first would have prefetched, up to byte last.
inline void prefetch_start(const uint8_t* first, uintptr_t last) {
    const uintptr_t p = reinterpret_cast<uintptr_t>(first);
    for (uintptr_t off = 0; off < kPrefetchL2 && p + off <= last; off += 64) {
        if (off < kPrefetchL1) {
            _mm_prefetch(reinterpret_cast<const char*>(p + off), _MM_HINT_T0);
        } else {
            _mm_prefetch(reinterpret_cast<const char*>(p + off), _MM_HINT_T1);
        }
    }
}

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

size_t q4_token_bytes(int64_t nb) { return static_cast<size_t>((nb + 15) / 16) * sizeof(XChunk4); }

// A row whose last chunk holds only 1 or 2 blocks ends in a "short tail" (see
// q4_tails8): that chunk's group 0 repeats the tail blocks in slots 0-1 and
// 2-3 (slot k holds tail block k & 1), and dx / sx hold slot k's d / s in lanes
// 4k..4k+3 (zeros for a missing second block).
inline bool q4_short_tail_rows(int64_t nb) { return nb % 16 == 1 || nb % 16 == 2; }

template <DType W>
void repack_q4(const void* xrow, int64_t nb, uint8_t* out) {
    using XBlock = std::conditional_t<W == DType::Q4_1, BlockQ8_1, BlockQ8_0>;
    const XBlock* x = static_cast<const XBlock*>(xrow);
    XChunk4* xc = reinterpret_cast<XChunk4*>(out);
    const __m512i ones = _mm512_set1_epi8(1);
    const int64_t nc = (nb + 15) / 16;
    const int64_t ntail = nb % 16;
    for (int64_t c = 0; c < nc; ++c) {
        XChunk4& ch = xc[c];
        const bool short_tail = c == nc - 1 && q4_short_tail_rows(nb);
        if (short_tail) {
            std::memset(ch.dx, 0, sizeof ch.dx);
            std::memset(ch.sx, 0, sizeof ch.sx);
        }
        for (int g = 0; g < 4; ++g) {
            for (int k = 0; k < 4; ++k) {
                const int64_t b = short_tail ? 16 * c + (k & 1) : 16 * c + 4 * g + k;
                const bool valid = short_tail ? g == 0 && (k & 1) < ntail : b < nb;
                __m128i lo = _mm_setzero_si128(), hi = _mm_setzero_si128();
                float d = 0.0f, sum = 0.0f;
                if (valid) {
                    lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x[b].qs));
                    hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x[b].qs + 16));
                    d = h2f(x[b].d);
                    if constexpr (W == DType::Q4_1) sum = h2f(x[b].s);
                }
                _mm_store_si128(reinterpret_cast<__m128i*>(ch.lo[g] + 16 * k), lo);
                _mm_store_si128(reinterpret_cast<__m128i*>(ch.hi[g] + 16 * k), hi);
                if (!short_tail) {
                    ch.dx[4 * k + g] = d;
                    ch.sx[4 * k + g] = sum;
                } else if (g == 0) {
                    for (int i = 0; i < 4; ++i) {
                        ch.dx[4 * k + i] = d;
                        ch.sx[4 * k + i] = sum;
                    }
                }
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

// Sixteen blocks as eight pairs, for Q8_0 weights.
struct alignas(64) XChunk8 {
    int8_t q[8][64];       // pair p: blocks 2p and 2p + 1, 32 quants each
    int32_t init[8][16];   // -128 * (sum of the 4 quants lane i of pair p meets)
    float dx[16];          // full chunks: lane 4q + i holds block 8(q >> 1) + 2i + (q & 1)'s d
    float dxr[8][16];      // per pair: lanes 0-7 block 2p's d, lanes 8-15 block 2p + 1's
};
static_assert(sizeof(XChunk8) == 1600);

size_t q8_token_bytes(int64_t nb) { return static_cast<size_t>((nb + 15) / 16) * sizeof(XChunk8); }

void repack_q8(const void* xrow, int64_t nb, uint8_t* out) {
    const BlockQ8_0* x = static_cast<const BlockQ8_0*>(xrow);
    XChunk8* xc = reinterpret_cast<XChunk8*>(out);
    const __m512i ones = _mm512_set1_epi8(1);
    for (int64_t c = 0; c < (nb + 15) / 16; ++c) {
        XChunk8& ch = xc[c];
        float d[16];
        for (int p = 0; p < 8; ++p) {
            for (int k = 0; k < 2; ++k) {
                const int64_t b = 16 * c + 2 * p + k;
                __m256i q = _mm256_setzero_si256();
                d[2 * p + k] = 0.0f;
                if (b < nb) {
                    q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[b].qs));
                    d[2 * p + k] = h2f(x[b].d);
                }
                _mm256_store_si256(reinterpret_cast<__m256i*>(ch.q[p] + 32 * k), q);
                _mm256_store_ps(ch.dxr[p] + 8 * k, _mm256_set1_ps(d[2 * p + k]));
            }
            const __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, _mm512_load_si512(ch.q[p]));
            _mm512_store_si512(ch.init[p], _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(s, 7)));
        }
        for (int q = 0; q < 4; ++q) {
            for (int i = 0; i < 4; ++i) ch.dx[4 * q + i] = d[8 * (q >> 1) + 2 * i + (q & 1)];
        }
    }
}

// ---------------------------------------------------------------------------
// Permute index vectors (element i of the result takes element idx[i];
// indices 16..31 (dwords) or 32..63 (words) select the second source).

inline __m512i idx_words(const uint16_t (&v)[32]) { return _mm512_loadu_si512(v); }
inline __m512i idx_dwords(const uint32_t (&v)[16]) { return _mm512_loadu_si512(v); }

// Q4_1, 20-byte blocks: block k = dwords 5k..5k+4: (d, m), 4 dwords of quants.
// Every field is dword-aligned, so the quants are gathered with a dword
// permute, one uop where the word permute is two.
alignas(64) constexpr uint32_t kQ41Qs[16] = {1, 2, 3, 4, 6, 7, 8, 9, 11, 12, 13, 14, 16, 17, 18, 19};
// Scales. Chunks: word 4k + g of the result takes block k's d from group g's
// first 64 bytes (written with mask 0x11111111 << g), word 16 + 4k + g its m.
alignas(64) constexpr uint16_t kQ41Dm[32] = {0,  0,  0,  0,  10, 10, 10, 10, 20, 20, 20, 20, 30, 30, 30, 30,
                                             1,  1,  1,  1,  11, 11, 11, 11, 21, 21, 21, 21, 31, 31, 31, 31};
// Short tails (see q4_tails8): slots 0-1 come from the first source, 2-3 from
// the second, each holding a row's tail blocks 0-1.
alignas(64) constexpr uint32_t kQ41TailQs[16] = {1, 2, 3, 4, 6, 7, 8, 9, 17, 18, 19, 20, 22, 23, 24, 25};
alignas(64) constexpr uint16_t kQ41TailDm[32] = {0, 0, 0, 0, 10, 10, 10, 10, 0, 0, 0, 0, 10, 10, 10, 10,
                                                 1, 1, 1, 1, 11, 11, 11, 11, 1, 1, 1, 1, 11, 11, 11, 11};
// Q4_0, 18-byte blocks: block k = words 9k..9k+8: d, 8 words of quants.
alignas(64) constexpr uint16_t kQ40Qs[32] = {1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 13, 14, 15, 16, 17,
                                             19, 20, 21, 22, 23, 24, 25, 26, 28, 29, 30, 31, 32, 33, 34, 35};
alignas(64) constexpr uint16_t kQ40Dm[32] = {0, 0, 0, 0, 9, 9, 9, 9, 18, 18, 18, 18, 27, 27, 27, 27,
                                             0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
alignas(64) constexpr uint16_t kQ40TailQs[32] = {1,  2,  3,  4,  5,  6,  7,  8,  10, 11, 12, 13, 14, 15, 16, 17,
                                                 33, 34, 35, 36, 37, 38, 39, 40, 42, 43, 44, 45, 46, 47, 48, 49};
alignas(64) constexpr uint16_t kQ40TailDm[32] = {0, 0, 0, 0, 9, 9, 9, 9, 0, 0, 0, 0, 9, 9, 9, 9,
                                                 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
// Q8_0, 34-byte blocks: block k = words 17k..17k+16: d, 16 words of quants.
// Full chunks: lane 4q + i takes the d at word 17 * (q & 1) of pair 4(q >> 1) + i's
// 64-byte load (written with that pair's mask).
alignas(64) constexpr uint16_t kQ80Dm[32] = {0, 0, 0, 0, 17, 17, 17, 17, 0, 0, 0, 0, 17, 17, 17, 17,
                                             0, 0, 0, 0, 0,  0,  0,  0,  0, 0, 0, 0, 0,  0,  0,  0};
alignas(64) constexpr uint16_t kQ80D[32] = {0, 0, 0, 0, 0, 0, 0, 0, 17, 17, 17, 17, 17, 17, 17, 17,
                                            0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
// Q5_0, 22-byte blocks: block k = words 11k..11k+10: d, qh (2 words), 8 words of
// nibbles. A group of four is 88 bytes, so block 3's fields lie past the first 64.
alignas(64) constexpr uint16_t kQ50Qs[32] = {3,  4,  5,  6,  7,  8,  9,  10, 14, 15, 16, 17, 18, 19, 20, 21,
                                             25, 26, 27, 28, 29, 30, 31, 32, 36, 37, 38, 39, 40, 41, 42, 43};
alignas(64) constexpr uint16_t kQ50Dm[32] = {0, 0, 0, 0, 11, 11, 11, 11, 22, 22, 22, 22, 33, 33, 33, 33,
                                             0, 0, 0, 0, 0,  0,  0,  0,  0,  0,  0,  0,  0,  0,  0,  0};
// Q5_1, 24-byte blocks: block k = dwords 6k..6k+5: (d, m), qh, 4 dwords of nibbles.
alignas(64) constexpr uint32_t kQ51Qs[16] = {2, 3, 4, 5, 8, 9, 10, 11, 14, 15, 16, 17, 20, 21, 22, 23};
alignas(64) constexpr uint16_t kQ51Dm[32] = {0, 0, 0, 0, 12, 12, 12, 12, 24, 24, 24, 24, 36, 36, 36, 36,
                                             1, 1, 1, 1, 13, 13, 13, 13, 25, 25, 25, 25, 37, 37, 37, 37};

// Loads the n bytes of a Q4 weight group into A (first 64) and B (the rest). Full groups use plain loads; a row's last, partial group uses
// masked loads so nothing past the row is touched.
template <int kGroupBytes>
inline void load_group(const uint8_t* p, int n, __m512i* a, __m512i* b) {
    static_assert(kGroupBytes == 80 || kGroupBytes == 72, "four Q4_1 or Q4_0 blocks");
    if (n == kGroupBytes) {
        *a = _mm512_loadu_si512(p);
        if constexpr (kGroupBytes == 80) {
            *b = _mm512_zextsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 64)));
        } else {
            *b = _mm512_zextsi128_si512(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 64)));
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
    static constexpr int kBlockBytes = W == DType::Q4_1   ? 20
                                       : W == DType::Q4_0 ? 18
                                       : W == DType::Q5_1 ? 24
                                       : W == DType::Q5_0 ? 22
                                                          : 34;
    // Where a block's 16 bytes of nibbles start (Q5: after d [, m] and qh).
    static constexpr int kQsOffset = W == DType::Q4_1 ? 4 : W == DType::Q4_0 ? 2 : W == DType::Q5_1 ? 8 : 6;
};

// Q5_0 / Q5_1 run Q4's tiles with a fifth bit (see "Q5_0 / Q5_1" below).
template <DType W>
constexpr bool kQ5 = W == DType::Q5_0 || W == DType::Q5_1;
// Weights d * q + m: the row's result adds m_w * s_x per block (Q8_1 activations).
template <DType W>
constexpr bool kWithMin = W == DType::Q4_1 || W == DType::Q5_1;
// Weights d * (q - o), o = 8 (Q4_0) or 16 (Q5_0): the unsigned q meet the
// activations, and a lane starts from -o * (the sum of its activations).
template <DType W>
constexpr int kInitScale = W == DType::Q4_0   ? -8
                           : W == DType::Q5_0 ? -16
                                              : 0;

// Blocks whose fields are all dword-aligned (20 and 24 bytes) are gathered
// with a dword permute.
template <DType W>
constexpr bool kDwordBlocks = W == DType::Q4_1 || W == DType::Q5_1;

template <DType W>
inline __m512i q4_idx_qs() {
    if constexpr (W == DType::Q4_1) {
        return idx_dwords(kQ41Qs);
    } else if constexpr (W == DType::Q5_1) {
        return idx_dwords(kQ51Qs);
    } else if constexpr (W == DType::Q5_0) {
        return idx_words(kQ50Qs);
    } else {
        return idx_words(kQ40Qs);
    }
}

// The quants of four blocks (a: their first 64 bytes, b: the rest) with block
// k's 16 bytes in 128-bit lane k, or with the tail index, see q4_tails8.
template <DType W>
inline __m512i q4_gather_qs(const __m512i& a, const __m512i& idx, const __m512i& b) {
    if constexpr (kDwordBlocks<W>) {
        return _mm512_permutex2var_epi32(a, idx, b);
    } else {
        return _mm512_permutex2var_epi16(a, idx, b);
    }
}

// The lanes' starting value comes from memory (init: -8 * sums for Q4_0, zeros
// for Q4_1): a load instead of a register copy of zero.
inline __m512i q4_group_dot(const __m512i& lo, const __m512i& hi, const XChunk4& x, int g) {
    __m512i p = _mm512_dpbusd_epi32(_mm512_load_si512(x.init[g]), lo, _mm512_load_si512(x.lo[g]));
    return _mm512_dpbusd_epi32(p, hi, _mm512_load_si512(x.hi[g]));
}

inline __m512i pair_sum(const __m512i& a, const __m512i& b) {
    return _mm512_madd_epi16(_mm512_packs_epi32(a, b), _mm512_set1_epi16(1));
}

// The float step of a chunk, once its integer sums s are formed.
template <DType W>
inline void q4_chunk_float(const __m512i& dm, const __m512i& s, const XChunk4& x, __m512* acc) {
    const __m512 dw = _mm512_cvtph_ps(_mm512_castsi512_si256(dm));
    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, _mm512_load_ps(x.dx)), *acc);
    if constexpr (W == DType::Q4_1) {
        *acc = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(dm, 1)), _mm512_load_ps(x.sx), *acc);
    }
}

// Group g (blocks 4g..4g+3) of a full chunk: prefetches its line(s) ahead,
// merges its scales into dm and returns its quants with block 4g + k's 16
// bytes in 128-bit lane k.
template <DType W, class Pf>
inline __m512i q4_full_group(const uint8_t* wc, int g, const __m512i& idx_qs, const __m512i& idx_dm, __m512i* dm,
                             Pf pf) {
    constexpr int kBB = Q4Traits<W>::kBlockBytes;
    // One line per 64 bytes of the chunk (320 for Q4_1, 288 for Q4_0).
    prefetch_ahead(wc + 64 * g, pf);
    if (g == 3) prefetch_ahead(wc + 256, pf);
    const uint8_t* p = wc + 4 * g * kBB;
    const __m512i a = _mm512_loadu_si512(p);
    __m512i b;
    if constexpr (W == DType::Q4_1) {
        b = _mm512_zextsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 64)));
    } else {
        b = _mm512_zextsi128_si512(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 64)));
    }
    const __mmask32 mask = W == DType::Q4_1 ? (0x11111111u << g) : (0x1111u << g);
    *dm = _mm512_mask_permutexvar_epi16(*dm, mask, idx_dm, a);
    return q4_gather_qs<W>(a, idx_qs, b);
}

// A full chunk (16 blocks) of one row against T tokens.
template <DType W, int T, class Pf>
inline void q4_chunk_full(const uint8_t* wc, const XChunk4* const* xc, int64_t c, const __m512i& idx_qs,
                          const __m512i& idx_dm, __m512* acc, Pf pf) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512i dm = _mm512_setzero_si512();
    __m512i l01[T], l23[T];
    for (int g = 0; g < 4; ++g) {
        const __m512i qs = q4_full_group<W>(wc, g, idx_qs, idx_dm, &dm, pf);
        const __m512i lo = _mm512_and_si512(qs, m4);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(qs, 4), m4);
        for (int j = 0; j < T; ++j) {
            const __m512i d = q4_group_dot(lo, hi, xc[j][c], g);
            if (g == 0) l01[j] = d;
            if (g == 1) l01[j] = pair_sum(l01[j], d);
            if (g == 2) l23[j] = d;
            if (g == 3) l23[j] = pair_sum(l23[j], d);
        }
    }
    for (int j = 0; j < T; ++j) q4_chunk_float<W>(dm, pair_sum(l01[j], l23[j]), xc[j][c], &acc[j]);
}

// The last, partial chunk: nbc < 16 blocks, masked loads, missing groups are 0.
template <DType W, int T>
inline void q4_chunk_tail(const uint8_t* wc, int64_t nbc, const XChunk4* const* xc, int64_t c,
                          const __m512i& idx_qs, const __m512i& idx_dm, __m512* acc) {
    constexpr int kBB = Q4Traits<W>::kBlockBytes;
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const __m512i zero = _mm512_setzero_si512();
    const int ng = static_cast<int>((nbc + 3) / 4);
    __m512i dm = zero;
    __m512i l01[T], l23[T];
    for (int j = 0; j < T; ++j) l01[j] = l23[j] = zero;
    for (int g = 0; g < ng; ++g) {
        const int nbytes = static_cast<int>(std::min<int64_t>(4, nbc - 4 * g)) * kBB;
        __m512i a, b;
        load_group<4 * kBB>(wc + 4 * g * kBB, nbytes, &a, &b);
        const __mmask32 mask = W == DType::Q4_1 ? (0x11111111u << g) : (0x1111u << g);
        dm = _mm512_mask_permutexvar_epi16(dm, mask, idx_dm, a);
        const __m512i qs = q4_gather_qs<W>(a, idx_qs, b);
        const __m512i lo = _mm512_and_si512(qs, m4);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(qs, 4), m4);
        for (int j = 0; j < T; ++j) {
            const __m512i d = q4_group_dot(lo, hi, xc[j][c], g);
            if (g < 2) {
                l01[j] = g == 0 ? d : pair_sum(l01[j], d);
            } else {
                l23[j] = g == 2 ? d : pair_sum(l23[j], d);
            }
        }
    }
    // Same pairing as a full chunk, with zeros for the missing groups.
    for (int j = 0; j < T; ++j) {
        if (ng == 1) l01[j] = pair_sum(l01[j], zero);
        if (ng == 3) l23[j] = pair_sum(l23[j], zero);
        q4_chunk_float<W>(dm, pair_sum(l01[j], l23[j]), xc[j][c], &acc[j]);
    }
}

// Short tails: a row that ends in 1 or 2 blocks past its full chunks (576
// values, SmolLM2's width, is 16 + 2 blocks). Those tail blocks t = 0, 1 stay
// out of the row's accumulator: each gives, from its exact integer dot S_t,
//   v_t = fma(m_w, s_x, float(S_t) * (d_w * d_x))   (Q4_0: float(S_t) * (d_w * d_x))
// (the d term, then the m term fused, as a chunk's float step; +0 for a missing
// second block), and the row's result is
//   y = hsum(acc) + (v_0 + v_1).
// Decode gathers the tails of 8 rows into one chunk (q4_tails8), so they cost
// what any 16 blocks cost instead of a half-empty group per row pair; tiles
// (q4_tail_tile) gather one row's tails for 8 tokens the same way. The activations'
// tail chunk holds its group 0 as slots 0-3 = tail blocks 0, 1, 0, 1, with
// d_x and s_x of slot k in lanes 4k..4k+3.

// Rows ra and rb's tails as one group: slots 0-1 from ra, 2-3 from rb. ka/kb
// are the byte masks of the loads (0 for an absent row: a masked-off load
// touches no memory).
template <DType W>
inline __m512i q4_tail_group(const uint8_t* ta, __mmask64 ka, const uint8_t* tb, __mmask64 kb, const __m512i& idx_qs,
                             const __m512i& idx_dm, __mmask32 dm_a, __mmask32 dm_b, __m512i* dm, const XChunk4& xt) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const __m512i a = _mm512_maskz_loadu_epi8(ka, ta);
    const __m512i b = _mm512_maskz_loadu_epi8(kb, tb);
    *dm = _mm512_mask_permutexvar_epi16(*dm, dm_a, idx_dm, a);
    *dm = _mm512_mask_permutexvar_epi16(*dm, dm_b, idx_dm, b);
    const __m512i qs = q4_gather_qs<W>(a, idx_qs, b);
    const __m512i lo = _mm512_and_si512(qs, m4);
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(qs, 4), m4);
    return q4_group_dot(lo, hi, xt, 0);
}

// v for the 16 lanes of a tail chunk from its integer sums s (lane 4k + j:
// slot k of group j) and scales dm (words 4k + j: d, 16 + 4k + j: m).
template <DType W>
inline __m512 q4_tail_values(const __m512i& s, const __m512i& dm, const __m512& dx, const __m512& sx) {
    const __m512 dw = _mm512_cvtph_ps(_mm512_castsi512_si256(dm));
    if constexpr (kWithMin<W>) {
        const __m512 mw = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(dm, 1));
        return _mm512_fmadd_ps(mw, sx, _mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, dx)));
    } else {
        (void)sx;
        return _mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, dx));
    }
}

// v_0 + v_1 of the two rows of each group: lanes 0-3 (slot 0) + 4-7 (slot 1) are
// rows 2j (lane j), lanes 8-11 + 12-15 rows 2j + 1 (lane 8 + j).
inline __m512 q4_tail_pair_sums(const __m512& v) { return _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0xB1)); }

template <DType W>
struct Q4Tail {
    __m512i idx_qs, idx_dm;
    __mmask64 bytes;  // a row's tail
    explicit Q4Tail(int ntail)
        : idx_qs(W == DType::Q4_1 ? idx_dwords(kQ41TailQs) : idx_words(kQ40TailQs)),
          idx_dm(idx_words(W == DType::Q4_1 ? kQ41TailDm : kQ40TailDm)),
          bytes(bytes_mask(ntail * Q4Traits<W>::kBlockBytes)) {}
    // Words group j takes from its first / second row.
    static __mmask32 dm_a(int j) { return W == DType::Q4_1 ? (0x00110011u << j) : (0x0011u << j); }
    static __mmask32 dm_b(int j) { return W == DType::Q4_1 ? (0x11001100u << j) : (0x1100u << j); }
};

// Tails of rows 0 .. n - 1 (n <= 8), row i's at t + i * stride; returns
// q4_tail_pair_sums, the tail sum of row 2j in lane j and of row 2j + 1 in lane 8 + j.
template <DType W>
inline __m512 q4_tails8(const uint8_t* t, size_t stride, int n, const Q4Tail<W>& tl, const XChunk4& xt) {
    __m512i dm = _mm512_setzero_si512();
    __m512i p[4];
    for (int j = 0; j < 4; ++j) {
        // An absent row loads nothing, from row 0's address (one past the matrix may not exist).
        const bool va = 2 * j < n, vb = 2 * j + 1 < n;
        const uint8_t* ta = va ? t + static_cast<size_t>(2 * j) * stride : t;
        const uint8_t* tb = vb ? t + static_cast<size_t>(2 * j + 1) * stride : t;
        p[j] = q4_tail_group<W>(ta, va ? tl.bytes : 0, tb, vb ? tl.bytes : 0, tl.idx_qs, tl.idx_dm, Q4Tail<W>::dm_a(j),
                                Q4Tail<W>::dm_b(j), &dm, xt);
    }
    const __m512i s = pair_sum(pair_sum(p[0], p[1]), pair_sum(p[2], p[3]));
    return q4_tail_pair_sums(q4_tail_values<W>(s, dm, _mm512_load_ps(xt.dx), _mm512_load_ps(xt.sx)));
}

// One row's tail against T tokens: out[j] = v_0 + v_1 for token j. dx4/sx4
// hold, per four tokens q, lane 4k + i = d_x / s_x of tail block k of token
// 4q + i (k < 2; zero elsewhere), see q4_tail_token_scales.
template <DType W, int T>
inline void q4_tail_tokens(const uint8_t* t, const Q4Tail<W>& tl, const XChunk4* const* xc, int64_t c,
                           const float (*dx4)[16], const float (*sx4)[16], float* out) {
    __m512i dm = _mm512_setzero_si512();
    const __m512i zero = _mm512_setzero_si512();
    // Slots 0-1 hold the row, 2-3 nothing; group j of the tree is token 4q + j.
    const __m512i a = _mm512_maskz_loadu_epi8(tl.bytes, t);
    dm = _mm512_mask_permutexvar_epi16(dm, Q4Tail<W>::dm_a(0) * 0xF, tl.idx_dm, a);
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const __m512i qs = q4_gather_qs<W>(a, tl.idx_qs, zero);
    const __m512i lo = _mm512_and_si512(qs, m4);
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(qs, 4), m4);
    for (int q = 0; q < (T + 3) / 4; ++q) {
        __m512i p[4];
        for (int i = 0; i < 4; ++i) p[i] = 4 * q + i < T ? q4_group_dot(lo, hi, xc[4 * q + i][c], 0) : zero;
        const __m512i s = pair_sum(pair_sum(p[0], p[1]), pair_sum(p[2], p[3]));
        alignas(64) float v[16];
        _mm512_store_ps(v, q4_tail_pair_sums(q4_tail_values<W>(s, dm, _mm512_load_ps(dx4[q]), _mm512_load_ps(sx4[q]))));
        for (int i = 0; i < 4 && 4 * q + i < T; ++i) out[4 * q + i] = v[i];
    }
}

template <int T>
inline void q4_tail_token_scales(const XChunk4* const* xc, int64_t c, float (*dx4)[16], float (*sx4)[16]) {
    for (int q = 0; q < (T + 3) / 4; ++q) {
        for (int l = 0; l < 16; ++l) {
            const int k = l / 4, j = 4 * q + l % 4;
            const bool on = k < 2 && j < T;
            dx4[q][l] = on ? xc[j][c].dx[4 * k] : 0.0f;
            sx4[q][l] = on ? xc[j][c].sx[4 * k] : 0.0f;
        }
    }
}

// Passes of 2 or 3 tokens (see matmul_q32).
template <DType W, int T>
__attribute__((noinline)) void q4_rows(const char* w, size_t w_stride, int64_t nb, const uint8_t* xp, size_t xp_stride,
                                       float* y, size_t ldy, int64_t r0, int64_t r1, uintptr_t pf_last) {
    constexpr int kBB = Q4Traits<W>::kBlockBytes;
    const int64_t nfull = nb / 16;
    const int64_t ntail = nb % 16;
    const bool short_tail = q4_short_tail_rows(nb);
    const __m512i idx_qs = q4_idx_qs<W>();
    const __m512i idx_dm = idx_words(W == DType::Q4_1 ? kQ41Dm : kQ40Dm);
    const Q4Tail<W> tl(static_cast<int>(ntail));
    const XChunk4* xc[T];
    for (int j = 0; j < T; ++j) xc[j] = reinterpret_cast<const XChunk4*>(xp + static_cast<size_t>(j) * xp_stride);
    alignas(64) float dx4[(T + 3) / 4][16], sx4[(T + 3) / 4][16];
    if (short_tail) q4_tail_token_scales<T>(xc, nfull, dx4, sx4);
    for (int64_t r = r0; r < r1; ++r) {
        const uint8_t* wr = reinterpret_cast<const uint8_t*>(w + static_cast<size_t>(r) * w_stride);
        __m512 acc[T];
        for (int j = 0; j < T; ++j) acc[j] = _mm512_setzero_ps();
        with_row_prefetch(
            wr, static_cast<size_t>(nb) * kBB, pf_last, [&](auto pf) __attribute__((always_inline)) {
                prefetch_ahead_rest(wr, static_cast<size_t>(nfull) * 16 * kBB, static_cast<size_t>(nb) * kBB, pf);
                for (int64_t c = 0; c < nfull; ++c)
                    q4_chunk_full<W, T>(wr + c * 16 * kBB, xc, c, idx_qs, idx_dm, acc, pf);
            });
        const uint8_t* tail = wr + nfull * 16 * kBB;
        float tails[T] = {};
        if (short_tail) {
            q4_tail_tokens<W, T>(tail, tl, xc, nfull, dx4, sx4, tails);
        } else if (ntail != 0) {
            q4_chunk_tail<W, T>(tail, ntail, xc, nfull, idx_qs, idx_dm, acc);
        }
        for (int j = 0; j < T; ++j) {
            const float h = hsum(acc[j]);
            y[static_cast<size_t>(j) * ldy + static_cast<size_t>(r)] = short_tail ? h + tails[j] : h;
        }
    }
}

// One token (decode): one row's chunks as q4_chunk_full<W, 1> / q4_chunk_tail<W, 1>, 16 rows at
// a time: their final sums in one hsum16 and, for short tails, their tails in
// two q4_tails8 chunks.
template <DType W>
__attribute__((noinline)) void q4_rows_t1(const char* w, size_t w_stride, int64_t nb, const uint8_t* xp, float* y,
                                          int64_t r0, int64_t r1, uintptr_t pf_last) {
    constexpr int kBB = Q4Traits<W>::kBlockBytes;
    const int64_t nfull = nb / 16;
    const int64_t ntail = nb % 16;
    const bool short_tail = q4_short_tail_rows(nb);
    const size_t row_bytes = static_cast<size_t>(nb) * kBB;
    const __m512i idx_qs = q4_idx_qs<W>();
    const __m512i idx_dm = idx_words(W == DType::Q4_1 ? kQ41Dm : kQ40Dm);
    const Q4Tail<W> tl(static_cast<int>(ntail));
    // Row 2i of 16 in lane i of the first q4_tails8 result, row 2i + 1 in lane 8 + i; rows 8-15 likewise in the second.
    const __m512i idx_rows = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 16, 24, 17, 25, 18, 26, 19, 27);
    const XChunk4* const xc[1] = {reinterpret_cast<const XChunk4*>(xp)};
    for (int64_t b0 = r0; b0 < r1; b0 += 16) {
        const int n = static_cast<int>(std::min<int64_t>(16, r1 - b0));
        const uint8_t* wb = reinterpret_cast<const uint8_t*>(w + static_cast<size_t>(b0) * w_stride);
        __m512 acc[16];
        for (int i = 0; i < 16; ++i) {
            acc[i] = _mm512_setzero_ps();
            if (i >= n) continue;
            const uint8_t* wr = wb + static_cast<size_t>(i) * w_stride;
            with_row_prefetch(
                wr, row_bytes, pf_last, [&](auto pf) __attribute__((always_inline)) {
                    prefetch_ahead_rest(wr, static_cast<size_t>(nfull) * 16 * kBB, row_bytes, pf);
                    for (int64_t c = 0; c < nfull; ++c) {
                        q4_chunk_full<W, 1>(wr + c * 16 * kBB, xc, c, idx_qs, idx_dm, &acc[i], pf);
                    }
                });
            if (!short_tail && ntail != 0) {
                q4_chunk_tail<W, 1>(wr + nfull * 16 * kBB, ntail, xc, nfull, idx_qs, idx_dm, &acc[i]);
            }
        }
        __m512 s = hsum16(acc);
        if (short_tail) {
            const uint8_t* t = wb + nfull * 16 * kBB;
            const __m512 ta = q4_tails8<W>(t, w_stride, std::min(n, 8), tl, xc[0][nfull]);
            const __m512 tb =
                n > 8 ? q4_tails8<W>(t + 8 * w_stride, w_stride, n - 8, tl, xc[0][nfull]) : _mm512_setzero_ps();
            s = _mm512_add_ps(s, _mm512_permutex2var_ps(ta, idx_rows, tb));
        }
        _mm512_mask_storeu_ps(y + b0, static_cast<__mmask16>((1u << n) - 1), s);
    }
}

// Q8_0 x Q8_0: one row, T tokens.
//
// Full chunks (16 blocks = 8 pairs): pair p's 64 quant bytes (w ^ 0x80) meet its
// activations in one vpdpbusd, giving int32 lanes 0-7 for block 2p and 8-15 for
// block 2p + 1. Lane values reach 4 * 128 * 127, too wide for the int16 trick of
// the Q4 kernels, so an unpack tree adds them exactly: unpack(lo, hi) + add per
// pair of pairs, the same on 64-bit units, then 128-bit lane swaps; block
// 8(q >> 1) + 2i + (q & 1)'s dot ends in lane 4q + i. Then one float step:
// acc = fma(cvt(dots), d_w * d_x, acc).
// The last, partial chunk goes pair by pair: acc = fma(cvt(int lanes of pair p),
// d_w * d_x per lane, acc).
inline __m512i add_unpack32(const __m512i& a, const __m512i& b) {
    return _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
}
inline __m512i add_unpack64(const __m512i& a, const __m512i& b) {
    return _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
}

template <int T, class Pf>
inline void q8_chunk_full(const uint8_t* wc, const XChunk8* const* xc, int64_t c, const __m512i& idx_dm, __m512* acc,
                          Pf pf) {
    const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
    __m512i dm = _mm512_setzero_si512();
    // Pair p's weights (w + 128 as unsigned bytes); merges its two d into dm.
    auto load_pair = [&](int p) {
        prefetch_ahead(wc + 64 * p, pf);
        if (p == 7) prefetch_ahead(wc + 512, pf);
        const uint8_t* bp = wc + 68 * p;
        __m512i qs = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bp + 2)));
        qs = _mm512_inserti64x4(qs, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bp + 36)), 1);
        const __mmask32 mask = (0x11u << (p & 3)) << (8 * (p >> 2));
        dm = _mm512_mask_permutexvar_epi16(dm, mask, idx_dm, _mm512_loadu_si512(bp));
        return _mm512_xor_si512(qs, bias);
    };
    auto dot = [&](int j, int p, const __m512i& wq) {
        return _mm512_dpbusd_epi32(_mm512_load_si512(xc[j][c].init[p]), wq, _mm512_load_si512(xc[j][c].q[p]));
    };
    __m512i r0[T], r1[T], r2[T];
    __m512i wq = load_pair(0);
    for (int j = 0; j < T; ++j) r0[j] = dot(j, 0, wq);
    wq = load_pair(1);
    for (int j = 0; j < T; ++j) r0[j] = add_unpack32(r0[j], dot(j, 1, wq));
    wq = load_pair(2);
    for (int j = 0; j < T; ++j) r1[j] = dot(j, 2, wq);
    wq = load_pair(3);
    for (int j = 0; j < T; ++j) r0[j] = add_unpack64(r0[j], add_unpack32(r1[j], dot(j, 3, wq)));
    wq = load_pair(4);
    for (int j = 0; j < T; ++j) r1[j] = dot(j, 4, wq);
    wq = load_pair(5);
    for (int j = 0; j < T; ++j) r1[j] = add_unpack32(r1[j], dot(j, 5, wq));
    wq = load_pair(6);
    for (int j = 0; j < T; ++j) r2[j] = dot(j, 6, wq);
    wq = load_pair(7);
    for (int j = 0; j < T; ++j) r1[j] = add_unpack64(r1[j], add_unpack32(r2[j], dot(j, 7, wq)));
    const __m512 dw = _mm512_cvtph_ps(_mm512_castsi512_si256(dm));
    for (int j = 0; j < T; ++j) {
        const __m512i sums = _mm512_add_epi32(_mm512_shuffle_i32x4(r0[j], r1[j], 0x88), _mm512_shuffle_i32x4(r0[j], r1[j], 0xDD));
        acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(dw, _mm512_load_ps(xc[j][c].dx)), acc[j]);
    }
}

// The last, partial chunk (ntail < 16 blocks), pair by pair, per lane.
template <int T>
inline void q8_chunk_tail(const uint8_t* wc, int64_t ntail, const XChunk8* const* xc, int64_t c,
                          const __m512i& idx_d, __m512* acc) {
    const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int p = 0; p < (ntail + 1) / 2; ++p) {
        const uint8_t* bp = wc + 68 * p;
        __m512i qs = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bp + 2)));
        __m512i hdr;
        if (ntail - 2 * p >= 2) {
            qs = _mm512_inserti64x4(qs, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bp + 36)), 1);
            hdr = _mm512_loadu_si512(bp);
        } else {
            qs = _mm512_zextsi256_si512(_mm512_castsi512_si256(qs));
            hdr = _mm512_maskz_loadu_epi8(bytes_mask(34), bp);
        }
        const __m512i wq = _mm512_xor_si512(qs, bias);
        const __m512 dw = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi16(idx_d, hdr)));
        for (int j = 0; j < T; ++j) {
            const XChunk8& x = xc[j][c];
            const __m512i d = _mm512_dpbusd_epi32(_mm512_load_si512(x.init[p]), wq, _mm512_load_si512(x.q[p]));
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(dw, _mm512_load_ps(x.dxr[p])), acc[j]);
        }
    }
}

// Passes of 2 or 3 tokens (see matmul_q32).
template <int T>
__attribute__((noinline)) void q8_rows(const char* w, size_t w_stride, int64_t nb, const uint8_t* xp, size_t xp_stride,
                                       float* y, size_t ldy, int64_t r0, int64_t r1, uintptr_t pf_last) {
    const int64_t nfull = nb / 16;
    const int64_t ntail = nb % 16;
    const __m512i idx_dm = idx_words(kQ80Dm);
    const __m512i idx_d = idx_words(kQ80D);
    const XChunk8* xc[T];
    for (int j = 0; j < T; ++j) xc[j] = reinterpret_cast<const XChunk8*>(xp + static_cast<size_t>(j) * xp_stride);
    for (int64_t r = r0; r < r1; ++r) {
        const uint8_t* wr = reinterpret_cast<const uint8_t*>(w + static_cast<size_t>(r) * w_stride);
        __m512 acc[T];
        for (int j = 0; j < T; ++j) acc[j] = _mm512_setzero_ps();
        with_row_prefetch(
            wr, static_cast<size_t>(nb) * 34, pf_last, [&](auto pf) __attribute__((always_inline)) {
                prefetch_ahead_rest(wr, static_cast<size_t>(nfull) * 16 * 34, static_cast<size_t>(nb) * 34, pf);
                for (int64_t c = 0; c < nfull; ++c) q8_chunk_full<T>(wr + c * 16 * 34, xc, c, idx_dm, acc, pf);
            });
        if (ntail != 0) q8_chunk_tail<T>(wr + nfull * 16 * 34, ntail, xc, nfull, idx_d, acc);
        for (int j = 0; j < T; ++j) y[static_cast<size_t>(j) * ldy + static_cast<size_t>(r)] = hsum(acc[j]);
    }
}

// One token (decode), 16 rows' sums at a time (hsum16 equals hsum per row).
__attribute__((noinline)) void q8_rows_t1(const char* w, size_t w_stride, int64_t nb, const uint8_t* xp, float* y,
                                          int64_t r0, int64_t r1, uintptr_t pf_last) {
    const int64_t nfull = nb / 16;
    const int64_t ntail = nb % 16;
    const __m512i idx_dm = idx_words(kQ80Dm);
    const __m512i idx_d = idx_words(kQ80D);
    const XChunk8* const xc[1] = {reinterpret_cast<const XChunk8*>(xp)};
    __m512 accs[16];
    int64_t b0 = r0;
    for (int64_t r = r0; r < r1; ++r) {
        const uint8_t* wr = reinterpret_cast<const uint8_t*>(w + static_cast<size_t>(r) * w_stride);
        __m512 acc[1] = {_mm512_setzero_ps()};
        with_row_prefetch(
            wr, static_cast<size_t>(nb) * 34, pf_last, [&](auto pf) __attribute__((always_inline)) {
                prefetch_ahead_rest(wr, static_cast<size_t>(nfull) * 16 * 34, static_cast<size_t>(nb) * 34, pf);
                for (int64_t c = 0; c < nfull; ++c) q8_chunk_full<1>(wr + c * 16 * 34, xc, c, idx_dm, acc, pf);
            });
        if (ntail != 0) q8_chunk_tail<1>(wr + nfull * 16 * 34, ntail, xc, nfull, idx_d, acc);
        accs[r - b0] = acc[0];
        if (r - b0 == 15 || r == r1 - 1) {
            const int64_t n = r - b0 + 1;
            for (int64_t i = n; i < 16; ++i) accs[i] = _mm512_setzero_ps();
            _mm512_mask_storeu_ps(y + b0, static_cast<__mmask16>((1u << n) - 1), hsum16(accs));
            b0 = r + 1;
        }
    }
}

// ---------------------------------------------------------------------------
// Tiles: one row x T <= 8 tokens, for passes of four tokens or more.
//
// Most of the work per token of the one-token kernels is reduction, not
// products: a Q4 group's vpdpbusd leaves each block's products in four lanes,
// and pair_sum gathers them (six operations per token and chunk beside eight
// vpdpbusd); Q8_0's unpack tree costs three times that. A tile instead transposes each
// weight chunk once, in registers, so that dword lane L of column vector i
// holds bytes 4i..4i+3 of the very block whose sum lane L carries in the float
// step (q4_lane_block, q8_lane_block: the lane orders above), and the
// activations are repacked to match (XtChunk4, XtChunk8). Every vpdpbusd then
// adds into its block's own lane: a token's chunk is its start value, eight
// vpdpbusd and the float step. The transposition (eight in-lane shuffles for
// Q4, twenty-four for Q8_0) is paid once per row and chunk and shared by the
// tile's T tokens, whose sums are T independent chains. (Tiles of 2 or 4 rows,
// sharing each activation load, measured 10-40% slower on an AMD EPYC Zen 4:
// their weight columns and accumulators do not fit the 32 registers.)
//
// The integer sums are exact, so they are the numbers the reduction trees
// give; the float step, the partial chunks (q4_chunk_tail, q8_chunk_tail, on
// the one-token layout), the short tails (XtTail4) and hsum are the ones above
// in the same order: a (row, token) gets the same bits from a tile as from the
// one-token kernels.

// q4_lane_block, q8_lane_block: kernels_impl.h (amx.cpp keeps these orders too).

struct alignas(64) XtChunk4 {
    int8_t lo[4][64];  // [i][4L + t]: quant 4i + t of block q4_lane_block(L)
    int8_t hi[4][64];  // [i][4L + t]: its quant 16 + 4i + t
    int32_t init[16];  // Q4_0: -8 * (the sum of the block's 32 quants); Q4_1: 0
    float dx[16];      // the block's d (XChunk4::dx's order)
    float sx[16];      // Q4_1: its s; Q4_0: 0
};
static_assert(sizeof(XtChunk4) == 704);

struct alignas(64) XtChunk8 {
    int8_t q[8][64];   // [i][4L + t]: quant 4i + t of block q8_lane_block(L)
    int32_t init[16];  // -128 * (the sum of the block's 32 quants)
    float dx[16];      // the block's d (XChunk8::dx's order)
};
static_assert(sizeof(XtChunk8) == 640);

// Short tails in tiles: the tail blocks (t = 0, 1) of up to 8 tokens, one
// lane per (t, token): lane 8t + j. The row's side (q4_tail_tile) puts block
// t's dword i in lanes 8t..8t+7 of column i, so one chunk's worth of vpdpbusd
// gives every S_t of the tile's tokens; v_t is then formed by q4_tail_values
// and v_0 + v_1 by one add (zeros for a missing second block or token, as in
// q4_tails8).
struct alignas(64) XtTail4 {
    int8_t lo[4][64];  // [i][4L + t']: quant 4i + t' of tail block L / 8 of token L % 8
    int8_t hi[4][64];  // its quant 16 + 4i + t'
    int32_t init[16];  // Q4_0: -8 * (the block's quants summed); Q4_1: 0
    float dx[16];
    float sx[16];  // Q4_1
};
static_assert(sizeof(XtTail4) == 704);

template <DType W>
using XtChunk = std::conditional_t<W == DType::Q8_0, XtChunk8, XtChunk4>;
template <DType W>
using XChunk = std::conditional_t<W == DType::Q8_0, XChunk8, XChunk4>;

// The transposed chunks of a row of nb blocks: its full chunks, and for Q5 its
// last, partial chunk too (3-15 blocks; 1-2 are a short tail).
template <DType W>
int64_t tile_chunks(int64_t nb) {
    return nb / 16 + (kQ5<W> && nb % 16 != 0 && !q4_short_tail_rows(nb) ? 1 : 0);
}

// A tile's activations (n tokens): the tokens' transposed chunks, chunk c of
// token j at [c * n + j] (one base address for a chunk's n tokens); then, for
// Q4 and Q8_0, each token's last, partial chunk, if any, in the layout
// q4_chunk_tail and q8_chunk_tail read; then, for Q4 and Q5 rows with short
// tails, the tile's XtTail4.
template <DType W>
size_t tile_bytes(int64_t nb, int n) {
    const bool short_tails = W != DType::Q8_0 && q4_short_tail_rows(nb);
    const bool partial = nb % 16 != 0 && !short_tails && !kQ5<W>;
    return static_cast<size_t>(n) *
               (static_cast<size_t>(tile_chunks<W>(nb)) * sizeof(XtChunk<W>) + (partial ? sizeof(XChunk<W>) : 0)) +
           (short_tails ? sizeof(XtTail4) : 0);
}

template <DType W>
void repack_tile(const void* xrow, int64_t nb, uint8_t* out, size_t chunk_stride, uint8_t* tail) {
    using XBlock = std::conditional_t<kWithMin<W>, BlockQ8_1, BlockQ8_0>;
    const XBlock* x = static_cast<const XBlock*>(xrow);
    const int64_t nfull = nb / 16;
    for (int64_t c = 0; c < tile_chunks<W>(nb); ++c) {
        XtChunk<W>& ch = *reinterpret_cast<XtChunk<W>*>(out + static_cast<size_t>(c) * chunk_stride);
        for (int lane = 0; lane < 16; ++lane) {
            const int bl = W == DType::Q8_0 ? q8_lane_block(lane) : q4_lane_block(lane);
            if constexpr (kQ5<W>) {
                if (16 * c + bl >= nb) {  // the partial chunk: a missing block's lane is zeros
                    for (int i = 0; i < 4; ++i) {
                        std::memset(ch.lo[i] + 4 * lane, 0, 4);
                        std::memset(ch.hi[i] + 4 * lane, 0, 4);
                    }
                    ch.init[lane] = 0;
                    ch.dx[lane] = ch.sx[lane] = 0.0f;
                    continue;
                }
            }
            const XBlock& b = x[16 * c + bl];
            int32_t sum = 0;
            for (int t = 0; t < kQK; ++t) sum += b.qs[t];
            ch.dx[lane] = h2f(b.d);
            if constexpr (W == DType::Q8_0) {
                for (int i = 0; i < 8; ++i) std::memcpy(ch.q[i] + 4 * lane, b.qs + 4 * i, 4);
                ch.init[lane] = -128 * sum;
            } else {
                for (int i = 0; i < 4; ++i) {
                    std::memcpy(ch.lo[i] + 4 * lane, b.qs + 4 * i, 4);
                    std::memcpy(ch.hi[i] + 4 * lane, b.qs + 16 + 4 * i, 4);
                }
                ch.init[lane] = kInitScale<W> * sum;
                if constexpr (kWithMin<W>) {
                    ch.sx[lane] = h2f(b.s);
                } else {
                    ch.sx[lane] = 0.0f;
                }
            }
        }
    }
    // Rows with short tails take them from XtTail4 instead; Q5's partial chunk
    // is the last of the chunks above.
    if constexpr (W == DType::Q8_0) {
        if (nb % 16 != 0) repack_q8(x + 16 * nfull, nb % 16, tail);
    } else if constexpr (!kQ5<W>) {
        if (nb % 16 != 0 && !q4_short_tail_rows(nb)) repack_q4<W>(x + 16 * nfull, nb % 16, tail);
    }
}

// One row's full chunk, transposed: column i's lane L holds bytes 4i..4i+3 of
// the lane's block (Q4: low nibbles in lo, high in hi), with the float step's
// d (and m) per lane.
struct Q4Cols {
    __m512i lo[4], hi[4];
    __m512 dw, mw;
};

// A 4 x 4 dword transpose in each 128-bit lane k: v[i]'s dword g = q[g]'s dword
// i. With q[g] holding block 4g + k in lane k, dword lane 4k + g of every v[i]
// holds block 4g + k = q4_lane_block(4k + g).
inline void transpose_dwords4(const __m512i* q, __m512i* v) {
    const __m512i t0 = _mm512_unpacklo_epi32(q[0], q[1]), t1 = _mm512_unpackhi_epi32(q[0], q[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(q[2], q[3]), t3 = _mm512_unpackhi_epi32(q[2], q[3]);
    v[0] = _mm512_unpacklo_epi64(t0, t2);
    v[1] = _mm512_unpackhi_epi64(t0, t2);
    v[2] = _mm512_unpacklo_epi64(t1, t3);
    v[3] = _mm512_unpackhi_epi64(t1, t3);
}

template <DType W, class Pf>
inline void q4_cols(const uint8_t* wc, const __m512i& idx_qs, const __m512i& idx_dm, Q4Cols* k, Pf pf) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512i dm = _mm512_setzero_si512();
    __m512i q[4];  // 128-bit lane k: block 4g + k, dword i = its bytes 4i..4i+3
    for (int g = 0; g < 4; ++g) q[g] = q4_full_group<W>(wc, g, idx_qs, idx_dm, &dm, pf);
    __m512i v[4];
    transpose_dwords4(q, v);
    for (int i = 0; i < 4; ++i) {
        k->lo[i] = _mm512_and_si512(v[i], m4);
        k->hi[i] = _mm512_and_si512(_mm512_srli_epi16(v[i], 4), m4);
    }
    k->dw = _mm512_cvtph_ps(_mm512_castsi512_si256(dm));
    k->mw = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(dm, 1));
}

// One row's chunk against T tokens: the exact sums, token by token within
// each column (T independent chains), then q4_chunk_float's step.
template <DType W, int T>
inline void q4_tile_chunk(const Q4Cols& k, const XtChunk4* xt, __m512* acc) {
    __m512i s[T];
    for (int j = 0; j < T; ++j) s[j] = kInitScale<W> != 0 ? _mm512_load_si512(xt[j].init) : _mm512_setzero_si512();
    for (int i = 0; i < 4; ++i) {
        for (int j = 0; j < T; ++j) {
            s[j] = _mm512_dpbusd_epi32(s[j], k.lo[i], _mm512_load_si512(xt[j].lo[i]));
            s[j] = _mm512_dpbusd_epi32(s[j], k.hi[i], _mm512_load_si512(xt[j].hi[i]));
        }
    }
    for (int j = 0; j < T; ++j) {
        const XtChunk4& x = xt[j];
        acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[j]), _mm512_mul_ps(k.dw, _mm512_load_ps(x.dx)), acc[j]);
        if constexpr (kWithMin<W>) acc[j] = _mm512_fmadd_ps(k.mw, _mm512_load_ps(x.sx), acc[j]);
    }
}

// Q5_0 / Q5_1 weights (what llama.cpp writes for the K-quant mixes' rows that
// are not a multiple of 256): a Q5 block is a Q4 block (d [, m] and 16 bytes
// of nibbles, value i low in byte i, value 16 + i high) plus qh, the values'
// fifth bits (bit i: value i). They run Q4's tiles and Q4's numbers with
// values 0-31: the same activation layout (XtChunk4, XtTail4), Q5_0's offset
// 16 in the lanes' start (kInitScale), Q5_1's m_w s_x term, the same float
// step, short tails and hsum. Unlike Q4 they take these tiles for every token
// count, one included, and their partial chunk (3-15 blocks) is a chunk whose
// missing blocks are zeros (masked loads; zero activations, d and s): a lane
// summing 8 products of values up to 31 leaves no room for pair_sum's int16
// in the one-token layout, so there is no second layout to agree with.
//
// The fifth bits join the values before the transposition: group g's nibbles
// gathered with block k's 16 bytes in 128-bit lane k, byte i of that lane is
// value i (low nibble) and 16 + i (high), so the low and high halves of block
// k's qh, side by side in a 64-bit mask, say which bytes add 16. The masks
// are built from the four qh words in general registers, beside the vector work.

// One group's values (nbg = 4 blocks, or 1-3 of a partial chunk; the rest
// zeros) with block k's in 128-bit lane k: lo byte 16k + i = value i, hi byte
// 16k + i = value 16 + i. Merges the blocks' scales into dm (as q4_full_group).
template <DType W, bool kFull>
inline void q5_group(const uint8_t* p, int nbg, int g, const __m512i& idx_qs, const __m512i& idx_dm, __m512i* dm,
                     __m512i* lo, __m512i* hi) {
    constexpr int kBB = Q4Traits<W>::kBlockBytes;
    constexpr int kQh = W == DType::Q5_1 ? 4 : 2;  // qh's offset in a block
    __m512i a, b;
    if constexpr (kFull) {
        a = _mm512_loadu_si512(p);
        b = _mm512_maskz_loadu_epi8(bytes_mask(4 * kBB - 64), p + 64);
    } else {
        const int n = nbg * kBB;
        a = _mm512_maskz_loadu_epi8(bytes_mask(std::min(n, 64)), p);
        b = n > 64 ? _mm512_maskz_loadu_epi8(bytes_mask(n - 64), p + 64) : _mm512_setzero_si512();
    }
    // Block 3's scales lie past the first 64 bytes: a two-source permute, then merged.
    const __mmask32 mask = kWithMin<W> ? (0x11111111u << g) : (0x1111u << g);
    *dm = _mm512_mask_mov_epi16(*dm, mask, _mm512_permutex2var_epi16(a, idx_dm, b));
    const __m512i qs = q4_gather_qs<W>(a, idx_qs, b);
    uint32_t h[4] = {0, 0, 0, 0};
    for (int k = 0; k < (kFull ? 4 : nbg); ++k) std::memcpy(&h[k], p + k * kBB + kQh, 4);
    const uint64_t mlo = (h[0] & 0xFFFFu) | static_cast<uint64_t>(h[1] & 0xFFFFu) << 16 |
                         static_cast<uint64_t>(h[2] & 0xFFFFu) << 32 | static_cast<uint64_t>(h[3]) << 48;
    const uint64_t mhi = (h[0] >> 16) | static_cast<uint64_t>(h[1] >> 16) << 16 |
                         static_cast<uint64_t>(h[2] >> 16) << 32 | static_cast<uint64_t>(h[3] >> 16) << 48;
    const __m512i m4 = _mm512_set1_epi8(0x0F), b16 = _mm512_set1_epi8(0x10);
    const __m512i l = _mm512_and_si512(qs, m4), u = _mm512_and_si512(_mm512_srli_epi16(qs, 4), m4);
    *lo = _mm512_mask_add_epi8(l, mlo, l, b16);
    *hi = _mm512_mask_add_epi8(u, mhi, u, b16);
}

// One row's chunk of nbc blocks (16: kFull), transposed as q4_cols leaves Q4's.
template <DType W, bool kFull, class Pf>
inline void q5_cols(const uint8_t* wc, int nbc, const __m512i& idx_qs, const __m512i& idx_dm, Q4Cols* k, Pf pf) {
    constexpr int kBB = Q4Traits<W>::kBlockBytes;
    __m512i dm = _mm512_setzero_si512();
    __m512i lo[4], hi[4];
    for (int g = 0; g < 4; ++g) {
        if constexpr (kFull) {
            // One line per 64 bytes of the chunk (352 for Q5_0, 384 for Q5_1).
            prefetch_ahead(wc + 64 * g, pf);
            if (g == 3) {
                prefetch_ahead(wc + 256, pf);
                prefetch_ahead(wc + 320, pf);
            }
            q5_group<W, true>(wc + 4 * g * kBB, 4, g, idx_qs, idx_dm, &dm, &lo[g], &hi[g]);
        } else {
            const int nbg = std::clamp(nbc - 4 * g, 0, 4);
            if (nbg == 0) {
                lo[g] = hi[g] = _mm512_setzero_si512();
            } else {
                q5_group<W, false>(wc + 4 * g * kBB, nbg, g, idx_qs, idx_dm, &dm, &lo[g], &hi[g]);
            }
        }
    }
    transpose_dwords4(lo, k->lo);
    transpose_dwords4(hi, k->hi);
    k->dw = _mm512_cvtph_ps(_mm512_castsi512_si256(dm));
    k->mw = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(dm, 1));
}

// A short tail's fifth bits for column c of q4_tail_tile (lanes 0-7: tail block
// 0's values sh..sh+3 in their 4 bytes, lanes 8-15: block 1's).
inline __mmask64 q5_tail_bits(uint32_t h0, uint32_t h1, int sh) {
    return static_cast<__mmask64>(((h0 >> sh) & 0xFu) * 0x11111111u) |
           static_cast<__mmask64>(((h1 >> sh) & 0xFu) * 0x11111111u) << 32;
}

struct Q8Cols {
    __m512i v[8];
    __m512 dw;
};

template <class Pf>
inline void q8_cols(const uint8_t* wc, const __m512i& idx_dm, Q8Cols* k, Pf pf) {
    const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
    __m512i dm = _mm512_setzero_si512();
    __m512i pr[8];  // pair p: block 2p's 8 dwords in lanes 0-7, block 2p + 1's in 8-15 (w + 128)
    for (int p = 0; p < 8; ++p) {
        prefetch_ahead(wc + 64 * p, pf);
        if (p == 7) prefetch_ahead(wc + 512, pf);
        const uint8_t* bp = wc + 68 * p;
        __m512i qs = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bp + 2)));
        qs = _mm512_inserti64x4(qs, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bp + 36)), 1);
        const __mmask32 mask = (0x11u << (p & 3)) << (8 * (p >> 2));
        dm = _mm512_mask_permutexvar_epi16(dm, mask, idx_dm, _mm512_loadu_si512(bp));
        pr[p] = _mm512_xor_si512(qs, bias);
    }
    // In each 128-bit lane l, a 4 x 4 dword transpose of pairs 4a..4a+3 (u[a][c]:
    // dword r = pair 4a + r's dword c of lane l), then 128-bit lanes 0 and 2
    // (dwords 0-3 of blocks 2p and 2p + 1) or 1 and 3 (dwords 4-7) of a = 0, 1:
    // column c (c + 4) lane 8a' + 4h + r = dword c (c + 4) of block 2(4a' + r) + h,
    // which is q8_lane_block's order.
    __m512i u[2][4];
    for (int a = 0; a < 2; ++a) {
        const __m512i t0 = _mm512_unpacklo_epi32(pr[4 * a], pr[4 * a + 1]);
        const __m512i t1 = _mm512_unpackhi_epi32(pr[4 * a], pr[4 * a + 1]);
        const __m512i t2 = _mm512_unpacklo_epi32(pr[4 * a + 2], pr[4 * a + 3]);
        const __m512i t3 = _mm512_unpackhi_epi32(pr[4 * a + 2], pr[4 * a + 3]);
        u[a][0] = _mm512_unpacklo_epi64(t0, t2);
        u[a][1] = _mm512_unpackhi_epi64(t0, t2);
        u[a][2] = _mm512_unpacklo_epi64(t1, t3);
        u[a][3] = _mm512_unpackhi_epi64(t1, t3);
    }
    for (int c = 0; c < 4; ++c) {
        k->v[c] = _mm512_shuffle_i32x4(u[0][c], u[1][c], 0x88);
        k->v[c + 4] = _mm512_shuffle_i32x4(u[0][c], u[1][c], 0xDD);
    }
    k->dw = _mm512_cvtph_ps(_mm512_castsi512_si256(dm));
}

// The same for Q8_0, with q8_chunk_full's float step.
template <int T>
inline void q8_tile_chunk(const Q8Cols& k, const XtChunk8* xt, __m512* acc) {
    __m512i s[T];
    for (int j = 0; j < T; ++j) s[j] = _mm512_load_si512(xt[j].init);
    for (int i = 0; i < 8; ++i) {
        for (int j = 0; j < T; ++j) s[j] = _mm512_dpbusd_epi32(s[j], k.v[i], _mm512_load_si512(xt[j].q[i]));
    }
    for (int j = 0; j < T; ++j) {
        acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[j]), _mm512_mul_ps(k.dw, _mm512_load_ps(xt[j].dx)), acc[j]);
    }
}

template <DType W>
void repack_tail_tokens(const uint8_t* xq, size_t xq_stride, int n, int64_t nb, XtTail4* out) {
    using XBlock = std::conditional_t<kWithMin<W>, BlockQ8_1, BlockQ8_0>;
    std::memset(out, 0, sizeof *out);
    const int64_t nfull = nb / 16;
    for (int lane = 0; lane < 16; ++lane) {
        const int t = lane / 8, j = lane % 8;
        if (j >= n || t >= nb % 16) continue;
        const XBlock& b = reinterpret_cast<const XBlock*>(xq + static_cast<size_t>(j) * xq_stride)[16 * nfull + t];
        int32_t sum = 0;
        for (int q = 0; q < kQK; ++q) sum += b.qs[q];
        for (int i = 0; i < 4; ++i) {
            std::memcpy(out->lo[i] + 4 * lane, b.qs + 4 * i, 4);
            std::memcpy(out->hi[i] + 4 * lane, b.qs + 16 + 4 * i, 4);
        }
        out->init[lane] = kInitScale<W> * sum;
        out->dx[lane] = h2f(b.d);
        if constexpr (kWithMin<W>) out->sx[lane] = h2f(b.s);
    }
}

// Index vectors for q4_tail_tile: column i (dwords of both tail blocks' quants)
// and the scales (words 0-15: d of lanes 0-15, 16-31: m).
template <DType W>
struct Q4TailIdx {
    __m512i col[4], dm;
    __mmask64 bytes;
    int ntail;
    explicit Q4TailIdx(int n) : bytes(bytes_mask(n * Q4Traits<W>::kBlockBytes)), ntail(n) {
        constexpr int kBB = Q4Traits<W>::kBlockBytes;
        alignas(64) uint16_t c[32], d[32];
        for (int i = 0; i < 4; ++i) {
            for (int lane = 0; lane < 16; ++lane) {
                // Block t's quant bytes start at t * kBB + kQsOffset; dword i of them.
                const int first = (lane / 8) * kBB + Q4Traits<W>::kQsOffset + 4 * i;
                c[2 * lane] = static_cast<uint16_t>(first / 2);
                c[2 * lane + 1] = static_cast<uint16_t>(first / 2 + 1);
            }
            col[i] = _mm512_load_si512(c);
        }
        for (int lane = 0; lane < 16; ++lane) {
            d[lane] = static_cast<uint16_t>((lane / 8) * kBB / 2);
            d[16 + lane] = static_cast<uint16_t>((lane / 8) * kBB / 2 + 1);  // m (unused for Q4_0, Q5_0)
        }
        dm = _mm512_load_si512(d);
    }
};

// The tail sums v_0 + v_1 of one row for the tile's tokens, token j in lane j (lanes 8-15: the same sums).
template <DType W>
inline __m512 q4_tail_tile(const uint8_t* t, const Q4TailIdx<W>& ti, const XtTail4& x) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const __m512i a = _mm512_maskz_loadu_epi8(ti.bytes, t);
    // Two chains of vpdpbusd (low and high nibbles), added at the end: exact integers.
    __m512i s = kInitScale<W> != 0 ? _mm512_load_si512(x.init) : _mm512_setzero_si512();
    __m512i s2 = _mm512_setzero_si512();
    uint32_t h0 = 0, h1 = 0;  // Q5: the tail blocks' fifth bits
    if constexpr (kQ5<W>) {
        constexpr int kQh = W == DType::Q5_1 ? 4 : 2;
        std::memcpy(&h0, t + kQh, 4);
        if (ti.ntail == 2) std::memcpy(&h1, t + Q4Traits<W>::kBlockBytes + kQh, 4);
    }
    for (int i = 0; i < 4; ++i) {
        const __m512i v = _mm512_permutexvar_epi16(ti.col[i], a);
        __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        if constexpr (kQ5<W>) {
            const __m512i b16 = _mm512_set1_epi8(0x10);
            lo = _mm512_mask_add_epi8(lo, q5_tail_bits(h0, h1, 4 * i), lo, b16);
            hi = _mm512_mask_add_epi8(hi, q5_tail_bits(h0, h1, 16 + 4 * i), hi, b16);
        }
        s = _mm512_dpbusd_epi32(s, lo, _mm512_load_si512(x.lo[i]));
        s2 = _mm512_dpbusd_epi32(s2, hi, _mm512_load_si512(x.hi[i]));
    }
    s = _mm512_add_epi32(s, s2);
    // Block 1's lanes of a row with one tail block: quants, d and m all zero (masked load).
    const __m512i dm = _mm512_permutexvar_epi16(ti.dm, a);
    const __m512 v = q4_tail_values<W>(s, dm, _mm512_load_ps(x.dx), _mm512_load_ps(x.sx));
    return _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4E));
}

// One token against the short tails of rows 0..n-1 (n <= 8, row i's at t +
// i * stride): q4_tail_tile's lanes and numbers with rows in place of tokens.
// Lane 8b + i holds row i's tail block b, gathered, against x, whose lanes
// 8b + i all hold the token's tail block b (repack_tail_tokens of one token at
// stride 0). Returns v_0 + v_1 of row i in lane i, the bits q4_tail_tile gives
// a tile's token for that row. Decode with tail blocks one row at a time spent
// a quarter of its Q5 time there.
template <DType W>
inline __m512 q5_tails8(const uint8_t* t, size_t stride, int n, int ntail, const XtTail4& x) {
    static_assert(kQ5<W>);
    constexpr int kQh = W == DType::Q5_1 ? 4 : 2;
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i off = _mm512_add_epi32(
        _mm512_mullo_epi32(_mm512_and_si512(lane, _mm512_set1_epi32(7)), _mm512_set1_epi32(static_cast<int>(stride))),
        _mm512_mullo_epi32(_mm512_srli_epi32(lane, 3), _mm512_set1_epi32(Q4Traits<W>::kBlockBytes)));
    const unsigned rows = (1u << n) - 1;
    const __mmask16 on = static_cast<__mmask16>(ntail == 2 ? rows | rows << 8 : rows);  // masked-off lanes read nothing
    const __m512i zero = _mm512_setzero_si512();
    auto gather = [&](int at) {
        return _mm512_mask_i32gather_epi32(zero, on, _mm512_add_epi32(off, _mm512_set1_epi32(at)), t, 1);
    };
    const __m512i h = gather(kQh);
    const __m512i dmw = gather(0);  // d, and Q5_1's m, of each lane's block
    const __m512i dm = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(dmw)),
                                          _mm512_cvtepi32_epi16(_mm512_srli_epi32(dmw, 16)), 1);
    const __m512i m4 = _mm512_set1_epi8(0x0F), b16 = _mm512_set1_epi8(0x10);
    __m512i s = kInitScale<W> != 0 ? _mm512_load_si512(x.init) : zero;
    for (int c = 0; c < 4; ++c) {
        const __m512i q = gather(Q4Traits<W>::kQsOffset + 4 * c);
        // Byte k of a lane's column c: values 4c + k (low nibble) and 16 + 4c + k
        // (high), whose fifth bits are bit k + 4 (c & 1) of qh's byte c / 2 and 2 + c / 2.
        const __m512i pat = _mm512_set1_epi32(c % 2 == 0 ? 0x08040201 : static_cast<int>(0x80402010u));
        const __m512i lo_src = _mm512_set1_epi32(0x01010101 * (c / 2)),
                      hi_src = _mm512_set1_epi32(0x01010101 * (2 + c / 2));
        const __m512i idx =
            _mm512_setr_epi32(0, 0x04040404, 0x08080808, 0x0C0C0C0C, 0, 0x04040404, 0x08080808, 0x0C0C0C0C, 0,
                              0x04040404, 0x08080808, 0x0C0C0C0C, 0, 0x04040404, 0x08080808, 0x0C0C0C0C);
        const __mmask64 klo = _mm512_test_epi8_mask(_mm512_shuffle_epi8(h, _mm512_add_epi8(idx, lo_src)), pat);
        const __mmask64 khi = _mm512_test_epi8_mask(_mm512_shuffle_epi8(h, _mm512_add_epi8(idx, hi_src)), pat);
        __m512i lo = _mm512_and_si512(q, m4), hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
        lo = _mm512_mask_add_epi8(lo, klo, lo, b16);
        hi = _mm512_mask_add_epi8(hi, khi, hi, b16);
        s = _mm512_dpbusd_epi32(s, lo, _mm512_load_si512(x.lo[c]));
        s = _mm512_dpbusd_epi32(s, hi, _mm512_load_si512(x.hi[c]));
    }
    const __m512 v = q4_tail_values<W>(s, dm, _mm512_load_ps(x.dx), _mm512_load_ps(x.sx));
    return _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4E));
}

// Per-call constants of tile_row.
template <DType W>
struct TileConsts {
    __m512i idx_qs, idx_dm, idx_d;
    Q4TailIdx<W> tail;
    explicit TileConsts(int64_t nb)
        : idx_qs(W == DType::Q8_0 ? _mm512_setzero_si512() : q4_idx_qs<W>()),
          idx_dm(idx_words(W == DType::Q8_0   ? kQ80Dm
                           : W == DType::Q4_1 ? kQ41Dm
                           : W == DType::Q5_1 ? kQ51Dm
                           : W == DType::Q5_0 ? kQ50Dm
                                              : kQ40Dm)),
          idx_d(idx_words(kQ80D)),
          tail(static_cast<int>(nb % 16)) {}
};

// One row against a tile of T tokens: xt, their full chunks (chunk c of token j
// at xt[c * T + j]); xo[j], token j's partial chunk; xtail, their short tails.
template <DType W, int T>
__attribute__((always_inline)) inline void tile_row(const char* w, size_t w_stride, int64_t nb, const XtChunk<W>* xt,
                                                    const XChunk<W>* const* xo, const XtTail4* xtail,
                                                    const TileConsts<W>& kc, float* y, size_t ldy, int64_t r,
                                                    uintptr_t pf_last) {
    constexpr int kBB = W == DType::Q8_0 ? 34 : Q4Traits<W>::kBlockBytes;
    const int64_t nfull = nb / 16;
    const int64_t ntail = nb % 16;
    const uint8_t* wr = reinterpret_cast<const uint8_t*>(w + static_cast<size_t>(r) * w_stride);
    const uint8_t* tail = wr + nfull * 16 * kBB;
    __m512 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm512_setzero_ps();
    __m512 tails = _mm512_setzero_ps();
    // Tiles keep RowPrefetch for every row: with_row_prefetch's second copy of the
    // row made 4-8-token passes 5-14% slower (bench_kernels, Intel AMX host).
    const RowPrefetch pf = row_prefetch(wr, static_cast<size_t>(nb) * kBB, pf_last);
    prefetch_ahead_rest(wr, static_cast<size_t>(nfull) * 16 * kBB, static_cast<size_t>(nb) * kBB, pf);
    if constexpr (W == DType::Q8_0) {
        for (int64_t c = 0; c < nfull; ++c) {
            Q8Cols k;
            q8_cols(wr + c * 16 * kBB, kc.idx_dm, &k, pf);
            q8_tile_chunk<T>(k, xt + c * T, acc);
        }
        if (ntail != 0) q8_chunk_tail<T>(tail, ntail, xo, 0, kc.idx_d, acc);
    } else if constexpr (kQ5<W>) {
        for (int64_t c = 0; c < nfull; ++c) {
            Q4Cols k;
            q5_cols<W, true>(wr + c * 16 * kBB, 16, kc.idx_qs, kc.idx_dm, &k, pf);
            q4_tile_chunk<W, T>(k, xt + c * T, acc);
        }
        if (q4_short_tail_rows(nb)) {
            tails = q4_tail_tile<W>(tail, kc.tail, *xtail);
        } else if (ntail != 0) {
            Q4Cols k;
            q5_cols<W, false>(tail, static_cast<int>(ntail), kc.idx_qs, kc.idx_dm, &k, pf);
            q4_tile_chunk<W, T>(k, xt + nfull * T, acc);
        }
    } else {
        for (int64_t c = 0; c < nfull; ++c) {
            Q4Cols k;
            q4_cols<W>(wr + c * 16 * kBB, kc.idx_qs, kc.idx_dm, &k, pf);
            q4_tile_chunk<W, T>(k, xt + c * T, acc);
        }
        if (q4_short_tail_rows(nb)) {
            tails = q4_tail_tile<W>(tail, kc.tail, *xtail);
        } else if (ntail != 0) {
            q4_chunk_tail<W, T>(tail, ntail, xo, 0, kc.idx_qs, kc.idx_dm, acc);
        }
    }
    // hsum8 gives each lane hsum's bits; a short tail's sums are then added, y = hsum(acc) + (v_0 + v_1).
    if constexpr (T == 1) {
        const float h = hsum(acc[0]);
        y[r] = W != DType::Q8_0 && q4_short_tail_rows(nb) ? h + _mm512_cvtss_f32(tails) : h;
        return;
    }
    __m512 h = hsum8(acc);
    if (W != DType::Q8_0 && q4_short_tail_rows(nb)) h = _mm512_add_ps(h, tails);
    alignas(64) float out[16];
    _mm512_store_ps(out, h);
    for (int j = 0; j < T; ++j) y[static_cast<size_t>(j) * ldy + static_cast<size_t>(r)] = out[j];
}

template <DType W, int T>
__attribute__((noinline)) void tiles(const char* w, size_t w_stride, int64_t nb, const uint8_t* xp, float* y,
                                     size_t ldy, int64_t r0, int64_t r1, uintptr_t pf_last) {
    const XtChunk<W>* xt = reinterpret_cast<const XtChunk<W>*>(xp);
    const uint8_t* tails = xp + static_cast<size_t>(tile_chunks<W>(nb)) * T * sizeof(XtChunk<W>);
    const XChunk<W>* xo[T];
    for (int j = 0; j < T; ++j) xo[j] = reinterpret_cast<const XChunk<W>*>(tails) + j;
    const XtTail4* xtail = reinterpret_cast<const XtTail4*>(tails);
    const TileConsts<W> kc(nb);
    for (int64_t r = r0; r < r1; ++r) tile_row<W, T>(w, w_stride, nb, xt, xo, xtail, kc, y, ldy, r, pf_last);
}

template <DType W>
void tiles_dispatch(int n, const char* w, size_t w_stride, int64_t nb, const uint8_t* xp, float* y, size_t ldy,
                    int64_t r0, int64_t r1, uintptr_t pf_last) {
    switch (n) {
        case 8: tiles<W, 8>(w, w_stride, nb, xp, y, ldy, r0, r1, pf_last); break;
        case 7: tiles<W, 7>(w, w_stride, nb, xp, y, ldy, r0, r1, pf_last); break;
        case 6: tiles<W, 6>(w, w_stride, nb, xp, y, ldy, r0, r1, pf_last); break;
        case 5: tiles<W, 5>(w, w_stride, nb, xp, y, ldy, r0, r1, pf_last); break;
        case 4: tiles<W, 4>(w, w_stride, nb, xp, y, ldy, r0, r1, pf_last); break;
        case 3: tiles<W, 3>(w, w_stride, nb, xp, y, ldy, r0, r1, pf_last); break;
        case 2: tiles<W, 2>(w, w_stride, nb, xp, y, ldy, r0, r1, pf_last); break;
        default: tiles<W, 1>(w, w_stride, nb, xp, y, ldy, r0, r1, pf_last); break;
    }
}

// Passes of four tokens or more (see matmul_q32): tiles of up to 8 tokens (8
// float accumulators, which hsum8 sums at once, and 8 live integer sums fit the
// registers beside a chunk's columns).
template <DType W>
void matmul_tiles(const void* w, size_t w_stride, int64_t n_in, const void* xq, size_t xq_stride, int n_tok, float* y,
                  size_t ldy, int64_t r0, int64_t r1) {
    constexpr int kT = 8;
    const int64_t nb = n_in / kQK;
    const bool short_tails = W != DType::Q8_0 && q4_short_tail_rows(nb);
    const int n_tiles = (n_tok + kT - 1) / kT;
    const char* wb = static_cast<const char*>(w);
    const bool single_pass = n_tok <= kT;
    const uintptr_t pf_last =
        single_pass && r1 > r0 ? reinterpret_cast<uintptr_t>(wb + static_cast<size_t>(r1) * w_stride) - 1 : 0;
    if (pf_last != 0) {
        prefetch_start(reinterpret_cast<const uint8_t*>(wb + static_cast<size_t>(r0) * w_stride), pf_last);
    }
    // Tile i holds tokens [8i, 8i + n) at xp + i * tile_bytes(nb, 8) (all sizes are multiples of 64).
    Scratch scratch(static_cast<size_t>(n_tiles - 1) * tile_bytes<W>(nb, kT) +
                    tile_bytes<W>(nb, n_tok - (n_tiles - 1) * kT));
    uint8_t* xp = scratch.data();
    const char* xb = static_cast<const char*>(xq);
    auto tile_at = [&](int i) { return xp + static_cast<size_t>(i) * tile_bytes<W>(nb, kT); };
    for (int i = 0; i < n_tiles; ++i) {
        const int n = std::min(kT, n_tok - i * kT);
        uint8_t* base = tile_at(i);
        uint8_t* tails = base + static_cast<size_t>(tile_chunks<W>(nb)) * n * sizeof(XtChunk<W>);
        for (int j = 0; j < n; ++j) {
            const char* xr = xb + static_cast<size_t>(i * kT + j) * xq_stride;
            repack_tile<W>(xr, nb, base + static_cast<size_t>(j) * sizeof(XtChunk<W>), n * sizeof(XtChunk<W>),
                           tails + static_cast<size_t>(j) * sizeof(XChunk<W>));
        }
        if constexpr (W != DType::Q8_0) {
            if (short_tails) {
                repack_tail_tokens<W>(reinterpret_cast<const uint8_t*>(xb) + static_cast<size_t>(i) * kT * xq_stride,
                                      xq_stride, n, nb, reinterpret_cast<XtTail4*>(tails));
            }
        }
    }
    const int64_t rb = single_pass ? r1 - r0 : row_block(w_stride);
    for (int64_t b0 = r0; b0 < r1; b0 += rb) {
        const int64_t b1 = std::min(r1, b0 + rb);
        for (int i = 0; i < n_tiles; ++i) {
            tiles_dispatch<W>(std::min(kT, n_tok - i * kT), wb, w_stride, nb, tile_at(i),
                              y + static_cast<size_t>(i) * kT * ldy, ldy, b0, b1, pf_last);
        }
    }
}

// One token against Q5 rows (decode), 8 rows at a time: each row's chunks as
// tile_row<W, 1> runs them, the 8 sums in one hsum8 (lane i = hsum of row i),
// and the rows' short tails in one q5_tails8. The bits of tiles<W, 1>.
template <DType W>
__attribute__((noinline)) void q5_rows_t1(const char* w, size_t w_stride, int64_t nb, const XtChunk4* xt,
                                          const XtTail4& xtail, float* y, int64_t r0, int64_t r1, uintptr_t pf_last) {
    constexpr int kBB = Q4Traits<W>::kBlockBytes;
    const int64_t nfull = nb / 16;
    const int ntail = static_cast<int>(nb % 16);
    const bool short_tail = q4_short_tail_rows(nb);
    const size_t row_bytes = static_cast<size_t>(nb) * kBB;
    const __m512i idx_qs = q4_idx_qs<W>();
    const __m512i idx_dm = idx_words(W == DType::Q5_1 ? kQ51Dm : kQ50Dm);
    for (int64_t b0 = r0; b0 < r1; b0 += 8) {
        const int n = static_cast<int>(std::min<int64_t>(8, r1 - b0));
        const uint8_t* wb = reinterpret_cast<const uint8_t*>(w + static_cast<size_t>(b0) * w_stride);
        __m512 acc[8];
        for (int i = 0; i < 8; ++i) {
            acc[i] = _mm512_setzero_ps();
            if (i >= n) continue;
            const uint8_t* wr = wb + static_cast<size_t>(i) * w_stride;
            with_row_prefetch(
                wr, row_bytes, pf_last, [&](auto pf) __attribute__((always_inline)) {
                    prefetch_ahead_rest(wr, static_cast<size_t>(nfull) * 16 * kBB, row_bytes, pf);
                    for (int64_t c = 0; c < nfull; ++c) {
                        Q4Cols k;
                        q5_cols<W, true>(wr + c * 16 * kBB, 16, idx_qs, idx_dm, &k, pf);
                        q4_tile_chunk<W, 1>(k, xt + c, &acc[i]);
                    }
                    if (!short_tail && ntail != 0) {
                        Q4Cols k;
                        q5_cols<W, false>(wr + nfull * 16 * kBB, ntail, idx_qs, idx_dm, &k, pf);
                        q4_tile_chunk<W, 1>(k, xt + nfull, &acc[i]);
                    }
                });
        }
        __m512 h = hsum8(acc);
        if (short_tail) h = _mm512_add_ps(h, q5_tails8<W>(wb + nfull * 16 * kBB, w_stride, n, ntail, xtail));
        _mm512_mask_storeu_ps(y + b0, static_cast<__mmask16>((1u << n) - 1), h);
    }
}

// Q5_0 / Q5_1: tiles, and for one token q5_rows_t1 (see "Q5_0 / Q5_1").
template <DType W>
void matmul_q5(const void* w, size_t w_stride, int64_t n_in, const void* xq, size_t xq_stride, int n_tok, float* y,
               size_t ldy, int64_t r0, int64_t r1) {
    if (n_tok > 1) {
        matmul_tiles<W>(w, w_stride, n_in, xq, xq_stride, n_tok, y, ldy, r0, r1);
        return;
    }
    const int64_t nb = n_in / kQK;
    const char* wb = static_cast<const char*>(w);
    const uintptr_t pf_last = r1 > r0 ? reinterpret_cast<uintptr_t>(wb + static_cast<size_t>(r1) * w_stride) - 1 : 0;
    if (pf_last != 0) {
        prefetch_start(reinterpret_cast<const uint8_t*>(wb + static_cast<size_t>(r0) * w_stride), pf_last);
    }
    Scratch scratch(static_cast<size_t>(tile_chunks<W>(nb)) * sizeof(XtChunk4) + sizeof(XtTail4));
    XtChunk4* xt = reinterpret_cast<XtChunk4*>(scratch.data());
    XtTail4* xtail = reinterpret_cast<XtTail4*>(xt + tile_chunks<W>(nb));
    repack_tile<W>(xq, nb, scratch.data(), sizeof(XtChunk4), nullptr);
    // The token's tail blocks in all 8 lanes of each: 8 "tokens" at stride 0.
    if (q4_short_tail_rows(nb)) repack_tail_tokens<W>(static_cast<const uint8_t*>(xq), 0, 8, nb, xtail);
    q5_rows_t1<W>(wb, w_stride, nb, xt, *xtail, y, r0, r1, pf_last);
}

// ---------------------------------------------------------------------------
// K-quants: passes of 1-3 tokens stream their rows once (q45k_rows_t1 /
// q6k_rows_t1 and the _tn rows below); 4-5 tokens run the tiles of one row x
// up to 8 tokens described here; 6-8 and 16 tokens the lane tiles further down
// (matmul_k_tiles chooses).
//
// Each super-block's exact integer sums come from vpdpbusd on the row's values
// unpacked once for the tile (64 per vector, in the order the activations'
// quants already have); a vector's lanes hold 4-product sums (at most
// 4 * 63 * 128), so packssdw keeps them exact and vpmaddwd / vpdpwssd apply
// the 6- or 8-bit scales. The float step is the scalar level's expression, per
// super-block, evaluated for the tile's tokens in the lanes of one vector (the
// same IEEE operations per lane, no contraction): the bits are Isa::Scalar's,
// as the AVX2 level's are.

// From a and b each holding two rows' 8 lanes (lanes 0-7, 8-15): 128-bit lane
// k = the partial sums of row k (a's rows 0, 1, b's 2, 3).
inline __m512i add_halves8_epi32(const __m512i& a, const __m512i& b) {
    return _mm512_add_epi32(_mm512_shuffle_i32x4(a, b, 0x88), _mm512_shuffle_i32x4(a, b, 0xDD));
}

// Lanes 0-7: the totals of the eight rows whose 4 partial sums are the 128-bit
// lanes of w0 (rows 0-3) and w1 (rows 4-7).
inline __m512i hsum_quads_epi32(const __m512i& w0, const __m512i& w1) {
    const __m512i z = _mm512_add_epi32(_mm512_unpacklo_epi64(w0, w1), _mm512_unpackhi_epi64(w0, w1));
    const __m512i t = _mm512_add_epi32(z, _mm512_shuffle_epi32(z, _MM_PERM_CDAB));  // dword 0: row k, dword 2: 4 + k
    return _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 0, 4, 8, 12, 2, 6, 10, 14), t);
}

// Lanes 0-7: the totals of v[0..7]'s 16 int32 lanes (exact: any order).
inline __m512i hsum8_epi32(const __m512i* v) {
    __m512i u[4], w[2];
    for (int i = 0; i < 4; ++i) {
        u[i] = _mm512_add_epi32(_mm512_shuffle_i32x4(v[2 * i], v[2 * i + 1], 0x44),
                                _mm512_shuffle_i32x4(v[2 * i], v[2 * i + 1], 0xEE));
    }
    for (int i = 0; i < 2; ++i) w[i] = add_halves8_epi32(u[2 * i], u[2 * i + 1]);
    return hsum_quads_epi32(w[0], w[1]);
}

// The eight tokens' d (lanes 0-7; a missing token's lane is 0).
template <int T>
inline __m512 tokens_d(const BlockQ8_K* const* xr, int64_t b) {
    alignas(64) float d[16] = {};
    for (int j = 0; j < T; ++j) d[j] = xr[j][b].d;
    return _mm512_load_ps(d);
}

// Lanes 0-7: sum_j mn_j * (bsums[2j] + bsums[2j + 1]) of each token (Q4_K's min term).
// mins: the 8 mins as words 2j, 2j + 1 of both 256-bit halves.
template <int T>
inline __m512i q4k_min_sums(const BlockQ8_K* const* xr, int64_t b, const __m512i& mins) {
    __m512i v[4];  // tokens 2q (lanes 0-7) and 2q + 1 (8-15)
    for (int q = 0; q < 4; ++q) {
        auto bsums = [&](int j) {
            return j < T ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr[j][b].bsums))
                         : _mm256_setzero_si256();
        };
        v[q] = 2 * q < T ? _mm512_madd_epi16(
                               _mm512_inserti64x4(_mm512_castsi256_si512(bsums(2 * q)), bsums(2 * q + 1), 1), mins)
                         : _mm512_setzero_si512();
    }
    return hsum_quads_epi32(add_halves8_epi32(v[0], v[1]), add_halves8_epi32(v[2], v[3]));
}

// One token. AVX2's kernels formed a super-block's sums 32 values a vector and
// its scales, mins and float step in general registers, and reached 50% (Q4_K)
// and 43% (Q6_K) of the weight-read floor on a Llama-3-8B-shaped slice, where
// Q4_0 and Q4_1 read at the floor: the K-quant matrices that make up most of a
// Q4_K_M model decoded at half the speed memory allows. These take 64 values a
// vector (vpmaddubsw, then vpmaddwd with each sub-block's scale), the scales as
// one vector, and one reduction for the super-block's two integer sums; the
// float step is still the scalar level's expression, in the same IEEE operations.

// A token's Q8_K super-block for Q4_K / Q5_K rows: quants in the order of a row's
// values in q45k_rows_t1 (vector k: sub-blocks kSub[k][0] then kSub[k][1]),
// sub-block sums (bsums[2j] + bsums[2j + 1]) and d.
struct alignas(64) XK45 {
    int8_t q[4][64];
    int16_t bs[8];
    float d;
};
static_assert(sizeof(XK45) == 320);

// Q4_K's qs[64c + i]: value i of sub-block 2 (2c + i / 32) (low nibble) and of
// sub-block 2 (2c + i / 32) + 1 (high): vector 2c holds low nibbles, 2c + 1 high.
constexpr int kSub[4][2] = {{0, 2}, {1, 3}, {4, 6}, {5, 7}};

void repack_xk45(const BlockQ8_K* x, int64_t nb, XK45* out) {
    for (int64_t b = 0; b < nb; ++b) {
        for (int k = 0; k < 4; ++k) {
            for (int h = 0; h < 2; ++h) std::memcpy(out[b].q[k] + 32 * h, x[b].qs + 32 * kSub[k][h], 32);
        }
        for (int j = 0; j < 8; ++j) out[b].bs[j] = static_cast<int16_t>(x[b].bsums[2 * j] + x[b].bsums[2 * j + 1]);
        out[b].d = x[b].d;
    }
}

// Words 0-15 = a, 16-31 = b: permute indices (words 0-15 take word a of the
// source, 16-31 word b), or variable shift counts per 256-bit half.
inline __m512i idx_halves(int a, int b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16(static_cast<int16_t>(a))),
                              _mm256_set1_epi16(static_cast<int16_t>(b)), 1);
}

// The 4 int32 lanes of a and the 4 of b, totalled: [sum a, sum b] (exact).
inline __m128i total2_epi32(const __m128i& a, const __m128i& b) {
    const __m128i t = _mm_hadd_epi32(a, b);
    return _mm_hadd_epi32(t, t);
}

inline __m128i fold512_epi32(const __m512i& v) {
    const __m256i h = _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

// always_inline: see prefetch_ahead.
template <class Pf>
inline __attribute__((always_inline)) void prefetch_block(const void* blk, size_t bytes, Pf pf) {
    const uint8_t* p = static_cast<const uint8_t*>(blk);
    for (size_t o = 0; o < bytes; o += 64) prefetch_ahead(p + o, pf);
}

// A super-block's two integer sums, folded to 4 lanes each: sum_j sc_j S_j (*si)
// and sum_j mn_j X_j (*mi).
// Q5_K: bit j of qh[l] to bit 4 of byte l, for sub-blocks kSub[k]: left by
// 4 - j (j <= 4) or right by j - 4, in words (a byte's own bit lands there).
struct Q5kShifts {
    __m512i sh[4];
    Q5kShifts() : sh{idx_halves(4, 2), idx_halves(3, 1), idx_halves(0, 2), idx_halves(1, 3)} {}
};

// A Q4_K / Q5_K super-block's 256 values (0-31) as bytes: vector k holds
// sub-block kSub[k][0]'s 32 values, then kSub[k][1]'s.
template <class Blk>
inline void q45k_values(const Blk& B, const Q5kShifts& q5, __m512i* v) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m16 = _mm512_set1_epi8(0x10);
    const __m512i q0 = _mm512_loadu_si512(B.qs), q1 = _mm512_loadu_si512(B.qs + 64);
    v[0] = _mm512_and_si512(q0, m4);
    v[1] = _mm512_and_si512(_mm512_srli_epi16(q0, 4), m4);
    v[2] = _mm512_and_si512(q1, m4);
    v[3] = _mm512_and_si512(_mm512_srli_epi16(q1, 4), m4);
    if constexpr (std::is_same_v<Blk, BlockQ5_K>) {
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(B.qh)));
        v[0] = _mm512_or_si512(v[0], _mm512_and_si512(_mm512_sllv_epi16(qh, q5.sh[0]), m16));
        v[1] = _mm512_or_si512(v[1], _mm512_and_si512(_mm512_sllv_epi16(qh, q5.sh[1]), m16));
        v[2] = _mm512_or_si512(v[2], _mm512_and_si512(_mm512_srlv_epi16(qh, q5.sh[2]), m16));
        v[3] = _mm512_or_si512(v[3], _mm512_and_si512(_mm512_srlv_epi16(qh, q5.sh[3]), m16));
    }
}

template <class Blk>
inline void q45k_block_t1(const Blk& B, const XK45& X, const __m512i* idx_sc, const Q5kShifts& q5, __m128i* si,
                          __m128i* mi) {
    alignas(8) uint8_t sc[8], mn[8];
    q4k_scales_mins(B.scales, sc, mn);
    const __m512i scw =
        _mm512_zextsi128_si512(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc))));
    __m512i v[4];
    q45k_values<Blk>(B, q5, v);
    // Pairs of products at most 2 * 31 * 128, times a 6-bit scale: exact.
    __m512i p[4];
    for (int k = 0; k < 4; ++k) {
        p[k] = _mm512_madd_epi16(_mm512_maddubs_epi16(v[k], _mm512_load_si512(X.q[k])),
                                 _mm512_permutexvar_epi16(idx_sc[k], scw));
    }
    *si = fold512_epi32(_mm512_add_epi32(_mm512_add_epi32(p[0], p[1]), _mm512_add_epi32(p[2], p[3])));
    *mi = _mm_madd_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn))),
                         _mm_load_si128(reinterpret_cast<const __m128i*>(X.bs)));
}

// Super-blocks two at a time: one reduction and one set of float operations for
// both, each lane the scalar level's operation for its super-block, and the two
// terms added to s in order (the scalar expression's sequence of roundings).
template <class Blk>
__attribute__((noinline)) void q45k_rows_t1(const char* w, size_t w_stride, int64_t nb, const XK45* x, float* y,
                                            int64_t r0, int64_t r1, uintptr_t pf_last) {
    __m512i idx_sc[4];
    for (int k = 0; k < 4; ++k) idx_sc[k] = idx_halves(kSub[k][0], kSub[k][1]);
    const Q5kShifts sh;
    for (int64_t r = r0; r < r1; ++r) {
        const Blk* wr = reinterpret_cast<const Blk*>(w + static_cast<size_t>(r) * w_stride);
        with_row_prefetch(
            reinterpret_cast<const uint8_t*>(wr), static_cast<size_t>(nb) * sizeof(Blk),
            pf_last, [&](auto pf) __attribute__((always_inline)) {
                float s = 0.0f;
                int64_t b = 0;
                for (; b + 2 <= nb; b += 2) {
                    prefetch_block(&wr[b], 2 * sizeof(Blk), pf);
                    __m128i si0, mi0, si1, mi1;
                    q45k_block_t1<Blk>(wr[b], x[b], idx_sc, sh, &si0, &mi0);
                    q45k_block_t1<Blk>(wr[b + 1], x[b + 1], idx_sc, sh, &si1, &mi1);
                    // [sumi_0, sumi_1, summ_0, summ_1]
                    const __m128 f =
                        _mm_cvtepi32_ps(_mm_hadd_epi32(_mm_hadd_epi32(si0, si1), _mm_hadd_epi32(mi0, mi1)));
                    uint32_t dd0, dd1;  // (d, dmin) of each
                    std::memcpy(&dd0, &wr[b].d, 4);
                    std::memcpy(&dd1, &wr[b + 1].d, 4);
                    // [d_0, dmin_0, d_1, dmin_1] -> [d_0, d_1, dmin_0, dmin_1]
                    const __m128 dwp =
                        _mm_permute_ps(_mm_cvtph_ps(_mm_set_epi32(0, 0, static_cast<int>(dd1), static_cast<int>(dd0))),
                                       _MM_SHUFFLE(3, 1, 2, 0));
                    const __m128 xd = _mm_setr_ps(x[b].d, x[b + 1].d, x[b].d, x[b + 1].d);
                    const __m128 prod = _mm_mul_ps(_mm_mul_ps(dwp, xd), f);  // [d s_i, d s_i, dm s_m, dm s_m]
                    const __m128 t = _mm_sub_ps(prod, _mm_movehl_ps(prod, prod));
                    s += _mm_cvtss_f32(t);
                    s += _mm_cvtss_f32(_mm_movehdup_ps(t));
                }
                for (; b < nb; ++b) {
                    prefetch_block(&wr[b], sizeof(Blk), pf);
                    __m128i si, mi;
                    q45k_block_t1<Blk>(wr[b], x[b], idx_sc, sh, &si, &mi);
                    const __m128i t = total2_epi32(si, mi);  // [sumi, summ, ...]
                    const float sumi = static_cast<float>(_mm_cvtsi128_si32(t));
                    const float summ = static_cast<float>(_mm_extract_epi32(t, 1));
                    const float d = h2f(wr[b].d) * x[b].d;
                    const float dm = h2f(wr[b].dmin) * x[b].d;
                    s += d * sumi - dm * summ;
                }
                y[r] = s;
            });
    }
}

// The constants of q6k_block_t1. Half h of a super-block: ql[64h..64h+63] and
// qh[32h..32h+31] (in both 256-bit halves) give values 0-63 (low nibbles, qh
// bits 0-1 / 2-3) and 64-127 (high nibbles, bits 4-5 / 6-7) of the half; groups
// of 16 values share a scale.
struct Q6kConsts {
    __m512i sh_lo, sh_hi, idx_sc[2][2];
    Q6kConsts() : sh_lo(idx_halves(4, 2)), sh_hi(idx_halves(0, 2)) {
        for (int h = 0; h < 2; ++h) {
            for (int k = 0; k < 2; ++k) {
                alignas(64) uint16_t ix[32];
                for (int i = 0; i < 32; ++i) ix[i] = static_cast<uint16_t>(8 * h + 4 * k + i / 8);
                idx_sc[h][k] = _mm512_load_si512(ix);
            }
        }
    }
};

// Half h of a Q6_K super-block as bytes 0-63: *lo = its values 0-63, *hi = 64-127.
inline void q6k_half(const BlockQ6_K& B, int h, const __m512i& sh_lo, const __m512i& sh_hi, __m512i* lo, __m512i* hi) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    const __m512i l = _mm512_loadu_si512(B.ql + 64 * h);
    const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(B.qh + 32 * h)));
    *lo = _mm512_or_si512(_mm512_and_si512(l, m4), _mm512_and_si512(_mm512_sllv_epi16(qh, sh_lo), m30));
    *hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), m4),
                          _mm512_and_si512(_mm512_srlv_epi16(qh, sh_hi), m30));
}

// A Q6_K super-block's two integer sums, folded to 4 lanes each: sum_g sc_g
// sum q6 q8 (*si) and sum_g sc_g bsums_g (*ci).
inline void q6k_block_t1(const BlockQ6_K& B, const BlockQ8_K& X, const Q6kConsts& kc, __m128i* si, __m128i* ci) {
    const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(B.scales)));
    const __m512i scw = _mm512_zextsi256_si512(sc);
    __m512i acc = _mm512_setzero_si512();
    for (int h = 0; h < 2; ++h) {
        __m512i lo, hi;
        q6k_half(B, h, kc.sh_lo, kc.sh_hi, &lo, &hi);
        // Pairs of products at most 2 * 63 * 128, times an 8-bit scale: exact.
        const __m512i p0 = _mm512_madd_epi16(_mm512_maddubs_epi16(lo, _mm512_loadu_si512(X.qs + 128 * h)),
                                             _mm512_permutexvar_epi16(kc.idx_sc[h][0], scw));
        const __m512i p1 = _mm512_madd_epi16(_mm512_maddubs_epi16(hi, _mm512_loadu_si512(X.qs + 128 * h + 64)),
                                             _mm512_permutexvar_epi16(kc.idx_sc[h][1], scw));
        acc = _mm512_add_epi32(acc, _mm512_add_epi32(p0, p1));
    }
    const __m256i corr = _mm256_madd_epi16(sc, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(X.bsums)));
    *si = fold512_epi32(acc);
    *ci = _mm_add_epi32(_mm256_castsi256_si128(corr), _mm256_extracti128_si256(corr, 1));
}

// Super-blocks two at a time, as q45k_rows_t1: sumi = si - 32 ci, then the
// scalar level's (d_w d_x) float(sumi) per lane, added to s in order.
__attribute__((noinline)) void q6k_rows_t1(const char* w, size_t w_stride, int64_t nb, const BlockQ8_K* x, float* y,
                                           int64_t r0, int64_t r1, uintptr_t pf_last) {
    const Q6kConsts kc;
    for (int64_t r = r0; r < r1; ++r) {
        const BlockQ6_K* wr = reinterpret_cast<const BlockQ6_K*>(w + static_cast<size_t>(r) * w_stride);
        with_row_prefetch(
            reinterpret_cast<const uint8_t*>(wr), static_cast<size_t>(nb) * sizeof(BlockQ6_K),
            pf_last, [&](auto pf) __attribute__((always_inline)) {
                float s = 0.0f;
                int64_t b = 0;
                for (; b + 2 <= nb; b += 2) {
                    prefetch_block(&wr[b], 2 * sizeof(BlockQ6_K), pf);
                    __m128i si0, ci0, si1, ci1;
                    q6k_block_t1(wr[b], x[b], kc, &si0, &ci0);
                    q6k_block_t1(wr[b + 1], x[b + 1], kc, &si1, &ci1);
                    const __m128i t =
                        _mm_hadd_epi32(_mm_hadd_epi32(si0, si1), _mm_hadd_epi32(ci0, ci1));  // [si0, si1, ci0, ci1]
                    const __m128i sumi = _mm_sub_epi32(t, _mm_slli_epi32(_mm_unpackhi_epi64(t, t), 5));  // lanes 0, 1
                    const __m128 dw = _mm_cvtph_ps(_mm_set_epi16(0, 0, 0, 0, 0, 0, static_cast<int16_t>(wr[b + 1].d),
                                                                 static_cast<int16_t>(wr[b].d)));
                    const __m128 v =
                        _mm_mul_ps(_mm_mul_ps(dw, _mm_setr_ps(x[b].d, x[b + 1].d, 0.0f, 0.0f)), _mm_cvtepi32_ps(sumi));
                    s += _mm_cvtss_f32(v);
                    s += _mm_cvtss_f32(_mm_movehdup_ps(v));
                }
                for (; b < nb; ++b) {
                    prefetch_block(&wr[b], sizeof(BlockQ6_K), pf);
                    __m128i si, ci;
                    q6k_block_t1(wr[b], x[b], kc, &si, &ci);
                    const __m128i t = total2_epi32(si, ci);  // [sum sc q6 q8, sum sc bsums, ...]
                    const int sumi = _mm_cvtsi128_si32(t) - 32 * _mm_extract_epi32(t, 1);
                    s += (h2f(wr[b].d) * x[b].d) * static_cast<float>(sumi);
                }
                y[r] = s;
            });
    }
}

// Two or three tokens (a verify row of 2-3 positions, 2-3 streams): one row's
// super-block unpacked once (values, scale vectors) for all of them, each
// token's sums as in the one-token rows, and the float step of tokens 0 and 1
// in the lanes of one vector (token 2's alone), each the scalar level's
// operations, added to its own sum. AVX2's rows, which this replaced, took 2.0x
// the one-token time for two tokens on the Llama-3-8B slice.
template <class Blk, int T>
__attribute__((noinline)) void q45k_rows_tn(const char* w, size_t w_stride, int64_t nb, const XK45* const* x, float* y,
                                            size_t ldy, int64_t r0, int64_t r1, uintptr_t pf_last) {
    static_assert(T == 2 || T == 3);
    __m512i idx_sc[4];
    for (int k = 0; k < 4; ++k) idx_sc[k] = idx_halves(kSub[k][0], kSub[k][1]);
    const Q5kShifts q5;
    for (int64_t r = r0; r < r1; ++r) {
        const Blk* wr = reinterpret_cast<const Blk*>(w + static_cast<size_t>(r) * w_stride);
        with_row_prefetch(
            reinterpret_cast<const uint8_t*>(wr), static_cast<size_t>(nb) * sizeof(Blk),
            pf_last, [&](auto pf) __attribute__((always_inline)) {
                float s[T] = {};
                for (int64_t b = 0; b < nb; ++b) {
                    const Blk& B = wr[b];
                    prefetch_block(&B, sizeof(Blk), pf);
                    alignas(8) uint8_t sc[8], mn[8];
                    q4k_scales_mins(B.scales, sc, mn);
                    const __m512i scw = _mm512_zextsi128_si512(
                        _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc))));
                    const __m128i mins = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn)));
                    __m512i v[4], scv[4];
                    q45k_values<Blk>(B, q5, v);
                    for (int k = 0; k < 4; ++k) scv[k] = _mm512_permutexvar_epi16(idx_sc[k], scw);
                    __m128i si[T], mi[T];
                    for (int j = 0; j < T; ++j) {
                        const XK45& X = x[j][b];
                        __m512i p[4];
                        for (int k = 0; k < 4; ++k)
                            p[k] = _mm512_madd_epi16(_mm512_maddubs_epi16(v[k], _mm512_load_si512(X.q[k])), scv[k]);
                        si[j] =
                            fold512_epi32(_mm512_add_epi32(_mm512_add_epi32(p[0], p[1]), _mm512_add_epi32(p[2], p[3])));
                        mi[j] = _mm_madd_epi16(mins, _mm_load_si128(reinterpret_cast<const __m128i*>(X.bs)));
                    }
                    const float dw = h2f(B.d), dmw = h2f(B.dmin);
                    // Tokens 0 and 1: [sumi_0, sumi_1, summ_0, summ_1].
                    const __m128 f =
                        _mm_cvtepi32_ps(_mm_hadd_epi32(_mm_hadd_epi32(si[0], si[1]), _mm_hadd_epi32(mi[0], mi[1])));
                    const __m128 dd = _mm_mul_ps(_mm_setr_ps(dw, dw, dmw, dmw),
                                                 _mm_setr_ps(x[0][b].d, x[1][b].d, x[0][b].d, x[1][b].d));
                    const __m128 prod = _mm_mul_ps(dd, f);
                    const __m128 t01 = _mm_sub_ps(prod, _mm_movehl_ps(prod, prod));
                    s[0] += _mm_cvtss_f32(t01);
                    s[1] += _mm_cvtss_f32(_mm_movehdup_ps(t01));
                    if constexpr (T == 3) {
                        const __m128i t = total2_epi32(si[2], mi[2]);
                        const float d = dw * x[2][b].d, dm = dmw * x[2][b].d;
                        s[2] += d * static_cast<float>(_mm_cvtsi128_si32(t)) -
                                dm * static_cast<float>(_mm_extract_epi32(t, 1));
                    }
                }
                for (int j = 0; j < T; ++j) y[static_cast<size_t>(j) * ldy + static_cast<size_t>(r)] = s[j];
            });
    }
}

template <int T>
__attribute__((noinline)) void q6k_rows_tn(const char* w, size_t w_stride, int64_t nb, const BlockQ8_K* const* x,
                                           float* y, size_t ldy, int64_t r0, int64_t r1, uintptr_t pf_last) {
    static_assert(T == 2 || T == 3);
    const Q6kConsts kc;
    for (int64_t r = r0; r < r1; ++r) {
        const BlockQ6_K* wr = reinterpret_cast<const BlockQ6_K*>(w + static_cast<size_t>(r) * w_stride);
        with_row_prefetch(
            reinterpret_cast<const uint8_t*>(wr), static_cast<size_t>(nb) * sizeof(BlockQ6_K),
            pf_last, [&](auto pf) __attribute__((always_inline)) {
                float s[T] = {};
                for (int64_t b = 0; b < nb; ++b) {
                    const BlockQ6_K& B = wr[b];
                    prefetch_block(&B, sizeof(BlockQ6_K), pf);
                    const __m256i sc =
                        _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(B.scales)));
                    const __m512i scw = _mm512_zextsi256_si512(sc);
                    __m512i q[2][2], scv[2][2];
                    for (int h = 0; h < 2; ++h) {
                        q6k_half(B, h, kc.sh_lo, kc.sh_hi, &q[h][0], &q[h][1]);
                        for (int k = 0; k < 2; ++k) scv[h][k] = _mm512_permutexvar_epi16(kc.idx_sc[h][k], scw);
                    }
                    __m128i si[T], ci[T];
                    for (int j = 0; j < T; ++j) {
                        const BlockQ8_K& X = x[j][b];
                        __m512i acc = _mm512_setzero_si512();
                        for (int h = 0; h < 2; ++h) {
                            for (int k = 0; k < 2; ++k) {
                                acc = _mm512_add_epi32(
                                    acc, _mm512_madd_epi16(
                                             _mm512_maddubs_epi16(q[h][k], _mm512_loadu_si512(X.qs + 128 * h + 64 * k)),
                                             scv[h][k]));
                            }
                        }
                        const __m256i corr =
                            _mm256_madd_epi16(sc, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(X.bsums)));
                        si[j] = fold512_epi32(acc);
                        ci[j] = _mm_add_epi32(_mm256_castsi256_si128(corr), _mm256_extracti128_si256(corr, 1));
                    }
                    const float dw = h2f(B.d);
                    const __m128i t = _mm_hadd_epi32(_mm_hadd_epi32(si[0], si[1]), _mm_hadd_epi32(ci[0], ci[1]));
                    const __m128i sumi = _mm_sub_epi32(t, _mm_slli_epi32(_mm_unpackhi_epi64(t, t), 5));  // lanes 0, 1
                    const __m128 v =
                        _mm_mul_ps(_mm_mul_ps(_mm_set1_ps(dw), _mm_setr_ps(x[0][b].d, x[1][b].d, 0.0f, 0.0f)),
                                   _mm_cvtepi32_ps(sumi));
                    s[0] += _mm_cvtss_f32(v);
                    s[1] += _mm_cvtss_f32(_mm_movehdup_ps(v));
                    if constexpr (T == 3) {
                        const __m128i t2 = total2_epi32(si[2], ci[2]);
                        const int sumi2 = _mm_cvtsi128_si32(t2) - 32 * _mm_extract_epi32(t2, 1);
                        s[2] += (dw * x[2][b].d) * static_cast<float>(sumi2);
                    }
                }
                for (int j = 0; j < T; ++j) y[static_cast<size_t>(j) * ldy + static_cast<size_t>(r)] = s[j];
            });
    }
}

// Two or three tokens against K-quant rows [r0, r1), streamed once.
void matmul_k_tn(DType t, const void* w, size_t w_stride, int64_t n_in, const void* xq, size_t xq_stride, int n_tok,
                 float* y, size_t ldy, int64_t r0, int64_t r1) {
    const int64_t nb = n_in / kQKK;
    const char* wb = static_cast<const char*>(w);
    const uintptr_t pf_last = r1 > r0 ? reinterpret_cast<uintptr_t>(wb + static_cast<size_t>(r1) * w_stride) - 1 : 0;
    if (pf_last != 0) {
        prefetch_start(reinterpret_cast<const uint8_t*>(wb + static_cast<size_t>(r0) * w_stride), pf_last);
    }
    const BlockQ8_K* xr[3];
    for (int j = 0; j < n_tok; ++j)
        xr[j] = reinterpret_cast<const BlockQ8_K*>(static_cast<const char*>(xq) + static_cast<size_t>(j) * xq_stride);
    if (t == DType::Q6_K) {
        if (n_tok == 2) {
            q6k_rows_tn<2>(wb, w_stride, nb, xr, y, ldy, r0, r1, pf_last);
        } else {
            q6k_rows_tn<3>(wb, w_stride, nb, xr, y, ldy, r0, r1, pf_last);
        }
        return;
    }
    Scratch scratch(static_cast<size_t>(n_tok) * static_cast<size_t>(nb) * sizeof(XK45));
    const XK45* xk[3];
    for (int j = 0; j < n_tok; ++j) {
        XK45* o = reinterpret_cast<XK45*>(scratch.data()) + static_cast<size_t>(j) * static_cast<size_t>(nb);
        repack_xk45(xr[j], nb, o);
        xk[j] = o;
    }
    const bool five = t == DType::Q5_K;
    if (n_tok == 2) {
        five ? q45k_rows_tn<BlockQ5_K, 2>(wb, w_stride, nb, xk, y, ldy, r0, r1, pf_last)
             : q45k_rows_tn<BlockQ4_K, 2>(wb, w_stride, nb, xk, y, ldy, r0, r1, pf_last);
    } else {
        five ? q45k_rows_tn<BlockQ5_K, 3>(wb, w_stride, nb, xk, y, ldy, r0, r1, pf_last)
             : q45k_rows_tn<BlockQ4_K, 3>(wb, w_stride, nb, xk, y, ldy, r0, r1, pf_last);
    }
}

// One token against K-quant rows [r0, r1): the rows stream from memory once.
void matmul_k_t1(DType t, const void* w, size_t w_stride, int64_t n_in, const void* xq, float* y, int64_t r0,
                 int64_t r1) {
    const int64_t nb = n_in / kQKK;
    const char* wb = static_cast<const char*>(w);
    const uintptr_t pf_last = r1 > r0 ? reinterpret_cast<uintptr_t>(wb + static_cast<size_t>(r1) * w_stride) - 1 : 0;
    if (pf_last != 0) {
        prefetch_start(reinterpret_cast<const uint8_t*>(wb + static_cast<size_t>(r0) * w_stride), pf_last);
    }
    const BlockQ8_K* x = static_cast<const BlockQ8_K*>(xq);
    if (t == DType::Q6_K) {
        q6k_rows_t1(wb, w_stride, nb, x, y, r0, r1, pf_last);
        return;
    }
    Scratch scratch(static_cast<size_t>(nb) * sizeof(XK45));
    XK45* xk = reinterpret_cast<XK45*>(scratch.data());
    repack_xk45(x, nb, xk);
    if (t == DType::Q4_K) {
        q45k_rows_t1<BlockQ4_K>(wb, w_stride, nb, xk, y, r0, r1, pf_last);
    } else {
        q45k_rows_t1<BlockQ5_K>(wb, w_stride, nb, xk, y, r0, r1, pf_last);
    }
}

// Q4_K or Q5_K (Blk): dpbusd's sums of four products are at most 4 * 31 * 128, so
// packssdw keeps them exact.
template <class Blk, int T>
__attribute__((noinline)) void q45k_tiles(const char* w, size_t w_stride, int64_t nb, const BlockQ8_K* const* xr,
                                          float* y, size_t ldy, int64_t r0, int64_t r1, uintptr_t pf_last) {
    constexpr bool kFive = std::is_same_v<Blk, BlockQ5_K>;
    const __m512i m4 = _mm512_set1_epi8(0x0F), m16 = _mm512_set1_epi8(0x10);
    // Q5_K's fifth bits for chunk c: bit 2c of qh[l] (low nibbles, lower half) and
    // bit 2c + 1 (high nibbles, upper half), moved to bit 4 of each byte from qh >> 2c.
    const __m512i sh5 = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(3), 1);
    // packssdw(P_2q, P_2q+1) holds, in 128-bit lane k, sub-block 4q + k / 2's sums
    // (words 0-3) and 4q + 2 + k / 2's (words 4-7): the scale words to match.
    alignas(64) uint16_t ia[32], ib[32], im[32];
    for (int i = 0; i < 32; ++i) {
        const int k = i / 8, m = i % 8;
        ia[i] = static_cast<uint16_t>((m < 4 ? 0 : 2) + k / 2);
        ib[i] = static_cast<uint16_t>(ia[i] + 4);
        im[i] = static_cast<uint16_t>((i % 16) / 2);  // bsums 2j and 2j + 1 meet min j
    }
    const __m512i idx_a = _mm512_load_si512(ia), idx_b = _mm512_load_si512(ib), idx_m = _mm512_load_si512(im);
    for (int64_t r = r0; r < r1; ++r) {
        const Blk* wr = reinterpret_cast<const Blk*>(w + static_cast<size_t>(r) * w_stride);
        with_row_prefetch(
            reinterpret_cast<const uint8_t*>(wr), static_cast<size_t>(nb) * sizeof(Blk),
            pf_last, [&](auto pf) __attribute__((always_inline)) {
                __m512 s = _mm512_setzero_ps();
                for (int64_t b = 0; b < nb; ++b) {
                    prefetch_block(&wr[b], sizeof(Blk), pf);
                    alignas(16) uint8_t sc[16], mn[16];
                    q4k_scales_mins(wr[b].scales, sc, mn);
                    const __m512i scw = _mm512_castsi128_si512(
                        _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc))));
                    const __m512i mnw = _mm512_castsi128_si512(
                        _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn))));
                    const __m512i sa = _mm512_permutexvar_epi16(idx_a, scw), sb = _mm512_permutexvar_epi16(idx_b, scw);
                    const __m512i mins = _mm512_permutexvar_epi16(idx_m, mnw);
                    __m512i q[4];  // values 64c..64c+63: sub-block 2c (low nibbles), 2c + 1 (high)
                    for (int c = 0; c < 4; ++c) {
                        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr[b].qs + 32 * c));
                        q[c] = _mm512_and_si512(
                            _mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1), m4);
                    }
                    if constexpr (kFive) {
                        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr[b].qh));
                        __m512i qh = _mm512_inserti64x4(_mm512_castsi256_si512(h), h, 1);
                        for (int c = 0; c < 4; ++c, qh = _mm512_srli_epi16(qh, 2))
                            q[c] = _mm512_or_si512(q[c], _mm512_and_si512(_mm512_sllv_epi16(qh, sh5), m16));
                    }
                    __m512i sums[8];
                    for (int j = 0; j < 8; ++j) {
                        if (j >= T) {
                            sums[j] = _mm512_setzero_si512();
                            continue;
                        }
                        const int8_t* xq = xr[j][b].qs;
                        __m512i p[4];
                        for (int c = 0; c < 4; ++c)
                            p[c] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[c], _mm512_loadu_si512(xq + 64 * c));
                        sums[j] = _mm512_dpwssd_epi32(_mm512_madd_epi16(_mm512_packs_epi32(p[0], p[1]), sa),
                                                      _mm512_packs_epi32(p[2], p[3]), sb);
                    }
                    const __m512 sumi = _mm512_cvtepi32_ps(hsum8_epi32(sums));
                    const __m512 summ = _mm512_cvtepi32_ps(q4k_min_sums<T>(xr, b, mins));
                    const __m512 xd = tokens_d<T>(xr, b);
                    const __m512 d = _mm512_mul_ps(_mm512_set1_ps(h2f(wr[b].d)), xd);
                    const __m512 dm = _mm512_mul_ps(_mm512_set1_ps(h2f(wr[b].dmin)), xd);
                    s = _mm512_add_ps(s, _mm512_sub_ps(_mm512_mul_ps(d, sumi), _mm512_mul_ps(dm, summ)));
                }
                alignas(64) float out[16];
                _mm512_store_ps(out, s);
                for (int j = 0; j < T; ++j) y[static_cast<size_t>(j) * ldy + static_cast<size_t>(r)] = out[j];
            });
    }
}

template <int T>
__attribute__((noinline)) void q6k_tiles(const char* w, size_t w_stride, int64_t nb, const BlockQ8_K* const* xr,
                                         float* y, size_t ldy, int64_t r0, int64_t r1, uintptr_t pf_last) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    // qh's two bits for values 0-31 / 32-63 of a half (shifted left 4 / 2) and
    // 64-95 / 96-127 (right 0 / 2), one vector of both halves each.
    const __m512i sh_lo = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i sh_hi = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    // packssdw(P_h0, P_h1): in 128-bit lane k, group 8h + k (words 0-3) and 8h + 4 + k (words 4-7).
    alignas(64) uint16_t i0[32], i1[32];
    for (int i = 0; i < 32; ++i) {
        const int k = i / 8, m = i % 8;
        i0[i] = static_cast<uint16_t>(k + (m < 4 ? 0 : 4));
        i1[i] = static_cast<uint16_t>(i0[i] + 8);
    }
    const __m512i idx0 = _mm512_load_si512(i0), idx1 = _mm512_load_si512(i1);
    for (int64_t r = r0; r < r1; ++r) {
        const BlockQ6_K* wr = reinterpret_cast<const BlockQ6_K*>(w + static_cast<size_t>(r) * w_stride);
        with_row_prefetch(
            reinterpret_cast<const uint8_t*>(wr), static_cast<size_t>(nb) * sizeof(BlockQ6_K),
            pf_last, [&](auto pf) __attribute__((always_inline)) {
                __m512 s = _mm512_setzero_ps();
                for (int64_t b = 0; b < nb; ++b) {
                    prefetch_block(&wr[b], sizeof(BlockQ6_K), pf);
                    const __m512i scw = _mm512_castsi256_si512(
                        _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr[b].scales))));
                    const __m512i s0 = _mm512_permutexvar_epi16(idx0, scw), s1 = _mm512_permutexvar_epi16(idx1, scw);
                    // -32 * sum_g scale_g * bsums_g, from the bsums' 16 words in lanes 0-7.
                    const __m512i corr = _mm512_mullo_epi16(scw, _mm512_set1_epi16(-32));
                    __m512i q[2][2];  // [h][p]: values 128h + 64p .. + 63
                    for (int h = 0; h < 2; ++h) {
                        const __m512i l = _mm512_loadu_si512(wr[b].ql + 64 * h);
                        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr[b].qh + 32 * h));
                        const __m512i qh2 = _mm512_inserti64x4(_mm512_castsi256_si512(qh), qh, 1);
                        q[h][0] = _mm512_or_si512(_mm512_and_si512(l, m4),
                                                  _mm512_and_si512(_mm512_sllv_epi16(qh2, sh_lo), m30));
                        q[h][1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), m4),
                                                  _mm512_and_si512(_mm512_srlv_epi16(qh2, sh_hi), m30));
                    }
                    __m512i sums[8];
                    for (int j = 0; j < 8; ++j) {
                        if (j >= T) {
                            sums[j] = _mm512_setzero_si512();
                            continue;
                        }
                        const int8_t* xq = xr[j][b].qs;
                        __m512i p[2][2];
                        for (int h = 0; h < 2; ++h) {
                            for (int pp = 0; pp < 2; ++pp) {
                                p[h][pp] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[h][pp],
                                                               _mm512_loadu_si512(xq + 128 * h + 64 * pp));
                            }
                        }
                        const __m512i bs = _mm512_zextsi256_si512(
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr[j][b].bsums)));
                        __m512i acc = _mm512_madd_epi16(bs, corr);
                        acc = _mm512_dpwssd_epi32(acc, _mm512_packs_epi32(p[0][0], p[0][1]), s0);
                        sums[j] = _mm512_dpwssd_epi32(acc, _mm512_packs_epi32(p[1][0], p[1][1]), s1);
                    }
                    const __m512 sumi = _mm512_cvtepi32_ps(hsum8_epi32(sums));
                    const __m512 d = _mm512_mul_ps(_mm512_set1_ps(h2f(wr[b].d)), tokens_d<T>(xr, b));
                    s = _mm512_add_ps(s, _mm512_mul_ps(d, sumi));
                }
                alignas(64) float out[16];
                _mm512_store_ps(out, s);
                for (int j = 0; j < T; ++j) y[static_cast<size_t>(j) * ldy + static_cast<size_t>(r)] = out[j];
            });
    }
}

// Tiles of 16 tokens, one token per lane (passes of 16 tokens or more). The
// tiles above keep a token's sums in a vector's lanes and pay per token for
// the sub-block scales (packssdw, vpmaddwd / vpdpwssd), a horizontal sum and
// the min sums: about twice Q4_1's work per value. Here a row's super-block
// is unpacked once into bytes, each 4 of its values are broadcast to all 16
// lanes and meet the 16 tokens' matching quants (one vpdpbusd: the token's
// 4-product sum in its lane), a sub-block's sums are multiplied by its scale
// once for all the tokens (vpmulld), the min and bsums terms are vpmaddwd of
// the tokens' sums against the broadcast scale pairs, and the float step is
// the scalar level's expression with the tokens in the lanes. No horizontal
// sum at all; the integer sums are exact, so the bits are Isa::Scalar's.

// A tile's super-block, L = 16 or 8 tokens: q[m], lane t: token t's 4 quants
// meeting dword m of the row's unpacked values (q45k_values' order for Q4_K /
// Q5_K, the natural order for Q6_K); bs[i], lane t: the words that meet scale
// pair i (Q4_K / Q5_K: sub-block sums 2i and 2i + 1; Q6_K: bsums 2i and
// 2i + 1); d. Lanes past a tile's last token are zeros.
template <int L>
struct alignas(64) XKL {
    int8_t q[64][4 * L];
    int16_t bs[8][2 * L];
    float d[L];
};
static_assert(sizeof(XKL<16>) == 4672 && sizeof(XKL<8>) == 2368);

// Where dword m of a row's unpacked values starts among the natural values.
inline int xkl_value(bool ksub, int m) { return ksub ? 32 * kSub[m / 16][(m % 16) / 8] + 4 * (m % 8) : 4 * m; }

template <int L>
void repack_xkl(bool ksub, const BlockQ8_K* const* xr, int n, int64_t nb, XKL<L>* out) {
    std::memset(static_cast<void*>(out), 0, static_cast<size_t>(nb) * sizeof(XKL<L>));
    for (int64_t b = 0; b < nb; ++b) {
        XKL<L>& o = out[b];
        for (int m = 0; m < 64; ++m) {
            const int v = xkl_value(ksub, m);
            for (int t = 0; t < n; ++t) std::memcpy(o.q[m] + 4 * t, xr[t][b].qs + v, 4);
        }
        for (int i = 0; i < 8; ++i) {
            for (int t = 0; t < n; ++t) {
                const int16_t* bs = xr[t][b].bsums;
                for (int e = 0; e < 2; ++e) {
                    const int j = 2 * i + e;
                    o.bs[i][2 * t + e] =
                        ksub ? (i < 4 ? static_cast<int16_t>(bs[2 * j] + bs[2 * j + 1]) : int16_t{0}) : bs[j];
                }
            }
        }
        for (int t = 0; t < n; ++t) o.d[t] = xr[t][b].d;
    }
}

// The compiler would keep the unpacked values in registers and extract each
// dword to broadcast it (two shuffles per vpdpbusd); after this it reads them
// back from memory, where a broadcast is part of the load.
inline void read_back(const int32_t* p) { asm volatile("" : : "r"(p) : "memory"); }

// The integer and float operations of the lane tiles, on 16 lanes (zmm) or 8 (ymm).
template <int L>
struct Lanes;
template <>
struct Lanes<16> {
    using I = __m512i;
    using F = __m512;
    static I zero() { return _mm512_setzero_si512(); }
    static I set1(int32_t v) { return _mm512_set1_epi32(v); }
    static I load(const void* p) { return _mm512_load_si512(p); }
    static I dpbusd(const I& acc, const I& u, const I& s) { return _mm512_dpbusd_epi32(acc, u, s); }
    static I add(const I& a, const I& b) { return _mm512_add_epi32(a, b); }
    static I sub(const I& a, const I& b) { return _mm512_sub_epi32(a, b); }
    static I mullo(const I& a, const I& b) { return _mm512_mullo_epi32(a, b); }
    static I madd(const I& a, const I& b) { return _mm512_madd_epi16(a, b); }
    static I slli5(const I& a) { return _mm512_slli_epi32(a, 5); }
    static F cvt(const I& a) { return _mm512_cvtepi32_ps(a); }
    static F fzero() { return _mm512_setzero_ps(); }
    static F fset1(float v) { return _mm512_set1_ps(v); }
    static F fload(const float* p) { return _mm512_load_ps(p); }
    static F fmul(const F& a, const F& b) { return _mm512_mul_ps(a, b); }
    static F fadd(const F& a, const F& b) { return _mm512_add_ps(a, b); }
    static F fsub(const F& a, const F& b) { return _mm512_sub_ps(a, b); }
    static void fstore(float* p, const F& v) { _mm512_store_ps(p, v); }
};
template <>
struct Lanes<8> {
    using I = __m256i;
    using F = __m256;
    static I zero() { return _mm256_setzero_si256(); }
    static I set1(int32_t v) { return _mm256_set1_epi32(v); }
    static I load(const void* p) { return _mm256_load_si256(static_cast<const __m256i*>(p)); }
    static I dpbusd(const I& acc, const I& u, const I& s) { return _mm256_dpbusd_epi32(acc, u, s); }
    static I add(const I& a, const I& b) { return _mm256_add_epi32(a, b); }
    static I sub(const I& a, const I& b) { return _mm256_sub_epi32(a, b); }
    static I mullo(const I& a, const I& b) { return _mm256_mullo_epi32(a, b); }
    static I madd(const I& a, const I& b) { return _mm256_madd_epi16(a, b); }
    static I slli5(const I& a) { return _mm256_slli_epi32(a, 5); }
    static F cvt(const I& a) { return _mm256_cvtepi32_ps(a); }
    static F fzero() { return _mm256_setzero_ps(); }
    static F fset1(float v) { return _mm256_set1_ps(v); }
    static F fload(const float* p) { return _mm256_load_ps(p); }
    static F fmul(const F& a, const F& b) { return _mm256_mul_ps(a, b); }
    static F fadd(const F& a, const F& b) { return _mm256_add_ps(a, b); }
    static F fsub(const F& a, const F& b) { return _mm256_sub_ps(a, b); }
    static void fstore(float* p, const F& v) { _mm256_store_ps(p, v); }
};

// Row r's results for the tile's n tokens: y[t * ldy + r].
template <int L>
inline void store_tokens(const typename Lanes<L>::F& s, int n, float* y, size_t ldy, int64_t r) {
    alignas(64) float out[L];
    Lanes<L>::fstore(out, s);
    for (int t = 0; t < n; ++t) y[static_cast<size_t>(t) * ldy + static_cast<size_t>(r)] = out[t];
}

// A Q4_K / Q5_K super-block unpacked for a lane tile: its 256 values (0-31)
// as dwords in q45k_values' order, the 6-bit scales as dwords, the mins as
// word pairs (mn 2i, mn 2i + 1).
struct alignas(64) Q45kUnpacked {
    int32_t vals[64];
    int32_t sc32[8];
    int32_t mnp[4];
};

template <class Blk>
inline void q45k_unpack(const Blk& B, const Q5kShifts& q5, Q45kUnpacked* u) {
    __m512i v[4];
    q45k_values<Blk>(B, q5, v);
    for (int k = 0; k < 4; ++k) _mm512_store_si512(u->vals + 16 * k, v[k]);
    alignas(8) uint8_t sc[8], mn[8];
    q4k_scales_mins(B.scales, sc, mn);
    _mm256_store_si256(reinterpret_cast<__m256i*>(u->sc32),
                       _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc))));
    _mm_store_si128(reinterpret_cast<__m128i*>(u->mnp),
                    _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn))));
}

// Rows r .. r + R - 1 of a lane tile. Each activation load feeds R rows'
// vpdpbusd: a 16-lane tile's activations (74 KB at 4096 values) outgrow L1, so
// one row at a time reads them from L2 once per row. Each row's integer and
// float operations are those of one row alone, in the same order. Only
// 8-lane tiles prefetch: 16-lane ones run in passes of 16+ tokens, whose rows
// come in blocks that stay in L2 (pf_last 0), and a prefetch at distance 0
// still costs an issue slot.
template <class Blk, int L, int R>
inline __attribute__((always_inline)) void q45k_tile_rows(const char* w, size_t w_stride, int64_t nb, const XKL<L>* x,
                                                          int n, float* y, size_t ldy, int64_t r, uintptr_t pf_last,
                                                          const Q5kShifts& q5) {
    using V = Lanes<L>;
    const Blk* wr[R];
    RowPrefetch pf[R];
    typename V::F s[R];
    for (int j = 0; j < R; ++j) {
        wr[j] = reinterpret_cast<const Blk*>(w + static_cast<size_t>(r + j) * w_stride);
        pf[j] = row_prefetch(reinterpret_cast<const uint8_t*>(wr[j]), static_cast<size_t>(nb) * sizeof(Blk), pf_last);
        s[j] = V::fzero();
    }
    // Rows follow each other: where the last one's lines stay inside, all do.
    auto run = [&](auto pick) __attribute__((always_inline)) {
        for (int64_t b = 0; b < nb; ++b) {
            const XKL<L>& X = x[b];
            Q45kUnpacked u[R];
            for (int j = 0; j < R; ++j) {
                if constexpr (L == 8) prefetch_block(&wr[j][b], sizeof(Blk), pick(j));
                q45k_unpack<Blk>(wr[j][b], q5, &u[j]);
            }
            read_back(u[0].vals);
            typename V::I tot[R];
            for (int j = 0; j < R; ++j) tot[j] = V::zero();
            for (int k = 0; k < 4; ++k) {
                for (int h = 0; h < 2; ++h) {
                    // Sub-block kSub[k][h]: dwords 16k + 8h .. + 7, two chains.
                    typename V::I a0[R], a1[R];
                    for (int j = 0; j < R; ++j) a0[j] = a1[j] = V::zero();
                    for (int i = 0; i < 8; i += 2) {
                        const int m = 16 * k + 8 * h + i;
                        const typename V::I x0 = V::load(X.q[m]), x1 = V::load(X.q[m + 1]);
                        for (int j = 0; j < R; ++j) {
                            a0[j] = V::dpbusd(a0[j], V::set1(u[j].vals[m]), x0);
                            a1[j] = V::dpbusd(a1[j], V::set1(u[j].vals[m + 1]), x1);
                        }
                    }
                    for (int j = 0; j < R; ++j)
                        tot[j] = V::add(tot[j], V::mullo(V::add(a0[j], a1[j]), V::set1(u[j].sc32[kSub[k][h]])));
                }
            }
            const typename V::F xd = V::fload(X.d);
            for (int j = 0; j < R; ++j) {
                typename V::I summ = V::madd(V::load(X.bs[0]), V::set1(u[j].mnp[0]));
                for (int i = 1; i < 4; ++i) summ = V::add(summ, V::madd(V::load(X.bs[i]), V::set1(u[j].mnp[i])));
                const typename V::F d = V::fmul(V::fset1(h2f(wr[j][b].d)), xd);
                const typename V::F dm = V::fmul(V::fset1(h2f(wr[j][b].dmin)), xd);
                s[j] = V::fadd(s[j], V::fsub(V::fmul(d, V::cvt(tot[j])), V::fmul(dm, V::cvt(summ))));
            }
        }
    };
    if constexpr (L == 8) {
        if (pf[R - 1].l2 != 0) {
            run([](int) { return PfAhead{}; });
        } else {
            run([&](int j) { return pf[j]; });
        }
    } else {
        run([&](int j) { return pf[j]; });
    }
    for (int j = 0; j < R; ++j) store_tokens<L>(s[j], n, y, ldy, r + j);
}

template <class Blk, int L>
__attribute__((noinline)) void q45k_tiles_l(const char* w, size_t w_stride, int64_t nb, const XKL<L>* x, int n,
                                            float* y, size_t ldy, int64_t r0, int64_t r1, uintptr_t pf_last) {
    const Q5kShifts q5;
    int64_t r = r0;
    for (; r + 2 <= r1; r += 2) q45k_tile_rows<Blk, L, 2>(w, w_stride, nb, x, n, y, ldy, r, pf_last, q5);
    for (; r < r1; ++r) q45k_tile_rows<Blk, L, 1>(w, w_stride, nb, x, n, y, ldy, r, pf_last, q5);
}

// A Q6_K super-block unpacked for a lane tile: its 256 values (0-63) as dwords
// in order, the 8-bit scales as dwords and as word pairs (scale 2i, 2i + 1).
struct alignas(64) Q6kUnpacked {
    int32_t vals[64];
    int32_t sc32[16];
    int32_t scp[8];
    float d;
};

inline void q6k_unpack(const BlockQ6_K& B, const __m512i& sh_lo, const __m512i& sh_hi, Q6kUnpacked* u) {
    for (int h = 0; h < 2; ++h) {
        __m512i lo, hi;
        q6k_half(B, h, sh_lo, sh_hi, &lo, &hi);
        _mm512_store_si512(u->vals + 32 * h, lo);
        _mm512_store_si512(u->vals + 32 * h + 16, hi);
    }
    const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(B.scales));
    _mm512_store_si512(u->sc32, _mm512_cvtepi8_epi32(sc8));
    _mm256_store_si256(reinterpret_cast<__m256i*>(u->scp), _mm256_cvtepi8_epi16(sc8));
    u->d = h2f(B.d);
}

// Rows r .. r + R - 1 of a Q6_K lane tile, as q45k_tile_rows.
template <int L, int R>
inline __attribute__((always_inline)) void q6k_tile_rows(const char* w, size_t w_stride, int64_t nb, const XKL<L>* x,
                                                         int n, float* y, size_t ldy, int64_t r, uintptr_t pf_last,
                                                         const __m512i& sh_lo, const __m512i& sh_hi) {
    using V = Lanes<L>;
    const BlockQ6_K* wr[R];
    RowPrefetch pf[R];
    typename V::F s[R];
    for (int j = 0; j < R; ++j) {
        wr[j] = reinterpret_cast<const BlockQ6_K*>(w + static_cast<size_t>(r + j) * w_stride);
        pf[j] =
            row_prefetch(reinterpret_cast<const uint8_t*>(wr[j]), static_cast<size_t>(nb) * sizeof(BlockQ6_K), pf_last);
        s[j] = V::fzero();
    }
    // Rows follow each other: where the last one's lines stay inside, all do.
    auto run = [&](auto pick) __attribute__((always_inline)) {
        for (int64_t b = 0; b < nb; ++b) {
            const XKL<L>& X = x[b];
            Q6kUnpacked u[R];
            for (int j = 0; j < R; ++j) {
                if constexpr (L == 8) prefetch_block(&wr[j][b], sizeof(BlockQ6_K), pick(j));
                q6k_unpack(wr[j][b], sh_lo, sh_hi, &u[j]);
            }
            read_back(u[0].vals);
            typename V::I tot[R];
            for (int j = 0; j < R; ++j) tot[j] = V::zero();
            for (int g = 0; g < 16; ++g) {  // groups of 16 values: dwords 4g .. 4g + 3
                const typename V::I x0 = V::load(X.q[4 * g]), x1 = V::load(X.q[4 * g + 1]);
                const typename V::I x2 = V::load(X.q[4 * g + 2]), x3 = V::load(X.q[4 * g + 3]);
                for (int j = 0; j < R; ++j) {
                    typename V::I a0 = V::dpbusd(V::zero(), V::set1(u[j].vals[4 * g]), x0);
                    typename V::I a1 = V::dpbusd(V::zero(), V::set1(u[j].vals[4 * g + 1]), x1);
                    a0 = V::dpbusd(a0, V::set1(u[j].vals[4 * g + 2]), x2);
                    a1 = V::dpbusd(a1, V::set1(u[j].vals[4 * g + 3]), x3);
                    tot[j] = V::add(tot[j], V::mullo(V::add(a0, a1), V::set1(u[j].sc32[g])));
                }
            }
            const typename V::F xd = V::fload(X.d);
            for (int j = 0; j < R; ++j) {
                typename V::I corr = V::madd(V::load(X.bs[0]), V::set1(u[j].scp[0]));
                for (int i = 1; i < 8; ++i) corr = V::add(corr, V::madd(V::load(X.bs[i]), V::set1(u[j].scp[i])));
                const typename V::I sumi = V::sub(tot[j], V::slli5(corr));
                const typename V::F d = V::fmul(V::fset1(u[j].d), xd);
                s[j] = V::fadd(s[j], V::fmul(d, V::cvt(sumi)));
            }
        }
    };
    if constexpr (L == 8) {
        if (pf[R - 1].l2 != 0) {
            run([](int) { return PfAhead{}; });
        } else {
            run([&](int j) { return pf[j]; });
        }
    } else {
        run([&](int j) { return pf[j]; });
    }
    for (int j = 0; j < R; ++j) store_tokens<L>(s[j], n, y, ldy, r + j);
}

template <int L>
__attribute__((noinline)) void q6k_tiles_l(const char* w, size_t w_stride, int64_t nb, const XKL<L>* x, int n, float* y,
                                           size_t ldy, int64_t r0, int64_t r1, uintptr_t pf_last) {
    const __m512i sh_lo = idx_halves(4, 2), sh_hi = idx_halves(0, 2);  // as q6k_rows_t1
    int64_t r = r0;
    for (; r + 2 <= r1; r += 2) q6k_tile_rows<L, 2>(w, w_stride, nb, x, n, y, ldy, r, pf_last, sh_lo, sh_hi);
    for (; r < r1; ++r) q6k_tile_rows<L, 1>(w, w_stride, nb, x, n, y, ldy, r, pf_last, sh_lo, sh_hi);
}

template <int T>
void k_tiles(DType t, const char* w, size_t w_stride, int64_t nb, const BlockQ8_K* const* xr, float* y, size_t ldy,
             int64_t r0, int64_t r1, uintptr_t pf_last) {
    if (t == DType::Q4_K) {
        q45k_tiles<BlockQ4_K, T>(w, w_stride, nb, xr, y, ldy, r0, r1, pf_last);
    } else if (t == DType::Q5_K) {
        q45k_tiles<BlockQ5_K, T>(w, w_stride, nb, xr, y, ldy, r0, r1, pf_last);
    } else {
        q6k_tiles<T>(w, w_stride, nb, xr, y, ldy, r0, r1, pf_last);
    }
}

// Passes of several tokens (see matmul); weights in row blocks that stay in L2
// across the tiles of a long pass.
void matmul_k_tiles(DType t, const void* w, size_t w_stride, int64_t n_in, const void* xq, size_t xq_stride, int n_tok,
                    float* y, size_t ldy, int64_t r0, int64_t r1) {
    constexpr int kT = 8;
    const int64_t nb = n_in / kQKK;
    const char* wb = static_cast<const char*>(w);
    const char* xb = static_cast<const char*>(xq);
    const int64_t rb = n_tok <= kT ? r1 - r0 : row_block(w_stride);
    // A pass of up to 8 tokens streams the rows from memory once: prefetch them.
    const uintptr_t pf_last =
        n_tok <= kT && r1 > r0 ? reinterpret_cast<uintptr_t>(wb + static_cast<size_t>(r1) * w_stride) - 1 : 0;
    if (pf_last != 0) {
        prefetch_start(reinterpret_cast<const uint8_t*>(wb + static_cast<size_t>(r0) * w_stride), pf_last);
    }
    // The pass in lane tiles: 16 tokens to a zmm tile while 16 remain, then
    // 8-lane (ymm) tiles of 6-8 tokens; the last 1-5 tokens run k_tiles. (A
    // lane tile costs the same whatever its tokens: on the Llama-3-8B Q4_K
    // slice, 2 threads, a pass of 8 sequences took 78 ms in one, 4 took 55 ms
    // in k_tiles<4> and 77 ms in a lane tile.)
    struct LaneTile {
        int t0, n, lanes;
        size_t at;  // offset of its activations in the scratch
    };
    std::vector<LaneTile> lt;
    int t_rest = 0;
    size_t bytes = 0;
    while (n_tok - t_rest >= 6) {
        const int lanes = n_tok - t_rest >= 16 ? 16 : 8;
        const int n = std::min(lanes, n_tok - t_rest);
        lt.push_back({t_rest, n, lanes, bytes});
        bytes += static_cast<size_t>(nb) * (lanes == 16 ? sizeof(XKL<16>) : sizeof(XKL<8>));
        t_rest += n;
    }
    const int n_lt = static_cast<int>(lt.size());
    Scratch scratch(bytes);
    for (int i = 0; i < n_lt; ++i) {
        const BlockQ8_K* xr[16];
        for (int j = 0; j < lt[i].n; ++j)
            xr[j] = reinterpret_cast<const BlockQ8_K*>(xb + static_cast<size_t>(lt[i].t0 + j) * xq_stride);
        if (lt[i].lanes == 16) {
            repack_xkl<16>(t != DType::Q6_K, xr, lt[i].n, nb, reinterpret_cast<XKL<16>*>(scratch.data() + lt[i].at));
        } else {
            repack_xkl<8>(t != DType::Q6_K, xr, lt[i].n, nb, reinterpret_cast<XKL<8>*>(scratch.data() + lt[i].at));
        }
    }
    for (int64_t b0 = r0; b0 < r1; b0 += rb) {
        const int64_t b1 = std::min(r1, b0 + rb);
        for (int i = 0; i < n_lt; ++i) {
            const LaneTile& L = lt[i];
            float* yt = y + static_cast<size_t>(L.t0) * ldy;
            if (L.lanes == 16) {
                const XKL<16>* xt = reinterpret_cast<const XKL<16>*>(scratch.data() + L.at);
                switch (t) {
                    case DType::Q4_K:
                        q45k_tiles_l<BlockQ4_K, 16>(wb, w_stride, nb, xt, L.n, yt, ldy, b0, b1, pf_last);
                        break;
                    case DType::Q5_K:
                        q45k_tiles_l<BlockQ5_K, 16>(wb, w_stride, nb, xt, L.n, yt, ldy, b0, b1, pf_last);
                        break;
                    default: q6k_tiles_l<16>(wb, w_stride, nb, xt, L.n, yt, ldy, b0, b1, pf_last); break;
                }
            } else {
                const XKL<8>* xt = reinterpret_cast<const XKL<8>*>(scratch.data() + L.at);
                switch (t) {
                    case DType::Q4_K:
                        q45k_tiles_l<BlockQ4_K, 8>(wb, w_stride, nb, xt, L.n, yt, ldy, b0, b1, pf_last);
                        break;
                    case DType::Q5_K:
                        q45k_tiles_l<BlockQ5_K, 8>(wb, w_stride, nb, xt, L.n, yt, ldy, b0, b1, pf_last);
                        break;
                    default: q6k_tiles_l<8>(wb, w_stride, nb, xt, L.n, yt, ldy, b0, b1, pf_last); break;
                }
            }
        }
        for (int t0 = t_rest; t0 < n_tok; t0 += kT) {
            const BlockQ8_K* xr[kT];
            for (int j = 0; j < kT; ++j) {
                xr[j] = reinterpret_cast<const BlockQ8_K*>(xb + static_cast<size_t>(std::min(t0 + j, n_tok - 1)) *
                                                                    xq_stride);
            }
            float* yt = y + static_cast<size_t>(t0) * ldy;
            switch (std::min(kT, n_tok - t0)) {
                case 8: k_tiles<8>(t, wb, w_stride, nb, xr, yt, ldy, b0, b1, pf_last); break;
                case 7: k_tiles<7>(t, wb, w_stride, nb, xr, yt, ldy, b0, b1, pf_last); break;
                case 6: k_tiles<6>(t, wb, w_stride, nb, xr, yt, ldy, b0, b1, pf_last); break;
                case 5: k_tiles<5>(t, wb, w_stride, nb, xr, yt, ldy, b0, b1, pf_last); break;
                case 4: k_tiles<4>(t, wb, w_stride, nb, xr, yt, ldy, b0, b1, pf_last); break;
                case 3: k_tiles<3>(t, wb, w_stride, nb, xr, yt, ldy, b0, b1, pf_last); break;
                case 2: k_tiles<2>(t, wb, w_stride, nb, xr, yt, ldy, b0, b1, pf_last); break;
                default: k_tiles<1>(t, wb, w_stride, nb, xr, yt, ldy, b0, b1, pf_last); break;
            }
        }
    }
}

// Passes of 2 or 3 tokens run the one-token layout's kernels with a row's sums
// for all the tokens at once (q4_rows, q8_rows): their work per row is less
// than a tile's transposition, tail gathering and hsum8 for so few tokens,
// which measured 1.2-1.3x slower there in the model's passes (weights streamed
// from memory, Zen 4). All three give the same bits.
constexpr int kFewTokens = 3;

template <int T>
void few_tokens(DType t, const char* wb, size_t w_stride, int64_t nb, const uint8_t* xp, size_t tok_bytes, float* y,
                size_t ldy, int64_t r0, int64_t r1, uintptr_t pf_last) {
    switch (t) {
        case DType::Q4_1: q4_rows<DType::Q4_1, T>(wb, w_stride, nb, xp, tok_bytes, y, ldy, r0, r1, pf_last); return;
        case DType::Q4_0: q4_rows<DType::Q4_0, T>(wb, w_stride, nb, xp, tok_bytes, y, ldy, r0, r1, pf_last); return;
        default: q8_rows<T>(wb, w_stride, nb, xp, tok_bytes, y, ldy, r0, r1, pf_last); return;
    }
}

void matmul_q32(DType t, const void* w, size_t w_stride, int64_t n_in, const void* xq, size_t xq_stride, int n_tok,
                float* y, size_t ldy, int64_t r0, int64_t r1) {
    if (n_tok > kFewTokens) {
        switch (t) {
            case DType::Q4_1:
                matmul_tiles<DType::Q4_1>(w, w_stride, n_in, xq, xq_stride, n_tok, y, ldy, r0, r1);
                return;
            case DType::Q4_0:
                matmul_tiles<DType::Q4_0>(w, w_stride, n_in, xq, xq_stride, n_tok, y, ldy, r0, r1);
                return;
            default: matmul_tiles<DType::Q8_0>(w, w_stride, n_in, xq, xq_stride, n_tok, y, ldy, r0, r1); return;
        }
    }
    // Up to kFewTokens: one pass over the rows, whose weights come from memory; prefetch them.
    const int64_t nb = n_in / kQK;
    const char* wb = static_cast<const char*>(w);
    const uintptr_t pf_last = r1 > r0 ? reinterpret_cast<uintptr_t>(wb + static_cast<size_t>(r1) * w_stride) - 1 : 0;
    if (pf_last != 0) {
        prefetch_start(reinterpret_cast<const uint8_t*>(wb + static_cast<size_t>(r0) * w_stride), pf_last);
    }
    const size_t tok_bytes = t == DType::Q8_0 ? q8_token_bytes(nb) : q4_token_bytes(nb);
    Scratch scratch(static_cast<size_t>(n_tok) * tok_bytes);
    uint8_t* xp = scratch.data();
    for (int j = 0; j < n_tok; ++j) {
        const void* xr = static_cast<const char*>(xq) + static_cast<size_t>(j) * xq_stride;
        uint8_t* out = xp + static_cast<size_t>(j) * tok_bytes;
        switch (t) {
            case DType::Q4_1: repack_q4<DType::Q4_1>(xr, nb, out); break;
            case DType::Q4_0: repack_q4<DType::Q4_0>(xr, nb, out); break;
            default: repack_q8(xr, nb, out); break;
        }
    }
    switch (n_tok) {
        case 3: few_tokens<3>(t, wb, w_stride, nb, xp, tok_bytes, y, ldy, r0, r1, pf_last); return;
        case 2: few_tokens<2>(t, wb, w_stride, nb, xp, tok_bytes, y, ldy, r0, r1, pf_last); return;
        default: break;
    }
    switch (t) {
        case DType::Q4_1: q4_rows_t1<DType::Q4_1>(wb, w_stride, nb, xp, y, r0, r1, pf_last); return;
        case DType::Q4_0: q4_rows_t1<DType::Q4_0>(wb, w_stride, nb, xp, y, r0, r1, pf_last); return;
        default: q8_rows_t1(wb, w_stride, nb, xp, y, r0, r1, pf_last); return;
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
                y[b].d = f2h(d);
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
                y[b].d = f2h(d);
                y[b].s = f2h(d * static_cast<float>(sum));
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
        case DType::Q5_0: matmul_q5<DType::Q5_0>(w, w_stride, n_in, xq, xq_stride, n_tok, y, ldy, r0, r1); return;
        case DType::Q5_1: matmul_q5<DType::Q5_1>(w, w_stride, n_in, xq, xq_stride, n_tok, y, ldy, r0, r1); return;
        case DType::Q4_K:
        case DType::Q5_K:
        case DType::Q6_K:
            // Every level gives the scalar level's bits, so the fastest is taken:
            // rows streaming the weights once for 1-3 tokens, tiles beyond.
            if (n_tok == 1) {
                matmul_k_t1(wtype, w, w_stride, n_in, xq, y, r0, r1);
            } else if (n_tok <= 3) {
                matmul_k_tn(wtype, w, w_stride, n_in, xq, xq_stride, n_tok, y, ldy, r0, r1);
            } else {
                matmul_k_tiles(wtype, w, w_stride, n_in, xq, xq_stride, n_tok, y, ldy, r0, r1);
            }
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
    const float ss = hsum(_mm512_add_ps(a0, a1));
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
    const __m512 inv = _mm512_set1_ps(1.0f / hsum(sv));
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = tail_mask(n - i);
        _mm512_mask_storeu_ps(x + i, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, x + i), inv));
    }
}

namespace {

// The attention helpers of both KV kinds (f16; int8 / fp8 bytes) over one loop each.
// load(e, mask) gives up to 16 values of a row from element e as floats (masked
// lanes 0).

// sum_i a[i] * row[i]: two accumulators of 16, the tail masked.
template <class Load>
float dot_row(const float* a, int64_t n, Load load) {
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), load(i, __mmask16{0xFFFF}), s0);
        s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), load(i + 16, __mmask16{0xFFFF}), s1);
    }
    for (; i < n; i += 16) {
        const __mmask16 k = tail_mask(n - i);
        s0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, a + i), load(i, k), s0);
    }
    return hsum(_mm512_add_ps(s0, s1));
}

// dot_row of a with each of n rows (load(j, e, mask) reads row j), 16 rows at a time:
// each row's two accumulators as dot_row's, their horizontal sums in one hsum16 (lane
// j = hsum of row j's, bit for bit), then post(j0, sums) gives the values stored at
// out[j0 .. j0 + 16). A key's score is what dot_row gives it alone, whichever other
// keys share its 16: one hsum16 instead of 16 hsums (attention scores were 19% of a
// 512-token prompt on one Zen 4 core, most of it the per-key horizontal sum).
// NQ > 0: n_in == 32 * NQ, a's chunks held in registers across the rows (the common
// head sizes, 64 and 128: the loop is then the same arithmetic without a's loads).
template <int NQ, class Load, class Post>
void dot_rows(const float* a, int64_t n_in, int64_t n, Load load, Post post, float* out) {
    __m512 acc[16];
    __m512 qa[2 * (NQ > 0 ? NQ : 1)];
    if constexpr (NQ > 0)
        for (int c = 0; c < 2 * NQ; ++c) qa[c] = _mm512_loadu_ps(a + 16 * c);
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
        const int64_t m = std::min<int64_t>(16, n - j0);
        if constexpr (NQ > 0) {
            for (int64_t j = 0; j < m; ++j) {
                __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
                for (int c = 0; c < NQ; ++c) {
                    s0 = _mm512_fmadd_ps(qa[2 * c], load(j0 + j, 32 * c, __mmask16{0xFFFF}), s0);
                    s1 = _mm512_fmadd_ps(qa[2 * c + 1], load(j0 + j, 32 * c + 16, __mmask16{0xFFFF}), s1);
                }
                acc[j] = _mm512_add_ps(s0, s1);
            }
            for (int64_t j = m; j < 16; ++j) acc[j] = _mm512_setzero_ps();
            _mm512_mask_storeu_ps(out + j0, tail_mask(m), post(j0, hsum16(acc)));
            continue;
        }
        for (int64_t j = 0; j < m; ++j) {
            __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
            int64_t i = 0;
            for (; i + 32 <= n_in; i += 32) {
                s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), load(j0 + j, i, __mmask16{0xFFFF}), s0);
                s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), load(j0 + j, i + 16, __mmask16{0xFFFF}), s1);
            }
            for (; i < n_in; i += 16) {
                const __mmask16 k = tail_mask(n_in - i);
                s0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, a + i), load(j0 + j, i, k), s0);
            }
            acc[j] = _mm512_add_ps(s0, s1);
        }
        for (int64_t j = m; j < 16; ++j) acc[j] = _mm512_setzero_ps();
        _mm512_mask_storeu_ps(out + j0, tail_mask(m), post(j0, hsum16(acc)));
    }
}

// out += coef(j) * row j for j = 0, 1, ..., n - 1 in order (load(j, e, mask) reads
// row j); out stays in registers across the rows, 64 values at a time; each element
// sees the same fma sequence as one axpy per row.
template <class Coef, class Load>
void accum_rows(int64_t n, int64_t head_dim, float* out, Coef coef, Load load) {
    for (int64_t i = 0; i < head_dim; i += 64) {
        __mmask16 km[4];
        __m512 o[4];
        for (int c = 0; c < 4; ++c) {
            km[c] = i + 16 * c < head_dim ? tail_mask(head_dim - i - 16 * c) : __mmask16{0};
            o[c] = _mm512_maskz_loadu_ps(km[c], out + i + 16 * c);
        }
        for (int64_t j = 0; j < n; ++j) {
            const __m512 a = _mm512_set1_ps(coef(j));
            for (int c = 0; c < 4; ++c) o[c] = _mm512_fmadd_ps(a, load(j, i + 16 * c, km[c]), o[c]);
        }
        for (int c = 0; c < 4; ++c) _mm512_mask_storeu_ps(out + i + 16 * c, km[c], o[c]);
    }
}

inline __m512 load16_f16(const uint16_t* p, __mmask16 k) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, p)); }

// Up to 16 quantized KV values (mask k) as floats (unscaled; masked lanes 0). e4m3
// through f16 as in avx2.cpp's load8_kv (exact, but for the NaN byte).
inline __m512 load16_kv(KvQuant t, const uint8_t* p, __mmask16 k) {
    const __m128i b = _mm_maskz_loadu_epi8(k, p);
    if (t == KvQuant::Int8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
    const __m256i w = _mm256_cvtepu8_epi16(b);
    const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8),
                                      _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7F)), 7));
    return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
}

}  // namespace

float dot_f32_f16(const float* a, const uint16_t* b, int64_t n) {
    return dot_row(a, n, [&](int64_t e, __mmask16 k) { return load16_f16(b + e, k); });
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

// scale * dot_f32_f16 per key: the same products and sums (dot_rows), and the same
// float product scale * sum, lane by lane.
void attn_scores_f16(const float* q, const uint16_t* k, size_t stride, int64_t n, int64_t head_dim, float scale,
                     float* scores) {
    const __m512 sv = _mm512_set1_ps(scale);
    const auto load = [&](int64_t j, int64_t e, __mmask16 m) {
        return load16_f16(k + static_cast<size_t>(j) * stride + e, m);
    };
    const auto post = [&](int64_t, __m512 h) { return _mm512_mul_ps(sv, h); };
    if (head_dim == 64) return dot_rows<2>(q, head_dim, n, load, post, scores);
    if (head_dim == 128) return dot_rows<4>(q, head_dim, n, load, post, scores);
    dot_rows<0>(q, head_dim, n, load, post, scores);
}

// Each element sees the same fma sequence as axpy_f16.
void attn_accum_f16(const float* p, const uint16_t* v, size_t stride, int64_t n, int64_t head_dim, float* out) {
    accum_rows(n, head_dim, out, [&](int64_t j) { return p[j]; },
               [&](int64_t j, int64_t e, __mmask16 k) { return load16_f16(v + static_cast<size_t>(j) * stride + e, k); });
}

// scale * (k_scale[j] * dot_row(q, k_j)) per key, lane by lane (dot_rows).
// A span's rows over one KV block: its first n_max keys (or values) converted to f32
// once (cvtph is exact) into kf, a row of `pitch` floats each; the rows then compute
// from kf with the same masked loads giving the same values, so each row's bits are
// those of the one-row kernel. Small blocks only (up to 16 rows of at most 256).
namespace {
constexpr int64_t kRowsKeys = 16, kRowsDim = 256;
int64_t block_rows(int64_t rows, const int64_t* n) {
    int64_t m = 0;
    for (int64_t r = 0; r < rows; ++r) m = std::max(m, n[r]);
    return m;
}
void to_f32(const uint16_t* k, size_t stride, int64_t n, int64_t head_dim, int64_t pitch, float* kf) {
    for (int64_t j = 0; j < n; ++j)
        for (int64_t e = 0; e < head_dim; e += 16)
            _mm512_storeu_ps(kf + j * pitch + e,
                             load16_f16(k + static_cast<size_t>(j) * stride + e, tail_mask(head_dim - e)));
}
}  // namespace

void attn_scores_f16_rows(const float* q, size_t q_stride, size_t q_head, int64_t heads, int64_t rows, const int64_t* n,
                          const uint16_t* k, size_t stride, int64_t head_dim, float scale, float* scores,
                          size_t s_stride) {
    const int64_t n_max = block_rows(rows, n);
    const int64_t pairs = heads * rows;  // pair i: head i / rows, row i % rows
    auto q_of = [&](int64_t i) { return q + (i / rows) * q_head + (i % rows) * q_stride; };
    if (pairs < 2 || n_max > kRowsKeys || head_dim > kRowsDim) {
        for (int64_t i = 0; i < pairs; ++i)
            if (n[i % rows] > 0)
                attn_scores_f16(q_of(i), k, stride, n[i % rows], head_dim, scale, scores + i * s_stride);
        return;
    }
    alignas(64) float kf[kRowsKeys * kRowsDim];
    const int64_t pitch = (head_dim + 15) / 16 * 16;
    to_f32(k, stride, n_max, head_dim, pitch, kf);
    const __m512 sv = _mm512_set1_ps(scale);
    const auto load = [&](int64_t j, int64_t e, __mmask16 m) { return _mm512_maskz_loadu_ps(m, kf + j * pitch + e); };
    const auto post = [&](int64_t, __m512 h) { return _mm512_mul_ps(sv, h); };
    for (int64_t i = 0; i < pairs; ++i) {
        const int64_t nr = n[i % rows];
        if (nr <= 0) continue;
        const float* qr = q_of(i);
        float* sr = scores + i * s_stride;
        if (head_dim == 64)
            dot_rows<2>(qr, head_dim, nr, load, post, sr);
        else if (head_dim == 128)
            dot_rows<4>(qr, head_dim, nr, load, post, sr);
        else
            dot_rows<0>(qr, head_dim, nr, load, post, sr);
    }
}

namespace {
// M (head, row) pairs' value sums over one converted block of 64-wide values (vf,
// rows `pitch` floats apart), their fma chains interleaved: pair t's out[e] =
// fma(p_t[j], v_j[e], out[e]) for j = 0 .. n_t - 1 in order, as accum_rows gives it.
template <int M>
void accum_pairs64(const float* const* p, const int64_t* n, float* const* out, const float* vf, int64_t pitch) {
    __m512 o[M][4];
    int64_t jmax = 0;
    for (int t = 0; t < M; ++t) {
        for (int c = 0; c < 4; ++c) o[t][c] = _mm512_loadu_ps(out[t] + 16 * c);
        jmax = std::max(jmax, n[t]);
    }
    for (int64_t j = 0; j < jmax; ++j) {
        const float* vr = vf + j * pitch;
        const __m512 v0 = _mm512_load_ps(vr), v1 = _mm512_load_ps(vr + 16), v2 = _mm512_load_ps(vr + 32),
                     v3 = _mm512_load_ps(vr + 48);
        for (int t = 0; t < M; ++t) {
            if (j >= n[t]) continue;
            const __m512 a = _mm512_set1_ps(p[t][j]);
            o[t][0] = _mm512_fmadd_ps(a, v0, o[t][0]);
            o[t][1] = _mm512_fmadd_ps(a, v1, o[t][1]);
            o[t][2] = _mm512_fmadd_ps(a, v2, o[t][2]);
            o[t][3] = _mm512_fmadd_ps(a, v3, o[t][3]);
        }
    }
    for (int t = 0; t < M; ++t)
        for (int c = 0; c < 4; ++c) _mm512_storeu_ps(out[t] + 16 * c, o[t][c]);
}
}  // namespace

void attn_accum_f16_rows(const float* p, size_t p_stride, int64_t heads, int64_t rows, const int64_t* n,
                         const uint16_t* v, size_t stride, int64_t head_dim, float* out, size_t out_stride,
                         size_t out_head) {
    const int64_t n_max = block_rows(rows, n);
    const int64_t pairs = heads * rows;  // pair i: head i / rows, row i % rows
    auto out_of = [&](int64_t i) { return out + (i / rows) * out_head + (i % rows) * out_stride; };
    if (pairs < 2 || n_max > kRowsKeys || head_dim > kRowsDim) {
        for (int64_t i = 0; i < pairs; ++i)
            if (n[i % rows] > 0) attn_accum_f16(p + i * p_stride, v, stride, n[i % rows], head_dim, out_of(i));
        return;
    }
    alignas(64) float vf[kRowsKeys * kRowsDim];
    const int64_t pitch = (head_dim + 15) / 16 * 16;
    to_f32(v, stride, n_max, head_dim, pitch, vf);
    if (head_dim == 64) {
        // Three pairs at a time: twelve independent chains hide the fma latency that
        // bounds one pair's four.
        const float* pp[3];
        int64_t nn[3];
        float* oo[3];
        int m = 0;
        for (int64_t i = 0; i < pairs; ++i) {
            if (n[i % rows] <= 0) continue;
            pp[m] = p + i * p_stride;
            nn[m] = n[i % rows];
            oo[m] = out_of(i);
            if (++m == 3) {
                accum_pairs64<3>(pp, nn, oo, vf, pitch);
                m = 0;
            }
        }
        if (m == 2) accum_pairs64<2>(pp, nn, oo, vf, pitch);
        if (m == 1) accum_pairs64<1>(pp, nn, oo, vf, pitch);
        return;
    }
    for (int64_t i = 0; i < pairs; ++i) {
        const int64_t nr = n[i % rows];
        if (nr <= 0) continue;
        const float* pr = p + i * p_stride;
        accum_rows(
            nr, head_dim, out_of(i), [&](int64_t j) { return pr[j]; },
            [&](int64_t j, int64_t e, __mmask16 m) { return _mm512_maskz_loadu_ps(m, vf + j * pitch + e); });
    }
}

void attn_scores_q(KvQuant t, const float* q, const uint8_t* k, const float* k_scale, size_t stride, int64_t n,
                   int64_t head_dim, float scale, float* scores) {
    const __m512 sv = _mm512_set1_ps(scale);
    const auto load = [&](int64_t j, int64_t e, __mmask16 m) {
        return load16_kv(t, k + static_cast<size_t>(j) * stride + e, m);
    };
    const auto post = [&](int64_t j0, __m512 h) {
        return _mm512_mul_ps(sv, _mm512_mul_ps(_mm512_maskz_loadu_ps(tail_mask(n - j0), k_scale + j0), h));
    };
    if (head_dim == 64) return dot_rows<2>(q, head_dim, n, load, post, scores);
    if (head_dim == 128) return dot_rows<4>(q, head_dim, n, load, post, scores);
    dot_rows<0>(q, head_dim, n, load, post, scores);
}

void attn_accum_q(KvQuant t, const float* p, const uint8_t* v, const float* v_scale, size_t stride, int64_t n,
                  int64_t head_dim, float* out) {
    accum_rows(n, head_dim, out, [&](int64_t j) { return p[j] * v_scale[j]; },
               [&](int64_t j, int64_t e, __mmask16 m) { return load16_kv(t, v + static_cast<size_t>(j) * stride + e, m); });
}

uint64_t read_fold(const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    size_t i = 0;
    for (; i + 256 <= n; i += 256) {
        a0 = _mm512_xor_si512(a0, _mm512_loadu_si512(b + i));
        a1 = _mm512_xor_si512(a1, _mm512_loadu_si512(b + i + 64));
        a2 = _mm512_xor_si512(a2, _mm512_loadu_si512(b + i + 128));
        a3 = _mm512_xor_si512(a3, _mm512_loadu_si512(b + i + 192));
    }
    __m512i a = _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3));
    alignas(64) uint64_t lanes[8];
    _mm512_store_si512(lanes, a);
    uint64_t r = 0;
    for (uint64_t l : lanes) r ^= l;
    for (; i < n; ++i) r ^= b[i];
    return r;
}

void round_fp16(float* x, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m256i h = _mm512_cvtps_ph(_mm512_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT);
        _mm512_storeu_ps(x + i, _mm512_cvtph_ps(h));
    }
    if (i < n) {
        const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1);
        const __m256i h = _mm512_cvtps_ph(_mm512_maskz_loadu_ps(m, x + i), _MM_FROUND_TO_NEAREST_INT);
        _mm512_mask_storeu_ps(x + i, m, _mm512_cvtph_ps(h));
    }
}

}  // namespace duet::cpu::avx512
