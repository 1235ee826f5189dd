// CUDA MPS (Multi-Process Service) for one `duet serve --mps`: a GPU's prefill and
// decode processes are separate CUDA contexts, which the GPU time-slices, so a long
// prefill pass can hold every decode stream on that GPU until its slice ends; under
// MPS their kernels share the GPU at once (docs/ARCHITECTURE.md, "A GPU's role
// split"). The launcher starts a control daemon of its own (`nvidia-cuda-mps-control
// -d`, which starts the MPS server when the first process connects) with its pipes
// and logs under a directory of the instance, hands that directory to every role
// process through CUDA_MPS_PIPE_DIRECTORY / CUDA_MPS_LOG_DIRECTORY (read when a
// process first touches CUDA), and stops it at exit (`quit` on the control's input).
#pragma once

#include <string>

#include "base/result.h"

namespace duet {

class MpsDaemon {
public:
    static constexpr const char* kControl = "nvidia-cuda-mps-control";
    // Makes dir/pipe and dir/log (0700) and runs `control -d` there; an error names
    // the control and why (not found, its exit status, its log directory).
    static Result<MpsDaemon> start(const std::string& dir, const std::string& control = kControl);
    MpsDaemon(MpsDaemon&& o) noexcept;
    MpsDaemon& operator=(MpsDaemon&&) = delete;
    MpsDaemon(const MpsDaemon&) = delete;
    ~MpsDaemon();  // stop(), its error logged
    // `quit` to the daemon (it ends the MPS server once its clients are gone); once.
    Status stop();
    std::string pipe_dir() const { return dir_ + "/pipe"; }
    std::string log_dir() const { return dir_ + "/log"; }
    // Sets CUDA_MPS_PIPE_DIRECTORY and CUDA_MPS_LOG_DIRECTORY in this process's
    // environment, for the children it starts from here on.
    Status export_env() const;

private:
    MpsDaemon(std::string dir, std::string control) : dir_(std::move(dir)), control_(std::move(control)) {}
    std::string dir_, control_;
    bool running_ = false;
};

// Runs control with argv[1..] = args and `input` on its standard input, with the
// daemon's two directories in its environment; its exit status (127: not found).
Result<int> run_mps_control(const std::string& control, const std::string& arg, const std::string& input,
                            const std::string& pipe_dir, const std::string& log_dir);

}  // namespace duet
