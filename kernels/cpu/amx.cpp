// AMX (Intel's tile unit, AMX-TILE + AMX-INT8) for the AVX-512 level's quantized
// products: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants (see "Q4_K / Q5_K" and
// "Q6_K" below) against 16 tokens at a time. It gives avx512::matmul's bits
// exactly, so Isa::Amx is the AVX-512 level with a faster way to its numbers,
// never a level of its own numbers: any row or token the tiles do not cover goes
// to avx512::matmul, and a sequence's logits do not depend on which of the two
// computed a row.
//
// Why that holds. avx512.cpp's reduction for one (row, token) is, per 32-value
// block b, the exact integer dot S_b, then per "lane" l of a 16-lane accumulator
// (lane l takes block 16c + q4_lane_block(l) of each chunk c, or q8_lane_block(l)
// for Q8_0), in chunk order:
//   acc_l = fma(float(S_b), d_w * d_x, acc_l)          [Q4_1, Q5_1: then
//   acc_l = fma(m_w, s_x, acc_l)]
// and the result is hsum(acc) (the pinned tree l + l+8, + 4, + 2, + 1), plus
// (v_0 + v_1) for a Q4-family row ending in one or two blocks past its chunks
// (a "short tail": v_t = float(S_t) * (d_w * d_x) [, then fma(m_w, s_x, .)]).
// Every float operation there is per lane, so it does not care where the
// accumulator lives: here acc_l of 16 rows x 16 tokens sits in 16 registers,
// one per row, a lane per token, and TDPBSSD gives the S_b of the 16 x 16 at
// once (C[row][token], K = 32: one block; exact int32 sums). The same
// operations in the same order, with d_w broadcast and d_x a vector, then the
// tree across the 16 lanes' accumulators, elementwise.
//
// Blocks missing from a partial last chunk (3-15 blocks) are zeros there: their
// step adds fma(0, 0, acc) = acc (acc is never -0: it starts at +0 and an exact
// sum that is zero rounds to +0), so here they are skipped. Q8_0 rows with a
// partial chunk are not taken (avx512 reduces that chunk per pair of 4-value
// sums, not per block): their calls run avx512::matmul.
//
// Operands: A = the weights, 16 rows x 32 bytes of one block (Q8_0: straight from
// the row, stride w_stride; the 4- and 5-bit types: unpacked once per strip of 16
// rows into signed bytes, the offset 8 / 16 subtracted); B = the activations of
// 16 tokens, 8 rows of 64 bytes (token m's bytes 4r..4r+3 at row r, column 4m),
// transposed once per call; C = 16 x 16 int32, stored and read back as vectors.
//
// What bounds it (Intel Xeon, 2026-12-07): a TDPBSSD and the store of its C take
// about 5 ns each, and the float steps of a block (16 x cvt, mul, fma) about as
// long again; the tile unit and the vector units did not overlap in a
// microbenchmark (tile work, then 64 float steps: the sum of the two alone), so
// neither 2 x 2 tile blocking (C of two strips x two token tiles per loaded A and
// B) nor issuing block k + 1's tiles before block k's float steps changed the
// time; both were tried and dropped.
#include "kernels/cpu/immintrin_avx512.h"

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <type_traits>

#include "kernels/cpu/kernels_impl.h"

