// KV blobs (src/kv/blob.h) and CRC32C: round trips of every dtype and of sequences
// starting mid-block, every header field refused by name, bit flips refused, imports
// that fail leaving the live blocks untouched, dtype conversion; no model needed.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <random>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kernels/cpu/kernels.h"
#include "kv/blob.h"
#include "kv/crc32c.h"

using namespace duet;

namespace {

// The CRC-32C definition, bit by bit (reflected polynomial 0x82F63B78).
uint32_t crc32c_bitwise(const uint8_t* p, size_t n) {
    uint32_t c = 0xFFFFFFFFu;
    for (size_t i = 0; i < n; ++i) {
        c ^= p[i];
        for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
    }
    return ~c;
}

KvLayout layout_of(KvDtype dt) {
    KvLayout l;
    l.n_layer = 3;
    l.n_head_kv = 2;
    l.head_dim = 8;
    l.block_tokens = 16;
    l.dtype = dt;
    return l;
}

KvIdentity ident() {
    KvIdentity id;
    for (int i = 0; i < 16; ++i) {
        id.model[i] = static_cast<uint8_t>(i + 1);
        id.tokenizer[i] = static_cast<uint8_t>(0xA0 + i);
    }
    id.n_vocab = 1000;
    return id;
}

struct TmpDir {
    std::string path;
    TmpDir() {
        char t[] = "/tmp/duet-kvblob-XXXXXX";
        path = ::mkdtemp(t);
    }
    ~TmpDir() { std::system(("rm -rf " + path).c_str()); }
};

std::vector<uint8_t> read_file(const std::string& p) {
    std::ifstream in(p, std::ios::binary);
    return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {});
}
void write_file(const std::string& p, const std::vector<uint8_t>& b) {
    std::ofstream out(p, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

// Fills positions [from, to) of seq with random values (finite scales for quantized rows).
void fill_random(KvPool& pool, const KvSeq& seq, int64_t from, int64_t to, std::mt19937& rng) {
    const KvLayout& l = pool.layout();
    const size_t row = static_cast<size_t>(l.head_dim) * l.elem_bytes();
    for (int64_t p = from; p < to; ++p) {
        const int32_t b = seq.blocks()[p / l.block_tokens];
        const int64_t t = p % l.block_tokens;
        for (int32_t layer = 0; layer < l.n_layer; ++layer)
            for (int32_t h = 0; h < l.n_head_kv; ++h) {
                for (uint8_t* base : {pool.k(b, layer, h), pool.v(b, layer, h)})
                    for (size_t i = 0; i < row; ++i) base[t * row + i] = static_cast<uint8_t>(rng());
                if (l.quantized()) {
                    pool.k_scales(b, layer, h)[t] = static_cast<float>(rng() % 1000) / 37.0f;
                    pool.v_scales(b, layer, h)[t] = static_cast<float>(rng() % 1000) / 41.0f;
                }
            }
    }
}

// Every stored byte (values and scales) of positions [from, to) equal in both.
void expect_same_rows(KvPool& a, const KvSeq& sa, KvPool& b, const KvSeq& sb, int64_t from, int64_t to) {
    const KvLayout& l = a.layout();
    const size_t row = static_cast<size_t>(l.head_dim) * l.elem_bytes();
    for (int64_t p = from; p < to; ++p) {
        const int32_t ba = sa.blocks()[p / l.block_tokens], bb = sb.blocks()[p / l.block_tokens];
        const int64_t t = p % l.block_tokens;
        for (int32_t layer = 0; layer < l.n_layer; ++layer)
            for (int32_t h = 0; h < l.n_head_kv; ++h) {
                ASSERT_EQ(0, std::memcmp(a.k(ba, layer, h) + t * row, b.k(bb, layer, h) + t * row, row)) << p;
                ASSERT_EQ(0, std::memcmp(a.v(ba, layer, h) + t * row, b.v(bb, layer, h) + t * row, row)) << p;
                if (l.quantized()) {
                    ASSERT_EQ(a.k_scales(ba, layer, h)[t], b.k_scales(bb, layer, h)[t]) << p;
                    ASSERT_EQ(a.v_scales(ba, layer, h)[t], b.v_scales(bb, layer, h)[t]) << p;
                }
            }
    }
}

struct Source {
    std::unique_ptr<KvPool> pool;
    KvSeq seq;
    std::vector<int32_t> tokens;
    ~Source() { seq.release(*pool); }
};

std::unique_ptr<Source> make_source(KvDtype dt, int64_t n, uint32_t seed, int32_t blocks = 16) {
    auto s = std::make_unique<Source>();
    s->pool = std::move(KvPool::create(layout_of(dt), blocks)).value();
    std::mt19937 rng(seed);
    EXPECT_TRUE(s->seq.prepare_append(*s->pool, 0, n).ok());
    fill_random(*s->pool, s->seq, 0, n, rng);
    s->seq.set_n_tokens(n);
    for (int64_t i = 0; i < n; ++i) s->tokens.push_back(static_cast<int32_t>(rng() % 1000));
    return s;
}

}  // namespace

TEST(Crc32c, StandardVectorAndBitwiseReference) {
    EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);
    EXPECT_EQ(crc32c("", 0), 0u);
    std::mt19937 rng(5);
    std::vector<uint8_t> buf(70000);
    for (auto& b : buf) b = static_cast<uint8_t>(rng());
    for (size_t n : {1u, 3u, 7u, 8u, 9u, 63u, 64u, 65u, 255u, 256u, 1000u, 4096u, 65537u})
        for (size_t off : {0u, 1u, 5u}) {
            ASSERT_EQ(crc32c(buf.data() + off, n), crc32c_bitwise(buf.data() + off, n)) << n << "@" << off;
            // A running CRC extends: A then B is the CRC of A followed by B.
            const size_t cut = n / 3;
            ASSERT_EQ(crc32c(buf.data() + off + cut, n - cut, crc32c(buf.data() + off, cut)),
                      crc32c_bitwise(buf.data() + off, n));
        }
    const iovec iov[3] = {{buf.data(), 10}, {buf.data() + 10, 0}, {buf.data() + 10, 90}};
    EXPECT_EQ(crc32c_iov(iov), crc32c_bitwise(buf.data(), 100));
}

