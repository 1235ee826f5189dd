// The KV blob: one sequence's KV (a range of its positions) as a file, the unit of
// export, import, checkpoint and offload (DESIGN.md "KV blob format"; the rules
// are in KVLOG.md next to this file).
//
//   [0, 128)            header, little-endian (BlobHeader; CRC32C of bytes 0..123 at 124)
//   [128, +4n)          the n token ids, i32
//   then                K/V values ordered layer -> K|V -> kv head -> token -> dim
//                       (f16 bits, or one byte each for int8 / fp8)
//   then (quantized)    the rows' f32 scales ordered layer -> K|V -> kv head -> token
// No padding anywhere, so the file can be read by mmap or scattered straight into
// an arena's tiles. The data CRC32C in the header covers every byte after it.
#pragma once

#include <array>
#include <functional>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <sys/uio.h>

#include "base/result.h"
#include "kv/kv_pool.h"

namespace duet {

// 128 bits of a SHA-256: what a blob or log says about the model and tokenizer that
// computed it (model/fingerprint.h computes them from a GGUF file).
using Fp128 = std::array<uint8_t, 16>;
std::string fp_hex(const Fp128& f);

struct KvIdentity {
    Fp128 model{};      // the weights (and the hyper-parameters that shape the KV)
    Fp128 tokenizer{};  // vocabulary, merges, types, pre-tokenizer, specials, BOS/EOS
    int64_t n_vocab = 0;  // not stored: an import refuses token ids outside [0, n_vocab) (0: unchecked)
};

constexpr size_t kBlobHeaderBytes = 128;
constexpr uint32_t kBlobVersion = 1;
constexpr char kBlobMagic[8] = {'D', 'U', 'E', 'T', 'K', 'V', 'B', '\0'};

// How a quantized blob keeps its scales (the only layout so far).
enum class KvScaleLayout : uint8_t {
    None = 0,       // f16: no scales
    RowF32Tail = 1  // one f32 per (layer, K|V, head, token) row, after all values
};

struct BlobHeader {
    uint32_t version = kBlobVersion;
    KvIdentity id;
    KvLayout layout;  // n_layer, n_head_kv, head_dim, dtype, block_tokens
    KvScaleLayout scales = KvScaleLayout::None;
    uint32_t flags = 0;  // none defined: a reader refuses bits it does not know
    uint64_t first_pos = 0;
    uint64_t n_tokens = 0;
    uint64_t data_bytes = 0;  // bytes after the header
    uint32_t data_crc = 0;    // CRC32C of those bytes
};

// Bytes after the header for n tokens of this layout (tokens, values, scales);
// an Error when the count overflows 64 bits or exceeds what a blob may hold.
Result<uint64_t> blob_data_bytes(const KvLayout& l, uint64_t n_tokens);

// The KV shape fields at bytes 48..67 of a blob header and of a log header (the
// same offsets in both): n_layer, n_head_kv, head_dim (u32), dtype, scale layout
// (u8), a zero u16, block_tokens (u32).
void kv_layout_put(uint8_t* header, const KvLayout& l);
Result<KvLayout> kv_layout_get(const uint8_t* header);
// The KV shape fields a blob or log header stores, checked (ranges, a known dtype,
// the scale layout that goes with it); the Error names the field.
Result<KvLayout> kv_layout_decode(uint32_t n_layer, uint32_t n_head_kv, uint32_t head_dim, uint32_t block_tokens,
                                  uint8_t dtype, uint8_t scale_layout);

void blob_header_encode(const BlobHeader& h, uint8_t out[kBlobHeaderBytes]);
// Parses and checks a header on its own: magic, version, CRC, known dtype, flags,
// reserved bytes zero, dimensions in range, data_bytes consistent with the counts.
// The Error names the field, what was found and what was expected.
Result<BlobHeader> blob_header_decode(const uint8_t* p, size_t n);
// Checks a decoded header against what this process would accept: the loaded
// model's and tokenizer's fingerprints and the arena's shape (n_layer, n_head_kv,
// head_dim, block_tokens; the dtype may differ: import converts). Names the
// field and both values.
Status blob_check_compatible(const BlobHeader& h, const KvIdentity& want, const KvLayout& arena);

// The arena memory of positions [first, first + n) of a sequence over `blocks`, in
// blob order (values, then scales when quantized): one iovec per run of
// consecutive tokens of one (layer, K|V, head) inside one block. A writev of
// these from the arena is a blob's KV data; a readv into them restores it.
// Errors: positions beyond the blocks.
Result<std::vector<iovec>> kv_rows_iov(KvPool& pool, std::span<const int32_t> blocks, uint64_t first, uint64_t n);

// Writes positions [first, first + n) of `seq` (whose tokens are `tokens`, all of
// its positions) as a blob at `path`: a temporary file in the same directory,
// fsync, rename, fsync of the directory, so the path holds either the old file or
// the whole new one. Returns the header written. sync false: no fsync of the file
// or the directory (the rename alone: a reader sees the old file or the whole new
// one, but a power loss may lose it): for KV that can be computed again (a
// preempted request's swap).
Result<BlobHeader> blob_write(const std::string& path, const KvIdentity& id, KvPool& pool, const KvSeq& seq,
                              std::span<const int32_t> tokens, uint64_t first, uint64_t n, bool sync = true);

struct BlobImport {
    BlobHeader header;
    std::vector<int32_t> tokens;  // the blob's tokens (positions first_pos...)
    bool converted = false;       // the blob's dtype was not the arena's: rows were requantized
    std::string note;             // what the conversion did, for the caller to say
};

// Reads the blob at path into `seq`, which must hold exactly header.first_pos
// positions (empty for a blob of a whole sequence). Everything is checked before
// any block `seq` holds is touched: the header, the fit with `want` and the arena,
// the file's size, and the data CRC, read into shadow blocks (a fork of seq, its
// partial last block copied first) that are freed on any failure, leaving seq as
// it was. A blob of another dtype is converted row by row (f16 <-> int8 / fp8,
// dequantized through f32 and requantized as the KV append would).
Result<BlobImport> blob_import(const std::string& path, const KvIdentity& want, KvPool& pool, KvSeq& seq);
// The same from an open file descriptor at offset `at` (a checkpoint inside a log
// directory, a socket's spooled body).
Result<BlobImport> blob_import_fd(int fd, uint64_t at, uint64_t file_size, const KvIdentity& want, KvPool& pool,
                                  KvSeq& seq);

// The engine of the imports above: checks the header (against `want`, the arena's
// shape and the sequence length `expect_first`) and the file size, asks rows_for
// for the destination of the rows (kv_rows_iov order, in the arena's dtype: called
// once, after every header check), reads the tokens and the rows into it (through
// f32 when the dtypes differ) and checks the data CRC and the token ids. On an
// Error the destination may hold anything: it must not be live (shadow blocks, a
// staging buffer).
using BlobRowsFor = std::function<Result<std::vector<iovec>>(const BlobHeader&)>;
Result<BlobImport> blob_read_into(int fd, uint64_t at, uint64_t file_size, const KvIdentity& want,
                                  const KvLayout& arena, uint64_t expect_first, const BlobRowsFor& rows_for);

// Reads only the header and checks the whole data CRC (duet kv inspect / verify):
// no arena needed. The Error says what is wrong and where.
Result<BlobHeader> blob_verify_file(const std::string& path);

// Scatter read: n bytes at file offset `at` into iov (in order), in chunks of at
// most IOV_MAX buffers; an Error on a short file or an I/O error.
Status pread_iov(int fd, uint64_t at, std::span<const iovec> iov);
// The CRC32C of n bytes of the file from offset `at` (read in chunks), continuing crc.
Result<uint32_t> crc32c_file(int fd, uint64_t at, uint64_t n, uint32_t crc = 0);
// Gather write of the whole iov at offset `at` (short writes continued).
Status pwrite_iov(int fd, uint64_t at, std::span<const iovec> iov);
// write-temp -> fsync -> rename -> fsync(directory) helpers shared with the log.
Status fsync_dir_of(const std::string& path);

}  // namespace duet
