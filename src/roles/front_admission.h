// The front's admission (engine/scheduling.h AdmissionControl, rules A1-A3) and what
// it judges with: the prompt tokens this front admitted that prefill has not
// finished (per class, and by prefill's order key), prefill's measured rates (its
// workers' work counters, read every 50 ms by the front's notifier thread), the
// arenas' blocks held by requests, decode's time per token, and the prompts A1
// refused (RetryMemory). One lock; every method may be called from any thread.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <vector>

#include "engine/scheduling.h"
#include "roles/openai.h"
#include "shm/instance.h"

namespace duet {

class ContextService;

class FrontAdmission {
public:
    explicit FrontAdmission(AdmissionOptions o) : admission_(std::move(o)) {}

    // A request's place in the queue while its prompt is not prefilled.
    using QueueAt = std::multimap<uint64_t, int64_t>::iterator;
    // Decides for a request of class c with `tokens` to prefill (its choices' prompts,
    // less a context's KV) and a prompt of `prompt_length` tokens; an admitted
    // request's tokens (if any) join the queue, `at` its place (by prefill's order
    // key). `retry_key`: the prompt's RetryMemory key.
    AdmissionDecision admit(SloClass c, int64_t tokens, int64_t prompt_length, uint64_t retry_key, QueueAt& at);
    // They leave it: prefill is done with them (the first token came) or the request
    // ended without one.
    void left(SloClass c, int64_t tokens, QueueAt at);
    // A refused request's 429: what refused it (the rule, its class, the wait), the
    // error code clients key on (slo_unreachable, queue_full, kv_full) and when to
    // come back.
    ApiError refusal_error(SloClass c, const AdmissionDecision& d) const;

    // The notifier thread, every 50 ms: the running prefill workers' work counters
    // into the rates, and the decode arenas' blocks held by requests (not an idle
    // context's, which give way: `contexts`, null when off) with each running
    // request's blocks and time left at the measured time per token.
    void sample_prefill_work(shm::Registry& reg);
    void sample_kv(shm::Instance& inst, const ContextService* contexts);
    // A gap between two tokens a client saw, in seconds: decode's time per token
    // (a moving average), which A3's drain estimate uses.
    void observe_itl(double gap_s);

    // For /metrics: prompt tokens queued per class, and prefill's rates (tokens/s,
    // all running workers together; the best window's and the last one's), on
    // prefill's own cores and with the partner's too.
    struct Snapshot {
        std::array<int64_t, kSloClasses> queued{};
        double rate = 0, rate_recent = 0, wide_rate = 0, wide_rate_recent = 0;
    };
    Snapshot snapshot() const;
    const AdmissionOptions& options() const { return admission_.options(); }

private:
    mutable std::mutex mu_;
    AdmissionControl admission_;
    PrefillRateMeter prefill_rate_;       // passes on prefill's own cores
    PrefillRateMeter prefill_wide_rate_;  // passes with the partner's cores too (admission_rate)
    QueueView queue_;
    KvView kv_;                     // A3's view of the arenas (sample_kv)
    uint32_t prefill_workers_ = 1;  // running: the queue drains at their summed rate
    // Each registry slot's work counters as last read: (generation, busy ns, tokens,
    // wide busy ns, wide tokens).
    std::vector<std::array<uint64_t, 5>> work_seen_;
    RetryMemory retries_;           // prompts A1 refused (engine/scheduling.h)
    std::atomic<double> itl_s_{0};  // decode's time per token, an average over recent gaps (0: none seen)
};

}  // namespace duet
