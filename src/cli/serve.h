// `duet serve`: the launcher (roles/launcher.h: the plan, the children's settings,
// the supervision states). This side reads the facts plan_serve needs (the model,
// hwloc's topology, the GPUs), resolves --port 0, and runs the launcher with the
// argv of src/cli/role_flags.h.
//
// `duet front`: the HTTP front of a running instance (the OpenAI API); drains on
// SIGTERM.
#pragma once

#include <string>

#include "roles/launcher.h"

namespace duet {

// `duet serve` (RoleStart::Children) and `duet instance` (RoleStart::External: the
// instance and its supervision, the roles started by systemd's units).
int cmd_serve(const ServeSettings& s, RoleStart start = RoleStart::Children);
int cmd_front(const FrontSettings& s);

struct SystemdArgs {
    std::string out = "duet-systemd";           // generate: where; install: from where
    std::string exe = "/usr/local/bin/duet";    // generate: the binary the units run
    std::string root;                           // install: a root other than / (tests, images)
    std::string xml;                            // generate: plan for the machine of this hwloc XML export
    double gpu_memory_gib = 0;                  // generate --xml: each GPU's memory where the export lacks it
};
// `duet systemd generate`: the units of systemd/ and, from this machine's plan (the
// same as duet serve's), the drop-ins with each role's cores, NUMA node and device,
// the target's workers, and /etc/duet/duet.env. `duet systemd install`: copies them
// into place (ROOT/etc/systemd/system, ROOT/etc/duet).
int cmd_systemd_generate(const ServeSettings& s, const SystemdArgs& a);
int cmd_systemd_install(const SystemdArgs& a);

}  // namespace duet
