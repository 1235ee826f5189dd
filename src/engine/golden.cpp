#include "engine/golden.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace duet {

using json = nlohmann::json;

namespace {

constexpr const char* kFormat = "duet-golden-1";

// log-sum-exp of a row, in double.
double lse(const float* l, int64_t n) {
    double mx = -INFINITY;
    for (int64_t i = 0; i < n; ++i) mx = std::max(mx, static_cast<double>(l[i]));
    double s = 0;
    for (int64_t i = 0; i < n; ++i) s += std::exp(static_cast<double>(l[i]) - mx);
    return mx + std::log(s);
}

// Every position's logits row of `ids`, one pass with all logits, on blocks of
// `pool` released before returning.
Result<std::vector<float>> all_logits(Backend& backend, KvPool& pool, const std::vector<int32_t>& ids) {
    KvSeq seq;
    const auto n = static_cast<int64_t>(ids.size());
    if (Status st = seq.prepare_append(pool, 0, n); !st)
        return make_error("the golden check's {} tokens: {}", n, st.error().message);
    SeqBatch b;
    b.kv = &seq;
    b.tokens = ids.data();
    b.n_tokens = static_cast<int32_t>(n);
    b.all_logits = true;
    std::vector<float> logits;
    Status st = backend.forward(std::span<SeqBatch>(&b, 1), logits);
    seq.release(pool);
    if (!st) return make_error("the golden check's pass: {}", st.error().message);
    if (logits.size() != static_cast<size_t>(n * backend.n_vocab()))
        return make_error("the golden check's pass gave {} logits, expected {}", logits.size(), n * backend.n_vocab());
    return logits;
}

}  // namespace

// The built-in references' text: golden_builtin.cpp, made at build time from
// golden/*.json (cmake/embed_golden.cmake).
const char* builtin_golden_text(size_t i);
size_t builtin_golden_count();

Result<GoldenRef> parse_golden(const std::string& text) {
    json j = json::parse(text, nullptr, false);
    if (j.is_discarded() || !j.is_object()) return make_error("a golden reference is a JSON object");
    try {
        if (j.value("format", "") != kFormat)
            return make_error("golden reference format '{}', expected '{}'", j.value("format", ""), kFormat);
        GoldenRef r;
        r.model_fingerprint = std::stoull(j.at("model_fingerprint").get<std::string>(), nullptr, 16);
        r.source = j.value("source", "");
        const json& tol = j.at("tolerance");
        r.tol_mean = tol.at("mean").get<double>();
        r.tol_max = tol.at("max").get<double>();
        r.tol_top1_gap = tol.at("top1_gap").get<double>();
        for (const json& p : j.at("prompts")) {
            GoldenRef::Prompt q;
            q.name = p.value("name", "");
            q.ids = p.at("ids").get<std::vector<int32_t>>();
            if (q.ids.empty()) return make_error("golden prompt '{}' has no ids", q.name);
            for (const json& at : p.at("positions")) {
                GoldenRef::Position pos;
                pos.pos = at.at("pos").get<int32_t>();
                if (pos.pos < 0 || pos.pos >= static_cast<int32_t>(q.ids.size()))
                    return make_error("golden prompt '{}': position {} outside its {} ids", q.name, pos.pos, q.ids.size());
                for (const json& e : at.at("logprobs")) pos.logprobs.emplace_back(e.at(0).get<int32_t>(), e.at(1).get<double>());
                if (pos.logprobs.size() < 2) return make_error("golden prompt '{}': fewer than 2 log-probs at {}", q.name, pos.pos);
                q.positions.push_back(std::move(pos));
            }
            r.prompts.push_back(std::move(q));
        }
        if (r.prompts.empty()) return make_error("a golden reference without prompts");
        return r;
    } catch (const std::exception& e) {
        return make_error("golden reference: {}", e.what());
    }
}

std::string golden_json(const GoldenRef& r) {
    json j;
    j["format"] = kFormat;
    j["model_fingerprint"] = fmt::format("{:#018x}", r.model_fingerprint);
    j["source"] = r.source;
    j["tolerance"] = {{"mean", r.tol_mean}, {"max", r.tol_max}, {"top1_gap", r.tol_top1_gap}};
    j["prompts"] = json::array();
    for (const GoldenRef::Prompt& p : r.prompts) {
        json q = {{"name", p.name}, {"ids", p.ids}, {"positions", json::array()}};
        for (const GoldenRef::Position& at : p.positions) {
            json lp = json::array();
            for (const auto& [id, v] : at.logprobs) lp.push_back({id, v});
            q["positions"].push_back({{"pos", at.pos}, {"logprobs", lp}});
        }
        j["prompts"].push_back(std::move(q));
    }
    return j.dump(1) + "\n";
}

const GoldenRef* builtin_golden(uint64_t fingerprint) {
    static const std::vector<GoldenRef> refs = [] {
        std::vector<GoldenRef> v;
        for (size_t i = 0; i < builtin_golden_count(); ++i)
            if (auto r = parse_golden(builtin_golden_text(i))) v.push_back(std::move(r).value());
        return v;
    }();
    for (const GoldenRef& r : refs)
        if (r.model_fingerprint == fingerprint) return &r;
    return nullptr;
}

