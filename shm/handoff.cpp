#include "shm/handoff.h"

#include <vector>

namespace duet::shm {

bool handoff_accept(KvArena& arena, RequestTable& table, const Handoff& h, ProcRef to, uint32_t to_user) {
    if (!table.is_with(h.req, h.attempt, ReqState::Prefilling, h.from)) return false;
    // Acquire pairs with the giver's release of the count: the entries are written.
    const uint32_t n = table.slot(h.req.slot).n_blocks.load(std::memory_order_acquire);
    const int32_t* blocks = table.blocks(h.req.slot);
    std::vector<int32_t> taken;
    taken.reserve(n);
    for (uint32_t i = 0; i < n; ++i) {
        if (!arena.share(h.from_user, to_user, blocks[i])) break;
        taken.push_back(blocks[i]);
    }
    if (taken.size() == n &&
        table.commit(h.req, h.attempt, ReqState::Prefilling, h.from, ReqState::Decoding, to))
        return true;
    arena.unref(to_user, taken.data(), static_cast<uint32_t>(taken.size()));
    return false;
}

bool handoff_settled(const RequestTable& table, const Handoff& h) {
    return !table.is_with(h.req, h.attempt, ReqState::Prefilling, h.from);
}

}  // namespace duet::shm
