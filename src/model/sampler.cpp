#include "model/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace duet {

namespace {

uint64_t splitmix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

}  // namespace

Status SamplingParams::validate() const {
    if (!(temperature >= 0.0f && temperature <= 100.0f))
        return make_error("temperature must be between 0 and 100, got {}", temperature);
    if (top_k < 0) return make_error("top_k must be >= 0 (0 disables it), got {}", top_k);
    if (!(top_p > 0.0f && top_p <= 1.0f)) return make_error("top_p must be in (0, 1], got {}", top_p);
    if (!(min_p >= 0.0f && min_p <= 1.0f)) return make_error("min_p must be in [0, 1], got {}", min_p);
    if (!(repetition_penalty > 0.0f && repetition_penalty <= 10.0f))
        return make_error("repetition_penalty must be in (0, 10], got {}", repetition_penalty);
    if (!(frequency_penalty >= -2.0f && frequency_penalty <= 2.0f))
        return make_error("frequency_penalty must be between -2 and 2, got {}", frequency_penalty);
    if (!(presence_penalty >= -2.0f && presence_penalty <= 2.0f))
        return make_error("presence_penalty must be between -2 and 2, got {}", presence_penalty);
    return {};
}

double sample_uniform(uint64_t seed, uint64_t index) {
    uint64_t r = splitmix64(splitmix64(seed) ^ splitmix64(index ^ 0x5851f42d4c957f2dull));
    return static_cast<double>(r >> 11) * 0x1.0p-53;
}

bool has_penalties(const SamplingParams& p) {
    return p.repetition_penalty != 1.0f || p.frequency_penalty != 0.0f || p.presence_penalty != 0.0f;
}

void penalty_edits(const SamplingParams& p, int64_t n_vocab, std::span<const int32_t> prompt,
                   std::span<const int32_t> output, std::vector<PenaltyEdit>& out) {
    out.clear();
    if (!has_penalties(p) || n_vocab <= 0) return;
    // Runs every step for every penalized row, over its whole prompt and output
    // (4096 tokens x 128 rows a step on a GPU): a bitmap of the tokens seen and their
    // output counts in per-thread scratch, read back in id order, so the cost is
    // O(prompt + output + n_vocab / 64) and no sort (sorting the tokens took 49.8 ms
    // of a 4096-token, batch-128 decode step on an H200; bench/RESULTS.md). Ids out
    // of range are ignored. The scratch is left zeroed for the next call.
    thread_local std::vector<uint64_t> seen;
    thread_local std::vector<int32_t> count;
    const size_t words = static_cast<size_t>((n_vocab + 63) / 64);
    if (seen.size() < words) seen.resize(words, 0);
    if (count.size() < static_cast<size_t>(n_vocab)) count.resize(static_cast<size_t>(n_vocab), 0);
    const bool rep = p.repetition_penalty != 1.0f;
    // Room first: nothing below may throw while the scratch is dirty.
    out.reserve(std::min(output.size() + (rep ? prompt.size() : 0), static_cast<size_t>(n_vocab)));
    size_t lo = words, hi = 0;  // the words touched
    auto mark = [&](int32_t t) {
        const size_t w = static_cast<size_t>(t) >> 6;
        seen[w] |= uint64_t{1} << (t & 63);
        lo = std::min(lo, w);
        hi = std::max(hi, w + 1);
    };
    for (int32_t t : output)
        if (t >= 0 && t < n_vocab) {
            mark(t);
            ++count[static_cast<size_t>(t)];
        }
    if (rep)  // prompt tokens matter only to the repetition penalty
        for (int32_t t : prompt)
            if (t >= 0 && t < n_vocab) mark(t);
    for (size_t w = lo; w < hi; ++w) {
        for (uint64_t bits = seen[w]; bits; bits &= bits - 1) {
            const int32_t t = static_cast<int32_t>(w * 64 + static_cast<size_t>(__builtin_ctzll(bits)));
            int32_t& c = count[static_cast<size_t>(t)];
            // Repetition: divide positive logits, multiply negative ones (CTRL / HF
            // semantics), once per distinct token of prompt or output; then frequency
            // and presence for output tokens.
            const float sub = c > 0 ? p.frequency_penalty * static_cast<float>(c) + p.presence_penalty : 0.0f;
            out.push_back({t, rep ? 1 : 0, sub});
            c = 0;
        }
        seen[w] = 0;
    }
}

