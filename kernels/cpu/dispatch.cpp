// Run-time choice of instruction set, argument checks, and the kernels that
// have a single (scalar) implementation: conversions and dequantization.
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "kernels/cpu/kernels.h"
#include "kernels/cpu/kernels_impl.h"

namespace duet::cpu {

namespace {

// F16C is not among the names Clang 14's __builtin_cpu_supports knows: read
// CPUID leaf 1, ECX bit 29. (AVX state being enabled by the OS is implied by
// __builtin_cpu_supports("avx2"), which checks XCR0.)
bool cpu_has_f16c() {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return false;
    return (c & (1u << 29)) != 0;
}

// AMX-TILE and AMX-INT8 (CPUID leaf 7: EDX bits 24, 25), their state enabled in
// XCR0 (bits 17, 18: XTILECFG, XTILEDATA), and Linux's permission for this process
// to use the 8 KiB of tile data (arch_prctl ARCH_REQ_XCOMP_PERM; refused where the
// kernel predates 5.16 or a sigaltstack is too small).
bool amx_usable() {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if ((d & (1u << 24)) == 0 || (d & (1u << 25)) == 0) return false;
    if (!__get_cpuid(1, &a, &b, &c, &d) || (c & (1u << 27)) == 0) return false;  // OSXSAVE
    unsigned lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & (3u << 17)) != (3u << 17)) return false;
    constexpr long kArchReqXcompPerm = 0x1023;
    constexpr long kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

struct IsaInfo {
    bool avx2 = false;
    bool avx512 = false;
    bool amx = false;
    Isa best = Isa::Scalar;
};

// Detected once; DUET_ISA=scalar|avx2|avx512|amx caps `best` (tests, benchmarks).
const IsaInfo& isa_info() {
    static const IsaInfo info = [] {
        IsaInfo r;
#if defined(__x86_64__) && !defined(DUET_KERNELS_SCALAR_ONLY)
        __builtin_cpu_init();
        r.avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && cpu_has_f16c();
        r.avx512 = r.avx2 && __builtin_cpu_supports("avx512f") &&
                   __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                   __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni");
        r.amx = r.avx512 && amx_usable();
#endif
        r.best = r.amx ? Isa::Amx : r.avx512 ? Isa::Avx512 : r.avx2 ? Isa::Avx2 : Isa::Scalar;
        if (const char* cap = std::getenv("DUET_ISA"); cap != nullptr && *cap != '\0') {
            Isa want;
            if (std::strcmp(cap, "scalar") == 0) {
                want = Isa::Scalar;
            } else if (std::strcmp(cap, "avx2") == 0) {
                want = Isa::Avx2;
            } else if (std::strcmp(cap, "avx512") == 0) {
                want = Isa::Avx512;
            } else if (std::strcmp(cap, "amx") == 0) {
                want = Isa::Amx;
            } else {
                std::fprintf(stderr,
                             "duet: DUET_ISA=%s is not one of scalar, avx2, avx512, amx; "
                             "ignoring it and using %s\n",
                             cap, isa_name(r.best));
                return r;
            }
            if (static_cast<int>(want) < static_cast<int>(r.best)) r.best = want;
        }
        return r;
    }();
    return info;
}

void check_isa(Isa isa) {
    if (!isa_supported(isa)) kernel_fail("called with an instruction set this CPU or build lacks");
}

}  // namespace

const char* isa_name(Isa isa) {
    switch (isa) {
        case Isa::Scalar: return "scalar";
        case Isa::Avx2: return "avx2";
        case Isa::Avx512: return "avx512";
        case Isa::Amx: return "amx";
    }
    return "unknown";
}

bool isa_supported(Isa isa) {
    switch (isa) {
        case Isa::Scalar: return true;
        case Isa::Avx2: return isa_info().avx2;
        case Isa::Avx512: return isa_info().avx512;
        case Isa::Amx: return isa_info().amx;
    }
    return false;
}

Isa isa_best() { return isa_info().best; }

