#include "kv/kv_pool.h"

#include <algorithm>
#include <cassert>
#include <cstdlib>
#include <cstring>

namespace duet {

LocalBlockAllocator::LocalBlockAllocator(int32_t n_blocks) : refs_(n_blocks, 0) {
    free_.reserve(n_blocks);
    // Lowest ids on top of the stack: allocation order is 0, 1, 2, ...
    for (int32_t b = n_blocks - 1; b >= 0; --b) free_.push_back(b);
}

bool LocalBlockAllocator::alloc(int32_t n, int32_t* out) {
    if (n < 0 || n > n_free()) return false;
    for (int32_t i = 0; i < n; ++i) {
        out[i] = free_.back();
        free_.pop_back();
        refs_[out[i]] = 1;
    }
    return true;
}

void LocalBlockAllocator::ref(int32_t block) {
    assert(refs_[block] > 0);
    ++refs_[block];
}

void LocalBlockAllocator::unref(int32_t block) {
    assert(refs_[block] > 0);
    if (--refs_[block] == 0) free_.push_back(block);
}

const char* kv_dtype_name(KvDtype t) {
    switch (t) {
        case KvDtype::F16: return "f16";
        case KvDtype::Int8: return "int8";
        case KvDtype::Fp8: return "fp8";
    }
    return "?";
}

Result<KvDtype> parse_kv_dtype(std::string_view name) {
    for (KvDtype t : {KvDtype::F16, KvDtype::Int8, KvDtype::Fp8})
        if (name == kv_dtype_name(t)) return t;
    return make_error("unknown KV dtype '{}' (f16, int8 or fp8)", name);
}

Result<KvDtype> kv_dtype_from(uint32_t v) {
    if (v > static_cast<uint32_t>(KvDtype::Fp8)) return make_error("unknown KV dtype number {}", v);
    return static_cast<KvDtype>(v);
}

Result<std::unique_ptr<KvPool>> KvPool::create(const KvLayout& layout, int32_t n_blocks) {
    if (n_blocks <= 0) return make_error("KV pool needs at least one block, got {}", n_blocks);
    size_t bytes = layout.block_bytes() * static_cast<size_t>(n_blocks);
    bytes = (bytes + 4095) / 4096 * 4096;
    void* p = std::aligned_alloc(4096, bytes);
    if (!p) return make_error("cannot allocate {} MiB for {} KV blocks", bytes >> 20, n_blocks);
    auto pool = std::make_unique<KvPool>(layout, p,
                                         std::make_unique<LocalBlockAllocator>(n_blocks));
    pool->owned_ = true;
    return pool;
}

KvPool::KvPool(const KvLayout& layout, void* data, std::unique_ptr<KvBlockAllocator> allocator)
    : layout_(layout), data_(static_cast<uint8_t*>(data)), n_blocks_(allocator->n_blocks()), alloc_(std::move(allocator)) {}

KvPool::~KvPool() {
    if (owned_) std::free(data_);
}

void KvPool::copy_block(int32_t dst, int32_t src) {
    if (block_copy_) return block_copy_(dst, src);
    const size_t n = layout_.tile_bytes();
    for (int32_t l = 0; l < layout_.n_layer; ++l) std::memcpy(tile(dst, l), tile(src, l), n);
}

KvSeq::~KvSeq() { assert(blocks_.empty() && "KvSeq destroyed without release()"); }

KvSeq::KvSeq(KvSeq&& o) noexcept : blocks_(std::move(o.blocks_)), n_tokens_(o.n_tokens_) {
    o.blocks_.clear();
    o.n_tokens_ = 0;
}

KvSeq& KvSeq::operator=(KvSeq&& o) noexcept {
    assert(blocks_.empty());
    blocks_ = std::move(o.blocks_);
    n_tokens_ = o.n_tokens_;
    o.blocks_.clear();
    o.n_tokens_ = 0;
    return *this;
}

Status KvSeq::prepare_append(KvPool& pool, int64_t from, int64_t new_len) {
    const int64_t bt = pool.layout().block_tokens;
    const int64_t need = (new_len + bt - 1) / bt;
    const int64_t have = static_cast<int64_t>(blocks_.size());
    KvBlockAllocator& a = pool.allocator();
    // Shared blocks that the new positions would write into.
    std::vector<int64_t> cow;
    for (int64_t i = from / bt; i < std::min(have, need); ++i)
        if (a.refcount(blocks_[i]) > 1) cow.push_back(i);
    const int64_t n_new = std::max<int64_t>(0, need - have);
    const int64_t total = n_new + static_cast<int64_t>(cow.size());
    // Cached blocks no one holds can be taken too (the allocator evicts them): counted
    // only when the free ones fall short.
    if (total > a.n_free() && total > a.n_available())
        return make_error(ErrorKind::NoKvBlocks, "KV cache is full: {} more blocks needed, {} free or cached of {}",
                          total, a.n_available(), a.n_blocks());
    std::vector<int32_t> fresh(total);
    if (!a.alloc(static_cast<int32_t>(total), fresh.data()))
        return make_error(ErrorKind::NoKvBlocks, "KV block allocation of {} failed", total);
    size_t k = 0;
    for (int64_t i : cow) {
        pool.copy_block(fresh[k], blocks_[i]);
        a.unref(blocks_[i]);
        blocks_[i] = fresh[k++];
    }
    while (k < fresh.size()) blocks_.push_back(fresh[k++]);
    return {};
}

void KvSeq::truncate(KvPool& pool, int64_t n) {
    const int64_t bt = pool.layout().block_tokens;
    const size_t keep = static_cast<size_t>((n + bt - 1) / bt);
    while (blocks_.size() > keep) {
        pool.allocator().unref(blocks_.back());
        blocks_.pop_back();
    }
    n_tokens_ = std::min(n_tokens_, n);
}

KvSeq KvSeq::adopt(std::vector<int32_t> blocks, int64_t n_tokens) {
    KvSeq s;
    s.blocks_ = std::move(blocks);
    s.n_tokens_ = n_tokens;
    return s;
}

std::vector<int32_t> KvSeq::detach() {
    std::vector<int32_t> b = std::move(blocks_);
    blocks_.clear();
    n_tokens_ = 0;
    return b;
}

KvSeq KvSeq::fork(KvPool& pool) const {
    KvSeq s;
    s.blocks_ = blocks_;
    s.n_tokens_ = n_tokens_;
    for (int32_t b : blocks_) pool.allocator().ref(b);
    return s;
}

}  // namespace duet
