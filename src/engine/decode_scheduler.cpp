#include "engine/decode_scheduler.h"

#include <algorithm>

namespace duet {

DecodeStep plan_decode(std::span<const DecodeRowView> active, std::span<const DecodeSeqView> parked,
                       DecodeArenaView arena, uint64_t kv_wait_ns) {
    DecodeStep s;
    if (active.empty()) return s;
    int64_t with_drafts = 0, plain = 0;
    for (const DecodeRowView& r : active) {
        with_drafts += r.need;
        plain += r.need_one;
    }
    if (with_drafts <= arena.available || plain <= arena.available) {
        const bool drafts = with_drafts <= arena.available;
        s.action = DecodeStep::Action::Run;
        for (size_t i = 0; i < active.size(); ++i)
            s.rows.push_back({i, drafts ? std::max<int32_t>(1, active[i].want) : 1});
        return s;
    }
    std::vector<DecodeSeqView> seqs(active.size());
    for (size_t i = 0; i < active.size(); ++i) seqs[i] = active[i].seq;
    const size_t v = pick_decode_victim(seqs);
    const size_t vp = pick_decode_victim(parked);
    if (vp != SIZE_MAX && parked[vp].slo_class >= seqs[v].slo_class) {
        s.action = DecodeStep::Action::PreemptParked;
        s.victim = vp;
        return s;
    }
    s.victim = v;
    if (active.size() > 1) {
        s.action = DecodeStep::Action::Preempt;
    } else if (active[v].fits_arena && arena.others_hold && active[v].waited_ns < kv_wait_ns) {
        s.action = DecodeStep::Action::Wait;
    } else {
        s.action = DecodeStep::Action::Fail;
    }
    return s;
}

}  // namespace duet
