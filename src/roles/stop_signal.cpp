#include "roles/stop_signal.h"

#include <signal.h>

namespace duet {

namespace {
// Process-wide by nature: a signal handler can reach nothing else.
std::atomic<bool> g_stop{false};
static_assert(std::atomic<bool>::is_always_lock_free);  // async-signal-safe to store
// A flag polled by loops; nothing is published with it: relaxed on both sides.
void on_signal(int) { g_stop.store(true, std::memory_order_relaxed); }
}  // namespace

const std::atomic<bool>& StopSignal::install() {
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, nullptr);
    sigaction(SIGINT, &sa, nullptr);
    signal(SIGPIPE, SIG_IGN);
    return g_stop;
}

bool StopSignal::requested() { return g_stop.load(std::memory_order_relaxed); }

}  // namespace duet
