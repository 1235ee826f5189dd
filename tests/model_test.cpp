// The model on the real default model: logits and greedy continuations against
// llama.cpp's (tests/fixtures, made by scripts/make-references.py), and the
// batch- and chunk-invariance contract that crash recovery relies on.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>

#include "base/thread_pool.h"
#include "engine/engine.h"
#include "model/cpu_backend.h"
#include "require.h"

using namespace duet;

// model_test_scalar / model_test_avx2 (tests/CMakeLists.txt) run this suite with
// DUET_ISA capping the kernel level. On a CPU without that level the cap would run a
// lower one under the level's name: the run is skipped (exit 77) saying why, or fails
// where DUET_REQUIRE names the level. (--gtest_list_tests, ctest's discovery, runs
// without DUET_ISA.)
[[maybe_unused]] static const bool kCapChecked = [] {
    const char* cap = std::getenv("DUET_ISA");
    if (!cap || !*cap) return true;
    const std::string level(cap);
    const cpu::Isa want = level == "amx"      ? cpu::Isa::Amx
                          : level == "avx512" ? cpu::Isa::Avx512
                          : level == "avx2"   ? cpu::Isa::Avx2
                                              : cpu::Isa::Scalar;
    // This CPU's best level is what the default run (no DUET_ISA) already ran: the
    // suite again under its name would prove nothing new.
    const cpu::Isa best = cpu::isa_supported(cpu::Isa::Amx)      ? cpu::Isa::Amx
                          : cpu::isa_supported(cpu::Isa::Avx512) ? cpu::Isa::Avx512
                          : cpu::isa_supported(cpu::Isa::Avx2)   ? cpu::Isa::Avx2
                                                                 : cpu::Isa::Scalar;
    if (want == best) {
        std::fprintf(stderr, "SKIPPED: DUET_ISA=%s is this CPU's best level: the default run of the suite was it\n",
                     cap);
        std::exit(77);
    }
    if (cpu::isa_supported(want)) return true;
    std::fprintf(stderr, "%s: DUET_ISA=%s, which this CPU or build lacks: the suite at that level did not run\n",
                 test_require::required(level) ? "FAIL (DUET_REQUIRE)" : "SKIPPED", cap);
    std::exit(test_require::required(level) ? 1 : 77);
}();
using nlohmann::json;

namespace {

Engine& engine() {
    static std::unique_ptr<Engine> e = [] {
        EngineOptions o;
        o.model_path = DUET_MODEL_PATH;
        o.threads = 2;
        o.n_ctx = 2048;
        auto r = Engine::create(o);
        if (!r) {
            ADD_FAILURE() << r.error().message;
            std::abort();
        }
        return std::move(r).value();
    }();
    return *e;
}

json load_fixture(const std::string& name) {
    std::ifstream in(std::string(DUET_FIXTURES) + "/" + name);
    if (!in) {
        ADD_FAILURE() << "missing fixture " << name << ": run scripts/make-references.py";
        return json();
    }
    return json::parse(in);
}

std::vector<int32_t> prompt_ids(int n, int salt) {
    std::vector<int32_t> v(n);
    for (int i = 0; i < n; ++i) v[i] = (i * 7919 + salt * 104729 + 17) % 49152;
    return v;
}

// All-position logits of one sequence, fed in chunks of `chunk` tokens.
std::vector<float> run_chunked(Engine& e, const std::vector<int32_t>& toks, int chunk) {
    KvSeq seq;
    std::vector<float> all, l;
    for (size_t i = 0; i < toks.size(); i += chunk) {
        int n = static_cast<int>(std::min<size_t>(chunk, toks.size() - i));
        SeqBatch b{&seq, toks.data() + i, n, true};
        Status s = e.backend().forward({&b, 1}, l);
        EXPECT_TRUE(s.ok()) << s.error().message;
        all.insert(all.end(), l.begin(), l.end());
    }
    seq.release(e.pool());
    return all;
}

}  // namespace

TEST(Model, LoadsSmolLM2Hyperparameters) {
    const ModelConfig& c = engine().model().config();
    EXPECT_EQ(c.arch, "llama");
    EXPECT_EQ(c.n_layer, 30);
    EXPECT_EQ(c.n_embd, 576);
    EXPECT_EQ(c.n_head, 9);
    EXPECT_EQ(c.n_head_kv, 3);
    EXPECT_EQ(c.head_dim, 64);
    EXPECT_EQ(c.n_vocab, 49152);
    EXPECT_EQ(c.rope_base, 100000.0);
    EXPECT_TRUE(c.tied_output);
}

// A token's logits must not depend on how its sequence was chunked: a re-driven
// request re-prefills its answer and must continue it token for token.
TEST(Model, LogitsAreBitwiseIndependentOfChunking) {
    Engine& e = engine();
    auto toks = prompt_ids(40, 1);
    auto whole = run_chunked(e, toks, 40);
    auto ones = run_chunked(e, toks, 1);
    auto sevens = run_chunked(e, toks, 7);
    ASSERT_EQ(whole.size(), ones.size());
    ASSERT_EQ(whole.size(), sevens.size());
    EXPECT_EQ(0, std::memcmp(whole.data(), ones.data(), whole.size() * sizeof(float)));
    EXPECT_EQ(0, std::memcmp(whole.data(), sevens.data(), whole.size() * sizeof(float)));
}

