#include "roles/supervisor.h"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string_view>
#include <thread>

#include "engine/golden.h"

namespace duet {

Supervisor::Supervisor(shm::Instance& inst, shm::ProcRef front, std::function<void(shm::ReqRef)> resend)
    : inst_(inst), front_(front), resend_(std::move(resend)) {}

Supervisor::~Supervisor() { (void)stop_all(5000); }

Result<pid_t> Supervisor::spawn(const RoleSpec& spec) {
    if (spec.argv.empty()) return make_error("role {}: no command", spec.name);
    std::vector<char*> argv;
    for (const std::string& a : spec.argv) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    // The environment less systemd's notify variables: under a Type=notify unit the
    // supervisor is the main process and speaks for its roles (roles/sd_notify.h).
    std::vector<char*> envp;
    for (char** e = environ; *e; ++e) {
        const std::string_view v(*e);
        if (v.starts_with("NOTIFY_SOCKET=") || v.starts_with("WATCHDOG_USEC=") || v.starts_with("WATCHDOG_PID="))
            continue;
        envp.push_back(*e);
    }
    envp.push_back(nullptr);
    pid_t pid = fork();
    if (pid < 0) return make_error("role {}: fork failed: {}", spec.name, std::strerror(errno));
    if (pid == 0) {
        // A role must not outlive its supervisor: a launcher killed with SIGKILL (the
        // OOM killer) would otherwise leave workers running against a segment nobody
        // serves, and a front given SIGTERM drains for its whole grace period holding
        // the port while no worker is left. SIGKILL, as any role's crash is survivable
        // (the KV logs' rules, re-drive); whoever restarts the service starts afresh.
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() == 1) _exit(127);  // the supervisor is already gone
        // Its own process group: a Ctrl-C at the terminal reaches the launcher alone,
        // which drains and then stops the roles in order.
        setpgid(0, 0);
        execve(argv[0], argv.data(), envp.data());
        _exit(127);
    }
    return pid;
}

Result<pid_t> Supervisor::start(const RoleSpec& spec) {
    auto pid = spawn(spec);
    if (!pid) return pid.error();
    children_.push_back(Child{spec, *pid, {}, false, false});
    return *pid;
}

shm::RecoveryReport Supervisor::recover(pid_t pid) {
    shm::RecoveryReport total;
    shm::Registry& reg = inst_.registry();
    for (uint32_t s = 0; s < reg.n_slots(); ++s) {
        if (reg.pid(s) != pid || reg.state(s) == shm::ProcState::Free) continue;
        auto r = inst_.recover(reg.current(s), front_, true);
        if (r) total += *r;  // an error: alive by its pid (cannot happen for a reaped child)
    }
    shm::RequestTable& t = inst_.requests();
    for (uint32_t s = 0; s < t.n_slots(); ++s) {
        if (t.state(s) != shm::ReqState::Queued || t.owner_slot(s) != static_cast<int32_t>(front_.slot)) continue;
        // Not a request whose client is gone (a dead front's): sweep_orphans() ends those.
        const uint64_t client = t.slot(s).client.load(std::memory_order_relaxed);
        if (client == 0 || reg.alive(shm::ProcRef::unpack(client))) resend_(t.current(s));
    }
    return total;
}

std::vector<Supervisor::Event> Supervisor::poll() {
    std::vector<Event> events;
    for (Child& c : children_) {
        if (c.pid <= 0) continue;
        int status = 0;
        pid_t r = waitpid(c.pid, &status, WNOHANG);
        if (r != c.pid) continue;
        Event e;
        e.role = c.spec.name;
        e.pid = c.pid;
        e.status = status;
        e.recovered = recover(c.pid);
        e.retired = c.retired;
        c.pid = 0;
        const uint64_t now = shm::monotonic_ns();
        c.deaths_ns.push_back(now);
        std::erase_if(c.deaths_ns, [&](uint64_t t) { return now - t > 10'000'000'000ull; });
        // A worker whose golden-logits check failed computes wrong answers on this
        // box: starting it again cannot help (engine/golden.h).
        const bool hopeless = WIFEXITED(status) && WEXITSTATUS(status) == kGoldenExitCode;
        if (c.given_up || hopeless || c.deaths_ns.size() >= 5) {
            c.given_up = true;
        } else if (auto p = spawn(c.spec); p.ok()) {
            c.pid = *p;
            e.restarted_as = *p;
            ++restarts_;
        }
        events.push_back(std::move(e));
    }
    std::erase_if(children_, [](const Child& c) { return c.retired && c.pid == 0; });
    return events;
}

std::vector<Supervisor::Event> Supervisor::poll_registry() {
    std::vector<Event> events;
    shm::Registry& reg = inst_.registry();
    for (uint32_t s = 0; s < reg.n_slots(); ++s) {
        const shm::ProcState st = reg.state(s);
        if (st != shm::ProcState::Starting && st != shm::ProcState::Running && st != shm::ProcState::Leaving &&
            st != shm::ProcState::Dead)
            continue;
        const auto role = static_cast<shm::Role>(reg.slot(s).role.load(std::memory_order_relaxed));
        if (role != shm::Role::Front && role != shm::Role::Prefill && role != shm::Role::Decode) continue;
        const shm::ProcRef r = reg.current(s);
        if (st != shm::ProcState::Dead && reg.process_running(r)) continue;
        Event e;
        e.role = shm::role_name(role);
        e.pid = reg.pid(s);
        e.recovered = recover(e.pid);
        events.push_back(std::move(e));
    }
    return events;
}

bool Supervisor::reap(Child& c, uint64_t deadline_ns) {
    int status = 0;
    pid_t r = 0;
    while ((r = waitpid(c.pid, &status, WNOHANG)) == 0 && shm::monotonic_ns() < deadline_ns)
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
    if (r == 0) {
        kill(c.pid, SIGKILL);
        waitpid(c.pid, &status, 0);
    }
    recover(c.pid);  // a clean exit left nothing; a killed one may have
    c.pid = 0;
    return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

Status Supervisor::stop_all(int grace_ms) {
    std::string unclean;
    for (Child& c : children_)
        if (c.pid > 0) kill(c.pid, SIGTERM);
    const uint64_t deadline = shm::monotonic_ns() + static_cast<uint64_t>(grace_ms) * 1000000ull;
    for (Child& c : children_) {
        if (c.pid <= 0) continue;
        if (!reap(c, deadline)) unclean += " " + c.spec.name;
    }
    if (!unclean.empty()) return make_error("roles did not exit cleanly:{}", unclean);
    return {};
}

bool Supervisor::retire(const std::string& role) {
    for (Child& c : children_)
        if (c.spec.name == role && c.pid > 0) {
            c.given_up = c.retired = true;
            kill(c.pid, SIGTERM);
            return true;
        }
    return false;
}

void Supervisor::kill_role(const std::string& role) {
    for (Child& c : children_)
        if (c.spec.name == role && c.pid > 0) kill(c.pid, SIGKILL);
}

pid_t Supervisor::pid_of(const std::string& role) const {
    for (const Child& c : children_)
        if (c.spec.name == role) return c.pid;
    return 0;
}

}  // namespace duet
