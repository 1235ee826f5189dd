// The runtime on the shared-memory arena (duet run's path): the KV data and block
// accounting live in /dev/shm, a generation's blocks are held there while it runs
// and returned after, one instance name cannot be used twice, and a run killed
// with SIGKILL leaves a stale segment that the next run replaces.
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include "engine/engine.h"
#include "shm_test_util.h"

using namespace duet;
using namespace duet::shm::testing;

namespace {

EngineOptions options(const std::string& instance) {
    EngineOptions o;
    o.model_path = DUET_MODEL_PATH;
    o.threads = 1;
    o.n_ctx = 256;
    o.instance = instance;
    return o;
}

// A segment lives in /dev/shm, or in /dev/hugepages where hugetlbfs has room.
bool exists(const std::string& path) {
    struct stat st {};
    if (stat(path.c_str(), &st) == 0) return true;
    const std::string shm = "/dev/shm/";
    return path.rfind(shm, 0) == 0 && stat(("/dev/hugepages/" + path.substr(shm.size())).c_str(), &st) == 0;
}

}  // namespace

TEST(EngineShm, KvBlocksLiveInTheArenaWhileGeneratingAndAreReturned) {
    std::string name = unique_name("eng");
    {
        auto e = Engine::create(options(name));
        ASSERT_TRUE(e.ok()) << e.error().message;
        Engine& eng = **e;
        EXPECT_TRUE(exists("/dev/shm/duet." + name));
        EXPECT_TRUE(exists("/dev/shm/duet." + name + ".kv"));
        shm::Instance& in = eng.shm().instance();
        shm::ProcRef me = eng.shm().self();
        EXPECT_TRUE(in.registry().alive(me));
        EXPECT_EQ(in.registry().pid(me.slot), getpid());
        shm::KvArena& arena = in.arena(0);
        const int32_t user = arena.user_of(me);
        ASSERT_GE(user, 0);
        EXPECT_EQ(arena.n_blocks(), 16u);  // 256 tokens / 16
        // The pool's data is the KV segment's payload.
        EXPECT_EQ(reinterpret_cast<const uint8_t*>(eng.pool().k(0, 0, 0)), in.cpu_kv_data());

        std::vector<int32_t> prompt = eng.tokenizer().encode("The capital of France is", true, false);
        GenerateOptions g;
        g.max_tokens = 40;  // prompt + 40 crosses several 16-token blocks
        g.stop_at_eog = false;
        std::vector<uint32_t> held;
        auto st = eng.generate(prompt, g, [&](int32_t) {
            held.push_back(arena.census().refs_by_user[user]);
            return true;
        });
        ASSERT_TRUE(st.ok()) << st.error().message;
        ASSERT_EQ(held.size(), 40u);
        const size_t n0 = prompt.size();
        // While generating, exactly the blocks covering the sequence are held, by us.
        EXPECT_EQ(held.front(), (n0 + 15) / 16);
        EXPECT_EQ(held.back(), (n0 + 39 + 15) / 16);
        shm::ArenaCensus c = arena.census();
        EXPECT_EQ(c.held, 0u);
        EXPECT_EQ(c.free, c.total);
        EXPECT_EQ(arena.n_free(), 16u);
    }
    EXPECT_FALSE(exists("/dev/shm/duet." + name)) << "a clean exit removes the segments";
    EXPECT_FALSE(exists("/dev/shm/duet." + name + ".kv"));
}

TEST(EngineShm, AnInstanceNameInUseIsRefused) {
    std::string name = unique_name("eng");
    auto a = Engine::create(options(name));
    ASSERT_TRUE(a.ok()) << a.error().message;
    auto b = Engine::create(options(name));
    ASSERT_FALSE(b.ok());
    EXPECT_NE(b.error().message.find("in use by a live instance"), std::string::npos) << b.error().message;
}

