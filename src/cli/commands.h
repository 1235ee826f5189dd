// The CLI subcommands. Each returns the process exit status and prints its own
// errors to stderr.
#pragma once

#include <string>

#include "engine/engine.h"

namespace duet {

struct RunArgs {
    std::string model;
    std::string prompt;
    bool chat = false;
    std::string system;
    std::string chat_template;
    int64_t max_tokens = 128;
    bool ignore_eos = false;
    SamplingParams sampling;
    std::string cpus;
    EngineOptions engine;
};

struct BenchArgs {
    std::string model;
    int n_prompt = 512;
    int n_gen = 128;
    int reps = 3;
    int verify = 8;  // a verify row of this many positions against as many single steps (0: not measured)
    // Passes of R rows for each R here, R sequences of one position and one sequence of
    // R positions, against the 1-row pass and the weight-read floor (empty: not measured).
    std::vector<int> rows;
    bool json = false;
    std::string cpus;
    EngineOptions engine;
};

int cmd_run(RunArgs args);
int cmd_info(const std::string& model);
// jsonl: each line of standard input a JSON string, tokenized to a line of ids (a
// reference script's many texts, one process).
// Conversations rendered by the model's chat template (or the named one), a JSON line
// each way (a reference script's many conversations, one process).
int cmd_chat_template(const std::string& model, const std::string& name);
int cmd_tokenize(const std::string& model, std::string text, bool have_text, bool parse_special, bool jsonl = false);
int cmd_bench_model(BenchArgs args);
// duet model synth (model/synth.h): the shape and type by name; layers -1: the shape's.
int cmd_model_synth(const std::string& shape, const std::string& type, int64_t layers, uint64_t seed,
                    const std::string& out);

}  // namespace duet
