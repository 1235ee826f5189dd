// Prefill and decode as separate processes over one shm instance, on the real
// model, with this test as the front: greedy outputs equal the single-process
// engine's (duet run's path) token for token, several requests are decoded in one
// batch, and a SIGKILLed decode or prefill worker loses nothing — its requests are
// re-driven from prompt + tokens already produced and finish with exactly the same
// tokens — and every KV block is free again at the end.
#include <signal.h>

#include <filesystem>
#include <thread>

#include <gtest/gtest.h>

#include "engine/engine.h"
#include "engine/scheduling.h"
#include "roles/supervisor.h"
#include "roles/worker_stats.h"
#include "roles/workers.h"
#include "shm_test_util.h"
#include "time_scale.h"

using namespace duet;
using namespace duet::shm::testing;

namespace {

// Polls every step_us until done() holds or limit_ms (widened by DUET_TIME_SCALE:
// the sanitizer runs on a loaded 2-core machine) passed; whether it held.
template <typename F>
bool poll_until(F done, uint64_t limit_ms, useconds_t step_us = 500) {
    const uint64_t until = shm::monotonic_ns() + test_time::scaled_ns(limit_ms * 1'000'000);
    while (!done()) {
        if (shm::monotonic_ns() >= until) return false;
        usleep(step_us);
    }
    return true;
}

const std::vector<std::string> kPrompts = {
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    // Long enough for several KV blocks and several prefill chunks.
    "Shared memory lets two processes on one machine read and write the same pages without copying. "
    "A ring buffer with one producer and one consumer needs no locks: the producer writes a record, then "
    "publishes its index with a release store, and the consumer reads the index with an acquire load. "
    "In an inference server this means that",
};
constexpr size_t kLong = 4;  // index of the long prompt
constexpr uint32_t kMaxTokens = 24;

struct Flags {
    std::atomic<bool> stop;
};

struct Serving {
    std::unique_ptr<Model> model;
    shm::InstanceConfig cfg;
    shm::Instance inst;
    SegmentGuard flags_guard{unique_name("srvflags")};
    shm::Segment flags_seg;
    Flags* flags = nullptr;
    shm::ProcRef front;
    std::unique_ptr<PrefillRouter> router;

    void start(uint32_t n_prefill = 1, uint32_t n_decode = 1, bool kv_split = false, uint32_t n_blocks = 0) {
        auto m = Model::load(DUET_MODEL_PATH);
        ASSERT_TRUE(m.ok()) << m.error().message;
        model = std::move(m).value();
        ServeLayout l;
        l.instance = unique_name("serve");
        l.n_requests = 8;
        l.n_ctx = 256;
        l.n_prefill = n_prefill;
        l.n_decode = n_decode;
        l.kv_split = kv_split;
        l.n_blocks = n_blocks;
        cfg = serve_instance_config(l, *model);
        auto in = shm::Instance::create(cfg);
        ASSERT_TRUE(in.ok()) << in.error().message;
        inst = std::move(*in);
        shm::SegmentOptions o;
        o.payload_bytes = 4096;
        auto f = shm::Segment::create(flags_guard.name, o);
        ASSERT_TRUE(f.ok());
        flags_seg = std::move(*f);
        flags = new (flags_seg.payload()) Flags{};
        auto fr = inst.registry().claim(shm::Role::Front, -1, getpid());
        ASSERT_TRUE(fr.ok());
        front = *fr;
        inst.registry().set_running(front);
        router = std::make_unique<PrefillRouter>(inst, /*redrive=*/false);
    }
    ~Serving() { shm::Instance::unlink(cfg.name); }

    pid_t spawn(bool prefill, int cpu, WorkerOptions o = {}) {
        return fork_run([this, prefill, cpu, o]() mutable {
            o.threads = 1;
            o.cpus = {cpu};
            o.isa = cpu::isa_best();
            std::unique_ptr<WorkerBase> w;
            if (prefill) {
                auto p = PrefillWorker::create(inst, *model, o);
                if (!p) return 2;
                w = std::move(*p);
            } else {
                auto d = DecodeWorker::create(inst, *model, o);
                if (!d) return 2;
                w = std::move(*d);
            }
            return w->run(flags->stop).ok() ? 0 : 1;
        });
    }

    void send(shm::ReqRef r) { EXPECT_TRUE(router->send(r)); }

    // A greedy request, sent to prefill.
    shm::ReqRef submit(const std::vector<int32_t>& prompt, uint32_t max_tokens = kMaxTokens, bool stop_at_eog = true,
                       SloClass cls = SloClass::Standard) {
        RequestParams p;
        p.slo_class = cls;
        p.sampling.temperature = 0.0f;
        p.max_tokens = max_tokens;
        p.stop_at_eog = stop_at_eog ? 1 : 0;
        auto r = inst.requests().submit(front, prompt.data(), static_cast<uint32_t>(prompt.size()), &p, sizeof p);
        EXPECT_TRUE(r.ok()) << r.error().message;
        send(*r);
        return *r;
    }

    bool ended(shm::ReqRef r) {
        const shm::RequestTable& t = inst.requests();
        return t.is(r, shm::ReqState::Finished) || t.is(r, shm::ReqState::Failed) || t.is(r, shm::ReqState::Cancelled);
    }

    std::vector<int32_t> output(shm::ReqRef r) {
        std::vector<int32_t> out;
        (void)inst.requests().read_output(r, 0, out);
        return out;
    }

    // Waits until r is FINISHED (60 s at most), returns its output and frees the slot.
    std::vector<int32_t> collect(shm::ReqRef r) {
        shm::RequestTable& t = inst.requests();
        for (int i = 0; i < 60000 && !t.is(r, shm::ReqState::Finished); ++i) {
            if (t.is(r, shm::ReqState::Failed)) break;
            usleep(1000);
        }
        std::vector<int32_t> out;
        EXPECT_TRUE(t.is(r, shm::ReqState::Finished)) << "request " << r.slot << " is " << shm::req_state_name(t.state(r.slot));
        (void)t.read_output(r, 0, out);
        EXPECT_TRUE(t.transition(r, shm::ReqState::Finished, shm::ReqState::Free));
        return out;
    }

