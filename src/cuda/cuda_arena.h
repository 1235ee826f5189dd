// An instance's KV data on a GPU, shared by every process of the instance that
// computes on that GPU (prefill and decode). The memory is a cuMemCreate allocation
// exported as a POSIX fd (kernels/cuda/vmm.h) and kept by the launcher's fd keeper
// (shm/fd_keeper.h) under "kv.arena.<arena>" (kv_arena_key): the first worker to start creates and
// deposits it, the others, and any restarted one, fetch and map it. With the keeper
// holding an fd, the data outlives every worker that maps it: a restarted decode
// finds the KV of the requests it re-drives where prefill left it. Block metadata
// (allocation, references, prefix index) stays in the shm control segment.
//
// Built only with DUET_CUDA; this header includes no CUDA header.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "base/result.h"

namespace duet {

// The fd keeper's key for the instance's KV arena `arena` (the control segment's
// arena index; its metadata names the device, checked by every process mapping it).
std::string kv_arena_key(uint32_t arena);

// How the processes share the arena. Vmm: a cuMemCreate allocation exported as a
// POSIX fd, made by the first worker and held by the keeper's fd. Ipc, the legacy
// fallback for GPUs that cannot export VMM allocations as fds (some virtualized GPUs
// and drivers): a cudaMalloc allocation made by the launcher (IpcKvArenaOwner), whose
// cudaIpcGetMemHandle travels as the keeper's metadata; it lives as long as the
// launcher does, so it too survives any worker's death (the launcher then holds a
// CUDA context on each such GPU). DUET_KV_SHARING=vmm|ipc
// forces one; otherwise Vmm where the device supports it.
enum class KvSharing { Vmm, Ipc };
Result<KvSharing> kv_sharing(int device);

// Device memory that the processes of an instance on one GPU share and that one of
// them fills (the model's bf16 weights: prefill and decode on a GPU hold one copy,
// not two). Kept by the fd keeper under `key` (a VMM allocation exported as an fd),
// with `content` saying what it holds: a process finding it kept with the same
// content maps it; the first makes it, fills it, then deposits it (so nobody maps
// it half filled), and keeps whichever the keeper then holds (a racing process's,
// if that one deposited first). Needs VMM fd export: otherwise an error, and the
// caller keeps a private copy.
class SharedDeviceBuffer {
public:
    using Fill = std::function<Status(void* device_ptr)>;
    static Result<std::unique_ptr<SharedDeviceBuffer>> get_or_make(const std::string& instance, const std::string& key,
                                                                  int device, uint64_t bytes, const std::string& content,
                                                                  const Fill& fill);
    ~SharedDeviceBuffer();  // unmaps
    SharedDeviceBuffer(const SharedDeviceBuffer&) = delete;
    SharedDeviceBuffer& operator=(const SharedDeviceBuffer&) = delete;
    void* data() const { return ptr_; }
    bool filled_here() const { return filled_here_; }

private:
    SharedDeviceBuffer() = default;
    void* ptr_ = nullptr;
    uint64_t bytes_ = 0;
    unsigned long long handle_ = 0;
    bool filled_here_ = false;
};

class IpcKvArenaOwner {
public:
    // Allocates `bytes` on `device` and deposits its IPC handle under kv_arena_key(arena).
    static Result<std::unique_ptr<IpcKvArenaOwner>> create(const std::string& instance, uint32_t arena, int device,
                                                          uint64_t bytes);
    ~IpcKvArenaOwner();  // frees it (after the workers are gone)
    IpcKvArenaOwner(const IpcKvArenaOwner&) = delete;
    IpcKvArenaOwner& operator=(const IpcKvArenaOwner&) = delete;

private:
    IpcKvArenaOwner() = default;
    int device_ = 0;
    void* ptr_ = nullptr;
};

class SharedKvArena {
public:
    // Maps the instance's arena `arena`, on `device`, at least `bytes` long, creating
    // it (and depositing it with the keeper) when nobody has. Errors: no fd keeper
    // (the instance was not started by `duet serve --device`), the kept arena is on
    // another device (a worker started with another GPU than its pair's) or smaller
    // than `bytes`, CUDA failures.
    static Result<std::unique_ptr<SharedKvArena>> open(const std::string& instance, uint32_t arena, int device,
                                                       uint64_t bytes);
    // Maps the instance's arena `arena` as made by the worker of another GPU (decode's,
    // for a prefill worker handing off into it), for GPU `access_device` to copy
    // into: with peer access where the two GPUs have it, else mapped for its own GPU
    // alone (copies then go through cudaMemcpyPeerAsync, which the driver stages
    // through host memory). Errors: not kept yet (its worker has not started: the
    // message says "not kept"), CUDA failures.
    // At least `bytes` long, else an error. access_device -1: the arena's own GPU.
    static Result<std::unique_ptr<SharedKvArena>> open_peer(const std::string& instance, uint32_t arena,
                                                            int access_device, uint64_t bytes);
    ~SharedKvArena();  // unmaps (the memory lives on while the keeper or others hold it)
    int device() const { return owner_; }  // the GPU the memory is on
    bool peer() const { return peer_; }  // open_peer: reachable from access_device by peer access
    SharedKvArena(const SharedKvArena&) = delete;
    SharedKvArena& operator=(const SharedKvArena&) = delete;

    void* data() const { return ptr_; }
    uint64_t bytes() const { return bytes_; }

private:
    SharedKvArena() = default;
    int device_ = 0;
    void* ptr_ = nullptr;
    uint64_t bytes_ = 0;
    unsigned long long handle_ = 0;
    bool ipc_ = false;  // opened from a legacy IPC handle
    bool peer_ = true;
    int owner_ = 0;
};

}  // namespace duet
