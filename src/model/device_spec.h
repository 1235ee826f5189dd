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

// Whether this build has the CUDA backend (DUET_CUDA at configure time).
bool cuda_built();

// An error unless d is the CPU or a CUDA device this process can see ("cuda:3: no
// such device (2 CUDA devices visible)").
Status check_device(const DeviceSpec& d);

// The PCI address of CUDA device d ("0000:3b:00.0", as /sys/bus/pci/devices names
// it): how a CUDA ordinal, which CUDA_VISIBLE_DEVICES renumbers, is matched with the
// machine's GPUs for placement. "" when it cannot be told.
std::string cuda_pci_address(const DeviceSpec& d);

// The memory of CUDA device d in bytes (no context is created); an error when it
// cannot be told.
Result<uint64_t> cuda_total_memory(const DeviceSpec& d);

}  // namespace duet
