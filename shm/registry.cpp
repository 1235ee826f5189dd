#include "shm/registry.h"

#include <poll.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <new>
#include <sstream>

namespace duet::shm {

namespace {

constexpr uint32_t kRegistryMagic = 0x67657270;  // "preg"

// [pid:32][generation:24][state:8]: the claim names the process in the same CAS, so
// no instant exists at which a slot is taken by an unknown process.
uint64_t pack_sg(uint32_t pid, uint32_t gen, ProcState s) {
    return (static_cast<uint64_t>(pid) << 32) | (static_cast<uint64_t>(gen & 0xffffff) << 8) |
           static_cast<uint64_t>(s);
}
uint32_t gen_of(uint64_t sg) { return static_cast<uint32_t>(sg >> 8) & 0xffffff; }
pid_t pid_of(uint64_t sg) { return static_cast<pid_t>(sg >> 32); }
ProcState state_of(uint64_t sg) { return static_cast<ProcState>(sg & 0xff); }
bool is_live(ProcState s) { return s == ProcState::Starting || s == ProcState::Running || s == ProcState::Leaving; }

int pidfd_open(pid_t pid) { return static_cast<int>(syscall(SYS_pidfd_open, pid, 0)); }

}  // namespace

const char* role_name(Role r) {
    switch (r) {
    case Role::None: return "none";
    case Role::Launcher: return "launcher";
    case Role::Front: return "front";
    case Role::Prefill: return "prefill";
    case Role::Decode: return "decode";
    case Role::Runner: return "runner";
    case Role::Tool: return "tool";
    }
    return "?";
}

const char* proc_state_name(ProcState s) {
    switch (s) {
    case ProcState::Free: return "free";
    case ProcState::Starting: return "starting";
    case ProcState::Running: return "running";
    case ProcState::Dead: return "dead";
    case ProcState::Leaving: return "leaving";
    }
    return "?";
}

uint64_t process_start_ticks(pid_t pid) {
    char path[64];
    std::snprintf(path, sizeof path, "/proc/%d/stat", static_cast<int>(pid));
    std::ifstream f(path);
    std::string s;
    if (!std::getline(f, s)) return 0;
    // The command name (field 2) may hold spaces and parentheses: fields resume after
    // the last ')'. starttime is field 22, the 20th after it.
    size_t p = s.rfind(')');
    if (p == std::string::npos) return 0;
    std::istringstream in(s.substr(p + 1));
    std::string field;
    if (!(in >> field) || field == "Z" || field == "X" || field == "x") return 0;  // field 3: state
    for (int i = 4; i <= 22; ++i)
        if (!(in >> field)) return 0;
    return std::strtoull(field.c_str(), nullptr, 10);
}

size_t Registry::bytes(uint32_t n_slots) { return sizeof(RegistryHeader) + sizeof(ProcSlot) * n_slots; }

Status Registry::init(void* mem, uint32_t n_slots) {
    if (n_slots == 0 || n_slots > 4096) return make_error("registry needs 1-4096 slots, got {}", n_slots);
    std::memset(mem, 0, bytes(n_slots));
    auto* h = new (mem) RegistryHeader{};
    h->n_slots = n_slots;
    auto* slots = reinterpret_cast<ProcSlot*>(h + 1);
    for (uint32_t i = 0; i < n_slots; ++i) {
        new (&slots[i]) ProcSlot{};
        slots[i].device.store(-1, std::memory_order_relaxed);
    }
    h->magic = kRegistryMagic;
    return {};
}

void Registry::note_golden_failure(std::string_view reason) {
    // The first failure writes the reason; the length's release publishes it.
    if (hdr_->golden_failures.fetch_add(1, std::memory_order_acq_rel) != 0) return;
    const size_t n = std::min(reason.size(), sizeof hdr_->golden_reason - 1);
    std::memcpy(hdr_->golden_reason, reason.data(), n);
    hdr_->golden_reason_len.store(static_cast<uint32_t>(n), std::memory_order_release);
}

std::string Registry::golden_reason() const {
    const uint32_t n = hdr_->golden_reason_len.load(std::memory_order_acquire);
    return std::string(hdr_->golden_reason, std::min<size_t>(n, sizeof hdr_->golden_reason));
}

Result<Registry> Registry::attach(void* mem) {
    Registry r;
    r.hdr_ = static_cast<RegistryHeader*>(mem);
    if (r.hdr_->magic != kRegistryMagic) return make_error("not a process registry (magic {:#x})", r.hdr_->magic);
    r.slots_ = reinterpret_cast<ProcSlot*>(r.hdr_ + 1);
    return r;
}

Result<ProcRef> Registry::claim(Role role, int32_t device, pid_t pid, uint32_t index) {
    uint64_t ticks = process_start_ticks(pid);
    for (uint32_t i = 0; i < n_slots(); ++i) {
        ProcSlot& s = slots_[i];
        uint64_t sg = s.state_gen.load(std::memory_order_relaxed);
        if (state_of(sg) != ProcState::Free) continue;
        uint32_t gen = gen_of(sg) + 1;
        if (gen >= (1u << 24)) gen = 1;  // 24 bits of generation fit the word
        // Acquire pairs with the release of the slot's last release()/reclaim(): the
        // previous owner's writes are done. STARTING first, so nobody else claims it.
        if (!s.state_gen.compare_exchange_strong(sg, pack_sg(static_cast<uint32_t>(pid), gen, ProcState::Starting),
                                                 std::memory_order_acquire, std::memory_order_relaxed))
            continue;
        s.role.store(static_cast<uint32_t>(role), std::memory_order_relaxed);
        s.device.store(device, std::memory_order_relaxed);
        s.start_ticks.store((ticks << 24) | gen, std::memory_order_relaxed);
        s.index.store(index, std::memory_order_relaxed);
        s.numa.store(-1, std::memory_order_relaxed);
        for (std::atomic<uint64_t>& w : s.role_page) w.store(0, std::memory_order_relaxed);
        s.doorbell.word.store(0, std::memory_order_relaxed);
        // Release pairs with readers' acquire of heartbeat: the fields above are set.
        s.heartbeat_ns.store(monotonic_ns(), std::memory_order_release);
        return ProcRef{i, gen};
    }
    return make_error("all {} process registry slots are in use", n_slots());
}

namespace {
bool transition(std::atomic<uint64_t>& w, ProcRef r, bool (*from_ok)(ProcState), ProcState to) {
    uint64_t sg = w.load(std::memory_order_relaxed);
    for (;;) {
        if (gen_of(sg) != r.gen || !from_ok(state_of(sg))) return false;
        // acq_rel: a transition publishes this process's prior writes (release) and
        // sees the previous holder's (acquire).
        if (w.compare_exchange_weak(sg, pack_sg(static_cast<uint32_t>(pid_of(sg)), r.gen, to), std::memory_order_acq_rel,
                                    std::memory_order_relaxed))
            return true;
    }
}
}  // namespace

bool Registry::set_running(ProcRef r) {
    return transition(slots_[r.slot].state_gen, r, [](ProcState s) { return s == ProcState::Starting; },
                      ProcState::Running);
}
bool Registry::set_leaving(ProcRef r) {
    return transition(slots_[r.slot].state_gen, r, [](ProcState s) { return s == ProcState::Running; },
                      ProcState::Leaving);
}
bool Registry::stay_after_all(ProcRef r) {
    return transition(slots_[r.slot].state_gen, r, [](ProcState s) { return s == ProcState::Leaving; },
                      ProcState::Running);
}
bool Registry::release(ProcRef r) {
    return transition(slots_[r.slot].state_gen, r, is_live, ProcState::Free);
}
bool Registry::mark_dead(ProcRef r) {
    return transition(slots_[r.slot].state_gen, r, is_live, ProcState::Dead);
}
bool Registry::reclaim(ProcRef r) {
    return transition(slots_[r.slot].state_gen, r, [](ProcState s) { return s == ProcState::Dead; },
                      ProcState::Free);
}

ProcState Registry::state(uint32_t slot) const {
    return state_of(slots_[slot].state_gen.load(std::memory_order_acquire));  // pairs with transition()'s release
}
namespace {
bool is_worker(const ProcSlot& s, Role role, int32_t index) {
    return s.role.load(std::memory_order_relaxed) == static_cast<uint32_t>(role) &&
           (index < 0 || s.index.load(std::memory_order_relaxed) == static_cast<uint32_t>(index));
}
}  // namespace

bool Registry::running_as(uint32_t slot, Role role, int32_t index) const {
    return state(slot) == ProcState::Running && is_worker(slots_[slot], role, index);
}

int32_t Registry::find_running(Role role, int32_t index) const {
    for (uint32_t s = 0; s < n_slots(); ++s)
        if (running_as(s, role, index)) return static_cast<int32_t>(s);
    return -1;
}

void Registry::set_assigned(Role role, uint32_t index, bool on) {
    if (index >= 32) return;
    std::atomic<uint32_t>& w = hdr_->assigned[role == Role::Decode ? 1 : 0];
    if (on)
        w.fetch_or(1u << index, std::memory_order_relaxed);
    else
        w.fetch_and(~(1u << index), std::memory_order_relaxed);
}

bool Registry::assigned(Role role, uint32_t index) const {
    const uint32_t w = hdr_->assigned[role == Role::Decode ? 1 : 0].load(std::memory_order_relaxed);
    return w == 0 || (index < 32 && (w >> index & 1u));
}

int32_t Registry::find_working(Role role, int32_t index) const {
    for (uint32_t s = 0; s < n_slots(); ++s) {
        const ProcState st = state(s);
        if ((st == ProcState::Running || st == ProcState::Leaving) && is_worker(slots_[s], role, index))
            return static_cast<int32_t>(s);
    }
    return -1;
}

void Registry::wake(Role role, int32_t index) {
    for (uint32_t s = 0; s < n_slots(); ++s)
        if (running_as(s, role, index)) doorbell_ring(doorbell(s));
}

ProcRef Registry::current(uint32_t slot) const {
    // Relaxed: the generation and pid travel in the word itself; nothing else is read.
    return ProcRef{slot, gen_of(slots_[slot].state_gen.load(std::memory_order_relaxed))};
}
pid_t Registry::pid(uint32_t slot) const {
    return pid_of(slots_[slot].state_gen.load(std::memory_order_relaxed));  // as current()
}
bool Registry::alive(ProcRef r) const {
    if (r.slot >= n_slots()) return false;
    uint64_t sg = slots_[r.slot].state_gen.load(std::memory_order_acquire);  // pairs with transition()
    return gen_of(sg) == r.gen && is_live(state_of(sg));
}
void Registry::heartbeat(ProcRef r) const {
    // Release, like claim()'s store: a reader that acquires any heartbeat sees the
    // fields claim() set.
    slots_[r.slot].heartbeat_ns.store(monotonic_ns(), std::memory_order_release);
}

bool Registry::process_running(ProcRef r) const {
    if (r.slot >= n_slots()) return false;
    const ProcSlot& s = slots_[r.slot];
    uint64_t sg = s.state_gen.load(std::memory_order_acquire);  // pairs with transition()'s release
    if (gen_of(sg) != r.gen) return false;
    pid_t pid = pid_of(sg);
    uint64_t st = s.start_ticks.load(std::memory_order_relaxed);
    uint64_t now = pid > 0 ? process_start_ticks(pid) : 0;
    // A start time of another generation: claimed a moment ago and not stored yet;
    // the pid was set by the claim itself, so its existence decides.
    bool recorded = (st & 0xffffff) == r.gen;
    return now != 0 && (!recorded || now == (st >> 24));
}

std::vector<ProcRef> Registry::dead_slots() const {
    std::vector<ProcRef> out;
    for (uint32_t i = 0; i < n_slots(); ++i) {
        uint64_t sg = slots_[i].state_gen.load(std::memory_order_acquire);  // pairs with transition()
        if (state_of(sg) == ProcState::Dead) out.push_back({i, gen_of(sg)});
    }
    return out;
}

std::vector<ProcRef> Registry::sweep_dead() {
    std::vector<ProcRef> dead;
    for (uint32_t i = 0; i < n_slots(); ++i) {
        ProcSlot& s = slots_[i];
        uint64_t sg = s.state_gen.load(std::memory_order_acquire);
        if (!is_live(state_of(sg))) continue;
        ProcRef r{i, gen_of(sg)};
        if (process_running(r)) continue;
        if (mark_dead(r)) dead.push_back(r);
    }
    return dead;
}

LivenessMonitor::~LivenessMonitor() {
    for (auto& it : items_)
        if (it.pidfd >= 0) ::close(it.pidfd);
}

Status LivenessMonitor::watch(const Registry& reg, ProcRef r) {
    if (r.slot >= reg.n_slots()) return make_error("registry slot {} out of range", r.slot);
    const ProcSlot& s = reg.slot(r.slot);
    s.heartbeat_ns.load(std::memory_order_acquire);  // pairs with claim()'s / heartbeat()'s release: ticks set
    pid_t pid = pid_of(s.state_gen.load(std::memory_order_relaxed));  // the claim's own word
    int fd = pid > 0 ? pidfd_open(pid) : -1;
    if (fd < 0 && errno != ESRCH) return make_error("pidfd_open({}) failed: {}", pid, std::strerror(errno));
    // The pidfd now pins this pid: if its start time still matches, it is our process
    // and the fd will report its exit; otherwise ours exited before we looked.
    uint64_t st = s.start_ticks.load(std::memory_order_relaxed);
    if (fd >= 0 && (st & 0xffffff) == r.gen && process_start_ticks(pid) != (st >> 24)) {
        ::close(fd);
        fd = -1;
    }
    if (!reg.alive(r) && fd >= 0) {
        ::close(fd);
        fd = -1;
    }
    items_.push_back({r, fd});
    return {};
}

void LivenessMonitor::unwatch(ProcRef r) {
    for (size_t i = 0; i < items_.size(); ++i)
        if (items_[i].ref == r) {
            if (items_[i].pidfd >= 0) ::close(items_[i].pidfd);
            items_.erase(items_.begin() + static_cast<long>(i));
            return;
        }
}

std::vector<ProcRef> LivenessMonitor::wait(int timeout_ms) {
    std::vector<ProcRef> out;
    std::vector<pollfd> fds;
    for (auto& it : items_) {
        if (it.pidfd < 0) out.push_back(it.ref);
        fds.push_back({it.pidfd, POLLIN, 0});  // poll ignores negative fds
    }
    if (out.empty()) {
        int n = poll(fds.data(), fds.size(), timeout_ms);
        if (n < 0 && errno != EINTR) return out;
    }
    std::vector<Item> keep;
    for (size_t i = 0; i < items_.size(); ++i) {
        auto& it = items_[i];
        if (it.pidfd < 0) continue;  // reported above
        if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) {
            ::close(it.pidfd);
            out.push_back(it.ref);
        } else {
            keep.push_back(it);
        }
    }
    items_ = std::move(keep);
    return out;
}

}  // namespace duet::shm
