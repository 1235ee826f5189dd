// CUDA device discovery, callable from host code compiled without nvcc.
#pragma once

#include <string>

namespace duet::cuda {

// Number of usable CUDA devices; 0 when there is no driver or no GPU.
int device_count();
// "NVIDIA H200 (sm_90, 141 GiB)" or the CUDA error string.
std::string device_name(int device);
// The device's PCI address as sysfs names it ("0000:3b:00.0", lower case); "" on error.
std::string pci_bus_id(int device);
// Runs a tiny kernel on the device and checks its result: a real launch, not a query.
bool smoke_test(int device, std::string* error);

}  // namespace duet::cuda