namespace duet::cpu::amx {

namespace {

inline float h2f(uint16_t h) { return _cvtsh_ss(h); }

// Lane i = i * stride: the offsets of 16 consecutive rows, for gathers.
inline __m512i lane_offsets(size_t stride) {
    return _mm512_mullo_epi32(_mm512_set1_epi32(static_cast<int32_t>(stride)),
                              _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
}

// A Q8_K super-block's quants of 16 tokens (rows at idx from blk) as 64 rows of 64
// bytes, row r holding each token's bytes 4r .. 4r + 3 (token m at 4m): the B
// tiles of Q4_K / Q5_K's sub-blocks (8 rows each) and of Q6_K's groups (4 each).
inline void gather_q8k_quants(const uint8_t* blk, const __m512i& idx, uint8_t* out) {
    for (int r = 0; r < 64; ++r) {
        _mm512_store_si512(out + 64 * r, _mm512_i32gather_epi32(idx, blk + offsetof(BlockQ8_K, qs) + 4 * r, 1));
    }
}

template <DType W>
constexpr bool kWithMin = W == DType::Q4_1 || W == DType::Q5_1;
template <DType W>
constexpr bool kQ5 = W == DType::Q5_0 || W == DType::Q5_1;
template <DType W>
constexpr int kBlockBytes = W == DType::Q4_0   ? 18
                            : W == DType::Q4_1 ? 20
                            : W == DType::Q5_0 ? 22
                            : W == DType::Q5_1 ? 24
                                               : 34;
// The activations' block: Q8_1 (d, s, 32 quants) for weights with a minimum, else Q8_0.
template <DType W>
constexpr int kXBlockBytes = kWithMin<W> ? 36 : 34;

// The tile palette: tmm0-1 C (16 x 16 int32), tmm2-3 A (16 rows x 32 bytes),
// tmm4-5 B (8 rows x 64 bytes); two of each so that two blocks are in flight.
struct alignas(64) TileConfig {
    uint8_t palette = 1;
    uint8_t start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

TileConfig tile_config() {
    TileConfig c;
    for (int t = 0; t < 2; ++t) {
        c.colsb[t] = 64, c.rows[t] = 16;
        c.colsb[2 + t] = 32, c.rows[2 + t] = 16;
        c.colsb[4 + t] = 64, c.rows[4 + t] = 8;
    }
    return c;
}

// Grows, never shrinks; one per thread (the thread pool's workers call matmul
// concurrently). malloc, not std::vector: see kernels_impl.h.
struct ScratchBuf {
    uint8_t* p = nullptr;
    size_t n = 0;
    ~ScratchBuf() { std::free(p); }
    uint8_t* get(size_t want) {
        if (want > n) {
            std::free(p);
            n = (want + 4095) & ~size_t{4095};
            p = static_cast<uint8_t*>(std::aligned_alloc(64, n));
            if (p == nullptr) kernel_fail("matmul (amx): out of memory for scratch");
        }
        return p;
    }
};
thread_local ScratchBuf t_scratch;

// A token tile's activations for one block: B (512 bytes), then d_x and s_x of
// its 16 tokens (zeros for a missing token).
constexpr size_t kXTileBlock = 512 + 64 + 64;
// A strip's weights for one block: A (16 rows x 32 signed bytes), then d_w and m_w
// of its 16 rows.
constexpr size_t kWStripBlock = 512 + 64 + 64;

// Tokens [t0, t0 + 16) of xq into nb blocks of kXTileBlock at out: B's rows by
// gathers (dword r of the 16 tokens' block), the scales as floats.
template <DType W>
void repack_tokens(const uint8_t* xq, size_t xq_stride, int t0, int64_t nb, uint8_t* out) {
    constexpr int kQ = kWithMin<W> ? 4 : 2;  // the quants' offset in an activation block
    const __m512i idx = lane_offsets(xq_stride);
    const uint8_t* x0 = xq + static_cast<size_t>(t0) * xq_stride;
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = x0 + static_cast<size_t>(b) * kXBlockBytes<W>;
        uint8_t* o = out + static_cast<size_t>(b) * kXTileBlock;
        for (int r = 0; r < 8; ++r) {
            _mm512_store_si512(o + 64 * r, _mm512_i32gather_epi32(idx, blk + kQ + 4 * r, 1));
        }
        // d (and Q8_1's s) of each token: the block's first dword.
        const __m512i hdr = _mm512_i32gather_epi32(idx, blk, 1);
        _mm512_store_ps(o + 512, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(hdr)));
        if constexpr (kWithMin<W>) {
            _mm512_store_ps(o + 576, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(hdr, 16))));
        } else {
            _mm512_store_ps(o + 576, _mm512_setzero_ps());
        }
    }
}

// Rows [n0, n0 + 16) of the weights into nb blocks of kWStripBlock at out: the
// values as signed bytes (value i of block b at byte 32n + i), d_w and m_w.
template <DType W>
void unpack_strip(const uint8_t* w, size_t w_stride, int64_t nb, uint8_t* out) {
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const __m256i off = _mm256_set1_epi8(W == DType::Q4_0 ? 8 : W == DType::Q5_0 ? 16 : 0);
    const __m256i b16 = _mm256_set1_epi8(16);
    for (int n = 0; n < 16; ++n) {
        const uint8_t* row = w + static_cast<size_t>(n) * w_stride;
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t* blk = row + static_cast<size_t>(b) * kBlockBytes<W>;
            uint8_t* o = out + static_cast<size_t>(b) * kWStripBlock;
            uint16_t d;
            std::memcpy(&d, blk, 2);
            reinterpret_cast<float*>(o + 512)[n] = h2f(d);
            if constexpr (kWithMin<W>) {
                uint16_t m;
                std::memcpy(&m, blk + 2, 2);
                reinterpret_cast<float*>(o + 576)[n] = h2f(m);
            }
            if constexpr (W == DType::Q8_0) continue;
            constexpr int kQs = W == DType::Q4_0 ? 2 : W == DType::Q4_1 ? 4 : W == DType::Q5_0 ? 6 : 8;
            const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + kQs));
            const __m128i lo = _mm_and_si128(q, m4);
            const __m128i hi = _mm_and_si128(_mm_srli_epi16(q, 4), m4);
            __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
            if constexpr (kQ5<W>) {
                uint32_t qh;
                std::memcpy(&qh, blk + (W == DType::Q5_1 ? 4 : 2), 4);
                v = _mm256_mask_add_epi8(v, static_cast<__mmask32>(qh), v, b16);
            }
            v = _mm256_sub_epi8(v, off);
            _mm256_store_si256(reinterpret_cast<__m256i*>(o + 32 * n), v);
        }
    }
}

// One block's float step for the 16 rows: acc[n] (a lane per token) from the
// stored C (row n: the 16 tokens' S).
template <DType W>
inline void block_step(const int32_t* cs, const uint8_t* wblk, const uint8_t* xblk, __m512* acc) {
    const float* dw = reinterpret_cast<const float*>(wblk + 512);
    const float* mw = reinterpret_cast<const float*>(wblk + 576);
    const __m512 dx = _mm512_load_ps(xblk + 512);
    const __m512 sx = _mm512_load_ps(xblk + 576);
    for (int n = 0; n < 16; ++n) {
        const __m512 s = _mm512_cvtepi32_ps(_mm512_load_si512(cs + 16 * n));
        acc[n] = _mm512_fmadd_ps(s, _mm512_mul_ps(_mm512_set1_ps(dw[n]), dx), acc[n]);
        if constexpr (kWithMin<W>) acc[n] = _mm512_fmadd_ps(_mm512_set1_ps(mw[n]), sx, acc[n]);
    }
}

