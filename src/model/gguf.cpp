#include "model/gguf.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace duet {

namespace {

constexpr uint32_t kGgufMagic = 0x46554747;  // "GGUF" read as little-endian u32
constexpr uint64_t kMaxTensors = 1u << 20;
constexpr uint64_t kMaxKv = 1u << 20;
constexpr size_t kMaxNameLen = 64;  // llama.cpp's GGML_MAX_NAME

size_t gguf_scalar_size(GgufType t) {
    switch (t) {
        case GgufType::U8: case GgufType::I8: case GgufType::BOOL: return 1;
        case GgufType::U16: case GgufType::I16: return 2;
        case GgufType::U32: case GgufType::I32: case GgufType::F32: return 4;
        case GgufType::U64: case GgufType::I64: case GgufType::F64: return 8;
        default: return 0;
    }
}

// A bounds-checked little-endian cursor over the file bytes.
class Reader {
public:
    Reader(const uint8_t* p, size_t n) : p_(p), n_(n) {}
    size_t pos() const { return pos_; }
    size_t left() const { return n_ - pos_; }

    bool need(size_t k) const { return k <= left(); }

    template <typename T>
    bool read(T& out) {
        if (!need(sizeof(T))) return false;
        std::memcpy(&out, p_ + pos_, sizeof(T));
        pos_ += sizeof(T);
        return true;
    }
    bool read_string(std::string_view& out) {
        uint64_t len = 0;
        if (!read(len) || !need(len)) return false;
        out = std::string_view(reinterpret_cast<const char*>(p_ + pos_), len);
        pos_ += len;
        return true;
    }
    const uint8_t* here() const { return p_ + pos_; }
    void skip(size_t k) { pos_ += k; }

private:
    const uint8_t* p_;
    size_t n_;
    size_t pos_ = 0;
};

bool valid_gguf_type(uint32_t t) { return t <= static_cast<uint32_t>(GgufType::F64); }

int64_t load_int(GgufType t, const uint8_t* p) {
    switch (t) {
        case GgufType::U8: case GgufType::BOOL: return *p;
        case GgufType::I8: return static_cast<int8_t>(*p);
        case GgufType::U16: { uint16_t v; std::memcpy(&v, p, 2); return v; }
        case GgufType::I16: { int16_t v; std::memcpy(&v, p, 2); return v; }
        case GgufType::U32: { uint32_t v; std::memcpy(&v, p, 4); return v; }
        case GgufType::I32: { int32_t v; std::memcpy(&v, p, 4); return v; }
        case GgufType::U64: { uint64_t v; std::memcpy(&v, p, 8); return static_cast<int64_t>(v); }
        case GgufType::I64: { int64_t v; std::memcpy(&v, p, 8); return v; }
        case GgufType::F32: { float v; std::memcpy(&v, p, 4); return static_cast<int64_t>(v); }
        case GgufType::F64: { double v; std::memcpy(&v, p, 8); return static_cast<int64_t>(v); }
        default: return 0;
    }
}

double load_float(GgufType t, const uint8_t* p) {
    if (t == GgufType::F32) { float v; std::memcpy(&v, p, 4); return v; }
    if (t == GgufType::F64) { double v; std::memcpy(&v, p, 8); return v; }
    if (t == GgufType::U64) { uint64_t v; std::memcpy(&v, p, 8); return static_cast<double>(v); }
    return static_cast<double>(load_int(t, p));
}

}  // namespace

const char* gguf_type_name(GgufType t) {
    switch (t) {
        case GgufType::U8: return "u8";
        case GgufType::I8: return "i8";
        case GgufType::U16: return "u16";
        case GgufType::I16: return "i16";
        case GgufType::U32: return "u32";
        case GgufType::I32: return "i32";
        case GgufType::F32: return "f32";
        case GgufType::BOOL: return "bool";
        case GgufType::STRING: return "string";
        case GgufType::ARRAY: return "array";
        case GgufType::U64: return "u64";
        case GgufType::I64: return "i64";
        case GgufType::F64: return "f64";
    }
    return "unknown";
}

