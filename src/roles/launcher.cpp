#include "roles/launcher.h"

#include "base/log.h"

#include "engine/scheduling.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <thread>

#include "engine/backends.h"
#include "engine/golden.h"
#include "kv/shm_kv.h"
#include "model/backend.h"
#include "model/gpu_plan.h"
#include "roles/rebalance.h"
#include "roles/recovery.h"
#include "roles/routing.h"
#include "roles/sd_notify.h"
#include "roles/supervisor.h"
#include "roles/worker_stats.h"
#include "shm/fd_keeper.h"

namespace duet {

// ---------------------------------------------------------------- the launcher

namespace {

constexpr uint64_t kSecond = 1'000'000'000ull;

// Requests QUEUED, PREFILLING or DECODING: not the ended ones a front keeps for a resume.
uint32_t in_flight(const shm::RequestTable& t) {
    uint32_t n = 0;
    for (uint32_t s = 0; s < t.n_slots(); ++s) {
        const shm::ReqState st = t.state(s);
        n += st == shm::ReqState::Queued || st == shm::ReqState::Prefilling || st == shm::ReqState::Decoding;
    }
    return n;
}

// The launcher's lines: notices, unless a role died (warning) or cannot be served (error).
void say(const std::string& m, log::Level level = log::Level::Notice) { log::line(level, m); }

// Each role's host arena on its workers' NUMA nodes (ServePlan::bind_arenas).
void bind_arenas(shm::Instance& inst, const ServePlan& plan) {
    for (const shm::Role role : {shm::Role::Prefill, shm::Role::Decode}) {
        std::vector<int> nodes;
        for (const RoleLaunch& r : plan.roles)
            if (r.role == shm::role_name(role)) nodes.push_back(r.numa);
        const uint32_t arena = worker_arena(inst.config(), role, 0);
        const uint64_t bytes = inst.config().cpu_kv_bytes / inst.n_arenas();
        if (Status st = bind_to_nodes(inst.cpu_kv_data(arena), bytes, nodes); !st) {
            say(fmt::format("{}'s KV arena: {} (left to first touch)", shm::role_name(role), st.error().message));
        } else if (inst.kv_segment().page_mode() == shm::PageMode::HugeTlb) {
            // hugetlbfs keeps no shared policy: the binding holds for this mapping
            // only, so the pages are faulted in here, now, where it holds.
            volatile uint8_t* p = inst.cpu_kv_data(arena);
            for (uint64_t off = 0; off < bytes; off += 2u << 20) p[off] = 0;
        }
    }
}

// What the launcher holds for GPU serving: the fd keeper (the first worker creates
// the KV arena in device memory and deposits its fd there; the others and restarted
// ones fetch it; cuda_arena.h) and the arenas of GPUs that share by legacy IPC
// handles only. Both live as long as the launcher does.
struct GpuHolds {
    std::unique_ptr<shm::FdKeeper> keeper;
    std::vector<std::unique_ptr<DeviceKvMemory>> legacy;
};

Result<GpuHolds> hold_gpu_arenas(shm::Instance& inst, const ServePlan& plan, const KvLayout& kl) {
    GpuHolds h;
    if (plan.gpus.empty()) return h;
    auto k = shm::FdKeeper::start(plan.layout.instance);
    if (!k) return k.error();
    h.keeper = std::move(k).value();
    for (size_t g = 0; g < plan.gpus.size(); ++g) {
        const uint64_t bytes = kl.block_bytes() * inst.arena(static_cast<uint32_t>(g)).n_blocks();
        auto held = hold_legacy_kv(plan.layout.instance, static_cast<uint32_t>(g), plan.gpus[g], bytes);
        if (!held) return held.error();
        if (!*held) continue;
        h.legacy.push_back(std::move(held).value());
        say(fmt::format("{}'s KV arena is shared with legacy CUDA IPC handles (held by the launcher)",
                        plan.gpus[g].name()));
    }
    return h;
}

// The supervision loop over a created instance.
class Launcher {
public:
    Launcher(shm::Instance& inst, shm::ProcRef self, const ServeSettings& s, const ServePlan& plan,
             const ArgvBuilder& argv, const std::atomic<bool>& stop, RoleStart start)
        : external_(start == RoleStart::External),
          inst_(inst),
          s_(s),
          plan_(plan),
          argv_(argv),
          stop_(stop),
          redrive_(inst, /*redrive=*/true),
          // Re-driven requests go back to prefill on the launcher's own rings (the
          // front's rings have one producer: the front), to the least busy worker.
          sup_(inst, self, [this](shm::ReqRef r) { (void)redrive_.send(r); }),
          roles_(plan.roles),
          rebalancer_(RebalanceOptions{static_cast<uint64_t>(std::max(s.rebalance_s, 1)) * kSecond}) {}

