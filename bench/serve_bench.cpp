#include <utility>  // Boost 1.74's asio/awaitable.hpp uses std::exchange without including it

#include "bench/serve_bench.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <random>
#include <vector>

#include <boost/asio.hpp>
#include <boost/beast.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "base/result.h"
#include "engine/scheduling.h"

namespace duet {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;
using asio::awaitable;
using asio::use_awaitable;
using nlohmann::json;

namespace {

using Clock = std::chrono::steady_clock;

struct Record {
    bool stream = false;  // mixed: one of the long-running decode streams
    int prompt = 0, max_tokens = 0;
    double start = 0;                // seconds since the run began
    std::vector<double> events;      // arrival of each text event, seconds since the run began
    int64_t completion_tokens = -1;  // from the usage chunk
    int64_t prompt_tokens = -1;
    std::string error;  // "" when it completed
    int status = 0;     // the HTTP status
    int cls = -1;       // overload: its class (SloClass), -1: none sent
    int step = -1;      // overload: its step of the ramp
    int retries = 0;    // 429s waited on and sent again
};

struct Run {
    Run(const ServeBenchOptions& opts, asio::io_context& ctx, tcp::endpoint e, std::string m)
        : o(opts), io(ctx), ep(e), model(std::move(m)) {
        arrivals_rng.seed(o.seed);
        tokens_rng.seed(o.seed ^ 0x9E3779B97F4A7C15ull);
    }
    const ServeBenchOptions& o;
    asio::io_context& io;
    tcp::endpoint ep;
    std::string model;
    Clock::time_point t0 = Clock::now();
    // Arrival times and lengths of the long prompts come from their own generator,
    // so every server sees the same schedule however many stream requests it ran.
    std::mt19937_64 arrivals_rng, tokens_rng;
    std::vector<std::unique_ptr<Record>> records;
    int in_flight = 0;
    std::string server;  // the Server header of the first response

