// The CUDA backend on the whole default model (ctest label `gpu`; skipped, not
// passed, without a GPU): its greedy tokens against the CPU backend's, its logits
// close to them, and the invariances the serving roles rely on (a sequence's logits
// do not depend on its batch, on how its prompt was chunked, on copy-on-write forks,
// nor on whether a decode step replayed a CUDA graph).
//
// Every CUDA use runs in a forked child (as in cuda_test.cpp), so the probe and the
// tests can share one binary run; the child's gtest failures print there and make
// its exit code non-zero.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "cuda/cuda_backend.h"
#include "kernels/cuda/device.h"
#include "engine/engine.h"
#include "cuda_test_util.h"

using namespace duet;

namespace {

using duet::testing::have_gpu;
using duet::testing::in_child;

std::unique_ptr<Engine> make_engine(const std::string& device, bool graphs = true, int64_t n_ctx = 2048,
                                    const std::string& kv_dtype = "f16", bool qgemv = false) {
    EngineOptions o;
    o.kv_dtype = kv_dtype;
    o.cuda_qgemv = qgemv;
    o.model_path = DUET_MODEL_PATH;
    o.threads = 2;
    o.n_ctx = n_ctx;
    o.device = device;
    o.cuda_graphs = graphs;
    auto r = Engine::create(o);
    if (!r) {
        ADD_FAILURE() << device << ": " << r.error().message;
        return nullptr;
    }
    return std::move(r).value();
}

int32_t argmax(const float* row, int64_t n) { return static_cast<int32_t>(std::max_element(row, row + n) - row); }

// Greedy continuation of prompt: n tokens, and the logits of every step. With
// `follow`, the tokens fed back are follow's (teacher forcing), not the argmax's:
// the logits of two backends stay comparable past a step where their picks part.
std::vector<int32_t> greedy(Engine& e, const std::vector<int32_t>& prompt, int n, std::vector<std::vector<float>>* steps,
                            const std::vector<int32_t>* follow = nullptr) {
    KvSeq seq;
    std::vector<float> l;
    std::vector<int32_t> out;
    SeqBatch b{&seq, prompt.data(), static_cast<int32_t>(prompt.size()), false};
    EXPECT_TRUE(e.backend().forward({&b, 1}, l).ok());
    for (int i = 0; i < n; ++i) {
        if (steps) steps->push_back(l);
        out.push_back(argmax(l.data(), e.backend().n_vocab()));
        const int32_t next = follow ? (*follow)[static_cast<size_t>(i)] : out.back();
        SeqBatch d{&seq, &next, 1, false};
        Status st = e.backend().forward({&d, 1}, l);
        EXPECT_TRUE(st.ok()) << st.error().message;
        if (!st) break;
    }
    seq.release(e.pool());
    return out;
}

double rms(const std::vector<float>& a) {
    double s = 0;
    for (float v : a) s += static_cast<double>(v) * v;
    return std::sqrt(s / static_cast<double>(a.size()));
}

double rms_diff(const std::vector<float>& a, const std::vector<float>& b) {
    double s = 0;
    for (size_t i = 0; i < a.size(); ++i) s += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    return std::sqrt(s / static_cast<double>(a.size()));
}

}  // namespace

