// KV blobs of sequences whose blocks live in GPU memory (a CUDA backend's KvPool):
// through page-locked host memory, with the checks of kv/blob.h. The current CUDA
// device must be the arena's.
#pragma once

#include <span>
#include <string>

#include "kv/blob.h"
#include "kv/kv_stage.h"

namespace duet {

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
// process's address space) and its host mirror (kv/kv_stage.h): every layer of
// whole blocks, runs of consecutive ids merged, one stream, waited on. The mirror is
// pageable memory (it is reserved as large as the arena: it cannot be page-locked
// whole); the driver stages those copies itself.
class CudaKvStage final : public KvStage {
public:
    CudaKvStage(int device, void* arena, KvPool& mirror);
    Status pull(std::span<const int32_t> blocks) override;
    Status push(std::span<const int32_t> blocks) override;

private:
    int device_;
    void* arena_;
    KvPool& mirror_;
};

}  // namespace duet
