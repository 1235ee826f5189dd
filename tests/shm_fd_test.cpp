// The fd keeper with a memfd standing in for a GPU allocation exported as a POSIX fd:
// a process deposits it and dies, others fetch and map the same memory; racing
// deposits agree on one; bad requests and a missing keeper get clear errors, and
// nothing waits for ever.
#include "shm/fd_keeper.h"

#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>

#include <cstring>

#include <gtest/gtest.h>

#include "shm_test_util.h"

using namespace duet::shm;
using namespace duet::shm::testing;

namespace {

constexpr size_t kBytes = 1 << 20;

int make_allocation(uint8_t fill) {
    const int fd = memfd_create("fake-kv-arena", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, kBytes) != 0) return -1;
    void* p = mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) return -1;
    std::memset(p, fill, kBytes);
    munmap(p, kBytes);
    return fd;
}

uint8_t* map(int fd) {
    void* p = mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    return p == MAP_FAILED ? nullptr : static_cast<uint8_t*>(p);
}

ino_t inode(int fd) {
    struct stat st{};
    fstat(fd, &st);
    return st.st_ino;
}

}  // namespace

TEST(FdKeeper, AnAllocationOutlivesTheProcessThatMadeItAndIsSharedByTheOthers) {
    const std::string inst = unique_name("fdk");
    auto keeper = FdKeeper::start(inst);
    ASSERT_TRUE(keeper.ok()) << keeper.error().message;
    EXPECT_FALSE(FdKeeper::start(inst).ok()) << "one keeper per instance";

    // The creator deposits its allocation and dies (SIGKILL: nothing closed politely).
    pid_t creator = fork_run([&] {
        const int fd = make_allocation(0xab);
        if (fd < 0) return 2;
        auto kept = fd_put(inst, "kv.0", fd, "bytes=1048576 device=0");
        if (!kept.ok()) return 3;
        raise(SIGKILL);
        return 4;
    });
    EXPECT_EQ(wait_exit(creator), 128 + SIGKILL);
    EXPECT_EQ((*keeper)->size(), 1u);

    // Another process maps it, finds the creator's bytes, writes its own.
    pid_t user = fork_run([&] {
        auto kept = fd_get(inst, "kv.0");
        if (!kept.ok() || kept->meta != "bytes=1048576 device=0") return 2;
        uint8_t* p = map(kept->fd);
        if (!p) return 3;
        for (size_t i = 0; i < kBytes; i += 4096)
            if (p[i] != 0xab) return 4;
        std::memset(p, 0x5c, kBytes);
        return 0;
    });
    EXPECT_EQ(wait_exit(user), 0);
    // And this one sees that write: one allocation, three processes.
    auto kept = fd_get(inst, "kv.0");
    ASSERT_TRUE(kept.ok()) << kept.error().message;
    uint8_t* p = map(kept->fd);
    ASSERT_NE(p, nullptr);
    EXPECT_EQ(p[0], 0x5c);
    EXPECT_EQ(p[kBytes - 1], 0x5c);
    munmap(p, kBytes);
    close(kept->fd);

    auto missing = fd_get(inst, "kv.7");
    ASSERT_FALSE(missing.ok());
    EXPECT_NE(missing.error().message.find("'kv.7' is not kept"), std::string::npos) << missing.error().message;
}

TEST(FdKeeper, RacingDepositsAgreeOnTheFirst) {
    const std::string inst = unique_name("fdk");
    auto keeper = FdKeeper::start(inst);
    ASSERT_TRUE(keeper.ok()) << keeper.error().message;
    struct Shared {
        std::atomic<int> go;
        ino_t got[4];
        uint8_t fill[4];
    };
    SegmentGuard guard{unique_name("fdkshared")};
    SegmentOptions o;
    o.payload_bytes = 4096;
    auto seg = Segment::create(guard.name, o);
    ASSERT_TRUE(seg.ok());
    auto* sh = new (seg->payload()) Shared{};
    std::vector<pid_t> kids;
    for (int i = 0; i < 4; ++i)
        kids.push_back(fork_run([&, i] {
            const int fd = make_allocation(static_cast<uint8_t>(i + 1));
            while (!sh->go.load()) usleep(100);
            auto kept = fd_put(inst, "kv.race", fd, "");
            if (!kept.ok()) return 2;
            sh->got[i] = inode(kept->fd);
            uint8_t* p = map(kept->fd);
            sh->fill[i] = p ? p[100] : 0;
            return 0;
        }));
    sh->go.store(1);
    for (pid_t k : kids) EXPECT_EQ(wait_exit(k), 0);
    for (int i = 1; i < 4; ++i) {
        EXPECT_EQ(sh->got[i], sh->got[0]) << "process " << i << " got another allocation";
        EXPECT_EQ(sh->fill[i], sh->fill[0]);
    }
    EXPECT_GE(sh->fill[0], 1);
    EXPECT_LE(sh->fill[0], 4);
    EXPECT_EQ((*keeper)->size(), 1u);
}

TEST(FdKeeper, BadRequestsAndAMissingKeeperGetClearErrors) {
    const std::string inst = unique_name("fdk");
    auto none = fd_get(inst, "kv.0", 200);
    ASSERT_FALSE(none.ok());
    EXPECT_NE(none.error().message.find("no fd keeper is running"), std::string::npos) << none.error().message;
    EXPECT_FALSE(fd_get(inst, "", 200).ok());
    EXPECT_FALSE(fd_get(inst, std::string(80, 'k'), 200).ok());
    EXPECT_FALSE(fd_put(inst, "kv.0", -1, "").ok());

    auto keeper = FdKeeper::start(inst);
    ASSERT_TRUE(keeper.ok()) << keeper.error().message;
    // Garbage, a truncated message, a client that says nothing: refused or timed
    // out, and the keeper goes on serving.
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    const std::string name = "duet." + inst + ".fds";
    std::memcpy(a.sun_path + 1, name.data(), name.size());
    const socklen_t len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
    for (const std::string& junk : {std::string("xyz"), std::string(400, '\xff'), std::string()}) {
        const int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
        ASSERT_EQ(connect(s, reinterpret_cast<const sockaddr*>(&a), len), 0);
        if (!junk.empty()) {
            ASSERT_EQ(send(s, junk.data(), junk.size(), MSG_NOSIGNAL), static_cast<ssize_t>(junk.size()));
        }
        close(s);
    }
    const int fd = make_allocation(7);
    auto put = fd_put(inst, "kv.0", fd, "m");
    ASSERT_TRUE(put.ok()) << put.error().message;
    EXPECT_EQ((*keeper)->refused(), 3u) << "served in order: the three before this one";
    EXPECT_EQ(inode(put->fd), inode(fd));
    close(fd);
    close(put->fd);

    // The keeper gone: a clear error at once, no wait.
    keeper->reset();
    auto gone = fd_get(inst, "kv.0", 5000);
    ASSERT_FALSE(gone.ok());
    EXPECT_NE(gone.error().message.find("no fd keeper is running"), std::string::npos) << gone.error().message;
}
