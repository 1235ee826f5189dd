#include "model/cpu_backend.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

namespace duet {

using cpu::Isa;

namespace {

// Batches of at most this many tokens run with replicated per-token work.
constexpr int64_t kReplicateTokens = 8;
// Attention reads each KV block once for up to this many rows of one sequence.
constexpr int64_t kAttnRows = 8;

// A growable 64-byte aligned buffer.
class Buf {
public:
    ~Buf() { std::free(p_); }
    void* get(size_t bytes) {
        if (bytes > cap_) {
            std::free(p_);
            cap_ = (bytes + 4095) / 4096 * 4096;
            p_ = std::aligned_alloc(64, cap_);
            if (!p_) std::abort();
        }
        return p_;
    }
    template <typename T>
    T* as() const { return static_cast<T*>(p_); }

private:
    void* p_ = nullptr;
    size_t cap_ = 0;
};

// Thread tid's attention items [*a0, *a1) of n_items = spans x n_head: contiguous
// runs with about equal shares of the work, not of the items. span_end[i] is the
// cost of spans 0..i (one head each); every head of a span costs the same. An
// even split by count gave a causal prompt's first half (a quarter of the keys
// read) to one thread and its second half to the other.
void split_items(const std::vector<int64_t>& span_end, int64_t n_head, int tid, int nth, int64_t* a0, int64_t* a1) {
    const int64_t n_items = static_cast<int64_t>(span_end.size()) * n_head;
    const int64_t total = span_end.empty() ? 0 : span_end.back() * n_head;
    // The cost of items before item `it`.
    auto before = [&](int64_t it) {
        if (it >= n_items) return total;
        const int64_t sp = it / n_head, h = it % n_head;
        const int64_t prev = sp == 0 ? 0 : span_end[static_cast<size_t>(sp - 1)];
        return prev * n_head + h * (span_end[static_cast<size_t>(sp)] - prev);
    };
    // The first item whose preceding cost reaches k / nth of the total.
    auto first_at = [&](int k) {
        if (k >= nth) return n_items;
        int64_t lo = 0, hi = n_items;
        while (lo < hi) {
            const int64_t mid = lo + (hi - lo) / 2;
            if (before(mid) * nth >= total * k) {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        return lo;
    };
    *a0 = first_at(tid);
    *a1 = first_at(tid + 1);
}

}  // namespace

// Per-forward state shared by the threads of one run().
struct CpuBackend::Scratch {
    // Inputs of the current pass, flattened over the batch.
    int64_t T = 0;                    // tokens in the batch
    std::vector<int32_t> tok;         // [T] token ids
    std::vector<int64_t> pos;         // [T] position of each token
    std::vector<int32_t> seq;         // [T] sequence index
    std::vector<const KvSeq*> seqs;   // per sequence
    std::vector<int64_t> out_rows;    // token indices whose logits are wanted
    // Attention's work items, times the heads: runs of consecutive tokens of one
    // sequence, at most kAttnRows long ({first token, count}).
    std::vector<std::pair<int64_t, int64_t>> spans;
    std::vector<int64_t> span_end;  // keys the spans' rows read, spans 0..i (split_items)
    // Query heads per attention item: those of one KV head (an f16 cache converts
    // each block once for them all) where that leaves every thread four items or
    // more, else one (a lone sequence's 9 heads split 5 / 4 over two threads, its
    // 3 groups 2 / 1).
    int64_t heads_per_item = 1;
    float* logits = nullptr;

    // x, xn, hs and xq hold one copy per thread when `replicate` (see run()).
    // x_out / att_out: the rows of x / att that the last layer keeps (see run()),
    // x_out also per thread when `replicate`.
    Buf x, xn, hs, q, k, v, att, tmp, gate, up, xq, scores, x_out, att_out;
    bool replicate = false;
    size_t xq_stride = 0;
    int64_t scores_n = 0;  // floats of attention scores per row ([kAttnRows x group][threads] rows)
    // set_interrupt's check, for this pass (null: none); stop[l]: stop before layer
    // l (written by thread 0 before the last barrier of layer l - 1, read by every
    // thread after it).
    const std::function<bool()>* interrupt = nullptr;
    std::vector<uint8_t> stop;
};

CpuBackend::CpuBackend(const Model& model, KvPool& pool, ThreadPool& threads, Isa isa)
    : model_(model), pool_(pool), threads_(threads), isa_(isa), s_(std::make_unique<Scratch>()) {
    // Quantized activations: rows as wide as the widest any matrix of the model takes.
    size_t xq_stride = 0;
    auto widen = [&](const GgufTensor* w) {
        if (w) xq_stride = std::max(xq_stride, dtype_row_bytes(cpu::vec_dot_type(w->type), w->ne[0]));
    };
    for (int64_t l = 0; l < model.config().n_layer; ++l) {
        const LayerWeights& w = model.layer(l);
        for (const GgufTensor* m : {w.wq, w.wk, w.wv, w.wo, w.w_gate, w.w_up, w.w_down}) widen(m);
    }
    widen(&model.output());
    s_->xq_stride = (xq_stride + 63) / 64 * 64;
}

CpuBackend::~CpuBackend() = default;

int64_t CpuBackend::n_vocab() const { return model_.config().n_vocab; }

Status CpuBackend::forward_export(std::span<SeqBatch> batch, std::vector<float>& logits, const KvExport& exp) {
    if (exp.dest.size() != batch.size() || exp.dst_ids.size() != batch.size())
        return make_error("forward_export: {} destinations for {} sequences", exp.dest.size(), batch.size());
    std::vector<int64_t> before(batch.size());
    for (size_t s = 0; s < batch.size(); ++s) before[s] = batch[s].kv ? batch[s].kv->n_tokens() : 0;
    if (Status st = forward(batch, logits); !st) return st;
    std::vector<ExportSeq> seqs;
    for (const SeqBatch& b : batch) seqs.push_back({b.kv->blocks(), b.kv->n_tokens()});
    auto plan = plan_export(pool_.layout(), pool_.allocator().n_blocks(), exp, seqs);
    if (!plan) {
        for (size_t s = 0; s < batch.size(); ++s) batch[s].kv->truncate(pool_, before[s]);  // as before the call
        return plan.error();
    }
    const auto* src = reinterpret_cast<const uint8_t*>(pool_.data());
    for (size_t d = 0; d < plan->size(); ++d) {
        auto* dst = reinterpret_cast<uint8_t*>(exp.dests[d].data);
        for (const std::vector<CopyRun>& layer : (*plan)[d])
            for (const CopyRun& r : layer) std::memcpy(dst + r.dst, src + r.src, r.bytes);
    }
    return {};
}

Status CpuBackend::forward(std::span<SeqBatch> batch, std::vector<float>& logits) {
    Scratch& s = *s_;
    const ModelConfig& c = model_.config();
    int64_t T = 0;
    int64_t n_out = 0;
    for (const SeqBatch& b : batch) {
        if (!b.kv || b.n_tokens < 0 || (b.n_tokens > 0 && !b.tokens))
            return make_error("forward: malformed batch entry");
        for (int32_t i = 0; i < b.n_tokens; ++i)
            if (b.tokens[i] < 0 || b.tokens[i] >= c.n_vocab)
                return make_error("token id {} is out of range (vocabulary of {})", b.tokens[i], c.n_vocab);
        T += b.n_tokens;
        n_out += b.output_rows();
    }
    // Room for the new positions, all or nothing.
    size_t prepared = 0;
    for (; prepared < batch.size(); ++prepared) {
        SeqBatch& b = batch[prepared];
        const int64_t from = b.kv->n_tokens();
        if (Status st = b.kv->prepare_append(pool_, from, from + b.n_tokens); !st) {
            for (size_t j = 0; j < prepared; ++j) batch[j].kv->truncate(pool_, batch[j].kv->n_tokens());
            return st;
        }
    }
    logits.resize(static_cast<size_t>(n_out * c.n_vocab));
    if (T == 0) return {};

    s.T = T;
    s.tok.resize(T);
    s.pos.resize(T);
    s.seq.resize(T);
    s.seqs.resize(batch.size());
    s.out_rows.clear();
    int64_t t = 0;
    for (size_t i = 0; i < batch.size(); ++i) {
        const SeqBatch& b = batch[i];
        s.seqs[i] = b.kv;
        for (int32_t j = 0; j < b.n_tokens; ++j, ++t) {
            s.tok[t] = b.tokens[j];
            s.pos[t] = b.kv->n_tokens() + j;
            s.seq[t] = static_cast<int32_t>(i);
            if (b.all_logits || j == b.n_tokens - 1) s.out_rows.push_back(t);
        }
    }
    s.logits = logits.data();

    const int64_t E = c.n_embd, Q = c.n_head * c.head_dim, KV = c.n_head_kv * c.head_dim, F = c.n_ff;
    // Few tokens: every thread keeps private copies of the per-token state.
    s.replicate = T <= kReplicateTokens && threads_.size() > 1;
    const size_t copies = s.replicate ? static_cast<size_t>(threads_.size()) : 1;
    s.x.get(sizeof(float) * copies * T * E);
    s.xn.get(sizeof(float) * copies * T * E);
    s.hs.get(sizeof(float) * copies * T * F);
    s.q.get(sizeof(float) * T * Q);
    s.k.get(sizeof(float) * T * KV);
    s.v.get(sizeof(float) * T * KV);
    s.att.get(sizeof(float) * T * Q);
    s.tmp.get(sizeof(float) * T * E);
    s.gate.get(sizeof(float) * T * F);
    s.up.get(sizeof(float) * T * F);
    s.xq.get(s.xq_stride * copies * T);
    if (const int64_t n_out = static_cast<int64_t>(s.out_rows.size()); n_out < T) {
        s.x_out.get(sizeof(float) * copies * n_out * E);
        s.att_out.get(sizeof(float) * n_out * Q);
    }
    int64_t max_ctx = 0;
    for (const SeqBatch& b : batch) max_ctx = std::max(max_ctx, b.kv->n_tokens() + b.n_tokens);
    s.scores_n = (max_ctx + 15) / 16 * 16;
    // Spans as long as leave every thread four items or more; any length gives
    // the same results (see run()).
    int64_t span_rows = kAttnRows;
    const int64_t min_items = 4 * static_cast<int64_t>(threads_.size());
    while (span_rows > 1 && (T + span_rows - 1) / span_rows * c.n_head < min_items) span_rows /= 2;
    s.spans.clear();
    s.span_end.clear();
    for (int64_t i = 0, cost = 0; i < T;) {
        int64_t n = 1;
        while (n < span_rows && i + n < T && s.seq[i + n] == s.seq[i]) ++n;
        s.spans.emplace_back(i, n);
        for (int64_t r = i; r < i + n; ++r) cost += s.pos[r] + 1;
        s.span_end.push_back(cost);
        i += n;
    }
    const bool group_heads =
        !pool_.layout().quantized() && static_cast<int64_t>(s.spans.size()) * c.n_head_kv >= min_items;
    s.heads_per_item = group_heads ? c.n_head / c.n_head_kv : 1;
    // Rows of scores per thread: an item's rows, times its heads.
    s.scores.get(sizeof(float) * threads_.size() * kAttnRows * static_cast<size_t>(s.heads_per_item) * s.scores_n);

    s.interrupt = interrupt_ ? &interrupt_ : nullptr;
    s.stop.assign(static_cast<size_t>(c.n_layer) + 1, 0);

    threads_.run([this](int tid, int nth) { run(tid, nth); });

    if (s.interrupt) {
        s.interrupt = nullptr;
        const auto at = std::find(s.stop.begin(), s.stop.end(), uint8_t{1});
        if (at != s.stop.end()) {
            // As before the call: the blocks prepared for the new positions go back
            // (a caller's reservation included, as when prepare_append fails).
            for (SeqBatch& b : batch) b.kv->truncate(pool_, b.kv->n_tokens());
            return make_error(ErrorKind::Interrupted, "the pass was stopped before layer {} of {}",
                              at - s.stop.begin(), c.n_layer);
        }
    }
    for (SeqBatch& b : batch) b.kv->set_n_tokens(b.kv->n_tokens() + b.n_tokens);
    return {};
}

void CpuBackend::run(int tid, int nth) {
    Scratch& s = *s_;
    const ModelConfig& c = model_.config();
    const Isa isa = isa_;
    const int64_t T = s.T;
    const int64_t E = c.n_embd, HD = c.head_dim, NH = c.n_head, NKV = c.n_head_kv;
    const int64_t Q = NH * HD, KV = NKV * HD, F = c.n_ff;
    const int64_t group = NH / NKV;
    const float eps = static_cast<float>(c.rms_eps);
    const float scale = 1.0f / std::sqrt(static_cast<float>(HD));
    const int32_t bt = pool_.layout().block_tokens;
    const bool quant = pool_.layout().quantized();
    const cpu::KvQuant qt = pool_.layout().dtype == KvDtype::Fp8 ? cpu::KvQuant::Fp8 : cpu::KvQuant::Int8;
    const size_t xqs = s.xq_stride;

    // Two ways to share the per-token work (norms, quantization, residuals):
    // with few tokens (decode), every thread does all of it on private copies, so
    // only the matrix products, the KV write and attention need barriers; with many
    // (prefill), threads split the tokens and meet at a barrier before each
    // product. Either way each token's values are computed by the same code in the
    // same order, so the choice never changes a result.
    const bool rep = s.replicate;
    int64_t t0, t1;  // this thread's tokens for shared writes
    ThreadPool::split(T, tid, nth, t0, t1);
    int64_t r0 = rep ? 0 : t0, r1 = rep ? T : t1;  // rows of the per-token work
    int64_t rows_in = T;                           // rows the products take
    const size_t priv = rep ? static_cast<size_t>(tid) : 0;
    float* x = s.x.as<float>() + priv * T * E;
    float* xn = s.xn.as<float>() + priv * T * E;
    float* hs = s.hs.as<float>() + priv * T * F;
    char* xq = s.xq.as<char>() + priv * T * xqs;
    float* q = s.q.as<float>();
    float* k = s.k.as<float>();
    float* v = s.v.as<float>();
    float* att = s.att.as<float>();
    const int64_t n_out = static_cast<int64_t>(s.out_rows.size());
    bool pruned = false;  // x's row r is output row r (else token s.out_rows[r])
    float* tmp = s.tmp.as<float>();
    float* gate = s.gate.as<float>();
    float* up = s.up.as<float>();
    auto sync_rows = [&] {
        if (!rep) threads_.barrier();
    };

    // Quantizes rows [r0, r1) of src (n values each) for products with w.
    auto quantize = [&](const float* src, int64_t n, const GgufTensor* w) {
        const DType vt = cpu::vec_dot_type(w->type);
        for (int64_t i = r0; i < r1; ++i) cpu::quantize_row(isa, vt, src + i * n, xq + i * xqs, n);
    };
    // y[n_tok][rows of w] = w · xq, this thread's share of the rows of w.
    auto matmul_n = [&](const GgufTensor* w, float* y, int64_t n_tok) {
        const int64_t rows = w->ne[1];
        int64_t w0, w1;
        ThreadPool::split(rows, tid, nth, w0, w1, 16);
        if (w0 < w1)
            cpu::matmul(isa, w->type, w->data, w->row_bytes(), w->ne[0], xq, xqs, static_cast<int>(n_tok), y,
                        static_cast<size_t>(rows), w0, w1);
    };
    auto matmul = [&](const GgufTensor* w, float* y) { matmul_n(w, y, rows_in); };
    // Products of the same input with two matrices, re-quantizing between them
    // only when their activation types differ.
    auto requantize_if = [&](const GgufTensor* prev, const GgufTensor* next, const float* src, int64_t n) {
        if (cpu::vec_dot_type(next->type) == cpu::vec_dot_type(prev->type)) return;
        threads_.barrier();  // every thread is done reading xq
        quantize(src, n, next);
        sync_rows();
    };
    auto f32 = [](const GgufTensor* t) { return reinterpret_cast<const float*>(t->data); };

    const GgufTensor& emb = model_.tok_embd();
    for (int64_t i = r0; i < r1; ++i)
        cpu::dequantize_row(emb.type, emb.data + static_cast<size_t>(s.tok[i]) * emb.row_bytes(), x + i * E, E);

    for (int64_t l = 0; l < c.n_layer; ++l) {
        if (s.stop[static_cast<size_t>(l)]) return;  // every thread alike (see stop)
        const LayerWeights& w = model_.layer(l);
        const int32_t li = static_cast<int32_t>(l);

        // q, k, v projections of the normed residual.
        for (int64_t i = r0; i < r1; ++i) cpu::rms_norm(isa, x + i * E, f32(w.attn_norm), xn + i * E, E, eps);
        quantize(xn, E, w.wq);
        sync_rows();
        matmul(w.wq, q);
        requantize_if(w.wq, w.wk, xn, E);
        matmul(w.wk, k);
        requantize_if(w.wk, w.wv, xn, E);
        matmul(w.wv, v);
        threads_.barrier();

        // Bias, RoPE, and this token's K/V into its KV block (f16, or quantized with
        // a scale per row). Attention then reads every position, this one included,
        // from the cache, so a token's result does not depend on whether its
        // neighbours came in the same chunk.
        auto rope = c.rope_neox ? cpu::rope_neox : cpu::rope;
        for (int64_t i = t0; i < t1; ++i) {
            float* qi = q + i * Q;
            float* ki = k + i * KV;
            float* vi = v + i * KV;
            if (w.bq) {
                cpu::add(isa, qi, f32(w.bq), Q);
                cpu::add(isa, ki, f32(w.bk), KV);
                cpu::add(isa, vi, f32(w.bv), KV);
            }
            rope(isa, qi, static_cast<int>(NH), static_cast<int>(HD), static_cast<int>(c.rot_dim), s.pos[i],
                 model_.rope_inv_freq().data());
            rope(isa, ki, static_cast<int>(NKV), static_cast<int>(HD), static_cast<int>(c.rot_dim), s.pos[i],
                 model_.rope_inv_freq().data());
            // Q is rounded to f16 like the K it meets (llama.cpp's CPU path and
            // flash-attention kernels do the same), so duet agrees with them closely.
            cpu::round_fp16(isa, qi, Q);
            const int32_t blk = s.seqs[s.seq[i]]->blocks()[s.pos[i] / bt];
            const int64_t slot = s.pos[i] % bt;
            for (int32_t h = 0; h < NKV; ++h) {
                if (!quant) {
                    cpu::fp32_to_fp16_row(isa, ki + h * HD, pool_.k16(blk, li, h) + slot * HD, HD);
                    cpu::fp32_to_fp16_row(isa, vi + h * HD, pool_.v16(blk, li, h) + slot * HD, HD);
                } else {
                    pool_.k_scales(blk, li, h)[slot] = cpu::quantize_kv_row(qt, ki + h * HD, HD, pool_.k(blk, li, h) + slot * HD);
                    pool_.v_scales(blk, li, h)[slot] = cpu::quantize_kv_row(qt, vi + h * HD, HD, pool_.v(blk, li, h) + slot * HD);
                }
            }
        }
        threads_.barrier();

        // Attention: one (span, heads) item at a time, a span being up to kAttnRows
        // consecutive tokens of one sequence (a verify row, a prefill chunk), the
        // heads those of one KV head on an f16 cache (`hpi` of them: each KV block is
        // converted once for them all), one head on a quantized one: each KV block
        // (16 positions) is read once for all the item's rows that reach it. Every
        // (token, head) still meets its positions in order through the same
        // arithmetic, one block per call, so its result is what it would be alone.
        {
            const int64_t hpi = s.heads_per_item;
            int64_t a0, a1;
            split_items(s.span_end, NH / hpi, tid, nth, &a0, &a1);
            // Row r of this thread's span at [r][tid]: the threads' first rows side by
            // side, as when every item was one row (measured: a decode step of a
            // Llama-3-8B-shaped Q6_K slice ran 9% slower with each thread's rows
            // together, the first rows kAttnRows apart, on a 2-vCPU Zen 4).
            float* sc = s.scores.as<float>() + static_cast<size_t>(tid) * s.scores_n;
            const size_t row_step = static_cast<size_t>(nth) * s.scores_n;
            for (int64_t it = a0; it < a1; ++it) {
                const auto [first, rows] = s.spans[static_cast<size_t>(it / (NH / hpi))];
                const int64_t h = it % (NH / hpi) * hpi;  // the item's first head
                const int32_t kvh = static_cast<int32_t>(h / group);
                const std::vector<int32_t>& blocks = s.seqs[s.seq[first]]->blocks();
                // Positions grow along a span: its last row sees the most.
                const int64_t n_max = s.pos[first + rows - 1] + 1;
                auto n_ctx = [&](int64_t r) { return s.pos[first + r] + 1; };
                auto row_sc = [&](int64_t r) { return sc + static_cast<size_t>(r) * row_step; };
                // The keys of block j each row sees (0: none yet).
                int64_t seen[kAttnRows];
                auto block_keys = [&](int64_t j) {
                    for (int64_t r = 0; r < rows; ++r) seen[r] = std::clamp<int64_t>(n_ctx(r) - j, 0, bt);
                };
                for (int64_t j = 0; j < n_max; j += bt) {
                    const int32_t b = blocks[j / bt];
                    if (!quant) {  // the block's keys converted once for the item's heads and rows
                        block_keys(j);
                        cpu::attn_scores_f16_rows(isa, q + first * Q + h * HD, static_cast<size_t>(Q),
                                                  static_cast<size_t>(HD), hpi, rows, seen, pool_.k16(b, li, kvh), HD,
                                                  HD, scale, row_sc(0) + j, row_step);
                        continue;
                    }
                    for (int64_t r = 0; r < rows; ++r) {
                        if (j >= n_ctx(r)) continue;
                        const int64_t n = std::min<int64_t>(bt, n_ctx(r) - j);
                        const float* qh = q + (first + r) * Q + h * HD;
                        cpu::attn_scores_q(isa, qt, qh, pool_.k(b, li, kvh), pool_.k_scales(b, li, kvh), HD, n, HD,
                                           scale, row_sc(r) + j);
                    }
                }
                // Head h + g's row r: scores row g * rows + r.
                for (int64_t g = 0; g < hpi; ++g)
                    for (int64_t r = 0; r < rows; ++r) {
                        cpu::softmax(isa, row_sc(g * rows + r), n_ctx(r));
                        // Probabilities meet f16 V rows: rounded to f16 as llama.cpp does.
                        cpu::round_fp16(isa, row_sc(g * rows + r), n_ctx(r));
                        std::memset(att + (first + r) * Q + (h + g) * HD, 0, sizeof(float) * HD);
                    }
                for (int64_t j = 0; j < n_max; j += bt) {
                    const int32_t b = blocks[j / bt];
                    if (!quant) {
                        block_keys(j);
                        cpu::attn_accum_f16_rows(isa, row_sc(0) + j, row_step, hpi, rows, seen, pool_.v16(b, li, kvh),
                                                 HD, HD, att + first * Q + h * HD, static_cast<size_t>(Q),
                                                 static_cast<size_t>(HD));
                        continue;
                    }
                    for (int64_t r = 0; r < rows; ++r) {
                        if (j >= n_ctx(r)) continue;
                        const int64_t n = std::min<int64_t>(bt, n_ctx(r) - j);
                        float* out = att + (first + r) * Q + h * HD;
                        cpu::attn_accum_q(isa, qt, row_sc(r) + j, pool_.v(b, li, kvh), pool_.v_scales(b, li, kvh), HD,
                                          n, HD, out);
                    }
                }
            }
        }
        threads_.barrier();

        // The last layer's output projection and MLP serve only the rows whose
        // logits are wanted (a prompt's last token): the other rows' K and V
        // are written and nothing reads their results. llama.cpp prunes the
        // same rows. Each kept row's values come from the same row-wise
        // operations, so its logits are unchanged.
        if (l == c.n_layer - 1 && n_out < T) {  // n_out >= 1: every entry's last row
            float* x_out = s.x_out.as<float>() + priv * n_out * E;
            float* att_out = s.att_out.as<float>();
            int64_t o0, o1;
            ThreadPool::split(n_out, tid, nth, o0, o1);
            for (int64_t r = rep ? 0 : o0; r < (rep ? n_out : o1); ++r)
                std::memcpy(x_out + r * E, x + s.out_rows[static_cast<size_t>(r)] * E, sizeof(float) * E);
            for (int64_t r = o0; r < o1; ++r)
                std::memcpy(att_out + r * Q, att + s.out_rows[static_cast<size_t>(r)] * Q, sizeof(float) * Q);
            threads_.barrier();
            x = x_out;
            att = att_out;
            rows_in = n_out;
            r0 = rep ? 0 : o0;
            r1 = rep ? n_out : o1;
            pruned = true;
        }

        // Output projection.
        quantize(att, Q, w.wo);
        sync_rows();
        matmul(w.wo, tmp);
        threads_.barrier();

        // Residual, then the MLP block.
        for (int64_t i = r0; i < r1; ++i) {
            cpu::add(isa, x + i * E, tmp + i * E, E);
            cpu::rms_norm(isa, x + i * E, f32(w.ffn_norm), xn + i * E, E, eps);
        }
        quantize(xn, E, w.w_gate);
        sync_rows();
        matmul(w.w_gate, gate);
        requantize_if(w.w_gate, w.w_up, xn, E);
        matmul(w.w_up, up);
        threads_.barrier();
        for (int64_t i = r0; i < r1; ++i) cpu::swiglu(isa, gate + i * F, up + i * F, hs + i * F, F);
        quantize(hs, F, w.w_down);
        sync_rows();
        matmul(w.w_down, tmp);
        // Stop before the next layer? Only in the pass's first half (Backend::set_interrupt).
        if (tid == 0 && s.interrupt && 2 * (l + 1) <= c.n_layer && (*s.interrupt)())
            s.stop[static_cast<size_t>(l) + 1] = 1;
        threads_.barrier();
        for (int64_t i = r0; i < r1; ++i) cpu::add(isa, x + i * E, tmp + i * E, E);
    }

    // Output head for the rows whose logits are wanted; output row r is packed at
    // row r of xn / xq.
    sync_rows();  // split: x rows change hands (tokens above, output rows below)
    const GgufTensor* out = &model_.output();
    int64_t o0 = 0, o1 = n_out;
    if (!rep) ThreadPool::split(n_out, tid, nth, o0, o1);
    const DType vt = cpu::vec_dot_type(out->type);
    for (int64_t r = o0; r < o1; ++r) {
        const int64_t xr = pruned ? r : s.out_rows[static_cast<size_t>(r)];
        cpu::rms_norm(isa, x + xr * E, f32(&model_.output_norm()), xn + r * E, E, eps);
        cpu::quantize_row(isa, vt, xn + r * E, xq + r * xqs, E);
    }
    sync_rows();
    matmul_n(out, s.logits, n_out);
}

}  // namespace duet
