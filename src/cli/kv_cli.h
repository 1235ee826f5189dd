// `duet kv inspect FILE [--json]` and `duet kv verify DIR`: what a KV blob or KV
// log holds and whether the engine would accept it, read with kv/blob.h and
// kv/kv_log.h alone (no model, no arena). Exit status 0 when valid (a log with a
// torn tail is valid: recovery cuts the tail), 1 when not.
#pragma once

#include <string>

namespace duet {

// A .kvblob (magic DUETKVB) or .kvlog (DUETKVL): its header, and for a log every
// valid record, the context's final length and the torn tail or the corruption.
int cmd_kv_inspect(const std::string& path, bool json);
// Every *.kvlog and *.kvblob under dir (recursively; dir may be one file): one
// line each, "ok", "torn tail at N (why)" or "INVALID: why".
int cmd_kv_verify(const std::string& dir);

}  // namespace duet
