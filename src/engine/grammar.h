// Grammar-constrained decoding: a request's grammar (a JSON schema, any JSON
// object, or an EBNF grammar) as the set of tokens it allows next, applied where a
// token is chosen (roles/worker_base.cpp WorkerBase::draw) by setting every other
// token's logit to -inf before sampling.
//
// The engine is xgrammar's C++ core (Apache-2.0; fetched and compiled by
// cmake/xgrammar.cmake), which compiles a grammar against the model's vocabulary
// and walks it token by token. Two things duet adds:
// - Nothing is silently skipped. xgrammar ignores some JSON-schema keywords and
//   drops some constraints with a warning; check_grammar() turns every such
//   warning into an error, and the front (roles/json_schema_check.h) refuses
//   keywords outside the supported set before that, so a request either gets the
//   constraint it asked for or a 400 naming what cannot be honoured.
// - The state is a function of the output. A request's matcher is kept per worker
//   process and synced to the request's output tokens at each pick (rolled back to
//   their common prefix, then fed the rest), so a hand-off, a re-drive after a
//   crash, a preemption or rejected drafts all rebuild it exactly, and the same
//   seed gives the same output.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "base/result.h"

namespace duet {

class Tokenizer;

enum class GrammarKind : uint8_t {
    JsonSchema = 1,     // source: a JSON schema (response_format json_schema)
    JsonObject = 2,     // any JSON object (response_format json_object); source empty
    Ebnf = 3,           // source: xgrammar's EBNF, root rule "root"
    StructuralTag = 4,  // source: an xgrammar structural tag (JSON): tool calls (roles/tool_calls.h)
};

struct GrammarSpec {
    GrammarKind kind = GrammarKind::JsonSchema;
    std::string source;
    friend bool operator==(const GrammarSpec&, const GrammarSpec&) = default;
};

// Whether the grammar can be honoured exactly (what the front asks before admitting
// a request; compiled against a byte vocabulary, not the model's): the parse or
// conversion error, or the first constraint xgrammar would drop or approximate, as
// a message for a 400. A source seen before gets its verdict from a memo
// (thread-safe; 256 sources).
Status check_grammar(const GrammarSpec& g);

// (A mask from GrammarSet::allowed is applied to a row by model/sampler.h
// apply_token_mask.)

// One process's grammars over one vocabulary: compiled ones cached by their source,
// and the matcher of each request it picks tokens for.
class GrammarSet {
public:
    // n_vocab: the width of the model's logits (>= the tokenizer's vocabulary).
    GrammarSet(const Tokenizer& tok, int32_t n_vocab);
    ~GrammarSet();
    GrammarSet(const GrammarSet&) = delete;
    GrammarSet& operator=(const GrammarSet&) = delete;

    // The tokens grammar g allows after `output` (the request's output tokens so far),
    // as a bitset of n_vocab bits (bit i of word i / 32: token i allowed), valid until
    // the next call. key names the request (its matcher is kept under it). Errors: the
    // grammar does not compile, or an output token is one it does not allow (the
    // output was not made under it).
    Result<std::span<const uint32_t>> allowed(uint64_t key, const GrammarSpec& g, std::span<const int32_t> output);
    // Forgets request key's matcher (it ended, or left this process). Forgetting is
    // never needed for correctness: a matcher is rebuilt from the output.
    void forget(uint64_t key);
    // Compiles grammar g ahead, on a background thread (at the caller's priority; one
    // compile at a time in the process, its or the caller's), so that the allowed()
    // that first needs it finds it compiled instead of compiling inside a step: for a
    // request on its way here (decode: while prefill computes it). allowed() for a
    // grammar still being compiled ahead waits for that compile; one queued and not
    // yet started it compiles itself. A grammar compiled or queued already is not
    // queued again; past 64 queued, none is. Never needed for correctness: a grammar
    // that fails to compile ahead is compiled (and fails) in allowed(), and where no
    // thread can be started nothing is compiled ahead.
    void prefetch(const GrammarSpec& g);
    // Returns once nothing is queued or being compiled ahead (tests).
    void wait_prefetched();
    int32_t n_vocab() const;
    size_t n_matchers() const;
    // Compile and mask times, for /metrics and the benchmark.
    struct Stats {
        // Compiles in allowed(), on the caller's thread (its step waited for them),
        // and the time it spent in them or waiting for a compile ahead to end.
        uint64_t compiles = 0, compile_ns = 0;
        // Compiles ahead (prefetch), on the background thread, and their time; used:
        // how many allowed() found compiled ahead, waited: found still compiling.
        uint64_t ahead = 0, ahead_ns = 0, ahead_used = 0, ahead_waited = 0;
        uint64_t masks = 0, mask_ns = 0;
        uint64_t fed = 0, rolled_back = 0;  // tokens accepted / undone to sync with outputs
    };
    Stats stats() const;

private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

}  // namespace duet
