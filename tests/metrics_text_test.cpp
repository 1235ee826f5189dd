// The front's /metrics page (src/roles/metrics_text.h) from a hand-built snapshot:
// every family's "# TYPE" line and samples, in the order the front serves them,
// against text written out here in Prometheus' exposition format.
#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

#include "roles/metrics_text.h"

using namespace duet;

namespace {

MetricsSnapshot two_arenas_three_workers() {
    MetricsSnapshot s;
    s.requests = 7, s.errors = 2, s.finished = 4, s.cancelled = 1, s.failed = 1, s.rejected_busy = 3;
    s.tokens = 120, s.prompt_tokens = 55, s.worker_restarts = 1, s.redriven = 2, s.in_flight = 5;
    s.role_changes_to_prefill = 1, s.role_changes_to_decode = 2;
    s.passes_interrupted = 3;
    s.drafted = {10, 6}, s.drafts_accepted = {7, 6}, s.verify_rows = {4, 1};
    s.golden_failures = 1;
    s.arenas = {{10, 3, 2}, {20, 1, 4}};
    s.kv_dtype = "int8";
    s.block_tokens = 16;
    MetricsSnapshot::Worker p0;
    p0.queued = 2, p0.up = true, p0.items = 1, p0.tokens = 40, p0.served = 9, p0.routed = 11;
    p0.claims_declined = 3, p0.claims_unanswered = 1;
    p0.grammar_compiles = 2, p0.grammar_compile_ns = 12'000'000;
    MetricsSnapshot::Worker p1;  // being restarted: its gauges are not reported
    p1.queued = 0, p1.up = false, p1.items = 99, p1.tokens = 99, p1.served = 99, p1.routed = 4;
    p1.claims_declined = 99;
    MetricsSnapshot::Worker d0;
    d0.queued = 1, d0.up = true, d0.items = 3, d0.tokens = 70, d0.served = 8, d0.borrows = 5, d0.borrowed_ns = 1'500'000'000;
    d0.yields = 2, d0.yielded_ns = 250'000'000, d0.pass_fixed_milli = 4250;
    d0.draft_pool_tokens = 1234, d0.draft_pool_bytes = 9'437'184;
    d0.grammar_compile_ns = 500'000, d0.grammar_ahead = 2, d0.grammar_ahead_ns = 25'000'000;
    s.prefill = {p0, p1};
    s.decode = {d0};
    return s;
}

const char* const kTwoArenasThreeWorkers =
    "# HELP duet_requests_total Requests the front admitted.\n"
    "# TYPE duet_requests_total counter\n"
    "duet_requests_total 7\n"
    "# HELP duet_request_errors_total Responses with an error status (4xx, 5xx).\n"
    "# TYPE duet_request_errors_total counter\n"
    "duet_request_errors_total 2\n"
    "# HELP duet_requests_finished_total Requests that ran to their end.\n"
    "# TYPE duet_requests_finished_total counter\n"
    "duet_requests_finished_total 4\n"
    "# HELP duet_requests_cancelled_total Requests cancelled (client gone or asked).\n"
    "# TYPE duet_requests_cancelled_total counter\n"
    "duet_requests_cancelled_total 1\n"
    "# HELP duet_requests_failed_total Admitted requests that ended in an error.\n"
    "# TYPE duet_requests_failed_total counter\n"
    "duet_requests_failed_total 1\n"
    "# HELP duet_requests_rejected_busy_total Requests refused with 429: every request slot was taken.\n"
    "# TYPE duet_requests_rejected_busy_total counter\n"
    "duet_requests_rejected_busy_total 3\n"
    "# HELP duet_generated_tokens_total Tokens generated and sent to clients.\n"
    "# TYPE duet_generated_tokens_total counter\n"
    "duet_generated_tokens_total 120\n"
    "# HELP duet_worker_restarts_total Worker processes restarted after dying.\n"
    "# TYPE duet_worker_restarts_total counter\n"
    "duet_worker_restarts_total 1\n"
    "# HELP duet_requests_redriven_total Requests re-driven after their worker died.\n"
    "# TYPE duet_requests_redriven_total counter\n"
    "duet_requests_redriven_total 2\n"
    "# HELP duet_requests_in_flight Requests admitted and not yet finished.\n"
    "# TYPE duet_requests_in_flight gauge\n"
    "duet_requests_in_flight 5\n"
    "# HELP duet_kv_blocks KV blocks of every arena by state: free, cached (unreferenced, reusable), held.\n"
    "# TYPE duet_kv_blocks gauge\n"
    "duet_kv_blocks{state=\"free\"} 30\n"
    "duet_kv_blocks{state=\"cached\"} 4\n"
    "duet_kv_blocks{state=\"held\"} 6\n"
    "# HELP duet_prompt_tokens_total Prompt tokens of admitted requests.\n"
    "# TYPE duet_prompt_tokens_total counter\n"
    "duet_prompt_tokens_total 55\n"
    "# HELP duet_worker_role_changes_total Workers that changed role to the one named, their cores following a "
    "lopsided load (--rebalance).\n"
    "# TYPE duet_worker_role_changes_total counter\n"
    "duet_worker_role_changes_total{to=\"prefill\"} 1\n"
    "duet_worker_role_changes_total{to=\"decode\"} 2\n"
    "# HELP duet_prefill_passes_interrupted_total Prefill passes stopped between layers for a critical request that "
    "arrived meanwhile (--no-pass-interrupt: none); each is computed again.\n"
    "# TYPE duet_prefill_passes_interrupted_total counter\n"
    "duet_prefill_passes_interrupted_total 3\n"
    "# HELP duet_draft_tokens_total Drafted tokens decode checked in verify rows (--draft-tokens), by drafter "
    "(sequence: the sequence's own tokens; pool: the outputs the worker finished, --draft-pool-tokens) and outcome: "
    "accepted (the draw at their position picked them) or rejected.\n"
    "# TYPE duet_draft_tokens_total counter\n"
    "duet_draft_tokens_total{drafter=\"sequence\",outcome=\"accepted\"} 7\n"
    "duet_draft_tokens_total{drafter=\"sequence\",outcome=\"rejected\"} 3\n"
    "duet_draft_tokens_total{drafter=\"pool\",outcome=\"accepted\"} 6\n"
    "duet_draft_tokens_total{drafter=\"pool\",outcome=\"rejected\"} 0\n"
    "# HELP duet_verify_rows_total Verify rows decode ran (the newest token and its drafts, in a step's pass), by "
    "drafter.\n"
    "# TYPE duet_verify_rows_total counter\n"
    "duet_verify_rows_total{drafter=\"sequence\"} 4\n"
    "duet_verify_rows_total{drafter=\"pool\"} 1\n"
    "# HELP duet_kv_arena_blocks KV blocks of each arena by state.\n"
    "# TYPE duet_kv_arena_blocks gauge\n"
    "duet_kv_arena_blocks{arena=\"0\",state=\"free\"} 10\n"
    "duet_kv_arena_blocks{arena=\"0\",state=\"cached\"} 3\n"
    "duet_kv_arena_blocks{arena=\"0\",state=\"held\"} 2\n"
    "duet_kv_arena_blocks{arena=\"1\",state=\"free\"} 20\n"
    "duet_kv_arena_blocks{arena=\"1\",state=\"cached\"} 1\n"
    "duet_kv_arena_blocks{arena=\"1\",state=\"held\"} 4\n"
    "# HELP duet_kv_info The KV cache's element type and tokens per block (always 1).\n"
    "# TYPE duet_kv_info gauge\n"
    "duet_kv_info{dtype=\"int8\",block_tokens=\"16\"} 1\n"
    "# HELP duet_queue_depth Messages waiting in a worker's rings.\n"
    "# TYPE duet_queue_depth gauge\n"
    "duet_queue_depth{role=\"prefill\",worker=\"0\"} 2\n"
    "duet_queue_depth{role=\"prefill\",worker=\"1\"} 0\n"
    "duet_queue_depth{role=\"decode\",worker=\"0\"} 1\n"
    "# HELP duet_worker_up 1 while a process runs for the worker, else 0.\n"
    "# TYPE duet_worker_up gauge\n"
    "duet_worker_up{role=\"prefill\",worker=\"0\"} 1\n"
    "duet_worker_up{role=\"prefill\",worker=\"1\"} 0\n"
    "duet_worker_up{role=\"decode\",worker=\"0\"} 1\n"
    "# HELP duet_worker_requests Requests a worker holds now.\n"
    "# TYPE duet_worker_requests gauge\n"
    "duet_worker_requests{role=\"prefill\",worker=\"0\"} 1\n"
    "duet_worker_requests{role=\"decode\",worker=\"0\"} 3\n"
    "# HELP duet_worker_tokens Tokens of the requests a worker holds now.\n"
    "# TYPE duet_worker_tokens gauge\n"
    "duet_worker_tokens{role=\"prefill\",worker=\"0\"} 40\n"
    "duet_worker_tokens{role=\"decode\",worker=\"0\"} 70\n"
    "# HELP duet_worker_served_total Requests a worker took since it started.\n"
    "# TYPE duet_worker_served_total counter\n"
    "duet_worker_served_total{role=\"prefill\",worker=\"0\"} 9\n"
    "duet_worker_served_total{role=\"decode\",worker=\"0\"} 8\n"
    "# HELP duet_worker_borrowed_cores_total Times a worker took the other role's cores: while it was idle, or "
    "(prefill) by a claim, for a pass led by a critical request or one for prompts that would miss their TTFT "
    "target on prefill's cores alone (--lend-cores).\n"
    "# TYPE duet_worker_borrowed_cores_total counter\n"
    "duet_worker_borrowed_cores_total{role=\"prefill\",worker=\"0\"} 0\n"
    "duet_worker_borrowed_cores_total{role=\"decode\",worker=\"0\"} 5\n"
    "# HELP duet_worker_borrowed_seconds_total Time a worker computed with the other role's cores (--lend-cores).\n"
    "# TYPE duet_worker_borrowed_seconds_total counter\n"
    "duet_worker_borrowed_seconds_total{role=\"prefill\",worker=\"0\"} 0\n"
    "duet_worker_borrowed_seconds_total{role=\"decode\",worker=\"0\"} 1.5\n"
    "# HELP duet_worker_grammar_compiles_total Grammars (response_format, tools) a worker compiled, by where: step "
    "(in its serving thread: every request it held waited) or ahead (decode: in the background, for a request "
    "still in prefill).\n"
    "# TYPE duet_worker_grammar_compiles_total counter\n"
    "duet_worker_grammar_compiles_total{role=\"prefill\",worker=\"0\",where=\"step\"} 2\n"
    "duet_worker_grammar_compiles_total{role=\"prefill\",worker=\"0\",where=\"ahead\"} 0\n"
    "duet_worker_grammar_compiles_total{role=\"decode\",worker=\"0\",where=\"step\"} 0\n"
    "duet_worker_grammar_compiles_total{role=\"decode\",worker=\"0\",where=\"ahead\"} 2\n"
    "# HELP duet_worker_grammar_compile_seconds_total Time a worker spent compiling grammars, by where (step: its "
    "serving thread's time, waits for a compile ahead included; ahead: the background thread's).\n"
    "# TYPE duet_worker_grammar_compile_seconds_total counter\n"
    "duet_worker_grammar_compile_seconds_total{role=\"prefill\",worker=\"0\",where=\"step\"} 0.012\n"
    "duet_worker_grammar_compile_seconds_total{role=\"prefill\",worker=\"0\",where=\"ahead\"} 0\n"
    "duet_worker_grammar_compile_seconds_total{role=\"decode\",worker=\"0\",where=\"step\"} 0.0005\n"
    "duet_worker_grammar_compile_seconds_total{role=\"decode\",worker=\"0\",where=\"ahead\"} 0.025\n"
    "# HELP duet_worker_yielded_cores_total Times a decode worker stepped aside so that a prefill pass computed "
    "on its cores too: one led by a critical request, or one for prompts at risk of their TTFT target "
    "(--lend-cores).\n"
    "# TYPE duet_worker_yielded_cores_total counter\n"
    "duet_worker_yielded_cores_total{role=\"decode\",worker=\"0\"} 2\n"
    "# HELP duet_worker_yielded_seconds_total Time a decode worker stepped aside for prefill passes (claims).\n"
    "# TYPE duet_worker_yielded_seconds_total counter\n"
    "duet_worker_yielded_seconds_total{role=\"decode\",worker=\"0\"} 0.25\n"
    "# HELP duet_worker_claims_missed_total Times a prefill worker's claim on decode's cores got none, and why: "
    "declined (decode had less time in hand than the pass needed) or unanswered (decode did not end its step in "
    "time); the pass computed on prefill's cores alone (--lend-cores).\n"
    "# TYPE duet_worker_claims_missed_total counter\n"
    "duet_worker_claims_missed_total{role=\"prefill\",worker=\"0\",why=\"declined\"} 3\n"
    "duet_worker_claims_missed_total{role=\"prefill\",worker=\"0\",why=\"unanswered\"} 1\n"
    "# HELP duet_worker_routed_total Requests this front sent to a prefill worker.\n"
    "# TYPE duet_worker_routed_total counter\n"
    "duet_worker_routed_total{role=\"prefill\",worker=\"0\"} 11\n"
    "duet_worker_routed_total{role=\"prefill\",worker=\"1\"} 4\n"
    "# HELP duet_worker_pass_fixed_positions A decode worker's passes' fixed cost (weights read, barriers) in "
    "positions, from a line fitted over its recent passes (drafts are weighed by each pass size's measured cost, "
    "not by this line).\n"
    "# TYPE duet_worker_pass_fixed_positions gauge\n"
    "duet_worker_pass_fixed_positions{role=\"decode\",worker=\"0\"} 4.25\n"
    "# HELP duet_draft_pool_tokens Tokens a decode worker's draft pool holds now: the outputs it finished, the last "
    "--draft-pool-tokens of them.\n"
    "# TYPE duet_draft_pool_tokens gauge\n"
    "duet_draft_pool_tokens{role=\"decode\",worker=\"0\"} 1234\n"
    "# HELP duet_draft_pool_bytes Memory of a decode worker's draft pool (its ring and index), fixed when the worker "
    "starts.\n"
    "# TYPE duet_draft_pool_bytes gauge\n"
    "duet_draft_pool_bytes{role=\"decode\",worker=\"0\"} 9437184\n"
    "# HELP duet_golden_check_failures_total Workers whose golden-logits check failed (not restarted; /ready says "
    "why).\n"
    "# TYPE duet_golden_check_failures_total counter\n"
    "duet_golden_check_failures_total 1\n";

}  // namespace

