// DUET_REQUIRE=avx2,avx512,io_uring,gpu,gpus2: what a designated machine must run.
// A test that would skip for want of one of these (a CPU level, io_uring, a GPU, a
// second GPU) fails there instead, so that a machine meant to cover it cannot pass
// by skipping; elsewhere it skips and says why (never counted as passed).
#pragma once

#include <cstdlib>
#include <string>
#include <string_view>

namespace duet::test_require {

inline bool required(std::string_view what) {
    const char* v = std::getenv("DUET_REQUIRE");
    if (!v) return false;
    std::string_view s(v);
    while (!s.empty()) {
        const size_t comma = s.find(',');
        if (s.substr(0, comma) == what) return true;
        if (comma == std::string_view::npos) break;
        s.remove_prefix(comma + 1);
    }
    return false;
}

}  // namespace duet::test_require

// Skips the test with `why`, or fails it where DUET_REQUIRE names `what`.
#define DUET_SKIP_UNLESS_REQUIRED(what, why)                                                          \
    do {                                                                                              \
        if (::duet::test_require::required(what)) FAIL() << "DUET_REQUIRE names " << (what) << ": " << (why); \
        GTEST_SKIP() << (why);                                                                        \
    } while (0)
