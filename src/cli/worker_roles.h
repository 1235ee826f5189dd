// `duet prefill` and `duet decode`: a worker process attached to a running
// instance by name (the launcher or a test creates the instance; the worker reads
// its layout from the control segment). Runs until SIGTERM or SIGINT. Its settings
// and flags: roles/launcher.h WorkerSettings, cli/role_flags.h.
#pragma once

#include "roles/launcher.h"

namespace duet {

int cmd_worker(const WorkerSettings& a, bool prefill);

}  // namespace duet
