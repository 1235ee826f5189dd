// `duet serve`: the launcher. Creates the instance's shared memory, starts the
// front, prefill and decode as child processes (`duet front`, `duet prefill`,
// `duet decode`; prefill and decode placed by the hwloc plan), restarts a role that
// dies (recovering and re-driving its requests; a dead front's requests are
// cancelled and freed, their clients being gone), and on SIGTERM or SIGINT drains:
// the front answers 503 to new requests, running ones get a grace period, the rest
// are cancelled, everything stops, the segments are removed, exit 0. A role that
// keeps dying fails the requests in flight and stops the launcher with exit 1.
//
// `duet front`: the HTTP front of a running instance (the OpenAI API); drains on
// SIGTERM.
#pragma once

#include <cstdint>
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
    // Seconds every role gets to start (load the model, map the arena) before the
    // launcher gives up; 0: 60 s plus 10 s per GiB of model file (GPU workers
    // dequantize and upload every weight).
    int start_timeout_s = 0;
    std::string instance;  // default serve-<pid>
    std::string front_cpus, prefill_cpus, decode_cpus;
    std::string isa;
    std::string chat_template;
    int64_t prefill_budget = 512;  // tokens per prefill forward pass, shared by the requests packed into it
    bool prefix_cache = true;
    int prefill_workers = 1, decode_workers = 1;  // processes of each role
    // cpu, or GPUs cuda:N[,cuda:M...]: a prefill and a decode worker on each, sharing
    // its KV arena (or, kv_arenas per-role, one role per GPU).
    std::string device = "cpu";
    double kv_memory = 0.9;  // GPUs: the fraction of each GPU's memory for weights + KV + scratch
    // "shared": prefill and decode workers of a device use one KV arena (hand-offs
    // copy nothing); "per-role": each role its own (ServeLayout::kv_split).
    std::string kv_arenas = "shared";
    std::string kv_dtype = "f16";  // f16, int8, fp8 (ServeLayout::kv_dtype)
    bool cuda_qgemv = false;       // GPU workers: CudaBackendOptions::quantized_gemv
};

int cmd_serve(const ServeArgs& a);

struct FrontArgs {
    std::string instance;
    std::string model;
    std::string host = "127.0.0.1";
    int port = 8080;
    int io_threads = 2;
    int grace_s = 30;
    std::string chat_template;
    std::string cpus;  // pin the process (all its threads) here
};

int cmd_front(const FrontArgs& a);

}  // namespace duet
