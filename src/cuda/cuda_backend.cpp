#include "cuda/cuda_backend.h"

#include "cuda/cuda_arena.h"
#include "cuda/cuda_kv_io.h"
#include "cuda/cuda_util.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <atomic>
#include <map>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "kernels/cuda/attention.h"
#include "base/trace.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cpu/kernels.h"
#include "model/bf16_weights.h"
#include "model/gpu_plan.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/qgemv.h"
#include "cuda/sample_inputs.h"

namespace duet {

namespace {

// The activations and inputs of a pass. Eager passes use one set that grows with the
// largest pass; graph-replayed decode steps another, sized once for the largest
// bucket, so that growing the first never moves memory a captured graph points at.
struct Acts {
    DevBuf x, xb, q, k, v, att, tmp, gate, up, logits, attn_ws, in;
};

struct LayerDev {
    const uint16_t *wq = nullptr, *wk = nullptr, *wv = nullptr, *wo = nullptr;
    const uint16_t *gate = nullptr, *up = nullptr, *down = nullptr;
    const float *attn_norm = nullptr, *ffn_norm = nullptr;
    const float *bq = nullptr, *bk = nullptr, *bv = nullptr;
};

// Where each per-pass input lives in the int32 input buffer (host staging and device).
struct InputLayout {
    int T = 0, n_out = 0, n_seq = 0, max_blocks = 0;
    int n_tiles = 0;  // query tiles of the tiled prefill attention (0: the per-query kernel)
    size_t tok() const { return 0; }
    size_t pos() const { return static_cast<size_t>(T); }
    size_t tblock() const { return 2 * static_cast<size_t>(T); }
    size_t toff() const { return 3 * static_cast<size_t>(T); }
    size_t qseq() const { return 4 * static_cast<size_t>(T); }
    size_t vis() const { return 5 * static_cast<size_t>(T); }
    size_t orow() const { return 6 * static_cast<size_t>(T); }
    size_t tables() const { return orow() + static_cast<size_t>(n_out); }
    size_t tiles() const { return tables() + static_cast<size_t>(n_seq) * max_blocks; }
    size_t count() const { return tiles() + 2 * static_cast<size_t>(n_tiles); }
};

// An unrecoverable CUDA failure: say so and end the process (abort: a core for the
// post-mortem, and the supervisor restarts the worker).
[[noreturn]] void fatal(const std::string& why) {
    std::fprintf(stderr, "duet: fatal CUDA error: %s\n", why.c_str());
    std::fflush(stderr);
    std::abort();
}

int splits_for(int64_t len) { return static_cast<int>(std::max<int64_t>(1, (len + cuda::kSplitTokens - 1) / cuda::kSplitTokens)); }

}  // namespace

// ---------------------------------------------------------------- KV memory

Result<std::unique_ptr<CudaKvMemory>> CudaKvMemory::create(int device, const KvLayout& l, int32_t n_blocks) {
    if (n_blocks <= 0) return make_error("KV pool needs at least one block, got {}", n_blocks);
    const int n_dev = cuda::device_count();
    if (device < 0 || device >= n_dev)
        return make_error("cuda:{}: no such device ({} CUDA device{} visible)", device, n_dev, n_dev == 1 ? "" : "s");
    std::unique_ptr<CudaKvMemory> m(new CudaKvMemory());
    m->device_ = device;
    m->bytes_ = l.block_bytes() * static_cast<size_t>(n_blocks);
    DUET_CUDA_TRY(cudaSetDevice(device));
    void* p = nullptr;
    if (cudaError_t e = cudaMalloc(&p, m->bytes_); e != cudaSuccess)
        return make_error("cuda:{}: cannot allocate {:.1f} MiB for {} KV blocks: {}", device, m->bytes_ / 1048576.0,
                          n_blocks, cudaGetErrorString(e));
    m->data_ = p;
    return m;
}

CudaKvMemory::~CudaKvMemory() {
    if (data_) {
        cudaSetDevice(device_);
        cudaFree(data_);
    }
}

// ---------------------------------------------------------------- backend

struct CudaBackend::Impl {
    const Model* model = nullptr;
    KvPool* pool = nullptr;
    CudaBackendOptions o;
    cudaStream_t stream = nullptr;
    std::unique_ptr<cuda::Gemm> gemm;  // destroyed before the stream it is bound to
    std::string device_name;

    // Weights, all in one allocation: private, or shared with the GPU's other processes.
    DevBuf weights;
    std::unique_ptr<SharedDeviceBuffer> shared_weights;
    bool weights_shared = false;
    size_t weight_bytes = 0;
    std::vector<LayerDev> layers;
    // quantized_gemv: a matrix's GGUF blocks on the device, by its bf16 copy.
    struct QMat {
        const void* w;
        int type;
        size_t row_bytes;
    };
    std::map<const uint16_t*, QMat> qmats;
    const uint16_t* embd = nullptr;
    const uint16_t* out = nullptr;
    const float* out_norm = nullptr;
    const float* inv_freq = nullptr;

    Acts eager, graph_acts;
    DevBuf cublas_ws;
    HostBuf hin;  // input staging (both sets; a pass completes before the next is staged)

    // Decode graphs per (bucket, attention splits).
    std::vector<int> buckets;
    int graph_max_blocks = 0;
    std::map<std::pair<int, int>, cudaGraphExec_t> graphs;
    int captures = 0;
    int64_t replays = 0;

    bool copy_failed = false;  // a copy-on-write block copy could not be queued: fatal (see fatal())