bool GgufValue::is_int() const {
    switch (type) {
        case GgufType::U8: case GgufType::I8: case GgufType::U16: case GgufType::I16:
        case GgufType::U32: case GgufType::I32: case GgufType::U64: case GgufType::I64:
            return true;
        default: return false;
    }
}

int64_t GgufValue::elem_int(uint64_t k) const {
    return load_int(elem_type, elems + k * gguf_scalar_size(elem_type));
}

double GgufValue::elem_float(uint64_t k) const {
    return load_float(elem_type, elems + k * gguf_scalar_size(elem_type));
}

GgufFile::~GgufFile() {
    if (mapped_ && base_) munmap(const_cast<uint8_t*>(base_), size_);
}

Result<std::unique_ptr<GgufFile>> GgufFile::open(const std::string& path) {
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return make_error("cannot open model file {}: {}", path, std::strerror(errno));
    struct stat st {};
    if (fstat(fd, &st) != 0) {
        int e = errno;
        ::close(fd);
        return make_error("cannot stat {}: {}", path, std::strerror(e));
    }
    if (!S_ISREG(st.st_mode)) {
        ::close(fd);
        return make_error("{} is not a regular file", path);
    }
    size_t size = static_cast<size_t>(st.st_size);
    if (size == 0) {
        ::close(fd);
        return make_error("{} is empty: expected a GGUF file", path);
    }
    // MAP_POPULATE: fault the weights in now, not during the first tokens.
    void* p = mmap(nullptr, size, PROT_READ, MAP_PRIVATE | MAP_POPULATE, fd, 0);
    int e = errno;
    ::close(fd);
    if (p == MAP_FAILED) return make_error("cannot mmap {}: {}", path, std::strerror(e));

    std::unique_ptr<GgufFile> f(new GgufFile());
    f->path_ = path;
    f->base_ = static_cast<const uint8_t*>(p);
    f->size_ = size;
    f->mapped_ = true;
    if (Status s = f->parse_all(); !s) return make_error("{}: {}", path, s.error().message);
    return f;
}

Result<std::unique_ptr<GgufFile>> GgufFile::parse(const uint8_t* data, size_t size) {
    std::unique_ptr<GgufFile> f(new GgufFile());
    f->path_ = "<memory>";
    f->base_ = data;
    f->size_ = size;
    if (Status s = f->parse_all(); !s) return s.error();
    return f;
}

