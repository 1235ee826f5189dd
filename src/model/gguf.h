// GGUF reader: parses the header, metadata and tensor table of a GGUF file
// (llama.cpp's format, version 2 and 3) and gives views of tensor data in a
// read-only memory mapping. Nothing is copied: strings and tensor data point into
// the mapping, which lives as long as the GgufFile.
//
// Every length, count and offset read from the file is checked against the bytes
// that remain before it is used, so a truncated or corrupt file gives an Error that
// names the byte offset (and the key or tensor) where parsing stopped.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "base/result.h"
#include "kernels/cpu/quant_types.h"

namespace duet {

enum class GgufType : uint32_t {
    U8 = 0, I8 = 1, U16 = 2, I16 = 3, U32 = 4, I32 = 5, F32 = 6, BOOL = 7,
    STRING = 8, ARRAY = 9, U64 = 10, I64 = 11, F64 = 12,
};

const char* gguf_type_name(GgufType t);

// One metadata value. Scalars are widened (integers to int64/uint64, floats to
// double). Arrays keep their raw little-endian elements in the mapping (numeric)
// or a list of views (strings); arrays of arrays are rejected, as llama.cpp does.
struct GgufValue {
    GgufType type = GgufType::U8;
    uint64_t u = 0;         // unsigned integers and bool
    int64_t i = 0;          // signed integers (also set for unsigned that fit)
    double f = 0;           // floats
    std::string_view s;     // STRING
    GgufType elem_type = GgufType::U8;  // ARRAY
    uint64_t count = 0;                 // ARRAY
    const uint8_t* elems = nullptr;     // ARRAY of numbers: raw elements
    std::vector<std::string_view> strs; // ARRAY of strings

    bool is_int() const;
    bool is_float() const { return type == GgufType::F32 || type == GgufType::F64; }
    // Element k of a numeric array, widened.
    int64_t elem_int(uint64_t k) const;
    double elem_float(uint64_t k) const;
};

struct GgufTensor {
    std::string_view name;
    DType type = DType::F32;
    int n_dims = 0;
    int64_t ne[4] = {1, 1, 1, 1};  // ne[0] is the contiguous dimension
    uint64_t offset = 0;           // from the start of the data section
    const uint8_t* data = nullptr;
    size_t nbytes = 0;

    int64_t n_elements() const { return ne[0] * ne[1] * ne[2] * ne[3]; }
    size_t row_bytes() const { return dtype_row_bytes(type, ne[0]); }
};

class GgufFile {
public:
    // Maps and parses the file at path.
    static Result<std::unique_ptr<GgufFile>> open(const std::string& path);
    // Parses size bytes at data, which must outlive the result (fuzzing, tests).
    static Result<std::unique_ptr<GgufFile>> parse(const uint8_t* data, size_t size);

    ~GgufFile();
    GgufFile(const GgufFile&) = delete;
    GgufFile& operator=(const GgufFile&) = delete;

    uint32_t version() const { return version_; }
    size_t alignment() const { return alignment_; }
    size_t data_offset() const { return data_offset_; }
    size_t file_size() const { return size_; }
    const std::string& path() const { return path_; }

    // Metadata in file order.
    const std::vector<std::pair<std::string_view, GgufValue>>& metadata() const { return kv_; }
    const GgufValue* find(std::string_view key) const;

    // Typed getters: an Error names the key and what was found when the key is
    // missing or has another type. Integers of any width are accepted.
    Result<int64_t> get_int(std::string_view key) const;
    Result<double> get_float(std::string_view key) const;  // ints accepted too
    Result<std::string_view> get_string(std::string_view key) const;
    Result<bool> get_bool(std::string_view key) const;
    // With a default when the key is absent (still an Error on a wrong type).
    Result<int64_t> get_int_or(std::string_view key, int64_t def) const;
    Result<double> get_float_or(std::string_view key, double def) const;
    Result<bool> get_bool_or(std::string_view key, bool def) const;

    const std::vector<GgufTensor>& tensors() const { return tensors_; }
    const GgufTensor* tensor(std::string_view name) const;

private:
    GgufFile() = default;
    Status parse_all();

    std::string path_;
    const uint8_t* base_ = nullptr;
    size_t size_ = 0;
    bool mapped_ = false;
    uint32_t version_ = 0;
    size_t alignment_ = 32;
    size_t data_offset_ = 0;
    std::vector<std::pair<std::string_view, GgufValue>> kv_;
    std::unordered_map<std::string_view, size_t> kv_index_;
    std::vector<GgufTensor> tensors_;
    std::unordered_map<std::string_view, size_t> tensor_index_;
};

}  // namespace duet
