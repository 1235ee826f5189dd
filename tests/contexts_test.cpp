// Contexts on the real default model (src/engine/contexts.h): every rule C1-C5 has a
// test that breaks it. The reference for exactness is one fresh computation of the
// context's tokens in a sequence of its own (whole, no chunking), compared bitwise.
//
// Built twice: contexts_test, and contexts_staged_test (DUET_CONTEXTS_STAGED, ctest
// names "Staged.*") where the store reaches the arena only through a host mirror and
// a stage (kv/kv_stage.h, as for a GPU arena) and the arena's memory is unreadable
// (PROT_NONE) except while the backend computes or the stage copies: every test
// then also checks S1-S3 (a tile read unpulled reads zeros and breaks exactness; a
// store touching the arena itself faults).
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>

#include "base/thread_pool.h"
#include "deferred_stage.h"
#include "engine/contexts.h"
#include "kv/kv_stage.h"
#include "kv/log_device.h"
#include "model/cpu_backend.h"
#include "model/fingerprint.h"
#include "model/model.h"
#include "shm/instance.h"

using namespace duet;

namespace {

const Model& model() {
    static std::unique_ptr<Model> m = [] {
        auto r = Model::load(DUET_MODEL_PATH);
        if (!r) {
            ADD_FAILURE() << r.error().message;
            std::abort();
        }
        return std::move(r).value();
    }();
    return *m;
}

KvIdentity identity() {
    const Model& m = model();
    return {model_fingerprint(m.file()), tokenizer_fingerprint(m.file()), m.config().n_vocab};
}

struct TmpDir {
    std::string path;
    TmpDir() {
        char t[] = "/tmp/duet-contexts-XXXXXX";
        path = ::mkdtemp(t);
    }
    ~TmpDir() { std::system(("rm -rf " + path).c_str()); }
};

std::vector<int32_t> ids(std::mt19937& rng, size_t n) {
    std::uniform_int_distribution<int32_t> d(100, 40000);
    std::vector<int32_t> v(n);
    for (auto& x : v) x = d(rng);
    return v;
}

#ifdef DUET_CONTEXTS_STAGED
constexpr bool kStaged = true;
#else
constexpr bool kStaged = false;
#endif

// The arena's memory, readable only inside a Guard (staged runs).
struct Fence {
    void* data = nullptr;
    size_t bytes = 0;
    int open = 0;
    struct Guard {
        Fence& f;
        explicit Guard(Fence& fence) : f(fence) {
            if (f.data && f.open++ == 0) ::mprotect(f.data, f.bytes, PROT_READ | PROT_WRITE);
        }
        ~Guard() {
            if (f.data && --f.open == 0) ::mprotect(f.data, f.bytes, PROT_NONE);
        }
    };
};

// The compute of a staged rig: the backend reaches the arena.
struct FencedCompute final : ContextCompute {
    ContextCompute& inner;
    Fence& fence;
    FencedCompute(ContextCompute& c, Fence& f) : inner(c), fence(f) {}
    Status extend(KvSeq& seq, std::span<const int32_t> tokens, std::vector<float>& last) override {
        Fence::Guard g(fence);
        return inner.extend(seq, tokens, last);
    }
};

// The stage of a staged rig: a GPU's, through a bounce pool of two halves of 2
// blocks whose copies run only when waited on (deferred_stage.h), the arena
// reachable only inside it.
struct FencedStage final : KvStage {
    std::unique_ptr<test::DeferredBounceStage> inner;
    Fence& fence;
    int pulls = 0, pushes = 0;
    FencedStage(KvPool& arena, KvPool& mirror, Fence& f)
        : inner(test::DeferredBounceStage::make(arena, mirror, 2)), fence(f) {}
    Status pull(std::span<const int32_t> blocks) override {
        Fence::Guard g(fence);
        ++pulls;
        return checked(inner->pull(blocks));
    }
    Status push(std::span<const int32_t> blocks) override {
        Fence::Guard g(fence);
        ++pushes;
        return checked(inner->push(blocks));
    }
    Status checked(Status st) {
        EXPECT_EQ(inner->pending(), 0);
        EXPECT_TRUE(inner->violations.empty());
        return st;
    }
};

// A pool, a backend over it and a store; `budget` tokens per pass (small: contexts
// are computed in several passes, the reference in one). Staged: the pool is the
// arena, the store works on its mirror.
struct Rig {
    std::unique_ptr<KvPool> pool;
    Fence fence;
    void* arena_mem = nullptr;
    std::unique_ptr<KvMirror> mirror;
    std::unique_ptr<FencedStage> stage;
    std::unique_ptr<FencedCompute> fenced;
    ThreadPool threads{2};
    std::unique_ptr<CpuBackend> backend;
    std::unique_ptr<KvCacheManager> kv;
    std::unique_ptr<BackendCompute> compute;
    std::unique_ptr<LogDevice> dev;
    std::unique_ptr<KvLogSync> sync;
    std::unique_ptr<ContextStore> store;
    std::string dir;
    // The reference's own pool and backend: the store's pool may be full.
    std::unique_ptr<KvPool> ref_pool;
    std::unique_ptr<CpuBackend> ref_backend;