    double now() const { return std::chrono::duration<double>(Clock::now() - t0).count(); }
    int uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(arrivals_rng); }
};

std::string request_body(Run& run, const Record& r) {
    std::vector<int32_t> ids(static_cast<size_t>(r.prompt));
    std::uniform_int_distribution<int32_t> tok(run.o.token_lo, run.o.token_hi - 1);
    std::mt19937_64& rng = r.stream ? run.tokens_rng : run.arrivals_rng;  // long prompts: the same on every server
    for (int32_t& id : ids) id = tok(rng);
    json j = {{"model", run.model},   {"prompt", ids},        {"max_tokens", r.max_tokens},
              {"temperature", 0},     {"ignore_eos", true},   {"stream", true},
              {"stream_options", {{"include_usage", true}}}};
    if (r.cls >= 0) j["priority"] = slo_class_name(static_cast<SloClass>(r.cls));
    return j.dump();
}

// Consumes complete SSE events from buf (their "data:" lines; "id:" and other fields
// are skipped, as an EventSource does); t: when these bytes arrived.
void take_events(std::string& buf, Record& r, double t, bool& done) {
    size_t at;
    while ((at = buf.find("\n\n")) != std::string::npos) {
        std::string ev = buf.substr(0, at);
        buf.erase(0, at + 2);
        std::string joined;
        bool has_data = false;
        for (size_t from = 0; from <= ev.size();) {
            const size_t nl = std::min(ev.find('\n', from), ev.size());
            std::string_view line(ev.data() + from, nl - from);
            if (line.rfind("data:", 0) == 0) {
                line.remove_prefix(line.size() > 5 && line[5] == ' ' ? 6 : 5);
                if (has_data) joined += '\n';
                joined.append(line);
                has_data = true;
            }
            from = nl + 1;
        }
        if (!has_data) continue;
        std::string_view data(joined);
        if (data == "[DONE]") {
            done = true;
            continue;
        }
        json j = json::parse(data, nullptr, false);
        if (j.is_discarded()) continue;
        if (j.contains("error")) {
            r.error = j["error"].dump();
            continue;
        }
        if (auto u = j.find("usage"); u != j.end() && u->is_object()) {
            r.completion_tokens = u->value("completion_tokens", int64_t{-1});
            r.prompt_tokens = u->value("prompt_tokens", int64_t{-1});
        }
        if (auto c = j.find("choices"); c != j.end() && c->is_array() && !c->empty()) {
            const json& ch = (*c)[0];
            std::string text;
            if (ch.contains("text") && ch["text"].is_string()) text = ch["text"].get<std::string>();
            else if (ch.contains("delta") && ch["delta"].contains("content") && ch["delta"]["content"].is_string())
                text = ch["delta"]["content"].get<std::string>();
            if (!text.empty()) r.events.push_back(t);
        }
    }
}

// A refusal's wait: retry-after-ms, else Retry-After (seconds), else 1 s.
double retry_after_s(const http::response<http::string_body>& res) {
    try {
        if (auto ms = res.find("retry-after-ms"); ms != res.end()) return std::stod(std::string(ms->value())) / 1e3;
        if (auto s = res.find(http::field::retry_after); s != res.end()) return std::stod(std::string(s->value()));
    } catch (const std::exception&) {
    }
    return 1.0;
}

// One attempt: the response's status and events into r. A 429's wait into *retry_s.
awaitable<void> attempt(Run& run, Record& r, const std::string& body, double* retry_s) {
    beast::error_code ec;
    beast::tcp_stream stream(run.io);
    stream.expires_after(std::chrono::duration_cast<Clock::duration>(
        std::chrono::duration<double>(std::max(1.0, run.o.timeout_s - (run.now() - r.start)))));
    co_await stream.async_connect(run.ep, asio::redirect_error(use_awaitable, ec));
    if (!ec) {
        http::request<http::string_body> req{http::verb::post, "/v1/completions", 11};
        req.set(http::field::host, run.o.host);
        req.set(http::field::content_type, "application/json");
        req.body() = body;
        req.prepare_payload();
        co_await http::async_write(stream, req, asio::redirect_error(use_awaitable, ec));
    }
    if (ec) {
        r.error = "connect/write: " + ec.message();
        co_return;
    }
    beast::flat_buffer buf;
    http::response_parser<http::string_body> parser;
    parser.body_limit(64u << 20);
    std::string sse;
    bool done = false;
    auto on_chunk = [&](std::uint64_t, beast::string_view data, beast::error_code&) -> std::size_t {
        sse.append(data.data(), data.size());
        take_events(sse, r, run.now(), done);
        return data.size();
    };
    parser.on_chunk_body(on_chunk);
    co_await http::async_read_header(stream, buf, parser, asio::redirect_error(use_awaitable, ec));
    if (!ec && run.server.empty()) run.server = std::string(parser.get()[http::field::server]);
    if (!ec) r.status = static_cast<int>(parser.get().result_int());
    while (!ec && !parser.is_done())
        co_await http::async_read_some(stream, buf, parser, asio::redirect_error(use_awaitable, ec));
    if (ec && r.error.empty()) r.error = "read: " + ec.message();
    if (!ec && parser.get().result() != http::status::ok && r.error.empty())
        r.error = fmt::format("HTTP {}: {}", parser.get().result_int(), parser.get().body());
    if (!ec && r.status == 429) *retry_s = retry_after_s(parser.get());
    if (r.error.empty() && !done) r.error = "the stream ended without [DONE]";
    if (r.error.empty() && r.completion_tokens != r.max_tokens)
        r.error = fmt::format("{} tokens generated, {} asked for", r.completion_tokens, r.max_tokens);
    stream.socket().shutdown(tcp::socket::shutdown_both, ec);
}

// A request as a client that honours Retry-After sends it (the openai client does):
// refused with 429, it waits as told and sends it again, its start (TTFT) kept from
// the first try; with --no-retry (and always in the overload scenario, which counts
// refusals against goodput) a refusal is its outcome.
awaitable<void> one_request(Run& run, Record& r) {
    ++run.in_flight;
    const std::string body = request_body(run, r);
    r.start = run.now();
    asio::steady_timer timer(run.io);
    for (;;) {
        double retry_s = -1;
        r.events.clear();
        r.error.clear();
        r.status = 0;
        r.completion_tokens = r.prompt_tokens = -1;
        co_await attempt(run, r, body, &retry_s);
        if (retry_s < 0 || !run.o.retry || run.o.scenario == "overload") break;
        if (run.now() + retry_s - r.start > run.o.timeout_s) break;
        ++r.retries;
        timer.expires_after(std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(retry_s)));
        co_await timer.async_wait(use_awaitable);
    }
    --run.in_flight;
}

