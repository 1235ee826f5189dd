#include "cli/trace_cli.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <utility>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace duet {

Result<std::vector<TraceRow>> summarize_trace(const std::string& text) {
    // A file its writers did not close ends in ",\n" (trace.h): closed here.
    std::string t = text;
    while (!t.empty() && (t.back() == '\n' || t.back() == ' ' || t.back() == '\r' || t.back() == '\t')) t.pop_back();
    if (!t.empty() && t.back() == ',') t.pop_back();
    if (!t.empty() && t.back() != ']') t += "]";
    nlohmann::json doc = nlohmann::json::parse(t, nullptr, false);
    if (doc.is_discarded()) return make_error("not a trace-event JSON array (it does not parse)");
    if (doc.is_object() && doc.contains("traceEvents")) doc = doc["traceEvents"];
    if (!doc.is_array()) return make_error("not a trace-event JSON array");
    std::map<int64_t, std::string> names;  // pid -> process_name
    for (const auto& e : doc)
        if (e.is_object() && e.value("ph", "") == "M" && e.value("name", "") == "process_name" && e.contains("pid"))
            names[e["pid"].get<int64_t>()] = e["args"].value("name", "");
    std::map<std::pair<std::string, std::string>, std::vector<double>> durations;
    for (const auto& e : doc) {
        if (!e.is_object() || e.value("ph", "") != "X" || !e.contains("dur") || !e["dur"].is_number()) continue;
        const int64_t pid = e.value("pid", int64_t{0});
        const auto n = names.find(pid);
        const std::string process = n != names.end() ? n->second : fmt::format("pid {}", pid);
        durations[{process, e.value("name", "")}].push_back(e["dur"].get<double>() / 1000.0);
    }
    std::vector<TraceRow> rows;
    for (auto& [key, d] : durations) {
        std::sort(d.begin(), d.end());
        TraceRow r;
        r.process = key.first;
        r.name = key.second;
        r.count = d.size();
        for (double x : d) r.total_ms += x;
        r.mean_ms = r.total_ms / static_cast<double>(d.size());
        const auto at = [&](double p) {
            return d[std::min(d.size() - 1, static_cast<size_t>(p * static_cast<double>(d.size())))];
        };
        r.p50_ms = at(0.5);
        r.p99_ms = at(0.99);
        r.max_ms = d.back();
        rows.push_back(std::move(r));
    }
    std::stable_sort(rows.begin(), rows.end(), [](const TraceRow& a, const TraceRow& b) {
        return a.process != b.process ? a.process < b.process : a.total_ms > b.total_ms;
    });
    return rows;
}

int cmd_trace_summary(const std::string& file, bool json) {
    std::ifstream in(file, std::ios::binary);
    if (!in) {
        std::fprintf(stderr, "duet trace summary: cannot read %s\n", file.c_str());
        return 1;
    }
    std::stringstream ss;
    ss << in.rdbuf();
    auto rows = summarize_trace(ss.str());
    if (!rows) {
        std::fprintf(stderr, "duet trace summary: %s: %s\n", file.c_str(), rows.error().message.c_str());
        return 1;
    }
    if (json) {
        nlohmann::json out = nlohmann::json::array();
        for (const TraceRow& r : *rows)
            out.push_back({{"process", r.process},
                           {"name", r.name},
                           {"count", r.count},
                           {"total_ms", r.total_ms},
                           {"mean_ms", r.mean_ms},
                           {"p50_ms", r.p50_ms},
                           {"p99_ms", r.p99_ms},
                           {"max_ms", r.max_ms}});
        std::printf("%s\n", out.dump(2).c_str());
        return 0;
    }
    std::printf(
        "| process | range | count | total ms | mean ms | p50 ms | p99 ms | max ms |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|\n");
    for (const TraceRow& r : *rows)
        std::printf("%s", fmt::format("| {} | {} | {} | {:.1f} | {:.3f} | {:.3f} | {:.3f} | {:.3f} |\n", r.process,
                                      r.name, r.count, r.total_ms, r.mean_ms, r.p50_ms, r.p99_ms, r.max_ms)
                              .c_str());
    return 0;
}

}  // namespace duet
