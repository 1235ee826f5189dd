// Process placement on hwloc synthetic topologies and hand-made GPU machines: who
// gets which cores, and the errors for impossible requests.
#include "roles/placement.h"

#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <tuple>

#include <gtest/gtest.h>

using namespace duet;

namespace {

const Placement& role(const Plan& p, const std::string& name, int device = -1) {
    for (const Placement& r : p.roles)
        if (r.role == name && r.device == device) return r;
    static Placement none;
    ADD_FAILURE() << "no " << name << " for device " << device;
    return none;
}

bool disjoint(const std::vector<int>& a, const std::vector<int>& b) {
    for (int x : a)
        if (std::find(b.begin(), b.end(), x) != b.end()) return false;
    return true;
}

}  // namespace

TEST(Placement, TwoCoresPrefillAndDecodeApartFrontSharesPrefill) {
    auto m = Machine::synthetic("pack:1 core:2 pu:1");
    ASSERT_TRUE(m.ok()) << m.error().message;
    auto p = plan_placement(*m, {});
    ASSERT_TRUE(p.ok()) << p.error().message;
    EXPECT_EQ(role(*p, "prefill").cpus, std::vector<int>{0});
    EXPECT_EQ(role(*p, "decode").cpus, std::vector<int>{1});
    EXPECT_EQ(role(*p, "front").cpus, std::vector<int>{0});
    EXPECT_EQ(p->notes.size(), 1u);
}

TEST(Placement, SmtSiblingsAreNotUsedAndTheFrontGetsACoreWhenThereAreThree) {
    auto m = Machine::synthetic("pack:1 core:5 pu:2");  // PUs 0..9, core k = PUs 2k, 2k+1
    ASSERT_TRUE(m.ok());
    auto p = plan_placement(*m, {});
    ASSERT_TRUE(p.ok());
    const auto& pre = role(*p, "prefill").cpus;
    const auto& dec = role(*p, "decode").cpus;
    const auto& fr = role(*p, "front").cpus;
    EXPECT_EQ(pre, (std::vector<int>{0, 2}));
    EXPECT_EQ(dec, (std::vector<int>{4, 6}));
    EXPECT_EQ(fr, std::vector<int>{8});
    EXPECT_EQ(role(*p, "prefill").threads, 2);
    for (int c : pre) EXPECT_EQ(c % 2, 0) << "one hardware thread per core";
    EXPECT_TRUE(disjoint(pre, dec) && disjoint(fr, pre) && disjoint(fr, dec));
    EXPECT_TRUE(p->notes.empty());
}

TEST(Placement, PrefillAndDecodeStayOnOneNumaNodeAndTheFrontGoesElsewhere) {
    auto m = Machine::synthetic("pack:2 numa:1 core:4 pu:1");
    ASSERT_TRUE(m.ok()) << m.error().message;
    EXPECT_EQ(m->n_numa, 2);
    auto p = plan_placement(*m, {});
    ASSERT_TRUE(p.ok());
    EXPECT_EQ(role(*p, "prefill").numa, role(*p, "decode").numa);
    EXPECT_NE(role(*p, "front").numa, role(*p, "prefill").numa);
    EXPECT_EQ(role(*p, "prefill").cpus.size() + role(*p, "decode").cpus.size(), 4u);
}

TEST(Placement, OverridesAreCheckedAndMustKeepPrefillAndDecodeApart) {
    auto m = Machine::synthetic("pack:1 core:4 pu:1");
    ASSERT_TRUE(m.ok());
    PlanOptions o;
    o.prefill_cpus = {0, 1};
    o.decode_cpus = {1, 2};
    auto bad = plan_placement(*m, o);
    ASSERT_FALSE(bad.ok());
    EXPECT_NE(bad.error().message.find("overlap at CPU 1"), std::string::npos) << bad.error().message;
    o.decode_cpus = {7};
    auto missing = plan_placement(*m, o);
    ASSERT_FALSE(missing.ok());
    EXPECT_NE(missing.error().message.find("CPU 7 is not on this machine"), std::string::npos);
    o.decode_cpus = {3};
    auto ok = plan_placement(*m, o);
    ASSERT_TRUE(ok.ok());
    EXPECT_EQ(role(*ok, "prefill").cpus, (std::vector<int>{0, 1}));
    EXPECT_EQ(role(*ok, "decode").cpus, std::vector<int>{3});
}

