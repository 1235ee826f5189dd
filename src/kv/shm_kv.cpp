#include "kv/shm_kv.h"

#include <dirent.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace duet {

int32_t ShmBlockAllocator::n_available() const {
    // The census reads every block's word: only worth it when the free count falls short.
    const shm::ArenaCensus c = arena_.census();
    return static_cast<int32_t>(c.free + c.cached);
}

bool ShmBlockAllocator::alloc(int32_t n, int32_t* out) {
    if (n < 0) return false;
    return arena_.alloc(user_, static_cast<uint32_t>(n), out);
}

void ShmBlockAllocator::ref(int32_t block) {
    // A per-process count saturates at 2^15 - 1 references to one block (4 users):
    // far beyond any fork fan-out this process makes; reaching it is a bug.
    if (!arena_.ref(user_, block)) {
        std::fprintf(stderr, "duet: KV block %d has too many references from this process\n", block);
        std::abort();
    }
}

int32_t ShmBlockAllocator::refcount(int32_t block) const {
    int32_t n = static_cast<int32_t>(arena_.refcount(block));
    for (const auto& [b, giver] : handed_)
        if (b == block) n -= static_cast<int32_t>(arena_.refs_of(giver, block));
    return n;
}

void ShmBlockAllocator::handed_by(uint32_t giver_user, const std::vector<int32_t>& blocks) {
    // Prune entries whose giver has let go (or whose block we no longer hold).
    std::erase_if(handed_, [&](const std::pair<int32_t, uint32_t>& e) {
        return arena_.refs_of(e.second, e.first) == 0 || arena_.refs_of(user_, e.first) == 0;
    });
    for (int32_t b : blocks) handed_.emplace_back(b, giver_user);
}

Result<std::string> shm_scope() {
    const char* v = std::getenv("DUET_SHM_SCOPE");
    if (!v || !*v) return std::string();
    const std::string s(v);
    const bool ok = s.size() <= 32 && std::all_of(s.begin(), s.end(), [](char c) {
        return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
    });
    if (!ok) return make_error("DUET_SHM_SCOPE '{}': expected 1-32 letters, digits or '_'", s);
    return s + ".";
}

int remove_stale_segments(const std::string& prefix) {
    auto scope = shm_scope();
    if (!scope) return 0;
    const std::string full = "duet." + *scope + prefix;
    std::vector<std::string> names;
    for (const char* dir : {"/dev/shm", "/dev/hugepages"}) {
        DIR* d = opendir(dir);
        if (!d) continue;
        while (dirent* e = readdir(d)) {
            std::string name = e->d_name;
            if (name.rfind(full, 0) == 0) names.push_back(name);
        }
        closedir(d);
    }
    int n = 0;
    for (const std::string& name : names) {
        auto r = shm::Segment::remove_if_stale(name);  // checks liveness and identity under the lock
        n += r.ok() && *r;
    }
    return n;
}

Result<std::unique_ptr<ShmKv>> ShmKv::create(const KvLayout& layout, int32_t n_blocks, const ShmKvOptions& o) {
    if (n_blocks <= 0) return make_error("KV pool needs at least one block, got {}", n_blocks);
    remove_stale_segments("run-");
    shm::InstanceConfig c;
    c.name = o.instance;
    c.registry_slots = 8;
    c.n_rings = 2;
    c.ring_capacity = 64;
    c.requests.n_slots = 4;
    c.requests.max_tokens = static_cast<uint32_t>(n_blocks) * static_cast<uint32_t>(layout.block_tokens);
    c.requests.block_tokens = static_cast<uint32_t>(layout.block_tokens);
    c.arenas.push_back(shm::ArenaConfig{static_cast<uint32_t>(n_blocks), 4, 0});
    c.cpu_kv_bytes = o.device_data ? 0 : layout.block_bytes() * static_cast<size_t>(n_blocks);
    c.model_fingerprint = o.model_fingerprint;
    c.kv_dtype = static_cast<uint32_t>(layout.dtype);
    c.huge_pages = o.huge_pages;
    auto inst = shm::Instance::create(c);
    if (!inst) return inst.error();
    std::unique_ptr<ShmKv> kv(new ShmKv());
    kv->inst_ = std::move(*inst);
    auto self = kv->inst_.registry().claim(shm::Role::Runner, -1, getpid());
    if (!self) return self.error();
    kv->self_ = *self;
    kv->inst_.registry().set_running(kv->self_);
    auto user = kv->inst_.arena(0).join(kv->self_);
    if (!user) return user.error();
    kv->user_ = *user;
    kv->joined_ = true;
    kv->device_name_ = o.device_data ? o.device_name : std::string();
    void* data = o.device_data ? o.device_data : static_cast<void*>(kv->inst_.cpu_kv_data());
    kv->pool_ = std::make_unique<KvPool>(layout, data,
                                         std::make_unique<ShmBlockAllocator>(kv->inst_.arena(0), kv->user_));
    return kv;
}

ShmKv::~ShmKv() {
    pool_.reset();
    if (joined_) inst_.arena(0).leave(user_);
    if (self_.valid()) inst_.registry().release(self_);
    shm::Instance::unlink(inst_.config().name);  // this object created the instance
}

std::string ShmKv::describe() const {
    const auto& cs = inst_.control_segment();
    if (!device_name_.empty()) {
        const KvLayout& l = pool_->layout();
        const double mib = static_cast<double>(l.block_bytes()) * pool_->allocator().n_blocks() / 1048576.0;
        return fmt::format("shm: {} ({} KiB), KV on {} ({:.1f} MiB, {} blocks)", cs.path(), cs.payload_bytes() >> 10,
                           device_name_, mib, pool_->allocator().n_blocks());
    }
    const auto& ks = inst_.kv_segment();
    return fmt::format("shm: {} ({} KiB), KV {} ({:.1f} MiB, {} blocks, {})", cs.path(), cs.payload_bytes() >> 10,
                       ks.path(), ks.payload_bytes() / 1048576.0, pool_->allocator().n_blocks(),
                       shm::page_mode_name(ks.page_mode()));
}

}  // namespace duet