    // What the front does when a worker dies.
    uint32_t recover(pid_t pid) {
        uint32_t redriven = 0;
        shm::Registry& reg = inst.registry();
        for (uint32_t s = 0; s < reg.n_slots(); ++s)
            if (reg.pid(s) == pid && reg.state(s) != shm::ProcState::Free) {
                auto rep = inst.recover(reg.current(s), front, true);
                EXPECT_TRUE(rep.ok()) << rep.error().message;
                if (rep.ok()) redriven += rep->redriven;
            }
        for (uint32_t s = 0; s < inst.requests().n_slots(); ++s)
            if (inst.requests().state(s) == shm::ReqState::Queued) send(inst.requests().current(s));
        return redriven;
    }
};

// The single-process engine's greedy outputs (duet run's path), computed once; the
// engine's threads are gone when this returns.
void engine_reference(std::vector<std::vector<int32_t>>& prompts, std::vector<std::vector<int32_t>>& want) {
    static std::vector<std::vector<int32_t>> p0, w0;
    if (p0.empty()) {
        EngineOptions eo;
        eo.model_path = DUET_MODEL_PATH;
        eo.threads = 1;
        eo.n_ctx = 256;
        auto e = Engine::create(eo);
        ASSERT_TRUE(e.ok()) << e.error().message;
        for (const std::string& text : kPrompts) {
            p0.push_back((*e)->tokenizer().encode(text, true, false));
            GenerateOptions g;
            g.max_tokens = kMaxTokens;
            g.sampling.temperature = 0.0f;
            std::vector<int32_t> out;
            ASSERT_TRUE((*e)->generate(p0.back(), g, [&](int32_t id) {
                out.push_back(id);
                return true;
            }).ok());
            w0.push_back(out);
        }
    }
    prompts = p0;
    want = w0;
}

// The single-process engine's greedy continuation of each (prompt, max_tokens), not
// stopped at end of generation.
std::vector<std::vector<int32_t>> engine_greedy(const std::vector<std::pair<std::vector<int32_t>, uint32_t>>& runs) {
    std::vector<std::vector<int32_t>> out(runs.size());
    EngineOptions eo;
    eo.model_path = DUET_MODEL_PATH;
    eo.threads = 1;
    eo.n_ctx = 256;
    auto e = Engine::create(eo);
    if (!e) {
        ADD_FAILURE() << e.error().message;
        return out;
    }
    for (size_t i = 0; i < runs.size(); ++i) {
        GenerateOptions g;
        g.max_tokens = runs[i].second;
        g.sampling.temperature = 0.0f;
        g.stop_at_eog = false;
        EXPECT_TRUE((*e)->generate(runs[i].first, g, [&](int32_t id) {
            out[i].push_back(id);
            return true;
        }).ok());
    }
    return out;
}

// A prefill and a decode worker in this process, stepped by hand: the test chooses
// the interleaving.
struct SteppedWorkers {
    std::unique_ptr<PrefillWorker> prefill;
    std::unique_ptr<DecodeWorker> decode;

    void start(Serving& sv, WorkerOptions o) {
        o.threads = 1;
        o.isa = cpu::isa_best();
        auto pw = PrefillWorker::create(sv.inst, *sv.model, o);
        ASSERT_TRUE(pw.ok()) << pw.error().message;
        prefill = std::move(pw).value();
        auto dw = DecodeWorker::create(sv.inst, *sv.model, o);
        ASSERT_TRUE(dw.ok()) << dw.error().message;
        decode = std::move(dw).value();
    }
    void step() {
        ASSERT_TRUE(prefill->step().ok());
        ASSERT_TRUE(decode->step().ok());
    }
    // After the requests were freed: a few more steps (prefill settles its hand-offs),
    // then both stop; no block is held.
    void stop_and_check_arena(Serving& sv) {
        for (int k = 0; k < 10; ++k) step();
        prefill.reset();
        decode.reset();
        const shm::ArenaCensus c = sv.inst.arena(0).census();
        EXPECT_EQ(c.held, 0u);
        EXPECT_EQ(c.free + c.cached, c.total);
    }
};

}  // namespace

