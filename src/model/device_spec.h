// Which device a process computes on: "cpu" or "cuda:N" ("cuda" is cuda:0), as the
// --device option of `duet run`, `duet prefill` and `duet decode` takes it.
#pragma once

#include <string>

#include "base/result.h"

namespace duet {

struct DeviceSpec {
    bool cuda = false;
    int index = 0;  // the CUDA device ordinal when cuda
    std::string name() const { return cuda ? "cuda:" + std::to_string(index) : "cpu"; }
    friend bool operator==(const DeviceSpec&, const DeviceSpec&) = default;
};

// Parses "cpu", "cuda" or "cuda:N" (N >= 0). An error names what was expected.
Result<DeviceSpec> parse_device(const std::string& s);

// The device queries (is it there, its PCI address, its memory) are in
// engine/backends.h, the one place that knows whether this build has CUDA.

}  // namespace duet
