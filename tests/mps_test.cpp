// The --mps launcher side (roles/mps.h) against a stand-in for
// nvidia-cuda-mps-control that behaves as the real one does for what duet uses:
// `-f` runs a daemon in the foreground until `quit` reaches it through a control
// call (no argument, the command on its input) or it is killed; a control call
// answers 0 only while a daemon runs in its CUDA_MPS_PIPE_DIRECTORY. It records
// every call. The daemon itself (and what MPS does to the GPU's processes) needs a
// GPU: the `gpu` test gpu_serve_e2e runs `duet serve --mps` there.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include "roles/mps.h"

using namespace duet;

namespace {

struct FakeControl {
    std::string dir, control, record;
    // daemon: what `-f` does ("serve": run until quit or killed; "exit 3": fail at
    // once; "mute": run without ever answering).
    explicit FakeControl(const std::string& daemon = "serve") {
        dir = ::testing::TempDir() + "/mps-test-" + std::to_string(::getpid()) + "-" + std::to_string(next++);
        std::filesystem::create_directories(dir);
        control = dir + "/fake-mps-control";
        record = dir + "/record";
        std::ofstream f(control);
        f << "#!/bin/sh\n"
          << "rec='" << record << "'\n"
          << "p=\"$CUDA_MPS_PIPE_DIRECTORY\"\n"
          << "if [ \"$1\" = -f ]; then\n"
          << "  echo \"daemon pipe=$p log=$CUDA_MPS_LOG_DIRECTORY notify=${NOTIFY_SOCKET:-none}\" >> \"$rec\"\n";
        if (daemon == "exit 3") {
            f << "  exit 3\n";
        } else {
            if (daemon == "serve") f << "  touch \"$p/up\"\n";
            f << "  trap 'echo daemon-terminated >> \"$rec\"; rm -f \"$p/up\"; exit 0' TERM\n"
              << "  while [ ! -f \"$p/quit\" ]; do sleep 0.02; done\n"
              << "  echo daemon-quit >> \"$rec\"; rm -f \"$p/up\"; exit 0\n";
        }
        f << "fi\n"
          << "in=$(cat)\n"
          << "[ -f \"$p/up\" ] || exit 1\n"
          << "echo \"call input=$in\" >> \"$rec\"\n"
          << "[ \"$in\" = quit ] && touch \"$p/quit\"\n"
          << "exit 0\n";
        f.close();
        ::chmod(control.c_str(), 0755);
    }
    ~FakeControl() { std::filesystem::remove_all(dir); }
    std::string said() const {
        std::ifstream f(record);
        std::stringstream s;
        s << f.rdbuf();
        return s.str();
    }
    bool says(const std::string& what) const { return said().find(what) != std::string::npos; }
    static inline int next = 0;
};

bool alive(pid_t pid) { return ::kill(pid, 0) == 0; }

TEST(Mps, RunsTheDaemonInAPrivateDirectoryAndQuitsItOnce) {
    FakeControl fake;
    ::setenv("NOTIFY_SOCKET", "/run/systemd/notify", 1);  // not the daemon's to use
    auto d = MpsDaemon::start(fake.dir, "duet-mps-test-", fake.control);
    ::unsetenv("NOTIFY_SOCKET");
    ASSERT_TRUE(d.ok()) << d.error().message;
    const std::string home = d->dir();
    EXPECT_EQ(home.rfind(fake.dir + "/duet-mps-test-", 0), 0u) << home;
    struct stat st {};
    for (const std::string& p : {home, d->pipe_dir(), d->log_dir()}) {
        ASSERT_EQ(::lstat(p.c_str(), &st), 0) << p;
        EXPECT_TRUE(S_ISDIR(st.st_mode)) << p;
        EXPECT_EQ(st.st_mode & 0777, 0700u) << p;
        EXPECT_EQ(st.st_uid, ::geteuid()) << p;
    }
    EXPECT_TRUE(fake.says("daemon pipe=" + home + "/pipe log=" + home + "/log notify=none")) << fake.said();
    EXPECT_TRUE(fake.says("call input=get_server_list")) << "ready only once it answered: " << fake.said();
    const pid_t pid = d->pid();
    EXPECT_TRUE(alive(pid));
    ASSERT_TRUE(d->stop().ok());
    EXPECT_TRUE(fake.says("call input=quit\ndaemon-quit\n")) << fake.said();
    EXPECT_FALSE(alive(pid)) << "reaped";
    EXPECT_FALSE(std::filesystem::exists(home));
    const std::string before = fake.said();
    EXPECT_TRUE(d->stop().ok());  // once
    EXPECT_EQ(fake.said(), before);
}

TEST(Mps, TwoDaemonsOfOneInstanceNameDoNotMeet) {
    FakeControl fake;
    auto a = MpsDaemon::start(fake.dir, "duet-mps-same-", fake.control);
    auto b = MpsDaemon::start(fake.dir, "duet-mps-same-", fake.control);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_NE(a->dir(), b->dir());
    ASSERT_TRUE(a->stop().ok());
    EXPECT_TRUE(alive(b->pid()));
}

TEST(Mps, TheDestructorQuitsADaemonNotStopped) {
    FakeControl fake;
    { ASSERT_TRUE(MpsDaemon::start(fake.dir, "d-", fake.control).ok()); }
    EXPECT_TRUE(fake.says("daemon-quit")) << fake.said();
}

// A launcher killed (SIGKILL: no destructor runs) takes its daemon with it.
TEST(Mps, TheDaemonEndsWithALauncherKilled) {
    FakeControl fake;
    const pid_t launcher = ::fork();
    ASSERT_GE(launcher, 0);
    if (launcher == 0) {
        auto d = MpsDaemon::start(fake.dir, "d-", fake.control);
        if (!d) ::_exit(1);
        ::pause();
        ::_exit(0);
    }
    for (int i = 0; i < 500 && !fake.says("get_server_list"); ++i)
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
    ASSERT_TRUE(fake.says("get_server_list")) << fake.said();
    ::kill(launcher, SIGKILL);
    ::waitpid(launcher, nullptr, 0);
    for (int i = 0; i < 500 && !fake.says("daemon-terminated"); ++i)
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
    EXPECT_TRUE(fake.says("daemon-terminated")) << fake.said();
}

TEST(Mps, ExportsTheDirectoriesForTheChildren) {
    FakeControl fake;
    auto d = MpsDaemon::start(fake.dir, "d-", fake.control);
    ASSERT_TRUE(d.ok());
    ASSERT_TRUE(d->export_env().ok());
    EXPECT_EQ(std::string(std::getenv("CUDA_MPS_PIPE_DIRECTORY")), d->pipe_dir());
    EXPECT_EQ(std::string(std::getenv("CUDA_MPS_LOG_DIRECTORY")), d->log_dir());
    ::unsetenv("CUDA_MPS_PIPE_DIRECTORY");
    ::unsetenv("CUDA_MPS_LOG_DIRECTORY");
}

TEST(Mps, ErrorsNameTheControlAndWhyAndLeaveNoDirectory) {
    FakeControl failing("exit 3");
    auto d = MpsDaemon::start(failing.dir, "d-", failing.control);
    ASSERT_FALSE(d.ok());
    EXPECT_NE(d.error().message.find("exited with status 3 before answering"), std::string::npos) << d.error().message;

    FakeControl mute("mute");
    auto m = MpsDaemon::start(mute.dir, "d-", mute.control, 0.5);
    ASSERT_FALSE(m.ok());
    EXPECT_NE(m.error().message.find("did not answer within 0.5 s"), std::string::npos) << m.error().message;

    auto missing = MpsDaemon::start(failing.dir, "d-", "no-such-mps-control");
    ASSERT_FALSE(missing.ok());
    EXPECT_NE(missing.error().message.find("no-such-mps-control not found"), std::string::npos)
        << missing.error().message;
    for (const auto& e : std::filesystem::directory_iterator(failing.dir))
        EXPECT_NE(e.path().filename().string().rfind("d-", 0), 0u) << "left behind: " << e.path();
    for (const auto& e : std::filesystem::directory_iterator(mute.dir))
        EXPECT_NE(e.path().filename().string().rfind("d-", 0), 0u) << "left behind: " << e.path();
}

}  // namespace
