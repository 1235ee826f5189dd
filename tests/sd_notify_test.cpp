// SdNotify (src/roles/sd_notify.h) against a datagram socket standing in for
// systemd's: the messages' exact text, the watchdog's rate limit, and off when the
// environment does not ask for it (no NOTIFY_SOCKET; WATCHDOG_PID of another process).
#include <gtest/gtest.h>

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

#include "roles/sd_notify.h"

using namespace duet;

namespace {

class Listener {
public:
    Listener() {
        path_ = "/tmp/duet-sd-notify-test-" + std::to_string(getpid());
        ::unlink(path_.c_str());
        fd_ = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
        sockaddr_un a{};
        a.sun_family = AF_UNIX;
        path_.copy(a.sun_path, sizeof a.sun_path - 1);
        EXPECT_EQ(::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
        timeval tv{0, 200000};
        ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    }
    ~Listener() {
        ::close(fd_);
        ::unlink(path_.c_str());
    }
    const std::string& path() const { return path_; }
    // The next datagram, or "" after 200 ms without one.
    std::string next() {
        char buf[4096];
        const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
        return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
    }

private:
    std::string path_;
    int fd_ = -1;
};

void clear_env() {
    ::unsetenv("NOTIFY_SOCKET");
    ::unsetenv("WATCHDOG_USEC");
    ::unsetenv("WATCHDOG_PID");
}

}  // namespace

TEST(SdNotify, MessagesAsSystemdReadsThem) {
    Listener l;
    clear_env();
    ::setenv("NOTIFY_SOCKET", l.path().c_str(), 1);
    SdNotify& n = SdNotify::init();
    ASSERT_TRUE(n.enabled());
    EXPECT_EQ(n.watchdog_usec(), 0u);
    n.status("loading model.gguf");
    EXPECT_EQ(l.next(), "STATUS=loading model.gguf");
    n.extend_timeout(90000000);
    EXPECT_EQ(l.next(), "EXTEND_TIMEOUT_USEC=90000000");
    n.ready("serving on http://127.0.0.1:8080");
    EXPECT_EQ(l.next(), "READY=1\nSTATUS=serving on http://127.0.0.1:8080");
    n.watchdog(1'000'000'000);  // no WATCHDOG_USEC: no ping
    n.stopping("draining");
    EXPECT_EQ(l.next(), "STOPPING=1\nSTATUS=draining");
    EXPECT_EQ(l.next(), "");
    clear_env();
}

TEST(SdNotify, WatchdogPingsAtMostEveryQuarterPeriod) {
    Listener l;
    clear_env();
    ::setenv("NOTIFY_SOCKET", l.path().c_str(), 1);
    ::setenv("WATCHDOG_USEC", "400000", 1);  // 400 ms: a ping at most every 100 ms
    SdNotify& n = SdNotify::init();
    ASSERT_EQ(n.watchdog_usec(), 400000u);
    const uint64_t t0 = 5'000'000'000;
    n.watchdog(t0);
    EXPECT_EQ(l.next(), "WATCHDOG=1");
    n.watchdog(t0 + 50'000'000);  // too soon
    n.watchdog(t0 + 99'999'999);
    n.watchdog(t0 + 100'000'000);
    EXPECT_EQ(l.next(), "WATCHDOG=1");
    EXPECT_EQ(l.next(), "") << "one ping per quarter period";
    clear_env();
}

TEST(SdNotify, OffWithoutTheSocketOrForAnotherPid) {
    Listener l;
    clear_env();
    ::setenv("WATCHDOG_USEC", "400000", 1);
    SdNotify& off = SdNotify::init();
    EXPECT_FALSE(off.enabled());
    off.ready("x");
    off.watchdog(1);
    ::setenv("NOTIFY_SOCKET", l.path().c_str(), 1);
    ::setenv("WATCHDOG_PID", std::to_string(getpid() + 1).c_str(), 1);  // another process's watchdog
    SdNotify& other = SdNotify::init();
    EXPECT_TRUE(other.enabled());
    EXPECT_EQ(other.watchdog_usec(), 0u);
    other.watchdog(1);
    EXPECT_EQ(l.next(), "");
    clear_env();
}
