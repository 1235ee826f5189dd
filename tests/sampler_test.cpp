// Sampling: each filter against a float64 computation written in the test, the
// (seed, index) determinism contract, and the empirical distribution.
#include "model/sampler.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
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

TEST(Sampler, AMaskBansExactlyTheTokensItDoesNotAllow) {
    constexpr float kBanned = -std::numeric_limits<float>::infinity();
    const int64_t n = 70;  // two whole words and 6 bits of a third
    std::vector<uint32_t> bits = {0xFFFFFFFFu, 0x00000000u, 0b100101u};
    std::vector<float> row(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) row[static_cast<size_t>(i)] = static_cast<float>(i);
    row[3] = kBanned;  // banned already (a bias of -100 after min_tokens, say)
    EXPECT_EQ(apply_token_mask(row.data(), n, bits), 31 + 3);
    for (int64_t i = 0; i < n; ++i) {
        const bool allowed = i < 32 ? i != 3 : i >= 64 && ((0b100101u >> (i - 64)) & 1u);
        EXPECT_EQ(row[static_cast<size_t>(i)], allowed ? static_cast<float>(i) : kBanned) << i;
    }
    std::vector<float> one = {1, 2, 3};
    EXPECT_EQ(apply_token_mask(one.data(), 3, std::vector<uint32_t>{0}), 0) << "nothing allowed: nothing left";
    EXPECT_EQ(one, std::vector<float>(3, kBanned));
}

// Constraints as the worker applied them on the host before they reached the
// sampler (and a GPU sampler): the row copied, each bias added, the banned tokens
// -inf, the tokens the bitset lacks -inf, then the plain sampler with its penalties;
// -1 when nothing is left. Random rows, bias tables, bans and bitsets over greedy,
// tempered, top-k / top-p / min-p and penalized parameters.
TEST(Sampler, ConstraintsPickWhatTheRowEditedByHandGives) {
    constexpr float kBanned = -std::numeric_limits<float>::infinity();
    std::mt19937 rng(11);
    Sampler s, plain;
    int picked = 0, none = 0;
    for (int round = 0; round < 400; ++round) {
        const int64_t nv = std::vector<int64_t>{5, 64, 70, 1000}[static_cast<size_t>(round % 4)];
        std::normal_distribution<float> z(0.0f, 2.0f);
        std::vector<float> row(static_cast<size_t>(nv));
        for (float& x : row) x = z(rng);
        SamplingParams p;
        p.temperature = std::vector<float>{0.0f, 0.7f, 1.3f}[static_cast<size_t>(round % 3)];
        if (p.temperature > 0 && round % 5 == 1) p.top_k = 7;
        if (p.temperature > 0 && round % 7 == 2) p.top_p = 0.8f;
        if (p.temperature > 0 && round % 11 == 3) p.min_p = 0.05f;
        if (round % 2 == 1) {
            p.repetition_penalty = 1.3f;
            p.frequency_penalty = 0.4f;
        }
        p.seed = static_cast<uint64_t>(round);
        std::uniform_int_distribution<int32_t> tok(-2, static_cast<int32_t>(nv) + 2);
        std::vector<int32_t> prompt(8), output(5);
        for (auto& t : prompt) t = tok(rng) % static_cast<int32_t>(nv);
        for (auto& t : output) t = tok(rng) % static_cast<int32_t>(nv);
        // Distinct bias tokens (one bias each), some out of range.
        std::vector<TokenBias> bias;
        std::vector<char> used(static_cast<size_t>(nv) + 8, 0);
        for (int i = 0, n = static_cast<int>(rng() % 6); i < n; ++i) {
            const int32_t t = tok(rng);
            if (t >= 0 && used[static_cast<size_t>(t)]++) continue;
            bias.push_back({t, std::uniform_real_distribution<float>(-100.0f, 100.0f)(rng)});
        }
        std::vector<int32_t> banned;
        if (round % 3 != 0) banned = {tok(rng), tok(rng)};
        std::vector<uint32_t> allowed;
        if (round % 4 >= 2) {
            allowed.resize(static_cast<size_t>((nv + 31) / 32));
            const uint32_t density = rng() % 3;  // all but a few, about half, or a few
            for (auto& w : allowed)
                w = density == 0   ? ~(1u << (rng() % 32))
                    : density == 1 ? static_cast<uint32_t>(rng())
                                   : static_cast<uint32_t>(rng() & rng() & rng());
            if (round % 40 == 6) std::fill(allowed.begin(), allowed.end(), 0u);  // nothing allowed
        }
        std::vector<float> edited = row;
        for (const TokenBias& b : bias)
            if (b.token >= 0 && b.token < nv) edited[static_cast<size_t>(b.token)] += b.bias;
        for (int32_t t : banned)
            if (t >= 0 && t < nv) edited[static_cast<size_t>(t)] = kBanned;
        bool any = false;
        for (int64_t t = 0; t < nv; ++t) {
            float& x = edited[static_cast<size_t>(t)];
            if (!allowed.empty() && !((allowed[static_cast<size_t>(t / 32)] >> (t % 32)) & 1u)) x = kBanned;
            any = any || x > kBanned;
        }
        const int32_t want = any ? plain.sample(edited.data(), nv, p, prompt, output, 9) : -1;
        const TokenConstraints c{bias, banned, allowed};
        const std::vector<float> before = row;
        EXPECT_EQ(s.sample(row.data(), nv, p, prompt, output, 9, c), want) << "round " << round;
        EXPECT_EQ(row, before) << "the row is not changed";
        ++(want < 0 ? none : picked);
    }
    EXPECT_GT(none, 0);
    EXPECT_GT(picked, 300);
}

