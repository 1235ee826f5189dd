// The launch plan (roles/launcher.h): from the settings and the machine's facts to
// the workers, their devices, cores and arenas (plan_serve), and the launcher's
// state machine as a pure function (launch_step). No processes, no I/O: the
// launcher (launcher.cpp) runs what these decide.
#include <algorithm>
#include <limits>
#include <optional>

#include "base/thread_pool.h"
#include "engine/scheduling.h"
#include "model/gpu_plan.h"
#include "roles/launcher.h"

namespace duet {

// ---------------------------------------------------------------- the plan

Result<std::vector<DeviceSpec>> parse_device_list(const std::string& text, bool kv_split,
                                                  const std::function<Status(const DeviceSpec&)>& check) {
    std::vector<DeviceSpec> gpus;
    for (size_t at = 0; at <= text.size();) {
        const size_t comma = std::min(text.find(',', at), text.size());
        auto d = parse_device(text.substr(at, comma - at));
        if (!d) return d.error();
        if (d->cuda) {
            if (check)
                if (Status st = check(*d); !st) return st.error();
            // A GPU named twice: with per-role arenas, prefill and decode on one GPU with
            // an arena each (hand-offs copy device to device); else a mistake.
            for (const DeviceSpec& g : gpus)
                if (g == *d && !kv_split) return make_error("--device names {} twice", d->name());
            gpus.push_back(*d);
        } else if (text.find(',') != std::string::npos) {
            return make_error("--device: cpu or a list of GPUs (cuda:0,cuda:1), not both");
        }
        at = comma + 1;
    }
    return gpus;
}

namespace {

struct WorkerCounts {
    int prefill = 1, decode = 1;
};

// CPU: as asked. GPUs: a pair per GPU, or (per-role arenas) prefill on the first
// --prefill-workers GPUs and decode on the others.
Result<WorkerCounts> worker_counts(const ServeSettings& s, int n_gpus, bool kv_split) {
    if (n_gpus == 0) {
        if (Status st = check_worker_counts(s.prefill_workers, s.decode_workers); !st) return st.error();
        return WorkerCounts{s.prefill_workers, s.decode_workers};
    }
    if (Status st = check_gpu_count(n_gpus); !st) return st.error();
    if (!kv_split) {
        if (s.prefill_workers != 1 || s.decode_workers != 1)
            return make_error(
                "--prefill-workers / --decode-workers: on GPUs there is a prefill and a decode worker per "
                "GPU (or, --kv-arenas per-role, prefill on the first --prefill-workers GPUs and decode on "
                "the rest)");
        return WorkerCounts{n_gpus, n_gpus};
    }
    const int n_decode = n_gpus - s.prefill_workers;
    if (n_decode < 1 || (s.decode_workers != 1 && s.decode_workers != n_decode))
        return make_error(
            "--kv-arenas per-role on {} GPUs: prefill on the first --prefill-workers ({}), decode on the "
            "others (at least one; --decode-workers, if given, their number)",
            n_gpus, s.prefill_workers);
    return WorkerCounts{s.prefill_workers, n_decode};
}

// What plan_placement is asked: the counts, the GPUs by hwloc's numbering (matched
// by PCI address, as CUDA_VISIBLE_DEVICES renumbers CUDA's), the CPU overrides.
Result<PlanOptions> placement_options(const ServeSettings& s, const ServeFacts& f, WorkerCounts n, bool kv_split,
                                      std::string& gpu_note) {
    PlanOptions po;
    po.prefill_workers = n.prefill;
    po.decode_workers = n.decode;
    const bool gpus = !f.gpus.empty();
    if (gpus && kv_split) po.prefill_gpus = n.prefill;
    if (gpus) {
        if (!s.prefill_cpus.empty() || !s.decode_cpus.empty())
            return make_error(
                "--prefill-cpus and --decode-cpus place CPU workers; with --device the workers go on "
                "cores close to their GPU");
        for (const GpuFacts& g : f.gpus) {
            for (const MachineGpu& m : f.machine.gpus)
                if (!g.pci.empty() && m.pci == g.pci) po.devices.push_back(m.device);
            if (po.devices.size() != static_cast<size_t>(&g - f.gpus.data() + 1)) {
                gpu_note =
                    fmt::format(" ({} at PCI address '{}' not found on the PCI bus: workers placed as for the CPU)",
                                g.device.name(), g.pci);
                po.devices.clear();
                break;
            }
        }
    }
    for (auto [text, out] : {std::pair{&s.front_cpus, &po.front_cpus}, std::pair{&s.prefill_cpus, &po.prefill_cpus},
                             std::pair{&s.decode_cpus, &po.decode_cpus}}) {
        if (text->empty()) continue;
        auto l = parse_cpu_list(*text);
        if (!l) return l.error();
        *out = *l;
    }
    return po;
}

// The KV blocks of each GPU's arena: what the weights (one bf16 copy per GPU, shared
// by its pair) and scratch leave of --kv-memory of the smallest GPU.
Result<uint32_t> plan_gpu_blocks(const ServeSettings& s, const ServeFacts& f, int n_prefill, bool kv_split) {
    uint32_t blocks = UINT32_MAX;
    for (const GpuFacts& g : f.gpus) {
        // A GPU listed k times (per-role arenas, both roles on it) holds k arenas:
        // each plans within 1/k of it (weights and scratch counted in each share).
        const auto k = static_cast<uint64_t>(
            std::count_if(f.gpus.begin(), f.gpus.end(), [&](const GpuFacts& o) { return o.device == g.device; }));
        // Scratch: two CUDA contexts, activations, cuBLAS, graphs (2 GiB); a decode
        // GPU of per-role arenas may also hold a context of each prefill process
        // (copies to it without peer access run in its context): 512 MiB each.
        const uint64_t scratch = (2ull << 30) + (kv_split ? static_cast<uint64_t>(n_prefill) * (512ull << 20) : 0);
        auto p = plan_device_arena(f.kv, g.total_memory / k, s.kv_memory, f.gpu_weight_bytes, scratch, 2ull << 20);
        if (!p) return make_error("{}: {}", g.device.name(), p.error().message);
        blocks = std::min(blocks, p->n_blocks);
    }
    return blocks;
}

// "prefill" when the role has one worker, else "prefill 1".
std::string role_name_of(const Placement& p, const PlanOptions& po) {
    const int n = p.role == "prefill" ? po.prefill_workers : p.role == "decode" ? po.decode_workers : 1;
    return n > 1 ? fmt::format("{} {}", p.role, p.index) : p.role;
}

// Each placed process as the child it is started as.
std::vector<RoleLaunch> role_launches(const ServeSettings& s, const ServePlan& plan, const Plan& placed,
                                      const PlanOptions& po) {
    std::vector<RoleLaunch> workers;
    RoleLaunch front;
    for (const Placement& p : placed.roles) {
        RoleLaunch r;
        r.role = p.role;
        r.name = role_name_of(p, po);
        r.cpus = p.cpus;
        r.numa = p.numa;
        if (p.role == "front") {
            FrontSettings fs;
            fs.instance = plan.layout.instance;
            fs.model = s.model;
            fs.host = s.host;
            fs.port = s.port;
            fs.io_threads = s.io_threads;
            fs.grace_s = s.grace_s;
            fs.chat_template = s.chat_template;
            fs.contexts_dir = s.contexts_dir;
            fs.contexts_max = s.contexts_max;
            fs.contexts_disk_max = s.contexts_disk_max;
            fs.responses_max = s.responses_max;
            fs.public_metrics = s.public_metrics;
            fs.resume_window_s = s.resume_window_s;
            fs.resume_grace_s = s.resume_grace_s;
            fs.scheduling = s.scheduling;
            if (!p.cpus.empty()) fs.cpus = format_cpu_list(p.cpus);
            r.settings = fs;
            front = std::move(r);
            continue;
        }
        WorkerSettings ws;
        ws.instance = plan.layout.instance;
        ws.model = s.model;
        ws.index = static_cast<uint32_t>(p.index);
        ws.numa = p.numa;
        ws.threads = static_cast<int>(p.cpus.size());
        ws.cpus = format_cpu_list(p.cpus);
        ws.isa = s.isa;
        ws.golden = s.golden;
        ws.swap_dir = swap_dir_of(s, plan.layout.instance);
        if (p.role == "decode") {
            ws.max_batch = s.max_batch;
            ws.max_draft = s.max_draft;
            ws.draft_pool_tokens = s.draft_pool_tokens;
            ws.prefix_cache = s.prefix_cache;  // publishes finished answers' blocks
        }
        if (s.lend_cores && plan.gpus.empty()) ws.borrow_cpus = format_cpu_list(lent_cpus(placed, p));
        if (p.role == "prefill") {
            ws.prefill_budget = s.prefill_budget;
            ws.prefill_pass_ms = s.prefill_pass_ms;
            ws.prefill_cut_window_s = s.prefill_cut_window_s;
            ws.prefix_cache = s.prefix_cache;
            ws.risk_claims = s.risk_claims;
            ws.pass_interrupt = s.pass_interrupt;
        }
        if (!plan.gpus.empty()) {
            // The GPU of the worker's arena (arena i is on the i-th GPU listed): a pair's
            // on its GPU; per-role, prefill p on GPU p and decode d on GPU P + d.
            const bool decode = p.role == "decode";
            const size_t arena = plan.layout.kv_split && decode ? plan.layout.n_prefill + static_cast<uint32_t>(p.index)
                                                                : static_cast<size_t>(p.index);
            ws.device = plan.gpus.at(arena).name();
            ws.cuda_qgemv = s.cuda_qgemv;
        }
        r.settings = ws;
        workers.push_back(std::move(r));
    }
    workers.push_back(std::move(front));
    return workers;
}

}  // namespace

std::vector<int> lent_cpus(const Plan& placed, const Placement& p) {
    if (p.role != "prefill" && p.role != "decode") return {};
    const std::string other = p.role == "prefill" ? "decode" : "prefill";
    std::vector<int> out;
    for (const Placement& q : placed.roles) {
        if (q.role != other || q.index != p.index) continue;
        for (int c : q.cpus) {
            bool shared = std::find(p.cpus.begin(), p.cpus.end(), c) != p.cpus.end();
            for (const Placement& r : placed.roles)
                if (&r != &q && &r != &p && (r.role == "prefill" || r.role == "decode") &&
                    std::find(r.cpus.begin(), r.cpus.end(), c) != r.cpus.end())
                    shared = true;
            if (!shared) out.push_back(c);
        }
    }
    return out;
}

Result<ServePlan> plan_serve(const ServeSettings& s, const ServeFacts& f) {
    if (s.kv_arenas != "shared" && s.kv_arenas != "per-role")
        return make_error("--kv-arenas {}: shared or per-role", s.kv_arenas);
    const bool kv_split = s.kv_arenas == "per-role";
    if (s.ctx < 16 || s.ctx > f.n_ctx_train)
        return make_error("--ctx must be between 16 and the model's {} tokens", f.n_ctx_train);
    auto dtype = parse_kv_dtype(s.kv_dtype);
    if (!dtype) return make_error("--kv-dtype: {}", dtype.error().message);
    if (auto slo = SloTable::parse(s.scheduling.slo); !slo) return slo.error();
    // Contexts offer blocks to the workers and take a completion's back in the arena
    // those compute in (kContextArena: GPU 0's, its requests bound to GPU 0's pair).
    // With per-role GPU arenas a completion ends in a decode GPU's arena
    // (ContextService::open says the same to an instance started otherwise).
    if (!s.contexts_dir.empty() && !f.gpus.empty() && kv_split)
        return make_error(
            "--contexts-dir: contexts on GPUs need each GPU's roles to share its KV arena (--kv-arenas shared): a "
            "context's completion would end in a decode GPU's arena");
    if (!s.contexts_dir.empty() && s.prefill_workers + s.decode_workers >= static_cast<int>(kMaxServeWorkers))
        return make_error("--contexts-dir: the front takes a user of the KV arena: at most {} workers in all",
                          kMaxServeWorkers - 1);
    if (s.mps && f.gpus.empty())
        return make_error(
            "--mps: CUDA MPS shares a GPU between processes; this instance runs on the CPU "
            "(--device cuda:N)");
    if (s.rebalance_s < 0) return make_error("--rebalance {}: seconds, 0 (never) or more", s.rebalance_s);
    if (s.rebalance_s > 0 && !f.gpus.empty())
        return make_error("--rebalance: workers change role on CPU serving only (a GPU's form of it is planned)");
    if (s.rebalance_s > 0 && kv_split)
        return make_error("--rebalance: workers change role with one shared KV arena only (--kv-arenas shared)");
    if (s.rebalance_s > 0 && s.prefill_workers + s.decode_workers < 3)
        return make_error(
            "--rebalance: three workers or more (--prefill-workers + --decode-workers), so that a role keeps one "
            "when another moves");
    ServePlan plan;
    for (const GpuFacts& g : f.gpus) plan.gpus.push_back(g.device);
    const int n_gpus = static_cast<int>(f.gpus.size());
    auto n = worker_counts(s, n_gpus, kv_split);
    if (!n) return n.error();
    auto po = placement_options(s, f, *n, kv_split, plan.gpu_note);
    if (!po) return po.error();
    auto placed = plan_placement(f.machine, *po);
    if (!placed) return placed.error();
    plan.notes = placed->notes;

    ServeLayout& l = plan.layout;
    l.instance = s.instance.empty() ? fmt::format("{}serve-{}", f.shm_scope, f.pid) : s.instance;
    l.n_requests = static_cast<uint32_t>(s.slots);
    l.n_ctx = s.ctx;
    l.n_prefill = static_cast<uint32_t>(n->prefill);
    l.n_decode = static_cast<uint32_t>(n->decode);
    l.n_gpus = static_cast<uint32_t>(n_gpus);
    l.kv_split = kv_split;
    l.kv_dtype = *dtype;
    l.contexts = !s.contexts_dir.empty();
    l.rebalance = s.rebalance_s > 0;
    if (s.contexts_max < 1) return make_error("--contexts-max {}: at least 1", s.contexts_max);
    l.contexts_max = static_cast<uint32_t>(s.contexts_max);
    if (s.kv_blocks < 0 || s.kv_blocks > std::numeric_limits<uint32_t>::max())
        return make_error(
            "--kv-blocks {}: a count of KV blocks, 0 (CPU: sized from --slots and --ctx; GPUs: what "
            "--kv-memory leaves) or more",
            s.kv_blocks);
    l.n_blocks = static_cast<uint32_t>(s.kv_blocks);
    if (n_gpus > 0) {
        // What --kv-memory leaves, capped by --kv-blocks (a small GPU arena shows
        // preemption and swap, as on CPU).
        auto blocks = plan_gpu_blocks(s, f, n->prefill, kv_split);
        if (!blocks) return blocks.error();
        l.n_blocks = s.kv_blocks > 0 ? std::min(*blocks, static_cast<uint32_t>(s.kv_blocks)) : *blocks;
    }
    plan.roles = role_launches(s, plan, *placed, *po);
    for (const Placement& p : placed->roles)  // in the placement's order
        plan.placed += fmt::format(", {} on CPUs {}", role_name_of(p, *po), format_cpu_list(p.cpus));
    // Each role's host arena on its workers' NUMA nodes (run_launcher).
    plan.bind_arenas = n_gpus == 0 && kv_split && f.machine.n_numa > 1;
    plan.start_timeout_s = s.start_timeout_s > 0
                               ? s.start_timeout_s
                               : 60 + static_cast<int>(10.0 * static_cast<double>(f.model_file_bytes) / 1073741824.0);
    return plan;
}

// ---------------------------------------------------------------- the states

const char* launch_state_name(LaunchState s) {
    switch (s) {
        case LaunchState::Starting: return "starting";
        case LaunchState::Serving: return "serving";
        case LaunchState::Draining: return "draining";
        case LaunchState::Done: return "done";
    }
    return "?";
}

LaunchStep launch_step(LaunchState s, const LaunchInputs& in) {
    LaunchStep out;
    out.next = s;
    if (s == LaunchState::Starting) {
        if (in.all_running) {
            out.next = LaunchState::Serving;
            out.announce = true;
        } else if (!in.stop && in.now_ns > in.start_deadline_ns) {
            out.start_timed_out = true;
        }
    }
    if ((out.next == LaunchState::Starting || out.next == LaunchState::Serving) && (in.stop || out.start_timed_out)) {
        // Drain: the front stops admitting, gives running requests the grace period,
        // cancels the rest and exits; it is not restarted.
        out.next = LaunchState::Draining;
        out.retire_front = true;
        return out;
    }
    if (s == LaunchState::Draining) {
        if (in.front_exited)
            out.next = LaunchState::Done;
        else if (!in.front_killed && in.now_ns > in.drain_deadline_ns)
            out.kill_front = true;
    }
    return out;
}

}  // namespace duet
