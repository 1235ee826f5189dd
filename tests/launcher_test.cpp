// The launcher's pure parts: parse_device_list, plan_serve over hand-made machines
// and GPUs (no model, no GPU, no processes), the launcher's state transitions, and the
// supervisor's restart and quarantine policy (roles/restart_policy.h).
#include <map>

#include <gtest/gtest.h>

#include "roles/launcher.h"
#include "roles/restart_policy.h"

using namespace duet;

namespace {

constexpr uint64_t kGiB = 1ull << 30;

// 2 layers x 1 KV head x dim 64, 16 tokens a block, f16: a tile is K and V of 16 x 64
// halves = 2 x 2048 bytes, a block 2 tiles = 8 KiB.
KvLayout small_layout() {
    KvLayout l;
    l.n_layer = 2;
    l.n_head_kv = 1;
    l.head_dim = 64;
    l.block_tokens = 16;
    return l;
}

ServeFacts cpu_facts(const char* topology = "pack:1 core:4 pu:1") {
    ServeFacts f;
    auto m = Machine::synthetic(topology);
    EXPECT_TRUE(m.ok()) << m.error().message;
    if (m) f.machine = *m;
    f.n_ctx_train = 8192;
    f.kv = small_layout();
    f.model_file_bytes = 100ull << 20;
    f.pid = 4242;
    return f;
}

// Two sockets of four cores, a GPU on each (hwloc's numbering: GPU 0 on socket 0).
ServeFacts gpu_facts(std::vector<std::pair<int, uint64_t>> gpus) {
    ServeFacts f = cpu_facts();
    Machine m;
    m.n_numa = 2;
    for (int i = 0; i < 8; ++i) m.cores.push_back({i / 4, {i}});
    m.gpus.push_back({0, "0000:17:00.0", {0, 1, 2, 3}});
    m.gpus.push_back({1, "0000:b1:00.0", {4, 5, 6, 7}});
    m.gpus.push_back({2, "0000:ca:00.0", {4, 5, 6, 7}});
    f.machine = m;
    for (auto [index, memory] : gpus) {
        GpuFacts g;
        g.device = DeviceSpec{true, index};
        g.pci = m.gpus.at(static_cast<size_t>(index)).pci;
        g.total_memory = memory;
        f.gpus.push_back(g);
    }
    f.gpu_weight_bytes = 1 * kGiB;
    return f;
}

const RoleLaunch& role(const ServePlan& p, const std::string& name) {
    for (const RoleLaunch& r : p.roles)
        if (r.name == name) return r;
    ADD_FAILURE() << "no role " << name;
    static RoleLaunch none;
    return none;
}

const WorkerSettings& worker(const ServePlan& p, const std::string& name) {
    return std::get<WorkerSettings>(role(p, name).settings);
}

}  // namespace

TEST(Launcher, DeviceListsParse) {
    auto cpu = parse_device_list("cpu", false);
    ASSERT_TRUE(cpu.ok());
    EXPECT_TRUE(cpu->empty());
    auto two = parse_device_list("cuda:0,cuda:3", false);
    ASSERT_TRUE(two.ok()) << two.error().message;
    ASSERT_EQ(two->size(), 2u);
    EXPECT_EQ((*two)[1].index, 3);
    auto twice = parse_device_list("cuda:1,cuda:1", false);
    ASSERT_FALSE(twice.ok());
    EXPECT_EQ(twice.error().message, "--device names cuda:1 twice");
    EXPECT_TRUE(parse_device_list("cuda:1,cuda:1", true).ok()) << "per-role arenas: prefill and decode on one GPU";
    auto mixed = parse_device_list("cpu,cuda:0", false);
    ASSERT_FALSE(mixed.ok());
    EXPECT_NE(mixed.error().message.find("not both"), std::string::npos) << mixed.error().message;
    EXPECT_FALSE(parse_device_list("gpu0", false).ok());
}