// The GPU multiplies bf16 weights with bf16 activations, the CPU Q4_1 blocks with
// Q8_1 activations: logits differ by rounding, so greedy picks may part where the
// CPU's two best are nearly tied. The GPU is fed the CPU's tokens (teacher forcing),
// so that all 32 steps of every prompt are compared, and checked:
// - every step's logits within a relative RMS of the CPU's: 3% with an f16 cache. A
//   quantized cache rounds the two backends' slightly different K and V to its grid
//   independently, adding a grid step where they straddle a grid point: 4% for int8,
//   8% for fp8 (e4m3: 3 mantissa bits). Measured on an H200 (2026-12-04, the
//   default model's first 4 layers, all 128 steps): worst steps of 1.9% (f16), 2.0%
//   (f16, quantized GEMV), 2.4% (int8), 5.9% (fp8). The first bounds, set before any
//   GPU ran, were 2% for all, checked only up to the first parting;
// - picks part at few steps: at most 8 of 128 (20 with fp8); measured 3, 2, 1 and 9;
// - every step where the picks part is a near tie at that step's noise: the CPU's
//   margin between its pick and the GPU's under 5 times the RMS difference of the two
//   rows of logits (the difference of two logits' noise has about 1.4 times that
//   spread: a parting past it would be a 3.5-sigma event, not rounding).
// The same with the KV cache quantized (int8, fp8) on both backends, and with the
// GPU's decode projections from the GGUF blocks (the quantized GEMV: the CPU's very
// weights, where bf16 rounds them). The figures are printed for the GPU check's report.
TEST(CudaModel, GreedyTokensMatchTheCpuBackend) {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device on this machine";
    for (const auto& [dt, qgemv] : {std::pair{"f16", false}, {"int8", false}, {"fp8", false}, {"f16", true}}) in_child([dt, qgemv] {
        const double bound = std::string(dt) == "f16" ? 0.03 : std::string(dt) == "int8" ? 0.04 : 0.08;
        const int max_parted = std::string(dt) == "fp8" ? 20 : 8;  // of 128 steps
        auto cpu = make_engine("cpu", true, 2048, dt);
        auto gpu = make_engine("cuda:0", true, 2048, dt, qgemv);
        ASSERT_TRUE(cpu && gpu);
        if (qgemv) {
            EXPECT_NE(static_cast<CudaBackend&>(gpu->backend()).describe().find("quantized GEMV"), std::string::npos);
        }
        const std::vector<std::string> prompts = {
            "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
            "The quick brown fox",
            "def fibonacci(n):\n    ",
            "Once upon a time, in a small village by the sea, there lived",
        };
        double worst = 0, worst_tie = 0;
        int parted = 0, steps = 0;
        for (const std::string& p : prompts) {
            auto ids = cpu->tokenizer().encode(p, true, true);
            std::vector<std::vector<float>> lc, lg;
            auto tc = greedy(*cpu, ids, 32, &lc);
            ASSERT_EQ(tc.size(), 32u);
            auto tg = greedy(*gpu, ids, 32, &lg, &tc);
            ASSERT_EQ(tg.size(), 32u);
            for (size_t i = 0; i < tc.size(); ++i, ++steps) {
                const double d = rms_diff(lc[i], lg[i]);
                const double r = d / rms(lc[i]);
                worst = std::max(worst, r);
                EXPECT_LT(r, bound) << "prompt '" << p << "' step " << i;
                if (tc[i] == tg[i]) continue;
                ++parted;
                const double margin = lc[i][tc[i]] - lc[i][tg[i]];
                worst_tie = std::max(worst_tie, margin / d);
                EXPECT_LT(margin, 5 * d) << "prompt '" << p << "': step " << i << " CPU " << tc[i] << " GPU " << tg[i]
                                         << ": not a near tie at this step's noise " << d;
            }
        }
        EXPECT_LE(parted, max_parted) << "picks parted at too many steps for rounding";
        std::fprintf(stderr,
                     "KV %s%s: %d steps, worst relative RMS %.4f (bound %.2f); picks parted at %d steps, worst "
                     "CPU margin %.2f x the step's RMS difference (bound 5)\n",
                     dt, qgemv ? ", quantized GEMV" : "", steps, worst, bound, parted, worst_tie);
    });
}

