// Scheduling under pressure, the policy half (pure: table-tested without a model or
// processes; the front and the prefill worker apply it). DESIGN.md "Scheduling".
//
// Classes: every request has a priority class, critical, standard (the default) or
// batch, each with a time-to-first-token and an inter-token target (`--slo`). An
// integer priority maps to a class as vLLM's does to an order (lower is served
// first): negative is critical, 0 standard, positive batch.
//
// Order: prefill takes requests by a key, smallest first: arrival + the class's TTFT
// target + a millisecond per prompt token (so that within a class short prompts go
// first: earliest deadline first) + the class's rank (critical 0, standard 1, batch 2)
// times kClassPrecedenceNs (30 s). Between classes that is priority with aging: a
// critical request goes before any standard one that has waited less than 34 s (5 s +
// 30 s - 1 s), before any batch one that has waited less than 119 s. (Plain earliest
// deadline first across classes, as first built, let a standard request that had
// waited 4 s go before a new critical one; under 2x load most critical requests missed
// their target behind them, while A1 had predicted their wait from the critical queue
// alone.) That is the aging bound: a request is only ever overtaken by one whose key
// is smaller, so once arrival + its target + rank x 30 s + its length in ms has passed
// (standard: 35 s, batch: 120 s, plus at most --ctx ms) nothing that arrives later is
// served before it.
// Admission (AdmissionControl): a request is answered 429 before it takes any KV or
// slot when
//   A1. the prefill work queued ahead of it (its class and more urgent ones, in
//       tokens) plus its own prompt, over the measured prefill rate, predicts a TTFT
//       past its class's target times `slack`, and its prompt alone would meet it
//       (one that alone cannot is not refused by A1: no later try would meet the
//       target, and refused it would find short prompts queued ahead each time; A2
//       and A3 bound it, critical or not), and A1 has not refused it before
//       (RetryMemory: a prompt back after its Retry-After is not judged by A1
//       again); or
//   A2. the queue of prompt tokens not yet prefilled is over its high watermark: then
//       standard and batch requests are refused until it falls under the low one
//       (hysteresis; critical requests are judged by A1 alone); or
//   A3. the KV blocks held by requests (not by idle contexts, which give way) are
//       over their high watermark, a fraction of the arena: standard and batch
//       requests are refused until they fall under the low one (hysteresis; a
//       critical request is admitted: decode preempts less urgent work for it).
//       Admitting into a full arena only makes decode preempt: each admission would
//       cost a swap or a recomputation of someone's KV.
// Retry-After is computed from the same prediction: the time the queue ahead needs
// to drain to where the request would meet its target (A1), or to the low watermark
// (A2: prompt by prompt in prefill's order when the front knows them, since each
// leaves the front's queue whole, with its first token: queue_drain_tokens), at the
// measured rate; for A3, when the running requests that end first (by
// their tokens left at the measured time per token) will have freed enough blocks to
// bring the arena under its low watermark (kv_drain_ns); at least 1 ms; HTTP's Retry-After header is that in
// whole seconds rounded up, and `retry-after-ms` the milliseconds (the openai client
// honours both).
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "base/result.h"