Result<GoldenReport> check_golden(Backend& backend, KvPool& pool, uint64_t model_fingerprint, const GoldenRef& ref) {
    GoldenReport rep;
    if (ref.model_fingerprint != model_fingerprint) {
        rep.summary = fmt::format("the reference is for model {:#018x}, this model is {:#018x} (another or a damaged file)",
                                  ref.model_fingerprint, model_fingerprint);
        return rep;
    }
    const int64_t nv = backend.n_vocab();
    bool ok = true;
    std::string failed;
    for (const GoldenRef::Prompt& p : ref.prompts) {
        auto logits = all_logits(backend, pool, p.ids);
        if (!logits) return logits.error();
        double sum = 0, worst = 0;
        size_t n = 0;
        for (const GoldenRef::Position& at : p.positions) {
            const float* row = logits->data() + static_cast<size_t>(at.pos) * static_cast<size_t>(nv);
            const double l = lse(row, nv);
            bool finite = std::isfinite(l);
            for (const auto& [id, v] : at.logprobs) {
                if (id < 0 || id >= nv) return make_error("golden prompt '{}': id {} outside the vocabulary", p.name, id);
                const double d = finite ? std::abs((row[id] - l) - v) : INFINITY;
                sum += d;
                worst = std::max(worst, d);
                ++n;
            }
            const double gap = at.logprobs[0].second - at.logprobs[1].second;
            const auto top = static_cast<int32_t>(std::max_element(row, row + nv) - row);
            if (gap > ref.tol_top1_gap && top != at.logprobs[0].first) {
                ok = false;
                failed += fmt::format("; '{}' position {}: top-1 {} where the reference has {} (gap {:.2f})", p.name,
                                      at.pos, top, at.logprobs[0].first, gap);
            }
        }
        const double mean = n ? sum / static_cast<double>(n) : 0;
        rep.summary += fmt::format("{}{} mean {:.3f} worst {:.3f}", rep.summary.empty() ? "" : ", ", p.name, mean, worst);
        rep.worst_mean = std::max(rep.worst_mean, mean);
        rep.worst = std::max(rep.worst, worst);
        if (!(mean <= ref.tol_mean)) {
            ok = false;
            failed += fmt::format("; '{}': mean |dlogprob| {:.3f} > {}", p.name, mean, ref.tol_mean);
        }
        if (!(worst <= ref.tol_max)) {
            ok = false;
            failed += fmt::format("; '{}': worst |dlogprob| {:.3f} > {}", p.name, worst, ref.tol_max);
        }
    }
    rep.passed = ok;
    rep.summary = fmt::format("|dlogprob| against {}: {}{}", ref.source.empty() ? "the reference" : ref.source,
                              rep.summary, failed);
    return rep;
}

Result<GoldenRef> record_golden(Backend& backend, KvPool& pool, uint64_t model_fingerprint, const GoldenRef& shape,
                                int top_k) {
    GoldenRef r = shape;
    r.model_fingerprint = model_fingerprint;
    const int64_t nv = backend.n_vocab();
    for (GoldenRef::Prompt& p : r.prompts) {
        auto logits = all_logits(backend, pool, p.ids);
        if (!logits) return logits.error();
        for (GoldenRef::Position& at : p.positions) {
            const float* row = logits->data() + static_cast<size_t>(at.pos) * static_cast<size_t>(nv);
            const double l = lse(row, nv);
            std::vector<int32_t> order(static_cast<size_t>(nv));
            std::iota(order.begin(), order.end(), 0);
            const auto k = static_cast<size_t>(std::clamp<int64_t>(top_k, 2, nv));
            std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(k), order.end(),
                              [&](int32_t a, int32_t b) { return row[a] > row[b] || (row[a] == row[b] && a < b); });
            at.logprobs.clear();
            for (size_t i = 0; i < k; ++i) at.logprobs.emplace_back(order[i], row[order[i]] - l);
        }
    }
    return r;
}

Result<std::unique_ptr<GoldenRef>> find_golden(const std::string& spec, const std::string& model_path,
                                               uint64_t model_fingerprint) {
    auto read = [](const std::string& path) -> Result<std::unique_ptr<GoldenRef>> {
        std::ifstream f(path);
        if (!f) return make_error("cannot read the golden reference {}", path);
        std::stringstream ss;
        ss << f.rdbuf();
        auto r = parse_golden(ss.str());
        if (!r) return make_error("{}: {}", path, r.error().message);
        return std::make_unique<GoldenRef>(std::move(r).value());
    };
    if (spec == "none") return std::unique_ptr<GoldenRef>();
    if (spec != "auto") return read(spec);  // its fingerprint is checked by check_golden
    const std::string beside = model_path + ".golden.json";
    std::error_code ec;
    if (std::filesystem::exists(beside, ec)) return read(beside);
    if (const GoldenRef* b = builtin_golden(model_fingerprint)) return std::make_unique<GoldenRef>(*b);
    return std::unique_ptr<GoldenRef>();
}

}  // namespace duet
