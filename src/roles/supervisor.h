// The process manager's side of the failure model: starts the roles (front, prefill
// and decode workers) as child processes, notices a death when poll() reaps it
// (SIGCHLD-free: waitpid polling; `duet serve` polls every 2 ms), recovers what the
// dead process held (shm::Instance::recover, re-driving its running requests),
// hands each re-driven request whose client front is still alive to `resend` (the
// launcher sends it to prefill on its own rings), and restarts the role: at once,
// or after a backoff once it dies often, and never again only when it cannot start
// (roles/restart_policy.h). A request that its workers keep dying on without
// progress is failed alone (ReqError::Poison) instead of re-driven.
#pragma once

#include <sys/types.h>

#include <functional>
#include <string>
#include <unordered_map>
#include <vector>

#include "base/result.h"
#include "roles/restart_policy.h"
#include "shm/instance.h"

namespace duet {

struct RoleSpec {
    std::string name;               // for messages: "prefill", "decode", ...
    std::vector<std::string> argv;  // argv[0] is the executable's path
};

class Supervisor {
public:
    // front: the process that recovery makes the owner of re-driven requests (the
    // caller; under `duet serve`, the launcher, not `duet front`).
    // resend: called after a recovery for each QUEUED request that process owns
    // whose client is alive or unset (a dead front's are left to sweep_orphans).
    Supervisor(shm::Instance& inst, shm::ProcRef front, std::function<void(shm::ReqRef)> resend);
    ~Supervisor();  // stops every role (SIGTERM, then SIGKILL after 5 s)
    Supervisor(const Supervisor&) = delete;
    Supervisor& operator=(const Supervisor&) = delete;

    Result<pid_t> start(const RoleSpec& spec);

    struct Event {
        std::string role;
        pid_t pid = 0;
        int status = 0;  // as from waitpid
        shm::RecoveryReport recovered;
        pid_t restarted_as = 0;      // 0: not restarted (yet)
        uint64_t restart_at_ns = 0;  // a restart after a backoff, then (monotonic_ns)
        bool given_up = false;       // never restarted: `why`
        std::string why;
        bool retired = false;  // it was retire()d: an exit asked for, not a failure
    };
    // Reaps children that ended, recovers and restarts them (or plans their restart
    // after a backoff, started by a later poll()). Non-blocking.
    std::vector<Event> poll();
    // Roles this supervisor did not start (systemd's units: `duet instance`): every
    // front, prefill or decode process in the registry whose process is gone (its
    // pid and start time no longer match) is recovered, never restarted (its
    // process manager restarts it). Non-blocking; reads /proc once per live role.
    std::vector<Event> poll_registry();
    // `duet instance` starting on an instance whose supervisor died while its roles
    // ran on (their units do not stop with it): every other launcher's registry slot
    // whose process is gone is recovered as a dead role's is (the re-drives it owned
    // become ours and are sent again). An error naming the pid when another
    // supervisor still runs. Returns the pids taken over from.
    Result<std::vector<pid_t>> take_over();
    // `duet instance` stopping cleanly: the live processes of the registry's roles
    // (their units do not stop with the instance) get SIGTERM, the front first (its
    // drain, front_grace_ms at most, while the workers still compute), then the
    // prefill and decode workers (worker_grace_ms); one still registered past its
    // time gets SIGKILL, and what it left is recovered. Returns how many it signalled.
    size_t stop_registered(int front_grace_ms, int worker_grace_ms);
    // SIGTERM to every role; SIGKILL to those still running after grace_ms; then
    // recovers whatever they left. Errors name roles that did not exit cleanly.
    Status stop_all(int grace_ms);
    // Sends SIGTERM to a role that is not to be restarted when it exits (a drain, or
    // a worker changing role: poll() reports its exit, retired, and forgets it).
    // True if it was running.
    bool retire(const std::string& role);
    // SIGKILL to a role (one that outlived its drain).
    void kill_role(const std::string& role);

    pid_t pid_of(const std::string& role) const;
    size_t restarts() const { return restarts_; }

private:
    struct Child {
        RoleSpec spec;
        pid_t pid = 0;
        RoleDeaths deaths;
        uint64_t restart_at_ns = 0;  // a planned restart (pid 0 until then)
        bool given_up = false;       // not restarted (it cannot start, or retired)
        bool retired = false;
    };
    // Whether the process registered RUNNING (it had started) before it died.
    bool had_run(pid_t pid);
    Result<pid_t> spawn(const RoleSpec& spec);
    // Waits for a signalled child until deadline_ns, then SIGKILLs it; recovers what
    // it left. True if it exited with status 0.
    bool reap(Child& c, uint64_t deadline_ns);
    shm::RecoveryReport recover(pid_t pid);

    shm::Instance& inst_;
    shm::ProcRef front_;
    std::function<void(shm::ReqRef)> resend_;
    std::vector<Child> children_;
    size_t restarts_ = 0;
    // Running requests that dead workers held: deaths in a row without progress,
    // by (slot << 32 | generation).
    std::unordered_map<uint64_t, RequestDeaths> request_deaths_;
};

}  // namespace duet
