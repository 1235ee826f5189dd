#include "roles/stop_text.h"

#include <algorithm>

namespace duet {

StopText::StopText(std::vector<std::string> stops) : stops_(std::move(stops)) {
    for (const std::string& s : stops_) hold_ = std::max(hold_, s.size());
}

bool StopText::append(std::string_view piece, bool check) {
    if (stopped_) return false;
    const size_t old = text_.size();
    text_ += piece;
    if (!check) return false;
    // A match ends in the new text (one that ended before was found then, or was not
    // looked for), so it starts at most its length less one before it: in what take()
    // held back. The text ends before the one that begins first.
    size_t cut = std::string::npos;
    for (const std::string& s : stops_)
        if (!s.empty()) cut = std::min(cut, text_.find(s, old + 1 > s.size() ? old + 1 - s.size() : 0));
    if (cut == std::string::npos) return false;
    text_.resize(cut);
    stopped_ = true;
    return true;
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
