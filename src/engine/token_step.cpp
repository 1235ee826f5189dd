#include "engine/token_step.h"

namespace duet {

Finish check_stop(const StopRules& r, bool eog, size_t n_out) {
    if (r.stop_at_eog && eog) return Finish::Eog;
    if (n_out >= r.max_tokens) return Finish::Length;
    return Finish::None;
}

bool eog_banned(const StopRules& r, size_t n_out) { return r.stop_at_eog && n_out < r.min_tokens; }

std::string_view finish_reason(Finish f) {
    switch (f) {
    case Finish::Length: return "length";
    case Finish::Eog:
    case Finish::StopString: return "stop";
    case Finish::Timeout: return "timeout";
    case Finish::Cancelled: return "cancelled";
    case Finish::None:
    case Finish::Failed: break;
    }
    return "";
}

}  // namespace duet
