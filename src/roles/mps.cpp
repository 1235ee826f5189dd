#include "roles/mps.h"

#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "base/log.h"

extern char** environ;

namespace duet {
namespace {

using Clock = std::chrono::steady_clock;

// The control's path: as given if it names a directory, else the first executable
// of that name on PATH ("" if none), found here so that the child only execs.
std::string resolve(const std::string& control) {
    if (control.find('/') != std::string::npos) return control;
    const char* path = std::getenv("PATH");
    std::string_view rest = path ? path : "/usr/local/bin:/usr/bin:/bin";
    while (true) {
        const size_t colon = rest.find(':');
        const std::string_view d = rest.substr(0, colon);
        const std::string cand = (d.empty() ? std::string(".") : std::string(d)) + "/" + control;
        if (::access(cand.c_str(), X_OK) == 0) return cand;
        if (colon == std::string_view::npos) return "";
        rest.remove_prefix(colon + 1);
    }
}

// argv and environment for the child, made before fork (the child only calls
// async-signal-safe functions): the parent's environment less systemd's notify
// variables (the daemon is not the unit's main process) and any MPS directories,
// plus the daemon's.
struct Exec {
    std::vector<std::string> strings;
    std::vector<char*> argv, envp;
};
Exec make_exec(const std::string& path, const std::string& arg, const std::string& pipe_dir,
               const std::string& log_dir) {
    Exec e;
    e.strings.push_back(path);
    if (!arg.empty()) e.strings.push_back(arg);
    const size_t n_args = e.strings.size();
    for (char** v = environ; *v != nullptr; ++v) {
        const std::string_view s(*v);
        if (s.starts_with("NOTIFY_SOCKET=") || s.starts_with("WATCHDOG_USEC=") || s.starts_with("WATCHDOG_PID=") ||
            s.starts_with("CUDA_MPS_PIPE_DIRECTORY=") || s.starts_with("CUDA_MPS_LOG_DIRECTORY="))
            continue;
        e.strings.emplace_back(s);
    }
    e.strings.push_back("CUDA_MPS_PIPE_DIRECTORY=" + pipe_dir);
    e.strings.push_back("CUDA_MPS_LOG_DIRECTORY=" + log_dir);
    for (size_t i = 0; i < e.strings.size(); ++i) (i < n_args ? e.argv : e.envp).push_back(e.strings[i].data());
    e.argv.push_back(nullptr);
    e.envp.push_back(nullptr);
    return e;
}

// In the child: fd becomes its standard input (kept across exec even when it
// already is fd 0, which O_CLOEXEC would otherwise close).
void stdin_from(int fd) {
    if (fd == STDIN_FILENO) {
        ::fcntl(fd, F_SETFD, 0);
    } else {
        ::dup2(fd, STDIN_FILENO);
    }
}

// Waits up to `s` seconds for pid; its status, or -1 if it is still running.
int wait_for(pid_t pid, double s) {
    const auto until = Clock::now() + std::chrono::duration<double>(s);
    while (true) {
        int status = 0;
        const pid_t r = ::waitpid(pid, &status, WNOHANG);
        if (r == pid) return status;
        if (r < 0 && errno != EINTR) return 0;  // not ours any more: nothing to wait for
        if (Clock::now() > until) return -1;
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
}

std::string describe(int status) {
    if (WIFSIGNALED(status)) return fmt::format("was killed by signal {}", WTERMSIG(status));
    return fmt::format("exited with status {}", WEXITSTATUS(status));
}

}  // namespace

Result<int> run_mps_control(const std::string& control, const std::string& arg, const std::string& input,
                            const std::string& pipe_dir, const std::string& log_dir) {
    const std::string path = resolve(control);
    if (path.empty()) return 127;
    Exec e = make_exec(path, arg, pipe_dir, log_dir);
    int in[2];
    if (::pipe2(in, O_CLOEXEC) != 0) return make_error("{}: pipe: {}", control, std::strerror(errno));
    const pid_t pid = ::fork();
    if (pid < 0) {
        ::close(in[0]);
        ::close(in[1]);
        return make_error("{}: fork: {}", control, std::strerror(errno));
    }
    if (pid == 0) {
        stdin_from(in[0]);
        ::execve(e.argv[0], e.argv.data(), e.envp.data());
        ::_exit(127);
    }
    ::close(in[0]);
    // A word or two: it fits the pipe, so this never blocks (SIGPIPE is ignored by
    // every duet role; a control that exits without reading gets EPIPE here).
    const ssize_t w = input.empty() ? 0 : ::write(in[1], input.data(), input.size());
    (void)w;
    ::close(in[1]);
    const int status = wait_for(pid, 30);
    if (status == -1) {
        ::kill(pid, SIGKILL);
        ::waitpid(pid, nullptr, 0);
        return make_error("{} {}: no answer in 30 s", control, arg);
    }
    if (WIFSIGNALED(status)) return make_error("{} {}: killed by signal {}", control, arg, WTERMSIG(status));
    return WEXITSTATUS(status);
}

Result<MpsDaemon> MpsDaemon::start(const std::string& parent, const std::string& prefix, const std::string& control,
                                   double ready_s) {
    // A fresh directory of ours alone: nobody else can have made or swapped it.
    std::string tmpl = parent + "/" + prefix + "XXXXXX";
    if (::mkdtemp(tmpl.data()) == nullptr)
        return make_error("--mps: cannot make a directory {}: {}", tmpl, std::strerror(errno));
    MpsDaemon d(tmpl, control);
    for (const std::string& p : {d.pipe_dir(), d.log_dir()}) {
        if (::mkdir(p.c_str(), 0700) != 0) {
            const int err = errno;
            std::error_code ec;
            std::filesystem::remove_all(d.dir_, ec);
            return make_error("--mps: cannot make {}: {}", p, std::strerror(err));
        }
    }
    auto fail = [&](std::string why) -> Error {
        std::error_code ec;
        std::filesystem::remove_all(d.dir_, ec);
        return make_error("--mps: {}", why);
    };
    const std::string path = resolve(control);
    if (path.empty())
        return fail(fmt::format("{} not found (CUDA MPS comes with the NVIDIA driver's utilities)", control));
    Exec e = make_exec(path, "-f", d.pipe_dir(), d.log_dir());
    const int null_fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (null_fd < 0) return fail(fmt::format("/dev/null: {}", std::strerror(errno)));
    const pid_t parent_pid = ::getpid();
    const pid_t pid = ::fork();
    if (pid < 0) {
        ::close(null_fd);
        return fail(fmt::format("fork: {}", std::strerror(errno)));
    }
    if (pid == 0) {
        // It ends with the launcher, however the launcher ends (SIGKILL, the OOM
        // killer): SIGTERM, on which the control daemon stops its server.
        ::prctl(PR_SET_PDEATHSIG, SIGTERM);
        if (::getppid() != parent_pid) ::_exit(127);  // the launcher is already gone
        ::setpgid(0, 0);                              // a Ctrl-C reaches the launcher alone, which stops it in order
        stdin_from(null_fd);
        ::execve(e.argv[0], e.argv.data(), e.envp.data());
        ::_exit(127);
    }
    ::close(null_fd);
    d.pid_ = pid;
    // Ready once it answers a query (its server starts with the first client).
    const auto until = Clock::now() + std::chrono::duration<double>(ready_s);
    while (true) {
        int status = 0;
        if (::waitpid(pid, &status, WNOHANG) == pid) {
            d.pid_ = -1;
            if (WIFEXITED(status) && WEXITSTATUS(status) == 127) return fail(fmt::format("{} could not be run", path));
            return fail(fmt::format("{} -f {} before answering (its log: {})", path, describe(status), d.log_dir()));
        }
        auto rc = run_mps_control(path, "", "get_server_list\n", d.pipe_dir(), d.log_dir());
        if (rc && *rc == 0) return d;
        if (Clock::now() > until) {
            Status st = d.stop();
            (void)st;
            return make_error("--mps: {} -f did not answer within {} s", path, ready_s);
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
}

MpsDaemon::MpsDaemon(MpsDaemon&& o) noexcept
    : dir_(std::move(o.dir_)), control_(std::move(o.control_)), pid_(std::exchange(o.pid_, -1)) {}

MpsDaemon::~MpsDaemon() {
    if (Status st = stop(); !st) log::error(st.error().message);
}

Status MpsDaemon::stop() {
    if (pid_ < 0) return {};
    const pid_t pid = std::exchange(pid_, -1);
    Status result;
    auto rc = run_mps_control(control_, "", "quit\n", pipe_dir(), log_dir());
    if (!rc) result = make_error("--mps: stopping the daemon: {}", rc.error().message);
    // Told to quit: it ends once the MPS server's clients are gone; not told (it did
    // not answer): a moment, then the signals.
    int status = wait_for(pid, rc && *rc == 0 ? 10 : 0.1);
    if (status == -1) {  // it did not end: SIGTERM, then SIGKILL
        ::kill(pid, SIGTERM);
        status = wait_for(pid, 2);
        if (status == -1) {
            ::kill(pid, SIGKILL);
            ::waitpid(pid, nullptr, 0);
        }
        if (result.ok()) result = make_error("--mps: the daemon did not end after `quit`: killed");
    }
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
    return result;
}

Status MpsDaemon::export_env() const {
    if (::setenv("CUDA_MPS_PIPE_DIRECTORY", pipe_dir().c_str(), 1) != 0 ||
        ::setenv("CUDA_MPS_LOG_DIRECTORY", log_dir().c_str(), 1) != 0)
        return make_error("--mps: setenv: {}", std::strerror(errno));
    return {};
}

}  // namespace duet
