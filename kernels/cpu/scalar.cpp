// The reference level: plain loops, written to be obviously right. The SIMD
// levels are tested against these. Quantizers of activation types (Q8_0, Q8_1,
// Q8_K) are the definition the SIMD quantizers reproduce bit for bit.
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "kernels/cpu/kernels_impl.h"

namespace duet::cpu {

namespace {

// e4m3 ("fn"): sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is
// subnormal (m * 2^-9); S.1111.111 is NaN; no infinities.
constexpr float fp8_e4m3_value(unsigned b) {
    const unsigned e = (b >> 3) & 15u, m = b & 7u;
    float v = 0.0f;
    if (e == 0) {
        v = static_cast<float>(m) / 512.0f;
    } else if (e == 15 && m == 7) {
        v = std::numeric_limits<float>::quiet_NaN();
    } else {
        v = 1.0f + static_cast<float>(m) / 8.0f;
        for (unsigned i = 7; i < e; ++i) v *= 2.0f;
        for (unsigned i = e; i < 7; ++i) v /= 2.0f;
    }
    return (b & 0x80u) ? -v : v;
}

struct Fp8Table {
    float v[256];
};
constexpr Fp8Table make_fp8_table() {
    Fp8Table t{};
    for (unsigned b = 0; b < 256; ++b) t.v[b] = fp8_e4m3_value(b);
    return t;
}
constexpr Fp8Table kFp8Table = make_fp8_table();

}  // namespace

alignas(64) const float kFp8E4M3[256] = {
#define DUET_FP8_ROW(r) kFp8Table.v[r], kFp8Table.v[r + 1], kFp8Table.v[r + 2], kFp8Table.v[r + 3], \
                        kFp8Table.v[r + 4], kFp8Table.v[r + 5], kFp8Table.v[r + 6], kFp8Table.v[r + 7]
    DUET_FP8_ROW(0), DUET_FP8_ROW(8), DUET_FP8_ROW(16), DUET_FP8_ROW(24), DUET_FP8_ROW(32), DUET_FP8_ROW(40),
    DUET_FP8_ROW(48), DUET_FP8_ROW(56), DUET_FP8_ROW(64), DUET_FP8_ROW(72), DUET_FP8_ROW(80), DUET_FP8_ROW(88),
    DUET_FP8_ROW(96), DUET_FP8_ROW(104), DUET_FP8_ROW(112), DUET_FP8_ROW(120), DUET_FP8_ROW(128), DUET_FP8_ROW(136),
    DUET_FP8_ROW(144), DUET_FP8_ROW(152), DUET_FP8_ROW(160), DUET_FP8_ROW(168), DUET_FP8_ROW(176), DUET_FP8_ROW(184),
    DUET_FP8_ROW(192), DUET_FP8_ROW(200), DUET_FP8_ROW(208), DUET_FP8_ROW(216), DUET_FP8_ROW(224), DUET_FP8_ROW(232),
    DUET_FP8_ROW(240), DUET_FP8_ROW(248),
#undef DUET_FP8_ROW
};

}  // namespace duet::cpu

