// `duet bench grammar`: the cost structured outputs add to each token, against the
// goals the structured-outputs issue sets (mask p50 <= 50 us, p99 <= 1 ms at this
// vocabulary, one core; compile <= 10 ms typical, cached after). For each schema of
// a JSON-lines corpus (tests/cli/schema_corpus.py prints one): its first compile,
// a compile found in the cache, then a walk of tokens drawn among those its mask
// allows, timing per token the mask (engine/grammar.h GrammarSet::allowed: the
// matcher fed the new token, the bitmask filled) and its application to a row of
// logits (every banned token set to -inf, as WorkerBase::pick does); and, measured
// in the same run as the reference, one read of a row of logits (the floor of
// applying any mask). Markdown by default, --json for one object.
#pragma once

#include <string>

namespace duet {

struct GrammarBenchArgs {
    std::string model;
    std::string schemas;  // JSON lines with a "schema" (and a "name"); "-": stdin
    int tokens = 64;      // walked per schema (fewer when its grammar ends first)
    unsigned seed = 1;
    bool json = false;
};

int cmd_bench_grammar(const GrammarBenchArgs& a);

}  // namespace duet
