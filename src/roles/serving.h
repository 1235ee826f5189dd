// What the serving roles share, by concept: the instance layout and wire format
// (roles/wire.h), routing to prefill and decode (roles/routing.h), and the recovery
// of requests when processes die (roles/recovery.h). Code in src/ includes the one
// it needs; this header is for the tests and tools that use them all.
#pragma once

#include "roles/recovery.h"
#include "roles/routing.h"
#include "roles/wire.h"
