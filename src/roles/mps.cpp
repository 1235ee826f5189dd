#include "roles/mps.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

extern char** environ;

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "base/log.h"

namespace duet {

Result<int> run_mps_control(const std::string& control, const std::string& arg, const std::string& input,
                            const std::string& pipe_dir, const std::string& log_dir) {
    // argv and the environment made before fork: the child only calls dup2 and exec.
    std::vector<std::string> env_s;
    for (char** e = environ; *e != nullptr; ++e) {
        if (std::strncmp(*e, "CUDA_MPS_PIPE_DIRECTORY=", 24) != 0 &&
            std::strncmp(*e, "CUDA_MPS_LOG_DIRECTORY=", 23) != 0)
            env_s.emplace_back(*e);
    }
    env_s.push_back("CUDA_MPS_PIPE_DIRECTORY=" + pipe_dir);
    env_s.push_back("CUDA_MPS_LOG_DIRECTORY=" + log_dir);
    std::vector<char*> envp;
    for (std::string& e : env_s) envp.push_back(e.data());
    envp.push_back(nullptr);
    std::string c = control, a = arg;
    std::vector<char*> argv{c.data()};
    if (!a.empty()) argv.push_back(a.data());
    argv.push_back(nullptr);
    int in[2];
    if (::pipe2(in, O_CLOEXEC) != 0) return make_error("{}: pipe: {}", control, std::strerror(errno));
    const pid_t pid = ::fork();
    if (pid < 0) {
        ::close(in[0]);
        ::close(in[1]);
        return make_error("{}: fork: {}", control, std::strerror(errno));
    }
    if (pid == 0) {  // the child: only async-signal-safe calls until exec
        ::dup2(in[0], STDIN_FILENO);
        ::execvpe(argv[0], argv.data(), envp.data());
        ::_exit(127);
    }
    ::close(in[0]);
    // The input is a word or two: it fits the pipe, so this never blocks.
    const ssize_t w = input.empty() ? 0 : ::write(in[1], input.data(), input.size());
    ::close(in[1]);
    (void)w;
    // `-d` forks the daemon and returns, `quit` returns once sent: seconds at most.
    using clock = std::chrono::steady_clock;
    const auto until = clock::now() + std::chrono::seconds(30);
    int status = 0;
    for (;;) {
        const pid_t r = ::waitpid(pid, &status, WNOHANG);
        if (r == pid) break;
        if (r < 0 && errno != EINTR) return make_error("{}: waitpid: {}", control, std::strerror(errno));
        if (clock::now() > until) {
            ::kill(pid, SIGKILL);
            ::waitpid(pid, &status, 0);
            return make_error("{} {}: no answer in 30 s", control, arg);
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    if (WIFSIGNALED(status)) return make_error("{} {}: killed by signal {}", control, arg, WTERMSIG(status));
    return WEXITSTATUS(status);
}

Result<MpsDaemon> MpsDaemon::start(const std::string& dir, const std::string& control) {
    MpsDaemon d(dir, control);
    for (const std::string& p : {dir, d.pipe_dir(), d.log_dir()}) {
        if (::mkdir(p.c_str(), 0700) != 0 && errno != EEXIST)
            return make_error("--mps: cannot make {}: {}", p, std::strerror(errno));
    }
    auto rc = run_mps_control(control, "-d", "", d.pipe_dir(), d.log_dir());
    if (!rc) return make_error("--mps: {}", rc.error().message);
    if (*rc == 127)
        return make_error("--mps: {} not found or not runnable (CUDA MPS comes with the NVIDIA driver's utilities)",
                          control);
    if (*rc != 0) return make_error("--mps: {} -d exited with status {} (its log: {})", control, *rc, d.log_dir());
    d.running_ = true;
    return d;
}

MpsDaemon::MpsDaemon(MpsDaemon&& o) noexcept
    : dir_(std::move(o.dir_)), control_(std::move(o.control_)), running_(std::exchange(o.running_, false)) {}

MpsDaemon::~MpsDaemon() {
    if (Status st = stop(); !st) log::error(st.error().message);
}

Status MpsDaemon::stop() {
    if (!running_) return {};
    running_ = false;
    auto rc = run_mps_control(control_, "", "quit\n", pipe_dir(), log_dir());
    if (!rc) return make_error("--mps: stopping the daemon: {}", rc.error().message);
    if (*rc != 0)
        return make_error("--mps: `quit` to {} exited with status {} (its log: {})", control_, *rc, log_dir());
    return {};
}

Status MpsDaemon::export_env() const {
    if (::setenv("CUDA_MPS_PIPE_DIRECTORY", pipe_dir().c_str(), 1) != 0 ||
        ::setenv("CUDA_MPS_LOG_DIRECTORY", log_dir().c_str(), 1) != 0)
        return make_error("--mps: setenv: {}", std::strerror(errno));
    return {};
}

}  // namespace duet
