// Telling systemd how a role is doing (sd_notify(3) through libsystemd): READY=1 once
// it serves, STATUS= lines while loading and serving, EXTEND_TIMEOUT_USEC= while a
// big model loads, WATCHDOG=1 while the role shows progress (the front's event loop
// turning; a worker's loop turning or its pass computing: WorkerBase::watch_liveness),
// so that a wedge, not a long pass, is what trips WatchdogSec=; STOPPING=1 when it
// drains.
//
// Off (every call a no-op) unless the process was started with NOTIFY_SOCKET set, as
// a Type=notify unit is. The watchdog is on when WATCHDOG_USEC is set and
// WATCHDOG_PID, if set, names this process (sd_watchdog_enabled(3)).
//
// The launcher (`duet serve` as one unit) is the unit's main process: the roles it
// starts get an environment without NOTIFY_SOCKET and WATCHDOG_* (Supervisor::spawn),
// so they stay silent (systemd would drop their messages under NotifyAccess=main).
#pragma once

#include <cstdint>
#include <string>

namespace duet {

class SdNotify {
public:
    // Reads the environment once.
    static SdNotify& init();
    static SdNotify& get();  // after init (an uninitialized one is off)

    bool enabled() const { return enabled_; }
    uint64_t watchdog_usec() const { return watchdog_usec_; }  // 0: no watchdog

    void ready(const std::string& status);
    void status(const std::string& status);
    // "Give me `usec` more to start (or stop)" from now on (EXTEND_TIMEOUT_USEC).
    void extend_timeout(uint64_t usec);
    void stopping(const std::string& status);
    // WATCHDOG=1 at most every watchdog_usec / 4; from one thread (not thread-safe).
    void watchdog(uint64_t now_ns);
    // The raw message, for anything else (tests; "ERRNO=", ...).
    void send(const std::string& message);

private:
    bool enabled_ = false;
    uint64_t watchdog_usec_ = 0;
    uint64_t last_ping_ns_ = 0;
};

}  // namespace duet
