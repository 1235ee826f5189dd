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

// The wait told with a 429 is computed at the slower of the best and recent rates:
// a client told to come back must not find the queue as full as it left it.
TEST(Scheduling, RetryAfterIsComputedAtTheSlowerRate) {
    AdmissionOptions o;
    o.slo = *SloTable::parse("critical=1s/50ms,standard=2s/100ms,batch=10s/1s");
    o.queue_high = 1000;
    o.queue_low = 600;
    AdmissionControl a(o);
    QueueView q;
    q.pending = {0, 0, 1000};
    auto d = a.decide(SloClass::Batch, 10, q, 1000, 200);  // A2: (1000 - 600) / 200 tokens/s
    EXPECT_FALSE(d.admit);
    EXPECT_EQ(d.reason, "queue");
    EXPECT_EQ(d.retry_after_ms, 2000u);
    d = a.decide(SloClass::Batch, 10, q, 1000, 4000);  // a faster recent window: the best rate is the slower
    EXPECT_EQ(d.retry_after_ms, 400u);
    // A1 refuses by the best rate: 1000 ahead + 10 over 1000/s is 1.01 s > 1 s. The
    // queue must fall to 990 tokens; 10 tokens at 200/s: 50 ms.
    o.queue_high = 0;
    AdmissionControl a1(o);
    q.pending = {1000, 0, 0};
    d = a1.decide(SloClass::Critical, 10, q, 1000, 200);
    EXPECT_FALSE(d.admit);
    EXPECT_EQ(d.reason, "ttft");
    EXPECT_EQ(d.retry_after_ms, 50u);
    EXPECT_TRUE(a1.decide(SloClass::Critical, 10, {{900, 0, 0}}, 1000, 200).admit);  // 0.91 s at the best rate
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
    EXPECT_EQ(d.reason, "ttft");
    EXPECT_EQ(d.retry_after_ms, 1600u);
    EXPECT_EQ(retry_after_seconds(d.retry_after_ms), 2u);
    // Batch: 23500 + 100 = 23.6 s > 10 s; the room is 10000 - 100: (23500 - 9900) / 1000 = 13.6 s.
    d = a.decide(SloClass::Batch, 100, q, 1000);
    EXPECT_FALSE(d.admit);
    EXPECT_EQ(d.retry_after_ms, 13600u);
    // A prompt that alone misses its target: waiting cannot help once nothing is ahead.
    QueueView empty;
    EXPECT_TRUE(a.decide(SloClass::Critical, 5000, empty, 1000).admit);
    // With something ahead it waits for all of it: (500 - 0) / 1000 s.
    q.pending = {500, 0, 0};
    d = a.decide(SloClass::Critical, 5000, q, 1000);
    EXPECT_FALSE(d.admit);
    EXPECT_EQ(d.retry_after_ms, 500u);
    // Slack 2: 3.6 s <= 2 x 2 s for standard.
    o.slack = 2;
    AdmissionControl lax(o);
    q.pending = {500, 3000, 20000};
    EXPECT_TRUE(lax.decide(SloClass::Standard, 100, q, 1000).admit);
}

TEST(Scheduling, A2WatermarksHaveHysteresisAndSpareCriticalWork) {
    AdmissionOptions o;
    o.slo = *SloTable::parse("critical=100s/1s,standard=100s/1s,batch=100s/1s");  // A1 never refuses here
    o.queue_high = 1000;
    o.queue_low = 600;
    AdmissionControl a(o);
    QueueView q;
    q.pending = {0, 999, 0};
    EXPECT_TRUE(a.decide(SloClass::Standard, 50, q, 100).admit);
    q.pending = {0, 1000, 0};  // at the high mark: refused
    auto d = a.decide(SloClass::Batch, 50, q, 100);
    EXPECT_FALSE(d.admit);
    EXPECT_EQ(d.reason, "queue");
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

// The aging bound: with deadlines = arrival + the class's TTFT target, a batch
// request is overtaken by a critical one only while the critical one's deadline is
// earlier; once the batch deadline has passed, a later critical arrival goes after it.
TEST(Scheduling, EarliestDeadlineFirstAgesBatchWork) {
    const SloTable slo;  // critical 1 s, batch 60 s
    const uint64_t batch_arrival = 0;
    const uint64_t batch_deadline = batch_arrival + slo.of(SloClass::Batch).ttft_ns;
    for (uint64_t critical_arrival : {uint64_t{1'000'000'000}, batch_deadline - slo.of(SloClass::Critical).ttft_ns + 1}) {
        const uint64_t critical_deadline = critical_arrival + slo.of(SloClass::Critical).ttft_ns;
        std::vector<PrefillJobView> jobs = {{batch_deadline, 100, true, false}, {critical_deadline, 100, true, false}};
        PrefillPlan p = plan_prefill(jobs, 100, false);
        ASSERT_EQ(p.entries.size(), 1u);
        // Served first: critical while its deadline is earlier, batch once it is not.
        EXPECT_EQ(p.entries[0].job, critical_deadline < batch_deadline ? 1u : 0u) << critical_arrival;
    }
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
