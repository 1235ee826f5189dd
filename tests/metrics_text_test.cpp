// The front's /metrics page (src/roles/metrics_text.h) from a hand-built snapshot:
// every family's "# TYPE" line and samples, in the order the front serves them,
// against text written out here in Prometheus' exposition format.
#include <gtest/gtest.h>

#include <string>

#include "roles/metrics_text.h"

using namespace duet;

namespace {

MetricsSnapshot two_arenas_three_workers() {
    MetricsSnapshot s;
    s.requests = 7, s.errors = 2, s.finished = 4, s.cancelled = 1, s.failed = 1, s.rejected_busy = 3;
    s.tokens = 120, s.prompt_tokens = 55, s.worker_restarts = 1, s.redriven = 2, s.in_flight = 5;
    s.arenas = {{10, 3, 2}, {20, 1, 4}};
    s.kv_dtype = "int8";
    s.block_tokens = 16;
    MetricsSnapshot::Worker p0;
    p0.queued = 2, p0.up = true, p0.items = 1, p0.tokens = 40, p0.served = 9, p0.routed = 11;
    MetricsSnapshot::Worker p1;  // being restarted: its gauges are not reported
    p1.queued = 0, p1.up = false, p1.items = 99, p1.tokens = 99, p1.served = 99, p1.routed = 4;
    MetricsSnapshot::Worker d0;
    d0.queued = 1, d0.up = true, d0.items = 3, d0.tokens = 70, d0.served = 8;
    s.prefill = {p0, p1};
    s.decode = {d0};
    return s;
}

const char* const kTwoArenasThreeWorkers =
    "# TYPE duet_requests_total counter\n"
    "duet_requests_total 7\n"
    "# TYPE duet_request_errors_total counter\n"
    "duet_request_errors_total 2\n"
    "# TYPE duet_requests_finished_total counter\n"
    "duet_requests_finished_total 4\n"
    "# TYPE duet_requests_cancelled_total counter\n"
    "duet_requests_cancelled_total 1\n"
    "# TYPE duet_requests_failed_total counter\n"
    "duet_requests_failed_total 1\n"
    "# TYPE duet_requests_rejected_busy_total counter\n"
    "duet_requests_rejected_busy_total 3\n"
    "# TYPE duet_generated_tokens_total counter\n"
    "duet_generated_tokens_total 120\n"
    "# TYPE duet_worker_restarts_total counter\n"
    "duet_worker_restarts_total 1\n"
    "# TYPE duet_requests_redriven_total counter\n"
    "duet_requests_redriven_total 2\n"
    "# TYPE duet_requests_in_flight gauge\n"
    "duet_requests_in_flight 5\n"
    "# TYPE duet_kv_blocks gauge\n"
    "duet_kv_blocks{state=\"free\"} 30\n"
    "duet_kv_blocks{state=\"cached\"} 4\n"
    "duet_kv_blocks{state=\"held\"} 6\n"
    "# TYPE duet_prompt_tokens_total counter\n"
    "duet_prompt_tokens_total 55\n"
    "# TYPE duet_kv_arena_blocks gauge\n"
    "duet_kv_arena_blocks{arena=\"0\",state=\"free\"} 10\n"
    "duet_kv_arena_blocks{arena=\"0\",state=\"cached\"} 3\n"
    "duet_kv_arena_blocks{arena=\"0\",state=\"held\"} 2\n"
    "duet_kv_arena_blocks{arena=\"1\",state=\"free\"} 20\n"
    "duet_kv_arena_blocks{arena=\"1\",state=\"cached\"} 1\n"
    "duet_kv_arena_blocks{arena=\"1\",state=\"held\"} 4\n"
    "# TYPE duet_kv_info gauge\n"
    "duet_kv_info{dtype=\"int8\",block_tokens=\"16\"} 1\n"
    "# TYPE duet_queue_depth gauge\n"
    "duet_queue_depth{role=\"prefill\",worker=\"0\"} 2\n"
    "duet_queue_depth{role=\"prefill\",worker=\"1\"} 0\n"
    "duet_queue_depth{role=\"decode\",worker=\"0\"} 1\n"
    "# TYPE duet_worker_up gauge\n"
    "duet_worker_up{role=\"prefill\",worker=\"0\"} 1\n"
    "duet_worker_up{role=\"prefill\",worker=\"1\"} 0\n"
    "duet_worker_up{role=\"decode\",worker=\"0\"} 1\n"
    "# TYPE duet_worker_requests gauge\n"
    "duet_worker_requests{role=\"prefill\",worker=\"0\"} 1\n"
    "duet_worker_requests{role=\"decode\",worker=\"0\"} 3\n"
    "# TYPE duet_worker_tokens gauge\n"
    "duet_worker_tokens{role=\"prefill\",worker=\"0\"} 40\n"
    "duet_worker_tokens{role=\"decode\",worker=\"0\"} 70\n"
    "# TYPE duet_worker_served_total counter\n"
    "duet_worker_served_total{role=\"prefill\",worker=\"0\"} 9\n"
    "duet_worker_served_total{role=\"decode\",worker=\"0\"} 8\n"
    "# TYPE duet_worker_routed_total counter\n"
    "duet_worker_routed_total{role=\"prefill\",worker=\"0\"} 11\n"
    "duet_worker_routed_total{role=\"prefill\",worker=\"1\"} 4\n";

}  // namespace

TEST(MetricsText, CountersArenasAndWorkersInExpositionFormat) {
    EXPECT_EQ(metrics_text(two_arenas_three_workers()), kTwoArenasThreeWorkers);
}

