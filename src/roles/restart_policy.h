// What a supervisor does when a role's process died, as pure functions over what it
// remembers (Supervisor, `duet serve`'s and `duet instance`'s).
//
// A role is restarted for as long as it can still start: a death after it ran
// (registered RUNNING: model loaded, golden check passed) restarts it, at once for
// the first kImmediateRestarts deaths within kDeathWindowNs and then after a delay
// that doubles with each further death (kFirstBackoffNs up to kMaxBackoffNs), so a
// burst of deaths never stops the server and a crash loop does not spin. Only a role
// that dies kMaxFailedStarts times in a row before it ever ran (it cannot bind its
// port, cannot load its model) is given up on; a failed golden check (exit 3) at once.
//
// A request is failed alone, with its reason, when deaths follow it: kPoisonDeaths
// deaths in a row of the worker that held it without its output growing in between
// (a request that crashes whichever worker computes it). A request that makes
// progress between deaths is re-driven however many deaths it sees.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace duet {

inline constexpr uint64_t kDeathWindowNs = 60'000'000'000ull;
inline constexpr uint32_t kImmediateRestarts = 3;
inline constexpr uint64_t kFirstBackoffNs = 250'000'000ull;
inline constexpr uint64_t kMaxBackoffNs = 8'000'000'000ull;
inline constexpr uint32_t kMaxFailedStarts = 5;
inline constexpr uint32_t kPoisonDeaths = 3;

// One role's deaths, as its supervisor remembers them.
struct RoleDeaths {
    std::vector<uint64_t> deaths_ns;  // within kDeathWindowNs of the latest
    uint32_t failed_starts = 0;       // deaths in a row before it ran
};

struct RestartPlan {
    enum class Kind { Now, Later, Never };
    Kind kind = Kind::Now;
    uint64_t at_ns = 0;  // Later: when
    std::string why;     // Never: for the log and the failed requests
    RoleDeaths deaths;   // the history with this death
};

// A death at now_ns; had_run: it registered RUNNING before it died; golden_failed:
// it exited with the golden check's code.
RestartPlan plan_restart(const RoleDeaths& before, uint64_t now_ns, bool had_run, bool golden_failed);

// A running request the dead worker held: the deaths in a row it saw without
// progress (0: none yet), and its output tokens then.
struct RequestDeaths {
    uint32_t deaths = 0;
    uint32_t n_output = 0;
};
// The request's record after this death, where its output is n_output_now.
RequestDeaths count_request_death(const RequestDeaths& before, uint32_t n_output_now);
inline bool quarantined(const RequestDeaths& d) { return d.deaths >= kPoisonDeaths; }

}  // namespace duet