// Spare indices (--rebalance: no worker assigned there) leave no line at all.
TEST(MetricsText, SpareWorkerIndicesAreLeftOut) {
    MetricsSnapshot s = two_arenas_three_workers();
    MetricsSnapshot::Worker spare;
    spare.spare = true;
    s.prefill.push_back(spare);
    s.decode.push_back(spare);
    s.decode.push_back(spare);
    EXPECT_EQ(metrics_text(s), kTwoArenasThreeWorkers);
}

TEST(MetricsText, CountersArenasAndWorkersInExpositionFormat) {
    EXPECT_EQ(metrics_text(two_arenas_three_workers()), kTwoArenasThreeWorkers);
}

TEST(MetricsText, NoWorkersAndNoArenasLeaveOnlyTheHelpAndTypeLines) {
    MetricsSnapshot s;
    s.kv_dtype = "unknown";
    const std::string text = metrics_text(s);
    EXPECT_NE(text.find("duet_kv_blocks{state=\"free\"} 0\n"), std::string::npos) << text;
    EXPECT_NE(text.find("# HELP duet_kv_arena_blocks KV blocks of each arena by state.\n"
                        "# TYPE duet_kv_arena_blocks gauge\n"
                        "# HELP duet_kv_info The KV cache's element type and tokens per block (always 1).\n"
                        "# TYPE duet_kv_info gauge\n"
                        "duet_kv_info{dtype=\"unknown\",block_tokens=\"0\"} 1\n"
                        "# HELP duet_queue_depth Messages waiting in a worker's rings.\n"
                        "# TYPE duet_queue_depth gauge\n"
                        "# HELP duet_worker_up 1 while a process runs for the worker, else 0.\n"
                        "# TYPE duet_worker_up gauge\n"
                        "# HELP duet_worker_requests Requests a worker holds now.\n"
                        "# TYPE duet_worker_requests gauge\n"
                        "# HELP duet_worker_tokens Tokens of the requests a worker holds now.\n"
                        "# TYPE duet_worker_tokens gauge\n"
                        "# HELP duet_worker_served_total Requests a worker took since it started.\n"
                        "# TYPE duet_worker_served_total counter\n"
                        "# HELP duet_worker_borrowed_cores_total Times a worker took the other role's cores: "
                        "while it was idle, or (prefill) by a claim, for a pass led by a critical request or one "
                        "for prompts that would miss their TTFT target on prefill's cores alone (--lend-cores).\n"
                        "# TYPE duet_worker_borrowed_cores_total counter\n"
                        "# HELP duet_worker_borrowed_seconds_total Time a worker computed with the other role's "
                        "cores (--lend-cores).\n"
                        "# TYPE duet_worker_borrowed_seconds_total counter\n"
                        "# HELP duet_worker_grammar_compiles_total Grammars (response_format, tools) a worker "
                        "compiled, by where: step (in its serving thread: every request it held waited) or ahead "
                        "(decode: in the background, for a request still in prefill).\n"
                        "# TYPE duet_worker_grammar_compiles_total counter\n"
                        "# HELP duet_worker_grammar_compile_seconds_total Time a worker spent compiling grammars, "
                        "by where (step: its serving thread's time, waits for a compile ahead included; ahead: the "
                        "background thread's).\n"
                        "# TYPE duet_worker_grammar_compile_seconds_total counter\n"
                        "# HELP duet_worker_yielded_cores_total Times a decode worker stepped aside so that a "
                        "prefill pass computed on its cores too: one led by a critical request, or one for "
                        "prompts at risk of their TTFT target (--lend-cores).\n"
                        "# TYPE duet_worker_yielded_cores_total counter\n"
                        "# HELP duet_worker_yielded_seconds_total Time a decode worker stepped aside for prefill "
                        "passes (claims).\n"
                        "# TYPE duet_worker_yielded_seconds_total counter\n"
                        "# HELP duet_worker_claims_missed_total Times a prefill worker's claim on decode's cores "
                        "got none, and why: declined (decode had less time in hand than the pass needed) or "
                        "unanswered (decode did not end its step in time); the pass computed on prefill's cores "
                        "alone (--lend-cores).\n"
                        "# TYPE duet_worker_claims_missed_total counter\n"
                        "# HELP duet_worker_routed_total Requests this front sent to a prefill worker.\n"
                        "# TYPE duet_worker_routed_total counter\n"
                        "# HELP duet_worker_pass_fixed_positions A decode worker's passes' fixed cost (weights "
                        "read, barriers) in positions, from a line fitted over its recent passes (drafts are "
                        "weighed by each pass size's measured cost, not by this line).\n"
                        "# TYPE duet_worker_pass_fixed_positions gauge\n"
                        "# HELP duet_draft_pool_tokens Tokens a decode worker's draft pool holds now: the outputs "
                        "it finished, the last --draft-pool-tokens of them.\n"
                        "# TYPE duet_draft_pool_tokens gauge\n"
                        "# HELP duet_draft_pool_bytes Memory of a decode worker's draft pool (its ring and index), "
                        "fixed when the worker starts.\n"
                        "# TYPE duet_draft_pool_bytes gauge\n"
                        "# HELP duet_golden_check_failures_total Workers whose golden-logits check failed (not "
                        "restarted; /ready says why).\n"
                        "# TYPE duet_golden_check_failures_total counter\n"
                        "duet_golden_check_failures_total 0\n"),
              std::string::npos)
        << text;
    EXPECT_EQ(text.find("histogram"), std::string::npos) << text;  // none set
}