    uint64_t max_disk_bytes = 0;
    shm::ContextTable* table = nullptr;  // C6: the records of contexts that are not durable
    Rig(const std::string& d, int32_t n_blocks, int64_t budget = 24, uint64_t disk_max = 0)
        : dir(d), max_disk_bytes(disk_max) {
        const KvLayout layout = kv_layout(model(), KvDtype::F16);
        if (kStaged) {
            fence.bytes = layout.block_bytes() * static_cast<size_t>(n_blocks);
            arena_mem = ::mmap(nullptr, fence.bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            EXPECT_NE(arena_mem, MAP_FAILED);
            fence.data = arena_mem;
            pool = std::make_unique<KvPool>(layout, arena_mem, std::make_unique<LocalBlockAllocator>(n_blocks));
            auto m = KvMirror::create(layout, pool->allocator());
            EXPECT_TRUE(m.ok()) << m.error().message;
            mirror = std::move(m).value();
            stage = std::make_unique<FencedStage>(*pool, mirror->pool(), fence);
        } else {
            pool = std::move(KvPool::create(layout, n_blocks)).value();
        }
        backend = std::make_unique<CpuBackend>(model(), *pool, threads, cpu::isa_best());
        ref_pool = std::move(KvPool::create(kv_layout(model(), KvDtype::F16), 64)).value();
        ref_backend = std::make_unique<CpuBackend>(model(), *ref_pool, threads, cpu::isa_best());
        kv = std::make_unique<KvCacheManager>(*pool);
        compute = std::make_unique<BackendCompute>(*backend, *kv, budget);
        if (kStaged) fenced = std::make_unique<FencedCompute>(*compute, fence);
        auto u = UringLogDevice::create();
        EXPECT_TRUE(u.ok()) << u.error().message;
        dev = std::move(u).value();
        sync = std::make_unique<KvLogSync>(*dev);
        reopen();
    }
    void reopen() {
        store.reset();
        ContextStoreOptions o;
        o.dir = dir;
        o.id = identity();
        o.max_contexts = 64;
        o.max_disk_bytes = max_disk_bytes;
        o.table = table;
        if (kStaged) {
            o.stage = stage.get();
            o.mirror = mirror.get();
        }
        auto s = kStaged ? ContextStore::open(mirror->pool(), *sync, *fenced, o)
                         : ContextStore::open(*pool, *sync, *compute, o);
        ASSERT_TRUE(s.ok()) << s.error().message;
        store = std::move(s).value();
    }
    ~Rig() {
        store.reset();
        ref_backend.reset();
        backend.reset();
        if (kStaged) {
            mirror.reset();
            pool.reset();
            ::munmap(arena_mem, fence.bytes);
        }
    }

    // The reference: the next-token logits of `tokens` computed in one pass.
    std::vector<float> fresh(const std::vector<int32_t>& tokens) {
        KvSeq seq;
        std::vector<float> logits;
        SeqBatch b{&seq, tokens.data(), static_cast<int32_t>(tokens.size()), false};
        Status st = ref_backend->forward({&b, 1}, logits);
        EXPECT_TRUE(st.ok()) << st.error().message;
        seq.release(*ref_pool);
        return logits;
    }
    // C1 for one context: its next logits, bitwise, against the reference.
    void expect_exact(const std::string& id, const std::string& after) {
        auto t = store->tokens(id);
        ASSERT_TRUE(t.ok()) << t.error().message;
        if (t->empty()) return;
        auto got = store->next_logits(id);
        ASSERT_TRUE(got.ok()) << after << ": " << got.error().message;
        const std::vector<float> want = fresh(*t);
        ASSERT_EQ(got->size(), want.size());
        EXPECT_EQ(std::memcmp(got->data(), want.data(), want.size() * sizeof(float)), 0)
            << id << " (" << t->size() << " tokens) after " << after << ": logits differ from a fresh computation";
    }
};

int argmax(const std::vector<float>& v) { return static_cast<int>(std::max_element(v.begin(), v.end()) - v.begin()); }

}  // namespace

TEST(Contexts, EveryOperationKeepsTheLogitsOfAFreshComputation) {
    TmpDir d;
    Rig rig(d.path, 512);
    std::mt19937 rng(20261201);
    std::vector<std::string> live;
    int next_id = 0;
    const int n_ops = std::getenv("DUET_CONTEXT_OPS") ? std::atoi(std::getenv("DUET_CONTEXT_OPS")) : 200;
    for (int op = 0; op < n_ops; ++op) {
        const int kind = live.empty() ? 0 : static_cast<int>(rng() % 9);
        const std::string id = live.empty() ? "" : live[rng() % live.size()];
        std::string what;
        std::string touched = id;
        auto len = [&] { return static_cast<int64_t>(rig.store->tokens(id)->size()); };
        if (kind == 0 && live.size() < 6) {
            touched = fmt::format("c{}", next_id++);
            what = "create";
            auto r = rig.store->create(touched, ids(rng, 1 + rng() % 40), rng() % 3 != 0);
            ASSERT_TRUE(r.ok()) << r.error().message;
            live.push_back(touched);
        } else if (kind <= 2) {
            if (len() > 140) continue;
            what = "append";
            ASSERT_TRUE(rig.store->append(id, ids(rng, 1 + rng() % 20)).ok());
        } else if (kind == 3) {
            what = "truncate";
            ASSERT_TRUE(rig.store->truncate(id, static_cast<int64_t>(rng() % (len() + 1))).ok());
        } else if (kind == 4) {
            what = "edit";
            ASSERT_TRUE(rig.store->edit(id, static_cast<int64_t>(rng() % (len() + 1)), ids(rng, 1 + rng() % 12)).ok());
        } else if (kind == 5 && live.size() < 6) {
            what = "fork";
            touched = fmt::format("c{}", next_id++);
            auto r = rig.store->fork(id, touched, static_cast<int64_t>(rng() % (len() + 1)));
            ASSERT_TRUE(r.ok()) << r.error().message;
            live.push_back(touched);
        } else if (kind == 6) {
            what = "generate";  // the greedy next token joins the context
            if (len() == 0 || len() > 140) continue;
            auto l = rig.store->next_logits(id);
            ASSERT_TRUE(l.ok()) << l.error().message;
            const int32_t tok = argmax(*l);
            ASSERT_TRUE(rig.store->append(id, std::vector<int32_t>{tok}).ok());
        } else if (kind == 7) {
            what = "evict";
            ASSERT_TRUE(rig.store->evict(id).ok());
        } else if (rng() % 4 == 0) {
            what = "reopen";  // as after a restart: durable contexts stay, the others are gone
            rig.reopen();
            std::vector<std::string> kept;
            for (const auto& i : rig.store->list()) kept.push_back(i.id);
            live = kept;
            if (live.empty()) continue;
            touched = live[rng() % live.size()];
        } else {
            what = "remove";
            ASSERT_TRUE(rig.store->remove(id).ok());
            live.erase(std::find(live.begin(), live.end(), id));
            continue;
        }
        rig.expect_exact(touched, fmt::format("op {} ({})", op, what));
        if (::testing::Test::HasFailure()) return;
    }
}

TEST(Contexts, ForksShareBlocksAndNeverChangeTheirParent) {
    TmpDir d;
    Rig rig(d.path, 256);
    std::mt19937 rng(7);
    const std::vector<int32_t> base = ids(rng, 50);
    ASSERT_TRUE(rig.store->create("parent", base, true).ok());
    const int32_t free_before = rig.pool->allocator().n_free();
    ASSERT_TRUE(rig.store->fork("parent", "child", 40).ok());
    EXPECT_EQ(rig.pool->allocator().n_free(), free_before) << "a fork takes no block until it writes";
    ContextUsage u;
    ASSERT_TRUE(rig.store->append("child", ids(rng, 30), &u).ok());
    EXPECT_EQ(u.prefilled, 30) << "only the new tokens are computed";
    ASSERT_TRUE(rig.store->truncate("child", 5).ok());
    ASSERT_TRUE(rig.store->edit("child", 2, ids(rng, 9)).ok());
    EXPECT_EQ(*rig.store->tokens("parent"), base) << "the parent's tokens are its own";
    rig.expect_exact("parent", "the child's edits");
    rig.expect_exact("child", "its own edits");
    rig.reopen();
    EXPECT_EQ(*rig.store->tokens("parent"), base);
    rig.expect_exact("parent", "a restart");
    rig.expect_exact("child", "a restart");
}

TEST(Contexts, ARestartRestoresFromTheLogWithoutPrefill) {
    TmpDir d;
    Rig rig(d.path, 256);
    std::mt19937 rng(11);
    const std::vector<int32_t> t = ids(rng, 300);
    ContextUsage u;
    ASSERT_TRUE(rig.store->create("long", t, true, &u).ok());
    EXPECT_EQ(u.prefilled, 300);
    ASSERT_TRUE(rig.store->create("scratch", ids(rng, 20), false).ok());
    rig.reopen();
    auto l = rig.store->list();
    ASSERT_EQ(l.size(), 1u) << "the context that was not durable is gone";
    EXPECT_EQ(l[0].id, "long");
    EXPECT_EQ(l[0].n_tokens, 300);
    EXPECT_FALSE(l[0].resident) << "restored on first use";
    EXPECT_GT(l[0].disk_bytes, 300u * kv_layout(model(), KvDtype::F16).bytes_per_token());
    ContextUsage r;
    auto logits = rig.store->next_logits("long", &r);
    ASSERT_TRUE(logits.ok()) << logits.error().message;
    EXPECT_EQ(r.restored, 299) << "every position but the last read back from the log";
    EXPECT_EQ(r.prefilled, 1) << "the last position's logits are not kept on disk: one token computed";
    rig.expect_exact("long", "a restart");
}

// Export then import: the imported context is exact, computes nothing, and (durable)
// is in its log after a restart; a refused blob leaves no block held and no file.
TEST(Contexts, ExportImportRoundTripAndRefusalsHoldNothing) {
    TmpDir d;
    Rig rig(d.path, 128);
    std::mt19937 rng(5);
    const std::vector<int32_t> t = ids(rng, 70);
    ASSERT_TRUE(rig.store->create("src", t, false).ok());
    const std::string blob = d.path + "/src.blob";
    ASSERT_TRUE(rig.store->export_blob("src", blob).ok());
    ContextUsage u;
    auto im = rig.store->import_blob("dst", blob, true, &u);
    ASSERT_TRUE(im.ok()) << im.error().message;
    EXPECT_EQ(im->n_tokens, 70);
    EXPECT_EQ(u.restored, 70);
    EXPECT_EQ(u.prefilled, 0);
    EXPECT_EQ(*rig.store->tokens("dst"), t);
    rig.expect_exact("dst", "an import");
    const int32_t free_before = rig.pool->allocator().n_free();
    // A flipped data byte, another model, a taken id: refused, nothing held or written.
    std::string bytes;
    {
        std::ifstream in(blob, std::ios::binary);
        bytes.assign(std::istreambuf_iterator<char>(in), {});
    }
    auto write = [&](const std::string& path, std::string b) {
        std::ofstream(path, std::ios::binary) << b;
        return path;
    };
    std::string flipped = bytes;
    flipped[flipped.size() / 2] ^= 4;
    auto bad = rig.store->import_blob("bad", write(d.path + "/flip.blob", flipped), true);
    ASSERT_FALSE(bad.ok());
    EXPECT_EQ(bad.error().kind, ErrorKind::Invalid);
    EXPECT_NE(bad.error().message.find("data_crc"), std::string::npos) << bad.error().message;
    auto taken = rig.store->import_blob("dst", blob, true);
    EXPECT_EQ(taken.error().kind, ErrorKind::Exists);
    auto cut = rig.store->import_blob("bad", write(d.path + "/cut.blob", bytes.substr(0, 60)), true);
    EXPECT_EQ(cut.error().kind, ErrorKind::Invalid);
    EXPECT_EQ(rig.pool->allocator().n_free(), free_before) << "refused imports hold no block";
    EXPECT_FALSE(std::filesystem::exists(d.path + "/bad.kvlog")) << "and write no log";
    EXPECT_FALSE(rig.store->info("bad").ok());
    rig.reopen();
    EXPECT_EQ(*rig.store->tokens("dst"), t) << "a durable import is in its log";
    rig.expect_exact("dst", "an import and a restart");
}

// append_with_kv: KV computed elsewhere joins the context; only the positions it
// lacks are computed, and a context changed meanwhile refuses it (its blocks dropped).
TEST(Contexts, KvComputedElsewhereJoinsWithoutBeingComputedAgain) {
    TmpDir d;
    Rig rig(d.path, 128);
    std::mt19937 rng(9);
    const std::vector<int32_t> t = ids(rng, 40), more = ids(rng, 25);
    ASSERT_TRUE(rig.store->create("c", t, true).ok());
    // "Elsewhere": a sequence of the context's tokens and more, computed here in one go.
    std::vector<int32_t> all = t;
    all.insert(all.end(), more.begin(), more.end());
    KvSeq other;
    std::vector<float> logits;
    SeqBatch b{&other, all.data(), 60, false};  // 5 of the 25 new positions left to compute
    {
        Fence::Guard g(rig.fence);  // the backend computes in the arena
        ASSERT_TRUE(rig.kv->reserve({&b, 1}).ok());
        ASSERT_TRUE(rig.backend->forward({&b, 1}, logits).ok());
    }
    ContextUsage u;
    auto r = rig.store->append_with_kv("c", t.size(), more, other.detach(), 60, &u);
    ASSERT_TRUE(r.ok()) << r.error().message;
    EXPECT_EQ(u.prefilled, 5);
    EXPECT_EQ(*rig.store->tokens("c"), all);
    rig.expect_exact("c", "append_with_kv");
    // Edited meanwhile (it has 65 tokens, not 40): refused, nothing changed, nothing held.
    const int32_t free_before = rig.pool->allocator().n_free();
    KvSeq stale;
    SeqBatch b2{&stale, all.data(), 50, false};
    {
        Fence::Guard g(rig.fence);
        ASSERT_TRUE(rig.kv->reserve({&b2, 1}).ok());
        ASSERT_TRUE(rig.backend->forward({&b2, 1}, logits).ok());
    }
    auto refused = rig.store->append_with_kv("c", t.size(), more, stale.detach(), 50);
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.error().kind, ErrorKind::Exists);
    EXPECT_EQ(rig.pool->allocator().n_free(), free_before);
    EXPECT_EQ(*rig.store->tokens("c"), all);
    rig.reopen();
    EXPECT_EQ(*rig.store->tokens("c"), all) << "logged";
    rig.expect_exact("c", "append_with_kv and a restart");
}

