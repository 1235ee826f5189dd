// `duet serve`: the launcher. Creates the instance's shared memory, starts prefill
// and decode as child processes (placed by the hwloc plan), runs the HTTP front,
// restarts a worker that dies (recovering and re-driving its requests), and on
// SIGTERM or SIGINT drains: new requests get 503, running ones get a grace period,
// the rest are cancelled, everything stops, the segments are removed, exit 0.
#pragma once

#include <string>

namespace duet {

struct ServeArgs {
    std::string model;
    std::string host = "127.0.0.1";
    int port = 8080;
    int64_t ctx = 2048;
    int slots = 64;
    int io_threads = 2;
    int grace_s = 30;
    std::string instance;  // default serve-<pid>
    std::string prefill_cpus, decode_cpus;
    std::string isa;
    std::string chat_template;
    int64_t prefill_budget = 512;  // tokens per prefill forward pass, shared by the requests packed into it
    bool prefix_cache = true;
};

int cmd_serve(const ServeArgs& a);

}  // namespace duet
