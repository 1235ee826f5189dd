#include "cli/kv_cli.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string>
#include <system_error>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "kv/blob.h"
#include "kv/kv_log.h"

namespace duet {

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

enum class KvFileKind { Blob, Log, Other };

// The first bytes of a file: what the magic says it is. kv_log.cpp keeps the
// log's magic to itself; its first seven bytes are these.
constexpr char kLogMagic7[7] = {'D', 'U', 'E', 'T', 'K', 'V', 'L'};

// Reads up to n bytes from the start of path.
Result<std::vector<uint8_t>> read_head(const std::string& path, size_t n) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return make_error("open {}: {}", path, std::strerror(errno));
    std::vector<uint8_t> b(n);
    const ssize_t r = ::pread(fd, b.data(), n, 0);
    const int e = errno;
    ::close(fd);
    if (r < 0) return make_error("read {}: {}", path, std::strerror(e));
    b.resize(static_cast<size_t>(r));
    return b;
}

KvFileKind kind_of(const std::vector<uint8_t>& head) {
    if (head.size() >= 8 && std::memcmp(head.data(), kBlobMagic, 8) == 0) return KvFileKind::Blob;
    if (head.size() >= 8 && std::memcmp(head.data(), kLogMagic7, 7) == 0 && head[7] == 0) return KvFileKind::Log;
    return KvFileKind::Other;
}

// kv_log_scan's errors start with the path; the lines here name it already.
std::string without_path(const std::string& msg, const std::string& path) {
    const std::string p = path + ": ";
    return msg.rfind(p, 0) == 0 ? msg.substr(p.size()) : msg;
}

std::string hex32(uint32_t v) { return fmt::format("{:#010x}", v); }
std::string hex64(uint64_t v) { return fmt::format("{:#018x}", v); }

json layout_json(const KvLayout& l) {
    return {{"n_layer", l.n_layer},
            {"n_head_kv", l.n_head_kv},
            {"head_dim", l.head_dim},
            {"dtype", kv_dtype_name(l.dtype)},
            {"block_tokens", l.block_tokens}};
}

void print_field(const char* key, const std::string& value) { fmt::print("  {:<22} {}\n", key, value); }

void print_layout(const KvLayout& l) {
    print_field("n_layer", std::to_string(l.n_layer));
    print_field("n_head_kv", std::to_string(l.n_head_kv));
    print_field("head_dim", std::to_string(l.head_dim));
    print_field("dtype", kv_dtype_name(l.dtype));
    print_field("block_tokens", std::to_string(l.block_tokens));
}

int inspect_blob(const std::string& path, const std::vector<uint8_t>& head, bool as_json) {
    auto h = blob_header_decode(head.data(), head.size());
    // The header on its own decodes; then the file's size and data CRC.
    std::optional<Error> data_error;
    if (h) {
        auto v = blob_verify_file(path);
        if (!v) data_error = v.error();
    }
    const bool valid = h.ok() && !data_error;
    const std::string error = !h ? h.error().message : (data_error ? data_error->message : "");
    if (as_json) {
        json j = {{"file", path}, {"kind", "blob"}, {"valid", valid}};
        if (h) {
            j["header"] = {{"version", h->version},
                           {"model", fp_hex(h->id.model)},
                           {"tokenizer", fp_hex(h->id.tokenizer)},
                           {"layout", layout_json(h->layout)},
                           {"first_pos", h->first_pos},
                           {"n_tokens", h->n_tokens},
                           {"data_bytes", h->data_bytes},
                           {"data_crc", hex32(h->data_crc)}};
            j["data_crc_ok"] = !data_error;
        }
        if (!valid) j["error"] = error;
        fmt::print("{}\n", j.dump(2));
        return valid ? 0 : 1;
    }
    fmt::print("{}: KV blob\n", path);
    if (h) {
        print_field("version", std::to_string(h->version));
        print_field("model", fp_hex(h->id.model));
        print_field("tokenizer", fp_hex(h->id.tokenizer));
        print_layout(h->layout);
        print_field("first_pos", std::to_string(h->first_pos));
        print_field("n_tokens", fmt::format("{} (positions [{}, {}))", h->n_tokens, h->first_pos,
                                            h->first_pos + h->n_tokens));
        print_field("data_bytes", std::to_string(h->data_bytes));
        print_field("data_crc", fmt::format("{} ({})", hex32(h->data_crc), data_error ? "does NOT verify" : "verifies"));
    }
    if (valid)
        fmt::print("valid\n");
    else
        fmt::print("INVALID: {}\n", error);
    return valid ? 0 : 1;
}

