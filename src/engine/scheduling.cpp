#include "engine/scheduling.h"

#include <algorithm>
#include <charconv>
#include <cmath>

#include <fmt/format.h>

#include "base/fnv.h"

namespace duet {

const char* slo_class_name(SloClass c) {
    switch (c) {
        case SloClass::Critical: return "critical";
        case SloClass::Standard: return "standard";
        case SloClass::Batch: return "batch";
    }
    return "?";
}

Result<SloClass> parse_priority(std::string_view s) {
    for (size_t i = 0; i < kSloClasses; ++i)
        if (s == slo_class_name(static_cast<SloClass>(i))) return static_cast<SloClass>(i);
    int64_t v = 0;
    const char* end = s.data() + s.size();
    auto [p, ec] = std::from_chars(s.data() + (!s.empty() && s[0] == '+'), end, v);
    if (s.empty() || ec != std::errc() || p != end)
        return make_error(ErrorKind::Invalid, "priority '{}': critical, standard, batch or an integer (lower is more "
                          "urgent: negative is critical, 0 standard, positive batch)", s);
    return v < 0 ? SloClass::Critical : v == 0 ? SloClass::Standard : SloClass::Batch;
}

namespace {

Result<uint64_t> parse_duration_ns(std::string_view s) {
    double scale = 0;
    if (s.size() > 2 && s.substr(s.size() - 2) == "ms") {
        scale = 1e6;
        s.remove_suffix(2);
    } else if (s.size() > 1 && s.back() == 's') {
        scale = 1e9;
        s.remove_suffix(1);
    } else {
        return make_error(ErrorKind::Invalid, "'{}': a duration with its unit (300ms, 2s)", s);
    }
    double v = 0;
    auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    if (ec != std::errc() || p != s.data() + s.size() || !(v > 0) || v * scale > 3.6e12)
        return make_error(ErrorKind::Invalid, "'{}': a positive duration of at most an hour", s);
    return static_cast<uint64_t>(std::llround(v * scale));
}

std::string duration_text(uint64_t ns) {
    if (ns % 1'000'000'000ull == 0) return fmt::format("{}s", ns / 1'000'000'000ull);
    return fmt::format("{}ms", static_cast<double>(ns) / 1e6);
}

}  // namespace

Result<SloTable> SloTable::parse(std::string_view spec) {
    SloTable t;
    while (!spec.empty()) {
        const size_t comma = std::min(spec.find(','), spec.size());
        std::string_view item = spec.substr(0, comma);
        spec.remove_prefix(std::min(comma + 1, spec.size()));
        const size_t eq = item.find('=');
        const size_t slash = item.find('/');
        if (eq == std::string_view::npos || slash == std::string_view::npos || slash < eq)
            return make_error(ErrorKind::Invalid, "--slo '{}': CLASS=TTFT/ITL, e.g. critical=300ms/20ms", item);
        auto c = parse_priority(item.substr(0, eq));
        if (!c || item.substr(0, eq).find_first_of("0123456789") != std::string_view::npos)
            return make_error(ErrorKind::Invalid, "--slo '{}': the class is critical, standard or batch", item);
        auto ttft = parse_duration_ns(item.substr(eq + 1, slash - eq - 1));
        if (!ttft) return make_error(ErrorKind::Invalid, "--slo {}: TTFT {}", item, ttft.error().message);
        auto itl = parse_duration_ns(item.substr(slash + 1));
        if (!itl) return make_error(ErrorKind::Invalid, "--slo {}: ITL {}", item, itl.error().message);
        t.t[static_cast<size_t>(*c)] = {*ttft, *itl};
    }
    return t;
}

std::string SloTable::to_string() const {
    std::string s;
    for (size_t i = 0; i < kSloClasses; ++i)
        s += fmt::format("{}{}={}/{}", i ? "," : "", slo_class_name(static_cast<SloClass>(i)), duration_text(t[i].ttft_ns),
                         duration_text(t[i].itl_ns));
    return s;
}

int64_t pass_cut_tokens(uint64_t busy_ns, uint64_t tokens, uint64_t pass_ns, uint64_t last_critical_ns,
                        uint64_t now_ns, uint64_t window_ns) {
    if (pass_ns == 0 || tokens < static_cast<uint64_t>(kRateEvidenceTokens) || busy_ns == 0) return 0;
    if (window_ns > 0 && (last_critical_ns == 0 || (now_ns > last_critical_ns && now_ns - last_critical_ns > window_ns)))
        return 0;
    const double n = static_cast<double>(tokens) / static_cast<double>(busy_ns) * static_cast<double>(pass_ns);
    return std::max<int64_t>(64, static_cast<int64_t>(n));
}

void PrefillRateMeter::add(uint64_t busy_ns, int64_t tokens) {
    busy_ns_ += busy_ns;
    tokens_ += std::max<int64_t>(0, tokens);
    if (busy_ns_ < window_ns_) return;
    last_ = static_cast<double>(tokens_) / (static_cast<double>(busy_ns_) / 1e9);
    best_ = std::max(last_, best_ * decay_);
    measured_ += tokens_;
    busy_ns_ = 0;
    tokens_ = 0;
}

MeasuredRate admission_rate(SloClass c, MeasuredRate own, MeasuredRate wide) {
    if (c == SloClass::Critical && wide.best > 0) return wide;
    return own.best > 0 ? own : wide;
}

uint64_t yield_budget_ns(const std::vector<StreamPace>& streams, double fraction, uint64_t cap_ns) {
    uint64_t budget = cap_ns;
    for (const StreamPace& p : streams) {
        if (p.itl_target_ns == 0) continue;
        const double allowed = fraction * static_cast<double>(p.itl_target_ns) * static_cast<double>(p.tokens);
        const double in_hand = allowed - static_cast<double>(p.since_ns);
        if (in_hand <= 0) return 0;
        budget = std::min<uint64_t>({budget, static_cast<uint64_t>(in_hand), p.itl_target_ns});
    }
    return budget;
}

bool queue_misses_on_own_cores(std::vector<PendingPrompt> q, uint64_t now_ns, double own_rate) {
    if (own_rate <= 0) return false;
    std::sort(q.begin(), q.end(), [](const PendingPrompt& a, const PendingPrompt& b) { return a.order_key < b.order_key; });
    double tokens = 0;
    for (const PendingPrompt& p : q) {
        tokens += static_cast<double>(std::max<int64_t>(0, p.remaining));
        if (static_cast<double>(now_ns) + tokens / own_rate * 1e9 > static_cast<double>(p.deadline_ns)) return true;
    }
    return false;
}

uint64_t retry_after_seconds(uint64_t ms) { return std::max<uint64_t>(1, (ms + 999) / 1000); }

int64_t queue_drain_tokens(const std::multimap<uint64_t, int64_t>& prompts, int64_t total, int64_t target) {
    int64_t work = 0, left = total;
    for (const auto& [key, tokens] : prompts) {
        if (left <= target) return work;
        work += tokens;
        left -= tokens;
    }
    return work + std::max<int64_t>(0, left - target);
}

uint64_t kv_drain_ns(std::vector<RunningKv> running, int64_t used, int64_t target) {
    if (used <= target) return 0;
    std::sort(running.begin(), running.end(), [](const RunningKv& a, const RunningKv& b) { return a.left_ns < b.left_ns; });
    for (const RunningKv& r : running) {
        used -= r.blocks;
        if (used <= target) return r.left_ns;
    }
    return UINT64_MAX;
}

uint64_t RetryMemory::key(SloClass c, const int32_t* tokens, size_t n) {
    // The class and the tokens' bytes (a collision spares one A1 refusal).
    Fnv f;
    f.add(static_cast<uint8_t>(c));
    f.add(tokens, n * sizeof(int32_t));
    return f.h;
}

void RetryMemory::refused(uint64_t key, uint64_t now_ns, uint64_t retry_after_ms) {
    const uint64_t until = now_ns + retry_after_ms * 1'000'000ull + grace_ns_;
    std::erase_if(until_, [&](const Entry& e) { return e.until_ns < now_ns || e.key == key; });
    if (capacity_ == 0) return;
    if (until_.size() >= capacity_) {  // the oldest refusal goes
        auto oldest = std::min_element(until_.begin(), until_.end(),
                                       [](const Entry& a, const Entry& b) { return a.at_ns < b.at_ns; });
        until_.erase(oldest);
    }
    until_.push_back({key, until, now_ns});
}

const char* refusal_name(Refusal r) {
    switch (r) {
        case Refusal::None: return "";
        case Refusal::Ttft: return "ttft";
        case Refusal::Queue: return "queue";
        case Refusal::Kv: return "kv";
    }
    return "";
}

bool RetryMemory::returning(uint64_t key, uint64_t now_ns) const {
    for (const Entry& e : until_)
        if (e.key == key) return now_ns <= e.until_ns;
    return false;
}

void RetryMemory::judged(uint64_t key, uint64_t now_ns, bool returning, const AdmissionDecision& d) {
    if (d.admit) std::erase_if(until_, [&](const Entry& e) { return e.key == key; });
    else if (d.refusal == Refusal::Ttft || returning)
        refused(key, now_ns, d.retry_after_ms);
}

AdmissionDecision AdmissionControl::decide(SloClass c, int64_t prompt_tokens, const QueueView& q, double rate,
                                           double recent, const KvView* kv, bool returning) {
    AdmissionDecision d;
    // The rate predicted with: the slower of the best and the recent window's (the
    // best alone admitted standard requests predicted at 5 s that waited 8 s under 2x
    // load: bench/RESULTS.md "Overload").
    rate = recent > 0 && recent < rate ? recent : rate;
    const int64_t total = q.total();
    if (o_.queue_high > 0) {  // A2's hysteresis
        if (total >= o_.queue_high) over_ = true;
        else if (total <= o_.queue_low) over_ = false;
    }
    // A3's hysteresis, in blocks, updated whatever refuses this request.
    int64_t kv_low = 0;
    const bool kv_on = kv && o_.kv_high > 0 && kv->total > 0;
    if (kv_on) {
        const auto high = static_cast<int64_t>(std::ceil(o_.kv_high * static_cast<double>(kv->total)));
        kv_low = static_cast<int64_t>(std::floor(o_.kv_low * static_cast<double>(kv->total)));
        if (kv->used >= high) kv_over_ = true;
        else if (kv->used <= kv_low) kv_over_ = false;
    }
    const double target_s = static_cast<double>(o_.slo.of(c).ttft_ns) / 1e9 * o_.slack;
    const int64_t ahead = q.ahead_of(c);
    if (rate > 0) d.predicted_ttft_ns = static_cast<uint64_t>(static_cast<double>(ahead + prompt_tokens) / rate * 1e9);
    // A prompt that alone meets its target (with the rate known). One that does not
    // is not judged by A1 (below), so A2 and A3 bound it even when it is critical.
    const bool can_meet = static_cast<double>(prompt_tokens) / std::max(rate, 1e-9) <= target_s;
    const bool watermarked = c != SloClass::Critical || (rate > 0 && !can_meet);
    if (over_ && watermarked) {
        d.admit = false;
        d.refusal = Refusal::Queue;
        const double s =
            rate > 0 ? static_cast<double>(queue_drain_tokens(q.prompts, total, o_.queue_low)) / rate : 1.0;
        d.retry_after_ms = std::max<uint64_t>(1, static_cast<uint64_t>(std::ceil(s * 1000)));
        return d;
    }
    if (kv_on) {
        if (kv_over_ && watermarked) {
            d.admit = false;
            d.refusal = Refusal::Kv;
            const uint64_t ns = kv_drain_ns(kv->running, kv->used, kv_low);
            // Nothing running frees enough (the blocks are held elsewhere): a second,
            // the next look.
            d.retry_after_ms = ns == UINT64_MAX ? 1000 : std::max<uint64_t>(1, (ns + 999'999) / 1'000'000);
            return d;
        }
    }
    // A1 refuses only what waiting can help: a queue ahead, and a prompt that alone
    // meets its target. One that alone takes longer never meets it, refused or not;
    // refused, it came back to find short requests queued ahead again and again (the
    // mixed scenario: long prompts' TTFT p50 12.5 s, against 6.3 s with no admission;
    // bench/RESULTS.md). A2 and A3 bound it instead (`watermarked`). Nor does it
    // judge a prompt it refused before that came back in time (RetryMemory).
    if (!returning && rate > 0 && ahead > 0 && can_meet && static_cast<double>(ahead + prompt_tokens) / rate > target_s) {
        d.admit = false;
        d.refusal = Refusal::Ttft;
        // The queue ahead must shrink to what leaves room for this prompt.
        const double room = std::max(0.0, rate * target_s - static_cast<double>(prompt_tokens));
        const double s = std::max(0.0, static_cast<double>(ahead) - room) / rate;
        d.retry_after_ms = std::max<uint64_t>(1, static_cast<uint64_t>(std::ceil(s * 1000)));
    }
    return d;
}

}  // namespace duet
