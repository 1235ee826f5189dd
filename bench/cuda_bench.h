// `duet bench cuda`: the CUDA backend's figures, each against a floor measured in
// the same run on the same GPU (bench/RESULTS.md records them):
// - HBM bandwidth (a large device-to-device copy) and the bf16 matrix-product peak
//   (an 8192^3 cuBLAS product), the two references;
// - decode step time per batch size against its floor: (bf16 weights + the KV the
//   step reads) / HBM bandwidth; with and without CUDA graphs at two sizes;
// - prefill tokens/s, as FLOP/s against the bf16 peak;
// - the per-layer KV copy of a hand-off between arenas (the plan of kv/kv_copy.h,
//   executed with one copy per run, contiguous and fragmented block ids) against
//   one plain copy of the same bytes; between two GPUs over peer access when there
//   are two, else within one;
// - contexts' KV through the host mirror (CudaKvStage's page-locked bounce pool)
//   against one page-locked copy of the same bytes, and the direct pageable copy.
// Built only with DUET_CUDA; this header includes no CUDA header.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/result.h"
#include "kv/kv_pool.h"

namespace duet {

struct CudaBenchOptions {
    std::string model;
    int device = 0;
    std::vector<int> batches = {1, 8, 32, 64, 128, 256};
    int ctx = 512;          // tokens per sequence before the timed decode steps
    int steps = 32;         // timed decode steps per batch size
    int prefill_tokens = 2048;
    KvDtype kv_dtype = KvDtype::F16;  // how the KV cache stores its values
    // Figures left out, for a model at real size within a device check's minutes:
    // sampled (the sampled step), eager (the graph-less backend: a second copy of
    // the weights), qgemv (the quantized-GEMV backend and its projection table),
    // copies (the hand-off copy and the mirror's).
    bool sampled = true, eager = true, qgemv = true, copies = true;
};

// Runs everything asked for; each figure is also printed to stderr as one JSON line
// when done (a run stopped at a time limit keeps what it measured); the figures as JSON ("hbm_gb_s", "bf16_tflops",
// "decode": [...], "prefill": {...}, "kv_copy": {...}).
Result<nlohmann::json> run_cuda_bench(const CudaBenchOptions& o);

// The same figures as a Markdown section (what scripts/gpu-check puts in its report).
std::string cuda_bench_markdown(const nlohmann::json& j);

}  // namespace duet
