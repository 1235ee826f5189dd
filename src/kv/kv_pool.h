// Paged KV cache: a pool of fixed-size blocks (16 tokens by default) and the
// per-sequence block tables that index it.
//
// Data layout (DESIGN.md "KV arena"): layer planes are contiguous, so one layer of
// many blocks can be copied at once. One (layer, block) tile holds
//   [K|V][kv_head][token in block][dim] values (f16, or int8 / fp8 e4m3 bytes), then,
//   quantized, [K|V][kv_head][token in block] f32 scales: value = scale * stored.
// A quantized row (one token of one head) has its own scale, computed when the
// token is written and never changed: a scale per whole block would change as
// tokens are appended, requantizing the earlier ones, and a token's result would
// then depend on how its neighbours were chunked (and on later tokens). The scales
// live in the block, so a block copy, a hand-off or a fork carries them along.
// Block allocation sits behind KvBlockAllocator so the shared-memory arena can
// replace the in-process allocator without touching the model.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string_view>
#include <vector>

#include "base/result.h"

namespace duet {

// How KV values are stored. The numbers are part of the shm layout (InstanceConfig).
enum class KvDtype : uint8_t {
    F16 = 0,
    Int8 = 1,  // symmetric: scale = max |x| / 127 per row, stored = round(x / scale)
    Fp8 = 2,   // e4m3 (OCP "fn": no infinities, max 448): scale = max |x| / 448 per row
};
const char* kv_dtype_name(KvDtype t);  // "f16", "int8", "fp8"
Result<KvDtype> parse_kv_dtype(std::string_view name);
// A dtype number as stored in shared memory (shm::InstanceConfig::kv_dtype).
Result<KvDtype> kv_dtype_from(uint32_t v);

struct KvLayout {
    int32_t n_layer = 0;
    int32_t n_head_kv = 0;
    int32_t head_dim = 0;
    int32_t block_tokens = 16;
    KvDtype dtype = KvDtype::F16;

    bool quantized() const { return dtype != KvDtype::F16; }
    size_t elem_bytes() const { return quantized() ? 1 : 2; }
    // Rows (token x head) of K, or of V, in one tile.
    size_t rows() const { return static_cast<size_t>(n_head_kv) * block_tokens; }
    // Bytes of K values (or of V values) in one tile; K's scales follow V's values.
    size_t values_bytes() const { return rows() * head_dim * elem_bytes(); }
    size_t scales_bytes() const { return quantized() ? rows() * sizeof(float) : 0; }
    // One (layer, block) tile: K and V for every head and token, with their scales.
    size_t tile_bytes() const { return 2 * (values_bytes() + scales_bytes()); }
    // Bytes of one block, all layers (an arena of n blocks holds n of these).
    size_t block_bytes() const { return tile_bytes() * static_cast<size_t>(n_layer); }
    // Bytes of KV per token, all layers.
    size_t bytes_per_token() const { return block_bytes() / static_cast<size_t>(block_tokens); }
};

// Hands out block ids with reference counts. Not thread-safe: one engine thread
// allocates; forward passes only read and write block contents.
class KvBlockAllocator {
public:
    virtual ~KvBlockAllocator() = default;
    virtual int32_t n_blocks() const = 0;
    virtual int32_t n_free() const = 0;
    // Blocks an alloc() can take now: the free ones and, where the allocator keeps a
    // prefix cache, cached blocks no one references (alloc evicts them).
    virtual int32_t n_available() const { return n_free(); }
    // Takes n blocks (refcount 1) into out, all or nothing.
    virtual bool alloc(int32_t n, int32_t* out) = 0;
    virtual void ref(int32_t block) = 0;
    // Drops a reference; the block is free again when the count reaches zero.
    virtual void unref(int32_t block) = 0;
    virtual int32_t refcount(int32_t block) const = 0;
};

// The in-process allocator: a free stack and a refcount array.
class LocalBlockAllocator final : public KvBlockAllocator {
public:
    explicit LocalBlockAllocator(int32_t n_blocks);
    int32_t n_blocks() const override { return static_cast<int32_t>(refs_.size()); }
    int32_t n_free() const override { return static_cast<int32_t>(free_.size()); }
    bool alloc(int32_t n, int32_t* out) override;
    void ref(int32_t block) override;
    void unref(int32_t block) override;
    int32_t refcount(int32_t block) const override { return refs_[block]; }

private:
    std::vector<int32_t> free_;
    std::vector<int32_t> refs_;
};

class KvPool {
public:
    // Owns n_blocks blocks of data in process memory.
    static Result<std::unique_ptr<KvPool>> create(const KvLayout& layout, int32_t n_blocks);
    // Blocks of data at `data` (not owned), ids from `allocator`.
    KvPool(const KvLayout& layout, void* data, std::unique_ptr<KvBlockAllocator> allocator);
    ~KvPool();
    KvPool(const KvPool&) = delete;
    KvPool& operator=(const KvPool&) = delete;

    const KvLayout& layout() const { return layout_; }
    // Every block's data, in the layout above (host or device memory).
    void* data() const { return data_; }
    KvBlockAllocator& allocator() { return *alloc_; }
    const KvBlockAllocator& allocator() const { return *alloc_; }