Record& add(Run& run, bool stream, int prompt, int max_tokens) {
    auto r = std::make_unique<Record>();
    r->stream = stream;
    r->prompt = prompt;
    r->max_tokens = max_tokens;
    run.records.push_back(std::move(r));
    return *run.records.back();
}

awaitable<void> decode_stream(Run& run) {
    while (run.now() < run.o.duration_s) co_await one_request(run, add(run, true, run.o.stream_prompt, run.o.stream_output));
}

awaitable<void> arrivals(Run& run) {
    std::exponential_distribution<double> gap(run.o.rate);
    asio::steady_timer timer(run.io);
    double next = run.o.scenario == "mixed" ? 1.0 : 0.0;  // mixed: let the streams start first
    for (;;) {
        next += gap(run.arrivals_rng);
        if (next >= run.o.duration_s) break;
        timer.expires_at(run.t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(next)));
        co_await timer.async_wait(use_awaitable);
        Record& r = add(run, false, run.uniform(run.o.prompt_min, run.o.prompt_max),
                        run.uniform(run.o.output_min, run.o.output_max));
        asio::co_spawn(run.io, one_request(run, r), asio::detached);
    }
}

// overload: the ramp's steps, each at its multiple of capacity, classes drawn from
// the mix (the same schedule for every server: one seeded generator).
awaitable<void> overload_arrivals(Run& run, std::vector<double> ramp, std::array<double, kSloClasses> mix) {
    asio::steady_timer timer(run.io);
    std::uniform_real_distribution<double> u(0, 100);
    double next = 0;
    for (size_t step = 0; step < ramp.size(); ++step) {
        const double end = run.o.step_s * static_cast<double>(step + 1);
        std::exponential_distribution<double> gap(run.o.capacity * ramp[step]);
        next = std::max(next, run.o.step_s * static_cast<double>(step));
        for (;;) {
            next += gap(run.arrivals_rng);
            if (next >= end) {
                next = end;
                break;
            }
            timer.expires_at(run.t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(next)));
            co_await timer.async_wait(use_awaitable);
            Record& r = add(run, false, run.uniform(run.o.prompt_min, run.o.prompt_max),
                            run.uniform(run.o.output_min, run.o.output_max));
            const double x = u(run.arrivals_rng);
            r.cls = x < mix[0] ? 0 : x < mix[0] + mix[1] ? 1 : 2;
            r.step = static_cast<int>(step);
            asio::co_spawn(run.io, one_request(run, r), asio::detached);
        }
    }
}

// Nearest-rank percentile of sorted values.
double pct(const std::vector<double>& v, double p) {
    if (v.empty()) return NAN;
    size_t i = static_cast<size_t>(std::ceil(p / 100.0 * static_cast<double>(v.size())));
    return v[std::min(v.size() - 1, i == 0 ? 0 : i - 1)];
}

