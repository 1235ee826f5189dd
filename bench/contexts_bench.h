// `duet bench contexts`: the context store (src/engine/contexts.h) in one process,
// against re-computing the same tokens on the same threads, measured in the same
// run:
// - edit: a context of --tokens tokens, its last 16 replaced by 16 new ones and the
//   next token's logits, against one fresh prefill of all tokens + 16;
// - restart restore: a durable context of --restore-tokens tokens, the store opened
//   again (page cache dropped: cold) and the next token's logits, against a cold
//   prefill of the same tokens;
// - multi-turn: --turns turns of a user message and a reply appended to a context,
//   each turn's first-token logits, against prefilling the whole history each turn
//   (the tokens each way computes, and the total time to the first tokens).
// Markdown by default, --json for one object. The HTTP path (/v1/contexts) is
// measured separately once it exists.
#pragma once

#include <string>

namespace duet {

struct ContextBenchArgs {
    std::string model;
    int threads = 2;
    int tokens = 2048;          // the edited context
    int restore_tokens = 4096;  // the restored context
    int turns = 20;             // multi-turn: turns
    int user_tokens = 48, reply_tokens = 24;
    int reps = 3;               // edits and restores (median kept)
    std::string dir;            // "": a new directory under /var/tmp
    bool json = false;
};

int cmd_bench_contexts(const ContextBenchArgs& a);

}  // namespace duet
