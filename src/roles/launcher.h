// `duet serve`'s launcher, as three parts:
//
// - the settings of each process (ServeSettings: what `duet serve` was asked;
//   WorkerSettings and FrontSettings: what a `duet prefill` / `duet decode` /
//   `duet front` child is started with: src/cli/role_flags.h turns them into argv
//   and back, next to the flags' definitions);
// - plan_serve, a pure function from the settings and the facts of the machine
//   (hwloc's topology, the GPUs' PCI addresses and memory, the model's sizes) to the
//   instance's layout and every child's settings and placement: table-tested
//   without a model, GPUs or processes (tests/launcher_test.cpp);
// - the launcher itself (run_launcher): creates the instance, starts the children,
//   and supervises them through explicit states, Starting -> Serving -> Draining ->
//   Done, whose transitions are the pure launch_step.
//
// What it does (DESIGN.md, "Failure model"): restarts a role that dies (recovering
// and re-driving its requests; a dead front's requests are cancelled and freed,
// their clients being gone); on SIGTERM or SIGINT drains: the front answers 503 to
// new requests, running ones get a grace period, the rest are cancelled, everything
// stops, the segments are removed, exit 0. A role that cannot start (restart_policy.h)
// fails the requests in flight and stops the launcher with exit 1.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <variant>
#include <vector>

#include "base/result.h"
#include "engine/drafter.h"
#include "kv/kv_pool.h"
#include "model/device_spec.h"
#include "roles/placement.h"
#include "roles/wire.h"

