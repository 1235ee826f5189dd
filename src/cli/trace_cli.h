// `duet trace summary FILE [--json]`: a trace file (src/base/trace.h: Chrome's
// trace-event JSON, written with --trace or DUET_TRACE) as a table: per process name
// and range name, how many, total, mean, p50, p99 (nearest rank) and largest
// duration. A file that was not closed (its writer killed: it ends in ",") is read
// too, and a line a killed writer tore is skipped and counted on stderr.
#pragma once

#include <string>
#include <vector>

#include "base/result.h"

namespace duet {

struct TraceRow {
    std::string process, name;
    size_t count = 0;
    double total_ms = 0, mean_ms = 0, p50_ms = 0, p99_ms = 0, max_ms = 0;
};

// The rows of a trace file's text, by process (in name order), then by total time,
// largest first: a whole trace-event JSON document, or duet's file read line by
// line (not closed, or with torn lines: how many were skipped into *torn). Errors:
// no event parses.
Result<std::vector<TraceRow>> summarize_trace(const std::string& text, size_t* torn = nullptr);

int cmd_trace_summary(const std::string& file, bool json);

}  // namespace duet
