#include "roles/placement.h"

#include "base/thread_pool.h"  // parse_cpu_list

#include <hwloc.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

namespace duet {

namespace {

std::vector<int> pus_of(hwloc_const_cpuset_t set) {
    std::vector<int> out;
    for (int id = hwloc_bitmap_first(set); id >= 0; id = hwloc_bitmap_next(set, id)) out.push_back(id);
    return out;
}

Result<Machine> from_topology(hwloc_topology_t t, std::string source) {
    Machine m;
    m.source = std::move(source);
    const int n_numa = hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_NUMANODE);
    m.n_numa = std::max(1, n_numa);
    hwloc_obj_type_t unit = hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_CORE) > 0 ? HWLOC_OBJ_CORE : HWLOC_OBJ_PU;
    const int n = hwloc_get_nbobjs_by_type(t, unit);
    for (int i = 0; i < n; ++i) {
        hwloc_obj_t c = hwloc_get_obj_by_type(t, unit, static_cast<unsigned>(i));
        MachineCore core;
        core.pus = pus_of(c->cpuset);
        if (core.pus.empty()) continue;
        for (int j = 0; j < n_numa; ++j) {
            hwloc_obj_t node = hwloc_get_obj_by_type(t, HWLOC_OBJ_NUMANODE, static_cast<unsigned>(j));
            if (node && hwloc_bitmap_intersects(c->cpuset, node->cpuset)) {
                core.numa = j;
                break;
            }
        }
        m.cores.push_back(std::move(core));
    }
    if (m.cores.empty()) return make_error("hwloc found no cores in {}", m.source);
    // NVIDIA display/3D controllers, in PCI bus order (CUDA_DEVICE_ORDER=PCI_BUS_ID),
    // read from sysfs: hwloc's own PCI discovery leaks memory on every load (seen by
    // LeakSanitizer) and needs nothing it adds here.
    if (std::string(m.source) == "this machine") {
        namespace fs = std::filesystem;
        std::error_code ec;
        for (const auto& d : fs::directory_iterator("/sys/bus/pci/devices", ec)) {
            auto read = [&](const char* f) {
                std::ifstream in(d.path() / f);
                std::string v;
                std::getline(in, v);
                return v;
            };
            if (read("vendor") != "0x10de" || read("class").rfind("0x03", 0) != 0) continue;
            MachineGpu g;
            g.pci = d.path().filename().string();
            if (auto cpus = parse_cpu_list(read("local_cpulist")); cpus.ok()) g.pus = *cpus;
            m.gpus.push_back(std::move(g));
        }
    }
    std::sort(m.gpus.begin(), m.gpus.end(), [](const MachineGpu& a, const MachineGpu& b) { return a.pci < b.pci; });
    for (size_t i = 0; i < m.gpus.size(); ++i) m.gpus[i].device = static_cast<int>(i);
    return m;
}

struct Topology {
    hwloc_topology_t t = nullptr;
    ~Topology() {
        if (t) hwloc_topology_destroy(t);
    }
};

int numa_of_cpu(const Machine& m, int cpu) {
    for (const MachineCore& c : m.cores)
        if (std::find(c.pus.begin(), c.pus.end(), cpu) != c.pus.end()) return c.numa;
    return -1;
}

Status check_cpus(const Machine& m, const std::vector<int>& cpus, const char* what) {
    for (int c : cpus)
        if (numa_of_cpu(m, c) < 0) return make_error("--{}-cpus: CPU {} is not on this machine ({})", what, c, m.source);
    return {};
}

}  // namespace

Result<Machine> Machine::detect() {
    Topology tp;
    if (hwloc_topology_init(&tp.t) != 0) return make_error("hwloc_topology_init failed");
    if (hwloc_topology_load(tp.t) != 0) return make_error("hwloc could not read this machine's topology");
    return from_topology(tp.t, "this machine");
}

Result<Machine> Machine::synthetic(const std::string& description) {
    Topology tp;
    if (hwloc_topology_init(&tp.t) != 0) return make_error("hwloc_topology_init failed");
    if (hwloc_topology_set_synthetic(tp.t, description.c_str()) != 0)
        return make_error("'{}' is not an hwloc synthetic topology (e.g. \"pack:2 numa:1 core:8 pu:2\")", description);
    if (hwloc_topology_load(tp.t) != 0) return make_error("hwloc could not build '{}'", description);
    return from_topology(tp.t, fmt::format("synthetic \"{}\"", description));
}

std::string format_cpu_list(const std::vector<int>& cpus) {
    std::vector<int> v = cpus;
    std::sort(v.begin(), v.end());
    v.erase(std::unique(v.begin(), v.end()), v.end());
    std::string out;
    for (size_t i = 0; i < v.size();) {
        size_t j = i;
        while (j + 1 < v.size() && v[j + 1] == v[j] + 1) ++j;
        if (!out.empty()) out.push_back(',');
        out.append(std::to_string(v[i]));
        if (j > i) {
            out.push_back('-');
            out.append(std::to_string(v[j]));
        }
        i = j + 1;
    }
    return out;
}

