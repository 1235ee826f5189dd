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
#include <fstream>
#include <optional>
#include <string_view>
#include <thread>

#include "base/log.h"
#include "base/trace.h"
#include "cli/role_flags.h"
#include "engine/backends.h"
#include "engine/golden.h"
#include "kv/shm_kv.h"
#include "model/backend.h"
#include "model/chat_template.h"
#include "model/gpu_plan.h"
#include "model/tokenizer.h"
#include "roles/context_api.h"
#include "roles/front.h"
#include "roles/mps.h"
#include "roles/sd_notify.h"
#include "roles/stop_signal.h"
#include "roles/tool_calls.h"

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

// Another machine than this one, to plan for (duet systemd generate --xml): its
// topology and GPUs from an hwloc XML export, and each GPU's memory where the export
// does not say it.
struct OtherMachine {
    Machine machine;
    uint64_t gpu_memory = 0;
};

// The facts of the world plan_serve reads: the GPUs (each checked), hwloc's
// topology (this machine's, or `other`'s), the model's sizes.
Result<ServeFacts> serve_facts(const ServeSettings& s, const Model& model, const std::vector<DeviceSpec>& gpus,
                               const OtherMachine* other) {
    ServeFacts f;
    for (const DeviceSpec& d : gpus) {  // each checked by parse_device_list
        GpuFacts g;
        g.device = d;
        g.pci = other ? other->machine.gpus[static_cast<size_t>(d.index)].pci : cuda_pci_address(d);
        f.gpus.push_back(std::move(g));
    }
    if (!gpus.empty())
        if (Status st = check_gpu_count(static_cast<int>(gpus.size())); !st) return st.error();
    if (other) {
        f.machine = other->machine;
    } else {
        auto machine = Machine::detect();
        if (!machine) return machine.error();
        f.machine = std::move(machine).value();
    }
    for (GpuFacts& g : f.gpus) {
        if (other) {
            const uint64_t said = other->machine.gpus[static_cast<size_t>(g.device.index)].memory_bytes;
            g.total_memory = other->gpu_memory > 0 ? other->gpu_memory : said;
            if (g.total_memory == 0)
                return make_error(
                    "--xml: the export does not say GPU {}'s memory (it was made without hwloc's CUDA "
                    "backend); give it with --gpu-memory GiB",
                    g.device.index);
            continue;
        }
        auto total = cuda_total_memory(g.device);
        if (!total) return total.error();
        g.total_memory = *total;
    }
    f.n_ctx_train = model.config().n_ctx_train;
    auto dtype = parse_kv_dtype(s.kv_dtype);
    if (!dtype) return make_error("--kv-dtype: {}", dtype.error().message);
    f.kv = kv_layout(model, *dtype);
    if (!gpus.empty()) f.gpu_weight_bytes = bf16_weight_bytes(model);
    f.model_file_bytes = model.file().file_size();
    f.pid = static_cast<int>(getpid());
    auto scope = shm_scope();
    if (!scope) return scope.error();
    f.shm_scope = *scope;
    return f;
}

}  // namespace

namespace {

// What `duet serve`, `duet instance` and `duet systemd generate` share: the settings
// checked and made absolute, the model loaded, the plan for this machine.
struct Prepared {
    ServeSettings s;
    std::unique_ptr<Model> model;
    ServePlan plan;
};

Result<Prepared> prepare_serve(const ServeSettings& settings, bool pick_port, const OtherMachine* other = nullptr) {
    if (settings.kv_arenas != "shared" && settings.kv_arenas != "per-role")
        return make_error("--kv-arenas {}: shared or per-role", settings.kv_arenas);
    auto in_export = [&](const DeviceSpec& d) -> Status {
        if (static_cast<size_t>(d.index) >= other->machine.gpus.size())
            return make_error("{}: the export has {} NVIDIA GPUs", d.name(), other->machine.gpus.size());
        return {};
    };
    auto gpus = other ? parse_device_list(settings.device, settings.kv_arenas == "per-role", in_export)
                      : parse_device_list(settings.device, settings.kv_arenas == "per-role", check_device);
    if (!gpus) return gpus.error();
    SdNotify::init().status(fmt::format("loading {}", settings.model));  // `duet serve` as a Type=notify unit
    auto model = Model::load(settings.model);
    if (!model) return model.error();
    // The front loads these too; failing here gives the error before anything starts.
    auto tok = Tokenizer::from_gguf((*model)->file());
    if (!tok) return tok.error();
    auto tmpl = ChatTemplate::from_gguf((*model)->file(), settings.chat_template);
    if (!tmpl) return tmpl.error();
    // The workers read it again; a missing or malformed file is an error before any starts.
    auto golden = find_golden(settings.golden, settings.model, (*model)->fingerprint());
    if (!golden) return make_error("--golden: {}", golden.error().message);
    ServeSettings s = settings;
    if (s.golden != "auto" && s.golden != "none") s.golden = std::filesystem::absolute(s.golden).string();
    if (!s.contexts_dir.empty()) s.contexts_dir = std::filesystem::absolute(s.contexts_dir).string();
    if (s.port == 0 && pick_port) {
        auto p = free_port(s.host);
        if (!p) return p.error();
        s.port = *p;
    }
    auto facts = serve_facts(s, **model, *gpus, other);
    if (!facts) return facts.error();
    auto plan = plan_serve(s, *facts);
    if (!plan) return plan.error();
    for (const std::string& n : plan->notes) log::notice("placement: " + n);
    Prepared p;
    p.s = std::move(s);
    p.model = std::move(model).value();
    p.plan = std::move(plan).value();
    return p;
}

}  // namespace

