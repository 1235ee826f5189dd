// KV blobs of sequences whose blocks live in GPU memory (a CUDA backend's KvPool):
// through page-locked host memory, with the checks of kv/blob.h. The current CUDA
// device must be the arena's.
#pragma once

#include <memory>
#include <span>
#include <string>

#include "kv/blob.h"
#include "kv/kv_copy.h"
#include "kv/kv_stage.h"

namespace duet {

// Queues on `stream` (a cudaStream_t of the current device) the copies `runs` from
// `from` to `to`. Many small runs (fragmented block ids: at most 256 KiB a run on
// average, every run's ends and length 16-byte aligned) go as one copy_runs launch
// per ByteRuns::kMax runs (kernels/cuda/ops.h) where the current device's kernels
// reach both ends (its own memory, page-locked host memory); otherwise (a few large
// runs, which the copy engines move faster; memory of another GPU; pageable host
// memory) a cudaMemcpyAsync per run. No run's source may overlap another's
// destination (the KV copies go between two arenas). On an error the copies queued
// before it stay queued. *by_kernel (optional): whether the launches were used.
Status queue_runs(void* to, const void* from, std::span<const CopyRun> runs, void* stream, bool* by_kernel = nullptr);

// blob_write for a device arena: the tiles of the blocks that hold positions
// [first, first + n) are copied to a page-locked staging arena (one copy per run of
// consecutive block ids per layer), then written from there.
Result<BlobHeader> blob_write_device(const std::string& path, const KvIdentity& id, KvPool& dev, const KvSeq& seq,
                                     std::span<const int32_t> tokens, uint64_t first, uint64_t n);

// blob_import for a device arena. The blob is read and checked (CRC, fingerprints,
// shape, token ids, dtype converted) in page-locked staging blocks, with the
// sequence's partial last block copied there first; only then are fresh device
// blocks written from the staging blocks and swapped into seq. On any failure the
// fresh blocks are freed and seq is as before.
Result<BlobImport> blob_import_device(const std::string& path, const KvIdentity& want, KvPool& dev, KvSeq& seq);

// The stage between a GPU arena (`arena`, device memory of GPU `device`, in this
// process's address space) and its host mirror (kv/kv_stage.h), through a
// page-locked bounce pool of two halves of about 16 MiB (BounceKvStage, rules B1-B3):
// one stream, an event per half. The mirror is pageable memory reserved as large as
// the arena, so it cannot be page-locked whole; copies from pageable memory would be
// staged by the driver through its own small buffer, one synchronous piece at a time.
class CudaKvStage final : public BounceKvStage {
public:
    static Result<std::unique_ptr<CudaKvStage>> create(int device, void* arena, KvPool& mirror,
                                                       size_t half_bytes = size_t{16} << 20);
    ~CudaKvStage() override;

protected:
    Status start_pull(std::span<const int32_t> arena, std::span<const int32_t> bounce, int half) override;
    Status start_push(std::span<const int32_t> bounce, std::span<const int32_t> arena, int half) override;
    Status wait(int half) override;

private:
    CudaKvStage(int device, void* arena, KvPool& mirror, std::unique_ptr<KvPool> bounce, void* pinned);
    Status start(const void* from, int32_t from_blocks, std::span<const int32_t> src, void* to, int32_t to_blocks,
                 std::span<const int32_t> dst, int half);
    int device_;
    void* arena_;
    int32_t arena_blocks_;
    std::unique_ptr<KvPool> bounce_;
    void* pinned_ = nullptr;
    void* stream_ = nullptr;      // cudaStream_t
    void* events_[2] = {};        // cudaEvent_t
    Status failed_[2];            // a start's error, reported by wait
};

}  // namespace duet