// The last layer runs its output projection and MLP only for the rows whose
// logits are wanted (CpuBackend::run): a prompt's last row must equal that row
// of an all-rows pass, whether the pass is short (per-thread copies) or long,
// and a prompt fed in chunks that each keep one row must leave the KV that
// continues exactly.
TEST(Model, RowsWithoutLogitsSkipTheLastLayerExactly) {
    Engine& e = engine();
    const int64_t nv = e.model().config().n_vocab;
    const size_t row = static_cast<size_t>(nv) * sizeof(float);
    for (int n : {5, 40}) {
        const auto toks = prompt_ids(n, 21 + n);
        const auto all = run_chunked(e, toks, n);
        ASSERT_EQ(all.size(), static_cast<size_t>(n * nv));
        std::vector<float> l;
        KvSeq s;
        SeqBatch b{&s, toks.data(), n, false};
        ASSERT_TRUE(e.backend().forward({&b, 1}, l).ok());
        ASSERT_EQ(l.size(), static_cast<size_t>(nv));
        EXPECT_EQ(0, std::memcmp(all.data() + static_cast<size_t>(n - 1) * nv, l.data(), row)) << n << " tokens";
        s.release(e.pool());
        // Chunks of up to 3 (each wanting its last row), then the last token alone.
        KvSeq c;
        for (int i = 0; i + 1 < n; i += 3) {
            const int k = std::min(3, n - 1 - i);
            SeqBatch ch{&c, toks.data() + i, k, false};
            ASSERT_TRUE(e.backend().forward({&ch, 1}, l).ok());
        }
        SeqBatch last{&c, toks.data() + n - 1, 1, false};
        ASSERT_TRUE(e.backend().forward({&last, 1}, l).ok());
        EXPECT_EQ(0, std::memcmp(all.data() + static_cast<size_t>(n - 1) * nv, l.data(), row)) << n << " in chunks";
        c.release(e.pool());
    }
    // Several kept rows in one short pass: two 3-token entries keep rows 2 and 5.
    const auto a = prompt_ids(3, 31), b = prompt_ids(3, 32);
    const auto a_all = run_chunked(e, a, 3), b_all = run_chunked(e, b, 3);
    KvSeq sa, sb;
    SeqBatch two[2] = {{&sa, a.data(), 3, false}, {&sb, b.data(), 3, false}};
    std::vector<float> l;
    ASSERT_TRUE(e.backend().forward(two, l).ok());
    ASSERT_EQ(l.size(), static_cast<size_t>(2 * nv));
    EXPECT_EQ(0, std::memcmp(a_all.data() + 2 * nv, l.data(), row));
    EXPECT_EQ(0, std::memcmp(b_all.data() + 2 * nv, l.data() + nv, row));
    sa.release(e.pool());
    sb.release(e.pool());
}

// ...nor on how many threads compute it: the kernels split work by output rows and
// heads, never a reduction across threads. (Cores lent between roles change a
// worker's thread count from one pass to the next; a request's KV and logits must
// not notice.) A 40-token prompt in one pass and in chunks of 7, then 3 decode steps
// of a batch of two, on 1, 2, 3 and 5 threads.
TEST(Model, LogitsAreBitwiseIndependentOfThreadCount) {
    const Model& m = engine().model();
    auto toks = prompt_ids(40, 5), other = prompt_ids(23, 6);
    auto run = [&](int n_threads, int chunk) {
        ThreadPool threads(n_threads);
        auto pool = KvPool::create(kv_layout(m, KvDtype::F16), 64);
        EXPECT_TRUE(pool.ok());
        CpuBackend b(m, **pool, threads, engine().isa());
        KvSeq a, c;
        std::vector<float> all, l;
        for (size_t i = 0; i < toks.size(); i += static_cast<size_t>(chunk)) {
            const int n = std::min<int>(chunk, static_cast<int>(toks.size() - i));
            SeqBatch sb{&a, toks.data() + i, n, true};
            EXPECT_TRUE(b.forward({&sb, 1}, l).ok());
            all.insert(all.end(), l.begin(), l.end());
        }
        SeqBatch sc{&c, other.data(), static_cast<int32_t>(other.size()), false};
        EXPECT_TRUE(b.forward({&sc, 1}, l).ok());
        for (int step = 0; step < 3; ++step) {
            int32_t ta = 100 + step, tc = 200 + step;
            SeqBatch two[2] = {{&a, &ta, 1, false}, {&c, &tc, 1, false}};
            EXPECT_TRUE(b.forward({two, 2}, l).ok());
            all.insert(all.end(), l.begin(), l.end());
        }
        a.release(**pool);
        c.release(**pool);
        return all;
    };
    const std::vector<float> one = run(1, 40);
    for (auto [n, chunk] : {std::pair{2, 40}, std::pair{3, 7}, std::pair{5, 40}}) {
        const std::vector<float> got = run(n, chunk);
        ASSERT_EQ(got.size(), one.size());
        EXPECT_EQ(0, std::memcmp(got.data(), one.data(), one.size() * sizeof(float)))
            << n << " threads (chunks of " << chunk << ") give other logits than 1 thread";
    }
}