int64_t apply_token_mask(float* row, int64_t n, std::span<const uint32_t> bits) {
    constexpr float kBanned = -std::numeric_limits<float>::infinity();
    int64_t left = 0;
    for (int64_t w = 0; w * 32 < n; ++w) {
        const int64_t lo = w * 32, hi = std::min<int64_t>(n, lo + 32);
        const uint32_t word = static_cast<size_t>(w) < bits.size() ? bits[static_cast<size_t>(w)] : 0;
        if (word == 0) {
            std::fill(row + lo, row + hi, kBanned);
            continue;
        }
        for (int64_t i = lo; i < hi; ++i) {
            if ((word >> (i - lo)) & 1u)
                left += row[i] > kBanned;  // (a NaN is no choice either)
            else
                row[i] = kBanned;
        }
    }
    return left;
}

void token_adds(const TokenConstraints& c, int64_t n_vocab, std::vector<TokenAdd>& out) {
    out.clear();
    for (const TokenBias& b : c.bias)
        if (b.token >= 0 && b.token < n_vocab) out.push_back({b.token, b.bias});
    // Stable: a token's biases are summed in the order the request gave them.
    std::stable_sort(out.begin(), out.end(), [](const TokenAdd& a, const TokenAdd& b) { return a.token < b.token; });
    size_t n = 0;
    for (size_t i = 0; i < out.size(); ++i) {
        if (n > 0 && out[n - 1].token == out[i].token)
            out[n - 1].add += out[i].add;
        else
            out[n++] = out[i];
    }
    out.resize(n);
    constexpr float kBanned = -std::numeric_limits<float>::infinity();
    for (int32_t t : c.banned) {
        if (t < 0 || t >= n_vocab) continue;
        auto it = std::lower_bound(out.begin(), out.end(), t, [](const TokenAdd& a, int32_t x) { return a.token < x; });
        if (it != out.end() && it->token == t)
            it->add = kBanned;
        else
            out.insert(it, {t, kBanned});
    }
}

int32_t Sampler::sample(const float* logits, int64_t n_vocab, const SamplingParams& p, std::span<const int32_t> prompt,
                        std::span<const int32_t> output, uint64_t index, const TokenConstraints& c) {
    if (c.empty()) return sample(logits, n_vocab, p, prompt, output, index);
    constexpr float kBanned = -std::numeric_limits<float>::infinity();
    if (c.bias.empty() && c.banned.empty() && p.temperature <= 0.0f && !has_penalties(p)) {
        // Greedy under a bitset alone: the argmax over its set bits (what the general
        // path below picks, the lowest id on a tie, without copying the row).
        int32_t best = -1;
        float best_v = kBanned;
        for (size_t w = 0; w < c.allowed.size(); ++w)
            for (uint32_t word = c.allowed[w]; word != 0; word &= word - 1) {
                const int64_t i = static_cast<int64_t>(w) * 32 + __builtin_ctz(word);
                if (i >= n_vocab) break;
                if (logits[i] > best_v) {
                    best_v = logits[i];
                    best = static_cast<int32_t>(i);
                }
            }
        return best;
    }
    constrained_.assign(logits, logits + n_vocab);
    if (!c.allowed.empty()) apply_token_mask(constrained_.data(), n_vocab, c.allowed);
    token_adds(c, n_vocab, adds_);
    for (const TokenAdd& a : adds_) {
        float& x = constrained_[static_cast<size_t>(a.token)];
        x = apply_token_add(x, a.add);
    }
    bool any = false;  // (a NaN is no choice either)
    for (int64_t t = 0; t < n_vocab && !any; ++t) any = constrained_[static_cast<size_t>(t)] > kBanned;
    if (!any) return -1;
    return sample(constrained_.data(), n_vocab, p, prompt, output, index);
}

