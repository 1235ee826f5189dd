#include "roles/placement.h"

#include "base/thread_pool.h"  // parse_cpu_list

#include <hwloc.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
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

Result<Machine> Machine::from_xml(const std::string& path) {
    Topology tp;
    if (hwloc_topology_init(&tp.t) != 0) return make_error("hwloc_topology_init failed");
    if (hwloc_topology_set_xml(tp.t, path.c_str()) != 0)
        return make_error("{}: cannot read it as an hwloc XML topology ({})", path, std::strerror(errno));
    // The export's PCI devices (no discovery runs: nothing is read from this machine).
    hwloc_topology_set_io_types_filter(tp.t, HWLOC_TYPE_FILTER_KEEP_IMPORTANT);
    if (hwloc_topology_load(tp.t) != 0) return make_error("hwloc could not load {}", path);
    auto m = from_topology(tp.t, fmt::format("hwloc XML {}", path));
    if (!m) return m;
    // NVIDIA display and 3D controllers (not its NVSwitches, class 0x0680), in PCI
    // bus order as CUDA_DEVICE_ORDER=PCI_BUS_ID numbers them, each with the hardware
    // threads of the first non-I/O object above it (its package or NUMA node).
    for (hwloc_obj_t d = hwloc_get_next_pcidev(tp.t, nullptr); d; d = hwloc_get_next_pcidev(tp.t, d)) {
        const auto& p = d->attr->pcidev;
        if (p.vendor_id != 0x10de || (p.class_id >> 8) != 0x03) continue;
        MachineGpu g;
        g.pci = fmt::format("{:04x}:{:02x}:{:02x}.{:x}", static_cast<unsigned>(p.domain), static_cast<unsigned>(p.bus),
                            static_cast<unsigned>(p.dev), static_cast<unsigned>(p.func));
        if (hwloc_obj_t a = hwloc_get_non_io_ancestor_obj(tp.t, d); a && a->cpuset) g.pus = pus_of(a->cpuset);
        // Its memory, where the export ran hwloc's CUDA backend (an OS device "cudaN"
        // under it says, in KiB); NVML's devices do not say.
        for (hwloc_obj_t o = d->io_first_child; o; o = o->next_sibling)
            if (const char* kib = hwloc_obj_get_info_by_name(o, "CUDAGlobalMemorySize"))
                g.memory_bytes = std::strtoull(kib, nullptr, 10) * 1024;
        m->gpus.push_back(std::move(g));
    }
    std::sort(m->gpus.begin(), m->gpus.end(), [](const MachineGpu& a, const MachineGpu& b) { return a.pci < b.pci; });
    for (size_t i = 0; i < m->gpus.size(); ++i) m->gpus[i].device = static_cast<int>(i);
    return m;
}

