// Recovery of requests when processes die: failing every request in flight when a
// role cannot be restarted, and ending the requests of a front that is gone. (A
// dead worker's requests are re-driven by the supervisor: src/roles/supervisor.h;
// requests stranded on a dead prefill worker's ring are re-sent by
// PrefillRouter::resend_stranded: src/roles/routing.h.)
#pragma once

#include <cstdint>

#include "roles/wire.h"
#include "shm/instance.h"

namespace duet {

// Fails every request in flight (QUEUED, PREFILLING, DECODING) with `why`, and
// wakes the front to answer their clients.
void fail_in_flight(shm::Instance& inst, ReqError why);

// How long a request whose front died waits for a restarted front to adopt it and
// its client to come back (SSE resume with Last-Event-ID, a retry with the same
// X-Request-Id) before it is cancelled: requests with a front record only
// (shm::ReqFrontRecord; every plain completion has one), timed from when a sweep
// first saw their front dead.
inline constexpr uint64_t kResumeWindowNs = 30'000'000'000ull;
// How long a stream whose client disconnected (its front alive) waits for the client
// to come back with Last-Event-ID before it is cancelled (roles/front.h).
inline constexpr uint64_t kResumeGraceNs = 5'000'000'000ull;

// Requests whose client (the front that submitted them) is gone: running ones are
// cancelled, finished ones freed; those with a front record only once they have
// waited `resume_window_ns` for a new front. The launcher calls this after a front
// died, and now and then for those that ended later. Returns how many it touched.
uint32_t sweep_orphans(shm::Instance& inst, uint64_t resume_window_ns = kResumeWindowNs);

}  // namespace duet
