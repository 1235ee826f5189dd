// Deterministic KV contents for the files tests make: the fuzz seeds
// (tests/fuzz/seeds-kv-blob, seeds-kv-log, written by tests/kv_gen.cpp) and the
// CLI test's inputs. A position's token and KV rows are a pure function of the
// position, so any history of appends and truncations that ends at length n holds
// the same KV as a fresh sequence of n positions: the log fuzzer rebuilds the
// checkpoint blob its seeds name from this header alone.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kv/blob.h"
#include "kv/kv_pool.h"

namespace duet::kvgen {

inline KvIdentity identity() {
    KvIdentity id;
    for (size_t i = 0; i < id.model.size(); ++i) {
        id.model[i] = static_cast<uint8_t>(0x10 + i);
        id.tokenizer[i] = static_cast<uint8_t>(0xa0 + i);
    }
    return id;
}
constexpr int64_t kVocab = 1000;

// The layout of most files: small enough that a seed is a few KB, with a block of
// 4 tokens so that a few positions already span blocks.
inline KvLayout layout(KvDtype dt = KvDtype::F16) {
    KvLayout l;
    l.n_layer = 2;
    l.n_head_kv = 2;
    l.head_dim = 8;
    l.block_tokens = 4;
    l.dtype = dt;
    return l;
}
// Odd heads and dims: a blob of an odd number of positions has its scale tail at an
// offset that is not a multiple of 4. (Four tokens a block: KvPool puts a tile's
// scales right after its values, so heads x block_tokens x head_dim must be a
// multiple of 4 for an int8 / fp8 arena's floats to be aligned.)
inline KvLayout odd_layout(KvDtype dt) {
    KvLayout l;
    l.n_layer = 1;
    l.n_head_kv = 3;
    l.head_dim = 5;
    l.block_tokens = 4;
    l.dtype = dt;
    return l;
}

// The context whose log seeds carry a checkpoint, and that checkpoint's length:
// its blob is <kCheckpointContext>.1.kvblob holding positions [0, kCheckpointTokens).
constexpr const char* kCheckpointContext = "fz";
constexpr uint64_t kCheckpointTokens = 5;

inline int32_t token_at(uint64_t pos) { return static_cast<int32_t>((pos * 37 + 11) % kVocab); }

// A 32-bit mix of the coordinates of one value (splitmix-style finalizer).
inline uint32_t mix(uint64_t pos, int32_t layer, int kv, int32_t head, uint64_t d) {
    uint64_t x = pos * 0x9e3779b97f4a7c15ull ^ (uint64_t(layer) << 48) ^ (uint64_t(kv) << 40) ^
                 (uint64_t(head) << 32) ^ d;
    x ^= x >> 31;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 29;
    return static_cast<uint32_t>(x);
}

// Writes positions [from, to) of seq's blocks (already prepared) with the values
// of the pure function: finite f16 values, int8 bytes, fp8 bytes that are not NaN,
// positive scales.
inline void fill(KvPool& pool, const KvSeq& seq, uint64_t from, uint64_t to) {
    const KvLayout& l = pool.layout();
    const uint64_t bt = static_cast<uint64_t>(l.block_tokens), dim = static_cast<uint64_t>(l.head_dim);
    for (uint64_t pos = from; pos < to; ++pos) {
        const int32_t blk = seq.blocks()[pos / bt];
        const uint64_t t = pos % bt;
        for (int32_t layer = 0; layer < l.n_layer; ++layer)
            for (int kv = 0; kv < 2; ++kv)
                for (int32_t h = 0; h < l.n_head_kv; ++h) {
                    uint8_t* row = (kv == 0 ? pool.k(blk, layer, h) : pool.v(blk, layer, h)) + t * dim * l.elem_bytes();
                    for (uint64_t d = 0; d < dim; ++d) {
                        const uint32_t m = mix(pos, layer, kv, h, d);
                        if (l.dtype == KvDtype::F16) {
                            // Sign, exponent 13..16 (|x| in [2^-2, 2^2)), any mantissa.
                            const uint16_t bits = static_cast<uint16_t>((m & 0x8000) | ((13 + (m >> 16) % 4) << 10) |
                                                                        (m & 0x3ff));
                            std::memcpy(row + 2 * d, &bits, 2);
                        } else if (l.dtype == KvDtype::Int8) {
                            row[d] = static_cast<uint8_t>(m);
                        } else {
                            row[d] = static_cast<uint8_t>(m & 0xf7);  // never 0x7f / 0xff (NaN)
                        }
                    }
                    if (l.quantized()) {
                        float* s = kv == 0 ? pool.k_scales(blk, layer, h) : pool.v_scales(blk, layer, h);
                        s[t] = 0.001f * static_cast<float>(1 + mix(pos, layer, kv, h, 999) % 1000);
                    }
                }
    }
}

// Appends n positions of the pure function to seq (and their tokens to `tokens`).
inline Status append(KvPool& pool, KvSeq& seq, std::vector<int32_t>& tokens, uint64_t n) {
    const uint64_t from = static_cast<uint64_t>(seq.n_tokens());
    if (Status s = seq.prepare_append(pool, static_cast<int64_t>(from), static_cast<int64_t>(from + n)); !s) return s;
    fill(pool, seq, from, from + n);
    tokens.resize(from);
    for (uint64_t p = from; p < from + n; ++p) tokens.push_back(token_at(p));
    seq.set_n_tokens(static_cast<int64_t>(from + n));
    return {};
}

// The checkpoint blob that the log seeds of kCheckpointContext name, at
// dir/<kCheckpointContext>.1.kvblob.
inline Status write_checkpoint_blob(const std::string& dir) {
    auto pool = KvPool::create(layout(), 8);
    if (!pool) return pool.error();
    KvSeq seq;
    std::vector<int32_t> tokens;
    Status s = append(**pool, seq, tokens, kCheckpointTokens);
    if (s) {
        auto h = blob_write(dir + "/" + kCheckpointContext + ".1.kvblob", identity(), **pool, seq, tokens, 0,
                            kCheckpointTokens);
        if (!h) s = h.error();
    }
    seq.release(**pool);
    return s;
}

}  // namespace duet::kvgen
