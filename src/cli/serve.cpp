#include "cli/serve.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <thread>

#include "base/thread_pool.h"
#include "roles/front.h"
#include "roles/placement.h"
#include "roles/supervisor.h"

namespace duet {

namespace {
std::atomic<bool> g_stop{false};  // set by the signal handler: a process-wide flag by nature
void on_signal(int) { g_stop.store(true); }

}  // namespace

int cmd_serve(const ServeArgs& a) {
    auto fail = [](const std::string& m) {
        std::fprintf(stderr, "duet serve: %s\n", m.c_str());
        return 1;
    };
    auto model = Model::load(a.model);
    if (!model) return fail(model.error().message);
    auto tok = Tokenizer::from_gguf((*model)->file());
    if (!tok) return fail(tok.error().message);
    auto tmpl = ChatTemplate::from_gguf((*model)->file(), a.chat_template);
    if (!tmpl) return fail(tmpl.error().message);
    if (a.ctx < 16 || a.ctx > (*model)->config().n_ctx_train)
        return fail(fmt::format("--ctx must be between 16 and the model's {} tokens", (*model)->config().n_ctx_train));

    // Placement: prefill and decode on disjoint cores.
    auto machine = Machine::detect();
    if (!machine) return fail(machine.error().message);
    PlanOptions po;
    for (auto [text, out] : {std::pair{&a.prefill_cpus, &po.prefill_cpus}, std::pair{&a.decode_cpus, &po.decode_cpus}}) {
        if (text->empty()) continue;
        auto l = parse_cpu_list(*text);
        if (!l) return fail(l.error().message);
        *out = *l;
    }
    auto plan = plan_placement(*machine, po);
    if (!plan) return fail(plan.error().message);
    std::vector<int> prefill_cpus, decode_cpus;
    for (const Placement& p : plan->roles) {
        if (p.role == "prefill") prefill_cpus = p.cpus;
        if (p.role == "decode") decode_cpus = p.cpus;
    }

    ServeLayout layout;
    layout.instance = a.instance.empty() ? fmt::format("serve-{}", getpid()) : a.instance;
    layout.n_requests = static_cast<uint32_t>(a.slots);
    layout.n_ctx = a.ctx;
    auto inst = shm::Instance::create(serve_instance_config(layout, **model));
    if (!inst) return fail(inst.error().message);
    auto self = inst->registry().claim(shm::Role::Front, -1, getpid());
    if (!self) return fail(self.error().message);
    inst->registry().set_running(*self);

    FrontOptions fo;
    fo.host = a.host;
    fo.port = static_cast<uint16_t>(a.port);
    fo.io_threads = a.io_threads;
    fo.model_id = std::filesystem::path(a.model).stem().string();
    Front front(*inst, *self, **tok, *tmpl, fo);

    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigaction(SIGTERM, &sa, nullptr);
    sigaction(SIGINT, &sa, nullptr);
    signal(SIGPIPE, SIG_IGN);

    std::error_code ec;
    const std::string exe = std::filesystem::read_symlink("/proc/self/exe", ec).string();
    if (ec) return fail("cannot find this executable: " + ec.message());
    int rc = 0;
    {
        Supervisor sup(*inst, *self, [&](shm::ReqRef r) { (void)front.send(r); });
        for (auto [role, cpus] : {std::pair{"prefill", &prefill_cpus}, std::pair{"decode", &decode_cpus}}) {
            std::vector<std::string> argv = {exe, role, "--instance", layout.instance, "-m", a.model, "-t",
                                             std::to_string(cpus->size()), "--cpus", format_cpu_list(*cpus)};
            if (!a.isa.empty()) argv.insert(argv.end(), {"--isa", a.isa});
            if (std::string(role) == "prefill") {
                argv.insert(argv.end(), {"--budget", std::to_string(a.prefill_budget)});
                if (!a.prefix_cache) argv.push_back("--no-prefix-cache");
            }
            if (auto st = sup.start({role, argv}); !st) return fail(st.error().message);
        }
        if (Status st = front.start(); !st) return fail(st.error().message);
        for (int i = 0; i < 3000 && !(inst->registry().find_running(shm::Role::Prefill) >= 0 &&
                                      inst->registry().find_running(shm::Role::Decode) >= 0);
             ++i) {
            sup.poll();
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
        std::fprintf(stderr, "duet serve: listening on http://%s:%u (model %s, instance %s, prefill on CPUs %s, decode on %s)\n",
                     a.host.c_str(), front.port(), fo.model_id.c_str(), layout.instance.c_str(),
                     format_cpu_list(prefill_cpus).c_str(), format_cpu_list(decode_cpus).c_str());
        while (!g_stop.load()) {
            for (const Supervisor::Event& e : sup.poll()) {
                front.counters().worker_restarts.fetch_add(e.restarted_as ? 1 : 0);
                front.counters().redriven.fetch_add(e.recovered.redriven);
                std::fprintf(stderr, "duet serve: %s (pid %d) died (%s %d); recovered %llu KV references, re-drove %u requests; %s\n",
                             e.role.c_str(), e.pid, WIFSIGNALED(e.status) ? "signal" : "exit",
                             WIFSIGNALED(e.status) ? WTERMSIG(e.status) : WEXITSTATUS(e.status),
                             static_cast<unsigned long long>(e.recovered.refs_dropped), e.recovered.redriven,
                             e.restarted_as ? fmt::format("restarted as pid {}", e.restarted_as).c_str() : "not restarted");
                if (!e.restarted_as) {
                    // It kept dying: nothing can serve requests. Fail them all with a
                    // clear error, stop, exit 1 (systemd restarts the whole service).
                    std::fprintf(stderr, "duet serve: giving up on %s; failing %zu requests in flight\n", e.role.c_str(),
                                 front.in_flight());
                    front.drain();
                    front.fail_all(ReqError::NoWorker);
                    rc = 1;
                    g_stop.store(true);
                }
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(2));
        }
        // Drain.
        std::fprintf(stderr, "duet serve: draining (%zu requests in flight, grace %d s)\n", front.in_flight(), a.grace_s);
        front.drain();
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(a.grace_s);
        while (front.in_flight() > 0 && std::chrono::steady_clock::now() < deadline) {
            sup.poll();
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
        }
        if (front.in_flight() > 0) {
            front.cancel_all();
            for (int i = 0; i < 1000 && front.in_flight() > 0; ++i) {
                sup.poll();
                std::this_thread::sleep_for(std::chrono::milliseconds(5));
            }
        }
        front.stop();
        if (Status st = sup.stop_all(10000); !st) {
            std::fprintf(stderr, "duet serve: %s\n", st.error().message.c_str());
            rc = 1;
        }
    }
    inst->registry().release(*self);
    shm::Instance::unlink(layout.instance);
    std::fprintf(stderr, "duet serve: stopped\n");
    return rc;
}

}  // namespace duet
