// One time scale for every time bound a C++ test sets: DUET_TIME_SCALE (default 1; the
// sanitizer runs of `make test` set 4 under ASan, 10 under TSan), so that a bound
// that holds on an idle machine is not a coin toss on a loaded 2-core one under a
// sanitizer. Bounds that catch a wrong complexity or a missed wake-up stay far from
// the figures measured (each test says what it measured); the scale only widens them.
#pragma once

#include <cstdint>
#include <cstdlib>

namespace duet::test_time {

inline double scale() {
    const char* v = std::getenv("DUET_TIME_SCALE");
    const double s = v ? std::atof(v) : 1.0;
    return s >= 1.0 ? s : 1.0;
}

// `ns` widened by the scale.
inline uint64_t scaled_ns(uint64_t ns) { return static_cast<uint64_t>(static_cast<double>(ns) * scale()); }

}  // namespace duet::test_time