    // taken_from: the pids of the supervisors whose instance this one took over
    // (External only; empty when it created the instance).
    int run(const std::string& model_id, const std::vector<pid_t>& taken_from);
    // run() found another supervisor of the instance running: it left its roles and
    // segments alone, and so must its caller.
    bool abandoned() const { return abandoned_; }

private:
    Status start_roles();
    void handle_events();
    uint64_t window_ns() const { return static_cast<uint64_t>(s_.resume_window_s) * kSecond; }
    void handle_external_events();

    bool external_;
    void turn(const std::string& model_id);

    shm::Instance& inst_;
    const ServeSettings& s_;
    const ServePlan& plan_;
    const ArgvBuilder& argv_;
    const std::atomic<bool>& stop_;
    PrefillRouter redrive_;
    Supervisor sup_;
    LaunchState state_ = LaunchState::Starting;
    bool failed_ = false;  // exit 1; also a stop request
    bool abandoned_ = false;      // another supervisor runs: run() returned at once
    bool golden_failed_ = false;  // a worker failed its golden check: exit kGoldenExitCode
    bool front_exited_ = false, front_killed_ = false;
    uint64_t start_deadline_ = 0, drain_deadline_ = 0, next_sweep_ = 0, next_poll_ = 0, next_status_ = 0;
    uint64_t next_swap_sweep_ = 0;
    // Swap blobs nobody will read: of requests that ended (cancelled or failed while
    // QUEUED, say) or whose slot holds another request now, and temporary files of a
    // writer that died; every 5 s.
    void sweep_swap_dir();

    // Whether every worker the launcher runs now (roles_) and the front are running.
    bool all_running() const;
    // --rebalance (roles/rebalance.h): every 50 ms while serving, or while a change
    // is under way.
    void rebalance(uint64_t now);
    // Worker `index` of `role`: whether it holds or is sent anything (R4), and whether
    // it has more than it can compute alone (R1's busy: slot -1, none running).
    uint64_t work_items(shm::Role role, uint32_t index, int32_t slot) const;
    bool holds_work(shm::Role role, uint32_t index, int32_t slot) const;
    bool busy(shm::Role role, uint32_t index, int32_t slot) const;
    std::optional<RoleLaunch> successor(const RoleLaunch& from, shm::Role to) const;
    void start_successor();

