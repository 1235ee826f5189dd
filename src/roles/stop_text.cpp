#include "roles/stop_text.h"

#include <algorithm>

namespace duet {

StopText::StopText(std::vector<std::string> stops) : stops_(std::move(stops)) {
    for (const std::string& s : stops_) hold_ = std::max(hold_, s.size());
}

bool StopText::append(std::string_view piece) {
    if (stopped_) return false;
    text_ += piece;
    // A match can only end in the new text and only start in text not yet streamed
    // or the stop string's length before it (what take() held back).
    for (const std::string& s : stops_) {
        const size_t at = text_.find(s, taken_ > s.size() ? taken_ - s.size() : 0);
        if (at != std::string::npos) {
            text_.resize(at);
            stopped_ = true;
        }
    }
    return stopped_;
}

std::string StopText::take(bool all) {
    size_t safe = (all || stopped_) ? text_.size() : (text_.size() > hold_ ? text_.size() - hold_ : 0);
    // Never split a UTF-8 character when holding back.
    while (safe > taken_ && safe < text_.size() && (static_cast<unsigned char>(text_[safe]) & 0xC0) == 0x80) --safe;
    if (safe <= taken_) return {};
    std::string out = text_.substr(taken_, safe - taken_);
    taken_ = safe;
    return out;
}

}  // namespace duet
