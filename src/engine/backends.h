// The one place that knows which backends this build has: the CPU backend always,
// the CUDA backend (src/cuda) in a build with CUDA. Everything above the engine (the
// workers, the launcher, the one-process Engine) makes backends and the device
// memory their KV pools live in through these functions and never names a CUDA
// type. Which GPU half is built is CMake's choice of file (backends_cuda.cpp or
// backends_no_cuda.cpp), so in the product `#if DUET_HAVE_CUDA` appears in src/cuda
// only (bench/cuda_cmd.cpp, a benchmark, has its own).
//
// In a build without CUDA every device query answers "no GPU" and every GPU request
// fails with an error that says the build has no CUDA.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "base/result.h"
#include "base/thread_pool.h"
#include "kernels/cpu/kernels.h"
#include "kv/kv_pool.h"
#include "kv/kv_stage.h"
#include "model/backend.h"
#include "model/device_spec.h"
#include "model/model.h"

namespace duet {

// True when this build has the CUDA backend.
bool cuda_built();
// OK for the CPU; for cuda:N, OK if the GPU exists. Errors: no such GPU, a build
// without CUDA.
Status check_device(const DeviceSpec& d);
// The GPU's PCI address (domain:bus:dev.fn, as hwloc prints it); "" for the CPU, in
// a build without CUDA, or when CUDA cannot tell.
std::string cuda_pci_address(const DeviceSpec& d);
// The GPU's memory in bytes. Errors: not a GPU, a build without CUDA, CUDA failures.
Result<uint64_t> cuda_total_memory(const DeviceSpec& d);

// Device memory a KV pool lives in (a GPU's; the CPU's KV is in /dev/shm and needs
// no holder). Freed or unmapped by the destructor.
class DeviceKvMemory {
public:
    virtual ~DeviceKvMemory() = default;
    virtual uint8_t* data() const = 0;
    virtual int device() const = 0;             // the GPU the memory is on
    virtual bool peer() const { return true; }  // open_peer_kv: reachable by peer access
};

// A private arena of n_blocks blocks of `l` on GPU `d` (the one-process Engine).
Result<std::unique_ptr<DeviceKvMemory>> make_device_kv(const DeviceSpec& d, const KvLayout& l, int32_t n_blocks);
// Arena `arena` of a serving instance on GPU `d`, at least `bytes` long: mapped, or
// made and deposited with the instance's fd keeper by the first worker to ask
// (cuda_arena.h SharedKvArena::open).
Result<std::unique_ptr<DeviceKvMemory>> open_shared_kv(const std::string& instance, uint32_t arena, const DeviceSpec& d,
                                                       uint64_t bytes);
// Arena `arena` as made by another GPU's worker, mapped for GPU `access` to copy into
// (SharedKvArena::open_peer). Errors: not kept yet (the message says "not kept"),
// CUDA failures.
Result<std::unique_ptr<DeviceKvMemory>> open_peer_kv(const std::string& instance, uint32_t arena,
                                                     const DeviceSpec& access, uint64_t bytes);
// The stage between arena `arena` of a serving instance on a GPU and its host
// mirror (kv/kv_stage.h), for a process that computes nothing there (the front's
// contexts): the arena is mapped on the first copy (its first worker makes it: until
// then copies fail with "not kept"), on its own GPU.
Result<std::unique_ptr<KvStage>> kept_kv_stage(const std::string& instance, uint32_t arena, KvPool& mirror);
// The stage between GPU memory this process has mapped (a worker's own arena) and
// its host mirror: a preempted request's swap (roles/decode_worker.cpp), through
// page-locked halves of about 16 MiB (CudaKvStage). Errors: a build without CUDA,
// CUDA failures.
Result<std::unique_ptr<KvStage>> device_kv_stage(const DeviceKvMemory& kv, KvPool& mirror);
// The launcher's hold on arena `arena` of GPU `d`: where the GPU cannot export VMM
// allocations as fds, the arena is made here and lives as long as the result does
// (cuda_arena.h IpcKvArenaOwner); null where the workers make it themselves (VMM).
Result<std::unique_ptr<DeviceKvMemory>> hold_legacy_kv(const std::string& instance, uint32_t arena, const DeviceSpec& d,
                                                       uint64_t bytes);

struct BackendOptions {
    DeviceSpec device;
    cpu::Isa isa = cpu::Isa::Scalar;  // the CPU backend's kernel level
    ThreadPool* threads = nullptr;    // the CPU backend's compute threads (required for the CPU)
    // CUDA: decode steps of up to max_batch sequences of up to max_ctx tokens replay
    // graphs; graphs false runs every pass eagerly; quantized_gemv and
    // share_weights_instance as CudaBackendOptions.
    int max_batch = 256;
    int64_t max_ctx = 4096;
    bool cuda_graphs = true;
    bool cuda_qgemv = false;
    std::string share_weights_instance;
};

struct MadeBackend {
    std::unique_ptr<Backend> backend;
    std::string description;  // "cpu avx512, 4 threads", or the CUDA backend's own
};

// The backend for `o.device` over `pool` (whose memory must be on that device).
// Errors: a GPU in a build without CUDA, no such GPU, the CUDA backend's errors.
Result<MadeBackend> make_backend(const Model& model, KvPool& pool, const BackendOptions& o);
// make_backend for a GPU: the CUDA backend, or (a build without CUDA) an error that
// says so. Defined by backends_cuda.cpp or backends_no_cuda.cpp, whichever CMake
// compiled.
Result<MadeBackend> make_gpu_backend(const Model& model, KvPool& pool, const BackendOptions& o);

}  // namespace duet