// Blobs of every dtype, whole sequences and ranges starting mid-block, of lengths
// 1 to a few blocks: the rows land byte for byte, and a blob written from the
// imported sequence is the same file.
TEST(KvBlob, RoundTripsEveryDtypeAndMidBlockStarts) {
    TmpDir dir;
    for (KvDtype dt : {KvDtype::F16, KvDtype::Int8, KvDtype::Fp8})
        for (int64_t first : {0, 5, 16, 21})
            for (int64_t n : {1, 2, 15, 16, 17, 33, 70}) {
                SCOPED_TRACE(std::string(kv_dtype_name(dt)) + " first " + std::to_string(first) + " n " +
                             std::to_string(n));
                auto src = make_source(dt, first + n, static_cast<uint32_t>(first * 100 + n));
                const std::string path = dir.path + "/a.kvblob";
                auto h = blob_write(path, ident(), *src->pool, src->seq, src->tokens, static_cast<uint64_t>(first),
                                    static_cast<uint64_t>(n));
                ASSERT_TRUE(h.ok()) << h.error().message;
                struct stat st {};
                ASSERT_EQ(::stat(path.c_str(), &st), 0);
                EXPECT_EQ(static_cast<uint64_t>(st.st_size), kBlobHeaderBytes + h->data_bytes);
                // The whole-sequence layout: 4n token bytes + 2 L H n D e values (+ 2 L H n scales).
                const KvLayout l = layout_of(dt);
                EXPECT_EQ(h->data_bytes, static_cast<uint64_t>(4 * n + 2 * l.n_layer * l.n_head_kv * n * l.head_dim *
                                                                          static_cast<int64_t>(l.elem_bytes()) +
                                                               (l.quantized() ? 8 * l.n_layer * l.n_head_kv * n : 0)));

                auto dst = make_source(dt, first, 999);  // a different prefix: only [first, first+n) compared
                const int32_t free_before = dst->pool->allocator().n_free();
                auto im = blob_import(path, ident(), *dst->pool, dst->seq);
                ASSERT_TRUE(im.ok()) << im.error().message;
                EXPECT_FALSE(im->converted);
                EXPECT_EQ(dst->seq.n_tokens(), first + n);
                EXPECT_EQ(im->tokens, std::vector<int32_t>(src->tokens.begin() + first, src->tokens.end()));
                expect_same_rows(*src->pool, src->seq, *dst->pool, dst->seq, first, first + n);
                const int64_t bt = l.block_tokens;
                EXPECT_EQ(free_before - dst->pool->allocator().n_free(), (first + n + bt - 1) / bt - (first + bt - 1) / bt +
                                                                            (first % bt != 0 ? 1 : 0) - (first % bt != 0 ? 1 : 0));
                // Written again from the import: the same bytes.
                std::vector<int32_t> toks(dst->tokens.begin(), dst->tokens.begin() + first);
                toks.insert(toks.end(), im->tokens.begin(), im->tokens.end());
                const std::string again = dir.path + "/b.kvblob";
                ASSERT_TRUE(blob_write(again, ident(), *dst->pool, dst->seq, toks, static_cast<uint64_t>(first),
                                       static_cast<uint64_t>(n))
                                .ok());
                EXPECT_EQ(read_file(path), read_file(again));
                auto v = blob_verify_file(path);
                EXPECT_TRUE(v.ok()) << v.error().message;
            }
}