    std::vector<RoleLaunch> roles_;  // the children as they are now (a role change replaces one)
    Rebalancer rebalancer_;
    struct Change {
        enum class Phase { None, Leaving, Exiting, Starting } phase = Phase::None;
        shm::ProcRef who;  // the leaving worker's registry slot
        RoleLaunch from, to;
        uint64_t since_ns = 0, quiet_since_ns = 0;
    } change_;
};

const WorkerSettings& worker_of(const RoleLaunch& r) { return std::get<WorkerSettings>(r.settings); }
shm::Role role_of(const RoleLaunch& r) { return r.role == "prefill" ? shm::Role::Prefill : shm::Role::Decode; }

bool Launcher::all_running() const {
    const shm::Registry& reg = inst_.registry();
    if (reg.find_running(shm::Role::Front) < 0) return false;
    for (const RoleLaunch& r : roles_)
        if (r.role != "front" && reg.find_running(role_of(r), static_cast<int32_t>(worker_of(r).index)) < 0) return false;
    return true;
}

// What worker `index` of `role` holds (slot -1: none running) plus its messages
// waiting, each message counted as a second item: holds_work when any, busy when it
// has more than it computes alone.
uint64_t Launcher::work_items(shm::Role role, uint32_t index, int32_t slot) const {
    const uint64_t queued =
        role == shm::Role::Prefill ? queued_for_prefill(inst_, index) : queued_for_decode(inst_, index);
    const uint64_t items =
        slot < 0
            ? 0
            : worker_stats(inst_.registry(), static_cast<uint32_t>(slot)).load_items.load(std::memory_order_relaxed);
    return queued > 0 ? items + 2 * queued : items;
}

bool Launcher::holds_work(shm::Role role, uint32_t index, int32_t slot) const {
    return work_items(role, index, slot) > 0;
}

bool Launcher::busy(shm::Role role, uint32_t index, int32_t slot) const {
    // One prompt or one sequence keeps a worker's cores busy, but a second worker
    // would not take any of it (a sequence stays where it runs; a pass is one
    // worker's): only a second one, or one waiting, is work another could have.
    return work_items(role, index, slot) >= 2;
}

void Launcher::rebalance(uint64_t now) {
    shm::Registry& reg = inst_.registry();
    const ServeRings rings = ServeRings::of(inst_.config());
    switch (change_.phase) {
    case Change::Phase::None: {
        if (state_ != LaunchState::Serving) return;
        RoleSample sample[2];
        for (const shm::Role role : {shm::Role::Prefill, shm::Role::Decode}) {
            const uint32_t n = role == shm::Role::Prefill ? rings.n_prefill : rings.n_decode;
            RoleSample& rs = sample[role == shm::Role::Decode];
            for (uint32_t i = 0; i < n; ++i) {
                const int32_t slot = reg.find_running(role, static_cast<int32_t>(i));
                if (slot < 0) continue;
                ++rs.running;
                rs.busy += busy(role, i, slot);
            }
        }
        rebalancer_.observe(now, sample[0], sample[1]);
        const std::optional<shm::Role> from = rebalancer_.decide();
        if (!from) return;
        // R3 and R4: the idle worker of the idle role with the highest index (a
        // successor of an earlier change, when there is one).
        const RoleLaunch* pick = nullptr;
        int32_t pick_slot = -1;
        for (const RoleLaunch& r : roles_) {
            if (r.role == "front" || role_of(r) != *from) continue;
            const uint32_t i = worker_of(r).index;
            const int32_t slot = reg.find_running(*from, static_cast<int32_t>(i));
            if (slot < 0 || holds_work(*from, i, slot)) continue;
            if (!pick || i > worker_of(*pick).index) pick = &r, pick_slot = slot;
        }
        if (!pick) return;  // all of them busy this instant: the next sample decides again
        const shm::Role to = *from == shm::Role::Prefill ? shm::Role::Decode : shm::Role::Prefill;
        std::optional<RoleLaunch> next = successor(*pick, to);
        if (!next) return;  // no index it could take (see successor): the next sample decides again
        const shm::ProcRef who = reg.current(static_cast<uint32_t>(pick_slot));
        if (!reg.set_leaving(who)) return;
        change_ = Change{Change::Phase::Leaving, who, *pick, std::move(*next), now, 0};
        say(fmt::format("{} (pid {}) leaves its role for {} (prefill busy {:.0f}%, decode {:.0f}% over {} s); it is "
                        "given no more work",
                        change_.from.name, reg.pid(who.slot), change_.to.name, 100 * rebalancer_.utilization(shm::Role::Prefill),
                        100 * rebalancer_.utilization(shm::Role::Decode), s_.rebalance_s));
        rebalancer_.reset();
        return;
    }
    case Change::Phase::Leaving: {
        const shm::Role role = role_of(change_.from);
        const uint32_t index = worker_of(change_.from).index;
        LeaveInputs in;
        in.still_leaving = reg.alive(change_.who) && reg.state(change_.who.slot) == shm::ProcState::Leaving;
        in.others_running = reg.find_running(role) >= 0;  // find_running passes the leaving one over
        in.draining = state_ != LaunchState::Serving;
        in.holds_work = holds_work(role, index, static_cast<int32_t>(change_.who.slot));
        in.now_ns = now;
        in.since_ns = change_.since_ns;
        in.quiet_since_ns = change_.quiet_since_ns;
        const LeaveStep step = leave_step(in);
        change_.quiet_since_ns = step.quiet_since_ns;
        switch (step.action) {
        case LeaveAction::Wait: return;
        case LeaveAction::Drop:
            say(fmt::format("{} ended while leaving its role; it keeps it", change_.from.name));
            change_ = {};
            return;
        case LeaveAction::Stay:
            reg.stay_after_all(change_.who);
            say(fmt::format("{} keeps its role ({})", change_.from.name,
                            in.draining          ? "draining"
                            : !in.others_running ? fmt::format("no other {} worker runs now", shm::role_name(role))
                                                 : fmt::format("still working {} s after it was to leave",
                                                               Rebalancer::kLeaveTimeoutNs / kSecond)));
            change_ = {};
            return;
        case LeaveAction::Retire:
            if (!sup_.retire(change_.from.name)) {  // not running under the supervisor this instant
                reg.stay_after_all(change_.who);
                change_ = {};
                return;
            }
            reg.set_assigned(role, index, false);
            change_.phase = Change::Phase::Exiting;
            change_.since_ns = now;
            return;
        }
        return;
    }
    case Change::Phase::Exiting:  // handle_events starts the successor once it exited
        if (now - change_.since_ns > 30 * kSecond) {
            say(fmt::format("{} did not stop within 30 s of SIGTERM; killing it", change_.from.name));
            sup_.kill_role(change_.from.name);
            change_.since_ns = now;
        }
        return;
    case Change::Phase::Starting:
        if (reg.find_running(role_of(change_.to), static_cast<int32_t>(worker_of(change_.to).index)) >= 0) {
            inst_.requests().role_changes(role_of(change_.to) == shm::Role::Decode).fetch_add(1, std::memory_order_relaxed);
            say(fmt::format("{} runs (on CPUs {})", change_.to.name, worker_of(change_.to).cpus));
            change_ = {};
            rebalancer_.reset();  // R5: its first window starts now
        }
        return;
    }
}

// The worker that takes `from`'s CPUs in role `to`, with the settings of a running
// worker of `to`. Its index keeps cores lent only between the plan's partners: a
// worker at an index the plan has (index < the plan's count of its role) always runs
// on the plan's CPUs for it, so that its partner (whose --borrow-cpus the plan fixed)
// borrows the cores it is lent, never another worker's. So the successor takes a
// free planned index of `to` whose planned CPUs are `from`'s (and that index's
// planned lent cores), else the lowest free index past the plan's (lending nothing;
// no planned worker borrows from it); none free: no change.
std::optional<RoleLaunch> Launcher::successor(const RoleLaunch& from, shm::Role to) const {
    const std::string role = shm::role_name(to);
    const ServeRings rings = ServeRings::of(inst_.config());
    const uint32_t n = to == shm::Role::Prefill ? rings.n_prefill : rings.n_decode;
    const shm::Registry& reg = inst_.registry();
    const WorkerSettings& was = worker_of(from);
    auto free_index = [&](uint32_t index) {
        for (const RoleLaunch& r : roles_)
            if (r.role == role && worker_of(r).index == index) return false;
        for (uint32_t s = 0; s < reg.n_slots(); ++s)
            if (reg.alive(reg.current(s)) &&
                reg.slot(s).role.load(std::memory_order_relaxed) == static_cast<uint32_t>(to) &&
                reg.slot(s).index.load(std::memory_order_relaxed) == index)
                return false;
        return true;
    };
    uint32_t planned = 0;  // the plan's count of `to`
    const RoleLaunch* same = nullptr;
    for (const RoleLaunch& p : plan_.roles) {
        if (p.role != role) continue;
        ++planned;
        if (!same && worker_of(p).cpus == was.cpus && free_index(worker_of(p).index)) same = &p;
    }
    std::optional<uint32_t> index;
    if (same) index = worker_of(*same).index;
    for (uint32_t i = planned; !index && i < n; ++i)
        if (free_index(i)) index = i;
    if (!index) return std::nullopt;
    const RoleLaunch* like = nullptr;
    for (const RoleLaunch& r : roles_)
        if (r.role == role) like = &r;
    if (!like) return std::nullopt;  // R3 keeps one; defensive
    RoleLaunch out = *like;
    out.name = fmt::format("{} {}", role, *index);
    out.cpus = from.cpus;
    out.numa = from.numa;
    WorkerSettings ws = worker_of(*like);
    ws.index = *index;
    ws.cpus = was.cpus;
    ws.threads = was.threads;
    ws.numa = was.numa;
    ws.borrow_cpus = same ? worker_of(*same).borrow_cpus : "";
    out.settings = ws;
    return out;
}

void Launcher::start_successor() {
    std::erase_if(roles_, [&](const RoleLaunch& r) { return r.name == change_.from.name; });
    shm::Registry& reg = inst_.registry();
    auto pid = sup_.start({change_.to.name, argv_(change_.to)});
    if (!pid) {
        // The old worker again, in its old role (a fork can fail for a moment).
        say(fmt::format("{} could not start ({}); {} starts again instead", change_.to.name, pid.error().message,
                        change_.from.name));
        if (auto again = sup_.start({change_.from.name, argv_(change_.from)}); again) {
            roles_.push_back(change_.from);
            reg.set_assigned(role_of(change_.from), worker_of(change_.from).index, true);
        } else {
            say(fmt::format("{} could not start either ({}); failing the requests in flight", change_.from.name,
                            again.error().message));
            fail_in_flight(inst_, ReqError::NoWorker);
            failed_ = true;
        }
        change_ = {};
        rebalancer_.reset();
        return;
    }
    roles_.push_back(change_.to);
    reg.set_assigned(role_of(change_.to), worker_of(change_.to).index, true);
    say(fmt::format("{} stopped; {} starts on its CPUs ({}) as pid {}", change_.from.name, change_.to.name,
                    worker_of(change_.to).cpus, *pid));
    change_.phase = Change::Phase::Starting;
}

Status Launcher::start_roles() {
    for (const RoleLaunch& r : plan_.roles)  // /metrics: these indices, not the spares
        if (r.role != "front") inst_.registry().set_assigned(role_of(r), worker_of(r).index, true);
    if (external_) return {};  // their units start them
    for (const RoleLaunch& r : plan_.roles)
        if (auto st = sup_.start({r.name, argv_(r)}); !st) return st.error();
    return {};
}

// `duet instance`: a role that died is recovered (its blocks, its requests re-driven;
// a front's requests left to its successor for the resume window); its unit
// restarts it.
void Launcher::handle_external_events() {
    // Every 20 ms (each look reads /proc once per live role), not every 2 ms turn.
    const uint64_t now = shm::monotonic_ns();
    if (now < next_poll_) return;
    next_poll_ = now + 20'000'000;
    shm::RequestTable& t = inst_.requests();
    for (const Supervisor::Event& e : sup_.poll_registry()) {
        t.worker_restarts().fetch_add(1, std::memory_order_relaxed);  // its unit restarts it
        t.redriven().fetch_add(e.recovered.redriven, std::memory_order_relaxed);
        say(fmt::format("{} (pid {}) is gone; recovered {} KV references, re-drove {} requests{}; its unit restarts it",
                        e.role, e.pid, e.recovered.refs_dropped, e.recovered.redriven,
                        e.recovered.failed ? fmt::format(", failed {} its workers kept dying on", e.recovered.failed)
                                           : std::string()),
            log::Level::Warning);
        if (e.role == "front") sweep_orphans(inst_, window_ns());
    }
}

void Launcher::handle_events() {
    if (external_) return handle_external_events();
    shm::RequestTable& t = inst_.requests();
    for (const Supervisor::Event& e : sup_.poll()) {
        if (state_ == LaunchState::Draining && e.role == "front") {  // drained and gone
            front_exited_ = true;
            continue;
        }
        if (e.retired && change_.phase == Change::Phase::Exiting && e.role == change_.from.name) {
            if (e.recovered.redriven > 0) t.redriven().fetch_add(e.recovered.redriven, std::memory_order_relaxed);
            if (state_ == LaunchState::Serving) {
                start_successor();
            } else {  // draining: nothing new starts
                std::erase_if(roles_, [&](const RoleLaunch& r) { return r.name == change_.from.name; });
                change_ = {};
            }
            continue;
        }
        if (!e.given_up) t.worker_restarts().fetch_add(1, std::memory_order_relaxed);  // /metrics counters
        t.redriven().fetch_add(e.recovered.redriven, std::memory_order_relaxed);
        const std::string next = e.restarted_as ? fmt::format("restarted as pid {}", e.restarted_as)
                                 : e.restart_at_ns
                                     ? fmt::format("restarting in {:.2f} s (it died often: backoff)",
                                                   static_cast<double>(e.restart_at_ns - shm::monotonic_ns()) * 1e-9)
                                     : fmt::format("not restarted: {}", e.why);
        say(fmt::format("{} (pid {}) died ({} {}); recovered {} KV references, re-drove {} requests{}; {}", e.role,
                        e.pid, WIFSIGNALED(e.status) ? "signal" : "exit",
                        WIFSIGNALED(e.status) ? WTERMSIG(e.status) : WEXITSTATUS(e.status), e.recovered.refs_dropped,
                        e.recovered.redriven,
                        e.recovered.failed ? fmt::format(", failed {} its workers kept dying on", e.recovered.failed)
                                           : std::string(),
                        next),
            log::Level::Warning);
        if (e.role == "front") sweep_orphans(inst_, window_ns());  // its clients are gone, or coming back
        if (!e.given_up) continue;
        if (WIFEXITED(e.status) && WEXITSTATUS(e.status) == kGoldenExitCode) {
            say(fmt::format("{} failed its golden-logits check (its log above says how): this model does not compute "
                            "what it should here; stopping with exit code {}",
                            e.role, kGoldenExitCode),
                log::Level::Error);
            fail_in_flight(inst_, ReqError::NoWorker);
            failed_ = golden_failed_ = true;
        } else {
            // It cannot start (say the front cannot bind its port): nothing can serve
            // requests. Fail them all with a clear error, drain, exit 1 (systemd
            // restarts the whole service).
            say(fmt::format("giving up on {}; failing the requests in flight", e.role), log::Level::Error);
            fail_in_flight(inst_, ReqError::NoWorker);
            failed_ = true;
        }
    }
}

void Launcher::turn(const std::string& model_id) {
    LaunchInputs in;
    in.now_ns = shm::monotonic_ns();
    in.all_running = all_running();
    in.stop = stop_.load(std::memory_order_relaxed) || failed_;
    in.front_exited = front_exited_;
    in.start_deadline_ns = start_deadline_;
    in.drain_deadline_ns = drain_deadline_;
    in.front_killed = front_killed_;
    const LaunchStep step = launch_step(state_, in);
    SdNotify& sd = SdNotify::get();
    sd.watchdog(in.now_ns);  // from the supervision loop itself
    if (step.announce && external_) {
        say(fmt::format("every role runs: the front, {} prefill and {} decode (instance {})", plan_.layout.n_prefill,
                        plan_.layout.n_decode, plan_.layout.instance));
        sd.status(fmt::format("instance {}: every role runs", plan_.layout.instance));
    } else if (step.announce) {
        say(fmt::format("listening on http://{}:{} (model {}, instance {}{}{})", s_.host, s_.port, model_id,
                        plan_.layout.instance, plan_.placed, plan_.gpu_note));
        sd.ready(fmt::format("serving on http://{}:{} (model {}, instance {})", s_.host, s_.port, model_id,
                             plan_.layout.instance));
    }
    if (step.start_timed_out) {
        say(fmt::format("the roles did not all start within {} s (--start-timeout)", plan_.start_timeout_s));
        failed_ = true;
    }
    state_ = step.next;
    if (step.retire_front) {
        drain_deadline_ = in.now_ns + static_cast<uint64_t>(s_.grace_s + 15) * kSecond;
        say(fmt::format("draining (grace {} s)", s_.grace_s));
        sd.stopping(fmt::format("draining (grace {} s)", s_.grace_s));
        if (!sup_.retire("front")) state_ = LaunchState::Done;  // no front (it gave up, or never started)
    }
    if (state_ == LaunchState::Done) return;
    handle_events();
    const uint64_t now = shm::monotonic_ns();
    if (now >= next_sweep_) {  // requests of a dead front that ended since; re-drives stranded on a dead prefill
        sweep_orphans(inst_, window_ns());
        redrive_.resend_stranded();
        next_sweep_ = now + 50'000'000;
        if (s_.rebalance_s > 0 && !external_) rebalance(now);
    }
    if (now >= next_swap_sweep_) {
        sweep_swap_dir();
        next_swap_sweep_ = now + 5'000'000'000ull;
    }
    if (state_ == LaunchState::Serving && now >= next_status_ && SdNotify::get().enabled()) {  // systemctl status
        const shm::RequestTable& t = inst_.requests();
        SdNotify::get().status(fmt::format("serving: {} requests in flight, {} role restarts", in_flight(t),
                                           t.worker_restarts().load(std::memory_order_relaxed)));
        next_status_ = now + 2'000'000'000ull;
    }
    if (step.kill_front) {
        say("the front outlived its drain; killing it");
        sup_.kill_role("front");
        front_killed_ = true;
    }
}

void Launcher::sweep_swap_dir() {
    const std::string dir = swap_dir_of(s_, plan_.layout.instance);
    if (dir.empty()) return;
    const shm::RequestTable& t = inst_.requests();
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
        const std::string name = e.path().filename().string();
        unsigned slot = 0, gen = 0;
        int used = 0;
        bool stale = false;
        if (std::sscanf(name.c_str(), "%u.%u.kvblob%n", &slot, &gen, &used) == 2 &&
            static_cast<size_t>(used) == name.size()) {
            if (slot >= t.n_slots() || t.current(slot).gen != gen) {
                stale = true;
            } else {
                const shm::ReqState st = t.state(slot);
                stale = st == shm::ReqState::Free || st == shm::ReqState::Finished || st == shm::ReqState::Failed ||
                        st == shm::ReqState::Cancelled;
            }
        } else if (name.find(".kvblob.tmp.") != std::string::npos) {
            // A write in progress takes milliseconds: one a minute old was abandoned.
            const auto age = std::filesystem::file_time_type::clock::now() - e.last_write_time(ec);
            stale = !ec && age > std::chrono::minutes(1);
        }
        if (stale) std::filesystem::remove(e.path(), ec);
    }
}

int Launcher::run(const std::string& model_id, const std::vector<pid_t>& taken_from) {
    if (Status st = start_roles(); !st) {
        say(st.error().message);
        failed_ = true;
    }
    start_deadline_ = shm::monotonic_ns() + static_cast<uint64_t>(plan_.start_timeout_s) * kSecond;
    if (external_ && !taken_from.empty()) {
        // Its predecessor died; the roles ran on. What that one held (the re-drives
        // it had not sent) is ours now, and roles that died meanwhile are recovered
        // by the first turn's poll.
        start_deadline_ = UINT64_MAX;
        if (auto took = sup_.take_over(); !took) {
            // Another supervisor runs (started beside this one): the instance is its;
            // this one leaves without touching its roles or its segments.
            say(took.error().message, log::Level::Error);
            abandoned_ = true;
            return 1;
        }
        const uint32_t busy = in_flight(inst_.requests());
        SdNotify::get().ready(
            fmt::format("instance {} taken over; {} requests in flight", plan_.layout.instance, busy));
        say(fmt::format("instance {} taken over{}, whose roles ran on: {} requests in flight go on",
                        plan_.layout.instance,
                        taken_from.front() > 0 ? fmt::format(" from pid {} (gone)", taken_from.front()) : "", busy),
            log::Level::Warning);
    } else if (external_) {
        // Ready once the instance exists: the role units are ordered after this one.
        start_deadline_ = UINT64_MAX;
        SdNotify::get().ready(fmt::format("instance {} created; waiting for its roles' units", plan_.layout.instance));
        say(fmt::format("instance {} created; its roles are started by their units (duet front, prefill, decode)",
                        plan_.layout.instance));
    } else {
        // The start may take --start-timeout (a big model), past TimeoutStartSec's default.
        SdNotify::get().extend_timeout(static_cast<uint64_t>(plan_.start_timeout_s + 10) * 1'000'000ull);
        SdNotify::get().status("starting the roles");
    }
    while (state_ != LaunchState::Done) {
        turn(model_id);
        if (state_ != LaunchState::Done) std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    // Stopping: the roles systemd started do not stop with this unit (they outlive
    // its crash: taken over), so a stop of the instance alone stops them here; under
    // `systemctl stop duet.target` they stopped first (ordered after it).
    if (external_ && !abandoned_) {
        // The front's drain (--grace) and 10 s more, within the unit's TimeoutStopSec=.
        if (const size_t n = sup_.stop_registered(std::min(s_.grace_s + 10, 45) * 1000, 10000); n > 0)
            say(fmt::format("stopped the {} role(s) still running on the instance", n));
    }
    sweep_orphans(inst_, 0);  // stopping: nobody will come back for them
    int rc = golden_failed_ ? kGoldenExitCode : failed_ ? 1 : 0;
    if (Status st = sup_.stop_all(10000); !st) {
        say(st.error().message);
        if (rc == 0) rc = 1;  // a golden failure's 3 stays (the other worker may exit 3 too)
    }
    return rc;
}

// What `duet instance` found at its start: an instance whose segments live roles
// still hold (inst set), taken over from the supervisors in `from`; or none (inst
// empty: create it).
struct TakenOver {
    std::optional<Result<shm::Instance>> inst;
    std::vector<pid_t> from;
};

// `duet instance` after its predecessor died (SIGKILL, the OOM killer, a crash): the
// roles' units do not stop with the instance, so its segments are still held and
// its requests still run. Attaching to them instead of creating new ones loses
// nothing. An instance with GPU arenas cannot be: the fd keeper that hands their
// device memory to a restarted worker died with its predecessor, so its roles are
// stopped (their units restart them onto the new instance) and it is made afresh.
// An error when another supervisor of it still runs, or when the live instance was
// made with another configuration (the roles then run on: stop them first).
Result<TakenOver> take_over_instance(const shm::InstanceConfig& cfg, const ServePlan& plan) {
    TakenOver out;
    if (!shm::Segment::in_use("duet." + cfg.name)) return out;
    std::optional<Result<shm::Instance>> held(shm::Instance::open(cfg));
    Result<shm::Instance>& live = *held;
    if (!live) {
        if (!shm::Segment::in_use("duet." + cfg.name)) return out;  // its last role went meanwhile: stale
        return make_error(
            "instance {} is held by running processes and cannot be taken over ({}); stop its roles "
            "(systemctl stop duet.target) and start it again",
            cfg.name, live.error().message);
    }
    shm::Registry& reg = live->registry();
    std::vector<pid_t> roles;
    for (uint32_t s = 0; s < reg.n_slots(); ++s) {
        const shm::ProcRef r = reg.current(s);
        if (!reg.alive(r) || !reg.process_running(r)) {
            if (reg.state(s) != shm::ProcState::Free &&
                static_cast<shm::Role>(reg.slot(s).role.load(std::memory_order_relaxed)) == shm::Role::Launcher)
                out.from.push_back(reg.pid(s));
            continue;
        }
        if (static_cast<shm::Role>(reg.slot(s).role.load(std::memory_order_relaxed)) == shm::Role::Launcher)
            return make_error("instance {} is supervised by a running process (pid {})", cfg.name, reg.pid(s));
        roles.push_back(reg.pid(s));
    }
    if (!plan.gpus.empty()) {
        say(fmt::format("instance {} is held by {} running role(s), but its GPU arenas' fd keeper died with its "
                        "supervisor: stopping them (their units start them again) and making it afresh",
                        cfg.name, roles.size()),
            log::Level::Warning);
        for (const pid_t pid : roles) kill(pid, SIGKILL);
        held.reset();  // its mappings and locks: the segments are stale once the roles are gone
        for (int i = 0; i < 3000 && shm::Segment::in_use("duet." + cfg.name); ++i)
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
        out.from.clear();
        return out;  // create() replaces the stale segments, or says who holds them still
    }
    if (out.from.empty()) out.from.push_back(0);  // held by roles alone (its supervisor's slot was freed)
    out.inst = std::move(held);
    return out;
}

}  // namespace

std::string swap_dir_of(const ServeSettings& s, const std::string& instance) {
    if (s.swap_root.empty()) return "";
    return (std::filesystem::path(s.swap_root) / ("duet-swap-" + instance)).string();
}

int run_launcher(const ServeSettings& s, const ServePlan& plan, const Model& model, const ArgvBuilder& argv,
                 const std::atomic<bool>& stop, RoleStart start) {
    // Each run names its instance serve-<pid>, so a launcher that was SIGKILLed (the
    // OOM killer) leaves segments that no later start would replace by name: any
    // such segment of this scope that no live process holds (its OFD locks say so)
    // goes now. A named instance's stale segments are replaced when it starts again.
    if (const int stale = remove_stale_segments("serve-"); stale > 0)
        say(fmt::format("removed {} stale shared-memory segment(s) that no live process held", stale));
    const shm::InstanceConfig cfg = serve_instance_config(plan.layout, model);
    auto taken = start == RoleStart::External ? take_over_instance(cfg, plan) : Result<TakenOver>(TakenOver{});
    if (!taken) {
        say(taken.error().message, log::Level::Error);
        return 1;
    }
    auto inst = taken->inst ? std::move(*taken->inst) : shm::Instance::create(cfg);
    if (!inst) {
        say(inst.error().message);
        return 1;
    }
    const bool adopted = !taken->from.empty();
    const KvLayout kl = kv_layout(model, plan.layout.kv_dtype);
    const uint32_t blocks = inst->arena(0).n_blocks();
    say(fmt::format("KV {}, {} arena(s) of {} blocks ({:.2f} GiB, {} tokens) each", kv_dtype_name(kl.dtype),
                    inst->n_arenas(), blocks,
                    static_cast<double>(blocks) * static_cast<double>(kl.block_bytes()) / 1073741824.0,
                    static_cast<long long>(blocks) * kl.block_tokens));
    if (plan.bind_arenas && !adopted) bind_arenas(*inst, plan);
    // The workers' swap directory, empty (a previous run's blobs are of requests that
    // are gone; a taken-over instance's are of its requests, kept), and gone again at
    // the end.
    const std::string swap_dir = swap_dir_of(s, plan.layout.instance);
    if (!swap_dir.empty() && !adopted) {
        std::error_code ec;
        std::filesystem::remove_all(swap_dir, ec);
        std::filesystem::create_directories(swap_dir, ec);
        if (!ec) std::filesystem::permissions(swap_dir, std::filesystem::perms::owner_all, ec);
        if (ec) say(fmt::format("swap directory {}: {} (preemption recomputes)", swap_dir, ec.message()));
    }
    struct RemoveSwap {
        std::string dir;
        ~RemoveSwap() {
            std::error_code ec;
            if (!dir.empty()) std::filesystem::remove_all(dir, ec);
        }
    } remove_swap{swap_dir};
    auto holds = hold_gpu_arenas(*inst, plan, kl);
    auto self = holds ? inst->registry().claim(shm::Role::Launcher, -1, getpid()) : Result<shm::ProcRef>(holds.error());
    if (!self) {  // before any role started: nothing left behind (a taken-over instance's roles run on)
        if (!adopted) shm::Instance::unlink(plan.layout.instance);
        if (adopted) remove_swap.dir.clear();  // its blobs are the running requests'
        say(self.error().message);
        return 1;
    }
    inst->registry().set_running(*self);
    int rc = 0;
    bool abandoned = false;
    {
        Launcher l(*inst, *self, s, plan, argv, stop, start);
        rc = l.run(std::filesystem::path(s.model).stem().string(), taken->from);
        abandoned = l.abandoned();
    }
    inst->registry().release(*self);
    if (abandoned) {  // another supervisor's instance: its segments and swap blobs stay
        remove_swap.dir.clear();
        return rc;
    }
    shm::Instance::unlink(plan.layout.instance);
    say("stopped");
    return rc;
}

}  // namespace duet