Status bind_to_nodes(void* addr, size_t bytes, std::vector<int> nodes) {
    std::sort(nodes.begin(), nodes.end());
    nodes.erase(std::unique(nodes.begin(), nodes.end()), nodes.end());
    std::erase_if(nodes, [](int n) { return n < 0 || n >= 1024; });
    if (nodes.empty()) return {};
    constexpr uintptr_t kAlign = 2u << 20;
    const uintptr_t begin = (reinterpret_cast<uintptr_t>(addr) + kAlign - 1) & ~(kAlign - 1);
    const uintptr_t end = (reinterpret_cast<uintptr_t>(addr) + bytes) & ~(kAlign - 1);
    if (end <= begin) return {};
    unsigned long mask[1024 / (8 * sizeof(unsigned long))] = {};
    for (int n : nodes) mask[static_cast<size_t>(n) / (8 * sizeof(unsigned long))] |= 1ul << (static_cast<unsigned>(n) % (8 * sizeof(unsigned long)));
    constexpr int kPreferred = 1, kInterleave = 3;  // MPOL_PREFERRED, MPOL_INTERLEAVE (linux/mempolicy.h)
    const int mode = nodes.size() == 1 ? kPreferred : kInterleave;
    if (syscall(SYS_mbind, begin, end - begin, mode, mask, 1024ul, 0u) != 0)
        return make_error("mbind to NUMA node(s) {}: {}", fmt::join(nodes, ","), std::strerror(errno));
    return {};
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

namespace {

using NodeCpus = std::map<int, std::vector<int>>;  // one hardware thread per core, by NUMA node

// Splits `cpus` among n workers: even shares, or shared cores when too few.
std::vector<std::vector<int>> split_cpus(const std::vector<int>& cpus, int n, const char* role, Plan& plan) {
    std::vector<std::vector<int>> out(static_cast<size_t>(n));
    if (static_cast<int>(cpus.size()) >= n) {
        size_t at = 0;
        for (int w = 0; w < n; ++w) {
            const size_t share = cpus.size() / static_cast<size_t>(n) +
                                 (static_cast<size_t>(w) < cpus.size() % static_cast<size_t>(n) ? 1 : 0);
            out[static_cast<size_t>(w)].assign(cpus.begin() + static_cast<long>(at),
                                               cpus.begin() + static_cast<long>(at + share));
            at += share;
        }
    } else {
        for (int w = 0; w < n; ++w) out[static_cast<size_t>(w)] = {cpus[static_cast<size_t>(w) % cpus.size()]};
        plan.notes.push_back(fmt::format("{} {} workers on {} core(s): they share cores", n, role, cpus.size()));
    }
    return out;
}

// One node's cores for its np prefill and nd decode workers: prefill's and decode's.
void split_node(const std::vector<int>& pool, int np, int nd, int node, std::vector<int>& pre, std::vector<int>& dec,
                Plan& plan) {
    if (np == 0 || nd == 0) {  // this node runs one role only
        (np ? pre : dec) = pool;
    } else if (pool.size() == 1) {
        pre = dec = pool;
        plan.notes.push_back(fmt::format("one core on NUMA node {}: prefill and decode share it", node));
    } else {
        // Decode is bound by memory bandwidth, which a few cores saturate; prefill by
        // arithmetic, which wants every core it can get. Even split (by worker
        // count), prefill first.
        size_t n_dec = pool.size() * static_cast<size_t>(nd) / static_cast<size_t>(np + nd);
        n_dec = std::clamp<size_t>(n_dec, 1, pool.size() - 1);
        pre.assign(pool.begin(), pool.end() - static_cast<long>(n_dec));
        dec.assign(pool.end() - static_cast<long>(n_dec), pool.end());
    }
}

Status check_disjoint(const std::vector<std::vector<int>>& prefill, const std::vector<std::vector<int>>& decode) {
    for (const auto& pre : prefill)
        for (const auto& dec : decode)
            for (int c : pre)
                if (std::find(dec.begin(), dec.end(), c) != dec.end())
                    return make_error("prefill and decode CPU lists overlap at CPU {}: they must be disjoint", c);
    return {};
}

Result<Plan> plan_cpu(const Machine& m, const PlanOptions& o, NodeCpus by_node) {
    Plan plan;
    const int P = o.prefill_workers, D = o.decode_workers;
    if (P < 1 || D < 1) return make_error("at least one prefill and one decode worker (asked for {} and {})", P, D);
    // Nodes by core count, largest first (ties: lower node first).
    std::vector<int> nodes;
    for (auto& [node, cpus] : by_node) nodes.push_back(node);
    std::stable_sort(nodes.begin(), nodes.end(), [&](int a, int b) { return by_node[a].size() > by_node[b].size(); });
    const size_t used = std::min(nodes.size(), static_cast<size_t>(std::max(P, D)));
    // Workers per node: index i on nodes[i % used].
    std::vector<int> np(used, 0), nd(used, 0);
    for (int i = 0; i < P; ++i) ++np[static_cast<size_t>(i) % used];
    for (int i = 0; i < D; ++i) ++nd[static_cast<size_t>(i) % used];
    // The front: a core of a node no worker uses, else the last core of the largest
    // node when that leaves at least a core per worker there (and three cores in
    // all, as before: two cores are better spent on prefill and decode).
    std::vector<int> front;
    if (nodes.size() > used) front = {by_node[nodes[used]].front()};
    std::vector<std::vector<int>> pools(used);
    for (size_t k = 0; k < used; ++k) pools[k] = by_node[nodes[k]];
    if (front.empty() && pools[0].size() >= 3 && pools[0].size() > static_cast<size_t>(np[0] + nd[0])) {
        front = {pools[0].back()};
        pools[0].pop_back();
    }
    std::vector<std::vector<int>> prefill(static_cast<size_t>(P)), decode(static_cast<size_t>(D));
    for (size_t k = 0; k < used; ++k) {
        std::vector<int> pre, dec;
        split_node(pools[k], np[k], nd[k], nodes[k], pre, dec, plan);
        auto ps = np[k] ? split_cpus(pre, np[k], "prefill", plan) : std::vector<std::vector<int>>{};
        auto ds = nd[k] ? split_cpus(dec, nd[k], "decode", plan) : std::vector<std::vector<int>>{};
        for (int i = static_cast<int>(k), j = 0; i < P; i += static_cast<int>(used), ++j)
            prefill[static_cast<size_t>(i)] = ps[static_cast<size_t>(j)];
        for (int i = static_cast<int>(k), j = 0; i < D; i += static_cast<int>(used), ++j)
            decode[static_cast<size_t>(i)] = ds[static_cast<size_t>(j)];
    }
    if (!o.prefill_cpus.empty()) prefill = split_cpus(o.prefill_cpus, P, "prefill", plan);
    if (!o.decode_cpus.empty()) decode = split_cpus(o.decode_cpus, D, "decode", plan);
    if (front.empty()) {
        front = {prefill[0].front()};
        plan.notes.push_back("no core to spare for the front: it shares the prefill cores (it mostly sleeps)");
    }
    if (!o.front_cpus.empty()) front = o.front_cpus;
    if (!o.prefill_cpus.empty() || !o.decode_cpus.empty())
        if (Status st = check_disjoint(prefill, decode); !st) return st.error();
    plan.roles.push_back({"front", 0, -1, front, 1, numa_of_cpu(m, front.front())});
    for (int i = 0; i < P; ++i) {
        const auto& c = prefill[static_cast<size_t>(i)];
        plan.roles.push_back({"prefill", i, -1, c, static_cast<int>(c.size()), numa_of_cpu(m, c.front())});
    }
    for (int i = 0; i < D; ++i) {
        const auto& c = decode[static_cast<size_t>(i)];
        plan.roles.push_back({"decode", i, -1, c, static_cast<int>(c.size()), numa_of_cpu(m, c.front())});
    }
    return plan;
}

// GPUs: each process drives its device from one core close to it.
Result<Plan> plan_gpus(const Machine& m, const PlanOptions& o) {
    Plan plan;
    std::map<int, int> users;  // processes planned on each core (its first hardware thread)
    // A free core near the GPU; else, where the GPU has cores near it, the least used
    // of those (shared: a GPU worker's own CPU time is kernel launches and host-side
    // sampling, while its page-locked staging memory and PCIe path belong to its
    // package, so a free core across the socket link would cost every host copy);
    // else the least used core anywhere. Sharing is noted.
    auto take_near = [&](const std::vector<int>& near, int device) -> int {
        const auto is_near = [&](const MachineCore& c) {
            return std::find(near.begin(), near.end(), c.pus.front()) != near.end();
        };
        int best = -1;
        for (bool near_only : {true, false}) {
            for (const MachineCore& c : m.cores)
                if ((!near_only || is_near(c)) && (best < 0 || users[c.pus.front()] < users[best]))
                    best = c.pus.front();
            if (best >= 0) break;
        }
        if (best < 0) return -1;
        if (users[best] > 0)
            plan.notes.push_back(device >= 0
                                     ? fmt::format("GPU {}: no free core close to it; sharing CPU {}", device, best)
                                     : fmt::format("the front shares CPU {}", best));
        else if (device >= 0 && !near.empty() && std::find(near.begin(), near.end(), best) == near.end())
            plan.notes.push_back(fmt::format("GPU {}: no core close to it; using CPU {}", device, best));
        ++users[best];
        return best;
    };
    for (size_t i = 0; i < o.devices.size(); ++i) {
        const int d = o.devices[i];
        if (d < 0 || d >= static_cast<int>(m.gpus.size()))
            return make_error("GPU {} does not exist: {} has {} NVIDIA GPU(s)", d, m.source, m.gpus.size());
        const MachineGpu& g = m.gpus[static_cast<size_t>(d)];
        if (o.prefill_gpus > 0) {  // one role per GPU: prefill on the first ones, decode on the rest
            const bool prefill = static_cast<int>(i) < o.prefill_gpus;
            const int c = take_near(g.pus, d);
            const int index = prefill ? static_cast<int>(i) : static_cast<int>(i) - o.prefill_gpus;
            plan.roles.push_back({prefill ? "prefill" : "decode", index, d, {c}, 1, numa_of_cpu(m, c)});
            continue;
        }
        for (const char* role : {"prefill", "decode"}) {
            const int c = take_near(g.pus, d);
            // Worker i of each role is the pair on the i-th GPU served.
            plan.roles.push_back({role, static_cast<int>(i), d, {c}, 1, numa_of_cpu(m, c)});
        }
    }
    // The front last, apart from the workers where a core is left: the least used
    // core of the machine, the first NUMA node's first at a tie.
    std::vector<int> front = o.front_cpus;
    if (front.empty()) front = {take_near({}, -1)};
    plan.roles.insert(plan.roles.begin(), {"front", 0, -1, front, 1, numa_of_cpu(m, front.front())});
    return plan;
}

}  // namespace

Result<Plan> plan_placement(const Machine& m, const PlanOptions& o) {
    for (auto [list, what] : {std::pair{&o.front_cpus, "front"}, std::pair{&o.prefill_cpus, "prefill"},
                              std::pair{&o.decode_cpus, "decode"}})
        if (Status st = check_cpus(m, *list, what); !st) return st.error();
    for (int c : o.prefill_cpus)
        if (std::find(o.decode_cpus.begin(), o.decode_cpus.end(), c) != o.decode_cpus.end())
            return make_error("prefill and decode CPU lists overlap at CPU {}: they must be disjoint", c);
    NodeCpus by_node;
    for (const MachineCore& c : m.cores) by_node[c.numa].push_back(c.pus.front());
    return o.devices.empty() ? plan_cpu(m, o, std::move(by_node)) : plan_gpus(m, o);
}

}  // namespace duet
