#include "roles/restart_policy.h"

#include <algorithm>

#include <fmt/format.h>

namespace duet {

RestartPlan plan_restart(const RoleDeaths& before, uint64_t now_ns, bool had_run, bool golden_failed) {
    RestartPlan p;
    p.deaths = before;
    std::erase_if(p.deaths.deaths_ns, [&](uint64_t t) { return now_ns - t > kDeathWindowNs; });
    p.deaths.deaths_ns.push_back(now_ns);
    p.deaths.failed_starts = had_run ? 0 : before.failed_starts + 1;
    if (golden_failed) {
        // It computes wrong answers on this box: starting it again cannot help.
        p.kind = RestartPlan::Kind::Never;
        p.why = "it failed its golden-logits check";
        return p;
    }
    if (p.deaths.failed_starts >= kMaxFailedStarts) {
        p.kind = RestartPlan::Kind::Never;
        p.why = fmt::format("it died {} times in a row before it could serve", p.deaths.failed_starts);
        return p;
    }
    const size_t n = p.deaths.deaths_ns.size();
    if (n <= kImmediateRestarts) {
        p.kind = RestartPlan::Kind::Now;
        return p;
    }
    const size_t doublings = std::min<size_t>(n - kImmediateRestarts - 1, 16);
    p.kind = RestartPlan::Kind::Later;
    p.at_ns = now_ns + std::min(kFirstBackoffNs << doublings, kMaxBackoffNs);
    return p;
}

RequestDeaths count_request_death(const RequestDeaths& before, uint32_t n_output_now) {
    // Progress since the last death it saw clears its record: the deaths were not its.
    if (before.deaths > 0 && n_output_now > before.n_output) return {1, n_output_now};
    return {before.deaths + 1, n_output_now};
}

}  // namespace duet