// Two independent products on tiles 0, 2, 4 and 1, 3, 5: C0 = A0 B0 into c0,
// C1 = A1 B1 into c1 (A's 16 rows at a_stride, B's at 64 bytes).
inline void two_products(const void* a0, const void* a1, size_t a_stride, const void* b0, const void* b1, int32_t* c0,
                         int32_t* c1) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_loadd(2, a0, a_stride);
    _tile_loadd(4, b0, 64);
    _tile_loadd(3, a1, a_stride);
    _tile_loadd(5, b1, 64);
    _tile_dpbssd(0, 2, 4);
    _tile_dpbssd(1, 3, 5);
    _tile_stored(0, c0, 64);
    _tile_stored(1, c1, 64);
}

// A block's A operand: the unpacked strip, or (Q8_0) the rows themselves.
template <DType W>
struct AOperand {
    const uint8_t* strip;  // unpack_strip's output
    const uint8_t* rows;   // Q8_0: row n0
    size_t w_stride;
    const void* ptr(int64_t b) const {
        if constexpr (W == DType::Q8_0) return rows + static_cast<size_t>(b) * 34 + 2;
        return strip + static_cast<size_t>(b) * kWStripBlock;
    }
    size_t stride() const { return W == DType::Q8_0 ? w_stride : 32; }
};

// 16 rows x 16 tokens: out[n] holds row n's results, a lane per token.
// hsum's tree (l + l+8, then + 4, + 2, + 1) read as a binary tree over the lanes
// in this order: adjacent leaves pair up, then adjacent pairs, and so on, each
// sum left + right. Taking the lanes in this order, the sums fold as they come,
// with at most four partial sums waiting.
constexpr int kTreeOrder[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};

// 16 rows x 16 tokens: out[n] holds row n's results, a lane per token. stack:
// 4 x 16 vectors of scratch; cbuf: 2 KiB.
template <DType W>
void tile_16x16(const AOperand<W>& a, const uint8_t* strip, const uint8_t* xt, int64_t nb, __m512* out, int32_t* cbuf,
                __m512* stack) {
    const bool short_tail = W != DType::Q8_0 && (nb % 16 == 1 || nb % 16 == 2);
    // Blocks that go through the chunk lanes: all of them, but a short tail.
    const int64_t nb_chunked = short_tail ? nb - nb % 16 : nb;
    const int64_t nchunks = (nb_chunked + 15) / 16;
    auto wblk = [&](int64_t b) { return strip + static_cast<size_t>(b) * kWStripBlock; };
    auto xblk = [&](int64_t b) { return xt + static_cast<size_t>(b) * kXTileBlock; };
    int level[4];
    int depth = 0;
    for (int i = 0; i < 16; ++i) {
        const int l = kTreeOrder[i];
        const int beta = W == DType::Q8_0 ? q8_lane_block(l) : q4_lane_block(l);
        __m512 acc[16];
        for (int n = 0; n < 16; ++n) acc[n] = _mm512_setzero_ps();
        int64_t c = 0;
        for (; c + 1 < nchunks && 16 * (c + 1) + beta < nb_chunked; c += 2) {
            const int64_t b0 = 16 * c + beta, b1 = b0 + 16;
            two_products(a.ptr(b0), a.ptr(b1), a.stride(), xblk(b0), xblk(b1), cbuf, cbuf + 256);
            block_step<W>(cbuf, wblk(b0), xblk(b0), acc);
            block_step<W>(cbuf + 256, wblk(b1), xblk(b1), acc);
        }
        for (; c < nchunks && 16 * c + beta < nb_chunked; ++c) {
            const int64_t b0 = 16 * c + beta;
            _tile_zero(0);
            _tile_loadd(2, a.ptr(b0), a.stride());
            _tile_loadd(4, xblk(b0), 64);
            _tile_dpbssd(0, 2, 4);
            _tile_stored(0, cbuf, 64);
            block_step<W>(cbuf, wblk(b0), xblk(b0), acc);
        }
        // Fold: while the waiting sum on top is at this one's level, left + right.
        int lev = 0;
        while (depth > 0 && level[depth - 1] == lev) {
            const __m512* left = stack + 16 * (depth - 1);
            for (int n = 0; n < 16; ++n) acc[n] = _mm512_add_ps(left[n], acc[n]);
            --depth;
            ++lev;
        }
        if (i == 15) {
            for (int n = 0; n < 16; ++n) out[n] = acc[n];
            break;
        }
        for (int n = 0; n < 16; ++n) stack[16 * depth + n] = acc[n];
        level[depth++] = lev;
    }
    if (!short_tail) return;
    // v_t = float(S_t) * (d_w * d_x) [, fma(m_w, s_x, .)]; y = h + (v_0 + v_1).
    __m512 v[2][16];
    for (int t = 0; t < 2; ++t) {
        for (int n = 0; n < 16; ++n) v[t][n] = _mm512_setzero_ps();
        const int64_t b = nb_chunked + t;
        if (b >= nb) continue;
        _tile_zero(0);
        _tile_loadd(2, a.ptr(b), a.stride());
        _tile_loadd(4, xblk(b), 64);
        _tile_dpbssd(0, 2, 4);
        _tile_stored(0, cbuf, 64);
        const float* dw = reinterpret_cast<const float*>(wblk(b) + 512);
        const float* mw = reinterpret_cast<const float*>(wblk(b) + 576);
        const __m512 dx = _mm512_load_ps(xblk(b) + 512);
        const __m512 sx = _mm512_load_ps(xblk(b) + 576);
        for (int n = 0; n < 16; ++n) {
            const __m512 s = _mm512_cvtepi32_ps(_mm512_load_si512(cbuf + 16 * n));
            v[t][n] = _mm512_mul_ps(s, _mm512_mul_ps(_mm512_set1_ps(dw[n]), dx));
            if constexpr (kWithMin<W>) v[t][n] = _mm512_fmadd_ps(_mm512_set1_ps(mw[n]), sx, v[t][n]);
        }
    }
    for (int n = 0; n < 16; ++n) out[n] = _mm512_add_ps(out[n], _mm512_add_ps(v[0][n], v[1][n]));
}

