#include "kv/blob.h"

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kernels/cpu/kernels.h"
#include "kv/crc32c.h"
#include "kv/le_bytes.h"

namespace duet {

using le::get;
using le::put;

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the blob and log formats are little-endian; add swaps");

std::string fp_hex(const Fp128& f) {
    std::string s;
    for (uint8_t b : f) s += fmt::format("{:02x}", b);
    return s;
}

namespace {

// Header field offsets (KVLOG.md "KV blob").
constexpr size_t kOffVersion = 8, kOffHeaderBytes = 12, kOffModel = 16, kOffTokenizer = 32, kOffLayers = 48,
                 kOffHeads = 52, kOffHeadDim = 56, kOffDtype = 60, kOffScales = 61, kOffReserved0 = 62,
                 kOffBlockTokens = 64, kOffFlags = 68, kOffFirstPos = 72, kOffTokens = 80, kOffDataBytes = 88,
                 kOffDataCrc = 96, kOffReserved1 = 100, kOffHeaderCrc = 124;
// Limits a reader accepts: far above any model, low enough that no product overflows.
constexpr uint32_t kMaxLayers = 4096, kMaxHeads = 4096, kMaxHeadDim = 4096, kMaxBlockTokens = 4096;
constexpr uint64_t kMaxTokens = uint64_t{1} << 32, kMaxPos = uint64_t{1} << 40;

Error errno_error(const char* what, const std::string& path) {
    const int e = errno;
    return make_error(errno_kind(e), "{} {}: {}", what, path, std::strerror(e));
}

// Bytes of one value of a dtype as stored.
size_t elem_bytes_of(KvDtype t) { return t == KvDtype::F16 ? 2 : 1; }

}  // namespace

Result<uint64_t> blob_data_bytes(const KvLayout& l, uint64_t n) {
    if (n > kMaxTokens) return make_error("token count {} is over the limit of {}", n, kMaxTokens);
    // Every factor is below 2^13 and n below 2^32: the products fit in 64 bits, but
    // check anyway so a future limit change cannot overflow silently.
    uint64_t rows = 0, vals = 0, total = 0;
    if (__builtin_mul_overflow(uint64_t(2) * uint64_t(l.n_layer) * uint64_t(l.n_head_kv), n, &rows) ||
        __builtin_mul_overflow(rows, uint64_t(l.head_dim) * elem_bytes_of(l.dtype), &vals) ||
        __builtin_add_overflow(vals, 4 * n, &total) ||
        (l.quantized() && __builtin_add_overflow(total, rows * 4, &total)))
        return make_error("{} tokens of {} layers x {} heads x {} dims overflow 64 bits", n, l.n_layer, l.n_head_kv,
                          l.head_dim);
    return total;
}

void blob_header_encode(const BlobHeader& h, uint8_t out[kBlobHeaderBytes]) {
    std::memset(out, 0, kBlobHeaderBytes);
    std::memcpy(out, kBlobMagic, 8);
    put<uint32_t>(out, kOffVersion, h.version);
    put<uint32_t>(out, kOffHeaderBytes, kBlobHeaderBytes);
    std::memcpy(out + kOffModel, h.id.model.data(), 16);
    std::memcpy(out + kOffTokenizer, h.id.tokenizer.data(), 16);
    kv_layout_put(out, h.layout);
    put<uint32_t>(out, kOffFlags, h.flags);
    put<uint64_t>(out, kOffFirstPos, h.first_pos);
    put<uint64_t>(out, kOffTokens, h.n_tokens);
    put<uint64_t>(out, kOffDataBytes, h.data_bytes);
    put<uint32_t>(out, kOffDataCrc, h.data_crc);
    put<uint32_t>(out, kOffHeaderCrc, crc32c(out, kOffHeaderCrc));
}

Result<KvLayout> kv_layout_decode(uint32_t layers, uint32_t heads, uint32_t dim, uint32_t bt, uint8_t dtype,
                                  uint8_t scales) {
    if (layers == 0 || layers > kMaxLayers) return make_error("n_layer: {} is out of range 1..{}", layers, kMaxLayers);
    if (heads == 0 || heads > kMaxHeads) return make_error("n_head_kv: {} is out of range 1..{}", heads, kMaxHeads);
    if (dim == 0 || dim > kMaxHeadDim) return make_error("head_dim: {} is out of range 1..{}", dim, kMaxHeadDim);
    if (bt == 0 || bt > kMaxBlockTokens) return make_error("block_tokens: {} is out of range 1..{}", bt, kMaxBlockTokens);
    KvLayout l;
    l.n_layer = static_cast<int32_t>(layers);
    l.n_head_kv = static_cast<int32_t>(heads);
    l.head_dim = static_cast<int32_t>(dim);
    l.block_tokens = static_cast<int32_t>(bt);
    auto dt = kv_dtype_from(dtype);
    if (!dt) return make_error("dtype: {}", dt.error().message);
    l.dtype = *dt;
    // A quantized tile's f32 scales follow its byte values: they are 4-byte aligned
    // only when a tile's value bytes are a multiple of 4 (every real model's are).
    if (l.quantized() && (uint64_t{heads} * bt * dim) % 4 != 0)
        return make_error("head_dim: n_head_kv {} x block_tokens {} x head_dim {} is not a multiple of 4, which {} KV "
                          "needs (its scales must stay aligned)",
                          heads, bt, dim, kv_dtype_name(l.dtype));
    const uint8_t want_scales = static_cast<uint8_t>(l.quantized() ? KvScaleLayout::RowF32Tail : KvScaleLayout::None);
    if (scales != want_scales)
        return make_error("scale_layout: {} for dtype {}, expected {}", scales, kv_dtype_name(l.dtype), want_scales);
    return l;
}

void kv_layout_put(uint8_t* out, const KvLayout& l) {
    put<uint32_t>(out, kOffLayers, static_cast<uint32_t>(l.n_layer));
    put<uint32_t>(out, kOffHeads, static_cast<uint32_t>(l.n_head_kv));
    put<uint32_t>(out, kOffHeadDim, static_cast<uint32_t>(l.head_dim));
    out[kOffDtype] = static_cast<uint8_t>(l.dtype);
    out[kOffScales] = static_cast<uint8_t>(l.quantized() ? KvScaleLayout::RowF32Tail : KvScaleLayout::None);
    put<uint32_t>(out, kOffBlockTokens, static_cast<uint32_t>(l.block_tokens));
}

Result<KvLayout> kv_layout_get(const uint8_t* p) {
    return kv_layout_decode(get<uint32_t>(p, kOffLayers), get<uint32_t>(p, kOffHeads), get<uint32_t>(p, kOffHeadDim),
                            get<uint32_t>(p, kOffBlockTokens), p[kOffDtype], p[kOffScales]);
}

Result<BlobHeader> blob_header_decode(const uint8_t* p, size_t n) {
    if (n < kBlobHeaderBytes)
        return make_error("truncated header: {} bytes, a KV blob header is {}", n, kBlobHeaderBytes);
    if (std::memcmp(p, kBlobMagic, 8) != 0) return make_error("magic: not a duet KV blob (expected 'DUETKVB')");
    const uint32_t crc = get<uint32_t>(p, kOffHeaderCrc), want_crc = crc32c(p, kOffHeaderCrc);
    if (crc != want_crc)
        return make_error("header_crc: stored {:#010x}, computed {:#010x} (the header is corrupt)", crc, want_crc);
    BlobHeader h;
    h.version = get<uint32_t>(p, kOffVersion);
    if (h.version != kBlobVersion)
        return make_error("version: the blob is format version {}, this build reads version {}", h.version,
                          kBlobVersion);
    if (uint32_t hb = get<uint32_t>(p, kOffHeaderBytes); hb != kBlobHeaderBytes)
        return make_error("header_bytes: {}, expected {}", hb, kBlobHeaderBytes);
    std::memcpy(h.id.model.data(), p + kOffModel, 16);
    std::memcpy(h.id.tokenizer.data(), p + kOffTokenizer, 16);
    auto lay = kv_layout_get(p);
    if (!lay) return lay.error();
    h.layout = *lay;
    h.scales = h.layout.quantized() ? KvScaleLayout::RowF32Tail : KvScaleLayout::None;
    if (get<uint16_t>(p, kOffReserved0) != 0) return make_error("reserved bytes 62..63 are not zero");
    for (size_t i = kOffReserved1; i < kOffHeaderCrc; ++i)
        if (p[i] != 0) return make_error("reserved byte {} is not zero", i);
    h.flags = get<uint32_t>(p, kOffFlags);
    if (h.flags != 0) return make_error("flags: {:#x} has bits this build does not know (none are defined)", h.flags);
    h.first_pos = get<uint64_t>(p, kOffFirstPos);
    h.n_tokens = get<uint64_t>(p, kOffTokens);
    if (h.n_tokens > kMaxTokens) return make_error("n_tokens: {} is over the limit of {}", h.n_tokens, kMaxTokens);
    if (h.first_pos > kMaxPos || h.first_pos + h.n_tokens > kMaxPos)
        return make_error("first_pos: {} + n_tokens {} is beyond position {}", h.first_pos, h.n_tokens, kMaxPos);
    h.data_bytes = get<uint64_t>(p, kOffDataBytes);
    auto want_bytes = blob_data_bytes(h.layout, h.n_tokens);
    if (!want_bytes) return make_error("n_tokens: {}", want_bytes.error().message);
    if (h.data_bytes != *want_bytes)
        return make_error("data_bytes: {}, but {} tokens of this layout take {}", h.data_bytes, h.n_tokens, *want_bytes);
    h.data_crc = get<uint32_t>(p, kOffDataCrc);
    return h;
}

Status blob_check_compatible(const BlobHeader& h, const KvIdentity& want, const KvLayout& arena) {
    if (h.id.model != want.model)
        return make_error("model_fingerprint: the KV was computed by model {}, this is model {} (other weights: the "
                          "KV would be garbage here)",
                          fp_hex(h.id.model), fp_hex(want.model));
    if (h.id.tokenizer != want.tokenizer)
        return make_error("tokenizer_fingerprint: the KV's tokens come from tokenizer {}, this model's is {}",
                          fp_hex(h.id.tokenizer), fp_hex(want.tokenizer));
    const auto field = [](const char* name, int64_t have, int64_t want_v) -> Status {
        if (have != want_v) return make_error("{}: the KV has {}, this arena {}", name, have, want_v);
        return {};
    };
    if (Status s = field("n_layer", h.layout.n_layer, arena.n_layer); !s) return s;
    if (Status s = field("n_head_kv", h.layout.n_head_kv, arena.n_head_kv); !s) return s;
    if (Status s = field("head_dim", h.layout.head_dim, arena.head_dim); !s) return s;
    if (Status s = field("block_tokens", h.layout.block_tokens, arena.block_tokens); !s) return s;
    return {};
}

Result<std::vector<iovec>> kv_rows_iov(KvPool& pool, std::span<const int32_t> blocks, uint64_t first, uint64_t n) {
    const KvLayout& l = pool.layout();
    const uint64_t bt = static_cast<uint64_t>(l.block_tokens);
    if (n == 0) return std::vector<iovec>{};
    if (first + n > blocks.size() * bt)
        return make_error("positions [{}, {}) are beyond the sequence's {} blocks", first, first + n, blocks.size());
    const size_t row = static_cast<size_t>(l.head_dim) * l.elem_bytes();
    std::vector<iovec> iov;
    const uint64_t b0 = first / bt, b1 = (first + n - 1) / bt;
    iov.reserve(static_cast<size_t>(2 * l.n_layer * l.n_head_kv * (b1 - b0 + 1)) * (l.quantized() ? 2 : 1));
    // Runs of tokens of one block: [lo, hi) within block b.
    const auto each_run = [&](auto&& fn) {
        for (uint64_t b = b0; b <= b1; ++b) {
            const uint64_t lo = std::max(first, b * bt) - b * bt, hi = std::min(first + n, (b + 1) * bt) - b * bt;
            fn(blocks[b], lo, hi);
        }
    };
    for (int32_t layer = 0; layer < l.n_layer; ++layer)
        for (int kv = 0; kv < 2; ++kv)
            for (int32_t h = 0; h < l.n_head_kv; ++h)
                each_run([&](int32_t blk, uint64_t lo, uint64_t hi) {
                    uint8_t* base = kv == 0 ? pool.k(blk, layer, h) : pool.v(blk, layer, h);
                    iov.push_back({base + lo * row, (hi - lo) * row});
                });
    if (l.quantized())
        for (int32_t layer = 0; layer < l.n_layer; ++layer)
            for (int kv = 0; kv < 2; ++kv)
                for (int32_t h = 0; h < l.n_head_kv; ++h)
                    each_run([&](int32_t blk, uint64_t lo, uint64_t hi) {
                        float* s = kv == 0 ? pool.k_scales(blk, layer, h) : pool.v_scales(blk, layer, h);
                        iov.push_back({s + lo, (hi - lo) * sizeof(float)});
                    });
    return iov;
}

namespace {

// preadv / pwritev of the whole iov from offset `at`, IOV_MAX buffers a call, a
// short transfer continued where it stopped.
Status transfer_iov(int fd, uint64_t at, std::span<const iovec> iov, bool write) {
    std::vector<iovec> chunk;
    size_t i = 0, skip = 0;  // skip: bytes of iov[i] already moved
    while (i < iov.size()) {
        chunk.clear();
        for (size_t j = i; j < iov.size() && chunk.size() < IOV_MAX; ++j) {
            const size_t off = j == i ? skip : 0;
            if (iov[j].iov_len > off) chunk.push_back({static_cast<uint8_t*>(iov[j].iov_base) + off, iov[j].iov_len - off});
        }
        if (chunk.empty()) break;
        const int n = static_cast<int>(chunk.size());
        const ssize_t r = write ? ::pwritev(fd, chunk.data(), n, static_cast<off_t>(at))
                                : ::preadv(fd, chunk.data(), n, static_cast<off_t>(at));
        if (r < 0) {
            const int e = errno;
            if (e == EINTR) continue;
            return make_error(errno_kind(e), "{} at offset {}: {}", write ? "write" : "read", at, std::strerror(e));
        }
        if (r == 0 && !write) return make_error("the file ends at offset {}, before the data it should hold", at);
        at += static_cast<uint64_t>(r);
        size_t left = static_cast<size_t>(r);
        while (left > 0 && i < iov.size()) {
            const size_t avail = iov[i].iov_len - skip;
            if (left >= avail) {
                left -= avail;
                ++i;
                skip = 0;
            } else {
                skip += left;
                left = 0;
            }
        }
        while (i < iov.size() && iov[i].iov_len == 0) ++i;
    }
    return {};
}

}  // namespace

Status pread_iov(int fd, uint64_t at, std::span<const iovec> iov) { return transfer_iov(fd, at, iov, false); }
Status pwrite_iov(int fd, uint64_t at, std::span<const iovec> iov) { return transfer_iov(fd, at, iov, true); }

Result<uint32_t> crc32c_file(int fd, uint64_t at, uint64_t n, uint32_t crc) {
    std::vector<uint8_t> buf(std::min<uint64_t>(n, 4u << 20));
    while (n > 0) {
        const size_t k = static_cast<size_t>(std::min<uint64_t>(n, buf.size()));
        if (Status s = pread_iov(fd, at, std::array{iovec{buf.data(), k}}); !s) return s.error();
        crc = crc32c(buf.data(), k, crc);
        at += k;
        n -= k;
    }
    return crc;
}

Status fsync_dir_of(const std::string& path) {
    const size_t slash = path.rfind('/');
    const std::string dir = slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
    const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return errno_error("open directory", dir);
    const int r = ::fsync(fd);
    const int e = errno;
    ::close(fd);
    if (r != 0) {
        errno = e;
        return errno_error("fsync directory", dir);
    }
    return {};
}

Result<BlobHeader> blob_write(const std::string& path, const KvIdentity& id, KvPool& pool, const KvSeq& seq,
                              std::span<const int32_t> tokens, uint64_t first, uint64_t n, bool sync) {
    if (first + n > static_cast<uint64_t>(seq.n_tokens()) || first + n > tokens.size())
        return make_error("positions [{}, {}) are beyond the sequence ({} positions, {} tokens)", first, first + n,
                          seq.n_tokens(), tokens.size());
    BlobHeader h;
    h.id = id;
    h.layout = pool.layout();
    h.scales = h.layout.quantized() ? KvScaleLayout::RowF32Tail : KvScaleLayout::None;
    h.first_pos = first;
    h.n_tokens = n;
    auto bytes = blob_data_bytes(h.layout, n);
    if (!bytes) return bytes.error();
    h.data_bytes = *bytes;
    auto rows = kv_rows_iov(pool, seq.blocks(), first, n);
    if (!rows) return rows.error();
    std::vector<iovec> iov;
    iov.reserve(rows->size() + 2);
    uint8_t head[kBlobHeaderBytes];
    iov.push_back({head, kBlobHeaderBytes});
    iov.push_back({const_cast<int32_t*>(tokens.data() + first), n * sizeof(int32_t)});
    iov.insert(iov.end(), rows->begin(), rows->end());
    h.data_crc = crc32c_iov(std::span(iov).subspan(1));
    blob_header_encode(h, head);

    const std::string tmp = fmt::format("{}.tmp.{}", path, ::getpid());
    const int fd = ::open(tmp.c_str(), O_CREAT | O_TRUNC | O_WRONLY | O_CLOEXEC, 0600);
    if (fd < 0) return errno_error("create", tmp);
    Status s = pwrite_iov(fd, 0, iov);
    if (s && sync && ::fsync(fd) != 0) s = errno_error("fsync", tmp);
    ::close(fd);
    if (s && ::rename(tmp.c_str(), path.c_str()) != 0) s = errno_error("rename to", path);
    if (!s) {
        ::unlink(tmp.c_str());
        return s.error();
    }
    if (sync)
        if (Status d = fsync_dir_of(path); !d) return d.error();
    return h;
}

namespace {

// Rows of a blob of dtype `from` (values then scales, blob order, at `src`) into the
// arena rows `dst` (kv_rows_iov of the arena), converting each value through f32.
void convert_rows(const KvLayout& from, const KvLayout& to, const uint8_t* src, uint64_t n,
                  std::span<const iovec> dst) {
    const size_t dim = static_cast<size_t>(from.head_dim);
    const uint64_t n_rows = 2 * static_cast<uint64_t>(from.n_layer) * from.n_head_kv * n;
    const uint8_t* src_vals = src;
    // The scale tail follows the values at any byte offset (odd counts): read with memcpy.
    const uint8_t* src_scales = src + n_rows * dim * elem_bytes_of(from.dtype);
    // The arena side: value runs first, then (quantized) as many scale runs.
    const size_t n_runs = to.quantized() ? dst.size() / 2 : dst.size();
    std::vector<float> x(dim);
    uint64_t r = 0;  // row in blob order
    for (size_t run = 0; run < n_runs; ++run) {
        const size_t rows_in_run = dst[run].iov_len / (dim * elem_bytes_of(to.dtype));
        uint8_t* out = static_cast<uint8_t*>(dst[run].iov_base);
        float* out_scale = to.quantized() ? static_cast<float*>(dst[n_runs + run].iov_base) : nullptr;
        for (size_t k = 0; k < rows_in_run; ++k, ++r) {
            const uint8_t* in = src_vals + r * dim * elem_bytes_of(from.dtype);
            if (from.dtype == KvDtype::F16) {
                for (size_t d = 0; d < dim; ++d) {
                    uint16_t h;
                    std::memcpy(&h, in + 2 * d, 2);
                    x[d] = cpu::fp16_to_fp32(h);
                }
            } else {
                float s;
                std::memcpy(&s, src_scales + 4 * r, 4);
                for (size_t d = 0; d < dim; ++d)
                    x[d] = s * (from.dtype == KvDtype::Int8 ? static_cast<float>(static_cast<int8_t>(in[d]))
                                                            : cpu::fp8_e4m3_to_fp32(in[d]));
            }
            if (to.dtype == KvDtype::F16) {
                for (size_t d = 0; d < dim; ++d) {
                    const uint16_t h = cpu::fp32_to_fp16(x[d]);
                    std::memcpy(out + 2 * (k * dim + d), &h, 2);
                }
            } else {
                out_scale[k] = cpu::quantize_kv_row(to.dtype == KvDtype::Int8 ? cpu::KvQuant::Int8 : cpu::KvQuant::Fp8,
                                                    x.data(), static_cast<int64_t>(dim), out + k * dim);
            }
        }
    }
}

}  // namespace

Result<BlobImport> blob_read_into(int fd, uint64_t at, uint64_t file_size, const KvIdentity& want,
                                  const KvLayout& arena, uint64_t expect_first, const BlobRowsFor& rows_for) {
    uint8_t head[kBlobHeaderBytes];
    if (file_size < at + kBlobHeaderBytes)
        return make_error("truncated: {} bytes, a KV blob header alone is {}", file_size - std::min(file_size, at),
                          kBlobHeaderBytes);
    if (Status s = pread_iov(fd, at, std::array{iovec{head, kBlobHeaderBytes}}); !s) return s.error();
    auto h = blob_header_decode(head, kBlobHeaderBytes);
    if (!h) return h.error();
    if (Status s = blob_check_compatible(*h, want, arena); !s) return s.error();
    const uint64_t have = file_size - at - kBlobHeaderBytes;
    if (have != h->data_bytes)
        return make_error("{}: {} bytes after the header, the header says {}", have < h->data_bytes ? "truncated" : "size",
                          have, h->data_bytes);
    if (expect_first != h->first_pos)
        return make_error("first_pos: the blob continues a sequence at position {}, the sequence has {} positions",
                          h->first_pos, expect_first);

    BlobImport out;
    out.header = *h;
    const uint64_t n = h->n_tokens;
    auto rows = rows_for(*h);
    if (!rows) return rows.error();
    out.tokens.resize(n);
    uint64_t off = at + kBlobHeaderBytes;
    if (Status s = pread_iov(fd, off, std::array{iovec{out.tokens.data(), n * 4}}); !s) return s.error();
    uint32_t crc = crc32c(out.tokens.data(), n * 4);
    off += n * 4;
    if (h->layout.dtype == arena.dtype) {
        if (Status s = pread_iov(fd, off, *rows); !s) return s.error();
        crc = crc32c_iov(*rows, crc);
    } else {
        std::vector<uint8_t> buf(h->data_bytes - n * 4);
        if (Status s = pread_iov(fd, off, std::array{iovec{buf.data(), buf.size()}}); !s) return s.error();
        crc = crc32c(buf.data(), buf.size(), crc);
        if (crc == h->data_crc) convert_rows(h->layout, arena, buf.data(), n, *rows);
        out.converted = true;
        out.note = fmt::format("converted {} KV rows from {} to {}", 2 * uint64_t(h->layout.n_layer) * h->layout.n_head_kv * n,
                               kv_dtype_name(h->layout.dtype), kv_dtype_name(arena.dtype));
    }
    if (crc != h->data_crc)
        return make_error("data_crc: stored {:#010x}, computed {:#010x} (the data is corrupt)", h->data_crc, crc);
    for (uint64_t i = 0; i < n; ++i)
        if (out.tokens[i] < 0 || (want.n_vocab > 0 && out.tokens[i] >= want.n_vocab))
            return make_error("token {} at position {} is not in the vocabulary of {} tokens", out.tokens[i],
                              h->first_pos + i, want.n_vocab);
    return out;
}

Result<BlobImport> blob_import_fd(int fd, uint64_t at, uint64_t file_size, const KvIdentity& want, KvPool& pool,
                                  KvSeq& seq) {
    // Shadow blocks: a fork shares seq's blocks; prepare_append copies the partial last
    // block before anything is written, so nothing seq holds is touched.
    KvSeq shadow = seq.fork(pool);
    auto r = blob_read_into(fd, at, file_size, want, pool.layout(), static_cast<uint64_t>(seq.n_tokens()),
                            [&](const BlobHeader& h) -> Result<std::vector<iovec>> {
                                const int64_t first = static_cast<int64_t>(h.first_pos);
                                const int64_t end = first + static_cast<int64_t>(h.n_tokens);
                                if (Status s = shadow.prepare_append(pool, first, end); !s)
                                    return make_error("no room in the KV arena for {} tokens: {}", h.n_tokens,
                                                      s.error().message);
                                return kv_rows_iov(pool, shadow.blocks(), h.first_pos, h.n_tokens);
                            });
    if (!r) {
        shadow.release(pool);
        return r.error();
    }
    shadow.set_n_tokens(static_cast<int64_t>(r->header.first_pos + r->header.n_tokens));
    seq.release(pool);
    seq = std::move(shadow);
    return r;
}

Result<BlobImport> blob_import(const std::string& path, const KvIdentity& want, KvPool& pool, KvSeq& seq) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return errno_error("open", path);
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
        ::close(fd);
        return errno_error("stat", path);
    }
    auto r = blob_import_fd(fd, 0, static_cast<uint64_t>(st.st_size), want, pool, seq);
    ::close(fd);
    if (!r) return make_error("{}: {}", path, r.error().message);
    return r;
}

Result<BlobHeader> blob_verify_file(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return errno_error("open", path);
    struct stat st {};
    ::fstat(fd, &st);
    const uint64_t size = static_cast<uint64_t>(st.st_size);
    uint8_t head[kBlobHeaderBytes];
    const ssize_t got = ::pread(fd, head, kBlobHeaderBytes, 0);
    auto h = blob_header_decode(head, got < 0 ? 0 : static_cast<size_t>(got));
    if (!h) {
        ::close(fd);
        return h.error();
    }
    if (size - kBlobHeaderBytes != h->data_bytes) {
        ::close(fd);
        return make_error("{}: {} bytes after the header, the header says {}",
                          size - kBlobHeaderBytes < h->data_bytes ? "truncated" : "size", size - kBlobHeaderBytes,
                          h->data_bytes);
    }
    auto crc = crc32c_file(fd, kBlobHeaderBytes, h->data_bytes);
    ::close(fd);
    if (!crc) return crc.error();
    if (*crc != h->data_crc)
        return make_error("data_crc: stored {:#010x}, computed {:#010x} (the data is corrupt)", h->data_crc, *crc);
    return h;
}

}  // namespace duet
