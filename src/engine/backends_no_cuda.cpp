// The GPU half of the backend factory in a build without CUDA (CMake compiles this
// file or backends_cuda.cpp): every device query answers "no GPU", and every GPU
// request is an error that says the build has no CUDA.
#include "engine/backends.h"

namespace duet {

namespace {

Error no_cuda(const DeviceSpec& d) {
    return make_error(ErrorKind::Device, "device {}: this duet was built without CUDA (configure with -DDUET_CUDA=ON)",
                      d.name());
}

}  // namespace

bool cuda_built() { return false; }

Status check_device(const DeviceSpec& d) {
    if (!d.cuda) return {};
    return no_cuda(d);
}

std::string cuda_pci_address(const DeviceSpec& d) {
    (void)d;
    return "";
}

Result<uint64_t> cuda_total_memory(const DeviceSpec& d) {
    return make_error("{}: this duet was built without CUDA", d.name());
}

Result<std::unique_ptr<DeviceKvMemory>> make_device_kv(const DeviceSpec& d, const KvLayout& l, int32_t n_blocks) {
    (void)l;
    (void)n_blocks;
    return no_cuda(d);
}

Result<std::unique_ptr<DeviceKvMemory>> open_shared_kv(const std::string& instance, uint32_t arena, const DeviceSpec& d,
                                                       uint64_t bytes) {
    (void)instance;
    (void)arena;
    (void)bytes;
    return no_cuda(d);
}

Result<std::unique_ptr<DeviceKvMemory>> open_peer_kv(const std::string& instance, uint32_t arena,
                                                     const DeviceSpec& access, uint64_t bytes) {
    (void)instance;
    (void)arena;
    (void)bytes;
    return no_cuda(access);
}

Result<std::unique_ptr<KvStage>> kept_kv_stage(const std::string& instance, uint32_t arena, KvPool& mirror) {
    (void)instance;
    (void)arena;
    (void)mirror;
    return make_error(ErrorKind::Device, "the KV arena is on a GPU and this duet was built without CUDA");
}

Result<std::unique_ptr<KvStage>> device_kv_stage(const DeviceKvMemory& kv, KvPool& mirror) {
    (void)kv;
    (void)mirror;
    return make_error(ErrorKind::Device, "GPU KV memory and this duet was built without CUDA");
}

Result<std::unique_ptr<DeviceKvMemory>> hold_legacy_kv(const std::string& instance, uint32_t arena, const DeviceSpec& d,
                                                       uint64_t bytes) {
    (void)instance;
    (void)arena;
    (void)bytes;
    return no_cuda(d);
}

Result<MadeBackend> make_gpu_backend(const Model& model, KvPool& pool, const BackendOptions& o) {
    (void)model;
    (void)pool;
    return no_cuda(o.device);
}

}  // namespace duet