// The driver every format shares, over rows [r0, r1) (a multiple of 16) x tokens
// [0, nt) (a multiple of 16): token blocks whose repacked activations stay within
// about 1 MiB (L2), strips of 16 rows unpacked once per token block, and 16 x 16
// tiles whose results (a vector per row, a lane per token) are transposed into y.
// A format F gives: tile_bytes() (a token tile's repacked activations),
// strip_bytes() (a strip's unpacked weights), work_bytes() (its tile function's
// scratch), config() (its tile palette), repack(xq, xq_stride, t0, out),
// unpack(rows, w_stride, strip) and tile(rows, w_stride, strip, xt, out, work);
// all sizes multiples of 64.
template <class F>
void run_tiles(const F& f, const uint8_t* w, size_t w_stride, const uint8_t* xq, size_t xq_stride, int nt, float* y,
               size_t ldy, int64_t r0, int64_t r1) {
    const size_t tile_bytes = f.tile_bytes(), strip_bytes = f.strip_bytes(), work_bytes = f.work_bytes();
    const int n_tiles = nt / 16;
    const int tb = std::min(static_cast<int>(std::max<size_t>(1, (size_t{1} << 20) / tile_bytes)), n_tiles);
    uint8_t* strip = t_scratch.get(strip_bytes + static_cast<size_t>(tb) * tile_bytes + work_bytes + 16 * 64);
    uint8_t* xts = strip + strip_bytes;
    uint8_t* work = xts + static_cast<size_t>(tb) * tile_bytes;
    float* ybuf = reinterpret_cast<float*>(work + work_bytes);
    const TileConfig cfg = f.config();
    _tile_loadconfig(&cfg);
    // Lane i of a gather from ybuf: row i's value (ybuf + 16 i + m for token m).
    const __m512i rows16 = lane_offsets(16);
    for (int t0 = 0; t0 < n_tiles; t0 += tb) {
        const int nti = std::min(tb, n_tiles - t0);
        for (int i = 0; i < nti; ++i) f.repack(xq, xq_stride, 16 * (t0 + i), xts + static_cast<size_t>(i) * tile_bytes);
        for (int64_t n0 = r0; n0 < r1; n0 += 16) {
            const uint8_t* rows = w + static_cast<size_t>(n0) * w_stride;
            f.unpack(rows, w_stride, strip);
            for (int i = 0; i < nti; ++i) {
                __m512 out[16];
                f.tile(rows, w_stride, strip, xts + static_cast<size_t>(i) * tile_bytes, out, work);
                // out[n] lane m -> y[(token) * ldy + row]
                for (int n = 0; n < 16; ++n) _mm512_store_ps(ybuf + 16 * n, out[n]);
                for (int m = 0; m < 16; ++m) {
                    float* yr = y + static_cast<size_t>(16 * (t0 + i) + m) * ldy + static_cast<size_t>(n0);
                    _mm512_storeu_ps(yr, _mm512_i32gather_ps(_mm512_add_epi32(rows16, _mm512_set1_epi32(m)), ybuf, 4));
                }
            }
        }
    }
    _tile_release();
}

// The 32-value block types for run_tiles; work: C (2 KiB) and the fold's stack.
template <DType W>
struct Q32Format {
    int64_t nb;
    size_t tile_bytes() const { return static_cast<size_t>(nb) * kXTileBlock; }
    size_t strip_bytes() const { return static_cast<size_t>(nb) * kWStripBlock; }
    size_t work_bytes() const { return 2048 + 4 * 16 * 64; }
    TileConfig config() const { return tile_config(); }
    void repack(const uint8_t* xq, size_t xq_stride, int t0, uint8_t* out) const {
        repack_tokens<W>(xq, xq_stride, t0, nb, out);
    }
    void unpack(const uint8_t* rows, size_t w_stride, uint8_t* strip) const {
        unpack_strip<W>(rows, w_stride, nb, strip);
    }
    void tile(const uint8_t* rows, size_t w_stride, const uint8_t* strip, const uint8_t* xt, __m512* out,
              uint8_t* work) const {
        const AOperand<W> a{strip, rows, w_stride};
        tile_16x16<W>(a, strip, xt, nb, out, reinterpret_cast<int32_t*>(work), reinterpret_cast<__m512*>(work + 2048));
    }
};