    // The device's own timings of a pass, for a trace file (base/trace.h): events
    // around the forward (graph or eager) and around what follows it up to the
    // read-back (sampling, argmax, copies), made when a trace is first open.
    cudaEvent_t timing[3] = {};
    bool timed = false;  // this pass recorded them
    // Records timing[k] on the stream when a trace file is open. A failure only
    // leaves the pass untimed: its error is cleared (the kernels' launch checks read
    // cudaGetLastError), and the events are made all three or none.
    void mark(int k) {
        if (k == 0) timed = false;
        if (!trace::active() || (k > 0 && !timed)) return;
        if (timing[0] == nullptr) {
            for (cudaEvent_t& e : timing) {
                if (cudaEventCreate(&e) == cudaSuccess) continue;
                (void)cudaGetLastError();
                for (cudaEvent_t& m : timing) {
                    if (m) cudaEventDestroy(m);
                    m = nullptr;
                }
                return;
            }
        }
        timed = cudaEventRecord(timing[k], stream) == cudaSuccess;
        if (!timed) (void)cudaGetLastError();
    }
    // After the stream's synchronization: the two intervals as events on the "gpu"
    // track, ending when the host saw the stream finish (the device's durations; their
    // placement is late by the synchronization's wake-up at most).
    void trace_timings(bool graph) {
        float fwd_ms = 0, rest_ms = 0;
        if (!timed) return;
        if (cudaEventElapsedTime(&fwd_ms, timing[0], timing[1]) != cudaSuccess ||
            cudaEventElapsedTime(&rest_ms, timing[1], timing[2]) != cudaSuccess) {
            (void)cudaGetLastError();
            return;
        }
        const uint64_t end = trace::now_ns();
        const auto fwd = static_cast<uint64_t>(fwd_ms * 1e6), rest = static_cast<uint64_t>(rest_ms * 1e6);
        trace::event(graph ? "gpu decode step (graph)" : "gpu forward", end - rest - fwd, fwd, "gpu");
        trace::event("gpu sample, argmax, copy back", end - rest, rest, "gpu");
    }

    ~Impl() {
        if (stream) cudaStreamSynchronize(stream);
        if (copy_stream) cudaStreamSynchronize(copy_stream);
        for (cudaEvent_t e : timing)
            if (e) cudaEventDestroy(e);
        for (cudaEvent_t e : layer_done) cudaEventDestroy(e);
        if (copy_stream) cudaStreamDestroy(copy_stream);
        for (auto& [key, exec] : graphs) cudaGraphExecDestroy(exec);
        if (pool) pool->clear_block_copy(this);
        gemm.reset();
        if (stream) cudaStreamDestroy(stream);
    }

    // Copy-on-write copies on this backend's stream, installed before every pass (a
    // pool another backend also used gets this one's back).
    void install_block_copy() {
        if (pool->block_copy_owner() == this) return;
        pool->set_block_copy(
            [this](int32_t dst, int32_t src) {
                const KvLayout& l = pool->layout();
                const size_t bytes = l.tile_bytes();
                for (int32_t layer = 0; layer < l.n_layer; ++layer)
                    if (cudaMemcpyAsync(pool->k(dst, layer, 0), pool->k(src, layer, 0), bytes, cudaMemcpyDeviceToDevice,
                                        stream) != cudaSuccess)
                        copy_failed = true;
            },
            this);
    }

    Status upload_weights();
    Status reserve(Acts& a, const InputLayout& l, int64_t max_len, bool* moved);
    // The copies of a pass's export, per destination, per layer (empty: none).
    std::vector<std::vector<std::vector<CopyRun>>> export_runs;
    std::vector<KvDest> export_dests;
    cudaStream_t copy_stream = nullptr;
    std::vector<cudaEvent_t> layer_done;

