#include "kv/kv_stage.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "kv/kv_copy.h"

namespace duet {

Result<std::unique_ptr<KvMirror>> KvMirror::create(const KvLayout& layout, KvBlockAllocator& allocator) {
    std::unique_ptr<KvMirror> m(new KvMirror());
    m->bytes_ = layout.block_bytes() * static_cast<size_t>(std::max(1, allocator.n_blocks()));
    // Reserved, not committed: an arena of a GPU may be larger than this host's
    // memory; only the staged blocks' pages are touched.
    void* p = ::mmap(nullptr, m->bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED)
        return make_error("the host mirror of a KV arena ({} bytes of address space): {}", m->bytes_,
                          std::strerror(errno));
    m->data_ = p;
    m->pool_ = std::make_unique<KvPool>(layout, p, std::make_unique<ForwardingBlockAllocator>(allocator));
    return m;
}

KvMirror::~KvMirror() {
    pool_.reset();
    if (data_) ::munmap(data_, bytes_);
}

void KvMirror::release() {
    // Anonymous private pages read back as zeros after this: nothing stale stays.
    (void)::madvise(data_, bytes_, MADV_DONTNEED);
}

std::span<const int32_t> blocks_of_positions(std::span<const int32_t> blocks, int32_t block_tokens, uint64_t first,
                                             uint64_t n) {
    if (n == 0 || block_tokens <= 0) return {};
    const uint64_t bt = static_cast<uint64_t>(block_tokens);
    const uint64_t b0 = first / bt, b1 = std::min<uint64_t>((first + n - 1) / bt + 1, blocks.size());
    if (b0 >= b1) return {};
    return blocks.subspan(b0, b1 - b0);
}

Status HostKvStage::copy(const KvPool& from, KvPool& to, std::span<const int32_t> blocks) {
    const KvLayout& l = from.layout();
    for (int32_t layer = 0; layer < l.n_layer; ++layer) {
        auto runs = plan_layer_copy(l, from.allocator().n_blocks(), to.allocator().n_blocks(), blocks, blocks, layer);
        if (!runs) return runs.error();
        for (const CopyRun& r : *runs)
            std::memcpy(static_cast<uint8_t*>(to.data()) + r.dst, static_cast<const uint8_t*>(from.data()) + r.src,
                        r.bytes);
    }
    return {};
}

Status HostKvStage::pull(std::span<const int32_t> blocks) { return copy(arena_, mirror_, blocks); }
Status HostKvStage::push(std::span<const int32_t> blocks) { return copy(mirror_, arena_, blocks); }

}  // namespace duet