TEST(Serving, PrefillAndDecodeProcessesMatchTheEngineAndSurviveKills) {
    Serving sv;
    sv.start();
    if (::testing::Test::HasFatalFailure()) return;
    // Workers first: this process is still single-threaded, so fork() is safe.
    pid_t prefill = sv.spawn(true, 0);
    pid_t decode = sv.spawn(false, 1);
    ChildReaper reaper{{&prefill, &decode}};

    // References from the single-process engine (its threads end before any later fork).
    std::vector<std::vector<int32_t>> prompts, want;
    engine_reference(prompts, want);
    if (::testing::Test::HasFatalFailure()) return;

    // All four at once: decode runs them as one batch.
    std::vector<shm::ReqRef> reqs;
    for (auto& p : prompts) reqs.push_back(sv.submit(p));
    for (size_t i = 0; i < reqs.size(); ++i) EXPECT_EQ(sv.collect(reqs[i]), want[i]) << kPrompts[i];

    // SIGKILL decode mid-stream, then prefill; every stream finishes identically.
    uint32_t redriven = 0;
    for (bool kill_decode : {true, false}) {
        reqs.clear();
        for (auto& p : prompts) reqs.push_back(sv.submit(p));
        shm::RequestTable& t = sv.inst.requests();
        if (kill_decode) {  // wait until some tokens have been produced by decode
            (void)poll_until([&] { return t.slot(reqs[0].slot).n_output.load() >= 4; }, 10'000);
        } else {
            usleep(2000);
        }
        pid_t& victim = kill_decode ? decode : prefill;
        kill(victim, SIGKILL);
        EXPECT_EQ(wait_exit(victim), 128 + SIGKILL);
        redriven += sv.recover(victim);
        victim = sv.spawn(!kill_decode, kill_decode ? 1 : 0);
        for (size_t i = 0; i < reqs.size(); ++i)
            EXPECT_EQ(sv.collect(reqs[i]), want[i]) << kPrompts[i] << (kill_decode ? " (decode killed)" : " (prefill killed)");
    }
    EXPECT_GT(redriven, 0u) << "the kills should have caught requests in flight";
    std::printf("2 worker kills re-drove %u requests; all outputs equal the engine's\n", redriven);

    sv.flags->stop.store(true);
    EXPECT_EQ(wait_exit(prefill), 0);
    EXPECT_EQ(wait_exit(decode), 0);
    prefill = decode = 0;
    shm::ArenaCensus c = sv.inst.arena(0).census();
    EXPECT_EQ(c.held, 0u) << c.held << " KV blocks still held";
    EXPECT_EQ(c.free + c.cached, c.total);
    for (uint32_t s = 0; s < sv.inst.requests().n_slots(); ++s)
        EXPECT_EQ(sv.inst.requests().state(s), shm::ReqState::Free);
}

// Prefill packs several requests into each forward pass within its token budget,
// earliest deadline first (a short prompt sent just after a long one is handed off
// first), and takes the full blocks of prompts it has seen from the prefix cache:
// outputs are still the engine's, and two identical prompts sent together (what
// n = 2 does) share their prompt's blocks.
TEST(Serving, PrefillPacksRequestsAndReusesCachedPrefixes) {
    Serving sv;
    sv.start();
    if (::testing::Test::HasFatalFailure()) return;
    WorkerOptions po;
    po.prefill_budget = 16;  // the long prompt takes several passes
    pid_t prefill = sv.spawn(true, 0, po);
    pid_t decode = sv.spawn(false, 1);
    ChildReaper reaper{{&prefill, &decode}};
    std::vector<std::vector<int32_t>> prompts, want;
    engine_reference(prompts, want);
    if (::testing::Test::HasFatalFailure()) return;
    ASSERT_GT(prompts[kLong].size(), 3u * 16u);
    shm::RequestTable& t = sv.inst.requests();
    const uint32_t bt = sv.cfg.requests.block_tokens;

    // Long first, then the short ones: all packed, the short ones handed off first.
    std::vector<shm::ReqRef> reqs(prompts.size());
    reqs[kLong] = sv.submit(prompts[kLong]);
    for (size_t i = 0; i < prompts.size(); ++i)
        if (i != kLong) reqs[i] = sv.submit(prompts[i]);
    for (size_t i = 0; i < prompts.size(); ++i) {
        for (int k = 0; k < 60000 && t.slot(reqs[i].slot).handoff_ns.load() == 0 && !t.is(reqs[i], shm::ReqState::Finished); ++k)
            usleep(1000);
    }
    for (size_t i = 0; i < prompts.size(); ++i) {
        if (i == kLong) continue;
        EXPECT_LT(t.slot(reqs[i].slot).handoff_ns.load(), t.slot(reqs[kLong].slot).handoff_ns.load())
            << kPrompts[i] << ": a short prompt waited for the long one";
        EXPECT_EQ(t.slot(reqs[i].slot).n_cached.load(), 0u);
    }
    for (size_t i = 0; i < reqs.size(); ++i) EXPECT_EQ(sv.collect(reqs[i]), want[i]) << kPrompts[i];

    // The long prompt again, twice at once: both take its full blocks from the cache
    // (all but the block holding the last token, which is computed for its logits).
    const uint32_t cacheable = static_cast<uint32_t>((prompts[kLong].size() - 1) / bt * bt);
    shm::ReqRef a = sv.submit(prompts[kLong]), b = sv.submit(prompts[kLong]);
    for (int k = 0; k < 60000 && !(t.slot(a.slot).handoff_ns.load() && t.slot(b.slot).handoff_ns.load()); ++k) usleep(1000);
    EXPECT_EQ(t.slot(a.slot).n_cached.load(), cacheable);
    EXPECT_EQ(t.slot(b.slot).n_cached.load(), cacheable);
    // Decode holds both: their leading blocks are the same blocks.
    const uint32_t nfull = cacheable / bt;
    ASSERT_GE(t.slot(a.slot).n_blocks.load(), nfull);
    ASSERT_GE(t.slot(b.slot).n_blocks.load(), nfull);
    for (uint32_t i = 0; i < nfull; ++i) EXPECT_EQ(t.blocks(a.slot)[i], t.blocks(b.slot)[i]) << "block " << i;
    EXPECT_EQ(sv.collect(a), want[kLong]);
    EXPECT_EQ(sv.collect(b), want[kLong]);

    sv.flags->stop.store(true);
    EXPECT_EQ(wait_exit(prefill), 0);
    EXPECT_EQ(wait_exit(decode), 0);
    prefill = decode = 0;
    shm::ArenaCensus c = sv.inst.arena(0).census();
    EXPECT_EQ(c.held, 0u);
    EXPECT_GE(c.cached, prompts[kLong].size() / bt) << "the long prompt's full blocks stay cached";
    EXPECT_EQ(c.free + c.cached, c.total);
}

// KV pressure between the roles, stepped by hand in this process so the interleaving
// is the one that failed on 2026-12-03: decode runs one sequence (A) while prefill
// computes a long prompt (B) pass by pass until the arena is full. B, alone in its
// pass and short, waits; A, alone in decode, needs a block for its next token. B
// gives back its blocks while it waits (they stay cached, evictable) and A waits
// rather than fail (nobody to preempt): A finishes, then B is computed again and
// finishes. Both outputs equal the single-process engine's.
TEST(Serving, ALoneDecodeSequenceGetsTheBlocksOfAPromptThatWaits) {
    Serving sv;
    sv.start(1, 1, false, /*n_blocks=*/12);
    if (::testing::Test::HasFatalFailure()) return;
    const uint32_t bt = sv.cfg.requests.block_tokens;
    ASSERT_EQ(bt, 16u) << "the scenario's sizes assume 16-token blocks";
    // A: 20 + 100 tokens (8 blocks at the end); B: 170 + 2 (11 blocks). Together they
    // never fit in 12; each alone does.
    std::vector<int32_t> pa, pb;
    for (int i = 0; i < 20; ++i) pa.push_back(200 + 37 * i % 900);
    for (int i = 0; i < 170; ++i) pb.push_back(300 + 53 * i % 1500);
    const uint32_t na = 100, nb = 2;
    const auto want = engine_greedy({{pa, na}, {pb, nb}});
    ASSERT_EQ(want[0].size(), na);
    ASSERT_EQ(want[1].size(), nb);
    WorkerOptions o;
    o.prefill_budget = 32;  // B takes six passes, two blocks each
    SteppedWorkers w;
    w.start(sv, o);
    if (::testing::Test::HasFatalFailure()) return;
    shm::RequestTable& t = sv.inst.requests();
    const shm::ReqRef a = sv.submit(pa, na, false);
    for (int k = 0; k < 1000 && sv.output(a).size() < 4 && !sv.ended(a); ++k) w.step();
    ASSERT_TRUE(t.is(a, shm::ReqState::Decoding)) << shm::req_state_name(t.state(a.slot));
    const shm::ReqRef b = sv.submit(pb, nb, false);
    bool full = false;  // every block held at once (the pressure happened)
    for (int k = 0; k < 20000 && !(sv.ended(a) && sv.ended(b)); ++k) {
        w.step();
        if (::testing::Test::HasFatalFailure()) return;
        const shm::ArenaCensus c = sv.inst.arena(0).census();
        full |= c.held == c.total && !sv.ended(a);
    }
    EXPECT_TRUE(full) << "the arena never filled: the scenario did not happen";
    ASSERT_TRUE(t.is(a, shm::ReqState::Finished)) << "A is " << shm::req_state_name(t.state(a.slot));
    ASSERT_TRUE(t.is(b, shm::ReqState::Finished)) << "B is " << shm::req_state_name(t.state(b.slot));
    EXPECT_EQ(sv.output(a), want[0]);
    EXPECT_EQ(sv.output(b), want[1]);
    EXPECT_TRUE(t.transition(a, shm::ReqState::Finished, shm::ReqState::Free));
    EXPECT_TRUE(t.transition(b, shm::ReqState::Finished, shm::ReqState::Free));
    w.stop_and_check_arena(sv);
}

// Preemption by swap, stepped by hand: two sequences grow in decode until the arena
// (12 blocks) is full; the newer gives way, and since the prefill rate is not known
// yet (or is far slower than a copy here) its KV is swapped out to a blob instead of
// dropped. Prefill reads it back once there is room (after the other one ends) and
// computes only the one token that had no KV: the prefill workers' work counter says
// so. Both outputs equal the single-process engine's, the blob is gone, and every
// block is free at the end.
TEST(Serving, APreemptedRequestIsSwappedOutAndReadBackNotComputedAgain) {
    Serving sv;
    sv.start(1, 1, false, /*n_blocks=*/12);
    if (::testing::Test::HasFatalFailure()) return;
    ASSERT_EQ(sv.cfg.requests.block_tokens, 16u);
    char tmpl[] = "/tmp/duet-swap-test-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    const std::string dir = tmpl;
    std::vector<int32_t> pa, pb;
    for (int i = 0; i < 20; ++i) pa.push_back(200 + 37 * i % 900);
    for (int i = 0; i < 20; ++i) pb.push_back(500 + 41 * i % 1200);
    const uint32_t n_out = 100;  // 120 tokens each: 8 blocks; both together need 16
    const auto want = engine_greedy({{pa, n_out}, {pb, n_out}});
    WorkerOptions o;
    o.swap_dir = dir;
    o.max_draft = 0;  // a token a step: with drafts A could end before B took its blocks
    SteppedWorkers w;
    w.start(sv, o);
    if (::testing::Test::HasFatalFailure()) return;
    shm::RequestTable& t = sv.inst.requests();
    const shm::ReqRef a = sv.submit(pa, n_out, false);
    usleep(2000);  // b is the newer: the one that gives way
    const shm::ReqRef b = sv.submit(pb, n_out, false);
    std::vector<uint32_t> sent = {t.attempt(a.slot), t.attempt(b.slot)};
    for (int k = 0; k < 20000 && !(sv.ended(a) && sv.ended(b)); ++k) {
        w.step();
        if (::testing::Test::HasFatalFailure()) return;
        // The front's part: a preempted request (QUEUED at a new attempt) is sent again.
        for (auto [r, at] : {std::pair{a, &sent[0]}, std::pair{b, &sent[1]}})
            if (t.is(r, shm::ReqState::Queued) && t.attempt(r.slot) != *at) {
                *at = t.attempt(r.slot);
                sv.send(r);
            }
    }
    ASSERT_TRUE(t.is(a, shm::ReqState::Finished)) << "A is " << shm::req_state_name(t.state(a.slot));
    ASSERT_TRUE(t.is(b, shm::ReqState::Finished)) << "B is " << shm::req_state_name(t.state(b.slot));
    EXPECT_EQ(sv.output(a), want[0]);
    EXPECT_EQ(sv.output(b), want[1]);
    const uint64_t swaps = t.swaps().load();
    EXPECT_GE(swaps, 1u) << "nothing was swapped: the arena was not small enough";
    EXPECT_GT(t.swapped_bytes().load(), 0u);
    // Prefill computed the prompts, and after each swap the one token without KV.
    uint64_t computed = 0;
    for (uint32_t s = 0; s < sv.inst.registry().n_slots(); ++s)
        if (sv.inst.registry().slot(s).role.load() == static_cast<uint32_t>(shm::Role::Prefill))
            computed += worker_stats(sv.inst.registry(), s).work_tokens.load();
    EXPECT_EQ(computed, pa.size() + pb.size() + swaps) << "a swapped request was computed again";
    EXPECT_EQ(t.slot(b.slot).n_swapped.load(), 0u);
    EXPECT_TRUE(t.transition(a, shm::ReqState::Finished, shm::ReqState::Free));
    EXPECT_TRUE(t.transition(b, shm::ReqState::Finished, shm::ReqState::Free));
    w.stop_and_check_arena(sv);
    // Each blob was removed once read back.
    std::error_code ec;
    EXPECT_TRUE(std::filesystem::is_empty(dir, ec)) << dir;
    std::filesystem::remove_all(dir, ec);
}

// Preemption for decode's batch slots: with both slots taken by batch requests, a
// critical request's hand-off takes the newer one's slot at once (that one is
// preempted, goes back through prefill and keeps its place), instead of waiting for
// a batch request to end, and is not held up by a batch hand-off that came before it
// and waits (a class apart is the threshold: that one never displaces its equals).
// Every output equals the engine's.
TEST(Serving, ACriticalHandOffTakesTheSlotOfABatchSequence) {
    Serving sv;
    sv.start(1, 1);
    if (::testing::Test::HasFatalFailure()) return;
    std::vector<int32_t> pa, pb, pc, pd;
    for (int i = 0; i < 12; ++i) pa.push_back(300 + 31 * i % 700);
    for (int i = 0; i < 12; ++i) pb.push_back(900 + 43 * i % 800);
    for (int i = 0; i < 12; ++i) pc.push_back(1500 + 29 * i % 600);
    for (int i = 0; i < 12; ++i) pd.push_back(2100 + 23 * i % 500);
    const uint32_t n_long = 60, n_short = 8;
    const auto want = engine_greedy({{pa, n_long}, {pb, n_long}, {pc, n_short}, {pd, n_short}});
    WorkerOptions o;
    o.max_batch = 2;
    o.max_draft = 0;  // a token a step: the scenario counts steps
    SteppedWorkers w;
    w.start(sv, o);
    if (::testing::Test::HasFatalFailure()) return;
    shm::RequestTable& t = sv.inst.requests();
    const shm::ReqRef a = sv.submit(pa, n_long, false, SloClass::Batch);
    usleep(2000);  // b is the newer: the one that gives way
    const shm::ReqRef b = sv.submit(pb, n_long, false, SloClass::Batch);
    std::vector<shm::ReqRef> reqs = {a, b};
    std::vector<uint32_t> sent = {t.attempt(a.slot), t.attempt(b.slot)};
    auto step = [&] {
        w.step();
        // The front's part: a preempted request (QUEUED at a new attempt) is sent again.
        for (size_t i = 0; i < reqs.size(); ++i)
            if (t.is(reqs[i], shm::ReqState::Queued) && t.attempt(reqs[i].slot) != sent[i]) {
                sent[i] = t.attempt(reqs[i].slot);
                sv.send(reqs[i]);
            }
    };
    for (int k = 0; k < 200 && !(sv.output(a).size() >= 4 && sv.output(b).size() >= 4); ++k) step();
    ASSERT_TRUE(t.is(a, shm::ReqState::Decoding) && t.is(b, shm::ReqState::Decoding));
    // Another batch request: no slot for it while both batch requests run (a class
    // apart is the threshold). Handed off, it waits in decode, holding its KV.
    const shm::ReqRef d = sv.submit(pd, n_short, false, SloClass::Batch);
    reqs.push_back(d);
    sent.push_back(t.attempt(d.slot));
    const size_t a_before = sv.output(a).size(), b_before = sv.output(b).size();
    for (int k = 0; k < 10; ++k) step();
    EXPECT_LE(sv.output(d).size(), 1u) << "a batch request displaced another";
    EXPECT_TRUE(t.is(d, shm::ReqState::Decoding)) << "handed off: D is " << shm::req_state_name(t.state(d.slot));
    EXPECT_GT(sv.output(a).size(), a_before);
    EXPECT_GT(sv.output(b).size(), b_before);
    // A critical request, handed off after d: it is not held up behind d (decode takes
    // every hand-off and runs the most urgent), and takes b's slot.
    const shm::ReqRef c = sv.submit(pc, n_short, false, SloClass::Critical);
    reqs.push_back(c);
    sent.push_back(t.attempt(c.slot));
    bool displaced = false;
    for (int k = 0; k < 400 && !sv.ended(c); ++k) {
        step();
        if (t.is(c, shm::ReqState::Decoding) && !t.is(b, shm::ReqState::Decoding)) displaced = true;
        ASSERT_FALSE(sv.ended(a) || sv.ended(b)) << "the batch requests ended before the critical one";
    }
    EXPECT_TRUE(displaced) << "the critical request never took a batch request's slot";
    ASSERT_TRUE(t.is(c, shm::ReqState::Finished)) << "C is " << shm::req_state_name(t.state(c.slot));
    EXPECT_TRUE(t.is(a, shm::ReqState::Decoding)) << "the older batch request kept its slot";
    for (int k = 0; k < 20000 && !(sv.ended(a) && sv.ended(b) && sv.ended(d)); ++k) step();
    const std::vector<shm::ReqRef> order = {a, b, c, d};
    for (size_t i = 0; i < order.size(); ++i) {
        ASSERT_TRUE(t.is(order[i], shm::ReqState::Finished)) << i << " is " << shm::req_state_name(t.state(order[i].slot));
        EXPECT_EQ(sv.output(order[i]), want[i]) << "request " << i;
        EXPECT_TRUE(t.transition(order[i], shm::ReqState::Finished, shm::ReqState::Free));
    }
    w.stop_and_check_arena(sv);
}

// `duet instance` restarted on an instance its predecessor left running: take_over
// recovers the dead supervisor's registry slot, makes the re-drive it owned and had
// not sent its own and sends it; it refuses while another supervisor runs.
TEST(Serving, ASupervisorTakesOverADeadOnesRequests) {
    Serving sv;
    sv.start();
    if (::testing::Test::HasFatalFailure()) return;
    shm::Registry& reg = sv.inst.registry();
    shm::RequestTable& t = sv.inst.requests();
    const pid_t gone = fork_run([] { return 0; });
    ASSERT_GT(gone, 0);
    ASSERT_EQ(wait_exit(gone), 0);  // reaped: a pid that no longer runs
    auto dead = reg.claim(shm::Role::Launcher, -1, gone);
    ASSERT_TRUE(dead.ok());
    reg.set_running(*dead);
    ASSERT_FALSE(reg.process_running(*dead));
    // A request the dead supervisor re-drove (QUEUED, its own) and never sent; its
    // client (the front) is alive.
    RequestParams p;
    p.sampling.temperature = 0.0f;
    p.max_tokens = 4;
    const std::vector<int32_t> prompt = {1, 2, 3, 4};
    auto r = t.submit(sv.front, prompt.data(), static_cast<uint32_t>(prompt.size()), &p, sizeof p);
    ASSERT_TRUE(r.ok()) << r.error().message;
    ASSERT_TRUE(t.adopt(*r, sv.front, *dead));
    auto self = reg.claim(shm::Role::Launcher, -1, getpid());
    ASSERT_TRUE(self.ok());
    reg.set_running(*self);
    std::vector<shm::ReqRef> sent;
    {
        Supervisor sup(sv.inst, *self, [&](shm::ReqRef q) { sent.push_back(q); });
        auto from = sup.take_over();
        ASSERT_TRUE(from.ok()) << from.error().message;
        EXPECT_EQ(*from, std::vector<pid_t>{gone});
    }
    EXPECT_EQ(reg.state(dead->slot), shm::ProcState::Free) << "the dead supervisor's slot is recovered";
    EXPECT_TRUE(t.is(*r, shm::ReqState::Queued));
    EXPECT_EQ(t.owner_slot(r->slot), static_cast<int32_t>(self->slot)) << "the re-drive is the new supervisor's";
    ASSERT_EQ(sent.size(), 1u) << "and sent again";
    EXPECT_EQ(sent[0].slot, r->slot);
    EXPECT_EQ(sent[0].gen, r->gen);

    // Another supervisor that runs (this test's parent process stands for it): refused,
    // naming it, and nothing is touched.
    auto live = reg.claim(shm::Role::Launcher, -1, getppid());
    ASSERT_TRUE(live.ok());
    reg.set_running(*live);
    sent.clear();
    {
        Supervisor sup(sv.inst, *self, [&](shm::ReqRef q) { sent.push_back(q); });
        auto from = sup.take_over();
        ASSERT_FALSE(from.ok());
        EXPECT_NE(from.error().message.find(std::to_string(getppid())), std::string::npos) << from.error().message;
    }
    EXPECT_TRUE(sent.empty());
    EXPECT_EQ(reg.state(live->slot), shm::ProcState::Running);
    reg.release(*live);
    reg.release(*self);
    ASSERT_TRUE(t.transition(*r, shm::ReqState::Queued, shm::ReqState::Cancelled));
}

// The same with the real `duet prefill` and `duet decode` executables under the
// Supervisor: a SIGKILLed decode is noticed, recovered, its requests re-driven and
// the role restarted, and the streams still equal the engine's; SIGTERM stops both
// cleanly.
TEST(Serving, SupervisedWorkerExecutablesRecoverAndStopCleanly) {
    std::vector<std::vector<int32_t>> prompts, want;
    engine_reference(prompts, want);
    if (::testing::Test::HasFatalFailure()) return;
    Serving sv;
    sv.start();
    if (::testing::Test::HasFatalFailure()) return;
    Supervisor sup(sv.inst, sv.front, [&](shm::ReqRef r) { sv.send(r); });
    const std::string bin = DUET_BINARY;
    for (auto [role, cpu] : {std::pair{"prefill", "0"}, std::pair{"decode", "1"}})
        ASSERT_TRUE(sup.start({role, {bin, role, "--instance", sv.cfg.name, "-m", DUET_MODEL_PATH, "-t", "1",
                                      "--cpus", cpu}})
                        .ok());
    auto collect = [&](shm::ReqRef r) {  // as Serving::collect, polling the supervisor meanwhile
        shm::RequestTable& t = sv.inst.requests();
        for (int i = 0; i < 60000 && !t.is(r, shm::ReqState::Finished) && !t.is(r, shm::ReqState::Failed); ++i) {
            sup.poll();
            usleep(1000);
        }
        return sv.collect(r);
    };
    std::vector<shm::ReqRef> reqs;
    for (auto& p : prompts) reqs.push_back(sv.submit(p));
    shm::RequestTable& t = sv.inst.requests();
    // Decode holds the first request once it has made 4 tokens. Every decode
    // worker starts with a golden check: under ASan on a loaded 2-core machine that
    // passed a fixed 10 s (2026-12-05 for the first worker, 2026-12-07 for the
    // restarted one), decode was killed holding nothing, and the check after the
    // kill failed. The wait follows DUET_TIME_SCALE and fails rather than kill too
    // early.
    auto await_four_tokens = [&](shm::ReqRef r) {
        const uint64_t until = shm::monotonic_ns() + test_time::scaled_ns(30'000'000'000ull);
        while (shm::monotonic_ns() < until && t.slot(r.slot).n_output.load() < 4) {
            sup.poll();
            usleep(500);
        }
        return t.slot(r.slot).n_output.load() >= 4;
    };
    ASSERT_TRUE(await_four_tokens(reqs[0])) << "the first request made no 4 tokens in time";
    pid_t dec = sup.pid_of("decode");
    ASSERT_GT(dec, 0);
    kill(dec, SIGKILL);
    std::vector<Supervisor::Event> ev;
    (void)poll_until(
        [&] {
            ev = sup.poll();
            return !ev.empty();
        },
        5'000, 1000);
    ASSERT_EQ(ev.size(), 1u);
    EXPECT_EQ(ev[0].role, "decode");
    EXPECT_TRUE(WIFSIGNALED(ev[0].status) && WTERMSIG(ev[0].status) == SIGKILL);
    EXPECT_GT(ev[0].restarted_as, 0);
    EXPECT_GT(ev[0].recovered.redriven + ev[0].recovered.adopted, 0u) << "decode held requests when killed";
    for (size_t i = 0; i < reqs.size(); ++i) EXPECT_EQ(collect(reqs[i]), want[i]) << kPrompts[i];
    EXPECT_EQ(sup.restarts(), 1u);

    // A worker that stops cleanly (SIGTERM) in the middle of its requests keeps its
    // registry slot, so they are recovered and re-driven like a crash's.
    reqs.clear();
    for (auto& p : prompts) reqs.push_back(sv.submit(p));
    ASSERT_TRUE(await_four_tokens(reqs[0])) << "the first request made no 4 tokens in time (decode restarted)";
    dec = sup.pid_of("decode");
    ASSERT_GT(dec, 0);
    kill(dec, SIGTERM);
    ev.clear();
    (void)poll_until(
        [&] {
            ev = sup.poll();
            return !ev.empty();
        },
        5'000, 1000);
    ASSERT_EQ(ev.size(), 1u);
    EXPECT_TRUE(WIFEXITED(ev[0].status) && WEXITSTATUS(ev[0].status) == 0);
    EXPECT_GT(ev[0].recovered.redriven, 0u) << "decode held requests when it stopped";
    for (size_t i = 0; i < reqs.size(); ++i) EXPECT_EQ(collect(reqs[i]), want[i]) << kPrompts[i] << " (decode stopped)";
    EXPECT_EQ(sup.restarts(), 2u);
    Status st = sup.stop_all(10000);
    EXPECT_TRUE(st.ok()) << st.error().message;
    shm::ArenaCensus c = sv.inst.arena(0).census();
    EXPECT_EQ(c.held, 0u) << c.held << " KV blocks still held";
    EXPECT_EQ(c.free + c.cached, c.total);
    for (uint32_t s = 0; s < sv.inst.registry().n_slots(); ++s)
        if (s != sv.front.slot) {
            EXPECT_EQ(sv.inst.registry().state(s), shm::ProcState::Free) << "registry slot " << s;
        }
}

// Two prefill and two decode workers: the front routes each request to the prefill
// worker with the least work ahead (or the one already computing its prefix), and
// prefill hands each off to the decode worker with the most room. Both workers of
// each role take requests; a prompt sent twice at once goes to one prefill worker,
// which computes its blocks once; outputs equal the engine's; a SIGKILLed decode
// worker's requests are re-driven and finish identically while the other keeps
// decoding; hand-offs sent to a decode worker that dies before taking them go to the
// other; every block is returned.
TEST(Serving, RequestsAreRoutedAmongSeveralPrefillAndDecodeWorkers) {
    Serving sv;
    sv.start(2, 2);
    if (::testing::Test::HasFatalFailure()) return;
    shm::Registry& reg = sv.inst.registry();
    auto spawn = [&](bool prefill, uint32_t index) {
        WorkerOptions o;
        o.index = index;
        if (prefill) o.prefill_budget = 16;  // the long prompt takes several passes
        return sv.spawn(prefill, prefill ? 0 : 1, o);
    };
    pid_t pre[2] = {spawn(true, 0), spawn(true, 1)};
    pid_t dec[2] = {spawn(false, 0), spawn(false, 1)};
    ChildReaper reaper{{&pre[0], &pre[1], &dec[0], &dec[1]}};
    std::vector<std::vector<int32_t>> prompts, want;
    engine_reference(prompts, want);
    if (::testing::Test::HasFatalFailure()) return;
    for (int i = 0; i < 10000; ++i) {  // all four registered
        bool all = true;
        for (int32_t k = 0; k < 2; ++k)
            all = all && reg.find_running(shm::Role::Prefill, k) >= 0 && reg.find_running(shm::Role::Decode, k) >= 0;
        if (all) break;
        usleep(1000);
    }
    auto served = [&](shm::Role role, int32_t index) -> uint64_t {
        const int32_t s = reg.find_running(role, index);
        EXPECT_GE(s, 0) << shm::role_name(role) << " " << index << " is not running";
        return s < 0 ? 0 : worker_stats(reg, static_cast<uint32_t>(s)).served.load();
    };
    shm::RequestTable& t = sv.inst.requests();
    const uint32_t bt = sv.cfg.requests.block_tokens;

    // A prompt nobody has computed, twice at once: one prefill worker takes both; the
    // second waits for the first's blocks and shares them.
    const uint64_t p0 = served(shm::Role::Prefill, 0), p1 = served(shm::Role::Prefill, 1);
    shm::ReqRef a = sv.submit(prompts[kLong]), b = sv.submit(prompts[kLong]);
    for (int k = 0; k < 60000 && !(t.slot(a.slot).handoff_ns.load() && t.slot(b.slot).handoff_ns.load()); ++k) usleep(1000);
    const uint64_t d0 = served(shm::Role::Prefill, 0) - p0, d1 = served(shm::Role::Prefill, 1) - p1;
    EXPECT_TRUE((d0 == 2 && d1 == 0) || (d0 == 0 && d1 == 2)) << "prefill 0 took " << d0 << ", prefill 1 took " << d1;
    const uint32_t cacheable = static_cast<uint32_t>((prompts[kLong].size() - 1) / bt * bt);
    EXPECT_EQ(std::max(t.slot(a.slot).n_cached.load(), t.slot(b.slot).n_cached.load()), cacheable);
    for (uint32_t i = 0; i < cacheable / bt; ++i) EXPECT_EQ(t.blocks(a.slot)[i], t.blocks(b.slot)[i]) << "block " << i;
    EXPECT_EQ(sv.collect(a), want[kLong]);
    EXPECT_EQ(sv.collect(b), want[kLong]);

    // Every prompt at once: both prefill and both decode workers take some.
    std::vector<shm::ReqRef> reqs;
    for (auto& p : prompts) reqs.push_back(sv.submit(p));
    for (size_t i = 0; i < reqs.size(); ++i) EXPECT_EQ(sv.collect(reqs[i]), want[i]) << kPrompts[i];
    for (int32_t k = 0; k < 2; ++k) {
        EXPECT_GT(served(shm::Role::Prefill, k), 0u) << "prefill " << k << " took no request";
        EXPECT_GT(served(shm::Role::Decode, k), 0u) << "decode " << k << " took no request";
    }

    // SIGKILL the decode worker holding a request mid-stream: re-driven, identical.
    reqs.clear();
    for (auto& p : prompts) reqs.push_back(sv.submit(p));
    (void)poll_until([&] { return t.slot(reqs[0].slot).n_output.load() >= 4; }, 10'000);
    int k = -1;  // a decode worker holding one of them now
    for (const shm::ReqRef& r : reqs) {
        const int32_t owner = t.owner_slot(r.slot);
        if (k < 0 && t.is(r, shm::ReqState::Decoding) && owner >= 0)
            k = reg.pid(static_cast<uint32_t>(owner)) == dec[0] ? 0 : reg.pid(static_cast<uint32_t>(owner)) == dec[1] ? 1 : -1;
    }
    ASSERT_GE(k, 0) << "no request was being decoded";
    const uint64_t other_before = served(shm::Role::Decode, 1 - k);
    kill(dec[k], SIGKILL);
    EXPECT_EQ(wait_exit(dec[k]), 128 + SIGKILL);
    EXPECT_GT(sv.recover(dec[k]), 0u) << "the killed decode worker held requests";
    dec[k] = spawn(false, static_cast<uint32_t>(k));
    for (size_t i = 0; i < reqs.size(); ++i) EXPECT_EQ(sv.collect(reqs[i]), want[i]) << kPrompts[i] << " (decode " << k << " killed)";
    EXPECT_GT(served(shm::Role::Decode, 1 - k) + served(shm::Role::Decode, k), other_before)
        << "the re-driven requests were decoded again";

    // A decode worker that dies before taking the hand-offs sent to it: prefill sends
    // them to the other one, without waiting for a restart (the copies left in the
    // dead one's ring are dropped by its successor).
    const int j = 1 - k;
    kill(dec[j], SIGSTOP);
    reqs.clear();
    for (auto& p : prompts) reqs.push_back(sv.submit(p));
    (void)poll_until([&] { return queued_for_decode(sv.inst, static_cast<uint32_t>(j)) != 0; }, 10'000);
    ASSERT_GT(queued_for_decode(sv.inst, static_cast<uint32_t>(j)), 0u) << "nothing was handed to the stopped worker";
    kill(dec[j], SIGKILL);
    EXPECT_EQ(wait_exit(dec[j]), 128 + SIGKILL);
    sv.recover(dec[j]);
    dec[j] = 0;
    for (size_t i = 0; i < reqs.size(); ++i) EXPECT_EQ(sv.collect(reqs[i]), want[i]) << kPrompts[i] << " (decode " << j << " dead)";
    dec[j] = spawn(false, static_cast<uint32_t>(j));
    reqs.clear();
    for (auto& p : prompts) reqs.push_back(sv.submit(p));
    for (size_t i = 0; i < reqs.size(); ++i) EXPECT_EQ(sv.collect(reqs[i]), want[i]) << kPrompts[i] << " (decode " << j << " back)";

    // The same for a prefill worker: requests sent to it and not taken when it died
    // are sent to the other one (the front's resend_stranded()), no restart needed.
    kill(pre[j], SIGSTOP);
    reqs.clear();
    for (auto& p : prompts) reqs.push_back(sv.submit(p));
    ASSERT_GT(queued_for_prefill(sv.inst, static_cast<uint32_t>(j)), 0u) << "nothing was sent to the stopped worker";
    kill(pre[j], SIGKILL);
    EXPECT_EQ(wait_exit(pre[j]), 128 + SIGKILL);
    for (uint32_t s = 0; s < reg.n_slots(); ++s)  // recovery only (Serving::recover would send QUEUED requests again)
        if (reg.pid(s) == pre[j] && reg.state(s) != shm::ProcState::Free) {
            EXPECT_TRUE(sv.inst.recover(reg.current(s), sv.front, true).ok());
        }
    pre[j] = 0;
    EXPECT_GT(sv.router->resend_stranded(), 0u);
    for (size_t i = 0; i < reqs.size(); ++i) EXPECT_EQ(sv.collect(reqs[i]), want[i]) << kPrompts[i] << " (prefill " << j << " dead)";
    pre[j] = spawn(true, static_cast<uint32_t>(j));
    reqs.clear();
    for (auto& p : prompts) reqs.push_back(sv.submit(p));
    for (size_t i = 0; i < reqs.size(); ++i) EXPECT_EQ(sv.collect(reqs[i]), want[i]) << kPrompts[i] << " (prefill " << j << " back)";

    sv.flags->stop.store(true);
    for (pid_t* p : {&pre[0], &pre[1], &dec[0], &dec[1]}) {
        EXPECT_EQ(wait_exit(*p), 0);
        *p = 0;
    }
    shm::ArenaCensus c = sv.inst.arena(0).census();
    EXPECT_EQ(c.held, 0u) << c.held << " KV blocks still held";
    EXPECT_EQ(c.free + c.cached, c.total);
}

// Per-role KV arenas (duet serve --kv-arenas per-role): prefill writes its arena,
// and the pass that ends a prompt copies every block of the request (earlier
// chunks and cached-prefix blocks too) into blocks of decode's arena, which decode
// alone reads. Outputs equal the engine's with prompts over several chunks and
// cached prefixes; a killed decode or prefill worker loses nothing; at the end
// neither arena holds a block, and prefill's arena kept the prompts in its prefix
// cache.
TEST(Serving, PerRoleArenasCopyEachHandOffIntoDecodesArena) {
    Serving sv;
    sv.start(1, 2, /*kv_split=*/true);
    if (::testing::Test::HasFatalFailure()) return;
    ASSERT_EQ(sv.inst.n_arenas(), 2u);
    auto spawn = [&](bool prefill, uint32_t index) {
        WorkerOptions o;
        o.index = index;
        if (prefill) o.prefill_budget = 32;  // the long prompt takes several passes
        return sv.spawn(prefill, prefill ? 0 : 1, o);
    };
    pid_t prefill = spawn(true, 0);
    pid_t dec[2] = {spawn(false, 0), spawn(false, 1)};
    ChildReaper reaper{{&prefill, &dec[0], &dec[1]}};
    std::vector<std::vector<int32_t>> prompts, want;
    engine_reference(prompts, want);
    if (::testing::Test::HasFatalFailure()) return;

    // Twice: the second round takes the prompts' full blocks from prefill's prefix
    // cache, and those cached blocks must reach decode's arena too.
    for (int round = 0; round < 2; ++round) {
        std::vector<shm::ReqRef> reqs;
        for (auto& p : prompts) reqs.push_back(sv.submit(p));
        for (size_t i = 0; i < reqs.size(); ++i)
            EXPECT_EQ(sv.collect(reqs[i]), want[i]) << kPrompts[i] << " (round " << round << ")";
    }
    EXPECT_GT(sv.inst.arena(0).census().cached, 0u) << "prefill's arena keeps the prompts' blocks cached";
    EXPECT_EQ(sv.inst.arena(1).census().cached, 0u) << "decode's arena caches nothing";

    // Kill the decode worker holding streams, then the prefill worker.
    shm::RequestTable& t = sv.inst.requests();
    shm::Registry& reg = sv.inst.registry();
    uint32_t redriven = 0;
    for (bool kill_decode : {true, false}) {
        std::vector<shm::ReqRef> reqs;
        for (auto& p : prompts) reqs.push_back(sv.submit(p));
        pid_t* victim = &prefill;
        uint32_t index = 0;
        if (kill_decode) {
            (void)poll_until([&] { return t.slot(reqs[0].slot).n_output.load() >= 4; }, 10'000);
            const int32_t owner = t.owner_slot(reqs[0].slot);
            for (uint32_t d = 0; d < 2; ++d)
                if (owner >= 0 && reg.pid(static_cast<uint32_t>(owner)) == dec[d]) {
                    victim = &dec[d];
                    index = d;
                }
            ASSERT_NE(victim, &prefill) << "request 0 should be decoding";
        } else {
            usleep(2000);
        }
        kill(*victim, SIGKILL);
        EXPECT_EQ(wait_exit(*victim), 128 + SIGKILL);
        redriven += sv.recover(*victim);
        *victim = spawn(!kill_decode, index);
        for (size_t i = 0; i < reqs.size(); ++i)
            EXPECT_EQ(sv.collect(reqs[i]), want[i]) << kPrompts[i] << (kill_decode ? " (decode killed)" : " (prefill killed)");
    }
    EXPECT_GT(redriven, 0u) << "the kills should have caught requests in flight";

    sv.flags->stop.store(true);
    for (pid_t* p : {&prefill, &dec[0], &dec[1]}) {
        EXPECT_EQ(wait_exit(*p), 0);
        *p = 0;
    }
    for (uint32_t a = 0; a < 2; ++a) {
        shm::ArenaCensus c = sv.inst.arena(a).census();
        EXPECT_EQ(c.held, 0u) << c.held << " KV blocks still held in arena " << a;
        EXPECT_EQ(c.free + c.cached, c.total);
    }
    for (uint32_t s = 0; s < t.n_slots(); ++s) EXPECT_EQ(t.state(s), shm::ReqState::Free);
}

// Per-role arenas with a decode arena too small for every hand-off at once: a pass
// that would end a prompt whose blocks find no room in decode's arena is planned
// without it (PrefillJobView::may_end), and the prompt ends in a later pass, once
// decode has freed blocks. Every output is still the engine's.
TEST(Serving, APromptWaitsForRoomInDecodesArena) {
    Serving sv;
    sv.start(1, 1, /*kv_split=*/true, /*n_blocks=*/12);
    if (::testing::Test::HasFatalFailure()) return;
    ASSERT_EQ(sv.inst.n_arenas(), 2u);
    WorkerOptions po;
    po.prefill_budget = 64;
    pid_t prefill = sv.spawn(true, 0, po);
    pid_t dec = sv.spawn(false, 1, WorkerOptions{});
    ChildReaper reaper{{&prefill, &dec}};
    std::vector<std::vector<int32_t>> prompts, want;
    engine_reference(prompts, want);
    if (::testing::Test::HasFatalFailure()) return;
    shm::RequestTable& t = sv.inst.requests();
    std::vector<shm::ReqRef> reqs;
    std::vector<uint32_t> sent;
    for (size_t i = 0; i < 8; ++i) {  // every slot
        reqs.push_back(sv.submit(prompts[i % prompts.size()]));
        sent.push_back(t.attempt(reqs.back().slot));
    }
    const auto all_ended = [&] {
        return std::all_of(reqs.begin(), reqs.end(), [&](shm::ReqRef r) { return sv.ended(r); });
    };
    for (int k = 0; k < 60000 && !all_ended(); ++k) {
        usleep(1000);
        // The front's part: a preempted request (QUEUED at a new attempt) is sent again.
        for (size_t i = 0; i < reqs.size(); ++i)
            if (t.is(reqs[i], shm::ReqState::Queued) && t.attempt(reqs[i].slot) != sent[i]) {
                sent[i] = t.attempt(reqs[i].slot);
                sv.send(reqs[i]);
            }
    }
    for (size_t i = 0; i < reqs.size(); ++i)
        EXPECT_EQ(sv.collect(reqs[i]), want[i % prompts.size()]) << kPrompts[i % prompts.size()];
    sv.flags->stop.store(true);
    for (pid_t* p : {&prefill, &dec}) {
        EXPECT_EQ(wait_exit(*p), 0);
        *p = 0;
    }
    for (uint32_t a = 0; a < 2; ++a) EXPECT_EQ(sv.inst.arena(a).census().held, 0u) << "arena " << a;
}