TEST(Contexts, IdleContextsGiveWayAndComeBackIdentical) {
    TmpDir d;
    // 28 blocks of 16 positions: room for about four 100-token contexts at once.
    Rig rig(d.path, 28);
    std::mt19937 rng(3);
    std::vector<std::vector<int32_t>> toks;
    for (int i = 0; i < 8; ++i) {
        toks.push_back(ids(rng, 100));
        auto r = rig.store->create(fmt::format("k{}", i), toks.back(), i % 2 == 0);  // half spilled, half logged
        ASSERT_TRUE(r.ok()) << "context " << i << ": " << r.error().message;
    }
    EXPECT_GT(rig.store->evictions(), 0u);
    int resident = 0;
    for (const auto& i : rig.store->list()) resident += i.resident;
    EXPECT_LT(resident, 8);
    for (int i = 0; i < 8; ++i) {  // each restored (some evicted again) as the others come back
        const std::string id = fmt::format("k{}", i);
        ContextUsage u;
        {
            auto r = rig.store->append(id, std::vector<int32_t>{int32_t(500 + i)}, &u);
            ASSERT_TRUE(r.ok()) << id << ": " << r.error().message;
        }
        toks[static_cast<size_t>(i)].push_back(500 + i);
        EXPECT_EQ(*rig.store->tokens(id), toks[static_cast<size_t>(i)]);
        rig.expect_exact(id, "eviction and restore");
    }
}

