// The front's /metrics page in Prometheus' text exposition format (version 0.0.4),
// rendered from a snapshot of what it reports, so the format is tested without a
// server. The front takes the snapshot (src/roles/front.cpp).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "base/histogram.h"
#include "engine/contexts.h"
#include "engine/drafter.h"
#include "engine/scheduling.h"

namespace duet {

struct MetricsSnapshot {
    // Requests, as the front counted them; restarts and re-drives, as the instance did.
    uint64_t requests = 0, errors = 0, finished = 0, cancelled = 0, failed = 0, rejected_busy = 0;
    uint64_t tokens = 0, prompt_tokens = 0;
    uint64_t worker_restarts = 0, redriven = 0;
    uint64_t role_changes_to_prefill = 0, role_changes_to_decode = 0;  // `duet serve --rebalance`
    uint64_t passes_interrupted = 0;  // prefill passes stopped for a critical request
    // Decode's drafted tokens checked in verify rows, and kept, by where they came
    // from (engine/drafter.h DraftSource).
    std::array<uint64_t, kDraftSources> drafted{}, drafts_accepted{}, verify_rows{};
    uint64_t golden_failures = 0;  // workers whose golden-logits check failed
    uint64_t in_flight = 0;
    // Each KV arena's blocks, in arena order (one per GPU on a GPU instance, one per
    // role with per-role arenas); duet_kv_blocks sums them.
    struct Arena {
        uint64_t free = 0, cached = 0, held = 0;
    };
    std::vector<Arena> arenas;
    std::string kv_dtype;  // "f16", "int8", ...; "unknown"
    uint32_t block_tokens = 0;
    // One per worker index, in index order.
    struct Worker {
        uint64_t queued = 0;  // messages waiting in its rings
        bool up = false;      // a process runs for it; only then are the gauges below reported
        bool spare = false;   // an index no worker is assigned (--rebalance): no line at all
        uint64_t items = 0, tokens = 0, served = 0;
        uint64_t borrows = 0, borrowed_ns = 0;  // the other role's cores taken, and time computed with them
        uint64_t yields = 0, yielded_ns = 0;    // decode: times it stepped aside for a claim, and for how long
        uint64_t pass_fixed_milli = 0;          // decode: its passes' fixed cost in positions, x1000 (0: none yet)
        uint64_t draft_pool_tokens = 0, draft_pool_bytes = 0;  // decode: its draft pool (bytes 0: none)
        uint64_t claims_declined = 0, claims_unanswered = 0;  // prefill: claims that got no cores (claims.h)
        uint64_t routed = 0;  // prefill: requests this front sent it
        // Grammars compiled in its serving thread and ahead (WorkerStats), and their time.
        uint64_t grammar_compiles = 0, grammar_compile_ns = 0, grammar_ahead = 0, grammar_ahead_ns = 0;
    };
    std::vector<Worker> prefill, decode;
    // The latency histograms, not copied (their counts are atomics); a null one is
    // left out.
    const Histogram *ttft = nullptr, *itl = nullptr, *e2e = nullptr;
    const Histogram *queue = nullptr, *prefill_time = nullptr, *handoff = nullptr;
    const Histogram *admit = nullptr, *stream_event = nullptr;
    // The front's contexts (null: off, nothing reported).
    const ContextStats* contexts = nullptr;
    // Scheduling (engine/scheduling.h): refusals by reason, timeouts, and per class
    // (critical, standard, batch) the TTFT histogram, completions that ended and
    // those that met both targets; the front's queue and prefill's measured rate.
    bool scheduling = false;  // the families below are reported (a serving front: always)
    uint64_t rejected_ttft = 0, rejected_queue = 0, rejected_kv = 0, timeouts = 0, preempted = 0, preempted_swap = 0;
    uint64_t swapped_bytes = 0;  // KV bytes decode swapped out, every worker (the request table's counter)
    std::array<const Histogram*, kSloClasses> class_ttft{}, class_itl{};
    std::array<uint64_t, kSloClasses> class_done{}, class_met{};
    std::array<int64_t, kSloClasses> queued_tokens{};
    double prefill_rate = 0, prefill_rate_recent = 0;  // the best window's (decayed) and the last one's
    // The same over passes computed with the partner's cores too (admission_rate).
    double prefill_wide_rate = 0, prefill_wide_rate_recent = 0;
};

// The whole page: counters, KV blocks, per-arena and per-worker gauges, histograms,
// and with contexts on their gauges, counters and histograms.
std::string metrics_text(const MetricsSnapshot& s);

}  // namespace duet
