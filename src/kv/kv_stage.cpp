#include "kv/kv_stage.h"

#include <sys/mman.h>

#include <algorithm>
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

Result<BlobHeader> staged_blob_write(const StagedKvIo& kv, const std::string& path, const KvIdentity& id,
                                     const KvSeq& seq, std::span<const int32_t> tokens, uint64_t first, uint64_t n,
                                     bool sync) {
    if (!kv.stage) return blob_write(path, id, *kv.io, seq, tokens, first, n, sync);
    Result<BlobHeader> out = [&]() -> Result<BlobHeader> {
        if (Status st = kv.stage->pull(blocks_of_positions(seq.blocks(), kv.io->layout().block_tokens, first, n)); !st)
            return make_error(st.error().kind, "KV from the arena: {}", st.error().message);
        return blob_write(path, id, *kv.io, seq, tokens, first, n, sync);
    }();
    if (kv.mirror) kv.mirror->release();
    return out;
}

Result<BlobImport> staged_blob_import(const StagedKvIo& kv, const std::string& path, const KvIdentity& want,
                                      KvSeq& seq) {
    if (!kv.stage) return blob_import(path, want, *kv.io, seq);
    if (seq.n_tokens() != 0 || !seq.blocks().empty())
        return make_error(ErrorKind::Invalid, "a staged blob import starts from an empty sequence");
    auto im = blob_import(path, want, *kv.io, seq);
    if (im) {
        if (Status st = kv.stage->push(seq.blocks()); !st) {
            seq.release(*kv.io);
            im = make_error(st.error().kind, "KV into the arena: {}", st.error().message);
        }
    }
    if (kv.mirror) kv.mirror->release();
    return im;
}

Status copy_host_blocks(const KvPool& from, std::span<const int32_t> src, KvPool& to, std::span<const int32_t> dst) {
    const KvLayout& l = from.layout();
    for (int32_t layer = 0; layer < l.n_layer; ++layer) {
        auto runs = plan_layer_copy(l, from.allocator().n_blocks(), to.allocator().n_blocks(), src, dst, layer);
        if (!runs) return runs.error();
        for (const CopyRun& r : *runs)
            std::memcpy(static_cast<uint8_t*>(to.data()) + r.dst, static_cast<const uint8_t*>(from.data()) + r.src,
                        r.bytes);
    }
    return {};
}

int32_t bounce_chunk_blocks(const KvLayout& layout, size_t half_bytes) {
    const size_t b = std::max<size_t>(layout.block_bytes(), 1);
    return static_cast<int32_t>(std::clamp<size_t>(half_bytes / b, 1, 1 << 20));
}

BounceKvStage::BounceKvStage(KvPool& mirror, KvPool& bounce)
    : mirror_(mirror), bounce_(bounce), chunk_(std::max(1, bounce.allocator().n_blocks() / 2)) {
    ids_.resize(static_cast<size_t>(chunk_) * 2);
    for (size_t i = 0; i < ids_.size(); ++i) ids_[i] = static_cast<int32_t>(i);
}

std::span<const int32_t> BounceKvStage::half_ids(int half, size_t n) const {
    return std::span<const int32_t>(ids_).subspan(static_cast<size_t>(half) * static_cast<size_t>(chunk_), n);
}

// Chunk i goes through half i % 2. Pull: the device copy of chunk i is started, then
// chunk i - 1 (the other half) is waited on and copied into the mirror, so the two
// overlap; the half chunk i + 1 refills was emptied in this step (B2). Push: a half
// is waited on before the mirror's next chunk is copied into it (B2).
Status BounceKvStage::pull(std::span<const int32_t> blocks) {
    if (blocks.empty()) return {};
    const size_t c = static_cast<size_t>(chunk_);
    const size_t n = (blocks.size() + c - 1) / c;
    const auto chunk = [&](size_t i) { return blocks.subspan(i * c, std::min(c, blocks.size() - i * c)); };
    bool pending[2] = {false, false};
    const auto drain = [&](Status st) {  // B3
        for (int h = 0; h < 2; ++h)
            if (pending[h]) (void)wait(h);
        return st;
    };
    const auto finish = [&](size_t i) -> Status {
        const int h = static_cast<int>(i % 2);
        pending[h] = false;
        if (Status st = wait(h); !st) return st;  // B1
        return copy_host_blocks(bounce_, half_ids(h, chunk(i).size()), mirror_, chunk(i));
    };
    for (size_t i = 0; i < n; ++i) {
        const int h = static_cast<int>(i % 2);
        if (Status st = start_pull(chunk(i), half_ids(h, chunk(i).size()), h); !st) return drain(st);
        pending[h] = true;
        if (i > 0)
            if (Status st = finish(i - 1); !st) return drain(st);
    }
    return drain(finish(n - 1));
}

Status BounceKvStage::push(std::span<const int32_t> blocks) {
    if (blocks.empty()) return {};
    const size_t c = static_cast<size_t>(chunk_);
    const size_t n = (blocks.size() + c - 1) / c;
    bool pending[2] = {false, false};
    Status err;
    for (size_t i = 0; i < n && err; ++i) {
        const int h = static_cast<int>(i % 2);
        const auto part = blocks.subspan(i * c, std::min(c, blocks.size() - i * c));
        if (pending[h]) {  // B2
            pending[h] = false;
            if (Status st = wait(h); !st) {
                err = st;
                break;
            }
        }
        if (Status st = copy_host_blocks(mirror_, part, bounce_, half_ids(h, part.size())); !st) {
            err = st;
            break;
        }
        if (Status st = start_push(half_ids(h, part.size()), part, h); !st) {
            err = st;
            break;
        }
        pending[h] = true;
    }
    for (int h = 0; h < 2; ++h)  // B3
        if (pending[h])
            if (Status st = wait(h); !st && err) err = st;
    return err;
}

Status HostKvStage::pull(std::span<const int32_t> blocks) { return copy_host_blocks(arena_, blocks, mirror_, blocks); }
Status HostKvStage::push(std::span<const int32_t> blocks) { return copy_host_blocks(mirror_, blocks, arena_, blocks); }

}  // namespace duet