TEST(Contexts, BadRequestsAreRefusedAndChangeNothing) {
    TmpDir d;
    Rig rig(d.path, 64);
    std::mt19937 rng(5);
    auto kind_of = [](auto r) { return r.ok() ? ErrorKind::Other : r.error().kind; };
    EXPECT_EQ(kind_of(rig.store->create("../etc", ids(rng, 3), true)), ErrorKind::Invalid);
    EXPECT_EQ(kind_of(rig.store->create("", ids(rng, 3), true)), ErrorKind::Invalid);
    EXPECT_EQ(kind_of(rig.store->create(std::string(65, 'a'), ids(rng, 3), true)), ErrorKind::Invalid);
    ASSERT_TRUE(rig.store->create("a", ids(rng, 10), true).ok());
    EXPECT_EQ(kind_of(rig.store->create("a", ids(rng, 3), true)), ErrorKind::Exists);
    EXPECT_EQ(kind_of(rig.store->append("nope", ids(rng, 3))), ErrorKind::NotFound);
    EXPECT_EQ(kind_of(rig.store->truncate("a", 11)), ErrorKind::Invalid);
    EXPECT_EQ(kind_of(rig.store->edit("a", -1, ids(rng, 2))), ErrorKind::Invalid);
    EXPECT_EQ(kind_of(rig.store->fork("a", "a", 3)), ErrorKind::Exists);
    EXPECT_EQ(kind_of(rig.store->fork("a", "b", 99)), ErrorKind::Invalid);
    EXPECT_EQ(rig.store->tokens("a")->size(), 10u);
    ASSERT_TRUE(rig.store->create("empty", {}, true).ok());
    EXPECT_EQ(kind_of(rig.store->next_logits("empty")), ErrorKind::Invalid);
    // More than the pool holds, with nothing to evict: no room, nothing changed.
    const int32_t free_before = rig.pool->allocator().n_free();
    auto big = rig.store->append("a", ids(rng, 64 * 16));
    ASSERT_FALSE(big.ok());
    EXPECT_EQ(big.error().kind, ErrorKind::NoKvBlocks);
    EXPECT_EQ(rig.store->tokens("a")->size(), 10u);
    rig.expect_exact("a", "a refused append");
    EXPECT_GE(rig.pool->allocator().n_free(), free_before - 1);
    ASSERT_TRUE(rig.store->remove("a").ok());
    EXPECT_EQ(kind_of(rig.store->info("a")), ErrorKind::NotFound);
    std::ifstream gone(d.path + "/a.kvlog");
    EXPECT_FALSE(gone.good()) << "remove deletes the log";
}