TEST(Placement, GpuRolesRunOnCoresCloseToTheirGpu) {
    Machine m;
    m.source = "two sockets, a GPU on each";
    m.n_numa = 2;
    for (int i = 0; i < 8; ++i) m.cores.push_back({i / 4, {i}});
    m.gpus.push_back({0, "0000:17:00.0", {0, 1, 2, 3}});
    m.gpus.push_back({1, "0000:b1:00.0", {4, 5, 6, 7}});
    PlanOptions o;
    o.devices = {1, 0};  // served in this order: pair 0 on GPU 1, pair 1 on GPU 0
    auto p = plan_placement(m, o);
    ASSERT_TRUE(p.ok()) << p.error().message;
    for (int d : {0, 1})
        for (const char* r : {"prefill", "decode"}) {
            const Placement& pl = role(*p, r, d);
            ASSERT_EQ(pl.cpus.size(), 1u);
            EXPECT_EQ(pl.numa, d) << r << " of GPU " << d << " is on CPU " << pl.cpus[0];
            EXPECT_EQ(pl.index, 1 - d) << r << " of GPU " << d << ": worker index = position in the devices served";
        }
    EXPECT_FALSE(plan_placement(m, PlanOptions{{2}, {}, {}, {}}).ok()) << "GPU 2 does not exist";
}

TEST(Placement, ThisMachineCanBePlanned) {
    auto m = Machine::detect();
    ASSERT_TRUE(m.ok()) << m.error().message;
    EXPECT_FALSE(m->cores.empty());
    auto p = plan_placement(*m, {});
    ASSERT_TRUE(p.ok()) << p.error().message;
    EXPECT_EQ(p->roles.size(), 3u);
}

TEST(Placement, CpuListFormatting) {
    EXPECT_EQ(format_cpu_list({3, 0, 1, 2, 8, 10, 11}), "0-3,8,10-11");
    EXPECT_EQ(format_cpu_list({5}), "5");
    EXPECT_EQ(format_cpu_list({}), "");
}

TEST(Placement, SeveralWorkersSplitTheCoresOfANode) {
    auto m = Machine::synthetic("pack:1 core:9 pu:1");
    ASSERT_TRUE(m.ok());
    PlanOptions o;
    o.prefill_workers = 2;
    o.decode_workers = 2;
    auto p = plan_placement(*m, o);
    ASSERT_TRUE(p.ok()) << p.error().message;
    std::vector<std::vector<int>> pre, dec;
    for (const Placement& r : p->roles) {
        if (r.role == "prefill") {
            EXPECT_EQ(r.index, static_cast<int>(pre.size()));
            pre.push_back(r.cpus);
        }
        if (r.role == "decode") {
            EXPECT_EQ(r.index, static_cast<int>(dec.size()));
            dec.push_back(r.cpus);
        }
    }
    ASSERT_EQ(pre.size(), 2u);
    ASSERT_EQ(dec.size(), 2u);
    EXPECT_EQ(role(*p, "front").cpus, std::vector<int>{8});
    std::vector<int> all = role(*p, "front").cpus;
    for (auto* v : {&pre, &dec})
        for (const auto& c : *v) {
            EXPECT_EQ(c.size(), 2u) << "8 cores, 4 workers";
            all.insert(all.end(), c.begin(), c.end());
        }
    std::sort(all.begin(), all.end());
    EXPECT_EQ(std::unique(all.begin(), all.end()), all.end()) << "no core shared";
    EXPECT_TRUE(p->notes.empty());
}

