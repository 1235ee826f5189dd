#include "kernels/cuda/sample.h"

#include <cfloat>
#include <climits>
#include <cmath>

namespace duet::cuda {

namespace {

constexpr int kThreads = 1024;
constexpr int kPer = kSampleMaxSorted / kThreads;  // sorted candidates per thread in the scans

// Orders floats as unsigned integers (ascending), -0 as +0 (they compare equal).
__device__ inline uint32_t order_key(float f) {
    if (f == 0.0f) f = 0.0f;
    const uint32_t u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The CPU sampler's candidate order: the larger logit first, the lower id on ties.
__device__ inline bool better(float a, int ia, float b, int ib) { return a > b || (a == b && ia < ib); }

// exp of a candidate's logit less the maximum, as the CPU computes it: the
// difference in float, the exponential in double.
__device__ inline double weight(float x, float mx) { return exp(static_cast<double>(__fsub_rn(x, mx))); }

struct Shared {
    float cl[kSampleMaxSorted];  // sorted candidates: tempered logits and ids
    int ci[kSampleMaxSorted];
    double scan[kThreads / 32];
    unsigned hist[256];
    uint32_t prefix;
    int k, n, pick;
    float fmax;
    int imax;
};

// Exclusive prefix sum over the block (every thread calls it); *total gets the sum.
template <typename T>
__device__ T block_exclusive_scan(T v, T* total, T* warp_sums) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    T x = v;
    for (int off = 1; off < 32; off <<= 1) {
        const T y = __shfl_up_sync(0xffffffffu, x, off);
        if (lane >= off) x += y;
    }
    if (lane == 31) warp_sums[warp] = x;
    __syncthreads();
    if (warp == 0) {
        T w = lane < kThreads / 32 ? warp_sums[lane] : T(0);
        for (int off = 1; off < 32; off <<= 1) {
            const T y = __shfl_up_sync(0xffffffffu, w, off);
            if (lane >= off) w += y;
        }
        if (lane < kThreads / 32) warp_sums[lane] = w;  // inclusive, per warp
    }
    __syncthreads();
    const T before = warp == 0 ? T(0) : warp_sums[warp - 1];
    *total = warp_sums[kThreads / 32 - 1];
    __syncthreads();  // warp_sums may be reused
    return before + x - v;
}

// The best of w[0..nv) (largest, lowest id on ties): into sh.fmax / sh.imax.
__device__ void block_best(const float* w, int64_t nv, Shared& sh) {
    float best = -INFINITY;
    int id = INT_MAX;
    for (int64_t i = threadIdx.x; i < nv; i += kThreads)
        if (id == INT_MAX || better(w[i], static_cast<int>(i), best, id)) {
            best = w[i];
            id = static_cast<int>(i);
        }
    for (int off = 16; off > 0; off >>= 1) {
        const float b = __shfl_down_sync(0xffffffffu, best, off);
        const int j = __shfl_down_sync(0xffffffffu, id, off);
        if (j != INT_MAX && (id == INT_MAX || better(b, j, best, id))) {
            best = b;
            id = j;
        }
    }
    __shared__ float wb[kThreads / 32];
    __shared__ int wi[kThreads / 32];
    if ((threadIdx.x & 31) == 0) {
        wb[threadIdx.x >> 5] = best;
        wi[threadIdx.x >> 5] = id;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float b = wb[0];
        int j = wi[0];
        for (int k = 1; k < kThreads / 32; ++k)
            if (wi[k] != INT_MAX && (j == INT_MAX || better(wb[k], wi[k], b, j))) {
                b = wb[k];
                j = wi[k];
            }
        sh.fmax = b;
        sh.imax = j;
    }
    __syncthreads();
}

// The K best of w[0..nv) (K <= kSampleMaxSorted, K <= nv) into sh.cl / sh.ci, best
// first: a radix select of the K-th largest key (four passes of 8 bits), the larger
// ones gathered in any order, the ties at the K-th in id order, then a bitonic sort.
__device__ void select_sorted(const float* w, int64_t nv, int K, Shared& sh) {
    uint32_t prefix = 0, mask = 0;
    int k = K;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += kThreads) sh.hist[b] = 0;
        __syncthreads();
        for (int64_t i = threadIdx.x; i < nv; i += kThreads) {
            const uint32_t key = order_key(w[i]);
            if ((key & mask) == prefix) atomicAdd(&sh.hist[(key >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int b = 255;
            for (; b > 0; --b) {
                if (static_cast<int>(sh.hist[b]) >= k) break;
                k -= static_cast<int>(sh.hist[b]);
            }
            sh.prefix = prefix | (static_cast<uint32_t>(b) << shift);
            sh.k = k;
        }
        __syncthreads();
        prefix = sh.prefix;
        k = sh.k;
        mask |= 0xFFu << shift;
    }
    // prefix: the K-th largest key; k of the keys equal to it belong to the K.
    if (threadIdx.x == 0) sh.n = 0;
    __syncthreads();
    const int64_t chunk = (nv + kThreads - 1) / kThreads;
    const int64_t lo = threadIdx.x * chunk, hi = min(nv, lo + chunk);
    int ties = 0;
    for (int64_t i = lo; i < hi; ++i) {
        const uint32_t key = order_key(w[i]);
        if (key > prefix) {
            const int at = atomicAdd(&sh.n, 1);
            sh.cl[at] = w[i];
            sh.ci[at] = static_cast<int>(i);
        } else if (key == prefix) {
            ++ties;
        }
    }
    int n_ties = 0;
    __shared__ int warp_ints[kThreads / 32];
    int rank = block_exclusive_scan<int>(ties, &n_ties, warp_ints);
    for (int64_t i = lo; i < hi && rank < k; ++i)
        if (order_key(w[i]) == prefix) {
            sh.cl[K - k + rank] = w[i];
            sh.ci[K - k + rank] = static_cast<int>(i);
            ++rank;
        }
    int P = 1;
    while (P < K) P <<= 1;
    for (int i = K + threadIdx.x; i < P; i += kThreads) {
        sh.cl[i] = -INFINITY;
        sh.ci[i] = INT_MAX;
    }
    __syncthreads();
    for (int size = 2; size <= P; size <<= 1)
        for (int stride = size / 2; stride > 0; stride >>= 1) {
            for (int i = threadIdx.x; i < P; i += kThreads) {
                const int j = i ^ stride;
                if (j <= i) continue;
                const bool up = (i & size) == 0;
                const bool swap = up ? better(sh.cl[j], sh.ci[j], sh.cl[i], sh.ci[i])
                                     : better(sh.cl[i], sh.ci[i], sh.cl[j], sh.ci[j]);
                if (swap) {
                    const float f = sh.cl[i];
                    sh.cl[i] = sh.cl[j];
                    sh.cl[j] = f;
                    const int d = sh.ci[i];
                    sh.ci[i] = sh.ci[j];
                    sh.ci[j] = d;
                }
            }
            __syncthreads();
        }
}

// Over the sorted candidates [0, n): the first index whose running sum of
// weight / div reaches `reach` (the CPU's "cum >= top_p", or, with strict, "target
// < cum"), or n when none does. Also the sum of the weights, in *total.
__device__ int first_reaching(int n, float mx, double div, double reach, bool strict, double* total, Shared& sh) {
    double local[kPer];
    double mine = 0;
    for (int j = 0; j < kPer; ++j) {
        const int i = threadIdx.x * kPer + j;
        local[j] = i < n ? weight(sh.cl[i], mx) / div : 0.0;
        mine += local[j];
    }
    if (threadIdx.x == 0) sh.pick = n;
    __syncthreads();
    double sum = 0;
    double c = block_exclusive_scan<double>(mine, &sum, sh.scan);
    for (int j = 0; j < kPer; ++j) {
        const int i = threadIdx.x * kPer + j;
        if (i >= n) break;
        c += local[j];
        if (strict ? reach < c : c >= reach) {
            atomicMin(&sh.pick, i);
            break;
        }
    }
    __syncthreads();
    *total = sum;
    const int r = sh.pick;
    __syncthreads();
    return r;
}

// 1024 threads a block: the bounds keep the registers within 64 a thread (without
// them nvcc takes 82 and every launch fails for lack of resources).
__global__ void __launch_bounds__(kThreads)
    sample_kernel(const float* logits, int64_t nv, const SampleRow* rows, const SampleEdit* edits,
                  const uint32_t* masks, int32_t* picks, float* work) {
    __shared__ Shared sh;
    const SampleRow r = rows[blockIdx.x];
    const float* l = logits + static_cast<int64_t>(r.row) * nv;
    float* w = work + static_cast<int64_t>(blockIdx.x) * nv;
    if (r.mask_begin >= 0) {  // the tokens its bitset does not allow: -inf
        const uint32_t* m = masks + r.mask_begin;
        for (int64_t i = threadIdx.x; i < nv; i += kThreads) w[i] = (m[i >> 5] >> (i & 31)) & 1u ? l[i] : -INFINITY;
    } else {
        for (int64_t i = threadIdx.x; i < nv; i += kThreads) w[i] = l[i];
    }
    __syncthreads();
    // Bias, bans and penalties (one edit per distinct token: no two threads write one
    // entry).
    for (int e = threadIdx.x; e < r.edit_count; e += kThreads) {
        const SampleEdit ed = edits[r.edit_begin + e];
        float x = w[ed.token];
        if (ed.add == -INFINITY)
            x = -INFINITY;  // a ban, whatever the logit (model/sampler.h apply_token_add)
        else if (ed.add != 0.0f)
            x = __fadd_rn(x, ed.add);
        if (ed.rep) x = x > 0 ? __fdiv_rn(x, r.rep) : __fmul_rn(x, r.rep);
        w[ed.token] = __fsub_rn(x, ed.sub);
    }
    __syncthreads();
    if (r.inv_temp == 0.0f) {  // greedy
        block_best(w, nv, sh);
        // Every logit -inf: nothing to choose (the host says so).
        if (threadIdx.x == 0) picks[blockIdx.x] = sh.fmax == -INFINITY ? -1 : sh.imax;
        return;
    }
    for (int64_t i = threadIdx.x; i < nv; i += kThreads) w[i] = __fmul_rn(w[i], r.inv_temp);
    __syncthreads();

    // The candidates: sorted (sh.cl / sh.ci, n of them) once top-k or top-p ran,
    // else all of w in id order.
    int64_t n = nv;
    bool sorted = false;
    if (r.top_k > 0 && r.top_k < nv) {
        if (r.top_k > kSampleMaxSorted) {
            if (threadIdx.x == 0) picks[blockIdx.x] = -1;
            return;
        }
        select_sorted(w, nv, r.top_k, sh);
        n = r.top_k;
        sorted = true;
    }
    float mx;
    if (sorted) {
        mx = sh.cl[0];
    } else {
        block_best(w, nv, sh);
        mx = sh.fmax;
    }
    if (mx == -INFINITY) {  // every candidate -inf: nothing to choose (the host says so)
        if (threadIdx.x == 0) picks[blockIdx.x] = -1;
        return;
    }
    // The normalizer over the candidates.
    double sum = 0;
    {
        double mine = 0;
        if (sorted) {
            for (int i = threadIdx.x; i < n; i += kThreads) mine += weight(sh.cl[i], mx);
        } else {
            for (int64_t i = threadIdx.x; i < nv; i += kThreads) mine += weight(w[i], mx);
        }
        block_exclusive_scan<double>(mine, &sum, sh.scan);
    }
    if (r.top_p < 1.0f) {
        // The smallest best-first prefix holding top_p of the mass (all n if none).
        int64_t K = sorted ? n : (n < 64 ? n : 64);
        for (;;) {
            if (K > kSampleMaxSorted) {
                if (threadIdx.x == 0) picks[blockIdx.x] = -1;
                return;
            }
            if (!sorted) select_sorted(w, nv, static_cast<int>(K), sh);
            double unused;
            const int keep = first_reaching(static_cast<int>(K), mx, sum, static_cast<double>(r.top_p), false, &unused, sh);
            if (keep < K || K == n) {
                n = keep < K ? keep + 1 : K;
                break;
            }
            K = n < K * 4 ? n : K * 4;
        }
        sorted = true;
    }
    if (r.min_p_on) {
        const float cut = __fadd_rn(mx, r.log_min_p);
        if (sorted) {
            // Keep the candidates at or above the cut, in order.
            int mine = 0;
            for (int j = 0; j < kPer; ++j) {
                const int i = threadIdx.x * kPer + j;
                mine += i < n && sh.cl[i] >= cut;
            }
            int kept = 0;
            __shared__ int warp_ints[kThreads / 32];
            int at = block_exclusive_scan<int>(mine, &kept, warp_ints);
            float fl[kPer];
            int fi[kPer];
            for (int j = 0; j < kPer; ++j) {
                const int i = threadIdx.x * kPer + j;
                fl[j] = i < n ? sh.cl[i] : 0.0f;
                fi[j] = i < n ? sh.ci[i] : 0;
            }
            __syncthreads();
            for (int j = 0; j < kPer; ++j) {
                const int i = threadIdx.x * kPer + j;
                if (i < n && fl[j] >= cut) {
                    sh.cl[at] = fl[j];
                    sh.ci[at] = fi[j];
                    ++at;
                }
            }
            __syncthreads();
            n = kept;
        } else {
            // Id order: the filtered-out tokens weigh nothing below.
            for (int64_t i = threadIdx.x; i < nv; i += kThreads)
                if (w[i] < cut) w[i] = -INFINITY;
            __syncthreads();
        }
    }
    // The draw: the first candidate, in order, whose running sum passes u * total. A
    // candidate of logit -inf (banned, masked, filtered) weighs nothing and is never
    // drawn, not even where the running sums' rounding (the block's order is not the
    // CPU's) would let the draw land on it, nor as the fallback.
    if (sorted) {
        // Sorted best first: the -inf candidates are the list's tail; cut it.
        if (threadIdx.x == 0) sh.pick = static_cast<int>(n);
        __syncthreads();
        for (int i = threadIdx.x; i < n; i += kThreads)
            if (sh.cl[i] == -INFINITY) atomicMin(&sh.pick, i);
        __syncthreads();
        n = sh.pick;  // >= 1: the best candidate is above -inf (checked above)
        __syncthreads();
        double total = 0;
        // The total first (the same scan, reaching nothing), then the target.
        first_reaching(static_cast<int>(n), mx, 1.0, INFINITY, true, &total, sh);
        const int i = first_reaching(static_cast<int>(n), mx, 1.0, r.u * total, true, &total, sh);
        if (threadIdx.x == 0) picks[blockIdx.x] = sh.ci[i < n ? i : n - 1];
        return;
    }
    const int64_t chunk = (nv + kThreads - 1) / kThreads;
    const int64_t lo = threadIdx.x * chunk, hi = min(nv, lo + chunk);
    double mine = 0;
    int last = -1;  // the last kept token in my chunk
    for (int64_t i = lo; i < hi; ++i)
        if (w[i] != -INFINITY) {
            mine += weight(w[i], mx);
            last = static_cast<int>(i);
        }
    double total = 0;
    double c = block_exclusive_scan<double>(mine, &total, sh.scan);
    const double target = r.u * total;
    if (threadIdx.x == 0) {
        sh.pick = INT_MAX;
        sh.imax = -1;
    }
    __syncthreads();
    if (last >= 0) atomicMax(&sh.imax, last);
    for (int64_t i = lo; i < hi; ++i) {
        if (w[i] == -INFINITY) continue;
        c += weight(w[i], mx);
        if (target < c) {
            atomicMin(&sh.pick, static_cast<int>(i));
            break;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) picks[blockIdx.x] = sh.pick != INT_MAX ? sh.pick : sh.imax;
}

}  // namespace

size_t sample_workspace_bytes(int n_rows, int64_t n_vocab) {
    return static_cast<size_t>(n_rows > 0 ? n_rows : 0) * static_cast<size_t>(n_vocab) * sizeof(float);
}

cudaError_t sample_rows(const float* logits, int64_t n_vocab, const SampleRow* rows, int n_rows,
                        const SampleEdit* edits, const uint32_t* masks, int32_t* picks, void* workspace,
                        cudaStream_t stream) {
    if (n_rows <= 0) return cudaSuccess;
    if (n_vocab <= 0 || n_vocab > INT_MAX) return cudaErrorInvalidValue;
    sample_kernel<<<n_rows, kThreads, 0, stream>>>(logits, n_vocab, rows, edits, masks, picks,
                                                   static_cast<float*>(workspace));
    return cudaGetLastError();
}

}  // namespace duet::cuda
