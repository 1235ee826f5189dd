#include "roles/routing.h"

#include "base/log.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <tuple>

#include "roles/worker_stats.h"
#include "shm/doorbell.h"

namespace duet {

uint32_t pick_prefill(const std::vector<PrefillView>& v) {
    const bool none_eligible = std::none_of(v.begin(), v.end(), [](const PrefillView& x) { return x.eligible; });
    uint32_t best = 0;
    while (!none_eligible && best + 1 < v.size() && !v[best].eligible) ++best;
    for (uint32_t i = best + 1; i < v.size(); ++i) {
        const PrefillView &a = v[i], &b = v[best];
        if (!none_eligible && !a.eligible) continue;
        if (a.running != b.running) {
            if (a.running) best = i;
            continue;
        }
        if (a.ahead + 2 * a.to_compute < b.ahead + 2 * b.to_compute) best = i;
    }
    return best;
}

uint32_t pick_decode(const std::vector<DecodeView>& v) {
    auto rank = [](const DecodeView& x) {
        const bool room = x.max_items == 0 || x.items < x.max_items;
        return std::tuple(!x.running, !room, !x.near, x.items, x.tokens);
    };
    uint32_t best = 0;
    for (uint32_t i = 1; i < v.size(); ++i)
        if (rank(v[i]) < rank(v[best])) best = i;
    return best;
}

DecodeView decode_view(shm::Instance& inst, uint32_t d, int numa) {
    DecodeView v;
    v.items = queued_for_decode(inst, d);
    shm::Registry& reg = inst.registry();
    if (int32_t s = reg.find_running(shm::Role::Decode, static_cast<int32_t>(d)); s >= 0) {
        const WorkerStats& ps = worker_stats(reg, static_cast<uint32_t>(s));
        v.running = true;
        v.items += ps.load_items.load(std::memory_order_relaxed);
        v.tokens = ps.load_tokens.load(std::memory_order_relaxed);
        v.max_items = ps.max_items.load(std::memory_order_relaxed);
        const int32_t node = reg.slot(static_cast<uint32_t>(s)).numa.load(std::memory_order_relaxed);
        v.near = numa < 0 || node < 0 || node == numa;
    }
    return v;
}

uint64_t queued_for_prefill(shm::Instance& inst, uint32_t p) {
    const ServeRings rings = ServeRings::of(inst.config());
    return shm::ring_occupancy(inst.ring(rings.to_prefill(p))) + shm::ring_occupancy(inst.ring(rings.redrive(p)));
}

uint64_t queued_for_decode(shm::Instance& inst, uint32_t d) {
    const ServeRings rings = ServeRings::of(inst.config());
    uint64_t n = 0;
    for (uint32_t p = 0; p < rings.n_prefill; ++p)
        if (rings.linked(p, d)) n += shm::ring_occupancy(inst.ring(rings.to_decode(p, d)));
    return n;
}

bool workers_running(shm::Instance& inst) {
    shm::Registry& reg = inst.registry();
    return reg.find_running(shm::Role::Prefill) >= 0 && reg.find_running(shm::Role::Decode) >= 0;
}

std::vector<uint64_t> PrefixAffinity::block_keys(const int32_t* tokens, size_t n, size_t block_tokens) {
    std::vector<uint64_t> keys;
    uint64_t h = 0x9e3779b97f4a7c15ull;
    for (size_t at = 0; block_tokens > 0 && at + block_tokens <= n; at += block_tokens) {
        for (size_t i = 0; i < block_tokens; ++i) {  // splitmix64 over (previous, token): chained, so a key names its whole prefix
            uint64_t z = h ^ (static_cast<uint64_t>(static_cast<uint32_t>(tokens[at + i])) + 0x9e3779b97f4a7c15ull);
            z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
            z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
            h = z ^ (z >> 31);
        }
        keys.push_back(h);
    }
    return keys;
}

PrefillRouter::PrefillRouter(shm::Instance& inst, bool redrive) : inst_(inst), rings_(ServeRings::of(inst.config())) {
    if (rings_.n_prefill == 0) {  // checked by whoever attaches (cmd_front): no ring to send on
        log::error(fmt::format("instance {} has no prefill workers", inst.config().name));
        std::abort();
    }
    for (uint32_t p = 0; p < rings_.n_prefill; ++p)
        out_.emplace_back(inst.ring(redrive ? rings_.redrive(p) : rings_.to_prefill(p)));
    queued_.resize(rings_.n_prefill);
    sent_.assign(rings_.n_prefill, 0);
}

std::vector<uint64_t> PrefillRouter::sent_counts() {
    std::lock_guard<std::mutex> lock(mu_);
    return sent_;
}

PrefillRouter::Choice PrefillRouter::choose(shm::ReqRef r, bool with_affinity) {
    shm::RequestTable& t = inst_.requests();
    shm::Registry& reg = inst_.registry();
    const uint32_t n_prompt = t.slot(r.slot).n_prompt.load(std::memory_order_relaxed);
    const uint64_t n_all = n_prompt + t.slot(r.slot).n_output.load(std::memory_order_acquire);
    const uint32_t n = rings_.n_prefill;
    const uint32_t bt = inst_.config().requests.block_tokens;
    Choice c;
    c.to_compute = n_all;
    // A request bound to an arena (a context's): only that arena's workers.
    const int32_t bound = request_params(t, r.slot).bound_arena();
    const auto eligible = [&](uint32_t i) {
        return bound < 0 || worker_arena(inst_.config(), shm::Role::Prefill, i) == static_cast<uint32_t>(bound);
    };
    if (n == 1) {
        c.eligible = eligible(0);
        return c;
    }
    if (with_affinity) c.keys = PrefixAffinity::block_keys(t.tokens(r.slot), n_prompt, bt);
    const PrefixAffinity::Match m = affinity_.find(c.keys, [&](shm::ReqRef q) { return being_prefilled(q); });
    // Prefill workers on different GPUs: the prompt's blocks cached in each one's
    // arena (the hashes the prefill workers publish under: chained SHA-256 of the
    // tokens and the model).
    const bool per_arena = gpu_instance(inst_.config()) && n > 1;
    const bool paired = ServeRings::of(inst_.config()).paired;
    chain_.clear();
    if (per_arena) {
        const int32_t* tokens = t.tokens(r.slot);
        const uint64_t max_blocks = std::min<uint64_t>(n_prompt / bt, (n_all - 1) / bt);
        shm::BlockHash h;
        for (uint64_t b = 0; b < max_blocks; ++b) {
            h = hasher_.hash(h, tokens + b * bt, bt, inst_.config().model_fingerprint, {});
            chain_.push_back(h);
        }
    }
    std::vector<PrefillView> v(n);
    for (uint32_t i = 0; i < n; ++i) {
        v[i].eligible = eligible(i);
        // Requests sent but not taken yet (the worker's gauge does not count them);
        // one sent again (re-driven: a new attempt) counts where it went last.
        std::deque<Sent>& q = queued_[i];
        std::erase_if(q, [&](const Sent& s) {
            return !t.is(s.req, shm::ReqState::Queued) || t.attempt(s.req.slot) != s.attempt || s.req == r;
        });
        for (const Sent& s : q) v[i].ahead += s.tokens;
        if (int32_t s = reg.find_running(shm::Role::Prefill, static_cast<int32_t>(i)); s >= 0) {
            // A GPU pair serves only with both halves up: its prefill hands off to its
            // own decode worker alone.
            v[i].running = !paired || reg.find_running(shm::Role::Decode, static_cast<int32_t>(i)) >= 0;
            v[i].ahead += worker_stats(reg, static_cast<uint32_t>(s)).load_tokens.load(std::memory_order_relaxed);
        }
        uint64_t cached = m.worker == static_cast<int32_t>(i) ? m.blocks * bt : 0;
        if (per_arena && !chain_.empty()) {
            const uint32_t k = worker_arena(inst_.config(), shm::Role::Prefill, i);
            if (k < inst_.n_arenas())
                cached = std::max<uint64_t>(cached, uint64_t{cached_prefix_blocks(inst_.arena(k), chain_)} * bt);
        }
        v[i].to_compute = n_all - std::min<uint64_t>(cached, n_all - 1);
    }
    c.worker = pick_prefill(v);
    c.eligible = v[c.worker].eligible;
    c.running = v[c.worker].running;
    c.to_compute = v[c.worker].to_compute;
    return c;
}

uint32_t cached_prefix_blocks(const shm::KvArena& a, std::span<const shm::BlockHash> chain) {
    uint32_t n = 0;
    while (n < chain.size() && a.has_cached(chain[n])) ++n;
    return n;
}

bool PrefillRouter::being_prefilled(shm::ReqRef q) const {
    const shm::RequestTable& t = inst_.requests();
    return t.is(q, shm::ReqState::Queued) || t.is(q, shm::ReqState::Prefilling);
}

bool PrefillRouter::send(shm::ReqRef r) {
    std::lock_guard<std::mutex> lock(mu_);  // each ring has one producer: this process
    shm::RequestTable& t = inst_.requests();
    const Choice c = choose(r, /*with_affinity=*/true);
    if (!c.eligible) {
        // Bound to an arena no prefill worker computes in: computed elsewhere, its
        // offered blocks would name another arena's. Refused instead.
        t.slot(r.slot).error_code.store(static_cast<int32_t>(ReqError::NoWorker), std::memory_order_relaxed);
        (void)t.transition(r, shm::ReqState::Queued, shm::ReqState::Failed);  // (cancelled meanwhile: ended too)
        return false;
    }
    const uint32_t p = c.worker;
    const WireMsg msg{r.slot, r.gen, 0, 0, 0, 0, {}};
    const uint64_t give_up = shm::monotonic_ns() + 2'000'000'000ull;
    bool sent = false;
    while (!(sent = out_[p].try_push(msg)) && shm::monotonic_ns() < give_up) usleep(100);  // prefill drains it every step
    inst_.registry().wake(shm::Role::Prefill, static_cast<int32_t>(p));
    if (!sent) {
        t.slot(r.slot).error_code.store(static_cast<int32_t>(ReqError::NotSent), std::memory_order_relaxed);
        (void)t.transition(r, shm::ReqState::Queued, shm::ReqState::Failed);  // (cancelled meanwhile: ended too)
        return false;
    }
    ++sent_[p];
    if (rings_.n_prefill > 1) {
        queued_[p].push_back({r, t.attempt(r.slot), c.to_compute});
        affinity_.note(c.keys, p, r, [&](shm::ReqRef q) { return being_prefilled(q); });
    }
    return true;
}

uint32_t PrefillRouter::resend_stranded() {
    std::lock_guard<std::mutex> lock(mu_);
    if (rings_.n_prefill < 2) return 0;
    shm::RequestTable& t = inst_.requests();
    shm::Registry& reg = inst_.registry();
    uint32_t moved = 0;
    for (uint32_t p = 0; p < rings_.n_prefill; ++p) {
        if (queued_[p].empty() || reg.find_running(shm::Role::Prefill, static_cast<int32_t>(p)) >= 0) continue;
        std::deque<Sent> stranded;
        stranded.swap(queued_[p]);
        for (const Sent& s : stranded) {
            if (!t.is(s.req, shm::ReqState::Queued) || t.attempt(s.req.slot) != s.attempt) continue;
            const Choice c = choose(s.req, /*with_affinity=*/false);
            // The copy left in p's ring loses prefill's QUEUED -> PREFILLING CAS to
            // whichever worker takes the request first, and is dropped.
            if (!c.running || !c.eligible || !out_[c.worker].try_push(WireMsg{s.req.slot, s.req.gen, 0, 0, 0, 0, {}})) {
                queued_[p].push_back(s);  // no live worker (or its ring full): it waits for p
                continue;
            }
            reg.wake(shm::Role::Prefill, static_cast<int32_t>(c.worker));
            queued_[c.worker].push_back({s.req, s.attempt, c.to_compute});
            ++sent_[c.worker];
            ++moved;
        }
    }
    return moved;
}

}  // namespace duet
