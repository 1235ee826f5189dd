// The --mps launcher side (roles/mps.h) against a stand-in for
// nvidia-cuda-mps-control that records how it was run: `-d` with the instance's
// pipe and log directories in its environment, then `quit` on its input, once.
// The daemon itself (and what MPS does to the GPU's processes) needs a GPU: the
// `gpu` test gpu_serve_e2e runs `duet serve --mps` there.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "roles/mps.h"

using namespace duet;

namespace {

struct FakeControl {
    std::string dir, control, record;
    explicit FakeControl(int exit_code = 0) {
        dir = ::testing::TempDir() + "/mps-test-" + std::to_string(::getpid()) + "-" + std::to_string(next++);
        std::filesystem::create_directories(dir);
        control = dir + "/fake-mps-control";
        record = dir + "/record";
        std::ofstream f(control);
        f << "#!/bin/sh\n"
          << "{ echo \"args=$*\"; echo \"pipe=$CUDA_MPS_PIPE_DIRECTORY\"; echo \"log=$CUDA_MPS_LOG_DIRECTORY\";\n"
          << "  [ \"$1\" = \"-d\" ] || echo \"input=$(cat)\"; } >> '" << record << "'\n"
          << "exit " << exit_code << "\n";
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
    static inline int next = 0;
};

TEST(Mps, StartsTheDaemonWithTheInstancesDirectoriesAndQuitsItOnce) {
    FakeControl fake;
    const std::string home = fake.dir + "/duet-mps-test";
    {
        auto d = MpsDaemon::start(home, fake.control);
        ASSERT_TRUE(d.ok()) << d.error().message;
        EXPECT_EQ(d->pipe_dir(), home + "/pipe");
        struct stat st {};
        ASSERT_EQ(::stat(d->pipe_dir().c_str(), &st), 0);
        EXPECT_EQ(st.st_mode & 0777, 0700u);
        ASSERT_EQ(::stat(d->log_dir().c_str(), &st), 0);
        EXPECT_EQ(fake.said(), "args=-d\npipe=" + home + "/pipe\nlog=" + home + "/log\n");
        ASSERT_TRUE(d->stop().ok());
        EXPECT_TRUE(d->stop().ok());  // once: nothing more is sent
    }                                 // nor by the destructor
    EXPECT_EQ(fake.said(), "args=-d\npipe=" + home + "/pipe\nlog=" + home + "/log\n" + "args=\npipe=" + home +
                               "/pipe\nlog=" + home + "/log\ninput=quit\n");
}

TEST(Mps, TheDestructorQuitsADaemonNotStopped) {
    FakeControl fake;
    { ASSERT_TRUE(MpsDaemon::start(fake.dir + "/d", fake.control).ok()); }
    EXPECT_NE(fake.said().find("input=quit"), std::string::npos) << fake.said();
}

TEST(Mps, ExportsTheDirectoriesForTheChildren) {
    FakeControl fake;
    auto d = MpsDaemon::start(fake.dir + "/d", fake.control);
    ASSERT_TRUE(d.ok());
    ASSERT_TRUE(d->export_env().ok());
    EXPECT_EQ(std::string(std::getenv("CUDA_MPS_PIPE_DIRECTORY")), d->pipe_dir());
    EXPECT_EQ(std::string(std::getenv("CUDA_MPS_LOG_DIRECTORY")), d->log_dir());
    ::unsetenv("CUDA_MPS_PIPE_DIRECTORY");
    ::unsetenv("CUDA_MPS_LOG_DIRECTORY");
}

TEST(Mps, ErrorsNameTheControlAndWhy) {
    FakeControl failing(3);
    auto d = MpsDaemon::start(failing.dir + "/d", failing.control);
    ASSERT_FALSE(d.ok());
    EXPECT_NE(d.error().message.find("exited with status 3"), std::string::npos) << d.error().message;
    EXPECT_NE(d.error().message.find(failing.dir + "/d/log"), std::string::npos) << d.error().message;

    auto missing = MpsDaemon::start(failing.dir + "/e", failing.dir + "/no-such-control");
    ASSERT_FALSE(missing.ok());
    EXPECT_NE(missing.error().message.find("no-such-control not found"), std::string::npos) << missing.error().message;
}

}  // namespace