Status GgufFile::parse_all() {
    Reader r(base_, size_);
    uint32_t magic = 0;
    if (!r.read(magic)) return make_error("file is {} bytes, too short for a GGUF header", size_);
    if (magic != kGgufMagic)
        return make_error("not a GGUF file: bytes 0-3 are {:02x} {:02x} {:02x} {:02x}, expected 'GGUF'",
                          base_[0], base_[1], base_[2], base_[3]);
    if (!r.read(version_)) return make_error("truncated header at offset {}", r.pos());
    if (version_ != 2 && version_ != 3)
        return make_error("GGUF version {} is not supported (expected 2 or 3)", version_);
    uint64_t n_tensors = 0, n_kv = 0;
    if (!r.read(n_tensors) || !r.read(n_kv)) return make_error("truncated header at offset {}", r.pos());
    if (n_tensors > kMaxTensors) return make_error("tensor count {} at offset 8 is absurd", n_tensors);
    if (n_kv > kMaxKv) return make_error("metadata count {} at offset 16 is absurd", n_kv);

    kv_.reserve(n_kv);
    for (uint64_t k = 0; k < n_kv; ++k) {
        size_t at = r.pos();
        std::string_view key;
        if (!r.read_string(key)) return make_error("truncated metadata key #{} at offset {}", k, at);
        uint32_t raw_type = 0;
        if (!r.read(raw_type)) return make_error("truncated type of key '{}' at offset {}", key, r.pos());
        if (!valid_gguf_type(raw_type))
            return make_error("key '{}' has unknown value type {} at offset {}", key, raw_type, r.pos() - 4);
        GgufValue v;
        v.type = static_cast<GgufType>(raw_type);
        size_t vat = r.pos();
        if (v.type == GgufType::STRING) {
            if (!r.read_string(v.s)) return make_error("truncated string value of '{}' at offset {}", key, vat);
        } else if (v.type == GgufType::ARRAY) {
            uint32_t et = 0;
            if (!r.read(et) || !r.read(v.count))
                return make_error("truncated array header of '{}' at offset {}", key, vat);
            if (!valid_gguf_type(et) || et == static_cast<uint32_t>(GgufType::ARRAY))
                return make_error("array '{}' at offset {} has element type {} (arrays of arrays and unknown types are not supported)",
                                  key, vat, et);
            v.elem_type = static_cast<GgufType>(et);
            if (v.elem_type == GgufType::STRING) {
                // Each string needs at least its 8-byte length: bound the count first.
                if (v.count > r.left() / 8)
                    return make_error("array '{}' at offset {} claims {} strings, more than the file holds", key, vat, v.count);
                v.strs.resize(v.count);
                for (uint64_t j = 0; j < v.count; ++j)
                    if (!r.read_string(v.strs[j]))
                        return make_error("truncated string #{} of array '{}' at offset {}", j, key, r.pos());
            } else {
                size_t es = gguf_scalar_size(v.elem_type);
                if (v.count > r.left() / es)
                    return make_error("array '{}' at offset {} claims {} elements of {} bytes, more than the file holds",
                                      key, vat, v.count, es);
                v.elems = r.here();
                r.skip(v.count * es);
            }
        } else {
            size_t es = gguf_scalar_size(v.type);
            if (!r.need(es)) return make_error("truncated value of '{}' at offset {}", key, vat);
            const uint8_t* p = r.here();
            r.skip(es);
            if (v.is_int() || v.type == GgufType::BOOL) {
                v.i = load_int(v.type, p);
                v.u = static_cast<uint64_t>(v.i);
                if (v.type == GgufType::U64) std::memcpy(&v.u, p, 8);
                if (v.type == GgufType::BOOL && *p > 1)
                    return make_error("bool '{}' at offset {} has value {}", key, vat, *p);
            } else {
                v.f = load_float(v.type, p);
            }
        }
        if (kv_index_.count(key)) return make_error("duplicate metadata key '{}' at offset {}", key, at);
        kv_index_.emplace(key, kv_.size());
        kv_.emplace_back(key, std::move(v));
    }

    if (const GgufValue* a = find("general.alignment")) {
        if (!a->is_int() || a->i <= 0 || (a->i & (a->i - 1)) != 0 || a->i > (1 << 20))
            return make_error("general.alignment must be a power of two, found {}", a->i);
        alignment_ = static_cast<size_t>(a->i);
    }

    tensors_.reserve(n_tensors);
    for (uint64_t k = 0; k < n_tensors; ++k) {
        size_t at = r.pos();
        GgufTensor t;
        if (!r.read_string(t.name)) return make_error("truncated name of tensor #{} at offset {}", k, at);
        if (t.name.size() >= kMaxNameLen)
            return make_error("tensor #{} at offset {} has a name of {} bytes (at most {})", k, at, t.name.size(), kMaxNameLen - 1);
        uint32_t n_dims = 0;
        if (!r.read(n_dims)) return make_error("truncated tensor '{}' at offset {}", t.name, r.pos());
        if (n_dims == 0 || n_dims > 4)
            return make_error("tensor '{}' at offset {} has {} dimensions (1 to 4 supported)", t.name, at, n_dims);
        t.n_dims = static_cast<int>(n_dims);
        for (uint32_t d = 0; d < n_dims; ++d) {
            uint64_t ne = 0;
            if (!r.read(ne)) return make_error("truncated shape of tensor '{}' at offset {}", t.name, r.pos());
            if (ne == 0 || ne > (uint64_t{1} << 40))
                return make_error("tensor '{}' dimension {} is {} at offset {}", t.name, d, ne, r.pos() - 8);
            t.ne[d] = static_cast<int64_t>(ne);
        }
        if (static_cast<double>(t.ne[0]) * t.ne[1] * t.ne[2] * t.ne[3] > 1e13)
            return make_error("tensor '{}' has an absurd element count", t.name);
        uint32_t type = 0;
        if (!r.read(type) || !r.read(t.offset))
            return make_error("truncated tensor '{}' at offset {}", t.name, r.pos());
        t.type = static_cast<DType>(type);
        if (!dtype_supported(t.type) || t.type == DType::Q8_1 || t.type == DType::Q8_K)
            return make_error(
                "tensor '{}' has type {} ({}), which duet does not support "
                "(supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)",
                t.name, type, dtype_name(t.type));
        if (t.ne[0] % dtype_block_elems(t.type) != 0)
            return make_error("tensor '{}' row length {} is not a multiple of the {} block size {}",
                              t.name, t.ne[0], dtype_name(t.type), dtype_block_elems(t.type));
        if (t.offset % alignment_ != 0)
            return make_error("tensor '{}' data offset {} is not a multiple of the alignment {}",
                              t.name, t.offset, alignment_);
        t.nbytes = dtype_row_bytes(t.type, t.ne[0]) * static_cast<size_t>(t.ne[1] * t.ne[2] * t.ne[3]);
        if (tensor_index_.count(t.name)) return make_error("duplicate tensor name '{}' at offset {}", t.name, at);
        tensor_index_.emplace(t.name, tensors_.size());
        tensors_.push_back(t);
    }

    data_offset_ = (r.pos() + alignment_ - 1) / alignment_ * alignment_;
    if (data_offset_ > size_)
        return make_error("truncated: tensor data should start at offset {} but the file is {} bytes",
                          data_offset_, size_);
    size_t data_size = size_ - data_offset_;
    for (GgufTensor& t : tensors_) {
        if (t.offset > data_size || t.nbytes > data_size - t.offset)
            return make_error("truncated: tensor '{}' needs bytes {}..{} of the file, which has {}",
                              t.name, data_offset_ + t.offset, data_offset_ + t.offset + t.nbytes, size_);
        t.data = base_ + data_offset_ + t.offset;
    }
    return {};
}

