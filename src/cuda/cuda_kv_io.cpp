#include "cuda/cuda_kv_io.h"

#include <cerrno>
#include <cstring>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cuda/cuda_util.h"
#include "kernels/cuda/ops.h"
#include "kv/kv_copy.h"

namespace duet {

namespace {

// Whether kernels on the current device (`device`) can read and write p.
bool kernel_reachable(const void* p, int device) {
    cudaPointerAttributes a{};
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
        cudaGetLastError();  // not known to CUDA (pageable memory on some drivers)
        return false;
    }
    if (a.type == cudaMemoryTypeDevice) return a.device == device;
    // Page-locked host memory, mapped at the same address under unified addressing.
    return a.type == cudaMemoryTypeHost && a.devicePointer == p;
}

// Queues on `stream` the copies of every layer of blocks src[i] of the arena at
// `from` (from_blocks blocks) into blocks dst[i] of the one at `to`, merged into
// runs of consecutive ids. On an error the copies queued before it stay queued.
Status queue_tiles(const KvLayout& l, int32_t from_blocks, const void* from, std::span<const int32_t> src,
                   int32_t to_blocks, void* to, std::span<const int32_t> dst, cudaStream_t stream) {
    std::vector<CopyRun> all;
    for (int32_t layer = 0; layer < l.n_layer; ++layer) {
        auto runs = plan_layer_copy(l, from_blocks, to_blocks, src, dst, layer);
        if (!runs) return runs.error();
        all.insert(all.end(), runs->begin(), runs->end());
    }
    return queue_runs(to, from, all, stream);
}

}  // namespace

Status queue_runs(void* to, const void* from, std::span<const CopyRun> runs, void* stream_, bool* by_kernel) {
    auto stream = static_cast<cudaStream_t>(stream_);
    auto* dst = static_cast<uint8_t*>(to);
    auto* src = static_cast<const uint8_t*>(from);
    if (by_kernel) *by_kernel = false;
    // Where one launch pays: many runs, small on average (a copy engine moves large
    // runs faster than one pass of 16-byte loads), all 16-byte aligned (the kernel's
    // byte loop is for odd tails, not whole runs).
    uint64_t total = 0, odd = reinterpret_cast<uintptr_t>(to) | reinterpret_cast<uintptr_t>(from);
    for (const CopyRun& r : runs) {
        total += r.bytes;
        odd |= r.src | r.dst | r.bytes;
    }
    const bool many_small = runs.size() > 1 && total / runs.size() <= (uint64_t{256} << 10) && (odd & 15) == 0;
    int device = 0;
    if (many_small) DUET_CUDA_TRY(cudaGetDevice(&device));
    if (many_small && kernel_reachable(from, device) && kernel_reachable(to, device)) {
        if (by_kernel) *by_kernel = true;
        cuda::ByteRuns b;
        for (size_t i = 0; i < runs.size();) {
            b.n = 0;
            for (; i < runs.size() && b.n < cuda::ByteRuns::kMax; ++i, ++b.n) {
                b.src_off[b.n] = runs[i].src;
                b.dst_off[b.n] = runs[i].dst;
                b.bytes[b.n] = runs[i].bytes;
            }
            if (Status st = cuda_ok(cuda::copy_runs(dst, src, b, stream), "copy_runs (KV tiles)"); !st) return st;
        }
        return {};
    }
    for (const CopyRun& r : runs)
        if (Status st = cuda_ok(cudaMemcpyAsync(dst + r.dst, src + r.src, r.bytes, cudaMemcpyDefault, stream),
                                "cudaMemcpyAsync (KV tiles)");
            !st)
            return st;
    return {};
}

