// Drafts for verify rows (engine/decode_scheduler.h): tokens a sequence is likely to
// produce next, proposed before the pass that checks them. A draft costs a position
// in the pass and never changes the output: the worker keeps a drafted token only
// when the draw at its position (the same draw plain decoding makes, keyed by seed
// and position, over logits that do not depend on the row's length: the invariance
// contract) picked it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace duet {

class Drafter {
public:
    virtual ~Drafter() = default;
    // Up to out.size() tokens to follow `output` (the sequence's tokens so far:
    // prompt then output), written to out; how many.
    virtual size_t propose(std::span<const int32_t> prompt, std::span<const int32_t> output,
                           std::span<int32_t> out) const = 0;
};

// Prompt lookup: the longest suffix of the sequence (max_ngram tokens down to
// min_ngram) that occurred earlier in its prompt or output, most recent occurrence
// first; the tokens that followed it there are the draft. Pays where output copies
// input (quoting, editing, extraction); proposes nothing otherwise.
class PromptLookupDrafter final : public Drafter {
public:
    PromptLookupDrafter(int min_ngram = 2, int max_ngram = 4) : min_(min_ngram), max_(max_ngram) {}
    size_t propose(std::span<const int32_t> prompt, std::span<const int32_t> output,
                   std::span<int32_t> out) const override;

private:
    int min_, max_;
};

}  // namespace duet