// Every family has its HELP line right before its TYPE line, and no name twice.
TEST(MetricsText, EveryFamilyHasHelpThenType) {
    Histogram h;
    ContextStats c;
    MetricsSnapshot s = two_arenas_three_workers();
    s.ttft = &h;
    s.contexts = &c;
    const std::string text = metrics_text(s);
    std::vector<std::string> lines;
    for (size_t at = 0; at < text.size();) {
        const size_t nl = text.find('\n', at);
        ASSERT_NE(nl, std::string::npos) << "the page ends with a newline";
        lines.push_back(text.substr(at, nl - at));
        at = nl + 1;
    }
    std::set<std::string> seen;
    for (size_t i = 0; i < lines.size(); ++i) {
        if (lines[i].rfind("# TYPE ", 0) != 0) continue;
        const std::string name = lines[i].substr(7, lines[i].find(' ', 7) - 7);
        ASSERT_GT(i, 0u);
        EXPECT_EQ(lines[i - 1].rfind("# HELP " + name + " ", 0), 0u) << lines[i];
        EXPECT_TRUE(seen.insert(name).second) << name << " twice";
    }
    EXPECT_EQ(seen.size(), 41u);  // 16 front families (role changes, interrupted passes, drafts, verify rows among
                                  // them), 2 of arenas, 16 of workers (2 of the draft pool), golden, 1 histogram,
                                  // 5 of contexts
}