int32_t Sampler::sample(const float* logits, int64_t n_vocab, const SamplingParams& p,
                        std::span<const int32_t> prompt, std::span<const int32_t> output, uint64_t index) {
    const float* l = logits;
    if (has_penalties(p)) {
        work_.assign(logits, logits + n_vocab);
        penalty_edits(p, n_vocab, prompt, output, edits_);
        for (const PenaltyEdit& e : edits_) {
            float& w = work_[static_cast<size_t>(e.token)];
            if (e.rep) w = w > 0 ? w / p.repetition_penalty : w * p.repetition_penalty;
            w -= e.sub;
        }
        l = work_.data();
    }

    if (p.temperature <= 0.0f) {
        int32_t best = 0;
        for (int64_t t = 1; t < n_vocab; ++t)
            if (l[t] > l[best]) best = static_cast<int32_t>(t);
        return best;
    }

    // Tempered, max-subtracted logits of the candidates, best first when filtered.
    const float inv_t = 1.0f / p.temperature;
    cand_.resize(static_cast<size_t>(n_vocab));
    for (int64_t t = 0; t < n_vocab; ++t) cand_[t] = {l[t] * inv_t, static_cast<int32_t>(t)};
    auto better = [](const Cand& a, const Cand& b) { return a.logit > b.logit || (a.logit == b.logit && a.id < b.id); };
    size_t n = cand_.size();
    bool sorted = false;
    if (p.top_k > 0 && static_cast<size_t>(p.top_k) < n) {
        std::partial_sort(cand_.begin(), cand_.begin() + p.top_k, cand_.end(), better);
        n = static_cast<size_t>(p.top_k);
        sorted = true;
    }
    float mx = -std::numeric_limits<float>::infinity();
    for (size_t i = 0; i < n; ++i) mx = std::max(mx, cand_[i].logit);
    double sum = 0;
    for (size_t i = 0; i < n; ++i) sum += std::exp(static_cast<double>(cand_[i].logit - mx));

    if (p.top_p < 1.0f) {
        // Grow a sorted prefix until it holds top_p of the mass: the usual case
        // needs only a few dozen candidates, not a sort of the whole vocabulary.
        size_t k = std::min<size_t>(n, 64);
        for (;;) {
            if (!sorted || k > n) std::partial_sort(cand_.begin(), cand_.begin() + k, cand_.begin() + n, better);
            double cum = 0;
            size_t keep = 0;
            while (keep < k) {
                cum += std::exp(static_cast<double>(cand_[keep].logit - mx)) / sum;
                ++keep;
                if (cum >= p.top_p) break;
            }
            if (cum >= p.top_p || k == n) {
                n = keep;
                break;
            }
            k = std::min(n, k * 4);
            sorted = false;
        }
    }
    if (p.min_p > 0.0f) {
        // Keep candidates with probability >= min_p * p_max, i.e. logit >= mx + log(min_p).
        const float cut = mx + std::log(p.min_p);
        size_t w = 0;
        for (size_t i = 0; i < n; ++i)
            if (cand_[i].logit >= cut) cand_[w++] = cand_[i];
        n = w;
    }
    double total = 0;
    for (size_t i = 0; i < n; ++i) total += std::exp(static_cast<double>(cand_[i].logit - mx));
    const double u = sample_uniform(p.seed, index) * total;
    double cum = 0;
    for (size_t i = 0; i < n; ++i) {
        cum += std::exp(static_cast<double>(cand_[i].logit - mx));
        if (u < cum) return cand_[i].id;
    }
    return cand_[n - 1].id;
}

}  // namespace duet
