// The server's API key (OpenAI-style "Authorization: Bearer <key>"), compared in
// constant time: the presented token and the key are both hashed (SHA-256) and the
// digests compared with CRYPTO_memcmp, so neither the key's length nor the position
// of the first differing byte shows in the time a refusal takes.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

namespace duet {

class ApiKey {
public:
    ApiKey() = default;
    // An empty key: no key (every request allowed).
    explicit ApiKey(std::string_view key);
    bool enabled() const { return enabled_; }
    // Whether a request with this Authorization header value may pass: "Bearer"
    // (any case), one space, the key. Always true without a key.
    bool allows(std::string_view authorization) const;

private:
    bool enabled_ = false;
    std::array<uint8_t, 32> digest_{};
};

}  // namespace duet
