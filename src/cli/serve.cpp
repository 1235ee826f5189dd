#include "cli/serve.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sched.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <thread>

#include "cli/role_flags.h"
#include "engine/backends.h"
#include "engine/golden.h"
#include "model/chat_template.h"
#include "model/cpu_backend.h"
#include "model/gpu_plan.h"
#include "model/tokenizer.h"
#include "roles/context_api.h"
#include "roles/front.h"
#include "roles/sd_notify.h"
#include "roles/stop_signal.h"

namespace duet {

namespace {

// A port the kernel says is free now (for --port 0: the front, which may be
// restarted, needs one fixed number).
Result<int> free_port(const std::string& host) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return make_error("socket: {}", std::strerror(errno));
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    if (inet_pton(AF_INET, host.c_str(), &sa.sin_addr) != 1) {
        close(fd);
        return make_error("--host {}: not an IPv4 address (give --port explicitly)", host);
    }
    socklen_t len = sizeof sa;
    if (bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0 ||
        getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len) != 0) {
        const std::string err = std::strerror(errno);
        close(fd);
        return make_error("cannot find a free port on {}: {}", host, err);
    }
    close(fd);
    return static_cast<int>(ntohs(sa.sin_port));
}

}  // namespace

namespace {

// The facts of the world plan_serve reads: the GPUs (each checked), hwloc's
// topology, the model's sizes.
Result<ServeFacts> serve_facts(const ServeSettings& s, const Model& model, const std::vector<DeviceSpec>& gpus) {
    ServeFacts f;
    for (const DeviceSpec& d : gpus) {  // each checked by parse_device_list
        GpuFacts g;
        g.device = d;
        g.pci = cuda_pci_address(d);
        f.gpus.push_back(std::move(g));
    }
    if (!gpus.empty())
        if (Status st = check_gpu_count(static_cast<int>(gpus.size())); !st) return st.error();
    auto machine = Machine::detect();
    if (!machine) return machine.error();
    f.machine = std::move(machine).value();
    for (GpuFacts& g : f.gpus) {
        auto total = cuda_total_memory(g.device);
        if (!total) return total.error();
        g.total_memory = *total;
    }
    f.n_ctx_train = model.config().n_ctx_train;
    auto dtype = parse_kv_dtype(s.kv_dtype);
    if (!dtype) return make_error("--kv-dtype: {}", dtype.error().message);
    f.kv = CpuBackend::kv_layout(model, *dtype);
    if (!gpus.empty()) f.gpu_weight_bytes = bf16_weight_bytes(model);
    f.model_file_bytes = model.file().file_size();
    f.pid = static_cast<int>(getpid());
    return f;
}

}  // namespace

int cmd_serve(const ServeSettings& settings) {
    auto fail = [](const std::string& m) {
        std::fprintf(stderr, "duet serve: %s\n", m.c_str());
        return 1;
    };
    const std::atomic<bool>& stop = StopSignal::install();
    if (settings.kv_arenas != "shared" && settings.kv_arenas != "per-role")
        return fail(fmt::format("--kv-arenas {}: shared or per-role", settings.kv_arenas));
    auto gpus = parse_device_list(settings.device, settings.kv_arenas == "per-role", check_device);
    if (!gpus) return fail(gpus.error().message);
    SdNotify::init().status(fmt::format("loading {}", settings.model));  // `duet serve` as a Type=notify unit
    auto model = Model::load(settings.model);
    if (!model) return fail(model.error().message);
    // The front loads these too; failing here gives the error before anything starts.
    auto tok = Tokenizer::from_gguf((*model)->file());
    if (!tok) return fail(tok.error().message);
    auto tmpl = ChatTemplate::from_gguf((*model)->file(), settings.chat_template);
    if (!tmpl) return fail(tmpl.error().message);
    // The workers read it again; a missing or malformed file is an error before any starts.
    auto golden = find_golden(settings.golden, settings.model, (*model)->fingerprint());
    if (!golden) return fail("--golden: " + golden.error().message);
    ServeSettings s = settings;
    if (s.golden != "auto" && s.golden != "none") s.golden = std::filesystem::absolute(s.golden).string();
    if (!s.contexts_dir.empty()) s.contexts_dir = std::filesystem::absolute(s.contexts_dir).string();
    if (s.port == 0) {
        auto p = free_port(s.host);
        if (!p) return fail(p.error().message);
        s.port = *p;
    }
    auto facts = serve_facts(s, **model, *gpus);
    if (!facts) return fail(facts.error().message);
    auto plan = plan_serve(s, *facts);
    if (!plan) return fail(plan.error().message);
    for (const std::string& n : plan->notes) std::fprintf(stderr, "duet serve: placement: %s\n", n.c_str());
    std::error_code ec;
    const std::string exe = std::filesystem::read_symlink("/proc/self/exe", ec).string();
    if (ec) return fail("cannot find this executable: " + ec.message());
    // The children inherit the environment: the front reads its key there (an
    // argument would show in every process listing).
    if (!s.api_key.empty() && ::setenv("DUET_API_KEY", s.api_key.c_str(), 1) != 0)
        return fail(fmt::format("DUET_API_KEY: {}", std::strerror(errno)));
    return run_launcher(s, *plan, **model, [&](const RoleLaunch& r) { return role_argv(exe, r); }, stop);
}

