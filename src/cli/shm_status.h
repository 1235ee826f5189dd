// `duet shm status NAME [--json]`: what a live instance's shared memory holds —
// processes, KV arenas, requests, rings — read by attaching to it by name.
#pragma once

#include <string>

namespace duet {

int cmd_shm_status(const std::string& instance, bool json);

}  // namespace duet
