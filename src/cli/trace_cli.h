// `duet trace summary FILE [--json]`: a trace file (src/base/trace.h: Chrome's
// trace-event JSON, written with --trace or DUET_TRACE) as a table: per process name
// and range name, how many, total, mean, p50, p99 and largest duration. A file that
// was not closed (its writer killed: it ends in ",") is read too.
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
// largest first. Errors: not a trace-event JSON array.
Result<std::vector<TraceRow>> summarize_trace(const std::string& text);

int cmd_trace_summary(const std::string& file, bool json);

}  // namespace duet