// The bias and bans as one addition per token: in id order, a token's biases summed,
// a banned token -inf whatever its bias, ids outside the vocabulary left out.
TEST(Sampler, TokenAddsSumEachTokensBiasesAndBanOverAll) {
    const std::vector<TokenBias> bias = {{9, 1.5f}, {2, -3.0f}, {9, 0.25f}, {100, 5.0f}, {-1, 5.0f}, {4, 7.0f}};
    const std::vector<int32_t> banned = {4, 0, 100, 0};
    std::vector<TokenAdd> a;
    token_adds(TokenConstraints{bias, banned, {}}, 100, a);
    constexpr float kBanned = -std::numeric_limits<float>::infinity();
    ASSERT_EQ(a.size(), 4u);
    EXPECT_EQ(a[0].token, 0);
    EXPECT_EQ(a[0].add, kBanned);
    EXPECT_EQ(a[1].token, 2);
    EXPECT_EQ(a[1].add, -3.0f);
    EXPECT_EQ(a[2].token, 4);
    EXPECT_EQ(a[2].add, kBanned) << "banned over its bias";
    EXPECT_EQ(a[3].token, 9);
    EXPECT_EQ(a[3].add, 1.75f);
    // The sampler adds each sum once: token 9's 0.0173 + (1.5 + 0.3) rounds below
    // (0.0173 + 1.5) + 0.3, which token 10 holds, so 10 wins (added one after the
    // other, 9 would tie it and win as the lower id). A ban sets -inf whatever the
    // logit, +inf included.
    const std::vector<TokenBias> twice = {{9, 1.5f}, {9, 0.3f}};
    std::vector<float> row(100, 0.0f);
    row[9] = 0.0173f;
    const float one_by_one = (row[9] + 1.5f) + 0.3f;
    ASSERT_LT(row[9] + (1.5f + 0.3f), one_by_one) << "the case must tell the two orders apart";
    row[10] = one_by_one;
    Sampler s;
    SamplingParams g;
    g.temperature = 0;
    EXPECT_EQ(s.sample(row.data(), 100, g, {}, {}, 0, TokenConstraints{twice, {}, {}}), 10);
    row[10] = 0.0f;
    EXPECT_EQ(s.sample(row.data(), 100, g, {}, {}, 0, TokenConstraints{twice, {}, {}}), 9);
    row[4] = std::numeric_limits<float>::infinity();
    EXPECT_EQ(s.sample(row.data(), 100, g, {}, {}, 0, TokenConstraints{bias, banned, {}}), 9) << "4 is banned";
    EXPECT_EQ(apply_token_add(std::numeric_limits<float>::quiet_NaN(), kBanned), kBanned);
    EXPECT_EQ(s.sample(row.data(), 100, g, {}, {}, 0, TokenConstraints{}), 4);
}
