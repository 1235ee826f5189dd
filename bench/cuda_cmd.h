// `duet bench cuda`: the CUDA backend against floors measured on the same GPU
// (bench/cuda_bench.h). Markdown by default, --json for one JSON object.
#pragma once

#include <string>
#include <vector>

namespace duet {

struct CudaBenchArgs {
    std::string model;
    std::string device = "cuda:0";
    std::vector<int> batches;  // empty: 1, 8, 32, 64, 128, 256
    int ctx = 512;
    int steps = 32;
    int prefill_tokens = 2048;
    std::string kv_dtype = "f16";
    bool json = false;
    std::string json_out;  // also write the JSON here
    std::string trace;     // a trace file (base/trace.h); empty: none
    std::vector<std::string> skip;  // figures left out: sampled, eager, qgemv, copies
};

int cmd_bench_cuda(const CudaBenchArgs& a);

}  // namespace duet
