// NVTX ranges reach a profiler: this test is the tool, linked in statically (NVTX's
// static injection: a strong InitializeInjectionNvtx2_fnptr), and records what the
// code pushes and pops.
#include "base/trace.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

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

// duet's own trace file (base/trace.h): ranges, spans and a device's events as
// complete events of this process, named; strict JSON once finished.
namespace {

std::string temp_path(const char* name) {
    return (std::filesystem::temp_directory_path() / (std::string(name) + "-" + std::to_string(::getpid()) + ".json"))
        .string();
}

nlohmann::json read_json(const std::string& path) {
    std::ifstream in(path);
    std::stringstream ss;
    ss << in.rdbuf();
    return nlohmann::json::parse(ss.str());  // throws unless the whole file is JSON
}

}  // namespace

TEST(TraceFile, RangesSpansAndDeviceEventsAreCompleteEventsOfThisProcess) {
    EXPECT_FALSE(duet::trace::active());
    { duet::trace::Range nothing("before any file"); }  // no file: recorded nowhere
    const std::string path = temp_path("duet-trace-unit");
    ASSERT_TRUE(duet::trace::start_file(path).ok());
    ASSERT_TRUE(duet::trace::open(path, "unit \"test\"").ok());
    EXPECT_TRUE(duet::trace::active());
    const uint64_t t0 = duet::trace::now_ns();
    {
        duet::trace::Range outer("outer");
        duet::trace::Range inner("inner");
    }
    duet::trace::span("measured", t0 + 1'234, t0 + 5'678);
    duet::trace::event("device work", t0 + 10'000, 2'500, "gpu");
    duet::trace::event("device work", t0 + 20'000, 1'000, "gpu");
    ASSERT_TRUE(duet::trace::finish_file(path).ok());
    EXPECT_FALSE(duet::trace::active());
    { duet::trace::Range after("after the end"); }  // not written past the closing bracket

    const nlohmann::json doc = read_json(path);
    ASSERT_TRUE(doc.is_array());
    const int64_t pid = ::getpid();
    std::map<std::string, std::vector<nlohmann::json>> x;
    std::string process, track;
    int64_t track_tid = -1;
    for (const auto& e : doc) {
        const std::string ph = e.at("ph"), name = e.at("name");
        if (ph == "X") x[name].push_back(e);
        if (ph == "M" && name == "process_name" && e.at("pid") == pid) process = e.at("args").at("name");
        if (ph == "M" && name == "thread_name") track = e.at("args").at("name"), track_tid = e.at("tid");
    }
    EXPECT_EQ(process, "unit \"test\"");
    EXPECT_EQ(doc.back().at("name"), "trace end");
    ASSERT_EQ(x["outer"].size(), 1u);
    ASSERT_EQ(x["inner"].size(), 1u);
    EXPECT_EQ(x.count("before any file") + x.count("after the end"), 0u);
    const auto& o = x["outer"][0];
    const auto& i = x["inner"][0];
    EXPECT_EQ(o.at("pid"), pid);
    EXPECT_EQ(o.at("tid"), i.at("tid"));
    EXPECT_LE(o.at("ts").get<double>(), i.at("ts").get<double>());
    EXPECT_GE(o.at("ts").get<double>() + o.at("dur").get<double>(),
              i.at("ts").get<double>() + i.at("dur").get<double>());
    ASSERT_EQ(x["measured"].size(), 1u);
    EXPECT_NEAR(x["measured"][0].at("ts").get<double>(), static_cast<double>(t0 + 1'234) / 1000.0, 0.0015);
    EXPECT_NEAR(x["measured"][0].at("dur").get<double>(), 4.444, 1e-9);
    ASSERT_EQ(x["device work"].size(), 2u);
    EXPECT_EQ(track, "gpu");
    for (const auto& e : x["device work"]) EXPECT_EQ(e.at("tid"), track_tid);
    EXPECT_NEAR(x["device work"][0].at("dur").get<double>(), 2.5, 1e-9);
    std::filesystem::remove(path);
}

// Processes append to one file at once (an instance's roles): every line whole,
// every event there, the file JSON once finished.
TEST(TraceFile, ProcessesAppendToOneFileWithoutTearingLines) {
    const std::string path = temp_path("duet-trace-procs");
    ASSERT_TRUE(duet::trace::start_file(path).ok());
    constexpr int kProcs = 4, kRanges = 3000;  // ~300 KB each: several 64 KiB writes, racing
    std::vector<pid_t> kids;
    for (int k = 0; k < kProcs; ++k) {
        const pid_t p = ::fork();
        ASSERT_GE(p, 0);
        if (p == 0) {
            if (!duet::trace::open(path, "writer " + std::to_string(k)).ok()) ::_exit(2);
            for (int r = 0; r < kRanges; ++r) duet::trace::Range range("a range with a name of some length");
            std::exit(0);  // the rest at exit
        }
        kids.push_back(p);
    }
    for (pid_t p : kids) {
        int status = 0;
        ASSERT_EQ(::waitpid(p, &status, 0), p);
        ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    }
    ASSERT_TRUE(duet::trace::finish_file(path).ok());
    const nlohmann::json doc = read_json(path);
    std::map<int64_t, int> per_pid;
    std::set<std::string> names;
    for (const auto& e : doc) {
        if (e.at("ph") == "X") ++per_pid[e.at("pid").get<int64_t>()];
        if (e.at("ph") == "M") names.insert(e.at("args").at("name").get<std::string>());
    }
    ASSERT_EQ(per_pid.size(), static_cast<size_t>(kProcs));
    for (const auto& [pid, n] : per_pid) EXPECT_EQ(n, kRanges) << "pid " << pid;
    EXPECT_EQ(names, (std::set<std::string>{"writer 0", "writer 1", "writer 2", "writer 3"}));
    std::filesystem::remove(path);
}
