// Sampling: each filter against a float64 computation written in the test, the
// (seed, index) determinism contract, and the empirical distribution.
#include "model/sampler.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <numeric>
#include <random>

using namespace duet;

namespace {

std::vector<double> softmax64(const std::vector<float>& l, double temp) {
    double mx = *std::max_element(l.begin(), l.end());
    std::vector<double> p(l.size());
    double s = 0;
    for (size_t i = 0; i < l.size(); ++i) s += p[i] = std::exp((l[i] - mx) / temp);
    for (double& x : p) x /= s;
    return p;
}

}  // namespace

TEST(Sampler, GreedyPicksArgmaxLowestIdOnTies) {
    Sampler s;
    std::vector<float> l = {0.1f, 3.0f, -1.0f, 3.0f};
    SamplingParams p;
    p.temperature = 0;
    EXPECT_EQ(s.sample(l.data(), 4, p, {}, {}, 0), 1);
}

TEST(Sampler, SameSeedAndIndexSameToken) {
    Sampler s1, s2;
    std::vector<float> l(1000);
    for (size_t i = 0; i < l.size(); ++i) l[i] = static_cast<float>(std::sin(i * 0.37) * 3);
    SamplingParams p;
    p.seed = 42;
    for (uint64_t i = 0; i < 50; ++i) EXPECT_EQ(s1.sample(l.data(), 1000, p, {}, {}, i), s2.sample(l.data(), 1000, p, {}, {}, i));
    // A different index or seed changes the draw.
    EXPECT_NE(sample_uniform(1, 0), sample_uniform(1, 1));
    EXPECT_NE(sample_uniform(1, 0), sample_uniform(2, 0));
}

TEST(Sampler, UniformDrawsAreUniform) {
    std::vector<int> bins(20, 0);
    const int n = 200000;
    for (int i = 0; i < n; ++i) {
        double u = sample_uniform(7, static_cast<uint64_t>(i));
        ASSERT_GE(u, 0.0);
        ASSERT_LT(u, 1.0);
        ++bins[static_cast<int>(u * 20)];
    }
    double chi2 = 0, e = n / 20.0;
    for (int b : bins) chi2 += (b - e) * (b - e) / e;
    EXPECT_LT(chi2, 43.8);  // p = 0.001 for 19 degrees of freedom
}

TEST(Sampler, TemperatureMatchesSoftmaxDistribution) {
    Sampler s;
    std::vector<float> l = {1.0f, 2.0f, 0.5f, -1.0f, 1.5f};
    SamplingParams p;
    p.temperature = 0.7f;
    p.seed = 3;
    std::vector<double> want = softmax64(l, 0.7);
    std::vector<int> got(5, 0);
    const int n = 100000;
    for (int i = 0; i < n; ++i) ++got[s.sample(l.data(), 5, p, {}, {}, static_cast<uint64_t>(i))];
    double chi2 = 0;
    for (int k = 0; k < 5; ++k) chi2 += (got[k] - n * want[k]) * (got[k] - n * want[k]) / (n * want[k]);
    EXPECT_LT(chi2, 18.5);  // p = 0.001 for 4 degrees of freedom
}