// A sequence's logits are the same alone, in a batch with others, and prefilled in
// chunks; a copy-on-write fork continues like the original.
TEST(CudaModel, LogitsDoNotDependOnBatchChunkingOrForks) {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device on this machine";
    for (const char* dt : {"f16", "int8"}) in_child([dt] {
        std::fprintf(stderr, "KV %s\n", dt);
        auto e = make_engine("cuda:0", true, 2048, dt);
        ASSERT_TRUE(e);
        const int64_t nv = e->backend().n_vocab();
        std::vector<int32_t> a(700), b(90);
        for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<int32_t>((i * 7919 + 17) % nv);
        for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<int32_t>((i * 104729 + 5) % nv);
        std::vector<float> alone, l;
        {
            KvSeq s;
            SeqBatch x{&s, a.data(), static_cast<int32_t>(a.size()), false};
            ASSERT_TRUE(e->backend().forward({&x, 1}, alone).ok());
            s.release(e->pool());
        }
        // Chunked (100, 300, 300) with b in the same passes.
        KvSeq sa, sb;
        int32_t done = 0;
        for (int32_t n : {100, 300, 300}) {
            SeqBatch x[2] = {{&sb, b.data(), done == 0 ? static_cast<int32_t>(b.size()) : 0, false},
                             {&sa, a.data() + done, n, false}};
            ASSERT_TRUE(e->backend().forward(x, l).ok());
            done += n;
        }
        ASSERT_EQ(l.size(), static_cast<size_t>(nv));  // b had no tokens in the last pass: a's row only
        EXPECT_LT(rms_diff(alone, l) / rms(alone), 1e-3);
        EXPECT_EQ(argmax(alone.data(), nv), argmax(l.data(), nv));

        // Fork mid-block (700 = 43 blocks + 12): both decode 42 (the first write
        // copies the shared block: same logits); then a writes 999 at 701, the fork
        // 4242 at 701 into what was the same block, and a's next step must see its
        // own 999, as a never-forked sequence does.
        KvSeq fa = sa.fork(e->pool());
        std::vector<float> l1, l2, la, lr;
        int32_t t42 = 42, t999 = 999, t4242 = 4242, t7 = 7;
        SeqBatch x1{&sa, &t42, 1, false}, x2{&fa, &t42, 1, false};
        ASSERT_TRUE(e->backend().forward({&x1, 1}, l1).ok());
        ASSERT_TRUE(e->backend().forward({&x2, 1}, l2).ok());
        EXPECT_LT(rms_diff(l1, l2) / rms(l1), 1e-4);
        SeqBatch ya{&sa, &t999, 1, false}, yf{&fa, &t4242, 1, false}, za{&sa, &t7, 1, false};
        ASSERT_TRUE(e->backend().forward({&ya, 1}, l1).ok());
        ASSERT_TRUE(e->backend().forward({&yf, 1}, l2).ok());
        ASSERT_TRUE(e->backend().forward({&za, 1}, la).ok());
        {
            KvSeq r;
            std::vector<int32_t> ref = a;
            ref.insert(ref.end(), {42, 999, 7});
            SeqBatch x{&r, ref.data(), static_cast<int32_t>(ref.size()), false};
            ASSERT_TRUE(e->backend().forward({&x, 1}, lr).ok());
            r.release(e->pool());
        }
        EXPECT_LT(rms_diff(la, lr) / rms(lr), 1e-3) << "the fork's write reached the sequence it was forked from";
        sa.release(e->pool());
        sb.release(e->pool());
        fa.release(e->pool());
    });
}

