#include "kernels/cuda/attention.h"

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "kernels/cuda/rope_math.cuh"

#include <cmath>
#include <type_traits>

namespace duet::cuda {

namespace {

constexpr int kWarps = 4;

__device__ inline float warp_sum(float v) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

__device__ inline float warp_max(float v) {
    for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
    return v;
}

// Where one layer's K/V rows and scales are (src/kv/kv_pool.h): a (layer, block)
// tile holds K values, V values, then (quantized) K scales and V scales; a row is
// one token of one KV head.
template <int DT>
struct KvView {
    static constexpr int kElem = DT == kKvF16 ? 2 : 1;
    const uint8_t* layer;       // the layer's plane
    size_t rows, values, tile;  // rows of K (= of V) in a tile; bytes of their values; of a tile
    int block_tokens, head_dim;

    __device__ KvView(const PagedKv& kv)
        : rows(static_cast<size_t>(kv.n_head_kv) * kv.block_tokens), values(rows * kv.head_dim * kElem),
          block_tokens(kv.block_tokens), head_dim(kv.head_dim) {
        tile = 2 * (values + (DT == kKvF16 ? 0 : rows * sizeof(float)));
        layer = static_cast<const uint8_t*>(kv.data) + static_cast<size_t>(kv.layer) * kv.n_blocks * tile;
    }
    __device__ size_t row(int head, int slot) const { return static_cast<size_t>(head) * block_tokens + slot; }
    __device__ const uint8_t* k(int blk, int head, int slot) const {
        return layer + static_cast<size_t>(blk) * tile + row(head, slot) * head_dim * kElem;
    }
    __device__ const uint8_t* v(int blk, int head, int slot) const { return k(blk, head, slot) + values; }
    // A block's K scales (rows of them, then V's; quantized types).
    __device__ float* scales(int blk) const {
        return reinterpret_cast<float*>(const_cast<uint8_t*>(layer) + static_cast<size_t>(blk) * tile + 2 * values);
    }
    __device__ float k_scale(int blk, int head, int slot) const { return scales(blk)[row(head, slot)]; }
    __device__ float v_scale(int blk, int head, int slot) const { return scales(blk)[rows + row(head, slot)]; }
};

// Value d of a stored row, unscaled.
template <int DT>
__device__ inline float kv_load(const uint8_t* row, int d) {
    if constexpr (DT == kKvF16) {
        return __half2float(reinterpret_cast<const __half*>(row)[d]);
    } else if constexpr (DT == kKvInt8) {
        return static_cast<float>(static_cast<int8_t>(row[d]));
    } else {
        return __half2float(__half(__nv_cvt_fp8_to_halfraw(row[d], __NV_E4M3)));
    }
}

// One row of n values (x, in f32) into the arena at `row` (and, quantized, its
// scale), by one warp: f16 round to nearest even, or the quantization of
// kernels/cpu quantize_kv_row, the same bits.
template <int DT>
__device__ void store_row_warp(const float* x, int n, uint8_t* row, float* scale) {
    const int lane = threadIdx.x & 31;
    if constexpr (DT == kKvF16) {
        for (int d = lane; d < n; d += 32) reinterpret_cast<__half*>(row)[d] = __float2half_rn(x[d]);
    } else {
        float amax = 0.0f;
        for (int d = lane; d < n; d += 32) amax = fmaxf(amax, fabsf(x[d]));
        amax = warp_max(amax);
        const float top = DT == kKvInt8 ? 127.0f : 448.0f;
        const float inv = __fdiv_rn(top, amax);
        if (isinf(amax) || isinf(inv)) {  // zeros, values below ~1e-36, or an overflow: as on the CPU
            for (int d = lane; d < n; d += 32) row[d] = 0;
            if (lane == 0) *scale = isinf(amax) ? __int_as_float(0x7fc00000) : 0.0f;
            return;
        }
        for (int d = lane; d < n; d += 32) {
            const float v = __fmul_rn(x[d], inv);
            if constexpr (DT == kKvInt8)
                row[d] = static_cast<uint8_t>(static_cast<int8_t>(fmaxf(-127.0f, fminf(127.0f, rintf(v)))));
            else
                row[d] = __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
        }
        if (lane == 0) *scale = __fdiv_rn(amax, top);
    }
}

// K and V of one token (rows of n_head_kv x head_dim f32) into block blk, row slot,
// of kv.layer: one warp per (K|V, head) row.
template <int DT>
__device__ void append_token(const float* kt, const float* vt, int blk, int slot, const PagedKv& kv) {
    const KvView<DT> view(kv);
    const int warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    for (int r = warp; r < 2 * kv.n_head_kv; r += n_warps) {
        const bool is_v = r >= kv.n_head_kv;
        const int head = is_v ? r - kv.n_head_kv : r;
        auto* row = const_cast<uint8_t*>(is_v ? view.v(blk, head, slot) : view.k(blk, head, slot));
        float* scale = DT == kKvF16 ? nullptr : view.scales(blk) + (is_v ? view.rows : 0) + view.row(head, slot);
        store_row_warp<DT>((is_v ? vt : kt) + static_cast<size_t>(head) * kv.head_dim, kv.head_dim, row, scale);
    }
}

// One block per (head, sequence, split): each warp runs an online softmax over every
// kWarps-th token of the split, lanes holding head_dim / 32 dimensions each; the
// warps' states merge in shared memory; the split's (max, sum, weighted V) go to the
// workspace for the combine.
template <int HD, int DT>
__global__ void partial_kernel(const float* q, PagedKv kv, const int32_t* tables, int max_blocks, const int32_t* qseq,
                               const int32_t* lens, float scale, float* part_acc, float* part_m, float* part_l,
                               int n_split) {
    constexpr int PER = HD / 32;
    const int s = blockIdx.x, h = blockIdx.y, split = blockIdx.z;  // s: the query (x: up to 2^31 - 1 of them)
    const int seq = qseq ? qseq[s] : s;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int len = lens[s];
    const int start = split * kSplitTokens, end = min(len, start + kSplitTokens);
    const size_t slot = (static_cast<size_t>(s) * kv.n_head + h) * n_split + split;
    const int hkv = h / (kv.n_head / kv.n_head_kv);
    const KvView<DT> view(kv);

    float qr[PER], acc[PER];
    const float* qs = q + (static_cast<size_t>(s) * kv.n_head + h) * HD;
    for (int i = 0; i < PER; ++i) {
        qr[i] = qs[lane + 32 * i] * scale;
        acc[i] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    for (int t = start + warp; t < end; t += kWarps) {
        const int blk = tables[static_cast<size_t>(seq) * max_blocks + t / kv.block_tokens], slot = t % kv.block_tokens;
        const uint8_t* k = view.k(blk, hkv, slot);
        const uint8_t* v = view.v(blk, hkv, slot);
        float dot = 0.0f;
        for (int i = 0; i < PER; ++i) dot += qr[i] * kv_load<DT>(k, lane + 32 * i);
        const float sc = DT == kKvF16 ? warp_sum(dot) : warp_sum(dot) * view.k_scale(blk, hkv, slot);
        const float m_new = fmaxf(m, sc);
        // A -inf score (overflow) weighs nothing (-inf - -inf would be NaN); a NaN
        // score (a NaN row) makes the output NaN wherever it comes, as on the CPU.
        if (m_new == -INFINITY && !isnan(sc)) continue;
        const float corr = m == -INFINITY ? 0.0f : expf(m - m_new), p = expf(sc - m_new);
        l = l * corr + p;
        const float pv = DT == kKvF16 ? p : p * view.v_scale(blk, hkv, slot);
        for (int i = 0; i < PER; ++i) acc[i] = acc[i] * corr + pv * kv_load<DT>(v, lane + 32 * i);
        m = m_new;
    }
    __shared__ float sm[kWarps], sl[kWarps], sacc[kWarps][HD];
    if (lane == 0) {
        sm[warp] = m;
        sl[warp] = l;
    }
    for (int i = 0; i < PER; ++i) sacc[warp][lane + 32 * i] = acc[i];
    __syncthreads();
    float M = -INFINITY;
    for (int w = 0; w < kWarps; ++w) M = fmaxf(M, sm[w]);
    for (int d = threadIdx.x; d < HD; d += blockDim.x) {
        float a = 0.0f;
        for (int w = 0; w < kWarps; ++w)
            if (sm[w] != -INFINITY) a += expf(sm[w] - M) * sacc[w][d];
        part_acc[slot * HD + d] = a;
    }
    if (threadIdx.x == 0) {
        float L = 0.0f;
        for (int w = 0; w < kWarps; ++w)
            if (sm[w] != -INFINITY) L += expf(sm[w] - M) * sl[w];
        part_m[slot] = M;  // -inf: this split had no token
        part_l[slot] = L;
    }
}

template <int HD>
__global__ void combine_kernel(const float* part_acc, const float* part_m, const float* part_l, int n_split, int n_head,
                               float* out) {
    const int s = blockIdx.x, h = blockIdx.y;
    const size_t first = (static_cast<size_t>(s) * n_head + h) * n_split;
    float M = -INFINITY;
    for (int k = 0; k < n_split; ++k) M = fmaxf(M, part_m[first + k]);
    float L = 0.0f;
    for (int k = 0; k < n_split; ++k)
        if (part_m[first + k] != -INFINITY) L += expf(part_m[first + k] - M) * part_l[first + k];
    for (int d = threadIdx.x; d < HD; d += blockDim.x) {
        float a = 0.0f;
        for (int k = 0; k < n_split; ++k)
            if (part_m[first + k] != -INFINITY) a += expf(part_m[first + k] - M) * part_acc[(first + k) * HD + d];
        out[(static_cast<size_t>(s) * n_head + h) * HD + d] = L > 0.0f ? a / L : 0.0f;
    }
}

template <int HD, int DT>
cudaError_t launch(const float* q, const PagedKv& kv, const int32_t* tables, int max_blocks, const int32_t* qseq,
                   const int32_t* lens, int n_seq, int n_split, float scale, float* out, void* ws, cudaStream_t stream) {
    const size_t slots = static_cast<size_t>(n_seq) * kv.n_head * n_split;
    float* acc = static_cast<float*>(ws);
    float* m = acc + slots * HD;
    float* l = m + slots;
    partial_kernel<HD, DT><<<dim3(n_seq, kv.n_head, n_split), 32 * kWarps, 0, stream>>>(q, kv, tables, max_blocks, qseq,
                                                                                     lens, scale, acc, m, l, n_split);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
    combine_kernel<HD><<<dim3(n_seq, kv.n_head), HD, 0, stream>>>(acc, m, l, n_split, kv.n_head, out);
    return cudaGetLastError();
}

int splits(int max_len) { return max_len <= 0 ? 1 : (max_len + kSplitTokens - 1) / kSplitTokens; }

// Grid: (tile, head); 4 warps of 4 queries each. Per 16-token stretch of the
// sequence, the block loads K and V of the head's KV head into shared memory; each
// warp then runs its queries' online softmax over those tokens (lanes hold
// head_dim / 32 dimensions), skipping tokens past a query's visible length (causal).
template <int HD, int DT>
__global__ void prefill_tiled_kernel(const float* q, PagedKv kv, const int32_t* tables, int max_blocks,
                                     const int32_t* qseq, const int32_t* lens, const int32_t* tiles, float scale,
                                     float* out) {
    constexpr int PER = HD / 32, QW = kPrefillTile / kWarps, KT = 16;
    const int tile = blockIdx.x, h = blockIdx.y;
    const int q0 = tiles[2 * tile], nq = tiles[2 * tile + 1];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int seq = qseq[q0];
    const int hkv = h / (kv.n_head / kv.n_head_kv);
    const KvView<DT> view(kv);

    float qr[QW][PER], acc[QW][PER], m[QW], l[QW];
    int len[QW];
    for (int i = 0; i < QW; ++i) {
        const int k = warp * QW + i;
        len[i] = k < nq ? lens[q0 + k] : 0;
        const float* qs = q + (static_cast<size_t>(q0 + (k < nq ? k : 0)) * kv.n_head + h) * HD;
        for (int p = 0; p < PER; ++p) {
            qr[i][p] = qs[lane + 32 * p] * scale;
            acc[i][p] = 0.0f;
        }
        m[i] = -INFINITY;
        l[i] = 0.0f;
    }
    int max_len = 0;
    for (int k = 0; k < nq; ++k) max_len = max(max_len, lens[q0 + k]);

    // The stretch's K and V as f32, scaled (quantized types: a row times its scale).
    __shared__ float ks[KT][HD], vs[KT][HD];
    for (int t0 = 0; t0 < max_len; t0 += KT) {
        __syncthreads();  // the previous stretch is used up
        for (int e = threadIdx.x; e < KT * HD; e += blockDim.x) {
            const int tt = e / HD, d = e % HD, t = t0 + tt;
            float kk = 0.0f, vv = 0.0f;
            if (t < max_len) {
                const int blk = tables[static_cast<size_t>(seq) * max_blocks + t / kv.block_tokens], slot = t % kv.block_tokens;
                kk = kv_load<DT>(view.k(blk, hkv, slot), d);
                vv = kv_load<DT>(view.v(blk, hkv, slot), d);
                if constexpr (DT != kKvF16) {
                    kk *= view.k_scale(blk, hkv, slot);
                    vv *= view.v_scale(blk, hkv, slot);
                }
            }
            ks[tt][d] = kk;
            vs[tt][d] = vv;
        }
        __syncthreads();
        const int n_here = min(KT, max_len - t0);
        for (int tt = 0; tt < n_here; ++tt) {
            const int t = t0 + tt;
            float kf[PER], vf[PER];
            for (int p = 0; p < PER; ++p) {
                kf[p] = ks[tt][lane + 32 * p];
                vf[p] = vs[tt][lane + 32 * p];
            }
            for (int i = 0; i < QW; ++i) {
                if (t >= len[i]) continue;  // the same for every lane of the warp
                float dot = 0.0f;
                for (int p = 0; p < PER; ++p) dot += qr[i][p] * kf[p];
                const float sc = warp_sum(dot);
                const float m_new = fmaxf(m[i], sc);
                if (m_new == -INFINITY && !isnan(sc)) continue;
                const float corr = m[i] == -INFINITY ? 0.0f : expf(m[i] - m_new), pr = expf(sc - m_new);
                l[i] = l[i] * corr + pr;
                for (int p = 0; p < PER; ++p) acc[i][p] = acc[i][p] * corr + pr * vf[p];
                m[i] = m_new;
            }
        }
    }
    for (int i = 0; i < QW; ++i) {
        const int k = warp * QW + i;
        if (k >= nq) continue;
        float* o = out + (static_cast<size_t>(q0 + k) * kv.n_head + h) * HD;
        for (int p = 0; p < PER; ++p) o[lane + 32 * p] = l[i] > 0.0f ? acc[i][p] / l[i] : 0.0f;
    }
}

// Grid: tokens. Rotate q's and k's pairs (each pair by one thread), then round q and
// write K and V of the token to the arena.
template <int DT>
__global__ void qk_rope_append_kernel(float* q, float* k, const float* v, const int32_t* pos, const float* inv_freq,
                                      int rot_dim, bool neox, const int32_t* token_block, const int32_t* token_offset,
                                      PagedKv kv) {
    const int t = blockIdx.x, half = rot_dim / 2, HD = kv.head_dim;
    const int qrow = kv.n_head * HD, krow = kv.n_head_kv * HD;
    float* qt = q + static_cast<size_t>(t) * qrow;
    float* kt = k + static_cast<size_t>(t) * krow;
    const double p = static_cast<double>(pos[t]);
    if (half > 0) {
        for (int e = threadIdx.x; e < (kv.n_head + kv.n_head_kv) * half; e += blockDim.x) {
            const int h = e / half, i = e % half;
            float* row = h < kv.n_head ? qt + h * HD : kt + (h - kv.n_head) * HD;
            detail::rope_pair(row, i, half, p, inv_freq, neox);
        }
    }
    __syncthreads();
    for (int d = threadIdx.x; d < qrow; d += blockDim.x) qt[d] = __half2float(__float2half_rn(qt[d]));
    if (token_block[t] < 0) return;  // a padding row of a captured decode step
    append_token<DT>(kt, v + static_cast<size_t>(t) * krow, token_block[t], token_offset[t], kv);
}

// Grid: tokens; a warp per (K|V, kv head) row.
template <int DT>
__global__ void kv_append_kernel(const float* k, const float* v, const int32_t* token_block, const int32_t* token_offset,
                                 PagedKv kv) {
    const int t = blockIdx.x;
    if (token_block[t] < 0) return;  // a padding row of a captured decode step
    const size_t row = static_cast<size_t>(kv.n_head_kv) * kv.head_dim;
    append_token<DT>(k + t * row, v + t * row, token_block[t], token_offset[t], kv);
}

bool valid(const PagedKv& kv) {
    return kv.n_head_kv > 0 && kv.n_head % kv.n_head_kv == 0 && kv.block_tokens > 0 && kv.dtype >= kKvF16 &&
           kv.dtype <= kKvFp8;
}

// f(std::integral_constant<int, dtype>) for kv.dtype (checked by valid()).
template <class F>
cudaError_t by_dtype(const PagedKv& kv, F&& f) {
    switch (kv.dtype) {
    case kKvF16: return f(std::integral_constant<int, kKvF16>{});
    case kKvInt8: return f(std::integral_constant<int, kKvInt8>{});
    case kKvFp8: return f(std::integral_constant<int, kKvFp8>{});
    default: return cudaErrorInvalidValue;
    }
}

}  // namespace

size_t paged_attention_workspace_bytes(const PagedKv& kv, int n_query, int max_len) {
    const size_t slots = static_cast<size_t>(n_query) * kv.n_head * splits(max_len);
    return slots * (static_cast<size_t>(kv.head_dim) + 2) * sizeof(float);
}

cudaError_t paged_attention(const float* q, const PagedKv& kv, const int32_t* block_tables, int max_blocks_per_seq,
                            const int32_t* query_seq, const int32_t* visible, int n_query, int max_len, float scale,
                            float* out, void* workspace, cudaStream_t stream) {
    if (n_query <= 0) return cudaSuccess;
    if (!valid(kv)) return cudaErrorInvalidValue;
    const int n_split = splits(max_len);
    return by_dtype(kv, [&](auto dt) {
        constexpr int DT = decltype(dt)::value;
        switch (kv.head_dim) {
        case 64:
            return launch<64, DT>(q, kv, block_tables, max_blocks_per_seq, query_seq, visible, n_query, n_split, scale,
                                  out, workspace, stream);
        case 128:
            return launch<128, DT>(q, kv, block_tables, max_blocks_per_seq, query_seq, visible, n_query, n_split, scale,
                                   out, workspace, stream);
        default: return cudaErrorInvalidValue;
        }
    });
}

cudaError_t paged_attention_prefill(const float* q, const PagedKv& kv, const int32_t* block_tables, int max_blocks_per_seq,
                                    const int32_t* query_seq, const int32_t* visible, const int32_t* tiles, int n_tiles,
                                    float scale, float* out, cudaStream_t stream) {
    if (n_tiles <= 0) return cudaSuccess;
    if (!valid(kv)) return cudaErrorInvalidValue;
    const dim3 grid(static_cast<unsigned>(n_tiles), static_cast<unsigned>(kv.n_head));
    return by_dtype(kv, [&](auto dt) {
        constexpr int DT = decltype(dt)::value;
        switch (kv.head_dim) {
        case 64:
            prefill_tiled_kernel<64, DT><<<grid, 32 * kWarps, 0, stream>>>(q, kv, block_tables, max_blocks_per_seq,
                                                                            query_seq, visible, tiles, scale, out);
            return cudaGetLastError();
        case 128:
            prefill_tiled_kernel<128, DT><<<grid, 32 * kWarps, 0, stream>>>(q, kv, block_tables, max_blocks_per_seq,
                                                                             query_seq, visible, tiles, scale, out);
            return cudaGetLastError();
        default: return cudaErrorInvalidValue;
        }
    });
}

cudaError_t qk_rope_kv_append(float* q, float* k, const float* v, int n_tok, const int32_t* pos, const float* inv_freq,
                              int rot_dim, bool neox, const int32_t* token_block, const int32_t* token_offset,
                              const PagedKv& kv, cudaStream_t stream) {
    if (n_tok <= 0) return cudaSuccess;
    if (!valid(kv)) return cudaErrorInvalidValue;
    return by_dtype(kv, [&](auto dt) {
        qk_rope_append_kernel<decltype(dt)::value>
            <<<n_tok, 256, 0, stream>>>(q, k, v, pos, inv_freq, rot_dim, neox, token_block, token_offset, kv);
        return cudaGetLastError();
    });
}

cudaError_t kv_append(const float* k, const float* v, int n_tok, const int32_t* token_block,
                      const int32_t* token_offset, const PagedKv& kv, cudaStream_t stream) {
    if (n_tok <= 0) return cudaSuccess;
    if (!valid(kv)) return cudaErrorInvalidValue;
    return by_dtype(kv, [&](auto dt) {
        kv_append_kernel<decltype(dt)::value><<<n_tok, 256, 0, stream>>>(k, v, token_block, token_offset, kv);
        return cudaGetLastError();
    });
}

}  // namespace duet::cuda
