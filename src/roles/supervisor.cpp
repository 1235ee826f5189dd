#include "roles/supervisor.h"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <string_view>
#include <thread>
#include <unordered_set>

#include "base/log.h"
#include "engine/golden.h"
#include "roles/wire.h"

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
    children_.push_back(Child{spec, *pid, {}, 0, false, false});
    return *pid;
}

bool Supervisor::had_run(pid_t pid) {
    shm::Registry& reg = inst_.registry();
    for (uint32_t s = 0; s < reg.n_slots(); ++s)
        if (reg.pid(s) == pid && (reg.state(s) == shm::ProcState::Running || reg.state(s) == shm::ProcState::Leaving))
            return true;
    return false;
}

shm::RecoveryReport Supervisor::recover(pid_t pid) {
    shm::RecoveryReport total;
    shm::Registry& reg = inst_.registry();
    shm::RequestTable& t = inst_.requests();
    // Each running request the dead process held: one more death in a row for it,
    // unless its output grew since the last (restart_policy.h). Counted once per
    // death, though recovery may look at a request on more than one pass.
    std::unordered_set<uint64_t> counted;
    const auto fail_code = [&](shm::ReqRef q) -> int32_t {
        const uint64_t key = (static_cast<uint64_t>(q.slot) << 32) | q.gen;
        RequestDeaths& d = request_deaths_[key];
        if (counted.insert(key).second) {
            d = count_request_death(d, t.slot(q.slot).n_output.load(std::memory_order_acquire));
            // Each request's story in the log (journalctl DUET_REQUEST=slot.gen, or
            // DUET_REQUEST_ID= the id its client was given).
            const std::string id = fmt::format("{}.{}", q.slot, q.gen);
            if (quarantined(d))
                log::error(fmt::format("request {}: failed, not re-driven: the worker computing it died {} times in a "
                                       "row (pid {} the last) while its output stayed at {} tokens",
                                       id, d.deaths, pid, d.n_output),
                           {request_field(q), request_id_field(t, q)});
            else
                log::notice(fmt::format("request {}: re-driven at {} output tokens (pid {} died holding it)", id,
                                        d.n_output, pid),
                            {request_field(q), request_id_field(t, q)});
        }
        return quarantined(d) ? static_cast<int32_t>(ReqError::Poison) : 0;
    };
    for (uint32_t s = 0; s < reg.n_slots(); ++s) {
        if (reg.pid(s) != pid || reg.state(s) == shm::ProcState::Free) continue;
        auto r = inst_.recover(reg.current(s), front_, true, fail_code);
        if (r) total += *r;  // an error: alive by its pid (cannot happen for a reaped child)
    }
    if (request_deaths_.size() > 2 * static_cast<size_t>(t.n_slots()))  // forget ended requests
        std::erase_if(request_deaths_, [&](const auto& kv) {
            const auto slot = static_cast<uint32_t>(kv.first >> 32);
            return t.current(slot).gen != static_cast<uint32_t>(kv.first);
        });
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
        const bool ran = had_run(c.pid);  // before recovery frees its registry slot
        e.recovered = recover(c.pid);
        e.retired = c.retired;
        c.pid = 0;
        if (c.given_up) {  // retired
            e.given_up = true;
            events.push_back(std::move(e));
            continue;
        }
        const bool golden = WIFEXITED(status) && WEXITSTATUS(status) == kGoldenExitCode;
        RestartPlan plan = plan_restart(c.deaths, shm::monotonic_ns(), ran, golden);
        c.deaths = std::move(plan.deaths);
        if (plan.kind == RestartPlan::Kind::Never) {
            c.given_up = e.given_up = true;
            e.why = std::move(plan.why);
        } else if (plan.kind == RestartPlan::Kind::Later) {
            c.restart_at_ns = e.restart_at_ns = plan.at_ns;
        } else if (auto p = spawn(c.spec); p.ok()) {
            c.pid = e.restarted_as = *p;
            ++restarts_;
        } else {
            c.given_up = e.given_up = true;
            e.why = p.error().message;
        }
        events.push_back(std::move(e));
    }
    // Restarts whose backoff has passed.
    const uint64_t now = shm::monotonic_ns();
    for (Child& c : children_) {
        if (c.pid != 0 || c.given_up || c.restart_at_ns == 0 || now < c.restart_at_ns) continue;
        c.restart_at_ns = 0;
        if (auto p = spawn(c.spec); p.ok()) {
            c.pid = *p;
            ++restarts_;
        } else {
            c.given_up = true;
        }
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

Result<std::vector<pid_t>> Supervisor::take_over() {
    shm::Registry& reg = inst_.registry();
    std::vector<pid_t> from;
    for (uint32_t s = 0; s < reg.n_slots(); ++s) {
        if (s == front_.slot || reg.state(s) == shm::ProcState::Free) continue;
        if (static_cast<shm::Role>(reg.slot(s).role.load(std::memory_order_relaxed)) != shm::Role::Launcher) continue;
        const shm::ProcRef r = reg.current(s);
        if (reg.state(s) != shm::ProcState::Dead && reg.process_running(r))
            return make_error("instance {} is supervised by a running process (pid {}): not taking it over",
                              inst_.config().name, reg.pid(s));
        from.push_back(reg.pid(s));
    }
    for (const pid_t pid : from) (void)recover(pid);
    return from;
}

size_t Supervisor::stop_registered(int front_grace_ms, int worker_grace_ms) {
    shm::Registry& reg = inst_.registry();
    const auto live = [&](bool fronts) {
        std::vector<shm::ProcRef> out;
        for (uint32_t s = 0; s < reg.n_slots(); ++s) {
            const auto role = static_cast<shm::Role>(reg.slot(s).role.load(std::memory_order_relaxed));
            if (fronts ? role != shm::Role::Front : role != shm::Role::Prefill && role != shm::Role::Decode) continue;
            const shm::ProcRef r = reg.current(s);
            if (reg.alive(r) && reg.process_running(r)) out.push_back(r);
        }
        return out;
    };
    size_t n = 0;
    // The front first, while the workers still compute what it drains; then the
    // workers, with nothing left to hand them.
    for (const bool fronts : {true, false}) {
        const std::vector<shm::ProcRef> now = live(fronts);
        n += now.size();
        for (const shm::ProcRef& r : now) kill(reg.pid(r.slot), SIGTERM);
        const uint64_t deadline =
            shm::monotonic_ns() + static_cast<uint64_t>(fronts ? front_grace_ms : worker_grace_ms) * 1000000ull;
        std::vector<shm::ProcRef> left = live(fronts);
        while (!left.empty() && shm::monotonic_ns() < deadline) {
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
            (void)poll_registry();  // a worker that dies meanwhile: its requests re-driven for the drain
            left = live(fronts);
        }
        for (const shm::ProcRef& r : left) kill(reg.pid(r.slot), SIGKILL);
        for (int i = 0; i < 100 && !live(fronts).empty(); ++i)
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
        (void)poll_registry();  // what the killed ones held
    }
    return n;
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
