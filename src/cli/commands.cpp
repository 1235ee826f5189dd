#include "cli/commands.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <iterator>
#include <stdexcept>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "model/chat_template.h"
#include "model/synth.h"

namespace duet {

namespace {

std::string read_stdin() {
    return std::string(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());
}

bool apply_cpus(const std::string& cpus, EngineOptions& e) {
    if (cpus.empty()) return true;
    auto list = parse_cpu_list(cpus);
    if (!list) {
        std::fprintf(stderr, "duet: --cpus: %s\n", list.error().message.c_str());
        return false;
    }
    e.cpus = *list;
    return true;
}

double now_s() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

int cmd_run(RunArgs a) {
    a.engine.model_path = a.model;
    if (!apply_cpus(a.cpus, a.engine)) return 2;
    if (Status s = a.sampling.validate(); !s) {
        std::fprintf(stderr, "duet: %s\n", s.error().message.c_str());
        return 2;
    }
    if (a.prompt.empty()) a.prompt = read_stdin();
    auto eng = Engine::create(a.engine);
    if (!eng) {
        std::fprintf(stderr, "duet: %s\n", eng.error().message.c_str());
        return 1;
    }
    Engine& e = **eng;
    const Tokenizer& tok = e.tokenizer();
    std::fprintf(stderr, "duet: %s\n", e.shm().describe().c_str());

    std::vector<int32_t> prompt;
    if (a.chat) {
        auto tmpl = ChatTemplate::from_gguf(e.model().file(), a.chat_template);
        if (!tmpl) {
            std::fprintf(stderr, "duet: %s\n", tmpl.error().message.c_str());
            return 2;
        }
        std::vector<ChatMessage> msgs;
        if (!a.system.empty()) msgs.push_back({"system", a.system});
        msgs.push_back({"user", a.prompt});
        auto text = tmpl->apply(msgs, true);
        if (!text) {
            std::fprintf(stderr, "duet: %s\n", text.error().message.c_str());
            return 2;
        }
        // A template that writes its own BOS (Llama-3) must not get a second one.
        prompt = tok.encode(*text, !tmpl->includes_bos(), true);
    } else {
        prompt = tok.encode(a.prompt, true, false);
    }

    GenerateOptions g;
    g.max_tokens = a.max_tokens;
    g.sampling = a.sampling;
    g.stop_at_eog = !a.ignore_eos;
    Detokenizer detok(tok);
    auto st = e.generate(prompt, g, [&](int32_t id) {
        if (!a.ignore_eos && tok.is_eog(id)) return true;
        std::string s = detok.push(id);
        std::fwrite(s.data(), 1, s.size(), stdout);
        std::fflush(stdout);
        return true;
    });
    std::string rest = detok.finish();
    std::fwrite(rest.data(), 1, rest.size(), stdout);
    std::fputc('\n', stdout);
    std::fflush(stdout);
    if (!st) {
        std::fprintf(stderr, "duet: %s\n", st.error().message.c_str());
        return 1;
    }
    const double pp = st->prompt_seconds > 0 ? st->prompt_tokens / st->prompt_seconds : 0;
    const double tg = st->generate_seconds > 0 ? (st->generated - 1) / st->generate_seconds : 0;
    std::fprintf(stderr, "duet: prompt %lld tokens, %.1f tokens/s; generated %lld tokens, %.1f tokens/s (%s)\n",
                 static_cast<long long>(st->prompt_tokens), pp, static_cast<long long>(st->generated), tg,
                 e.backend_description().c_str());
    return 0;
}

int cmd_info(const std::string& path) {
    auto f = GgufFile::open(path);
    if (!f) {
        std::fprintf(stderr, "duet: %s\n", f.error().message.c_str());
        return 1;
    }
    const GgufFile& g = **f;
    fmt::print("file: {}\nGGUF version {}, {} metadata keys, {} tensors, alignment {}, data at offset {}\n",
               path, g.version(), g.metadata().size(), g.tensors().size(), g.alignment(), g.data_offset());
    fmt::print("\nmetadata:\n");
    for (const auto& [k, v] : g.metadata()) {
        std::string val;
        switch (v.type) {
            case GgufType::STRING: {
                std::string s(v.s.substr(0, 120));
                for (char& ch : s)
                    if (ch == '\n') ch = ' ';
                val = fmt::format("\"{}\"{}", s, v.s.size() > 120 ? "..." : "");
                break;
            }
            case GgufType::ARRAY:
                val = fmt::format("[{} x {}]", v.count, gguf_type_name(v.elem_type));
                if (v.elem_type == GgufType::STRING && v.count > 0)
                    val += fmt::format(" \"{}\", ...", std::string(v.strs[0].substr(0, 40)));
                break;
            case GgufType::F32: case GgufType::F64: val = fmt::format("{}", v.f); break;
            case GgufType::BOOL: val = v.u ? "true" : "false"; break;
            case GgufType::U64: val = fmt::format("{}", v.u); break;
            default: val = fmt::format("{}", v.i);
        }
        fmt::print("  {:<44} {:<6} {}\n", k, gguf_type_name(v.type), val);
    }
    fmt::print("\ntensors:\n");
    size_t total = 0;
    for (const GgufTensor& t : g.tensors()) {
        std::string shape = fmt::format("{}", t.ne[0]);
        for (int d = 1; d < t.n_dims; ++d) shape += fmt::format(" x {}", t.ne[d]);
        fmt::print("  {:<32} {:<5} {:<16} {:>10} bytes at {}\n", t.name, dtype_name(t.type), shape, t.nbytes,
                   g.data_offset() + t.offset);
        total += t.nbytes;
    }
    fmt::print("\n{} tensors, {:.1f} MiB of weights\n", g.tensors().size(), total / 1048576.0);
    auto m = Model::load(path);
    if (!m) {
        fmt::print("\nnot loadable as a model: {}\n", m.error().message);
        return 0;
    }
    const ModelConfig& c = (*m)->config();
    fmt::print("\nmodel: {} ({}), {} layers, n_embd {}, n_ff {}, heads {} / kv {}, head_dim {}, rope base {} dims {}, "
               "vocab {}, context {}, output {}\n",
               c.name, c.arch, c.n_layer, c.n_embd, c.n_ff, c.n_head, c.n_head_kv, c.head_dim, c.rope_base, c.rot_dim,
               c.n_vocab, c.n_ctx_train, c.tied_output ? "tied to token_embd" : "separate");
    return 0;
}

int cmd_chat_template(const std::string& path, const std::string& name) {
    auto f = GgufFile::open(path);
    if (!f) {
        std::fprintf(stderr, "duet: %s\n", f.error().message.c_str());
        return 1;
    }
    auto tmpl = ChatTemplate::from_gguf(**f, name);
    if (!tmpl) {
        std::fprintf(stderr, "duet: %s: %s\n", path.c_str(), tmpl.error().message.c_str());
        return 1;
    }
    std::string line;
    while (std::getline(std::cin, line)) {
        const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
        std::vector<ChatMessage> msgs;
        bool ok = j.is_object() && j.contains("messages") && j["messages"].is_array();
        for (const nlohmann::json& m : ok ? j["messages"] : nlohmann::json::array()) {
            ok = ok && m.is_object() && m.contains("role") && m["role"].is_string() && m.contains("content") &&
                 m["content"].is_string();
            if (ok) msgs.emplace_back(m["role"].get<std::string>(), m["content"].get<std::string>());
        }
        const nlohmann::json& gen = ok ? j.value("add_generation_prompt", nlohmann::json(false)) : nlohmann::json();
        if (!ok || !gen.is_boolean()) {
            std::fprintf(stderr,
                         "duet: a line is not {\"messages\": [{role, content}...], \"add_generation_prompt\": "
                         "bool}: %.80s\n",
                         line.c_str());
            return 1;
        }
        auto text = tmpl->apply(msgs, gen.get<bool>());
        if (!text) {
            std::fprintf(stderr, "duet: %s\n", text.error().message.c_str());
            return 1;
        }
        fmt::print("{}\n", nlohmann::json(*text).dump());
    }
    return 0;
}

int cmd_tokenize(const std::string& path, std::string text, bool have_text, bool parse_special, bool jsonl) {
    if (jsonl && have_text) {
        std::fprintf(stderr, "duet: --jsonl reads its texts from standard input, not the command line\n");
        return 2;
    }
    if (!have_text && !jsonl) text = read_stdin();
    auto f = GgufFile::open(path);
    if (!f) {
        std::fprintf(stderr, "duet: %s\n", f.error().message.c_str());
        return 1;
    }
    auto tok = Tokenizer::from_gguf(**f);
    if (!tok) {
        std::fprintf(stderr, "duet: %s: %s\n", path.c_str(), tok.error().message.c_str());
        return 1;
    }
    if (jsonl) {
        std::string line;
        while (std::getline(std::cin, line)) {
            const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
            if (!j.is_string()) {
                std::fprintf(stderr, "duet: --jsonl: a line is not a JSON string: %.80s\n", line.c_str());
                return 1;
            }
            fmt::print("{}\n", nlohmann::json((*tok)->encode(j.get<std::string>(), true, parse_special)).dump());
        }
        return 0;
    }
    std::vector<int32_t> ids = (*tok)->encode(text, true, parse_special);
    std::string out = "[";
    for (size_t i = 0; i < ids.size(); ++i) out += fmt::format("{}{}", i ? ", " : "", ids[i]);
    fmt::print("{}]\n", out);
    return 0;
}

namespace {

// The floor of one decode step: the time to read exactly the weights a token
// reads (every matrix once, the output head, one embedding row), with the
// widest loads and the same threads, each thread its share of every tensor.
// Best of 20, after the weights were just used, so cache residency matches the
// decode steps measured before it.
double measure_weight_read_seconds(const Model& m, ThreadPool& pool, cpu::Isa isa) {
    std::vector<const GgufTensor*> ts = {&m.output()};
    for (int64_t l = 0; l < m.config().n_layer; ++l) {
        const LayerWeights& w = m.layer(l);
        for (const GgufTensor* t : {w.wq, w.wk, w.wv, w.wo, w.w_gate, w.w_up, w.w_down}) ts.push_back(t);
    }
    std::vector<uint64_t> sink(static_cast<size_t>(pool.size()) * 8, 0);
    double best = 1e30;
    for (int rep = 0; rep < 20; ++rep) {
        double t0 = now_s();
        pool.run([&](int tid, int nth) {
            uint64_t acc = 0;
            for (const GgufTensor* t : ts) {
                int64_t b, e;
                ThreadPool::split(static_cast<int64_t>(t->nbytes), tid, nth, b, e, 4096);
                if (b < e) acc ^= cpu::read_fold(isa, t->data + b, static_cast<size_t>(e - b));
            }
            sink[static_cast<size_t>(tid) * 8] ^= acc;
        });
        best = std::min(best, now_s() - t0);
    }
    uint64_t all = 0;
    for (uint64_t v : sink) all ^= v;
    if (all == 0x5eed) std::fprintf(stderr, " ");  // keeps the reads observable
    return best;
}

struct Stat {
    double mean = 0, sd = 0;
};

Stat stats(const std::vector<double>& v) {
    Stat s;
    for (double x : v) s.mean += x;
    s.mean /= static_cast<double>(v.size());
    for (double x : v) s.sd += (x - s.mean) * (x - s.mean);
    s.sd = v.size() > 1 ? std::sqrt(s.sd / static_cast<double>(v.size() - 1)) : 0;
    return s;
}

}  // namespace

int cmd_bench_model(BenchArgs a) {
    a.engine.model_path = a.model;
    if (!apply_cpus(a.cpus, a.engine)) return 2;
    if (a.n_prompt < 1 || a.n_gen < 1 || a.reps < 1) {
        std::fprintf(stderr, "duet: --n-prompt, --n-gen and --repetitions must be >= 1\n");
        return 2;
    }
    // KV for the prompt and its generation, or for the 8 sequences of the verify
    // measure where the model's context holds them (the engine's KV is one context
    // long): otherwise the measure is left out, and said so.
    const int64_t plain = std::max(a.n_prompt, a.n_gen) + 16, eight = 8 * int64_t{a.n_prompt + a.verify + 16};
    if (a.verify > 0) {
        auto m = Model::load(a.model);
        if (m && (*m)->config().n_ctx_train < eight) {
            std::fprintf(stderr, "duet: --verify left out: 8 sequences of %d tokens exceed the model's context of %lld\n",
                         a.n_prompt + a.verify, static_cast<long long>((*m)->config().n_ctx_train));
            a.verify = 0;
        }
    }
    // The rows measure: max R sequences of the prompt and kRowSteps positions, and one
    // sequence of the prompt and kRowSteps passes of max R positions.
    constexpr int kRowSteps = 8;
    const int max_rows = a.rows.empty() ? 0 : *std::max_element(a.rows.begin(), a.rows.end());
    const int64_t rows_kv = std::max<int64_t>(int64_t{max_rows} * (a.n_prompt + kRowSteps + 16),
                                              a.n_prompt + int64_t{kRowSteps + 1} * max_rows + 16);
    a.engine.n_ctx = std::max<int64_t>({plain, a.verify > 0 ? eight : 0, max_rows > 0 ? rows_kv : 0});
    auto eng = Engine::create(a.engine);
    if (!eng) {
        std::fprintf(stderr, "duet: %s\n", eng.error().message.c_str());
        return 1;
    }
    Engine& e = **eng;
    const int64_t nv = e.model().config().n_vocab;
    std::vector<int32_t> toks(static_cast<size_t>(std::max({a.n_prompt, a.n_gen, kRowSteps + max_rows, a.verify})));
    for (size_t i = 0; i < toks.size(); ++i) toks[i] = static_cast<int32_t>((i * 7919 + 13) % static_cast<size_t>(nv));
    std::vector<float> logits;

    auto run_pp = [&]() -> double {
        KvSeq seq;
        SeqBatch b{&seq, toks.data(), a.n_prompt, false};
        double t0 = now_s();
        Status s = e.backend().forward({&b, 1}, logits);
        double dt = now_s() - t0;
        seq.release(e.pool());
        if (!s) throw std::runtime_error(s.error().message);
        return a.n_prompt / dt;
    };
    auto run_tg = [&]() -> double {
        KvSeq seq;
        double t0 = now_s();
        for (int i = 0; i < a.n_gen; ++i) {
            SeqBatch b{&seq, &toks[i], 1, false};
            Status s = e.backend().forward({&b, 1}, logits);
            if (!s) {
                seq.release(e.pool());
                throw std::runtime_error(s.error().message);
            }
        }
        double dt = now_s() - t0;
        seq.release(e.pool());
        return a.n_gen / dt;
    };
    // Decode passes over sequences holding the prompt's KV: `rows` sequences of one
    // position each (`steps` passes), or one row of a.verify positions; seconds per pass.
    auto run_decode = [&](int rows, int width, int steps) -> double {
        std::vector<KvSeq> seqs(static_cast<size_t>(rows));
        for (KvSeq& s : seqs) {
            SeqBatch b{&s, toks.data(), a.n_prompt, false};
            if (Status st = e.backend().forward({&b, 1}, logits); !st) throw std::runtime_error(st.error().message);
        }
        std::vector<SeqBatch> batch;
        double t0 = now_s();
        for (int i = 0; i < steps; ++i) {
            batch.clear();
            for (KvSeq& s : seqs) batch.push_back({&s, &toks[static_cast<size_t>(i)], width, width > 1});
            if (Status st = e.backend().forward(batch, logits); !st) throw std::runtime_error(st.error().message);
        }
        const double dt = (now_s() - t0) / steps;
        for (KvSeq& s : seqs) s.release(e.pool());
        return dt;
    };
    // Warm-up: page in weights, size scratch buffers.
    run_pp();
    run_tg();
    std::vector<double> pp, tg, single, verify, batch8;
    for (int r = 0; r < a.reps; ++r) pp.push_back(run_pp());
    for (int r = 0; r < a.reps; ++r) tg.push_back(run_tg());
    if (a.verify > 0) {
        run_decode(8, 1, 1);
        for (int r = 0; r < a.reps; ++r) {
            single.push_back(run_decode(1, 1, a.verify) * 1e3);
            verify.push_back(run_decode(1, a.verify, 1) * 1e3);
            batch8.push_back(run_decode(8, 1, a.verify) * 1e3);
        }
    }
    // The rows measure: each figure the best of the repetitions (the least disturbed
    // by the other core's tenants), ms per pass.
    std::vector<std::array<double, 3>> rows_ms;  // R, R sequences' pass, one sequence's R-position pass
    for (int R : a.rows) {
        double seqs = 1e30, one = 1e30;
        for (int r = 0; r < a.reps; ++r) {
            seqs = std::min(seqs, run_decode(R, 1, kRowSteps) * 1e3);
            one = std::min(one, run_decode(1, R, kRowSteps) * 1e3);
        }
        rows_ms.push_back({static_cast<double>(R), seqs, one});
    }
    const double bytes = static_cast<double>(e.model().weight_bytes_per_token());
    const double floor_tps = 1.0 / measure_weight_read_seconds(e.model(), e.threads(), e.isa());
    const double bw = bytes * floor_tps;
    Stat spp = stats(pp), stg = stats(tg);
    if (a.json) {
        nlohmann::json j = {
            {"model", a.model},
            {"threads", e.threads().size()},
            {"isa", cpu::isa_name(e.isa())},
            {"n_prompt", a.n_prompt},
            {"n_gen", a.n_gen},
            {"pp_tokens_per_s", spp.mean},
            {"pp_tokens_per_s_sd", spp.sd},
            {"tg_tokens_per_s", stg.mean},
            {"tg_tokens_per_s_sd", stg.sd},
            {"weight_bytes_per_token", bytes},
            {"read_bandwidth_bytes_per_s", bw},
            {"tg_floor_tokens_per_s", floor_tps},
            {"tg_fraction_of_floor", stg.mean / floor_tps},
        };
        if (a.verify > 0) {
            j["verify"] = a.verify;
            j["step_ms"] = stats(single).mean;
            j["verify_row_ms"] = stats(verify).mean;
            j["step_batch8_ms"] = stats(batch8).mean;
        }
        if (!rows_ms.empty()) {
            j["floor_pass_ms"] = 1e3 / floor_tps;
            j["rows"] = nlohmann::json::array();
            for (const auto& [R, seqs, one] : rows_ms)
                j["rows"].push_back({{"rows", static_cast<int>(R)}, {"sequences_ms", seqs}, {"one_sequence_ms", one}});
        }
        std::printf("%s\n", j.dump().c_str());
    } else {
        fmt::print("model {} | {} threads | {}\n", a.model, e.threads().size(), cpu::isa_name(e.isa()));
        fmt::print("pp{:<5} {:10.1f} ± {:.1f} tokens/s\n", a.n_prompt, spp.mean, spp.sd);
        fmt::print("tg{:<5} {:10.1f} ± {:.1f} tokens/s\n", a.n_gen, stg.mean, stg.sd);
        fmt::print("floor: reading the {:.1f} MB of weights a token uses takes {:.1f} GB/s -> {:.1f} tokens/s; "
                   "tg is {:.0f}% of it\n",
                   bytes / 1e6, bw / 1e9, floor_tps, 100.0 * stg.mean / floor_tps);
        if (a.verify > 0) {
            const Stat s1 = stats(single), sv = stats(verify), s8 = stats(batch8);
            fmt::print(
                "decode at {} tokens: a step {:.2f} ± {:.2f} ms; a verify row of {} positions {:.2f} ± {:.2f} ms "
                "({:.2f} steps' time for {} positions); a step of 8 sequences {:.2f} ± {:.2f} ms ({:.2f} steps)\n",
                a.n_prompt, s1.mean, s1.sd, a.verify, sv.mean, sv.sd, sv.mean / s1.mean, a.verify, s8.mean, s8.sd,
                s8.mean / s1.mean);
        }
        if (!rows_ms.empty()) {
            const double base = rows_ms.front()[1], floor_ms = 1e3 / floor_tps;
            fmt::print("passes at {} tokens of context, best of {} (weight-read floor {:.2f} ms a pass):\n", a.n_prompt,
                       a.reps, floor_ms);
            fmt::print(
                "| rows | R sequences ms | x first | x floor | one sequence, R positions ms | x first | x floor |\n");
            for (const auto& [R, seqs, one] : rows_ms)
                fmt::print("| {} | {:.2f} | {:.2f} | {:.2f} | {:.2f} | {:.2f} | {:.2f} |\n", static_cast<int>(R), seqs,
                           seqs / base, seqs / floor_ms, one, one / base, one / floor_ms);
        }
    }
    return 0;
}

int cmd_model_synth(const std::string& shape, const std::string& type, int64_t layers, uint64_t seed,
                    const std::string& out) {
    auto s = synth_shape(shape);
    if (!s) {
        std::string names;
        for (const std::string& n : synth_shape_names()) names += (names.empty() ? "" : ", ") + n;
        std::fprintf(stderr, "duet: no shape '%s' (%s)\n", shape.c_str(), names.c_str());
        return 2;
    }
    SynthOptions o;
    o.shape = *s;
    o.layers = layers;
    o.seed = seed;
    bool found = false;
    for (DType t : {DType::BF16, DType::F16, DType::F32, DType::Q4_0, DType::Q4_1, DType::Q5_0, DType::Q5_1,
                    DType::Q8_0, DType::Q4_K, DType::Q5_K, DType::Q6_K}) {
        std::string n = dtype_name(t);
        for (char& c : n) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
        if (n == type) o.type = t, found = true;
    }
    if (!found) {
        std::fprintf(stderr,
                     "duet: no weight type '%s' (bf16, f16, f32, q4_0, q4_1, q5_0, q5_1, q8_0, q4_k, q5_k, q6_k)\n",
                     type.c_str());
        return 2;
    }
    const double t0 = now_s();
    if (Status st = write_synth_model(out, o); !st) {
        std::fprintf(stderr, "duet: %s\n", st.error().message.c_str());
        return 1;
    }
    std::fprintf(stderr, "duet: wrote %s: %s, %lld layers, %s, %.2f GB in %.1f s\n", out.c_str(), s->name.c_str(),
                 static_cast<long long>(layers >= 0 ? layers : s->n_layer), dtype_name(o.type),
                 static_cast<double>(synth_model_bytes(o)) / 1e9, now_s() - t0);
    return 0;
}

}  // namespace duet
