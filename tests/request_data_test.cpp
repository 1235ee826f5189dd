// A request's data (roles/request_data.h) as bytes: what is written is what is read,
// and a reader refuses every damaged, foreign or unknown form (no model, no
// processes); through a request table, exactly the request's own data of the
// length its parameters name.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>

#include "kv/crc32c.h"
#include "roles/request_data.h"

namespace duet {
namespace {

RequestData sample() {
    RequestData d;
    for (int32_t t = 0; t < 300; ++t) d.bias.push_back({t * 97 % 49152, static_cast<float>(t % 201) - 100.0f});
    d.bias.push_back({7, 0.25f});
    d.grammar = GrammarSpec{GrammarKind::JsonSchema, R"({"type": "object", "properties": {"a": {"type": "integer"}}})"};
    d.stops = {"\n\n", "END", std::string(3000, 'x'), "\xe2\x82\xac"};
    return d;
}

TEST(RequestData, WhatIsWrittenIsRead) {
    for (const RequestData& d : {RequestData{}, sample()}) {
        const std::vector<uint8_t> b = encode_request_data(d);
        auto got = decode_request_data(b);
        ASSERT_TRUE(got.ok()) << got.error().message;
        EXPECT_EQ(*got, d);
    }
    // The layout, by hand: 16 header bytes, then (kind 1, 8 bytes, token, bias).
    RequestData one;
    one.bias.push_back({0x01020304, -100.0f});
    const std::vector<uint8_t> b = encode_request_data(one);
    ASSERT_EQ(b.size(), 16u + 8u + 8u);
    EXPECT_EQ(std::memcmp(b.data(), "dxrq", 4), 0);
    EXPECT_EQ(b[4], kRequestDataVersion);
    EXPECT_EQ(b[8], 16);  // the body's length
    EXPECT_EQ(b[16], 1);  // the logit-bias kind
    EXPECT_EQ(b[20], 8);
    EXPECT_EQ(b[24], 0x04);  // little-endian token
    EXPECT_EQ(b[27], 0x01);
    float f;
    std::memcpy(&f, b.data() + 28, 4);
    EXPECT_EQ(f, -100.0f);
}

TEST(RequestData, AGrammarTravelsWithItsKind) {
    for (const GrammarSpec& g :
         {GrammarSpec{GrammarKind::JsonObject, ""}, GrammarSpec{GrammarKind::Ebnf, "root ::= \"a\""},
          GrammarSpec{GrammarKind::JsonSchema, std::string(40000, ' ') + "{}"}}) {
        RequestData d;
        d.grammar = g;
        auto got = decode_request_data(encode_request_data(d));
        ASSERT_TRUE(got.ok()) << got.error().message;
        EXPECT_EQ(*got, d);
    }
    // A kind this reader does not know is refused, not read as another.
    RequestData d;
    d.grammar = GrammarSpec{GrammarKind::Ebnf, "root ::= \"a\""};
    std::vector<uint8_t> b = encode_request_data(d);
    ASSERT_EQ(b[16], 2);  // the grammar section
    b[24] = 9;            // its kind byte
    const uint32_t crc = crc32c(b.data() + 16, b.size() - 16);
    std::memcpy(b.data() + 12, &crc, 4);
    auto r = decode_request_data(b);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.error().message.find("grammar section"), std::string::npos) << r.error().message;
}

TEST(RequestData, DamagedForeignOrUnknownIsRefused) {
    const std::vector<uint8_t> good = encode_request_data(sample());
    auto refused = [](std::vector<uint8_t> b, const char* what) {
        auto r = decode_request_data(b);
        EXPECT_FALSE(r.ok()) << what;
        if (!r.ok()) {
            EXPECT_EQ(r.error().kind, ErrorKind::Invalid) << what;
        }
    };
    // Every single flipped bit of the body is caught by the checksum; of the header
    // by the magic, version, length or checksum.
    for (size_t i = 0; i < good.size(); i += 7) {
        auto b = good;
        b[i] ^= 0x10;
        refused(b, "a flipped bit");
    }
    refused({}, "empty");
    refused({good.begin(), good.begin() + 10}, "shorter than the header");
    refused({good.begin(), good.end() - 8}, "a body cut short");
    auto longer = good;
    longer.push_back(0);
    refused(longer, "a byte past the body");
    // Bodies forged with a right checksum, so that only their content is wrong: a
    // kind this reader does not know (a newer front's), a bias table of part of an
    // entry, a section past the end, a section header cut short; another version.
    auto forged = [](const std::vector<uint8_t>& body, uint32_t version = kRequestDataVersion) {
        std::vector<uint8_t> b = {'d', 'x', 'r', 'q'};
        auto put = [&](uint32_t v) {
            for (int i = 0; i < 4; ++i) b.push_back(static_cast<uint8_t>(v >> (8 * i)));
        };
        put(version);
        put(static_cast<uint32_t>(body.size()));
        put(crc32c(body.data(), body.size()));
        b.insert(b.end(), body.begin(), body.end());
        return b;
    };
    EXPECT_TRUE(decode_request_data(forged({})).ok()) << "the forge itself is right";
    refused(forged({9, 0, 0, 0, 0, 0, 0, 0}), "an unknown kind");
    refused(forged({1, 0, 0, 0, 4, 0, 0, 0, 1, 2, 3, 4}), "a bias table of half an entry");
    refused(forged({1, 0, 0, 0, 16, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8}), "a section past the end");
    refused(forged({1, 0, 0}), "a section header cut short");
    refused(forged({}, kRequestDataVersion + 1), "another version");
    // Stop strings: by hand (kind 3, 9 bytes: length 5, "hello"), then cut short,
    // empty, and one longer than its section.
    auto ok = decode_request_data(forged({3, 0, 0, 0, 9, 0, 0, 0, 5, 0, 0, 0, 'h', 'e', 'l', 'l', 'o'}));
    ASSERT_TRUE(ok.ok()) << ok.error().message;
    EXPECT_EQ(ok->stops, std::vector<std::string>{"hello"});
    refused(forged({3, 0, 0, 0, 3, 0, 0, 0, 5, 0, 0}), "a stop string's length cut short");
    refused(forged({3, 0, 0, 0, 4, 0, 0, 0, 0, 0, 0, 0}), "an empty stop string");
    refused(forged({3, 0, 0, 0, 8, 0, 0, 0, 5, 0, 0, 0, 'a', 'b', 'c', 'd'}), "a stop string past its section");
    refused(forged({3, 0, 0, 0, 0, 0, 0, 0}), "an empty stop-string section");
}

// Through a request table: the data the parameters name, of exactly that length.
TEST(RequestData, ReadFromTheRequestSlot) {
    shm::RequestTableConfig c;
    c.n_slots = 2;
    c.max_tokens = 16;
    std::vector<uint8_t> mem(shm::RequestTable::bytes(c) + 64);
    void* p = mem.data() + (64 - reinterpret_cast<uintptr_t>(mem.data()) % 64) % 64;
    ASSERT_TRUE(shm::RequestTable::init(p, c).ok());
    shm::RequestTable t = *shm::RequestTable::attach(p);
    int32_t prompt[1] = {3};
    auto r = t.submit({0, 1}, prompt, 1, nullptr, 0);
    ASSERT_TRUE(r.ok());
    RequestParams params;
    auto none = read_request_data(t, *r, params);
    ASSERT_TRUE(none.ok());
    EXPECT_TRUE(none->empty()) << "no data named: none read";
    const std::vector<uint8_t> b = encode_request_data(sample());
    params.data_bytes = static_cast<uint32_t>(b.size());
    EXPECT_FALSE(read_request_data(t, *r, params).ok()) << "named but not written";
    ASSERT_TRUE(t.set_ext_data(*r, b.data(), static_cast<uint32_t>(b.size())).ok());
    auto got = read_request_data(t, *r, params);
    ASSERT_TRUE(got.ok()) << got.error().message;
    EXPECT_EQ(*got, sample());
    params.data_bytes -= 8;
    EXPECT_FALSE(read_request_data(t, *r, params).ok()) << "another length than its parameters say";
}

}  // namespace
}  // namespace duet
