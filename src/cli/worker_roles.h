// `duet prefill` and `duet decode`: a worker process attached to a running
// instance by name (the launcher or a test creates the instance; the worker reads
// its layout from the control segment). Runs until SIGTERM or SIGINT.
#pragma once

#include <string>

namespace duet {

struct WorkerArgs {
    std::string instance;
    std::string model;
    int threads = 1;
    std::string cpus;
    std::string isa;
};

int cmd_worker(const WorkerArgs& a, bool prefill);

}  // namespace duet