namespace duet::cpu::scalar {

namespace {

// --- quantizers -------------------------------------------------------------

// Weights (tests only): ggml's reference rounding. d = max / -8 where max is
// the first value of largest magnitude, so that value maps to 0 (i.e. -8).
void quantize_q4_0(const float* x, BlockQ4_0* y, int64_t nb) {
    for (int64_t i = 0; i < nb; ++i, x += kQK) {
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < kQK; ++j) {
            if (std::fabs(x[j]) > amax) {
                amax = std::fabs(x[j]);
                max = x[j];
            }
        }
        const float d = max / -8.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        y[i].d = float_to_half(d);
        for (int j = 0; j < kQK / 2; ++j) {
            const int q0 = std::min(15, static_cast<int>(static_cast<int8_t>(x[j] * id + 8.5f)));
            const int q1 = std::min(15, static_cast<int>(static_cast<int8_t>(x[j + 16] * id + 8.5f)));
            y[i].qs[j] = static_cast<uint8_t>(q0 | (q1 << 4));
        }
    }
}

void quantize_q4_1(const float* x, BlockQ4_1* y, int64_t nb) {
    for (int64_t i = 0; i < nb; ++i, x += kQK) {
        float mn = x[0], mx = x[0];
        for (int j = 1; j < kQK; ++j) {
            mn = std::min(mn, x[j]);
            mx = std::max(mx, x[j]);
        }
        const float d = (mx - mn) / 15.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        y[i].d = float_to_half(d);
        y[i].m = float_to_half(mn);
        for (int j = 0; j < kQK / 2; ++j) {
            const int q0 = std::min(15, static_cast<int>(static_cast<int8_t>((x[j] - mn) * id + 0.5f)));
            const int q1 = std::min(15, static_cast<int>(static_cast<int8_t>((x[j + 16] - mn) * id + 0.5f)));
            y[i].qs[j] = static_cast<uint8_t>(q0 | (q1 << 4));
        }
    }
}

// Activations (and Q8_0 test weights). q = round_even(x * (127 / amax)),
// d = amax / 127 stored as f16. This is llama.cpp's x86 rounding (its scalar
// reference uses roundf; the two differ only on exact ties).
float absmax(const float* x, int n) {
    float amax = 0.0f;
    for (int j = 0; j < n; ++j) amax = std::max(amax, std::fabs(x[j]));
    return amax;
}

void quantize_q8_0(const float* x, BlockQ8_0* y, int64_t nb) {
    for (int64_t i = 0; i < nb; ++i, x += kQK) {
        const float amax = absmax(x, kQK);
        const float d = amax / 127.0f;
        const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
        y[i].d = float_to_half(d);
        for (int j = 0; j < kQK; ++j) y[i].qs[j] = static_cast<int8_t>(round_even(x[j] * id));
    }
}

// As Q8_0, plus s = f16(d * sum(qs)) for the Q4_1 minimum term.
void quantize_q8_1(const float* x, BlockQ8_1* y, int64_t nb) {
    for (int64_t i = 0; i < nb; ++i, x += kQK) {
        const float amax = absmax(x, kQK);
        const float d = amax / 127.0f;
        const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
        int sum = 0;
        for (int j = 0; j < kQK; ++j) {
            const int q = round_even(x[j] * id);
            y[i].qs[j] = static_cast<int8_t>(q);
            sum += q;
        }
        y[i].d = float_to_half(d);
        y[i].s = float_to_half(d * static_cast<float>(sum));
    }
}

// Q8_K: float scale d = 1 / (127 / amax); bsums = sums of 16 consecutive qs.
// (ggml scales by -127 / max, the signed value of largest magnitude; that
// flips the signs of qs and d together and gives the same products.)
void quantize_q8_k(const float* x, BlockQ8_K* y, int64_t nb) {
    for (int64_t i = 0; i < nb; ++i, x += kQKK) {
        const float amax = absmax(x, kQKK);
        if (amax == 0.0f) {
            std::memset(&y[i], 0, sizeof(BlockQ8_K));
            continue;
        }
        const float iscale = 127.0f / amax;
        for (int j = 0; j < kQKK; ++j) y[i].qs[j] = static_cast<int8_t>(round_even(x[j] * iscale));
        for (int g = 0; g < kQKK / 16; ++g) {
            int s = 0;
            for (int j = 0; j < 16; ++j) s += y[i].qs[16 * g + j];
            y[i].bsums[g] = static_cast<int16_t>(s);
        }
        y[i].d = 1.0f / iscale;
    }
}

// --- dot products of one weight row with one activation row ---------------
// Integer sums are exact; the float order below is the scalar level's.

float dot_f32(const float* w, const float* x, int64_t n) {
    float s = 0.0f;
    for (int64_t k = 0; k < n; ++k) s += w[k] * x[k];
    return s;
}

float dot_f16(const uint16_t* w, const float* x, int64_t n) {
    float s = 0.0f;
    for (int64_t k = 0; k < n; ++k) s += half_to_float(w[k]) * x[k];
    return s;
}

float dot_bf16(const uint16_t* w, const float* x, int64_t n) {
    float s = 0.0f;
    for (int64_t k = 0; k < n; ++k) s += bf16_to_float(w[k]) * x[k];
    return s;
}

float dot_q4_0(const BlockQ4_0* w, const BlockQ8_0* x, int64_t nb) {
    float s = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
        int isum = 0;
        for (int j = 0; j < kQK / 2; ++j) {
            isum += ((w[b].qs[j] & 15) - 8) * x[b].qs[j];
            isum += ((w[b].qs[j] >> 4) - 8) * x[b].qs[j + 16];
        }
        s += (half_to_float(w[b].d) * half_to_float(x[b].d)) * static_cast<float>(isum);
    }
    return s;
}

