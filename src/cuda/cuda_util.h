// Small pieces the CUDA sources of src/cuda share: CUDA errors as Status, and
// buffers (device or page-locked host memory) that only grow.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "base/result.h"

namespace duet {

inline Status cuda_ok(cudaError_t e, const char* what) {
    if (e == cudaSuccess) return {};
    return make_error(ErrorKind::Device, "CUDA: {}: {}", what, cudaGetErrorString(e));
}

#define DUET_CUDA_TRY(expr)                                                        \
    do {                                                                           \
        if (::duet::Status st_ = ::duet::cuda_ok((expr), #expr); !st_) return st_.error(); \
    } while (0)

// A buffer that only grows: device memory (Pinned false) or page-locked host memory.
template <bool Pinned>
class GrowBuf {
public:
    GrowBuf() = default;
    GrowBuf(const GrowBuf&) = delete;
    GrowBuf& operator=(const GrowBuf&) = delete;
    ~GrowBuf() { release(); }
    // Room for `bytes` (rounded up to 64 KiB, or 4 KiB pinned); *moved (if given) is
    // set when the address changed. A failed allocation's error is cleared from
    // CUDA's last error: it is reported here, not by the next launch.
    Status reserve(size_t bytes, bool* moved = nullptr) {
        if (bytes <= cap_) return {};
        if (moved) *moved = true;
        release();
        const size_t unit = Pinned ? 4096 : 65536;
        const size_t want = (bytes + unit - 1) / unit * unit;
        const cudaError_t e = Pinned ? cudaMallocHost(&p_, want) : cudaMalloc(&p_, want);
        if (e != cudaSuccess) {
            cudaGetLastError();
            p_ = nullptr;
            return make_error("CUDA: cannot allocate {:.1f} MiB of {} memory: {}", want / 1048576.0,
                              Pinned ? "page-locked" : "device", cudaGetErrorString(e));
        }
        cap_ = want;
        return {};
    }
    template <typename T>
    T* as() const { return static_cast<T*>(p_); }

private:
    void release() {
        if (p_) Pinned ? cudaFreeHost(p_) : cudaFree(p_);
        p_ = nullptr;
        cap_ = 0;
    }
    void* p_ = nullptr;
    size_t cap_ = 0;
};
using DevBuf = GrowBuf<false>;
using HostBuf = GrowBuf<true>;

}  // namespace duet