    // [token][dim] rows of one head of one block of one layer (elem_bytes() each
    // value), and, quantized, the rows' [token] scales.
    uint8_t* k(int32_t block, int32_t layer, int32_t head) { return tile(block, layer) + head_off(head); }
    uint8_t* v(int32_t block, int32_t layer, int32_t head) {
        return tile(block, layer) + layout_.values_bytes() + head_off(head);
    }
    const uint8_t* k(int32_t block, int32_t layer, int32_t head) const {
        return const_cast<KvPool*>(this)->k(block, layer, head);
    }
    const uint8_t* v(int32_t block, int32_t layer, int32_t head) const {
        return const_cast<KvPool*>(this)->v(block, layer, head);
    }
    // f16 layouts: the rows as f16 bits.
    uint16_t* k16(int32_t block, int32_t layer, int32_t head) { return reinterpret_cast<uint16_t*>(k(block, layer, head)); }
    uint16_t* v16(int32_t block, int32_t layer, int32_t head) { return reinterpret_cast<uint16_t*>(v(block, layer, head)); }
    float* k_scales(int32_t block, int32_t layer, int32_t head) {
        return reinterpret_cast<float*>(tile(block, layer) + 2 * layout_.values_bytes()) + scale_off(head);
    }
    float* v_scales(int32_t block, int32_t layer, int32_t head) { return k_scales(block, layer, head) + layout_.rows(); }
    const float* k_scales(int32_t block, int32_t layer, int32_t head) const {
        return const_cast<KvPool*>(this)->k_scales(block, layer, head);
    }
    const float* v_scales(int32_t block, int32_t layer, int32_t head) const {
        return const_cast<KvPool*>(this)->v_scales(block, layer, head);
    }
    // Copies every layer of block src into block dst (copy-on-write of a shared block).
    void copy_block(int32_t dst, int32_t src);
    // How copy_block copies when the data is not host memory (a GPU arena: the
    // backend enqueues device-to-device copies on its stream). Empty: memcpy.
    // `owner` names who installed it: clear_block_copy(owner) clears it only if it
    // is still that owner's (two backends may take turns on one pool).
    using BlockCopy = std::function<void(int32_t dst, int32_t src)>;
    void set_block_copy(BlockCopy f, const void* owner = nullptr) {
        block_copy_ = std::move(f);
        block_copy_owner_ = owner;
    }
    void clear_block_copy(const void* owner) {
        if (block_copy_owner_ == owner) set_block_copy({});
    }
    const void* block_copy_owner() const { return block_copy_owner_; }

private:
    size_t head_off(int32_t head) const {
        return static_cast<size_t>(head) * layout_.block_tokens * layout_.head_dim * layout_.elem_bytes();
    }
    size_t scale_off(int32_t head) const { return static_cast<size_t>(head) * layout_.block_tokens; }
    uint8_t* tile(int32_t block, int32_t layer) {
        return data_ + (static_cast<size_t>(layer) * n_blocks_ + block) * layout_.tile_bytes();
    }

    KvLayout layout_;
    uint8_t* data_;
    bool owned_ = false;
    size_t n_blocks_;
    std::unique_ptr<KvBlockAllocator> alloc_;
    BlockCopy block_copy_;
    const void* block_copy_owner_ = nullptr;
};

// A sequence's block table: block i holds positions [16 i, 16 i + 16).
class KvSeq {
public:
    KvSeq() = default;
    ~KvSeq();  // must be release()d (or empty) before destruction; checked in debug builds
    KvSeq(const KvSeq&) = delete;
    KvSeq& operator=(const KvSeq&) = delete;
    KvSeq(KvSeq&&) noexcept;
    KvSeq& operator=(KvSeq&&) noexcept;

    int64_t n_tokens() const { return n_tokens_; }
    const std::vector<int32_t>& blocks() const { return blocks_; }

    // Makes room for positions up to new_len and makes the blocks that positions
    // [from, new_len) fall in exclusively owned (copying a shared block first), so
    // a write there is never seen by a fork. Fails, changing nothing, when the pool
    // is out of blocks.
    Status prepare_append(KvPool& pool, int64_t from, int64_t new_len);
    // Records that positions [0, n) now hold valid KV.
    void set_n_tokens(int64_t n) { n_tokens_ = n; }
    // Drops positions >= n, releasing the blocks no longer needed.
    void truncate(KvPool& pool, int64_t n);
    // A copy-on-write fork: shares every block.
    KvSeq fork(KvPool& pool) const;
    void release(KvPool& pool) { truncate(pool, 0); }
    // A sequence over blocks whose references the caller already holds (a hand-off
    // from another process), with positions [0, n_tokens) valid.
    static KvSeq adopt(std::vector<int32_t> blocks, int64_t n_tokens);
    // Gives up the block list without dropping the references (they now belong to
    // the caller, e.g. until a hand-off settles).
    std::vector<int32_t> detach();

private:
    std::vector<int32_t> blocks_;
    int64_t n_tokens_ = 0;
};

}  // namespace duet