int cmd_serve(const ServeSettings& settings, RoleStart start) {
    log::set_name("serve");
    auto fail = [](const std::string& m) {
        log::error(m);
        return 1;
    };
    const std::atomic<bool>& stop = StopSignal::install();
    // --mps: the daemon first, its directories in this environment before anything
    // touches CUDA (prepare_serve queries the GPUs) and for every role started from
    // here; stopped once they are all gone. (On the CPU plan_serve refuses --mps.)
    std::optional<MpsDaemon> mps;
    if (settings.mps && settings.device != "cpu") {
        if (start == RoleStart::External)
            return fail("--mps: under systemd, duet-mps.service runs the daemon (duet systemd generate --mps)");
        std::error_code tec;
        const std::filesystem::path tmp = std::filesystem::temp_directory_path(tec);
        auto d = MpsDaemon::start(
            tec ? "/tmp" : tmp.string(),
            "duet-mps-" + (settings.instance.empty() ? std::string("serve") : settings.instance) + "-");
        if (!d) return fail(d.error().message);
        mps.emplace(std::move(d).value());
        if (Status st = mps->export_env(); !st) return fail(st.error().message);
        log::notice(fmt::format("--mps: control daemon {} up, pipes in {}", mps->pid(), mps->pipe_dir()));
    }
    auto prep = prepare_serve(settings, /*pick_port=*/true);
    if (!prep) return fail(prep.error().message);
    const ServeSettings& s = prep->s;
    if (start == RoleStart::External && s.rebalance_s > 0)
        return fail("--rebalance: workers change role only when `duet serve` starts them (here their units do)");

    std::error_code ec;
    const std::string exe = std::filesystem::read_symlink("/proc/self/exe", ec).string();
    if (ec) return fail("cannot find this executable: " + ec.message());
    // The children inherit the environment: the front reads its key there (an
    // argument would show in every process listing).
    if (!s.api_key.empty() && ::setenv("DUET_API_KEY", s.api_key.c_str(), 1) != 0)
        return fail(fmt::format("DUET_API_KEY: {}", std::strerror(errno)));
    // The trace file: started afresh, each role opens it from DUET_TRACE (and roles
    // restarted later too), closed once they are all gone.
    if (!s.trace.empty()) {
        if (Status st = trace::start_file(s.trace); !st) return fail("--trace: " + st.error().message);
        if (::setenv("DUET_TRACE", s.trace.c_str(), 1) != 0)
            return fail(fmt::format("DUET_TRACE: {}", std::strerror(errno)));
    }
    const int rc = run_launcher(
        s, prep->plan, *prep->model, [&](const RoleLaunch& r) { return role_argv(exe, r); }, stop, start);
    if (mps) {
        if (Status st = mps->stop(); !st) log::error(st.error().message);
    }
    if (!s.trace.empty()) {
        if (Status st = trace::finish_file(s.trace); !st) log::error("--trace: " + st.error().message);
    }
    return rc;
}