TEST(Launcher, CpuPlanStartsWorkersThenTheFrontWithTheirSettings) {
    ServeSettings s;
    s.model = "/models/m.gguf";
    s.port = 9000;
    s.ctx = 1024;
    s.slots = 8;
    s.prefill_budget = 128;
    s.prefix_cache = false;
    s.risk_claims = false;
    s.pass_interrupt = false;
    s.isa = "avx2";
    s.chat_template = "chatml";
    auto p = plan_serve(s, cpu_facts());
    ASSERT_TRUE(p.ok()) << p.error().message;
    ASSERT_EQ(p->roles.size(), 3u);
    EXPECT_EQ(p->roles[0].role, "prefill");
    EXPECT_EQ(p->roles[1].role, "decode");
    EXPECT_EQ(p->roles[2].role, "front") << "the front starts last";
    EXPECT_EQ(p->layout.instance, "serve-4242");
    EXPECT_EQ(p->layout.n_requests, 8u);
    EXPECT_EQ(p->layout.n_ctx, 1024);
    EXPECT_EQ(p->layout.n_prefill, 1u);
    EXPECT_EQ(p->layout.n_decode, 1u);
    EXPECT_EQ(p->layout.n_gpus, 0u);
    EXPECT_EQ(p->layout.n_blocks, 0u) << "CPU: the instance sizes its host arena";
    EXPECT_FALSE(p->bind_arenas);
    EXPECT_EQ(p->start_timeout_s, 60) << "100 MiB of model: 60 s + 10 s per GiB, rounded down";

    const WorkerSettings& pf = worker(*p, "prefill");
    EXPECT_EQ(pf.instance, "serve-4242");
    EXPECT_EQ(pf.model, "/models/m.gguf");
    EXPECT_EQ(pf.device, "cpu");
    EXPECT_EQ(pf.isa, "avx2");
    EXPECT_EQ(pf.prefill_budget, 128);
    EXPECT_FALSE(pf.prefix_cache);
    EXPECT_FALSE(pf.risk_claims);
    EXPECT_FALSE(pf.pass_interrupt);
    EXPECT_EQ(pf.threads, static_cast<int>(role(*p, "prefill").cpus.size()));
    EXPECT_FALSE(pf.cpus.empty());
    const WorkerSettings& dc = worker(*p, "decode");
    EXPECT_EQ(dc.prefill_budget, WorkerSettings{}.prefill_budget) << "prefill's settings are not decode's";
    EXPECT_FALSE(dc.prefix_cache) << "--no-prefix-cache: decode publishes no finished answers either";
    EXPECT_TRUE(dc.risk_claims);
    EXPECT_TRUE(dc.pass_interrupt);
    // Prefill and decode on cores of their own.
    for (int c : role(*p, "prefill").cpus)
        for (int d : role(*p, "decode").cpus) EXPECT_NE(c, d);

    const auto& fr = std::get<FrontSettings>(role(*p, "front").settings);
    EXPECT_EQ(fr.instance, "serve-4242");
    EXPECT_EQ(fr.port, 9000);
    EXPECT_EQ(fr.host, "127.0.0.1");
    EXPECT_EQ(fr.chat_template, "chatml");
    EXPECT_NE(p->placed.find("prefill on CPUs "), std::string::npos) << p->placed;
}