TEST(Contexts, ATornTailIsCutAndACorruptLogIsRefusedAlone) {
    TmpDir d;
    std::mt19937 rng(9);
    const std::vector<int32_t> a1 = ids(rng, 40), a2 = ids(rng, 30), b = ids(rng, 25);
    {
        Rig rig(d.path, 128);
        ASSERT_TRUE(rig.store->create("torn", a1, true).ok());
        ASSERT_TRUE(rig.store->append("torn", a2).ok());
        ASSERT_TRUE(rig.store->create("bad", b, true).ok());
        ASSERT_TRUE(rig.store->append("bad", ids(rng, 5)).ok());
        ASSERT_TRUE(rig.store->create("fine", b, true).ok());
    }
    // "torn": its last record cut in half, as a crash mid-write leaves it.
    const std::string torn = d.path + "/torn.kvlog";
    const auto size = std::filesystem::file_size(torn);
    const uint64_t last = (70 - 40) * kv_layout(model(), KvDtype::F16).bytes_per_token();
    std::filesystem::resize_file(torn, size - last / 2);
    // "bad": a byte of its first record flipped (a later commit follows: corruption).
    {
        std::fstream f(d.path + "/bad.kvlog", std::ios::in | std::ios::out | std::ios::binary);
        f.seekg(300);
        char c = 0;
        f.read(&c, 1);
        c ^= 0x40;
        f.seekp(300);
        f.write(&c, 1);
    }
    Rig rig(d.path, 128);
    ASSERT_EQ(rig.store->refused().size(), 1u);
    EXPECT_EQ(rig.store->refused()[0].first, "bad.kvlog");
    EXPECT_FALSE(rig.store->refused()[0].second.empty());
    EXPECT_EQ(*rig.store->tokens("torn"), a1) << "cut back to the last valid record";
    rig.expect_exact("torn", "a torn tail");
    rig.expect_exact("fine", "another context's corruption");
    EXPECT_EQ(rig.store->info("bad").error().kind, ErrorKind::NotFound);
    EXPECT_EQ(rig.store->create("bad", b, true).error().kind, ErrorKind::Exists) << "its files are kept for a person";
}