// sum_b d_w d_x sum_j q_w q_x  +  sum_b m_w s_x, with s_x = d_x sum_j q_x.
float dot_q4_1(const BlockQ4_1* w, const BlockQ8_1* x, int64_t nb) {
    float sd = 0.0f, sm = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
        int isum = 0;
        for (int j = 0; j < kQK / 2; ++j) {
            isum += (w[b].qs[j] & 15) * x[b].qs[j];
            isum += (w[b].qs[j] >> 4) * x[b].qs[j + 16];
        }
        sd += (half_to_float(w[b].d) * half_to_float(x[b].d)) * static_cast<float>(isum);
        sm += half_to_float(w[b].m) * half_to_float(x[b].s);
    }
    return sd + sm;
}

// Value i of a Q5 block: its nibble with bit i of qh on top.
inline int q5_value(const uint8_t* qs, const uint8_t* qh, int i) {
    const int nib = i < 16 ? qs[i] & 15 : qs[i - 16] >> 4;
    return nib | (((qh[i / 8] >> (i % 8)) & 1) << 4);
}

// Q4_0's and Q4_1's expressions with 5-bit values.
float dot_q5_0(const BlockQ5_0* w, const BlockQ8_0* x, int64_t nb) {
    float s = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
        int isum = 0;
        for (int i = 0; i < kQK; ++i) isum += (q5_value(w[b].qs, w[b].qh, i) - 16) * x[b].qs[i];
        s += (half_to_float(w[b].d) * half_to_float(x[b].d)) * static_cast<float>(isum);
    }
    return s;
}

float dot_q5_1(const BlockQ5_1* w, const BlockQ8_1* x, int64_t nb) {
    float sd = 0.0f, sm = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
        int isum = 0;
        for (int i = 0; i < kQK; ++i) isum += q5_value(w[b].qs, w[b].qh, i) * x[b].qs[i];
        sd += (half_to_float(w[b].d) * half_to_float(x[b].d)) * static_cast<float>(isum);
        sm += half_to_float(w[b].m) * half_to_float(x[b].s);
    }
    return sd + sm;
}

float dot_q8_0(const BlockQ8_0* w, const BlockQ8_0* x, int64_t nb) {
    float s = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
        int isum = 0;
        for (int j = 0; j < kQK; ++j) isum += w[b].qs[j] * x[b].qs[j];
        s += (half_to_float(w[b].d) * half_to_float(x[b].d)) * static_cast<float>(isum);
    }
    return s;
}

