// Synthetic models of a real architecture's exact shape (issue: the GPU path at real
// size): a GGUF with seeded random weights, written in seconds where it is needed —
// on a GPU machine without network, an 8B-shaped model for speed figures. Its
// numbers mean nothing (correctness stays with the real model against the CPU
// backend); its shapes, types and metadata are those of the named model, so every
// kernel, copy and KV byte costs what it would.
//
// The vocabulary is byte-level BPE without merges (256 byte tokens, then filler
// tokens, then control tokens begin/end of text), so any text tokenizes, one token
// per byte. Weights: uniform values of the spread a trained layer has (about
// 1/sqrt(fan-in)), quantized blocks with random codes and such scales; norms 1.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "base/result.h"
#include "kernels/cpu/quant_types.h"

namespace duet {

struct SynthShape {
    std::string name;  // "llama3-8b", ...
    int64_t n_vocab = 0, n_embd = 0, n_layer = 0, n_ff = 0, n_head = 0, n_head_kv = 0, n_ctx_train = 0;
    double rope_base = 10000.0;
    float rms_eps = 1e-5f;
    bool tied = false;  // the output head is the token embedding (no output.weight)
};

// The shapes by name: llama3-8b, llama3-70b (Meta's configs), smollm2-135m (the
// default model's), tiny (for tests: 2 layers, 256 wide, 512 tokens). nullopt: none.
std::optional<SynthShape> synth_shape(std::string_view name);
std::vector<std::string> synth_shape_names();

struct SynthOptions {
    SynthShape shape;
    DType type = DType::Q4_K;  // every matrix; norms in f32
    uint64_t seed = 1;
    int64_t layers = -1;  // fewer (or more) layers than the shape's: a slice; -1: the shape's
};

// The tensors write_synth_model writes for o, in file order: a matrix of `rows` rows
// of `cols` values (a vector: rows 1), its type and spread.
struct SynthTensor {
    std::string name;
    DType type;
    int64_t cols, rows;
    float sigma;  // standard deviation of its values (a norm: all ones)
    uint64_t bytes() const { return dtype_row_bytes(type, cols) * static_cast<uint64_t>(rows); }
};
std::vector<SynthTensor> synth_tensors(const SynthOptions& o);

// The file's bytes: what write_synth_model writes for o (for its caller's checks).
uint64_t synth_model_bytes(const SynthOptions& o);

// Writes the model to path (streamed: an 8B model never sits in memory). Errors:
// a type duet does not read, rows not a whole number of the type's blocks, I/O.
Status write_synth_model(const std::string& path, const SynthOptions& o);

}  // namespace duet