    Status enqueue(const Acts& a, const InputLayout& l, int max_len);
    DevBuf argmax_buf;  // argmax_rows' output (outside the graphs: may move)
    // Device sampling (kernels/cuda sample_rows) of the rows of entries with `sample`:
    // inputs staged in sample_in and uploaded to sample_dev, scratch, picks; the rows
    // and their picks as copied back; rows the kernel leaves to the host (-1) are
    // copied back alone and sampled by host_sampler.
    HostBuf sample_in;
    DevBuf sample_dev, sample_ws, sample_out;
    std::vector<std::pair<size_t, const SampleRequest*>> sampled;
    std::vector<int32_t> sampled_picks;
    std::vector<cuda::SampleRow> sample_rows_h;  // the step's inputs, before staging
    std::vector<cuda::SampleEdit> sample_edits_h;
    std::vector<uint32_t> sample_masks_h;
    std::vector<float> fallback_row;
    Sampler host_sampler;
    Status enqueue_samples(std::span<SeqBatch> batch, const Acts& a);
    Status finish_samples(const Acts& a, std::vector<int32_t>& picks);
    Status pass(std::span<SeqBatch> batch, int64_t T, int64_t n_out, bool decode_step, std::vector<float>& logits,
                std::vector<int32_t>* argmax);
    Status plan_export(std::span<SeqBatch> batch, const KvExport& exp);
};

Status CudaBackend::Impl::upload_weights() {
    const ModelConfig& c = model->config();
    // One allocation: a plan of (tensor, as bf16 or f32, offset) first.
    struct Item {
        const GgufTensor* t;
        bool bf16;
        size_t off;
        bool raw = false;  // the GGUF blocks as stored (quantized_gemv)
    };
    std::vector<Item> items;
    std::map<const GgufTensor*, size_t> at;  // a tensor named twice (tied output) is uploaded once
    std::map<const GgufTensor*, size_t> raw_at;
    size_t total = 0;
    auto add = [&](const GgufTensor* t, bool bf16) {
        if (!t || at.count(t)) return;
        const size_t bytes = static_cast<size_t>(t->n_elements()) * (bf16 ? 2 : 4);
        at[t] = total;
        items.push_back({t, bf16, total});
        total += (bytes + 255) / 256 * 256;
    };
    auto add_raw = [&](const GgufTensor* t) {
        if (!o.quantized_gemv || !t || raw_at.count(t) || !cuda::qgemv_supports(static_cast<int>(t->type)) ||
            t->n_dims != 2 || t->ne[0] % 32 != 0)
            return;
        const size_t bytes = static_cast<size_t>(t->row_bytes()) * static_cast<size_t>(t->ne[1]);
        raw_at[t] = total;
        items.push_back({t, false, total, true});
        total += (bytes + 255) / 256 * 256;
    };
    add(&model->tok_embd(), true);
    add(&model->output(), true);
    add_raw(&model->output());
    add(&model->output_norm(), false);
    for (int64_t l = 0; l < c.n_layer; ++l) {
        const LayerWeights& w = model->layer(l);
        for (const GgufTensor* m : {w.wq, w.wk, w.wv, w.wo, w.w_gate, w.w_up, w.w_down}) {
            add(m, true);
            add_raw(m);
        }
        for (const GgufTensor* f : {w.attn_norm, w.ffn_norm, w.bq, w.bk, w.bv}) add(f, false);
    }
    const size_t freq_off = total;
    total += (model->rope_inv_freq().size() * sizeof(float) + 255) / 256 * 256;
    weight_bytes = total;
    // Dequantizing is the slow part of loading (host work, tensor by tensor): threads
    // take tensors in turn, each dequantizing into its own buffer and copying it up
    // (host memory stays bounded by threads x the largest tensor).
    auto upload = [&](char* base) -> Status {
        std::atomic<size_t> next{0};
        std::atomic<bool> failed{false};
        std::mutex mu;
        Status first;
        auto work = [&] {
            cudaSetDevice(o.device);
            std::vector<float> f32;
            for (size_t i; !failed.load() && (i = next.fetch_add(1)) < items.size();) {
                const Item& it = items[i];
                const GgufTensor& t = *it.t;
                Status st;
                if (it.raw) {
                    st = cuda_ok(cudaMemcpy(base + it.off, t.data, static_cast<size_t>(t.row_bytes()) * t.ne[1],
                                            cudaMemcpyHostToDevice),
                                 "weights upload");
                } else if (it.bf16) {
                    auto h = dequantize_bf16(t);
                    st = !h ? Status(h.error())
                            : cuda_ok(cudaMemcpy(base + it.off, h->data(), h->size() * 2, cudaMemcpyHostToDevice),
                                      "weights upload");
                } else if (!dtype_supported(t.type) || t.n_dims < 1) {
                    st = make_error("tensor {}: cannot be read as f32", t.name);
                } else {
                    const int64_t rows = t.n_elements() / t.ne[0];
                    f32.resize(static_cast<size_t>(t.n_elements()));
                    for (int64_t r = 0; r < rows; ++r)
                        cpu::dequantize_row(t.type, t.data + static_cast<size_t>(r) * t.row_bytes(),
                                            f32.data() + static_cast<size_t>(r * t.ne[0]), t.ne[0]);
                    st = cuda_ok(cudaMemcpy(base + it.off, f32.data(), f32.size() * 4, cudaMemcpyHostToDevice),
                                 "weights upload");
                }
                if (!st) {
                    std::lock_guard<std::mutex> lock(mu);
                    if (first.ok()) first = st;
                    failed.store(true);
                }
            }
        };
        const unsigned n_threads = std::clamp(std::thread::hardware_concurrency(), 1u, 8u);
        std::vector<std::thread> threads;
        for (unsigned k = 1; k < n_threads; ++k) threads.emplace_back(work);
        work();
        for (std::thread& th : threads) th.join();
        if (!first.ok()) return first;
        DUET_CUDA_TRY(cudaMemcpy(base + freq_off, model->rope_inv_freq().data(),
                                 model->rope_inv_freq().size() * sizeof(float), cudaMemcpyHostToDevice));
        return {};
    };
    char* base = nullptr;
    if (!o.share_weights_instance.empty()) {
        const std::string content =
            fmt::format("bf16-weights{} model={:016x}", o.quantized_gemv ? "+blocks" : "", model->fingerprint());
        auto sh = SharedDeviceBuffer::get_or_make(o.share_weights_instance, fmt::format("weights.cuda.{}", o.device),
                                                  o.device, total, content,
                                                  [&](void* p) { return upload(static_cast<char*>(p)); });
        if (sh) {
            shared_weights = std::move(sh).value();
            base = static_cast<char*>(shared_weights->data());
            weights_shared = true;
        } else {
            cudaGetLastError();
            std::fprintf(stderr, "duet: cuda:%d: weights not shared (%s): a private copy\n", o.device,
                         sh.error().message.c_str());
        }
    }
    if (!base) {
        bool moved = false;
        if (Status st = weights.reserve(total, &moved); !st)
            return make_error("cuda:{}: cannot allocate {:.1f} MiB for the weights: {}", o.device, total / 1048576.0,
                              st.error().message);
        base = weights.as<char>();
        if (Status st = upload(base); !st) return st;
    }
    auto b16 = [&](const GgufTensor* t) {
        return t ? reinterpret_cast<const uint16_t*>(base + at.at(t)) : nullptr;
    };
    auto f = [&](const GgufTensor* t) { return t ? reinterpret_cast<const float*>(base + at.at(t)) : nullptr; };
    for (const auto& [t, off] : raw_at)
        qmats[b16(t)] = QMat{base + off, static_cast<int>(t->type), static_cast<size_t>(t->row_bytes())};
    embd = b16(&model->tok_embd());
    out = b16(&model->output());
    out_norm = f(&model->output_norm());
    inv_freq = reinterpret_cast<const float*>(base + freq_off);
    layers.resize(static_cast<size_t>(c.n_layer));
    for (int64_t l = 0; l < c.n_layer; ++l) {
        const LayerWeights& w = model->layer(l);
        LayerDev& d = layers[static_cast<size_t>(l)];
        d.wq = b16(w.wq);
        d.wk = b16(w.wk);
        d.wv = b16(w.wv);
        d.wo = b16(w.wo);
        d.gate = b16(w.w_gate);
        d.up = b16(w.w_up);
        d.down = b16(w.w_down);
        d.attn_norm = f(w.attn_norm);
        d.ffn_norm = f(w.ffn_norm);
        d.bq = f(w.bq);
        d.bk = f(w.bk);
        d.bv = f(w.bv);
    }
    return {};
}

// Buffers of set a for a pass of l.T tokens and l.n_out logit rows attending over at
// most max_len tokens; *moved when one moved.
Status CudaBackend::Impl::reserve(Acts& a, const InputLayout& l, int64_t max_len, bool* moved) {
    const ModelConfig& c = model->config();
    const size_t T = static_cast<size_t>(l.T);
    const size_t E = static_cast<size_t>(c.n_embd), Q = static_cast<size_t>(c.n_head * c.head_dim),
                 KV = static_cast<size_t>(c.n_head_kv * c.head_dim), F = static_cast<size_t>(c.n_ff);
    auto r = [&](DevBuf& b, size_t bytes) { return b.reserve(bytes, moved); };
    for (auto [buf, bytes] : std::initializer_list<std::pair<DevBuf*, size_t>>{
             {&a.x, T * E * 4},
             {&a.tmp, T * E * 4},
             {&a.xb, T * std::max({E, Q, F}) * 2},
             {&a.q, T * Q * 4},
             {&a.att, T * Q * 4},
             {&a.k, T * KV * 4},
             {&a.v, T * KV * 4},
             {&a.gate, T * F * 4},
             {&a.up, T * F * 4},
             {&a.logits, static_cast<size_t>(l.n_out) * static_cast<size_t>(c.n_vocab) * 4},
             {&a.in, l.count() * 4}}) {
        if (Status st = r(*buf, bytes); !st) return st;
    }
    cuda::PagedKv kv;
    kv.n_head = static_cast<int>(c.n_head);
    kv.n_head_kv = static_cast<int>(c.n_head_kv);
    kv.head_dim = static_cast<int>(c.head_dim);
    if (Status st = r(a.attn_ws, cuda::paged_attention_workspace_bytes(kv, l.T, static_cast<int>(max_len))); !st)
        return st;
    return hin.reserve(l.count() * 4);
}

// The whole pass on `stream` with buffer set a, reading its inputs from a.in (laid
// out as l).
Status CudaBackend::Impl::enqueue(const Acts& a, const InputLayout& l, int max_len) {
    const ModelConfig& c = model->config();
    const int T = l.T;
    const int E = static_cast<int>(c.n_embd), HD = static_cast<int>(c.head_dim), NH = static_cast<int>(c.n_head),
              NKV = static_cast<int>(c.n_head_kv), F = static_cast<int>(c.n_ff), V = static_cast<int>(c.n_vocab);
    const int Q = NH * HD, KV = NKV * HD;
    const float eps = static_cast<float>(c.rms_eps);
    const float scale = 1.0f / std::sqrt(static_cast<float>(HD));
    const int32_t* in_d = a.in.as<int32_t>();
    const int32_t* tok = in_d + l.tok();
    const int32_t* pos = in_d + l.pos();
    const int32_t* tblock = in_d + l.tblock();
    const int32_t* toff = in_d + l.toff();
    const int32_t* qseq = in_d + l.qseq();
    const int32_t* vis = in_d + l.vis();
    const int32_t* orow = in_d + l.orow();
    const int32_t* tables = in_d + l.tables();
    float *X = a.x.as<float>(), *TMP = a.tmp.as<float>();
    float *q = a.q.as<float>(), *k = a.k.as<float>(), *v = a.v.as<float>(), *att = a.att.as<float>();
    float *gate = a.gate.as<float>(), *up = a.up.as<float>();
    uint16_t* XB = a.xb.as<uint16_t>();
    std::string err;
    auto mm = [&](const uint16_t* w, int n_out, int n_in, const uint16_t* xin, int n_tok, float* y, int ldy) -> Status {
        if (n_tok <= cuda::kQgemvMaxTokens && !qmats.empty()) {
            if (auto it = qmats.find(w); it != qmats.end())
                return cuda_ok(cuda::qgemv(it->second.type, it->second.w, it->second.row_bytes, n_out, n_in, xin, n_tok,
                                           y, ldy, stream),
                               "qgemv");
        }
        if (!gemm->linear(w, n_out, n_in, xin, n_tok, y, ldy, stream, &err)) return make_error("{}", err);
        return {};
    };
#define DUET_STEP(expr)                                 \
    do {                                                \
        if (Status st_ = (expr); !st_) return st_;      \
    } while (0)
#define DUET_K(expr) DUET_CUDA_TRY(expr)

    cuda::PagedKv kv;
    kv.data = pool->data();
    kv.dtype = static_cast<int>(pool->layout().dtype);
    kv.n_blocks = pool->allocator().n_blocks();
    kv.n_head = NH;
    kv.n_head_kv = NKV;
    kv.head_dim = HD;
    kv.block_tokens = pool->layout().block_tokens;

    // Fused kernels (ops.h, attention.h: the same bits as the unfused ones): the
    // residual add with the next norm, norms and SwiGLU straight to bf16, RoPE with
    // the KV append. A decode step is launch-bound, so launches per layer count.
    DUET_K(cuda::embed_bf16(embd, tok, T, E, X, stream));
    DUET_K(cuda::rms_norm_bf16(X, layers[0].attn_norm, XB, T, E, eps, stream));
    for (int li = 0; li < static_cast<int>(c.n_layer); ++li) {
        const LayerDev& w = layers[static_cast<size_t>(li)];
        DUET_STEP(mm(w.wq, Q, E, XB, T, q, Q));
        DUET_STEP(mm(w.wk, KV, E, XB, T, k, KV));
        DUET_STEP(mm(w.wv, KV, E, XB, T, v, KV));
        if (w.bq) {
            DUET_K(cuda::add_bias(q, w.bq, T, Q, stream));
            DUET_K(cuda::add_bias(k, w.bk, T, KV, stream));
            DUET_K(cuda::add_bias(v, w.bv, T, KV, stream));
        }
        // RoPE; Q rounded to f16 (it meets f16 K, as on the CPU backend); K and V into
        // the arena.
        kv.layer = li;
        DUET_K(cuda::qk_rope_kv_append(q, k, v, T, pos, inv_freq, static_cast<int>(c.rot_dim), c.rope_neox, tblock, toff,
                                       kv, stream));
        if (!export_runs.empty()) {
            // This layer's KV is written: its copies go now, on the copy stream,
            // while the next layers compute. (The range covers issuing them; Nsight's
            // CUDA trace shows the copies themselves on the copy stream.)
            trace::Range range("kv copy layer (issue)");
            const cudaEvent_t done = layer_done[static_cast<size_t>(li)];
            DUET_K(cudaEventRecord(done, stream));
            DUET_K(cudaStreamWaitEvent(copy_stream, done, 0));
            const char* src = reinterpret_cast<const char*>(pool->data());
            for (size_t di = 0; di < export_runs.size(); ++di) {
                const KvDest& dest = export_dests[di];
                char* dst = reinterpret_cast<char*>(dest.data);
                const std::vector<CopyRun>& runs = export_runs[di][static_cast<size_t>(li)];
                if (dest.peer || dest.device < 0 || dest.device == o.device) {
                    // One launch for the layer's runs where this GPU's kernels reach
                    // the destination (its own memory); a copy per run otherwise.
                    if (Status st = queue_runs(dst, src, runs, copy_stream); !st) return st;
                } else {  // no peer access: the driver stages each copy through host memory
                    for (const CopyRun& r : runs)
                        DUET_K(cudaMemcpyPeerAsync(dst + r.dst, dest.device, src + r.src, o.device, r.bytes, copy_stream));
                }
            }
        }
        if (l.n_tiles > 0)
            DUET_K(cuda::paged_attention_prefill(q, kv, tables, l.max_blocks, qseq, vis, in_d + l.tiles(), l.n_tiles, scale,
                                                 att, stream));
        else
            DUET_K(cuda::paged_attention(q, kv, tables, l.max_blocks, qseq, vis, T, max_len, scale, att,
                                         a.attn_ws.as<void>(), stream));
        DUET_K(cuda::f32_to_bf16(att, XB, static_cast<int64_t>(T) * Q, stream));
        DUET_STEP(mm(w.wo, E, Q, XB, T, TMP, E));
        DUET_K(cuda::add_rms_norm_bf16(X, TMP, w.ffn_norm, XB, T, E, eps, stream));
        DUET_STEP(mm(w.gate, F, E, XB, T, gate, F));
        DUET_STEP(mm(w.up, F, E, XB, T, up, F));
        DUET_K(cuda::swiglu_bf16(gate, up, XB, static_cast<int64_t>(T) * F, stream));
        DUET_STEP(mm(w.down, E, F, XB, T, TMP, E));
        if (li + 1 < static_cast<int>(c.n_layer))
            DUET_K(cuda::add_rms_norm_bf16(X, TMP, layers[static_cast<size_t>(li) + 1].attn_norm, XB, T, E, eps, stream));
        else
            DUET_K(cuda::add(X, TMP, static_cast<int64_t>(T) * E, stream));
    }
    // The output head over the rows whose logits are wanted.
    DUET_K(cuda::gather_rows(X, orow, l.n_out, E, TMP, stream));
    DUET_K(cuda::rms_norm_bf16(TMP, out_norm, XB, l.n_out, E, eps, stream));
    DUET_STEP(mm(out, V, E, XB, l.n_out, a.logits.as<float>(), V));
#undef DUET_STEP
#undef DUET_K
    return {};
}

CudaBackend::CudaBackend() : d_(std::make_unique<Impl>()) {}
CudaBackend::~CudaBackend() {
    if (d_) cudaSetDevice(d_->o.device);
}

Result<std::unique_ptr<CudaBackend>> CudaBackend::create(const Model& model, KvPool& pool, const CudaBackendOptions& o) {
    const ModelConfig& c = model.config();
    if (c.head_dim != 64 && c.head_dim != 128)
        return make_error("the CUDA backend's attention covers head_dim 64 and 128; {} has {}", c.name, c.head_dim);
    if (o.max_batch < 1 || o.max_ctx < 1) return make_error("CUDA backend: max_batch and max_ctx must be positive");
    const int n_dev = cuda::device_count();
    if (o.device < 0 || o.device >= n_dev)
        return make_error("cuda:{}: no such device ({} CUDA device{} visible)", o.device, n_dev, n_dev == 1 ? "" : "s");
    std::unique_ptr<CudaBackend> b(new CudaBackend());
    Impl& d = *b->d_;
    d.model = &model;
    d.pool = &pool;
    d.o = o;
    d.device_name = cuda::device_name(o.device);
    DUET_CUDA_TRY(cudaSetDevice(o.device));
    DUET_CUDA_TRY(cudaStreamCreateWithFlags(&d.stream, cudaStreamNonBlocking));
    std::string err;
    d.gemm = std::make_unique<cuda::Gemm>();
    if (!d.gemm->init(&err)) return make_error("cuda:{}: {}", o.device, err);
    // cuBLAS's own workspace (its recommended 32 MiB on Hopper), fixed so graph
    // capture never allocates.
    constexpr size_t kCublasWs = 32u << 20;
    bool moved = false;
    if (Status st = d.cublas_ws.reserve(kCublasWs, &moved); !st) return st.error();
    if (!d.gemm->set_workspace(d.cublas_ws.as<void>(), kCublasWs, &err)) return make_error("cuda:{}: {}", o.device, err);
    if (Status st = d.upload_weights(); !st) return st.error();

    const int bt = pool.layout().block_tokens;
    d.buckets = decode_graph_buckets(o.max_batch);
    d.graph_max_blocks = static_cast<int>((o.max_ctx + bt - 1) / bt);
    if (o.graphs) {
        // The graph set, once, for the largest bucket at the longest context: no
        // graph step ever needs more, so captured graphs never see it move.
        InputLayout g;
        g.T = g.n_out = g.n_seq = d.buckets.back();
        g.max_blocks = d.graph_max_blocks;
        if (Status st = d.reserve(d.graph_acts, g, static_cast<int64_t>(splits_for(o.max_ctx)) * cuda::kSplitTokens, &moved);
            !st)
            return st.error();
    }

    d.install_block_copy();
    return b;
}

int64_t CudaBackend::n_vocab() const { return d_->model->config().n_vocab; }

Status CudaBackend::sync() {
    if (Status st = cuda_ok(cudaStreamSynchronize(d_->stream), "the backend's stream"); !st) return st;
    if (d_->copy_stream) return cuda_ok(cudaStreamSynchronize(d_->copy_stream), "the backend's copy stream");
    return {};
}
size_t CudaBackend::weight_bytes() const { return d_->weight_bytes; }
int CudaBackend::graphs_captured() const { return d_->captures; }
int64_t CudaBackend::graph_replays() const { return d_->replays; }

std::string CudaBackend::describe() const {
    return fmt::format("cuda:{} {}, weights {:.0f} MiB bf16{}{}, {}", d_->o.device, d_->device_name,
                       d_->weight_bytes / 1048576.0,
                       d_->qmats.empty() ? "" : fmt::format(" + GGUF blocks of {} matrices (quantized GEMV)", d_->qmats.size()),
                       d_->weights_shared ? " (shared on the GPU)" : "",
                       d_->o.graphs ? fmt::format("decode graphs for batches up to {}", d_->buckets.back())
                                    : std::string("no graphs"));
}

Status CudaBackend::forward(std::span<SeqBatch> batch, std::vector<float>& logits) {
    return forward_impl(batch, logits, nullptr, nullptr);
}

Status CudaBackend::forward_export(std::span<SeqBatch> batch, std::vector<float>& logits, const KvExport& exp) {
    return forward_impl(batch, logits, &exp, nullptr);
}

Status CudaBackend::forward_pick(std::span<SeqBatch> batch, std::vector<float>& logits, std::vector<int32_t>& argmax) {
    return forward_impl(batch, logits, nullptr, &argmax);
}

Status CudaBackend::forward_impl(std::span<SeqBatch> batch, std::vector<float>& logits, const KvExport* exp,
                                 std::vector<int32_t>* argmax) {
    Impl& d = *d_;
    const ModelConfig& c = d.model->config();
    int64_t T = 0, n_out = 0;
    bool decode_step = !batch.empty();
    for (const SeqBatch& b : batch) {
        if (!b.kv || b.n_tokens < 0 || (b.n_tokens > 0 && !b.tokens)) return make_error("forward: malformed batch entry");
        for (int32_t i = 0; i < b.n_tokens; ++i)
            if (b.tokens[i] < 0 || b.tokens[i] >= c.n_vocab)
                return make_error("token id {} is out of range (vocabulary of {})", b.tokens[i], c.n_vocab);
        T += b.n_tokens;
        n_out += b.output_rows();
        decode_step = decode_step && b.n_tokens == 1;
    }
    if (T > (int64_t{1} << 24)) return make_error("forward: {} tokens in one pass is more than the CUDA backend takes", T);
    if (exp && (exp->dst_ids.size() != batch.size() || exp->dest.size() != batch.size()))
        return make_error("forward_export: {} destinations for {} sequences", exp->dest.size(), batch.size());
    DUET_CUDA_TRY(cudaSetDevice(d.o.device));
    d.install_block_copy();
    size_t prepared = 0;
    for (; prepared < batch.size(); ++prepared) {
        SeqBatch& b = batch[prepared];
        const int64_t from = b.kv->n_tokens();
        if (Status st = b.kv->prepare_append(*d.pool, from, from + b.n_tokens); !st) {
            for (size_t j = 0; j < prepared; ++j) batch[j].kv->truncate(*d.pool, batch[j].kv->n_tokens());
            return st;
        }
    }
    // A copy-on-write copy that could not be queued leaves a sequence's block
    // uncopied, already swapped into its table: nothing to roll back to.
    if (d.copy_failed) fatal("a copy-on-write block copy could not be queued");
    Status st;
    if (exp) st = d.plan_export(batch, *exp);
    if (st) st = d.pass(batch, T, n_out, decode_step && !exp, logits, argmax);
    if (st && exp) st = cuda_ok(cudaStreamSynchronize(d.copy_stream), "the KV export's copies");
    d.export_runs.clear();
    if (!st) {
        // As if nothing happened (the callers' contract, as on CPU): the queued work
        // finished or failed before anything is reused, new positions dropped. An
        // error that leaves the context unusable (an illegal address, say: sticky,
        // every later call fails) is not something to retry: the process ends, and
        // the supervisor restarts it and re-drives its requests (the KV arena outlives it).
        cudaGetLastError();
        const cudaError_t e1 = cudaStreamSynchronize(d.stream);
        const cudaError_t e2 = d.copy_stream ? cudaStreamSynchronize(d.copy_stream) : cudaSuccess;
        if (e1 != cudaSuccess || e2 != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess)
            fatal(fmt::format("{} (the device is left unusable: {})", st.error().message,
                              cudaGetErrorString(e1 != cudaSuccess ? e1 : e2)));
        cudaGetLastError();
        for (SeqBatch& b : batch) b.kv->truncate(*d.pool, b.kv->n_tokens());
        return st;
    }
    for (SeqBatch& b : batch) b.kv->set_n_tokens(b.kv->n_tokens() + b.n_tokens);
    return {};
}

// The copies of exp for this (prepared) batch, per destination and layer.
Status CudaBackend::Impl::plan_export(std::span<SeqBatch> batch, const KvExport& exp) {
    const KvLayout& l = pool->layout();
    if (!copy_stream) {  // the events first: a stream means everything is ready
        while (layer_done.size() < static_cast<size_t>(l.n_layer)) {
            cudaEvent_t e = nullptr;
            DUET_CUDA_TRY(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
            layer_done.push_back(e);
        }
        DUET_CUDA_TRY(cudaStreamCreateWithFlags(&copy_stream, cudaStreamNonBlocking));
    }
    // The blocks each exported sequence has once the pass is done (prepared: its
    // table already holds them), all of them: those written by earlier chunks or
    // taken from the prefix cache go with the layers of this pass.
    std::vector<ExportSeq> seqs;
    for (const SeqBatch& b : batch) seqs.push_back({b.kv->blocks(), b.kv->n_tokens() + b.n_tokens});
    auto plan = duet::plan_export(l, pool->allocator().n_blocks(), exp, seqs);
    if (!plan) return make_error("forward_export: {}", plan.error().message);
    export_runs = std::move(plan).value();
    export_dests = exp.dests;
    return {};
}

// One pass over a prepared batch, into logits; the KV of the new positions written.
Status CudaBackend::Impl::pass(std::span<SeqBatch> batch, int64_t T, int64_t n_out, bool decode_step,
                               std::vector<float>& logits, std::vector<int32_t>* argmax) {
    const ModelConfig& c = model->config();
    logits.resize(static_cast<size_t>(n_out * c.n_vocab));
    if (argmax) argmax->resize(static_cast<size_t>(n_out));
    if (T == 0) return {};

    const int bt = pool->layout().block_tokens;
    int64_t max_len = 0;
    size_t max_blocks = 1;
    for (const SeqBatch& b : batch) {
        max_len = std::max(max_len, b.kv->n_tokens() + b.n_tokens);
        max_blocks = std::max(max_blocks, b.kv->blocks().size());
    }
    const int n_seq = static_cast<int>(batch.size());
    const int bucket = o.graphs && decode_step ? graph_bucket(buckets, n_seq) : -1;
    const bool graph = bucket > 0 && static_cast<int64_t>(max_blocks) <= graph_max_blocks && max_len <= o.max_ctx;

    InputLayout l;
    int attn_len = static_cast<int>(max_len);
    Acts& a = graph ? graph_acts : eager;
    if (graph) {
        l.T = l.n_out = l.n_seq = bucket;
        l.max_blocks = graph_max_blocks;
        attn_len = splits_for(max_len) * cuda::kSplitTokens;  // the graph's split count
    } else {
        l.T = static_cast<int>(T);
        l.n_out = static_cast<int>(n_out);
        l.n_seq = n_seq;
        l.max_blocks = static_cast<int>(max_blocks);
    }
    // Prefill-like passes (4 or more queries per sequence on average) take the tiled
    // attention: each stretch of K/V read once per 16 queries instead of once per query.
    std::vector<int32_t> tiles;
    if (!graph && T >= 4 * static_cast<int64_t>(n_seq)) {
        std::vector<int32_t> row_seq;
        row_seq.reserve(static_cast<size_t>(T));
        for (int s = 0; s < n_seq; ++s) row_seq.insert(row_seq.end(), static_cast<size_t>(batch[static_cast<size_t>(s)].n_tokens), s);
        tiles = attention_query_tiles(row_seq, cuda::kPrefillTile);
        l.n_tiles = static_cast<int>(tiles.size() / 2);
    }
    bool moved = false;
    if (Status st = reserve(a, l, attn_len, &moved); !st) return st;
    if (graph && moved) return make_error("CUDA backend: the decode graph buffers moved (a bug)");

    // Inputs, staged in page-locked memory and sent in one copy.
    int32_t* h = hin.as<int32_t>();
    std::memset(h, 0, l.count() * 4);
    int32_t* tblock = h + l.tblock();
    for (int i = 0; i < l.T; ++i) {
        tblock[i] = -1;  // padding rows (graph steps): no KV write, nothing visible
        h[l.qseq() + i] = std::min(i, l.n_seq - 1);
    }
    int t = 0, o_row = 0;
    for (int s = 0; s < n_seq; ++s) {
        const SeqBatch& b = batch[static_cast<size_t>(s)];
        const std::vector<int32_t>& blocks = b.kv->blocks();
        std::copy(blocks.begin(), blocks.end(), h + l.tables() + static_cast<size_t>(s) * l.max_blocks);
        for (int32_t j = 0; j < b.n_tokens; ++j, ++t) {
            const int64_t p = b.kv->n_tokens() + j;
            h[l.tok() + t] = b.tokens[j];
            h[l.pos() + t] = static_cast<int32_t>(p);
            tblock[t] = blocks[static_cast<size_t>(p / bt)];
            h[l.toff() + t] = static_cast<int32_t>(p % bt);
            h[l.qseq() + t] = s;
            h[l.vis() + t] = static_cast<int32_t>(p + 1);
            if (b.all_logits || j == b.n_tokens - 1) h[l.orow() + o_row++] = t;
        }
    }
    for (int i = static_cast<int>(n_out); i < l.n_out; ++i) h[l.orow() + i] = i;  // graph padding rows
    std::copy(tiles.begin(), tiles.end(), h + l.tiles());
    DUET_CUDA_TRY(cudaMemcpyAsync(a.in.as<int32_t>(), h, l.count() * 4, cudaMemcpyHostToDevice, stream));

    mark(0);
    {
        trace::Range range(graph ? "cuda decode step (graph)" : "cuda forward");
        if (graph) {
            const std::pair<int, int> key{bucket, splits_for(max_len)};
            auto it = graphs.find(key);
            if (it == graphs.end()) {
                cudaGraph_t g = nullptr;
                DUET_CUDA_TRY(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
                Status st = enqueue(a, l, attn_len);
                const cudaError_t e = cudaStreamEndCapture(stream, &g);
                if (!st || e != cudaSuccess) {
                    if (g) cudaGraphDestroy(g);
                    return st ? cuda_ok(e, "cudaStreamEndCapture") : st;
                }
                cudaGraphExec_t exec = nullptr;
                const cudaError_t ie = cudaGraphInstantiate(&exec, g, 0);
                cudaGraphDestroy(g);
                DUET_CUDA_TRY(ie);
                it = graphs.emplace(key, exec).first;
                ++captures;
            }
            DUET_CUDA_TRY(cudaGraphLaunch(it->second, stream));
            ++replays;
        } else if (Status st = enqueue(a, l, attn_len); !st) {
            return st;
        }
    }
    mark(1);
    const size_t row_bytes = static_cast<size_t>(c.n_vocab) * sizeof(float);
    bool skip_any = false;
    if (argmax) {
        argmax->resize(static_cast<size_t>(n_out));
        bool moved = false;
        if (Status st = argmax_buf.reserve(static_cast<size_t>(n_out) * sizeof(int32_t), &moved); !st) return st;
        DUET_CUDA_TRY(cuda::argmax_rows(a.logits.as<float>(), static_cast<int>(n_out), c.n_vocab, argmax_buf.as<int32_t>(),
                                        stream));
        DUET_CUDA_TRY(cudaMemcpyAsync(argmax->data(), argmax_buf.as<int32_t>(), static_cast<size_t>(n_out) * sizeof(int32_t),
                                      cudaMemcpyDeviceToHost, stream));
        for (const SeqBatch& b : batch)
            skip_any = skip_any || ((b.argmax_only || b.sample) && !b.all_logits && b.n_tokens > 0);
        if (Status st = enqueue_samples(batch, a); !st) return st;
    }
    if (!skip_any) {
        DUET_CUDA_TRY(cudaMemcpyAsync(logits.data(), a.logits.as<float>(), static_cast<size_t>(n_out) * row_bytes,
                                      cudaMemcpyDeviceToHost, stream));
    } else {
        // Only the rows somebody reads; consecutive ones in one copy.
        size_t r = 0, run_start = 0, run_len = 0;
        auto flush = [&]() -> Status {
            if (run_len == 0) return {};
            const size_t off = run_start * static_cast<size_t>(c.n_vocab);
            DUET_CUDA_TRY(cudaMemcpyAsync(logits.data() + off, a.logits.as<float>() + off, run_len * row_bytes,
                                          cudaMemcpyDeviceToHost, stream));
            run_len = 0;
            return {};
        };
        for (const SeqBatch& b : batch) {
            if (b.n_tokens == 0) continue;
            const size_t rows = static_cast<size_t>(b.output_rows());
            if ((b.argmax_only || b.sample) && !b.all_logits) {
                if (Status st = flush(); !st) return st;
            } else {
                if (run_len == 0) run_start = r;
                run_len += rows;
            }
            r += rows;
        }
        if (Status st = flush(); !st) return st;
    }
    mark(2);
    DUET_CUDA_TRY(cudaStreamSynchronize(stream));
    trace_timings(graph);
    if (argmax && !sampled.empty()) return finish_samples(a, *argmax);
    return {};
}

cuda::SampleRow sample_row_for(const SampleRequest& s, int32_t row, int64_t n_vocab,
                               std::vector<cuda::SampleEdit>& edits, std::vector<uint32_t>& masks) {
    const SamplingParams& p = *s.params;
    cuda::SampleRow x;
    x.row = row;
    x.inv_temp = p.temperature <= 0.0f ? 0.0f : 1.0f / p.temperature;
    x.top_k = p.top_k;
    x.top_p = p.top_p;
    x.min_p_on = p.min_p > 0.0f;
    x.log_min_p = x.min_p_on ? std::log(p.min_p) : 0.0f;
    x.rep = p.repetition_penalty;
    x.u = sample_uniform(p.seed, s.index);
    // The penalties and the constraints' additions merged, one edit per token (both
    // lists are in id order).
    thread_local std::vector<PenaltyEdit> pe;
    thread_local std::vector<TokenAdd> adds;
    penalty_edits(p, n_vocab, s.prompt, s.output, pe);
    token_adds(s.constraints, n_vocab, adds);
    x.edit_begin = static_cast<int32_t>(edits.size());
    size_t i = 0, j = 0;
    while (i < pe.size() || j < adds.size()) {
        if (j == adds.size() || (i < pe.size() && pe[i].token < adds[j].token)) {
            edits.push_back({pe[i].token, pe[i].rep, pe[i].sub, 0.0f});
            ++i;
        } else if (i == pe.size() || adds[j].token < pe[i].token) {
            edits.push_back({adds[j].token, 0, 0.0f, adds[j].add});
            ++j;
        } else {
            edits.push_back({pe[i].token, pe[i].rep, pe[i].sub, adds[j].add});
            ++i;
            ++j;
        }
    }
    x.edit_count = static_cast<int32_t>(edits.size()) - x.edit_begin;
    if (!s.constraints.allowed.empty()) {
        // n_vocab bits, words the request's bitset lacks none allowed.
        const size_t words = static_cast<size_t>((n_vocab + 31) / 32);
        x.mask_begin = static_cast<int32_t>(masks.size());
        const std::span<const uint32_t> a = s.constraints.allowed;
        masks.insert(masks.end(), a.begin(), a.begin() + static_cast<std::ptrdiff_t>(std::min(words, a.size())));
        masks.resize(static_cast<size_t>(x.mask_begin) + words, 0u);
    }
    return x;
}

Status CudaBackend::Impl::enqueue_samples(std::span<SeqBatch> batch, const Acts& a) {
    const int64_t nv = model->config().n_vocab;
    sampled.clear();
    size_t r = 0;
    for (const SeqBatch& b : batch) {
        r += static_cast<size_t>(b.output_rows());
        if (b.sample && b.n_tokens > 0) sampled.push_back({r - 1, b.sample});
    }
    if (sampled.empty()) return {};
    // Per row its parameters as the CPU sampler derives them (1 / temperature, log of
    // min_p, in float), its draw, and its penalties as edits.
    std::vector<cuda::SampleRow>& rows = sample_rows_h;
    std::vector<cuda::SampleEdit>& edits = sample_edits_h;
    std::vector<uint32_t>& masks = sample_masks_h;
    rows.clear();
    edits.clear();
    masks.clear();
    for (const auto& [row, s] : sampled)
        rows.push_back(sample_row_for(*s, static_cast<int32_t>(row), nv, edits, masks));
    // One upload: the rows, their edits, their bitsets (a grammar's: n_vocab / 8 bytes
    // a row, against 4 n_vocab for its logits to the host).
    const size_t rows_bytes = (rows.size() * sizeof(cuda::SampleRow) + 255) / 256 * 256;
    const size_t edits_bytes = (edits.size() * sizeof(cuda::SampleEdit) + 255) / 256 * 256;
    const size_t bytes = rows_bytes + edits_bytes + masks.size() * sizeof(uint32_t);
    if (Status st = sample_in.reserve(bytes); !st) return st;
    if (Status st = sample_dev.reserve(bytes); !st) return st;
    const int n = static_cast<int>(rows.size());
    if (Status st = sample_ws.reserve(cuda::sample_workspace_bytes(n, nv)); !st) return st;
    if (Status st = sample_out.reserve(rows.size() * sizeof(int32_t)); !st) return st;
    auto* h = sample_in.as<uint8_t>();
    std::memcpy(h, rows.data(), rows.size() * sizeof(cuda::SampleRow));
    if (!edits.empty()) std::memcpy(h + rows_bytes, edits.data(), edits.size() * sizeof(cuda::SampleEdit));
    if (!masks.empty()) std::memcpy(h + rows_bytes + edits_bytes, masks.data(), masks.size() * sizeof(uint32_t));
    DUET_CUDA_TRY(cudaMemcpyAsync(sample_dev.as<uint8_t>(), h, bytes, cudaMemcpyHostToDevice, stream));
    {
        trace::Range range("cuda sample");
        uint8_t* d = sample_dev.as<uint8_t>();
        DUET_CUDA_TRY(
            cuda::sample_rows(a.logits.as<float>(), nv, reinterpret_cast<const cuda::SampleRow*>(d), n,
                              reinterpret_cast<const cuda::SampleEdit*>(d + rows_bytes),
                              masks.empty() ? nullptr : reinterpret_cast<const uint32_t*>(d + rows_bytes + edits_bytes),
                              sample_out.as<int32_t>(), sample_ws.as<void>(), stream));
    }
    sampled_picks.resize(rows.size());
    DUET_CUDA_TRY(cudaMemcpyAsync(sampled_picks.data(), sample_out.as<int32_t>(), rows.size() * sizeof(int32_t),
                                  cudaMemcpyDeviceToHost, stream));
    return {};
}

Status CudaBackend::Impl::finish_samples(const Acts& a, std::vector<int32_t>& picks) {
    const int64_t nv = model->config().n_vocab;
    for (size_t i = 0; i < sampled.size(); ++i) {
        const auto& [row, s] = sampled[i];
        int32_t pick = sampled_picks[i];
        if (pick < 0) {
            fallback_row.resize(static_cast<size_t>(nv));
            DUET_CUDA_TRY(cudaMemcpy(fallback_row.data(), a.logits.as<float>() + row * static_cast<size_t>(nv),
                                     static_cast<size_t>(nv) * sizeof(float), cudaMemcpyDeviceToHost));
            // Candidates beyond what the kernel sorts, or nothing its constraints
            // allow (-1 again: the caller fails the request).
            pick = host_sampler.sample(fallback_row.data(), nv, *s->params, s->prompt, s->output, s->index,
                                       s->constraints);
        }
        if (pick >= nv) return make_error("device sampling picked token {} of a vocabulary of {}", pick, nv);
        picks[row] = pick;
    }
    sampled.clear();
    return {};
}

}  // namespace duet
