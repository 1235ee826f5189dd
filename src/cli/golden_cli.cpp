#include "cli/golden_cli.h"

#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "engine/engine.h"
#include "engine/golden.h"
#include "model/chat_template.h"

namespace duet {

namespace {

int fail(const std::string& m) {
    std::fprintf(stderr, "duet golden: %s\n", m.c_str());
    return 1;
}

// Five positions spread over a prompt of n tokens, the last among them.
std::vector<GoldenRef::Position> spread_positions(size_t n) {
    std::vector<GoldenRef::Position> v;
    for (size_t k = 0; k < 5; ++k) {
        const auto pos = static_cast<int32_t>(n == 1 ? 0 : k * (n - 1) / 4);
        if (v.empty() || v.back().pos != pos) v.push_back(GoldenRef::Position{pos, {}});
    }
    return v;
}

// The prompts of a reference recorded by duet: a chat in the model's template and a
// plain sentence, tokenized by the model's own tokenizer.
Result<GoldenRef> default_shape(Engine& e) {
    GoldenRef shape;
    const Tokenizer& tok = e.tokenizer();
    auto tmpl = ChatTemplate::from_gguf(e.model().file(), "");
    std::vector<std::pair<std::string, std::vector<int32_t>>> prompts;
    if (tmpl) {
        const std::vector<ChatMessage> msgs = {{"user", "What is the capital of France?"}};
        auto text = tmpl->apply(msgs, /*add_generation_prompt=*/true);
        if (text)
            prompts.emplace_back("chat", tok.encode(*text, tok.add_bos() && !tmpl->includes_bos(), /*parse_special=*/true));
    }
    prompts.emplace_back("capital", tok.encode("The capital of France is", tok.add_bos(), false));
    for (auto& [name, ids] : prompts) {
        GoldenRef::Prompt p;
        p.name = name;
        p.ids = ids;
        p.positions = spread_positions(ids.size());
        shape.prompts.push_back(std::move(p));
    }
    return shape;
}

// A reference from llama.cpp's logits fixture (tests/fixtures/logits.json): its
// chat and capital prompts, at its positions the top ids and the fixed ids as
// log-probabilities (logit - lse). The numbers are llama.cpp's.
Result<GoldenRef> from_llama_fixture(const std::string& path) {
    std::ifstream f(path);
    if (!f) return make_error("cannot read {}", path);
    auto j = nlohmann::json::parse(f, nullptr, false);
    if (j.is_discarded()) return make_error("{} is not JSON", path);
    try {
        GoldenRef r;
        const auto& meta = j.at("meta");
        r.source = fmt::format("llama.cpp {} ({})", meta.value("llama_cpp_commit", "?"), path.substr(path.rfind('/') + 1));
        for (const auto& p : j.at("prompts")) {
            const std::string name = p.at("name");
            if (name != "chat" && name != "capital") continue;  // short ones: a check at every start
            GoldenRef::Prompt q;
            q.name = name;
            q.ids = p.at("ids").get<std::vector<int32_t>>();
            for (const auto& at : p.at("positions")) {
                GoldenRef::Position pos;
                pos.pos = at.at("pos");
                const double lse = at.at("lse");
                // The top ids only: the tail's (the fixture's fixed ids, log-probs near
                // -20) errors grow with KV quantization without saying anything about
                // the answers.
                for (const auto& t : at.at("top")) pos.logprobs.emplace_back(t.at(0).get<int32_t>(), t.at(1).get<double>() - lse);
                q.positions.push_back(std::move(pos));
            }
            r.prompts.push_back(std::move(q));
        }
        if (r.prompts.empty()) return make_error("{} has no 'chat' or 'capital' prompt", path);
        return r;
    } catch (const std::exception& e) {
        return make_error("{}: {}", path, e.what());
    }
}

Result<std::unique_ptr<Engine>> golden_engine(const GoldenArgs& a) {
    EngineOptions o;
    o.model_path = a.model;
    o.device = a.device;
    o.kv_dtype = a.kv_dtype;
    o.isa = a.isa;
    o.n_ctx = 512;
    return Engine::create(o);
}

}  // namespace

int cmd_golden_record(const GoldenArgs& a) {
    auto eng = golden_engine(a);
    if (!eng) return fail(eng.error().message);
    Engine& e = **eng;
    GoldenRef r;
    if (!a.from.empty()) {
        auto fx = from_llama_fixture(a.from);
        if (!fx) return fail(fx.error().message);
        r = std::move(fx).value();
        r.model_fingerprint = e.model().fingerprint();
    } else {
        auto shape = default_shape(e);
        if (!shape) return fail(shape.error().message);
        auto rec = record_golden(e.backend(), e.pool(), e.model().fingerprint(), *shape, 40);
        if (!rec) return fail(rec.error().message);
        r = std::move(rec).value();
        r.source = fmt::format("duet golden record on {} (KV {})", a.device, a.kv_dtype);
    }
    r.tol_mean = a.tol_mean;
    r.tol_max = a.tol_max;
    r.tol_top1_gap = a.tol_top1_gap;
    // The check against what was just written: a reference its own model fails is
    // no reference (a llama.cpp one outside the tolerance, say).
    auto rep = check_golden(e.backend(), e.pool(), e.model().fingerprint(), r);
    if (!rep) return fail(rep.error().message);
    const std::string out = a.out.empty() ? a.model + ".golden.json" : a.out;
    if (!rep->passed) return fail(fmt::format("this model fails the reference it would write ({}); nothing written", rep->summary));
    std::ofstream f(out);
    f << golden_json(r);
    if (!f.flush()) return fail(fmt::format("cannot write {}", out));
    std::fprintf(stderr, "duet golden: wrote %s (%s)\n", out.c_str(), rep->summary.c_str());
    return 0;
}

int cmd_golden_check(const GoldenArgs& a) {
    auto eng = golden_engine(a);
    if (!eng) return fail(eng.error().message);
    Engine& e = **eng;
    auto ref = find_golden(a.golden, a.model, e.model().fingerprint());
    if (!ref) return fail(ref.error().message);
    if (!*ref) {
        std::printf("no golden reference for %s (fingerprint %#018llx): unchecked\n", a.model.c_str(),
                    static_cast<unsigned long long>(e.model().fingerprint()));
        return 0;
    }
    auto rep = check_golden(e.backend(), e.pool(), e.model().fingerprint(), **ref);
    if (!rep) return fail(rep.error().message);
    std::printf("%s: %s\n", rep->passed ? "passed" : "FAILED", rep->summary.c_str());
    return rep->passed ? 0 : kGoldenExitCode;
}

}  // namespace duet
