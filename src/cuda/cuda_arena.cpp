#include "cuda/cuda_arena.h"

#include <cuda_runtime.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "shm/fd_keeper.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/vmm.h"

namespace duet {

std::string kv_arena_key(uint32_t arena) { return "kv.arena." + std::to_string(arena); }

namespace {

// The metadata kept with the fd: "device=<n> bytes=<n>", and " ipc=<hex>" (the
// cudaIpcMemHandle_t's bytes) in the legacy mode.
std::string arena_meta(int device, uint64_t bytes) { return fmt::format("device={} bytes={}", device, bytes); }

// What a kept arena's metadata says.
struct KeptMeta {
    int device = -1;
    uint64_t bytes = 0;
    bool ipc = false;
    cudaIpcMemHandle_t handle{};
};

bool parse_meta(const std::string& m, KeptMeta* k) {
    unsigned long long b = 0;
    int d = -1, n = 0;
    if (std::sscanf(m.c_str(), "device=%d bytes=%llu%n", &d, &b, &n) != 2) return false;
    const std::string rest = m.substr(static_cast<size_t>(n));
    k->ipc = false;
    if (!rest.empty()) {
        constexpr size_t kHex = 2 * sizeof(cudaIpcMemHandle_t);
        if (rest.rfind(" ipc=", 0) != 0 || rest.size() != 5 + kHex) return false;
        auto* out = reinterpret_cast<unsigned char*>(&k->handle);
        for (size_t i = 0; i < sizeof(cudaIpcMemHandle_t); ++i) {
            unsigned v = 0;
            if (std::sscanf(rest.c_str() + 5 + 2 * i, "%2x", &v) != 1) return false;
            out[i] = static_cast<unsigned char>(v);
        }
        k->ipc = true;
    }
    k->device = d;
    k->bytes = b;
    return true;
}

// A kept arena mapped into this process.
struct Mapped {
    void* ptr = nullptr;
    uint64_t bytes = 0;
    unsigned long long handle = 0;  // VMM
    bool ipc = false;
};

// Maps kept arena `fd` (closed here) as its metadata `k` says: a legacy IPC handle
// opened in the context of GPU `ctx` (peer access enabled on first use), the current
// device `restore` afterwards; a VMM allocation mapped with access for its own GPU
// and `peers`. `what` names it in errors.
Result<Mapped> map_kept(int fd, const KeptMeta& k, int ctx, int restore, const std::vector<int>& peers,
                        const std::string& what) {
    Mapped m;
    m.bytes = k.bytes;
    m.ipc = k.ipc;
    if (k.ipc) {
        close(fd);  // a placeholder
        if (cudaError_t e = cudaSetDevice(ctx); e != cudaSuccess) return make_error("cuda:{}: {}", ctx, cudaGetErrorString(e));
        const cudaError_t e = cudaIpcOpenMemHandle(&m.ptr, k.handle, cudaIpcMemLazyEnablePeerAccess);
        cudaSetDevice(restore);
        if (e != cudaSuccess) {
            cudaGetLastError();
            return make_error("cuda:{}: cannot open {}'s IPC handle: {}", ctx, what, cudaGetErrorString(e));
        }
        return m;
    }
    cuda::SharedMapping sm;
    std::string err;
    const bool ok = cuda::vmm_map(fd, k.bytes, k.device, peers, &sm, &err);
    close(fd);
    if (!ok) return make_error("cuda:{}: cannot map {}: {}", k.device, what, err);
    m.ptr = sm.ptr;
    m.bytes = sm.bytes;
    m.handle = sm.handle;
    return m;
}

}  // namespace

Result<std::unique_ptr<SharedDeviceBuffer>> SharedDeviceBuffer::get_or_make(const std::string& instance,
                                                                              const std::string& key, int device,
                                                                              uint64_t bytes, const std::string& content,
                                                                              const Fill& fill) {
    std::unique_ptr<SharedDeviceBuffer> b(new SharedDeviceBuffer());
    const std::string want = fmt::format("{} bytes={}", content, bytes);
    // What the keeper holds: "<want> by=<maker>" (the maker tells a process whether
    // the kept one is its own).
    auto matches = [&](const std::string& meta) { return meta.rfind(want + " by=", 0) == 0; };
    auto map_kept = [&](const shm::KeptFd& k) -> Status {
        if (!matches(k.meta)) {
            close(k.fd);
            return make_error("instance {}: '{}' is kept with '{}', not '{}'", instance, key, k.meta, want);
        }
        cuda::SharedMapping m;
        std::string err;
        const size_t g = cuda::vmm_granularity(device, &err);
        const bool ok = g > 0 && cuda::vmm_map(k.fd, (bytes + g - 1) / g * g, device, {}, &m, &err);
        close(k.fd);
        if (!ok) return make_error("cuda:{}: cannot map '{}': {}", device, key, err);
        b->ptr_ = m.ptr;
        b->bytes_ = m.bytes;
        b->handle_ = m.handle;
        return {};
    };
    auto got = shm::fd_get(instance, key);
    if (got) {
        if (Status st = map_kept(*got); !st) return st.error();
        return b;
    }
    if (got.error().message.find("not kept") == std::string::npos) return got.error();
    std::string why;
    if (!cuda::vmm_supported(device, &why)) return make_error("cuda:{}: cannot share device memory by fd: {}", device, why);
    // One process makes it: whoever first deposits the claim "<key>.making" (a
    // placeholder fd). The others wait for the buffer itself, up to 50 s (inside the
    // launcher's start deadline), then give up (their caller keeps a private copy).
    {
        const int fd = memfd_create("duet-claim", MFD_CLOEXEC);
        if (fd < 0) return make_error("memfd_create: {}", std::strerror(errno));
        const std::string mine_claim = fmt::format("by={}", getpid());
        auto claim = shm::fd_put(instance, key + ".making", fd, mine_claim);
        close(fd);
        if (!claim) return claim.error();
        close(claim->fd);
        if (claim->meta != mine_claim) {
            for (int i = 0; i < 500; ++i) {
                usleep(100'000);
                got = shm::fd_get(instance, key);
                if (got) break;
            }
            if (!got)
                return make_error("instance {}: '{}' is being made by another process ({}) that has not finished", instance,
                                  key, claim->meta);
            if (Status st = map_kept(*got); !st) return st.error();
            return b;
        }
    }
    cuda::SharedAllocation mine;
    std::string err;
    if (!cuda::vmm_create(device, bytes, &mine, &err))
        return make_error("cuda:{}: cannot create '{}' ({:.1f} MiB): {}", device, key, bytes / 1048576.0, err);
    struct Release {
        cuda::SharedAllocation& a;
        ~Release() { cuda::vmm_release(a); }
    } release{mine};
    cuda::SharedMapping m;
    if (!cuda::vmm_map(mine.fd, mine.bytes, device, {}, &m, &err))
        return make_error("cuda:{}: cannot map '{}': {}", device, key, err);
    b->ptr_ = m.ptr;
    b->bytes_ = m.bytes;
    b->handle_ = m.handle;
    if (Status st = fill(m.ptr); !st) return st.error();  // ~b unmaps
    if (cudaError_t e = cudaDeviceSynchronize(); e != cudaSuccess)
        return make_error("cuda:{}: filling '{}': {}", device, key, cudaGetErrorString(e));
    const std::string meta = fmt::format("{} by={}", want, getpid());
    auto kept = shm::fd_put(instance, key, mine.fd, meta);
    if (!kept) return make_error("instance {}: cannot deposit '{}': {}", instance, key, kept.error().message);
    if (kept->meta == meta) {  // ours is the one kept
        close(kept->fd);
        b->filled_here_ = true;
        return b;
    }
    // Another process deposited first: use its copy, drop ours.
    cuda::SharedMapping own{b->ptr_, b->bytes_, b->handle_};
    cuda::vmm_unmap(own);
    b->ptr_ = nullptr;
    b->handle_ = 0;
    if (Status st = map_kept(*kept); !st) return st.error();
    return b;
}

SharedDeviceBuffer::~SharedDeviceBuffer() {
    if (!ptr_) return;
    cuda::SharedMapping m{ptr_, bytes_, handle_};
    cuda::vmm_unmap(m);
}

Result<KvSharing> kv_sharing(int device) {
    if (const char* e = std::getenv("DUET_KV_SHARING"); e && *e) {
        if (std::strcmp(e, "vmm") == 0) return KvSharing::Vmm;
        if (std::strcmp(e, "ipc") == 0) return KvSharing::Ipc;
        return make_error("DUET_KV_SHARING={}: expected vmm or ipc", e);
    }
    const int n = cuda::device_count();
    if (device < 0 || device >= n) return make_error("cuda:{}: no such device ({} CUDA devices visible)", device, n);
    std::string why;
    return cuda::vmm_supported(device, &why) ? KvSharing::Vmm : KvSharing::Ipc;
}

Result<std::unique_ptr<IpcKvArenaOwner>> IpcKvArenaOwner::create(const std::string& instance, uint32_t arena, int device,
                                                                  uint64_t bytes) {
    std::unique_ptr<IpcKvArenaOwner> o(new IpcKvArenaOwner());
    o->device_ = device;
    if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess)
        return make_error("cuda:{}: {}", device, cudaGetErrorString(e));
    if (cudaError_t e = cudaMalloc(&o->ptr_, bytes); e != cudaSuccess) {
        cudaGetLastError();
        o->ptr_ = nullptr;
        return make_error("cuda:{}: cannot allocate the {:.1f} MiB KV arena: {}", device, bytes / 1048576.0,
                          cudaGetErrorString(e));
    }
    cudaIpcMemHandle_t h{};
    if (cudaError_t e = cudaIpcGetMemHandle(&h, o->ptr_); e != cudaSuccess)
        return make_error("cuda:{}: cudaIpcGetMemHandle: {}", device, cudaGetErrorString(e));
    std::string meta = arena_meta(device, bytes) + " ipc=";
    for (size_t i = 0; i < sizeof h; ++i) meta += fmt::format("{:02x}", reinterpret_cast<const unsigned char*>(&h)[i]);
    // The keeper keeps an fd per key: a placeholder here, the handle is the metadata.
    const int fd = memfd_create("duet-ipc-arena", MFD_CLOEXEC);
    if (fd < 0) return make_error("memfd_create: {}", std::strerror(errno));
    auto kept = shm::fd_put(instance, kv_arena_key(arena), fd, meta);
    close(fd);
    if (!kept) return make_error("instance {}: cannot deposit the KV arena: {}", instance, kept.error().message);
    close(kept->fd);
    if (kept->meta != meta)
        return make_error("instance {}: another KV arena is already kept for cuda:{}", instance, device);
    return o;
}

IpcKvArenaOwner::~IpcKvArenaOwner() {
    if (ptr_) {
        cudaSetDevice(device_);
        cudaFree(ptr_);
    }
}

Result<std::unique_ptr<SharedKvArena>> SharedKvArena::open(const std::string& instance, uint32_t arena, int device,
                                                           uint64_t bytes) {
    const std::string key = kv_arena_key(arena);
    std::unique_ptr<SharedKvArena> a(new SharedKvArena());
    a->device_ = device;
    a->owner_ = device;
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
        // that of a process that got there first). (In the legacy mode the launcher
        // made it before starting anybody.)
        auto mode = kv_sharing(device);
        if (!mode) return mode.error();
        if (*mode == KvSharing::Ipc)
            return make_error("instance {}: no KV arena kept for cuda:{} (legacy IPC sharing: the launcher makes it)",
                              instance, device);
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
    KeptMeta k;
    if (!parse_meta(got->meta, &k)) {
        close(got->fd);
        return make_error("instance {}: the kept KV arena has malformed metadata '{}'", instance, got->meta);
    }
    if (k.device != device || k.bytes < bytes) {
        close(got->fd);
        return make_error("instance {}: the kept KV arena is {} bytes on cuda:{}; this process needs {} bytes on cuda:{}",
                          instance, k.bytes, k.device, bytes, device);
    }
    auto m = map_kept(got->fd, k, device, device, {}, "the KV arena");
    if (!m) return m.error();
    a->ptr_ = m->ptr;
    a->bytes_ = m->bytes;
    a->handle_ = m->handle;
    a->ipc_ = m->ipc;
    return a;
}

Result<std::unique_ptr<SharedKvArena>> SharedKvArena::open_peer(const std::string& instance, uint32_t arena,
                                                                int access_device, uint64_t need) {
    auto got = shm::fd_get(instance, kv_arena_key(arena));
    if (!got) return make_error("instance {}: KV arena {}: {}", instance, arena, got.error().message);
    KeptMeta k;
    if (!parse_meta(got->meta, &k)) {
        close(got->fd);
        return make_error("instance {}: the kept KV arena {} has malformed metadata '{}'", instance, arena, got->meta);
    }
    if (k.bytes < need) {
        close(got->fd);
        return make_error("instance {}: the kept KV arena {} is {} bytes; its blocks need {}", instance, arena, k.bytes, need);
    }
    const int owner = k.device;
    if (access_device < 0) access_device = owner;  // a process that only copies (the front's contexts)
    std::unique_ptr<SharedKvArena> a(new SharedKvArena());
    a->owner_ = owner;
    int can = 0;
    if (owner != access_device && cudaDeviceCanAccessPeer(&can, access_device, owner) != cudaSuccess) {
        cudaGetLastError();
        can = 0;
    }
    a->peer_ = owner == access_device || can != 0;
    // Opened in the context of the GPU that will use the pointer (ours) where it has
    // peer access; otherwise mapped for the arena's own GPU alone.
    const int ctx = a->peer_ ? access_device : owner;
    std::vector<int> peers;
    if (a->peer_ && owner != access_device) peers.push_back(access_device);
    auto m = map_kept(got->fd, k, ctx, access_device, peers, fmt::format("KV arena {} (on cuda:{})", arena, owner));
    if (!m) return m.error();
    a->device_ = m->ipc ? ctx : owner;  // where an IPC handle is closed
    a->ptr_ = m->ptr;
    a->bytes_ = m->bytes;
    a->handle_ = m->handle;
    a->ipc_ = m->ipc;
    return a;
}

SharedKvArena::~SharedKvArena() {
    if (!ptr_) return;
    if (ipc_) {
        int current = -1;
        const bool known = cudaGetDevice(&current) == cudaSuccess;
        cudaSetDevice(device_);
        cudaIpcCloseMemHandle(ptr_);
        if (known) cudaSetDevice(current);  // a peer's arena closed by a process computing elsewhere
        return;
    }
    cuda::SharedMapping m;
    m.ptr = ptr_;
    m.bytes = bytes_;
    m.handle = handle_;
    cuda::vmm_unmap(m);
}

}  // namespace duet
