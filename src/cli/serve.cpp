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

#include "base/thread_pool.h"
#include "model/cpu_backend.h"
#include "model/device_spec.h"
#include "model/gpu_plan.h"
#include "roles/front.h"
#include "roles/placement.h"
#include "roles/recovery.h"
#include "roles/supervisor.h"
#include "shm/fd_keeper.h"

#if DUET_HAVE_CUDA
#include "cuda/cuda_arena.h"
#endif

namespace duet {

namespace {
std::atomic<bool> g_stop{false};  // set by the signal handler: a process-wide flag by nature
// A flag polled by the supervision loop; nothing is published with it: relaxed.
void on_signal(int) { g_stop.store(true, std::memory_order_relaxed); }

void handle_signals() {
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigaction(SIGTERM, &sa, nullptr);
    sigaction(SIGINT, &sa, nullptr);
    signal(SIGPIPE, SIG_IGN);
}

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

int cmd_serve(const ServeArgs& a) {
    auto fail = [](const std::string& m) {
        std::fprintf(stderr, "duet serve: %s\n", m.c_str());
        return 1;
    };
    // --device cpu, or one or more GPUs: cuda:0 or cuda:0,cuda:1,... (a prefill and a
    // decode worker on each, sharing that GPU's KV arena; with --kv-arenas per-role,
    // prefill on the first --prefill-workers GPUs and decode on the others).
    if (a.kv_arenas != "shared" && a.kv_arenas != "per-role")
        return fail(fmt::format("--kv-arenas {}: shared or per-role", a.kv_arenas));
    const bool kv_split = a.kv_arenas == "per-role";
    std::vector<DeviceSpec> gpus;
    for (size_t at = 0; at <= a.device.size();) {
        const size_t comma = std::min(a.device.find(',', at), a.device.size());
        auto d = parse_device(a.device.substr(at, comma - at));
        if (!d) return fail(d.error().message);
        if (d->cuda) {
            if (Status st = check_device(*d); !st) return fail(st.error().message);
            // A GPU named twice: with per-role arenas, prefill and decode on one GPU with
            // an arena each (hand-offs copy device to device); else a mistake.
            for (const DeviceSpec& g : gpus)
                if (g == *d && !kv_split) return fail(fmt::format("--device names {} twice", d->name()));
            gpus.push_back(*d);
        } else if (a.device.find(',') != std::string::npos) {
            return fail("--device: cpu or a list of GPUs (cuda:0,cuda:1), not both");
        }
        at = comma + 1;
    }
    const int n_gpus = static_cast<int>(gpus.size());
    if (n_gpus > 0) {
        if (Status st = check_gpu_count(n_gpus); !st) return fail(st.error().message);
    }
    auto model = Model::load(a.model);
    if (!model) return fail(model.error().message);
    // The front loads these too; failing here gives the error before anything starts.
    auto tok = Tokenizer::from_gguf((*model)->file());
    if (!tok) return fail(tok.error().message);
    auto tmpl = ChatTemplate::from_gguf((*model)->file(), a.chat_template);
    if (!tmpl) return fail(tmpl.error().message);
    if (a.ctx < 16 || a.ctx > (*model)->config().n_ctx_train)
        return fail(fmt::format("--ctx must be between 16 and the model's {} tokens", (*model)->config().n_ctx_train));
    int port = a.port;
    if (port == 0) {
        auto p = free_port(a.host);
        if (!p) return fail(p.error().message);
        port = *p;
    }

    // Placement: prefill and decode on disjoint cores.
    auto machine = Machine::detect();
    if (!machine) return fail(machine.error().message);
    if (n_gpus == 0)  // on GPUs the GPUs decide (check_gpu_count)
        if (Status st = check_worker_counts(a.prefill_workers, a.decode_workers); !st) return fail(st.error().message);
    int n_prefill = a.prefill_workers, n_decode = a.decode_workers;
    if (n_gpus > 0 && !kv_split) {
        if (a.prefill_workers != 1 || a.decode_workers != 1)
            return fail("--prefill-workers / --decode-workers: on GPUs there is a prefill and a decode worker per GPU "
                        "(or, --kv-arenas per-role, prefill on the first --prefill-workers GPUs and decode on the rest)");
        n_prefill = n_decode = n_gpus;
    } else if (n_gpus > 0) {
        n_decode = n_gpus - a.prefill_workers;
        if (n_decode < 1 || (a.decode_workers != 1 && a.decode_workers != n_decode))
            return fail(fmt::format("--kv-arenas per-role on {} GPUs: prefill on the first --prefill-workers ({}), decode "
                                    "on the others (at least one; --decode-workers, if given, their number)",
                                    n_gpus, a.prefill_workers));
    }
    PlanOptions po;
    po.prefill_workers = n_prefill;
    po.decode_workers = n_decode;
    if (n_gpus > 0 && kv_split) po.prefill_gpus = n_prefill;
    std::string gpu_note;
    if (n_gpus > 0) {
        if (!a.prefill_cpus.empty() || !a.decode_cpus.empty())
            return fail("--prefill-cpus and --decode-cpus place CPU workers; with --device the workers go on cores "
                        "close to their GPU");
        // Each pair on cores close to its GPU: the PCI device's local CPUs (the CUDA
        // ordinal matched by PCI address, as CUDA_VISIBLE_DEVICES renumbers).
        for (const DeviceSpec& d : gpus) {
            const std::string pci = cuda_pci_address(d);
            for (const MachineGpu& g : machine->gpus)
                if (!pci.empty() && g.pci == pci) po.devices.push_back(g.device);
            if (po.devices.size() != static_cast<size_t>(&d - gpus.data() + 1)) {
                gpu_note = fmt::format(" ({} at PCI address '{}' not found on the PCI bus: workers placed as for the CPU)",
                                       d.name(), pci);
                po.devices.clear();
                break;
            }
        }
    }
    for (auto [text, out] : {std::pair{&a.front_cpus, &po.front_cpus}, std::pair{&a.prefill_cpus, &po.prefill_cpus},
                             std::pair{&a.decode_cpus, &po.decode_cpus}}) {
        if (text->empty()) continue;
        auto l = parse_cpu_list(*text);
        if (!l) return fail(l.error().message);
        *out = *l;
    }
    auto plan = plan_placement(*machine, po);
    if (!plan) return fail(plan.error().message);
    for (const std::string& n : plan->notes) std::fprintf(stderr, "duet serve: placement: %s\n", n.c_str());
    std::vector<int> front_cpus;
    std::vector<Placement> workers;  // prefill 0..P-1, then decode 0..D-1
    std::string placed;
    auto name_of = [&](const Placement& p) {  // "prefill" when the role has one worker, else "prefill 1"
        const int n = p.role == "prefill" ? po.prefill_workers : p.role == "decode" ? po.decode_workers : 1;
        return n > 1 ? fmt::format("{} {}", p.role, p.index) : p.role;
    };
    for (const Placement& p : plan->roles) {
        if (p.role == "front") front_cpus = p.cpus;
        else workers.push_back(p);
        placed += fmt::format(", {} on CPUs {}", name_of(p), format_cpu_list(p.cpus));
    }

    ServeLayout layout;
    layout.instance = a.instance.empty() ? fmt::format("serve-{}", getpid()) : a.instance;
    layout.n_requests = static_cast<uint32_t>(a.slots);
    layout.n_ctx = a.ctx;
    layout.n_prefill = static_cast<uint32_t>(n_prefill);
    layout.n_decode = static_cast<uint32_t>(n_decode);
    layout.n_gpus = static_cast<uint32_t>(n_gpus);
    layout.kv_split = kv_split;
    if (auto dt = parse_kv_dtype(a.kv_dtype); !dt) return fail("--kv-dtype: " + dt.error().message);
    else layout.kv_dtype = *dt;
    if (n_gpus > 0) {
        // The KV arenas take what the weights (one bf16 copy per GPU, shared by its
        // pair) and scratch (two CUDA contexts, activations, cuBLAS, graphs: 2 GiB)
        // leave of --kv-memory of the smallest GPU.
        const KvLayout kl = CpuBackend::kv_layout(**model, layout.kv_dtype);
        uint32_t blocks = UINT32_MAX;
        for (const DeviceSpec& g : gpus) {
            auto total = cuda_total_memory(g);
            if (!total) return fail(total.error().message);
            // A GPU listed k times (per-role arenas, both roles on it) holds k arenas:
            // each plans within 1/k of it (weights and scratch counted in each share).
            const auto k = static_cast<uint64_t>(std::count(gpus.begin(), gpus.end(), g));
            // Scratch: two CUDA contexts, activations, cuBLAS, graphs (2 GiB); a decode
            // GPU of per-role arenas may also hold a context of each prefill process
            // (copies to it without peer access run in its context): 512 MiB each.
            const uint64_t scratch = (2ull << 30) + (kv_split ? static_cast<uint64_t>(n_prefill) * (512ull << 20) : 0);
            auto p = plan_device_arena(kl, *total / k, a.kv_memory, bf16_weight_bytes(**model), scratch, 2ull << 20);
            if (!p) return fail(fmt::format("{}: {}", g.name(), p.error().message));
            blocks = std::min(blocks, p->n_blocks);
        }
        layout.n_blocks = blocks;
    }
    auto inst = shm::Instance::create(serve_instance_config(layout, **model));
    if (!inst) return fail(inst.error().message);
    {
        const KvLayout kl = CpuBackend::kv_layout(**model, layout.kv_dtype);
        const uint32_t blocks = inst->arena(0).n_blocks();
        std::fprintf(stderr, "duet serve: KV %s, %zu arena(s) of %u blocks (%.2f GiB, %lld tokens) each\n",
                     kv_dtype_name(kl.dtype), inst->n_arenas(), blocks,
                     static_cast<double>(blocks) * static_cast<double>(kl.block_bytes()) / 1073741824.0,
                     static_cast<long long>(blocks) * kl.block_tokens);
    }
    if (n_gpus == 0 && kv_split && machine->n_numa > 1) {
        // Each role's host arena on its workers' NUMA nodes: decode's pages are
        // written first by prefill (the hand-off copies), so first touch would put
        // them on prefill's node.
        for (const shm::Role role : {shm::Role::Prefill, shm::Role::Decode}) {
            std::vector<int> nodes;
            for (const Placement& w : workers)
                if (w.role == shm::role_name(role)) nodes.push_back(w.numa);
            const uint32_t arena = worker_arena(inst->config(), role, 0);
            const uint64_t bytes = inst->config().cpu_kv_bytes / inst->n_arenas();
            if (Status st = bind_to_nodes(inst->cpu_kv_data(arena), bytes, nodes); !st) {
                std::fprintf(stderr, "duet serve: %s's KV arena: %s (left to first touch)\n", shm::role_name(role),
                             st.error().message.c_str());
            } else if (inst->kv_segment().page_mode() == shm::PageMode::HugeTlb) {
                // hugetlbfs keeps no shared policy: the binding holds for this
                // mapping only, so the pages are faulted in here, now, where it holds.
                volatile uint8_t* p = inst->cpu_kv_data(arena);
                for (uint64_t off = 0; off < bytes; off += 2u << 20) p[off] = 0;
            }
        }
    }
    // GPU serving: the first worker creates the KV arena in device memory and deposits
    // its fd here; the others and restarted ones fetch it; it lives as long as the
    // launcher does (cuda_arena.h).
    std::unique_ptr<shm::FdKeeper> keeper;
#if DUET_HAVE_CUDA
    std::vector<std::unique_ptr<IpcKvArenaOwner>> ipc_arenas;  // the legacy sharing's arenas, held by the launcher
#endif
    auto fail_unlink = [&](const std::string& m) {  // before any role started: nothing left behind
        shm::Instance::unlink(layout.instance);
        return fail(m);
    };
    if (n_gpus > 0) {
        auto k = shm::FdKeeper::start(layout.instance);
        if (!k) return fail_unlink(k.error().message);
        keeper = std::move(k).value();
#if DUET_HAVE_CUDA
        for (size_t g = 0; g < gpus.size(); ++g) {
            auto mode = kv_sharing(gpus[g].index);
            if (!mode) return fail_unlink(mode.error().message);
            if (*mode != KvSharing::Ipc) continue;
            const KvLayout kl = CpuBackend::kv_layout(**model, layout.kv_dtype);
            const uint64_t bytes = kl.block_bytes() * inst->arena(g).n_blocks();
            auto owner = IpcKvArenaOwner::create(layout.instance, static_cast<uint32_t>(g), gpus[g].index, bytes);
            if (!owner) return fail_unlink(owner.error().message);
            ipc_arenas.push_back(std::move(owner).value());
            std::fprintf(stderr, "duet serve: %s's KV arena is shared with legacy CUDA IPC handles (held by the launcher)\n",
                         gpus[g].name().c_str());
        }
#endif
    }
    auto self = inst->registry().claim(shm::Role::Launcher, -1, getpid());
    if (!self) return fail(self.error().message);
    inst->registry().set_running(*self);
    handle_signals();

    std::error_code ec;
    const std::string exe = std::filesystem::read_symlink("/proc/self/exe", ec).string();
    if (ec) return fail("cannot find this executable: " + ec.message());
    const std::string model_id = std::filesystem::path(a.model).stem().string();
    shm::RequestTable& t = inst->requests();
    int rc = 0;
    {
        // Re-driven requests go back to prefill on the launcher's own rings (the
        // front's rings have one producer: the front), to the least busy worker.
        PrefillRouter redrive(*inst, /*redrive=*/true);
        auto resend = [&](shm::ReqRef r) { (void)redrive.send(r); };
        Supervisor sup(*inst, *self, resend);
        auto start_roles = [&]() -> Status {
            for (const Placement& w : workers) {
                std::vector<std::string> argv = {exe, w.role, "--instance", layout.instance, "-m", a.model,
                                                 "--index", std::to_string(w.index), "--numa", std::to_string(w.numa),
                                                 "-t", std::to_string(w.cpus.size()), "--cpus", format_cpu_list(w.cpus)};
                if (!a.isa.empty()) argv.insert(argv.end(), {"--isa", a.isa});
                if (n_gpus > 0) {  // the GPU of the worker's arena (arena i is the i-th GPU listed)
                    const shm::Role role = w.role == "prefill" ? shm::Role::Prefill : shm::Role::Decode;
                    const uint32_t arena = worker_arena(inst->config(), role, static_cast<uint32_t>(w.index));
                    argv.insert(argv.end(), {"--device", gpus.at(arena).name()});
                    if (a.cuda_qgemv) argv.push_back("--cuda-qgemv");
                }
                if (w.role == "prefill") {
                    argv.insert(argv.end(), {"--budget", std::to_string(a.prefill_budget)});
                    if (!a.prefix_cache) argv.push_back("--no-prefix-cache");
                }
                if (auto st = sup.start({name_of(w), argv}); !st) return st.error();
            }
            std::vector<std::string> argv = {exe,    "front",  "--instance", layout.instance,        "-m",
                                             a.model, "--host", a.host,       "--port",               std::to_string(port),
                                             "--io-threads", std::to_string(a.io_threads), "--grace", std::to_string(a.grace_s)};
            if (!a.chat_template.empty()) argv.insert(argv.end(), {"--chat-template", a.chat_template});
            if (!front_cpus.empty()) argv.insert(argv.end(), {"--cpus", format_cpu_list(front_cpus)});
            if (auto st = sup.start({"front", argv}); !st) return st.error();
            return {};
        };
        shm::Registry& reg = inst->registry();
        auto all_running = [&] { return reg.find_running(shm::Role::Front) >= 0 && workers_running(*inst, /*all=*/true); };
        if (Status st = start_roles(); !st) {
            std::fprintf(stderr, "duet serve: %s\n", st.error().message.c_str());
            rc = 1;
            g_stop.store(true, std::memory_order_relaxed);
        }
        const int start_s = a.start_timeout_s > 0
                                ? a.start_timeout_s
                                : 60 + static_cast<int>(10.0 * static_cast<double>((*model)->file().file_size()) / 1073741824.0);
        const uint64_t start_deadline = shm::monotonic_ns() + static_cast<uint64_t>(start_s) * 1'000'000'000ull;
        bool listening = false, draining = false, front_done = false;
        uint64_t drain_deadline = 0, next_sweep = 0;
        while (!front_done) {
            if (!listening && all_running()) {
                listening = true;
                std::fprintf(stderr, "duet serve: listening on http://%s:%d (model %s, instance %s%s%s)\n", a.host.c_str(),
                             port, model_id.c_str(), layout.instance.c_str(), placed.c_str(), gpu_note.c_str());
            }
            if (!listening && !g_stop.load(std::memory_order_relaxed) && shm::monotonic_ns() > start_deadline) {
                std::fprintf(stderr, "duet serve: the roles did not all start within %d s (--start-timeout)\n", start_s);
                rc = 1;
                g_stop.store(true, std::memory_order_relaxed);
            }
            if (g_stop.load(std::memory_order_relaxed) && !draining) {
                // Drain: the front stops admitting, gives running requests the grace
                // period, cancels the rest and exits; it is not restarted.
                draining = true;
                drain_deadline = shm::monotonic_ns() + static_cast<uint64_t>(a.grace_s + 15) * 1'000'000'000ull;
                std::fprintf(stderr, "duet serve: draining (grace %d s)\n", a.grace_s);
                if (!sup.retire("front")) break;  // no front (it gave up, or never started)
            }
            for (const Supervisor::Event& e : sup.poll()) {
                if (draining && e.role == "front") {  // drained and gone
                    front_done = true;
                    continue;
                }
                if (e.restarted_as) t.worker_restarts().fetch_add(1, std::memory_order_relaxed);  // /metrics counters
                t.redriven().fetch_add(e.recovered.redriven, std::memory_order_relaxed);
                std::fprintf(stderr, "duet serve: %s (pid %d) died (%s %d); recovered %llu KV references, re-drove %u requests; %s\n",
                             e.role.c_str(), e.pid, WIFSIGNALED(e.status) ? "signal" : "exit",
                             WIFSIGNALED(e.status) ? WTERMSIG(e.status) : WEXITSTATUS(e.status),
                             static_cast<unsigned long long>(e.recovered.refs_dropped), e.recovered.redriven,
                             e.restarted_as ? fmt::format("restarted as pid {}", e.restarted_as).c_str() : "not restarted");
                if (e.role == "front") sweep_orphans(*inst);  // its clients are gone
                if (!e.restarted_as) {
                    // It kept dying (at start, say the front cannot bind its port): nothing
                    // can serve requests. Fail them all with a clear error, drain, exit 1
                    // (systemd restarts the whole service).
                    std::fprintf(stderr, "duet serve: giving up on %s; failing the requests in flight\n", e.role.c_str());
                    fail_in_flight(*inst, ReqError::NoWorker);
                    rc = 1;
                    g_stop.store(true, std::memory_order_relaxed);
                }
            }
            const uint64_t now = shm::monotonic_ns();
            if (now >= next_sweep) {  // requests of a dead front that ended since; re-drives stranded on a dead prefill
                sweep_orphans(*inst);
                redrive.resend_stranded();
                next_sweep = now + 50'000'000;
            }
            if (draining && now > drain_deadline) {
                std::fprintf(stderr, "duet serve: the front outlived its drain; killing it\n");
                sup.kill_role("front");
                drain_deadline = UINT64_MAX;
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(2));
        }
        sweep_orphans(*inst);
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

int cmd_front(const FrontArgs& a) {
    auto fail = [](const std::string& m) {
        std::fprintf(stderr, "duet front: %s\n", m.c_str());
        return 1;
    };
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
    auto self = inst->registry().claim(shm::Role::Front, -1, getpid());
    if (!self) return fail(self.error().message);
    handle_signals();
    int rc = 0;
    {
        FrontOptions fo;
        fo.host = a.host;
        fo.port = static_cast<uint16_t>(a.port);
        fo.io_threads = a.io_threads;
        fo.model_id = std::filesystem::path(a.model).stem().string();
        Front front(*inst, *self, **tok, *tmpl, fo);
        if (Status st = front.start(); !st) {
            inst->registry().release(*self);
            return fail(st.error().message);
        }
        inst->registry().set_running(*self);
        while (!g_stop.load(std::memory_order_relaxed)) std::this_thread::sleep_for(std::chrono::milliseconds(5));
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