json dist(std::vector<double> v) {  // milliseconds
    std::sort(v.begin(), v.end());
    double sum = 0;
    for (double x : v) sum += x;
    return {{"n", v.size()},
            {"mean", v.empty() ? NAN : sum / static_cast<double>(v.size())},
            {"p50", pct(v, 50)},
            {"p90", pct(v, 90)},
            {"p99", pct(v, 99)},
            {"max", v.empty() ? NAN : v.back()}};
}

Status fetch_model(const ServeBenchOptions& o, const tcp::endpoint& ep, std::string& model) {
    asio::io_context io;
    beast::tcp_stream s(io);
    beast::error_code ec;
    s.connect(ep, ec);
    if (ec) return make_error("cannot connect to {}:{}: {}", o.host, o.port, ec.message());
    http::request<http::empty_body> req{http::verb::get, "/v1/models", 11};
    req.set(http::field::host, o.host);
    http::write(s, req, ec);
    beast::flat_buffer buf;
    http::response<http::string_body> res;
    if (!ec) http::read(s, buf, res, ec);
    if (ec) return make_error("GET /v1/models: {}", ec.message());
    json j = json::parse(res.body(), nullptr, false);
    if (j.is_discarded() || !j.contains("data") || !j["data"].is_array() || j["data"].empty() ||
        !j["data"][0].contains("id"))
        return make_error("GET /v1/models answered {} {}", res.result_int(), res.body());
    model = j["data"][0]["id"].get<std::string>();
    return {};
}

Status check_options(const ServeBenchOptions& o) {
    if (o.scenario != "mixed" && o.scenario != "poisson" && o.scenario != "overload")
        return make_error("--scenario must be mixed, poisson or overload");
    if (o.prompt_min < 1 || o.prompt_max < o.prompt_min || o.output_min < 1 || o.output_max < o.output_min)
        return make_error("length ranges must be 1 <= min <= max");
    if (o.token_lo < 0 || o.token_hi <= o.token_lo) return make_error("--token-range must be lo < hi");
    return {};
}

// Requests counted in the summary (those that started after the warm-up).
struct Counts {
    int64_t counted = 0, ok = 0, errors = 0;
};

// Summary over requests that started after the warm-up.
json summarize(const Run& run, Counts& n) {
    const ServeBenchOptions& o = run.o;
    std::vector<double> ttft, itl, itl_streams, tpot;
    int64_t tokens = 0, good = 0, retried = 0, retries = 0;
    double window_end = o.warmup_s;
    for (const auto& rp : run.records) {
        const Record& r = *rp;
        if (r.start < o.warmup_s) continue;
        ++n.counted;
        retried += r.retries > 0 ? 1 : 0;
        retries += r.retries;
        if (!r.error.empty() || r.events.empty()) {
            ++n.errors;
            continue;
        }
        ++n.ok;
        tokens += r.completion_tokens;
        window_end = std::max(window_end, r.events.back());
        const double t1 = (r.events.front() - r.start) * 1e3;
        if (!r.stream || o.scenario == "poisson") ttft.push_back(t1);
        for (size_t i = 1; i < r.events.size(); ++i) {
            double g = (r.events[i] - r.events[i - 1]) * 1e3;
            itl.push_back(g);
            if (r.stream) itl_streams.push_back(g);
        }
        double tp = r.completion_tokens > 1
                        ? (r.events.back() - r.events.front()) * 1e3 / static_cast<double>(r.completion_tokens - 1)
                        : 0;
        tpot.push_back(tp);
        if (t1 <= o.slo_ttft_ms && tp <= o.slo_tpot_ms) ++good;
    }
    const double window = std::max(1e-9, window_end - o.warmup_s);
    return {{"requests", n.counted},
            {"completed", n.ok},
            {"errors", n.errors},
            {"ttft_ms", dist(ttft)},
            {"itl_ms", dist(itl)},
            {"itl_streams_ms", dist(itl_streams)},
            {"tpot_ms", dist(tpot)},
            {"output_tokens_per_s", static_cast<double>(tokens) / window},
            {"requests_per_s", static_cast<double>(n.ok) / window},
            {"goodput_requests_per_s", static_cast<double>(good) / window},
            {"retried_requests", retried},
            {"retries", retries}};
}