namespace duet {

// Scheduling (engine/scheduling.h), given to the front: --slo, the admission
// watermark and slack, the default request timeout.
struct SchedulingSettings {
    std::string slo;                   // "critical=300ms/20ms,..."; "": the defaults
    int64_t admit_queue_tokens = 65536;  // A2's high watermark (low: 3/4 of it); 0: none
    double admit_slack = 1.0;          // A1: refuse past slack x the class's TTFT target (0: A1 off)
    double admit_kv = 0.95;            // A3's high watermark, a fraction of the KV arena (low: 0.1 under); 0: none
    int request_timeout_s = 600;       // a request's "timeout" when it names none
    friend bool operator==(const SchedulingSettings&, const SchedulingSettings&) = default;
};

// `duet serve`'s settings (its flags, src/cli/role_flags.cpp).
struct ServeSettings {
    std::string model;
    std::string golden = "auto";  // each worker's golden-logits check (WorkerSettings::golden)
    std::string host = "127.0.0.1";
    int port = 8080;  // 0: any free one (resolved by the caller before plan_serve)
    int64_t ctx = 2048;
    int slots = 64;
    int io_threads = 2;
    int grace_s = 30;
    // Seconds every role gets to start (load the model, map the arena) before the
    // launcher gives up; 0: 60 s plus 10 s per GiB of model file (GPU workers
    // dequantize and upload every weight).
    int start_timeout_s = 0;
    std::string instance;  // default <scope>serve-<pid> (shm_scope())
    std::string front_cpus, prefill_cpus, decode_cpus;
    std::string isa;
    std::string chat_template;
    int64_t prefill_budget = 512;  // tokens per prefill forward pass, shared by the requests packed into it
    int prefill_pass_ms = 250;     // a pass not led by a critical request: cut to this long (0: not cut)
    int prefill_cut_window_s = 60;  // ... only within this long of the last critical request (0: always)
    bool prefix_cache = true;
    bool risk_claims = true;  // prefill: WorkerOptions::risk_claims
    bool pass_interrupt = true;  // prefill: WorkerOptions::pass_interrupt
    // Where decode swaps a preempted request's KV (GPU KV through page-locked host
    // memory): the launcher makes
    // <swap_root>/duet-swap-<instance> (0700) and removes it at exit. "": recompute only.
    std::string swap_root = "/var/tmp";
    int prefill_workers = 1, decode_workers = 1;  // processes of each role
    // Seconds of a lopsided load after which a worker changes role (roles/rebalance.h:
    // one role's workers busy 90% of the time, the other's at most 25%); 0: never.
    // CPU serving, one shared arena, three workers or more, roles started by the
    // launcher. Off by default: with one worker of each role, cores lent between
    // them already follow the load (lend_cores).
    int rebalance_s = 0;
    // Sequences a decode step runs at most (WorkerOptions::max_batch): when they are
    // all taken, a more urgent hand-off takes a less urgent sequence's slot.
    int max_batch = 256;
    // Decode: drafted tokens per sequence and step, verified in the pass
    // (WorkerOptions::max_draft; 0: off; unset: the device's default).
    int max_draft = kDraftTokensUnset;
    // Decode: finished outputs kept for every sequence's drafts, in tokens
    // (WorkerOptions::draft_pool_tokens; 0: none).
    int64_t draft_pool_tokens = kDefaultDraftPoolTokens;
    // CPU serving: prefill i and decode i each borrow the other's cores while the other
    // holds no request (WorkerOptions::borrow_cpus, lent_cpus). On by default: in the
    // mixed scenario it cut ITL p50 from 27.9 to 18.6 ms and TTFT p50 from 8.8 to
    // 7.3 s (bench/RESULTS.md "Cores lent between roles").
    bool lend_cores = true;
    // cpu, or GPUs cuda:N[,cuda:M...]: a prefill and a decode worker on each, sharing
    // its KV arena (or, kv_arenas per-role, one role per GPU).
    std::string device = "cpu";
    double kv_memory = 0.9;  // GPUs: the fraction of each GPU's memory for weights + KV + scratch
    // CPU: the KV arena's blocks (each arena's, with per-role arenas); 0: enough for
    // every slot at full context, capped at 8 GiB.
    int64_t kv_blocks = 0;
    // "shared": prefill and decode workers of a device use one KV arena (hand-offs
    // copy nothing); "per-role": each role its own (ServeLayout::kv_split).
    std::string kv_arenas = "shared";
    std::string kv_dtype = "f16";  // f16, int8, fp8 (ServeLayout::kv_dtype)
    bool cuda_qgemv = false;       // GPU workers: CudaBackendOptions::quantized_gemv
    // Contexts (/v1/contexts): their logs' directory ("": off), and how many at most.
    std::string contexts_dir;
    int contexts_max = 1024;
    uint64_t contexts_disk_max = 0;  // bytes of logs at most (0: no limit)
    int responses_max = 256;         // stored /v1/responses at most (FrontOptions::responses_max)
    // The API key (Bearer) every route but /health and /ready asks for ("": none).
    // Given to the front through its environment (DUET_API_KEY), never its argv.
    std::string api_key;
    // `duet serve --trace FILE`: every role process writes its ranges there
    // (src/base/trace.h; handed down as DUET_TRACE). Empty: none.
    std::string trace;
    // `duet serve --mps`: a CUDA MPS control daemon for the instance's GPU processes
    // (roles/mps.h), pipes and logs under $TMPDIR (or /tmp)/duet-mps-<instance>.
    bool mps = false;
    bool public_metrics = false;  // /metrics without the key
    int resume_window_s = 30;     // a dead front's requests wait this long for their clients (kResumeWindowNs)
    int resume_grace_s = 5;       // a stream whose client left waits this long for it (kResumeGraceNs)
    SchedulingSettings scheduling;
};

// The swap directory of an instance's workers (ServeSettings::swap_root; "" when
// swapping is off: no root).
std::string swap_dir_of(const ServeSettings& s, const std::string& instance);

// A `duet prefill` or `duet decode` process's settings (WorkerOptions once parsed).
struct WorkerSettings {
    std::string instance;
    std::string model;
    uint32_t index = 0;  // which of its role's workers
    int numa = -1;       // its CPUs' NUMA node (for routing; -1: unknown)
    int threads = 1;
    std::string cpus;
    std::string isa;
    int64_t prefill_budget = 512;  // prefill: tokens per forward pass
    int prefill_pass_ms = 250;     // prefill: a pass not led by a critical request is cut to this long (0: not cut)
    int prefill_cut_window_s = 60;  // prefill: ... only within this long of the last critical request (0: always)
    bool prefix_cache = true;      // prefill: reuse and publish cached prompt blocks; decode: publish finished answers'
    bool risk_claims = true;       // prefill: WorkerOptions::risk_claims
    bool pass_interrupt = true;    // prefill: WorkerOptions::pass_interrupt
    std::string swap_dir;          // preempted requests' swapped KV (WorkerOptions::swap_dir; "": none)
    int max_batch = 256;           // decode: sequences per step at most (WorkerOptions::max_batch)
    int max_draft = kDraftTokensUnset;  // decode: drafted tokens per sequence and step (WorkerOptions::max_draft)
    int64_t draft_pool_tokens = kDefaultDraftPoolTokens;  // decode: WorkerOptions::draft_pool_tokens
    std::string borrow_cpus;       // the other role's cores, borrowed while it is idle ("": none)
    std::string device = "cpu";    // or cuda:N
    bool cuda_graphs = true;
    bool cuda_qgemv = false;
    std::string golden = "auto";  // the golden-logits check before READY: auto, none, or a reference file
    friend bool operator==(const WorkerSettings&, const WorkerSettings&) = default;
};

// A `duet front` process's settings.
struct FrontSettings {
    std::string instance;
    std::string model;
    std::string host = "127.0.0.1";
    int port = 8080;
    int io_threads = 2;
    int grace_s = 30;
    std::string chat_template;
    std::string cpus;  // pin the process (all its threads) here
    std::string contexts_dir;  // "": no /v1/contexts
    int contexts_max = 1024;
    uint64_t contexts_disk_max = 0;
    int responses_max = 256;
    std::string api_key;          // from --api-key or DUET_API_KEY (the launcher sets the latter)
    int resume_window_s = 30;
    int resume_grace_s = 5;
    bool public_metrics = false;  // /metrics without the key
    SchedulingSettings scheduling;
    friend bool operator==(const FrontSettings&, const FrontSettings&) = default;
};

// One child of the launcher.
struct RoleLaunch {
    std::string role;  // "prefill", "decode" or "front": the subcommand
    std::string name;  // for messages: "prefill", or "prefill 1" when the role has several
    std::variant<WorkerSettings, FrontSettings> settings;
    std::vector<int> cpus;  // where it is pinned (empty: anywhere)
    int numa = 0;
};

// What plan_serve needs to know of the world, read by the caller (the hwloc
// topology, the CUDA device queries, the model file), so that plan_serve is pure.
struct GpuFacts {
    DeviceSpec device;
    std::string pci;            // its PCI address ("" unknown)
    uint64_t total_memory = 0;  // bytes
};
struct ServeFacts {
    Machine machine;
    std::vector<GpuFacts> gpus;     // one per --device entry, in order (empty: the CPU)
    int64_t n_ctx_train = 0;        // the model's context
    KvLayout kv;                    // the model's KV layout in the settings' dtype
    uint64_t gpu_weight_bytes = 0;  // the weights one GPU holds (bf16_weight_bytes)
    uint64_t model_file_bytes = 0;  // for the default start timeout
    int pid = 0;                    // for the default instance name
    std::string shm_scope;          // before it (shm_scope(): "" or "S.")
};

struct ServePlan {
    ServeLayout layout;              // the instance (n_blocks planned here on GPUs)
    std::vector<DeviceSpec> gpus;    // arena i is on gpus[i] (empty: the CPU)
    std::vector<RoleLaunch> roles;   // prefill 0..P-1, decode 0..D-1, then the front: the start order
    std::vector<std::string> notes;  // what the placement had to compromise
    std::string placed;              // ", prefill on CPUs 0-1, decode on ..." for the listening line
    std::string gpu_note;            // a GPU not found on the PCI bus: placed as for the CPU
    int start_timeout_s = 60;
    // CPU, per-role arenas, several NUMA nodes: each role's host arena is bound to its
    // workers' nodes (decode's pages are written first by prefill, the hand-off
    // copies, so first touch would put them on prefill's node).
    bool bind_arenas = false;
};

// --device: "cpu", or GPUs "cuda:0,cuda:1,...". A GPU named twice is an error unless
// kv_split (prefill and decode on one GPU, an arena each); "cpu" in a list is one.
// check, if given, is asked about each GPU as it is read (check_device: the first
// error in the list is the one reported).
Result<std::vector<DeviceSpec>> parse_device_list(const std::string& text, bool kv_split,
                                                  const std::function<Status(const DeviceSpec&)>& check = {});

// The plan of an instance: checks every setting (errors name the flag), counts the
// workers (on GPUs a pair per GPU, or with --kv-arenas per-role prefill on the first
// --prefill-workers GPUs and decode on the rest), places them (plan_placement), and
// on GPUs sizes the KV arenas from the smallest GPU's memory.
Result<ServePlan> plan_serve(const ServeSettings& s, const ServeFacts& f);

// Cores lent between roles (CPU, ServeSettings::lend_cores): the CPUs placed role `p`
// borrows. Prefill i and decode i lend each other their CPUs (a worker without a
// partner of its index lends and borrows nothing), except CPUs another compute
// worker also runs on: the borrower watches only its partner's load
// (WorkerBase::borrow_cores).
std::vector<int> lent_cpus(const Plan& placed, const Placement& p);

// ---------------------------------------------------------------- the launcher's states

enum class LaunchState { Starting, Serving, Draining, Done };
const char* launch_state_name(LaunchState s);

struct LaunchInputs {
    uint64_t now_ns = 0;
    bool all_running = false;   // the front and every worker registered as running
    bool stop = false;          // SIGTERM / SIGINT, or the launcher failed (a role given up on)
    bool front_exited = false;  // Draining: the retired front was reaped
    uint64_t start_deadline_ns = 0;
    uint64_t drain_deadline_ns = 0;  // Draining: after it the front is killed
    bool front_killed = false;       // Draining: it was already
};

struct LaunchStep {
    LaunchState next = LaunchState::Starting;
    bool announce = false;         // print the listening line
    bool start_timed_out = false;  // Starting: not all running by the deadline (exit 1)
    bool retire_front = false;     // begin the drain: SIGTERM the front, not to be restarted
    bool kill_front = false;       // the front outlived its drain
};

// One turn of the launcher's loop: Starting becomes Serving once every role runs
// (announced once), or Draining on a stop request or at the start deadline (a
// failure); Serving becomes Draining on a stop request; Draining becomes Done when
// the retired front has exited, after killing it past the drain deadline.
LaunchStep launch_step(LaunchState s, const LaunchInputs& in);

// The argv a child is started with (src/cli/role_flags.h role_argv).
using ArgvBuilder = std::function<std::vector<std::string>(const RoleLaunch&)>;

// Runs the instance of `plan` until it is drained: creates its shared memory (and on
// GPUs the fd keeper and the arenas only the launcher can hold), starts every role,
// supervises them, removes the segments. `stop` is the process's stop request
// (StopSignal). Returns the exit status: 0 after a drain, 1 when something failed.
// How the roles are started: as the launcher's children (`duet serve`), or by
// someone else (`duet instance`: systemd's units start front, prefill and decode;
// the launcher creates the instance, holds it, recovers roles that die, and never
// starts one). An External launcher that finds its instance's segments held by
// live roles (its predecessor was killed; their units do not stop with it) takes
// that instance over instead: the requests in flight go on (src/roles/README.md).
enum class RoleStart { Children, External };

int run_launcher(const ServeSettings& s, const ServePlan& plan, const Model& model, const ArgvBuilder& argv,
                 const std::atomic<bool>& stop, RoleStart start = RoleStart::Children);

}  // namespace duet
