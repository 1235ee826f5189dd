// CUDA MPS (Multi-Process Service) for one `duet serve --mps`: a GPU's prefill and
// decode processes are separate CUDA contexts, which the GPU time-slices, so a long
// prefill pass can hold every decode stream on that GPU until its slice ends; under
// MPS their kernels share the GPU at once (docs/ARCHITECTURE.md, section 1). The
// launcher runs a control daemon of its own in the foreground (`nvidia-cuda-mps-control
// -f`, which starts the MPS server when the first process connects) as its child,
// so that it dies with the launcher (PR_SET_PDEATHSIG) even when the launcher is
// killed; its pipes and logs live in a fresh private directory (mkdtemp, 0700),
// handed to every role process through CUDA_MPS_PIPE_DIRECTORY /
// CUDA_MPS_LOG_DIRECTORY (read when a process first touches CUDA). stop() sends
// `quit`, reaps the daemon and removes the directory.
#pragma once

#include <sys/types.h>

#include <string>

#include "base/result.h"

namespace duet {

class MpsDaemon {
public:
    static constexpr const char* kControl = "nvidia-cuda-mps-control";
    // Makes <parent>/<prefix>XXXXXX with pipe/ and log/ in it, starts `control -f`
    // there and waits (up to ready_s) until it answers a query; an error names the
    // control and why (not found, its exit status, no answer).
    static Result<MpsDaemon> start(const std::string& parent, const std::string& prefix,
                                   const std::string& control = kControl, double ready_s = 10);
    MpsDaemon(MpsDaemon&& o) noexcept;
    MpsDaemon& operator=(MpsDaemon&&) = delete;
    MpsDaemon(const MpsDaemon&) = delete;
    ~MpsDaemon();  // stop(), its error logged
    // `quit` to the daemon (it ends the MPS server once its clients are gone), the
    // daemon reaped (killed if it has not ended in 10 s), the directory removed; once.
    Status stop();
    const std::string& dir() const { return dir_; }
    std::string pipe_dir() const { return dir_ + "/pipe"; }
    std::string log_dir() const { return dir_ + "/log"; }
    pid_t pid() const { return pid_; }
    // Sets CUDA_MPS_PIPE_DIRECTORY and CUDA_MPS_LOG_DIRECTORY in this process's
    // environment, for CUDA here and the children it starts from here on.
    Status export_env() const;

private:
    MpsDaemon(std::string dir, std::string control) : dir_(std::move(dir)), control_(std::move(control)) {}
    std::string dir_, control_;
    pid_t pid_ = -1;  // the daemon (-1: none to stop)
};

// Runs control with one argument (none if arg is empty) and `input` on its standard
// input, with the daemon's two directories in its environment; its exit status
// (127: not found or not runnable).
Result<int> run_mps_control(const std::string& control, const std::string& arg, const std::string& input,
                            const std::string& pipe_dir, const std::string& log_dir);

}  // namespace duet