Result<std::vector<double>> parse_ramp(const std::string& s) {
    std::vector<double> v;
    size_t at = 0;
    while (at <= s.size()) {
        const size_t comma = std::min(s.find(',', at), s.size());
        try {
            size_t used = 0;
            const std::string part = s.substr(at, comma - at);
            const double x = std::stod(part, &used);
            if (used != part.size() || !(x > 0)) throw std::invalid_argument(part);
            v.push_back(x);
        } catch (const std::exception&) {
            return make_error("--ramp {}: positive multiples of --capacity, comma separated", s);
        }
        at = comma + 1;
    }
    return v;
}

Result<std::array<double, kSloClasses>> parse_mix(const std::string& s) {
    std::array<double, kSloClasses> m{};
    if (std::sscanf(s.c_str(), "%lf/%lf/%lf", &m[0], &m[1], &m[2]) != 3 || m[0] < 0 || m[1] < 0 || m[2] < 0 ||
        std::fabs(m[0] + m[1] + m[2] - 100) > 1e-6)
        return make_error("--classes {}: critical/standard/batch percentages adding up to 100", s);
    return m;
}

// overload: per step and class, and in all. A request meets its class's targets when
// it completed with its first text within the TTFT target and its inter-token gaps
// within the ITL target on average; refused (429) ones count as sent, not met.
json summarize_overload(const Run& run, const std::vector<double>& ramp, const SloTable& slo, Counts& n) {
    struct Tally {
        int64_t sent = 0, completed = 0, refused = 0, failed = 0, met = 0;
        std::vector<double> ttft;
    };
    std::vector<std::array<Tally, kSloClasses>> t(ramp.size());
    for (const auto& rp : run.records) {
        const Record& r = *rp;
        if (r.step < 0 || r.cls < 0) continue;
        Tally& x = t[static_cast<size_t>(r.step)][static_cast<size_t>(r.cls)];
        ++x.sent;
        ++n.counted;
        if (r.status == 429) {
            ++x.refused;
            continue;
        }
        if (!r.error.empty() || r.events.empty()) {
            ++x.failed;
            ++n.errors;
            continue;
        }
        ++x.completed;
        ++n.ok;
        const double ttft = r.events.front() - r.start;
        x.ttft.push_back(ttft * 1e3);
        const double itl = r.events.size() > 1 ? (r.events.back() - r.events.front()) / static_cast<double>(r.events.size() - 1) : 0;
        const SloTarget& g = slo.of(static_cast<SloClass>(r.cls));
        if (ttft * 1e9 <= static_cast<double>(g.ttft_ns) && itl * 1e9 <= static_cast<double>(g.itl_ns)) ++x.met;
    }
    json steps = json::array();
    std::array<Tally, kSloClasses> all{};
    for (size_t s = 0; s < ramp.size(); ++s) {
        json classes = json::object();
        for (size_t c = 0; c < kSloClasses; ++c) {
            const Tally& x = t[s][c];
            classes[slo_class_name(static_cast<SloClass>(c))] = {
                {"sent", x.sent},
                {"completed", x.completed},
                {"refused", x.refused},
                {"failed", x.failed},
                {"met", x.met},
                {"attainment", x.sent ? static_cast<double>(x.met) / static_cast<double>(x.sent) : NAN},
                {"goodput_per_s", static_cast<double>(x.met) / run.o.step_s},
                {"ttft_ms", dist(x.ttft)}};
            all[c].sent += x.sent, all[c].met += x.met, all[c].refused += x.refused;
        }
        int64_t met = 0, sent = 0;
        for (size_t c = 0; c < kSloClasses; ++c) met += t[s][c].met, sent += t[s][c].sent;
        steps.push_back({{"load", ramp[s]},
                         {"rate", ramp[s] * run.o.capacity},
                         {"sent", sent},
                         {"goodput_per_s", static_cast<double>(met) / run.o.step_s},
                         {"attainment", sent ? static_cast<double>(met) / static_cast<double>(sent) : NAN},
                         {"classes", classes}});
    }
    return {{"requests", n.counted}, {"completed", n.ok}, {"errors", n.errors}, {"slo", slo.to_string()}, {"steps", steps}};
}