json log_header_json(const LogHeader& h) {
    return {{"version", h.version},
            {"context", h.context},
            {"salt", hex64(h.salt)},
            {"generation", h.generation},
            {"model", fp_hex(h.id.model)},
            {"tokenizer", fp_hex(h.id.tokenizer)},
            {"layout", layout_json(h.layout)},
            {"header_crc", hex32(h.crc)}};
}

void print_log_header(const LogHeader& h) {
    print_field("version", std::to_string(h.version));
    print_field("context", h.context);
    print_field("salt", hex64(h.salt));
    print_field("generation", std::to_string(h.generation));
    print_field("model", fp_hex(h.id.model));
    print_field("tokenizer", fp_hex(h.id.tokenizer));
    print_layout(h.layout);
}

std::string record_what(const LogRecordInfo& r) {
    switch (static_cast<LogRecordType>(r.type)) {
        case LogRecordType::Append: return fmt::format("positions [{}, {})", r.start, r.start + r.n);
        case LogRecordType::Truncate: return fmt::format("new length {}", r.n);
        case LogRecordType::Checkpoint: return fmt::format("{} positions from {}", r.n, r.blob);
    }
    return "";
}

int inspect_log(const std::string& path, const std::vector<uint8_t>& head, bool as_json) {
    auto scan = kv_log_scan(path);
    if (!scan) {
        // Corruption: the header still says what the log is, when it decodes.
        auto h = log_header_decode(head.data(), head.size());
        const std::string error = without_path(scan.error().message, path);
        if (as_json) {
            json j = {{"file", path}, {"kind", "log"}, {"valid", false}, {"error", error}};
            if (h) j["header"] = log_header_json(*h);
            fmt::print("{}\n", j.dump(2));
        } else {
            fmt::print("{}: KV log\n", path);
            if (h) print_log_header(*h);
            fmt::print("INVALID: {}\n", error);
        }
        return 1;
    }
    const LogScan& s = *scan;
    if (as_json) {
        json recs = json::array();
        for (const LogRecordInfo& r : s.records) {
            json x = {{"offset", r.offset},
                      {"type", log_record_type_name(r.type)},
                      {"seq", r.seq},
                      {"batch_seq", r.batch_seq},
                      {"payload_bytes", r.payload_bytes}};
            switch (static_cast<LogRecordType>(r.type)) {
                case LogRecordType::Append:
                    x["start"] = r.start;
                    x["n"] = r.n;
                    break;
                case LogRecordType::Truncate: x["new_length"] = r.n; break;
                case LogRecordType::Checkpoint:
                    x["n_tokens"] = r.n;
                    x["blob"] = r.blob;
                    break;
            }
            recs.push_back(std::move(x));
        }
        json j = {{"file", path},
                  {"kind", "log"},
                  {"valid", true},
                  {"header", log_header_json(s.header)},
                  {"records", std::move(recs)},
                  {"n_tokens", s.n_tokens()},
                  {"file_size", s.file_size},
                  {"valid_end", s.valid_end},
                  {"torn", s.torn}};
        if (s.torn) {
            j["torn_at"] = s.valid_end;
            j["torn_reason"] = s.torn_reason;
        }
        fmt::print("{}\n", j.dump(2));
        return 0;
    }
    fmt::print("{}: KV log\n", path);
    print_log_header(s.header);
    fmt::print("  {} valid record(s):\n", s.records.size());
    if (!s.records.empty())
        fmt::print("    {:>10}  {:<10}  {:>6}  {:>6}  {:>10}  {}\n", "offset", "type", "seq", "batch", "payload",
                   "contents");
    for (const LogRecordInfo& r : s.records)
        fmt::print("    {:>10}  {:<10}  {:>6}  {:>6}  {:>10}  {}\n", r.offset, log_record_type_name(r.type), r.seq,
                   r.batch_seq, r.payload_bytes, record_what(r));
    print_field("final length", fmt::format("{} positions", s.n_tokens()));
    print_field("file size", fmt::format("{} bytes, valid records end at {}", s.file_size, s.valid_end));
    if (s.torn) {
        print_field("torn tail", fmt::format("at offset {} ({} bytes): {}", s.valid_end, s.file_size - s.valid_end,
                                             s.torn_reason));
        fmt::print("valid, with a torn tail to cut at offset {} (opening the context cuts it)\n", s.valid_end);
    } else {
        print_field("torn tail", "none");
        fmt::print("valid\n");
    }
    return 0;
}