TEST(Placement, WorkerPairsSpreadOverNumaNodes) {
    auto m = Machine::synthetic("pack:2 numa:1 core:4 pu:1");
    ASSERT_TRUE(m.ok());
    PlanOptions o;
    o.prefill_workers = 2;
    o.decode_workers = 2;
    auto p = plan_placement(*m, o);
    ASSERT_TRUE(p.ok()) << p.error().message;
    int numa[2][2] = {{-1, -1}, {-1, -1}};
    for (const Placement& r : p->roles)
        if (r.role != "front") {
            for (int c : r.cpus) EXPECT_EQ(r.numa, c / 4);
            numa[r.role == "decode"][r.index] = r.numa;
        }
    EXPECT_EQ(numa[0][0], numa[1][0]) << "pair 0 on one node";
    EXPECT_EQ(numa[0][1], numa[1][1]) << "pair 1 on one node";
    EXPECT_NE(numa[0][0], numa[0][1]) << "the pairs on different nodes";
    // A role with more workers than cores shares them, and says so.
    o.prefill_workers = 3;
    o.decode_workers = 3;
    auto small = plan_placement(*Machine::synthetic("pack:1 core:2 pu:1"), o);
    ASSERT_TRUE(small.ok()) << small.error().message;
    bool noted = false;
    for (const std::string& n : small->notes) noted = noted || n.find("share cores") != std::string::npos;
    EXPECT_TRUE(noted);
    // Overrides are split among a role's workers.
    o.prefill_workers = 2;
    o.decode_workers = 1;
    o.prefill_cpus = {0, 1, 2, 3};
    o.decode_cpus = {4, 5};
    auto over = plan_placement(*m, o);
    ASSERT_TRUE(over.ok()) << over.error().message;
    EXPECT_EQ(over->roles[1].cpus, (std::vector<int>{0, 1}));
    EXPECT_EQ(over->roles[2].cpus, (std::vector<int>{2, 3}));
    EXPECT_EQ(over->roles[3].cpus, (std::vector<int>{4, 5}));
}

// Per-role arenas on GPUs: one process per GPU, prefill on the first prefill_gpus
// of the devices served (worker index = position), decode on the rest (index
// counted from the first decode GPU), each near its GPU.
TEST(Placement, PerRoleGpusRunOneProcessEach) {
    Machine m;
    m.source = "two sockets, two GPUs on each";
    m.n_numa = 2;
    for (int i = 0; i < 8; ++i) m.cores.push_back({i / 4, {i}});
    m.gpus.push_back({0, "0000:17:00.0", {0, 1, 2, 3}});
    m.gpus.push_back({1, "0000:18:00.0", {0, 1, 2, 3}});
    m.gpus.push_back({2, "0000:b1:00.0", {4, 5, 6, 7}});
    m.gpus.push_back({3, "0000:b2:00.0", {4, 5, 6, 7}});
    PlanOptions o;
    o.devices = {2, 0, 1, 3};
    o.prefill_gpus = 1;
    auto p = plan_placement(m, o);
    ASSERT_TRUE(p.ok()) << p.error().message;
    ASSERT_EQ(p->roles.size(), 5u) << "the front and one process per GPU";
    const Placement& pre = role(*p, "prefill", 2);
    EXPECT_EQ(pre.index, 0);
    EXPECT_EQ(pre.numa, 1);
    for (auto [gpu, index, node] : {std::tuple{0, 0, 0}, std::tuple{1, 1, 0}, std::tuple{3, 2, 1}}) {
        const Placement& d = role(*p, "decode", gpu);
        EXPECT_EQ(d.index, index) << "decode on GPU " << gpu;
        EXPECT_EQ(d.numa, node) << "decode on GPU " << gpu;
    }
    for (const Placement& r : p->roles)
        EXPECT_FALSE(r.role == "prefill" && r.device != 2) << "only GPU 2 runs prefill";
}