// C2 under SIGKILL: a child process runs operations on a durable context and
// reports the index of each acknowledged one on a pipe; it is killed at a random
// moment. Its operations are a function of a seed, so the parent knows every state
// the context went through: the store opened again must hold the last acknowledged
// state, or the next one (durable, its acknowledgment lost with the process).
namespace {

struct KillScript {
    std::mt19937 rng;
    std::vector<int32_t> tokens;
    explicit KillScript(unsigned seed) : rng(seed) { tokens = ids(rng, 20); }  // op 0: create
    // Op i > 0: (truncate to, tokens to append): a truncation, an edit (both), or an
    // append (no truncation).
    std::pair<int64_t, std::vector<int32_t>> next(int op) {
        const auto n = static_cast<int64_t>(tokens.size());
        if (n > 400) return {20, {}};
        if (op % 5 == 4 && n > 4) return {n - 3, {}};
        if (op % 7 == 3 && n > 8) return {n / 2, ids(rng, static_cast<size_t>(2 + op % 5))};
        return {-1, ids(rng, static_cast<size_t>(1 + op % 7))};
    }
    void apply(const std::pair<int64_t, std::vector<int32_t>>& o) {
        if (o.first >= 0) tokens.resize(static_cast<size_t>(o.first));
        tokens.insert(tokens.end(), o.second.begin(), o.second.end());
    }
};

}  // namespace

TEST(Contexts, SigkillAtAnyMomentKeepsEveryAcknowledgedOperationAndEditsAreAtomic) {
    (void)model();  // loaded before the fork: the child starts at once
    std::mt19937 when(42);
    for (int trial = 0; trial < 8; ++trial) {
        TmpDir d;
        int fds[2];
        ASSERT_EQ(::pipe(fds), 0);
        const unsigned seed = 100 + static_cast<unsigned>(trial);
        const pid_t pid = ::fork();
        ASSERT_GE(pid, 0);
        if (pid == 0) {
            ::close(fds[0]);
            Rig rig(d.path, 256, 32);
            KillScript script(seed);
            if (!rig.store->create("k", script.tokens, true).ok()) ::_exit(2);
            for (int op = 0;; ++op) {
                if (op > 0) {
                    auto o = script.next(op);
                    const bool ok = o.first < 0        ? rig.store->append("k", o.second).ok()
                                    : o.second.empty() ? rig.store->truncate("k", o.first).ok()
                                                       : rig.store->edit("k", o.first, o.second).ok();
                    if (!ok) ::_exit(3);
                    script.apply(o);
                }
                if (::write(fds[1], &op, 4) != 4) ::_exit(4);
            }
        }
        ::close(fds[1]);
        int last = -1, got_op = 0;
        if (::read(fds[0], &got_op, 4) == 4) last = got_op;  // the create is acknowledged
        ::usleep(static_cast<useconds_t>(20000 + when() % 400000));
        ::kill(pid, SIGKILL);
        int status = 0;
        ::waitpid(pid, &status, 0);
        while (::read(fds[0], &got_op, 4) == 4) last = got_op;
        ::close(fds[0]);
        ASSERT_GE(last, 0) << "trial " << trial << ": the child acknowledged nothing";
        KillScript script(seed);
        for (int op = 1; op <= last; ++op) script.apply(script.next(op));
        const std::vector<int32_t> acked = script.tokens;
        script.apply(script.next(last + 1));
        const std::vector<int32_t> in_flight = script.tokens;

        Rig rig(d.path, 256);
        ASSERT_TRUE(rig.store->refused().empty()) << rig.store->refused()[0].second;
        const std::vector<int32_t> got = *rig.store->tokens("k");
        EXPECT_TRUE(got == acked || got == in_flight)
            << "trial " << trial << ": after " << last << " acknowledged operations the log holds " << got.size()
            << " tokens; acknowledged " << acked.size() << ", in flight " << in_flight.size();
        rig.expect_exact("k", fmt::format("SIGKILL trial {} after {} operations", trial, last));
    }
}

