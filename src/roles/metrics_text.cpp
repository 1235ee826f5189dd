#include "roles/metrics_text.h"

#include <algorithm>
#include <string_view>
#include <tuple>
#include <utility>

#include <fmt/format.h>

namespace duet {

namespace {

// A family's "# HELP" and "# TYPE" lines, which every family carries (promtool and
// Prometheus' own clients expect both; the help text has no backslash or newline).
std::string family(const char* name, const char* type, const char* help) {
    return fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
}

std::string metrics_counters(const MetricsSnapshot& s) {
    MetricsSnapshot::Arena all;
    for (const MetricsSnapshot::Arena& a : s.arenas) {
        all.free += a.free;
        all.cached += a.cached;
        all.held += a.held;
    }
    struct One {
        const char *name, *type, *help;
        uint64_t value;
    };
    const One ones[] = {
        {"duet_requests_total", "counter", "Requests the front admitted.", s.requests},
        {"duet_request_errors_total", "counter", "Responses with an error status (4xx, 5xx).", s.errors},
        {"duet_requests_finished_total", "counter", "Requests that ran to their end.", s.finished},
        {"duet_requests_cancelled_total", "counter", "Requests cancelled (client gone or asked).", s.cancelled},
        {"duet_requests_failed_total", "counter", "Admitted requests that ended in an error.", s.failed},
        {"duet_requests_rejected_busy_total", "counter", "Requests refused with 429: every request slot was taken.",
         s.rejected_busy},
        {"duet_generated_tokens_total", "counter", "Tokens generated and sent to clients.", s.tokens},
        {"duet_worker_restarts_total", "counter", "Worker processes restarted after dying.", s.worker_restarts},
        {"duet_requests_redriven_total", "counter", "Requests re-driven after their worker died.", s.redriven},
        {"duet_requests_in_flight", "gauge", "Requests admitted and not yet finished.", s.in_flight},
    };
    std::string m;
    for (const One& o : ones) m += family(o.name, o.type, o.help) + fmt::format("{} {}\n", o.name, o.value);
    m += family("duet_kv_blocks", "gauge", "KV blocks of every arena by state: free, cached (unreferenced, reusable), held.");
    m += fmt::format("duet_kv_blocks{{state=\"free\"}} {}\nduet_kv_blocks{{state=\"cached\"}} {}\n"
                     "duet_kv_blocks{{state=\"held\"}} {}\n",
                     all.free, all.cached, all.held);
    m += family("duet_prompt_tokens_total", "counter", "Prompt tokens of admitted requests.") +
         fmt::format("duet_prompt_tokens_total {}\n", s.prompt_tokens);
    m += family("duet_worker_role_changes_total", "counter",
                "Workers that changed role to the one named, their cores following a lopsided load (--rebalance).") +
         fmt::format("duet_worker_role_changes_total{{to=\"prefill\"}} {}\nduet_worker_role_changes_total{{to=\"decode\"}} {}\n",
                     s.role_changes_to_prefill, s.role_changes_to_decode);
    m += family("duet_prefill_passes_interrupted_total", "counter",
                "Prefill passes stopped between layers for a critical request that arrived meanwhile "
                "(--no-pass-interrupt: none); each is computed again.") +
         fmt::format("duet_prefill_passes_interrupted_total {}\n", s.passes_interrupted);
    m += family("duet_draft_tokens_total", "counter",
                "Drafted tokens decode checked in verify rows (--draft-tokens), by drafter (sequence: the sequence's "
                "own tokens; pool: the outputs the worker finished, --draft-pool-tokens) and outcome: accepted (the "
                "draw at their position picked them) or rejected.");
    for (int i = 0; i < kDraftSources; ++i) {
        const char* d = draft_source_name(static_cast<DraftSource>(i));
        m += fmt::format(
            "duet_draft_tokens_total{{drafter=\"{0}\",outcome=\"accepted\"}} {1}\n"
            "duet_draft_tokens_total{{drafter=\"{0}\",outcome=\"rejected\"}} {2}\n",
            d, s.drafts_accepted[i], s.drafted[i] - std::min(s.drafted[i], s.drafts_accepted[i]));
    }
    m += family("duet_verify_rows_total", "counter",
                "Verify rows decode ran (the newest token and its drafts, in a step's pass), by drafter.");
    for (int i = 0; i < kDraftSources; ++i)
        m += fmt::format("duet_verify_rows_total{{drafter=\"{}\"}} {}\n",
                         draft_source_name(static_cast<DraftSource>(i)), s.verify_rows[i]);
    return m;
}

// Each arena's blocks too: with per-role arenas prefill's holds cached prompts and
// decode's the running sequences, which a sum hides.
std::string metrics_arenas(const MetricsSnapshot& s) {
    std::string m = family("duet_kv_arena_blocks", "gauge", "KV blocks of each arena by state.");
    for (size_t k = 0; k < s.arenas.size(); ++k) {
        const MetricsSnapshot::Arena& a = s.arenas[k];
        for (const auto& [state, n] : {std::pair{"free", a.free}, {"cached", a.cached}, {"held", a.held}})
            m += fmt::format("duet_kv_arena_blocks{{arena=\"{}\",state=\"{}\"}} {}\n", k, state, n);
    }
    m += family("duet_kv_info", "gauge", "The KV cache's element type and tokens per block (always 1).") +
         fmt::format("duet_kv_info{{dtype=\"{}\",block_tokens=\"{}\"}} 1\n", s.kv_dtype, s.block_tokens);
    return m;
}

// Per worker: queue depth, whether it is up, its load gauges and requests taken
// since it started (while up), and (prefill) the requests this front routed to it.
// Each metric's lines together, prefill workers first.
std::string metrics_workers(const MetricsSnapshot& s) {
    std::string queue = family("duet_queue_depth", "gauge", "Messages waiting in a worker's rings."),
                items = family("duet_worker_requests", "gauge", "Requests a worker holds now."),
                tokens = family("duet_worker_tokens", "gauge", "Tokens of the requests a worker holds now."),
                served = family("duet_worker_served_total", "counter", "Requests a worker took since it started."),
                up = family("duet_worker_up", "gauge", "1 while a process runs for the worker, else 0."),
                borrows = family("duet_worker_borrowed_cores_total", "counter",
                                 "Times a worker took the other role's cores: while it was idle, or (prefill) by a "
                                 "claim, for a pass led by a critical request or one for prompts that would miss "
                                 "their TTFT target on prefill's cores alone (--lend-cores)."),
                borrowed = family("duet_worker_borrowed_seconds_total", "counter",
                                  "Time a worker computed with the other role's cores (--lend-cores)."),
                yields = family("duet_worker_yielded_cores_total", "counter",
                                "Times a decode worker stepped aside so that a prefill pass computed on its "
                                "cores too: one led by a critical request, or one for prompts at risk of their "
                                "TTFT target (--lend-cores)."),
                yielded = family("duet_worker_yielded_seconds_total", "counter",
                                 "Time a decode worker stepped aside for prefill passes (claims)."),
                missed = family("duet_worker_claims_missed_total", "counter",
                                "Times a prefill worker's claim on decode's cores got none, and why: declined (decode "
                                "had less time in hand than the pass needed) or unanswered (decode did not end its "
                                "step in time); the pass computed on prefill's cores alone (--lend-cores)."),
                routed = family("duet_worker_routed_total", "counter", "Requests this front sent to a prefill worker."),
                fixed = family("duet_worker_pass_fixed_positions", "gauge",
                               "A decode worker's passes' fixed cost (weights read, barriers) in positions, from a "
                               "line fitted over its recent passes (drafts are weighed by each pass size's "
                               "measured cost, not by this line)."),
                pool_tokens = family("duet_draft_pool_tokens", "gauge",
                                     "Tokens a decode worker's draft pool holds now: the outputs it finished, the "
                                     "last --draft-pool-tokens of them."),
                pool_bytes = family("duet_draft_pool_bytes", "gauge",
                                    "Memory of a decode worker's draft pool (its ring and index), fixed when the "
                                    "worker starts."),
                compiles = family("duet_worker_grammar_compiles_total", "counter",
                                  "Grammars (response_format, tools) a worker compiled, by where: step (in its "
                                  "serving thread: every request it held waited) or ahead (decode: in the background, "
                                  "for a request still in prefill)."),
                compile_s = family("duet_worker_grammar_compile_seconds_total", "counter",
                                   "Time a worker spent compiling grammars, by where (step: its serving thread's "
                                   "time, waits for a compile ahead included; ahead: the background thread's).");
    auto add = [&](const char* role, size_t i, const MetricsSnapshot::Worker& w) {
        if (w.spare) return;
        const std::string labels = fmt::format("{{role=\"{}\",worker=\"{}\"}}", role, i);
        queue += fmt::format("duet_queue_depth{} {}\n", labels, w.queued);
        up += fmt::format("duet_worker_up{} {}\n", labels, w.up ? 1 : 0);
        if (!w.up) return;
        items += fmt::format("duet_worker_requests{} {}\n", labels, w.items);
        tokens += fmt::format("duet_worker_tokens{} {}\n", labels, w.tokens);
        served += fmt::format("duet_worker_served_total{} {}\n", labels, w.served);
        borrows += fmt::format("duet_worker_borrowed_cores_total{} {}\n", labels, w.borrows);
        borrowed += fmt::format("duet_worker_borrowed_seconds_total{} {}\n", labels,
                                static_cast<double>(w.borrowed_ns) / 1e9);
        for (const auto& [where, n, ns] : {std::tuple{"step", w.grammar_compiles, w.grammar_compile_ns},
                                           std::tuple{"ahead", w.grammar_ahead, w.grammar_ahead_ns}}) {
            compiles += fmt::format("duet_worker_grammar_compiles_total{{role=\"{}\",worker=\"{}\",where=\"{}\"}} {}\n",
                                    role, i, where, n);
            compile_s +=
                fmt::format("duet_worker_grammar_compile_seconds_total{{role=\"{}\",worker=\"{}\",where=\"{}\"}} {}\n",
                            role, i, where, static_cast<double>(ns) / 1e9);
        }
        if (std::string_view(role) != "decode") {
            for (const auto& [why, n] : {std::pair{"declined", w.claims_declined}, {"unanswered", w.claims_unanswered}})
                missed += fmt::format("duet_worker_claims_missed_total{{role=\"{}\",worker=\"{}\",why=\"{}\"}} {}\n",
                                      role, i, why, n);
            return;
        }
        yields += fmt::format("duet_worker_yielded_cores_total{} {}\n", labels, w.yields);
        yielded += fmt::format("duet_worker_yielded_seconds_total{} {}\n", labels, static_cast<double>(w.yielded_ns) / 1e9);
        if (w.pass_fixed_milli > 0)
            fixed += fmt::format("duet_worker_pass_fixed_positions{} {}\n", labels,
                                 static_cast<double>(w.pass_fixed_milli) / 1000.0);
        if (w.draft_pool_bytes > 0) {
            pool_tokens += fmt::format("duet_draft_pool_tokens{} {}\n", labels, w.draft_pool_tokens);
            pool_bytes += fmt::format("duet_draft_pool_bytes{} {}\n", labels, w.draft_pool_bytes);
        }
    };
    for (size_t p = 0; p < s.prefill.size(); ++p) {
        add("prefill", p, s.prefill[p]);
        if (!s.prefill[p].spare)
            routed += fmt::format("duet_worker_routed_total{{role=\"prefill\",worker=\"{}\"}} {}\n", p, s.prefill[p].routed);
    }
    for (size_t d = 0; d < s.decode.size(); ++d) add("decode", d, s.decode[d]);
    return queue + up + items + tokens + served + borrows + borrowed + compiles + compile_s + yields + yielded +
           missed + routed + fixed + pool_tokens + pool_bytes +
           family("duet_golden_check_failures_total", "counter",
                  "Workers whose golden-logits check failed (not restarted; /ready says why).") +
           fmt::format("duet_golden_check_failures_total {}\n", s.golden_failures);
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
    return family("duet_contexts", "gauge", "Contexts whose KV is resident in the arena, or only on disk.") +
           fmt::format("duet_contexts{{state=\"resident\"}} {}\nduet_contexts{{state=\"on_disk\"}} {}\n", resident,
                       all - std::min(all, resident)) +
           family("duet_context_tokens_total", "counter",
                  "Context tokens whose KV was restored from disk, reused from memory, or prefilled.") +
           fmt::format("duet_context_tokens_total{{source=\"restored\"}} {}\n"
                       "duet_context_tokens_total{{source=\"reused\"}} {}\n"
                       "duet_context_tokens_total{{source=\"prefilled\"}} {}\n",
                       c.restored_tokens.load(std::memory_order_relaxed), c.reused_tokens.load(std::memory_order_relaxed),
                       c.prefilled_tokens.load(std::memory_order_relaxed)) +
           family("duet_context_evictions_total", "counter", "Idle contexts whose KV left the arena for room.") +
           fmt::format("duet_context_evictions_total {}\n", c.evictions.load(std::memory_order_relaxed)) +
           c.restore.prometheus("duet_context_restore_seconds", "a context's KV read back from disk") +
           c.persist.prometheus("duet_context_persist_seconds", "a durable context operation's log records written and synced");
}

// Per class, labelled class="critical" | "standard" | "batch".
std::string metrics_classes(const MetricsSnapshot& s) {
    std::string m = family("duet_requests_rejected_total", "counter",
                           "Requests refused with 429 by admission: ttft (its class's target could not be met), "
                           "queue (the prefill queue's watermark), kv (the KV arena's watermark), busy (no request "
                           "slot).") +
                    fmt::format("duet_requests_rejected_total{{reason=\"ttft\"}} {}\n"
                                "duet_requests_rejected_total{{reason=\"queue\"}} {}\n"
                                "duet_requests_rejected_total{{reason=\"kv\"}} {}\n"
                                "duet_requests_rejected_total{{reason=\"busy\"}} {}\n",
                                s.rejected_ttft, s.rejected_queue, s.rejected_kv, s.rejected_busy) +
                    family("duet_requests_timed_out_total", "counter",
                           "Requests ended by their timeout (finish_reason \"timeout\").") +
                    fmt::format("duet_requests_timed_out_total {}\n", s.timeouts) +
                    family("duet_requests_preempted_total", "counter",
                           "Running requests that gave way to others, by how their KV was given back (recompute: "
                           "dropped and computed again by prefill; swap: written out by decode and read back by "
                           "prefill).") +
                    fmt::format("duet_requests_preempted_total{{mode=\"recompute\"}} {}\n", s.preempted) +
                    fmt::format("duet_requests_preempted_total{{mode=\"swap\"}} {}\n", s.preempted_swap) +
                    family("duet_swapped_bytes_total", "counter", "KV bytes decode swapped out of preempted requests.") +
                    fmt::format("duet_swapped_bytes_total {}\n", s.swapped_bytes) +
                    family("duet_prefill_rate_tokens_per_second", "gauge",
                           "Prefill's measured throughput in passes on its own cores, all workers together (0: not "
                           "measured yet): the best window (decayed) and the last one; admission predicts with the "
                           "slower.") +
                    fmt::format("duet_prefill_rate_tokens_per_second{{window=\"best\"}} {}\n", s.prefill_rate) +
                    fmt::format("duet_prefill_rate_tokens_per_second{{window=\"recent\"}} {}\n", s.prefill_rate_recent) +
                    family("duet_prefill_wide_rate_tokens_per_second", "gauge",
                           "The same in passes computed with decode's cores too (lent, or claimed: critical "
                           "requests are admitted at this rate).") +
                    fmt::format("duet_prefill_wide_rate_tokens_per_second{{window=\"best\"}} {}\n", s.prefill_wide_rate) +
                    fmt::format("duet_prefill_wide_rate_tokens_per_second{{window=\"recent\"}} {}\n",
                                s.prefill_wide_rate_recent);
    std::string queued = family("duet_class_queued_prompt_tokens", "gauge",
                                "Prompt tokens admitted and not yet prefilled, by class."),
                done = family("duet_class_requests_total", "counter", "Completions that ended without error, by class."),
                met = family("duet_class_slo_met_total", "counter",
                             "Completions that met their class's TTFT and mean ITL targets (goodput), by class."),
                ttft = family("duet_class_time_to_first_token_seconds", "histogram",
                              "request arrival to its first token, by class"),
                itl = family("duet_class_inter_token_latency_seconds", "histogram",
                             "between successive tokens of a request, by class");
    for (size_t k = 0; k < kSloClasses; ++k) {
        const std::string l = fmt::format("class=\"{}\"", slo_class_name(static_cast<SloClass>(k)));
        queued += fmt::format("duet_class_queued_prompt_tokens{{{}}} {}\n", l, s.queued_tokens[k]);
        done += fmt::format("duet_class_requests_total{{{}}} {}\n", l, s.class_done[k]);
        met += fmt::format("duet_class_slo_met_total{{{}}} {}\n", l, s.class_met[k]);
        if (s.class_ttft[k]) ttft += s.class_ttft[k]->series("duet_class_time_to_first_token_seconds", l);
        if (s.class_itl[k]) itl += s.class_itl[k]->series("duet_class_inter_token_latency_seconds", l);
    }
    return m + queued + done + met + (s.class_ttft[0] ? ttft : std::string()) + (s.class_itl[0] ? itl : std::string());
}

}  // namespace

std::string metrics_text(const MetricsSnapshot& s) {
    return metrics_counters(s) + metrics_arenas(s) + metrics_workers(s) + metrics_histograms(s) +
           (s.scheduling ? metrics_classes(s) : std::string()) +
           (s.contexts ? metrics_contexts(*s.contexts) : std::string());
}

}  // namespace duet
