// The scheduling policy (src/engine/scheduling.h): classes, --slo, the prefill rate
// meter, admission A1/A2 with its hysteresis and computed Retry-After. Expected
// values are worked out by hand in the comments.
#include <gtest/gtest.h>

#include "engine/prefill_scheduler.h"
#include "engine/scheduling.h"

using namespace duet;

TEST(Scheduling, PrioritiesNameAClassOrOrderLikeVllm) {
    EXPECT_EQ(*parse_priority("critical"), SloClass::Critical);
    EXPECT_EQ(*parse_priority("standard"), SloClass::Standard);
    EXPECT_EQ(*parse_priority("batch"), SloClass::Batch);
    EXPECT_EQ(*parse_priority("-5"), SloClass::Critical);  // lower is more urgent
    EXPECT_EQ(*parse_priority("0"), SloClass::Standard);
    EXPECT_EQ(*parse_priority("+3"), SloClass::Batch);
    for (const char* bad : {"", "urgent", "1.5", "Critical", "3x", "--1"}) {
        auto r = parse_priority(bad);
        ASSERT_FALSE(r) << bad;
        EXPECT_EQ(r.error().kind, ErrorKind::Invalid);
    }
}

TEST(Scheduling, SloSpecChangesTheClassesItNames) {
    auto t = SloTable::parse("critical=300ms/20ms,batch=30s/1.5s");
    ASSERT_TRUE(t) << t.error().message;
    EXPECT_EQ(t->of(SloClass::Critical).ttft_ns, 300'000'000u);
    EXPECT_EQ(t->of(SloClass::Critical).itl_ns, 20'000'000u);
    EXPECT_EQ(t->of(SloClass::Batch).ttft_ns, 30'000'000'000u);
    EXPECT_EQ(t->of(SloClass::Batch).itl_ns, 1'500'000'000u);
    EXPECT_EQ(t->of(SloClass::Standard).ttft_ns, SloTable{}.of(SloClass::Standard).ttft_ns);  // the default kept
    EXPECT_EQ(t->to_string(), "critical=300ms/20ms,standard=5s/250ms,batch=30s/1500ms");
    EXPECT_TRUE(SloTable::parse(""));
    for (const char* bad : {"critical=300/20ms", "critical=300ms", "urgent=1s/1s", "0=1s/1s", "critical=-1s/1s",
                            "critical=1s/2h", "critical=0ms/1ms"})
        EXPECT_FALSE(SloTable::parse(bad)) << bad;
}

TEST(Scheduling, TheRateIsPrefillsPassThroughputAndUnknownUntilMeasured) {
    constexpr uint64_t ms = 1'000'000;
    PrefillRateMeter m(1000 * ms, 0.5, /*min_tokens=*/0);  // 1 s windows, a best window halved per window
    m.add(400 * ms, 400);  // 0.4 s of passes: the window is not full
    EXPECT_EQ(m.rate(), 0);
    EXPECT_EQ(m.recent(), 0);
    m.add(300 * ms, 300);  // 0.7 s
    EXPECT_EQ(m.rate(), 0);
    m.add(300 * ms, 300);  // 1.0 s, 1000 tokens: 1000 tokens/s
    EXPECT_DOUBLE_EQ(m.rate(), 1000);
    EXPECT_DOUBLE_EQ(m.recent(), 1000);
    m.add(2000 * ms, 1000);  // 2 s, 500/s: the best window halved is 500 too
    EXPECT_DOUBLE_EQ(m.rate(), 500);
    EXPECT_DOUBLE_EQ(m.recent(), 500);
    m.add(1000 * ms, 1200);  // 1200/s: a better window
    EXPECT_DOUBLE_EQ(m.rate(), 1200);
    m.add(1000 * ms, 300);  // a slow window: best decays to 600, recent is 300
    EXPECT_DOUBLE_EQ(m.rate(), 600);
    EXPECT_DOUBLE_EQ(m.recent(), 300);
}

// A worker's first passes run cold: nothing is reported until min_tokens have been
// measured in closed windows, and then the best window counts (not the cold ones).
TEST(Scheduling, TheRateWaitsForEvidence) {
    constexpr uint64_t ms = 1'000'000;
    PrefillRateMeter m(100 * ms, 0.95, /*min_tokens=*/2048);
    for (int i = 0; i < 10; ++i) m.add(100 * ms, 6);  // 60 tokens/s, 60 tokens: not evidence
    EXPECT_EQ(m.rate(), 0);
    EXPECT_EQ(m.recent(), 0);
    m.add(100 * ms, 1000);  // 10000/s, 1060 tokens measured
    EXPECT_EQ(m.rate(), 0);
    m.add(100 * ms, 1000);  // 2060 measured
    EXPECT_DOUBLE_EQ(m.rate(), 10000);
    EXPECT_DOUBLE_EQ(m.recent(), 10000);
}

// Options with `slo` and A2's watermarks at 1000 (high) and 600 (low) tokens.
static AdmissionOptions watermarked(const char* slo) {
    AdmissionOptions o;
    o.slo = *SloTable::parse(slo);
    o.queue_high = 1000;
    o.queue_low = 600;
    return o;
}

// Predictions and the wait told with a 429 use the slower of the best and recent
// rates: an admitted request must meet its target on the machine as it is now, and
// a client told to come back must not find the queue as full as it left it.
TEST(Scheduling, AdmissionPredictsAtTheSlowerRate) {
    AdmissionOptions o = watermarked("critical=1s/50ms,standard=2s/100ms,batch=10s/1s");
    AdmissionControl a(o);
    QueueView q;
    q.pending = {0, 0, 1000};
    auto d = a.decide(SloClass::Batch, 10, q, 1000, 200);  // A2: (1000 - 600) / 200 tokens/s
    EXPECT_FALSE(d.admit);
    EXPECT_EQ(d.refusal, Refusal::Queue);
    EXPECT_EQ(d.retry_after_ms, 2000u);
    d = a.decide(SloClass::Batch, 10, q, 1000, 4000);  // a faster recent window: the best rate is the slower
    EXPECT_EQ(d.retry_after_ms, 400u);
    // A1 at 500 tokens/s (recent) rather than 1000 (best): 400 ahead + 10 is 0.82 s,
    // within critical's 1 s; 600 ahead + 10 is 1.22 s: refused until the queue has
    // fallen to 490 tokens, (600 - 490) / 500 = 220 ms.
    o.queue_high = 0;
    AdmissionControl a1(o);
    EXPECT_TRUE(a1.decide(SloClass::Critical, 10, {{400, 0, 0}}, 1000, 500).admit);
    d = a1.decide(SloClass::Critical, 10, {{600, 0, 0}}, 1000, 500);
    EXPECT_FALSE(d.admit);
    EXPECT_EQ(d.refusal, Refusal::Ttft);
    EXPECT_EQ(d.predicted_ttft_ns, 1'220'000'000u);
    EXPECT_EQ(d.retry_after_ms, 220u);
    EXPECT_TRUE(a1.decide(SloClass::Critical, 10, {{600, 0, 0}}, 1000, 0).admit);  // no recent window: the best
}

// Critical work goes at the rate of passes with the partner's cores (claimed for
// it), every other class at the rate of prefill's own cores; a rate not measured yet
// gives way to the other one.
TEST(Scheduling, CriticalWaitsArePredictedAtTheWideRateOthersAtTheOwn) {
    const MeasuredRate own{400, 380}, wide{750, 700}, none{};
    auto eq = [](MeasuredRate a, MeasuredRate b) { return a.best == b.best && a.recent == b.recent; };
    EXPECT_TRUE(eq(admission_rate(SloClass::Critical, own, wide), wide));
    EXPECT_TRUE(eq(admission_rate(SloClass::Standard, own, wide), own));
    EXPECT_TRUE(eq(admission_rate(SloClass::Batch, own, wide), own));
    EXPECT_TRUE(eq(admission_rate(SloClass::Critical, own, none), own));  // no cores lent: never measured
    EXPECT_TRUE(eq(admission_rate(SloClass::Standard, none, wide), wide));  // decode always idle so far
    EXPECT_TRUE(eq(admission_rate(SloClass::Batch, none, none), none));
    // The overload scenario's pair: two 256-token critical prompts 0.3 s apart, a 1 s
    // target. At one core's 420 tokens/s the second is predicted at 512 / 420 = 1.22 s
    // and refused; at the wide 800 tokens/s, 0.64 s: admitted.
    AdmissionOptions o;
    o.queue_high = 0;
    AdmissionControl a(o);
    const QueueView q{{256, 0, 0}};
    EXPECT_FALSE(a.decide(SloClass::Critical, 256, q, 420).admit);
    const MeasuredRate r = admission_rate(SloClass::Critical, {420, 420}, {800, 800});
    EXPECT_TRUE(a.decide(SloClass::Critical, 256, q, r.best, r.recent).admit);
}

TEST(Scheduling, A1RefusesWhatCannotMeetItsTargetAndSaysWhenItWould) {
    AdmissionOptions o;
    o.slo = *SloTable::parse("critical=1s/50ms,standard=2s/100ms,batch=10s/1s");
    o.queue_high = 0;  // A1 alone
    AdmissionControl a(o);
    QueueView q;
    q.pending = {500, 3000, 20000};
    // Unknown rate: nothing is refused.
    EXPECT_TRUE(a.decide(SloClass::Standard, 100, q, 0).admit);
    // 1000 tokens/s. Critical: 500 ahead + 100 = 0.6 s <= 1 s.
    auto d = a.decide(SloClass::Critical, 100, q, 1000);
    EXPECT_TRUE(d.admit);
    EXPECT_EQ(d.predicted_ttft_ns, 600'000'000u);
    // Standard: 3500 ahead + 100 = 3.6 s > 2 s. To meet it the queue ahead must fall
    // to 2000 - 100 = 1900 tokens: (3500 - 1900) / 1000 = 1.6 s.
    d = a.decide(SloClass::Standard, 100, q, 1000);
    EXPECT_FALSE(d.admit);
    EXPECT_EQ(d.refusal, Refusal::Ttft);
    EXPECT_EQ(d.retry_after_ms, 1600u);
    EXPECT_EQ(retry_after_seconds(d.retry_after_ms), 2u);
    // Batch: 23500 + 100 = 23.6 s > 10 s; the room is 10000 - 100: (23500 - 9900) / 1000 = 13.6 s.
    d = a.decide(SloClass::Batch, 100, q, 1000);
    EXPECT_FALSE(d.admit);
    EXPECT_EQ(d.retry_after_ms, 13600u);
    // A prompt that alone misses its target (5 s > 1 s): no later try meets it, so A1
    // admits it, with nothing ahead or with a queue ahead (its prediction says so).
    QueueView empty;
    EXPECT_TRUE(a.decide(SloClass::Critical, 5000, empty, 1000).admit);
    q.pending = {500, 0, 0};
    d = a.decide(SloClass::Critical, 5000, q, 1000);
    EXPECT_TRUE(d.admit);
    EXPECT_EQ(d.predicted_ttft_ns, 5'500'000'000u);
    // One that alone just meets it (1000 tokens: 1 s) waits for the queue ahead: all
    // of it, (500 - 0) / 1000 s.
    d = a.decide(SloClass::Critical, 1000, q, 1000);
    EXPECT_FALSE(d.admit);
    EXPECT_EQ(d.retry_after_ms, 500u);
    // Slack 2: 3.6 s <= 2 x 2 s for standard.
    o.slack = 2;
    AdmissionControl lax(o);
    q.pending = {500, 3000, 20000};
    EXPECT_TRUE(lax.decide(SloClass::Standard, 100, q, 1000).admit);
}

TEST(Scheduling, A2WatermarksHaveHysteresisAndSpareCriticalWork) {
    AdmissionOptions o = watermarked("critical=100s/1s,standard=100s/1s,batch=100s/1s");  // A1 never refuses here
    AdmissionControl a(o);
    QueueView q;
    q.pending = {0, 999, 0};
    EXPECT_TRUE(a.decide(SloClass::Standard, 50, q, 100).admit);
    q.pending = {0, 1000, 0};  // at the high mark: refused
    auto d = a.decide(SloClass::Batch, 50, q, 100);
    EXPECT_FALSE(d.admit);
    EXPECT_EQ(d.refusal, Refusal::Queue);
    EXPECT_EQ(d.retry_after_ms, 4000u);  // (1000 - 600) / 100 tokens/s
    EXPECT_TRUE(a.over_watermark());
    EXPECT_TRUE(a.decide(SloClass::Critical, 50, q, 100).admit);  // judged by A1 alone
    q.pending = {0, 700, 0};  // under high, over low: still refused (hysteresis)
    EXPECT_FALSE(a.decide(SloClass::Standard, 50, q, 100).admit);
    q.pending = {0, 600, 0};  // at the low mark: open again
    EXPECT_TRUE(a.decide(SloClass::Standard, 50, q, 100).admit);
    EXPECT_FALSE(a.over_watermark());
    q.pending = {0, 900, 0};
    EXPECT_TRUE(a.decide(SloClass::Standard, 50, q, 100).admit);
}

// A2's Retry-After with the prompts known: each leaves the front's queue whole (with
// its first token), in prefill's order, so the queue is under the low mark only once
// the prompt that brings it there has been computed, not after the steady drain of
// total - low tokens (which told clients to come back again and again while that
// prompt was computed).
TEST(Scheduling, A2RetryAfterWaitsForThePromptsThatBringTheQueueUnderTheLowMark) {
    // 3 prompts of 300 in order; low 500: after the first, 600 left (> 500); after
    // the second, 300: the work is 600 tokens, not 900 - 500 = 400.
    std::multimap<uint64_t, int64_t> q{{10, 300}, {20, 300}, {30, 300}};
    EXPECT_EQ(queue_drain_tokens(q, 900, 500), 600);
    EXPECT_EQ(queue_drain_tokens(q, 900, 600), 300);  // at the mark after the first
    EXPECT_EQ(queue_drain_tokens(q, 900, 900), 0);    // there already
    EXPECT_EQ(queue_drain_tokens(q, 900, 0), 900);
    // By order key, not by insertion: a short prompt first (an earlier key).
    std::multimap<uint64_t, int64_t> mixed{{30, 800}, {10, 100}, {20, 100}};
    EXPECT_EQ(queue_drain_tokens(mixed, 1000, 500), 1000);  // 900, 800, then 0
    EXPECT_EQ(queue_drain_tokens(mixed, 1000, 850), 200);
    // Tokens the view holds beyond the prompts it knows drain steadily after them.
    EXPECT_EQ(queue_drain_tokens({}, 1000, 600), 400);
    EXPECT_EQ(queue_drain_tokens(q, 1200, 100), 300 * 3 + 200);

    AdmissionOptions o = watermarked("critical=100s/1s,standard=100s/1s,batch=100s/1s");  // A1 never refuses here
    AdmissionControl a(o);
    QueueView v;
    v.pending = {0, 1000, 0};
    v.prompts = {{1, 400}, {2, 300}, {3, 300}};
    auto d = a.decide(SloClass::Standard, 50, v, 100);
    EXPECT_FALSE(d.admit);
    EXPECT_EQ(d.refusal, Refusal::Queue);
    EXPECT_EQ(d.retry_after_ms, 4000u);  // the first prompt's 400 tokens bring it to 600
    v.prompts = {{1, 300}, {2, 300}, {3, 400}};
    EXPECT_EQ(a.decide(SloClass::Standard, 50, v, 100).retry_after_ms, 6000u);  // 700 after one, 400 after two
}

// A critical prompt too long to meet its target even alone is not judged by A1, so
// the watermark bounds it as it bounds standard work.
TEST(Scheduling, ACriticalPromptThatCannotMeetItsTargetIsBoundByTheWatermark) {
    AdmissionOptions o = watermarked("critical=1s/1s,standard=100s/1s,batch=100s/1s");
    AdmissionControl a(o);
    QueueView q;
    q.pending = {0, 1200, 0};  // over the high mark
    EXPECT_FALSE(a.decide(SloClass::Standard, 50, q, 100).admit);
    EXPECT_TRUE(a.decide(SloClass::Critical, 50, q, 100).admit);  // 0.5 s alone: A1 judges it (nothing ahead)
    auto d = a.decide(SloClass::Critical, 500, q, 100);           // 5 s alone > 1 s
    EXPECT_FALSE(d.admit);
    EXPECT_EQ(d.refusal, Refusal::Queue);
    EXPECT_EQ(d.retry_after_ms, 6000u);  // (1200 - 600) / 100 tokens/s
    q.pending = {0, 600, 0};             // under the low mark: admitted
    EXPECT_TRUE(a.decide(SloClass::Critical, 500, q, 100).admit);
}

// A3: the KV blocks held by requests, with hysteresis between 95% and 85% (of 100
// blocks: over at 95, open again at 85); critical requests pass; Retry-After is when
// the running requests that end first have freed enough to get down to 85.
TEST(Scheduling, A3KvWatermarksHaveHysteresisAndARetryAfterFromTheRunningRequests) {
    AdmissionOptions o;
    o.slo = *SloTable::parse("critical=100s/1s,standard=100s/1s,batch=100s/1s");  // A1 never refuses here
    AdmissionControl a(o);
    const QueueView q;
    KvView kv;
    kv.total = 100;
    kv.used = 94;
    // Ending in 3 s, 0.5 s and 2 s, holding 4, 6 and 5 blocks.
    kv.running = {{4, 3'000'000'000ull}, {6, 500'000'000ull}, {5, 2'000'000'000ull}};
    EXPECT_TRUE(a.decide(SloClass::Standard, 50, q, 100, 0, &kv).admit);
    kv.used = 95;  // at the high mark
    auto d = a.decide(SloClass::Batch, 50, q, 100, 0, &kv);
    EXPECT_FALSE(d.admit);
    EXPECT_EQ(d.refusal, Refusal::Kv);
    // 95 - 6 (at 0.5 s) = 89, - 5 (at 2 s) = 84 <= 85: 2 s.
    EXPECT_EQ(d.retry_after_ms, 2000u);
    EXPECT_TRUE(a.over_kv_watermark());
    EXPECT_TRUE(a.decide(SloClass::Critical, 50, q, 100, 0, &kv).admit);  // decode preempts for it
    kv.used = 90;  // under high, over low: still refused
    EXPECT_FALSE(a.decide(SloClass::Standard, 50, q, 100, 0, &kv).admit);
    kv.used = 85;  // at the low mark: open again
    EXPECT_TRUE(a.decide(SloClass::Standard, 50, q, 100, 0, &kv).admit);
    EXPECT_FALSE(a.over_kv_watermark());
    kv.used = 93;
    EXPECT_TRUE(a.decide(SloClass::Standard, 50, q, 100, 0, &kv).admit);
    // Blocks held by nothing that will end (the running requests free too few): a
    // second, the next look.
    kv.used = 99;
    kv.running = {{1, 100'000'000ull}};
    d = a.decide(SloClass::Standard, 50, q, 100, 0, &kv);
    EXPECT_FALSE(d.admit);
    EXPECT_EQ(d.retry_after_ms, 1000u);
    // Off: kv_high 0.
    o.kv_high = 0;
    AdmissionControl off(o);
    EXPECT_TRUE(off.decide(SloClass::Batch, 50, q, 100, 0, &kv).admit);
    // kv_drain_ns alone.
    EXPECT_EQ(kv_drain_ns({}, 10, 10), 0u);
    EXPECT_EQ(kv_drain_ns({{3, 7}, {2, 5}}, 12, 10), 5u);
    EXPECT_EQ(kv_drain_ns({{3, 7}, {2, 5}}, 12, 7), 7u);
    EXPECT_EQ(kv_drain_ns({{3, 7}, {2, 5}}, 12, 6), UINT64_MAX);
}

// The order between classes (engine/scheduling.h "Order"): priority with aging. A
// critical request goes before a standard one that has waited 10 s (plain earliest
// deadline first would not: 10 s + 1 s > 5 s); a batch request that has waited past
// its bound (60 s + 2 x 30 s - 1 s) goes before a new critical one.
TEST(Scheduling, ClassesHavePrecedenceThatAgingBounds) {
    const SloTable slo;  // critical 1 s, standard 5 s, batch 60 s
    constexpr uint64_t s = 1'000'000'000, per_token = 1'000'000;
    auto key = [&](uint64_t arrival, SloClass c, uint64_t n) {
        return prefill_order_key(arrival, static_cast<uint32_t>(c), slo.of(c).ttft_ns, n, per_token);
    };
    auto first = [&](uint64_t a, uint64_t b) {  // which of two jobs (100 tokens each) a pass takes
        std::vector<PrefillJobView> jobs = {{a, 100, true, false}, {b, 100, true, false}};
        PrefillPlan p = plan_prefill(jobs, 100, false);
        EXPECT_EQ(p.entries.size(), 1u);
        return p.entries.empty() ? 9u : p.entries[0].job;
    };
    EXPECT_EQ(first(key(0, SloClass::Standard, 100), key(10 * s, SloClass::Critical, 100)), 1u);
    EXPECT_EQ(first(key(0, SloClass::Standard, 100), key(33 * s, SloClass::Critical, 100)), 1u);
    EXPECT_EQ(first(key(0, SloClass::Standard, 100), key(35 * s, SloClass::Critical, 100)), 0u);  // aged
    EXPECT_EQ(first(key(0, SloClass::Batch, 100), key(118 * s, SloClass::Critical, 100)), 1u);
    EXPECT_EQ(first(key(0, SloClass::Batch, 100), key(120 * s, SloClass::Critical, 100)), 0u);
    EXPECT_EQ(first(key(0, SloClass::Batch, 100), key(30 * s, SloClass::Standard, 100)), 1u);
    EXPECT_EQ(first(key(0, SloClass::Batch, 100), key(90 * s, SloClass::Standard, 100)), 0u);
    // Within a class, earliest deadline first: a shorter prompt goes first unless it
    // came more than its difference in milliseconds later.
    EXPECT_EQ(first(key(0, SloClass::Standard, 400), key(100'000'000, SloClass::Standard, 100)), 1u);
    EXPECT_EQ(first(key(0, SloClass::Standard, 400), key(400'000'000, SloClass::Standard, 100)), 0u);
    // An integer class past batch is batch.
    EXPECT_EQ(prefill_order_key(0, 7, 0, 0, 0), prefill_order_key(0, 2, 0, 0, 0));
}

// A pass led by a critical request takes only critical ones (the rest would pad it and
// delay those first tokens); a pass led by another class packs as before.
TEST(Scheduling, ACriticalPassIsNotPaddedWithOtherClasses) {
    // deadline, remaining, looked_up, follows, urgent
    std::vector<PrefillJobView> jobs = {{300, 200, true, false, false},
                                        {100, 50, true, false, true},
                                        {200, 100, true, false, false},
                                        {400, 60, true, false, true}};
    PrefillPlan p = plan_prefill(jobs, 512, false);
    EXPECT_EQ(p.entries, (std::vector<PrefillEntry>{{1, 50}, {3, 60}}));
    jobs[1].urgent = false;  // no critical one first: everything packs in deadline order
    p = plan_prefill(jobs, 512, false);
    EXPECT_EQ(p.entries, (std::vector<PrefillEntry>{{1, 50}, {2, 100}, {0, 200}, {3, 60}}));
}

// A pass not led by a critical request is cut to the lesser budget (a critical one
// arriving meanwhile waits for it); a pass led by one keeps the whole budget.
TEST(Scheduling, APassNotLedByACriticalRequestIsShort) {
    // deadline, remaining, looked_up, follows, urgent
    std::vector<PrefillJobView> jobs = {{300, 200, true, false, false}, {200, 100, true, false, false}};
    EXPECT_EQ(plan_prefill(jobs, 512, false, 128).entries, (std::vector<PrefillEntry>{{1, 100}, {0, 28}}));
    EXPECT_EQ(plan_prefill(jobs, 512, false, 0).entries, (std::vector<PrefillEntry>{{1, 100}, {0, 200}}));
    jobs.push_back({100, 300, true, false, true});
    EXPECT_EQ(plan_prefill(jobs, 512, false, 128).entries, (std::vector<PrefillEntry>{{2, 300}}));
    jobs[2].remaining = 600;
    EXPECT_EQ(plan_prefill(jobs, 512, false, 128).entries, (std::vector<PrefillEntry>{{2, 512}}));
}

// The cut: the worker's measured tokens per ns times the pass time, at least 64; no
// cut before 2048 tokens were measured, with no pass time, or (window > 0) when no
// critical request was taken within the window.
TEST(Scheduling, ThePassCutIsPaidOnlyWhileCriticalWorkIsAround) {
    const uint64_t ms = 1'000'000, s = 1000 * ms;
    // 4000 tokens in 10 s of passes: 400 tokens/s, so 250 ms is 100 tokens.
    EXPECT_EQ(pass_cut_tokens(10 * s, 4000, 250 * ms, 0, 100 * s, 0), 100);             // window 0: always
    EXPECT_EQ(pass_cut_tokens(10 * s, 4000, 250 * ms, 0, 100 * s, 60 * s), 0);          // no critical one yet
    EXPECT_EQ(pass_cut_tokens(10 * s, 4000, 250 * ms, 50 * s, 100 * s, 60 * s), 100);   // one 50 s ago
    EXPECT_EQ(pass_cut_tokens(10 * s, 4000, 250 * ms, 40 * s, 100 * s, 60 * s), 100);   // exactly 60 s ago
    EXPECT_EQ(pass_cut_tokens(10 * s, 4000, 250 * ms, 39 * s, 100 * s, 60 * s), 0);     // 61 s ago
    EXPECT_EQ(pass_cut_tokens(10 * s, 4000, 0, 99 * s, 100 * s, 60 * s), 0);            // no pass time
    EXPECT_EQ(pass_cut_tokens(10 * s, 2047, 250 * ms, 99 * s, 100 * s, 60 * s), 0);     // too little measured
    EXPECT_EQ(pass_cut_tokens(0, 4000, 250 * ms, 99 * s, 100 * s, 60 * s), 0);          // no busy time
    EXPECT_EQ(pass_cut_tokens(100 * s, 4000, 250 * ms, 99 * s, 100 * s, 60 * s), 64);   // 10 tokens: at least 64
    EXPECT_EQ(pass_cut_tokens(10 * s, 4000, 250 * ms, 101 * s, 100 * s, 60 * s), 100);  // a clock read later: within
}

// Decode's time in hand (C6): each stream may fall back to 0.8 of its class's
// inter-token target on average since its first step, never further, in a gap no
// longer than its target; the least of them, capped.
TEST(Scheduling, DecodeYieldsOnlyTheTimeEveryStreamHasInHand) {
    // 250 ms target: 10 tokens in 1.9 s have 0.8 x 250 x 10 - 1900 = 100 ms in hand.
    EXPECT_EQ(yield_budget_ns({{250'000'000, 1'900'000'000, 10}}, 0.8, 10'000'000'000ull), 100'000'000u);
    // In 0.5 s they have 1500 ms in hand, but one gap is at most the 250 ms target.
    EXPECT_EQ(yield_budget_ns({{250'000'000, 500'000'000, 10}}, 0.8, 10'000'000'000ull), 250'000'000u);
    // The tightest stream decides: a critical one (100 ms) with 4 tokens in 0.27 s
    // has 0.8 x 100 x 4 - 270 = 50 ms.
    EXPECT_EQ(yield_budget_ns({{250'000'000, 500'000'000, 10}, {100'000'000, 270'000'000, 4}}, 0.8, 10'000'000'000ull),
              50'000'000u);
    // A stream just in (no token yet) or behind its pace: nothing in hand.
    EXPECT_EQ(yield_budget_ns({{250'000'000, 500'000'000, 10}, {250'000'000, 1'000'000, 0}}, 0.8, 10'000'000'000ull), 0u);
    EXPECT_EQ(yield_budget_ns({{100'000'000, 900'000'000, 10}}, 0.8, 10'000'000'000ull), 0u);  // 800 - 900 < 0
    // No target (0) never limits; the cap holds.
    EXPECT_EQ(yield_budget_ns({{0, 5'000'000'000ull, 1}}, 0.8, 2'000'000'000ull), 2'000'000'000u);
    EXPECT_EQ(yield_budget_ns({}, 0.8, 2'000'000'000ull), 2'000'000'000u);
    EXPECT_EQ(yield_budget_ns({{5'000'000'000ull, 100'000'000, 100}}, 0.8, 2'000'000'000ull), 2'000'000'000u);
    // Spending the budget keeps the stream within its target: yielding the 100 ms of
    // the first case leaves its mean at (1900 + 100) / 10 = 200 ms = 0.8 x 250 ms, and
    // then nothing in hand.
    EXPECT_EQ(yield_budget_ns({{250'000'000, 2'000'000'000ull, 10}}, 0.8, 10'000'000'000ull), 0u);
}

// Prompts at risk (C6): computed in order (their keys) from now on prefill's own
// cores, one would get its first token after its deadline.
TEST(Scheduling, APromptIsAtRiskWhenItsOwnCoresMissItsDeadline) {
    const uint64_t s = 1'000'000'000ull;  // submitted at 1 s, 5 s target: the deadline is 6 s
    auto one = [&](uint64_t now, int64_t tokens, double rate) {
        return queue_misses_on_own_cores({{0, 6 * s, tokens}}, now, rate);
    };
    // 1536 tokens at 278 tokens/s from 1 s: 6.52 s > 6 s.
    EXPECT_TRUE(one(1 * s, 1536, 278));
    // 1024 tokens: 4.68 s: not at risk; from 2 s: 5.68 s, still not; from 2.5 s: 6.18 s, at risk.
    EXPECT_FALSE(one(1 * s, 1024, 278));
    EXPECT_FALSE(one(2 * s, 1024, 278));
    EXPECT_TRUE(one(2 * s + s / 2, 1024, 278));
    // Past its deadline already: at risk. Rate unknown: never.
    EXPECT_TRUE(one(7 * s, 1, 278));
    EXPECT_FALSE(one(7 * s, 1536, 0));
    EXPECT_FALSE(queue_misses_on_own_cores({}, s, 278));
    // The queue: a 1024-token prompt due at 6 s behind a 500-token one (a smaller
    // key) is at risk from 1 s: 1524 tokens take 5.48 s. Ahead of it, it is not (the
    // other one, due at 20 s, is fine at 6.48 s). Listed in either order.
    EXPECT_TRUE(queue_misses_on_own_cores({{2, 6 * s, 1024}, {1, 20 * s, 500}}, 1 * s, 278));
    EXPECT_FALSE(queue_misses_on_own_cores({{2, 20 * s, 500}, {1, 6 * s, 1024}}, 1 * s, 278));
}

// A1 judges a prompt once: back after its Retry-After (plus the grace), A1 admits
// it; A2 still judges it (and the prompt stays remembered through A2's Retry-After);
// too late, or back after it was admitted, and it is judged again.
TEST(Scheduling, APromptA1RefusedIsNotJudgedByA1WhenItComesBack) {
    const uint64_t ms = 1'000'000;
    const std::vector<int32_t> prompt = {5, 6, 7}, other = {5, 6, 8};
    const uint64_t k = RetryMemory::key(SloClass::Standard, prompt.data(), prompt.size());
    EXPECT_NE(k, RetryMemory::key(SloClass::Standard, other.data(), other.size()));
    EXPECT_NE(k, RetryMemory::key(SloClass::Batch, prompt.data(), prompt.size()));  // the class is part of it
    RetryMemory m(4, 100 * ms);
    AdmissionDecision yes, a1, a2;
    a1.admit = a2.admit = false;
    a1.refusal = Refusal::Ttft;
    a1.retry_after_ms = 500;
    a2.refusal = Refusal::Queue;
    a2.retry_after_ms = 2000;
    EXPECT_FALSE(m.returning(k, 0));  // never refused
    m.judged(k, 1000 * ms, false, a2);  // A2's refusal of a prompt A1 never refused: nothing remembered
    EXPECT_EQ(m.size(), 0u);
    m.judged(k, 1000 * ms, false, a1);  // back by 1.5 s, + 0.1 s grace
    EXPECT_TRUE(m.returning(k, 1550 * ms));
    EXPECT_TRUE(m.returning(k, 1560 * ms));  // asking forgets nothing
    // Back in time but refused by A2 (2 s): still returning until 3.55 s + 0.1 s.
    m.judged(k, 1550 * ms, true, a2);
    EXPECT_TRUE(m.returning(k, 3650 * ms));
    EXPECT_FALSE(m.returning(k, 3651 * ms));
    m.judged(k, 3600 * ms, true, yes);  // admitted: forgotten
    EXPECT_FALSE(m.returning(k, 3600 * ms));
    EXPECT_EQ(m.size(), 0u);
    m.refused(k, 4000 * ms, 500);
    EXPECT_FALSE(m.returning(k, 4601 * ms));  // too late: judged again
    m.judged(k, 4601 * ms, false, yes);
    EXPECT_EQ(m.size(), 0u);
    // At capacity the oldest refusal is forgotten; expired ones go first.
    for (int32_t i = 0; i < 5; ++i) m.refused(RetryMemory::key(SloClass::Standard, &i, 1), (5000 + i) * ms, 1000);
    EXPECT_EQ(m.size(), 4u);
    const int32_t first = 0, last = 4;
    EXPECT_FALSE(m.returning(RetryMemory::key(SloClass::Standard, &first, 1), 5100 * ms));
    EXPECT_TRUE(m.returning(RetryMemory::key(SloClass::Standard, &last, 1), 5100 * ms));
    m.refused(k, 9000 * ms, 1);  // the other four have expired by then
    EXPECT_EQ(m.size(), 1u);

    // decide(): the refused prompt (A1) is admitted when it comes back; A2 is not
    // lifted for it.
    AdmissionOptions o;
    o.slo = *SloTable::parse("standard=2s/100ms");
    o.queue_high = 4000;
    o.queue_low = 3000;
    AdmissionControl a(o);
    QueueView q{{0, 3000, 0}};
    auto d = a.decide(SloClass::Standard, 100, q, 1000);  // 3.1 s > 2 s
    EXPECT_FALSE(d.admit);
    EXPECT_EQ(d.refusal, Refusal::Ttft);
    EXPECT_TRUE(a.decide(SloClass::Standard, 100, q, 1000, 0, nullptr, true).admit);
    q.pending = {0, 4000, 0};  // over the high watermark: A2 refuses, returning or not
    d = a.decide(SloClass::Standard, 100, q, 1000, 0, nullptr, true);
    EXPECT_FALSE(d.admit);
    EXPECT_EQ(d.refusal, Refusal::Queue);
}
