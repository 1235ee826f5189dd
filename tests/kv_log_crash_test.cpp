// Kill test of the KV append log (src/kv/KVLOG.md W1, W2, W8, R1, R5): a child
// process appends and truncates two contexts from two threads through one
// KvLogSync over UringLogDevice (group commit), compacting now and then, and writes
// to a pipe each op it got acknowledged; the parent SIGKILLs it at a random instant,
// hundreds of times, and after each kill recovers both logs (kv_log_scan and
// KvLog::open, tests/kv_log_model.h): exactly a prefix of the op sequence, holding
// every acknowledged op, every token and KV byte equal to the model's. Most rounds
// go on from the recovered logs (the child recovers them again, then appends), some
// start from nothing, some kill the child while it is still recovering.
//
// A SIGKILL loses no page the process wrote (the kernel still holds them), so this
// tests the process-crash half: torn records of an interrupted write, records
// written but not acknowledged, compaction interrupted between its renames. What a
// power loss does to unsynced pages is kv_log_fault_test's part.
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <random>
#include <thread>

#include <gtest/gtest.h>

#include "require.h"
#include "kv_log_model.h"

using namespace duet;
using namespace duet::kvtest;

namespace {

constexpr int kLogs = 2;
constexpr uint64_t kMaxOpsPerRound = 4000;

enum MsgKind : uint32_t { kReady = 1, kAck = 2, kCompacted = 3, kFailed = 4 };
struct Msg {
    uint32_t log;
    uint32_t kind;
    uint64_t count;  // kAck: ops acknowledged so far; kCompacted: ops the checkpoint holds
};
static_assert(sizeof(Msg) == 16);  // below PIPE_BUF: each write is atomic

// The child compacts after the op that makes `count` ops, when this says so.
bool compact_at(uint64_t seed, uint64_t count) { return count > 0 && hash(seed, {count, 0x6370}) % 24 == 0; }

// One context's history across rounds, as the parent knows it (the child gets a
// copy by fork).
struct Chain {
    uint64_t seed = 0;
    KvDtype dt = KvDtype::F16;
    std::string ctx;
    bool exists = false;     // a log was created
    std::vector<KvOp> ops;   // what the log held at the last recovery
    KvModel model;           // the context after them
    uint64_t generation = 0;
    std::optional<uint64_t> cp_ops;
};

void send(int fd, uint32_t log, uint32_t kind, uint64_t count) {
    const Msg m{log, kind, count};
    (void)!::write(fd, &m, sizeof m);
}

struct ChildShared {
    std::string dir;
    std::array<Chain, kLogs> chains;
    int fd;
};

// The child: one thread per context recovers it (or creates it), then appends and
// truncates until killed.
int child_main(const ChildShared& s) {
    auto dev = UringLogDevice::create();
    if (!dev) {
        std::fprintf(stderr, "kv_log_crash child: %s\n", dev.error().message.c_str());
        send(s.fd, 0, kFailed, 0);
        return 2;
    }
    KvLogSync sync(**dev);
    std::vector<std::thread> th;
    for (uint32_t i = 0; i < kLogs; ++i)
        th.emplace_back([&, i] {
            const Chain& c = s.chains[i];
            KvWriter w(c.seed, c.dt, s.dir, c.ctx);
            const auto fail = [&](const std::string& why) {
                std::fprintf(stderr, "kv_log_crash child, log %u: %s\n", i, why.c_str());
                send(s.fd, i, kFailed, 0);
            };
            if (c.exists) {
                w.e.ops = c.ops;
                w.e.acked = c.ops.size();
                w.model = c.model;
                auto log = KvLog::open(sync, s.dir, c.ctx, w.e.id, w.pool.get(), &w.seq);
                if (!log) return fail("recovery: " + log.error().message);
                w.log = std::move(*log);
                if (static_cast<uint64_t>(w.seq.n_tokens()) != w.model.len())
                    return fail("recovered another length than the parent did");
            } else if (Status st = w.create(sync); !st) {
                return fail("create: " + st.error().message);
            }
            send(s.fd, i, kReady, w.e.ops.size());
            for (uint64_t n = 0; n < kMaxOpsPerRound; ++n) {
                if (Status st = w.step(); !st) return fail("append: " + st.error().message);
                const uint64_t count = w.e.ops.size();
                send(s.fd, i, kAck, count);
                if (compact_at(c.seed, count)) {
                    if (Status st = w.compact(); !st) return fail("compact: " + st.error().message);
                    send(s.fd, i, kCompacted, count);
                }
            }
        });
    for (auto& t : th) t.join();
    for (;;) ::pause();  // done with the round's ops: wait to be killed
}

struct Stats {
    int rounds = 0, early_kills = 0, fresh = 0;
    uint64_t acked = 0, recovered = 0;
    int unacked_recovered = 0, torn = 0, compactions = 0, compaction_landed_unreported = 0, compaction_cut_short = 0;
};

// Reads messages from fd until EOF (the child is dead) or, with wait_ready, until
// every log reported ready (false on a 20 s timeout).
bool read_msgs(int fd, std::vector<Msg>& msgs, std::string& partial, bool wait_ready) {
    const auto readies = [&] {
        int n = 0;
        for (const Msg& m : msgs) n += m.kind == kReady;
        return n;
    };
    for (;;) {
        if (wait_ready && (readies() >= kLogs || std::any_of(msgs.begin(), msgs.end(), [](const Msg& m) {
                               return m.kind == kFailed;
                           })))
            return true;
        pollfd p{fd, POLLIN, 0};
        if (::poll(&p, 1, 20000) <= 0) return false;
        char buf[4096];
        const ssize_t r = ::read(fd, buf, sizeof buf);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return !wait_ready;
        partial.append(buf, static_cast<size_t>(r));
        while (partial.size() >= sizeof(Msg)) {
            Msg m;
            std::memcpy(&m, partial.data(), sizeof m);
            msgs.push_back(m);
            partial.erase(0, sizeof m);
        }
    }
}

}  // namespace

