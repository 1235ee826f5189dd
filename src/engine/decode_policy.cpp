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

}  // namespace duet