// Bucket bounds as Prometheus' own clients print them (Go's shortest form): the 1-2-5
// series from 1 µs to 100 s, written out here, never a rounding artefact such as
// 4.9999999999999996e-06.
TEST(MetricsText, HistogramBucketBoundsAreCanonical) {
    Histogram h;
    h.observe(0.5);  // on a bound: counted in it (le is <=)
    h.observe(2.0);
    const std::string text = h.prometheus("x_seconds", "help");
    const char* const expected[] = {"1e-06", "2e-06", "5e-06", "1e-05", "2e-05", "5e-05", "0.0001", "0.0002", "0.0005",
                                    "0.001", "0.002", "0.005", "0.01",  "0.02",  "0.05",  "0.1",    "0.2",    "0.5",
                                    "1",     "2",     "5",     "10",    "20",    "50",    "100",    "+Inf"};
    size_t at = 0;
    int cum = 0;
    for (const char* le : expected) {
        if (std::string(le) == "0.5" || std::string(le) == "2") ++cum;
        const std::string line = std::string("x_seconds_bucket{le=\"") + le + "\"} " + std::to_string(cum) + "\n";
        const size_t found = text.find(line, at);
        ASSERT_NE(found, std::string::npos) << line << text;
        at = found + line.size();
    }
    EXPECT_EQ(text.substr(at), "x_seconds_sum 2.5\nx_seconds_count 2\n");
    EXPECT_EQ(text.find("999"), std::string::npos) << text;
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
    EXPECT_NE(text.find("# HELP duet_contexts Contexts whose KV is resident in the arena, or only on disk.\n"
    "# TYPE duet_contexts gauge\n"
                        "duet_contexts{state=\"resident\"} 2\n"
                        "duet_contexts{state=\"on_disk\"} 3\n"
                        "# HELP duet_context_tokens_total Context tokens whose KV was restored from disk, reused from memory, or prefilled.\n"
    "# TYPE duet_context_tokens_total counter\n"
                        "duet_context_tokens_total{source=\"restored\"} 4095\n"
                        "duet_context_tokens_total{source=\"reused\"} 17\n"
                        "duet_context_tokens_total{source=\"prefilled\"} 300\n"
                        "# HELP duet_context_evictions_total Idle contexts whose KV left the arena for room.\n"
    "# TYPE duet_context_evictions_total counter\n"
                        "duet_context_evictions_total 3\n"
                        "# HELP duet_context_restore_seconds a context's KV read back from disk\n"
                        "# TYPE duet_context_restore_seconds histogram\n"),
              std::string::npos)
        << text;
    EXPECT_NE(text.find("duet_context_restore_seconds_count 1\n"), std::string::npos) << text;
    EXPECT_NE(text.find("# TYPE duet_context_persist_seconds histogram\n"), std::string::npos) << text;
}