// A host arena's pages bound to NUMA nodes: node 0 (every machine has it) is
// accepted and recorded as the preferred node of the range; a node the machine
// does not have is mbind's error; no nodes, or a range without a whole aligned
// 2 MiB stretch, is nothing to do.
TEST(Placement, ArenaPagesAreBoundToTheirRolesNodes) {
    const size_t bytes = 8u << 20;
    void* mem = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    ASSERT_NE(mem, MAP_FAILED);
    ASSERT_TRUE(bind_to_nodes(mem, bytes, {0, 0}).ok());
    // The policy of a page inside the bound stretch: MPOL_PREFERRED (1) on node 0.
    const uintptr_t inside = (reinterpret_cast<uintptr_t>(mem) + (4u << 20)) & ~uintptr_t{(2u << 20) - 1};
    int mode = -1;
    unsigned long mask[16] = {};
    constexpr unsigned long kMpolFAddr = 2;  // MPOL_F_ADDR
    ASSERT_EQ(syscall(SYS_get_mempolicy, &mode, mask, 1024ul, inside, kMpolFAddr), 0) << std::strerror(errno);
    EXPECT_EQ(mode, 1);
    EXPECT_EQ(mask[0], 1ul);
    auto bad = bind_to_nodes(mem, bytes, {1000});
    ASSERT_FALSE(bad.ok()) << "node 1000 does not exist";
    EXPECT_NE(bad.error().message.find("mbind to NUMA node(s) 1000"), std::string::npos) << bad.error().message;
    EXPECT_TRUE(bind_to_nodes(mem, bytes, {}).ok());
    EXPECT_TRUE(bind_to_nodes(static_cast<char*>(mem) + 4096, (2u << 20), {1000}).ok()) << "no whole aligned stretch";
    munmap(mem, bytes);
}

// Real machines' hwloc exports (tests/fixtures/hwloc, from hwloc's own tests): the
// GPUs come from the export's PCI tree with the cores of their package, and each
// GPU's prefill/decode pair is planned on its own package's cores.
namespace {

std::string hwloc_fixture(const char* name) { return std::string(DUET_FIXTURES) + "/hwloc/" + name; }

// The NUMA node of every hardware thread in `pus`, or -1 if they span several.
int node_of(const Machine& m, const std::vector<int>& pus) {
    int node = -2;
    for (const MachineCore& c : m.cores) {
        for (int pu : c.pus) {
            if (std::find(pus.begin(), pus.end(), pu) != pus.end()) node = node == -2 || node == c.numa ? c.numa : -1;
        }
    }
    return node;
}

}  // namespace

