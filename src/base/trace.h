// Ranges on the Nsight Systems timeline (NVTX), for the steps a profile of serving
// wants to see: prefill passes, decode steps, hand-offs. Built in when the CUDA
// toolkit's header-only NVTX v3 is found (DUET_NVTX); a range then costs one
// predictable branch while no tool is attached. Without it, ranges are nothing.
#pragma once

namespace duet::trace {

// Whether this build emits NVTX ranges.
bool compiled_in();

// A range from construction to destruction on this thread's timeline; `what` must
// outlive it (a string literal).
class Range {
public:
    explicit Range(const char* what);
    ~Range();
    Range(const Range&) = delete;
    Range& operator=(const Range&) = delete;
};

}  // namespace duet::trace
