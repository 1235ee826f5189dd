// Paged KV cache: a pool of fixed-size blocks (16 tokens by default) and the
// per-sequence block tables that index it.
//
// Data layout (DESIGN.md "KV arena"): layer planes are contiguous, so one layer of
// many blocks can be copied at once:
//   data[layer][block][K|V][kv_head][token in block][dim], f16.
// Block allocation sits behind KvBlockAllocator so the shared-memory arena can
// replace the in-process allocator without touching the model.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "base/result.h"

namespace duet {

struct KvLayout {
    int32_t n_layer = 0;
    int32_t n_head_kv = 0;
    int32_t head_dim = 0;
    int32_t block_tokens = 16;

    // f16 values in one (layer, block) tile: K and V for every head and token.
    size_t tile_elems() const {
        return 2 * static_cast<size_t>(n_head_kv) * block_tokens * head_dim;
    }
    size_t tile_bytes() const { return tile_elems() * sizeof(uint16_t); }
    // Bytes of one block, all layers (an arena of n blocks holds n of these).
    size_t block_bytes() const { return tile_bytes() * static_cast<size_t>(n_layer); }
    // Bytes of KV per token, all layers.
    size_t bytes_per_token() const {
        return 2 * sizeof(uint16_t) * static_cast<size_t>(n_layer) * n_head_kv * head_dim;
    }
};

// Hands out block ids with reference counts. Not thread-safe: one engine thread
// allocates; forward passes only read and write block contents.
class KvBlockAllocator {
public:
    virtual ~KvBlockAllocator() = default;
    virtual int32_t n_blocks() const = 0;
    virtual int32_t n_free() const = 0;
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
    KvPool(const KvLayout& layout, uint16_t* data, std::unique_ptr<KvBlockAllocator> allocator);
    ~KvPool();
    KvPool(const KvPool&) = delete;
    KvPool& operator=(const KvPool&) = delete;

    const KvLayout& layout() const { return layout_; }
    // Every block's data, in the layout above (host or device memory).
    uint16_t* data() const { return data_; }
    KvBlockAllocator& allocator() { return *alloc_; }
    const KvBlockAllocator& allocator() const { return *alloc_; }

    // [token][dim] rows of one head of one block of one layer.
    uint16_t* k(int32_t block, int32_t layer, int32_t head) { return tile(block, layer) + head_off(head); }
    uint16_t* v(int32_t block, int32_t layer, int32_t head) {
        return tile(block, layer) + tile_half() + head_off(head);
    }
    const uint16_t* k(int32_t block, int32_t layer, int32_t head) const {
        return const_cast<KvPool*>(this)->k(block, layer, head);
    }
    const uint16_t* v(int32_t block, int32_t layer, int32_t head) const {
        return const_cast<KvPool*>(this)->v(block, layer, head);
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
    size_t tile_half() const { return layout_.tile_elems() / 2; }
    size_t head_off(int32_t head) const {
        return static_cast<size_t>(head) * layout_.block_tokens * layout_.head_dim;
    }
    uint16_t* tile(int32_t block, int32_t layer) {
        return data_ + (static_cast<size_t>(layer) * n_blocks_ + block) * layout_.tile_elems();
    }

    KvLayout layout_;
    uint16_t* data_;
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