// ---------------------------------------------------------------------------
// Q4_K / Q5_K. Every level gives the scalar level's bits for these: per
// super-block, the exact integers sumi = sum_j sc_j S_j and summ = sum_j m_j X_j
// (S_j: sub-block j's dot, X_j its activations' sum from bsums), then
//   s = s + (d_w d_x * float(sumi) - dmin_w d_x * float(summ))
// in super-block order. Here the S_j of 16 rows x 16 tokens come from one TDPBSSD
// per sub-block; sumi and summ are integer sums (vpmulld, vpmaddwd: any order
// gives the same integers), and the float expression runs per row on a vector
// of 16 tokens.

// A strip's super-block: A of the 8 sub-blocks (16 rows x 32 values), the scales
// sc[j][n] as int32, the mins as int16 pairs (m_2k, m_2k+1) per row, d_w, dmin_w.
constexpr size_t kKStripA = 0, kKStripSc = 4096, kKStripMn = 4608, kKStripD = 4864, kKStripDmin = 4928;
constexpr size_t kKStripBlock = 4992;
// A token tile's super-block: B of the 8 sub-blocks (8 rows x 64 bytes each), the
// activation sums as int16 pairs (X_2k, X_2k+1) per token, d_x.
constexpr size_t kKTileB = 0, kKTileX = 4096, kKTileD = 4352;
constexpr size_t kKTileBlock = 4416;

template <DType W>
void unpack_strip_k(const uint8_t* w, size_t w_stride, int64_t nsb, uint8_t* out) {
    using Blk = std::conditional_t<W == DType::Q5_K, BlockQ5_K, BlockQ4_K>;
    const __m256i m4 = _mm256_set1_epi8(0x0F), b16 = _mm256_set1_epi8(16);
    for (int n = 0; n < 16; ++n) {
        const Blk* row = reinterpret_cast<const Blk*>(w + static_cast<size_t>(n) * w_stride);
        for (int64_t b = 0; b < nsb; ++b) {
            const Blk& blk = row[b];
            uint8_t* o = out + static_cast<size_t>(b) * kKStripBlock;
            uint8_t sc[8], mn[8];
            q4k_scales_mins(blk.scales, sc, mn);
            for (int j = 0; j < 8; ++j) reinterpret_cast<int32_t*>(o + kKStripSc)[16 * j + n] = sc[j];
            for (int k = 0; k < 4; ++k) {
                reinterpret_cast<uint32_t*>(o + kKStripMn)[16 * k + n] =
                    static_cast<uint32_t>(mn[2 * k]) | static_cast<uint32_t>(mn[2 * k + 1]) << 16;
            }
            reinterpret_cast<float*>(o + kKStripD)[n] = h2f(blk.d);
            reinterpret_cast<float*>(o + kKStripDmin)[n] = h2f(blk.dmin);
            __m256i qh = _mm256_setzero_si256();
            if constexpr (W == DType::Q5_K) qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk.qh));
            for (int k = 0; k < 4; ++k) {
                // Sub-blocks 2k (low nibbles) and 2k + 1 (high) share 32 bytes of qs.
                const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk.qs + 32 * k));
                __m256i lo = _mm256_and_si256(q, m4);
                __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
                if constexpr (W == DType::Q5_K) {
                    const __mmask32 blo = _mm256_test_epi8_mask(qh, _mm256_set1_epi8(static_cast<char>(1 << (2 * k))));
                    const __mmask32 bhi =
                        _mm256_test_epi8_mask(qh, _mm256_set1_epi8(static_cast<char>(1 << (2 * k + 1))));
                    lo = _mm256_mask_add_epi8(lo, blo, lo, b16);
                    hi = _mm256_mask_add_epi8(hi, bhi, hi, b16);
                }
                _mm256_store_si256(reinterpret_cast<__m256i*>(o + kKStripA + 512 * (2 * k) + 32 * n), lo);
                _mm256_store_si256(reinterpret_cast<__m256i*>(o + kKStripA + 512 * (2 * k + 1) + 32 * n), hi);
            }
        }
    }
}