namespace duet {

enum class SloClass : uint8_t { Critical = 0, Standard = 1, Batch = 2 };

inline constexpr uint64_t kClassPrecedenceNs = 30'000'000'000ull;
inline constexpr uint64_t kDeadlineNsPerToken = 1'000'000;  // "Order": a millisecond per prompt token
// Prefill's order key (see "Order" above). slo_class: SloClass as an integer (a
// larger one is treated as batch).
inline uint64_t prefill_order_key(uint64_t arrival_ns, uint32_t slo_class, uint64_t ttft_target_ns, uint64_t n_tokens,
                                  uint64_t ns_per_token) {
    const uint64_t rank = slo_class > 2 ? 2 : slo_class;
    return arrival_ns + ttft_target_ns + rank * kClassPrecedenceNs + ns_per_token * n_tokens;
}
inline constexpr size_t kSloClasses = 3;
const char* slo_class_name(SloClass c);  // "critical", "standard", "batch"

// "critical" | "standard" | "batch" | an integer (lower: more urgent), as the body's
// `priority` or the X-Duet-Priority header gives it.
Result<SloClass> parse_priority(std::string_view s);

struct SloTarget {
    uint64_t ttft_ns = 0;
    uint64_t itl_ns = 0;
};

struct SloTable {
    // Defaults sized for the CPU runtime on a small model: a short prompt's first
    // token within 1 s for critical work; batch work only has to progress.
    std::array<SloTarget, kSloClasses> t = {
        SloTarget{1'000'000'000ull, 100'000'000ull},
        SloTarget{5'000'000'000ull, 250'000'000ull},
        SloTarget{60'000'000'000ull, 2'000'000'000ull},
    };
    const SloTarget& of(SloClass c) const { return t[static_cast<size_t>(c)]; }
    // "critical=300ms/20ms,batch=30s/1s": the classes named change, the others keep
    // their defaults. Durations: a number with ms or s.
    static Result<SloTable> parse(std::string_view spec);
    std::string to_string() const;
};

// Prefill's throughput in prompt tokens per second of busy time, measured from each
// prefill worker's work counters (roles/worker_stats.h: nanoseconds in forward passes and
// the prompt tokens they computed), which the front samples and feeds here as
// deltas. Only pass time counts: a prompt waiting for KV, for decode to take its
// hand-off or for a restarted worker is not prefill being slow. (It measured the
// request's [taken, handed off] interval before; on a cold server that read 63
// tokens/s where passes ran at 700, and A1 refused 16 short prompts.) A window
// closes when it holds `window_ns` of busy time. rate(): the best window, decayed by
// `decay` per window (a pass's cost is part fixed, part per token: small passes read
// slower than the full passes that drain a long queue, the queue a prediction is
// about); recent(): the last window (the machine as it is now: another process on
// the cores slows every pass). Both 0 until `min_tokens` have been measured: a
// worker's first passes run cold (page faults, caches) and would read far slower.
// Per worker: with several prefill workers the queue drains at their sum. Not
// thread-safe: the caller serializes.
// Prompt tokens measured before a rate counts (the meter's; prefill's pass cut).
inline constexpr int64_t kRateEvidenceTokens = 2048;

// The pass cut (--prefill-pass-ms): the tokens of a pass not led by a critical
// request, so that a critical one arriving meanwhile waits about pass_ns; 0: the
// whole budget. Measured from the worker's own passes (busy_ns, tokens), no cut
// before kRateEvidenceTokens. It costs prefill throughput (a long prompt in passes
// of ~110 tokens instead of 512 took 6.0-6.3 s against 5.2-5.8 s here), so it is
// paid only while critical work is around: when `window_ns` > 0, only within
// window_ns of the last critical request this worker took (last_critical_ns, 0:
// none yet). The first critical request after a quiet window may wait one whole
// pass (a 512-token pass: ~1.2 s on one core here).
int64_t pass_cut_tokens(uint64_t busy_ns, uint64_t tokens, uint64_t pass_ns, uint64_t last_critical_ns,
                        uint64_t now_ns, uint64_t window_ns);

class PrefillRateMeter {
public:
    explicit PrefillRateMeter(uint64_t window_ns = 200'000'000ull, double decay = 0.95,
                              int64_t min_tokens = kRateEvidenceTokens)
        : window_ns_(window_ns), decay_(decay), min_tokens_(min_tokens) {}
    // Passes that took `busy_ns` computed `tokens` prompt tokens.
    void add(uint64_t busy_ns, int64_t tokens);
    double rate() const { return measured_ >= min_tokens_ ? best_ : 0; }    // tokens/s; 0: not measured yet
    double recent() const { return measured_ >= min_tokens_ ? last_ : 0; }  // tokens/s; 0: not measured yet

private:
    uint64_t window_ns_;
    double decay_;
    int64_t min_tokens_;
    int64_t measured_ = 0;  // tokens in closed windows
    uint64_t busy_ns_ = 0;  // in the current window
    int64_t tokens_ = 0;
    double best_ = 0, last_ = 0;
};

// A measured prefill rate (tokens/s; 0: not measured yet): the best window's and
// the last one's (PrefillRateMeter).
struct MeasuredRate {
    double best = 0, recent = 0;
};

// The rate a class's wait is predicted with (A1 and Retry-After). Prefill's passes
// on its own cores and its wide passes (computed with the partner decode worker's
// cores as well: lent while decode is idle, or claimed by a pass led by a critical
// request or for prompts at risk, roles/claims.h) are measured apart. A critical request's passes
// claim the partner's cores wherever cores are lent, so its wait goes at the wide
// rate once one is measured (with no cores lent none ever is). Other classes have
// the lent cores only while decode happens to be idle, which a prediction cannot
// count on: the own rate, or the wide one while the own is not measured yet (a
// worker whose partner has always been idle). (One rate over both kinds of pass
// read the lending of an idle moment as prefill's speed under load.)
MeasuredRate admission_rate(SloClass c, MeasuredRate own, MeasuredRate wide);

// Claims for work that is not critical (WorkerBase::claim_cores, rule C6). While a
// prompt prefill holds would get its first token after its class's deadline on
// prefill's own cores (queue_misses_on_own_cores), a pass not led by a critical
// request may compute on the partner decode worker's cores while decode holds
// streams, for as long as decode has time in hand: every sequence it holds has
// run ahead of its class's inter-token target since its first step there, and
// stepping aside may spend that lead down to `fraction` of the target on average,
// never further, in gaps no longer than the target. So a stream's mean inter-token
// time stays within its target whatever decode yields, and a prompt at risk gets
// both cores. (Lent cores alone,
// only while decode is idle, left a long prompt on one core for 5-6 s while streams
// decoded at 20 ms per token against a 250 ms target: bench/RESULTS.md "The mixed
// scenario with lending".)
inline constexpr double kYieldPace = 0.8;  // `fraction` above
struct StreamPace {
    uint64_t itl_target_ns = 0;  // its class's (0: none: never limits)
    uint64_t since_ns = 0;       // time since its first step in this decode worker
    uint64_t tokens = 0;         // tokens it got since then
};
// How long decode may step aside now: the least over its sequences of
// fraction x target x tokens - since_ns (0 when one has no time in hand) and of
// their targets (no gap a yield makes is longer than a stream's target), at most
// cap_ns (also when none has a target).
uint64_t yield_budget_ns(const std::vector<StreamPace>& streams, double fraction, uint64_t cap_ns);
// A prompt prefill holds: its order key (prefill_order_key), its TTFT deadline
// (submission + its class's target) and the tokens it has left to compute.
struct PendingPrompt {
    uint64_t order_key = 0;
    uint64_t deadline_ns = 0;
    int64_t remaining = 0;
};
// Whether, computed in order from now at `own_rate` tokens/s, one of them would get
// its first token after its deadline (0: rate not known: false). The queue, not the
// lead alone: a prompt behind the lead is at risk from the lead's tokens too.
bool queue_misses_on_own_cores(std::vector<PendingPrompt> q, uint64_t now_ns, double own_rate);

struct AdmissionOptions {
    SloTable slo;
    double slack = 1.0;               // A1: refuse past slack x the class's TTFT target
    int64_t queue_high = 65536;       // A2: prompt tokens not yet prefilled (0: no watermark)
    int64_t queue_low = 49152;
    double kv_high = 0.95;            // A3: fractions of the KV arena held by requests (0: no watermark)
    double kv_low = 0.85;
};

// A running request as A3's Retry-After sees it: the KV blocks it holds and the time
// until it ends (its tokens left at the measured time per token).
struct RunningKv {
    int64_t blocks = 0;
    uint64_t left_ns = 0;
};

// What the front sees of the KV arenas: blocks held by requests, of how many, and
// the running requests.
struct KvView {
    int64_t used = 0, total = 0;
    std::vector<RunningKv> running;
    double used_fraction() const { return total > 0 ? static_cast<double>(used) / static_cast<double>(total) : 0; }
};

// When `used` blocks will be down to `target`: the running requests end in the order
// of their time left, each freeing its blocks; the time left of the one that brings
// it there. 0 when used <= target; UINT64_MAX when the running requests together
// do not hold enough.
uint64_t kv_drain_ns(std::vector<RunningKv> running, int64_t used, int64_t target);

// The prompt tokens prefill computes before the queue the front sees is down to
// `target` tokens: the prompts in `prompts` leave it whole, in order (a prompt leaves
// when its first token comes, however far prefill is into it), the tokens `total`
// holds beyond them continuously. 0 when total <= target. An estimate: the tokens
// already computed of the prompts prefill holds are not known here (the wait may be
// that much longer than needed), and it comes out short when prefill holds a prompt
// with a later key than one still queued (it does not set it aside), interleaves
// the prompts it holds, several workers drain at once, or a more urgent prompt comes
// first. Assuming a steady drain, A2 had told a client to come back in a few ms
// while the prompt that would bring the queue under the mark had seconds to go: 22
// refusals in a row under ASan.
int64_t queue_drain_tokens(const std::multimap<uint64_t, int64_t>& prompts, int64_t total, int64_t target);

// Why admission refused a request: the rule that did (A1, A2, A3 above).
enum class Refusal : uint8_t { None, Ttft, Queue, Kv };
const char* refusal_name(Refusal r);  // "", "ttft", "queue", "kv"

struct AdmissionDecision {
    bool admit = true;
    Refusal refusal = Refusal::None;  // why not
    uint64_t predicted_ttft_ns = 0;  // 0 when the rate is not known yet
    uint64_t retry_after_ms = 0;
};

// The queue the front sees: prompt tokens admitted and not yet prefilled, per class,
// and (where the front keeps them) the prompts themselves by prefill's order key
// (prefill_order_key; their tokens), which A2's Retry-After walks.
struct QueueView {
    std::array<int64_t, kSloClasses> pending{};
    std::multimap<uint64_t, int64_t> prompts{};
    int64_t total() const { return pending[0] + pending[1] + pending[2]; }
    // What is served before a new request of class c: its class and the more urgent.
    int64_t ahead_of(SloClass c) const {
        int64_t s = 0;
        for (size_t i = 0; i <= static_cast<size_t>(c); ++i) s += pending[i];
        return s;
    }
};

class AdmissionControl {
public:
    explicit AdmissionControl(AdmissionOptions o) : o_(std::move(o)) {}
    // Decides for a request of class c with `prompt_tokens` to prefill, given the
    // queue and prefill's measured rates (tokens/s, 0: unknown): the best window's
    // (`rate`) and the last one's (`recent`). Predictions and Retry-After use the
    // slower of the two: the machine as it is now, so that an admitted request meets
    // its target and a client told to wait does not come back to a queue as full as
    // it left it. Updates the watermark's hysteresis state (not thread-safe: the
    // caller serializes).
    // `kv`: the arenas (A3; null: not judged). `returning`: A1 refused this prompt
    // before and it came back in time (RetryMemory): A1 does not judge it again.
    AdmissionDecision decide(SloClass c, int64_t prompt_tokens, const QueueView& q, double rate, double recent = 0,
                             const KvView* kv = nullptr, bool returning = false);
    bool over_watermark() const { return over_; }
    bool over_kv_watermark() const { return kv_over_; }
    const AdmissionOptions& options() const { return o_; }

private:
    AdmissionOptions o_;
    bool over_ = false;
    bool kv_over_ = false;
};

// Retry-After in whole seconds for a delay in milliseconds (rounded up, at least 1).
uint64_t retry_after_seconds(uint64_t ms);

// A1 judges a prompt once. A client that waited the Retry-After A1 gave it found,
// in the mixed scenario, stream prompts that had arrived meanwhile queued ahead of
// it again, and again: one 1051-token prompt was refused 14 times and got its
// first token after 46.6 s (bench/RESULTS.md "The mixed scenario with claims").
// Waiting helped it no more than the first time. So the front remembers a prompt A1
// refused (a hash of its class and tokens) until its Retry-After plus `grace_ns`
// (the openai client waits the Retry-After, then retries at once); back within that,
// A1 does not judge it again. A2 and A3 still judge it: they bound what the server
// holds, not one request's wait; a returning prompt they refuse stays remembered
// until their Retry-After plus the grace (it was judged by A1 once already). It is
// forgotten once admitted. Another client's identical prompt inside that window is
// taken for the returning one: at most one A1 refusal spared per A1 refusal. At most
// `capacity` prompts remembered (beyond: the oldest forgotten first, which only
// costs them a second refusal). Not thread-safe: the caller serializes.
class RetryMemory {
public:
    explicit RetryMemory(size_t capacity = 4096, uint64_t grace_ns = 30'000'000'000ull)
        : capacity_(capacity), grace_ns_(grace_ns) {}
    static uint64_t key(SloClass c, const int32_t* tokens, size_t n);
    // A1 refused the prompt `key` now, telling it to come back in retry_after_ms.
    void refused(uint64_t key, uint64_t now_ns, uint64_t retry_after_ms);
    // Whether `key` was refused by A1 and is back in time (nothing forgotten).
    bool returning(uint64_t key, uint64_t now_ns) const;
    // What decide() said of `key`, judged with `returning` (its answer before):
    // admitted, it is forgotten; refused by A1, or by A2/A3 while returning, it is
    // remembered until d's Retry-After plus the grace.
    void judged(uint64_t key, uint64_t now_ns, bool returning, const AdmissionDecision& d);
    size_t size() const { return until_.size(); }

private:
    struct Entry {
        uint64_t key = 0, until_ns = 0, at_ns = 0;
    };
    size_t capacity_;
    uint64_t grace_ns_;
    std::vector<Entry> until_;  // small: a linear scan (capacity bounds it)
};

}  // namespace duet
