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
        if (plan.entries.empty() && !j.urgent && lesser_budget > 0) budget = std::min(budget, lesser_budget);
        const int64_t n = std::min(budget, j.remaining);
        plan.entries.push_back({k, n});
        budget -= n;
    }
    return plan;
}

}  // namespace duet