// Tokens [t0, t0 + 16) of Q8_K activations into nsb super-blocks of kKTileBlock.
void repack_tokens_k(const uint8_t* xq, size_t xq_stride, int t0, int64_t nsb, uint8_t* out) {
    const __m512i idx = lane_offsets(xq_stride);
    const uint8_t* x0 = xq + static_cast<size_t>(t0) * xq_stride;
    for (int64_t b = 0; b < nsb; ++b) {
        const uint8_t* blk = x0 + static_cast<size_t>(b) * sizeof(BlockQ8_K);
        uint8_t* o = out + static_cast<size_t>(b) * kKTileBlock;
        gather_q8k_quants(blk, idx, o + kKTileB);
        // X_2k = bsums[4k] + bsums[4k + 1], X_2k+1 = bsums[4k + 2] + bsums[4k + 3]
        // (|X| <= 32 * 128: int16), as a pair per token.
        for (int k = 0; k < 4; ++k) {
            const __m512i lo = _mm512_i32gather_epi32(idx, blk + offsetof(BlockQ8_K, bsums) + 8 * k, 1);
            const __m512i hi = _mm512_i32gather_epi32(idx, blk + offsetof(BlockQ8_K, bsums) + 8 * k + 4, 1);
            const __m512i x0s =
                _mm512_add_epi32(_mm512_srai_epi32(_mm512_slli_epi32(lo, 16), 16), _mm512_srai_epi32(lo, 16));
            const __m512i x1s =
                _mm512_add_epi32(_mm512_srai_epi32(_mm512_slli_epi32(hi, 16), 16), _mm512_srai_epi32(hi, 16));
            const __m512i pair =
                _mm512_or_si512(_mm512_and_si512(x0s, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(x1s, 16));
            _mm512_store_si512(o + kKTileX + 64 * k, pair);
        }
        _mm512_store_ps(o + kKTileD, _mm512_castsi512_ps(_mm512_i32gather_epi32(idx, blk + offsetof(BlockQ8_K, d), 1)));
    }
}

// 16 rows x 16 tokens over nsb super-blocks: out[n] = row n's results, a lane per
// token. cbuf: 8 KiB.
inline void tile_16x16_k(const uint8_t* strip, const uint8_t* xt, int64_t nsb, __m512* out, int32_t* cbuf) {
    for (int n = 0; n < 16; ++n) out[n] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nsb; ++b) {
        const uint8_t* sb = strip + static_cast<size_t>(b) * kKStripBlock;
        const uint8_t* xb = xt + static_cast<size_t>(b) * kKTileBlock;
        for (int j = 0; j < 8; j += 2) {
            two_products(sb + kKStripA + 512 * j, sb + kKStripA + 512 * (j + 1), 32, xb + kKTileB + 512 * j,
                         xb + kKTileB + 512 * (j + 1), cbuf + 256 * j, cbuf + 256 * (j + 1));
        }
        const int32_t* sc = reinterpret_cast<const int32_t*>(sb + kKStripSc);
        const int32_t* mn = reinterpret_cast<const int32_t*>(sb + kKStripMn);
        const float* dw = reinterpret_cast<const float*>(sb + kKStripD);
        const float* dmin = reinterpret_cast<const float*>(sb + kKStripDmin);
        const __m512 dx = _mm512_load_ps(xb + kKTileD);
        __m512i xp[4];
        for (int k = 0; k < 4; ++k) xp[k] = _mm512_load_si512(xb + kKTileX + 64 * k);
        for (int n = 0; n < 16; ++n) {
            __m512i sumi = _mm512_mullo_epi32(_mm512_load_si512(cbuf + 16 * n), _mm512_set1_epi32(sc[n]));
            for (int j = 1; j < 8; ++j) {
                sumi = _mm512_add_epi32(sumi, _mm512_mullo_epi32(_mm512_load_si512(cbuf + 256 * j + 16 * n),
                                                                 _mm512_set1_epi32(sc[16 * j + n])));
            }
            __m512i summ = _mm512_madd_epi16(xp[0], _mm512_set1_epi32(mn[n]));
            for (int k = 1; k < 4; ++k) {
                summ = _mm512_add_epi32(summ, _mm512_madd_epi16(xp[k], _mm512_set1_epi32(mn[16 * k + n])));
            }
            // s + (d * float(sumi) - dm * float(summ)), d = d_w * d_x, dm = dmin_w * d_x.
            const __m512 d = _mm512_mul_ps(_mm512_set1_ps(dw[n]), dx);
            const __m512 dm = _mm512_mul_ps(_mm512_set1_ps(dmin[n]), dx);
            const __m512 t =
                _mm512_sub_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(sumi)), _mm512_mul_ps(dm, _mm512_cvtepi32_ps(summ)));
            out[n] = _mm512_add_ps(out[n], t);
        }
    }
}

// Q4_K / Q5_K for run_tiles; work: the 8 sub-blocks' C.
template <DType W>
struct KFormat {
    int64_t nsb;
    size_t tile_bytes() const { return static_cast<size_t>(nsb) * kKTileBlock; }
    size_t strip_bytes() const { return static_cast<size_t>(nsb) * kKStripBlock; }
    size_t work_bytes() const { return 8192; }
    TileConfig config() const { return tile_config(); }
    void repack(const uint8_t* xq, size_t xq_stride, int t0, uint8_t* out) const {
        repack_tokens_k(xq, xq_stride, t0, nsb, out);
    }
    void unpack(const uint8_t* rows, size_t w_stride, uint8_t* strip) const {
        unpack_strip_k<W>(rows, w_stride, nsb, strip);
    }
    void tile(const uint8_t*, size_t, const uint8_t* strip, const uint8_t* xt, __m512* out, uint8_t* work) const {
        tile_16x16_k(strip, xt, nsb, out, reinterpret_cast<int32_t*>(work));
    }
};

// ---------------------------------------------------------------------------
// Q6_K: per super-block the exact sumi = sum_g sc_g (S_g - 32 X_g) over 16 groups
// of 16 values (S_g the group's dot with values 0-63, X_g its activations' sum),
// then s = s + (d_w d_x) * float(sumi): the scalar level's bits, as every level
// gives them. One TDPBSSD per group (K = 16, a tile palette of its own);
// sum_g sc_g S_g by vpmulld, 32 sum_g sc_g X_g by vpmaddwd.

