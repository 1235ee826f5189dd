// Where each process of an instance runs: the machine as hwloc sees it (cores,
// NUMA nodes, GPUs and the cores close to them), and the plan that puts the front
// and the prefill and decode workers (on CPU, one or more of each; on GPUs, a pair
// per GPU or one role per GPU) on cores of their own where there are enough (the
// plan's notes say what had to share). `duet topo` prints the plan; `duet serve`
// starts the roles with it (src/cli/serve.cpp).
#pragma once

#include <string>
#include <vector>

#include "base/result.h"

namespace duet {

struct MachineCore {
    int numa = 0;          // NUMA node (logical index)
    std::vector<int> pus;  // OS indices of its hardware threads, first one first
};

struct MachineGpu {
    int device = 0;         // CUDA ordinal, by PCI bus order
    std::string pci;        // domain:bus:dev.fn
    std::vector<int> pus;   // OS indices of the hardware threads close to it
    uint64_t memory_bytes = 0;  // an export's (hwloc's CUDA backend: CUDAGlobalMemorySize); 0: not known
};

struct Machine {
    std::vector<MachineCore> cores;
    int n_numa = 1;
    std::vector<MachineGpu> gpus;
    std::string source;  // "this machine", the synthetic description or the XML file

    // This machine, by hwloc (with NVIDIA GPUs found on its PCI bus).
    static Result<Machine> detect();
    // An hwloc synthetic topology, e.g. "pack:2 numa:1 core:8 pu:2" (for tests and
    // for planning another machine's layout).
    static Result<Machine> synthetic(const std::string& description);
    // Another machine, from its hwloc XML export (`lstopo machine.xml`), with the
    // NVIDIA GPUs on its PCI tree and the cores of the package each hangs off.
    static Result<Machine> from_xml(const std::string& path);
};

struct Placement {
    std::string role;       // "front", "prefill", "decode"
    int index = 0;          // which of its role's workers
    int device = -1;        // -1: CPU
    std::vector<int> cpus;  // OS indices of the hardware threads it is pinned to
    int threads = 1;        // compute threads
    int numa = 0;
};

struct PlanOptions {
    std::vector<int> devices;  // GPUs to serve on; empty: the CPU
    // Overrides (CPU serving): explicit CPU lists for the roles (split evenly among
    // a role's workers).
    std::vector<int> front_cpus, prefill_cpus, decode_cpus;
    // CPU serving: prefill and decode workers (each a process with its own rings).
    int prefill_workers = 1, decode_workers = 1;
    // GPUs with per-role KV arenas: the first prefill_gpus of `devices` run a
    // prefill process each, the others a decode process each. 0: a pair per GPU.
    int prefill_gpus = 0;
};

struct Plan {
    std::vector<Placement> roles;
    std::vector<std::string> notes;  // compromises the plan had to make
};

// The placement of front, prefill and decode processes. On CPU: one hardware thread
// per core (SMT siblings would share the SIMD units); workers spread over the NUMA
// nodes, largest first (worker i of each role on node i mod nodes, so a prefill and a
// decode worker of the same index share a node: one worker each is one node, as the
// KV arena's pages are best local to both); on each node prefill and decode workers
// on disjoint cores, the cores split evenly among a role's workers (workers share
// cores only when there are fewer cores than workers, with a note); the front on a
// core of its own when there is one to spare. On GPUs: a prefill and a decode process per device
// (or one role per device, prefill_gpus), each on a core close to its GPU. Errors: overlapping prefill/decode overrides,
// CPUs or devices the machine does not have.
Result<Plan> plan_placement(const Machine& m, const PlanOptions& o);

// Asks the kernel to place the pages of [addr, addr + bytes) — a shared mapping: the
// policy holds for every process that faults them in — on these NUMA nodes: the one
// node preferred, or several interleaved. Only whole 2 MiB-aligned stretches inside
// the range are bound (a huge-page mapping needs that alignment); nothing when no
// nodes are given. Errors: what mbind(2) says.
Status bind_to_nodes(void* addr, size_t bytes, std::vector<int> nodes);

// "0-3,8,10-11" as in --cpus.
std::string format_cpu_list(const std::vector<int>& cpus);

}  // namespace duet
