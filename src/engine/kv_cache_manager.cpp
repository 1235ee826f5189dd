#include "engine/kv_cache_manager.h"

#include <algorithm>

namespace duet {

int64_t blocks_to_append(const KvPool& pool, const KvSeq& seq, int64_t n) {
    const int64_t bt = pool.layout().block_tokens;
    const int64_t from = seq.n_tokens(), need = (from + n + bt - 1) / bt;
    const int64_t have = static_cast<int64_t>(seq.blocks().size());
    int64_t cow = 0;
    if (n > 0)
        for (int64_t i = from / bt; i < std::min(have, need); ++i)
            if (pool.allocator().refcount(seq.blocks()[static_cast<size_t>(i)]) > 1) ++cow;
    return std::max<int64_t>(0, need - have) + cow;
}

Status KvCacheManager::reserve(std::span<SeqBatch> batch) {
    int64_t need = 0;
    for (const SeqBatch& b : batch) need += blocks_to_append(pool_, *b.kv, b.n_tokens);
    // Cached blocks no one holds count too (alloc evicts them, least recently used
    // first); they are counted only when the free ones fall short.
    const int32_t free = pool_.allocator().n_free();
    if (need > free) {
        const int32_t available = pool_.allocator().n_available();
        if (need > available)
            return make_error(ErrorKind::NoKvBlocks,
                              "the pass needs {} KV blocks, {} of {} are free (unreferenced cached blocks counted)",
                              need, available, pool_.allocator().n_blocks());
    }
    for (size_t i = 0; i < batch.size(); ++i) {
        SeqBatch& b = batch[i];
        const int64_t from = b.kv->n_tokens();
        if (Status st = b.kv->prepare_append(pool_, from, from + b.n_tokens); !st) {
            unreserve(batch.first(i));
            return make_error(ErrorKind::NoKvBlocks, "{}", st.error().message);
        }
    }
    return {};
}

void KvCacheManager::unreserve(std::span<SeqBatch> batch) {
    for (SeqBatch& b : batch) b.kv->truncate(pool_, b.kv->n_tokens());
}

KvSeq KvCacheManager::lookup_prefix(std::span<const shm::BlockHash> hashes, size_t max_blocks) {
    if (!prefix_) return {};
    std::vector<int32_t> got;
    for (size_t i = 0; i < std::min(max_blocks, hashes.size()); ++i) {
        const int32_t b = prefix_->arena().acquire_cached(prefix_->user(), hashes[i]);
        if (b < 0) break;
        got.push_back(b);
    }
    if (got.empty()) return {};
    const auto tokens = static_cast<int64_t>(got.size()) * pool_.layout().block_tokens;
    return KvSeq::adopt(std::move(got), tokens);
}

size_t KvCacheManager::publish_prefix(const KvSeq& seq, std::span<const shm::BlockHash> hashes, size_t published,
                                      int64_t valid_tokens) {
    if (!prefix_) return published;
    const auto full = std::min(static_cast<size_t>(valid_tokens / pool_.layout().block_tokens), hashes.size());
    for (; published < full; ++published) prefix_->arena().publish(prefix_->user(), seq.blocks()[published], hashes[published]);
    return published;
}

Result<std::vector<int32_t>> KvCacheManager::reserve_in(KvBlockAllocator& dest, int64_t tokens) const {
    const int64_t bt = pool_.layout().block_tokens;
    const auto need = static_cast<int32_t>((tokens + bt - 1) / bt);
    std::vector<int32_t> got(static_cast<size_t>(need));
    if (!dest.alloc(need, got.data()))
        return make_error(ErrorKind::NoKvBlocks, "the hand-off needs {} KV blocks there, {} of {} are free", need,
                          dest.n_free(), dest.n_blocks());
    return got;
}

void KvCacheManager::release_in(KvBlockAllocator& dest, std::vector<int32_t>& blocks) {
    for (int32_t b : blocks) dest.unref(b);
    blocks.clear();
}

}  // namespace duet