void print_overload(const std::string& label, const json& summary) {
    std::printf("%s: overload ramp, SLO %s\n", label.c_str(), summary["slo"].get<std::string>().c_str());
    std::printf("  %-6s %-8s %-9s %-30s %-30s %-30s\n", "load", "goodput", "attain", "critical sent/refused/met",
                "standard sent/refused/met", "batch sent/refused/met");
    for (const json& st : summary["steps"]) {
        std::string cols[kSloClasses];
        for (size_t c = 0; c < kSloClasses; ++c) {
            const json& x = st["classes"][slo_class_name(static_cast<SloClass>(c))];
            cols[c] = fmt::format("{}/{}/{} ({:.0f}%)", x["sent"].get<int64_t>(), x["refused"].get<int64_t>(),
                                  x["met"].get<int64_t>(),
                                  x["sent"].get<int64_t>() ? 100.0 * x["attainment"].get<double>() : 0.0);
        }
        std::printf("  %-6.2f %-8.3f %-9.1f %-30s %-30s %-30s\n", st["load"].get<double>(),
                    st["goodput_per_s"].get<double>(),
                    st["sent"].get<int64_t>() ? 100.0 * st["attainment"].get<double>() : 0.0, cols[0].c_str(),
                    cols[1].c_str(), cols[2].c_str());
    }
}

json options_json(const ServeBenchOptions& o, const std::string& model) {
    return {{"host", o.host},
            {"port", o.port},
            {"model", model},
            {"scenario", o.scenario},
            {"duration_s", o.duration_s},
            {"warmup_s", o.warmup_s},
            {"rate", o.rate},
            {"prompt", {o.prompt_min, o.prompt_max}},
            {"output", {o.output_min, o.output_max}},
            {"streams", o.streams},
            {"stream_prompt", o.stream_prompt},
            {"stream_output", o.stream_output},
            {"slo_ttft_ms", o.slo_ttft_ms},
            {"slo_tpot_ms", o.slo_tpot_ms},
            {"seed", o.seed},
            {"capacity", o.capacity},
            {"ramp", o.ramp},
            {"step_s", o.step_s},
            {"classes", o.classes},
            {"slo", o.slo},
            {"retry", o.retry}};
}

// The summary lines: totals, each latency distribution with samples, the first error.
void print_summary(const Run& run, const std::string& label, const Counts& n, double end, const json& summary) {
    std::printf("%s: %lld requests (%lld completed, %lld errors) in %.1f s; %.1f output tokens/s, goodput %.3f req/s\n",
                label.c_str(), static_cast<long long>(n.counted), static_cast<long long>(n.ok),
                static_cast<long long>(n.errors), end, summary["output_tokens_per_s"].get<double>(),
                summary["goodput_requests_per_s"].get<double>());
    if (summary["retries"].get<int64_t>() > 0)
        std::printf("  %lld requests refused (429) and sent again after their Retry-After, %lld times in all\n",
                    static_cast<long long>(summary["retried_requests"].get<int64_t>()),
                    static_cast<long long>(summary["retries"].get<int64_t>()));
    for (const char* k : {"ttft_ms", "itl_ms", "itl_streams_ms", "tpot_ms"}) {
        const json& d = summary[k];
        if (d["n"].get<size_t>() == 0) continue;
        std::printf("  %-15s n=%-6zu p50 %9.2f  p90 %9.2f  p99 %9.2f  max %9.2f  mean %9.2f\n", k,
                    d["n"].get<size_t>(), d["p50"].get<double>(), d["p90"].get<double>(), d["p99"].get<double>(),
                    d["max"].get<double>(), d["mean"].get<double>());
    }
    for (const auto& rp : run.records)
        if (!rp->error.empty()) {
            std::printf("  first error: %s\n", rp->error.c_str());
            break;
        }
}

