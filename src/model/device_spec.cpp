#include "model/device_spec.h"

#include <charconv>

#if DUET_HAVE_CUDA
#include "kernels/cuda/device.h"
#include "kernels/cuda/vmm.h"
#endif

namespace duet {

Result<DeviceSpec> parse_device(const std::string& s) {
    DeviceSpec d;
    if (s.empty() || s == "cpu") return d;
    if (s == "cuda") {
        d.cuda = true;
        return d;
    }
    if (s.rfind("cuda:", 0) == 0 && s.size() > 5) {
        const char* b = s.data() + 5;
        const char* e = s.data() + s.size();
        int v = -1;
        auto [p, ec] = std::from_chars(b, e, v);
        if (ec == std::errc() && p == e && v >= 0) {
            d.cuda = true;
            d.index = v;
            return d;
        }
    }
    return make_error("unknown device '{}': expected cpu, cuda or cuda:N", s);
}

Status check_device(const DeviceSpec& d) {
    if (!d.cuda) return {};
#if DUET_HAVE_CUDA
    const int n = cuda::device_count();
    if (d.index >= n) return make_error("{}: no such device ({} CUDA device{} visible)", d.name(), n, n == 1 ? "" : "s");
    return {};
#else
    return make_error("device {}: this duet was built without CUDA (configure with -DDUET_CUDA=ON)", d.name());
#endif
}

std::string cuda_pci_address(const DeviceSpec& d) {
#if DUET_HAVE_CUDA
    if (d.cuda) return cuda::pci_bus_id(d.index);
#else
    (void)d;
#endif
    return "";
}

Result<uint64_t> cuda_total_memory(const DeviceSpec& d) {
#if DUET_HAVE_CUDA
    std::string why;
    const size_t n = d.cuda ? cuda::device_total_memory(d.index, &why) : 0;
    if (n == 0) return make_error("{}: its memory size cannot be told: {}", d.name(), d.cuda ? why : "not a GPU");
    return static_cast<uint64_t>(n);
#else
    return make_error("{}: this duet was built without CUDA", d.name());
#endif
}

bool cuda_built() {
#if DUET_HAVE_CUDA
    return true;
#else
    return false;
#endif
}

}  // namespace duet
