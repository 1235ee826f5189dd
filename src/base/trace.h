// Ranges on a timeline, for the steps a profile of serving wants to see: prefill
// passes, decode steps and their phases, hand-offs. Two sinks, either or both:
// - NVTX (the Nsight Systems timeline): built in when the CUDA toolkit's
//   header-only NVTX v3 is found (DUET_NVTX); a range then costs one predictable
//   branch while no tool is attached.
// - duet's own trace file, in Chrome's trace-event JSON (it opens in Perfetto and
//   chrome://tracing): on when the process opened one (`duet serve --trace FILE` for
//   its roles, `duet bench cuda --trace FILE`, or DUET_TRACE=FILE in the environment
//   of a front, prefill or decode process: a systemd unit's). Each
//   range is then a complete event ("ph":"X") with the process's pid and the
//   thread's tid; events are buffered per process and appended to the file in whole
//   lines (O_APPEND: the processes of one instance share it), at most every 200 ms
//   or 64 KiB and at exit. Timestamps are CLOCK_MONOTONIC microseconds, one clock for
//   every process of the machine. A process killed loses at most its last 200 ms;
//   one killed inside a write can leave its last line torn, which `duet trace
//   summary FILE` (src/cli/trace_cli.h) skips and Perfetto does not (delete it).
// The file is a JSON array: the first process to open it writes "[", and
// finish_file() closes it ("]") once every process writing to it is gone; a file
// not closed (a killed server) ends in ",\n", which the trace-event format allows
// (its array's closing bracket is optional) and `duet trace summary` reads.
#pragma once

#include <cstdint>
#include <string>

#include "base/result.h"

namespace duet::trace {

// Whether this build emits NVTX ranges.
bool compiled_in();

// A range from construction to destruction on this thread's timeline; `what` must
// outlive it (a string literal) and hold no '"' or '\\'.
class Range {
public:
    explicit Range(const char* what);
    ~Range();
    Range(const Range&) = delete;
    Range& operator=(const Range&) = delete;

private:
    const char* what_;
    uint64_t t0_ = 0;  // 0: no trace file was open when it began
};

// Starts a trace file at path: replaces what is there with the array's opening.
Status start_file(const std::string& path);
// This process's events go to path from now on (created and opened as by
// start_file if it does not exist yet), shown in the viewer as `process` (a
// process_name record). One file per process; a second open() replaces the first.
Status open(const std::string& path, const std::string& process);
// open(DUET_TRACE, process) when DUET_TRACE is set and not empty; else nothing.
Status open_from_env(const std::string& process);
// Whether this process writes a trace file.
bool active();
// A range on this thread's timeline measured by the caller (from start_ns to end_ns,
// CLOCK_MONOTONIC): for work known to be worth a range only once it is done. Nothing
// without a trace file (NVTX sees none).
void span(const char* what, uint64_t start_ns, uint64_t end_ns);
// An event measured elsewhere (a device's timings: CUDA events), on its own track
// `track` (a name shown as a thread of this process): from start_ns (CLOCK_MONOTONIC)
// for dur_ns. Nothing without a trace file.
void event(const char* what, uint64_t start_ns, uint64_t dur_ns, const char* track);
// Writes what is buffered now (also done at exit and every 200 ms).
void flush();
// Closes the array at path (an instant event "trace end", then "]"), after this
// process's own events (it writes none after); the caller makes sure no other
// process writes to it any more.
Status finish_file(const std::string& path);
// CLOCK_MONOTONIC in nanoseconds (the trace's clock).
uint64_t now_ns();

}  // namespace duet::trace