TEST(Sampler, TopKTopPMinPKeepTheRightSets) {
    Sampler s;
    // Probabilities at T=1 (float64): computed in the test from these logits.
    std::vector<float> l = {2.0f, 1.0f, 0.0f, -1.0f, 3.0f, -2.0f};
    std::vector<double> pr = softmax64(l, 1.0);
    auto support = [&](SamplingParams p) {
        std::map<int, int> seen;
        for (int i = 0; i < 20000; ++i) ++seen[s.sample(l.data(), 6, p, {}, {}, static_cast<uint64_t>(i))];
        std::vector<int> ids;
        for (auto& [k, v] : seen) ids.push_back(k);
        return ids;
    };
    SamplingParams p;
    p.top_k = 2;
    EXPECT_EQ(support(p), (std::vector<int>{0, 4}));
    p = {};
    p.top_k = 1;
    EXPECT_EQ(support(p), (std::vector<int>{4}));
    // top_p: smallest set of most likely tokens whose mass reaches top_p.
    p = {};
    p.top_p = static_cast<float>(pr[4] + pr[0] * 0.5);  // needs ids 4 and 0
    EXPECT_EQ(support(p), (std::vector<int>{0, 4}));
    p.top_p = static_cast<float>(pr[4] * 0.99);
    EXPECT_EQ(support(p), (std::vector<int>{4}));
    // min_p: p >= min_p * p_max. pr[1] / pr[4] = e^-2 ~ 0.135.
    p = {};
    p.min_p = 0.13f;
    EXPECT_EQ(support(p), (std::vector<int>{0, 1, 4}));
    p.min_p = 0.14f;
    EXPECT_EQ(support(p), (std::vector<int>{0, 4}));
}

TEST(Sampler, PenaltiesChangeLogitsAsSpecified) {
    Sampler s;
    SamplingParams p;
    p.temperature = 0;
    // Repetition: positive logits divided, negative multiplied.
    {
        std::vector<float> l = {2.0f, 1.9f, -0.1f};
        std::vector<int32_t> prompt = {0};
        p.repetition_penalty = 1.1f;  // 2.0/1.1 = 1.818 < 1.9
        EXPECT_EQ(s.sample(l.data(), 3, p, prompt, {}, 0), 1);
        p.repetition_penalty = 1.0f;
        EXPECT_EQ(s.sample(l.data(), 3, p, prompt, {}, 0), 0);
    }
    // Frequency: subtract count * penalty; presence: subtract once.
    {
        std::vector<float> l = {2.0f, 1.5f, 0.0f};
        std::vector<int32_t> out = {0, 0};
        p = {};
        p.temperature = 0;
        p.frequency_penalty = 0.2f;  // 2.0 - 0.4 = 1.6 > 1.5
        EXPECT_EQ(s.sample(l.data(), 3, p, {}, out, 0), 0);
        p.frequency_penalty = 0.3f;  // 2.0 - 0.6 = 1.4 < 1.5
        EXPECT_EQ(s.sample(l.data(), 3, p, {}, out, 0), 1);
        p.frequency_penalty = 0;
        p.presence_penalty = 0.6f;  // 2.0 - 0.6 = 1.4 < 1.5, once whatever the count
        EXPECT_EQ(s.sample(l.data(), 3, p, {}, out, 0), 1);
        p.presence_penalty = 0.4f;
        EXPECT_EQ(s.sample(l.data(), 3, p, {}, out, 0), 0);
    }
}

TEST(Sampler, ValidateRejectsAbsurdParameters) {
    SamplingParams p;
    EXPECT_TRUE(p.validate().ok());
    p.temperature = -1;
    EXPECT_FALSE(p.validate().ok());
    p = {};
    p.top_p = 0;
    EXPECT_FALSE(p.validate().ok());
    p = {};
    p.top_p = std::nanf("");
    EXPECT_FALSE(p.validate().ok());
    p = {};
    p.top_k = -3;
    EXPECT_NE(p.validate().error().message.find("top_k"), std::string::npos);
    p = {};
    p.frequency_penalty = 3;
    EXPECT_FALSE(p.validate().ok());
}

