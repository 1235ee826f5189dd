#include "roles/prefill_worker.h"

#include "base/log.h"

#include "base/trace.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <utility>

#include <fmt/format.h>

#include "engine/backends.h"
#include "engine/scheduling.h"
#include "model/fingerprint.h"
#include "roles/claims.h"
#include "roles/sd_notify.h"

namespace duet {

// Prefill's side of hand-offs: the decode workers it hands to (its outlets), the
// blocks a hand-off takes in a decode worker's arena, and the message it sends.

Status PrefillWorker::join_outlets() {
    const shm::InstanceConfig& c = inst_->config();
    for (uint32_t d = 0; d < rings_.n_decode; ++d) {
        const uint32_t a = worker_arena(c, shm::Role::Decode, d);
        if (find_outlet(a) >= 0) continue;
        Outlet o;
        o.arena = a;
        auto user = inst_->arena(a).join(self_);
        if (!user) return make_error("KV arena {} (decode worker {}'s): {}", a, d, user.error().message);
        o.user = *user;
        o.alloc = std::make_unique<ShmBlockAllocator>(inst_->arena(a), o.user);
        o.dest.n_blocks = static_cast<int32_t>(inst_->arena(a).n_blocks());
        if (!gpu_instance(c)) o.dest.data = inst_->cpu_kv_data(a);
        outlets_.push_back(std::move(o));
    }
    return {};
}

int32_t PrefillWorker::find_outlet(uint32_t arena) const {
    for (size_t i = 0; i < outlets_.size(); ++i)
        if (outlets_[i].arena == arena) return static_cast<int32_t>(i);
    return -1;
}

void PrefillWorker::release(Job& j) {
    j.seq.release(*pool_);
    forget_grammar(j.req);
    release_destination(j);
}

bool PrefillWorker::reserve_destination(Job& j) {
    // The decode workers best first (pick_decode's order); the first whose arena
    // is reachable and has room takes it.
    std::vector<DecodeView> views;
    for (uint32_t k = 0; k < rings_.n_decode; ++k) views.push_back(decode_view(*inst_, k, opts_.numa));
    std::vector<uint32_t> order(views.size());
    for (uint32_t k = 0; k < order.size(); ++k) order[k] = k;
    std::stable_sort(order.begin(), order.end(),
                     [&](uint32_t a, uint32_t b) { return pick_decode({views[b], views[a]}) == 1; });
    for (uint32_t d : order) {
        const uint32_t a = worker_arena(inst_->config(), shm::Role::Decode, d);
        const int32_t oi = find_outlet(a);
        if (oi < 0) continue;
        Outlet& o = outlets_[static_cast<size_t>(oi)];
        if (!o.dest.data) {
            // Made by its decode worker when it starts (not kept yet: later).
            auto m = open_peer_kv(inst_->config().name, a, opts_.device,
                                  pool_->layout().block_bytes() * inst_->arena(a).n_blocks());
            if (!m) {
                if (!o.said && m.error().message.find("not kept") == std::string::npos) log::warning(m.error().message);
                o.said = true;
                continue;
            }
            o.gpu = std::move(m).value();
            o.dest.data = o.gpu->data();
            o.dest.device = o.gpu->device();
            o.dest.peer = o.gpu->peer();
            if (!o.dest.peer)
                log::notice(
                    fmt::format("cuda:{} cannot reach cuda:{} by peer access: hand-offs there are staged "
                                "through host memory",
                                opts_.device.index, o.dest.device));
        }
        auto got = kv_->reserve_in(*o.alloc, static_cast<int64_t>(j.all.size()));
        if (!got) continue;  // full: decode frees as it finishes
        j.outlet = oi;
        j.dst = std::move(got).value();
        return true;
    }
    return false;
}

void PrefillWorker::release_destination(Job& j) {
    if (j.outlet >= 0) KvCacheManager::release_in(*outlets_[static_cast<size_t>(j.outlet)].alloc, j.dst);
    j.dst.clear();
    j.outlet = -1;
}

bool PrefillWorker::hands_to(uint32_t d, uint32_t arena) const {
    return rings_.linked(opts_.index, d) && worker_arena(inst_->config(), shm::Role::Decode, d) == arena;
}

bool PrefillWorker::decode_running_on(uint32_t arena) const {
    for (uint32_t d = 0; d < rings_.n_decode; ++d)
        if (hands_to(d, arena) && inst_->registry().find_running(shm::Role::Decode, static_cast<int32_t>(d)) >= 0)
            return true;
    return false;
}

shm::ProcRef PrefillWorker::send_handoff(const WireMsg& m, uint32_t arena) {
    trace::Range range("handoff");
    shm::Registry& reg = inst_->registry();
    // The decode workers whose arena holds the blocks (a GPU pair's own, decode's
    // arena the KV was copied into, or the one host arena): the one with room and
    // the least work.
    std::vector<uint32_t> cand;
    std::vector<DecodeView> views;
    for (uint32_t k = 0; k < rings_.n_decode; ++k)
        if (hands_to(k, arena)) {
            cand.push_back(k);
            views.push_back(decode_view(*inst_, k, opts_.numa));
        }
    const uint32_t d = cand.at(pick_decode(views));
    const int32_t s = reg.find_running(shm::Role::Decode, static_cast<int32_t>(d));
    auto& ring = out_[rings_.paired ? 0 : d];
    // Decode drains it every step; a decode worker that died is restarted and drains it
    // then (its unit, or duet serve): a wait, not a wedge, for the watchdog.
    for (int n = 0; !ring.try_push(m); ++n) {
        if (n % 256 == 0) alive();
        usleep(50);
    }
    reg.wake(shm::Role::Decode, static_cast<int32_t>(d));
    return s < 0 ? shm::ProcRef{} : reg.current(static_cast<uint32_t>(s));
}

}  // namespace duet