// The scheduling families (engine/scheduling.h), written out by hand: refusals by
// reason, timeouts, the measured prefill rate, and per class the queue, the ended
// and SLO-meeting completions and the TTFT histogram's series with its class label.
TEST(MetricsText, SchedulingFamiliesByClassAndReason) {
    MetricsSnapshot s;
    s.scheduling = true;
    s.rejected_ttft = 3, s.rejected_queue = 5, s.rejected_kv = 11, s.rejected_busy = 1, s.timeouts = 2, s.preempted = 4;
    s.preempted_swap = 6, s.swapped_bytes = 138240;
    s.prefill_rate = 1250.5, s.prefill_rate_recent = 900;
    s.prefill_wide_rate = 2100;
    s.queued_tokens = {100, 0, 4000};
    s.class_done = {7, 8, 9};
    s.class_met = {7, 6, 1};
    Histogram critical, standard, batch;
    critical.observe(0.3);
    s.class_ttft = {&critical, &standard, &batch};
    const std::string text = metrics_text(s);
    const std::string want =
        "# HELP duet_requests_rejected_total Requests refused with 429 by admission: ttft (its class's target could "
        "not be met), queue (the prefill queue's watermark), kv (the KV arena's watermark), busy (no request "
        "slot).\n"
        "# TYPE duet_requests_rejected_total counter\n"
        "duet_requests_rejected_total{reason=\"ttft\"} 3\n"
        "duet_requests_rejected_total{reason=\"queue\"} 5\n"
        "duet_requests_rejected_total{reason=\"kv\"} 11\n"
        "duet_requests_rejected_total{reason=\"busy\"} 1\n"
        "# HELP duet_requests_timed_out_total Requests ended by their timeout (finish_reason \"timeout\").\n"
        "# TYPE duet_requests_timed_out_total counter\n"
        "duet_requests_timed_out_total 2\n"
        "# HELP duet_requests_preempted_total Running requests that gave way to others, by how their KV was given "
        "back (recompute: dropped and computed again by prefill; swap: written out by decode and read back by "
        "prefill).\n"
        "# TYPE duet_requests_preempted_total counter\n"
        "duet_requests_preempted_total{mode=\"recompute\"} 4\n"
        "duet_requests_preempted_total{mode=\"swap\"} 6\n"
        "# HELP duet_swapped_bytes_total KV bytes decode swapped out of preempted requests.\n"
        "# TYPE duet_swapped_bytes_total counter\n"
        "duet_swapped_bytes_total 138240\n"
        "# HELP duet_prefill_rate_tokens_per_second Prefill's measured throughput in passes on its own cores, all "
        "workers together (0: not measured yet): the best window (decayed) and the last one; admission predicts with "
        "the slower.\n"
        "# TYPE duet_prefill_rate_tokens_per_second gauge\n"
        "duet_prefill_rate_tokens_per_second{window=\"best\"} 1250.5\n"
        "duet_prefill_rate_tokens_per_second{window=\"recent\"} 900\n"
        "# HELP duet_prefill_wide_rate_tokens_per_second The same in passes computed with decode's cores too (lent, "
        "or claimed: critical requests are admitted at this rate).\n"
        "# TYPE duet_prefill_wide_rate_tokens_per_second gauge\n"
        "duet_prefill_wide_rate_tokens_per_second{window=\"best\"} 2100\n"
        "duet_prefill_wide_rate_tokens_per_second{window=\"recent\"} 0\n"
        "# HELP duet_class_queued_prompt_tokens Prompt tokens admitted and not yet prefilled, by class.\n"
        "# TYPE duet_class_queued_prompt_tokens gauge\n"
        "duet_class_queued_prompt_tokens{class=\"critical\"} 100\n"
        "duet_class_queued_prompt_tokens{class=\"standard\"} 0\n"
        "duet_class_queued_prompt_tokens{class=\"batch\"} 4000\n"
        "# HELP duet_class_requests_total Completions that ended without error, by class.\n"
        "# TYPE duet_class_requests_total counter\n"
        "duet_class_requests_total{class=\"critical\"} 7\n"
        "duet_class_requests_total{class=\"standard\"} 8\n"
        "duet_class_requests_total{class=\"batch\"} 9\n"
        "# HELP duet_class_slo_met_total Completions that met their class's TTFT and mean ITL targets (goodput), by "
        "class.\n"
        "# TYPE duet_class_slo_met_total counter\n"
        "duet_class_slo_met_total{class=\"critical\"} 7\n"
        "duet_class_slo_met_total{class=\"standard\"} 6\n"
        "duet_class_slo_met_total{class=\"batch\"} 1\n"
        "# HELP duet_class_time_to_first_token_seconds request arrival to its first token, by class\n"
        "# TYPE duet_class_time_to_first_token_seconds histogram\n";
    const size_t at = text.find("# HELP duet_requests_rejected_total");
    ASSERT_NE(at, std::string::npos) << text;
    EXPECT_EQ(text.substr(at, want.size()), want);
    EXPECT_NE(text.find("duet_class_time_to_first_token_seconds_bucket{class=\"critical\",le=\"0.2\"} 0\n"
                        "duet_class_time_to_first_token_seconds_bucket{class=\"critical\",le=\"0.5\"} 1\n"),
              std::string::npos)
        << text;
    EXPECT_NE(text.find("duet_class_time_to_first_token_seconds_bucket{class=\"critical\",le=\"+Inf\"} 1\n"
                        "duet_class_time_to_first_token_seconds_sum{class=\"critical\"} 0.3\n"
                        "duet_class_time_to_first_token_seconds_count{class=\"critical\"} 1\n"
                        "duet_class_time_to_first_token_seconds_bucket{class=\"standard\",le=\"1e-06\"} 0\n"),
              std::string::npos)
        << text;
    EXPECT_NE(text.find("duet_class_time_to_first_token_seconds_count{class=\"batch\"} 0\n"), std::string::npos);
    // Without ITL histograms given, no ITL family; with them, after the TTFT one.
    EXPECT_EQ(text.find("duet_class_inter_token_latency_seconds"), std::string::npos);
    Histogram gaps[kSloClasses];
    gaps[2].observe(1.5);
    s.class_itl = {&gaps[0], &gaps[1], &gaps[2]};
    const std::string with_itl = metrics_text(s);
    const size_t itl_at = with_itl.find("# HELP duet_class_inter_token_latency_seconds between successive tokens of a "
                                        "request, by class\n# TYPE duet_class_inter_token_latency_seconds histogram\n");
    ASSERT_NE(itl_at, std::string::npos) << with_itl;
    EXPECT_GT(itl_at, with_itl.find("duet_class_time_to_first_token_seconds_count{class=\"batch\"}"));
    EXPECT_NE(with_itl.find("duet_class_inter_token_latency_seconds_bucket{class=\"batch\",le=\"1\"} 0\n"
                            "duet_class_inter_token_latency_seconds_bucket{class=\"batch\",le=\"2\"} 1\n"),
              std::string::npos)
        << with_itl;
    // Off (a snapshot that does not ask for them): none of it.
    s.scheduling = false;
    EXPECT_EQ(metrics_text(s).find("duet_class_"), std::string::npos);
}
