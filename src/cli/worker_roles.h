// `duet prefill` and `duet decode`: a worker process attached to a running
// instance by name (the launcher or a test creates the instance; the worker reads
// its layout from the control segment). Runs until SIGTERM or SIGINT.
#pragma once

#include <string>

namespace duet {

struct WorkerArgs {
    std::string instance;
    std::string model;
    uint32_t index = 0;  // which of its role's workers
    int numa = -1;       // its CPUs' NUMA node (for routing; -1: unknown)
    int threads = 1;
    std::string cpus;
    std::string isa;
    int64_t budget = 512;      // prefill: tokens per forward pass
    bool prefix_cache = true;  // prefill: reuse and publish cached prompt blocks
    std::string device = "cpu";  // or cuda:N
    bool cuda_graphs = true;
    bool cuda_qgemv = false;
};

int cmd_worker(const WorkerArgs& a, bool prefill);

}  // namespace duet
