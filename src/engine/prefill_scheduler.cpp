#include "engine/prefill_scheduler.h"

#include <algorithm>
#include <numeric>

namespace duet {

PrefillPlan plan_prefill(std::span<const PrefillJobView> jobs, int64_t budget, bool one_at_a_time,
                         int64_t lesser_budget) {
    std::vector<size_t> order(jobs.size());
    std::iota(order.begin(), order.end(), size_t{0});
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t a, size_t b) { return jobs[a].deadline_ns < jobs[b].deadline_ns; });
    PrefillPlan plan;
    for (size_t k : order) {
        if (budget <= 0 || (one_at_a_time && !plan.entries.empty())) break;
        const PrefillJobView& j = jobs[k];
        if (j.follows) continue;
        if (!plan.entries.empty() && jobs[plan.entries.front().job].urgent && !j.urgent) continue;
        if (!j.looked_up) {
            plan.lookup = static_cast<int64_t>(k);
            plan.entries.clear();
            return plan;
        }
        const int64_t b =
            plan.entries.empty() && !j.urgent && lesser_budget > 0 ? std::min(budget, lesser_budget) : budget;
        const int64_t n = std::min(b, j.remaining);
        if (n == j.remaining && !j.may_end) continue;
        plan.entries.push_back({k, n});
        budget = b - n;
    }
    return plan;
}

PrefillShortage plan_prefill_shortage(std::span<const PrefillKvView> jobs, std::span<const size_t> pass,
                                      PrefillArenaView arena, uint64_t kv_wait_ns) {
    PrefillShortage s;
    if (pass.size() != 1) return s;  // Shrink
    const size_t lone = pass.front();
    for (size_t k = 0; k < jobs.size(); ++k)
        if (k != lone && jobs[k].own_blocks && jobs[k].held > 0) s.jobs.push_back(k);
    if (!s.jobs.empty()) {
        s.action = PrefillShortage::Action::SetAside;
        return s;
    }
    // The other jobs' blocks are not freed by waiting (they do not run while it
    // waits): only the rest of the arena counts.
    int64_t others = 0;
    for (size_t k = 0; k < jobs.size(); ++k)
        if (k != lone) others += jobs[k].held;
    const PrefillKvView& j = jobs[lone];
    const bool waits =
        j.client_waits && j.need <= arena.blocks - others && arena.available < arena.blocks && j.waited_ns < kv_wait_ns;
    s.action = waits ? PrefillShortage::Action::Wait : PrefillShortage::Action::Fail;
    return s;
}

}  // namespace duet