TEST(KvLogCrash, RandomSigkillsLoseNoAcknowledgedRecord) {
    {
        auto probe = UringLogDevice::create();
        if (!probe) DUET_SKIP_UNLESS_REQUIRED("io_uring", "io_uring unavailable here: " + probe.error().message);
    }
    const int rounds = static_cast<int>(1000 * stress_scale());
    TempDir tmp;
    std::mt19937_64 rng(20261201);
    std::array<Chain, kLogs> chains;
    SyncLogDevice plain;
    KvLogSync sync(plain);
    Stats st;
    const auto t0 = std::chrono::steady_clock::now();
    for (int round = 0; round < rounds; ++round) {
        SCOPED_TRACE(testing::Message() << "round " << round);
        if (round % 9 == 0) {  // from nothing
            tmp.clear();
            for (int i = 0; i < kLogs; ++i) {
                Chain& c = chains[i];
                c = Chain{};
                c.seed = 1000003ull * round + i;
                c.dt = (round / 9 + i) % 2 ? KvDtype::Int8 : KvDtype::F16;
                c.ctx = "ctx" + std::to_string(i);
                c.model.seed = c.seed;
            }
            ++st.fresh;
        }
        int p[2];
        ASSERT_EQ(::pipe(p), 0);
        ChildShared shared{tmp.path, chains, p[1]};
        const pid_t pid = ::fork();
        ASSERT_GE(pid, 0);
        if (pid == 0) {
            ::prctl(PR_SET_PDEATHSIG, SIGKILL);
            ::close(p[0]);
            ::_exit(child_main(shared));
        }
        ::close(p[1]);
        std::vector<Msg> msgs;
        std::string partial;
        const bool early = rng() % 8 == 0;  // killed while creating or recovering its logs
        if (early) {
            ++st.early_kills;
            std::this_thread::sleep_for(std::chrono::microseconds(rng() % 3000));
        } else {
            const bool ready = read_msgs(p[0], msgs, partial, true);
            if (!ready) {
                ::kill(pid, SIGKILL);
                ::waitpid(pid, nullptr, 0);
                ::close(p[0]);
                FAIL() << "the child never became ready";
            }
            std::this_thread::sleep_for(std::chrono::microseconds(rng() % 12000));
        }
        ::kill(pid, SIGKILL);
        int status = 0;
        ASSERT_EQ(::waitpid(pid, &status, 0), pid);
        read_msgs(p[0], msgs, partial, false);
        ::close(p[0]);
        ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "the child exited on its own";
        for (const Msg& m : msgs) ASSERT_NE(m.kind, kFailed) << "the child failed on log " << m.log << " (its stderr says why)";
        ASSERT_TRUE(partial.empty());

        for (uint32_t i = 0; i < kLogs; ++i) {
            SCOPED_TRACE(testing::Message() << "log " << i);
            Chain& c = chains[i];
            uint64_t acked = c.ops.size(), compacted_at = 0;
            int compactions = 0;
            for (const Msg& m : msgs) {
                if (m.log != i) continue;
                if (m.kind == kAck) acked = std::max(acked, m.count);
                if (m.kind == kCompacted) {
                    ++compactions;
                    compacted_at = m.count;
                }
            }
            const std::string path = tmp.path + "/" + c.ctx + ".kvlog";
            if (file_size(path) == 0) {  // killed before its log was renamed into place
                ASSERT_FALSE(c.exists);
                ASSERT_EQ(acked, 0u);
                continue;
            }
            // What the log may hold: the ops up to the acknowledged ones and the one after.
            KvExpect e;
            e.seed = c.seed;
            e.layout = test_layout(c.dt);
            e.ops = c.ops;
            KvModel m = c.model;
            while (e.ops.size() < acked + 1) {
                e.ops.push_back(make_op(c.seed, e.ops.size(), m.len()));
                m.apply(e.ops.back());
            }
            e.acked = acked;
            e.generation = c.generation + compactions;
            e.cp_ops = compactions ? std::optional<uint64_t>(compacted_at) : c.cp_ops;
            // A compaction the child was killed in may have landed (its new log renamed
            // into place) without being reported: only right after the last ack.
            auto peek = kv_log_scan(path, &e.id);
            ASSERT_TRUE(peek.ok()) << peek.error().message;
            if (peek->header.generation == e.generation + 1) {
                ASSERT_TRUE(compact_at(c.seed, acked)) << "a compaction no op called for";
                e.generation += 1;
                e.cp_ops = acked;
                ++st.compaction_landed_unreported;
            } else {
                ASSERT_EQ(peek->header.generation, e.generation);
            }
            // Leftovers of a compaction killed before its new log was renamed into
            // place (recover_and_check checks that open removes them).
            for (const std::string& name : dir_names(tmp.path))
                if (name.rfind(c.ctx + ".", 0) == 0 && name != c.ctx + ".kvlog" &&
                    name != c.ctx + "." + std::to_string(e.generation) + ".kvblob") {
                    ++st.compaction_cut_short;
                    break;
                }
            Recovered r;
            ASSERT_NO_FATAL_FAILURE(recover_and_check(sync, tmp.path, c.ctx, e, r));
            st.torn += r.scan.torn;
            st.unacked_recovered += r.k > acked;
            st.acked += acked - std::min<uint64_t>(acked, c.ops.size());
            st.recovered += r.k - c.ops.size();
            st.compactions += compactions;
            c.exists = true;
            c.ops.assign(e.ops.begin(), e.ops.begin() + static_cast<ptrdiff_t>(r.k));
            c.model = r.model;
            c.generation = e.generation;
            c.cp_ops = e.cp_ops;
        }
        ++st.rounds;
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("%d rounds in %.1f s (%d from nothing, %d killed while recovering): %llu ops acknowledged, %llu "
                "recovered; %d times the in-flight op was recovered unacknowledged, %d torn tails cut; %d "
                "compactions reported, %d landed unreported, %d killed before landing\n",
                st.rounds, secs, st.fresh, st.early_kills, static_cast<unsigned long long>(st.acked),
                static_cast<unsigned long long>(st.recovered), st.unacked_recovered, st.torn, st.compactions,
                st.compaction_landed_unreported, st.compaction_cut_short);
    EXPECT_GT(st.acked, static_cast<uint64_t>(rounds)) << "the child barely appended anything before each kill";
    EXPECT_GT(st.compactions, 0);
    EXPECT_GT(st.unacked_recovered, 0) << "no kill landed between a record's write and its acknowledgment";
}
