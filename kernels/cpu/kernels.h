// CPU compute kernels, dispatched by instruction set at run time.
//
// Every function takes the Isa to use; the caller picks one per process
// (isa_best(), or a lower level for tests) and keeps it. All results for one
// output element are computed in an order that depends only on the Isa and the
// reduction length: never on how many rows or tokens are in the call, nor on the
// row range a thread was given. That is what makes a sequence's logits the same
// whatever batch it runs in and however its tokens were chunked.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/cpu/quant_types.h"

namespace duet::cpu {

enum class Isa : int {
    Scalar = 0,  // portable C++, the reference the SIMD levels are tested against
    Avx2 = 1,    // AVX2 + FMA + F16C
    Avx512 = 2,  // AVX-512 F/BW/VL/DQ + VNNI
    // Avx512 with AMX-TILE + AMX-INT8 (and the tile state granted by the OS): the
    // AVX-512 level's numbers bit for bit, its quantized products for 16+ tokens on
    // tiles. Not a level of its own results: it and Avx512 agree on every output.
    Amx = 3,
};

const char* isa_name(Isa isa);
bool isa_supported(Isa isa);  // by this CPU and this build
Isa isa_best();               // the highest supported level

// IEEE half and bfloat16 conversions (round to nearest even).
float fp16_to_fp32(uint16_t h);
uint16_t fp32_to_fp16(float f);
float bf16_to_fp32(uint16_t h);
uint16_t fp32_to_bf16(float f);

// Rows of n values of type t to float (any supported type; scalar code).
void dequantize_row(DType t, const void* src, float* dst, int64_t n);
// Float to a storage type (F32, F16, BF16, Q4_0, Q4_1, Q8_0, Q8_1, Q8_K); used to
// build test weights and to quantize activations.
void quantize_row(Isa isa, DType t, const float* src, void* dst, int64_t n);

// The type activations are quantized to before a product with weights of type w:
// Q8_0 for Q4_0, Q5_0 and Q8_0, Q8_1 for Q4_1 and Q5_1, Q8_K for the K-quants,
// F32 otherwise.
DType vec_dot_type(DType w);

// y[t * ldy + r] = sum_k W[r][k] * X[t][k] for r in [r0, r1), t in [0, n_tok).
// W row r starts at (const char*)w + r * w_stride; it holds n_in values of wtype.
// X row t starts at (const char*)xq + t * xq_stride and holds n_in values of
// vec_dot_type(wtype), produced by quantize_row with the same isa.
void matmul(Isa isa, DType wtype, const void* w, size_t w_stride, int64_t n_in,
            const void* xq, size_t xq_stride, int n_tok, float* y, size_t ldy,
            int64_t r0, int64_t r1);

// y = x / sqrt(mean(x^2) + eps) * w
void rms_norm(Isa isa, const float* x, const float* w, float* y, int64_t n, float eps);

// Rotary embedding, llama "normal" pairing: for each of n_heads heads of head_dim
// values in x, rotate pairs (x[2i], x[2i+1]) for i < rot_dim / 2 by angle
// pos * inv_freq[i]. Pairs past rot_dim are left alone.
void rope(Isa isa, float* x, int n_heads, int head_dim, int rot_dim, int64_t pos,
          const float* inv_freq);
// The same rotation with NEOX pairing: (x[i], x[i + rot_dim/2]) for i < rot_dim/2
// (Qwen2 and other models whose q/k weights GGUF leaves unpermuted).
void rope_neox(Isa isa, float* x, int n_heads, int head_dim, int rot_dim, int64_t pos,
               const float* inv_freq);

// out = silu(gate) * up
void swiglu(Isa isa, const float* gate, const float* up, float* out, int64_t n);

// y += x
void add(Isa isa, float* y, const float* x, int64_t n);

// In place: x = exp(x - max) / sum; returns nothing, handles -inf entries.
void softmax(Isa isa, float* x, int64_t n);

// Attention helpers over f16 KV rows.
float dot_f32_f16(Isa isa, const float* a, const uint16_t* b, int64_t n);
void axpy_f16(Isa isa, float a, const uint16_t* x, float* y, int64_t n);  // y += a*x
void fp32_to_fp16_row(Isa isa, const float* x, uint16_t* y, int64_t n);

// The same over n KV rows of one head at once (row j starts at k + j * stride,
// in elements, and holds head_dim values), saving a call per key. Results are
// bit-identical to the one-row forms:
//   scores[j] = scale * dot_f32_f16(isa, q, k_j, head_dim)
//   out: axpy_f16(isa, p[j], v_j, out, head_dim) for j = 0, 1, ..., n - 1 in order
void attn_scores_f16(Isa isa, const float* q, const uint16_t* k, size_t stride, int64_t n, int64_t head_dim,
                     float scale, float* scores);
void attn_accum_f16(Isa isa, const float* p, const uint16_t* v, size_t stride, int64_t n, int64_t head_dim,
                    float* out);
// The same for the rows of a span that read one KV block (a prefill chunk, a verify
// row), for `heads` query heads that share the block's KV head (grouped-query
// attention): head g's row r has its query at q + g * q_head + r * q_stride, meets
// the block's first n[r] keys (0: none), its scores at scores + (g * rows + r) *
// s_stride; its probabilities at p + (g * rows + r) * p_stride weigh the first n[r]
// values into out + g * out_head + r * out_stride. Each (head, row)'s results are
// bit for bit what attn_scores_f16 / attn_accum_f16 give it alone; the AVX-512
// level converts the block's f16 values once for all of them, and interleaves up to
// three of them's value sums (each a chain of dependent fmas).
void attn_scores_f16_rows(Isa isa, const float* q, size_t q_stride, size_t q_head, int64_t heads, int64_t rows,
                          const int64_t* n, const uint16_t* k, size_t stride, int64_t head_dim, float scale,
                          float* scores, size_t s_stride);
void attn_accum_f16_rows(Isa isa, const float* p, size_t p_stride, int64_t heads, int64_t rows, const int64_t* n,
                         const uint16_t* v, size_t stride, int64_t head_dim, float* out, size_t out_stride,
                         size_t out_head);

// Quantized KV rows (src/kv/kv_pool.h KvDtype): a row of n values is n bytes and
// one f32 scale, value = scale * decode(byte).
enum class KvQuant : int {
    Int8 = 1,  // decode: the signed byte; stored = round(x / scale), scale = max |x| / 127
    Fp8 = 2,   // decode: e4m3 ("fn": no infinities, max 448, 0x7f/0xff NaN); scale = max |x| / 448
};
float fp8_e4m3_to_fp32(uint8_t b);
// Round to nearest even, saturating to +-448 (CUDA's __NV_SATFINITE); NaN -> 0x7f.
uint8_t fp32_to_fp8_e4m3(float f);
// Writes the n values of x as bytes into q and returns the row's scale (0 for a row
// of zeros). Scalar code: the same bits as the CUDA KV append.
float quantize_kv_row(KvQuant t, const float* x, int64_t n, uint8_t* q);
// The attention helpers over n quantized rows (row j at k + j * stride bytes, its
// scale k_scale[j]):
//   scores[j] = scale * (k_scale[j] * dot(q, decode(k_j)))
//   out += (p[j] * v_scale[j]) * decode(v_j) for j = 0, 1, ..., n - 1 in order
void attn_scores_q(Isa isa, KvQuant t, const float* q, const uint8_t* k, const float* k_scale, size_t stride, int64_t n,
                   int64_t head_dim, float scale, float* scores);
void attn_accum_q(Isa isa, KvQuant t, const float* p, const uint8_t* v, const float* v_scale, size_t stride, int64_t n,
                  int64_t head_dim, float* out);

// x = fp16_to_fp32(fp32_to_fp16(x)) elementwise: values meeting f16 data are
// rounded like it (round to nearest even; identical bits at every level).
void round_fp16(Isa isa, float* x, int64_t n);

// Reads n bytes at p with the widest loads this level has and returns an xor
// fold of them (so the reads cannot be optimized away): the memory-read floor
// that benchmarks compare the model's weight reads against.
uint64_t read_fold(Isa isa, const void* p, size_t n);

}  // namespace duet::cpu
