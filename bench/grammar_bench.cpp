#include "bench/grammar_bench.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>
#include <vector>

#include "engine/grammar.h"
#include "model/gguf.h"
#include "model/sampler.h"
#include "model/tokenizer.h"

namespace duet {

namespace {

using Clock = std::chrono::steady_clock;

double us_since(Clock::time_point t0) { return std::chrono::duration<double, std::micro>(Clock::now() - t0).count(); }

double pct(std::vector<double> v, double p) {
    if (v.empty()) return 0;
    std::sort(v.begin(), v.end());
    return v[std::min(v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size())))];
}

}  // namespace

int cmd_bench_grammar(const GrammarBenchArgs& a) {
    auto f = GgufFile::open(a.model);
    if (!f) {
        std::fprintf(stderr, "duet bench grammar: %s\n", f.error().message.c_str());
        return 1;
    }
    auto tk = Tokenizer::from_gguf(**f);
    if (!tk) {
        std::fprintf(stderr, "duet bench grammar: %s\n", tk.error().message.c_str());
        return 1;
    }
    const Tokenizer& tok = **tk;
    std::ifstream file;
    if (a.schemas != "-") {
        file.open(a.schemas);
        if (!file) {
            std::fprintf(stderr, "duet bench grammar: cannot read %s\n", a.schemas.c_str());
            return 1;
        }
    }
    std::istream& in = a.schemas == "-" ? std::cin : file;
    const int32_t nv = tok.n_vocab();
    auto t_set = Clock::now();
    GrammarSet set(tok, nv);
    std::vector<float> row(static_cast<size_t>(nv)), work(static_cast<size_t>(nv));
    std::mt19937 rng(a.seed);
    for (float& x : row) x = std::uniform_real_distribution<float>(-10, 10)(rng);
    // The first mask builds the vocabulary's tables (xgrammar's TokenizerInfo): timed
    // with the first compile, apart.
    std::vector<double> compile_us, cached_us, mask_us, apply_us, read_us, check_us, checked_us;
    double first_us = 0;
    size_t n_schemas = 0, refused = 0, tokens = 0;
    std::string line;
    uint64_t key = 0;
    while (std::getline(in, line)) {
        if (line.empty()) continue;
        auto j = nlohmann::json::parse(line, nullptr, false);
        if (j.is_discarded() || !j.contains("schema")) continue;
        const GrammarSpec g{GrammarKind::JsonSchema, j["schema"].dump()};
        auto tc = Clock::now();
        const bool honoured = check_grammar(g).ok();
        check_us.push_back(us_since(tc));
        tc = Clock::now();
        (void)check_grammar(g);
        checked_us.push_back(us_since(tc));
        if (!honoured) {
            ++refused;
            continue;
        }
        ++n_schemas;
        const uint64_t k = ++key;
        auto t0 = Clock::now();
        auto m = set.allowed(k, g, {});
        const double took = us_since(t0);
        if (!m.ok()) {
            std::fprintf(stderr, "duet bench grammar: %s\n", m.error().message.c_str());
            return 1;
        }
        if (n_schemas == 1)
            first_us = std::chrono::duration<double, std::micro>(Clock::now() - t_set).count();
        else
            compile_us.push_back(took);
        set.forget(k);
        t0 = Clock::now();
        (void)set.allowed(k, g, {});  // compiled: from the cache, a new matcher
        cached_us.push_back(us_since(t0));
        std::vector<int32_t> out;
        for (int s = 0; s < a.tokens; ++s) {
            t0 = Clock::now();
            auto mask = set.allowed(k, g, out);
            mask_us.push_back(us_since(t0));
            if (!mask.ok()) break;
            t0 = Clock::now();
            std::copy(row.begin(), row.end(), work.begin());
            (void)apply_token_mask(work.data(), nv, *mask);
            apply_us.push_back(us_since(t0));
            t0 = Clock::now();
            std::copy(row.begin(), row.end(), work.begin());
            read_us.push_back(us_since(t0));
            if (work[static_cast<size_t>(s) % work.size()] > 1e30f) std::puts("");  // keeps the copy
            std::vector<int32_t> text;
            for (int32_t i = 0; i < nv; ++i)
                if ((((*mask)[static_cast<size_t>(i) >> 5] >> (i & 31)) & 1u) && !tok.is_eog(i)) text.push_back(i);
            if (text.empty()) break;
            out.push_back(text[rng() % text.size()]);
            ++tokens;
        }
        set.forget(k);
    }
    if (n_schemas == 0) {
        std::fprintf(stderr, "duet bench grammar: no schema in %s\n", a.schemas.c_str());
        return 1;
    }
    const double mask_p50 = pct(mask_us, 0.5), mask_p99 = pct(mask_us, 0.99);
    if (a.json) {
        nlohmann::json j = {
            {"schemas", n_schemas},
            {"refused", refused},
            {"tokens", tokens},
            {"n_vocab", nv},
            {"first_compile_us", first_us},
            {"compile_us",
             {{"p50", pct(compile_us, 0.5)}, {"p99", pct(compile_us, 0.99)}, {"max", pct(compile_us, 1.0)}}},
            {"cached_us", {{"p50", pct(cached_us, 0.5)}, {"p99", pct(cached_us, 0.99)}}},
            {"check_us", {{"p50", pct(check_us, 0.5)}, {"p99", pct(check_us, 0.99)}}},
            {"check_again_us", {{"p50", pct(checked_us, 0.5)}, {"p99", pct(checked_us, 0.99)}}},
            {"mask_us", {{"p50", mask_p50}, {"p99", mask_p99}, {"max", pct(mask_us, 1.0)}}},
            {"apply_us", {{"p50", pct(apply_us, 0.5)}, {"p99", pct(apply_us, 0.99)}}},
            {"row_copy_us", {{"p50", pct(read_us, 0.5)}}}};
        std::puts(j.dump().c_str());
        return 0;
    }
    std::printf("duet bench grammar: %zu schemas (%zu refused), %zu tokens walked, vocabulary %d\n\n", n_schemas,
                refused, tokens, nv);
    std::printf("| measure | p50 | p99 | max | goal |\n|---|---|---|---|---|\n");
    std::printf("| first compile, with the vocabulary's tables (us) | %.0f | | | |\n", first_us);
    std::printf("| the front's check, first time (us) | %.0f | %.0f | %.0f | |\n", pct(check_us, 0.5),
                pct(check_us, 0.99), pct(check_us, 1.0));
    std::printf("| the front's check, same schema again (us) | %.1f | %.1f | | |\n", pct(checked_us, 0.5),
                pct(checked_us, 0.99));
    std::printf("| compile (us) | %.0f | %.0f | %.0f | <= 10000 typical |\n", pct(compile_us, 0.5),
                pct(compile_us, 0.99), pct(compile_us, 1.0));
    std::printf("| compiled, from the cache (us) | %.1f | %.1f | | |\n", pct(cached_us, 0.5), pct(cached_us, 0.99));
    std::printf("| mask per token (us) | %.1f | %.1f | %.1f | p50 <= 50, p99 <= 1000 |\n", mask_p50, mask_p99,
                pct(mask_us, 1.0));
    std::printf("| mask applied to a row (us) | %.1f | %.1f | | |\n", pct(apply_us, 0.5), pct(apply_us, 0.99));
    std::printf("| reference: one copy of a row of logits, the floor of applying it (us) | %.1f | | | |\n",
                pct(read_us, 0.5));
    return 0;
}

}  // namespace duet
