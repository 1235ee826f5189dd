// The process manager's side of the failure model: starts the roles (front, prefill
// and decode workers) as child processes, notices a death when poll() reaps it
// (SIGCHLD-free: waitpid polling; `duet serve` polls every 2 ms), recovers what the
// dead process held (shm::Instance::recover, re-driving its running requests),
// hands each re-driven request whose client front is still alive to `resend` (the
// launcher sends it to prefill on its own rings), and restarts the role. A role
// that keeps dying (5 deaths within 10 s) is not restarted again.
#pragma once

#include <sys/types.h>

#include <functional>
#include <string>
#include <vector>

#include "base/result.h"
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
        pid_t restarted_as = 0;  // 0: not restarted
        bool retired = false;    // it was retire()d: an exit asked for, not a failure
    };
    // Reaps children that ended, recovers and restarts them. Non-blocking.
    std::vector<Event> poll();
    // Roles this supervisor did not start (systemd's units: `duet instance`): every
    // front, prefill or decode process in the registry whose process is gone (its
    // pid and start time no longer match) is recovered, never restarted (its
    // process manager restarts it). Non-blocking; reads /proc once per live role.
    std::vector<Event> poll_registry();
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
        std::vector<uint64_t> deaths_ns;
        bool given_up = false;  // not restarted (kept dying, or retired)
        bool retired = false;
    };
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
};

}  // namespace duet
