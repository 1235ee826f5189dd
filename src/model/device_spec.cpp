#include "model/device_spec.h"

#include <charconv>

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

}  // namespace duet
