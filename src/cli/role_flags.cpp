#include "cli/role_flags.h"

namespace duet {

namespace {

// The flag names both sides use (CLI11 takes "-m,--model"; argv carries the long one).
constexpr const char* kInstance = "--instance";
constexpr const char* kModel = "--model";
constexpr const char* kThreads = "--threads";
constexpr const char* kCpus = "--cpus";
constexpr const char* kIsa = "--isa";
constexpr const char* kIndex = "--index";
constexpr const char* kNuma = "--numa";
constexpr const char* kDevice = "--device";
constexpr const char* kNoCudaGraphs = "--no-cuda-graphs";
constexpr const char* kCudaQgemv = "--cuda-qgemv";
constexpr const char* kPrefillBudget = "--prefill-budget";
constexpr const char* kPrefillPassMs = "--prefill-pass-ms";
constexpr const char* kPrefillCutWindow = "--prefill-cut-window";
constexpr const char* kPrefillCutWindowHelp =
    "seconds: passes are cut (--prefill-pass-ms) only within this long of the last critical request the worker "
    "took, since the cut costs long prompts ~10-15% of prefill throughput (0: always cut)";
constexpr const char* kPrefillPassHelp =
    "a pass not led by a critical request is cut to the tokens this worker computes in this many ms at its "
    "measured rate, so a critical request arriving meanwhile waits at most about that long (0: no cut)";
constexpr const char* kNoPrefixCache = "--no-prefix-cache";
constexpr const char* kNoRiskClaims = "--no-risk-claims";
constexpr const char* kRiskClaimsHelp =
    "with cores lent: passes for prompts that would miss their TTFT target on prefill's cores alone do not claim "
    "decode's cores while it has streams ahead of their inter-token target and no critical request came within "
    "--prefill-cut-window (critical passes still do)";
constexpr const char* kNoPassInterrupt = "--no-pass-interrupt";
constexpr const char* kPassInterruptHelp =
    "a critical request sent to a prefill worker does not stop the pass in progress that no critical request leads "
    "(by default one stopped within its first half of layers is computed again later: exact by the invariance "
    "contract)";
constexpr const char* kSwapDir = "--swap-dir";
constexpr const char* kMaxBatch = "--max-batch";
constexpr const char* kBorrowCpus = "--borrow-cpus";
constexpr const char* kDraftTokens = "--draft-tokens";
constexpr const char* kDraftTokensHelp =
    "decode: up to this many tokens per sequence and step drafted by prompt lookup and checked in the step's pass "
    "(kept only where the draw picked them: the output does not change), fewer or none while a sequence's drafts "
    "miss; 0: off (default: 8 on the CPU; off on a GPU, whose logits are not yet bitwise equal between pass sizes)";
constexpr const char* kDraftPool = "--draft-pool-tokens";
constexpr const char* kDraftPoolHelp =
    "decode: the last this many tokens of the outputs a decode worker finished, a corpus every sequence drafts from "
    "where it matches more of the sequence than the sequence's own tokens do (repeated answers, agent loops); 36 "
    "bytes a token; 0: none";
constexpr const char* kMaxBatchHelp =
    "sequences a decode step runs at most; when all are taken, a hand-off of a more urgent class takes the slot of a "
    "less urgent sequence (preempted)";
constexpr const char* kHost = "--host";
constexpr const char* kPort = "--port";
constexpr const char* kIoThreads = "--io-threads";
constexpr const char* kGrace = "--grace";
constexpr const char* kChatTemplate = "--chat-template";
constexpr const char* kContextsDir = "--contexts-dir";
constexpr const char* kContextsMax = "--contexts-max";
constexpr const char* kResponsesMax = "--responses-max";
constexpr const char* kContextsDiskMax = "--contexts-disk-max";
constexpr const char* kApiKey = "--api-key";
constexpr const char* kPublicMetrics = "--public-metrics";
constexpr const char* kGolden = "--golden";
constexpr const char* kResumeWindow = "--resume-window";
constexpr const char* kResumeGrace = "--resume-grace";
constexpr const char* kSlo = "--slo";
constexpr const char* kAdmitQueue = "--admit-queue-tokens";
constexpr const char* kAdmitSlack = "--admit-slack";
constexpr const char* kAdmitKv = "--admit-kv";
constexpr const char* kRequestTimeout = "--request-timeout";
const char* const kResumeWindowHelp =
    "seconds the requests of a front that died wait for their clients to come back through a restarted front "
    "(GET /v1/requests/{id}/events with Last-Event-ID, or a retry with the same X-Request-Id) before they are "
    "cancelled";
const char* const kResumeGraceHelp =
    "seconds a stream whose client disconnected keeps running for the client to come back (GET "
    "/v1/requests/{id}/events with Last-Event-ID) before it is cancelled and its KV freed, and a stream that ended "
    "keeps its request slots for a resume (given way to new requests when none is free); 0: neither";
const char* const kGoldenHelp =
    "the golden-logits check each worker runs before it is ready: auto (<model>.golden.json beside the model, "
    "else the built-in reference for the model, else none), none, or a reference file (duet golden record); a "
    "worker that fails it exits 3 and serve stops with 3";
const char* const kApiKeyHelp =
    "require \"Authorization: Bearer KEY\" on every route but /health and /ready (401 otherwise); also read "
    "from DUET_API_KEY, which keeps it out of the process list";
const char* const kContextsDiskHelp =
    "bytes the durable contexts' logs may take (e.g. 20GB; 0: no limit): past it, operations get 429";
const char* const kContextsDirHelp =
    "keep contexts (/v1/contexts): their KV logs go here (mode 0700; created if missing); default: off";

std::string with_short(const char* s, const char* l) { return std::string(s) + "," + l; }
std::string negated(const char* l) { return std::string("!") + l; }

const char* const kQgemvHelp =
    "decode projections of up to 8 tokens from the GGUF blocks (Q4_0, Q4_1, Q8_0) instead of cuBLAS over bf16";

// --contexts-dir, --contexts-max, --contexts-disk-max, --responses-max: serve's,
// passed on to the front.
void add_contexts_flags(CLI::App& c, std::string& dir, int& max, uint64_t& disk_max, int& responses_max) {
    c.add_option(kContextsDir, dir, kContextsDirHelp);
    c.add_option(kContextsMax, max, "contexts kept at most (429 past it)")
        ->capture_default_str()
        ->check(CLI::Range(1, 1 << 20));
    c.add_option(kResponsesMax, responses_max,
                 "stored /v1/responses kept at most, the least recently used forgotten first (durable contexts with "
                 "--contexts-dir, else in memory)")
        ->capture_default_str()
        ->check(CLI::Range(1, 1 << 20));
    c.add_option(kContextsDiskMax, disk_max, kContextsDiskHelp)
        ->capture_default_str()
        ->transform(CLI::AsSizeValue(true));
}

void add_scheduling_flags(CLI::App& c, SchedulingSettings& s) {
    c.add_option(kSlo, s.slo,
                 "TTFT/ITL targets of the priority classes, e.g. critical=300ms/20ms,standard=5s/250ms,batch=60s/2s "
                 "(classes not named keep these defaults; a request's class: \"priority\" or X-Duet-Priority)");
    c.add_option(kAdmitQueue, s.admit_queue_tokens,
                 "prompt tokens admitted and not yet prefilled past which standard and batch requests get 429 with "
                 "Retry-After until the queue is back under 3/4 of it (0: no bound)")
        ->capture_default_str()
        ->check(CLI::Range(int64_t{0}, int64_t{1} << 40));
    c.add_option(kAdmitSlack, s.admit_slack,
                 "refuse (429, Retry-After) a request whose predicted time to first token passes this many times its "
                 "class's target while work is queued ahead of it (0: never)")
        ->capture_default_str()
        ->check(CLI::Range(0.0, 1000.0));
    c.add_option(kAdmitKv, s.admit_kv,
                 "the fraction of the KV arena held by requests past which standard and batch requests get 429 with "
                 "Retry-After until it is back 0.1 under (critical ones pass: decode preempts for them; 0: no bound)")
        ->capture_default_str()
        ->check(CLI::Range(0.0, 1.0));
    c.add_option(kRequestTimeout, s.request_timeout_s,
                 "seconds a request runs at most when its \"timeout\" names none; it then ends with what it has, "
                 "finish_reason \"timeout\"")
        ->capture_default_str()
        ->check(CLI::Range(1, 86400));
}

}  // namespace

void add_serve_flags(CLI::App& c, ServeSettings& s) {
    c.add_option(with_short("-m", kModel), s.model, "GGUF model file")->capture_default_str();
    c.add_option(kHost, s.host, "address to listen on")->capture_default_str();
    c.add_option(kPort, s.port, "port (0: any free one)")->capture_default_str()->check(CLI::Range(0, 65535));
    c.add_option("--ctx", s.ctx, "tokens per request (prompt + output)")->capture_default_str();
    c.add_option("--slots", s.slots, "requests in flight at most")->capture_default_str()->check(CLI::Range(1, 4096));
    c.add_option(kIoThreads, s.io_threads, "HTTP threads")->capture_default_str()->check(CLI::Range(1, 64));
    c.add_option(kGrace, s.grace_s, "seconds running requests get to finish on SIGTERM")->capture_default_str();
    c.add_option("--start-timeout", s.start_timeout_s,
                 "seconds the roles get to start before serve gives up (0: 60 + 10 per GiB of model)")
        ->capture_default_str()
        ->check(CLI::Range(0, 86400));
    c.add_option(kInstance, s.instance, "shared-memory instance name (default serve-<pid>)");
    c.add_option("--front-cpus", s.front_cpus, "pin the front here (default: the hwloc plan)");
    c.add_option("--prefill-cpus", s.prefill_cpus, "pin prefill here (default: the hwloc plan, duet topo)");
    c.add_option("--decode-cpus", s.decode_cpus, "pin decode here; disjoint from prefill");
    c.add_option(kIsa, s.isa, "kernel level: scalar, avx2, avx512, amx (default: best)");
    c.add_option(kGolden, s.golden, kGoldenHelp)->capture_default_str();
    c.add_option(kChatTemplate, s.chat_template, "override the chat template");
    c.add_option(kPrefillBudget, s.prefill_budget, "tokens per prefill forward pass (several requests packed)")
        ->capture_default_str()
        ->check(CLI::Range(16, 1 << 16));
    c.add_option(kPrefillPassMs, s.prefill_pass_ms, kPrefillPassHelp)->capture_default_str()->check(CLI::Range(0, 60000));
    c.add_option(kPrefillCutWindow, s.prefill_cut_window_s, kPrefillCutWindowHelp)
        ->capture_default_str()
        ->check(CLI::Range(0, 86400));
    c.add_flag(negated(kNoPrefixCache), s.prefix_cache,
               "do not reuse cached KV blocks (of prompts, and of answers decode finished)");
    c.add_flag(negated(kNoRiskClaims), s.risk_claims, kRiskClaimsHelp);
    c.add_flag(negated(kNoPassInterrupt), s.pass_interrupt, kPassInterruptHelp);
    c.add_flag("--mps", s.mps,
               "GPUs: run their processes under CUDA MPS, so that prefill's and decode's kernels share each GPU at "
               "once instead of by time slices (duet serve: a control daemon of the instance's own, "
               "nvidia-cuda-mps-control -d; systemd generate: the units use duet-mps.service)");
    c.add_option("--swap-root", s.swap_root,
                 "decode swaps a preempted request's KV to <root>/duet-swap-<instance> when that costs less than "
                 "computing it again (GPU KV through page-locked host memory; \"\": always recompute)")
        ->capture_default_str();
    c.add_option("--prefill-workers", s.prefill_workers,
                 "prefill processes (requests routed by cached prefix and queue)")
        ->capture_default_str()
        ->check(CLI::Range(1, 5));
    c.add_option(kDevice, s.device,
                 "cpu, or GPUs: cuda:N, or cuda:0,cuda:1,... (a prefill and a decode worker on each, sharing its KV "
                 "arena)")
        ->capture_default_str();
    c.add_flag(kCudaQgemv, s.cuda_qgemv, std::string("GPUs: ") + kQgemvHelp + " (duet bench cuda compares them)");
    c.add_option("--kv-dtype", s.kv_dtype,
                 "KV cache values: f16, or int8 / fp8 (e4m3) with a scale per token and head (about half the memory: "
                 "twice the tokens in the same arena)")
        ->capture_default_str();
    c.add_option("--kv-arenas", s.kv_arenas,
                 "shared: prefill and decode use one KV arena per device (hand-offs copy nothing); per-role: each role "
                 "its own (CPU: prefill's and decode's host arenas, each on its role's NUMA nodes; GPUs: prefill alone "
                 "on the first --prefill-workers GPUs, decode on the rest), each hand-off copying the request's KV "
                 "layer by layer")
        ->capture_default_str();
    c.add_option("--kv-blocks", s.kv_blocks,
                 "KV blocks of 16 tokens per arena; CPU: 0 sizes it for every slot at full context (at most 8 GiB); "
                 "GPU: at most this many of what --kv-memory leaves (0: all); a small arena shows eviction and "
                 "preemption")
        ->capture_default_str();
    c.add_option("--kv-memory", s.kv_memory,
                 "GPUs: fraction of each GPU's memory for weights, KV arena and scratch (the KV arena takes the rest "
                 "of it, at most --kv-blocks blocks when that is given)")
        ->capture_default_str()
        ->check(CLI::Range(0.05, 1.0));
    c.add_option("--decode-workers", s.decode_workers, "decode processes (hand-offs routed by batch room)")
        ->capture_default_str()
        ->check(CLI::Range(1, 5));
    c.add_option(kMaxBatch, s.max_batch, kMaxBatchHelp)->capture_default_str()->check(CLI::Range(1, 4096));
    c.add_option(kDraftTokens, s.max_draft, kDraftTokensHelp)->check(CLI::Range(0, 16));
    c.add_option(kDraftPool, s.draft_pool_tokens, kDraftPoolHelp)
        ->capture_default_str()
        ->check(CLI::Range(int64_t{0}, int64_t{1} << 26));
    c.add_flag("--lend-cores,!--no-lend-cores", s.lend_cores,
               "CPU (on by default; --no-lend-cores: off): prefill worker i computes on decode worker i's cores too "
               "while that one holds no request, and decode i on prefill i's while it holds none (given back within "
               "a step or a pass)");
    c.add_option("--rebalance", s.rebalance_s,
                 "CPU, three workers or more: seconds one role's workers stay busy (90%) while the other's stay idle "
                 "(25% at most) before an idle worker changes role, taking its cores to the busy role (0: never)")
        ->capture_default_str()
        ->check(CLI::Range(0, 3600));
    add_contexts_flags(c, s.contexts_dir, s.contexts_max, s.contexts_disk_max, s.responses_max);
    c.add_option(kApiKey, s.api_key, kApiKeyHelp)->envname("DUET_API_KEY");
    c.add_flag(kPublicMetrics, s.public_metrics, "serve /metrics without the API key (a local scraper)");
    c.add_option(kResumeWindow, s.resume_window_s, kResumeWindowHelp)->capture_default_str()->check(CLI::Range(0, 3600));
    c.add_option(kResumeGrace, s.resume_grace_s, kResumeGraceHelp)->capture_default_str()->check(CLI::Range(0, 3600));
    add_scheduling_flags(c, s.scheduling);
}

void add_front_flags(CLI::App& c, FrontSettings& s) {
    c.add_option(kInstance, s.instance, "the instance (segments /dev/shm/duet.<name>)")->required();
    c.add_option(with_short("-m", kModel), s.model, "GGUF model file (the instance's)")->capture_default_str();
    c.add_option(kHost, s.host, "address to listen on")->capture_default_str();
    c.add_option(kPort, s.port, "port")->capture_default_str()->check(CLI::Range(1, 65535));
    c.add_option(kIoThreads, s.io_threads, "HTTP threads")->capture_default_str()->check(CLI::Range(1, 64));
    c.add_option(kGrace, s.grace_s, "seconds running requests get to finish on SIGTERM")->capture_default_str();
    c.add_option(kChatTemplate, s.chat_template, "override the chat template");
    c.add_option(kCpus, s.cpus, "pin the front (all its threads) to these CPUs");
    add_contexts_flags(c, s.contexts_dir, s.contexts_max, s.contexts_disk_max, s.responses_max);
    c.add_option(kApiKey, s.api_key, kApiKeyHelp)->envname("DUET_API_KEY");
    c.add_flag(kPublicMetrics, s.public_metrics, "serve /metrics without the API key (a local scraper)");
    c.add_option(kResumeWindow, s.resume_window_s, kResumeWindowHelp)->capture_default_str()->check(CLI::Range(0, 3600));
    c.add_option(kResumeGrace, s.resume_grace_s, kResumeGraceHelp)->capture_default_str()->check(CLI::Range(0, 3600));
    add_scheduling_flags(c, s.scheduling);
}

void add_worker_flags(CLI::App& c, WorkerSettings& s, bool prefill) {
    c.add_option(kInstance, s.instance, "the instance (segments /dev/shm/duet.<name>)")->required();
    c.add_option(with_short("-m", kModel), s.model, "GGUF model file (the instance's)")->capture_default_str();
    c.add_option(with_short("-t", kThreads), s.threads, "compute threads")->capture_default_str();
    c.add_option(kCpus, s.cpus, "pin threads to these CPUs");
    c.add_option(kIsa, s.isa, "kernel level: scalar, avx2, avx512, amx (default: best)");
    c.add_option(kIndex, s.index, "which of the instance's workers of this role")->capture_default_str();
    c.add_option(kNuma, s.numa, "the NUMA node of --cpus (routing prefers a decode worker on prefill's node)");
    c.add_option(kDevice, s.device, "cpu, or cuda:N (the instance's KV arena on that GPU)")->capture_default_str();
    c.add_flag(negated(kNoCudaGraphs), s.cuda_graphs, "run every CUDA pass eagerly");
    c.add_flag(kCudaQgemv, s.cuda_qgemv, kQgemvHelp);
    c.add_option(kGolden, s.golden, kGoldenHelp)->capture_default_str();
    c.add_option(kSwapDir, s.swap_dir, "where preempted requests' KV is swapped (every worker of the instance: the same)");
    c.add_option(kBorrowCpus, s.borrow_cpus, "the other role's CPUs, computed on while it holds no request");
    if (!prefill) {
        c.add_option(kMaxBatch, s.max_batch, kMaxBatchHelp)->capture_default_str()->check(CLI::Range(1, 4096));
        c.add_option(kDraftTokens, s.max_draft, kDraftTokensHelp)->check(CLI::Range(0, 16));
        c.add_option(kDraftPool, s.draft_pool_tokens, kDraftPoolHelp)
            ->capture_default_str()
            ->check(CLI::Range(int64_t{0}, int64_t{1} << 26));
        c.add_flag(negated(kNoPrefixCache), s.prefix_cache,
                   "do not publish the KV blocks of finished answers in the prefix cache");
        return;
    }
    c.add_option(kPrefillBudget, s.prefill_budget, "tokens per forward pass (several requests packed)")
        ->capture_default_str()
        ->check(CLI::Range(16, 1 << 16));
    c.add_option(kPrefillPassMs, s.prefill_pass_ms, kPrefillPassHelp)->capture_default_str()->check(CLI::Range(0, 60000));
    c.add_option(kPrefillCutWindow, s.prefill_cut_window_s, kPrefillCutWindowHelp)
        ->capture_default_str()
        ->check(CLI::Range(0, 86400));
    c.add_flag(negated(kNoPrefixCache), s.prefix_cache,
               "do not reuse or publish cached KV blocks (of prompts, and of finished answers)");
    c.add_flag(negated(kNoRiskClaims), s.risk_claims, kRiskClaimsHelp);
    c.add_flag(negated(kNoPassInterrupt), s.pass_interrupt, kPassInterruptHelp);
}

std::vector<std::string> role_argv(const std::string& exe, const RoleLaunch& r) {
    std::vector<std::string> a = {exe, r.role};
    auto put = [&](const char* flag, const std::string& value) { a.insert(a.end(), {flag, value}); };
    auto put_if = [&](const char* flag, const std::string& value) {
        if (!value.empty()) put(flag, value);
    };
    if (const auto* f = std::get_if<FrontSettings>(&r.settings)) {
        put(kInstance, f->instance);
        put(kModel, f->model);
        put(kHost, f->host);
        put(kPort, std::to_string(f->port));
        put(kIoThreads, std::to_string(f->io_threads));
        put(kGrace, std::to_string(f->grace_s));
        put_if(kChatTemplate, f->chat_template);
        put_if(kCpus, f->cpus);
        put_if(kContextsDir, f->contexts_dir);
        put(kContextsMax, std::to_string(f->contexts_max));
        put(kContextsDiskMax, std::to_string(f->contexts_disk_max));
        put(kResponsesMax, std::to_string(f->responses_max));
        if (f->public_metrics) a.emplace_back(kPublicMetrics);
        put(kResumeWindow, std::to_string(f->resume_window_s));
        put(kResumeGrace, std::to_string(f->resume_grace_s));
        put_if(kSlo, f->scheduling.slo);
        put(kAdmitQueue, std::to_string(f->scheduling.admit_queue_tokens));
        put(kAdmitSlack, fmt::format("{}", f->scheduling.admit_slack));
        put(kAdmitKv, fmt::format("{}", f->scheduling.admit_kv));
        put(kRequestTimeout, std::to_string(f->scheduling.request_timeout_s));
        // The API key is not an argument: the launcher gives it in DUET_API_KEY.
        return a;
    }
    const auto& w = std::get<WorkerSettings>(r.settings);
    put(kInstance, w.instance);
    put(kModel, w.model);
    put(kIndex, std::to_string(w.index));
    put(kNuma, std::to_string(w.numa));
    put(kThreads, std::to_string(w.threads));
    put_if(kCpus, w.cpus);
    put_if(kIsa, w.isa);
    put(kDevice, w.device);
    if (!w.cuda_graphs) a.push_back(kNoCudaGraphs);
    if (w.cuda_qgemv) a.push_back(kCudaQgemv);
    put(kGolden, w.golden);
    put_if(kSwapDir, w.swap_dir);
    put_if(kBorrowCpus, w.borrow_cpus);
    if (r.role == "decode") {
        put(kMaxBatch, std::to_string(w.max_batch));
        if (w.max_draft != kDraftTokensUnset) put(kDraftTokens, std::to_string(w.max_draft));
        put(kDraftPool, std::to_string(w.draft_pool_tokens));
        if (!w.prefix_cache) a.push_back(kNoPrefixCache);
    }
    if (r.role == "prefill") {
        put(kPrefillBudget, std::to_string(w.prefill_budget));
        put(kPrefillPassMs, std::to_string(w.prefill_pass_ms));
        put(kPrefillCutWindow, std::to_string(w.prefill_cut_window_s));
        if (!w.prefix_cache) a.push_back(kNoPrefixCache);
        if (!w.risk_claims) a.push_back(kNoRiskClaims);
        if (!w.pass_interrupt) a.push_back(kNoPassInterrupt);
    }
    return a;
}

}  // namespace duet
