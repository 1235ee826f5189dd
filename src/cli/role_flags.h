// The flags of `duet serve`, `duet front`, `duet prefill` and `duet decode`, and
// the argv the launcher starts a child with, in one place: role_argv writes each
// setting under the same flag name add_worker_flags / add_front_flags parse it
// from, and tests/role_flags_test.cpp checks that every setting survives the trip.
#pragma once

#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "roles/launcher.h"

namespace duet {

void add_serve_flags(CLI::App& app, ServeSettings& s);
void add_front_flags(CLI::App& app, FrontSettings& s);
// prefill: also the prefill-only flags (--prefill-budget, --no-prefix-cache).
void add_worker_flags(CLI::App& app, WorkerSettings& s, bool prefill);

// The argv of a launcher's child: argv[0] the executable, argv[1] the subcommand
// (r.role), then every setting of r.settings.
std::vector<std::string> role_argv(const std::string& exe, const RoleLaunch& r);

}  // namespace duet
