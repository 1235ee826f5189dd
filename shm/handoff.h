// Handing a request and its KV blocks from one process to another (prefill to
// decode) without copying and without a crash window. The protocol and its crash
// cases are written down in shm/README.md ("Hand-off between processes").
#pragma once

#include "shm/kv_arena.h"
#include "shm/request_table.h"

namespace duet::shm {

// What a hand-off message names: the request, the attempt the giver prefilled, and
// the giver (registry ref and arena user).
struct Handoff {
    ReqRef req;
    uint32_t attempt = 0;
    ProcRef from;
    uint32_t from_user = 0;
};

// Receiver: if r is still exactly (attempt, PREFILLING, owned by the giver), takes
// its own references to every block in r's table from the giver (each only while
// the giver still holds it) and commits with one exact CAS to (DECODING, owned by
// `to`). True: r and the references are the receiver's. False: nothing changed
// hands (the giver died and was recovered, r was re-driven, cancelled, or is a later
// attempt), and the receiver holds nothing of r.
bool handoff_accept(KvArena& arena, RequestTable& table, const Handoff& h, ProcRef to, uint32_t to_user);

// Giver: whether r has left (attempt, PREFILLING, owned by the giver) — committed by
// the receiver, re-driven, cancelled or reused — so the giver can drop its own
// references to the blocks it handed.
bool handoff_settled(const RequestTable& table, const Handoff& h);

}  // namespace duet::shm
