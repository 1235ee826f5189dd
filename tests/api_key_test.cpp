// ApiKey: which Authorization values pass. (The constant-time property comes from
// comparing fixed-size SHA-256 digests with CRYPTO_memcmp; it is not timed here.)
#include <gtest/gtest.h>

#include "roles/api_key.h"

namespace duet {
namespace {

TEST(ApiKey, OnlyTheBearerKeyPasses) {
    ApiKey k("s3cret-key");
    ASSERT_TRUE(k.enabled());
    EXPECT_TRUE(k.allows("Bearer s3cret-key"));
    EXPECT_TRUE(k.allows("bearer s3cret-key")) << "the scheme is case-insensitive (RFC 7235)";
    EXPECT_TRUE(k.allows("BEARER s3cret-key"));
    EXPECT_FALSE(k.allows(""));
    EXPECT_FALSE(k.allows("Bearer"));
    EXPECT_FALSE(k.allows("Bearer "));
    EXPECT_FALSE(k.allows("s3cret-key")) << "no scheme";
    EXPECT_FALSE(k.allows("Basic s3cret-key"));
    EXPECT_FALSE(k.allows("Bearer s3cret-ke")) << "a prefix of the key";
    EXPECT_FALSE(k.allows("Bearer s3cret-key2")) << "the key and more";
    EXPECT_FALSE(k.allows("Bearer S3CRET-KEY")) << "the key itself is case-sensitive";
    EXPECT_FALSE(k.allows("Bearer  s3cret-key")) << "one space after the scheme";
    EXPECT_FALSE(k.allows(std::string("Bearer s3cret-key\0", 18)));
}

TEST(ApiKey, NoKeyAllowsEverything) {
    ApiKey none("");
    EXPECT_FALSE(none.enabled());
    EXPECT_TRUE(none.allows(""));
    EXPECT_TRUE(none.allows("Bearer anything"));
    ApiKey dflt;
    EXPECT_TRUE(dflt.allows(""));
}

}  // namespace
}  // namespace duet