// A verify row (a decode step of k positions: the newest token and k - 1 drafts) on
// the GPU runs as a plain launch (decode graphs replay one-token rows only) and
// gives the logits of k single steps, alone and beside graph-sized one-token rows,
// within the CUDA backend's chunking tolerance (the same as the test above; bitwise
// only on the CPU backend, tests/model_test.cpp), with the same greedy picks.
TEST(CudaModel, AVerifyRowGivesTheLogitsOfSingleSteps) {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device on this machine";
    in_child([] {
        auto e = make_engine("cuda:0", true, 2048);
        ASSERT_TRUE(e);
        const int64_t nv = e->backend().n_vocab();
        std::vector<int32_t> prefix(300), cont(8), other(40);
        for (size_t i = 0; i < prefix.size(); ++i) prefix[i] = static_cast<int32_t>((i * 7919 + 3) % nv);
        for (size_t i = 0; i < cont.size(); ++i) cont[i] = static_cast<int32_t>((i * 104729 + 11) % nv);
        for (size_t i = 0; i < other.size(); ++i) other[i] = static_cast<int32_t>((i * 31 + 5) % nv);
        std::vector<float> l;
        auto prefilled = [&](const std::vector<int32_t>& toks) {
            KvSeq s;
            SeqBatch b{&s, toks.data(), static_cast<int32_t>(toks.size()), false};
            EXPECT_TRUE(e->backend().forward({&b, 1}, l).ok());
            return s;
        };
        KvSeq ref = prefilled(prefix);
        std::vector<std::vector<float>> singles;
        for (int32_t t : cont) {
            SeqBatch b{&ref, &t, 1, false};
            ASSERT_TRUE(e->backend().forward({&b, 1}, l).ok());
            singles.push_back(l);
        }
        ref.release(e->pool());
        for (int32_t k = 1; k <= 8; ++k)
            for (const bool alone : {true, false}) {
                KvSeq sv = prefilled(prefix), so = prefilled(other);
                SeqBatch rows[2] = {{&so, other.data() + 39, 1, false}, {&sv, cont.data(), k, true}};
                const std::span<SeqBatch> batch = alone ? std::span<SeqBatch>(rows + 1, 1) : std::span<SeqBatch>(rows);
                ASSERT_TRUE(e->backend().forward(batch, l).ok());
                const int32_t first = alone ? 0 : 1;  // the verify row's first logits row
                ASSERT_EQ(l.size(), static_cast<size_t>((first + k) * nv));
                for (int32_t j = 0; j < k; ++j) {
                    const std::vector<float> row(l.begin() + (first + j) * nv, l.begin() + (first + j + 1) * nv);
                    EXPECT_LT(rms_diff(singles[j], row) / rms(singles[j]), 1e-3)
                        << "k = " << k << ", position " << j << (alone ? ", alone" : ", beside a one-token row");
                    EXPECT_EQ(argmax(singles[j].data(), nv), argmax(row.data(), nv))
                        << "k = " << k << ", position " << j << (alone ? ", alone" : ", beside a one-token row");
                }
                sv.release(e->pool());
                so.release(e->pool());
            }
    });
}

