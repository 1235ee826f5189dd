// Context names in KV logs (src/kv/kv_log.h): up to 64 characters of [A-Za-z0-9_.-]
// in a version 3 header (192 bytes), the 31-character names of version 1 and 2
// headers (128 bytes) still read, and which context a directory's file belongs to
// when names hold dots (a wrong answer would delete another context's checkpoint).
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "kv/kv_log.h"

using namespace duet;

namespace {

uint32_t u32_at(const uint8_t* p, size_t off) {
    uint32_t v;
    std::memcpy(&v, p + off, 4);
    return v;
}

LogHeader header(uint32_t version, const std::string& name) {
    LogHeader h;
    h.version = version;
    h.layout.n_layer = 2;
    h.layout.n_head_kv = 1;
    h.layout.head_dim = 64;
    h.layout.block_tokens = 16;
    h.salt = 0x1234;
    h.generation = 7;
    h.context = name;
    return h;
}

}  // namespace

TEST(KvLogNames, SixtyFourCharactersWithDots) {
    EXPECT_TRUE(check_context_name("a").ok());
    EXPECT_TRUE(check_context_name("chat.2026-12-02_v1").ok());
    EXPECT_TRUE(check_context_name(std::string(64, 'x')).ok());
    EXPECT_FALSE(check_context_name("").ok());
    EXPECT_FALSE(check_context_name(std::string(65, 'x')).ok());
    for (const char* bad : {"a/b", "../x", "a b", "a\\b", "é", "a:b"}) EXPECT_FALSE(check_context_name(bad).ok()) << bad;
}

TEST(KvLogNames, VersionThreeHeaderRoundTripsALongDottedName) {
    const std::string name = "team.alpha-" + std::string(53, 'n');  // 64 characters
    ASSERT_EQ(name.size(), 64u);
    uint8_t b[kLogHeaderBytesMax];
    log_header_encode(header(3, name), b);
    EXPECT_EQ(u32_at(b, 8), 3u);
    EXPECT_EQ(u32_at(b, 12), 192u) << "header_bytes";
    auto h = log_header_decode(b, 192);
    ASSERT_TRUE(h.ok()) << h.error().message;
    EXPECT_EQ(h->context, name);
    EXPECT_EQ(h->generation, 7u);
    EXPECT_EQ(h->bytes(), 192u);
    EXPECT_FALSE(log_header_decode(b, 128).ok()) << "a version 3 header cut to 128 bytes";
    b[170] = 1;  // a reserved byte
    EXPECT_FALSE(log_header_decode(b, 192).ok());
}

TEST(KvLogNames, VersionTwoHeadersStillReadAndHoldOnlyTheirNames) {
    uint8_t b[kLogHeaderBytesMax];
    log_header_encode(header(2, "old_name-31"), b);
    EXPECT_EQ(u32_at(b, 12), 128u);
    auto h = log_header_decode(b, 128);
    ASSERT_TRUE(h.ok()) << h.error().message;
    EXPECT_EQ(h->context, "old_name-31");
    EXPECT_EQ(h->bytes(), 128u);
    // A dotted name in a version 2 header is no file this or an older build wrote.
    log_header_encode(header(2, "a.b"), b);
    auto dotted = log_header_decode(b, 128);
    ASSERT_FALSE(dotted.ok());
    EXPECT_NE(dotted.error().message.find("version 2"), std::string::npos) << dotted.error().message;
}

TEST(KvLogNames, EachFileBelongsToOneContext) {
    EXPECT_EQ(context_of_file("a.kvlog"), "a");
    EXPECT_EQ(context_of_file("a.b.kvlog"), "a.b");
    EXPECT_EQ(context_of_file("a.b.kvlog.tmp"), "a.b");
    EXPECT_EQ(context_of_file("a.pin"), "a");
    EXPECT_EQ(context_of_file("a.5.kvblob"), "a") << "context a, generation 5";
    EXPECT_EQ(context_of_file("a.5.7.kvblob"), "a.5") << "context a.5, generation 7";
    EXPECT_EQ(context_of_file("a.b.3.kvblob"), "a.b");
    EXPECT_EQ(context_of_file("a.b.3.kvblob.tmp.4242"), "a.b");
    EXPECT_EQ(context_of_file("a.3.kvblob.tmp.4242"), "a");
    EXPECT_EQ(context_of_file("a.b.kvblob"), "") << "no generation: not a checkpoint";
    EXPECT_EQ(context_of_file("notes.txt"), "");
    EXPECT_EQ(context_of_file(".kvlog"), "");
    EXPECT_EQ(context_of_file(std::string(65, 'x') + ".kvlog"), "");
}
