// Workers that change role (`duet serve --rebalance S`, CPU serving with one shared
// KV arena): when one role's workers stay busy while the other's stay idle, the
// launcher retires an idle worker of the idle role and starts a worker of the busy
// role on its cores. Cores lent between partners (roles/claims.h, borrow_cores)
// cover the moments a role is idle; this covers a load whose mix stays lopsided.
//
// The rules (each has a test in tests/rebalance_test.cpp):
//   R1  Evidence: a role's utilization is the share of its running workers' samples
//       that were busy, over the last `window`: holding work another worker could
//       have taken (two requests or sequences or more, or messages waiting in its
//       rings; one prompt or one sequence alone stays where it is, so a second
//       worker would not help it). No decision before a whole window of samples
//       has been seen since the start or the last change.
//   R2  Imbalance: a worker moves from role A to role B when B's utilization is at
//       least `busy` (0.9) and A's at most `idle` (0.25); between the two nothing
//       moves (hysteresis: a load that moved a worker must fall a long way before
//       it moves one back).
//   R3  Never the last: A keeps at least one running worker (checked again while
//       the chosen one leaves: if the others died meanwhile, it stays).
//   R4  Never while it holds work: the launcher marks the chosen worker LEAVING
//       (shm/registry.h: routers pass it over), waits until it has held nothing and
//       had nothing waiting for `kQuietNs`, then stops it; if that takes longer than
//       `kLeaveTimeoutNs` it is kept (RUNNING again) and the change is dropped.
//   R5  One change at a time, then a whole new window (R1) before the next. A
//       drain keeps a worker that is still leaving; a successor that cannot start
//       (fork fails) gives way to the old worker in its old role.
// Indices: a successor takes an index of its new role that the plan gave a worker
// on the same CPUs (with that worker's lent cores), else one past the plan's (no
// lent cores): so every planned partner still borrows its own partner's cores
// (Launcher::successor).
// The moved worker's requests never move: it holds none (R4), and one that reached
// it anyway (a router that chose it just before LEAVING) is re-driven by the
// recovery that follows its exit, as for a crash (token-identical: DESIGN.md).
#pragma once

#include <cstdint>
#include <deque>
#include <optional>

#include "shm/registry.h"

namespace duet {

struct RebalanceOptions {
    uint64_t window_ns = 10'000'000'000ull;
    double busy = 0.9;
    double idle = 0.25;
};

// One look at both roles: running workers, and how many of them were busy.
struct RoleSample {
    uint32_t running = 0, busy = 0;
};

// R3-R5 for the worker chosen to leave, each sample until it goes (the launcher
// acts on the answer: Launcher::rebalance).
enum class LeaveAction {
    Wait,    // not yet
    Retire,  // R4: nothing held or sent for kQuietNs: stop it, start its successor
    Stay,    // it keeps its role (RUNNING again): R3 (no other worker of its role
             // runs), a drain began, or it kept working past kLeaveTimeoutNs
    Drop,    // it is no longer LEAVING (it died: restarted in its role, as any worker)
};
struct LeaveInputs {
    bool still_leaving = true;   // its registry slot is LEAVING at its generation
    bool others_running = true;  // another worker of its role runs
    bool draining = false;
    bool holds_work = false;     // requests or sequences in hand, or messages waiting
    uint64_t now_ns = 0, since_ns = 0;  // now; when it was marked
    uint64_t quiet_since_ns = 0;        // since when it has held nothing (0: it holds work)
};
struct LeaveStep {
    LeaveAction action = LeaveAction::Wait;
    uint64_t quiet_since_ns = 0;  // the next sample's
};
LeaveStep leave_step(const LeaveInputs& in);

class Rebalancer {
public:
    explicit Rebalancer(RebalanceOptions o) : o_(o) {}
    // A sample at now_ns (monotonic, non-decreasing).
    void observe(uint64_t now_ns, RoleSample prefill, RoleSample decode);
    // The role a worker should leave (R1-R3), or none.
    std::optional<shm::Role> decide() const;
    // A change began (or was dropped): the evidence starts again (R5).
    void reset() { samples_.clear(); }
    // Utilization over the window so far (R1); -1 without samples of running workers.
    double utilization(shm::Role role) const;

    static constexpr uint64_t kQuietNs = 200'000'000ull;
    static constexpr uint64_t kLeaveTimeoutNs = 10'000'000'000ull;

private:
    struct Sample {
        uint64_t at;
        RoleSample prefill, decode;
    };
    RebalanceOptions o_;
    std::deque<Sample> samples_;
};

}  // namespace duet