// --lend-cores: each role borrows the other's cores (one worker of each, CPU);
// --max-batch reaches decode only (role_flags_test: both survive the argv). Several workers of a role:
// no lending.
TEST(Launcher, LentCoresAreTheOtherRolesAndReachTheWorkersFlags) {
    ServeSettings s;
    s.model = "/models/m.gguf";
    EXPECT_TRUE(s.lend_cores);  // the default
    s.max_batch = 7;
    auto p = plan_serve(s, cpu_facts());
    ASSERT_TRUE(p.ok()) << p.error().message;
    const WorkerSettings& pf = worker(*p, "prefill");
    const WorkerSettings& dc = worker(*p, "decode");
    EXPECT_EQ(pf.borrow_cpus, dc.cpus);
    EXPECT_EQ(dc.borrow_cpus, pf.cpus);
    EXPECT_FALSE(pf.borrow_cpus.empty());
    EXPECT_EQ(dc.max_batch, 7);
    EXPECT_EQ(pf.max_batch, WorkerSettings{}.max_batch);
    s.lend_cores = false;
    auto q = plan_serve(s, cpu_facts());
    ASSERT_TRUE(q.ok());
    EXPECT_TRUE(worker(*q, "decode").borrow_cpus.empty());
    // Several workers of a role: prefill i and decode i lend each other their CPUs;
    // a worker without a partner of its index lends and borrows nothing.
    s.lend_cores = true;
    s.prefill_workers = 1;
    s.decode_workers = 2;
    auto r = plan_serve(s, cpu_facts("pack:1 core:6 pu:1"));
    ASSERT_TRUE(r.ok()) << r.error().message;
    std::map<std::pair<std::string, uint32_t>, const WorkerSettings*> w;
    for (const RoleLaunch& l : r->roles)
        if (const auto* ws = std::get_if<WorkerSettings>(&l.settings)) w[{l.role, ws->index}] = ws;
    const auto W = [&](const char* role, uint32_t i) { return w.at({role, i}); };
    ASSERT_EQ(w.size(), 3u);
    EXPECT_EQ(W("prefill", 0)->borrow_cpus, W("decode", 0)->cpus);
    EXPECT_EQ(W("decode", 0)->borrow_cpus, W("prefill", 0)->cpus);
    EXPECT_TRUE(W("decode", 1)->borrow_cpus.empty());
    s.prefill_workers = 2;
    auto t = plan_serve(s, cpu_facts("pack:1 core:8 pu:1"));
    ASSERT_TRUE(t.ok()) << t.error().message;
    w.clear();
    for (const RoleLaunch& l : t->roles)
        if (const auto* ws = std::get_if<WorkerSettings>(&l.settings)) w[{l.role, ws->index}] = ws;
    ASSERT_EQ(w.size(), 4u);
    for (uint32_t i : {0u, 1u}) {
        EXPECT_EQ(W("prefill", i)->borrow_cpus, W("decode", i)->cpus) << i;
        EXPECT_EQ(W("decode", i)->borrow_cpus, W("prefill", i)->cpus) << i;
        EXPECT_FALSE(W("prefill", i)->borrow_cpus.empty()) << i;
    }
    EXPECT_NE(W("prefill", 0)->borrow_cpus, W("prefill", 1)->borrow_cpus);
}

// A CPU that another compute worker also runs on is not lent: the borrower watches
// only its partner's load (WorkerBase::borrow_cores).
TEST(Launcher, ACpuSharedWithAThirdWorkerIsNotLent) {
    Plan placed;
    placed.roles = {{"front", 0, -1, {0}, 1, 0},   {"prefill", 0, -1, {0, 1}, 2, 0},
                    {"decode", 0, -1, {2, 3}, 2, 0}, {"decode", 1, -1, {3}, 1, 0}};
    EXPECT_EQ(lent_cpus(placed, placed.roles[1]), (std::vector<int>{2}));     // 3 is decode 1's too
    EXPECT_EQ(lent_cpus(placed, placed.roles[2]), (std::vector<int>{0, 1}));  // the front does not compute
    EXPECT_TRUE(lent_cpus(placed, placed.roles[3]).empty());                  // no prefill 1
    EXPECT_TRUE(lent_cpus(placed, placed.roles[0]).empty());
}

