#include "shm/context_table.h"

#include <algorithm>
#include <cstring>
#include <new>

#include <fmt/format.h>

namespace duet::shm {

namespace {

constexpr uint32_t kMagic = 0x78746363;  // "cctx"

size_t align64(size_t x) { return (x + 63) / 64 * 64; }

size_t slot_bytes_of(const ContextTableConfig& c) {
    return align64(sizeof(ContextSlotHead) + static_cast<size_t>(c.max_tokens) * sizeof(int32_t));
}

}  // namespace

size_t ContextTable::bytes(const ContextTableConfig& c) {
    if (c.n_slots == 0) return 0;
    return align64(sizeof(ContextTableHeader)) + static_cast<size_t>(c.n_slots) * slot_bytes_of(c);
}

Status ContextTable::init(void* mem, const ContextTableConfig& c) {
    if (c.n_slots == 0) return {};
    if (c.max_tokens == 0) return make_error("a context table needs room for tokens");
    // The slots are left as the fresh segment has them (zero: FREE), untouched, so
    // pages are only made for records that are written.
    auto* h = new (mem) ContextTableHeader{};
    h->n_slots = c.n_slots;
    h->max_tokens = c.max_tokens;
    h->slot_bytes = static_cast<uint32_t>(slot_bytes_of(c));
    h->owner.store(0, std::memory_order_relaxed);
    h->next_gen.store(1, std::memory_order_relaxed);
    // The magic is published last, by a release store that attach()'s acquire load
    // pairs with (a store, not a fence: ThreadSanitizer does not model fences).
    std::atomic_ref<uint32_t>(h->magic).store(kMagic, std::memory_order_release);
    return {};
}

Result<ContextTable> ContextTable::attach(void* mem) {
    auto* h = static_cast<ContextTableHeader*>(mem);
    if (std::atomic_ref<uint32_t>(h->magic).load(std::memory_order_acquire) != kMagic)
        return make_error("no context table here");
    if (h->slot_bytes != slot_bytes_of({h->n_slots, h->max_tokens}))
        return make_error("context table: slots of {} bytes, {} expected", h->slot_bytes,
                          slot_bytes_of({h->n_slots, h->max_tokens}));
    ContextTable t;
    t.hdr_ = h;
    t.slots_ = static_cast<uint8_t*>(mem) + align64(sizeof(ContextTableHeader));
    return t;
}

ContextSlotHead& ContextTable::head(uint32_t slot) const {
    return *reinterpret_cast<ContextSlotHead*>(slots_ + static_cast<size_t>(slot) * hdr_->slot_bytes);
}

int32_t* ContextTable::tokens(uint32_t slot) const {
    return reinterpret_cast<int32_t*>(slots_ + static_cast<size_t>(slot) * hdr_->slot_bytes + sizeof(ContextSlotHead));
}

ContextSlotState ContextTable::state(uint32_t slot) const {
    return static_cast<ContextSlotState>(head(slot).state.load(std::memory_order_acquire));
}

Status ContextTable::claim(ProcRef by, const Registry& reg) {
    if (!hdr_) return make_error("no context table");
    uint64_t old = hdr_->owner.load(std::memory_order_acquire);
    for (;;) {
        if (old != 0 && old != by.pack()) {
            const ProcRef holder = ProcRef::unpack(old);
            if (reg.process_running(holder))
                return make_error("the context table is held by another process (pid {})", reg.pid(holder.slot));
        }
        if (hdr_->owner.compare_exchange_weak(old, by.pack(), std::memory_order_acq_rel, std::memory_order_acquire))
            break;
    }
    recover();
    return {};
}

void ContextTable::release(ProcRef by) {
    if (!hdr_) return;
    uint64_t want = by.pack();
    hdr_->owner.compare_exchange_strong(want, 0, std::memory_order_acq_rel);
}

void ContextTable::recover() {
    index_.clear();
    free_.clear();
    const uint32_t n = hdr_->n_slots;
    uint64_t top = hdr_->next_gen.load(std::memory_order_relaxed);
    for (uint32_t s = 0; s < n; ++s) {
        ContextSlotHead& h = head(s);
        const auto st = static_cast<ContextSlotState>(h.state.load(std::memory_order_acquire));
        if (st != ContextSlotState::Live) {
            // WRITING: a put its writer never published (T1). Anything else: free.
            if (st != ContextSlotState::Free) h.state.store(static_cast<uint32_t>(ContextSlotState::Free), std::memory_order_release);
            continue;
        }
        if (h.id_len == 0 || h.id_len > kContextIdBytes || h.n_tokens > hdr_->max_tokens) {
            // Not something a put writes: dropped rather than trusted.
            h.state.store(static_cast<uint32_t>(ContextSlotState::Free), std::memory_order_release);
            continue;
        }
        top = std::max(top, h.gen + 1);
        std::string id(h.id, h.id_len);
        auto [it, fresh] = index_.emplace(id, s);
        if (!fresh) {
            // Two live records of one id: the writer died between publishing the new
            // one and freeing the old one. The newer wins.
            const uint32_t other = it->second;
            const uint32_t loser = head(other).gen < h.gen ? other : s;
            it->second = loser == other ? s : other;
            head(loser).state.store(static_cast<uint32_t>(ContextSlotState::Free), std::memory_order_release);
        }
    }
    for (uint32_t s = n; s-- > 0;)
        if (state(s) == ContextSlotState::Free) free_.push_back(s);
    hdr_->next_gen.store(top, std::memory_order_relaxed);
}

std::vector<ContextRecord> ContextTable::records() const {
    std::vector<std::pair<uint64_t, ContextRecord>> v;
    for (const auto& [id, s] : index_) {
        const ContextSlotHead& h = head(s);
        ContextRecord r;
        r.id = id;
        r.tokens.assign(tokens(s), tokens(s) + h.n_tokens);
        r.pinned = (h.flags & 1u) != 0;
        r.created_ns = h.created_ns;
        v.emplace_back(h.gen, std::move(r));
    }
    std::sort(v.begin(), v.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    std::vector<ContextRecord> out;
    out.reserve(v.size());
    for (auto& [g, r] : v) out.push_back(std::move(r));
    return out;
}

Status ContextTable::put(const ContextRecord& r) {
    if (!hdr_) return make_error("no context table");
    if (r.id.empty() || r.id.size() > kContextIdBytes)
        return make_error(ErrorKind::Invalid, "context id of {} bytes: 1 to {}", r.id.size(), kContextIdBytes);
    if (r.tokens.size() > hdr_->max_tokens)
        return make_error(ErrorKind::Invalid, "a context of {} tokens: the context table holds {} per context",
                          r.tokens.size(), hdr_->max_tokens);
    if (free_.empty())
        return make_error(ErrorKind::Limit, "the context table's {} records are all in use", hdr_->n_slots);
    const uint32_t s = free_.back();
    ContextSlotHead& h = head(s);
    // T1: the slot is written whole while WRITING (recovery frees it), then published.
    h.state.store(static_cast<uint32_t>(ContextSlotState::Writing), std::memory_order_relaxed);
    std::atomic_signal_fence(std::memory_order_seq_cst);
    h.n_tokens = static_cast<uint32_t>(r.tokens.size());
    h.gen = hdr_->next_gen.fetch_add(1, std::memory_order_relaxed);
    h.created_ns = r.created_ns;
    h.flags = r.pinned ? 1u : 0u;
    h.id_len = static_cast<uint32_t>(r.id.size());
    std::memcpy(h.id, r.id.data(), r.id.size());
    if (!r.tokens.empty()) std::memcpy(tokens(s), r.tokens.data(), r.tokens.size() * sizeof(int32_t));
    h.state.store(static_cast<uint32_t>(ContextSlotState::Live), std::memory_order_release);
    free_.pop_back();
    auto it = index_.find(r.id);
    if (it != index_.end()) {
        const uint32_t old = it->second;
        head(old).state.store(static_cast<uint32_t>(ContextSlotState::Free), std::memory_order_release);
        free_.push_back(old);
        it->second = s;
    } else {
        index_.emplace(r.id, s);
    }
    return {};
}

void ContextTable::erase(const std::string& id) {
    auto it = index_.find(id);
    if (it == index_.end()) return;
    head(it->second).state.store(static_cast<uint32_t>(ContextSlotState::Free), std::memory_order_release);
    free_.push_back(it->second);
    index_.erase(it);
}

}  // namespace duet::shm