// penalty_edits keeps per-thread scratch between calls (it runs for every penalized
// row of every step): random prompts and outputs, vocabularies of several sizes one
// after another, ids out of range, each against a plain map of the same tokens.
TEST(Sampler, PenaltyEditsMatchAPlainCountAcrossCalls) {
    std::mt19937 rng(7);
    for (int round = 0; round < 300; ++round) {
        const int64_t nv = std::vector<int64_t>{1, 63, 64, 65, 1000, 49152}[static_cast<size_t>(round % 6)];
        SamplingParams p;
        p.repetition_penalty = round % 3 == 0 ? 1.0f : 1.2f;
        p.frequency_penalty = round % 4 == 1 ? 0.0f : 0.3f;
        p.presence_penalty = round % 5 == 2 ? 0.0f : -0.4f;
        std::uniform_int_distribution<int32_t> tok(-3, static_cast<int32_t>(nv) + 3);
        std::vector<int32_t> prompt(static_cast<size_t>(rng() % 300)), output(static_cast<size_t>(rng() % 200));
        for (auto& t : prompt) t = tok(rng);
        for (auto& t : output) t = tok(rng);
        std::map<int32_t, int32_t> want;  // token -> count in the output
        for (int32_t t : output)
            if (t >= 0 && t < nv) ++want[t];
        if (p.repetition_penalty != 1.0f)
            for (int32_t t : prompt)
                if (t >= 0 && t < nv) want.emplace(t, 0);
        std::vector<PenaltyEdit> e;
        penalty_edits(p, nv, prompt, output, e);
        if (!has_penalties(p)) {
            EXPECT_TRUE(e.empty());
            continue;
        }
        ASSERT_EQ(e.size(), want.size()) << "round " << round;
        size_t i = 0;
        for (const auto& [t, c] : want) {
            EXPECT_EQ(e[i].token, t) << "round " << round;
            EXPECT_EQ(e[i].rep, p.repetition_penalty != 1.0f ? 1 : 0);
            EXPECT_EQ(e[i].sub, c > 0 ? p.frequency_penalty * static_cast<float>(c) + p.presence_penalty : 0.0f);
            ++i;
        }
    }
}

// The penalties as edits (what a GPU sampler receives): one per distinct token of
// prompt or output, in id order; the repetition flag on every one of them (when the
// penalty is on); frequency x count + presence on output tokens only; ids outside
// the vocabulary ignored; nothing without penalties.
TEST(Sampler, PenaltyEditsListEachTouchedTokenOnce) {
    SamplingParams p;
    std::vector<PenaltyEdit> e;
    const std::vector<int32_t> prompt = {7, 3, 7, 99, -1}, output = {3, 5, 3, 3, 100};
    penalty_edits(p, 100, prompt, output, e);
    EXPECT_TRUE(e.empty());
    EXPECT_FALSE(has_penalties(p));
    p.repetition_penalty = 1.3f;
    p.frequency_penalty = 0.25f;
    p.presence_penalty = 0.5f;
    EXPECT_TRUE(has_penalties(p));
    penalty_edits(p, 100, prompt, output, e);
    ASSERT_EQ(e.size(), 4u);
    auto at = [&](size_t i, int32_t tok, int32_t rep, float sub) {
        EXPECT_EQ(e[i].token, tok) << i;
        EXPECT_EQ(e[i].rep, rep) << i;
        EXPECT_EQ(e[i].sub, sub) << i;
    };
    at(0, 3, 1, 0.25f * 3 + 0.5f);  // in the prompt and three times in the output
    at(1, 5, 1, 0.25f + 0.5f);
    at(2, 7, 1, 0.0f);              // prompt only: repetition alone
    at(3, 99, 1, 0.0f);
    p.repetition_penalty = 1.0f;  // frequency and presence only: output tokens
    penalty_edits(p, 100, prompt, output, e);
    ASSERT_EQ(e.size(), 2u);
    at(0, 3, 0, 0.25f * 3 + 0.5f);
    at(1, 5, 0, 0.25f + 0.5f);
    // The sampler applies exactly these: a greedy pick over logits where the edits
    // decide.
    Sampler s;
    SamplingParams g = p;
    g.temperature = 0;
    std::vector<float> l(100, 0.0f);
    l[3] = 2.0f;   // 2 - 1.25 = 0.75
    l[5] = 1.0f;   // 1 - 0.75 = 0.25
    l[50] = 0.7f;  // untouched
    EXPECT_EQ(s.sample(l.data(), 100, g, prompt, output, 0), 3);
    l[50] = 0.8f;
    EXPECT_EQ(s.sample(l.data(), 100, g, prompt, output, 0), 50);
}
