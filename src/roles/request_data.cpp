#include "roles/request_data.h"

#include <cstring>

#include "kv/crc32c.h"

namespace duet {

namespace {

constexpr uint32_t kMagic = 0x71727864;  // "dxrq"
constexpr uint32_t kHeaderBytes = 16;    // magic, version, body length, body CRC32C

enum class Kind : uint32_t { LogitBias = 1, Grammar = 2, Stops = 3 };

void put32(std::vector<uint8_t>& out, uint32_t v) {
    for (int i = 0; i < 4; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
}
uint32_t get32(const uint8_t* p) {
    return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 | static_cast<uint32_t>(p[2]) << 16 |
           static_cast<uint32_t>(p[3]) << 24;
}

}  // namespace

std::vector<uint8_t> encode_request_data(const RequestData& d) {
    std::vector<uint8_t> body;
    if (!d.bias.empty()) {
        put32(body, static_cast<uint32_t>(Kind::LogitBias));
        put32(body, static_cast<uint32_t>(d.bias.size() * 8));
        for (const RequestParams::Bias& b : d.bias) {
            uint32_t f;
            std::memcpy(&f, &b.bias, 4);
            put32(body, static_cast<uint32_t>(b.token));
            put32(body, f);
        }
    }
    if (d.grammar) {  // its kind (one byte), then its source
        put32(body, static_cast<uint32_t>(Kind::Grammar));
        put32(body, static_cast<uint32_t>(1 + d.grammar->source.size()));
        body.push_back(static_cast<uint8_t>(d.grammar->kind));
        body.insert(body.end(), d.grammar->source.begin(), d.grammar->source.end());
    }
    if (!d.stops.empty()) {  // each its length, then its bytes
        size_t n = 0;
        for (const std::string& x : d.stops) n += 4 + x.size();
        put32(body, static_cast<uint32_t>(Kind::Stops));
        put32(body, static_cast<uint32_t>(n));
        for (const std::string& x : d.stops) {
            put32(body, static_cast<uint32_t>(x.size()));
            body.insert(body.end(), x.begin(), x.end());
        }
    }
    std::vector<uint8_t> out;
    put32(out, kMagic);
    put32(out, kRequestDataVersion);
    put32(out, static_cast<uint32_t>(body.size()));
    put32(out, crc32c(body.data(), body.size()));
    out.insert(out.end(), body.begin(), body.end());
    return out;
}

Result<RequestData> decode_request_data(std::span<const uint8_t> bytes) {
    if (bytes.size() < kHeaderBytes)
        return make_error(ErrorKind::Invalid, "request data of {} bytes: shorter than its header", bytes.size());
    const uint8_t* p = bytes.data();
    if (get32(p) != kMagic) return make_error(ErrorKind::Invalid, "request data without its magic");
    if (get32(p + 4) != kRequestDataVersion)
        return make_error(ErrorKind::Invalid, "request data of version {}; this worker reads version {}", get32(p + 4),
                          kRequestDataVersion);
    const uint32_t len = get32(p + 8);
    if (len != bytes.size() - kHeaderBytes)
        return make_error(ErrorKind::Invalid, "request data says {} bytes of body, holds {}", len,
                          bytes.size() - kHeaderBytes);
    const uint8_t* body = p + kHeaderBytes;
    if (crc32c(body, len) != get32(p + 12)) return make_error(ErrorKind::Invalid, "request data damaged (checksum)");
    RequestData d;
    for (uint32_t at = 0; at < len;) {
        if (len - at < 8) return make_error(ErrorKind::Invalid, "request data: a section header past the end");
        const uint32_t kind = get32(body + at), n = get32(body + at + 4);
        at += 8;
        if (n > len - at) return make_error(ErrorKind::Invalid, "request data: a section of {} bytes past the end", n);
        switch (static_cast<Kind>(kind)) {
        case Kind::LogitBias:
            if (n % 8 != 0)
                return make_error(ErrorKind::Invalid, "request data: a logit-bias table of {} bytes", n);
            for (uint32_t k = 0; k < n; k += 8) {
                RequestParams::Bias b;
                b.token = static_cast<int32_t>(get32(body + at + k));
                const uint32_t f = get32(body + at + k + 4);
                std::memcpy(&b.bias, &f, 4);
                d.bias.push_back(b);
            }
            break;
        case Kind::Grammar: {
            const uint8_t g = n > 0 ? body[at] : 0;
            if (n == 0 || d.grammar ||
                (g != static_cast<uint8_t>(GrammarKind::JsonSchema) &&
                 g != static_cast<uint8_t>(GrammarKind::JsonObject) && g != static_cast<uint8_t>(GrammarKind::Ebnf) &&
                 g != static_cast<uint8_t>(GrammarKind::StructuralTag)))
                return make_error(ErrorKind::Invalid, "request data: a grammar section of {} bytes, kind {}", n, g);
            d.grammar = GrammarSpec{static_cast<GrammarKind>(g),
                                    std::string(reinterpret_cast<const char*>(body + at + 1), n - 1)};
            break;
        }
        case Kind::Stops:
            if (n == 0 || !d.stops.empty())
                return make_error(ErrorKind::Invalid, "request data: a stop-string section of {} bytes", n);
            for (uint32_t k = 0; k < n;) {
                const uint32_t m = n - k >= 4 ? get32(body + at + k) : 0;
                if (m == 0 || m > n - k - 4)
                    return make_error(ErrorKind::Invalid, "request data: a stop string of {} bytes at {} of {}", m, k,
                                      n);
                d.stops.emplace_back(reinterpret_cast<const char*>(body + at + k + 4), m);
                k += 4 + m;
            }
            break;
        default: return make_error(ErrorKind::Invalid, "request data: a section of unknown kind {}", kind);
        }
        at += n;
    }
    return d;
}

Result<RequestData> read_request_data(const shm::RequestTable& t, shm::ReqRef r, const RequestParams& p) {
    if (p.data_bytes == 0) return RequestData{};
    auto bytes = t.ext_data(r);
    if (!bytes) return make_error(ErrorKind::Invalid, "request {}.{}: its data is not in its slot", r.slot, r.gen);
    if (bytes->size() != p.data_bytes)
        return make_error(ErrorKind::Invalid, "request {}.{}: {} bytes of data, its parameters say {}", r.slot, r.gen,
                          bytes->size(), p.data_bytes);
    return decode_request_data(*bytes);
}

}  // namespace duet
