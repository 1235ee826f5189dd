// A single-process engine: the model, its tokenizer, a KV pool, a thread team and
// the CPU backend, plus a one-sequence generate loop. `duet run` and `duet bench
// model` use it; the serving roles build on the same pieces.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "base/result.h"
#include "base/thread_pool.h"
#include "engine/token_step.h"
#include "kernels/cpu/kernels.h"
#include "kv/kv_pool.h"
#include "kv/shm_kv.h"
#include "model/cpu_backend.h"
#include "model/device_spec.h"
#include "model/model.h"
#include "model/sampler.h"
#include "model/tokenizer.h"

namespace duet {

struct EngineOptions {
    std::string model_path;
    int threads = 0;              // 0: one per CPU in `cpus`, or all online CPUs
    std::vector<int> cpus;        // pin threads here; empty: no pinning
    int64_t n_ctx = 0;            // KV capacity in tokens; 0: min(model's, 4096)
    std::string isa;              // "", "scalar", "avx2", "avx512", "amx"
    std::string instance;         // shm instance name (segments duet.<name>); "": run-<pid>-<n>
    bool huge_pages = true;       // for the KV data segment, when the system has them
    std::string device = "cpu";   // "cpu" or "cuda:N" (a build with DUET_CUDA)
    bool cuda_graphs = true;      // decode steps replay CUDA graphs (cuda devices)
    bool cuda_qgemv = false;      // decode projections from GGUF blocks (CudaBackendOptions::quantized_gemv)
    std::string kv_dtype = "f16";  // how the KV cache stores its values: f16, int8, fp8
};

struct GenerateOptions {
    int64_t max_tokens = 128;
    SamplingParams sampling;
    int64_t prefill_budget = 512;  // tokens per prefill forward pass
    bool stop_at_eog = true;
};

struct GenerateStats {
    int64_t prompt_tokens = 0;
    int64_t generated = 0;
    double prompt_seconds = 0;    // prefill, up to the first sampled token
    double generate_seconds = 0;  // the decode steps after it
    Finish finish = Finish::None;  // Eog or Length once it ends; None if on_token stopped it
};

class DeviceKvMemory;

class Engine {
public:
    static Result<std::unique_ptr<Engine>> create(const EngineOptions& opts);
    ~Engine();

    const Model& model() const { return *model_; }
    const Tokenizer& tokenizer() const { return *tok_; }
    KvPool& pool() { return shm_->pool(); }
    ShmKv& shm() { return *shm_; }
    ThreadPool& threads() { return *threads_; }
    Backend& backend() { return *backend_; }
    cpu::Isa isa() const { return isa_; }  // the CPU backend's (and the host kernels')
    const DeviceSpec& device() const { return device_; }
    // One line: the device and how the backend runs there.
    const std::string& backend_description() const { return backend_desc_; }
    int64_t n_ctx() const { return n_ctx_; }

    // Prefills prompt (in chunks), then samples and decodes until max_tokens, an
    // end-of-generation token, or on_token returning false. on_token sees each
    // generated token id (including a final end-of-generation token).
    Result<GenerateStats> generate(const std::vector<int32_t>& prompt, const GenerateOptions& opts,
                                   const std::function<bool(int32_t)>& on_token);

private:
    Engine() = default;

    std::unique_ptr<Model> model_;
    std::unique_ptr<Tokenizer> tok_;
    std::unique_ptr<ShmKv> shm_;  // the KV pool, on the shared-memory arena
    std::unique_ptr<ThreadPool> threads_;
    std::unique_ptr<DeviceKvMemory> device_kv_;  // before shm_: the pool points into it
    std::unique_ptr<Backend> backend_;
    cpu::Isa isa_ = cpu::Isa::Scalar;
    DeviceSpec device_;
    std::string backend_desc_;
    int64_t n_ctx_ = 0;
    Sampler sampler_;
};

// Parses "scalar" / "avx2" / "avx512" / "amx" / "" (best); an Error when the CPU lacks it.
Result<cpu::Isa> parse_isa(const std::string& name);

}  // namespace duet
