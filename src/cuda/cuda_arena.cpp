#include "cuda/cuda_arena.h"

#include <unistd.h>

#include <cstdio>

#include "shm/fd_keeper.h"
#include "vmm.h"

namespace duet {

std::string kv_arena_key(int device) { return "kv.cuda." + std::to_string(device); }

namespace {

// The metadata kept with the fd: "device=<n> bytes=<n>".
std::string arena_meta(int device, uint64_t bytes) { return fmt::format("device={} bytes={}", device, bytes); }

bool parse_meta(const std::string& m, int* device, uint64_t* bytes) {
    unsigned long long b = 0;
    int d = -1, n = 0;
    if (std::sscanf(m.c_str(), "device=%d bytes=%llu%n", &d, &b, &n) != 2 || static_cast<size_t>(n) != m.size())
        return false;
    *device = d;
    *bytes = b;
    return true;
}

}  // namespace

Result<std::unique_ptr<SharedKvArena>> SharedKvArena::open(const std::string& instance, int device, uint64_t bytes) {
    const std::string key = kv_arena_key(device);
    std::unique_ptr<SharedKvArena> a(new SharedKvArena());
    a->device_ = device;
    auto got = shm::fd_get(instance, key);
    if (!got && got.error().message.find("not kept") == std::string::npos)
        return make_error("instance {}: the GPU KV arena is passed between processes by the launcher's fd keeper: {}",
                          instance, got.error().message);
    // Our own allocation while we make one; released once the kept arena is mapped
    // (the keeper's duplicate holds it by then, whichever arena won).
    cuda::SharedAllocation mine;
    struct Release {
        cuda::SharedAllocation& a;
        ~Release() {
            if (a.fd >= 0 || a.handle) cuda::vmm_release(a);
        }
    } release{mine};
    if (!got) {
        // Nobody has made it: make it, and keep whichever the keeper holds (ours, or
        // that of a process that got there first).
        std::string err;
        if (!cuda::vmm_create(device, bytes, &mine, &err)) {
            // Out of memory perhaps because the other worker's arena, made a moment
            // ago, fills the GPU: use it if it appears.
            const bool oom = err.find("out of memory") != std::string::npos;
            for (int i = 0; oom && i < 50 && !got; ++i) {
                usleep(100'000);
                got = shm::fd_get(instance, key);
            }
            if (!got)
                return make_error("cuda:{}: cannot create the {:.1f} MiB KV arena: {}", device, bytes / 1048576.0, err);
        } else {
            got = shm::fd_put(instance, key, mine.fd, arena_meta(device, mine.bytes));
            if (!got) return make_error("instance {}: cannot deposit the KV arena: {}", instance, got.error().message);
        }
    }
    int kept_device = -1;
    uint64_t kept_bytes = 0;
    if (!parse_meta(got->meta, &kept_device, &kept_bytes)) {
        close(got->fd);
        return make_error("instance {}: the kept KV arena has malformed metadata '{}'", instance, got->meta);
    }
    if (kept_device != device || kept_bytes < bytes) {
        close(got->fd);
        return make_error("instance {}: the kept KV arena is {} bytes on cuda:{}; this process needs {} bytes on cuda:{}",
                          instance, kept_bytes, kept_device, bytes, device);
    }
    cuda::SharedMapping m;
    std::string err;
    const bool mapped = cuda::vmm_map(got->fd, kept_bytes, device, {}, &m, &err);
    close(got->fd);
    if (!mapped) return make_error("cuda:{}: cannot map the KV arena: {}", device, err);
    a->ptr_ = m.ptr;
    a->bytes_ = m.bytes;
    a->handle_ = m.handle;
    return a;
}

SharedKvArena::~SharedKvArena() {
    if (!ptr_) return;
    cuda::SharedMapping m;
    m.ptr = ptr_;
    m.bytes = bytes_;
    m.handle = handle_;
    cuda::vmm_unmap(m);
}

}  // namespace duet
