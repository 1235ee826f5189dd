// Tests for kernels/cpu: every kernel at every Isa this CPU supports, against
// the scalar level and against float64 references built here from the
// documented formulas (never from the code under test).
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/kernels.h"
#include "require.h"

namespace duet::cpu {
namespace {

std::vector<Isa> supported_isas() {
    std::vector<Isa> v;
    for (Isa i : {Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Amx}) {
        if (isa_supported(i)) v.push_back(i);
    }
    return v;
}

uint32_t bits(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
}
float from_bits(uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// Value of a binary16 from its fields, in double: the definition, not code.
double half_value(uint16_t h) {
    const int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
    const double sign = s ? -1.0 : 1.0;
    if (e == 31) return m ? std::numeric_limits<double>::quiet_NaN() : sign * INFINITY;
    if (e == 0) return sign * std::ldexp(m, -24);
    return sign * std::ldexp(1024 + m, e - 25);
}

std::vector<float> random_floats(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> d(lo, hi);
    std::vector<float> v(n);
    for (float& x : v) x = d(rng);
    return v;
}

std::string isa_str(Isa i) { return isa_name(i); }

// ---------------------------------------------------------------------------
// Dispatch

TEST(Isa, BestIsSupportedAndScalarAlwaysIs) {
    EXPECT_TRUE(isa_supported(Isa::Scalar));
    EXPECT_TRUE(isa_supported(isa_best()));
    EXPECT_STREQ(isa_name(Isa::Avx2), "avx2");
    if (isa_supported(Isa::Avx512)) {
        EXPECT_TRUE(isa_supported(Isa::Avx2));
    }
}

// Every kernel test below runs at each level this CPU has (supported_isas): a level it
// lacks is left out of all of them, so it is reported here, as a skip with the
// reason (or a failure where DUET_REQUIRE names it), never silently.
TEST(Isa, Avx2KernelsRunHere) {
    if (!isa_supported(Isa::Avx2))
        DUET_SKIP_UNLESS_REQUIRED("avx2", "this CPU or build lacks AVX2+FMA+F16C: the AVX2 kernels did not run");
    EXPECT_GE(static_cast<int>(isa_best()), static_cast<int>(Isa::Avx2));
}

TEST(Isa, Avx512KernelsRunHere) {
    if (!isa_supported(Isa::Avx512))
        DUET_SKIP_UNLESS_REQUIRED("avx512", "this CPU or build lacks AVX-512 F/BW/VL/DQ/VNNI: the AVX-512 kernels "
                                            "did not run");
    EXPECT_GE(static_cast<int>(isa_best()), static_cast<int>(Isa::Avx512));
}

TEST(Isa, AmxKernelsRunHere) {
    if (!isa_supported(Isa::Amx))
        DUET_SKIP_UNLESS_REQUIRED("amx",
                                  "this CPU, its OS or this build lacks AMX-TILE/AMX-INT8 (or refused the tile "
                                  "state): the AMX products did not run");
    EXPECT_TRUE(isa_supported(Isa::Avx512));
    EXPECT_EQ(isa_best(), Isa::Amx);
    EXPECT_STREQ(isa_name(Isa::Amx), "amx");
}

TEST(Isa, EnvironmentCapsBest) {
    // The detected level is cached in the first call, so check in a fresh
    // process: "threadsafe" death tests re-execute this binary.
    GTEST_FLAG_SET(death_test_style, "threadsafe");
    setenv("DUET_ISA", "scalar", 1);
    EXPECT_EXIT(std::exit(isa_best() == Isa::Scalar ? 0 : 1), testing::ExitedWithCode(0), "");
    setenv("DUET_ISA", "avx2", 1);
    const int want = isa_supported(Isa::Avx2) ? 1 : 0;
    EXPECT_EXIT(std::exit(static_cast<int>(isa_best()) == want ? 0 : 1), testing::ExitedWithCode(0), "");
    unsetenv("DUET_ISA");
}

TEST(Isa, VecDotTypes) {
    EXPECT_EQ(vec_dot_type(DType::Q4_0), DType::Q8_0);
    EXPECT_EQ(vec_dot_type(DType::Q8_0), DType::Q8_0);
    EXPECT_EQ(vec_dot_type(DType::Q4_1), DType::Q8_1);
    EXPECT_EQ(vec_dot_type(DType::Q4_K), DType::Q8_K);
    EXPECT_EQ(vec_dot_type(DType::Q5_K), DType::Q8_K);
    EXPECT_EQ(vec_dot_type(DType::Q5_0), DType::Q8_0);
    EXPECT_EQ(vec_dot_type(DType::Q5_1), DType::Q8_1);
    EXPECT_EQ(vec_dot_type(DType::Q6_K), DType::Q8_K);
    EXPECT_EQ(vec_dot_type(DType::F16), DType::F32);
    EXPECT_EQ(vec_dot_type(DType::BF16), DType::F32);
    EXPECT_EQ(vec_dot_type(DType::F32), DType::F32);
}

// ---------------------------------------------------------------------------
// fp16 / bf16 conversions

TEST(Fp16, EveryHalfToFloatMatchesItsDefinition) {
    for (uint32_t h = 0; h < 65536; ++h) {
        const float f = fp16_to_fp32(static_cast<uint16_t>(h));
        const double want = half_value(static_cast<uint16_t>(h));
        if (std::isnan(want)) {
            ASSERT_TRUE(std::isnan(f)) << h;
        } else {
            ASSERT_EQ(static_cast<double>(f), want) << h;
            ASSERT_EQ(std::signbit(f), (h >> 15) != 0) << h;
            ASSERT_EQ(fp32_to_fp16(f), h) << "round trip of " << h;
        }
    }
}

TEST(Fp16, EdgeCases) {
    EXPECT_EQ(fp32_to_fp16(0.0f), 0x0000);
    EXPECT_EQ(fp32_to_fp16(-0.0f), 0x8000);
    EXPECT_EQ(fp32_to_fp16(1.0f), 0x3C00);
    EXPECT_EQ(fp32_to_fp16(-2.0f), 0xC000);
    EXPECT_EQ(fp32_to_fp16(65504.0f), 0x7BFF);       // largest finite
    EXPECT_EQ(fp32_to_fp16(65519.99f), 0x7BFF);      // below the midpoint to 65536
    EXPECT_EQ(fp32_to_fp16(65520.0f), 0x7C00);       // midpoint: ties to even = inf
    EXPECT_EQ(fp32_to_fp16(1e10f), 0x7C00);
    EXPECT_EQ(fp32_to_fp16(INFINITY), 0x7C00);
    EXPECT_EQ(fp32_to_fp16(-INFINITY), 0xFC00);
    const uint16_t nan = fp32_to_fp16(std::numeric_limits<float>::quiet_NaN());
    EXPECT_EQ(nan & 0x7C00, 0x7C00);
    EXPECT_NE(nan & 0x03FF, 0);
    EXPECT_NE(fp32_to_fp16(from_bits(0x7F800001u)) & 0x03FF, 0);  // signalling NaN stays NaN
    EXPECT_TRUE(std::isnan(fp16_to_fp32(0x7C01)));
    // Subnormals: 2^-24 is the smallest; 2^-25 is a tie between 0 and it.
    EXPECT_EQ(fp32_to_fp16(std::ldexp(1.0f, -24)), 0x0001);
    EXPECT_EQ(fp32_to_fp16(std::ldexp(1.0f, -25)), 0x0000);
    EXPECT_EQ(fp32_to_fp16(std::ldexp(1.0f, -25) * 1.0001f), 0x0001);
    EXPECT_EQ(fp32_to_fp16(std::ldexp(3.0f, -25)), 0x0002);  // 1.5 ulp: tie to even (2)
    EXPECT_EQ(fp32_to_fp16(std::ldexp(5.0f, -25)), 0x0002);  // 2.5 ulp: tie to even (2)
    EXPECT_EQ(fp32_to_fp16(std::ldexp(1023.0f, -24)), 0x03FF);
    EXPECT_EQ(fp32_to_fp16(std::ldexp(1.0f, -14)), 0x0400);  // smallest normal
    EXPECT_EQ(fp32_to_fp16(std::ldexp(2047.0f, -25)), 0x0400);  // rounds up into the normals
    // Normal ties: 1 + 2^-11 is halfway between 1 and 1 + 2^-10.
    EXPECT_EQ(fp32_to_fp16(1.0f + std::ldexp(1.0f, -11)), 0x3C00);
    EXPECT_EQ(fp32_to_fp16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3C02);
    EXPECT_EQ(fp32_to_fp16(2049.0f), 0x6800);  // 2048
    EXPECT_EQ(fp32_to_fp16(2051.0f), 0x6802);  // 2052
    EXPECT_EQ(fp32_to_fp16(std::ldexp(1.0f, -30)), 0x0000);
    EXPECT_EQ(fp32_to_fp16(-std::ldexp(1.0f, -30)), 0x8000);
}

// For random floats, the result is the nearest half, ties to the even one:
// checked against the neighbours' exact values, not against another converter.
TEST(Fp16, RandomFloatsRoundToNearestEven) {
    std::mt19937 rng(7);
    for (int i = 0; i < 200000; ++i) {
        // Exponents spanning subnormal halves to overflow.
        const float x = std::ldexp(std::uniform_real_distribution<float>(1.0f, 2.0f)(rng),
                                   std::uniform_int_distribution<int>(-27, 16)(rng));
        const uint16_t h = fp32_to_fp16(x);
        const double v = half_value(h);
        if (std::isinf(v)) {
            ASSERT_GE(x, 65520.0f);
            continue;
        }
        const double err = std::fabs(v - x);
        const double below = h > 0 ? std::fabs(half_value(static_cast<uint16_t>(h - 1)) - x) : INFINITY;
        const double above = h < 0x7BFF ? std::fabs(half_value(static_cast<uint16_t>(h + 1)) - x) : INFINITY;
        ASSERT_LE(err, below) << x;
        ASSERT_LE(err, above) << x;
        if (err == below || err == above) {
            ASSERT_EQ(h & 1, 0) << "tie must go to even: " << x;
        }
    }
}

TEST(Bf16, EdgeCases) {
    EXPECT_EQ(fp32_to_bf16(1.0f), 0x3F80);
    EXPECT_EQ(fp32_to_bf16(from_bits(0x3F808000u)), 0x3F80);  // tie, even stays
    EXPECT_EQ(fp32_to_bf16(from_bits(0x3F818000u)), 0x3F82);  // tie, odd rounds up
    EXPECT_EQ(fp32_to_bf16(from_bits(0x3F808001u)), 0x3F81);
    EXPECT_EQ(fp32_to_bf16(from_bits(0x3F807FFFu)), 0x3F80);
    EXPECT_EQ(fp32_to_bf16(INFINITY), 0x7F80);
    EXPECT_EQ(fp32_to_bf16(-INFINITY), 0xFF80);
    EXPECT_EQ(fp32_to_bf16(from_bits(0x7F7FFFFFu)), 0x7F80);  // FLT_MAX rounds to inf
    EXPECT_EQ(fp32_to_bf16(from_bits(0x00000001u)), 0x0000);  // denormals round like others
    EXPECT_EQ(fp32_to_bf16(from_bits(0x00008000u)), 0x0000);
    EXPECT_EQ(fp32_to_bf16(from_bits(0x00018000u)), 0x0002);
    EXPECT_EQ(fp32_to_bf16(from_bits(0x80010000u)), 0x8001);
    const uint16_t nan = fp32_to_bf16(from_bits(0x7F800001u));  // NaN whose payload is all low bits
    EXPECT_EQ(nan & 0x7F80, 0x7F80);
    EXPECT_NE(nan & 0x007F, 0);
    for (uint32_t h = 0; h < 65536; h += 7) {
        const float f = bf16_to_fp32(static_cast<uint16_t>(h));
        EXPECT_EQ(bits(f), h << 16);
        if (!std::isnan(f)) {
            EXPECT_EQ(fp32_to_bf16(f), h);
        }
    }
}

// Random bit patterns (NaNs, infinities, subnormals included) through every
// level's row converters must match the scalar ones bit for bit.
TEST(Fp16, RowConvertersAgreeAcrossIsas) {
    std::mt19937 rng(11);
    std::vector<float> x(4099);
    for (float& f : x) f = from_bits(rng());
    const float specials[] = {0.0f, -0.0f, INFINITY, -INFINITY, 65520.0f, 65519.0f, std::ldexp(3.0f, -25),
                              from_bits(0x7F800001u), from_bits(0xFFC12345u), from_bits(0x00000001u)};
    for (size_t i = 0; i < std::size(specials); ++i) x[i * 13] = specials[i];
    for (int i = 0; i < 1000; ++i) x[2000 + i] = std::ldexp(static_cast<float>(i), -30 + i % 40);
    std::vector<uint16_t> want(x.size());
    for (size_t i = 0; i < x.size(); ++i) want[i] = fp32_to_fp16(x[i]);
    std::vector<uint16_t> want_bf(x.size());
    for (size_t i = 0; i < x.size(); ++i) want_bf[i] = fp32_to_bf16(x[i]);
    for (Isa isa : supported_isas()) {
        for (int64_t n : {1, 7, 8, 15, 16, 17, 33, 4099}) {
            std::vector<uint16_t> got(static_cast<size_t>(n) + 1, 0xABCD);
            fp32_to_fp16_row(isa, x.data(), got.data(), n);
            for (int64_t i = 0; i < n; ++i) ASSERT_EQ(got[i], want[i]) << isa_str(isa) << " i=" << i;
            ASSERT_EQ(got[n], 0xABCD) << "wrote past the end";
            quantize_row(isa, DType::F16, x.data(), got.data(), n);
            for (int64_t i = 0; i < n; ++i) ASSERT_EQ(got[i], want[i]) << isa_str(isa) << " i=" << i;
            quantize_row(isa, DType::BF16, x.data(), got.data(), n);
            for (int64_t i = 0; i < n; ++i) ASSERT_EQ(got[i], want_bf[i]) << isa_str(isa) << " i=" << i;
        }
    }
}

// ---------------------------------------------------------------------------
// Dequantization of hand-built blocks against the documented formulas.

// Packs 8 six-bit scales and mins the way the Q4_K layout documents them.
void pack_q4k_scales(const int* sc, const int* mn, uint8_t* s) {
    for (int j = 0; j < 4; ++j) {
        s[j] = static_cast<uint8_t>((sc[j] & 63) | ((sc[j + 4] >> 4) << 6));
        s[j + 4] = static_cast<uint8_t>((mn[j] & 63) | ((mn[j + 4] >> 4) << 6));
        s[j + 8] = static_cast<uint8_t>((sc[j + 4] & 15) | ((mn[j + 4] & 15) << 4));
    }
}

TEST(Dequantize, PlainTypes) {
    const uint16_t h[4] = {0x3C00, 0xC000, 0x0001, 0x7BFF};
    float out[4];
    dequantize_row(DType::F16, h, out, 4);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(static_cast<double>(out[i]), half_value(h[i]));
    const uint16_t b[3] = {0x3F80, 0xC040, 0x0001};
    dequantize_row(DType::BF16, b, out, 3);
    EXPECT_EQ(out[0], 1.0f);
    EXPECT_EQ(out[1], -3.0f);
    EXPECT_EQ(bits(out[2]), 0x00010000u);
    const float f[2] = {1.5f, -7.25f};
    dequantize_row(DType::F32, f, out, 2);
    EXPECT_EQ(out[0], 1.5f);
    EXPECT_EQ(out[1], -7.25f);
}

TEST(Dequantize, Q4_0) {
    BlockQ4_0 blk[2];
    blk[0].d = 0x3800;  // 0.5
    blk[1].d = 0xB400;  // -0.25
    for (int j = 0; j < 16; ++j) {
        blk[0].qs[j] = static_cast<uint8_t>(j | ((15 - j) << 4));
        blk[1].qs[j] = static_cast<uint8_t>(((j * 7) & 15) | (((j * 3 + 1) & 15) << 4));
    }
    float y[64];
    dequantize_row(DType::Q4_0, blk, y, 64);
    for (int b = 0; b < 2; ++b) {
        const double d = half_value(blk[b].d);
        for (int j = 0; j < 16; ++j) {
            EXPECT_EQ(y[32 * b + j], ((blk[b].qs[j] & 15) - 8) * d) << b << " " << j;
            EXPECT_EQ(y[32 * b + j + 16], ((blk[b].qs[j] >> 4) - 8) * d) << b << " " << j;
        }
    }
}

TEST(Dequantize, Q4_1) {
    BlockQ4_1 blk;
    blk.d = 0x3400;  // 0.25
    blk.m = 0xBE00;  // -1.5
    for (int j = 0; j < 16; ++j) blk.qs[j] = static_cast<uint8_t>(j | ((15 - j) << 4));
    float y[32];
    dequantize_row(DType::Q4_1, &blk, y, 32);
    for (int j = 0; j < 16; ++j) {
        EXPECT_EQ(y[j], j * 0.25 - 1.5);
        EXPECT_EQ(y[j + 16], (15 - j) * 0.25 - 1.5);
    }
}

TEST(Dequantize, Q8_0AndQ8_1AndQ8_K) {
    BlockQ8_0 a;
    BlockQ8_1 b;
    a.d = b.d = 0x3A00;  // 0.75
    b.s = 0;
    for (int j = 0; j < 32; ++j) a.qs[j] = b.qs[j] = static_cast<int8_t>(j * 8 - 128);
    float y[32];
    dequantize_row(DType::Q8_0, &a, y, 32);
    for (int j = 0; j < 32; ++j) EXPECT_EQ(y[j], (j * 8 - 128) * 0.75);
    dequantize_row(DType::Q8_1, &b, y, 32);
    for (int j = 0; j < 32; ++j) EXPECT_EQ(y[j], (j * 8 - 128) * 0.75);
    BlockQ8_K k;
    k.d = 0.125f;
    for (int j = 0; j < 256; ++j) k.qs[j] = static_cast<int8_t>(j - 128);
    std::vector<float> yk(256);
    dequantize_row(DType::Q8_K, &k, yk.data(), 256);
    for (int j = 0; j < 256; ++j) EXPECT_EQ(yk[j], (j - 128) * 0.125);
}

TEST(Dequantize, Q4_K) {
    // Scales and mins with distinct high bits so a wrong unpacking shows.
    const int sc[8] = {1, 17, 33, 63, 5, 21, 48, 62};
    const int mn[8] = {2, 40, 9, 63, 60, 3, 35, 16};
    BlockQ4_K blk;
    blk.d = 0x3000;     // 0.125
    blk.dmin = 0x2C00;  // 0.0625
    pack_q4k_scales(sc, mn, blk.scales);
    std::mt19937 rng(3);
    for (uint8_t& q : blk.qs) q = static_cast<uint8_t>(rng());
    std::vector<float> y(256);
    dequantize_row(DType::Q4_K, &blk, y.data(), 256);
    // Value 64c + l (l < 32): low nibble of qs[32c + l], sub-block 2c; value
    // 64c + 32 + l: its high nibble, sub-block 2c + 1.
    for (int c = 0; c < 4; ++c) {
        for (int l = 0; l < 32; ++l) {
            const int q = blk.qs[32 * c + l];
            EXPECT_EQ(y[64 * c + l], 0.125 * sc[2 * c] * (q & 15) - 0.0625 * mn[2 * c]) << c << " " << l;
            EXPECT_EQ(y[64 * c + 32 + l], 0.125 * sc[2 * c + 1] * (q >> 4) - 0.0625 * mn[2 * c + 1]) << c << " " << l;
        }
    }
}

// Q5_0 / Q5_1 blocks from 32 chosen 5-bit values: value i has its low 4 bits in
// qs[i % 16] (low nibble for i < 16, high for i >= 16) and its fifth bit at bit
// i of the little-endian qh.
template <class Blk>
void pack_q5(const int* q, Blk* blk) {
    uint32_t qh = 0;
    for (int i = 0; i < 32; ++i) {
        uint8_t& qs = blk->qs[i % 16];
        qs = static_cast<uint8_t>(qs | ((q[i] & 15) << (i < 16 ? 0 : 4)));
        qh |= static_cast<uint32_t>(q[i] >> 4) << i;
    }
    std::memcpy(blk->qh, &qh, 4);
}

TEST(Dequantize, Q5_0AndQ5_1) {
    int q[64];
    std::mt19937 rng(6);
    for (int& v : q) v = static_cast<int>(rng() % 32);
    q[0] = 31;
    q[31] = 16;
    q[32] = 0;
    q[63] = 15;
    BlockQ5_0 b0[2];
    BlockQ5_1 b1[2];
    std::memset(b0, 0, sizeof b0);
    std::memset(b1, 0, sizeof b1);
    for (int k = 0; k < 2; ++k) {
        pack_q5(q + 32 * k, &b0[k]);
        pack_q5(q + 32 * k, &b1[k]);
        b0[k].d = b1[k].d = k == 0 ? 0x3000 : 0x2C00;  // 0.125, 0.0625
        b1[k].m = k == 0 ? 0xBC00 : 0x3800;            // -1, 0.5
    }
    std::vector<float> y(64);
    dequantize_row(DType::Q5_0, b0, y.data(), 64);
    for (int i = 0; i < 64; ++i) EXPECT_EQ(y[i], (i < 32 ? 0.125 : 0.0625) * (q[i] - 16)) << i;
    dequantize_row(DType::Q5_1, b1, y.data(), 64);
    for (int i = 0; i < 64; ++i) EXPECT_EQ(y[i], (i < 32 ? 0.125 : 0.0625) * q[i] + (i < 32 ? -1.0 : 0.5)) << i;
}

TEST(Dequantize, Q5_K) {
    // Q4_K's scales and mins (distinct high bits) and 256 chosen 5-bit values:
    // value 32j + l (sub-block j) has its low 4 bits in qs[32(j / 2) + l] (low
    // nibble for even j, high for odd) and its fifth bit at bit j of qh[l].
    const int sc[8] = {63, 2, 17, 33, 62, 48, 5, 21};
    const int mn[8] = {9, 63, 40, 2, 16, 35, 60, 3};
    int q[256];
    std::mt19937 rng(4);
    for (int& v : q) v = static_cast<int>(rng() % 32);
    q[0] = 31;
    q[255] = 16;
    BlockQ5_K blk;
    std::memset(&blk, 0, sizeof blk);
    blk.d = 0x3000;     // 0.125
    blk.dmin = 0x2C00;  // 0.0625
    pack_q4k_scales(sc, mn, blk.scales);
    for (int e = 0; e < 256; ++e) {
        const int j = e / 32, l = e % 32;
        uint8_t& qs = blk.qs[32 * (j / 2) + l];
        qs = static_cast<uint8_t>(qs | ((q[e] & 15) << (j % 2 ? 4 : 0)));
        blk.qh[l] = static_cast<uint8_t>(blk.qh[l] | ((q[e] >> 4) << j));
    }
    std::vector<float> y(256);
    dequantize_row(DType::Q5_K, &blk, y.data(), 256);
    for (int e = 0; e < 256; ++e) EXPECT_EQ(y[e], 0.125 * sc[e / 32] * q[e] - 0.0625 * mn[e / 32]) << e;
}

TEST(Dequantize, Q6_K) {
    // Build a block from 256 chosen 6-bit values: value e = 128h + 32k + l has
    // its low 4 bits in ql[64h + l + 32(k & 1)] (low nibble for k < 2, high
    // for k >= 2) and its high 2 bits in qh[32h + l] at bit 2k; scale e / 16.
    int q[256];
    std::mt19937 rng(5);
    for (int& v : q) v = static_cast<int>(rng() % 64);
    q[0] = 0;
    q[1] = 63;
    BlockQ6_K blk;
    std::memset(&blk, 0, sizeof blk);
    for (int e = 0; e < 256; ++e) {
        const int h = e / 128, k = (e % 128) / 32, l = e % 32;
        uint8_t& ql = blk.ql[64 * h + l + 32 * (k & 1)];
        ql = static_cast<uint8_t>(ql | ((q[e] & 15) << (k >= 2 ? 4 : 0)));
        blk.qh[32 * h + l] = static_cast<uint8_t>(blk.qh[32 * h + l] | ((q[e] >> 4) << (2 * k)));
    }
    for (int g = 0; g < 16; ++g) blk.scales[g] = static_cast<int8_t>(g * 17 - 128);
    blk.d = 0x2000;  // 2^-7
    std::vector<float> y(256);
    dequantize_row(DType::Q6_K, &blk, y.data(), 256);
    for (int e = 0; e < 256; ++e) EXPECT_EQ(y[e], std::ldexp(1.0, -7) * blk.scales[e / 16] * (q[e] - 32)) << e;
}

// ---------------------------------------------------------------------------
// Quantizers

size_t row_bytes(DType t, int64_t n) { return dtype_row_bytes(t, n); }

// quantize -> dequantize stays within each type's rounding bound, per block.
TEST(Quantize, RoundTripWithinBound) {
    constexpr int64_t n = 1024;
    std::vector<float> x = random_floats(n, 21, -3.0f, 3.0f);
    for (int64_t i = 0; i < n; i += 96) x[i] *= 40.0f;  // outliers
    for (int64_t i = 0; i < 32; ++i) x[64 + i] = 0.0f;   // an all-zero block
    for (Isa isa : supported_isas()) {
        for (DType t : {DType::Q4_0, DType::Q4_1, DType::Q8_0, DType::Q8_1, DType::Q8_K}) {
            std::vector<uint8_t> q(row_bytes(t, n));
            std::vector<float> y(n);
            quantize_row(isa, t, x.data(), q.data(), n);
            dequantize_row(t, q.data(), y.data(), n);
            const int be = static_cast<int>(dtype_block_elems(t));
            for (int64_t b = 0; b < n / be; ++b) {
                double amax = 0, mn = INFINITY, mx = -INFINITY;
                for (int j = 0; j < be; ++j) {
                    amax = std::max(amax, std::fabs(static_cast<double>(x[b * be + j])));
                    mn = std::min(mn, static_cast<double>(x[b * be + j]));
                    mx = std::max(mx, static_cast<double>(x[b * be + j]));
                }
                const double h = std::ldexp(1.0, -11);  // f16 relative rounding
                double bound = 0;
                switch (t) {
                    case DType::Q4_0: bound = amax / 8 * (1 + 8 * h) + 1e-12; break;  // the far end clips by one step
                    case DType::Q4_1: bound = (mx - mn) / 15 * (0.5 + 16 * h) + std::fabs(mn) * h + 1e-6 * amax; break;
                    case DType::Q8_0: case DType::Q8_1: bound = amax / 127 * (0.5 + 128 * h) + 1e-12; break;
                    default: bound = amax / 127 * 0.5 * (1 + 1e-5) + 1e-12; break;
                }
                for (int j = 0; j < be; ++j) {
                    ASSERT_LE(std::fabs(y[b * be + j] - static_cast<double>(x[b * be + j])), bound)
                        << dtype_name(t) << " " << isa_str(isa) << " block " << b << " j " << j;
                }
            }
            if (t == DType::Q8_1) {
                const BlockQ8_1* blk = reinterpret_cast<const BlockQ8_1*>(q.data());
                for (int64_t b = 0; b < n / 32; ++b) {
                    int sum = 0;
                    for (int j = 0; j < 32; ++j) sum += blk[b].qs[j];
                    const double s = fp16_to_fp32(blk[b].d) * static_cast<double>(sum);
                    EXPECT_NEAR(fp16_to_fp32(blk[b].s), s, std::fabs(s) * 2e-3 + 1e-7);
                }
            }
            if (t == DType::Q8_K) {
                const BlockQ8_K* blk = reinterpret_cast<const BlockQ8_K*>(q.data());
                for (int64_t b = 0; b < n / 256; ++b) {
                    for (int g = 0; g < 16; ++g) {
                        int sum = 0;
                        for (int j = 0; j < 16; ++j) sum += blk[b].qs[16 * g + j];
                        EXPECT_EQ(blk[b].bsums[g], sum);
                    }
                }
            }
        }
    }
}

// Activation quantizers: every level gives the scalar level's bytes exactly,
// including on exact rounding ties (which go to even).
TEST(Quantize, ActivationTypesBitIdenticalAcrossIsas) {
    constexpr int64_t n = 2048;
    std::vector<float> x = random_floats(n, 33, -2.0f, 2.0f);
    // Block 1: amax 127 makes the scale 1, and k + 0.5 values are exact ties.
    for (int j = 0; j < 32; ++j) x[32 + j] = (j == 0) ? 127.0f : static_cast<float>(j - 16) + 0.5f;
    // Super-block 3 (Q8_K): the same trick at 256 granularity.
    for (int j = 0; j < 256; ++j) x[768 + j] = (j == 0) ? -127.0f : static_cast<float>(j % 100 - 50) + 0.5f;
    for (int j = 0; j < 256; ++j) x[1024 + j] = 0.0f;
    for (DType t : {DType::Q8_0, DType::Q8_1, DType::Q8_K, DType::F16, DType::BF16, DType::F32}) {
        std::vector<uint8_t> want(row_bytes(t, n));
        quantize_row(Isa::Scalar, t, x.data(), want.data(), n);
        for (Isa isa : supported_isas()) {
            std::vector<uint8_t> got(want.size(), 0xEE);
            quantize_row(isa, t, x.data(), got.data(), n);
            ASSERT_EQ(std::memcmp(got.data(), want.data(), want.size()), 0) << dtype_name(t) << " " << isa_str(isa);
        }
    }
    // The ties really were rounded to even.
    std::vector<uint8_t> q(row_bytes(DType::Q8_0, n));
    quantize_row(Isa::Scalar, DType::Q8_0, x.data(), q.data(), n);
    const BlockQ8_0* b1 = reinterpret_cast<const BlockQ8_0*>(q.data()) + 1;
    for (int j = 1; j < 32; ++j) {
        const double v = j - 16 + 0.5;
        const double r = std::nearbyint(v);  // default mode: ties to even
        EXPECT_EQ(b1->qs[j], static_cast<int>(r)) << j;
    }
}

// ---------------------------------------------------------------------------
// Matrix products

struct MatCase {
    DType wtype;
    int64_t n_in;
    int64_t rows;
    int n_tok;
};

// Weights for a test: quantized from random floats where duet has a quantizer;
// random blocks with sane scales for the K-quants.
std::vector<uint8_t> make_weights(DType t, int64_t rows, int64_t n_in, size_t stride, uint32_t seed) {
    std::vector<uint8_t> w(stride * static_cast<size_t>(rows), 0);  // exact: sanitizer builds catch over-reads
    std::mt19937 rng(seed);
    for (int64_t r = 0; r < rows; ++r) {
        uint8_t* row = w.data() + static_cast<size_t>(r) * stride;
        if (t == DType::Q5_0 || t == DType::Q5_1) {
            // Random values and fifth bits; d (and Q5_1's m, centring the row) drawn.
            for (size_t i = 0; i < row_bytes(t, n_in); ++i) row[i] = static_cast<uint8_t>(rng());
            const size_t bb = dtype_block_bytes(t);
            for (int64_t b = 0; b < n_in / 32; ++b) {
                const float d = std::uniform_real_distribution<float>(0.001f, 0.01f)(rng);
                const uint16_t dh = fp32_to_fp16(d), mh = fp32_to_fp16(-15.5f * d);
                std::memcpy(row + static_cast<size_t>(b) * bb, &dh, 2);
                if (t == DType::Q5_1) std::memcpy(row + static_cast<size_t>(b) * bb + 2, &mh, 2);
            }
        } else if (t == DType::Q4_K || t == DType::Q5_K || t == DType::Q6_K) {
            for (size_t i = 0; i < row_bytes(t, n_in); ++i) row[i] = static_cast<uint8_t>(rng());
            for (int64_t b = 0; b < n_in / 256; ++b) {
                const uint16_t d = fp32_to_fp16(std::uniform_real_distribution<float>(0.001f, 0.01f)(rng));
                const uint16_t dmin = fp32_to_fp16(std::uniform_real_distribution<float>(0.001f, 0.01f)(rng));
                if (t == DType::Q4_K) {
                    BlockQ4_K* blk = reinterpret_cast<BlockQ4_K*>(row) + b;
                    blk->d = d;
                    blk->dmin = dmin;
                } else if (t == DType::Q5_K) {
                    BlockQ5_K* blk = reinterpret_cast<BlockQ5_K*>(row) + b;
                    blk->d = d;
                    blk->dmin = dmin;
                } else {
                    reinterpret_cast<BlockQ6_K*>(row)[b].d = d;
                }
            }
        } else {
            std::vector<float> f = random_floats(static_cast<size_t>(n_in), seed * 1000 + static_cast<uint32_t>(r));
            if (r % 3 == 0) {
                for (float& v : f) v = v * 0.5f + 0.3f;  // an offset row (exercises Q4_1's min)
            }
            quantize_row(Isa::Scalar, t, f.data(), row, n_in);
        }
    }
    return w;
}

std::vector<uint8_t> make_acts(Isa isa, DType xt, int n_tok, int64_t n_in, size_t stride, uint32_t seed) {
    std::vector<uint8_t> x(stride * static_cast<size_t>(n_tok), 0);
    for (int t = 0; t < n_tok; ++t) {
        std::vector<float> f = random_floats(static_cast<size_t>(n_in), seed + static_cast<uint32_t>(t), -2.0f, 2.0f);
        if (t % 2 == 1) {
            for (float& v : f) v = std::fabs(v);  // skewed sums (Q8_1's s term)
        }
        quantize_row(isa, xt, f.data(), x.data() + static_cast<size_t>(t) * stride, n_in);
    }
    return x;
}

// Float64 product of the dequantized operands, and the sum of |terms| (the
// scale of float rounding error).
void reference_matmul(DType wt, const std::vector<uint8_t>& w, size_t ws, const std::vector<uint8_t>& x, size_t xs,
                      int64_t n_in, int64_t rows, int n_tok, std::vector<double>* y, std::vector<double>* mag) {
    const DType xt = vec_dot_type(wt);
    std::vector<float> wf(static_cast<size_t>(n_in)), xf(static_cast<size_t>(n_in));
    y->assign(static_cast<size_t>(rows) * n_tok, 0.0);
    mag->assign(y->size(), 0.0);
    for (int t = 0; t < n_tok; ++t) {
        dequantize_row(xt, x.data() + static_cast<size_t>(t) * xs, xf.data(), n_in);
        for (int64_t r = 0; r < rows; ++r) {
            dequantize_row(wt, w.data() + static_cast<size_t>(r) * ws, wf.data(), n_in);
            double s = 0, m = 0;
            for (int64_t k = 0; k < n_in; ++k) {
                s += static_cast<double>(wf[k]) * xf[k];
                m += std::fabs(static_cast<double>(wf[k]) * xf[k]);
            }
            (*y)[static_cast<size_t>(t) * rows + r] = s;
            (*mag)[static_cast<size_t>(t) * rows + r] = m;
        }
    }
}

std::vector<MatCase> mat_cases() {
    std::vector<MatCase> c;
    for (DType t : {DType::Q4_0, DType::Q4_1, DType::Q5_0, DType::Q5_1, DType::Q8_0}) {
        c.push_back({t, 32, 5, 1});
        c.push_back({t, 96, 19, 3});
        c.push_back({t, 544, 21, 11});  // 17 blocks: a partial group and chunk
        c.push_back({t, 576, 37, 9});   // SmolLM2's width
        c.push_back({t, 1536, 9, 2});
    }
    for (DType t : {DType::F32, DType::F16, DType::BF16}) {
        c.push_back({t, 1, 3, 2});
        c.push_back({t, 7, 11, 1});
        c.push_back({t, 33, 13, 5});
        c.push_back({t, 576, 17, 4});
    }
    for (DType t : {DType::Q4_K, DType::Q5_K, DType::Q6_K}) {
        c.push_back({t, 256, 7, 3});
        c.push_back({t, 1536, 11, 5});
    }
    return c;
}

TEST(Matmul, MatchesFloat64ReferenceAndScalarAtEveryIsa) {
    for (const MatCase& mc : mat_cases()) {
        const DType xt = vec_dot_type(mc.wtype);
        const size_t ws = row_bytes(mc.wtype, mc.n_in) + (mc.rows % 2 ? 64 : 0);  // padded strides too
        const size_t xs = row_bytes(xt, mc.n_in) + 32;
        const std::vector<uint8_t> w = make_weights(mc.wtype, mc.rows, mc.n_in, ws, 17);
        const std::vector<uint8_t> xq = make_acts(Isa::Scalar, xt, mc.n_tok, mc.n_in, xs, 29);
        std::vector<double> ref, mag;
        reference_matmul(mc.wtype, w, ws, xq, xs, mc.n_in, mc.rows, mc.n_tok, &ref, &mag);
        // Q4_1 uses s = f16(d * sum q) for the min term: allow its rounding.
        std::vector<double> extra(ref.size(), 0.0);
        if (mc.wtype == DType::Q4_1 || mc.wtype == DType::Q5_1) {
            const size_t bb = dtype_block_bytes(mc.wtype);  // m at bytes 2-3 of both layouts
            for (int t = 0; t < mc.n_tok; ++t) {
                const BlockQ8_1* xb = reinterpret_cast<const BlockQ8_1*>(xq.data() + static_cast<size_t>(t) * xs);
                for (int64_t r = 0; r < mc.rows; ++r) {
                    const uint8_t* wb = w.data() + static_cast<size_t>(r) * ws;
                    double e = 0;
                    for (int64_t b = 0; b < mc.n_in / 32; ++b) {
                        uint16_t m;
                        std::memcpy(&m, wb + static_cast<size_t>(b) * bb + 2, 2);
                        e += std::fabs(fp16_to_fp32(m) * fp16_to_fp32(xb[b].s));
                    }
                    extra[static_cast<size_t>(t) * mc.rows + r] = e * std::ldexp(1.0, -10);
                }
            }
        }
        const size_t ldy = static_cast<size_t>(mc.rows) + 3;
        std::vector<float> y_scalar(ldy * mc.n_tok, NAN);
        matmul(Isa::Scalar, mc.wtype, w.data(), ws, mc.n_in, xq.data(), xs, mc.n_tok, y_scalar.data(), ldy, 0, mc.rows);
        for (Isa isa : supported_isas()) {
            const std::vector<uint8_t> xi = make_acts(isa, xt, mc.n_tok, mc.n_in, xs, 29);
            ASSERT_EQ(xi, xq);
            std::vector<float> y(ldy * mc.n_tok, -7.0f);
            matmul(isa, mc.wtype, w.data(), ws, mc.n_in, xi.data(), xs, mc.n_tok, y.data(), ldy, 0, mc.rows);
            for (int t = 0; t < mc.n_tok; ++t) {
                for (int64_t r = 0; r < mc.rows; ++r) {
                    const size_t i = static_cast<size_t>(t) * mc.rows + r;
                    const float got = y[static_cast<size_t>(t) * ldy + r];
                    const float sc = y_scalar[static_cast<size_t>(t) * ldy + r];
                    const double tol = 1e-5 * mag[i] + extra[i] + 1e-30;
                    ASSERT_NEAR(got, ref[i], tol) << dtype_name(mc.wtype) << " " << isa_str(isa) << " n_in " << mc.n_in
                                                  << " r " << r << " t " << t;
                    ASSERT_NEAR(got, sc, 2e-6 * mag[i] + 1e-30) << dtype_name(mc.wtype) << " " << isa_str(isa);
                    if (mc.wtype == DType::Q4_K || mc.wtype == DType::Q5_K || mc.wtype == DType::Q6_K) {
                        // Exact integer sums + the scalar float expression: equal bits.
                        ASSERT_EQ(bits(got), bits(sc)) << dtype_name(mc.wtype) << " " << isa_str(isa);
                    }
                }
                for (size_t r = static_cast<size_t>(mc.rows); r < ldy; ++r) {
                    ASSERT_EQ(y[static_cast<size_t>(t) * ldy + r], -7.0f) << "wrote outside [r0, r1)";
                }
            }
        }
    }
}

// The contract: a (row, token) result does not depend on n_tok, r0, r1 or on
// which token of the call it is.
TEST(Matmul, BatchInvariantAtEveryIsa) {
    struct Shape {
        DType t;
        int64_t n_in, rows;
    };
    const Shape shapes[] = {{DType::Q4_1, 576, 41}, {DType::Q4_1, 1536, 12}, {DType::Q4_0, 544, 23},
                            {DType::Q8_0, 576, 29}, {DType::Q8_0, 96, 9},    {DType::F16, 100, 27},
                            {DType::F32, 64, 19},   {DType::BF16, 35, 10},   {DType::Q4_K, 512, 13},
                            {DType::Q6_K, 256, 11}, {DType::Q5_K, 768, 13},  {DType::Q5_0, 544, 23},
                            {DType::Q5_1, 576, 41}};
    constexpr int kTok = 19;
    for (const Shape& s : shapes) {
        const DType xt = vec_dot_type(s.t);
        const size_t ws = row_bytes(s.t, s.n_in), xs = row_bytes(xt, s.n_in);
        const std::vector<uint8_t> w = make_weights(s.t, s.rows, s.n_in, ws, 3);
        for (Isa isa : supported_isas()) {
            const std::vector<uint8_t> x = make_acts(isa, xt, kTok, s.n_in, xs, 77);
            const size_t ldy = static_cast<size_t>(s.rows);
            std::vector<float> full(ldy * kTok);
            matmul(isa, s.t, w.data(), ws, s.n_in, x.data(), xs, kTok, full.data(), ldy, 0, s.rows);
            std::mt19937 rng(static_cast<uint32_t>(s.rows));
            // Calls over token windows [t0, t0 + nt) and random row ranges.
            for (int trial = 0; trial < 12; ++trial) {
                const int t0 = static_cast<int>(rng() % kTok);
                const int nt = 1 + static_cast<int>(rng() % static_cast<uint32_t>(kTok - t0));
                const int64_t r0 = static_cast<int64_t>(rng() % static_cast<uint32_t>(s.rows));
                const int64_t r1 = r0 + 1 + static_cast<int64_t>(rng() % static_cast<uint32_t>(s.rows - r0));
                std::vector<float> part(ldy * static_cast<size_t>(nt), NAN);
                matmul(isa, s.t, w.data(), ws, s.n_in, x.data() + static_cast<size_t>(t0) * xs, xs, nt, part.data(), ldy,
                       r0, r1);
                for (int t = 0; t < nt; ++t) {
                    for (int64_t r = r0; r < r1; ++r) {
                        ASSERT_EQ(bits(part[static_cast<size_t>(t) * ldy + r]), bits(full[static_cast<size_t>(t0 + t) * ldy + r]))
                            << dtype_name(s.t) << " " << isa_str(isa) << " t0 " << t0 << " nt " << nt << " r " << r;
                    }
                }
            }
        }
    }
}

// The many-row contract (issue: many-row CPU products): for every weight type and
// level, a pass of N rows gives each (row, token) the bits a one-token call gives
// it, for N = 1..16, 31, 64 and 512: every tile shape (AVX-512's tiles of 1-8
// tokens on each kind of row end), its ragged ends, and the row-blocked path of
// long passes.
TEST(Matmul, EveryRowCountGivesTheOneTokenBits) {
    struct Shape {
        DType t;
        int64_t n_in, rows;
    };
    // Q4 / Q5 / Q8_0 widths: full chunks and a short tail (576 = 16 + 2 blocks),
    // full chunks only (1536), a partial chunk (672 = 16 + 5 blocks), only a tail
    // (32, 64), only a partial chunk (96).
    const Shape shapes[] = {
        {DType::Q4_0, 576, 37},  {DType::Q4_1, 576, 37},  {DType::Q8_0, 576, 37}, {DType::Q4_0, 1536, 19},
        {DType::Q4_1, 1536, 19}, {DType::Q8_0, 1536, 19}, {DType::Q4_0, 672, 23}, {DType::Q4_1, 672, 23},
        {DType::Q8_0, 672, 23},  {DType::Q4_1, 32, 9},    {DType::Q4_0, 64, 9},   {DType::Q8_0, 64, 9},
        {DType::Q4_K, 512, 37},  {DType::Q6_K, 512, 37},  {DType::F16, 100, 37},  {DType::BF16, 100, 37},
        {DType::F32, 100, 37},   {DType::Q5_K, 512, 37},  {DType::Q5_0, 576, 37}, {DType::Q5_1, 576, 37},
        {DType::Q5_0, 1536, 19}, {DType::Q5_1, 672, 23},  {DType::Q5_0, 672, 23}, {DType::Q5_1, 1536, 19},
        {DType::Q5_0, 96, 9},    {DType::Q5_1, 64, 9}};
    constexpr int kMaxTok = 512;
    std::vector<int> counts;
    for (int n = 1; n <= 16; ++n) counts.push_back(n);
    for (int n : {31, 64, kMaxTok}) counts.push_back(n);
    for (const Shape& s : shapes) {
        const DType xt = vec_dot_type(s.t);
        const size_t ws = row_bytes(s.t, s.n_in), xs = row_bytes(xt, s.n_in);
        const std::vector<uint8_t> w = make_weights(s.t, s.rows, s.n_in, ws, 11);
        const size_t ldy = static_cast<size_t>(s.rows);
        for (Isa isa : supported_isas()) {
            const std::vector<uint8_t> x = make_acts(isa, xt, kMaxTok, s.n_in, xs, 41);
            std::vector<float> one(ldy * kMaxTok);
            for (int t = 0; t < kMaxTok; ++t)
                matmul(isa, s.t, w.data(), ws, s.n_in, x.data() + static_cast<size_t>(t) * xs, xs, 1,
                       one.data() + static_cast<size_t>(t) * ldy, ldy, 0, s.rows);
            for (int n : counts) {
                std::vector<float> y(ldy * static_cast<size_t>(n), NAN);
                matmul(isa, s.t, w.data(), ws, s.n_in, x.data(), xs, n, y.data(), ldy, 0, s.rows);
                for (size_t i = 0; i < y.size(); ++i)
                    ASSERT_EQ(bits(y[i]), bits(one[i])) << dtype_name(s.t) << " " << isa_str(isa) << " rows " << n
                                                        << " token " << i / ldy << " row " << i % ldy;
            }
        }
    }
}

// AMX is the AVX-512 level on tiles (kernels.h): for every quantized weight type,
// each kind of row end (full chunks, short tails of 1-2 blocks, partial chunks,
// rows of a tail alone; K-quant rows of 1-34 super-blocks), row ranges that start off a strip of 16 and end in a
// ragged one, token counts around the 16-token tile and past a token block, padded
// strides: every output equals Avx512's bit for bit, and nothing outside [r0, r1)
// is written.
TEST(Matmul, AmxGivesTheAvx512Bits) {
    if (!isa_supported(Isa::Amx)) GTEST_SKIP() << "no AMX here (Isa.AmxKernelsRunHere says why)";
    struct Shape {
        DType t;
        int64_t blocks, rows, r0;
        int n_tok;
    };
    std::vector<Shape> shapes;
    for (DType t : {DType::Q4_0, DType::Q4_1, DType::Q5_0, DType::Q5_1, DType::Q8_0}) {
        for (int64_t blocks : {1, 2, 3, 16, 17, 18, 21, 31, 32, 48}) {
            shapes.push_back({t, blocks, 37, 5, 33});
            shapes.push_back({t, blocks, 16, 0, 16});
        }
        shapes.push_back({t, 18, 48, 0, 100});
        shapes.push_back({t, 48, 21, 3, 47});
        // 256 blocks: a token tile's activations are 160 KiB, so 113 tokens take two token blocks.
        shapes.push_back({t, 256, 20, 0, 113});
    }
    // K-quants: blocks of 256 values; 34 super-blocks take two token blocks at 113 tokens.
    for (DType t : {DType::Q4_K, DType::Q5_K, DType::Q6_K}) {
        // Q6_K takes tiles from 48 tokens: its shapes start there.
        const int lo = t == DType::Q6_K ? 48 : 16, hi = t == DType::Q6_K ? 65 : 33;
        for (int64_t blocks : {1, 2, 6}) {
            shapes.push_back({t, blocks, 37, 5, hi});
            shapes.push_back({t, blocks, 16, 0, lo});
        }
        shapes.push_back({t, 34, 20, 0, 113});
    }
    for (const Shape& s : shapes) {
        const int64_t n_in = dtype_block_elems(s.t) * s.blocks;
        const DType xt = vec_dot_type(s.t);
        const size_t ws = row_bytes(s.t, n_in) + (s.rows % 2 ? 64 : 0);
        const size_t xs = row_bytes(xt, n_in) + (s.n_tok % 2 ? 32 : 0);
        const std::vector<uint8_t> w = make_weights(s.t, s.rows, n_in, ws, 5);
        const std::vector<uint8_t> x = make_acts(Isa::Avx512, xt, s.n_tok, n_in, xs, 13);
        const size_t ldy = static_cast<size_t>(s.rows) + 2;
        std::vector<float> ya(ldy * static_cast<size_t>(s.n_tok), -7.0f), yb = ya;
        matmul(Isa::Avx512, s.t, w.data(), ws, n_in, x.data(), xs, s.n_tok, ya.data(), ldy, s.r0, s.rows);
        matmul(Isa::Amx, s.t, w.data(), ws, n_in, x.data(), xs, s.n_tok, yb.data(), ldy, s.r0, s.rows);
        for (size_t i = 0; i < ya.size(); ++i)
            ASSERT_EQ(bits(yb[i]), bits(ya[i])) << dtype_name(s.t) << " blocks " << s.blocks << " rows " << s.rows
                                                << " tokens " << s.n_tok << " token " << i / ldy << " row " << i % ldy;
    }
}

// Random shapes (block counts that hit every tail length, odd row ranges,
// padded strides): every level agrees with the scalar level within rounding,
// and each (row, token) equals its value from a one-token, one-row call.
TEST(Matmul, RandomShapesAgreeAndAreBatchInvariant) {
    std::mt19937 rng(2024);
    const DType types[] = {DType::Q4_0, DType::Q4_1, DType::Q8_0, DType::F16,  DType::F32, DType::BF16,
                           DType::Q4_K, DType::Q5_K, DType::Q6_K, DType::Q5_0, DType::Q5_1};
    for (int trial = 0; trial < 48; ++trial) {
        const DType t = types[trial % std::size(types)];
        const int64_t be = dtype_block_elems(t) == 1 ? 1 : dtype_block_elems(t);
        const int64_t max_blocks = be == 256 ? 4 : be == 32 ? 40 : 300;
        const int64_t n_in = be * (1 + static_cast<int64_t>(rng() % static_cast<uint32_t>(max_blocks)));
        const int64_t rows = 1 + static_cast<int64_t>(rng() % 40);
        const int n_tok = 1 + static_cast<int>(rng() % 13);
        const DType xt = vec_dot_type(t);
        const size_t ws = row_bytes(t, n_in) + 4 * (rng() % 3);  // odd-ish strides (multiples of 4)
        const size_t xs = row_bytes(xt, n_in) + 4 * (rng() % 3);
        const std::vector<uint8_t> w = make_weights(t, rows, n_in, ws, 100 + static_cast<uint32_t>(trial));
        std::vector<double> ref, mag;
        const std::vector<uint8_t> x0 = make_acts(Isa::Scalar, xt, n_tok, n_in, xs, 200 + static_cast<uint32_t>(trial));
        reference_matmul(t, w, ws, x0, xs, n_in, rows, n_tok, &ref, &mag);
        const int64_t r0 = static_cast<int64_t>(rng() % static_cast<uint32_t>(rows));
        const int64_t r1 = r0 + 1 + static_cast<int64_t>(rng() % static_cast<uint32_t>(rows - r0));
        for (Isa isa : supported_isas()) {
            const std::vector<uint8_t> x = make_acts(isa, xt, n_tok, n_in, xs, 200 + static_cast<uint32_t>(trial));
            const size_t ldy = static_cast<size_t>(rows);
            std::vector<float> y(ldy * n_tok, NAN);
            matmul(isa, t, w.data(), ws, n_in, x.data(), xs, n_tok, y.data(), ldy, r0, r1);
            for (int tk = 0; tk < n_tok; ++tk) {
                for (int64_t r = r0; r < r1; ++r) {
                    const size_t i = static_cast<size_t>(tk) * rows + r;
                    const double extra =
                        t == DType::Q4_1 || t == DType::Q5_1 ? 2e-3 * mag[i] : 0.0;  // s = f16(d * sum q)
                    ASSERT_NEAR(y[i], ref[i], 2e-5 * mag[i] + extra + 1e-30)
                        << dtype_name(t) << " " << isa_str(isa) << " n_in " << n_in << " r " << r << " t " << tk;
                }
            }
            // One token and one row per call.
            for (int tk = 0; tk < n_tok; ++tk) {
                std::vector<float> single(static_cast<size_t>(rows), NAN);
                for (int64_t r = r0; r < r1; ++r) {
                    matmul(isa, t, w.data(), ws, n_in, x.data() + static_cast<size_t>(tk) * xs, xs, 1, single.data(),
                           ldy, r, r + 1);
                }
                for (int64_t r = r0; r < r1; ++r) {
                    ASSERT_EQ(bits(single[r]), bits(y[static_cast<size_t>(tk) * ldy + r]))
                        << dtype_name(t) << " " << isa_str(isa) << " n_in " << n_in << " r " << r << " t " << tk;
                }
            }
        }
    }
}

// Rows that end in 1 or 2 blocks past their 16-block chunks (SmolLM2's 576
// values is 16 + 2) take their own path in AVX-512 decode: the tails of 8 rows
// are gathered into one chunk, 16 rows at a time. Every row must still get the
// bits a one-row call gives it and the bits the tiled (n_tok > 1) path gives it,
// whatever the row range (partial batches, odd starts, fewer than 8 rows), and
// stay within rounding of float64.
TEST(Matmul, ShortTailRowsInDecodeEqualOneRowCallsAndTiles) {
    struct Range {
        int64_t r0, r1;
    };
    for (DType t : {DType::Q4_0, DType::Q4_1}) {
        const DType xt = vec_dot_type(t);
        for (int64_t nb : {1, 2, 17, 18, 34, 50}) {
            const int64_t n_in = 32 * nb, rows = 53;
            for (size_t pad : {size_t{0}, size_t{4}}) {
                const size_t ws = row_bytes(t, n_in) + pad, xs = row_bytes(xt, n_in);
                const std::vector<uint8_t> w = make_weights(t, rows, n_in, ws, 5 + static_cast<uint32_t>(nb));
                std::vector<double> ref, mag;
                const std::vector<uint8_t> x0 = make_acts(Isa::Scalar, xt, 3, n_in, xs, 9);
                reference_matmul(t, w, ws, x0, xs, n_in, rows, 3, &ref, &mag);
                for (Isa isa : supported_isas()) {
                    const std::vector<uint8_t> x = make_acts(isa, xt, 3, n_in, xs, 9);
                    std::vector<float> one(static_cast<size_t>(rows), NAN), tiled(static_cast<size_t>(rows) * 3, NAN);
                    for (int64_t r = 0; r < rows; ++r) {
                        matmul(isa, t, w.data(), ws, n_in, x.data(), xs, 1, one.data(), 0, r, r + 1);
                    }
                    const size_t ldy = static_cast<size_t>(rows);
                    matmul(isa, t, w.data(), ws, n_in, x.data(), xs, 3, tiled.data(), ldy, 0, rows);
                    for (const Range& rg : {Range{0, rows}, Range{3, 53}, Range{5, 12}, Range{17, 18}, Range{44, 53},
                                            Range{16, 48}, Range{1, 40}}) {
                        std::vector<float> y(static_cast<size_t>(rows), NAN);
                        matmul(isa, t, w.data(), ws, n_in, x.data(), xs, 1, y.data(), 0, rg.r0, rg.r1);
                        for (int64_t r = 0; r < rows; ++r) {
                            const size_t i = static_cast<size_t>(r);
                            if (r < rg.r0 || r >= rg.r1) {
                                ASSERT_TRUE(std::isnan(y[i])) << "wrote outside [r0, r1)";
                                continue;
                            }
                            ASSERT_EQ(bits(y[i]), bits(one[i])) << dtype_name(t) << " " << isa_str(isa) << " nb " << nb
                                                                << " rows [" << rg.r0 << ", " << rg.r1 << ") r " << r;
                            ASSERT_EQ(bits(y[i]), bits(tiled[i]))
                                << dtype_name(t) << " " << isa_str(isa) << " nb " << nb << " r " << r;
                            const double extra =
                                t == DType::Q4_1 || t == DType::Q5_1 ? 2e-3 * mag[i] : 0.0;  // s = f16(d * sum q)
                            ASSERT_NEAR(y[i], ref[i], 2e-5 * mag[i] + extra + 1e-30)
                                << dtype_name(t) << " " << isa_str(isa);
                        }
                    }
                }
            }
        }
    }
}

// Bytes copied between two unmapped pages, against the first (at_end false) or
// the second: reading one byte before or past them faults.
class Guarded {
   public:
    Guarded(const std::vector<uint8_t>& src, bool at_end) {
        const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
        const size_t span = (src.size() + page - 1) / page * page;
        size_ = span + 2 * page;
        void* m = mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED) std::abort();
        base_ = static_cast<uint8_t*>(m);
        if (mprotect(base_, page, PROT_NONE) != 0 || mprotect(base_ + page + span, page, PROT_NONE) != 0) std::abort();
        data_ = base_ + page + (at_end ? span - src.size() : 0);
        std::memcpy(data_, src.data(), src.size());
    }
    ~Guarded() { munmap(base_, size_); }
    Guarded(const Guarded&) = delete;
    Guarded& operator=(const Guarded&) = delete;
    const uint8_t* data() const { return data_; }

   private:
    uint8_t* base_;
    uint8_t* data_;
    size_t size_;
};

// Weights and activations placed against unmapped pages: a kernel that reads a
// byte before the first row or past the last one (its last group, its tail, a
// padded load) faults here, not only under a sanitizer. Prefetches may reach
// past the rows; they never fault.
TEST(Matmul, ReadsNothingOutsideItsRows) {
    for (DType t : {DType::Q4_0, DType::Q4_1, DType::Q5_0, DType::Q5_1, DType::Q8_0, DType::F16, DType::Q4_K,
                    DType::Q5_K, DType::Q6_K}) {
        const DType xt = vec_dot_type(t);
        const int64_t be = dtype_block_elems(t);
        for (int64_t n_in : {be, 2 * be, 17 * be, 18 * be, 21 * be, 48 * be}) {
            // 48 tokens: AMX tiles where the CPU has them (Q6_K's threshold included).
            for (int n_tok : {1, 3, 9, 48}) {
                const int64_t rows = 21;
                const size_t ws = row_bytes(t, n_in), xs = row_bytes(xt, n_in);
                const std::vector<uint8_t> w = make_weights(t, rows, n_in, ws, 7);
                for (bool at_end : {false, true}) {
                    const Guarded gw(w, at_end);
                    for (Isa isa : supported_isas()) {
                        const Guarded gx(make_acts(isa, xt, n_tok, n_in, xs, 8), at_end);
                        std::vector<float> y(static_cast<size_t>(rows) * n_tok, NAN);
                        const size_t ldy = static_cast<size_t>(rows);
                        matmul(isa, t, gw.data(), ws, n_in, gx.data(), xs, n_tok, y.data(), ldy, 0, rows);
                        matmul(isa, t, gw.data(), ws, n_in, gx.data(), xs, n_tok, y.data(), ldy, rows - 1, rows);
                        for (float v : y) ASSERT_FALSE(std::isnan(v)) << dtype_name(t) << " " << isa_str(isa);
                    }
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Float row ops: tolerance against float64, determinism per Isa.

const int64_t kLens[] = {1, 5, 8, 15, 16, 17, 31, 64, 100, 576, 1537};

TEST(RowOps, RmsNorm) {
    for (int64_t n : kLens) {
        const std::vector<float> x = random_floats(static_cast<size_t>(n), 1, -3, 3);
        const std::vector<float> w = random_floats(static_cast<size_t>(n), 2, 0.5, 1.5);
        double ss = 0;
        for (float v : x) ss += static_cast<double>(v) * v;
        const double scale = 1.0 / std::sqrt(ss / static_cast<double>(n) + 1e-5);
        for (Isa isa : supported_isas()) {
            std::vector<float> y(static_cast<size_t>(n)), y2(static_cast<size_t>(n));
            rms_norm(isa, x.data(), w.data(), y.data(), n, 1e-5f);
            rms_norm(isa, x.data(), w.data(), y2.data(), n, 1e-5f);
            ASSERT_EQ(y, y2);
            for (int64_t i = 0; i < n; ++i) {
                const double want = x[i] * scale * w[i];
                ASSERT_NEAR(y[i], want, 4e-6 * std::fabs(want) + 1e-30) << isa_str(isa) << " n " << n;
            }
        }
    }
}

TEST(RowOps, RopeMatchesFloat64AndIsIdenticalAcrossIsas) {
    const int head_dim = 64;
    for (int rot_dim : {64, 32, 10}) {
        for (int64_t pos : {0, 1, 7, 1000, 32767}) {
            std::vector<float> inv(static_cast<size_t>(rot_dim / 2));
            for (int i = 0; i < rot_dim / 2; ++i) inv[i] = static_cast<float>(std::pow(10000.0, -2.0 * i / rot_dim));
            const std::vector<float> x0 = random_floats(3 * head_dim, static_cast<uint32_t>(pos) + 3);
            std::vector<float> first;
            for (Isa isa : supported_isas()) {
                std::vector<float> x = x0;
                rope(isa, x.data(), 3, head_dim, rot_dim, pos, inv.data());
                for (int h = 0; h < 3; ++h) {
                    for (int i = 0; i < head_dim / 2; ++i) {
                        const double a = x0[h * head_dim + 2 * i], b = x0[h * head_dim + 2 * i + 1];
                        double wa = a, wb = b;
                        if (2 * i < rot_dim) {
                            const double th = static_cast<double>(pos) * inv[i];
                            wa = a * std::cos(th) - b * std::sin(th);
                            wb = a * std::sin(th) + b * std::cos(th);
                        }
                        ASSERT_NEAR(x[h * head_dim + 2 * i], wa, 1e-6) << isa_str(isa) << " pos " << pos << " i " << i;
                        ASSERT_NEAR(x[h * head_dim + 2 * i + 1], wb, 1e-6) << isa_str(isa) << " pos " << pos;
                    }
                }
                if (first.empty()) {
                    first = x;
                } else {
                    ASSERT_EQ(0, std::memcmp(first.data(), x.data(), x.size() * 4)) << isa_str(isa);
                }
            }
        }
    }
}

TEST(RowOps, Swiglu) {
    for (int64_t n : kLens) {
        std::vector<float> g = random_floats(static_cast<size_t>(n), 4, -12, 12);
        const std::vector<float> u = random_floats(static_cast<size_t>(n), 5, -2, 2);
        g[0] = -100.0f;  // exp(100): the gate is fully closed
        if (n > 1) g[1] = 90.0f;
        for (Isa isa : supported_isas()) {
            std::vector<float> y(static_cast<size_t>(n)), y2(static_cast<size_t>(n));
            swiglu(isa, g.data(), u.data(), y.data(), n);
            swiglu(isa, g.data(), u.data(), y2.data(), n);
            ASSERT_EQ(y, y2);
            for (int64_t i = 0; i < n; ++i) {
                const double want = g[i] / (1.0 + std::exp(-static_cast<double>(g[i]))) * u[i];
                ASSERT_NEAR(y[i], want, 1e-6 * std::fabs(want) + 1e-37) << isa_str(isa) << " g " << g[i];
            }
        }
    }
}

TEST(RowOps, Add) {
    for (int64_t n : kLens) {
        const std::vector<float> a = random_floats(static_cast<size_t>(n), 6), b = random_floats(static_cast<size_t>(n), 7);
        for (Isa isa : supported_isas()) {
            std::vector<float> y = a;
            add(isa, y.data(), b.data(), n);
            for (int64_t i = 0; i < n; ++i) ASSERT_EQ(y[i], a[i] + b[i]);  // one rounding: exact everywhere
        }
    }
}

TEST(RowOps, Softmax) {
    for (int64_t n : kLens) {
        std::vector<float> x0 = random_floats(static_cast<size_t>(n), 8, -20, 20);
        for (int64_t i = 0; i < n; i += 3) x0[i] = -INFINITY;  // masked entries
        if (n > 1) x0[1] = 50.0f;
        double mx = -INFINITY;
        for (float v : x0) mx = std::max(mx, static_cast<double>(v));
        double sum = 0;
        for (float v : x0) sum += std::exp(v - mx);
        for (Isa isa : supported_isas()) {
            std::vector<float> x = x0, x2 = x0;
            softmax(isa, x.data(), n);
            softmax(isa, x2.data(), n);
            ASSERT_EQ(x, x2);
            for (int64_t i = 0; i < n; ++i) {
                if (x0[i] == -INFINITY) {  // masked, or every entry masked
                    ASSERT_EQ(x[i], 0.0f);
                    continue;
                }
                const double want = std::exp(x0[i] - mx) / sum;
                // x - max is rounded to float first: relative error |x - max| * 2^-24.
                const double rel = 1e-6 + std::fabs(x0[i] - mx) * 1.2e-7;
                ASSERT_NEAR(x[i], want, rel * want + 1e-37) << isa_str(isa) << " n " << n << " i " << i;
            }
        }
    }
    for (Isa isa : supported_isas()) {
        std::vector<float> x(20, -INFINITY);
        softmax(isa, x.data(), 20);
        for (float v : x) EXPECT_EQ(v, 0.0f) << "all masked gives zeros, not NaN";
    }
}

TEST(RowOps, F16Attention) {
    for (int64_t n : kLens) {
        const std::vector<float> a = random_floats(static_cast<size_t>(n), 9, -2, 2);
        const std::vector<float> bf = random_floats(static_cast<size_t>(n), 10, -2, 2);
        std::vector<uint16_t> b(static_cast<size_t>(n));
        for (int64_t i = 0; i < n; ++i) b[i] = fp32_to_fp16(bf[i]);
        double dot = 0, mag = 0;
        for (int64_t i = 0; i < n; ++i) {
            dot += static_cast<double>(a[i]) * half_value(b[i]);
            mag += std::fabs(static_cast<double>(a[i]) * half_value(b[i]));
        }
        const std::vector<float> y0 = random_floats(static_cast<size_t>(n), 12);
        for (Isa isa : supported_isas()) {
            const float d = dot_f32_f16(isa, a.data(), b.data(), n);
            ASSERT_EQ(bits(d), bits(dot_f32_f16(isa, a.data(), b.data(), n)));
            ASSERT_NEAR(d, dot, 1e-6 * mag + 1e-30) << isa_str(isa) << " n " << n;
            std::vector<float> y = y0;
            axpy_f16(isa, 0.37f, b.data(), y.data(), n);
            for (int64_t i = 0; i < n; ++i) {
                const double want = y0[i] + 0.37 * half_value(b[i]);
                ASSERT_NEAR(y[i], want, 2e-7 * (std::fabs(y0[i]) + std::fabs(0.37 * half_value(b[i])))) << isa_str(isa);
            }
        }
    }
}

// A span's rows over one KV block (attn_*_f16_rows), for one query head or several
// sharing the block's KV head, equal each (head, row)'s one-row kernel bit for bit:
// every row count up to 8, 1 to 4 heads (pair counts that leave 0, 1 and 2 pairs over
// the AVX-512 level's threes), rows that see none, some or all of the block's keys
// (causal spans), blocks of 16 keys and of more (the fallback), at every level the
// machine has.
TEST(RowOps, SpanRowsOverABlockEqualTheOneRowKernels) {
    for (int64_t head_dim : {64, 128, 80, 7}) {
        for (int64_t keys : {16, 5, 21}) {
            const size_t stride = static_cast<size_t>(head_dim) + 3;
            const std::vector<float> kf = random_floats(stride * static_cast<size_t>(keys), 31, -2, 2);
            std::vector<uint16_t> kv(kf.size());
            for (size_t i = 0; i < kf.size(); ++i) kv[i] = fp32_to_fp16(kf[i]);
            for (int64_t heads = 1; heads <= 4; ++heads)
                for (int64_t rows = 1; rows <= 8; ++rows) {
                    const size_t q_stride = static_cast<size_t>(head_dim) * 2 + 1, s_stride = 40, o_stride = q_stride;
                    const size_t q_head = q_stride * static_cast<size_t>(rows) + 5;  // head g's rows after g's
                    const size_t pairs = static_cast<size_t>(heads * rows);
                    const std::vector<float> q = random_floats(q_head * static_cast<size_t>(heads), 32, -2, 2);
                    const std::vector<float> p = random_floats(s_stride * pairs, 33, 0, 1);
                    const std::vector<float> out0 = random_floats(q_head * static_cast<size_t>(heads), 34);
                    std::vector<int64_t> n(static_cast<size_t>(rows));
                    for (int64_t r = 0; r < rows; ++r)
                        n[r] = std::clamp<int64_t>(keys - rows + 1 + r - (r == 1 ? 9 : 0), 0, keys);
                    for (Isa isa : supported_isas()) {
                        std::vector<float> got(s_stride * pairs, -7.0f), want = got;
                        attn_scores_f16_rows(isa, q.data(), q_stride, q_head, heads, rows, n.data(), kv.data(), stride,
                                             head_dim, 0.125f, got.data(), s_stride);
                        for (int64_t g = 0; g < heads; ++g)
                            for (int64_t r = 0; r < rows; ++r)
                                if (n[r] > 0)
                                    attn_scores_f16(isa, q.data() + g * q_head + r * q_stride, kv.data(), stride, n[r],
                                                    head_dim, 0.125f, want.data() + (g * rows + r) * s_stride);
                        ASSERT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * 4))
                            << isa_str(isa) << " head_dim " << head_dim << " keys " << keys << " heads " << heads
                            << " rows " << rows;
                        std::vector<float> acc = out0, acc_want = out0;
                        attn_accum_f16_rows(isa, p.data(), s_stride, heads, rows, n.data(), kv.data(), stride, head_dim,
                                            acc.data(), o_stride, q_head);
                        for (int64_t g = 0; g < heads; ++g)
                            for (int64_t r = 0; r < rows; ++r)
                                if (n[r] > 0)
                                    attn_accum_f16(isa, p.data() + (g * rows + r) * s_stride, kv.data(), stride, n[r],
                                                   head_dim, acc_want.data() + g * q_head + r * o_stride);
                        ASSERT_EQ(0, std::memcmp(acc.data(), acc_want.data(), acc.size() * 4))
                            << isa_str(isa) << " head_dim " << head_dim << " keys " << keys << " heads " << heads
                            << " rows " << rows;
                    }
                }
        }
    }
}

// The batched attention helpers equal the one-row forms bit for bit.
TEST(RowOps, BatchedAttentionEqualsOneRowForms) {
    for (int64_t head_dim : {64, 128, 80, 7}) {
        const int64_t n = 37;
        const size_t stride = static_cast<size_t>(head_dim) + 5;
        const std::vector<float> q = random_floats(static_cast<size_t>(head_dim), 13, -2, 2);
        const std::vector<float> kf = random_floats(stride * n, 14, -2, 2);
        const std::vector<float> p = random_floats(static_cast<size_t>(n), 15, 0, 1);
        const std::vector<float> out0 = random_floats(static_cast<size_t>(head_dim), 16);
        std::vector<uint16_t> kv(kf.size());
        for (size_t i = 0; i < kf.size(); ++i) kv[i] = fp32_to_fp16(kf[i]);
        for (Isa isa : supported_isas()) {
            std::vector<float> s(static_cast<size_t>(n));
            attn_scores_f16(isa, q.data(), kv.data(), stride, n, head_dim, 0.125f, s.data());
            for (int64_t j = 0; j < n; ++j) {
                const float want = 0.125f * dot_f32_f16(isa, q.data(), kv.data() + j * stride, head_dim);
                ASSERT_EQ(bits(s[j]), bits(want)) << isa_str(isa) << " head_dim " << head_dim << " j " << j;
            }
            std::vector<float> got = out0, want = out0;
            attn_accum_f16(isa, p.data(), kv.data(), stride, n, head_dim, got.data());
            for (int64_t j = 0; j < n; ++j) axpy_f16(isa, p[j], kv.data() + j * stride, want.data(), head_dim);
            ASSERT_EQ(0, std::memcmp(got.data(), want.data(), want.size() * 4)) << isa_str(isa) << " head_dim " << head_dim;
        }
    }
}

}  // namespace
TEST(RowOps, RopeNeoxMatchesFloat64AndIsIdenticalAcrossIsas) {
    const int head_dim = 64;
    for (int rot_dim : {64, 32}) {
        for (int64_t pos : {0, 3, 4095}) {
            std::vector<float> inv(static_cast<size_t>(rot_dim / 2));
            for (int i = 0; i < rot_dim / 2; ++i) inv[i] = static_cast<float>(std::pow(1e6, -2.0 * i / rot_dim));
            const std::vector<float> x0 = random_floats(2 * head_dim, static_cast<uint32_t>(pos) + 11);
            std::vector<float> first;
            for (Isa isa : supported_isas()) {
                std::vector<float> x = x0;
                rope_neox(isa, x.data(), 2, head_dim, rot_dim, pos, inv.data());
                const int half = rot_dim / 2;
                for (int h = 0; h < 2; ++h) {
                    const float* in = x0.data() + h * head_dim;
                    const float* out = x.data() + h * head_dim;
                    for (int i = 0; i < half; ++i) {
                        const double th = static_cast<double>(pos) * inv[i];
                        // NEOX pairs value i with value i + rot_dim/2.
                        ASSERT_NEAR(out[i], in[i] * std::cos(th) - in[i + half] * std::sin(th), 1e-6);
                        ASSERT_NEAR(out[i + half], in[i] * std::sin(th) + in[i + half] * std::cos(th), 1e-6);
                    }
                    for (int i = rot_dim; i < head_dim; ++i) ASSERT_EQ(out[i], in[i]);
                }
                if (first.empty()) {
                    first = x;
                } else {
                    ASSERT_EQ(0, std::memcmp(first.data(), x.data(), x.size() * 4)) << isa_str(isa);
                }
            }
        }
    }
}

TEST(RowOps, RoundFp16EqualsConversionRoundTripAtEveryIsa) {
    for (int64_t n : {1, 7, 16, 33, 1000}) {
        std::vector<float> x0 = random_floats(static_cast<size_t>(n), static_cast<uint32_t>(n));
        x0[0] = 65520.0f;  // rounds to inf in f16
        if (n > 3) {
            x0[1] = 1e-8f;  // f16 denormal range
            x0[2] = -0.0f;
        }
        for (Isa isa : supported_isas()) {
            std::vector<float> x = x0;
            round_fp16(isa, x.data(), n);
            for (int64_t i = 0; i < n; ++i) {
                const float want = fp16_to_fp32(fp32_to_fp16(x0[i]));
                ASSERT_EQ(0, std::memcmp(&want, &x[i], 4)) << isa_str(isa) << " i " << i << " x " << x0[i];
            }
        }
    }
}

TEST(RowOps, ReadFoldIsTheXorOfTheBytesAtEveryIsa) {
    std::vector<uint8_t> buf(10000);
    for (size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<uint8_t>(i * 131 + 7);
    for (size_t n : {size_t{0}, size_t{1}, size_t{63}, size_t{256}, size_t{1000}, size_t{9999}}) {
        // The fold of a buffer is an xor of 64-bit words and bytes: compare folds
        // folded down to one byte, which every grouping of the xor agrees on.
        uint8_t want = 0;
        for (size_t i = 0; i < n; ++i) want ^= buf[i];
        for (Isa isa : supported_isas()) {
            uint64_t f = read_fold(isa, buf.data(), n);
            uint8_t got = 0;
            for (int b = 0; b < 8; ++b) got ^= static_cast<uint8_t>(f >> (8 * b));
            ASSERT_EQ(got, want) << isa_str(isa) << " n " << n;
        }
    }
}

// ---------------------------------------------------------------------------
// Quantized KV rows

// Value of an e4m3 ("fn") byte from its fields, in double: the definition.
double e4m3_value(unsigned b) {
    const int s = (b >> 7) & 1, e = (b >> 3) & 15, m = b & 7;
    const double sign = s ? -1.0 : 1.0;
    if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
    if (e == 0) return sign * std::ldexp(m, -9);
    return sign * std::ldexp(8 + m, e - 10);
}

TEST(Fp8, EveryByteDecodesToItsDefinition) {
    for (unsigned b = 0; b < 256; ++b) {
        const double want = e4m3_value(b);
        const float got = fp8_e4m3_to_fp32(static_cast<uint8_t>(b));
        if (std::isnan(want)) {
            EXPECT_TRUE(std::isnan(got)) << b;
        } else {
            EXPECT_EQ(static_cast<double>(got), want) << b;
        }
    }
}

// Encoding: the nearest finite e4m3 value by brute force over all 254 of them, ties
// to the even mantissa, and anything beyond 448 saturated; checked on every float
// between the codes' midpoints, around them and at random.
TEST(Fp8, EncodingIsNearestEvenAndSaturates) {
    auto nearest = [](float f) -> unsigned {
        if (std::isnan(f)) return 0x7F;
        const double x = f;
        unsigned best = 0;
        double best_d = INFINITY;
        for (unsigned b = 0; b < 256; ++b) {
            const double v = e4m3_value(b);
            if (std::isnan(v)) continue;
            if ((b == 0x80) != std::signbit(x) && v == 0.0) continue;  // the zero of x's sign
            const double d = std::fabs(v - x);
            if (d < best_d || (d == best_d && (b & 1) == 0 && (best & 1) == 1)) {
                best = b;
                best_d = d;
            }
        }
        return best;
    };
    std::vector<float> xs = {0.0f, -0.0f, 448.0f, -448.0f, 464.0f, 1e30f, -INFINITY, INFINITY, 0x1p-10f, 0x1p-9f,
                             0x1.8p-9f, 0x1p-6f, 0x1.1p-6f, 1.0f, 1.0625f, 1.1875f, 3.0e-3f};
    for (unsigned b = 0; b < 255; ++b) {
        const double v = e4m3_value(b), w = e4m3_value(b + 1);
        if (std::isnan(v) || std::isnan(w) || (b & 0x7F) == 0x7F) continue;
        const float mid = static_cast<float>((v + w) / 2);
        xs.push_back(mid);
        xs.push_back(std::nextafter(mid, INFINITY));
        xs.push_back(std::nextafter(mid, -INFINITY));
        xs.push_back(static_cast<float>(v));
    }
    for (float r : random_floats(20000, 41, -500, 500)) xs.push_back(r);
    for (float r : random_floats(20000, 42, -0.02f, 0.02f)) xs.push_back(r);
    for (float x : xs) {
        const unsigned want = std::fabs(x) >= 448.0f ? (std::signbit(x) ? 0xFEu : 0x7Eu) : nearest(x);
        ASSERT_EQ(fp32_to_fp8_e4m3(x), want) << x;
    }
    EXPECT_EQ(fp32_to_fp8_e4m3(std::numeric_limits<float>::quiet_NaN()) & 0x7F, 0x7F);
}

// A row's scale is its largest magnitude over the type's top value; every value
// comes back within half a step (int8) or half an ulp of e4m3 (relative 2^-4,
// absolute near zero) of the original; the largest one exactly.
TEST(KvQuantRow, ScaleAndRoundTripBounds) {
    for (KvQuant t : {KvQuant::Int8, KvQuant::Fp8}) {
        for (int64_t n : {64, 128, 7}) {
            std::vector<float> x = random_floats(static_cast<size_t>(n), 50 + static_cast<uint32_t>(n), -3, 3);
            x[3 % n] = -5.5f;  // the largest magnitude, negative
            std::vector<uint8_t> q(static_cast<size_t>(n));
            const float s = quantize_kv_row(t, x.data(), n, q.data());
            const double top = t == KvQuant::Int8 ? 127.0 : 448.0;
            ASSERT_FLOAT_EQ(s, static_cast<float>(5.5 / top));
            for (int64_t i = 0; i < n; ++i) {
                const double back = static_cast<double>(s) *
                                    (t == KvQuant::Int8 ? static_cast<int8_t>(q[i]) : e4m3_value(q[i]));
                const double tol = t == KvQuant::Int8 ? 0.5 * s * 1.0001 : std::fabs(x[i]) / 16 + s * std::ldexp(1, -10);
                ASSERT_NEAR(back, x[i], tol) << (t == KvQuant::Int8 ? "int8" : "fp8") << " i " << i;
            }
            ASSERT_NEAR(static_cast<double>(s) * (t == KvQuant::Int8 ? static_cast<int8_t>(q[3 % n]) : e4m3_value(q[3 % n])),
                        -5.5, 1e-5);
        }
        std::vector<float> zeros(64, 0.0f);
        std::vector<uint8_t> q(64, 0xAB);
        EXPECT_EQ(quantize_kv_row(t, zeros.data(), 64, q.data()), 0.0f);
        for (uint8_t b : q) ASSERT_EQ(b, 0);
        // Values so small that 1 / scale overflows: zeros too, not NaN.
        std::vector<float> tiny(64, 0.0f);
        tiny[5] = 1e-38f;
        tiny[9] = -3e-39f;
        std::fill(q.begin(), q.end(), 0xAB);
        EXPECT_EQ(quantize_kv_row(t, tiny.data(), 64, q.data()), 0.0f);
        for (uint8_t b : q) ASSERT_EQ(b, 0);
    }
}

// attn_scores_q / attn_accum_q at every level against float64 over the decoded,
// scaled rows, on strided rows of several head sizes.
TEST(RowOps, QuantizedAttentionMatchesFloat64AtEveryIsa) {
    for (KvQuant t : {KvQuant::Int8, KvQuant::Fp8}) {
        for (int64_t head_dim : {64, 128, 80, 7}) {
            const int64_t n = 19;
            const size_t stride = static_cast<size_t>(head_dim) + 9;
            const std::vector<float> q = random_floats(static_cast<size_t>(head_dim), 61, -2, 2);
            const std::vector<float> p = random_floats(static_cast<size_t>(n), 62, 0, 1);
            const std::vector<float> out0 = random_floats(static_cast<size_t>(head_dim), 63);
            std::vector<uint8_t> k(stride * n), v(stride * n);
            std::vector<float> ks(static_cast<size_t>(n)), vs(static_cast<size_t>(n));
            for (int64_t j = 0; j < n; ++j) {
                const std::vector<float> kr = random_floats(static_cast<size_t>(head_dim), 70 + static_cast<uint32_t>(j), -4, 4);
                const std::vector<float> vr = random_floats(static_cast<size_t>(head_dim), 90 + static_cast<uint32_t>(j), -1, 1);
                ks[j] = quantize_kv_row(t, kr.data(), head_dim, k.data() + j * stride);
                vs[j] = quantize_kv_row(t, vr.data(), head_dim, v.data() + j * stride);
            }
            auto dec = [&](uint8_t b) { return t == KvQuant::Int8 ? static_cast<double>(static_cast<int8_t>(b)) : e4m3_value(b); };
            for (Isa isa : supported_isas()) {
                std::vector<float> sc(static_cast<size_t>(n));
                attn_scores_q(isa, t, q.data(), k.data(), ks.data(), stride, n, head_dim, 0.125f, sc.data());
                for (int64_t j = 0; j < n; ++j) {
                    double dot = 0, mag = 0;
                    for (int64_t i = 0; i < head_dim; ++i) {
                        const double e = q[i] * dec(k[j * stride + i]) * ks[j];
                        dot += e;
                        mag += std::fabs(e);
                    }
                    ASSERT_NEAR(sc[j], 0.125 * dot, 1e-6 * mag) << isa_str(isa) << " head_dim " << head_dim << " j " << j;
                    // A key's score does not depend on the keys computed beside it.
                    float alone = 0;
                    attn_scores_q(isa, t, q.data(), k.data() + j * stride, ks.data() + j, stride, 1, head_dim, 0.125f,
                                  &alone);
                    ASSERT_EQ(bits(alone), bits(sc[j])) << isa_str(isa) << " head_dim " << head_dim << " j " << j;
                }
                std::vector<float> out = out0;
                attn_accum_q(isa, t, p.data(), v.data(), vs.data(), stride, n, head_dim, out.data());
                for (int64_t i = 0; i < head_dim; ++i) {
                    double want = out0[i], mag = std::fabs(out0[i]);
                    for (int64_t j = 0; j < n; ++j) {
                        want += static_cast<double>(p[j]) * vs[j] * dec(v[j * stride + i]);
                        mag += std::fabs(static_cast<double>(p[j]) * vs[j] * dec(v[j * stride + i]));
                    }
                    ASSERT_NEAR(out[i], want, 1e-6 * mag) << isa_str(isa) << " head_dim " << head_dim << " i " << i;
                }
            }
        }
    }
}

}  // namespace duet::cpu
