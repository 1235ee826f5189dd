// `duet topo`: the machine as hwloc sees it and where each role would run.
#pragma once

#include <string>

namespace duet {

struct TopoArgs {
    std::string synthetic;  // plan for an hwloc synthetic topology instead of this machine
    std::string xml;        // or for another machine from its hwloc XML export
    std::string devices;    // GPUs, e.g. "0-3"; empty: CPU serving
    std::string front_cpus, prefill_cpus, decode_cpus;
    int prefill_workers = 1, decode_workers = 1;
    bool json = false;
};

int cmd_topo(const TopoArgs& a);

}  // namespace duet
