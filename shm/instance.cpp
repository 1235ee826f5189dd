#include "shm/instance.h"

namespace duet::shm {

namespace {

size_t align(size_t x, size_t a) { return (x + a - 1) / a * a; }

struct Fnv {
    uint64_t h = 1469598103934665603ull;
    void add(const void* p, size_t n) {
        const auto* b = static_cast<const uint8_t*>(p);
        for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
    }
    template <typename T>
    void add(const T& v) {
        add(&v, sizeof v);
    }
};

// Section offsets within the payload, in order: registry, rings, request table, arenas.
struct Sections {
    size_t registry = 0, rings = 0, ring_bytes = 0, requests = 0;
    std::vector<size_t> arenas;
    size_t total = 0;
};

Sections plan(const InstanceConfig& c) {
    Sections s;
    size_t off = 0;
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
    for (const ArenaConfig& a : arenas) {
        f.add(a.n_blocks);
        f.add(a.n_users);
        f.add(a.index_capacity);
    }
    f.add(cpu_kv_bytes);
    f.add(model_fingerprint);
    return f.h;
}

RingHeader* Instance::ring(uint32_t i) const {
    return reinterpret_cast<RingHeader*>(seg_.payload() + ring_off_.at(i));
}

Status Instance::map_sections(bool init) {
    Sections s = plan(cfg_);
    uint8_t* base = seg_.payload();
    if (init) {
        if (Status st = Registry::init(base + s.registry, cfg_.registry_slots); !st) return st;
        for (uint32_t i = 0; i < cfg_.n_rings; ++i)
            if (Status st = ring_init(base + s.rings + i * s.ring_bytes, cfg_.ring_record_bytes, cfg_.ring_capacity);
                !st)
                return st;
        if (Status st = RequestTable::init(base + s.requests, cfg_.requests); !st) return st;
        for (size_t d = 0; d < cfg_.arenas.size(); ++d)
            if (Status st = KvArena::init(base + s.arenas[d], cfg_.arenas[d]); !st) return st;
    }
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
    return {};
}

Result<Instance> Instance::create(const InstanceConfig& c) {
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
    // The segment's magic is stored last (release) inside Segment::create, but the
    // sections are formatted after that; nobody attaches before they are because
    // open() also needs the KV segment, which is created after the sections.
    auto seg = Segment::create("duet." + c.name, so);
    if (!seg) return seg.error();
    in.seg_ = std::move(*seg);
    if (Status st = in.map_sections(true); !st) return st.error();
    if (c.cpu_kv_bytes) {
        SegmentOptions ko;
        ko.payload_bytes = c.cpu_kv_bytes;
        ko.layout_version = kLayoutVersion;
        ko.config_fingerprint = c.fingerprint();
        ko.huge_pages = c.huge_pages;
        auto kv = Segment::create(kv_name(c.name), ko);
        if (!kv) {
            (void)Segment::unlink("duet." + c.name);
            return kv.error();
        }
        in.kv_seg_ = std::move(*kv);
    }
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
    if (Status st = in.map_sections(false); !st) return st.error();
    return in;
}

void Instance::unlink(const std::string& name) {
    (void)Segment::unlink("duet." + name);
    (void)Segment::unlink(kv_name(name));
}

}  // namespace duet::shm
