// `duet serve`: the launcher (roles/launcher.h: the plan, the children's settings,
// the supervision states). This side reads the facts plan_serve needs (the model,
// hwloc's topology, the GPUs), resolves --port 0, and runs the launcher with the
// argv of src/cli/role_flags.h.
//
// `duet front`: the HTTP front of a running instance (the OpenAI API); drains on
// SIGTERM.
#pragma once

#include "roles/launcher.h"

namespace duet {

int cmd_serve(const ServeSettings& s);
int cmd_front(const FrontSettings& s);

}  // namespace duet
