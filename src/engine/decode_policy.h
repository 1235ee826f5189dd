// Decode's policy when a step cannot get the KV blocks it needs: which sequence
// gives way. A pure function over plain views, table-tested without a model; the
// scheduling issue's preemption (classes, swap or recompute) fills it in.
#pragma once

#include <cstdint>
#include <span>

namespace duet {

struct DecodeSeqView {
    uint64_t admitted = 0;   // when it joined decode (an order: larger is later)
    int64_t tokens = 0;      // positions with KV
    uint32_t slo_class = 1;  // engine/scheduling.h SloClass: 0 critical, 1 standard, 2 batch
};

// The index of the sequence to give up: one of the least urgent class present, and
// of those the newest (the least work lost, and every request keeps its place behind
// the ones admitted before it); ties on `admitted` go to the later index. An empty
// span: none (SIZE_MAX). The one that gives way is preempted by recompute: its KV is
// dropped and its request goes back to prefill with its output so far, which it
// continues token-identically (the invariance contract).
size_t pick_decode_victim(std::span<const DecodeSeqView> seqs);

}  // namespace duet