// Decode steps replayed from CUDA graphs give the eager pass's logits, for batch
// sizes that fill a bucket and that leave padding rows, across an attention split
// boundary (512 tokens).
TEST(CudaModel, GraphReplayedDecodeMatchesEager) {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device on this machine";
    in_child([] {
        auto g = make_engine("cuda:0", true, 8192);
        auto n = make_engine("cuda:0", false, 8192);
        ASSERT_TRUE(g && n);
        const int64_t nv = g->backend().n_vocab();
        for (int n_seq : {1, 3, 8}) {
            std::vector<KvSeq> sg(n_seq), sn(n_seq);
            std::vector<std::vector<int32_t>> prompts(n_seq);
            std::vector<SeqBatch> bg, bn;
            std::vector<float> lg, ln;
            for (int s = 0; s < n_seq; ++s) {
                prompts[s].resize(500 + 3 * s);
                for (size_t i = 0; i < prompts[s].size(); ++i)
                    prompts[s][i] = static_cast<int32_t>((i * 31 + s * 977 + 1) % nv);
                SeqBatch x{&sg[s], prompts[s].data(), static_cast<int32_t>(prompts[s].size()), false};
                SeqBatch y{&sn[s], prompts[s].data(), static_cast<int32_t>(prompts[s].size()), false};
                ASSERT_TRUE(g->backend().forward({&x, 1}, lg).ok());
                ASSERT_TRUE(n->backend().forward({&y, 1}, ln).ok());
            }
            std::vector<int32_t> next(n_seq, 7);
            for (int step = 0; step < 20; ++step) {  // positions 500..529 cross 512
                bg.clear();
                bn.clear();
                for (int s = 0; s < n_seq; ++s) {
                    bg.push_back({&sg[s], &next[s], 1, false});
                    bn.push_back({&sn[s], &next[s], 1, false});
                }
                ASSERT_TRUE(g->backend().forward(bg, lg).ok());
                ASSERT_TRUE(n->backend().forward(bn, ln).ok());
                ASSERT_EQ(lg.size(), ln.size());
                // Same kernels; a padded bucket (3 in 4) may take another cuBLAS algorithm.
                EXPECT_LT(rms_diff(lg, ln) / rms(ln), n_seq == 3 ? 1e-3 : 1e-5) << n_seq << " sequences, step " << step;
                for (int s = 0; s < n_seq; ++s) next[s] = argmax(ln.data() + s * nv, nv);
            }
            for (int s = 0; s < n_seq; ++s) {
                sg[s].release(g->pool());
                sn[s].release(n->pool());
            }
        }
        auto* cb = dynamic_cast<CudaBackend*>(&g->backend());
        ASSERT_NE(cb, nullptr);
        EXPECT_EQ(cb->graph_replays(), 3 * 20);  // every decode step above
        EXPECT_GE(cb->graphs_captured(), 3);     // buckets 1, 4, 8; one and two attention splits
        std::fprintf(stderr, "%s: %d graphs, %lld replays\n", cb->describe().c_str(), cb->graphs_captured(),
                     static_cast<long long>(cb->graph_replays()));
    });
}

// A prefill's KV exported layer by layer into a second arena (as a hand-off to a
// decode process on another GPU would be; here both arenas are on GPU 0): the
// copied tiles equal the originals byte for byte, and a second backend decoding
// from the copy gives the original's logits and tokens.
TEST(CudaModel, KvExportedLayerByLayerDecodesLikeTheOriginal) {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device on this machine";
    in_child([] {
        auto e = make_engine("cuda:0");
        ASSERT_TRUE(e);
        auto* be = dynamic_cast<CudaBackend*>(&e->backend());
        ASSERT_NE(be, nullptr);
        const KvLayout layout = e->pool().layout();
        constexpr int32_t kBlocks = 64;
        auto mem = CudaKvMemory::create(0, layout, kBlocks);
        ASSERT_TRUE(mem) << mem.error().message;
        KvPool pool_b(layout, (*mem)->data(), std::make_unique<LocalBlockAllocator>(kBlocks));
        std::vector<int32_t> all(kBlocks);
        ASSERT_TRUE(pool_b.allocator().alloc(kBlocks, all.data()));
        std::shuffle(all.begin(), all.end(), std::mt19937(3));
        const int64_t nv = be->n_vocab();
        std::vector<int32_t> prompt(700);
        for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>((i * 7919 + 3) % nv);
        const size_t n_blk = (prompt.size() + 15) / 16;
        std::vector<int32_t> dst(all.begin(), all.begin() + static_cast<ptrdiff_t>(n_blk));
        for (size_t i = n_blk; i < all.size(); ++i) pool_b.allocator().unref(all[i]);

        KvSeq sa;
        std::vector<float> la, lb;
        KvExport exp;
        exp.dests = {KvDest{(*mem)->data(), kBlocks}};
        exp.dest = {0};
        exp.dst_ids = {dst};
        for (auto [from, n] : {std::pair{0, 300}, std::pair{300, 400}}) {
            SeqBatch b{&sa, prompt.data() + from, n, false};
            Status st = be->forward_export({&b, 1}, la, exp);
            ASSERT_TRUE(st.ok()) << st.error().message;
        }
        // Byte for byte, every layer of every block.
        const size_t tile = layout.tile_bytes();
        std::vector<uint8_t> x(tile), y(tile);
        for (size_t i = 0; i < n_blk; ++i)
            for (int32_t l = 0; l < layout.n_layer; ++l) {
                ASSERT_EQ(cudaMemcpy(x.data(), e->pool().k(sa.blocks()[i], l, 0), tile, cudaMemcpyDeviceToHost), cudaSuccess);
                ASSERT_EQ(cudaMemcpy(y.data(), pool_b.k(dst[i], l, 0), tile, cudaMemcpyDeviceToHost), cudaSuccess);
                ASSERT_EQ(x, y) << "block " << i << " layer " << l;
            }
        // A second backend on the copy decodes as the original does.
        CudaBackendOptions co;
        co.max_batch = 8;
        co.max_ctx = 2048;
        auto be2 = CudaBackend::create(e->model(), pool_b, co);
        ASSERT_TRUE(be2) << be2.error().message;
        KvSeq sb = KvSeq::adopt(dst, static_cast<int64_t>(prompt.size()));
        int32_t ta = argmax(la.data(), nv), tb = ta;
        for (int step = 0; step < 8; ++step) {
            SeqBatch xa{&sa, &ta, 1, false}, xb{&sb, &tb, 1, false};
            ASSERT_TRUE(be->forward({&xa, 1}, la).ok());
            ASSERT_TRUE((*be2)->forward({&xb, 1}, lb).ok());
            EXPECT_LT(rms_diff(la, lb) / rms(la), 1e-5) << "step " << step;
            ta = argmax(la.data(), nv);
            tb = argmax(lb.data(), nv);
            ASSERT_EQ(ta, tb) << "step " << step;
        }
        sa.release(e->pool());
        sb.release(pool_b);
    });
}

