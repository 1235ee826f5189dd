#include "base/trace.h"

#if DUET_NVTX
#include <nvtx3/nvToolsExt.h>
#endif

namespace duet::trace {

#if DUET_NVTX
bool compiled_in() { return true; }
Range::Range(const char* what) { nvtxRangePushA(what); }
Range::~Range() { nvtxRangePop(); }
#else
bool compiled_in() { return false; }
Range::Range(const char*) {}
Range::~Range() {}
#endif

}  // namespace duet::trace