TEST(Launcher, SeveralWorkersAreNamedByIndexAndPerRoleArenasAreBoundOnNumaMachines) {
    ServeSettings s;
    s.instance = "mine";
    s.prefill_workers = 2;
    s.decode_workers = 2;
    s.kv_arenas = "per-role";
    s.start_timeout_s = 7;
    auto p = plan_serve(s, cpu_facts("pack:2 numa:1 core:4 pu:1"));
    ASSERT_TRUE(p.ok()) << p.error().message;
    EXPECT_EQ(p->layout.instance, "mine");
    EXPECT_TRUE(p->layout.kv_split);
    EXPECT_TRUE(p->bind_arenas) << "two NUMA nodes, per-role arenas";
    EXPECT_EQ(p->start_timeout_s, 7);
    EXPECT_EQ(worker(*p, "prefill 0").index, 0u);
    EXPECT_EQ(worker(*p, "prefill 1").index, 1u);
    EXPECT_EQ(worker(*p, "decode 1").index, 1u);
    EXPECT_EQ(role(*p, "decode 1").numa, 1) << "worker i of each role on node i mod nodes";
    auto one_node = plan_serve(s, cpu_facts("pack:1 core:8 pu:1"));
    ASSERT_TRUE(one_node.ok()) << one_node.error().message;
    EXPECT_FALSE(one_node->bind_arenas) << "one node: nothing to bind";
}

TEST(Launcher, BadSettingsAreRefusedByName) {
    auto refused = [](ServeSettings s, ServeFacts f, const std::string& needle) {
        auto p = plan_serve(s, f);
        ASSERT_FALSE(p.ok()) << "accepted, expected an error with " << needle;
        EXPECT_NE(p.error().message.find(needle), std::string::npos) << p.error().message;
    };
    ServeSettings s;
    s.kv_arenas = "both";
    refused(s, cpu_facts(), "--kv-arenas both");
    s = {};
    s.ctx = 8;
    refused(s, cpu_facts(), "--ctx must be between 16 and the model's 8192 tokens");
    s.ctx = 8193;
    refused(s, cpu_facts(), "--ctx");
    s = {};
    s.kv_dtype = "f32";
    refused(s, cpu_facts(), "--kv-dtype");
    s = {};
    s.prefill_cpus = "0-1";
    s.decode_cpus = "1-2";
    refused(s, cpu_facts(), "");  // overlapping overrides (plan_placement says how)
    s = {};
    s.prefill_workers = 2;
    refused(s, gpu_facts({{0, 80 * kGiB}}), "--prefill-workers / --decode-workers");
    s = {};
    s.prefill_cpus = "0";
    refused(s, gpu_facts({{0, 80 * kGiB}}), "--prefill-cpus and --decode-cpus place CPU workers");
    s = {};
    s.kv_arenas = "per-role";
    refused(s, gpu_facts({{0, 80 * kGiB}}), "--kv-arenas per-role on 1 GPUs");
    s = {};
    s.kv_memory = 0.1;
    refused(s, gpu_facts({{0, 8 * kGiB}}), "cuda:0: no room for KV");
}

// --mps (roles/mps.h) is for a GPU's processes: refused on the CPU, planned on GPUs
// with nothing else changed (the launcher starts the daemon, not the plan).
TEST(Launcher, MpsIsForGpus) {
    ServeSettings s;
    s.mps = true;
    auto cpu = plan_serve(s, cpu_facts());
    ASSERT_FALSE(cpu.ok());
    EXPECT_NE(cpu.error().message.find("--mps: CUDA MPS shares a GPU"), std::string::npos) << cpu.error().message;
    auto gpu = plan_serve(s, gpu_facts({{0, 80 * kGiB}}));
    ASSERT_TRUE(gpu.ok()) << gpu.error().message;
    s.mps = false;
    auto plain = plan_serve(s, gpu_facts({{0, 80 * kGiB}}));
    ASSERT_TRUE(plain.ok());
    EXPECT_EQ(gpu->roles.size(), plain->roles.size());
}

