#include "cli/trace_cli.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <utility>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace duet {

namespace {

// The events of duet's trace file line by line (each event is one line, trace.h),
// lines that do not parse skipped and counted (a writer killed inside a write tears
// its last line).
nlohmann::json events_by_line(const std::string& text, size_t* skipped) {
    nlohmann::json out = nlohmann::json::array();
    std::istringstream in(text);
    std::string line;
    while (std::getline(in, line)) {
        while (!line.empty() && (line.back() == ',' || line.back() == '\r' || line.back() == ' ')) line.pop_back();
        if (line.empty() || line == "[" || line == "]") continue;
        nlohmann::json e = nlohmann::json::parse(line, nullptr, false);
        if (e.is_object())
            out.push_back(std::move(e));
        else
            ++*skipped;
    }
    return out;
}

}  // namespace

Result<std::vector<TraceRow>> summarize_trace(const std::string& text, size_t* torn) {
    size_t skipped = 0;
    // A whole trace-event document (any writer's); else duet's own file, line by line
    // (one its writers did not close ends in ",\n"; one may hold a torn line).
    nlohmann::json doc = nlohmann::json::parse(text, nullptr, false);
    if (doc.is_object() && doc.contains("traceEvents")) doc = doc["traceEvents"];
    if (!doc.is_array()) {
        doc = events_by_line(text, &skipped);
        if (doc.empty()) return make_error("not a trace-event JSON file (no event parses)");
    }
    if (torn) *torn = skipped;
    const auto pid_of = [](const nlohmann::json& e) {
        return e.contains("pid") && e["pid"].is_number_integer() ? e["pid"].get<int64_t>() : int64_t{0};
    };
    std::map<int64_t, std::string> names;  // pid -> process_name
    for (const auto& e : doc)
        if (e.is_object() && e.value("ph", "") == "M" && e.value("name", "") == "process_name" && e.contains("args") &&
            e["args"].is_object())
            names[pid_of(e)] = e["args"].value("name", "");
    std::map<std::pair<std::string, std::string>, std::vector<double>> durations;
    for (const auto& e : doc) {
        if (!e.is_object() || e.value("ph", "") != "X" || !e.contains("dur") || !e["dur"].is_number()) continue;
        const int64_t pid = pid_of(e);
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
        // Nearest rank: the smallest duration with at least p of them at or below it.
        const auto at = [&](double p) {
            const auto rank = static_cast<size_t>(std::ceil(p * static_cast<double>(d.size())));
            return d[std::clamp<size_t>(rank, 1, d.size()) - 1];
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
    size_t torn = 0;
    auto rows = summarize_trace(ss.str(), &torn);
    if (!rows) {
        std::fprintf(stderr, "duet trace summary: %s: %s\n", file.c_str(), rows.error().message.c_str());
        return 1;
    }
    if (torn > 0)
        std::fprintf(stderr, "duet trace summary: %s: %zu torn line(s) skipped (a writer killed while writing)\n",
                     file.c_str(), torn);
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
