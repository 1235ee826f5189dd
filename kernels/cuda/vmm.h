// Device memory shared between processes with CUDA's virtual memory management:
// cuMemCreate with a POSIX file-descriptor handle type, exported as an fd (passed to
// the other processes by shm::FdKeeper over SCM_RIGHTS), imported and mapped by each
// (cuMemAddressReserve + cuMemMap + cuMemSetAccess, with access for peer GPUs). The
// memory is freed only when every handle, fd and mapping is gone, so it outlives the
// process that made it. This is the KV arena's storage on a GPU.
//
// Driver entry points are fetched through the runtime (cudaGetDriverEntryPointByVersion),
// so nothing links libcuda.so: a binary built here starts on a machine with no driver.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace duet::cuda {

// Whether `device` makes VMM allocations exportable as POSIX fds (some virtualized
// GPUs and drivers do not), asked without creating a context; why not in *why. Where not, the legacy cudaIpc handles are
// the fallback (src/cuda/cuda_arena.h).
bool vmm_supported(int device, std::string* why);

// The device's memory in bytes, asked without creating a context (0 on error, why in
// *why): what the launcher sizes the GPU KV arenas by.
size_t device_total_memory(int device, std::string* why);

// The allocation granularity of `device` (sizes are multiples of it); 0 on error.
size_t vmm_granularity(int device, std::string* error);

struct SharedAllocation {
    int device = -1;
    size_t bytes = 0;               // rounded up to the granularity
    unsigned long long handle = 0;  // CUmemGenericAllocationHandle (this process's)
    int fd = -1;                    // the exported POSIX fd (this process's)
};
// Creates `bytes` (rounded up) of device memory on `device`, exportable as an fd.
bool vmm_create(int device, size_t bytes, SharedAllocation* out, std::string* error);
// Drops this process's handle and fd (the memory lives on while others hold it).
void vmm_release(SharedAllocation& a);

struct SharedMapping {
    void* ptr = nullptr;  // device address, valid in this process
    size_t bytes = 0;
    unsigned long long handle = 0;
};
// Imports the allocation behind `fd` (the caller keeps its fd), maps `bytes` of it
// and grants read/write access to `device` and every device in `peers`.
bool vmm_map(int fd, size_t bytes, int device, const std::vector<int>& peers, SharedMapping* out, std::string* error);
void vmm_unmap(SharedMapping& m);

}  // namespace duet::cuda