// An edit is one record: a crash that tears it leaves the context as it was before,
// never truncated and not appended.
TEST(Contexts, ATornEditLeavesTheContextAsItWas) {
    TmpDir d;
    std::mt19937 rng(13);
    const std::vector<int32_t> before = ids(rng, 60);
    {
        Rig rig(d.path, 128);
        ASSERT_TRUE(rig.store->create("e", before, true).ok());
        ASSERT_TRUE(rig.store->edit("e", 30, ids(rng, 10)).ok());
        EXPECT_EQ(rig.store->tokens("e")->size(), 40u);
    }
    const std::string log = d.path + "/e.kvlog";
    const uint64_t edit_bytes = 10 * kv_layout(model(), KvDtype::F16).bytes_per_token();
    std::filesystem::resize_file(log, std::filesystem::file_size(log) - edit_bytes / 2);
    Rig rig(d.path, 128);
    EXPECT_EQ(*rig.store->tokens("e"), before);
    rig.expect_exact("e", "a torn edit");
}

TEST(Contexts, TheDiskLimitRefusesWritesAndChangesNothing) {
    TmpDir d;
    const uint64_t bpt = kv_layout(model(), KvDtype::F16).bytes_per_token();
    Rig rig(d.path, 128, 24, 100 * bpt);  // room for about 100 positions of logs
    std::mt19937 rng(17);
    ASSERT_TRUE(rig.store->create("a", ids(rng, 60), true).ok());
    auto big = rig.store->append("a", ids(rng, 60));
    ASSERT_FALSE(big.ok());
    EXPECT_EQ(big.error().kind, ErrorKind::Limit);
    EXPECT_NE(big.error().message.find("--contexts-disk-max"), std::string::npos) << big.error().message;
    EXPECT_EQ(rig.store->tokens("a")->size(), 60u);
    EXPECT_EQ(rig.store->fork("a", "b").error().kind, ErrorKind::Limit) << "a durable fork writes all its positions";
    EXPECT_TRUE(rig.store->fork("a", "m", -1, 0).ok()) << "one in memory writes nothing";
    EXPECT_TRUE(rig.store->create("mem", ids(rng, 80), false).ok()) << "contexts in memory are not limited";
    EXPECT_TRUE(rig.store->append("a", ids(rng, 10)).ok()) << "within the limit";
    rig.expect_exact("a", "a refused append");
}

TEST(Contexts, APinnedContextIsNeverEvictedAndIsResidentAfterARestart) {
    TmpDir d;
    std::mt19937 rng(19);
    const std::vector<int32_t> sys = ids(rng, 90);
    {
        Rig rig(d.path, 28);  // 28 blocks: the pinned 6 and room for about two more contexts of 90
        ASSERT_TRUE(rig.store->create("sys", sys, true, nullptr, /*pin=*/true).ok());
        EXPECT_TRUE(rig.store->info("sys")->pinned);
        for (int i = 0; i < 6; ++i) ASSERT_TRUE(rig.store->create(fmt::format("o{}", i), ids(rng, 90), true).ok()) << i;
        EXPECT_GT(rig.store->evictions(), 0u) << "the others gave way";
        EXPECT_TRUE(rig.store->info("sys")->resident) << "the pinned one never does";
        EXPECT_EQ(rig.store->evict("sys").error().kind, ErrorKind::Invalid);
    }
    Rig rig(d.path, 28);
    auto i = rig.store->info("sys");
    ASSERT_TRUE(i.ok()) << i.error().message;
    EXPECT_TRUE(i->pinned && i->resident) << "restored when the store opens";
    EXPECT_FALSE(rig.store->info("o0")->resident) << "the others on first use";
    rig.expect_exact("sys", "a restart");
    ASSERT_TRUE(rig.store->remove("sys").ok());
    EXPECT_FALSE(std::filesystem::exists(d.path + "/sys.pin")) << "remove takes the pin too";
}