// Q4_K or Q5_K (Blk), per super-block: d_x (d_w sum_j sc_j S_j) - d_x (dmin_w sum_j
// m_j X_j), S_j the integer dot of sub-block j, X_j the sum of its activations (from
// bsums). Q5_K's values have bit j of qh[l] on top (value l of sub-block j).
template <class Blk>
float dot_q45_k(const Blk* w, const BlockQ8_K* x, int64_t nb) {
    float s = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
        int sumi = 0, summ = 0;
        for (int j = 0; j < 8; ++j) {
            int sc, mn;
            q4k_scale_min(j, w[b].scales, &sc, &mn);
            const uint8_t* q = w[b].qs + 32 * (j / 2);
            const int shift = 4 * (j % 2);
            int dot = 0;
            for (int l = 0; l < 32; ++l) {
                int v = (q[l] >> shift) & 15;
                if constexpr (std::is_same_v<Blk, BlockQ5_K>) v |= ((w[b].qh[l] >> j) & 1) << 4;
                dot += v * x[b].qs[32 * j + l];
            }
            sumi += sc * dot;
            summ += mn * (x[b].bsums[2 * j] + x[b].bsums[2 * j + 1]);
        }
        const float d = half_to_float(w[b].d) * x[b].d;
        const float dm = half_to_float(w[b].dmin) * x[b].d;
        s += d * static_cast<float>(sumi) - dm * static_cast<float>(summ);
    }
    return s;
}

// Per super-block: d_w d_x sum_g scale_g sum_{l in g} (q6 - 32) q8, over 16
// groups of 16. The integer sum is formed as sum q6*q8 - 32 * sum bsums.
float dot_q6_k(const BlockQ6_K* w, const BlockQ8_K* x, int64_t nb) {
    float s = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
        int q6[kQKK];
        for (int h = 0; h < 2; ++h) {
            const uint8_t* ql = w[b].ql + 64 * h;
            const uint8_t* qh = w[b].qh + 32 * h;
            for (int l = 0; l < 32; ++l) {
                q6[128 * h + l] = (ql[l] & 15) | (((qh[l] >> 0) & 3) << 4);
                q6[128 * h + l + 32] = (ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4);
                q6[128 * h + l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
                q6[128 * h + l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
            }
        }
        int sumi = 0;
        for (int g = 0; g < 16; ++g) {
            int dot = 0;
            for (int l = 0; l < 16; ++l) dot += q6[16 * g + l] * x[b].qs[16 * g + l];
            sumi += w[b].scales[g] * (dot - 32 * x[b].bsums[g]);
        }
        s += (half_to_float(w[b].d) * x[b].d) * static_cast<float>(sumi);
    }
    return s;
}

float dot_row(DType wtype, const void* w, const void* x, int64_t n_in) {
    switch (wtype) {
        case DType::F32: return dot_f32(static_cast<const float*>(w), static_cast<const float*>(x), n_in);
        case DType::F16: return dot_f16(static_cast<const uint16_t*>(w), static_cast<const float*>(x), n_in);
        case DType::BF16: return dot_bf16(static_cast<const uint16_t*>(w), static_cast<const float*>(x), n_in);
        case DType::Q4_0:
            return dot_q4_0(static_cast<const BlockQ4_0*>(w), static_cast<const BlockQ8_0*>(x), n_in / kQK);
        case DType::Q4_1:
            return dot_q4_1(static_cast<const BlockQ4_1*>(w), static_cast<const BlockQ8_1*>(x), n_in / kQK);
        case DType::Q5_0:
            return dot_q5_0(static_cast<const BlockQ5_0*>(w), static_cast<const BlockQ8_0*>(x), n_in / kQK);
        case DType::Q5_1:
            return dot_q5_1(static_cast<const BlockQ5_1*>(w), static_cast<const BlockQ8_1*>(x), n_in / kQK);
        case DType::Q8_0:
            return dot_q8_0(static_cast<const BlockQ8_0*>(w), static_cast<const BlockQ8_0*>(x), n_in / kQK);
        case DType::Q4_K:
            return dot_q45_k(static_cast<const BlockQ4_K*>(w), static_cast<const BlockQ8_K*>(x), n_in / kQKK);
        case DType::Q5_K:
            return dot_q45_k(static_cast<const BlockQ5_K*>(w), static_cast<const BlockQ8_K*>(x), n_in / kQKK);
        case DType::Q6_K:
            return dot_q6_k(static_cast<const BlockQ6_K*>(w), static_cast<const BlockQ8_K*>(x), n_in / kQKK);
        default: kernel_fail("matmul: unsupported weight type");
    }
}

}  // namespace

