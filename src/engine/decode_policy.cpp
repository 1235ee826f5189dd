#include "engine/decode_policy.h"

#include <cstdint>

namespace duet {

size_t pick_decode_victim(std::span<const DecodeSeqView> seqs) {
    size_t v = SIZE_MAX;
    for (size_t i = 0; i < seqs.size(); ++i)
        if (v == SIZE_MAX || seqs[i].slo_class > seqs[v].slo_class ||
            (seqs[i].slo_class == seqs[v].slo_class && seqs[i].admitted >= seqs[v].admitted))
            v = i;
    return v;
}

size_t pick_slot_victim(std::span<const DecodeSeqView> seqs, uint32_t incoming_class) {
    const size_t v = pick_decode_victim(seqs);
    return v != SIZE_MAX && seqs[v].slo_class > incoming_class ? v : SIZE_MAX;
}

PreemptMode choose_preemption(uint64_t bytes, int64_t tokens, double swap_bytes_per_s, double prefill_tokens_per_s) {
    if (swap_bytes_per_s <= 0 || tokens <= 0) return PreemptMode::Recompute;
    if (prefill_tokens_per_s <= 0) return PreemptMode::Swap;
    const double swap_s = 2.0 * static_cast<double>(bytes) / swap_bytes_per_s;
    const double recompute_s = static_cast<double>(tokens) / prefill_tokens_per_s;
    return swap_s < recompute_s ? PreemptMode::Swap : PreemptMode::Recompute;
}

}  // namespace duet
