#include "engine/drafter.h"

#include <algorithm>

namespace duet {

size_t PromptLookupDrafter::propose(std::span<const int32_t> prompt, std::span<const int32_t> output,
                                    std::span<int32_t> out) const {
    const size_t np = prompt.size(), n = np + output.size();
    auto at = [&](size_t i) { return i < np ? prompt[i] : output[i - np]; };
    if (out.empty() || n == 0) return 0;
    for (int len = std::min<int>(max_, static_cast<int>(n) - 1); len >= std::max(1, min_); --len) {
        const size_t l = static_cast<size_t>(len);
        // The suffix [n - l, n) matched at [s, s + l), s + l < n (something follows it).
        for (size_t s = n - l; s-- > 0;) {
            size_t k = 0;
            while (k < l && at(s + k) == at(n - l + k)) ++k;
            if (k < l) continue;
            size_t got = 0;
            for (size_t i = s + l; i < n && got < out.size(); ++i) out[got++] = at(i);
            return got;
        }
    }
    return 0;
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

}  // namespace duet