float fp16_to_fp32(uint16_t h) { return half_to_float(h); }
uint16_t fp32_to_fp16(float f) { return float_to_half(f); }
float bf16_to_fp32(uint16_t h) { return bf16_to_float(h); }
uint16_t fp32_to_bf16(float f) { return float_to_bf16(f); }

DType vec_dot_type(DType w) {
    switch (w) {
        case DType::Q4_0:
        case DType::Q5_0:
        case DType::Q8_0: return DType::Q8_0;
        case DType::Q4_1:
        case DType::Q5_1: return DType::Q8_1;
        case DType::Q4_K:
        case DType::Q5_K:
        case DType::Q6_K: return DType::Q8_K;
        default: return DType::F32;
    }
}

void dequantize_row(DType t, const void* src, float* dst, int64_t n) {
    const int64_t be = dtype_block_elems(t);
    if (be == 0 || n % be != 0) kernel_fail("dequantize_row: unsupported type or n not a multiple of its block");
    const int64_t nb = n / be;
    switch (t) {
        case DType::F32:
            std::memcpy(dst, src, static_cast<size_t>(n) * 4);
            return;
        case DType::F16: {
            const uint16_t* s = static_cast<const uint16_t*>(src);
            for (int64_t i = 0; i < n; ++i) dst[i] = half_to_float(s[i]);
            return;
        }
        case DType::BF16: {
            const uint16_t* s = static_cast<const uint16_t*>(src);
            for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_float(s[i]);
            return;
        }
        case DType::Q4_0: {
            const BlockQ4_0* b = static_cast<const BlockQ4_0*>(src);
            for (int64_t i = 0; i < nb; ++i, dst += kQK) {
                const float d = half_to_float(b[i].d);
                for (int j = 0; j < kQK / 2; ++j) {
                    dst[j] = static_cast<float>((b[i].qs[j] & 15) - 8) * d;
                    dst[j + 16] = static_cast<float>((b[i].qs[j] >> 4) - 8) * d;
                }
            }
            return;
        }
        case DType::Q4_1: {
            const BlockQ4_1* b = static_cast<const BlockQ4_1*>(src);
            for (int64_t i = 0; i < nb; ++i, dst += kQK) {
                const float d = half_to_float(b[i].d);
                const float m = half_to_float(b[i].m);
                for (int j = 0; j < kQK / 2; ++j) {
                    dst[j] = static_cast<float>(b[i].qs[j] & 15) * d + m;
                    dst[j + 16] = static_cast<float>(b[i].qs[j] >> 4) * d + m;
                }
            }
            return;
        }
        case DType::Q5_0:
        case DType::Q5_1: {
            // Value j: nibble j (low nibbles first) with bit j of qh as its fifth bit;
            // Q5_0: d * (q - 16), Q5_1: d * q + m.
            const size_t bytes = dtype_block_bytes(t);
            const uint8_t* p = static_cast<const uint8_t*>(src);
            for (int64_t i = 0; i < nb; ++i, dst += kQK, p += bytes) {
                uint16_t dh, mh = 0;
                uint32_t qh;
                std::memcpy(&dh, p, 2);
                if (t == DType::Q5_1) std::memcpy(&mh, p + 2, 2);
                const uint8_t* after = p + (t == DType::Q5_1 ? 4 : 2);
                std::memcpy(&qh, after, 4);
                const uint8_t* qs = after + 4;
                const float d = half_to_float(dh), m = half_to_float(mh);
                for (int j = 0; j < kQK / 2; ++j) {
                    const int q0 = (qs[j] & 15) | static_cast<int>(((qh >> j) & 1) << 4);
                    const int q1 = (qs[j] >> 4) | static_cast<int>(((qh >> (j + 16)) & 1) << 4);
                    if (t == DType::Q5_0) {
                        dst[j] = static_cast<float>(q0 - 16) * d;
                        dst[j + 16] = static_cast<float>(q1 - 16) * d;
                    } else {
                        dst[j] = static_cast<float>(q0) * d + m;
                        dst[j + 16] = static_cast<float>(q1) * d + m;
                    }
                }
            }
            return;
        }
        case DType::Q8_0: {
            const BlockQ8_0* b = static_cast<const BlockQ8_0*>(src);
            for (int64_t i = 0; i < nb; ++i, dst += kQK) {
                const float d = half_to_float(b[i].d);
                for (int j = 0; j < kQK; ++j) dst[j] = static_cast<float>(b[i].qs[j]) * d;
            }
            return;
        }
        case DType::Q8_1: {
            const BlockQ8_1* b = static_cast<const BlockQ8_1*>(src);
            for (int64_t i = 0; i < nb; ++i, dst += kQK) {
                const float d = half_to_float(b[i].d);
                for (int j = 0; j < kQK; ++j) dst[j] = static_cast<float>(b[i].qs[j]) * d;
            }
            return;
        }
        case DType::Q8_K: {
            const BlockQ8_K* b = static_cast<const BlockQ8_K*>(src);
            for (int64_t i = 0; i < nb; ++i, dst += kQKK) {
                for (int j = 0; j < kQKK; ++j) dst[j] = static_cast<float>(b[i].qs[j]) * b[i].d;
            }
            return;
        }
        case DType::Q4_K:
        case DType::Q5_K: {
            // 4 chunks of 64 values; chunk c: 32 low nibbles of qs[32c..32c+32)
            // with scale/min 2c, then the 32 high nibbles with scale/min 2c+1
            // (Q5_K: with bit 2c, resp. 2c+1, of qh[l] as value l's fifth bit).
            const bool five = t == DType::Q5_K;
            const size_t bytes = dtype_block_bytes(t);
            const uint8_t* p = static_cast<const uint8_t*>(src);
            for (int64_t i = 0; i < nb; ++i, p += bytes) {
                // d, dmin and scales lead both layouts; Q5_K's qh[32] precedes its qs.
                const BlockQ4_K* head = reinterpret_cast<const BlockQ4_K*>(p);
                const uint8_t* qh = five ? reinterpret_cast<const BlockQ5_K*>(p)->qh : nullptr;
                const uint8_t* qs = five ? reinterpret_cast<const BlockQ5_K*>(p)->qs : head->qs;
                const float d = half_to_float(head->d);
                const float dmin = half_to_float(head->dmin);
                for (int c = 0; c < 4; ++c) {
                    int sc0, m0, sc1, m1;
                    q4k_scale_min(2 * c, head->scales, &sc0, &m0);
                    q4k_scale_min(2 * c + 1, head->scales, &sc1, &m1);
                    const float d0 = d * static_cast<float>(sc0), mm0 = dmin * static_cast<float>(m0);
                    const float d1 = d * static_cast<float>(sc1), mm1 = dmin * static_cast<float>(m1);
                    const uint8_t* q = qs + 32 * c;
                    auto high = [&](int l, int bit) { return five ? ((qh[l] >> bit) & 1) << 4 : 0; };
                    for (int l = 0; l < 32; ++l) *dst++ = d0 * static_cast<float>((q[l] & 15) | high(l, 2 * c)) - mm0;
                    for (int l = 0; l < 32; ++l)
                        *dst++ = d1 * static_cast<float>((q[l] >> 4) | high(l, 2 * c + 1)) - mm1;
                }
            }
            return;
        }
        case DType::Q6_K: {
            // Two halves of 128 values. In half h, for l < 32: value 32k + l
            // (k = 0..3) takes 4 low bits from ql[64h + l + 32(k&1)] (low nibble
            // for k < 2, high for k >= 2) and 2 high bits from qh[32h + l] bits
            // 2k..2k+1; minus 32; scale scales[8h + 2k + l/16].
            const BlockQ6_K* b = static_cast<const BlockQ6_K*>(src);
            for (int64_t i = 0; i < nb; ++i) {
                const float d = half_to_float(b[i].d);
                for (int h = 0; h < 2; ++h) {
                    const uint8_t* ql = b[i].ql + 64 * h;
                    const uint8_t* qh = b[i].qh + 32 * h;
                    const int8_t* sc = b[i].scales + 8 * h;
                    for (int l = 0; l < 32; ++l) {
                        const int is = l / 16;
                        const int q0 = ((ql[l] & 15) | (((qh[l] >> 0) & 3) << 4)) - 32;
                        const int q1 = ((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32;
                        const int q2 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                        const int q3 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                        dst[l] = d * static_cast<float>(sc[is + 0]) * static_cast<float>(q0);
                        dst[l + 32] = d * static_cast<float>(sc[is + 2]) * static_cast<float>(q1);
                        dst[l + 64] = d * static_cast<float>(sc[is + 4]) * static_cast<float>(q2);
                        dst[l + 96] = d * static_cast<float>(sc[is + 6]) * static_cast<float>(q3);
                    }
                    dst += 128;
                }
            }
            return;
        }
        default:
            kernel_fail("dequantize_row: unsupported type");
    }
}

// ---------------------------------------------------------------------------
// Routing. Checks that are cheap and catch caller mistakes live here, once.

#if defined(__x86_64__) && !defined(DUET_KERNELS_SCALAR_ONLY)
#define DUET_ROUTE(isa, call)                  \
    switch (isa) {                             \
        case Isa::Amx:                         \
        case Isa::Avx512: return avx512::call; \
        case Isa::Avx2: return avx2::call;     \
        case Isa::Scalar: break;               \
    }                                          \
    return scalar::call
#else
#define DUET_ROUTE(isa, call) return scalar::call
#endif

void quantize_row(Isa isa, DType t, const float* src, void* dst, int64_t n) {
    check_isa(isa);
    const int64_t be = dtype_block_elems(t);
    const bool ok = t == DType::F32 || t == DType::F16 || t == DType::BF16 || t == DType::Q4_0 ||
                    t == DType::Q4_1 || t == DType::Q8_0 || t == DType::Q8_1 || t == DType::Q8_K;
    if (!ok || n % be != 0) kernel_fail("quantize_row: unsupported type or n not a multiple of its block");
    DUET_ROUTE(isa, quantize_row(t, src, dst, n));
}

void matmul(Isa isa, DType wtype, const void* w, size_t w_stride, int64_t n_in, const void* xq,
            size_t xq_stride, int n_tok, float* y, size_t ldy, int64_t r0, int64_t r1) {
    check_isa(isa);
    const bool ok = wtype == DType::F32 || wtype == DType::F16 || wtype == DType::BF16 || wtype == DType::Q4_0 ||
                    wtype == DType::Q4_1 || wtype == DType::Q5_0 || wtype == DType::Q5_1 || wtype == DType::Q8_0 ||
                    wtype == DType::Q4_K || wtype == DType::Q5_K || wtype == DType::Q6_K;
    if (!ok) kernel_fail("matmul: unsupported weight type");
    if (n_in <= 0 || n_in % dtype_block_elems(wtype) != 0) kernel_fail("matmul: n_in must be a positive multiple of the weight block");
    if (r1 <= r0 || n_tok <= 0) return;
#if defined(__x86_64__) && !defined(DUET_KERNELS_SCALAR_ONLY)
    if (isa == Isa::Amx) return amx::matmul(wtype, w, w_stride, n_in, xq, xq_stride, n_tok, y, ldy, r0, r1);
#endif
    DUET_ROUTE(isa, matmul(wtype, w, w_stride, n_in, xq, xq_stride, n_tok, y, ldy, r0, r1));
}

void rms_norm(Isa isa, const float* x, const float* w, float* y, int64_t n, float eps) {
    check_isa(isa);
    DUET_ROUTE(isa, rms_norm(x, w, y, n, eps));
}

void rope(Isa isa, float* x, int n_heads, int head_dim, int rot_dim, int64_t pos, const float* inv_freq) {
    check_isa(isa);
    if (rot_dim > head_dim || rot_dim % 2 != 0) kernel_fail("rope: rot_dim must be even and <= head_dim");
    DUET_ROUTE(isa, rope(x, n_heads, head_dim, rot_dim, pos, inv_freq));
}

void rope_neox(Isa isa, float* x, int n_heads, int head_dim, int rot_dim, int64_t pos, const float* inv_freq) {
    (void)isa;
    if (rot_dim > head_dim || rot_dim % 2 != 0) kernel_fail("rope_neox: rot_dim must be even and <= head_dim");
    scalar::rope_neox(x, n_heads, head_dim, rot_dim, pos, inv_freq);
}

void swiglu(Isa isa, const float* gate, const float* up, float* out, int64_t n) {
    check_isa(isa);
    DUET_ROUTE(isa, swiglu(gate, up, out, n));
}

void add(Isa isa, float* y, const float* x, int64_t n) {
    check_isa(isa);
    DUET_ROUTE(isa, add(y, x, n));
}

void softmax(Isa isa, float* x, int64_t n) {
    check_isa(isa);
    DUET_ROUTE(isa, softmax(x, n));
}

float dot_f32_f16(Isa isa, const float* a, const uint16_t* b, int64_t n) {
    check_isa(isa);
    DUET_ROUTE(isa, dot_f32_f16(a, b, n));
}

void axpy_f16(Isa isa, float a, const uint16_t* x, float* y, int64_t n) {
    check_isa(isa);
    DUET_ROUTE(isa, axpy_f16(a, x, y, n));
}

void fp32_to_fp16_row(Isa isa, const float* x, uint16_t* y, int64_t n) {
    check_isa(isa);
    DUET_ROUTE(isa, fp32_to_fp16_row(x, y, n));
}

void attn_scores_f16(Isa isa, const float* q, const uint16_t* k, size_t stride, int64_t n, int64_t head_dim,
                     float scale, float* scores) {
    check_isa(isa);
    DUET_ROUTE(isa, attn_scores_f16(q, k, stride, n, head_dim, scale, scores));
}

void attn_accum_f16(Isa isa, const float* p, const uint16_t* v, size_t stride, int64_t n, int64_t head_dim,
                    float* out) {
    check_isa(isa);
    DUET_ROUTE(isa, attn_accum_f16(p, v, stride, n, head_dim, out));
}

void attn_scores_f16_rows(Isa isa, const float* q, size_t q_stride, size_t q_head, int64_t heads, int64_t rows,
                          const int64_t* n, const uint16_t* k, size_t stride, int64_t head_dim, float scale,
                          float* scores, size_t s_stride) {
    check_isa(isa);
#if defined(__x86_64__) && !defined(DUET_KERNELS_SCALAR_ONLY)
    if (isa == Isa::Avx512 || isa == Isa::Amx)
        return avx512::attn_scores_f16_rows(q, q_stride, q_head, heads, rows, n, k, stride, head_dim, scale, scores,
                                            s_stride);
#endif
    for (int64_t g = 0; g < heads; ++g)
        for (int64_t r = 0; r < rows; ++r)
            if (n[r] > 0)
                attn_scores_f16(isa, q + g * q_head + r * q_stride, k, stride, n[r], head_dim, scale,
                                scores + (g * rows + r) * s_stride);
}

void attn_accum_f16_rows(Isa isa, const float* p, size_t p_stride, int64_t heads, int64_t rows, const int64_t* n,
                         const uint16_t* v, size_t stride, int64_t head_dim, float* out, size_t out_stride,
                         size_t out_head) {
    check_isa(isa);
#if defined(__x86_64__) && !defined(DUET_KERNELS_SCALAR_ONLY)
    if (isa == Isa::Avx512 || isa == Isa::Amx)
        return avx512::attn_accum_f16_rows(p, p_stride, heads, rows, n, v, stride, head_dim, out, out_stride, out_head);
#endif
    for (int64_t g = 0; g < heads; ++g)
        for (int64_t r = 0; r < rows; ++r)
            if (n[r] > 0)
                attn_accum_f16(isa, p + (g * rows + r) * p_stride, v, stride, n[r], head_dim,
                               out + g * out_head + r * out_stride);
}

float fp8_e4m3_to_fp32(uint8_t b) { return kFp8E4M3[b]; }

uint8_t fp32_to_fp8_e4m3(float f) {
    const uint32_t x = f32_bits(f);
    const auto sign = static_cast<uint8_t>((x >> 24) & 0x80u);
    const float a = std::fabs(f);
    if (std::isnan(a)) return 0x7F;
    if (a >= 448.0f) return sign | 0x7E;  // saturate (e4m3fn has no infinity)
    if (a < 0x1p-6f) {
        // Subnormal range: steps of 2^-9 (exact scaling); a rounded count of 8 is
        // the smallest normal, whose encoding (exponent 1, mantissa 0) is also 8.
        return sign | static_cast<uint8_t>(std::nearbyint(a * 512.0f));
    }
    int e2 = 0;
    std::frexp(a, &e2);  // a = f * 2^e2, f in [0.5, 1)
    int e = e2 - 1;      // a in [2^e, 2^(e+1))
    int m = static_cast<int>(std::nearbyint(std::ldexp(a, -e) * 8.0f)) - 8;  // exact scaling, ties to even
    if (m == 8) {
        m = 0;
        ++e;
    }
    if (e > 8 || (e == 8 && m > 6)) return sign | 0x7E;  // rounded past 448
    return sign | static_cast<uint8_t>(((e + 7) << 3) | m);
}

float quantize_kv_row(KvQuant t, const float* x, int64_t n, uint8_t* q) {
    float amax = 0.0f;
    for (int64_t i = 0; i < n; ++i) amax = std::fmax(amax, std::fabs(x[i]));
    const float top = t == KvQuant::Int8 ? 127.0f : 448.0f;
    const float inv = top / amax;
    if (std::isinf(amax) || std::isinf(inv)) {
        // Zeros (and values below ~1e-36, whose 1 / scale overflows): scale 0. A row
        // that overflowed: its values decode as NaN, as an f16 cache would give inf
        // and then NaN through the softmax.
        for (int64_t i = 0; i < n; ++i) q[i] = 0;
        return std::isinf(amax) ? std::numeric_limits<float>::quiet_NaN() : 0.0f;
    }
    const float scale = amax / top;
    for (int64_t i = 0; i < n; ++i) {
        const float v = x[i] * inv;
        if (t == KvQuant::Int8)
            q[i] = static_cast<uint8_t>(static_cast<int8_t>(std::fmax(-127.0f, std::fmin(127.0f, std::nearbyint(v)))));
        else
            q[i] = fp32_to_fp8_e4m3(v);
    }
    return scale;
}

void attn_scores_q(Isa isa, KvQuant t, const float* q, const uint8_t* k, const float* k_scale, size_t stride, int64_t n,
                   int64_t head_dim, float scale, float* scores) {
    check_isa(isa);
    DUET_ROUTE(isa, attn_scores_q(t, q, k, k_scale, stride, n, head_dim, scale, scores));
}

void attn_accum_q(Isa isa, KvQuant t, const float* p, const uint8_t* v, const float* v_scale, size_t stride, int64_t n,
                  int64_t head_dim, float* out) {
    check_isa(isa);
    DUET_ROUTE(isa, attn_accum_q(t, p, v, v_scale, stride, n, head_dim, out));
}

uint64_t read_fold(Isa isa, const void* p, size_t n) {
    check_isa(isa);
    DUET_ROUTE(isa, read_fold(p, n));
}

void round_fp16(Isa isa, float* x, int64_t n) {
    check_isa(isa);
    DUET_ROUTE(isa, round_fp16(x, n));
}

}  // namespace duet::cpu
