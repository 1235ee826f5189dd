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
// continues token-identically (the invariance contract) — or, where that costs
// less, by swap (choose_preemption).
size_t pick_decode_victim(std::span<const DecodeSeqView> seqs);

// Decode's batch is full (every slot taken) and the hand-off at the head of a ring,
// of class `incoming_class`, waits: the sequence that gives up its slot, by the same
// preemption (swap or recompute; it keeps its place). Only one of a class strictly
// less urgent than the incoming request's: that is the threshold, a class apart, so
// requests of one class never displace each other and cannot thrash. Of those, as
// pick_decode_victim: the least urgent class, the newest. SIZE_MAX: none (the
// hand-off waits for a slot to end, as before).
size_t pick_slot_victim(std::span<const DecodeSeqView> seqs, uint32_t incoming_class);

enum class PreemptMode { Recompute, Swap };

// How a victim gives way, by what its return would cost. Swap: its KV is written
// out (bytes) and read back by prefill before it continues: 2 x bytes at
// swap_bytes_per_s. Recompute: prefill computes its positions again (tokens at
// prefill_tokens_per_s). The cheaper, recompute on a tie; recompute when swapping is
// off or not possible here (swap_bytes_per_s <= 0). A prefill rate not known yet
// (<= 0) makes swap the choice: a computation is never cheaper than copying its
// result back on the machines duet runs on (the CPU here: 23 KB of KV per token of
// the default model against ~450 tokens/s of prefill per core), except on fast GPUs,
// where both rates are measured before the first preemption matters.
PreemptMode choose_preemption(uint64_t bytes, int64_t tokens, double swap_bytes_per_s, double prefill_tokens_per_s);

}  // namespace duet
