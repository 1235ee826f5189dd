// The backend factory's part every build has: the CPU backend, and GPUs through
// make_gpu_backend, which backends_cuda.cpp (a build with CUDA) or
// backends_no_cuda.cpp (without: every GPU request is an error saying so) defines;
// CMake compiles one of the two (src/CMakeLists.txt), so no source here switches on
// DUET_HAVE_CUDA.
#include "engine/backends.h"

#include "model/cpu_backend.h"

namespace duet {

Result<MadeBackend> make_backend(const Model& model, KvPool& pool, const BackendOptions& o) {
    if (o.device.cuda) return make_gpu_backend(model, pool, o);
    if (!o.threads) return make_error("the CPU backend needs compute threads");
    MadeBackend made;
    made.backend = std::make_unique<CpuBackend>(model, pool, *o.threads, o.isa);
    made.description = fmt::format("cpu {}, {} threads", cpu::isa_name(o.isa), o.threads->size());
    return made;
}

}  // namespace duet
