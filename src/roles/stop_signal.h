// The process's stop request, one per process: SIGTERM and SIGINT set it (the
// handler stores a flag and nothing else, being async-signal-safe), and SIGPIPE is
// ignored (a write to a closed socket or pipe is then an error return, not a
// death). Every role's command installs it before it starts serving and polls it:
// `duet serve` drains, `duet front` drains, `duet prefill` and `duet decode` stop.
#pragma once

#include <atomic>

namespace duet {

class StopSignal {
public:
    // Installs the handlers (again is harmless) and returns the flag they set.
    static const std::atomic<bool>& install();
    // True once SIGTERM or SIGINT arrived.
    static bool requested();
};

}  // namespace duet