int cmd_front(const FrontSettings& a) {
    auto fail = [](const std::string& m) {
        std::fprintf(stderr, "duet front: %s\n", m.c_str());
        return 1;
    };
    SdNotify& sd = SdNotify::init();
    sd.status("attaching to instance " + a.instance);
    auto inst = shm::Instance::attach(a.instance);
    if (!inst) return fail(inst.error().message);
    if (Status st = check_instance_workers(inst->config()); !st)
        return fail(fmt::format("instance {} is not a serving instance: {}", a.instance, st.error().message));
    auto model = Model::load(a.model);
    if (!model) return fail(model.error().message);
    if ((*model)->fingerprint() != inst->config().model_fingerprint)
        return fail(fmt::format("{} is not the model instance {} serves", a.model, a.instance));
    auto tok = Tokenizer::from_gguf((*model)->file());
    if (!tok) return fail(tok.error().message);
    auto tmpl = ChatTemplate::from_gguf((*model)->file(), a.chat_template);
    if (!tmpl) return fail(tmpl.error().message);
    if (!a.cpus.empty()) {  // before any thread starts: they all inherit it
        auto cpus = parse_cpu_list(a.cpus);
        if (!cpus) return fail("--cpus: " + cpus.error().message);
        cpu_set_t set;
        CPU_ZERO(&set);
        for (int c : *cpus) CPU_SET(c, &set);
        if (sched_setaffinity(0, sizeof set, &set) != 0) return fail(fmt::format("--cpus {}: {}", a.cpus, std::strerror(errno)));
    }
    const std::atomic<bool>& stop = StopSignal::install();
    auto self = inst->registry().claim(shm::Role::Front, -1, getpid());
    if (!self) return fail(self.error().message);
    int rc = 0;
    {
        FrontOptions fo;
        fo.host = a.host;
        fo.port = static_cast<uint16_t>(a.port);
        fo.io_threads = a.io_threads;
        fo.model_id = std::filesystem::path(a.model).stem().string();
        fo.api_key = a.api_key;
        fo.public_metrics = a.public_metrics;
        fo.resume_window_ns = static_cast<uint64_t>(a.resume_window_s) * 1'000'000'000ull;
        Front front(*inst, *self, **tok, *tmpl, fo);
        std::unique_ptr<ContextService> contexts;
        if (!a.contexts_dir.empty()) {
            std::error_code ec;
            std::filesystem::create_directories(a.contexts_dir, ec);
            std::filesystem::permissions(a.contexts_dir, std::filesystem::perms::owner_all,
                                         std::filesystem::perm_options::replace, ec);
            auto c = ContextService::open(*inst, *self, front.router(), **model, **tok, *tmpl, a.contexts_dir,
                                          static_cast<size_t>(a.contexts_max), a.contexts_disk_max);
            if (!c) {
                inst->registry().release(*self);
                return fail(c.error().message);
            }
            contexts = std::move(c).value();
            front.set_contexts(contexts.get());
        }
        if (Status st = front.start(); !st) {
            inst->registry().release(*self);
            return fail(st.error().message);
        }
        inst->registry().set_running(*self);
        sd.ready(fmt::format("serving on http://{}:{}", a.host, front.port()));
        // WATCHDOG=1 while the event loop turns (its timer ran within half the period).
        const uint64_t stale_ns = std::max<uint64_t>(sd.watchdog_usec() * 500, 200'000'000);
        uint64_t next_status = 0;
        size_t shown = SIZE_MAX;
        while (!stop.load(std::memory_order_relaxed)) {
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
            const uint64_t now = shm::monotonic_ns();
            if (now - std::min(now, front.loop_alive_ns()) < stale_ns) sd.watchdog(now);
            if (sd.enabled() && now >= next_status && front.in_flight() != shown) {  // systemctl status
                shown = front.in_flight();
                sd.status(fmt::format("serving on http://{}:{}: {} requests in flight", a.host, front.port(), shown));
                next_status = now + 2'000'000'000ull;
            }
        }
        sd.stopping(fmt::format("draining {} requests (grace {} s)", front.in_flight(), a.grace_s));
        std::fprintf(stderr, "duet front: draining (%zu requests in flight, grace %d s)\n", front.in_flight(), a.grace_s);
        front.drain();
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(a.grace_s);
        while (front.in_flight() > 0 && std::chrono::steady_clock::now() < deadline)
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
        if (front.in_flight() > 0) {
            front.cancel_all();
            for (int i = 0; i < 1000 && front.in_flight() > 0; ++i)
                std::this_thread::sleep_for(std::chrono::milliseconds(5));
            if (front.in_flight() > 0) rc = 1;
        }
        front.stop();
    }
    inst->registry().release(*self);
    return rc;
}

}  // namespace duet
