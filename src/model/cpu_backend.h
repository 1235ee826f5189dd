// The CPU backend: Llama-family forward pass on kernels/cpu, threads in a
// ThreadPool working SPMD with a barrier between phases.
#pragma once

#include <memory>

#include "base/thread_pool.h"
#include "kernels/cpu/kernels.h"
#include "model/backend.h"
#include "model/model.h"

namespace duet {

class CpuBackend final : public Backend {
public:
    CpuBackend(const Model& model, KvPool& pool, ThreadPool& threads, cpu::Isa isa);
    ~CpuBackend() override;

    Status forward(std::span<SeqBatch> batch, std::vector<float>& logits) override;
    // Checked by thread 0 before the last barrier of each layer in the pass's first
    // half; its answer for layer l + 1 is read by every thread after that barrier,
    // so all stop at the same layer.
    void set_interrupt(std::function<bool()> stop) override { interrupt_ = std::move(stop); }
    // forward(), then every exported sequence's blocks copied (memcpy, host arenas).
    Status forward_export(std::span<SeqBatch> batch, std::vector<float>& logits, const KvExport& exp) override;
    int64_t n_vocab() const override;
    cpu::Isa isa() const { return isa_; }

private:
    struct Scratch;
    void run(int tid, int nth);

    const Model& model_;
    KvPool& pool_;
    ThreadPool& threads_;
    cpu::Isa isa_;
    std::unique_ptr<Scratch> s_;
    std::function<bool()> interrupt_;
};

}  // namespace duet
