#include "roles/front_admission.h"

#include <algorithm>

#include <fmt/format.h>

#include "roles/context_api.h"
#include "roles/request_data.h"
#include "roles/wire.h"
#include "roles/worker_stats.h"

namespace duet {

AdmissionDecision FrontAdmission::admit(SloClass c, int64_t tokens, int64_t prompt_length, uint64_t retry_key,
                                        QueueAt& at) {
    std::lock_guard<std::mutex> lock(mu_);
    const uint64_t now = shm::monotonic_ns();
    const bool returning = retries_.returning(retry_key, now);
    const double n = prefill_workers_;
    const MeasuredRate r = admission_rate(c, {prefill_rate_.rate() * n, prefill_rate_.recent() * n},
                                          {prefill_wide_rate_.rate() * n, prefill_wide_rate_.recent() * n});
    AdmissionDecision d = admission_.decide(c, tokens, queue_, r.best, r.recent, &kv_, returning);
    if (d.admit && tokens > 0) {  // (none: a context's KV covers the prompt; it never leaves)
        queue_.pending[static_cast<size_t>(c)] += tokens;
        // Prefill's order key as the worker will compute it (from the whole prompt's
        // length, and the table's submit time, a moment later: the order among these
        // is the same).
        const uint64_t ttft = admission_.options().slo.of(c).ttft_ns;
        at = queue_.prompts.emplace(prefill_order_key(now, static_cast<uint32_t>(c), ttft,
                                                      static_cast<uint64_t>(prompt_length), kDeadlineNsPerToken),
                                    tokens);
    }
    retries_.judged(retry_key, now, returning, d);
    return d;
}

void FrontAdmission::left(SloClass c, int64_t tokens, QueueAt at) {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.pending[static_cast<size_t>(c)] -= tokens;
    queue_.prompts.erase(at);
}

void FrontAdmission::sample_prefill_work(shm::Registry& reg) {
    std::lock_guard<std::mutex> lock(mu_);
    work_seen_.resize(reg.n_slots(), {0, 0, 0, 0, 0});
    uint32_t running = 0;
    for (uint32_t s = 0; s < reg.n_slots(); ++s) {
        if (!reg.running_as(s, shm::Role::Prefill)) continue;
        const WorkerStats& ps = worker_stats(reg, s);
        ++running;
        // Two counters read one after the other: a pass's time may be seen before its
        // tokens; the next reading has them (a window holds many readings).
        const std::array<uint64_t, 4> now = {
            ps.busy_ns.load(std::memory_order_relaxed), ps.work_tokens.load(std::memory_order_relaxed),
            ps.wide_busy_ns.load(std::memory_order_relaxed), ps.wide_tokens.load(std::memory_order_relaxed)};
        std::array<uint64_t, 5>& seen = work_seen_[s];
        const uint64_t gen = reg.current(s).gen;
        if (seen[0] != gen) seen = {gen, 0, 0, 0, 0};  // a new process here: its counters started at 0
        for (size_t k = 0; k < 2; ++k) {
            const uint64_t busy = now[2 * k], tokens = now[2 * k + 1];
            if (busy >= seen[1 + 2 * k] && tokens >= seen[2 + 2 * k])
                (k == 0 ? prefill_rate_ : prefill_wide_rate_)
                    .add(busy - seen[1 + 2 * k], static_cast<int64_t>(tokens - seen[2 + 2 * k]));
            seen[1 + 2 * k] = busy;
            seen[2 + 2 * k] = tokens;
        }
    }
    prefill_workers_ = std::max<uint32_t>(1, running);
}

void FrontAdmission::sample_kv(shm::Instance& inst, const ContextService* contexts) {
    KvView v;
    const shm::InstanceConfig& cfg = inst.config();
    const int32_t ctx_user = contexts ? contexts->arena_user() : -1;
    // The decode workers' arenas: where admitted requests hold blocks until they end
    // (a prefill-only arena, kv_split, only while their prompts are computed).
    for (const uint32_t a : decode_arenas(cfg)) {
        const shm::ArenaCensus c = inst.arena(a).census();
        int64_t held = c.held;
        // Idle contexts give way to requests (ContextService::make_room): their blocks
        // are not the arena's load. (References, not blocks: a block a context shares
        // with a request counts for neither, an underestimate of a few blocks.)
        if (a == kContextArena && ctx_user >= 0)
            held -= std::min<int64_t>(held, static_cast<int64_t>(c.refs_by_user[static_cast<size_t>(ctx_user)]));
        v.used += held;
        v.total += c.total;
    }
    const shm::RequestTable& t = inst.requests();
    const double itl = itl_s_.load(std::memory_order_relaxed);
    const uint64_t per_token_ns = static_cast<uint64_t>((itl > 0 ? itl : 0.05) * 1e9);
    const int64_t bt = std::max<int64_t>(1, cfg.requests.block_tokens);
    for (uint32_t s = 0; s < t.n_slots(); ++s) {
        if (t.state(s) != shm::ReqState::Decoding) continue;
        const shm::ReqSlot& r = t.slot(s);
        const int64_t out = r.n_output.load(std::memory_order_relaxed);
        const int64_t tokens = r.n_prompt.load(std::memory_order_relaxed) + out;
        const int64_t left = std::max<int64_t>(0, static_cast<int64_t>(request_params(t, s).max_tokens) - out);
        v.running.push_back({(tokens + bt - 1) / bt, static_cast<uint64_t>(left) * per_token_ns});
    }
    std::lock_guard<std::mutex> lock(mu_);
    kv_ = std::move(v);
}

ApiError FrontAdmission::refusal_error(SloClass c, const AdmissionDecision& d) const {
    ApiError e;
    e.status = 429;
    e.type = "rate_limit_error";
    e.retry_after_ms = d.retry_after_ms;
    switch (d.refusal) {
        case Refusal::Queue:
            e.message = fmt::format("the server's prefill queue is full ({} class); retry in {} ms", slo_class_name(c),
                                    d.retry_after_ms);
            e.code = "queue_full";
            break;
        case Refusal::Kv:
            e.message = fmt::format(
                "the server's KV cache is full ({} class: critical requests only until running ones end); retry in {} "
                "ms",
                slo_class_name(c), d.retry_after_ms);
            e.code = "kv_full";
            break;
        case Refusal::Ttft:
        case Refusal::None:
            e.message = fmt::format(
                "a first token within the {} class's {} ms is not possible now (predicted {} ms); "
                "retry in {} ms",
                slo_class_name(c), options().slo.of(c).ttft_ns / 1000000, d.predicted_ttft_ns / 1000000,
                d.retry_after_ms);
            e.code = "slo_unreachable";
            break;
    }
    return e;
}

void FrontAdmission::observe_itl(double gap_s) {
    // An average over recent gaps (a racy update loses one gap at most).
    const double was = itl_s_.load(std::memory_order_relaxed);
    itl_s_.store(was > 0 ? 0.95 * was + 0.05 * gap_s : gap_s, std::memory_order_relaxed);
}

FrontAdmission::Snapshot FrontAdmission::snapshot() const {
    std::lock_guard<std::mutex> lock(mu_);
    Snapshot s;
    s.queued = queue_.pending;
    const double n = prefill_workers_;
    s.rate = prefill_rate_.rate() * n;
    s.rate_recent = prefill_rate_.recent() * n;
    s.wide_rate = prefill_wide_rate_.rate() * n;
    s.wide_rate_recent = prefill_wide_rate_.recent() * n;
    return s;
}

}  // namespace duet
