#include "engine/drafter.h"

#include <algorithm>
#include <tuple>

namespace duet {

Proposal PromptLookupDrafter::draft(std::span<const int32_t> prompt, std::span<const int32_t> output,
                                    std::span<int32_t> out) const {
    const size_t np = prompt.size(), n = np + output.size();
    auto at = [&](size_t i) { return i < np ? prompt[i] : output[i - np]; };
    if (out.empty() || n == 0) return {};
    for (int len = std::min<int>(max_, static_cast<int>(n) - 1); len >= std::max(1, min_); --len) {
        const size_t l = static_cast<size_t>(len);
        // The suffix [n - l, n) matched at [s, s + l), s + l < n (something follows it).
        for (size_t s = n - l; s-- > 0;) {
            size_t k = 0;
            while (k < l && at(s + k) == at(n - l + k)) ++k;
            if (k < l) continue;
            size_t got = 0;
            for (size_t i = s + l; i < n && got < out.size(); ++i) out[got++] = at(i);
            return {got, len};
        }
    }
    return {};
}

namespace {

// An n-gram's slot in the index: its length and tokens, mixed (splitmix64's finalizer).
uint64_t ngram_hash(const int32_t* t, int len) {
    uint64_t h = 0x9E3779B97F4A7C15ull * static_cast<uint64_t>(len);
    for (int i = 0; i < len; ++i) {
        h ^= static_cast<uint32_t>(t[i]) + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
        h ^= h >> 30;
        h *= 0xBF58476D1CE4E5B9ull;
        h ^= h >> 27;
        h *= 0x94D049BB133111EBull;
        h ^= h >> 31;
    }
    return h;
}

}  // namespace

NgramPool::NgramPool(size_t capacity_tokens) : ring_(std::max<size_t>(capacity_tokens, 1), kSeparator) {
    // Three n-grams a token, at most: an index of at least 4 entries a token keeps
    // most of the ring's n-grams findable (a collision keeps the newer).
    size_t n = 1;
    while (n < 4 * ring_.size()) n *= 2;
    index_.assign(n, 0);
}

void NgramPool::push(int32_t token) {
    ring_[end_ % ring_.size()] = token;
    ++end_;
}

void NgramPool::add(std::span<const int32_t> tokens) {
    if (tokens.empty()) return;
    const uint64_t start = end_;
    for (int32_t t : tokens) push(t);
    push(kSeparator);
    // Each n-gram that something follows within the sequence, pointing past itself.
    const uint64_t mask = index_.size() - 1;
    for (size_t i = kMinNgram; i < tokens.size(); ++i)
        for (int len = kMinNgram; len <= kMaxNgram && static_cast<size_t>(len) <= i; ++len)
            index_[ngram_hash(tokens.data() + i - len, len) & mask] = start + i + 1;
}

Proposal NgramPool::draft(std::span<const int32_t> prompt, std::span<const int32_t> output,
                          std::span<int32_t> out) const {
    const size_t np = prompt.size(), n = np + output.size();
    if (out.empty() || end_ == 0) return {};
    int32_t suffix[kMaxNgram];
    const uint64_t cap = ring_.size(), mask = index_.size() - 1;
    for (int len = std::min<int>(kMaxNgram, static_cast<int>(n)); len >= kMinNgram; --len) {
        for (int k = 0; k < len; ++k) {
            const size_t i = n - static_cast<size_t>(len) + static_cast<size_t>(k);
            suffix[k] = i < np ? prompt[i] : output[i - np];
        }
        const uint64_t e = index_[ngram_hash(suffix, len) & mask];
        if (e == 0) continue;
        const uint64_t p = e - 1;  // the position after the n-gram
        // Still in the ring, and the n-gram there (not another one that collided).
        if (p < static_cast<uint64_t>(len) || p >= end_ || end_ - (p - static_cast<uint64_t>(len)) > cap) continue;
        bool same = true;
        for (int k = 0; k < len && same; ++k)
            same = at(p - static_cast<uint64_t>(len) + static_cast<uint64_t>(k)) == suffix[k];
        if (!same) continue;
        size_t got = 0;
        for (uint64_t q = p; q < end_ && got < out.size() && at(q) != kSeparator; ++q) out[got++] = at(q);
        if (got > 0) return {got, len};
    }
    return {};
}

int draft_limit(DraftMode mode, int request_max, int server_max) {
    switch (mode) {
        case DraftMode::Off: return 0;
        case DraftMode::Auto:
            return std::min(kMaxDraftTokens, request_max > 0  ? request_max
                                             : server_max > 0 ? server_max
                                                              : kAutoDraftTokens);
        case DraftMode::Server: break;
    }
    return std::clamp(server_max, 0, kMaxDraftTokens);
}

int draft_budget(DraftPace& p, int max_draft) {
    if (max_draft <= 0) return 0;
    if (p.cap < 0) p.cap = max_draft;
    if (p.cap > 0) return std::min(p.cap, max_draft);
    if (p.wait > 0) {
        --p.wait;
        return 0;
    }
    return 1;  // a probe
}

void draft_verified(DraftPace& p, int max_draft, int drafted, int accepted) {
    if (drafted <= 0) return;  // nothing was proposed: nothing learned
    const bool probe = p.cap == 0;
    if (accepted == drafted) {
        p.cap = std::min(max_draft, std::max(p.cap, drafted) + 1);
        p.backoff = 1;
    } else if (accepted > 0) {
        p.cap = accepted;
        p.backoff = 1;
    } else {
        p.cap = 0;
        p.wait = probe ? p.backoff : 1;
        if (probe) p.backoff = std::min(DraftPace::kMaxWait, 2 * p.backoff);
    }
}

void DraftOdds::seen(int kept, int tried) {
    if (tried <= 0) return;
    for (int i = 0; i < tried; ++i) {
        hits *= kDecay;
        tries *= kDecay;
    }
    hits += kept;
    tries += tried;
}

void DraftMemory::keep(uint64_t key, const DraftRecord& r) {
    const uint64_t seq = next_seq_++;
    records_.insert_or_assign(key, Kept{r, seq});
    order_.emplace_back(key, seq);
    // The oldest go first; stale entries of order_ go as they reach its front.
    while (records_.size() > kMax || (!order_.empty() && order_.size() > 2 * kMax)) {
        const auto [k, q] = order_.front();
        order_.pop_front();
        auto it = records_.find(k);
        if (it != records_.end() && it->second.seq == q) records_.erase(it);
    }
}

std::optional<DraftRecord> DraftMemory::take(uint64_t key) {
    auto it = records_.find(key);
    if (it == records_.end()) return std::nullopt;
    const DraftRecord r = it->second.record;
    records_.erase(it);
    return r;
}

void PassCostModel::add(int64_t positions, uint64_t ns) {
    const double x = static_cast<double>(positions), y = static_cast<double>(ns);
    n_ = kDecay * n_ + 1;
    x_ = kDecay * x_ + x;
    y_ = kDecay * y_ + y;
    xx_ = kDecay * xx_ + x * x;
    xy_ = kDecay * xy_ + x * y;
    if (positions < 1) return;
    const int64_t s = std::min(positions, kMaxSize);
    // A larger pass counts as kMaxSize's by the prior's shape.
    const double t = y * (kPriorFixed + static_cast<double>(s)) / (kPriorFixed + x);
    // A pass the OS or a neighbour held up counts as kMaxJump times what its size
    // costs at most (its mean, or for a size not seen yet what costs() reads for
    // it from the others): one such pass would otherwise raise the size's cost,
    // and with it every larger size's (costs() never decreases), and a size
    // thought dear is seldom run again to correct it.
    double expect = 0;
    if (!size_n_.empty()) costs(s, std::span<double>(&expect, 1));
    const auto i = static_cast<size_t>(s - 1);
    if (size_n_.size() <= i) {
        size_n_.resize(i + 1, 0.0);
        size_ns_.resize(i + 1, 0.0);
    }
    size_ns_[i] = kSizeDecay * size_ns_[i] + (expect > 0 ? std::min(t, kMaxJump * expect) : t);
    size_n_[i] = kSizeDecay * size_n_[i] + 1;
}

double PassCostModel::fixed() const {
    if (n_ < 4) return kPriorFixed;
    const double var = xx_ * n_ - x_ * x_;         // n^2 times the positions' variance
    if (var < 0.25 * n_ * n_) return kPriorFixed;  // positions vary by less than half a position
    const double b = (xy_ * n_ - x_ * y_) / var;
    const double a = (y_ - b * x_) / n_;
    if (!(b > 0) || !(a > 0)) return kPriorFixed;
    return std::clamp(a / b, kMinFixed, kMaxFixed);
}

void PassCostModel::costs(int64_t first, std::span<double> out) const {
    const auto sizes = static_cast<int64_t>(size_n_.size());
    const auto seen = [&](int64_t s) { return s >= 1 && s <= sizes && size_n_[static_cast<size_t>(s - 1)] > 0; };
    const auto mean = [&](int64_t s) {
        return size_ns_[static_cast<size_t>(s - 1)] / size_n_[static_cast<size_t>(s - 1)];
    };
    const auto shape = [](int64_t a) { return kPriorFixed + static_cast<double>(a); };
    // lo: the nearest seen size at or below s (0: none); best: the seen size at or
    // below s that costs least in the prior's shape (mean / shape), the anchor of
    // sizes above every seen one; hi: the nearest seen size at or above s (0: not
    // looked for yet, -1: none).
    int64_t lo = 0, best = 0, hi = 0;
    const int64_t start = std::min(first, kMaxSize);
    for (int64_t t = 1; t < start; ++t) {
        if (!seen(t)) continue;
        lo = t;
        if (best == 0 || mean(t) / shape(t) < mean(best) / shape(best)) best = t;
    }
    double prev = 0;
    for (size_t k = 0; k < out.size(); ++k) {
        const int64_t wanted = first + static_cast<int64_t>(k), s = std::min(wanted, kMaxSize);
        if (seen(s)) {
            lo = s;
            if (best == 0 || mean(s) / shape(s) < mean(best) / shape(best)) best = s;
        }
        if (hi != -1 && hi < s) {
            hi = -1;  // none above, unless one is found
            for (int64_t t = s; t <= sizes; ++t) {
                if (seen(t)) {
                    hi = t;
                    break;
                }
            }
        }
        double c;
        if (lo == s) {
            c = mean(s);
        } else if (lo != 0 && hi > 0) {
            c = mean(lo) + (mean(hi) - mean(lo)) * static_cast<double>(s - lo) / static_cast<double>(hi - lo);
        } else if (lo != 0) {
            c = mean(best) * shape(s) / shape(best);
        } else if (hi > 0) {
            c = mean(hi) * shape(s) / shape(hi);
        } else {
            c = shape(s);  // nothing seen: the prior's line, in its own unit
        }
        if (wanted > s) c *= shape(wanted) / shape(s);  // past kMaxSize: by the prior's shape
        prev = k == 0 ? c : std::max(prev, c);
        out[k] = prev;
    }
}

void trim_drafts(std::span<const DraftRowView> rows, std::span<const double> cost, std::span<int> keep) {
    struct Candidate {
        double p;
        size_t row;
        int i;
    };
    std::vector<Candidate> all;
    for (size_t r = 0; r < rows.size(); ++r) {
        keep[r] = 0;
        double p = 1;
        for (int i = 1; i <= rows[r].drafts; ++i) all.push_back({p *= rows[r].accept, r, i});
    }
    std::sort(all.begin(), all.end(), [](const Candidate& a, const Candidate& b) {
        return std::tie(b.p, a.row, a.i) < std::tie(a.p, b.row, b.i);
    });
    if (cost.empty()) return;
    // The best prefix: tokens / cost compared as tokens * other cost, so that equal
    // yields stay equal whatever the rounding of a division.
    const size_t n = std::min(all.size(), cost.size() - 1);
    double tokens = static_cast<double>(rows.size()), best_tokens = tokens;
    size_t best = 0;
    for (size_t k = 1; k <= n; ++k) {
        tokens += all[k - 1].p;
        if (tokens * cost[best] > best_tokens * cost[k]) {
            best = k;
            best_tokens = tokens;
        }
    }
    // Taken likeliest first, a row's drafts in order: its earlier ones are in.
    for (size_t k = 0; k < best; ++k) keep[all[k].row] = std::max(keep[all[k].row], all[k].i);
}

}  // namespace duet
