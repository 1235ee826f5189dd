#include "cli/worker_roles.h"

#include <atomic>
#include <cstdio>
#include <filesystem>

#include <fmt/format.h>

#include "base/log.h"
#include "base/trace.h"
#include "engine/engine.h"
#include "roles/sd_notify.h"
#include "roles/stop_signal.h"
#include "roles/workers.h"

namespace duet {

int cmd_worker(const WorkerSettings& a, bool prefill) {
    const char* role = prefill ? "prefill" : "decode";
    log::set_name(role);
    if (Status st = trace::open_from_env(fmt::format("{} {}", role, a.index)); !st) {
        log::error("DUET_TRACE: " + st.error().message);
        return 1;
    }
    SdNotify& sd = SdNotify::init();
    sd.status(fmt::format("attaching to instance {}", a.instance));
    auto inst = shm::Instance::attach(a.instance);
    if (!inst) {
        log::error(inst.error().message);
        return 1;
    }
    // Loading (and on a GPU, uploading) a big model outlasts TimeoutStartSec's default:
    // a minute and 10 s per GiB, as `duet serve`'s --start-timeout.
    std::error_code ec;
    const uint64_t model_bytes = std::filesystem::file_size(a.model, ec);
    sd.extend_timeout(60'000'000ull + (ec ? 0 : model_bytes / (1ull << 30) * 10'000'000ull + 10'000'000ull));
    sd.status(fmt::format("loading {}", a.model));
    auto model = Model::load(a.model);
    if (!model) {
        log::error(model.error().message);
        return 1;
    }
    if ((*model)->fingerprint() != inst->config().model_fingerprint) {
        log::error(fmt::format("{} is not the model instance {} serves (fingerprint {:016x}, expected {:016x})",
                               a.model, a.instance, (*model)->fingerprint(), inst->config().model_fingerprint));
        return 2;
    }
    auto golden = find_golden(a.golden, a.model, (*model)->fingerprint());
    if (!golden) {
        log::error("--golden: " + golden.error().message);
        return 2;
    }
    WorkerOptions o;
    o.index = a.index;
    o.numa = a.numa;
    o.threads = a.threads;
    // A CPU list flag ("" : none) into `out`; false (said) when it does not parse.
    auto cpu_flag = [&](const char* flag, const std::string& text, std::vector<int>& out) {
        if (text.empty()) return true;
        auto list = parse_cpu_list(text);
        if (!list) {
            log::error(fmt::format("{}: {}", flag, list.error().message));
            return false;
        }
        out = *list;
        return true;
    };
    if (!cpu_flag("--cpus", a.cpus, o.cpus) || !cpu_flag("--borrow-cpus", a.borrow_cpus, o.borrow_cpus)) return 2;
    auto isa = parse_isa(a.isa);
    if (!isa) {
        log::error(isa.error().message);
        return 2;
    }
    o.isa = *isa;
    auto dev = parse_device(a.device);
    if (!dev) {
        log::error(dev.error().message);
        return 2;
    }
    o.device = *dev;
    o.cuda_graphs = a.cuda_graphs;
    o.cuda_qgemv = a.cuda_qgemv;
    o.prefill_budget = a.prefill_budget;
    o.prefill_pass_ns = static_cast<uint64_t>(a.prefill_pass_ms) * 1000000ull;
    o.prefill_cut_window_ns = static_cast<uint64_t>(a.prefill_cut_window_s) * 1000000000ull;
    o.prefix_cache = a.prefix_cache;
    o.risk_claims = a.risk_claims;
    o.pass_interrupt = a.pass_interrupt;
    o.swap_dir = a.swap_dir;
    o.max_batch = a.max_batch;
    o.max_draft = a.max_draft;
    o.draft_pool_tokens = a.draft_pool_tokens;
    o.defer_running = true;  // after the golden check
    const std::atomic<bool>& stop = StopSignal::install();
    // The golden-logits gate before READY: a failure exits kGoldenExitCode, which
    // neither the launcher nor systemd (RestartPreventExitStatus=3) restarts.
    auto gate = [&](WorkerBase& w) -> int {
        if (!*golden) {
            log::warning("no golden reference for this model (duet golden record makes one): unchecked");
            return 0;
        }
        sd.status("checking the golden logits");
        auto rep = w.golden_check(**golden);
        if (!rep) {
            log::error("golden check: " + rep.error().message);
            return 1;
        }
        if (!rep->passed) {
            log::error("golden check FAILED, not serving: " + rep->summary);
            inst->registry().note_golden_failure(fmt::format("{} {}: {}", role, a.index, rep->summary));
            sd.status("golden check failed: " + rep->summary);
            return kGoldenExitCode;
        }
        log::info("golden check passed: " + rep->summary);
        return 0;
    };
    Status st;
    if (prefill) {
        auto w = PrefillWorker::create(*inst, **model, o);
        if (!w) {
            log::error(w.error().message);
            return 1;
        }
        if (int rc = gate(**w); rc != 0) return rc;
        (*w)->mark_running();
        sd.ready(fmt::format("prefill {} serving instance {}", a.index, a.instance));
        st = (*w)->run(stop);
    } else {
        auto w = DecodeWorker::create(*inst, **model, o);
        if (!w) {
            log::error(w.error().message);
            return 1;
        }
        if (int rc = gate(**w); rc != 0) return rc;
        (*w)->mark_running();
        sd.ready(fmt::format("decode {} serving instance {}", a.index, a.instance));
        st = (*w)->run(stop);
    }
    sd.stopping(st ? "stopped" : st.error().message);
    if (!st) {
        log::error(st.error().message);
        return 1;
    }
    return 0;
}

}  // namespace duet
