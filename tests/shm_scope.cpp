// Linked into every GoogleTest executable: each test process gets its own shm scope
// (kv/shm_kv.h: shm_scope), so that a default-named instance or a start-up sweep in
// one test never touches the segments of a test running beside it (ctest runs each
// case as a process of its own, -j N at once). A scope set from outside is kept.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>

namespace {

[[maybe_unused]] const bool kScoped = [] {
    if (const char* v = std::getenv("DUET_SHM_SCOPE"); v && *v) return false;
    char scope[24];
    std::snprintf(scope, sizeof scope, "g%d", static_cast<int>(getpid()));
    return setenv("DUET_SHM_SCOPE", scope, 1) == 0;
}();

}  // namespace
