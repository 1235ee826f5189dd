#include "shm/request_table.h"

#include "shm/doorbell.h"  // DUET_TSAN: defined when built under ThreadSanitizer

#include <cstring>
#include <new>

namespace duet::shm {

namespace {

constexpr uint32_t kReqMagic = 0x74716572;  // "reqt"

// owner: registry slot + 1, 0 for none.
uint64_t pack_sg(uint32_t gen, uint32_t owner, ReqState s) {
    return (static_cast<uint64_t>(gen) << 24) | (static_cast<uint64_t>(owner & 0xffff) << 8) |
           static_cast<uint64_t>(s);
}
uint32_t gen_of(uint64_t sg) { return static_cast<uint32_t>(sg >> 24); }
// Bits 56..63: the attempt, bumped each time a running request goes back to QUEUED,
// so a message about an earlier attempt (a stale hand-off) can be told apart even
// when the same request is being prefilled again by a process in the same slot.
constexpr uint64_t kAttemptMask = 0xffull << 56;
uint32_t attempt_of(uint64_t sg) { return static_cast<uint32_t>(sg >> 56); }
uint32_t owner_of(uint64_t sg) { return static_cast<uint32_t>((sg >> 8) & 0xffff); }
ReqState state_of(uint64_t sg) { return static_cast<ReqState>(sg & 0xff); }

// A request's own data: its header, then up to ext_bytes, in whole cache lines.
size_t ext_stride(uint32_t ext_bytes) { return sizeof(ReqExtHeader) + (size_t{ext_bytes} + 63) / 64 * 64; }

size_t slot_bytes(uint32_t max_tokens, uint32_t max_blocks) {
    size_t b = sizeof(ReqSlot) + 4ull * max_tokens + 4ull * max_blocks;
    return (b + 63) / 64 * 64;
}

}  // namespace

const char* req_state_name(ReqState s) {
    switch (s) {
    case ReqState::Free: return "FREE";
    case ReqState::Queued: return "QUEUED";
    case ReqState::Prefilling: return "PREFILLING";
    case ReqState::Decoding: return "DECODING";
    case ReqState::Finished: return "FINISHED";
    case ReqState::Failed: return "FAILED";
    case ReqState::Cancelled: return "CANCELLED";
    }
    return "?";
}

bool req_transition_allowed(ReqState from, ReqState to) {
    using S = ReqState;
    switch (from) {
    case S::Free: return false;  // only submit() leaves FREE (with a new generation)
    case S::Queued: return to == S::Prefilling || to == S::Failed || to == S::Cancelled;
    case S::Prefilling:
        return to == S::Decoding || to == S::Finished || to == S::Failed || to == S::Cancelled || to == S::Queued;
    case S::Decoding: return to == S::Finished || to == S::Failed || to == S::Cancelled || to == S::Queued;
    case S::Finished:
    case S::Failed:
    case S::Cancelled: return to == S::Free;
    }
    return false;
}

size_t RequestTable::bytes(const RequestTableConfig& c) {
    if (c.block_tokens == 0) return sizeof(RequestTableHeader);  // init() rejects it
    uint32_t max_blocks = (c.max_tokens + c.block_tokens - 1) / c.block_tokens;
    return sizeof(RequestTableHeader) + slot_bytes(c.max_tokens, max_blocks) * c.n_slots +
           sizeof(TokenLogprob) * kLogprobRow * c.max_tokens * c.n_slots + size_t{kReqFrontBytes} * c.n_slots +
           ext_stride(c.ext_bytes) * c.n_slots;
}

Status RequestTable::init(void* mem, const RequestTableConfig& c) {
    if (c.n_slots == 0 || c.max_tokens == 0 || c.block_tokens == 0)
        return make_error("request table needs slots, tokens and a block size (got {}, {}, {})", c.n_slots,
                          c.max_tokens, c.block_tokens);
    // Header and slots; the log-probability rows after them are read only where
    // written (and a new segment is zero anyway), so their pages stay untouched.
    const uint32_t max_blocks = (c.max_tokens + c.block_tokens - 1) / c.block_tokens;
    std::memset(mem, 0, sizeof(RequestTableHeader) + slot_bytes(c.max_tokens, max_blocks) * c.n_slots);
    auto* h = new (mem) RequestTableHeader{};
    h->n_slots = c.n_slots;
    h->max_tokens = c.max_tokens;
    h->max_blocks = (c.max_tokens + c.block_tokens - 1) / c.block_tokens;
    h->slot_bytes = slot_bytes(h->max_tokens, h->max_blocks);
    h->ext_bytes = c.ext_bytes;
    for (uint32_t i = 0; i < c.n_slots; ++i)
        new (reinterpret_cast<uint8_t*>(h + 1) + i * h->slot_bytes) ReqSlot{};
    h->magic = kReqMagic;
    return {};
}

Result<RequestTable> RequestTable::attach(void* mem) {
    RequestTable t;
    t.h_ = static_cast<RequestTableHeader*>(mem);
    if (t.h_->magic != kReqMagic) return make_error("not a request table (magic {:#x})", t.h_->magic);
    return t;
}

Status RequestTable::set_front_data(ReqRef r, const void* data, uint32_t len) {
    ReqFrontRecord& f = front_record(r.slot);
    if (len > sizeof f.data) return make_error("a front record of {} bytes; a slot holds {}", len, sizeof f.data);
    if (current(r.slot).gen != r.gen) return make_error("request slot {} no longer holds the request", r.slot);
    f.ref.store(0, std::memory_order_relaxed);
    f.orphaned_ns.store(0, std::memory_order_relaxed);
    std::memcpy(f.data, data, len);
    f.len = len;
    // Release: a reader that sees the ref sees the bytes.
    f.ref.store(((static_cast<uint64_t>(r.gen) << 32) | r.slot) + 1, std::memory_order_release);
    return {};
}

ReqExtHeader& RequestTable::ext(uint32_t i) const {
    auto* base = reinterpret_cast<uint8_t*>(&front_record(0)) + size_t{kReqFrontBytes} * h_->n_slots;
    return *reinterpret_cast<ReqExtHeader*>(base + static_cast<size_t>(i) * ext_stride(h_->ext_bytes));
}

Status RequestTable::set_ext_data(ReqRef r, const void* data, uint32_t len) {
    if (r.slot >= h_->n_slots) return make_error("request slot {} out of range", r.slot);
    if (len > h_->ext_bytes)
        return make_error("{} bytes of request data; a request holds at most {}", len, h_->ext_bytes);
    if (current(r.slot).gen != r.gen) return make_error("request slot {} no longer holds the request", r.slot);
    ReqExtHeader& e = ext(r.slot);
    e.ref.store(0, std::memory_order_relaxed);
    std::memcpy(reinterpret_cast<uint8_t*>(&e) + sizeof e, data, len);
    e.len = len;
    // Release: a reader that sees the ref sees the bytes.
    e.ref.store(((static_cast<uint64_t>(r.gen) << 32) | r.slot) + 1, std::memory_order_release);
    return {};
}

std::optional<std::vector<uint8_t>> RequestTable::ext_data(ReqRef r) const {
    if (r.slot >= h_->n_slots) return std::nullopt;
    const ReqExtHeader& e = ext(r.slot);
    const uint64_t want = ((static_cast<uint64_t>(r.gen) << 32) | r.slot) + 1;
    if (e.ref.load(std::memory_order_acquire) != want || e.len > h_->ext_bytes) return std::nullopt;
    const auto* p = reinterpret_cast<const uint8_t*>(&e) + sizeof e;
    std::vector<uint8_t> out(p, p + e.len);
    // Written once per request, before the request was sent: data still naming r
    // after the copy, in a slot that still holds r, is r's. The check comes after
    // the copy's loads (a seqlock reader, as read_output).
#ifdef DUET_TSAN
    const bool still = const_cast<ReqExtHeader&>(e).ref.fetch_add(0, std::memory_order_acq_rel) == want;
#else
    std::atomic_thread_fence(std::memory_order_acquire);
    const bool still = e.ref.load(std::memory_order_relaxed) == want;
#endif
    if (!still || current(r.slot).gen != r.gen) return std::nullopt;
    return out;
}

std::optional<std::string> RequestTable::front_data(ReqRef r) const {
    const ReqFrontRecord& f = front_record(r.slot);
    const uint64_t want = ((static_cast<uint64_t>(r.gen) << 32) | r.slot) + 1;
    if (f.ref.load(std::memory_order_acquire) != want || f.len > sizeof f.data) return std::nullopt;
    std::string out(reinterpret_cast<const char*>(f.data), f.len);
    // Written once per request, before the request was sent: a record still naming
    // r after the copy, in a slot that still holds r, is r's.
    if (f.ref.load(std::memory_order_acquire) != want || current(r.slot).gen != r.gen) return std::nullopt;
    return out;
}

bool RequestTable::set_client(ReqRef r, ProcRef client) {
    if (current(r.slot).gen != r.gen || state(r.slot) == ReqState::Free) return false;
    slot(r.slot).client.store(client.pack(), std::memory_order_release);
    return current(r.slot).gen == r.gen;
}

Result<ReqRef> RequestTable::submit(ProcRef owner, const int32_t* prompt, uint32_t n_prompt, const void* params,
                                    uint32_t params_bytes) {
    if (n_prompt == 0) return make_error("the prompt is empty");
    if (n_prompt > h_->max_tokens)
        return make_error("the prompt has {} tokens; a request slot holds {}", n_prompt, h_->max_tokens);
    if (params_bytes > kReqParamBytes)
        return make_error("sampling parameters are {} bytes; a slot holds {}", params_bytes, kReqParamBytes);
    auto r = reserve(owner);
    if (!r) return r.error();
    if (Status st = queue(*r, prompt, n_prompt, params, params_bytes, owner); !st) return st.error();
    return r;
}

Result<ReqRef> RequestTable::reserve(ProcRef owner) {
    if (!owner.valid() || owner.slot >= 0xffff) return make_error("a request needs a registered owner");
    const uint32_t start = h_->hint.load(std::memory_order_relaxed);
    for (uint32_t k = 0; k < h_->n_slots; ++k) {
        uint32_t i = (start + k) % h_->n_slots;
        ReqSlot& s = slot(i);
        uint64_t sg = s.state_gen.load(std::memory_order_relaxed);
        if (state_of(sg) != ReqState::Free || owner_of(sg) != 0) continue;  // busy, or reserved by a submitter
        uint32_t gen = gen_of(sg) + 1;
        if (gen == 0) gen = 1;  // 32 bits of generation are used; wraps after 4e9 reuses
        // Acquire pairs with the release of the transition that freed the slot.
        if (!s.state_gen.compare_exchange_strong(sg, pack_sg(gen, owner.slot + 1, ReqState::Free),
                                                 std::memory_order_acquire, std::memory_order_relaxed))
            continue;
        h_->hint.store(i + 1, std::memory_order_relaxed);
        return ReqRef{i, gen};
    }
    return make_error("all {} request slots are in use; retry later", h_->n_slots);
}

Status RequestTable::queue(ReqRef r, const int32_t* prompt, uint32_t n_prompt, const void* params,
                           uint32_t params_bytes, ProcRef client) {
    if (r.slot >= h_->n_slots) return make_error("request slot {} out of range", r.slot);
    if (n_prompt == 0 || n_prompt > h_->max_tokens)
        return make_error("the prompt has {} tokens; a request slot holds 1 to {}", n_prompt, h_->max_tokens);
    if (params_bytes > kReqParamBytes)
        return make_error("sampling parameters are {} bytes; a slot holds {}", params_bytes, kReqParamBytes);
    ReqSlot& s = slot(r.slot);
    const uint64_t sg = s.state_gen.load(std::memory_order_relaxed);
    if (gen_of(sg) != r.gen || state_of(sg) != ReqState::Free || owner_of(sg) == 0)
        return make_error("request {}.{} is not reserved", r.slot, r.gen);
    s.cancel.store(0, std::memory_order_relaxed);
    s.n_cached.store(0, std::memory_order_relaxed);
    s.n_output.store(0, std::memory_order_relaxed);
    s.n_blocks.store(0, std::memory_order_relaxed);
    s.error_code.store(0, std::memory_order_relaxed);
    s.n_swapped.store(0, std::memory_order_relaxed);
    s.end_code.store(0, std::memory_order_relaxed);
    s.n_drafted.store(0, std::memory_order_relaxed);
    s.n_draft_kept.store(0, std::memory_order_relaxed);
    s.prefill_ns.store(0, std::memory_order_relaxed);
    s.handoff_ns.store(0, std::memory_order_relaxed);
    s.first_step_ns.store(0, std::memory_order_relaxed);
    s.client.store(client.pack(), std::memory_order_relaxed);
    s.kv_to.store(0, std::memory_order_relaxed);
    s.submit_ns = monotonic_ns();
    std::memset(s.params, 0, kReqParamBytes);
    if (params_bytes) std::memcpy(s.params, params, params_bytes);
    std::memcpy(tokens(r.slot), prompt, 4ull * n_prompt);
    s.n_prompt.store(n_prompt, std::memory_order_relaxed);
    // Release pairs with the acquire of whoever takes the request next (its
    // transition CAS or state load): the slot is filled before it is QUEUED. A plain
    // store: nobody else writes a reserved slot's word (unreserve() only after the
    // reserver died).
    s.state_gen.store(pack_sg(r.gen, owner_of(sg), ReqState::Queued), std::memory_order_release);
    return {};
}

bool RequestTable::transition(ReqRef r, ReqState from, ReqState to, ProcRef new_owner) {
    if (r.slot >= h_->n_slots || !req_transition_allowed(from, to)) return false;
    ReqSlot& s = slot(r.slot);
    uint64_t w = s.state_gen.load(std::memory_order_relaxed);
    for (;;) {
        if (gen_of(w) != r.gen || state_of(w) != from) return false;
        uint32_t owner = owner_of(w);
        if (new_owner.valid()) owner = new_owner.slot + 1;
        if (to == ReqState::Free) owner = 0;
        uint64_t attempt = w & kAttemptMask;
        if (to == ReqState::Queued) attempt = static_cast<uint64_t>((attempt_of(w) + 1) & 0xff) << 56;
        // acq_rel: publishes the actor's writes to the slot (release) and sees the
        // previous actor's (acquire).
        if (s.state_gen.compare_exchange_weak(w, pack_sg(r.gen, owner, to) | attempt, std::memory_order_acq_rel,
                                              std::memory_order_relaxed))
            return true;
    }
}

bool RequestTable::adopt(ReqRef r, ProcRef from, ProcRef new_owner) {
    if (r.slot >= h_->n_slots || !from.valid() || !new_owner.valid()) return false;
    ReqSlot& s = slot(r.slot);
    uint64_t w = s.state_gen.load(std::memory_order_relaxed);
    for (;;) {
        if (gen_of(w) != r.gen || state_of(w) == ReqState::Free || owner_of(w) != from.slot + 1) return false;
        // acq_rel: as transition().
        if (s.state_gen.compare_exchange_weak(w, pack_sg(r.gen, new_owner.slot + 1, state_of(w)) | (w & kAttemptMask),
                                              std::memory_order_acq_rel, std::memory_order_relaxed))
            return true;
    }
}

uint32_t RequestTable::attempt(uint32_t i) const {
    return attempt_of(slot(i).state_gen.load(std::memory_order_acquire));  // pairs with transition()
}

bool RequestTable::is_with(ReqRef r, uint32_t att, ReqState st, ProcRef owner) const {
    if (r.slot >= h_->n_slots) return false;
    uint64_t w = slot(r.slot).state_gen.load(std::memory_order_acquire);  // pairs with transition()
    return gen_of(w) == r.gen && attempt_of(w) == att && state_of(w) == st && owner_of(w) == owner.slot + 1;
}

bool RequestTable::commit(ReqRef r, uint32_t att, ReqState from, ProcRef from_owner, ReqState to, ProcRef to_owner) {
    if (r.slot >= h_->n_slots || !req_transition_allowed(from, to) || !to_owner.valid()) return false;
    uint64_t expect = pack_sg(r.gen, from_owner.slot + 1, from) | (static_cast<uint64_t>(att & 0xff) << 56);
    // acq_rel: as transition(). One exact CAS: generation, attempt, state and owner.
    return slot(r.slot).state_gen.compare_exchange_strong(
        expect, pack_sg(r.gen, to_owner.slot + 1, to) | (static_cast<uint64_t>(att & 0xff) << 56),
        std::memory_order_acq_rel, std::memory_order_relaxed);
}

int32_t RequestTable::owner_slot(uint32_t i) const {
    return static_cast<int32_t>(owner_of(slot(i).state_gen.load(std::memory_order_acquire))) - 1;  // pairs with transition()
}

ReqState RequestTable::state(uint32_t i) const {
    return state_of(slot(i).state_gen.load(std::memory_order_acquire));  // pairs with transition()
}

ReqRef RequestTable::current(uint32_t i) const {
    return ReqRef{i, gen_of(slot(i).state_gen.load(std::memory_order_acquire))};  // pairs with submit()
}

bool RequestTable::is(ReqRef r, ReqState st) const {
    if (r.slot >= h_->n_slots) return false;
    uint64_t w = slot(r.slot).state_gen.load(std::memory_order_acquire);  // pairs with transition()
    return gen_of(w) == r.gen && state_of(w) == st;
}

Status RequestTable::check_running(ReqRef r) const {
    if (r.slot >= h_->n_slots) return make_error("request slot {} out of range", r.slot);
    uint64_t w = slot(r.slot).state_gen.load(std::memory_order_relaxed);
    if (gen_of(w) != r.gen) return make_error("request {}.{} is gone (slot reused)", r.slot, r.gen);
    if (state_of(w) != ReqState::Prefilling && state_of(w) != ReqState::Decoding)
        return make_error("request {}.{} is {}: only a running request takes output or blocks", r.slot, r.gen,
                          req_state_name(state_of(w)));
    return {};
}

Status RequestTable::append_output(ReqRef r, const int32_t* toks, uint32_t n) {
    if (Status st = check_running(r); !st) return st;
    ReqSlot& s = slot(r.slot);
    uint32_t np = s.n_prompt.load(std::memory_order_relaxed);
    uint32_t no = s.n_output.load(std::memory_order_relaxed);  // ours alone
    if (np + no + n > h_->max_tokens)
        return make_error("request {}.{} would hold {} tokens; a slot holds {}", r.slot, r.gen, np + no + n,
                          h_->max_tokens);
    std::memcpy(tokens(r.slot) + np + no, toks, 4ull * n);
    // Release pairs with read_output()'s acquire: the tokens are written first.
    s.n_output.store(no + n, std::memory_order_release);
    return {};
}

Result<uint32_t> RequestTable::read_output(ReqRef r, uint32_t from, std::vector<int32_t>& out) const {
    if (r.slot >= h_->n_slots) return make_error("request slot {} out of range", r.slot);
    const ReqSlot& s = slot(r.slot);
    auto same = [&] { return gen_of(s.state_gen.load(std::memory_order_acquire)) == r.gen; };  // pairs with transitions
    if (!same()) return make_error("request {}.{} is gone (slot reused)", r.slot, r.gen);
    uint32_t n = s.n_output.load(std::memory_order_acquire);  // pairs with append_output()
    uint32_t np = s.n_prompt.load(std::memory_order_relaxed);  // set before QUEUED was published
    const size_t before = out.size();
    const int32_t* t = tokens(r.slot) + np;
    for (uint32_t i = from; i < n && np + i < h_->max_tokens; ++i) out.push_back(t[i]);
    // The slot may have been freed and reused while we copied: then the copy may hold
    // another request's tokens. The check must come after the copy's loads: a fence
    // (seqlock reader), or under ThreadSanitizer, which does not model fences, an
    // acq_rel RMW that leaves the word as it is.
#ifdef DUET_TSAN
    const bool still = gen_of(const_cast<ReqSlot&>(s).state_gen.fetch_add(0, std::memory_order_acq_rel)) == r.gen;
#else
    std::atomic_thread_fence(std::memory_order_acquire);
    const bool still = same();
#endif
    if (!still) {
        out.resize(before);
        return make_error("request {}.{} is gone (slot reused)", r.slot, r.gen);
    }
    return n;
}

Status RequestTable::append_blocks(ReqRef r, const int32_t* b, uint32_t n) {
    if (Status st = check_running(r); !st) return st;
    ReqSlot& s = slot(r.slot);
    uint32_t have = s.n_blocks.load(std::memory_order_relaxed);  // ours alone
    if (have + n > h_->max_blocks)
        return make_error("{} blocks; a slot's block table holds {}", have + n, h_->max_blocks);
    std::memcpy(blocks(r.slot) + have, b, 4ull * n);
    // Release pairs with readers' acquire of n_blocks.
    s.n_blocks.store(have + n, std::memory_order_release);
    return {};
}

Status RequestTable::offer_blocks(ReqRef r, const int32_t* b, uint32_t n) {
    if (r.slot >= h_->n_slots) return make_error("request slot {} out of range", r.slot);
    const uint64_t w = slot(r.slot).state_gen.load(std::memory_order_relaxed);
    if (gen_of(w) != r.gen) return make_error("request {}.{} is gone (slot reused)", r.slot, r.gen);
    if (state_of(w) != ReqState::Queued)
        return make_error("request {}.{} is {}: blocks are offered while it is queued", r.slot, r.gen,
                          req_state_name(state_of(w)));
    if (n > h_->max_blocks) return make_error("{} blocks; a slot's block table holds {}", n, h_->max_blocks);
    std::memcpy(blocks(r.slot), b, 4ull * n);
    // Release pairs with the taking worker's acquire of n_blocks.
    slot(r.slot).n_blocks.store(n, std::memory_order_release);
    return {};
}

Status RequestTable::reset_blocks(ReqRef r) {
    if (r.slot >= h_->n_slots) return make_error("request slot {} out of range", r.slot);
    uint64_t w = slot(r.slot).state_gen.load(std::memory_order_relaxed);
    if (gen_of(w) != r.gen) return make_error("request {}.{} is gone (slot reused)", r.slot, r.gen);
    slot(r.slot).n_blocks.store(0, std::memory_order_release);  // pairs with readers' acquire
    return {};
}

void RequestTable::cancel(ReqRef r) {
    if (r.slot >= h_->n_slots) return;
    // Names the generation, so a cancel that arrives after the slot was reused does
    // not touch the new request, and never replaces a newer request's cancel. A flag
    // only: the owner acts on it by a transition.
    std::atomic<uint32_t>& c = slot(r.slot).cancel;
    uint32_t cur = c.load(std::memory_order_relaxed);
    while (cur != r.gen && (cur == 0 || static_cast<int32_t>(r.gen - cur) > 0))
        if (c.compare_exchange_weak(cur, r.gen, std::memory_order_relaxed)) break;
}

bool RequestTable::cancelled(ReqRef r) const {
    return r.slot < h_->n_slots && slot(r.slot).cancel.load(std::memory_order_relaxed) == r.gen;
}

bool RequestTable::unreserve(ReqRef r) {
    if (r.slot >= h_->n_slots) return false;
    uint64_t w = slot(r.slot).state_gen.load(std::memory_order_relaxed);
    if (gen_of(w) != r.gen || state_of(w) != ReqState::Free || owner_of(w) == 0) return false;
    // Relaxed: the dead submitter's partial writes are overwritten by the next submit.
    return slot(r.slot).state_gen.compare_exchange_strong(w, pack_sg(r.gen, 0, ReqState::Free),
                                                         std::memory_order_relaxed);
}

std::vector<ReqRef> RequestTable::owned_by(uint32_t registry_slot) const {
    std::vector<ReqRef> out;
    for (uint32_t i = 0; i < h_->n_slots; ++i) {
        uint64_t sg = slot(i).state_gen.load(std::memory_order_acquire);  // pairs with transition()
        if (owner_of(sg) == registry_slot + 1) out.push_back({i, gen_of(sg)});
    }
    return out;
}

}  // namespace duet::shm