namespace {

// A valid blob of 20 tokens (first position 0), its bytes.
std::vector<uint8_t> small_blob(const TmpDir& dir, KvDtype dt = KvDtype::F16, int64_t n = 20) {
    auto src = make_source(dt, n, 7);
    const std::string path = dir.path + "/small.kvblob";
    EXPECT_TRUE(blob_write(path, ident(), *src->pool, src->seq, src->tokens, 0, static_cast<uint64_t>(n)).ok());
    return read_file(path);
}

// Imports bytes as a blob into a pool whose sequence holds `prefix` positions; the
// error message, or "" on success. Checks that a failed import changed nothing.
std::string import_bytes(const TmpDir& dir, const std::vector<uint8_t>& bytes, KvIdentity id = ident(),
                         KvDtype dt = KvDtype::F16, int64_t prefix = 0) {
    const std::string path = dir.path + "/in.kvblob";
    write_file(path, bytes);
    auto dst = make_source(dt, prefix, 3);
    const int32_t free_before = dst->pool->allocator().n_free();
    const std::vector<int32_t> blocks_before = dst->seq.blocks();
    std::vector<uint8_t> arena_before(static_cast<const uint8_t*>(dst->pool->data()),
                                      static_cast<const uint8_t*>(dst->pool->data()) + dst->pool->layout().block_bytes() * 16);
    auto r = blob_import(path, id, *dst->pool, dst->seq);
    if (r.ok()) return "";
    EXPECT_EQ(dst->pool->allocator().n_free(), free_before) << "a failed import leaked blocks";
    EXPECT_EQ(dst->seq.blocks(), blocks_before);
    EXPECT_EQ(dst->seq.n_tokens(), prefix);
    // The live blocks are untouched (shadow blocks may have been written: compare only live ones).
    const KvLayout& l = dst->pool->layout();
    for (int32_t b : blocks_before)
        for (int32_t layer = 0; layer < l.n_layer; ++layer) {
            const size_t off = (static_cast<size_t>(layer) * 16 + b) * l.tile_bytes();
            EXPECT_EQ(0, std::memcmp(arena_before.data() + off, static_cast<const uint8_t*>(dst->pool->data()) + off,
                                     l.tile_bytes()))
                << "live block " << b << " layer " << layer << " was touched";
        }
    return r.error().message;
}

void set_field(std::vector<uint8_t>& b, size_t off, const void* v, size_t n, bool fix_crc = true) {
    std::memcpy(b.data() + off, v, n);
    if (fix_crc) {
        const uint32_t c = crc32c(b.data(), 124);
        std::memcpy(b.data() + 124, &c, 4);
    }
}

}  // namespace