// --rebalance: the layout gets spare indices (ServeLayout::rebalance); only where a
// worker can take another's cores in the other role.
TEST(Launcher, RebalanceNeedsThreeCpuWorkersAndOneArena) {
    ServeSettings s;
    s.prefill_workers = 2;
    s.rebalance_s = 5;
    auto p = plan_serve(s, cpu_facts());
    ASSERT_TRUE(p.ok()) << p.error().message;
    EXPECT_TRUE(p->layout.rebalance);
    EXPECT_EQ(p->layout.n_prefill, 2u);
    EXPECT_EQ(p->roles.size(), 4u) << "the workers it starts: two prefill, one decode, and the front";
    s.rebalance_s = 0;
    EXPECT_FALSE(plan_serve(s, cpu_facts())->layout.rebalance);
    auto refused = [](ServeSettings s, ServeFacts f, const std::string& why) {
        auto p = plan_serve(s, f);
        ASSERT_FALSE(p.ok()) << why;
        EXPECT_NE(p.error().message.find("--rebalance" + why), std::string::npos) << p.error().message;
    };
    s = {};
    s.rebalance_s = 5;
    refused(s, cpu_facts(), ": three workers or more");  // one worker of each role: nothing to move
    s.prefill_workers = 2;
    ASSERT_TRUE(plan_serve(s, cpu_facts()).ok());
    s.kv_arenas = "per-role";
    refused(s, cpu_facts(), ": workers change role with one shared KV arena only");
    s = {};
    s.rebalance_s = 5;
    refused(s, gpu_facts({{0, 80 * kGiB}, {1, 80 * kGiB}}), ": workers change role on CPU serving only");
    s.rebalance_s = -1;
    refused(s, cpu_facts(), " -1: seconds");
}

// Contexts on GPUs: the front's store keeps them in GPU 0's arena, their requests
// bound to GPU 0's pair (RequestParams::arena), so any number of GPU pairs serve with
// them; per-role GPU arenas are refused, by name (a completion's KV would come back
// in a decode GPU's arena).
TEST(Launcher, ContextsTakeGpuZerosArena) {
    ServeSettings s;
    s.contexts_dir = "/tmp/ctx";
    for (size_t n : {1, 2, 3}) {  // gpu_facts' machine has 3 GPUs
        std::vector<std::pair<int, uint64_t>> gpus;
        for (size_t g = 0; g < n; ++g) gpus.push_back({static_cast<int>(g), 80 * kGiB});
        auto p = plan_serve(s, gpu_facts(gpus));
        ASSERT_TRUE(p.ok()) << n << " GPUs: " << p.error().message;
        EXPECT_TRUE(p->layout.contexts);
        EXPECT_EQ(p->layout.n_gpus, n);
        EXPECT_FALSE(p->layout.kv_split);
    }
    s.kv_arenas = "per-role";
    s.prefill_workers = 1;
    auto q = plan_serve(s, gpu_facts({{0, 80 * kGiB}, {1, 80 * kGiB}}));
    ASSERT_FALSE(q.ok());
    EXPECT_NE(q.error().message.find("--contexts-dir: contexts on GPUs need each GPU's roles to share its KV arena"),
              std::string::npos)
        << q.error().message;
}