Result<Plan> plan_placement(const Machine& m, const PlanOptions& o) {
    Plan plan;
    for (auto [list, what] : {std::pair{&o.front_cpus, "front"}, std::pair{&o.prefill_cpus, "prefill"},
                              std::pair{&o.decode_cpus, "decode"}})
        if (Status st = check_cpus(m, *list, what); !st) return st.error();
    for (int c : o.prefill_cpus)
        if (std::find(o.decode_cpus.begin(), o.decode_cpus.end(), c) != o.decode_cpus.end())
            return make_error("prefill and decode CPU lists overlap at CPU {}: they must be disjoint", c);

    // One hardware thread per core, grouped by NUMA node.
    std::map<int, std::vector<int>> by_node;
    for (const MachineCore& c : m.cores) by_node[c.numa].push_back(c.pus.front());

    if (o.devices.empty()) {
        // The node with the most cores holds prefill and decode (they share the KV arena).
        int home = by_node.begin()->first;
        for (auto& [node, cpus] : by_node)
            if (cpus.size() > by_node[home].size()) home = node;
        std::vector<int> pool = by_node[home];
        std::vector<int> front;
        for (auto& [node, cpus] : by_node)
            if (node != home && front.empty()) front = {cpus.front()};
        if (front.empty() && pool.size() >= 3) {
            front = {pool.back()};
            pool.pop_back();
        }
        std::vector<int> prefill, decode;
        if (pool.size() == 1) {
            prefill = decode = pool;
            plan.notes.push_back("one core: prefill and decode share it");
        } else {
            // Decode is bound by memory bandwidth, which a few cores saturate; prefill by
            // arithmetic, which wants every core it can get. Even split, prefill first.
            size_t n_decode = pool.size() / 2;
            prefill.assign(pool.begin(), pool.end() - static_cast<long>(n_decode));
            decode.assign(pool.end() - static_cast<long>(n_decode), pool.end());
        }
        if (front.empty()) {
            front = prefill;
            plan.notes.push_back("no core to spare for the front: it shares the prefill cores (it mostly sleeps)");
        }
        if (!o.front_cpus.empty()) front = o.front_cpus;
        if (!o.prefill_cpus.empty()) prefill = o.prefill_cpus;
        if (!o.decode_cpus.empty()) decode = o.decode_cpus;
        if (!o.prefill_cpus.empty() || !o.decode_cpus.empty()) {
            for (int c : prefill)
                if (std::find(decode.begin(), decode.end(), c) != decode.end())
                    return make_error("prefill and decode CPU lists overlap at CPU {}: they must be disjoint", c);
        }
        plan.roles.push_back({"front", -1, front, 1, numa_of_cpu(m, front.front())});
        plan.roles.push_back({"prefill", -1, prefill, static_cast<int>(prefill.size()), numa_of_cpu(m, prefill.front())});
        plan.roles.push_back({"decode", -1, decode, static_cast<int>(decode.size()), numa_of_cpu(m, decode.front())});
        return plan;
    }

    // GPUs: each process drives its device from one core close to it.
    std::set<int> taken;
    auto take_near = [&](const std::vector<int>& near, int device) -> int {
        for (const MachineCore& c : m.cores)
            if (!taken.count(c.pus.front()) && std::find(near.begin(), near.end(), c.pus.front()) != near.end()) {
                taken.insert(c.pus.front());
                return c.pus.front();
            }
        for (const MachineCore& c : m.cores)
            if (!taken.count(c.pus.front())) {
                taken.insert(c.pus.front());
                if (device >= 0)
                    plan.notes.push_back(
                        fmt::format("GPU {}: no free core close to it; using CPU {}", device, c.pus.front()));
                return c.pus.front();
            }
        return -1;
    };
    std::vector<int> front = o.front_cpus;
    if (front.empty()) {
        int c = take_near(by_node.begin()->second, -1);
        front = {c};
    }
    plan.roles.push_back({"front", -1, front, 1, numa_of_cpu(m, front.front())});
    for (int d : o.devices) {
        if (d < 0 || d >= static_cast<int>(m.gpus.size()))
            return make_error("GPU {} does not exist: {} has {} NVIDIA GPU(s)", d, m.source, m.gpus.size());
        const MachineGpu& g = m.gpus[static_cast<size_t>(d)];
        for (const char* role : {"prefill", "decode"}) {
            int c = take_near(g.pus, d);
            if (c < 0) return make_error("not enough cores for a prefill and a decode process per GPU");
            plan.roles.push_back({role, d, {c}, 1, numa_of_cpu(m, c)});
        }
    }
    return plan;
}

}  // namespace duet