// forward_pick on the device: decode steps (graph-replayed) whose rows are
// argmax_only give the argmax of the rows an identical batch returns in full, and
// the rows not marked come back whole.
TEST(CudaModel, DeviceArgmaxIsTheGreedyPickOfTheFullRow) {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device on this machine";
    in_child([] {
        auto e = make_engine("cuda:0");
        ASSERT_TRUE(e);
        const int64_t nv = e->backend().n_vocab();
        constexpr int kSeqs = 3;
        std::vector<KvSeq> sa(kSeqs), sb(kSeqs);
        std::vector<std::vector<int32_t>> prompts(kSeqs);
        std::vector<float> la, lb;
        std::vector<int32_t> am;
        for (int s = 0; s < kSeqs; ++s) {
            prompts[s].resize(60 + 11 * s);
            for (size_t i = 0; i < prompts[s].size(); ++i) prompts[s][i] = static_cast<int32_t>((i * 131 + s * 7 + 1) % nv);
            SeqBatch x{&sa[s], prompts[s].data(), static_cast<int32_t>(prompts[s].size()), false};
            SeqBatch y{&sb[s], prompts[s].data(), static_cast<int32_t>(prompts[s].size()), false};
            ASSERT_TRUE(e->backend().forward({&x, 1}, la).ok());
            ASSERT_TRUE(e->backend().forward({&y, 1}, lb).ok());
        }
        std::vector<int32_t> next(kSeqs, 11);
        for (int step = 0; step < 6; ++step) {
            std::vector<SeqBatch> ba, bb;
            for (int s = 0; s < kSeqs; ++s) {
                ba.push_back({&sa[s], &next[s], 1, false, s != 1});  // the middle one in full
                bb.push_back({&sb[s], &next[s], 1, false});
            }
            ASSERT_TRUE(e->backend().forward_pick(ba, la, am).ok());
            ASSERT_TRUE(e->backend().forward(bb, lb).ok());
            ASSERT_EQ(am.size(), static_cast<size_t>(kSeqs));
            for (int s = 0; s < kSeqs; ++s)
                EXPECT_EQ(am[s], argmax(lb.data() + s * nv, nv)) << "step " << step << " sequence " << s;
            EXPECT_TRUE(std::equal(la.begin() + nv, la.begin() + 2 * nv, lb.begin() + nv)) << "the full row, step " << step;
            for (int s = 0; s < kSeqs; ++s) next[s] = am[s];
        }
        for (int s = 0; s < kSeqs; ++s) {
            sa[s].release(e->pool());
            sb[s].release(e->pool());
        }
    });
}