TEST(Launcher, GpuPairsGetTheirGpuAndTheSmallestGpuSizesEveryArena) {
    ServeSettings s;
    s.kv_memory = 0.5;
    s.cuda_qgemv = true;
    // GPU 1 (16 GiB) and GPU 0 (8 GiB): 8 GiB x 0.5 - 1 GiB weights - 2 GiB scratch =
    // 1 GiB of KV = 131072 blocks of 8 KiB; GPU 1 alone would hold 5 GiB.
    auto p = plan_serve(s, gpu_facts({{1, 16 * kGiB}, {0, 8 * kGiB}}));
    ASSERT_TRUE(p.ok()) << p.error().message;
    EXPECT_EQ(p->layout.n_gpus, 2u);
    EXPECT_EQ(p->layout.n_prefill, 2u);
    EXPECT_EQ(p->layout.n_decode, 2u);
    EXPECT_EQ(p->layout.n_blocks, 131072u);
    EXPECT_EQ(worker(*p, "prefill 0").device, "cuda:1") << "pair i on the i-th GPU listed";
    EXPECT_EQ(worker(*p, "decode 0").device, "cuda:1");
    EXPECT_EQ(worker(*p, "prefill 1").device, "cuda:0");
    EXPECT_EQ(worker(*p, "decode 1").device, "cuda:0");
    EXPECT_TRUE(worker(*p, "decode 1").cuda_qgemv);
    EXPECT_EQ(role(*p, "prefill 0").numa, 1) << "on cores close to GPU 1 (socket 1)";
    EXPECT_EQ(role(*p, "decode 1").numa, 0);
    EXPECT_TRUE(p->gpu_note.empty()) << p->gpu_note;
    // --kv-blocks caps a GPU arena (a small one shows preemption and swap); past what
    // --kv-memory leaves, it is that.
    s.kv_blocks = 64;
    p = plan_serve(s, gpu_facts({{1, 16 * kGiB}, {0, 8 * kGiB}}));
    ASSERT_TRUE(p.ok()) << p.error().message;
    EXPECT_EQ(p->layout.n_blocks, 64u);
    s.kv_blocks = 1 << 20;
    p = plan_serve(s, gpu_facts({{1, 16 * kGiB}, {0, 8 * kGiB}}));
    ASSERT_TRUE(p.ok()) << p.error().message;
    EXPECT_EQ(p->layout.n_blocks, 131072u);
}

TEST(Launcher, PerRoleGpusPutPrefillFirstAndDecodeOnTheRest) {
    ServeSettings s;
    s.kv_arenas = "per-role";
    s.kv_memory = 0.5;
    auto p = plan_serve(s, gpu_facts({{0, 16 * kGiB}, {1, 16 * kGiB}, {2, 16 * kGiB}}));
    ASSERT_TRUE(p.ok()) << p.error().message;
    EXPECT_EQ(p->layout.n_prefill, 1u);
    EXPECT_EQ(p->layout.n_decode, 2u);
    EXPECT_EQ(worker(*p, "prefill").device, "cuda:0");
    EXPECT_EQ(worker(*p, "decode 0").device, "cuda:1");
    EXPECT_EQ(worker(*p, "decode 1").device, "cuda:2");
    // 16 GiB x 0.5 - 1 GiB - (2 GiB + 512 MiB for the one prefill process) = 4.5 GiB.
    EXPECT_EQ(p->layout.n_blocks, static_cast<uint32_t>((4 * kGiB + kGiB / 2) / 8192));

    // One GPU named twice: prefill and decode on it with an arena each, each planned
    // in half of it: 8 GiB x 0.5 - 1 GiB - 2.5 GiB = 0.5 GiB.
    auto same = plan_serve(s, gpu_facts({{0, 16 * kGiB}, {0, 16 * kGiB}}));
    ASSERT_TRUE(same.ok()) << same.error().message;
    EXPECT_EQ(same->layout.n_blocks, static_cast<uint32_t>(kGiB / 2 / 8192));
    EXPECT_EQ(worker(*same, "prefill").device, "cuda:0");
    EXPECT_EQ(worker(*same, "decode").device, "cuda:0");
}

TEST(Launcher, AGpuMissingFromThePciBusIsPlacedAsForTheCpu) {
    ServeFacts f = gpu_facts({{0, 16 * kGiB}});
    f.gpus[0].pci = "0000:99:00.0";
    auto p = plan_serve(ServeSettings{}, f);
    ASSERT_TRUE(p.ok()) << p.error().message;
    EXPECT_NE(p->gpu_note.find("cuda:0 at PCI address '0000:99:00.0' not found"), std::string::npos) << p->gpu_note;
    EXPECT_EQ(worker(*p, "prefill").device, "cuda:0") << "it still computes on its GPU";
}

