#include "roles/api_key.h"

#include <openssl/crypto.h>
#include <openssl/sha.h>

#include <cctype>

namespace duet {

namespace {

std::array<uint8_t, 32> digest_of(std::string_view s) {
    std::array<uint8_t, 32> d{};
    SHA256(reinterpret_cast<const unsigned char*>(s.data()), s.size(), d.data());
    return d;
}

}  // namespace

ApiKey::ApiKey(std::string_view key) : enabled_(!key.empty()), digest_(digest_of(key)) {}

bool ApiKey::allows(std::string_view authorization) const {
    if (!enabled_) return true;
    constexpr std::string_view scheme = "bearer ";
    if (authorization.size() < scheme.size()) return false;
    for (size_t i = 0; i < scheme.size(); ++i)
        if (std::tolower(static_cast<unsigned char>(authorization[i])) != scheme[i]) return false;
    const std::array<uint8_t, 32> got = digest_of(authorization.substr(scheme.size()));
    return CRYPTO_memcmp(got.data(), digest_.data(), got.size()) == 0;
}

}  // namespace duet