// A strip's super-block: A of the 16 groups (16 rows x 16 values), sc[g][n] as
// int32, the scales as int16 pairs (sc_2k, sc_2k+1) per row, d_w.
constexpr size_t kQ6StripA = 0, kQ6StripSc = 4096, kQ6StripScp = 5120, kQ6StripD = 5632;
constexpr size_t kQ6StripBlock = 5696;
// A token tile's super-block: B of the 16 groups (4 rows x 64 bytes), the bsums as
// int16 pairs (X_2k, X_2k+1) per token, d_x.
constexpr size_t kQ6TileB = 0, kQ6TileX = 4096, kQ6TileD = 4608;
constexpr size_t kQ6TileBlock = 4672;

TileConfig tile_config_q6() {
    TileConfig c;
    for (int t = 0; t < 2; ++t) c.colsb[t] = 64, c.rows[t] = 16;
    for (int t = 2; t < 4; ++t) c.colsb[t] = 16, c.rows[t] = 16;
    for (int t = 4; t < 6; ++t) c.colsb[t] = 64, c.rows[t] = 4;
    return c;
}

void unpack_strip_q6(const uint8_t* w, size_t w_stride, int64_t nsb, uint8_t* out) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3);
    for (int n = 0; n < 16; ++n) {
        const BlockQ6_K* row = reinterpret_cast<const BlockQ6_K*>(w + static_cast<size_t>(n) * w_stride);
        for (int64_t b = 0; b < nsb; ++b) {
            const BlockQ6_K& blk = row[b];
            uint8_t* o = out + static_cast<size_t>(b) * kQ6StripBlock;
            for (int g = 0; g < 16; ++g) reinterpret_cast<int32_t*>(o + kQ6StripSc)[16 * g + n] = blk.scales[g];
            for (int k = 0; k < 8; ++k) {
                reinterpret_cast<uint32_t*>(o + kQ6StripScp)[16 * k + n] =
                    static_cast<uint16_t>(blk.scales[2 * k]) |
                    static_cast<uint32_t>(static_cast<uint16_t>(blk.scales[2 * k + 1])) << 16;
            }
            reinterpret_cast<float*>(o + kQ6StripD)[n] = h2f(blk.d);
            for (int h = 0; h < 2; ++h) {
                const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk.ql + 64 * h));
                const __m256i bq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk.ql + 64 * h + 32));
                const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk.qh + 32 * h));
                auto hi2 = [&](int sh) {
                    return _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, sh), m3), 4);
                };
                // Values 128h + 32q + l, q = 0..3: groups 8h + 2q (l < 16) and 8h + 2q + 1.
                const __m256i v[4] = {
                    _mm256_or_si256(_mm256_and_si256(a, m4), hi2(0)),
                    _mm256_or_si256(_mm256_and_si256(bq, m4), hi2(2)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), m4), hi2(4)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bq, 4), m4), hi2(6)),
                };
                for (int q = 0; q < 4; ++q) {
                    const int g = 8 * h + 2 * q;
                    _mm_store_si128(reinterpret_cast<__m128i*>(o + kQ6StripA + 256 * g + 16 * n),
                                    _mm256_castsi256_si128(v[q]));
                    _mm_store_si128(reinterpret_cast<__m128i*>(o + kQ6StripA + 256 * (g + 1) + 16 * n),
                                    _mm256_extracti128_si256(v[q], 1));
                }
            }
        }
    }
}

void repack_tokens_q6(const uint8_t* xq, size_t xq_stride, int t0, int64_t nsb, uint8_t* out) {
    const __m512i idx = lane_offsets(xq_stride);
    const uint8_t* x0 = xq + static_cast<size_t>(t0) * xq_stride;
    for (int64_t b = 0; b < nsb; ++b) {
        const uint8_t* blk = x0 + static_cast<size_t>(b) * sizeof(BlockQ8_K);
        uint8_t* o = out + static_cast<size_t>(b) * kQ6TileBlock;
        gather_q8k_quants(blk, idx, o + kQ6TileB);
        for (int k = 0; k < 8; ++k) {
            _mm512_store_si512(o + kQ6TileX + 64 * k,
                               _mm512_i32gather_epi32(idx, blk + offsetof(BlockQ8_K, bsums) + 4 * k, 1));
        }
        _mm512_store_ps(o + kQ6TileD,
                        _mm512_castsi512_ps(_mm512_i32gather_epi32(idx, blk + offsetof(BlockQ8_K, d), 1)));
    }
}