// forward_pick with sample requests on the device: over decode steps of five
// sequences (each with other sampling parameters: temperature, top-k, top-p, min-p,
// penalties, and one whose top_k of 5000 leaves it to the host), the picks are the
// CPU sampler's over the rows an identical batch returns in full.
TEST(CudaModel, DeviceSamplingPicksTheCpuSamplersTokens) {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device on this machine";
    in_child([] {
        auto e = make_engine("cuda:0");
        ASSERT_TRUE(e);
        const int64_t nv = e->backend().n_vocab();
        constexpr int kSeqs = 5;
        std::vector<SamplingParams> params(kSeqs);
        params[0].temperature = 0.8f;
        params[1].temperature = 1.0f, params[1].top_k = 40, params[1].top_p = 0.9f;
        params[2].temperature = 0.7f, params[2].min_p = 0.05f, params[2].repetition_penalty = 1.2f;
        params[3].temperature = 0.0f, params[3].frequency_penalty = 0.5f, params[3].presence_penalty = 0.3f;
        params[4].temperature = 1.2f, params[4].top_k = 5000;
        for (int s = 0; s < kSeqs; ++s) params[s].seed = 17 + s;
        std::vector<KvSeq> sa(kSeqs), sb(kSeqs);
        std::vector<std::vector<int32_t>> prompts(kSeqs), outs(kSeqs);
        std::vector<float> la, lb;
        std::vector<int32_t> picks;
        for (int s = 0; s < kSeqs; ++s) {
            prompts[s].resize(40 + 9 * s);
            for (size_t i = 0; i < prompts[s].size(); ++i) prompts[s][i] = static_cast<int32_t>((i * 131 + s * 7 + 1) % nv);
            SeqBatch x{&sa[s], prompts[s].data(), static_cast<int32_t>(prompts[s].size()), false};
            SeqBatch y{&sb[s], prompts[s].data(), static_cast<int32_t>(prompts[s].size()), false};
            ASSERT_TRUE(e->backend().forward({&x, 1}, la).ok());
            ASSERT_TRUE(e->backend().forward({&y, 1}, lb).ok());
            outs[s].push_back(static_cast<int32_t>(s + 3));
        }
        Sampler cpu;
        for (int step = 0; step < 8; ++step) {
            std::vector<SeqBatch> ba, bb;
            std::vector<SampleRequest> reqs(kSeqs);
            for (int s = 0; s < kSeqs; ++s) {
                reqs[s] = SampleRequest{&params[s], prompts[s], outs[s], outs[s].size()};
                SeqBatch x{&sa[s], &outs[s].back(), 1, false};
                x.sample = &reqs[s];
                ba.push_back(x);
                bb.push_back({&sb[s], &outs[s].back(), 1, false});
            }
            ASSERT_TRUE(e->backend().forward_pick(ba, la, picks).ok());
            ASSERT_TRUE(e->backend().forward(bb, lb).ok());
            ASSERT_EQ(picks.size(), static_cast<size_t>(kSeqs));
            for (int s = 0; s < kSeqs; ++s) {
                const int32_t want = cpu.sample(lb.data() + s * nv, nv, params[s], prompts[s], outs[s], outs[s].size());
                EXPECT_EQ(picks[s], want) << "step " << step << " sequence " << s;
            }
            for (int s = 0; s < kSeqs; ++s) outs[s].push_back(picks[s]);
        }
        for (int s = 0; s < kSeqs; ++s) {
            sa[s].release(e->pool());
            sb[s].release(e->pool());
        }
    });
}