TEST(Placement, AnNvidiaDgx2ExportHasItsSixteenGpusNearTheirPackage) {
    auto m = Machine::from_xml(hwloc_fixture("nvidiaDGX2.xml"));
    ASSERT_TRUE(m.ok()) << m.error().message;
    EXPECT_EQ(m->n_numa, 2);
    ASSERT_EQ(m->cores.size(), 4u) << "hwloc's export keeps two cores of each package";
    ASSERT_EQ(m->gpus.size(), 16u) << "16 V100s; the 12 NVSwitches (class 0x0680) are not GPUs";
    int per_node[2] = {0, 0};
    for (const MachineGpu& g : m->gpus) {
        const int node = node_of(*m, g.pus);
        ASSERT_TRUE(node == 0 || node == 1)
            << "GPU " << g.device << " (" << g.pci << ") near " << format_cpu_list(g.pus);
        ++per_node[node];
        if (g.device > 0) {
            EXPECT_LT(m->gpus[static_cast<size_t>(g.device) - 1].pci, g.pci) << "PCI bus order";
        }
    }
    EXPECT_EQ(per_node[0], 8);
    EXPECT_EQ(per_node[1], 8);
    EXPECT_EQ(m->gpus[0].pci, "0000:34:00.0");

    // All 16 GPUs served: 32 workers on 4 cores. Each worker on a core of its GPU's
    // package (shared, and said so), never across the socket link; the front on the
    // least used core.
    PlanOptions o;
    for (int d = 0; d < 16; ++d) o.devices.push_back(d);
    auto p = plan_placement(*m, o);
    ASSERT_TRUE(p.ok()) << p.error().message;
    ASSERT_EQ(p->roles.size(), 33u);
    EXPECT_EQ(p->roles.front().role, "front");
    std::map<int, int> users;
    for (const Placement& r : p->roles) {
        ASSERT_EQ(r.cpus.size(), 1u);
        ++users[r.cpus[0]];
        if (r.device < 0) continue;
        const MachineGpu& g = m->gpus[static_cast<size_t>(r.device)];
        EXPECT_EQ(r.numa, node_of(*m, g.pus)) << r.role << " of GPU " << r.device << " on CPU " << r.cpus[0];
        EXPECT_EQ(r.index, r.device) << "worker index = position in the devices served";
    }
    ASSERT_EQ(users.size(), 4u);
    for (auto [cpu, n] : users) EXPECT_LE(n, 9) << "CPU " << cpu << " carries " << n << ": spread evenly (33 on 4)";
    EXPECT_FALSE(p->notes.empty()) << "sharing is said";

    // One GPU of each package served: each pair on its own package's two cores, no
    // core given twice but the front's, which shares the least used.
    auto two = plan_placement(*m, PlanOptions{{0, 15}, {}, {}, {}});
    ASSERT_TRUE(two.ok()) << two.error().message;
    std::map<int, int> once;
    for (const Placement& r : two->roles)
        if (r.device >= 0) {
            EXPECT_EQ(++once[r.cpus[0]], 1) << "CPU " << r.cpus[0] << " given twice";
            EXPECT_EQ(r.numa, r.device == 0 ? 0 : 1);
        }
    EXPECT_EQ(once.size(), 4u);
}

TEST(Placement, APower8ExportGivesEachGpuPairCoresOfItsOwnPackageAndTheFrontACoreApart) {
    auto m = Machine::from_xml(hwloc_fixture("power8gpudistances.xml"));
    ASSERT_TRUE(m.ok()) << m.error().message;
    ASSERT_EQ(m->gpus.size(), 4u);
    ASSERT_EQ(m->cores.size(), 8u);
    auto p = plan_placement(*m, PlanOptions{{0, 1, 2, 3}, {}, {}, {}});
    ASSERT_TRUE(p.ok()) << p.error().message;
    ASSERT_EQ(p->roles.size(), 9u);
    std::map<int, int> users;
    for (const Placement& r : p->roles) {
        ++users[r.cpus[0]];
        if (r.device < 0) continue;
        EXPECT_EQ(r.numa, node_of(*m, m->gpus[static_cast<size_t>(r.device)].pus))
            << r.role << " of GPU " << r.device << " on CPU " << r.cpus[0];
    }
    // 8 workers on 8 cores, each its own; the 9th process, the front, shares one.
    EXPECT_EQ(users.size(), 8u);
    int shared = 0;
    for (auto [cpu, n] : users) shared += n > 1;
    EXPECT_EQ(shared, 1);
    EXPECT_EQ(users[p->roles.front().cpus[0]], 2) << "the front is the one that shares";
}

TEST(Placement, AnXmlThatIsNotATopologyIsRefusedByName) {
    auto m = Machine::from_xml(hwloc_fixture("README.md"));
    ASSERT_FALSE(m.ok());
    EXPECT_NE(m.error().message.find("README.md"), std::string::npos) << m.error().message;
    EXPECT_FALSE(Machine::from_xml("/nonexistent/machine.xml").ok());
}