// A pass stopped between layers (Backend::set_interrupt: prefill's pass for a
// critical arrival) changes nothing: the batch is as before (positions and blocks),
// the check is consulted only in the first half of the layers, and the same pass run
// again gives the logits of a sequence that was never stopped, bitwise.
TEST(Model, AnInterruptedPassLeavesTheBatchAsBeforeAndRunsAgainExactly) {
    const Model& m = engine().model();
    const int64_t n_layer = m.config().n_layer;
    ThreadPool threads(2);
    auto pool = KvPool::create(kv_layout(m, KvDtype::F16), 64);
    ASSERT_TRUE(pool.ok());
    CpuBackend b(m, **pool, threads, engine().isa());
    auto toks = prompt_ids(50, 9);
    std::vector<float> ref, got;
    {  // the reference: 20 tokens, then 30, never stopped
        KvSeq s;
        SeqBatch one{&s, toks.data(), 20, false};
        ASSERT_TRUE(b.forward({&one, 1}, ref).ok());
        SeqBatch two{&s, toks.data() + 20, 30, true};
        ASSERT_TRUE(b.forward({&two, 1}, ref).ok());
        s.release(**pool);
    }
    KvSeq s;
    SeqBatch one{&s, toks.data(), 20, false};
    ASSERT_TRUE(b.forward({&one, 1}, got).ok());
    const std::vector<int32_t> blocks = s.blocks();
    const int32_t free_before = (*pool)->allocator().n_free();
    // Never stops: consulted once per layer of the first half only.
    int calls = 0;
    b.set_interrupt([&] { return ++calls, false; });
    {
        KvSeq t;
        SeqBatch x{&t, toks.data(), 5, false};
        ASSERT_TRUE(b.forward({&x, 1}, got).ok());
        EXPECT_EQ(calls, n_layer / 2);
        t.release(**pool);
    }
    // Stops at the 3rd check (before layer 3), then at the first.
    for (int stop_at : {3, 1}) {
        calls = 0;
        b.set_interrupt([&] { return ++calls == stop_at; });
        SeqBatch two{&s, toks.data() + 20, 30, true};
        Status st = b.forward({&two, 1}, got);
        ASSERT_FALSE(st.ok());
        EXPECT_EQ(st.kind(), ErrorKind::Interrupted);
        EXPECT_NE(st.error().message.find(fmt::format("before layer {} of {}", stop_at, n_layer)), std::string::npos)
            << st.error().message;
        EXPECT_EQ(calls, stop_at);
        EXPECT_EQ(s.n_tokens(), 20) << "no position appended";
        EXPECT_EQ(s.blocks(), blocks) << "the blocks prepared for the stopped positions went back";
        EXPECT_EQ((*pool)->allocator().n_free(), free_before);
    }
    b.set_interrupt({});
    SeqBatch two{&s, toks.data() + 20, 30, true};
    ASSERT_TRUE(b.forward({&two, 1}, got).ok());
    ASSERT_EQ(got.size(), ref.size());
    EXPECT_EQ(0, std::memcmp(got.data(), ref.data(), ref.size() * sizeof(float)))
        << "the pass run again after two stops gives other logits";
    s.release(**pool);
}

// ...nor on what else is in the batch.
TEST(Model, LogitsAreBitwiseIndependentOfBatch) {
    Engine& e = engine();
    auto a = prompt_ids(23, 2), b = prompt_ids(37, 3), c = prompt_ids(5, 4);
    auto alone = run_chunked(e, a, 23);
    KvSeq sa, sb, sc;
    // b and c first get some history, then all three go in one batch.
    std::vector<float> l;
    SeqBatch pre[2] = {{&sb, b.data(), 30, false}, {&sc, c.data(), 2, false}};
    ASSERT_TRUE(e.backend().forward(pre, l).ok());
    SeqBatch mixed[3] = {{&sb, b.data() + 30, 7, false}, {&sa, a.data(), 23, true}, {&sc, c.data() + 2, 3, true}};
    ASSERT_TRUE(e.backend().forward(mixed, l).ok());
    const int64_t nv = e.model().config().n_vocab;
    ASSERT_EQ(l.size(), static_cast<size_t>((1 + 23 + 3) * nv));
    EXPECT_EQ(0, std::memcmp(alone.data(), l.data() + nv, alone.size() * sizeof(float)));
    // And c's rows equal c alone.
    auto c_alone = run_chunked(e, c, 5);
    EXPECT_EQ(0, std::memcmp(c_alone.data() + 2 * nv, l.data() + 24 * nv, 3 * nv * sizeof(float)));
    sa.release(e.pool());
    sb.release(e.pool());
    sc.release(e.pool());
}

// A verify row (engine/decode_scheduler.h): a decode step of k positions, the newest
// token and k - 1 drafted ones, whose logits must be bitwise those of k single
// steps, alone and batched beside plain one-token rows and a prefill chunk; and a
// row whose tail was rejected (truncated) continues as if it had never been
// computed. Speculative decoding is exact because of this.
TEST(Model, AVerifyRowOfKTokensGivesTheLogitsOfKSingleSteps) {
    Engine& e = engine();
    const int64_t nv = e.model().config().n_vocab;
    const auto prefix = prompt_ids(30, 11), cont = prompt_ids(9, 12);
    const auto other = prompt_ids(20, 13), third = prompt_ids(12, 14);
    std::vector<float> l;
    auto prefilled = [&](const std::vector<int32_t>& toks) {
        KvSeq s;
        SeqBatch b{&s, toks.data(), static_cast<int32_t>(toks.size()), false};
        EXPECT_TRUE(e.backend().forward({&b, 1}, l).ok());
        return s;
    };
    // The reference: cont fed one token per pass after the prefix.
    KvSeq ref = prefilled(prefix);
    std::vector<float> singles;
    for (int32_t t : cont) {
        SeqBatch b{&ref, &t, 1, false};
        ASSERT_TRUE(e.backend().forward({&b, 1}, l).ok());
        singles.insert(singles.end(), l.begin(), l.end());
    }
    ref.release(e.pool());
    for (int32_t k = 1; k <= 8; ++k) {
        const size_t bytes = static_cast<size_t>(k * nv) * sizeof(float);
        KvSeq alone = prefilled(prefix);
        SeqBatch v{&alone, cont.data(), k, true};
        ASSERT_TRUE(e.backend().forward({&v, 1}, l).ok());
        ASSERT_EQ(l.size(), static_cast<size_t>(k * nv));
        EXPECT_EQ(0, std::memcmp(singles.data(), l.data(), bytes)) << "alone, k = " << k;
        // Rejected past j: the KV truncated to the prefix and j positions, the next
        // single step gives position j's reference logits again.
        const int32_t j = k / 2;
        alone.truncate(e.pool(), static_cast<int64_t>(prefix.size()) + j);
        SeqBatch next{&alone, cont.data() + j, 1, false};
        ASSERT_TRUE(e.backend().forward({&next, 1}, l).ok());
        EXPECT_EQ(0, std::memcmp(singles.data() + j * nv, l.data(), static_cast<size_t>(nv) * sizeof(float)))
            << "after truncating to " << j << " of " << k;
        alone.release(e.pool());

        KvSeq sv = prefilled(prefix), so = prefilled(other), st;
        SeqBatch mixed[3] = {
            {&so, other.data() + 19, 1, false}, {&sv, cont.data(), k, true}, {&st, third.data(), 12, false}};
        ASSERT_TRUE(e.backend().forward(mixed, l).ok());
        ASSERT_EQ(l.size(), static_cast<size_t>((1 + k + 1) * nv));
        EXPECT_EQ(0, std::memcmp(singles.data(), l.data() + nv, bytes)) << "batched, k = " << k;
        sv.release(e.pool());
        so.release(e.pool());
        st.release(e.pool());
    }
}

