#include "cli/topo.h"

#include <cstdio>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "base/thread_pool.h"
#include "roles/placement.h"
#include "roles/wire.h"

namespace duet {

int cmd_topo(const TopoArgs& a) {
    auto m = !a.xml.empty()         ? Machine::from_xml(a.xml)
             : !a.synthetic.empty() ? Machine::synthetic(a.synthetic)
                                    : Machine::detect();
    if (!m) {
        std::fprintf(stderr, "duet: %s\n", m.error().message.c_str());
        return 1;
    }
    if (Status st = check_worker_counts(a.prefill_workers, a.decode_workers); !st) {
        std::fprintf(stderr, "duet: %s\n", st.error().message.c_str());
        return 2;
    }
    PlanOptions o;
    o.prefill_workers = a.prefill_workers;
    o.decode_workers = a.decode_workers;
    for (auto [text, out, what] : {std::tuple{&a.devices, &o.devices, "devices"},
                                   std::tuple{&a.front_cpus, &o.front_cpus, "front-cpus"},
                                   std::tuple{&a.prefill_cpus, &o.prefill_cpus, "prefill-cpus"},
                                   std::tuple{&a.decode_cpus, &o.decode_cpus, "decode-cpus"}}) {
        if (text->empty()) continue;
        auto list = parse_cpu_list(*text);
        if (!list) {
            std::fprintf(stderr, "duet: --%s: %s\n", what, list.error().message.c_str());
            return 2;
        }
        *out = *list;
    }
    auto plan = plan_placement(*m, o);
    if (!plan) {
        std::fprintf(stderr, "duet: %s\n", plan.error().message.c_str());
        return 2;
    }
    if (a.json) {
        nlohmann::json j;
        j["machine"] = {{"source", m->source}, {"cores", m->cores.size()}, {"numa_nodes", m->n_numa}};
        j["gpus"] = nlohmann::json::array();
        for (const MachineGpu& g : m->gpus)
            j["gpus"].push_back({{"device", g.device}, {"pci", g.pci}, {"near_cpus", format_cpu_list(g.pus)}});
        j["roles"] = nlohmann::json::array();
        for (const Placement& r : plan->roles)
            j["roles"].push_back({{"role", r.role},
                                  {"index", r.index},
                                  {"device", r.device < 0 ? nlohmann::json("cpu") : nlohmann::json(r.device)},
                                  {"cpus", format_cpu_list(r.cpus)},
                                  {"threads", r.threads},
                                  {"numa", r.numa}});
        j["notes"] = plan->notes;
        fmt::print("{}\n", j.dump(2));
        return 0;
    }
    size_t pus = 0;
    for (const MachineCore& c : m->cores) pus += c.pus.size();
    fmt::print("{}: {} cores ({} hardware threads), {} NUMA node(s), {} NVIDIA GPU(s)\n", m->source, m->cores.size(),
               pus, m->n_numa, m->gpus.size());
    for (const MachineGpu& g : m->gpus)
        fmt::print("  GPU {}  {}  near CPUs {}\n", g.device, g.pci, format_cpu_list(g.pus));
    fmt::print("\n{:<8} {:>5} {:<7} {:<16} {:>7} {:>5}\n", "role", "index", "device", "cpus", "threads", "numa");
    for (const Placement& r : plan->roles)
        fmt::print("{:<8} {:>5} {:<7} {:<16} {:>7} {:>5}\n", r.role, r.index, r.device < 0 ? "cpu" : std::to_string(r.device),
                   format_cpu_list(r.cpus), r.threads, r.numa);
    for (const std::string& n : plan->notes) fmt::print("note: {}\n", n);
    return 0;
}

}  // namespace duet
