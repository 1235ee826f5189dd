// The golden-logits gate: before a worker says it is ready, it runs fixed prompts
// through its own backend and KV arena and compares the log-probabilities with a
// reference recorded for this model (a wrong or corrupted weight file, a broken
// kernel or device, a KV dtype that misbehaves: all fail here, not in answers).
//
// A reference (JSON) names the model by its fingerprint and holds, for each prompt
// (token ids), at some positions, [id, log-probability] pairs and the tolerance:
//   {"format": "duet-golden-1", "model_fingerprint": "0x…", "source": "…",
//    "tolerance": {"mean": 0.5, "max": 2.5, "top1_gap": 1.4},
//    "prompts": [{"name": "…", "ids": […], "positions": [{"pos": 4, "logprobs": [[29, -0.9], …]}]}]}
// A prompt fails when its mean |Δ log-prob| exceeds `mean`, any one exceeds `max`,
// or the top-1 differs where the reference's top-1/top-2 gap exceeds `top1_gap`.
//
// Where references come from: `duet golden record` (a trusted run of duet on this
// backend and KV dtype; or, --from, a llama.cpp logits fixture), a file next to the
// model (<model>.golden.json), and the built-in one for the default model (from
// llama.cpp, tests/fixtures/logits.json, through `duet golden record --from`).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "base/result.h"
#include "kv/kv_pool.h"
#include "model/backend.h"

namespace duet {

struct GoldenRef {
    struct Position {
        int32_t pos = 0;
        std::vector<std::pair<int32_t, double>> logprobs;  // the first is the reference's top-1, the second its top-2
    };
    struct Prompt {
        std::string name;
        std::vector<int32_t> ids;
        std::vector<Position> positions;
    };
    uint64_t model_fingerprint = 0;
    std::string source;
    double tol_mean = 0.5, tol_max = 2.5, tol_top1_gap = 1.4;
    std::vector<Prompt> prompts;
};

Result<GoldenRef> parse_golden(const std::string& json_text);
std::string golden_json(const GoldenRef& ref);

// The built-in references (the default model's); the one for `fingerprint`, if any.
const GoldenRef* builtin_golden(uint64_t fingerprint);

struct GoldenReport {
    bool passed = false;
    std::string summary;  // per prompt: mean and worst |Δ log-prob|; and what failed
    double worst_mean = 0, worst = 0;
};

// Runs every prompt through `backend` with KV blocks from `pool` (released after)
// and compares. Errors: the pass itself failed (no blocks, a backend error); a
// reference for another model is a failed report, not an error.
Result<GoldenReport> check_golden(Backend& backend, KvPool& pool, uint64_t model_fingerprint, const GoldenRef& ref);

// A reference from this backend: `shape`'s prompts and positions, the logprobs of the
// top `top_k` ids at each (the tolerance and source as given).
Result<GoldenRef> record_golden(Backend& backend, KvPool& pool, uint64_t model_fingerprint, const GoldenRef& shape,
                                int top_k);

// Which reference a worker checks against. `spec`: "none" (no check), "auto" (a file
// <model_path>.golden.json, else the built-in one, else none), or a file path (its
// fingerprint must be this model's). Null: no reference (unchecked).
Result<std::unique_ptr<GoldenRef>> find_golden(const std::string& spec, const std::string& model_path,
                                               uint64_t model_fingerprint);

// A worker's exit status when its check fails: systemd's RestartPreventExitStatus=3
// keeps it from restarting into the same failure, and the launcher stops serving.
constexpr int kGoldenExitCode = 3;

}  // namespace duet