TEST(Model, ForwardRejectsBadTokenIdsAndKeepsState) {
    Engine& e = engine();
    KvSeq s;
    std::vector<int32_t> bad = {1, 2, 49152};
    std::vector<float> l;
    SeqBatch b{&s, bad.data(), 3, false};
    Status st = e.backend().forward({&b, 1}, l);
    EXPECT_FALSE(st.ok());
    EXPECT_NE(st.error().message.find("49152"), std::string::npos);
    EXPECT_EQ(s.n_tokens(), 0);
    EXPECT_TRUE(s.blocks().empty());
}

namespace {

// log(sum(exp(l))) in float64.
double lse(const float* l, int64_t n) {
    double mx = l[0];
    for (int64_t i = 1; i < n; ++i) mx = std::max(mx, static_cast<double>(l[i]));
    double s = 0;
    for (int64_t i = 0; i < n; ++i) s += std::exp(l[i] - mx);
    return mx + std::log(s);
}

}  // namespace

// Logits against llama.cpp's at 5 positions of 4 prompts. duet rounds
// activations to 8 bits for the integer dot products and Q and the attention
// probabilities to f16, as llama.cpp does; at the AVX2 level its matrix products
// even agree with llama.cpp's to the bit. But 8-bit rounding is discontinuous, so
// any other summation order flips a few roundings and the flips spread through 30
// layers: llama.cpp's own batch and one-token-at-a-time paths differ by up to 1.4
// in one logit (the fixture's incremental_vs_batch). Held to, per prompt: mean
// |dlogprob| over the 296 stored logits x 5 positions <= 0.3, worst <= 2.0; the
// log-sum-exp within 0.6; the top-1 id equal wherever llama.cpp's top-1/top-2 gap
// exceeds 1.4. Measured 2026-11-29 (scalar / avx2 / avx512): worst prompt mean
// 0.13 / 0.15 / 0.23, worst logit 0.79 / 0.75 / 1.72. The accuracy test below
// is the tighter check.
TEST(Model, LogitsMatchLlamaCpp) {
    Engine& e = engine();
    json fx = load_fixture("logits.json");
    ASSERT_FALSE(fx.is_null());
    const int64_t nv = e.model().config().n_vocab;
    const int start = fx["meta"]["fixed_ids"]["start"], stride = fx["meta"]["fixed_ids"]["stride"];
    for (const json& p : fx["prompts"]) {
        std::vector<int32_t> ids = p["ids"].get<std::vector<int32_t>>();
        auto logits = run_chunked(e, ids, static_cast<int>(ids.size()));
        double sum = 0, mx = 0;
        int n = 0;
        for (const json& at : p["positions"]) {
            const int pos = at["pos"];
            const float* l = logits.data() + static_cast<size_t>(pos) * nv;
            const double my_lse = lse(l, nv);
            const double ref_lse = at["lse"];
            EXPECT_NEAR(my_lse, ref_lse, 0.6) << p["name"] << " pos " << pos;
            // Log-probabilities (logit - lse), so a uniform shift is not an error.
            auto cmp = [&](int id, double ref) {
                double d = std::abs((l[id] - my_lse) - (ref - ref_lse));
                sum += d;
                mx = std::max(mx, d);
                ++n;
            };
            for (const json& t : at["top"]) cmp(t[0].get<int>(), t[1].get<double>());
            for (size_t k = 0; k < at["fixed"].size(); ++k) cmp(start + static_cast<int>(k) * stride, at["fixed"][k].get<double>());
            const double gap = at["top"][0][1].get<double>() - at["top"][1][1].get<double>();
            int my_top = static_cast<int>(std::max_element(l, l + nv) - l);
            if (gap > 1.4) {
                EXPECT_EQ(my_top, at["top"][0][0].get<int>()) << p["name"] << " pos " << pos << " gap " << gap;
            }
        }
        std::printf("%-10s vs llama.cpp: mean |dlogprob| %.4f, worst %.4f\n", p["name"].get<std::string>().c_str(),
                    sum / n, mx);
        EXPECT_LE(sum / n, 0.3) << p["name"];
        EXPECT_LE(mx, 2.0) << p["name"];
    }
}

