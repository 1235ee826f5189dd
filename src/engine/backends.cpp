#include "engine/backends.h"

#include "model/cpu_backend.h"

#if DUET_HAVE_CUDA
#include "cuda/cuda_arena.h"
#include "cuda/cuda_backend.h"
#include "cuda/cuda_kv_io.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/vmm.h"
#endif

namespace duet {

namespace {

#if !DUET_HAVE_CUDA
Error no_cuda(const DeviceSpec& d) {
    return make_error(ErrorKind::Device, "device {}: this duet was built without CUDA (configure with -DDUET_CUDA=ON)",
                      d.name());
}
#endif

#if DUET_HAVE_CUDA
// A CUDA holder of device memory as a DeviceKvMemory.
template <class T>
class Held final : public DeviceKvMemory {
public:
    Held(std::unique_ptr<T> p, int device, bool peer) : p_(std::move(p)), device_(device), peer_(peer) {}
    uint8_t* data() const override { return static_cast<uint8_t*>(p_->data()); }
    int device() const override { return device_; }
    bool peer() const override { return peer_; }

private:
    std::unique_ptr<T> p_;
    int device_;
    bool peer_;
};

// IpcKvArenaOwner exposes no pointer: the launcher only holds it.
class HeldOwner final : public DeviceKvMemory {
public:
    HeldOwner(std::unique_ptr<IpcKvArenaOwner> p, int device) : p_(std::move(p)), device_(device) {}
    uint8_t* data() const override { return nullptr; }
    int device() const override { return device_; }

private:
    std::unique_ptr<IpcKvArenaOwner> p_;
    int device_;
};
#endif

}  // namespace

bool cuda_built() {
#if DUET_HAVE_CUDA
    return true;
#else
    return false;
#endif
}

Status check_device(const DeviceSpec& d) {
    if (!d.cuda) return {};
#if DUET_HAVE_CUDA
    const int n = cuda::device_count();
    if (d.index >= n)
        return make_error(ErrorKind::Device, "{}: no such device ({} CUDA device{} visible)", d.name(), n,
                          n == 1 ? "" : "s");
    return {};
#else
    return no_cuda(d);
#endif
}

std::string cuda_pci_address(const DeviceSpec& d) {
#if DUET_HAVE_CUDA
    if (d.cuda) return cuda::pci_bus_id(d.index);
#else
    (void)d;
#endif
    return "";
}

Result<uint64_t> cuda_total_memory(const DeviceSpec& d) {
#if DUET_HAVE_CUDA
    std::string why;
    const size_t n = d.cuda ? cuda::device_total_memory(d.index, &why) : 0;
    if (n == 0) return make_error("{}: its memory size cannot be told: {}", d.name(), d.cuda ? why : "not a GPU");
    return static_cast<uint64_t>(n);
#else
    return make_error("{}: this duet was built without CUDA", d.name());
#endif
}

Result<std::unique_ptr<DeviceKvMemory>> make_device_kv(const DeviceSpec& d, const KvLayout& l, int32_t n_blocks) {
#if DUET_HAVE_CUDA
    auto m = CudaKvMemory::create(d.index, l, n_blocks);
    if (!m) return m.error();
    return std::unique_ptr<DeviceKvMemory>(std::make_unique<Held<CudaKvMemory>>(std::move(m).value(), d.index, true));
#else
    (void)l;
    (void)n_blocks;
    return no_cuda(d);
#endif
}

Result<std::unique_ptr<DeviceKvMemory>> open_shared_kv(const std::string& instance, uint32_t arena, const DeviceSpec& d,
                                                       uint64_t bytes) {
#if DUET_HAVE_CUDA
    auto m = SharedKvArena::open(instance, arena, d.index, bytes);
    if (!m) return m.error();
    const int device = (*m)->device();
    return std::unique_ptr<DeviceKvMemory>(std::make_unique<Held<SharedKvArena>>(std::move(m).value(), device, true));
#else
    (void)instance;
    (void)arena;
    (void)bytes;
    return no_cuda(d);
#endif
}

Result<std::unique_ptr<DeviceKvMemory>> open_peer_kv(const std::string& instance, uint32_t arena,
                                                     const DeviceSpec& access, uint64_t bytes) {
#if DUET_HAVE_CUDA
    auto m = SharedKvArena::open_peer(instance, arena, access.index, bytes);
    if (!m) return m.error();
    const int device = (*m)->device();
    const bool peer = (*m)->peer();
    return std::unique_ptr<DeviceKvMemory>(std::make_unique<Held<SharedKvArena>>(std::move(m).value(), device, peer));
#else
    (void)instance;
    (void)arena;
    (void)bytes;
    return no_cuda(access);
#endif
}

#if DUET_HAVE_CUDA
namespace {

// kept_kv_stage's stage: maps the arena on the first copy, then CudaKvStage.
class KeptArenaStage final : public KvStage {
public:
    KeptArenaStage(std::string instance, uint32_t arena, KvPool& mirror)
        : instance_(std::move(instance)), arena_(arena), mirror_(mirror) {}
    Status pull(std::span<const int32_t> blocks) override {
        if (Status st = map(); !st) return st;
        return stage_->pull(blocks);
    }
    Status push(std::span<const int32_t> blocks) override {
        if (Status st = map(); !st) return st;
        return stage_->push(blocks);
    }

private:
    Status map() {
        if (stage_) return {};
        const uint64_t bytes = mirror_.layout().block_bytes() * static_cast<uint64_t>(mirror_.allocator().n_blocks());
        auto m = SharedKvArena::open_peer(instance_, arena_, -1, bytes);
        if (!m) return make_error("the KV arena of the contexts: {}", m.error().message);
        auto st = CudaKvStage::create(m.value()->device(), m.value()->data(), mirror_);
        if (!st) return make_error("the KV arena of the contexts: {}", st.error().message);
        mem_ = std::move(m).value();
        stage_ = std::move(st).value();
        return {};
    }
    std::string instance_;
    uint32_t arena_;
    KvPool& mirror_;
    std::unique_ptr<SharedKvArena> mem_;
    std::unique_ptr<CudaKvStage> stage_;
};

}  // namespace
#endif

Result<std::unique_ptr<KvStage>> kept_kv_stage(const std::string& instance, uint32_t arena, KvPool& mirror) {
#if DUET_HAVE_CUDA
    return std::unique_ptr<KvStage>(std::make_unique<KeptArenaStage>(instance, arena, mirror));
#else
    (void)instance;
    (void)arena;
    (void)mirror;
    return make_error(ErrorKind::Device, "the KV arena is on a GPU and this duet was built without CUDA");
#endif
}

Result<std::unique_ptr<KvStage>> device_kv_stage(const DeviceKvMemory& kv, KvPool& mirror) {
#if DUET_HAVE_CUDA
    auto st = CudaKvStage::create(kv.device(), kv.data(), mirror);
    if (!st) return st.error();
    return std::unique_ptr<KvStage>(std::move(st).value());
#else
    (void)kv;
    (void)mirror;
    return make_error(ErrorKind::Device, "GPU KV memory and this duet was built without CUDA");
#endif
}

Result<std::unique_ptr<DeviceKvMemory>> hold_legacy_kv(const std::string& instance, uint32_t arena, const DeviceSpec& d,
                                                       uint64_t bytes) {
#if DUET_HAVE_CUDA
    auto mode = kv_sharing(d.index);
    if (!mode) return mode.error();
    if (*mode != KvSharing::Ipc) return std::unique_ptr<DeviceKvMemory>();
    auto owner = IpcKvArenaOwner::create(instance, arena, d.index, bytes);
    if (!owner) return owner.error();
    return std::unique_ptr<DeviceKvMemory>(std::make_unique<HeldOwner>(std::move(owner).value(), d.index));
#else
    (void)instance;
    (void)arena;
    (void)bytes;
    return no_cuda(d);
#endif
}

Result<MadeBackend> make_backend(const Model& model, KvPool& pool, const BackendOptions& o) {
    MadeBackend made;
    if (o.device.cuda) {
#if DUET_HAVE_CUDA
        CudaBackendOptions co;
        co.device = o.device.index;
        co.max_batch = o.max_batch;
        co.max_ctx = o.max_ctx;
        co.graphs = o.cuda_graphs;
        co.quantized_gemv = o.cuda_qgemv;
        co.share_weights_instance = o.share_weights_instance;
        auto b = CudaBackend::create(model, pool, co);
        if (!b) return b.error();
        made.description = (*b)->describe();
        made.backend = std::move(b).value();
        return made;
#else
        return no_cuda(o.device);
#endif
    }
    if (!o.threads) return make_error("the CPU backend needs compute threads");
    made.backend = std::make_unique<CpuBackend>(model, pool, *o.threads, o.isa);
    made.description = fmt::format("cpu {}, {} threads", cpu::isa_name(o.isa), o.threads->size());
    return made;
}

}  // namespace duet
