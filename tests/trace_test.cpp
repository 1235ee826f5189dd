// NVTX ranges reach a profiler: this test is the tool, linked in statically (NVTX's
// static injection: a strong InitializeInjectionNvtx2_fnptr), and records what the
// code pushes and pops.
#include "base/trace.h"

#include <string>
#include <vector>

#include <gtest/gtest.h>

#if DUET_NVTX
#include <cstdint>
// This file provides the static injection symbol (declared before NVTX's loader
// refers to it; NVTX_API is empty on Linux).
#define NVTX_STATIC_INJECTION_IMPL
extern "C" int (*InitializeInjectionNvtx2_fnptr)(const void* (*)(uint32_t));
#include <nvtx3/nvToolsExt.h>

namespace {
std::vector<std::string> g_events;
int push(const char* what) {
    g_events.push_back(std::string("push ") + what);
    return static_cast<int>(g_events.size());
}
int pop() {
    g_events.push_back("pop");
    return 0;
}
int NVTX_API init(NvtxGetExportTableFunc_t get) {
    auto* cb = static_cast<const NvtxExportTableCallbacks*>(get(NVTX_ETID_CALLBACKS));
    if (!cb) return 0;
    NvtxFunctionTable table = nullptr;
    unsigned int size = 0;
    if (!cb->GetModuleFunctionTable(NVTX_CB_MODULE_CORE, &table, &size) || !table) return 0;
    if (size <= NVTX_CBID_CORE_RangePop) return 0;
    *table[NVTX_CBID_CORE_RangePushA] = reinterpret_cast<NvtxFunctionPointer>(&push);
    *table[NVTX_CBID_CORE_RangePop] = reinterpret_cast<NvtxFunctionPointer>(&pop);
    return 1;
}
}  // namespace

extern "C" {
int (*InitializeInjectionNvtx2_fnptr)(const void* (*)(uint32_t)) = &init;
}
#endif

TEST(Trace, RangesReachTheProfiler) {
#if !DUET_NVTX
    EXPECT_FALSE(duet::trace::compiled_in());
    GTEST_SKIP() << "built without NVTX (no CUDA toolkit)";
#else
    ASSERT_TRUE(duet::trace::compiled_in());
    {
        duet::trace::Range outer("decode step");
        duet::trace::Range inner("handoff");
    }
    EXPECT_EQ(g_events, (std::vector<std::string>{"push decode step", "push handoff", "pop", "pop"}));
#endif
}
