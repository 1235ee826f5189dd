// The CUDA backend: the same forward pass as the CPU backend (src/model/cpu_backend.h)
// on one GPU. Weights are GGUF tensors dequantized to bf16 at load and multiplied by
// cuBLAS (f32 accumulation); norms, RoPE, SwiGLU, KV append and paged attention are
// the kernels of kernels/cuda. The KV pool's data is device memory (a CudaKvMemory of
// this process, or the instance's shared device arena); its block metadata stays in
// the shm control segment as on CPU. Decode steps (one token per sequence) replay
// CUDA graphs captured per (batch bucket, attention split count); prefill chunks and
// larger batches run eagerly. Rows forward_pick samples (greedy or not) are picked on
// the device (kernels/cuda argmax_rows, sample_rows: the CPU sampler's tokens for the
// same (seed, position)) and their logits stay there; other rows come back to the host.
//
// Built only with DUET_CUDA (DUET_HAVE_CUDA=1); this header includes no CUDA header.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "base/result.h"
#include "kv/kv_copy.h"
#include "kv/kv_pool.h"
#include "model/backend.h"
#include "model/model.h"

namespace duet {

struct CudaBackendOptions {
    int device = 0;
    int max_batch = 256;     // decode steps of up to this many sequences replay graphs
    int64_t max_ctx = 4096;  // the longest sequence a graph-replayed step may hold
    bool graphs = true;      // false: every pass eager (for comparison and debugging)
    // Projections of passes of at most 8 tokens (decode steps of small batches) from
    // the GGUF blocks of Q4_0 / Q4_1 / Q8_0 matrices (kernels/cuda qgemv.h), kept on
    // the device next to the bf16 copy; larger passes and other types use cuBLAS.
    // Off until a GPU run shows it faster (duet bench cuda measures both).
    bool quantized_gemv = false;
    // The weights in device memory shared with the instance's other processes on this
    // GPU (cuda_arena.h SharedDeviceBuffer: one copy per GPU, not one per process);
    // "": a private copy. Falls back to a private copy where sharing is impossible.
    std::string share_weights_instance;
};

// Device memory for a KV pool's data, owned by this process (cudaMalloc): what
// `duet run --device cuda:N` uses. The serving roles share one arena between
// processes instead (kernels/cuda/vmm.h).
class CudaKvMemory {
public:
    static Result<std::unique_ptr<CudaKvMemory>> create(int device, const KvLayout& l, int32_t n_blocks);
    ~CudaKvMemory();
    CudaKvMemory(const CudaKvMemory&) = delete;
    CudaKvMemory& operator=(const CudaKvMemory&) = delete;
    void* data() const { return data_; }
    size_t bytes() const { return bytes_; }

private:
    CudaKvMemory() = default;
    int device_ = 0;
    void* data_ = nullptr;
    size_t bytes_ = 0;
};

class CudaBackend final : public Backend {
public:
    // pool's data must be device memory that options.device can read and write.
    // Errors: no such device, a model the kernels do not cover (head_dim other than
    // 64 or 128), out of device memory.
    static Result<std::unique_ptr<CudaBackend>> create(const Model& model, KvPool& pool, const CudaBackendOptions& o);
    ~CudaBackend() override;

    Status forward(std::span<SeqBatch> batch, std::vector<float>& logits) override;
    int64_t n_vocab() const override;
    // forward(), also copying every block of the exported sequences into their
    // destination arenas (kv_copy.h KvExport: decode's, on this GPU or another): each
    // layer's copies go on a copy stream as soon as the pass has written that layer,
    // overlapping the next layers' compute; peer copies where the GPUs reach each
    // other, driver-staged through host memory otherwise. Returns once the last
    // layer has landed. The pass runs eagerly.
    Status forward_export(std::span<SeqBatch> batch, std::vector<float>& logits, const KvExport& exp) override;
    // The argmax of every output row on the device (kernels/cuda argmax_rows), and the
    // rows of entries with `sample` sampled there (sample_rows; a row whose top-k or
    // top-p needs more than kSampleMaxSorted sorted candidates is copied back and
    // sampled on the host); only the rows of other entries come back to the host.
    Status forward_pick(std::span<SeqBatch> batch, std::vector<float>& logits, std::vector<int32_t>& argmax) override;
    // Both of its streams drained.
    Status sync() override;

    // "NVIDIA H200 (sm_90, 141 GiB), weights 270 MiB bf16, graphs for batches up to 256"
    std::string describe() const;
    size_t weight_bytes() const;
    // Decode graphs captured so far, and forward passes that replayed one.
    int graphs_captured() const;
    int64_t graph_replays() const;

private:
    CudaBackend();
    Status forward_impl(std::span<SeqBatch> batch, std::vector<float>& logits, const KvExport* exp,
                        std::vector<int32_t>* argmax);
    struct Impl;
    std::unique_ptr<Impl> d_;
};

}  // namespace duet