int cmd_front(const FrontSettings& a) {
    log::set_name("front");
    auto fail = [](const std::string& m) {
        log::error(m);
        return 1;
    };
    if (Status st = trace::open_from_env("front"); !st) return fail("DUET_TRACE: " + st.error().message);
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
        fo.resume_grace_ns = static_cast<uint64_t>(a.resume_grace_s) * 1'000'000'000ull;
        auto slo = SloTable::parse(a.scheduling.slo);
        if (!slo) return fail(slo.error().message);
        fo.admission.slo = *slo;
        fo.admission.slack = a.scheduling.admit_slack > 0 ? a.scheduling.admit_slack : 1e9;
        fo.admission.queue_high = a.scheduling.admit_queue_tokens;
        fo.admission.queue_low = a.scheduling.admit_queue_tokens / 4 * 3;
        fo.admission.kv_high = a.scheduling.admit_kv;
        fo.admission.kv_low = std::max(0.0, a.scheduling.admit_kv - 0.1);
        fo.request_timeout_s = a.scheduling.request_timeout_s;
        fo.responses_max = static_cast<size_t>(a.responses_max);
        if (!a.contexts_dir.empty()) fo.responses_dir = a.contexts_dir + "/responses";
        // Before the front: it outlives the front, whose coroutines (destroyed with its
        // event loop, a request still running among them) hold blocks they give back
        // to it.
        std::unique_ptr<ContextService> contexts;
        Front front(*inst, *self, **tok, *tmpl, fo);
        log::info(fmt::format("chat template {}; tool calls in the {} format", tmpl->name(),
                              tool_format_name(tool_format_of(tmpl->format()))));
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
            contexts->set_make_room([&front] { return front.release_ended_orphan(); });
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
        log::notice(fmt::format("draining ({} requests in flight, grace {} s)", front.in_flight(), a.grace_s));
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

// ---------------------------------------------------------------- duet systemd

// The unit files of systemd/, built in (systemd_units.cpp, cmake/embed_units.cmake).
size_t systemd_unit_count();
const char* systemd_unit_name(size_t i);
const char* systemd_unit_text(size_t i);

namespace {

// The units' CacheDirectory=duet (duet-instance, duet-prefill@, duet-decode@).
constexpr const char* kSystemdSwapRoot = "/var/cache/duet";
// duet-mps.service's RuntimeDirectory=: the MPS control daemon's pipes and logs.
constexpr const char* kSystemdMpsDir = "/run/duet-mps";

Status write_text(const std::filesystem::path& path, const std::string& text, std::filesystem::perms mode) {
    std::error_code ec;
    std::filesystem::create_directories(path.parent_path(), ec);
    if (ec) return make_error("{}: {}", path.parent_path().string(), ec.message());
    const std::string tmp = path.string() + ".tmp";
    {
        std::ofstream f(tmp, std::ios::trunc);
        f << text;
        if (!f.flush()) return make_error("cannot write {}", tmp);
    }
    std::filesystem::permissions(tmp, mode, ec);
    std::filesystem::rename(tmp, path, ec);
    if (ec) return make_error("{}: {}", path.string(), ec.message());
    return {};
}

// A word of an Environment= value or of an environment file line, quoted for both.
std::string env_quote(const std::string& v) {
    std::string q = "\"";
    for (char c : v) {
        if (c == '"' || c == '\\') q += '\\';
        q += c;
    }
    return q + "\"";
}

// argv less what a unit's ExecStart line gives itself (the executable, the role, and
// the flags named), joined for an environment variable that ExecStart splits ($VAR).
std::string args_without(const std::vector<std::string>& argv, std::initializer_list<std::string_view> drop) {
    std::string out;
    for (size_t i = 2; i < argv.size(); ++i) {
        const bool flag_with_value = argv[i].rfind("--", 0) == 0 && i + 1 < argv.size() && argv[i + 1].rfind("--", 0) != 0;
        if (std::find(drop.begin(), drop.end(), argv[i]) != drop.end()) {
            if (flag_with_value) ++i;
            continue;
        }
        if (argv[i].find_first_of(" \t\"'\\$%") != std::string::npos)
            continue;  // not representable as one word of a $VAR expansion: never in our flags' values
        out += (out.empty() ? "" : " ") + argv[i];
    }
    return out;
}

}  // namespace

int cmd_systemd_generate(const ServeSettings& settings, const SystemdArgs& a) {
    auto fail = [](const std::string& m) {
        std::fprintf(stderr, "duet systemd generate: %s\n", m.c_str());
        return 1;
    };
    if (settings.rebalance_s > 0)
        return fail("--rebalance: workers change role only when `duet serve` starts them (here their units do)");
    ServeSettings in = settings;
    in.model = std::filesystem::absolute(in.model).string();
    if (in.instance.empty()) in.instance = "duet";
    // The swap directory: every unit has a private /tmp and /var/tmp (PrivateTmp=),
    // where a worker would not see the directory the instance made, and
    // ProtectSystem=strict leaves it no other place to write but the CacheDirectory=
    // (duet) of the instance's and the workers' units: there, shared by them.
    // Only there (or nowhere: "", recompute): anywhere else the units could not write,
    // and both sides would quietly recompute. (duet serve's default, /var/tmp, is
    // taken for "not given", whether given or not.)
    if (in.swap_root == ServeSettings{}.swap_root) in.swap_root = kSystemdSwapRoot;
    const std::string root = kSystemdSwapRoot;
    if (!in.swap_root.empty() && ((in.swap_root != root && !in.swap_root.starts_with(root + "/")) ||
                                  in.swap_root.find_first_of(" \t\n\"'\\$") != std::string::npos))
        return fail(fmt::format("--swap-root {}: the units write only under {} (their CacheDirectory=; /tmp and "
                                "/var/tmp are private to each unit, the rest of the system read-only), with no "
                                "spaces or quotes; use {} (the default here), or \"\" to recompute",
                                in.swap_root, root, root));
    if (in.port == 0) return fail("--port: the front's unit needs a fixed port");
    std::optional<OtherMachine> other;
    if (!a.xml.empty()) {
        auto m = Machine::from_xml(a.xml);
        if (!m) return fail(fmt::format("--xml: {}", m.error().message));
        other = OtherMachine{std::move(m).value(), static_cast<uint64_t>(a.gpu_memory_gib * double(1ull << 30))};
    } else if (a.gpu_memory_gib > 0) {
        return fail("--gpu-memory: only with --xml (this machine's GPUs say their memory)");
    }
    auto prep = prepare_serve(in, /*pick_port=*/false, other ? &*other : nullptr);
    if (!prep) return fail(prep.error().message);
    const ServeSettings& s = prep->s;
    const ServePlan& plan = prep->plan;
    const std::filesystem::path out = a.out;
    const auto rw = std::filesystem::perms::owner_read | std::filesystem::perms::owner_write |
                    std::filesystem::perms::group_read | std::filesystem::perms::others_read;
    // The unit files, their ExecStart naming this executable path.
    for (size_t i = 0; i < systemd_unit_count(); ++i) {
        std::string text = systemd_unit_text(i);
        for (size_t at = 0; (at = text.find("/usr/local/bin/duet", at)) != std::string::npos; at += a.exe.size())
            text.replace(at, 19, a.exe);
        if (Status st = write_text(out / systemd_unit_name(i), text, rw); !st) return fail(st.error().message);
    }
    // The environment: what every unit reads (EnvironmentFile=/etc/duet/duet.env).
    std::string inst_args = fmt::format("--ctx {} --slots {} --kv-dtype {} --kv-arenas {} --resume-window {}", s.ctx,
                                        s.slots, s.kv_dtype, s.kv_arenas, s.resume_window_s);
    if (s.device != "cpu") inst_args += fmt::format(" --device {} --kv-memory {}", s.device, s.kv_memory);
    inst_args += fmt::format(" --prefill-workers {} --decode-workers {}", s.prefill_workers, s.decode_workers);
    // (Without a swap root the workers are given no swap directory: they recompute,
    // and the instance's default one, in its private /var/tmp, stays empty.)
    if (!s.swap_root.empty()) inst_args += " --swap-root " + s.swap_root;
    if (s.kv_blocks > 0) inst_args += fmt::format(" --kv-blocks {}", s.kv_blocks);
    if (!s.contexts_dir.empty())
        inst_args += fmt::format(" --contexts-dir {} --contexts-max {}", s.contexts_dir, s.contexts_max);
    if (s.responses_max != 256) inst_args += fmt::format(" --responses-max {}", s.responses_max);
    std::string env = "# duet systemd generate: the environment of every duet unit (/etc/duet/duet.env)\n";
    env += fmt::format("DUET_MODEL={}\nDUET_INSTANCE={}\nDUET_HOST={}\nDUET_PORT={}\n", env_quote(s.model),
                       env_quote(s.instance), env_quote(s.host), s.port);
    env += "DUET_INSTANCE_ARGS=" + env_quote(inst_args) + "\n";
    // --mps: duet-mps.service runs the control daemon; every role finds it here.
    if (s.mps)
        env += fmt::format("CUDA_MPS_PIPE_DIRECTORY={}/pipe\nCUDA_MPS_LOG_DIRECTORY={}/log\n", kSystemdMpsDir,
                           kSystemdMpsDir);
    std::string wants = s.mps ? " duet-mps.service" : "";
    const auto drop_in_mode = rw;
    for (const RoleLaunch& r : plan.roles) {
        const std::vector<std::string> argv = role_argv(a.exe, r);
        std::string conf = "# duet systemd generate: where this role runs on this machine (duet topo)\n";
        if (s.mps) conf += "[Unit]\nAfter=duet-mps.service\n";  // its CUDA contexts open under the daemon
        conf += "[Service]\n";
        std::string unit;
        if (r.role == "front") {
            env += "DUET_FRONT_ARGS=" + env_quote(args_without(argv, {"--instance", "--model", "--host", "--port"})) + "\n";
            unit = "duet-front.service";
        } else {
            const auto& w = std::get<WorkerSettings>(r.settings);
            unit = fmt::format("duet-{}@{}.service", r.role, w.index);
            wants += " " + unit;
            conf += "Environment=" +
                    env_quote("DUET_WORKER_ARGS=" + args_without(argv, {"--instance", "--model", "--index"})) + "\n";
            if (r.numa >= 0) conf += fmt::format("NUMAPolicy=bind\nNUMAMask={}\n", r.numa);
        }
        if (!r.cpus.empty()) conf += "CPUAffinity=" + format_cpu_list(r.cpus) + "\n";
        if (Status st = write_text(out / (unit + ".d") / "placement.conf", conf, drop_in_mode); !st)
            return fail(st.error().message);
    }
    if (!s.api_key.empty()) env += "DUET_API_KEY=" + env_quote(s.api_key) + "\n";
    // The env file holds the API key when there is one: its owner reads it alone.
    if (Status st = write_text(out / "duet.env", env, std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
        !st)
        return fail(st.error().message);
    // The workers this machine runs: started with the target, and again with the
    // instance when systemd restarts it after a stop (a crash leaves them running).
    // With --mps the instance also starts after the daemon (it may open CUDA contexts:
    // the legacy IPC arenas' holder).
    const std::string wanted = "# duet systemd generate: the roles of this machine\n[Unit]\nWants=duet-front.service" +
                               wants + "\n" + (s.mps ? "After=duet-mps.service\n" : "");
    for (const char* unit : {"duet.target", "duet-instance.service"})
        if (Status st = write_text(out / (std::string(unit) + ".d") / "roles.conf", wanted, drop_in_mode); !st)
            return fail(st.error().message);
    std::printf("wrote %s: the units, drop-ins for the front, %u prefill and %u decode workers (instance %s), and "
                "duet.env\ninstall: duet systemd install %s  (then: systemctl daemon-reload && systemctl enable --now "
                "duet.target)\n",
                out.c_str(), plan.layout.n_prefill, plan.layout.n_decode, s.instance.c_str(), out.c_str());
    return 0;
}

int cmd_systemd_install(const SystemdArgs& a) {
    auto fail = [](const std::string& m) {
        std::fprintf(stderr, "duet systemd install: %s\n", m.c_str());
        return 1;
    };
    namespace fs = std::filesystem;
    const fs::path from = a.out, root = a.root.empty() ? fs::path("/") : fs::path(a.root);
    const fs::path units = root / "etc/systemd/system", etc = root / "etc/duet";
    std::error_code ec;
    if (!fs::exists(from / "duet-instance.service", ec))
        return fail(fmt::format("{} holds no generated units (duet systemd generate --out {})", from.string(), from.string()));
    fs::create_directories(units, ec);
    fs::create_directories(etc, ec);
    if (ec) return fail(ec.message());
    size_t n = 0;
    for (const fs::directory_entry& e : fs::recursive_directory_iterator(from, ec)) {
        if (!e.is_regular_file()) continue;
        const fs::path rel = fs::relative(e.path(), from);
        const fs::path to = rel == "duet.env" ? etc / "duet.env" : units / rel;
        fs::create_directories(to.parent_path(), ec);
        fs::copy_file(e.path(), to, fs::copy_options::overwrite_existing, ec);
        if (ec) return fail(fmt::format("{} -> {}: {}", e.path().string(), to.string(), ec.message()));
        fs::permissions(to, fs::status(e.path()).permissions(), ec);
        ++n;
    }
    std::printf("installed %zu files under %s (units in %s, the environment in %s)\nnext: systemctl daemon-reload && "
                "systemctl enable --now duet.target\n",
                n, root.c_str(), units.c_str(), (etc / "duet.env").c_str());
    return 0;
}

}  // namespace duet