const GgufValue* GgufFile::find(std::string_view key) const {
    auto it = kv_index_.find(key);
    return it == kv_index_.end() ? nullptr : &kv_[it->second].second;
}

const GgufTensor* GgufFile::tensor(std::string_view name) const {
    auto it = tensor_index_.find(name);
    return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

Result<int64_t> GgufFile::get_int(std::string_view key) const {
    const GgufValue* v = find(key);
    if (!v) return make_error("metadata key '{}' is missing", key);
    if (!v->is_int()) return make_error("metadata key '{}' should be an integer, found {}", key, gguf_type_name(v->type));
    return v->i;
}

Result<double> GgufFile::get_float(std::string_view key) const {
    const GgufValue* v = find(key);
    if (!v) return make_error("metadata key '{}' is missing", key);
    if (v->is_float()) return v->f;
    if (v->is_int()) return static_cast<double>(v->i);
    return make_error("metadata key '{}' should be a number, found {}", key, gguf_type_name(v->type));
}

Result<std::string_view> GgufFile::get_string(std::string_view key) const {
    const GgufValue* v = find(key);
    if (!v) return make_error("metadata key '{}' is missing", key);
    if (v->type != GgufType::STRING)
        return make_error("metadata key '{}' should be a string, found {}", key, gguf_type_name(v->type));
    return v->s;
}

Result<bool> GgufFile::get_bool(std::string_view key) const {
    const GgufValue* v = find(key);
    if (!v) return make_error("metadata key '{}' is missing", key);
    if (v->type != GgufType::BOOL) return make_error("metadata key '{}' should be a bool, found {}", key, gguf_type_name(v->type));
    return v->u != 0;
}

Result<int64_t> GgufFile::get_int_or(std::string_view key, int64_t def) const {
    return find(key) ? get_int(key) : Result<int64_t>(def);
}

Result<double> GgufFile::get_float_or(std::string_view key, double def) const {
    return find(key) ? get_float(key) : Result<double>(def);
}

Result<bool> GgufFile::get_bool_or(std::string_view key, bool def) const {
    return find(key) ? get_bool(key) : Result<bool>(def);
}

}  // namespace duet