// C6: with a table, contexts that are not durable outlive the store's process: the
// next store lists them with exactly their tokens, their KV from their spill blob or
// computed again, exact either way. A put that cannot fit changes nothing.
TEST(Contexts, ContextsThatAreNotDurableOutliveTheStoreThroughTheTable) {
    TmpDir d;
    shm::InstanceConfig ic;
    ic.name = fmt::format("duet-test-ctxtab-{}", ::getpid());
    ic.huge_pages = false;
    ic.contexts = {16, 512};
    auto inst = shm::Instance::create(ic);
    ASSERT_TRUE(inst.ok()) << inst.error().message;
    struct Unlink {
        std::string name;
        ~Unlink() { shm::Instance::unlink(name); }
    } unlink{ic.name};
    auto me = inst->registry().claim(shm::Role::Front, -1, ::getpid());
    ASSERT_TRUE(me.ok());
    ASSERT_TRUE(inst->contexts().claim(*me, inst->registry()).ok());
    Rig rig(d.path, 64);
    rig.table = &inst->contexts();
    rig.reopen();
    std::mt19937 rng(21);
    std::map<std::string, std::vector<int32_t>> want;
    want["a"] = ids(rng, 100);
    want["b"] = ids(rng, 60);
    want["c"] = ids(rng, 50);
    ASSERT_TRUE(rig.store->create("a", want["a"], false).ok());
    ASSERT_TRUE(rig.store->create("b", want["b"], false, nullptr, true).ok());
    ASSERT_TRUE(rig.store->create("c", want["c"], true).ok());
    ASSERT_TRUE(rig.store->create("empty", {}, false).ok());
    want["empty"] = {};
    ASSERT_TRUE(rig.store->fork("a", "a2", 70).ok());
    const std::vector<int32_t> more = ids(rng, 9);
    ASSERT_TRUE(rig.store->append("a2", more).ok());
    want["a2"].assign(want["a"].begin(), want["a"].begin() + 70);
    want["a2"].insert(want["a2"].end(), more.begin(), more.end());
    ASSERT_TRUE(rig.store->truncate("b", 40).ok());
    want["b"].resize(40);
    const std::vector<int32_t> edit = ids(rng, 10);
    ASSERT_TRUE(rig.store->edit("a", 50, edit).ok());
    want["a"].resize(50);
    want["a"].insert(want["a"].end(), edit.begin(), edit.end());
    ASSERT_TRUE(rig.store->evict("a").ok());  // spilled: its KV comes back from the blob
    ASSERT_TRUE(rig.store->create("gone", ids(rng, 20), false).ok());
    ASSERT_TRUE(rig.store->remove("gone").ok());
    // Past a record's 512 tokens: refused, nothing changed.
    auto big = rig.store->append("a2", ids(rng, 600));
    ASSERT_FALSE(big.ok());
    EXPECT_EQ(big.error().kind, ErrorKind::Invalid);
    EXPECT_EQ(*rig.store->tokens("a2"), want["a2"]);
    EXPECT_EQ(inst->contexts().live(), 4u) << "a, a2, b, empty: the durable one is in its log";

    // The next store (a restarted front) over the same table and directory.
    rig.reopen();
    std::map<std::string, std::vector<int32_t>> got;
    for (const ContextInfo& i : rig.store->list()) {
        got[i.id] = *rig.store->tokens(i.id);
        EXPECT_EQ(i.durable, i.id == "c") << i.id;
        EXPECT_EQ(i.pinned, i.id == "b") << i.id;
    }
    EXPECT_EQ(got, want);
    ContextUsage ua, ua2;
    ASSERT_TRUE(rig.store->next_logits("a", &ua).ok());
    EXPECT_EQ(ua.restored, 59) << "read back from the spill blob, the last position computed";
    ASSERT_TRUE(rig.store->next_logits("a2", &ua2).ok());
    EXPECT_EQ(ua2.prefilled, 79) << "no spill: computed again from its tokens";
    for (const auto& [id, toks] : want) rig.expect_exact(id, "a restart with the table");
    // And it goes on: an operation after the restart is recorded too.
    ASSERT_TRUE(rig.store->append("empty", more).ok());
    rig.reopen();
    EXPECT_EQ(*rig.store->tokens("empty"), more);
    // Without the table, they are gone (C6 is the table's doing).
    rig.table = nullptr;
    rig.reopen();
    ASSERT_EQ(rig.store->list().size(), 1u);
    EXPECT_EQ(rig.store->list()[0].id, "c");
}
