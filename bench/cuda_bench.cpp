#include "bench/cuda_bench.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <random>

#include "cuda/cuda_backend.h"
#include "cuda/cuda_kv_io.h"
#include "cuda/cuda_util.h"
#include "kernels/cuda/gemm.h"
#include "model/bf16_weights.h"
#include "kernels/cuda/qgemv.h"
#include "kv/kv_copy.h"
#include "kv/kv_pool.h"
#include "kv/kv_stage.h"
#include "model/cpu_backend.h"
#include "model/model.h"

namespace duet {

namespace {

double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

struct Timer {
    cudaEvent_t a = nullptr, b = nullptr;
    Timer() {
        cudaEventCreate(&a);
        cudaEventCreate(&b);
    }
    ~Timer() {
        cudaEventDestroy(a);
        cudaEventDestroy(b);
    }
    void start(cudaStream_t s) { cudaEventRecord(a, s); }
    // Milliseconds since start(), once the stream has reached this point.
    float stop(cudaStream_t s) {
        cudaEventRecord(b, s);
        cudaEventSynchronize(b);
        float ms = 0;
        cudaEventElapsedTime(&ms, a, b);
        return ms;
    }
};

// Bytes per second of a 1 GiB device-to-device copy, counting the read and the write.
Result<double> hbm_bandwidth(cudaStream_t s) {
    const size_t bytes = size_t{1} << 30;
    DevBuf a, b;
    for (DevBuf* m : {&a, &b})
        if (Status st = m->reserve(bytes); !st) return st.error();
    DUET_CUDA_TRY(cudaMemsetAsync(a.as<void>(), 1, bytes, s));
    DUET_CUDA_TRY(cudaMemcpyAsync(b.as<void>(), a.as<void>(), bytes, cudaMemcpyDeviceToDevice, s));
    Timer t;
    constexpr int kReps = 10;
    t.start(s);
    for (int i = 0; i < kReps; ++i)
        DUET_CUDA_TRY(cudaMemcpyAsync(b.as<void>(), a.as<void>(), bytes, cudaMemcpyDeviceToDevice, s));
    const double sec = t.stop(s) / 1e3;
    DUET_CUDA_TRY(cudaGetLastError());
    return 2.0 * static_cast<double>(bytes) * kReps / sec;
}

// FLOP/s of an 8192^3 bf16 product through the backend's own Gemm.
Result<double> bf16_peak(cudaStream_t s) {
    constexpr int N = 8192;
    DevBuf w, x, y, ws;
    for (auto [m, bytes] : {std::pair{&w, size_t{N} * N * 2}, std::pair{&x, size_t{N} * N * 2},
                            std::pair{&y, size_t{N} * N * 4}, std::pair{&ws, size_t{32} << 20}})
        if (Status st = m->reserve(bytes); !st) return st.error();
    DUET_CUDA_TRY(cudaMemsetAsync(w.as<void>(), 0x3c, size_t{N} * N * 2, s));  // bf16 0x3c3c: 0.0115, finite
    DUET_CUDA_TRY(cudaMemsetAsync(x.as<void>(), 0x3c, size_t{N} * N * 2, s));
    cuda::Gemm g;
    std::string err;
    if (!g.init(&err) || !g.set_workspace(ws.as<void>(), size_t{32} << 20, &err)) return make_error("{}", err);
    auto run = [&]() { return g.linear(w.as<uint16_t>(), N, N, x.as<uint16_t>(), N, y.as<float>(), N, s, &err); };
    if (!run() || !run()) return make_error("{}", err);
    Timer t;
    constexpr int kReps = 10;
    t.start(s);
    for (int i = 0; i < kReps; ++i)
        if (!run()) return make_error("{}", err);
    const double sec = t.stop(s) / 1e3;
    return 2.0 * N * static_cast<double>(N) * N * kReps / sec;
}

std::vector<int32_t> synthetic_tokens(size_t n, int64_t n_vocab, uint64_t salt) {
    std::vector<int32_t> v(n);
    for (size_t i = 0; i < n; ++i) v[i] = static_cast<int32_t>((i * 7919 + salt * 104729 + 17) % static_cast<uint64_t>(n_vocab));
    return v;
}

// Parameters of the matrices a token multiplies through (all layers + the output head).
double matrix_params(const Model& m) {
    double n = static_cast<double>(m.output().ne[0]) * static_cast<double>(m.output().ne[1]);
    for (int64_t l = 0; l < m.config().n_layer; ++l) {
        const LayerWeights& w = m.layer(l);
        for (const GgufTensor* t : {w.wq, w.wk, w.wv, w.wo, w.w_gate, w.w_up, w.w_down})
            n += static_cast<double>(t->ne[0]) * static_cast<double>(t->ne[1]);
    }
    return n;
}

// The decode projections two ways, on the model's own matrices (layer 0's seven
// and the output head, all layers counted): cuBLAS over the bf16 copy (what the
// backend runs) against the quantized GEMV over GGUF's blocks (kernels/cuda
// qgemv.h), at 1, 2, 4 and 8 tokens, each the median of 50 timed launches, with
// each side's floor (its weight bytes over the measured HBM bandwidth).
Result<nlohmann::json> qgemv_vs_bf16(const Model& m, double hbm, cudaStream_t s) {
    using nlohmann::json;
    std::vector<std::pair<const GgufTensor*, double>> mats;  // (matrix, how many times a token uses its shape)
    const LayerWeights& w0 = m.layer(0);
    for (const GgufTensor* t : {w0.wq, w0.wk, w0.wv, w0.wo, w0.w_gate, w0.w_up, w0.w_down})
        mats.push_back({t, static_cast<double>(m.config().n_layer)});
    mats.push_back({&m.output(), 1.0});
    cuda::Gemm g;
    std::string err;
    DevBuf ws;
    if (Status st = ws.reserve(size_t{32} << 20); !st) return st.error();
    if (!g.init(&err) || !g.set_workspace(ws.as<void>(), size_t{32} << 20, &err)) return make_error("{}", err);
    json rows = json::array();
    std::map<int, std::pair<double, double>> step;  // tokens -> (bf16 ms, quantized ms) per decode step
    double bf16_bytes = 0, q_bytes = 0;
    bool all = true;
    for (const auto& [t, times] : mats) {
        const int n_in = static_cast<int>(t->ne[0]), n_out = static_cast<int>(t->ne[1]);
        if (!cuda::qgemv_supports(static_cast<int>(t->type)) || n_in % 32 != 0) {
            all = false;
            continue;
        }
        auto h = dequantize_bf16(*t);
        if (!h) return h.error();
        const size_t qb = static_cast<size_t>(t->row_bytes()) * n_out;
        DevBuf wq, wb, x, y;
        for (auto [b, bytes] : {std::pair{&wq, qb}, std::pair{&wb, h->size() * 2},
                                std::pair{&x, size_t{8} * n_in * 2}, std::pair{&y, size_t{8} * n_out * 4}})
            if (Status st = b->reserve(bytes); !st) return st.error();
        DUET_CUDA_TRY(cudaMemcpy(wq.as<void>(), t->data, qb, cudaMemcpyHostToDevice));
        DUET_CUDA_TRY(cudaMemcpy(wb.as<void>(), h->data(), h->size() * 2, cudaMemcpyHostToDevice));
        DUET_CUDA_TRY(cudaMemsetAsync(x.as<void>(), 0x3c, size_t{8} * n_in * 2, s));
        bf16_bytes += static_cast<double>(h->size()) * 2 * times;
        q_bytes += static_cast<double>(qb) * times;
        for (int nt : {1, 2, 4, 8}) {
            auto median_ms = [&](auto&& launch) -> Result<double> {
                std::vector<double> v;
                Timer tm;
                for (int i = 0; i < 53; ++i) {
                    tm.start(s);
                    if (Status st = launch(); !st) return st.error();
                    const double ms = tm.stop(s);
                    if (i >= 3) v.push_back(ms);
                }
                std::sort(v.begin(), v.end());
                return v[v.size() / 2];
            };
            auto b = median_ms([&]() -> Status {
                if (!g.linear(wb.as<uint16_t>(), n_out, n_in, x.as<uint16_t>(), nt, y.as<float>(), n_out, s, &err))
                    return make_error("{}", err);
                return {};
            });
            if (!b) return b.error();
            auto q = median_ms([&]() -> Status {
                return cuda_ok(cuda::qgemv(static_cast<int>(t->type), wq.as<void>(), t->row_bytes(), n_out, n_in,
                                           x.as<uint16_t>(), nt, y.as<float>(), n_out, s),
                               "qgemv");
            });
            if (!q) return q.error();
            rows.push_back({{"tensor", t->name}, {"type", static_cast<int>(t->type)}, {"n_out", n_out}, {"n_in", n_in},
                            {"tokens", nt}, {"bf16_ms", *b}, {"quantized_ms", *q}, {"ratio", *q / *b}});
            step[nt].first += *b * times;
            step[nt].second += *q * times;
        }
    }
    json out;
    out["matrices"] = rows;
    out["all_quantized_types_supported"] = all;
    out["bf16_floor_ms"] = bf16_bytes / hbm * 1e3;
    out["quantized_floor_ms"] = q_bytes / hbm * 1e3;
    json steps = json::array();
    for (const auto& [nt, v] : step)
        steps.push_back({{"tokens", nt}, {"bf16_ms", v.first}, {"quantized_ms", v.second}, {"ratio", v.second / v.first}});
    out["per_step"] = steps;
    return out;
}

// Seconds to copy `bytes` from the device into pageable host memory (a std::vector,
// as the backend's logits go), the median of five.
Result<double> d2h_pageable_seconds(size_t bytes) {
    DevBuf d;
    if (Status st = d.reserve(bytes); !st) return st.error();
    DUET_CUDA_TRY(cudaMemset(d.as<void>(), 0, bytes));
    std::vector<float> h(bytes / sizeof(float) + 1);
    std::vector<double> t;
    for (int r = 0; r < 6; ++r) {
        const double t0 = now_s();
        DUET_CUDA_TRY(cudaMemcpy(h.data(), d.as<void>(), bytes, cudaMemcpyDeviceToHost));
        if (r > 0) t.push_back(now_s() - t0);
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

// Median seconds per decode step of `steps` steps over batch B at context ctx (the
// median: a graph captured when the context crosses an attention split boundary
// does not count).
// How a step's tokens are picked: on the host from the logits copied back (Full), or
// on the device (forward_pick), greedy (Argmax) or sampled (Sample: temperature 0.8,
// top-p 0.95, repetition penalty 1.1, the common chat settings).
enum class Pick { Full, Argmax, Sample };
// B sequences of ctx tokens each in the pool, prefilled once for every kind of
// step timed over them (each kind truncates them back to ctx tokens when done).
struct DecodeSeqs {
    KvPool& pool;
    std::vector<KvSeq> seqs;
    std::vector<std::vector<int32_t>> prompts;
    int ctx = 0;
    explicit DecodeSeqs(KvPool& p) : pool(p) {}
    DecodeSeqs(const DecodeSeqs&) = delete;
    DecodeSeqs& operator=(const DecodeSeqs&) = delete;
    ~DecodeSeqs() {
        for (KvSeq& s : seqs) s.release(pool);
    }
};

Result<std::unique_ptr<DecodeSeqs>> prefill_seqs(CudaBackend& be, KvPool& pool, int B, int ctx) {
    auto d = std::make_unique<DecodeSeqs>(pool);
    d->seqs.resize(static_cast<size_t>(B));
    d->prompts.resize(static_cast<size_t>(B));
    d->ctx = ctx;
    std::vector<float> logits;
    // Prefill in passes of about 4096 tokens.
    const int per_pass = std::max(1, 4096 / std::max(1, ctx));
    for (int s0 = 0; s0 < B; s0 += per_pass) {
        std::vector<SeqBatch> batch;
        for (int s = s0; s < std::min(B, s0 + per_pass); ++s) {
            d->prompts[static_cast<size_t>(s)] =
                synthetic_tokens(static_cast<size_t>(ctx), be.n_vocab(), static_cast<uint64_t>(s));
            batch.push_back({&d->seqs[static_cast<size_t>(s)], d->prompts[static_cast<size_t>(s)].data(), ctx, false});
        }
        if (Status st = be.forward(batch, logits); !st) return st.error();
    }
    return d;
}

// The median of `steps` decode steps over d's sequences (after two unmeasured ones:
// graph capture), the token picked as `pick` says; d's sequences are back at ctx
// tokens after.
Result<double> decode_step_seconds(CudaBackend& be, DecodeSeqs& d, int steps, Pick pick = Pick::Full) {
    const int B = static_cast<int>(d.seqs.size());
    std::vector<int32_t> next(static_cast<size_t>(B), 42);
    SamplingParams sp;
    sp.temperature = 0.8f;
    sp.top_p = 0.95f;
    sp.repetition_penalty = 1.1f;
    std::vector<SampleRequest> reqs(static_cast<size_t>(B));
    std::vector<SeqBatch> step;
    for (int s = 0; s < B; ++s) {
        step.push_back(
            {&d.seqs[static_cast<size_t>(s)], &next[static_cast<size_t>(s)], 1, false, pick == Pick::Argmax});
        if (pick == Pick::Sample) {
            reqs[static_cast<size_t>(s)] = SampleRequest{&sp, d.prompts[static_cast<size_t>(s)], {}, 0};
            step.back().sample = &reqs[static_cast<size_t>(s)];
        }
    }
    std::vector<double> t;
    std::vector<float> logits;
    std::vector<int32_t> am;
    Status st;
    for (int i = 0; i < steps + 2 && st; ++i) {
        const double t0 = now_s();
        st = pick != Pick::Full ? be.forward_pick(step, logits, am) : be.forward(step, logits);
        if (st && i >= 2) t.push_back(now_s() - t0);  // two warm-up steps (graph capture)
    }
    for (KvSeq& s : d.seqs) s.truncate(d.pool, d.ctx);
    if (!st) return st.error();
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

// What the figures after the two references share: the model, its KV pool on the
// GPU and the backend over it, and the references themselves.
struct CudaRun {
    const CudaBenchOptions& o;
    const Model& m;
    const KvLayout& layout;
    KvPool& pool;
    CudaBackend& be;
    const CudaBackendOptions& co;  // be's options: the eager and quantized-GEMV variants start from them
    cudaStream_t s;
    double hbm = 0;     // bytes per second
    double peak = 0;    // bf16 FLOP/s
    double params = 0;  // matrix parameters a token multiplies through
    std::unique_ptr<CudaBackend> eager, qgemv;  // made at their first use
};

// Prefill: one sequence of prefill_tokens in one pass, best of three.
Result<nlohmann::json> prefill_figure(CudaRun& r) {
    const Model& m = r.m;
    const auto toks = synthetic_tokens(static_cast<size_t>(r.o.prefill_tokens), m.config().n_vocab, 99);
    std::vector<float> logits;
    double best = 1e30;
    for (int i = 0; i < 4; ++i) {
        KvSeq seq;
        SeqBatch b{&seq, toks.data(), r.o.prefill_tokens, false};
        const double t0 = now_s();
        Status st = r.be.forward({&b, 1}, logits);
        const double dt = now_s() - t0;
        seq.release(r.pool);
        if (!st) return st.error();
        if (i > 0) best = std::min(best, dt);  // the first pass sizes buffers
    }
    const double head = static_cast<double>(m.output().ne[0]) * static_cast<double>(m.output().ne[1]);
    const double N = r.o.prefill_tokens;
    const double c = m.config().n_layer * 4.0 * m.config().n_head * m.config().head_dim;
    // Every token through the layers, one row through the output head (the
    // logits of the last position), attention over the causal triangle.
    const double flops = N * 2.0 * (r.params - head) + 2.0 * head + c * N * (N + 1) / 2;
    return nlohmann::json{{"tokens", r.o.prefill_tokens},
                          {"seconds", best},
                          {"tokens_per_s", N / best},
                          {"tflops", flops / best / 1e12},
                          {"fraction_of_bf16_peak", flops / best / r.peak}};
}

// The variant of the backend that `change` makes of its options, in `slot` once made.
Result<CudaBackend*> variant(CudaRun& r, std::unique_ptr<CudaBackend>& slot, void (*change)(CudaBackendOptions&)) {
    if (!slot) {
        CudaBackendOptions vo = r.co;
        change(vo);
        auto v = CudaBackend::create(r.m, r.pool, vo);
        if (!v) return v.error();
        slot = std::move(v).value();
    }
    return slot.get();
}

// A decode step of batch B against (weights + KV read) / HBM bandwidth, with the
// token picked on the device (greedy, sampled), and eager or with the quantized
// GEMV at some sizes.
Result<nlohmann::json> decode_row(CudaRun& r, int B) {
    const CudaBenchOptions& o = r.o;
    auto seqs = prefill_seqs(r.be, r.pool, B, o.ctx);
    if (!seqs) return seqs.error();
    DecodeSeqs& d = **seqs;
    auto sec = decode_step_seconds(r.be, d, o.steps);
    if (!sec) return sec.error();
    // Attention reads K and V of every layer for each cached token (bytes_per_token).
    const double kv_read = static_cast<double>(B) * (o.ctx + 2 + o.steps / 2.0) *
                           static_cast<double>(r.layout.bytes_per_token());
    const double weight_bytes = 2.0 * r.params;  // bf16 matrices read by every step
    const double floor = (weight_bytes + kv_read) / r.hbm;
    // The step also writes B rows of logits and copies them to the host's
    // pageable memory (the Backend interface): that copy, measured alone.
    const size_t logit_bytes = static_cast<size_t>(B) * static_cast<size_t>(r.m.config().n_vocab) * sizeof(float);
    auto d2h = d2h_pageable_seconds(logit_bytes);
    if (!d2h) return d2h.error();
    const double floor_all = floor + static_cast<double>(logit_bytes) / r.hbm + *d2h;
    nlohmann::json row = {{"batch", B},
                          {"step_ms", *sec * 1e3},
                          {"tokens_per_s", B / *sec},
                          {"floor_ms", floor * 1e3},
                          {"logits_copy_ms", *d2h * 1e3},
                          {"floor_with_logits_ms", floor_all * 1e3},
                          {"ratio_to_floor", *sec / floor_all}};
    auto gsec = decode_step_seconds(r.be, d, o.steps, Pick::Argmax);
    if (!gsec) return gsec.error();
    row["argmax_step_ms"] = *gsec * 1e3;
    row["argmax_ratio_to_floor"] = *gsec / (floor + static_cast<double>(logit_bytes) / r.hbm);
    if (o.sampled) {
        auto ssec = decode_step_seconds(r.be, d, o.steps, Pick::Sample);
        if (!ssec) return ssec.error();
        row["sampled_step_ms"] = *ssec * 1e3;
    }
    if (o.eager && (B == 1 || B == 64)) {
        auto eager = variant(r, r.eager, [](CudaBackendOptions& v) { v.graphs = false; });
        if (!eager) return eager.error();
        auto esec = decode_step_seconds(**eager, d, o.steps);
        if (!esec) return esec.error();
        row["eager_step_ms"] = *esec * 1e3;
    }
    if (o.qgemv && B <= 8) {
        // The same step with the projections from the GGUF blocks (quantized_gemv).
        auto qgemv = variant(r, r.qgemv, [](CudaBackendOptions& v) { v.quantized_gemv = true; });
        if (!qgemv) return qgemv.error();
        auto qsec = decode_step_seconds(**qgemv, d, o.steps);
        if (!qsec) return qsec.error();
        row["qgemv_step_ms"] = *qsec * 1e3;
    }
    return row;
}

// The hand-off copy's destination: another GPU when it can reach it over peer
// access (enabled here), else this one.
int copy_destination(int device, int n_dev) {
    if (n_dev <= 1) return device;
    const int other = device == 0 ? 1 : 0;
    int can = 0;
    cudaDeviceCanAccessPeer(&can, device, other);
    if (!can) return device;
    cudaDeviceEnablePeerAccess(other, 0);
    cudaGetLastError();  // "already enabled" is fine
    return other;
}

// Seconds per copy of the plan's runs, the mean of five: each layer's runs queued as
// the backend's export queues them (queue_runs: one launch per 160 runs where a
// kernel reaches both arenas, else a copy per run).
Result<double> plan_copy_seconds(const std::vector<std::vector<CopyRun>>& plan, char* dst_base, const char* src_base,
                                 cudaStream_t s) {
    auto issue = [&]() -> Status {
        for (const auto& layer : plan)
            if (Status st = queue_runs(dst_base, src_base, layer, s); !st) return st;
        return {};
    };
    if (Status st = issue(); !st) return st.error();
    Timer t;
    t.start(s);
    for (int i = 0; i < 5; ++i)
        if (Status st = issue(); !st) return st.error();
    return t.stop(s) / 1e3 / 5;
}

// A 2048-token prefill exporting its KV layer by layer as it goes, against the
// same prefill alone: what the overlap leaves of the copy's time.
Status export_overlap(CudaRun& r, void* dst, int32_t dst_blocks, const std::vector<int32_t>& dst_ids,
                      nlohmann::json& kc) {
    const auto toks = synthetic_tokens(2048, r.m.config().n_vocab, 5);
    KvExport exp;
    exp.dests = {KvDest{dst, dst_blocks}};
    exp.dest = {0};
    exp.dst_ids = {dst_ids};
    std::vector<float> logits;
    double best_plain = 1e30, best_export = 1e30;
    for (int i = 0; i < 4; ++i)
        for (bool with_export : {false, true}) {
            KvSeq seq;
            SeqBatch b{&seq, toks.data(), 2048, false};
            const double t0 = now_s();
            Status st = with_export ? r.be.forward_export({&b, 1}, logits, exp) : r.be.forward({&b, 1}, logits);
            const double dt = now_s() - t0;
            seq.release(r.pool);
            if (!st) return st.error();
            if (i == 0) continue;
            (with_export ? best_export : best_plain) = std::min(with_export ? best_export : best_plain, dt);
        }
    kc["prefill_plain_ms"] = best_plain * 1e3;
    kc["prefill_export_ms"] = best_export * 1e3;
    kc["export_overhead_ms"] = (best_export - best_plain) * 1e3;
    kc["copy_alone_ms"] = kc["fragmented"]["seconds"].get<double>() * 1e3;
    return {};
}

// The per-layer KV copy of a hand-off: 2048 tokens' blocks, every layer, from the
// pool's arena (src, of src_blocks blocks) into a second arena (another GPU over
// peer access when there is one), contiguous and fragmented block ids, against one
// plain copy of the same bytes.
Result<nlohmann::json> kv_copy_figure(CudaRun& r, void* src, int32_t src_blocks, int n_dev) {
    const KvLayout& layout = r.layout;
    const int bt = layout.block_tokens;
    const int n = (2048 + bt - 1) / bt;
    const int dst_dev = copy_destination(r.o.device, n_dev);
    auto dst = CudaKvMemory::create(dst_dev, layout, 2 * n);
    if (!dst) return dst.error();
    DUET_CUDA_TRY(cudaSetDevice(r.o.device));
    std::vector<int32_t> src_ids(static_cast<size_t>(n)), contig(static_cast<size_t>(n)), frag(static_cast<size_t>(2 * n));
    std::iota(src_ids.begin(), src_ids.end(), 0);
    std::iota(contig.begin(), contig.end(), 0);
    std::iota(frag.begin(), frag.end(), 0);
    std::shuffle(frag.begin(), frag.end(), std::mt19937(7));
    frag.resize(static_cast<size_t>(n));
    const double total = static_cast<double>(layout.block_bytes()) * n;
    auto* src_base = reinterpret_cast<char*>(src);
    auto* dst_base = reinterpret_cast<char*>((*dst)->data());
    nlohmann::json kc = {{"tokens", 2048}, {"blocks", n}, {"bytes", total}, {"peer", dst_dev != r.o.device},
                         {"dst_device", dst_dev}};
    for (auto [name, ids] : {std::pair{"contiguous", &contig}, std::pair{"fragmented", &frag}}) {
        auto plan = plan_copy(layout, src_blocks, 2 * n, src_ids, *ids);
        if (!plan) return plan.error();
        size_t runs = 0;
        for (const auto& layer : *plan) runs += layer.size();
        auto sec = plan_copy_seconds(*plan, dst_base, src_base, r.s);
        if (!sec) return sec.error();
        kc[name] = {{"runs", runs}, {"seconds", *sec}, {"gb_s", total / *sec / 1e9},
                    {"per_layer_us", *sec / layout.n_layer * 1e6}};
    }
    DUET_CUDA_TRY(cudaMemcpyAsync(dst_base, src_base, static_cast<size_t>(total), cudaMemcpyDefault, r.s));
    Timer t;
    t.start(r.s);
    for (int i = 0; i < 5; ++i)
        DUET_CUDA_TRY(cudaMemcpyAsync(dst_base, src_base, static_cast<size_t>(total), cudaMemcpyDefault, r.s));
    const double sec = t.stop(r.s) / 1e3 / 5;
    kc["plain_gb_s"] = total / sec / 1e9;
    kc["contiguous"]["ratio_to_plain"] = kc["contiguous"]["gb_s"].get<double>() / (total / sec / 1e9);
    kc["fragmented"]["ratio_to_plain"] = kc["fragmented"]["gb_s"].get<double>() / (total / sec / 1e9);
    if (Status st = export_overlap(r, (*dst)->data(), 2 * n, frag, kc); !st) return st.error();
    return kc;
}

// Contexts on a GPU arena (kv/kv_stage.h): 2048 tokens' blocks (fragmented ids)
// pulled into the host mirror and pushed back through CudaKvStage's page-locked
// bounce pool, the mirror's pages released after each (as the store does, so page
// faults count) and kept; against the direct copy into the pageable mirror (what the
// driver stages itself) and the plain page-locked copy of the same bytes (the floor).
Result<nlohmann::json> kv_stage_figure(CudaRun& r, void* arena, int32_t arena_blocks) {
    const KvLayout& layout = r.layout;
    const int bt = layout.block_tokens;
    const int n = (2048 + bt - 1) / bt;
    std::vector<int32_t> ids(static_cast<size_t>(arena_blocks));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), std::mt19937(11));
    ids.resize(static_cast<size_t>(n));
    const size_t bytes = layout.block_bytes() * static_cast<size_t>(n);
    auto mirror = KvMirror::create(layout, r.pool.allocator());
    if (!mirror) return mirror.error();
    KvPool& mp = (*mirror)->pool();
    auto stage = CudaKvStage::create(r.o.device, arena, mp);
    if (!stage) return stage.error();
    // Median wall seconds of five (after one unmeasured), `release` between runs.
    auto median = [&](auto&& op, bool release) -> Result<double> {
        std::vector<double> t;
        for (int i = 0; i < 6; ++i) {
            if (release) (*mirror)->release();
            const double t0 = now_s();
            if (Status st = op(); !st) return st.error();
            if (i > 0) t.push_back(now_s() - t0);
        }
        std::sort(t.begin(), t.end());
        return t[t.size() / 2];
    };
    auto plan_to = plan_copy(layout, arena_blocks, arena_blocks, ids, ids);
    if (!plan_to) return plan_to.error();
    auto direct = [&](bool to_host) -> Status {
        for (const auto& layer : *plan_to)
            for (const CopyRun& c : layer) {
                char* a = static_cast<char*>(arena) + c.src;
                char* h = static_cast<char*>(mp.data()) + c.dst;
                if (Status st = cuda_ok(cudaMemcpyAsync(to_host ? h : a, to_host ? a : h, c.bytes, cudaMemcpyDefault, r.s),
                                        "KV copy (pageable)");
                    !st)
                    return st;
            }
        return cuda_ok(cudaStreamSynchronize(r.s), "KV copy (pageable)");
    };
    HostBuf pinned;
    if (Status st = pinned.reserve(bytes); !st) return st.error();
    auto plain = [&](bool to_host) -> Status {
        DUET_CUDA_TRY(cudaMemcpyAsync(to_host ? pinned.as<void>() : arena, to_host ? arena : pinned.as<void>(), bytes,
                                      to_host ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice, r.s));
        return cuda_ok(cudaStreamSynchronize(r.s), "KV copy (page-locked)");
    };
    nlohmann::json ks = {{"tokens", 2048}, {"blocks", n}, {"bytes", bytes}, {"chunk_blocks", (*stage)->chunk_blocks()}};
    struct Case {
        const char* name;
        std::function<Status()> op;
        bool release;
    };
    const std::vector<Case> cases = {
        {"floor_d2h", [&] { return plain(true); }, false},
        {"floor_h2d", [&] { return plain(false); }, false},
        {"pull", [&] { return (*stage)->pull(ids); }, true},
        {"pull_resident", [&] { return (*stage)->pull(ids); }, false},
        {"push", [&] { return (*stage)->push(ids); }, false},
        {"pageable_pull", [&] { return direct(true); }, true},
        {"pageable_push", [&] { return direct(false); }, false},
    };
    for (const Case& c : cases) {
        auto sec = median(c.op, c.release);
        if (!sec) return sec.error();
        ks[c.name] = {{"ms", *sec * 1e3}, {"gb_s", static_cast<double>(bytes) / *sec / 1e9}};
    }
    (*mirror)->release();
    return ks;
}

// The device's count after selecting o.device, or why it cannot be.
Result<int> select_device(int device) {
    int n_dev = 0;
    if (cudaGetDeviceCount(&n_dev) != cudaSuccess) n_dev = 0;
    cudaGetLastError();
    if (device < 0 || device >= n_dev)
        return make_error("cuda:{}: no such device ({} CUDA device{} visible)", device, n_dev, n_dev == 1 ? "" : "s");
    DUET_CUDA_TRY(cudaSetDevice(device));
    return n_dev;
}

}  // namespace

Result<nlohmann::json> run_cuda_bench(const CudaBenchOptions& o) {
    using nlohmann::json;
    if (o.batches.empty() || o.ctx < 1 || o.steps < 1 || o.prefill_tokens < 1)
        return make_error("bench cuda: batches, ctx, steps and prefill tokens must be positive");
    auto n_dev = select_device(o.device);
    if (!n_dev) return n_dev.error();
    cudaDeviceProp prop{};
    DUET_CUDA_TRY(cudaGetDeviceProperties(&prop, o.device));
    cudaStream_t s = nullptr;
    DUET_CUDA_TRY(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    struct StreamGuard {
        cudaStream_t s;
        ~StreamGuard() { cudaStreamDestroy(s); }
    } sg{s};

    json j;
    j["device"] = fmt::format("cuda:{} {} (sm_{}{})", o.device, prop.name, prop.major, prop.minor);
    auto bw = hbm_bandwidth(s);
    if (!bw) return bw.error();
    auto peak = bf16_peak(s);
    if (!peak) return peak.error();
    j["hbm_gb_s"] = *bw / 1e9;
    j["bf16_tflops"] = *peak / 1e12;

    auto model = Model::load(o.model);
    if (!model) return model.error();
    const Model& m = **model;
    const KvLayout layout = kv_layout(m, o.kv_dtype);
    j["kv_dtype"] = kv_dtype_name(o.kv_dtype);
    const int bt = layout.block_tokens;
    const int max_b = *std::max_element(o.batches.begin(), o.batches.end());
    const int64_t seq_tokens = o.ctx + o.steps + 4;
    const int64_t max_ctx = std::max<int64_t>(seq_tokens, o.prefill_tokens);
    // Room for the largest decode batch, the prefill, and the hand-off copy's 2048 tokens.
    const int64_t blocks =
        std::max<int64_t>({max_b * ((seq_tokens + bt - 1) / bt), (o.prefill_tokens + bt - 1) / bt, (2048 + bt - 1) / bt}) + 16;
    if (blocks > INT32_MAX) return make_error("bench cuda: {} KV blocks is too many", blocks);
    auto mem = CudaKvMemory::create(o.device, layout, static_cast<int32_t>(blocks));
    if (!mem) return mem.error();
    KvPool pool(layout, (*mem)->data(), std::make_unique<LocalBlockAllocator>(static_cast<int32_t>(blocks)));
    CudaBackendOptions co;
    co.device = o.device;
    co.max_batch = max_b;
    co.max_ctx = max_ctx;
    auto be = CudaBackend::create(m, pool, co);
    if (!be) return be.error();
    j["backend"] = (*be)->describe();

    CudaRun r{o, m, layout, pool, **be, co, s, *bw, *peak, matrix_params(m), nullptr, nullptr};
    const auto progress = [](const char* name, const json& v) {
        std::fprintf(stderr, "bench cuda: %s %s\n", name, v.dump().c_str());
        std::fflush(stderr);
    };
    progress("references", j);
    auto prefill = prefill_figure(r);
    if (!prefill) return prefill.error();
    j["prefill"] = *prefill;
    progress("prefill", *prefill);
    // Decode steps per batch size against (weights + KV read) / HBM bandwidth.
    json dec = json::array();
    for (int B : o.batches) {
        auto row = decode_row(r, B);
        if (!row) return row.error();
        progress("decode", *row);
        dec.push_back(*row);
    }
    j["decode"] = dec;
    j["decode_ctx"] = o.ctx;
    j["graphs_captured"] = (*be)->graphs_captured();
    if (o.copies) {
        auto kc = kv_copy_figure(r, (*mem)->data(), static_cast<int32_t>(blocks), *n_dev);
        if (!kc) return kc.error();
        j["kv_copy"] = *kc;
        progress("kv_copy", *kc);
        auto kst = kv_stage_figure(r, (*mem)->data(), static_cast<int32_t>(blocks));
        if (!kst) return kst.error();
        j["kv_stage"] = *kst;
        progress("kv_stage", *kst);
    }
    if (o.qgemv) {
        auto q = qgemv_vs_bf16(m, *bw, s);
        if (!q) return q.error();
        j["qgemv"] = *q;
    }
    return j;
}

std::string cuda_bench_markdown(const nlohmann::json& j) {
    std::string md;
    md += fmt::format("## CUDA backend figures\n\n- {}\n- {}\n", j["device"].get<std::string>(),
                      j["backend"].get<std::string>());
    md += fmt::format("- references: HBM {:.0f} GB/s (1 GiB device copy, read + write), bf16 product {:.0f} TFLOP/s "
                      "(8192^3, cuBLAS)\n\n",
                      j["hbm_gb_s"].get<double>(), j["bf16_tflops"].get<double>());
    const auto& p = j["prefill"];
    md += fmt::format("Prefill, {} tokens in one pass: {:.0f} tokens/s, {:.1f} TFLOP/s = {:.2f} of the bf16 peak\n\n",
                      p["tokens"].get<int>(), p["tokens_per_s"].get<double>(), p["tflops"].get<double>(),
                      p["fraction_of_bf16_peak"].get<double>());
    md += fmt::format("Decode steps at {} tokens of context, {} KV, median step (floor: bf16 weights + KV read over "
                      "HBM bandwidth; + logits: their HBM write and their copy to the host, measured alone):\n\n",
                      j["decode_ctx"].get<int>(), j.value("kv_dtype", "f16"));
    md += "| batch | step ms | tokens/s | floor ms | logits copy ms | floor + logits ms | ratio | greedy step ms "
          "(argmax on the GPU) | its ratio to the floor | sampled step ms (on the GPU: t 0.8, top-p 0.95, rep 1.1) "
          "| eager step ms (no graph) | step ms with the quantized GEMV |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|\n";
    for (const auto& r : j["decode"])
        md += fmt::format(
            "| {} | {:.3f} | {:.0f} | {:.3f} | {:.3f} | {:.3f} | {:.2f} | {:.3f} | {:.2f} | {} | {} | {} |\n",
            r["batch"].get<int>(), r["step_ms"].get<double>(), r["tokens_per_s"].get<double>(),
            r["floor_ms"].get<double>(), r["logits_copy_ms"].get<double>(), r["floor_with_logits_ms"].get<double>(),
            r["ratio_to_floor"].get<double>(), r["argmax_step_ms"].get<double>(),
            r["argmax_ratio_to_floor"].get<double>(),
            r.contains("sampled_step_ms") ? fmt::format("{:.3f}", r["sampled_step_ms"].get<double>()) : "",
            r.contains("eager_step_ms") ? fmt::format("{:.3f}", r["eager_step_ms"].get<double>()) : "",
            r.contains("qgemv_step_ms") ? fmt::format("{:.3f}", r["qgemv_step_ms"].get<double>()) : "");
    if (j.contains("qgemv")) {
        const auto& q = j["qgemv"];
        md += fmt::format("\nDecode projections of one step, all layers (layer 0's matrices timed alone, x layers; the "
                          "head once): cuBLAS over bf16 (floor {:.3f} ms) against the quantized GEMV over GGUF blocks "
                          "(floor {:.3f} ms){}:\n\n| tokens | bf16 ms | quantized ms | ratio |\n|---|---|---|---|\n",
                          q["bf16_floor_ms"].get<double>(), q["quantized_floor_ms"].get<double>(),
                          q["all_quantized_types_supported"].get<bool>() ? "" : " (matrices of other types left out)");
        for (const auto& r : q["per_step"])
            md += fmt::format("| {} | {:.3f} | {:.3f} | {:.2f} |\n", r["tokens"].get<int>(), r["bf16_ms"].get<double>(),
                              r["quantized_ms"].get<double>(), r["ratio"].get<double>());
    }
    if (!j.contains("kv_copy")) return md;
    const auto& k = j["kv_copy"];
    md += fmt::format("\nHand-off KV copy, {} tokens ({} blocks, {:.1f} MiB), layer by layer into {} (plain copy {:.0f} GB/s):\n\n",
                      k["tokens"].get<int>(), k["blocks"].get<int>(), k["bytes"].get<double>() / 1048576.0,
                      k["peer"].get<bool>() ? fmt::format("cuda:{} over peer access", k["dst_device"].get<int>())
                                            : std::string("a second arena on the same GPU"),
                      k["plain_gb_s"].get<double>());
    md += "| block ids | runs | GB/s | per layer µs | ratio to plain |\n|---|---|---|---|---|\n";
    for (const char* name : {"contiguous", "fragmented"}) {
        const auto& c = k[name];
        md += fmt::format("| {} | {} | {:.0f} | {:.1f} | {:.2f} |\n", name, c["runs"].get<size_t>(), c["gb_s"].get<double>(),
                          c["per_layer_us"].get<double>(), c["ratio_to_plain"].get<double>());
    }
    md += fmt::format("\nThe same 2048-token prefill exporting its KV layer by layer (fragmented ids) as it goes: {:.3f} ms "
                      "against {:.3f} ms alone: {:.3f} ms added, where the copy by itself takes {:.3f} ms\n",
                      k["prefill_export_ms"].get<double>(), k["prefill_plain_ms"].get<double>(),
                      k["export_overhead_ms"].get<double>(), k["copy_alone_ms"].get<double>());
    if (j.contains("kv_stage")) {
        const auto& k = j["kv_stage"];
        const auto cell = [&](const char* name) {
            return fmt::format("{:.2f} ms, {:.1f} GB/s", k[name]["ms"].get<double>(), k[name]["gb_s"].get<double>());
        };
        md += fmt::format("\nContexts' KV through the host mirror, {} tokens ({} blocks, {:.1f} MiB, fragmented ids; "
                          "bounce halves of {} blocks):\n\n| copy | device -> host | host -> device |\n|---|---|---|\n",
                          k["tokens"].get<int>(), k["blocks"].get<int>(), k["bytes"].get<double>() / 1048576.0,
                          k["chunk_blocks"].get<int>());
        md += fmt::format("| floor: one page-locked copy | {} | {} |\n", cell("floor_d2h"), cell("floor_h2d"));
        md += fmt::format("| CudaKvStage (bounce), mirror pages fresh (as the store) | {} | |\n", cell("pull"));
        md += fmt::format("| CudaKvStage (bounce), mirror pages resident | {} | {} |\n", cell("pull_resident"),
                          cell("push"));
        md += fmt::format("| direct into the pageable mirror (the driver stages) | {} | {} |\n", cell("pageable_pull"),
                          cell("pageable_push"));
    }
    return md;
}

}  // namespace duet