namespace {

// queue_tiles on a stream of its own, then waits.
Status copy_tiles(const KvLayout& l, int32_t from_blocks, const void* from, std::span<const int32_t> src,
                  int32_t to_blocks, void* to, std::span<const int32_t> dst) {
    cudaStream_t stream = nullptr;
    DUET_CUDA_TRY(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    const Status st = queue_tiles(l, from_blocks, from, src, to_blocks, to, dst, stream);
    const Status sync = cuda_ok(cudaStreamSynchronize(stream), "cudaStreamSynchronize (KV tiles)");
    cudaStreamDestroy(stream);
    if (!st) return st;
    return sync;
}

Status copy_tiles(const KvLayout& l, const KvPool& from, std::span<const int32_t> src, KvPool& to,
                  std::span<const int32_t> dst) {
    return copy_tiles(l, from.allocator().n_blocks(), from.data(), src, to.allocator().n_blocks(), to.data(), dst);
}

// A page-locked arena of k blocks of layout l.
struct Staging {
    HostBuf buf;
    std::unique_ptr<KvPool> pool;
    Status init(const KvLayout& l, int32_t k) {
        if (Status s = buf.reserve(l.block_bytes() * static_cast<size_t>(std::max(k, 1))); !s) return s;
        pool = std::make_unique<KvPool>(l, buf.as<void>(), std::make_unique<LocalBlockAllocator>(std::max(k, 1)));
        return {};
    }
};

// Block ids that put staging block i at position block b0 + i (the rest are never read).
std::vector<int32_t> virtual_blocks(uint64_t b0, int32_t k) {
    std::vector<int32_t> v(b0 + static_cast<uint64_t>(k), 0);
    for (int32_t i = 0; i < k; ++i) v[b0 + static_cast<uint64_t>(i)] = i;
    return v;
}

}  // namespace

Result<BlobHeader> blob_write_device(const std::string& path, const KvIdentity& id, KvPool& dev, const KvSeq& seq,
                                     std::span<const int32_t> tokens, uint64_t first, uint64_t n) {
    const KvLayout& l = dev.layout();
    const uint64_t bt = static_cast<uint64_t>(l.block_tokens);
    if (first + n > static_cast<uint64_t>(seq.n_tokens()) || first + n > tokens.size())
        return make_error("positions [{}, {}) are beyond the sequence ({} positions)", first, first + n, seq.n_tokens());
    const uint64_t b0 = first / bt, b1 = n == 0 ? b0 : (first + n - 1) / bt;
    const int32_t k = n == 0 ? 0 : static_cast<int32_t>(b1 - b0 + 1);
    Staging st;
    if (Status s = st.init(l, k); !s) return s.error();
    std::vector<int32_t> src(seq.blocks().begin() + static_cast<ptrdiff_t>(b0),
                             seq.blocks().begin() + static_cast<ptrdiff_t>(b0 + static_cast<uint64_t>(k)));
    std::vector<int32_t> dst(static_cast<size_t>(k));
    for (int32_t i = 0; i < k; ++i) dst[static_cast<size_t>(i)] = i;
    if (k > 0)
        if (Status s = copy_tiles(l, dev, src, *st.pool, dst); !s) return s.error();
    KvSeq view = KvSeq::adopt(virtual_blocks(b0, k), static_cast<int64_t>(first + n));
    auto h = blob_write(path, id, *st.pool, view, tokens, first, n);
    view.detach();  // borrowed ids: no references to drop
    return h;
}

Result<BlobImport> blob_import_device(const std::string& path, const KvIdentity& want, KvPool& dev, KvSeq& seq) {
    const KvLayout& l = dev.layout();
    const uint64_t bt = static_cast<uint64_t>(l.block_tokens);
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return make_error("open {}: {}", path, std::strerror(errno));
    struct stat sb {};
    ::fstat(fd, &sb);
    Staging st;
    std::vector<int32_t> fresh;
    uint64_t b0 = 0;
    auto r = blob_read_into(fd, 0, static_cast<uint64_t>(sb.st_size), want, l, static_cast<uint64_t>(seq.n_tokens()),
                            [&](const BlobHeader& h) -> Result<std::vector<iovec>> {
                                const uint64_t first = h.first_pos, n = h.n_tokens;
                                if (n == 0) return std::vector<iovec>{};
                                b0 = first / bt;
                                const int32_t k = static_cast<int32_t>((first + n - 1) / bt - b0 + 1);
                                if (Status s = st.init(l, k); !s) return s.error();
                                fresh.resize(static_cast<size_t>(k));
                                if (!dev.allocator().alloc(k, fresh.data())) {
                                    fresh.clear();
                                    return make_error("no room in the KV arena for {} tokens: {} blocks needed, {} free",
                                                      n, k, dev.allocator().n_free());
                                }
                                // The partial last block's earlier positions come along.
                                if (first % bt != 0) {
                                    const int32_t from = seq.blocks()[b0], to = 0;
                                    if (Status s = copy_tiles(l, dev, {&from, 1}, *st.pool, {&to, 1});
                                        !s)
                                        return s.error();
                                }
                                return kv_rows_iov(*st.pool, virtual_blocks(b0, k), first, n);
                            });
    ::close(fd);
    const auto drop_fresh = [&] {
        for (int32_t b : fresh) dev.allocator().unref(b);
    };
    if (!r) {
        drop_fresh();
        return make_error("{}: {}", path, r.error().message);
    }
    if (fresh.empty()) return r;  // an empty blob: seq is as it was
    std::vector<int32_t> ids(fresh.size());
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(i);
    if (Status s = copy_tiles(l, *st.pool, ids, dev, fresh); !s) {
        drop_fresh();
        return s.error();
    }
    // seq keeps its blocks before b0; its partial block b0 (copied into fresh[0]) goes.
    std::vector<int32_t> blocks = seq.detach();
    for (size_t i = b0; i < blocks.size(); ++i) dev.allocator().unref(blocks[i]);
    blocks.resize(std::min<size_t>(b0, blocks.size()));
    blocks.insert(blocks.end(), fresh.begin(), fresh.end());
    seq = KvSeq::adopt(std::move(blocks), static_cast<int64_t>(r->header.first_pos + r->header.n_tokens));
    return r;
}

Result<std::unique_ptr<CudaKvStage>> CudaKvStage::create(int device, void* arena, KvPool& mirror, size_t half_bytes) {
    DUET_CUDA_TRY(cudaSetDevice(device));
    const KvLayout& l = mirror.layout();
    const int32_t chunk = bounce_chunk_blocks(l, half_bytes);
    void* pinned = nullptr;
    const size_t bytes = l.block_bytes() * static_cast<size_t>(chunk) * 2;
    if (cudaError_t e = cudaMallocHost(&pinned, bytes); e != cudaSuccess) {
        cudaGetLastError();
        return make_error(ErrorKind::Device, "CUDA: cannot allocate {:.1f} MiB of page-locked memory to stage KV: {}",
                          bytes / 1048576.0, cudaGetErrorString(e));
    }
    auto bounce = std::make_unique<KvPool>(l, pinned, std::make_unique<LocalBlockAllocator>(chunk * 2));
    std::unique_ptr<CudaKvStage> s(new CudaKvStage(device, arena, mirror, std::move(bounce), pinned));
    cudaStream_t stream = nullptr;
    DUET_CUDA_TRY(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    s->stream_ = stream;
    for (void*& ev : s->events_) {
        cudaEvent_t e = nullptr;
        // Blocking: the store thread sleeps while a copy runs instead of spinning on
        // a core the front's HTTP threads may need.
        DUET_CUDA_TRY(cudaEventCreateWithFlags(&e, cudaEventDisableTiming | cudaEventBlockingSync));
        ev = e;
    }
    return s;
}

CudaKvStage::CudaKvStage(int device, void* arena, KvPool& mirror, std::unique_ptr<KvPool> bounce, void* pinned)
    : BounceKvStage(mirror, *bounce),
      device_(device),
      arena_(arena),
      arena_blocks_(mirror.allocator().n_blocks()),
      bounce_(std::move(bounce)),
      pinned_(pinned) {}

CudaKvStage::~CudaKvStage() {
    if (stream_) cudaStreamSynchronize(static_cast<cudaStream_t>(stream_));
    for (void* ev : events_)
        if (ev) cudaEventDestroy(static_cast<cudaEvent_t>(ev));
    if (stream_) cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
    bounce_.reset();
    if (pinned_) cudaFreeHost(pinned_);
}

// Every layer's runs on the stream, then the half's event. A failure is kept for
// wait(half): the copies already queued still run, and wait waits for them (B3).
Status CudaKvStage::start(const void* from, int32_t from_blocks, std::span<const int32_t> src, void* to,
                          int32_t to_blocks, std::span<const int32_t> dst, int half) {
    auto stream = static_cast<cudaStream_t>(stream_);
    Status st = cuda_ok(cudaSetDevice(device_), "cudaSetDevice (KV stage)");
    if (st)
        st = queue_tiles(bounce_->layout(), from_blocks, from, src, to_blocks, to, dst, stream);
    failed_[half] = st;
    Status rec = cuda_ok(cudaEventRecord(static_cast<cudaEvent_t>(events_[half]), stream), "cudaEventRecord (KV stage)");
    if (!rec) {
        // No event to wait on: the copies queued must end before this returns (B3).
        (void)cudaStreamSynchronize(stream);
        failed_[half] = {};
    }
    return rec;
}

Status CudaKvStage::start_pull(std::span<const int32_t> arena, std::span<const int32_t> bounce, int half) {
    return start(arena_, arena_blocks_, arena, bounce_->data(), bounce_->allocator().n_blocks(), bounce, half);
}

Status CudaKvStage::start_push(std::span<const int32_t> bounce, std::span<const int32_t> arena, int half) {
    return start(bounce_->data(), bounce_->allocator().n_blocks(), bounce, arena_, arena_blocks_, arena, half);
}

Status CudaKvStage::wait(int half) {
    const Status done = cuda_ok(cudaEventSynchronize(static_cast<cudaEvent_t>(events_[half])), "cudaEventSynchronize (KV stage)");
    Status st = failed_[half];
    failed_[half] = {};
    if (!st) return st;
    return done;
}

}  // namespace duet
