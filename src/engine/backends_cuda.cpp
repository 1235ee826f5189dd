// The GPU half of the backend factory in a build with CUDA (CMake compiles this
// file or backends_no_cuda.cpp): device queries, the CUDA backend, and the GPU KV
// memory holders behind DeviceKvMemory.
#include "engine/backends.h"

#include "cuda/cuda_arena.h"
#include "cuda/cuda_backend.h"
#include "cuda/cuda_kv_io.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/vmm.h"

namespace duet {

namespace {

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

}  // namespace

bool cuda_built() { return true; }

Status check_device(const DeviceSpec& d) {
    if (!d.cuda) return {};
    const int n = cuda::device_count();
    if (d.index >= n)
        return make_error(ErrorKind::Device, "{}: no such device ({} CUDA device{} visible)", d.name(), n,
                          n == 1 ? "" : "s");
    return {};
}

std::string cuda_pci_address(const DeviceSpec& d) {
    if (d.cuda) return cuda::pci_bus_id(d.index);
    return "";
}

Result<uint64_t> cuda_total_memory(const DeviceSpec& d) {
    std::string why;
    const size_t n = d.cuda ? cuda::device_total_memory(d.index, &why) : 0;
    if (n == 0) return make_error("{}: its memory size cannot be told: {}", d.name(), d.cuda ? why : "not a GPU");
    return static_cast<uint64_t>(n);
}

Result<std::unique_ptr<DeviceKvMemory>> make_device_kv(const DeviceSpec& d, const KvLayout& l, int32_t n_blocks) {
    auto m = CudaKvMemory::create(d.index, l, n_blocks);
    if (!m) return m.error();
    return std::unique_ptr<DeviceKvMemory>(std::make_unique<Held<CudaKvMemory>>(std::move(m).value(), d.index, true));
}

Result<std::unique_ptr<DeviceKvMemory>> open_shared_kv(const std::string& instance, uint32_t arena, const DeviceSpec& d,
                                                       uint64_t bytes) {
    auto m = SharedKvArena::open(instance, arena, d.index, bytes);
    if (!m) return m.error();
    const int device = (*m)->device();
    return std::unique_ptr<DeviceKvMemory>(std::make_unique<Held<SharedKvArena>>(std::move(m).value(), device, true));
}

Result<std::unique_ptr<DeviceKvMemory>> open_peer_kv(const std::string& instance, uint32_t arena,
                                                     const DeviceSpec& access, uint64_t bytes) {
    auto m = SharedKvArena::open_peer(instance, arena, access.index, bytes);
    if (!m) return m.error();
    const int device = (*m)->device();
    const bool peer = (*m)->peer();
    return std::unique_ptr<DeviceKvMemory>(std::make_unique<Held<SharedKvArena>>(std::move(m).value(), device, peer));
}

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

Result<std::unique_ptr<KvStage>> kept_kv_stage(const std::string& instance, uint32_t arena, KvPool& mirror) {
    return std::unique_ptr<KvStage>(std::make_unique<KeptArenaStage>(instance, arena, mirror));
}

Result<std::unique_ptr<KvStage>> device_kv_stage(const DeviceKvMemory& kv, KvPool& mirror) {
    auto st = CudaKvStage::create(kv.device(), kv.data(), mirror);
    if (!st) return st.error();
    return std::unique_ptr<KvStage>(std::move(st).value());
}

Result<std::unique_ptr<DeviceKvMemory>> hold_legacy_kv(const std::string& instance, uint32_t arena, const DeviceSpec& d,
                                                       uint64_t bytes) {
    auto mode = kv_sharing(d.index);
    if (!mode) return mode.error();
    if (*mode != KvSharing::Ipc) return std::unique_ptr<DeviceKvMemory>();
    auto owner = IpcKvArenaOwner::create(instance, arena, d.index, bytes);
    if (!owner) return owner.error();
    return std::unique_ptr<DeviceKvMemory>(std::make_unique<HeldOwner>(std::move(owner).value(), d.index));
}

Result<MadeBackend> make_gpu_backend(const Model& model, KvPool& pool, const BackendOptions& o) {
    CudaBackendOptions co;
    co.device = o.device.index;
    co.max_batch = o.max_batch;
    co.max_ctx = o.max_ctx;
    co.graphs = o.cuda_graphs;
    co.quantized_gemv = o.cuda_qgemv;
    co.share_weights_instance = o.share_weights_instance;
    auto b = CudaBackend::create(model, pool, co);
    if (!b) return b.error();
    MadeBackend made;
    made.description = (*b)->describe();
    made.backend = std::move(b).value();
    return made;
}

}  // namespace duet