// Each header field changed (with the header CRC made valid again, so the field
// itself is what is refused) is refused with the field named.
TEST(KvBlob, EveryHeaderFieldIsRefusedByName) {
    TmpDir dir;
    const std::vector<uint8_t> good = small_blob(dir);
    ASSERT_EQ(import_bytes(dir, good), "");
    struct Case {
        const char* name;
        size_t off;
        std::vector<uint8_t> value;
        const char* expect;
        bool fix_crc = true;
    };
    const auto u32 = [](uint32_t v) {
        std::vector<uint8_t> b(4);
        std::memcpy(b.data(), &v, 4);
        return b;
    };
    const auto u64 = [](uint64_t v) {
        std::vector<uint8_t> b(8);
        std::memcpy(b.data(), &v, 8);
        return b;
    };
    const std::vector<Case> cases = {
        {"magic", 0, {'X'}, "magic"},
        {"version", 8, u32(2), "version"},
        {"header bytes", 12, u32(64), "header_bytes"},
        {"model", 16, {0xEE}, "model_fingerprint"},
        {"tokenizer", 32, {0xEE}, "tokenizer_fingerprint"},
        {"layers", 48, u32(4), "n_layer"},
        {"layers zero", 48, u32(0), "n_layer"},
        {"heads", 52, u32(3), "n_head_kv"},
        {"head dim", 56, u32(16), "head_dim"},
        {"dtype unknown", 60, {9}, "dtype"},
        {"scale layout", 61, {1}, "scale_layout"},
        {"reserved 62", 62, {1}, "reserved"},
        {"block tokens", 64, u32(32), "block_tokens"},
        {"flags", 68, u32(1), "flags"},
        {"first pos", 72, u64(3), "first_pos"},
        {"n tokens", 80, u64(21), "data_bytes"},
        {"n tokens overflow", 80, u64(uint64_t{1} << 62), "n_tokens"},
        {"data bytes", 88, u64(5), "data_bytes"},
        {"data crc", 96, u32(0x12345678), "data_crc"},
        {"reserved tail", 110, {1}, "reserved"},
        {"header crc", 124, u32(0), "header_crc", false},
    };
    for (const Case& c : cases) {
        std::vector<uint8_t> b = good;
        set_field(b, c.off, c.value.data(), c.value.size(), c.fix_crc);
        if (c.off >= 48 && c.off < 60) {
            // Another shape, self-consistent (data_bytes to match): the arena refuses it.
            uint32_t L, H, D;
            std::memcpy(&L, b.data() + 48, 4);
            std::memcpy(&H, b.data() + 52, 4);
            std::memcpy(&D, b.data() + 56, 4);
            const uint64_t bytes = 4 * 20 + uint64_t{2} * L * H * 20 * D * 2;
            set_field(b, 88, &bytes, 8);
        }
        const std::string err = import_bytes(dir, b);
        EXPECT_NE(err.find(c.expect), std::string::npos) << c.name << ": " << err;
    }
    // Truncated anywhere, or grown: refused.
    for (size_t cut : {size_t{0}, size_t{10}, size_t{127}, size_t{128}, good.size() / 2, good.size() - 1}) {
        std::vector<uint8_t> b(good.begin(), good.begin() + static_cast<ptrdiff_t>(cut));
        EXPECT_NE(import_bytes(dir, b).find("truncated"), std::string::npos) << cut;
    }
    std::vector<uint8_t> grown = good;
    grown.push_back(0);
    EXPECT_NE(import_bytes(dir, grown).find("size"), std::string::npos);
    // Another model's or tokenizer's KV, and token ids outside the vocabulary.
    KvIdentity other = ident();
    other.model[3] ^= 1;
    EXPECT_NE(import_bytes(dir, good, other).find("model_fingerprint"), std::string::npos);
    other = ident();
    other.tokenizer[15] ^= 0x80;
    EXPECT_NE(import_bytes(dir, good, other).find("tokenizer_fingerprint"), std::string::npos);
    other = ident();
    other.n_vocab = 10;
    EXPECT_NE(import_bytes(dir, good, other).find("vocabulary"), std::string::npos);
    // Continuing a sequence of the wrong length.
    EXPECT_NE(import_bytes(dir, good, ident(), KvDtype::F16, 4).find("first_pos"), std::string::npos);
}

// Any single bit flipped anywhere in the file is refused (header or data CRC),
// never imported.
TEST(KvBlob, EveryBitFlipIsRefused) {
    TmpDir dir;
    for (KvDtype dt : {KvDtype::F16, KvDtype::Int8}) {
        const std::vector<uint8_t> good = small_blob(dir, dt, 3);
        for (size_t i = 0; i < good.size(); ++i)
            for (int bit = 0; bit < 8; ++bit) {
                std::vector<uint8_t> b = good;
                b[i] ^= static_cast<uint8_t>(1u << bit);
                ASSERT_NE(import_bytes(dir, b, ident(), dt), "") << "byte " << i << " bit " << bit;
            }
    }
}