TEST(EngineShm, AKilledRunsSegmentsAreReplacedNotReused) {
    std::string name = unique_name("eng");
    int ready[2];
    ASSERT_EQ(pipe(ready), 0);
    pid_t child = fork_run([&] {
        auto e = Engine::create(options(name));
        if (!e.ok()) return 1;
        // Mark the KV data so a reuse would show.
        (*e)->pool().k16(0, 0, 0)[0] = 0x1234;
        char c = 1;
        (void)!write(ready[1], &c, 1);
        pause();
        return 0;
    });
    char c = 0;
    ASSERT_EQ(read(ready[0], &c, 1), 1);
    kill(child, SIGKILL);
    EXPECT_EQ(wait_exit(child), 128 + SIGKILL);
    close(ready[0]);
    close(ready[1]);
    ASSERT_TRUE(exists("/dev/shm/duet." + name + ".kv")) << "SIGKILL leaves the segments behind";
    EXPECT_FALSE(shm::Segment::in_use("duet." + name + ".kv"));

    auto e = Engine::create(options(name));
    ASSERT_TRUE(e.ok()) << e.error().message;
    EXPECT_TRUE((*e)->shm().instance().control_segment().replaced_stale());
    EXPECT_EQ((*e)->pool().k16(0, 0, 0)[0], 0) << "fresh KV data, not the dead run's";
    EXPECT_EQ((*e)->shm().instance().registry().pid(0), getpid()) << "a fresh registry";
}

TEST(EngineShm, LeftoversOfDeadDefaultRunsAreSwept) {
    // A dead `duet run` with the default name pattern leaves duet.run-<pid>-<n>.
    // In this process's own scope (tests/shm_scope.cpp), which Engine's sweep looks at.
    auto scope = shm_scope();
    ASSERT_TRUE(scope.ok() && !scope->empty());
    std::string stale = *scope + "run-999999999-" + std::to_string(getpid());
    pid_t child = fork_run([&] {
        auto e = Engine::create(options(stale));
        if (!e.ok()) return 1;
        kill(getpid(), SIGKILL);
        return 0;
    });
    EXPECT_EQ(wait_exit(child), 128 + SIGKILL);
    ASSERT_TRUE(exists("/dev/shm/duet." + stale));
    auto e = Engine::create(options(""));
    ASSERT_TRUE(e.ok()) << e.error().message;
    EXPECT_FALSE(exists("/dev/shm/duet." + stale));
    EXPECT_FALSE(exists("/dev/shm/duet." + stale + ".kv"));
}

// Tests run side by side each in a scope of their own (DUET_SHM_SCOPE): a start sweeps
// the stale default-named segments of its own scope only, never another scope's (a
// test that left them behind on purpose checks them next), nor a named instance's.
TEST(EngineShm, ASweepLeavesOtherScopesAndNamedInstances) {
    auto scope = shm_scope();
    ASSERT_TRUE(scope.ok() && !scope->empty());
    const std::string other = "o" + std::to_string(getpid());
    const std::string theirs = other + ".run-999999998-" + std::to_string(getpid());
    const std::string named = unique_name("named");
    for (const std::string& name : {theirs, named}) {
        pid_t child = fork_run([&] {
            auto e = Engine::create(options(name));
            if (!e.ok()) return 1;
            kill(getpid(), SIGKILL);
            return 0;
        });
        EXPECT_EQ(wait_exit(child), 128 + SIGKILL);
        ASSERT_TRUE(exists("/dev/shm/duet." + name)) << name;
    }
    {
        auto e = Engine::create(options(""));  // sweeps this process's scope
        ASSERT_TRUE(e.ok()) << e.error().message;
    }
    EXPECT_TRUE(exists("/dev/shm/duet." + theirs)) << "another scope's stale segments are left";
    EXPECT_TRUE(exists("/dev/shm/duet." + named)) << "a named instance's stale segments are left";
    // The other scope's own start removes them.
    const std::string mine = std::getenv("DUET_SHM_SCOPE");
    setenv("DUET_SHM_SCOPE", other.c_str(), 1);
    EXPECT_GE(remove_stale_segments("run-"), 1);
    setenv("DUET_SHM_SCOPE", mine.c_str(), 1);
    EXPECT_FALSE(exists("/dev/shm/duet." + theirs));
    EXPECT_FALSE(exists("/dev/shm/duet." + theirs + ".kv"));
    // A named instance is replaced by name when it starts again.
    auto again = Engine::create(options(named));
    ASSERT_TRUE(again.ok()) << again.error().message;
    EXPECT_TRUE((*again)->shm().instance().control_segment().replaced_stale());
}
