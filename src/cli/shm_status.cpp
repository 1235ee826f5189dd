#include "cli/shm_status.h"

#include <cstdio>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "kv/kv_pool.h"
#include "roles/worker_stats.h"
#include "shm/instance.h"

namespace duet {

int cmd_shm_status(const std::string& name, bool as_json) {
    auto in = shm::Instance::attach(name);
    if (!in) {
        std::fprintf(stderr, "duet: %s\n", in.error().message.c_str());
        return 1;
    }
    const shm::InstanceConfig& c = in->config();
    const shm::Segment& seg = in->control_segment();
    nlohmann::json j;
    j["instance"] = name;
    const auto dtype = kv_dtype_from(c.kv_dtype);
    j["kv_dtype"] = dtype ? kv_dtype_name(*dtype) : "unknown";
    j["control_segment"] = {{"path", seg.path()},
                            {"bytes", seg.payload_bytes()},
                            {"creator_pid", seg.header().creator_pid},
                            {"fingerprint", fmt::format("{:#018x}", seg.header().config_fingerprint)}};
    if (c.cpu_kv_bytes)
        j["kv_segment"] = {{"path", in->kv_segment().path()},
                           {"bytes", in->kv_segment().payload_bytes()},
                           {"pages", shm::page_mode_name(in->kv_segment().page_mode())}};
    shm::Registry& reg = in->registry();
    const uint64_t now = shm::monotonic_ns();
    j["processes"] = nlohmann::json::array();
    for (uint32_t s = 0; s < reg.n_slots(); ++s) {
        shm::ProcState st = reg.state(s);
        if (st == shm::ProcState::Free) continue;
        const shm::ProcSlot& ps = reg.slot(s);
        // A snapshot for display: every field relaxed (a live process may change them meanwhile).
        uint64_t hb = ps.heartbeat_ns.load(std::memory_order_relaxed);
        const auto role = static_cast<shm::Role>(ps.role.load(std::memory_order_relaxed));
        nlohmann::json p = {{"slot", s},
                            {"generation", reg.current(s).gen},
                            {"state", shm::proc_state_name(st)},
                            {"role", shm::role_name(role)},
                            {"index", ps.index.load(std::memory_order_relaxed)},
                            {"device", ps.device.load(std::memory_order_relaxed)},
                            {"pid", reg.pid(s)},
                            {"heartbeat_age_ms", hb && now > hb ? (now - hb) / 1e6 : 0.0}};
        if (role == shm::Role::Prefill || role == shm::Role::Decode) {  // the workers' own page (roles/worker_stats.h)
            const WorkerStats& w = worker_stats(reg, s);
            p["load_items"] = w.load_items.load(std::memory_order_relaxed);
            p["load_tokens"] = w.load_tokens.load(std::memory_order_relaxed);
            p["served"] = w.served.load(std::memory_order_relaxed);
        }
        j["processes"].push_back(std::move(p));
    }
    j["arenas"] = nlohmann::json::array();
    for (size_t d = 0; d < in->n_arenas(); ++d) {
        shm::KvArena& a = in->arena(d);
        shm::ArenaCensus cs = a.census();
        nlohmann::json users = nlohmann::json::array();
        for (uint32_t u = 0; u < a.n_users(); ++u) {
            shm::ProcRef h = a.holder(u);
            if (h.valid()) users.push_back({{"user", u}, {"slot", h.slot}, {"generation", h.gen}, {"refs", cs.refs_by_user[u]}});
        }
        j["arenas"].push_back({{"arena", d},
                               {"blocks", cs.total},
                               {"free", cs.free},
                               {"cached", cs.cached},
                               {"held", cs.held},
                               {"users", users}});
    }
    shm::RequestTable& rt = in->requests();
    nlohmann::json by_state = nlohmann::json::object();
    for (uint32_t s = 0; s < rt.n_slots(); ++s) by_state[shm::req_state_name(rt.state(s))] = by_state.value(shm::req_state_name(rt.state(s)), 0) + 1;
    j["requests"] = {{"slots", rt.n_slots()}, {"by_state", by_state}};
    j["rings"] = nlohmann::json::array();
    for (uint32_t r = 0; r < c.n_rings; ++r) {
        shm::RingHeader* h = in->ring(r);
        uint64_t head = h->head.load(std::memory_order_relaxed), tail = h->tail.load(std::memory_order_relaxed);
        j["rings"].push_back({{"ring", r}, {"capacity", h->capacity}, {"queued", tail - head}, {"pushed", tail}});
    }
    if (as_json) {
        fmt::print("{}\n", j.dump(2));
        return 0;
    }
    fmt::print("instance {}: {} ({} KiB, created by pid {})\n", name, seg.path(), seg.payload_bytes() >> 10,
               seg.header().creator_pid);
    if (c.cpu_kv_bytes)
        fmt::print("KV data: {} ({:.1f} MiB, {})\n", in->kv_segment().path(), in->kv_segment().payload_bytes() / 1048576.0,
                   shm::page_mode_name(in->kv_segment().page_mode()));
    fmt::print("\nprocesses:\n");
    for (auto& p : j["processes"])
        fmt::print("  slot {:>3} gen {:>5}  {:<9} {:<8} device {:>2}  pid {:>7}  heartbeat {:.0f} ms ago\n",
                   p["slot"].get<uint32_t>(), p["generation"].get<uint32_t>(), p["state"].get<std::string>(),
                   p["role"].get<std::string>(), p["device"].get<int>(), p["pid"].get<int>(),
                   p["heartbeat_age_ms"].get<double>());
    fmt::print("\nKV arenas ({} values):\n", j["kv_dtype"].get<std::string>());
    for (auto& a : j["arenas"]) {
        fmt::print("  arena {}: {} blocks: {} free, {} cached, {} held\n", a["arena"].get<size_t>(),
                   a["blocks"].get<uint32_t>(), a["free"].get<uint32_t>(), a["cached"].get<uint32_t>(),
                   a["held"].get<uint32_t>());
        for (auto& u : a["users"])
            fmt::print("    user {} = registry slot {} gen {}: {} references\n", u["user"].get<uint32_t>(),
                       u["slot"].get<uint32_t>(), u["generation"].get<uint32_t>(), u["refs"].get<uint64_t>());
    }
    fmt::print("\nrequests: {} slots;", rt.n_slots());
    for (auto& [k, v] : by_state.items()) fmt::print(" {} {}", k, v.get<int>());
    fmt::print("\nrings:");
    for (auto& r : j["rings"]) fmt::print(" [{}] {}/{}", r["ring"].get<uint32_t>(), r["queued"].get<uint64_t>(), r["capacity"].get<uint64_t>());
    fmt::print("\n");
    return 0;
}

}  // namespace duet
