#include "roles/rebalance.h"

namespace duet {

void Rebalancer::observe(uint64_t now_ns, RoleSample prefill, RoleSample decode) {
    samples_.push_back({now_ns, prefill, decode});
    // Keep one sample at or before the window's start: it tells a whole window apart
    // from a partial one (R1).
    while (samples_.size() > 1 && samples_[1].at + o_.window_ns <= now_ns) samples_.pop_front();
}

double Rebalancer::utilization(shm::Role role) const {
    uint64_t busy = 0, running = 0;
    for (const Sample& s : samples_) {
        const RoleSample& r = role == shm::Role::Prefill ? s.prefill : s.decode;
        busy += r.busy;
        running += r.running;
    }
    return running == 0 ? -1.0 : static_cast<double>(busy) / static_cast<double>(running);
}

std::optional<shm::Role> Rebalancer::decide() const {
    if (samples_.size() < 2 || samples_.back().at - samples_.front().at < o_.window_ns) return std::nullopt;  // R1
    const double p = utilization(shm::Role::Prefill), d = utilization(shm::Role::Decode);
    if (p < 0 || d < 0) return std::nullopt;
    const RoleSample& now = samples_.back().prefill;
    const RoleSample& now_d = samples_.back().decode;
    if (d >= o_.busy && p <= o_.idle && now.running >= 2) return shm::Role::Prefill;   // R2, R3
    if (p >= o_.busy && d <= o_.idle && now_d.running >= 2) return shm::Role::Decode;  // R2, R3
    return std::nullopt;
}

LeaveStep leave_step(const LeaveInputs& in) {
    LeaveStep out;
    if (!in.still_leaving) return {LeaveAction::Drop, 0};
    if (in.draining || !in.others_running) return {LeaveAction::Stay, 0};
    out.quiet_since_ns = in.holds_work ? 0 : in.quiet_since_ns == 0 ? in.now_ns : in.quiet_since_ns;
    if (!in.holds_work && in.quiet_since_ns != 0 && in.now_ns - in.quiet_since_ns >= Rebalancer::kQuietNs)
        out.action = LeaveAction::Retire;
    else if (in.now_ns - in.since_ns > Rebalancer::kLeaveTimeoutNs)
        out.action = LeaveAction::Stay;
    return out;
}

}  // namespace duet
