// duet golden record / duet golden check: the golden-logits references the workers
// check before they are ready (engine/golden.h).
#pragma once

#include <string>

namespace duet {

struct GoldenArgs {
    std::string model;
    std::string out;             // record: default <model>.golden.json
    std::string from;            // record: a llama.cpp logits fixture instead of this run's logits
    std::string golden = "auto";  // check: auto, none, or a file
    std::string device = "cpu";
    std::string kv_dtype = "f16";
    std::string isa;
    double tol_mean = 0.5, tol_max = 2.5, tol_top1_gap = 1.4;
};

int cmd_golden_record(const GoldenArgs& a);
// Exit 0: passed or no reference; 3 (kGoldenExitCode): failed; 1: could not run.
int cmd_golden_check(const GoldenArgs& a);

}  // namespace duet