// The whole record: options, summary and every request with its event times.
Status write_record(const Run& run, const std::string& label, const json& opts, const json& summary) {
    json reqs = json::array();
    for (const auto& rp : run.records) {
        const Record& r = *rp;
        reqs.push_back({{"stream", r.stream},
                        {"prompt", r.prompt},
                        {"max_tokens", r.max_tokens},
                        {"start", r.start},
                        {"events", r.events},
                        {"completion_tokens", r.completion_tokens},
                        {"status", r.status},
                        {"retries", r.retries},
                        {"class", r.cls},
                        {"step", r.step},
                        {"error", r.error}});
    }
    json all = {{"label", label}, {"server", run.server}, {"options", opts}, {"summary", summary}, {"requests", reqs}};
    std::ofstream f(run.o.json_path);
    f << all.dump(-1, ' ', false, json::error_handler_t::replace) << "\n";
    if (!f) return make_error("cannot write {}", run.o.json_path);
    return {};
}

}  // namespace

int cmd_bench_serve(const ServeBenchOptions& o) {
    auto fail = [](const std::string& m) {
        std::fprintf(stderr, "duet bench serve: %s\n", m.c_str());
        return 1;
    };
    if (Status st = check_options(o); !st) return fail(st.error().message);
    beast::error_code ec;
    auto addr = asio::ip::make_address(o.host, ec);
    if (ec) return fail(fmt::format("--host {}: {}", o.host, ec.message()));
    tcp::endpoint ep{addr, static_cast<uint16_t>(o.port)};
    std::string model = o.model;
    if (model.empty())
        if (Status st = fetch_model(o, ep, model); !st) return fail(st.error().message);

    asio::io_context io;
    Run run(o, io, ep, model);
    std::vector<double> ramp;
    SloTable slo;
    if (o.scenario == "overload") {
        auto r = parse_ramp(o.ramp);
        if (!r) return fail(r.error().message);
        auto m = parse_mix(o.classes);
        if (!m) return fail(m.error().message);
        auto t = SloTable::parse(o.slo);
        if (!t) return fail(t.error().message);
        if (!(o.capacity > 0) || !(o.step_s > 0)) return fail("--capacity and --step must be positive");
        ramp = *r;
        slo = *t;
        asio::co_spawn(io, overload_arrivals(run, ramp, *m), asio::detached);
    }
    if (o.scenario == "mixed")
        for (int i = 0; i < o.streams; ++i) asio::co_spawn(io, decode_stream(run), asio::detached);
    if (o.rate > 0 && o.scenario != "overload") asio::co_spawn(io, arrivals(run), asio::detached);
    std::fprintf(stderr, "duet bench serve: %s for %.0f s against %s:%d (%s)\n", o.scenario.c_str(), o.duration_s,
                 o.host.c_str(), o.port, model.c_str());
    io.run();
    const double end = run.now();

    Counts n;
    const std::string label = o.label.empty() ? (run.server.empty() ? "server" : run.server) : o.label;
    const json summary = o.scenario == "overload" ? summarize_overload(run, ramp, slo, n) : summarize(run, n);
    if (o.scenario == "overload") print_overload(label, summary);
    else print_summary(run, label, n, end, summary);
    if (!o.json_path.empty())
        if (Status st = write_record(run, label, options_json(o, model), summary); !st) return fail(st.error().message);
    return n.errors == 0 ? 0 : 2;
}

}  // namespace duet