// Accuracy against exact arithmetic: at every stored position, duet's log-probs
// are compared with a float64 forward pass (tests/fixtures/logits_f64.json, numpy,
// no code shared with duet) and so are llama.cpp's. duet must be about as accurate
// as llama.cpp. Over all 4 prompts (5,920 log-probs), duet's mean |dlogprob| from
// float64 must be within 1.1x llama.cpp's. Per prompt the mean moves by about
// +-0.02 whenever a kernel's summation order changes (measured while tuning the
// AVX-512 kernels), so a prompt is held to 1.5x llama.cpp's + 0.02; a single logit
// to llama.cpp's worst + 1.0 (one flipped 8-bit rounding moves a logit by up to
// 1.4 in llama.cpp itself, see above). Measured 2026-11-29, avx512: duet 0.135
// overall vs llama.cpp 0.146; worst logits 0.50-0.89 vs llama.cpp's 0.49-0.90.
TEST(Model, LogitsAsAccurateAsLlamaCpp) {
    Engine& e = engine();
    json ref = load_fixture("logits.json");
    json f64 = load_fixture("logits_f64.json");
    ASSERT_FALSE(ref.is_null());
    ASSERT_FALSE(f64.is_null());
    const int64_t nv = e.model().config().n_vocab;
    const int start = ref["meta"]["fixed_ids"]["start"], stride = ref["meta"]["fixed_ids"]["stride"];
    double duet_all = 0, llama_all = 0;
    int n_all = 0;
    for (size_t pi = 0; pi < ref["prompts"].size(); ++pi) {
        const json& p = ref["prompts"][pi];
        const json& x = f64["prompts"][pi];
        ASSERT_EQ(p["ids"], x["ids"]);
        std::vector<int32_t> ids = p["ids"].get<std::vector<int32_t>>();
        auto logits = run_chunked(e, ids, static_cast<int>(ids.size()));
        double duet_sum = 0, llama_sum = 0, duet_max = 0, llama_max = 0;
        int n = 0;
        for (size_t k = 0; k < p["positions"].size(); ++k) {
            const json& at = p["positions"][k];
            const json& ex = x["positions"][k];
            const float* l = logits.data() + static_cast<size_t>(at["pos"].get<int>()) * nv;
            const double my_lse = lse(l, nv), ref_lse = at["lse"], ex_lse = ex["lse"];
            auto one = [&](int id, double llama_logit, double exact_logit) {
                const double exact = exact_logit - ex_lse;
                const double dd = std::abs((l[id] - my_lse) - exact);
                const double dl = std::abs((llama_logit - ref_lse) - exact);
                duet_sum += dd;
                llama_sum += dl;
                duet_max = std::max(duet_max, dd);
                llama_max = std::max(llama_max, dl);
                ++n;
            };
            for (size_t t = 0; t < at["top"].size(); ++t)
                one(at["top"][t][0].get<int>(), at["top"][t][1].get<double>(), ex["top"][t][1].get<double>());
            for (size_t t = 0; t < at["fixed"].size(); ++t)
                one(start + static_cast<int>(t) * stride, at["fixed"][t].get<double>(), ex["fixed"][t].get<double>());
        }
        std::printf("%-10s vs float64: duet mean %.4f max %.4f | llama.cpp mean %.4f max %.4f\n",
                    p["name"].get<std::string>().c_str(), duet_sum / n, duet_max, llama_sum / n, llama_max);
        EXPECT_LE(duet_sum / n, 1.5 * llama_sum / n + 0.02) << p["name"];
        EXPECT_LE(duet_max, llama_max + 1.0) << p["name"];
        duet_all += duet_sum;
        llama_all += llama_sum;
        n_all += n;
    }
    std::printf("all prompts vs float64: duet mean %.4f | llama.cpp mean %.4f\n", duet_all / n_all, llama_all / n_all);
    EXPECT_LE(duet_all / n_all, 1.1 * llama_all / n_all);
}

// 64-token greedy continuations against llama.cpp's: identical up to the first
// step where llama.cpp's own top-1/top-2 gap is below 0.5 (a near-tie, where
// 8-bit activation rounding decides: llama.cpp's own two paths differ by up to
// 1.4 in a logit); a divergence at a larger gap is a bug.
TEST(Model, GreedyContinuationsMatchLlamaCpp) {
    Engine& e = engine();
    json fx = load_fixture("greedy.json");
    ASSERT_FALSE(fx.is_null());
    for (const json& r : fx["runs"]) {
        std::vector<int32_t> prompt = r["prompt_ids"].get<std::vector<int32_t>>();
        std::vector<int32_t> want = r["ids"].get<std::vector<int32_t>>();
        std::vector<double> gap = r["gap"].get<std::vector<double>>();
        GenerateOptions g;
        g.max_tokens = static_cast<int64_t>(want.size());
        g.sampling.temperature = 0;
        g.stop_at_eog = false;
        std::vector<int32_t> got;
        auto st = e.generate(prompt, g, [&](int32_t id) {
            got.push_back(id);
            return true;
        });
        ASSERT_TRUE(st.ok()) << st.error().message;
        ASSERT_EQ(got.size(), want.size());
        size_t same = 0;
        while (same < want.size() && got[same] == want[same]) ++same;
        if (same < want.size()) {
            // The contexts are identical up to here, so only this step's own margin
            // can explain a different argmax.
            EXPECT_LT(gap[same], 0.5) << r["name"] << ": diverges at step " << same << " (got " << got[same]
                                      << ", llama.cpp " << want[same] << ") where llama.cpp's top-1/top-2 gap is "
                                      << gap[same];
        }
        std::printf("greedy %s: %zu of %zu tokens identical\n", r["name"].get<std::string>().c_str(), same, want.size());
    }
}