void quantize_row(DType t, const float* src, void* dst, int64_t n) {
    switch (t) {
        case DType::F32: std::memcpy(dst, src, static_cast<size_t>(n) * 4); return;
        case DType::F16: fp32_to_fp16_row(src, static_cast<uint16_t*>(dst), n); return;
        case DType::BF16: {
            uint16_t* d = static_cast<uint16_t*>(dst);
            for (int64_t i = 0; i < n; ++i) d[i] = float_to_bf16(src[i]);
            return;
        }
        case DType::Q4_0: quantize_q4_0(src, static_cast<BlockQ4_0*>(dst), n / kQK); return;
        case DType::Q4_1: quantize_q4_1(src, static_cast<BlockQ4_1*>(dst), n / kQK); return;
        case DType::Q8_0: quantize_q8_0(src, static_cast<BlockQ8_0*>(dst), n / kQK); return;
        case DType::Q8_1: quantize_q8_1(src, static_cast<BlockQ8_1*>(dst), n / kQK); return;
        case DType::Q8_K: quantize_q8_k(src, static_cast<BlockQ8_K*>(dst), n / kQKK); return;
        default: kernel_fail("quantize_row: unsupported type");
    }
}

void matmul(DType wtype, const void* w, size_t w_stride, int64_t n_in, const void* xq, size_t xq_stride,
            int n_tok, float* y, size_t ldy, int64_t r0, int64_t r1) {
    const char* wb = static_cast<const char*>(w);
    const char* xb = static_cast<const char*>(xq);
    for (int t = 0; t < n_tok; ++t) {
        for (int64_t r = r0; r < r1; ++r) {
            y[static_cast<size_t>(t) * ldy + static_cast<size_t>(r)] =
                dot_row(wtype, wb + static_cast<size_t>(r) * w_stride, xb + static_cast<size_t>(t) * xq_stride, n_in);
        }
    }
}

// The sum of squares is taken in double: this level is the accuracy reference.
void rms_norm(const float* x, const float* w, float* y, int64_t n, float eps) {
    double ss = 0.0;
    for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
    const float scale = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(n) + eps));
    for (int64_t i = 0; i < n; ++i) y[i] = x[i] * scale * w[i];
}

void rope(float* x, int n_heads, int head_dim, int rot_dim, int64_t pos, const float* inv_freq) {
    float c[512], s[512];
    for (int i0 = 0; i0 < rot_dim / 2; i0 += 512) {
        const int m = std::min(512, rot_dim / 2 - i0);
        rope_angles(pos, inv_freq + i0, m, c, s);
        for (int h = 0; h < n_heads; ++h) {
            float* v = x + static_cast<int64_t>(h) * head_dim + 2 * i0;
            for (int i = 0; i < m; ++i) {
                const float a = v[2 * i], b = v[2 * i + 1];
                v[2 * i] = a * c[i] - b * s[i];
                v[2 * i + 1] = a * s[i] + b * c[i];
            }
        }
    }
}

void rope_neox(float* x, int n_heads, int head_dim, int rot_dim, int64_t pos, const float* inv_freq) {
    float c[512], s[512];
    const int half = rot_dim / 2;
    for (int i0 = 0; i0 < half; i0 += 512) {
        const int m = std::min(512, half - i0);
        rope_angles(pos, inv_freq + i0, m, c, s);
        for (int h = 0; h < n_heads; ++h) {
            float* v = x + static_cast<int64_t>(h) * head_dim + i0;
            for (int i = 0; i < m; ++i) {
                const float a = v[i], b = v[i + half];
                v[i] = a * c[i] - b * s[i];
                v[i + half] = a * s[i] + b * c[i];
            }
        }
    }
}