TEST(MetricsText, NoWorkersAndNoArenasLeaveOnlyTheTypeLines) {
    MetricsSnapshot s;
    s.kv_dtype = "unknown";
    const std::string text = metrics_text(s);
    EXPECT_NE(text.find("duet_kv_blocks{state=\"free\"} 0\n"), std::string::npos) << text;
    EXPECT_NE(text.find("# TYPE duet_kv_arena_blocks gauge\n# TYPE duet_kv_info gauge\n"
                        "duet_kv_info{dtype=\"unknown\",block_tokens=\"0\"} 1\n"
                        "# TYPE duet_queue_depth gauge\n# TYPE duet_worker_up gauge\n"
                        "# TYPE duet_worker_requests gauge\n# TYPE duet_worker_tokens gauge\n"
                        "# TYPE duet_worker_served_total counter\n# TYPE duet_worker_routed_total counter\n"),
              std::string::npos)
        << text;
    EXPECT_EQ(text.find("histogram"), std::string::npos) << text;  // none set
}

TEST(MetricsText, HistogramsFollowInOrderWithTheirHelp) {
    Histogram ttft, itl, e2e, queue, prefill, handoff, admit, stream_event;
    ttft.observe(0.25);
    MetricsSnapshot s = two_arenas_three_workers();
    s.ttft = &ttft, s.itl = &itl, s.e2e = &e2e, s.queue = &queue, s.prefill_time = &prefill, s.handoff = &handoff;
    s.admit = &admit, s.stream_event = &stream_event;
    const std::string text = metrics_text(s);
    ASSERT_EQ(text.compare(0, std::string(kTwoArenasThreeWorkers).size(), kTwoArenasThreeWorkers), 0) << text;
    const char* const families[][2] = {
        {"duet_time_to_first_token_seconds", "request arrival to its first token, seen by the front"},
        {"duet_inter_token_latency_seconds", "between successive tokens of a request, seen by the front"},
        {"duet_request_duration_seconds", "request arrival to its last token"},
        {"duet_queue_time_seconds", "queued until a prefill worker took it"},
        {"duet_prefill_time_seconds", "prefill worker took it until its hand-off to decode"},
        {"duet_handoff_latency_seconds", "hand-off sent by prefill until decode's first step with it began"},
        {"duet_front_admit_seconds", "the front's parse + template + tokenize + enqueue per request"},
        {"duet_front_stream_event_seconds", "the front's read + detokenize + write per streamed event"},
    };
    size_t at = std::string(kTwoArenasThreeWorkers).size();
    for (const auto& [name, help] : families) {
        const std::string head = std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " histogram\n";
        EXPECT_EQ(text.compare(at, head.size(), head), 0) << name << " at " << at << ":\n" << text.substr(at, 200);
        at = text.find("# HELP", at + 1);
        if (at == std::string::npos) at = text.size();
    }
    EXPECT_EQ(at, text.size());  // nothing after the eight families
    EXPECT_NE(text.find("duet_time_to_first_token_seconds_bucket{le=\"0.2\"} 0\n"
                        "duet_time_to_first_token_seconds_bucket{le=\"0.5\"} 1\n"),
              std::string::npos)
        << text;
    EXPECT_NE(text.find("duet_time_to_first_token_seconds_bucket{le=\"+Inf\"} 1\n"
                        "duet_time_to_first_token_seconds_sum 0.25\n"
                        "duet_time_to_first_token_seconds_count 1\n"),
              std::string::npos)
        << text;
    EXPECT_NE(text.find("duet_inter_token_latency_seconds_bucket{le=\"+Inf\"} 0\n"
                        "duet_inter_token_latency_seconds_sum 0\n"
                        "duet_inter_token_latency_seconds_count 0\n"),
              std::string::npos)
        << text;
}

TEST(MetricsText, ContextsAreReportedOnlyWhenOn) {
    MetricsSnapshot s = two_arenas_three_workers();
    EXPECT_EQ(metrics_text(s).find("duet_context"), std::string::npos) << "contexts off: no family";
    ContextStats c;
    c.contexts = 5;
    c.resident = 2;
    c.restored_tokens = 4095;
    c.reused_tokens = 17;
    c.prefilled_tokens = 300;
    c.evictions = 3;
    c.restore.observe(0.03);
    s.contexts = &c;
    const std::string text = metrics_text(s);
    ASSERT_EQ(text.compare(0, std::string(kTwoArenasThreeWorkers).size(), kTwoArenasThreeWorkers), 0) << text;
    EXPECT_NE(text.find("# TYPE duet_contexts gauge\n"
                        "duet_contexts{state=\"resident\"} 2\n"
                        "duet_contexts{state=\"on_disk\"} 3\n"
                        "# TYPE duet_context_tokens_total counter\n"
                        "duet_context_tokens_total{source=\"restored\"} 4095\n"
                        "duet_context_tokens_total{source=\"reused\"} 17\n"
                        "duet_context_tokens_total{source=\"prefilled\"} 300\n"
                        "# TYPE duet_context_evictions_total counter\n"
                        "duet_context_evictions_total 3\n"
                        "# HELP duet_context_restore_seconds a context's KV read back from disk\n"
                        "# TYPE duet_context_restore_seconds histogram\n"),
              std::string::npos)
        << text;
    EXPECT_NE(text.find("duet_context_restore_seconds_count 1\n"), std::string::npos) << text;
    EXPECT_NE(text.find("# TYPE duet_context_persist_seconds histogram\n"), std::string::npos) << text;
}