// An import that finds corrupt data after reading into its shadow blocks leaves the
// sequence's live blocks (its partial last block included) exactly as they were.
TEST(KvBlob, FailedImportLeavesLiveBlocksUntouched) {
    TmpDir dir;
    auto src = make_source(KvDtype::F16, 40, 11);
    const std::string path = dir.path + "/cont.kvblob";
    ASSERT_TRUE(blob_write(path, ident(), *src->pool, src->seq, src->tokens, 21, 19).ok());
    std::vector<uint8_t> b = read_file(path);
    b.back() ^= 1;  // the last data byte: found only after every row was read
    const std::string err = import_bytes(dir, b, ident(), KvDtype::F16, 21);
    EXPECT_NE(err.find("data_crc"), std::string::npos) << err;
    // No room: refused before reading, nothing changed.
    auto big = make_source(KvDtype::F16, 16 * 15, 12, 16);
    const std::string p2 = dir.path + "/big.kvblob";
    ASSERT_TRUE(blob_write(p2, ident(), *big->pool, big->seq, big->tokens, 0, 16 * 15).ok());
    const std::string err2 = import_bytes(dir, read_file(p2), ident(), KvDtype::F16, 17);
    EXPECT_NE(err2.find("first_pos"), std::string::npos) << err2;
    auto dst = make_source(KvDtype::F16, 0, 1, 4);
    auto r = blob_import(p2, ident(), *dst->pool, dst->seq);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.error().message.find("no room"), std::string::npos) << r.error().message;
    EXPECT_EQ(dst->pool->allocator().n_free(), 4);
}

// A blob imported into an arena of another dtype is converted row by row, as the
// KV append would store the same values, and says so.
TEST(KvBlob, ImportConvertsBetweenDtypes) {
    TmpDir dir;
    const int64_t n = 21;
    // f16 rows of moderate values (random bits would include inf / NaN).
    auto src = make_source(KvDtype::F16, n, 21);
    const KvLayout l16 = layout_of(KvDtype::F16);
    std::mt19937 rng(4);
    std::normal_distribution<float> nd(0.0f, 2.0f);
    for (int64_t p = 0; p < n; ++p)
        for (int32_t layer = 0; layer < l16.n_layer; ++layer)
            for (int32_t h = 0; h < l16.n_head_kv; ++h)
                for (int kv = 0; kv < 2; ++kv) {
                    const int32_t b = src->seq.blocks()[p / 16];
                    uint16_t* row = (kv ? src->pool->v16(b, layer, h) : src->pool->k16(b, layer, h)) + (p % 16) * 8;
                    for (int d = 0; d < 8; ++d) row[d] = cpu::fp32_to_fp16(nd(rng));
                }
    const std::string path = dir.path + "/f16.kvblob";
    ASSERT_TRUE(blob_write(path, ident(), *src->pool, src->seq, src->tokens, 0, n).ok());
    for (KvDtype to : {KvDtype::Int8, KvDtype::Fp8}) {
        auto dst = make_source(to, 0, 1);
        auto im = blob_import(path, ident(), *dst->pool, dst->seq);
        ASSERT_TRUE(im.ok()) << im.error().message;
        EXPECT_TRUE(im->converted);
        EXPECT_NE(im->note.find(std::string("to ") + kv_dtype_name(to)), std::string::npos) << im->note;
        for (int64_t p = 0; p < n; ++p)
            for (int32_t layer = 0; layer < l16.n_layer; ++layer)
                for (int32_t h = 0; h < l16.n_head_kv; ++h) {
                    const int32_t bs = src->seq.blocks()[p / 16], bd = dst->seq.blocks()[p / 16];
                    float x[8];
                    for (int d = 0; d < 8; ++d) x[d] = cpu::fp16_to_fp32(src->pool->k16(bs, layer, h)[(p % 16) * 8 + d]);
                    uint8_t q[8];
                    const float s = cpu::quantize_kv_row(to == KvDtype::Int8 ? cpu::KvQuant::Int8 : cpu::KvQuant::Fp8,
                                                         x, 8, q);
                    ASSERT_EQ(0, std::memcmp(q, dst->pool->k(bd, layer, h) + (p % 16) * 8, 8)) << p;
                    ASSERT_EQ(s, dst->pool->k_scales(bd, layer, h)[p % 16]) << p;
                }
        // And back to f16: scale * decoded byte, rounded to f16.
        const std::string qpath = dir.path + "/q.kvblob";
        ASSERT_TRUE(blob_write(qpath, ident(), *dst->pool, dst->seq, im->tokens, 0, n).ok());
        auto back = make_source(KvDtype::F16, 0, 1);
        auto im2 = blob_import(qpath, ident(), *back->pool, back->seq);
        ASSERT_TRUE(im2.ok()) << im2.error().message;
        EXPECT_TRUE(im2->converted);
        for (int64_t p = 0; p < n; ++p) {
            const int32_t bq = dst->seq.blocks()[p / 16], bf = back->seq.blocks()[p / 16];
            const float s = dst->pool->v_scales(bq, 2, 1)[p % 16];
            for (int d = 0; d < 8; ++d) {
                const uint8_t byte = dst->pool->v(bq, 2, 1)[(p % 16) * 8 + d];
                const float dec = to == KvDtype::Int8 ? static_cast<float>(static_cast<int8_t>(byte))
                                                      : cpu::fp8_e4m3_to_fp32(byte);
                ASSERT_EQ(cpu::fp32_to_fp16(s * dec), back->pool->v16(bf, 2, 1)[(p % 16) * 8 + d]) << p;
            }
        }
    }
}