// Every step of llama.cpp's greedy runs, not only those before the first near tie
// (the free run above parts at step 0 of the chat run in most runs, where the gap is
// 0.35, and then checks nothing): llama.cpp's own 64 ids follow the prompt in one
// pass (teacher forcing), and at each step the argmax is llama.cpp's id wherever its
// top-1/top-2 gap is at least 0.5, and one of its top two where it is a near tie.
TEST(Model, TeacherForcedGreedyStepsMatchLlamaCpp) {
    Engine& e = engine();
    const int64_t nv = e.model().config().n_vocab;
    json fx = load_fixture("greedy.json");
    ASSERT_FALSE(fx.is_null());
    size_t checked = 0, ties = 0;
    for (const json& r : fx["runs"]) {
        const auto prompt = r["prompt_ids"].get<std::vector<int32_t>>();
        const auto want = r["ids"].get<std::vector<int32_t>>();
        const auto second = r["second_ids"].get<std::vector<int32_t>>();
        const auto gap = r["gap"].get<std::vector<double>>();
        ASSERT_EQ(want.size(), gap.size());
        std::vector<int32_t> ids = prompt;
        ids.insert(ids.end(), want.begin(), want.end() - 1);
        KvSeq s;
        std::vector<float> l;
        SeqBatch x[1] = {{&s, ids.data(), static_cast<int32_t>(ids.size()), true}};
        ASSERT_TRUE(e.backend().forward(x, l).ok());
        ASSERT_EQ(l.size(), ids.size() * static_cast<size_t>(nv));
        for (size_t i = 0; i < want.size(); ++i) {
            const float* row = l.data() + (prompt.size() - 1 + i) * static_cast<size_t>(nv);
            const int32_t got = static_cast<int32_t>(std::max_element(row, row + nv) - row);
            if (gap[i] >= 0.5) {
                EXPECT_EQ(got, want[i]) << r["name"] << " step " << i << ": llama.cpp's gap " << gap[i];
                ++checked;
            } else {
                EXPECT_TRUE(got == want[i] || got == second[i])
                    << r["name"] << " step " << i << ": " << got << " is not llama.cpp's top two (" << want[i] << ", "
                    << second[i] << ") at a near tie (gap " << gap[i] << ")";
                ties += got != want[i];
            }
        }
        s.release(e.pool());
    }
    std::printf("teacher-forced greedy: %zu clear steps identical to llama.cpp; %zu near ties went to its second\n",
                checked, ties);
    EXPECT_GT(checked, 150u) << "most steps have a clear margin";
}

// forward_pick: every output row's argmax is the sampler's greedy pick (lowest id
// on ties), for argmax_only entries too, and the other rows' logits are all there.
TEST(Model, ForwardArgmaxGivesTheGreedyPickOfEveryRow) {
    Engine& e = engine();
    const int64_t nv = e.model().config().n_vocab;
    auto a = prompt_ids(40, 1), b = prompt_ids(25, 2);
    KvSeq s1, s2, r1, r2;
    std::vector<float> l, ref;
    std::vector<int32_t> am;
    SeqBatch x[2] = {{&s1, a.data(), 40, false, true}, {&s2, b.data(), 25, true, false}};
    ASSERT_TRUE(e.backend().forward_pick(x, l, am).ok());
    SeqBatch y[2] = {{&r1, a.data(), 40, false}, {&r2, b.data(), 25, true}};
    ASSERT_TRUE(e.backend().forward(y, ref).ok());
    ASSERT_EQ(am.size(), 26u);  // one row for the first, every position of the second
    Sampler greedy;
    SamplingParams p;
    p.temperature = 0;
    for (size_t r = 0; r < am.size(); ++r)
        EXPECT_EQ(am[r], greedy.sample(ref.data() + r * nv, nv, p, {}, {}, 0)) << "row " << r;
    // The second entry's rows are all given, as forward() gives them.
    ASSERT_EQ(l.size(), ref.size());
    EXPECT_TRUE(std::equal(l.begin() + nv, l.end(), ref.begin() + nv));
    for (KvSeq* s : {&s1, &s2, &r1, &r2}) s->release(e.pool());
}

// forward_pick with sample requests: the pick of each sampling entry's (last) row is
// the sampler's token for that request and position, whatever rows come before it
// (an all-logits entry's several rows, an entry that only takes the argmax).
TEST(Model, ForwardPickSamplesTheRowsOfSampleEntries) {
    Engine& e = engine();
    const int64_t nv = e.model().config().n_vocab;
    auto a = prompt_ids(12, 1), b = prompt_ids(9, 2), c = prompt_ids(7, 3);
    SamplingParams pb, pc;
    pb.temperature = 0.9f, pb.top_k = 50, pb.seed = 5;
    pc.temperature = 1.1f, pc.top_p = 0.8f, pc.repetition_penalty = 1.3f, pc.seed = 6;
    const std::vector<int32_t> out_c = {c[0], 42};
    SampleRequest rb{&pb, b, {}, 0}, rc{&pc, c, out_c, 2};
    KvSeq s1, s2, s3, r1, r2, r3;
    std::vector<float> l, ref;
    std::vector<int32_t> picks;
    SeqBatch x[3] = {{&s1, a.data(), 12, true}, {&s2, b.data(), 9, false}, {&s3, c.data(), 7, false}};
    x[1].sample = &rb;
    x[2].sample = &rc;
    ASSERT_TRUE(e.backend().forward_pick(x, l, picks).ok());
    SeqBatch y[3] = {{&r1, a.data(), 12, true}, {&r2, b.data(), 9, false}, {&r3, c.data(), 7, false}};
    ASSERT_TRUE(e.backend().forward(y, ref).ok());
    ASSERT_EQ(picks.size(), 14u);
    Sampler sm;
    EXPECT_EQ(picks[12], sm.sample(ref.data() + 12 * nv, nv, pb, b, {}, 0));
    EXPECT_EQ(picks[13], sm.sample(ref.data() + 13 * nv, nv, pc, c, out_c, 2));
    SamplingParams greedy;
    greedy.temperature = 0;
    for (size_t r = 0; r < 12; ++r) EXPECT_EQ(picks[r], sm.sample(ref.data() + r * nv, nv, greedy, {}, {}, 0)) << r;
    // The draws matter: another position of c's request gives another token somewhere.
    int differ = 0;
    for (uint64_t i = 3; i < 40; ++i) differ += sm.sample(ref.data() + 13 * nv, nv, pc, c, out_c, i) != picks[13];
    EXPECT_GT(differ, 0);
    for (KvSeq* s : {&s1, &s2, &s3, &r1, &r2, &r3}) s->release(e.pool());
}

