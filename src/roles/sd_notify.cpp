#include "roles/sd_notify.h"

#include <systemd/sd-daemon.h>

#include <cstdlib>

#include <fmt/format.h>

namespace duet {

namespace {
SdNotify g_notify;
}

SdNotify& SdNotify::init() {
    SdNotify& n = g_notify;
    const char* sock = std::getenv("NOTIFY_SOCKET");
    n.enabled_ = sock != nullptr && *sock != '\0';
    uint64_t usec = 0;
    // > 0: on for this process (WATCHDOG_PID absent or ours).
    n.watchdog_usec_ = n.enabled_ && sd_watchdog_enabled(0, &usec) > 0 ? usec : 0;
    n.last_ping_ns_ = 0;
    return n;
}

SdNotify& SdNotify::get() { return g_notify; }

// libsystemd's sd_notify: the socket (abstract or path), credentials and the datagram
// done as systemd expects; our own would be a reimplementation of its protocol.
void SdNotify::send(const std::string& message) {
    if (!enabled_) return;
    (void)sd_notify(0, message.c_str());
}

void SdNotify::ready(const std::string& status) { send(fmt::format("READY=1\nSTATUS={}", status)); }

void SdNotify::status(const std::string& status) { send("STATUS=" + status); }

void SdNotify::extend_timeout(uint64_t usec) { send(fmt::format("EXTEND_TIMEOUT_USEC={}", usec)); }

void SdNotify::stopping(const std::string& status) { send(fmt::format("STOPPING=1\nSTATUS={}", status)); }

void SdNotify::watchdog(uint64_t now_ns) {
    if (watchdog_usec_ == 0) return;
    if (last_ping_ns_ != 0 && now_ns - last_ping_ns_ < watchdog_usec_ * 1000 / 4) return;
    last_ping_ns_ = now_ns;
    send("WATCHDOG=1");
}

}  // namespace duet