TEST(Launcher, StatesGoStartingServingDrainingDone) {
    using S = LaunchState;
    LaunchInputs in;
    in.now_ns = 100;
    in.start_deadline_ns = 1000;

    LaunchStep st = launch_step(S::Starting, in);  // nothing up yet
    EXPECT_EQ(st.next, S::Starting);
    EXPECT_FALSE(st.announce || st.retire_front || st.kill_front || st.start_timed_out);

    in.all_running = true;
    st = launch_step(S::Starting, in);
    EXPECT_EQ(st.next, S::Serving);
    EXPECT_TRUE(st.announce);
    EXPECT_FALSE(st.retire_front);

    st = launch_step(S::Serving, in);
    EXPECT_EQ(st.next, S::Serving);
    EXPECT_FALSE(st.announce) << "announced once";

    in.stop = true;
    st = launch_step(S::Serving, in);
    EXPECT_EQ(st.next, S::Draining);
    EXPECT_TRUE(st.retire_front);

    st = launch_step(S::Starting, in);  // up and stopped in the same turn
    EXPECT_EQ(st.next, S::Draining);
    EXPECT_TRUE(st.announce);
    EXPECT_TRUE(st.retire_front);

    in.drain_deadline_ns = 500;
    st = launch_step(S::Draining, in);
    EXPECT_EQ(st.next, S::Draining);
    EXPECT_FALSE(st.retire_front) << "retired once";
    EXPECT_FALSE(st.kill_front) << "within its drain";
    in.now_ns = 501;
    st = launch_step(S::Draining, in);
    EXPECT_TRUE(st.kill_front);
    in.front_killed = true;
    EXPECT_FALSE(launch_step(S::Draining, in).kill_front) << "killed once";
    in.front_exited = true;
    EXPECT_EQ(launch_step(S::Draining, in).next, S::Done);
    EXPECT_EQ(launch_step(S::Done, in).next, S::Done);
}

TEST(Launcher, RolesThatDoNotStartInTimeFailTheLaunch) {
    LaunchInputs in;
    in.start_deadline_ns = 1000;
    in.now_ns = 1001;
    LaunchStep st = launch_step(LaunchState::Starting, in);
    EXPECT_TRUE(st.start_timed_out);
    EXPECT_EQ(st.next, LaunchState::Draining);
    EXPECT_TRUE(st.retire_front);
    in.stop = true;  // already stopping: a drain, not a time-out
    st = launch_step(LaunchState::Starting, in);
    EXPECT_FALSE(st.start_timed_out);
    EXPECT_EQ(st.next, LaunchState::Draining);
    in.stop = false;
    in.all_running = true;  // up at the deadline: serving
    EXPECT_EQ(launch_step(LaunchState::Starting, in).next, LaunchState::Serving);
    EXPECT_STREQ(launch_state_name(LaunchState::Draining), "draining");
}

TEST(Launcher, EachGpuIsCheckedAsTheListIsRead) {
    std::vector<int> asked;
    auto check = [&](const DeviceSpec& d) -> Status {
        asked.push_back(d.index);
        if (d.index == 99) return make_error("cuda:99: no such device");
        return {};
    };
    auto r = parse_device_list("cuda:0,cuda:99,cpu", false, check);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.error().message, "cuda:99: no such device") << "the first error in the list, before the cpu entry's";
    EXPECT_EQ(asked, (std::vector<int>{0, 99}));
}

namespace {

constexpr uint64_t kSec = 1'000'000'000ull;

// Deaths at the given seconds (after it had run, unless told); the last plan.
RestartPlan deaths_at(const std::vector<double>& seconds, bool had_run = true) {
    RestartPlan p;
    for (double t : seconds) p = plan_restart(p.deaths, static_cast<uint64_t>(t * 1e9) + 1000 * kSec, had_run, false);
    return p;
}

}  // namespace