// forward_export (a hand-off into another arena): after the pass every block of
// the exported sequence — those earlier passes wrote too — is in its destination
// blocks, byte for byte, every layer; no other destination block is touched; an
// entry not exported copies nothing; a backend decoding from the copy gives the
// original's logits exactly. Too few destination blocks: an error, and the
// sequence is as before the call.
TEST(Model, ForwardExportCopiesEverySequenceBlockIntoTheOtherArena) {
    Engine& e = engine();
    const KvLayout layout = e.pool().layout();
    constexpr int32_t kBlocks = 32;
    auto pool_b = KvPool::create(layout, kBlocks);
    ASSERT_TRUE(pool_b.ok()) << pool_b.error().message;
    KvPool& b = **pool_b;
    const size_t arena_bytes = layout.block_bytes() * kBlocks;
    std::memset(b.data(), 0xAB, arena_bytes);
    std::vector<int32_t> ids(kBlocks);
    ASSERT_TRUE(b.allocator().alloc(kBlocks, ids.data()));
    std::shuffle(ids.begin(), ids.end(), std::mt19937(11));
    const std::vector<int32_t> dst(ids.begin(), ids.begin() + 5);  // 70 tokens: 5 blocks

    auto a = prompt_ids(70, 7), other = prompt_ids(20, 8);
    KvSeq sa, so;
    std::vector<float> la, lo;
    SeqBatch first{&sa, a.data(), 40, false};
    ASSERT_TRUE(e.backend().forward({&first, 1}, la).ok());
    KvExport exp;
    exp.dests = {KvDest{b.data(), kBlocks}};
    // Too few destination blocks for 70 tokens: refused, nothing changed.
    exp.dest = {0, -1};
    exp.dst_ids = {std::vector<int32_t>(dst.begin(), dst.begin() + 4), {}};
    SeqBatch pass[2] = {{&sa, a.data() + 40, 30, false}, {&so, other.data(), 20, false}};
    auto bad = e.backend().forward_export(pass, la, exp);
    ASSERT_FALSE(bad.ok());
    EXPECT_NE(bad.error().message.find("4 destination blocks"), std::string::npos) << bad.error().message;
    EXPECT_EQ(sa.n_tokens(), 40);
    EXPECT_EQ(so.n_tokens(), 0);
    for (size_t i = 0; i < arena_bytes; ++i) ASSERT_EQ(reinterpret_cast<const uint8_t*>(b.data())[i], 0xAB) << i;

    exp.dst_ids[0] = dst;
    ASSERT_TRUE(e.backend().forward_export(pass, la, exp).ok());
    ASSERT_EQ(sa.n_tokens(), 70);
    ASSERT_EQ(sa.blocks().size(), 5u);
    const size_t tile = layout.tile_bytes();
    std::vector<bool> named(kBlocks, false);
    for (size_t i = 0; i < dst.size(); ++i) {
        named[static_cast<size_t>(dst[i])] = true;
        for (int32_t l = 0; l < layout.n_layer; ++l)
            ASSERT_EQ(std::memcmp(e.pool().k(sa.blocks()[i], l, 0), b.k(dst[i], l, 0), tile), 0)
                << "block " << i << " layer " << l;
    }
    for (int32_t blk = 0; blk < kBlocks; ++blk)
        for (int32_t l = 0; !named[static_cast<size_t>(blk)] && l < layout.n_layer; ++l) {
            const auto* p = reinterpret_cast<const uint8_t*>(b.k(blk, l, 0));
            for (size_t i = 0; i < tile; ++i) ASSERT_EQ(p[i], 0xAB) << "block " << blk << " layer " << l << " touched";
        }

    // Decoding from the copy, with a backend of its own, gives the same logits.
    ThreadPool threads(1);
    CpuBackend cb(e.model(), b, threads, e.isa());
    for (size_t i = 5; i < ids.size(); ++i) b.allocator().unref(ids[i]);
    KvSeq sb = KvSeq::adopt(dst, 70);
    std::vector<float> lb;
    const int64_t nv = e.model().config().n_vocab;
    int32_t tok = static_cast<int32_t>(std::max_element(la.begin(), la.begin() + nv) - la.begin());
    for (int step = 0; step < 4; ++step) {
        SeqBatch xa{&sa, &tok, 1, false}, xb{&sb, &tok, 1, false};
        ASSERT_TRUE(e.backend().forward({&xa, 1}, la).ok());
        ASSERT_TRUE(cb.forward({&xb, 1}, lb).ok());
        ASSERT_EQ(la, lb) << "step " << step;
        tok = static_cast<int32_t>(std::max_element(la.begin(), la.end()) - la.begin());
    }
    sa.release(e.pool());
    so.release(e.pool());
    sb.release(b);
}

// ---------------------------------------------------------------------------
// Quantized KV (--kv-dtype int8 / fp8): a scale per (token, head) row, set when the
// row is written, so the chunking and batch invariance above still hold bit for
// bit; the logits stay close to the exact ones.

