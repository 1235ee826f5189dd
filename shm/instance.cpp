#include "shm/instance.h"

#include <cstdio>
#include <cstring>
#include <new>

#include "base/fnv.h"

namespace duet::shm {

namespace {

size_t align(size_t x, size_t a) { return (x + a - 1) / a * a; }

// The configuration, stored at the start of the payload so tools can attach by name.
struct StoredConfig {
    uint32_t magic;
    uint32_t n_arenas;
    uint32_t registry_slots, n_rings, ring_capacity, ring_record_bytes;
    uint32_t req_slots, req_max_tokens, req_block_tokens, huge_pages;
    uint64_t cpu_kv_bytes, model_fingerprint;
    uint32_t prefill_workers, decode_workers;
    uint32_t kv_split, kv_dtype;
    uint32_t context_slots, context_tokens;
    uint32_t req_ext_bytes, user_protocol;
    ArenaConfig arenas[kMaxArenas];
    char name[256];
};
static_assert(sizeof(StoredConfig) <= 4096);
constexpr uint32_t kConfigMagic = 0x666e6f63;  // "conf"

void store_config(void* mem, const InstanceConfig& c) {
    auto* s = new (mem) StoredConfig{};
    s->n_arenas = static_cast<uint32_t>(c.arenas.size());
    s->registry_slots = c.registry_slots;
    s->n_rings = c.n_rings;
    s->ring_capacity = c.ring_capacity;
    s->ring_record_bytes = c.ring_record_bytes;
    s->req_slots = c.requests.n_slots;
    s->req_max_tokens = c.requests.max_tokens;
    s->req_block_tokens = c.requests.block_tokens;
    s->req_ext_bytes = c.requests.ext_bytes;
    s->user_protocol = c.user_protocol;
    s->huge_pages = c.huge_pages;
    s->cpu_kv_bytes = c.cpu_kv_bytes;
    s->model_fingerprint = c.model_fingerprint;
    s->prefill_workers = c.prefill_workers;
    s->decode_workers = c.decode_workers;
    s->kv_split = c.kv_split;
    s->kv_dtype = c.kv_dtype;
    s->context_slots = c.contexts.n_slots;
    s->context_tokens = c.contexts.max_tokens;
    for (size_t i = 0; i < c.arenas.size(); ++i) s->arenas[i] = c.arenas[i];
    std::snprintf(s->name, sizeof s->name, "%s", c.name.c_str());
    s->magic = kConfigMagic;
}

Result<InstanceConfig> load_config(const void* mem) {
    const auto* s = static_cast<const StoredConfig*>(mem);
    if (s->magic != kConfigMagic) return make_error("no instance configuration in the control segment");
    if (s->n_arenas > kMaxArenas) return make_error("bad arena count {}", s->n_arenas);
    InstanceConfig c;
    c.name = std::string(s->name, strnlen(s->name, sizeof s->name));
    c.registry_slots = s->registry_slots;
    c.n_rings = s->n_rings;
    c.ring_capacity = s->ring_capacity;
    c.ring_record_bytes = s->ring_record_bytes;
    c.requests.n_slots = s->req_slots;
    c.requests.max_tokens = s->req_max_tokens;
    c.requests.block_tokens = s->req_block_tokens;
    c.requests.ext_bytes = s->req_ext_bytes;
    c.user_protocol = s->user_protocol;
    c.huge_pages = s->huge_pages;
    c.cpu_kv_bytes = s->cpu_kv_bytes;
    c.model_fingerprint = s->model_fingerprint;
    c.prefill_workers = s->prefill_workers;
    c.decode_workers = s->decode_workers;
    c.kv_split = s->kv_split != 0;
    c.kv_dtype = s->kv_dtype;
    c.contexts = {s->context_slots, s->context_tokens};
    c.arenas.assign(s->arenas, s->arenas + s->n_arenas);
    return c;
}

// Section offsets within the payload, in order: registry, rings, request table, arenas.
struct Sections {
    size_t registry = 0, rings = 0, ring_bytes = 0, requests = 0;
    std::vector<size_t> arenas;
    size_t contexts = 0;
    size_t total = 0;
};

Sections plan(const InstanceConfig& c) {
    Sections s;
    size_t off = 4096;  // the stored configuration
    s.registry = off;
    off = align(off + Registry::bytes(c.registry_slots), 4096);
    s.rings = off;
    s.ring_bytes = ring_bytes(c.ring_record_bytes, c.ring_capacity);
    off = align(off + s.ring_bytes * c.n_rings, 4096);
    s.requests = off;
    off = align(off + RequestTable::bytes(c.requests), 4096);
    for (const ArenaConfig& a : c.arenas) {
        s.arenas.push_back(off);
        off = align(off + KvArena::bytes(a), 4096);
    }
    s.contexts = off;
    off = align(off + ContextTable::bytes(c.contexts), 4096);
    s.total = off;
    return s;
}

std::string kv_name(const std::string& name) { return "duet." + name + ".kv"; }

}  // namespace

uint64_t InstanceConfig::fingerprint() const {
    Fnv f;
    f.add(kLayoutVersion);
    f.add(registry_slots);
    f.add(n_rings);
    f.add(ring_capacity);
    f.add(ring_record_bytes);
    f.add(requests.n_slots);
    f.add(requests.max_tokens);
    f.add(requests.block_tokens);
    f.add(requests.ext_bytes);
    for (const ArenaConfig& a : arenas) {
        f.add(a.n_blocks);
        f.add(a.n_users);
        f.add(a.index_capacity);
    }
    f.add(cpu_kv_bytes);
    f.add(model_fingerprint);
    f.add(prefill_workers);
    f.add(decode_workers);
    f.add(static_cast<uint32_t>(kv_split));
    f.add(kv_dtype);
    f.add(contexts.n_slots);
    f.add(contexts.max_tokens);
    f.add(user_protocol);
    return f.h;
}

uint8_t* Instance::cpu_kv_data(size_t arena) const {
    if (arena == 0 || cfg_.arenas.empty()) return kv_seg_.payload();
    uint64_t total = 0, before = 0;
    for (size_t i = 0; i < cfg_.arenas.size(); ++i) {
        total += cfg_.arenas[i].n_blocks;
        if (i < arena) before += cfg_.arenas[i].n_blocks;
    }
    return kv_seg_.payload() + cfg_.cpu_kv_bytes / total * before;
}

RingHeader* Instance::ring(uint32_t i) const {
    return reinterpret_cast<RingHeader*>(seg_.payload() + ring_off_.at(i));
}

static Status format_sections(uint8_t* base, const InstanceConfig& c) {
    Sections s = plan(c);
    store_config(base, c);
    if (Status st = Registry::init(base + s.registry, c.registry_slots); !st) return st;
    for (uint32_t i = 0; i < c.n_rings; ++i)
        if (Status st = ring_init(base + s.rings + i * s.ring_bytes, c.ring_record_bytes, c.ring_capacity); !st)
            return st;
    if (Status st = RequestTable::init(base + s.requests, c.requests); !st) return st;
    for (size_t d = 0; d < c.arenas.size(); ++d)
        if (Status st = KvArena::init(base + s.arenas[d], c.arenas[d]); !st) return st;
    if (Status st = ContextTable::init(base + s.contexts, c.contexts); !st) return st;
    return {};
}

Status Instance::map_sections() {
    Sections s = plan(cfg_);
    uint8_t* base = seg_.payload();
    auto reg = Registry::attach(base + s.registry);
    if (!reg) return reg.error();
    registry_ = *reg;
    ring_off_.clear();
    for (uint32_t i = 0; i < cfg_.n_rings; ++i) {
        ring_off_.push_back(s.rings + i * s.ring_bytes);
        if (Status st = ring_check(base + ring_off_.back(), cfg_.ring_record_bytes); !st) return st;
    }
    auto req = RequestTable::attach(base + s.requests);
    if (!req) return req.error();
    requests_ = *req;
    arenas_.clear();
    for (size_t d = 0; d < cfg_.arenas.size(); ++d) {
        auto a = KvArena::attach(base + s.arenas[d]);
        if (!a) return a.error();
        arenas_.push_back(*a);
    }
    contexts_ = ContextTable();
    if (cfg_.contexts.n_slots > 0) {
        auto t = ContextTable::attach(base + s.contexts);
        if (!t) return t.error();
        contexts_ = std::move(*t);
    }
    return {};
}

Result<Instance> Instance::create(const InstanceConfig& c) {
    if (c.arenas.size() > kMaxArenas) return make_error("at most {} KV arenas, got {}", kMaxArenas, c.arenas.size());
    if (c.cpu_kv_bytes && c.arenas.size() > 1) {
        uint64_t blocks = 0;
        for (const ArenaConfig& a : c.arenas) blocks += a.n_blocks;
        if (blocks == 0 || c.cpu_kv_bytes % blocks != 0)
            return make_error("{} bytes of host KV data do not divide into the {} blocks of {} arenas", c.cpu_kv_bytes,
                              blocks, c.arenas.size());
    }
    Instance in;
    in.cfg_ = c;
    Sections s = plan(c);
    // The control segment is small and touched everywhere: 4 KiB pages are fine, and
    // hugetlbfs pages are better kept for the KV data.
    SegmentOptions so;
    so.payload_bytes = s.total;
    so.layout_version = kLayoutVersion;
    so.config_fingerprint = c.fingerprint();
    so.huge_pages = false;
    // The KV data segment first: a process that finds the control segment finds
    // both. The control segment's sections are formatted before it is named.
    if (c.cpu_kv_bytes) {
        SegmentOptions ko;
        ko.payload_bytes = c.cpu_kv_bytes;
        ko.layout_version = kLayoutVersion;
        ko.config_fingerprint = c.fingerprint();
        ko.huge_pages = c.huge_pages;
        auto kv = Segment::create(kv_name(c.name), ko);
        if (!kv) return kv.error();
        in.kv_seg_ = std::move(*kv);
    }
    so.init = [&](uint8_t* payload, size_t) { return format_sections(payload, c); };
    auto seg = Segment::create("duet." + c.name, so);
    if (!seg) {
        if (c.cpu_kv_bytes) (void)Segment::unlink(kv_name(c.name));
        return seg.error();
    }
    in.seg_ = std::move(*seg);
    if (Status st = in.map_sections(); !st) return st.error();
    return in;
}

Result<Instance> Instance::open(const InstanceConfig& c) {
    Instance in;
    in.cfg_ = c;
    auto seg = Segment::open("duet." + c.name, kLayoutVersion, c.fingerprint());
    if (!seg) return seg.error();
    in.seg_ = std::move(*seg);
    if (c.cpu_kv_bytes) {
        auto kv = Segment::open(kv_name(c.name), kLayoutVersion, c.fingerprint());
        if (!kv) return kv.error();
        in.kv_seg_ = std::move(*kv);
    }
    if (in.seg_.payload_bytes() < plan(c).total)
        return make_error("{} is smaller than its configuration needs", in.seg_.path());
    if (Status st = in.map_sections(); !st) return st.error();
    return in;
}

Result<Instance> Instance::attach(const std::string& name) {
    auto seg = Segment::open("duet." + name, kLayoutVersion, 0, false);
    if (!seg) return seg.error();
    if (seg->payload_bytes() < 4096) return make_error("{} is too small for a control segment", seg->path());
    auto c = load_config(seg->payload());
    if (!c) return make_error("{}: {}", seg->path(), c.error().message);
    if (c->fingerprint() != seg->header().config_fingerprint)
        return make_error("{}: stored configuration does not match the header's fingerprint", seg->path());
    if (seg->payload_bytes() < plan(*c).total)
        return make_error("{} is smaller than its configuration needs", seg->path());
    Instance in;
    in.cfg_ = *c;
    in.seg_ = std::move(*seg);
    if (c->cpu_kv_bytes) {
        auto kv = Segment::open(kv_name(name), kLayoutVersion, c->fingerprint());
        if (!kv) return kv.error();
        in.kv_seg_ = std::move(*kv);
    }
    if (Status st = in.map_sections(); !st) return st.error();
    return in;
}

Result<RecoveryReport> Instance::recover(ProcRef dead, ProcRef by, bool redrive,
                                         const std::function<int32_t(ReqRef)>& fail_code) {
    RecoveryReport rep;
    if (dead.slot >= registry_.n_slots()) return make_error("registry slot {} out of range", dead.slot);
    if (registry_.current(dead.slot).gen != dead.gen) return rep;  // already recovered, slot reused
    if (registry_.alive(dead)) {
        if (registry_.process_running(dead))
            return make_error("process {} (registry slot {}) is alive: not recovering it", registry_.pid(dead.slot),
                              dead.slot);
        registry_.mark_dead(dead);
    }
    if (registry_.state(dead.slot) != ProcState::Dead) return rep;  // reclaimed meanwhile
    for (KvArena& a : arenas_) {
        int32_t u = a.user_of(dead);
        if (u >= 0) rep.refs_dropped += a.recover_user(static_cast<uint32_t>(u));
    }
    // The dead process changes nothing now, but live ones still act: a decode
    // worker may commit a hand-off the dead prefill sent (its exact CAS makes the
    // request the decode's), a front may cancel. So each request is first taken
    // from the dead owner with an exact CAS, and only then re-driven or failed: a
    // request the scan saw but a live process took meanwhile is not the dead one's.
    for (int pass = 0; pass < 8; ++pass) {
        const std::vector<ReqRef> owned = requests_.owned_by(dead.slot);
        if (owned.empty()) break;
        for (ReqRef q : owned) {
            if (requests_.state(q.slot) == ReqState::Free) {  // reserved by the dead: nobody else acts on it
                rep.unreserved += requests_.unreserve(q);
                continue;
            }
            if (!requests_.adopt(q, dead, by)) continue;  // taken by a live process, or reused
            const ReqState st = requests_.state(q.slot);
            switch (st) {
                case ReqState::Prefilling:
                case ReqState::Decoding:
                    if (const int32_t code = redrive && fail_code ? fail_code(q) : 0; code != 0) {
                        // The code before the transition, which publishes it.
                        requests_.slot(q.slot).error_code.store(code, std::memory_order_relaxed);
                        rep.failed += requests_.transition(q, st, ReqState::Failed, by);
                    } else if (redrive) {
                        (void)requests_.reset_blocks(q);  // its block references were just dropped
                        rep.redriven += requests_.transition(q, st, ReqState::Queued, by);
                    } else {
                        rep.failed += requests_.transition(q, st, ReqState::Failed, by);
                    }
                    break;
                default:  // QUEUED, FINISHED, FAILED, CANCELLED: the recoverer owns them now
                    ++rep.adopted;
            }
        }
    }
    if (!requests_.owned_by(dead.slot).empty())
        return make_error("requests of registry slot {} keep changing: recovery not finished", dead.slot);
    registry_.reclaim(dead);
    return rep;
}

void Instance::unlink(const std::string& name) {
    (void)Segment::unlink("duet." + name);
    (void)Segment::unlink(kv_name(name));
}

}  // namespace duet::shm