TEST(RestartPolicy, ABurstOfDeathsOfARoleThatRunsIsNeverGivenUpOn) {
    // The first three deaths within a minute restart at once; later ones after a
    // backoff that doubles from 0.25 s to at most 8 s; never given up on.
    EXPECT_EQ(deaths_at({0}).kind, RestartPlan::Kind::Now);
    EXPECT_EQ(deaths_at({0, 1, 2}).kind, RestartPlan::Kind::Now);
    std::vector<double> t;
    const uint64_t want_ms[] = {0, 0, 0, 250, 500, 1000, 2000, 4000, 8000, 8000, 8000};
    for (size_t i = 0; i < std::size(want_ms); ++i) {
        t.push_back(0.1 * static_cast<double>(i));
        const RestartPlan p = deaths_at(t);
        const uint64_t now = static_cast<uint64_t>(t.back() * 1e9) + 1000 * kSec;
        if (want_ms[i] == 0) {
            EXPECT_EQ(p.kind, RestartPlan::Kind::Now) << "death " << i + 1;
        } else {
            ASSERT_EQ(p.kind, RestartPlan::Kind::Later) << "death " << i + 1;
            EXPECT_EQ(p.at_ns - now, want_ms[i] * 1'000'000ull) << "death " << i + 1;
        }
    }
    for (int n = 12; n < 200; ++n) t.push_back(0.1 * n);
    EXPECT_EQ(deaths_at(t).kind, RestartPlan::Kind::Later);
}

TEST(RestartPolicy, DeathsOlderThanTheWindowAreForgotten) {
    // Five deaths, but the first four more than 60 s before the fifth: at once.
    EXPECT_EQ(deaths_at({0, 1, 2, 3}).kind, RestartPlan::Kind::Later);
    const RestartPlan p = deaths_at({0, 1, 2, 3, 64});
    EXPECT_EQ(p.kind, RestartPlan::Kind::Now);
    EXPECT_EQ(p.deaths.deaths_ns.size(), 1u);
}

TEST(RestartPolicy, OnlyARoleThatCannotStartIsGivenUpOn) {
    // Five deaths in a row before it ever ran (it cannot bind its port).
    for (int n = 1; n < 5; ++n) {
        std::vector<double> t;
        for (int i = 0; i < n; ++i) t.push_back(i);
        EXPECT_NE(deaths_at(t, false).kind, RestartPlan::Kind::Never) << n;
    }
    const RestartPlan p = deaths_at({0, 1, 2, 3, 4}, false);
    EXPECT_EQ(p.kind, RestartPlan::Kind::Never);
    EXPECT_NE(p.why.find("5 times in a row before it could serve"), std::string::npos) << p.why;
    // A start that got as far as running in between clears the count.
    RestartPlan q;
    for (int i = 0; i < 12; ++i)
        q = plan_restart(q.deaths, (1000 + static_cast<uint64_t>(i) * 100) * kSec, i % 4 == 3, false);
    EXPECT_NE(q.kind, RestartPlan::Kind::Never);
    EXPECT_EQ(q.deaths.failed_starts, 0u);
}

TEST(RestartPolicy, AFailedGoldenCheckIsNeverRestarted) {
    const RestartPlan p = plan_restart({}, 1000 * kSec, true, true);
    EXPECT_EQ(p.kind, RestartPlan::Kind::Never);
    EXPECT_NE(p.why.find("golden"), std::string::npos);
}

TEST(RestartPolicy, ARequestIsQuarantinedOnlyWhenDeathsFollowIt) {
    // Three deaths in a row with no new output: quarantined at the third.
    RequestDeaths d;
    d = count_request_death(d, 5);
    EXPECT_FALSE(quarantined(d));
    d = count_request_death(d, 5);
    EXPECT_FALSE(quarantined(d));
    d = count_request_death(d, 5);
    EXPECT_TRUE(quarantined(d));
    // A request that progressed between deaths is a bystander: any number of deaths.
    RequestDeaths b;
    for (uint32_t i = 0; i < 50; ++i) {
        b = count_request_death(b, 10 + i);
        EXPECT_FALSE(quarantined(b)) << i;
    }
    // Progress once resets the count; then three more deaths without progress.
    RequestDeaths c = count_request_death(count_request_death({}, 3), 3);
    c = count_request_death(c, 4);
    EXPECT_EQ(c.deaths, 1u);
    c = count_request_death(count_request_death(c, 4), 4);
    EXPECT_TRUE(quarantined(c));
}