namespace {

Engine& quantized_engine(const std::string& dtype) {
    static std::map<std::string, std::unique_ptr<Engine>> engines;
    auto& e = engines[dtype];
    if (!e) {
        EngineOptions o;
        o.model_path = DUET_MODEL_PATH;
        o.threads = 2;
        o.n_ctx = 2048;
        o.kv_dtype = dtype;
        auto r = Engine::create(o);
        if (!r) {
            ADD_FAILURE() << r.error().message;
            std::abort();
        }
        e = std::move(r).value();
    }
    return *e;
}

// Mean and max |log-prob - float64 log-prob| over the logits fixture's positions.
std::pair<double, double> logprob_error(Engine& e, const json& ref, const json& f64) {
    const int64_t nv = e.model().config().n_vocab;
    const int start = ref["meta"]["fixed_ids"]["start"], stride = ref["meta"]["fixed_ids"]["stride"];
    double sum = 0, mx = 0;
    int n = 0;
    for (size_t pi = 0; pi < ref["prompts"].size(); ++pi) {
        const json& p = ref["prompts"][pi];
        const json& x = f64["prompts"][pi];
        std::vector<int32_t> ids = p["ids"].get<std::vector<int32_t>>();
        auto logits = run_chunked(e, ids, static_cast<int>(ids.size()));
        for (size_t k = 0; k < x["positions"].size(); ++k) {
            const json& ex = x["positions"][k];
            const float* l = logits.data() + static_cast<size_t>(ex["pos"].get<int>()) * nv;
            const double my_lse = lse(l, nv), ex_lse = ex["lse"];
            auto one = [&](int id, double exact_logit) {
                const double d = std::abs((l[id] - my_lse) - (exact_logit - ex_lse));
                sum += d;
                mx = std::max(mx, d);
                ++n;
            };
            for (size_t t = 0; t < ex["top"].size(); ++t) one(ex["top"][t][0].get<int>(), ex["top"][t][1].get<double>());
            for (size_t t = 0; t < ex["fixed"].size(); ++t)
                one(start + static_cast<int>(t) * stride, ex["fixed"][t].get<double>());
        }
    }
    return {sum / n, mx};
}

}  // namespace

TEST(Model, QuantizedKvLogitsAreBitwiseIndependentOfChunkingAndBatch) {
    for (const char* dt : {"int8", "fp8"}) {
        Engine& e = quantized_engine(dt);
        EXPECT_EQ(e.pool().layout().dtype, *parse_kv_dtype(dt));
        auto toks = prompt_ids(40, 1);
        auto whole = run_chunked(e, toks, 40);
        auto ones = run_chunked(e, toks, 1);
        auto sevens = run_chunked(e, toks, 7);
        ASSERT_EQ(whole.size(), ones.size());
        EXPECT_EQ(0, std::memcmp(whole.data(), ones.data(), whole.size() * sizeof(float))) << dt;
        EXPECT_EQ(0, std::memcmp(whole.data(), sevens.data(), whole.size() * sizeof(float))) << dt;
        // Batched with another sequence: the same rows.
        auto other = prompt_ids(9, 5);
        KvSeq sa, sb;
        std::vector<float> l;
        SeqBatch both[2] = {{&sb, other.data(), 9, false}, {&sa, toks.data(), 40, true}};
        ASSERT_TRUE(e.backend().forward(both, l).ok());
        const int64_t nv = e.model().config().n_vocab;
        EXPECT_EQ(0, std::memcmp(whole.data(), l.data() + nv, whole.size() * sizeof(float))) << dt;
        sa.release(e.pool());
        sb.release(e.pool());
        // And the f16 cache gives different logits: the quantization is really there.
        auto f16 = run_chunked(engine(), toks, 40);
        EXPECT_NE(0, std::memcmp(whole.data(), f16.data(), whole.size() * sizeof(float))) << dt;
    }
}

TEST(Model, QuantizedKvLogitsStayCloseToExact) {
    json ref = load_fixture("logits.json");
    json f64 = load_fixture("logits_f64.json");
    ASSERT_FALSE(ref.is_null() || f64.is_null());
    const auto [f16_mean, f16_max] = logprob_error(engine(), ref, f64);
    std::printf("f16 KV vs float64: mean |dlogprob| %.4f max %.4f\n", f16_mean, f16_max);
    // Bounds: measured 2026-11-29 (avx512) int8 0.187 / max 2.39, fp8 0.208 / max
    // 2.99 against f16's 0.135 / 0.89. At this level the figure is chaotic: any
    // change of a KV value flips some 8-bit activation roundings downstream (an f16
    // cache holding int8-rounded K and V scored 0.128, a 32-value scale group 0.167),
    // so the bounds leave room; a wrong scale or row gives errors of several units.
    for (const char* dt : {"int8", "fp8"}) {
        const auto [mean, mx] = logprob_error(quantized_engine(dt), ref, f64);
        std::printf("%s KV vs float64: mean |dlogprob| %.4f max %.4f\n", dt, mean, mx);
        EXPECT_LE(mean, f16_mean + (std::string(dt) == "int8" ? 0.1 : 0.15)) << dt;
        EXPECT_LE(mx, 4.5) << dt;
    }
    // Greedy continuations: how long they follow the f16 cache's.
    json fx = load_fixture("greedy.json");
    ASSERT_FALSE(fx.is_null());
    auto greedy = [](Engine& e, const std::vector<int32_t>& prompt, size_t n) {
        GenerateOptions g;
        g.max_tokens = static_cast<int64_t>(n);
        g.sampling.temperature = 0;
        g.stop_at_eog = false;
        std::vector<int32_t> got;
        EXPECT_TRUE(e.generate(prompt, g, [&](int32_t id) {
                         got.push_back(id);
                         return true;
                     }).ok());
        return got;
    };
    for (const char* dt : {"int8", "fp8"}) {
        size_t same_all = 0, n_all = 0;
        for (const json& r : fx["runs"]) {
            std::vector<int32_t> prompt = r["prompt_ids"].get<std::vector<int32_t>>();
            const auto want = greedy(engine(), prompt, 32), got = greedy(quantized_engine(dt), prompt, 32);
            size_t same = 0;
            while (same < want.size() && same < got.size() && got[same] == want[same]) ++same;
            same_all += same;
            n_all += want.size();
        }
        std::printf("%s KV greedy: %zu of %zu tokens as with the f16 cache (prefix per prompt)\n", dt, same_all, n_all);
    }
}