void swiglu(const float* gate, const float* up, float* out, int64_t n) {
    for (int64_t i = 0; i < n; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

void add(float* y, const float* x, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

// Entries equal to -inf get probability 0. If every entry is -inf there is no
// distribution; the row is set to 0 rather than NaN.
void softmax(float* x, int64_t n) {
    float mx = -INFINITY;
    for (int64_t i = 0; i < n; ++i) mx = std::max(mx, x[i]);
    if (mx == -INFINITY) {
        for (int64_t i = 0; i < n; ++i) x[i] = 0.0f;
        return;
    }
    double sum = 0.0;
    for (int64_t i = 0; i < n; ++i) {
        x[i] = std::exp(x[i] - mx);
        sum += x[i];
    }
    const float inv = static_cast<float>(1.0 / sum);
    for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

float dot_f32_f16(const float* a, const uint16_t* b, int64_t n) {
    double s = 0.0;
    for (int64_t i = 0; i < n; ++i) s += static_cast<double>(a[i]) * half_to_float(b[i]);
    return static_cast<float>(s);
}

void axpy_f16(float a, const uint16_t* x, float* y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] += a * half_to_float(x[i]);
}

void fp32_to_fp16_row(const float* x, uint16_t* y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] = float_to_half(x[i]);
}

void attn_scores_f16(const float* q, const uint16_t* k, size_t stride, int64_t n, int64_t head_dim, float scale,
                     float* scores) {
    for (int64_t j = 0; j < n; ++j) scores[j] = scale * dot_f32_f16(q, k + static_cast<size_t>(j) * stride, head_dim);
}

void attn_accum_f16(const float* p, const uint16_t* v, size_t stride, int64_t n, int64_t head_dim, float* out) {
    for (int64_t j = 0; j < n; ++j) axpy_f16(p[j], v + static_cast<size_t>(j) * stride, out, head_dim);
}

void attn_scores_q(KvQuant t, const float* q, const uint8_t* k, const float* k_scale, size_t stride, int64_t n,
                   int64_t head_dim, float scale, float* scores) {
    for (int64_t j = 0; j < n; ++j) {
        const uint8_t* kj = k + static_cast<size_t>(j) * stride;
        double s = 0.0;
        for (int64_t i = 0; i < head_dim; ++i) s += static_cast<double>(q[i]) * kv_decode(t, kj[i]);
        scores[j] = scale * (k_scale[j] * static_cast<float>(s));
    }
}

void attn_accum_q(KvQuant t, const float* p, const uint8_t* v, const float* v_scale, size_t stride, int64_t n,
                  int64_t head_dim, float* out) {
    for (int64_t j = 0; j < n; ++j) {
        const uint8_t* vj = v + static_cast<size_t>(j) * stride;
        const float a = p[j] * v_scale[j];
        for (int64_t i = 0; i < head_dim; ++i) out[i] += a * kv_decode(t, vj[i]);
    }
}

uint64_t read_fold(const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    uint64_t acc[4] = {0, 0, 0, 0};
    size_t i = 0;
    for (; i + 32 <= n; i += 32)
        for (int j = 0; j < 4; ++j) {
            uint64_t v;
            std::memcpy(&v, b + i + 8 * j, 8);
            acc[j] ^= v;
        }
    for (; i < n; ++i) acc[0] ^= b[i];
    return acc[0] ^ acc[1] ^ acc[2] ^ acc[3];
}

void round_fp16(float* x, int64_t n) {
    for (int64_t i = 0; i < n; ++i) x[i] = half_to_float(float_to_half(x[i]));
}

}  // namespace duet::cpu::scalar
