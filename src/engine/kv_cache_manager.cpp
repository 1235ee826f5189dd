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
    const int32_t free = pool_.allocator().n_free();
    if (need > free)
        return make_error(ErrorKind::NoKvBlocks, "the pass needs {} KV blocks, {} of {} are free", need, free,
                          pool_.allocator().n_blocks());
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

}  // namespace duet