// Odd shapes: a quantized blob whose scale tail starts at an offset that is not a
// multiple of 4 converts (the scales are read unaligned, ASan/UBSan run it); a
// quantized arena whose scales would sit misaligned is refused by name.
TEST(KvBlob, OddShapesConvertAndMisalignedScalesAreRefused) {
    TmpDir dir;
    KvLayout l = layout_of(KvDtype::Int8);
    l.n_layer = 1;
    l.n_head_kv = 1;
    l.head_dim = 5;  // 16 x 5 bytes a tile side: aligned; 2 x 3 x 5 = 30 blob value bytes: not
    auto pool = std::move(KvPool::create(l, 2)).value();
    KvSeq seq;
    ASSERT_TRUE(seq.prepare_append(*pool, 0, 3).ok());
    for (int t = 0; t < 3; ++t)
        for (int d = 0; d < 5; ++d) {
            pool->k(seq.blocks()[0], 0, 0)[t * 5 + d] = static_cast<uint8_t>(t * 7 + d - 9);
            pool->v(seq.blocks()[0], 0, 0)[t * 5 + d] = static_cast<uint8_t>(d * 3 - t);
            pool->k_scales(seq.blocks()[0], 0, 0)[t] = 0.25f * (t + 1);
            pool->v_scales(seq.blocks()[0], 0, 0)[t] = 0.5f * (t + 1);
        }
    seq.set_n_tokens(3);
    const std::vector<int32_t> toks = {1, 2, 3};
    const std::string path = dir.path + "/odd.kvblob";
    ASSERT_TRUE(blob_write(path, ident(), *pool, seq, toks, 0, 3).ok());
    KvLayout f = l;
    f.dtype = KvDtype::F16;
    auto fpool = std::move(KvPool::create(f, 2)).value();
    KvSeq fs;
    auto im = blob_import(path, ident(), *fpool, fs);
    ASSERT_TRUE(im.ok()) << im.error().message;
    for (int t = 0; t < 3; ++t)
        for (int d = 0; d < 5; ++d) {
            const float want = 0.5f * (t + 1) * static_cast<float>(static_cast<int8_t>(static_cast<uint8_t>(d * 3 - t)));
            EXPECT_EQ(fpool->v16(fs.blocks()[0], 0, 0)[t * 5 + d], cpu::fp32_to_fp16(want)) << t << "," << d;
        }
    seq.release(*pool);
    fs.release(*fpool);
    // n_head_kv 1 x block_tokens 16 x head_dim 5 is fine; block_tokens 3 is not.
    auto bad = kv_layout_decode(1, 1, 5, 3, static_cast<uint8_t>(KvDtype::Int8), 1);
    ASSERT_FALSE(bad.ok());
    EXPECT_NE(bad.error().message.find("multiple of 4"), std::string::npos) << bad.error().message;
    EXPECT_TRUE(kv_layout_decode(1, 1, 5, 3, static_cast<uint8_t>(KvDtype::F16), 0).ok());
}