// 16 rows x 16 tokens over nsb super-blocks: out[n] = row n's results, a lane per
// token. cbuf: 16 KiB.
inline void tile_16x16_q6(const uint8_t* strip, const uint8_t* xt, int64_t nsb, __m512* out, int32_t* cbuf) {
    for (int n = 0; n < 16; ++n) out[n] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nsb; ++b) {
        const uint8_t* sb = strip + static_cast<size_t>(b) * kQ6StripBlock;
        const uint8_t* xb = xt + static_cast<size_t>(b) * kQ6TileBlock;
        for (int g = 0; g < 16; g += 2) {
            two_products(sb + kQ6StripA + 256 * g, sb + kQ6StripA + 256 * (g + 1), 16, xb + kQ6TileB + 256 * g,
                         xb + kQ6TileB + 256 * (g + 1), cbuf + 256 * g, cbuf + 256 * (g + 1));
        }
        const int32_t* sc = reinterpret_cast<const int32_t*>(sb + kQ6StripSc);
        const int32_t* scp = reinterpret_cast<const int32_t*>(sb + kQ6StripScp);
        const float* dw = reinterpret_cast<const float*>(sb + kQ6StripD);
        const __m512 dx = _mm512_load_ps(xb + kQ6TileD);
        for (int n = 0; n < 16; ++n) {
            __m512i sumi = _mm512_mullo_epi32(_mm512_load_si512(cbuf + 16 * n), _mm512_set1_epi32(sc[n]));
            for (int g = 1; g < 16; ++g) {
                sumi = _mm512_add_epi32(sumi, _mm512_mullo_epi32(_mm512_load_si512(cbuf + 256 * g + 16 * n),
                                                                 _mm512_set1_epi32(sc[16 * g + n])));
            }
            __m512i corr = _mm512_madd_epi16(_mm512_load_si512(xb + kQ6TileX), _mm512_set1_epi32(scp[n]));
            for (int k = 1; k < 8; ++k) {
                corr = _mm512_add_epi32(corr, _mm512_madd_epi16(_mm512_load_si512(xb + kQ6TileX + 64 * k),
                                                                _mm512_set1_epi32(scp[16 * k + n])));
            }
            sumi = _mm512_sub_epi32(sumi, _mm512_slli_epi32(corr, 5));
            // s + (d_w * d_x) * float(sumi)
            out[n] = _mm512_add_ps(out[n],
                                   _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(dw[n]), dx), _mm512_cvtepi32_ps(sumi)));
        }
    }
}

// Q6_K for run_tiles; work: the 16 groups' C.
struct Q6Format {
    int64_t nsb;
    size_t tile_bytes() const { return static_cast<size_t>(nsb) * kQ6TileBlock; }
    size_t strip_bytes() const { return static_cast<size_t>(nsb) * kQ6StripBlock; }
    size_t work_bytes() const { return 16384; }
    TileConfig config() const { return tile_config_q6(); }
    void repack(const uint8_t* xq, size_t xq_stride, int t0, uint8_t* out) const {
        repack_tokens_q6(xq, xq_stride, t0, nsb, out);
    }
    void unpack(const uint8_t* rows, size_t w_stride, uint8_t* strip) const {
        unpack_strip_q6(rows, w_stride, nsb, strip);
    }
    void tile(const uint8_t*, size_t, const uint8_t* strip, const uint8_t* xt, __m512* out, uint8_t* work) const {
        tile_16x16_q6(strip, xt, nsb, out, reinterpret_cast<int32_t*>(work));
    }
};

}  // namespace

// The fewest tokens worth tiles (bench_kernels Prefill/amx against Prefill/avx512,
// bench/RESULTS.md "AMX tiles"): from 16 the tiles tie or win for every type but
// Q6_K, whose 16-value groups cost two tile operations per 32 values; it ties at
// 32 tokens and wins from 64.
constexpr int kMinTokens = 16;
constexpr int kMinTokensQ6K = 48;

void matmul(DType wtype, const void* w, size_t w_stride, int64_t n_in, const void* xq, size_t xq_stride, int n_tok,
            float* y, size_t ldy, int64_t r0, int64_t r1) {
    const int64_t nb = n_in / kQK;
    const bool type_ok = wtype == DType::Q4_0 || wtype == DType::Q4_1 || wtype == DType::Q5_0 || wtype == DType::Q5_1 ||
                         (wtype == DType::Q8_0 && nb % 16 == 0) || wtype == DType::Q4_K || wtype == DType::Q5_K ||
                         wtype == DType::Q6_K;
    const int nt = n_tok / 16 * 16;
    const int64_t nr = (r1 - r0) / 16 * 16;
    if (!type_ok || n_tok < (wtype == DType::Q6_K ? kMinTokensQ6K : kMinTokens) || nr == 0) {
        avx512::matmul(wtype, w, w_stride, n_in, xq, xq_stride, n_tok, y, ldy, r0, r1);
        return;
    }
    const uint8_t* wb = static_cast<const uint8_t*>(w);
    const uint8_t* xb = static_cast<const uint8_t*>(xq);
    const int64_t r1t = r0 + nr, nsb = n_in / kQKK;
    auto run = [&](const auto& f) { run_tiles(f, wb, w_stride, xb, xq_stride, nt, y, ldy, r0, r1t); };
    switch (wtype) {
        case DType::Q4_0: run(Q32Format<DType::Q4_0>{nb}); break;
        case DType::Q4_1: run(Q32Format<DType::Q4_1>{nb}); break;
        case DType::Q5_0: run(Q32Format<DType::Q5_0>{nb}); break;
        case DType::Q5_1: run(Q32Format<DType::Q5_1>{nb}); break;
        case DType::Q4_K: run(KFormat<DType::Q4_K>{nsb}); break;
        case DType::Q5_K: run(KFormat<DType::Q5_K>{nsb}); break;
        case DType::Q6_K: run(Q6Format{nsb}); break;
        default: run(Q32Format<DType::Q8_0>{nb}); break;
    }
    if (r0 + nr < r1) avx512::matmul(wtype, w, w_stride, n_in, xq, xq_stride, n_tok, y, ldy, r0 + nr, r1);
    if (nt < n_tok) {
        avx512::matmul(wtype, w, w_stride, n_in, xb + static_cast<size_t>(nt) * xq_stride, xq_stride, n_tok - nt,
                       y + static_cast<size_t>(nt) * ldy, ldy, r0, r0 + nr);
    }
}

}  // namespace duet::cpu::amx