// One file's verdict for `verify`: 0 ok, 1 torn tail (still valid), 2 invalid.
int verify_one(const std::string& path, bool is_log, std::string& line) {
    if (is_log) {
        auto s = kv_log_scan(path);
        if (!s) {
            line = "INVALID: " + without_path(s.error().message, path);
            return 2;
        }
        if (s->torn) {
            line = fmt::format("torn tail at {} ({}; {} positions recovered)", s->valid_end, s->torn_reason,
                               s->n_tokens());
            return 1;
        }
        line = fmt::format("ok ({} records, {} positions)", s->records.size(), s->n_tokens());
        return 0;
    }
    auto h = blob_verify_file(path);
    if (!h) {
        line = "INVALID: " + without_path(h.error().message, path);
        return 2;
    }
    line = fmt::format("ok ({} positions from {})", h->n_tokens, h->first_pos);
    return 0;
}

}  // namespace

int cmd_kv_inspect(const std::string& path, bool as_json) {
    auto head = read_head(path, std::max(kBlobHeaderBytes, kLogHeaderBytesMax));
    if (!head) {
        std::fprintf(stderr, "duet: %s\n", head.error().message.c_str());
        return 1;
    }
    switch (kind_of(*head)) {
        case KvFileKind::Blob: return inspect_blob(path, *head, as_json);
        case KvFileKind::Log: return inspect_log(path, *head, as_json);
        case KvFileKind::Other: break;
    }
    const std::string error = "not a duet KV file (the magic is neither 'DUETKVB', a blob, nor 'DUETKVL', a log)";
    if (as_json)
        fmt::print("{}\n", json{{"file", path}, {"kind", "unknown"}, {"valid", false}, {"error", error}}.dump(2));
    else
        fmt::print("{}: INVALID: {}\n", path, error);
    return 1;
}

int cmd_kv_verify(const std::string& dir) {
    std::error_code ec;
    const fs::file_status st = fs::status(dir, ec);
    if (ec || !fs::exists(st)) {
        std::fprintf(stderr, "duet: %s: %s\n", dir.c_str(), ec ? ec.message().c_str() : "no such file or directory");
        return 1;
    }
    std::vector<std::string> files;
    if (fs::is_directory(st)) {
        for (auto it = fs::recursive_directory_iterator(dir, fs::directory_options::skip_permission_denied, ec);
             !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
            const fs::path& p = it->path();
            if ((p.extension() == ".kvlog" || p.extension() == ".kvblob") && it->is_regular_file(ec))
                files.push_back(p.string());
        }
        if (ec) {
            std::fprintf(stderr, "duet: listing %s: %s\n", dir.c_str(), ec.message().c_str());
            return 1;
        }
    } else {
        files.push_back(dir);
    }
    std::sort(files.begin(), files.end());
    if (files.empty()) {
        fmt::print("{}: no *.kvlog or *.kvblob files\n", dir);
        return 0;
    }
    std::vector<std::string> invalid;
    size_t torn = 0;
    for (const std::string& f : files) {
        std::string line;
        const int v = verify_one(f, fs::path(f).extension() == ".kvlog", line);
        fmt::print("{}: {}\n", f, line);
        if (v == 1) ++torn;
        if (v == 2) invalid.push_back(f);
    }
    fmt::print("{} file(s): {} ok, {} with a torn tail, {} invalid\n", files.size(),
               files.size() - torn - invalid.size(), torn, invalid.size());
    if (invalid.empty()) return 0;
    std::string names;
    for (const std::string& f : invalid) names += (names.empty() ? "" : ", ") + f;
    std::fprintf(stderr, "duet: invalid: %s\n", names.c_str());
    return 1;
}

}  // namespace duet
