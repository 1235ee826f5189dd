#include "roles/metrics_text.h"

#include <algorithm>
#include <utility>

#include <fmt/format.h>

namespace duet {

namespace {

std::string metrics_counters(const MetricsSnapshot& s) {
    MetricsSnapshot::Arena all;
    for (const MetricsSnapshot::Arena& a : s.arenas) {
        all.free += a.free;
        all.cached += a.cached;
        all.held += a.held;
    }
    return fmt::format(
               "# TYPE duet_requests_total counter\nduet_requests_total {}\n"
               "# TYPE duet_request_errors_total counter\nduet_request_errors_total {}\n"
               "# TYPE duet_requests_finished_total counter\nduet_requests_finished_total {}\n"
               "# TYPE duet_requests_cancelled_total counter\nduet_requests_cancelled_total {}\n"
               "# TYPE duet_requests_failed_total counter\nduet_requests_failed_total {}\n"
               "# TYPE duet_requests_rejected_busy_total counter\nduet_requests_rejected_busy_total {}\n"
               "# TYPE duet_generated_tokens_total counter\nduet_generated_tokens_total {}\n"
               "# TYPE duet_worker_restarts_total counter\nduet_worker_restarts_total {}\n"
               "# TYPE duet_requests_redriven_total counter\nduet_requests_redriven_total {}\n"
               "# TYPE duet_requests_in_flight gauge\nduet_requests_in_flight {}\n"
               "# TYPE duet_kv_blocks gauge\nduet_kv_blocks{{state=\"free\"}} {}\nduet_kv_blocks{{state=\"cached\"}} {}\n"
               "duet_kv_blocks{{state=\"held\"}} {}\n",
               s.requests, s.errors, s.finished, s.cancelled, s.failed, s.rejected_busy, s.tokens, s.worker_restarts,
               s.redriven, s.in_flight, all.free, all.cached, all.held) +
           fmt::format("# TYPE duet_prompt_tokens_total counter\nduet_prompt_tokens_total {}\n", s.prompt_tokens);
}

// Each arena's blocks too: with per-role arenas prefill's holds cached prompts and
// decode's the running sequences, which a sum hides.
std::string metrics_arenas(const MetricsSnapshot& s) {
    std::string m = "# TYPE duet_kv_arena_blocks gauge\n";
    for (size_t k = 0; k < s.arenas.size(); ++k) {
        const MetricsSnapshot::Arena& a = s.arenas[k];
        for (const auto& [state, n] : {std::pair{"free", a.free}, {"cached", a.cached}, {"held", a.held}})
            m += fmt::format("duet_kv_arena_blocks{{arena=\"{}\",state=\"{}\"}} {}\n", k, state, n);
    }
    m += fmt::format("# TYPE duet_kv_info gauge\nduet_kv_info{{dtype=\"{}\",block_tokens=\"{}\"}} 1\n", s.kv_dtype,
                     s.block_tokens);
    return m;
}

// Per worker: queue depth, whether it is up, its load gauges and requests taken
// since it started (while up), and (prefill) the requests this front routed to it.
// Each metric's lines together, prefill workers first.
std::string metrics_workers(const MetricsSnapshot& s) {
    std::string queue = "# TYPE duet_queue_depth gauge\n", items = "# TYPE duet_worker_requests gauge\n",
                tokens = "# TYPE duet_worker_tokens gauge\n", served = "# TYPE duet_worker_served_total counter\n",
                up = "# TYPE duet_worker_up gauge\n", routed = "# TYPE duet_worker_routed_total counter\n";
    auto add = [&](const char* role, size_t i, const MetricsSnapshot::Worker& w) {
        const std::string labels = fmt::format("{{role=\"{}\",worker=\"{}\"}}", role, i);
        queue += fmt::format("duet_queue_depth{} {}\n", labels, w.queued);
        up += fmt::format("duet_worker_up{} {}\n", labels, w.up ? 1 : 0);
        if (!w.up) return;
        items += fmt::format("duet_worker_requests{} {}\n", labels, w.items);
        tokens += fmt::format("duet_worker_tokens{} {}\n", labels, w.tokens);
        served += fmt::format("duet_worker_served_total{} {}\n", labels, w.served);
    };
    for (size_t p = 0; p < s.prefill.size(); ++p) {
        add("prefill", p, s.prefill[p]);
        routed += fmt::format("duet_worker_routed_total{{role=\"prefill\",worker=\"{}\"}} {}\n", p, s.prefill[p].routed);
    }
    for (size_t d = 0; d < s.decode.size(); ++d) add("decode", d, s.decode[d]);
    return queue + up + items + tokens + served + routed;
}

std::string metrics_histograms(const MetricsSnapshot& s) {
    struct Family {
        const Histogram* h;
        const char *name, *help;
    };
    const Family families[] = {
        {s.ttft, "duet_time_to_first_token_seconds", "request arrival to its first token, seen by the front"},
        {s.itl, "duet_inter_token_latency_seconds", "between successive tokens of a request, seen by the front"},
        {s.e2e, "duet_request_duration_seconds", "request arrival to its last token"},
        {s.queue, "duet_queue_time_seconds", "queued until a prefill worker took it"},
        {s.prefill_time, "duet_prefill_time_seconds", "prefill worker took it until its hand-off to decode"},
        {s.handoff, "duet_handoff_latency_seconds", "hand-off sent by prefill until decode's first step with it began"},
        {s.admit, "duet_front_admit_seconds", "the front's parse + template + tokenize + enqueue per request"},
        {s.stream_event, "duet_front_stream_event_seconds", "the front's read + detokenize + write per streamed event"},
    };
    std::string m;
    for (const Family& f : families)
        if (f.h) m += f.h->prometheus(f.name, f.help);
    return m;
}

// Relaxed loads: counters for display, no order among them.
std::string metrics_contexts(const ContextStats& c) {
    const uint64_t all = c.contexts.load(std::memory_order_relaxed), resident = c.resident.load(std::memory_order_relaxed);
    return fmt::format("# TYPE duet_contexts gauge\nduet_contexts{{state=\"resident\"}} {}\n"
                       "duet_contexts{{state=\"on_disk\"}} {}\n"
                       "# TYPE duet_context_tokens_total counter\n"
                       "duet_context_tokens_total{{source=\"restored\"}} {}\n"
                       "duet_context_tokens_total{{source=\"reused\"}} {}\n"
                       "duet_context_tokens_total{{source=\"prefilled\"}} {}\n"
                       "# TYPE duet_context_evictions_total counter\nduet_context_evictions_total {}\n",
                       resident, all - std::min(all, resident), c.restored_tokens.load(std::memory_order_relaxed),
                       c.reused_tokens.load(std::memory_order_relaxed), c.prefilled_tokens.load(std::memory_order_relaxed),
                       c.evictions.load(std::memory_order_relaxed)) +
           c.restore.prometheus("duet_context_restore_seconds", "a context's KV read back from disk") +
           c.persist.prometheus("duet_context_persist_seconds", "a durable context operation's log records written and synced");
}

}  // namespace

std::string metrics_text(const MetricsSnapshot& s) {
    return metrics_counters(s) + metrics_arenas(s) + metrics_workers(s) + metrics_histograms(s) +
           (s.contexts ? metrics_contexts(*s.contexts) : std::string());
}

}  // namespace duet
