// duet: one binary, subcommands. Exceptions stop here (argument parsing).
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "bench/contexts_bench.h"
#include "bench/cuda_cmd.h"
#include "bench/grammar_bench.h"
#include "bench/kv_bench.h"
#include "bench/serve_bench.h"
#include "bench/shm_bench.h"
#include "cli/commands.h"
#include "cli/golden_cli.h"
#include "cli/kv_cli.h"
#include "cli/role_flags.h"
#include "cli/serve.h"
#include "cli/shm_status.h"
#include "cli/topo.h"
#include "cli/trace_cli.h"
#include "cli/worker_roles.h"

using namespace duet;

namespace {

// The commands' arguments live as long as the app (CLI11 keeps pointers into them
// and each command's callback reads them).
using Store = std::vector<std::shared_ptr<void>>;
template <class T>
T& keep(Store& store) {
    auto p = std::make_shared<T>();
    store.push_back(p);
    return *p;
}

// duet run
void add_run(CLI::App& app, Store& store, int& rc, const std::string& default_model) {
    // duet run
    auto& run = keep<RunArgs>(store);
    run.model = default_model;
    CLI::App* c_run = app.add_subcommand("run", "generate text from a prompt");
    c_run->add_option("-m,--model", run.model, "GGUF model file")->capture_default_str();
    c_run->add_option("-p,--prompt", run.prompt, "prompt text (default: read standard input)");
    c_run->add_flag("--chat", run.chat, "wrap the prompt as a user message in the model's chat template");
    c_run->add_option("--system", run.system, "system message for --chat");
    c_run->add_option("--chat-template", run.chat_template,
                      "override the chat template (chatml, smollm2, qwen2, llama3)");
    c_run->add_option("-n,--max-tokens", run.max_tokens, "tokens to generate")
        ->capture_default_str()
        ->check(CLI::Range(0, 1 << 20));
    c_run->add_option("--temperature", run.sampling.temperature, "0 is greedy")->capture_default_str();
    c_run->add_option("--top-k", run.sampling.top_k, "0 disables")->capture_default_str();
    c_run->add_option("--top-p", run.sampling.top_p, "1 disables")->capture_default_str();
    c_run->add_option("--min-p", run.sampling.min_p, "0 disables")->capture_default_str();
    c_run->add_option("--repeat-penalty", run.sampling.repetition_penalty, "1 disables")->capture_default_str();
    c_run->add_option("--frequency-penalty", run.sampling.frequency_penalty)->capture_default_str();
    c_run->add_option("--presence-penalty", run.sampling.presence_penalty)->capture_default_str();
    c_run->add_option("--seed", run.sampling.seed, "random seed")->capture_default_str();
    c_run->add_option("-t,--threads", run.engine.threads, "compute threads (default: one per CPU)");
    c_run->add_option("--cpus", run.cpus, "pin threads to these CPUs, e.g. 0-3");
    c_run->add_option("--ctx", run.engine.n_ctx, "context size in tokens (default: min(model, 4096))");
    c_run->add_option("--isa", run.engine.isa, "kernel level: scalar, avx2, avx512, amx (default: best)");
    c_run->add_option("--device", run.engine.device, "cpu, or cuda:N (a build with CUDA)")->capture_default_str();
    c_run->add_flag("!--no-cuda-graphs", run.engine.cuda_graphs, "run every CUDA pass eagerly");
    c_run->add_flag(
        "--cuda-qgemv", run.engine.cuda_qgemv,
        "decode projections of up to 8 tokens from the GGUF blocks (Q4_0, Q4_1, Q8_0) instead of cuBLAS over bf16");
    c_run
        ->add_option("--kv-dtype", run.engine.kv_dtype,
                     "KV cache values: f16, int8 or fp8 (e4m3), quantized with a scale per token and head")
        ->capture_default_str();
    c_run->add_option("--instance", run.engine.instance,
                      "shared-memory instance name: segments /dev/shm/duet.<name>[.kv] (default: run-<pid>-0)");
    c_run->add_flag("!--no-huge-pages", run.engine.huge_pages, "keep the KV segment on 4 KiB pages");
    c_run->add_flag("--ignore-eos", run.ignore_eos, "keep generating past end-of-generation tokens");

    c_run->callback([&run = run, &rc = rc] { rc = cmd_run(run); });
}

// duet info, duet tokenize
void add_inspect_model(CLI::App& app, Store& store, int& rc, const std::string& default_model) {
    // duet info
    auto& info_model = keep<std::string>(store);
    info_model = default_model;
    CLI::App* c_info = app.add_subcommand("info", "print a GGUF file's metadata and tensor table");
    c_info->add_option("-m,--model", info_model, "GGUF model file")->capture_default_str();

    // duet tokenize
    auto& tok_model = keep<std::string>(store);
    tok_model = default_model;
    auto& tok_text = keep<std::string>(store);
    auto& tok_special = keep<bool>(store);
    tok_special = true;
    auto& tok_jsonl = keep<bool>(store);
    CLI::App* c_tok = app.add_subcommand("tokenize", "print the token ids of a text");
    c_tok->add_option("-m,--model", tok_model, "GGUF model file")->capture_default_str();
    c_tok->add_option("text", tok_text, "text to tokenize (default: standard input)");
    c_tok->add_option("--parse-special", tok_special, "recognize special token texts")->capture_default_str();
    c_tok->add_flag("--jsonl", tok_jsonl,
                    "many texts: each line of standard input a JSON string, each line of output its ids");

    // duet chat-template
    auto& ct_model = keep<std::string>(store);
    ct_model = default_model;
    auto& ct_name = keep<std::string>(store);
    CLI::App* c_ct = app.add_subcommand(
        "chat-template",
        "render conversations with the model's chat template: each line of standard input "
        "{\"messages\": [...], \"add_generation_prompt\": bool}, each line of output the text as a JSON string");
    c_ct->add_option("-m,--model", ct_model, "GGUF model file")->capture_default_str();
    c_ct->add_option("--chat-template", ct_name, "override the chat template (chatml, smollm2, qwen2, llama3)");
    c_ct->callback([&ct_model = ct_model, &ct_name = ct_name, &rc = rc] { rc = cmd_chat_template(ct_model, ct_name); });

    // duet model synth
    struct Synth {
        std::string shape = "llama3-8b", type = "q4_k", out;
        uint64_t seed = 1;
        int64_t layers = -1;
    };
    auto& sy = keep<Synth>(store);
    CLI::App* c_model = app.add_subcommand("model", "model files");
    c_model->require_subcommand(1);
    CLI::App* c_synth = c_model->add_subcommand(
        "synth", "write a GGUF of a real model's exact shape with seeded random weights (speed figures, no network)");
    c_synth->add_option("--shape", sy.shape, "llama3-8b, llama3-70b, smollm2-135m or tiny")->capture_default_str();
    c_synth
        ->add_option("--type", sy.type,
                     "every matrix's type: bf16, f16, f32, q4_0, q4_1, q5_0, q5_1, q8_0, q4_k, q5_k, q6_k")
        ->capture_default_str();
    c_synth->add_option("--layers", sy.layers, "layers (a slice of the shape; default: all of them)")
        ->check(CLI::Range(int64_t{0}, int64_t{1000}));
    c_synth->add_option("--seed", sy.seed, "random seed")->capture_default_str();
    c_synth->add_option("-o,--out", sy.out, "the GGUF file to write")->required();
    c_synth->callback([&sy = sy, &rc = rc] { rc = cmd_model_synth(sy.shape, sy.type, sy.layers, sy.seed, sy.out); });

    c_info->callback([&info_model = info_model, &rc = rc] { rc = cmd_info(info_model); });
    c_tok->callback(
        [&tok_model = tok_model, &tok_text = tok_text, &tok_special = tok_special, &tok_jsonl = tok_jsonl, &rc = rc,
         c_tok] { rc = cmd_tokenize(tok_model, tok_text, c_tok->count("text") > 0, tok_special, tok_jsonl); });
}

void add_bench_stores(CLI::App& parent, Store& store, int& rc, const std::string& default_model);

// duet bench model | cuda, and the rest (add_bench_stores)
void add_bench(CLI::App& app, Store& store, int& rc, const std::string& default_model) {
    // duet bench model
    auto& bench = keep<BenchArgs>(store);
    bench.model = default_model;
    CLI::App* c_bench = app.add_subcommand("bench", "benchmarks");
    c_bench->require_subcommand(1);
    CLI::App* c_bm = c_bench->add_subcommand("model", "prompt processing and generation tokens/s");
    c_bm->add_option("-m,--model", bench.model, "GGUF model file")->capture_default_str();
    c_bm->add_option("-p,--n-prompt", bench.n_prompt, "prompt tokens")->capture_default_str();
    c_bm->add_option("-n,--n-gen", bench.n_gen, "generated tokens")->capture_default_str();
    c_bm->add_option("-r,--repetitions", bench.reps, "repetitions")->capture_default_str();
    c_bm->add_option("-t,--threads", bench.engine.threads, "compute threads")->capture_default_str();
    c_bm->add_option("--cpus", bench.cpus, "pin threads to these CPUs");
    c_bm->add_option("--isa", bench.engine.isa, "kernel level");
    c_bm->add_option("--kv-dtype", bench.engine.kv_dtype, "KV cache values: f16, int8 or fp8")->capture_default_str();
    c_bm->add_option("--verify", bench.verify,
                     "after the prompt: one decode row of this many positions (a verify row) against as many "
                     "single steps, and a step of 8 sequences against one (0: neither)")
        ->capture_default_str()
        ->check(CLI::Range(0, 64));
    c_bm->add_option("--rows", bench.rows,
                     "passes of R rows for each R (e.g. 1,2,4,8,16): R sequences of one position and one sequence of R "
                     "positions, against the first R and the weight-read floor")
        ->delimiter(',')
        ->check(CLI::Range(1, 256));
    c_bm->add_flag("--json", bench.json, "print one JSON object");

    // duet bench cuda
    auto& cb = keep<CudaBenchArgs>(store);
    cb.model = default_model;
    CLI::App* c_bc = c_bench->add_subcommand("cuda", "the CUDA backend against HBM bandwidth and the bf16 peak");
    c_bc->add_option("-m,--model", cb.model, "GGUF model file")->capture_default_str();
    c_bc->add_option("--device", cb.device, "cuda:N")->capture_default_str();
    c_bc->add_option("--batches", cb.batches, "decode batch sizes (default 1 8 32 64 128 256)")
        ->delimiter(',')
        ->check(CLI::Range(1, 4096));
    c_bc->add_option("--ctx", cb.ctx, "context tokens per sequence for the decode steps")
        ->capture_default_str()
        ->check(CLI::Range(1, 1 << 20));
    c_bc->add_option("--steps", cb.steps, "timed decode steps per batch size")
        ->capture_default_str()
        ->check(CLI::Range(1, 100000));
    c_bc->add_option("--prefill", cb.prefill_tokens, "tokens of the timed prefill pass")
        ->capture_default_str()
        ->check(CLI::Range(1, 1 << 20));
    c_bc->add_option("--kv-dtype", cb.kv_dtype, "KV cache values: f16, int8 or fp8")->capture_default_str();
    c_bc->add_flag("--json", cb.json, "print one JSON object");
    c_bc->add_option("--json-out", cb.json_out, "also write the JSON to this file");
    c_bc->add_option("--trace", cb.trace,
                     "write the backend's ranges and the device's timings of each pass to this file (Chrome "
                     "trace-event JSON: Perfetto, duet trace summary)");
    c_bc->add_option(
            "--skip", cb.skip,
            "figures to leave out (a model at real size in a device check's minutes): sampled, eager, qgemv, copies")
        ->delimiter(',')
        ->check(CLI::IsMember({"sampled", "eager", "qgemv", "copies"}));

    c_bm->callback([&bench = bench, &rc = rc] { rc = cmd_bench_model(bench); });
    c_bc->callback([&cb = cb, &rc = rc] { rc = cmd_bench_cuda(cb); });
    add_bench_stores(*c_bench, store, rc, default_model);
}

// duet bench kv | contexts | shm | serve
void add_bench_stores(CLI::App& parent, Store& store, int& rc, const std::string& default_model) {
    CLI::App* c_bench = &parent;
    // duet bench kv
    auto& kvb = keep<KvBenchArgs>(store);
    kvb.model = default_model;
    CLI::App* c_bk = c_bench->add_subcommand("kv", "durable KV: appends/s, restore vs re-prefill and the disk, CRC32C");
    c_bk->add_option("-m,--model", kvb.model, "GGUF model file")->capture_default_str();
    c_bk->add_option("-t,--threads", kvb.threads, "compute threads (the re-prefill reference)")
        ->capture_default_str()
        ->check(CLI::Range(1, 1024));
    c_bk->add_option("--tokens", kvb.tokens, "the restored context's length")
        ->capture_default_str()
        ->check(CLI::Range(16, 1 << 20));
    c_bk->add_option("--chunk", kvb.chunk, "prefill chunk and log record tokens")
        ->capture_default_str()
        ->check(CLI::Range(1, 1 << 16));
    c_bk->add_option("--dir", kvb.dir, "directory for the logs (default: a new one under /var/tmp)");
    c_bk->add_option("--seconds", kvb.seconds, "length of each append measurement")
        ->capture_default_str()
        ->check(CLI::Range(0.05, 60.0));
    c_bk->add_option("-r,--repetitions", kvb.reps, "restore repetitions (median kept)")
        ->capture_default_str()
        ->check(CLI::Range(1, 100));
    c_bk->add_option("--kv-dtype", kvb.kv_dtype, "KV cache values: f16, int8 or fp8")->capture_default_str();
    c_bk->add_flag("--json", kvb.json, "print one JSON object");

    // duet bench grammar
    auto& gb = keep<GrammarBenchArgs>(store);
    gb.model = default_model;
    CLI::App* c_bg = c_bench->add_subcommand(
        "grammar", "structured outputs: schema compile time and the per-token mask, against its goals");
    c_bg->add_option("-m,--model", gb.model, "GGUF model file (its vocabulary)")->capture_default_str();
    c_bg->add_option("--schemas", gb.schemas,
                     "JSON lines with a \"schema\" each (tests/cli/schema_corpus.py); - for stdin")
        ->required();
    c_bg->add_option("--tokens", gb.tokens, "tokens walked per schema")
        ->capture_default_str()
        ->check(CLI::Range(1, 100000));
    c_bg->add_option("--seed", gb.seed, "the walk's seed")->capture_default_str();
    c_bg->add_flag("--json", gb.json, "print one JSON object");
    c_bg->callback([&gb, &rc] { rc = cmd_bench_grammar(gb); });

    // duet bench contexts
    auto& cxb = keep<ContextBenchArgs>(store);
    cxb.model = default_model;
    CLI::App* c_bcx = c_bench->add_subcommand(
        "contexts", "the context store: edit, restart restore and multi-turn against re-prefilling the tokens");
    c_bcx->add_option("-m,--model", cxb.model, "GGUF model file")->capture_default_str();
    c_bcx->add_option("-t,--threads", cxb.threads, "compute threads")->capture_default_str()->check(CLI::Range(1, 1024));
    c_bcx->add_option("--tokens", cxb.tokens, "the edited context's length")->capture_default_str()->check(CLI::Range(32, 1 << 20));
    c_bcx->add_option("--restore-tokens", cxb.restore_tokens, "the restored context's length")->capture_default_str()->check(CLI::Range(16, 1 << 20));
    c_bcx->add_option("--turns", cxb.turns, "multi-turn: turns")->capture_default_str()->check(CLI::Range(1, 1000));
    c_bcx->add_option("--user-tokens", cxb.user_tokens, "multi-turn: tokens of each user message")->capture_default_str()->check(CLI::Range(1, 1 << 16));
    c_bcx->add_option("--reply-tokens", cxb.reply_tokens, "multi-turn: tokens of each reply")->capture_default_str()->check(CLI::Range(1, 1 << 16));
    c_bcx->add_option("-r,--repetitions", cxb.reps, "edits and restores (median kept)")->capture_default_str()->check(CLI::Range(1, 100));
    c_bcx->add_option("--dir", cxb.dir, "directory for the logs (default: a new one under /var/tmp)");
    c_bcx->add_flag("--json", cxb.json, "print one JSON object");
    c_bcx->callback([&cxb = cxb, &rc = rc] { rc = cmd_bench_contexts(cxb); });

    // duet bench shm
    auto& shm_bench = keep<ShmBenchOptions>(store);
    auto& shm_quick = keep<bool>(store);
    CLI::App* c_bs = c_bench->add_subcommand("shm", "shared-memory rings, doorbell and KV arena against Boost");
    c_bs->add_option("--seconds", shm_bench.seconds, "length of each timed run")
        ->capture_default_str()
        ->check(CLI::Range(0.01, 60.0));
    c_bs->add_option("-r,--repetitions", shm_bench.reps, "runs per ring throughput figure (median kept)")
        ->capture_default_str()
        ->check(CLI::Range(1, 100));
    c_bs->add_option("--wakes", shm_bench.wakes, "doorbell wake-ups per implementation")
        ->capture_default_str()
        ->check(CLI::Range(1, 20000));
    c_bs->add_flag("--quick", shm_quick, "short runs (--seconds 0.05 -r 1 --wakes 300)");
    c_bs->add_flag("--json", shm_bench.json, "print one JSON object");

    // duet bench serve
    auto& sb = keep<ServeBenchOptions>(store);
    CLI::App* c_bsv = c_bench->add_subcommand(
        "serve", "load generator for an OpenAI-compatible server: TTFT, inter-token latency, throughput");
    c_bsv->add_option("--host", sb.host, "server address")->capture_default_str();
    c_bsv->add_option("--port", sb.port, "server port")->capture_default_str()->check(CLI::Range(1, 65535));
    c_bsv->add_option("--model", sb.model, "model name to send (default: the server's first in /v1/models)");
    c_bsv->add_option("--scenario", sb.scenario, "mixed (decode streams + arriving long prompts), poisson, or overload (a ramp of loads, classes)")
        ->capture_default_str();
    c_bsv->add_option("--label", sb.label, "name of this run in the output");
    c_bsv->add_option("--duration", sb.duration_s, "seconds of arrivals")
        ->capture_default_str()
        ->check(CLI::Range(1.0, 86400.0));
    c_bsv->add_option("--warmup", sb.warmup_s, "requests starting earlier are not counted")->capture_default_str();
    c_bsv->add_option("--rate", sb.rate, "arrivals per second (mixed: of long prompts)")
        ->capture_default_str()
        ->check(CLI::Range(0.0, 1e6));
    c_bsv->add_option("--prompt-min", sb.prompt_min, "prompt tokens, lower bound")->capture_default_str();
    c_bsv->add_option("--prompt-max", sb.prompt_max, "prompt tokens, upper bound")->capture_default_str();
    c_bsv->add_option("--output-min", sb.output_min, "output tokens, lower bound")->capture_default_str();
    c_bsv->add_option("--output-max", sb.output_max, "output tokens, upper bound")->capture_default_str();
    c_bsv->add_option("--streams", sb.streams, "mixed: decode streams kept running")
        ->capture_default_str()
        ->check(CLI::Range(0, 4096));
    c_bsv->add_option("--stream-prompt", sb.stream_prompt, "mixed: prompt tokens of a decode stream")
        ->capture_default_str();
    c_bsv->add_option("--stream-output", sb.stream_output, "mixed: output tokens per decode-stream request")
        ->capture_default_str();
    c_bsv->add_option("--slo-ttft", sb.slo_ttft_ms, "goodput: TTFT bound, ms")->capture_default_str();
    c_bsv->add_option("--slo-tpot", sb.slo_tpot_ms, "goodput: time per output token bound, ms")->capture_default_str();
    c_bsv->add_option("--token-lo", sb.token_lo, "prompt token ids drawn from [lo, hi)")->capture_default_str();
    c_bsv->add_option("--token-hi", sb.token_hi)->capture_default_str();
    c_bsv->add_option("--seed", sb.seed, "seed of arrivals, lengths and prompts")->capture_default_str();
    c_bsv->add_option("--timeout", sb.timeout_s, "per-request limit, seconds")->capture_default_str();
    c_bsv->add_flag("!--no-retry", sb.retry,
                    "a refused request (429) is its outcome; by default it waits its Retry-After and is sent again, "
                    "its TTFT counted from the first try (overload: never retried)");
    c_bsv->add_option("--json", sb.json_path, "write summary and per-request timings here");
    c_bsv->add_option("--capacity", sb.capacity, "overload: requests/s at 1x")->capture_default_str();
    c_bsv->add_option("--ramp", sb.ramp, "overload: multiples of --capacity, one step each")->capture_default_str();
    c_bsv->add_option("--step", sb.step_s, "overload: seconds per step")->capture_default_str();
    c_bsv->add_option("--classes", sb.classes, "overload: critical/standard/batch percentages")->capture_default_str();
    c_bsv->add_option("--slo", sb.slo, "overload: class targets, duet serve's --slo syntax (default: its defaults)");

    c_bsv->callback([&sb = sb, &rc = rc] { rc = cmd_bench_serve(sb); });
    c_bk->callback([&kvb = kvb, &rc = rc] { rc = cmd_bench_kv(kvb); });
    c_bs->callback([&shm_bench = shm_bench, &shm_quick = shm_quick, &rc = rc] {
        if (shm_quick) shm_bench = {0.05, 1, 300, shm_bench.json};
        rc = cmd_bench_shm(shm_bench);
    });
}

// duet shm status, duet kv inspect | verify, duet topo
void add_inspect_state(CLI::App& app, Store& store, int& rc, const std::string& default_model) {
    // duet shm status
    auto& shm_instance = keep<std::string>(store);
    auto& shm_json = keep<bool>(store);
    CLI::App* c_shm = app.add_subcommand("shm", "inspect an instance's shared memory");
    c_shm->require_subcommand(1);
    CLI::App* c_ss = c_shm->add_subcommand("status", "processes, KV arenas, requests and rings of a live instance");
    c_ss->add_option("instance", shm_instance, "instance name (segments /dev/shm/duet.<name>)")->required();
    c_ss->add_flag("--json", shm_json, "print one JSON object");

    // duet kv inspect / verify
    auto& kv_file = keep<std::string>(store);
    auto& kv_dir = keep<std::string>(store);
    auto& kv_json = keep<bool>(store);
    CLI::App* c_kv = app.add_subcommand("kv", "KV blobs and KV logs on disk");
    c_kv->require_subcommand(1);
    CLI::App* c_kvi = c_kv->add_subcommand(
        "inspect", "a .kvblob's header, or a .kvlog's header, records, final length and torn tail; exit 1 if invalid");
    c_kvi->add_option("file", kv_file, "a KV blob or KV log (told apart by magic)")->required();
    c_kvi->add_flag("--json", kv_json, "print one JSON object");
    CLI::App* c_kvv =
        c_kv->add_subcommand("verify", "check every *.kvlog and *.kvblob under a directory; exit 1 if any is invalid");
    c_kvv->add_option("dir", kv_dir, "directory (searched recursively) or one file")->required();

    // duet topo
    auto& topo = keep<TopoArgs>(store);
    CLI::App* c_topo = app.add_subcommand("topo", "the machine (hwloc) and where front, prefill and decode would run");
    auto* o_synth = c_topo->add_option("--synthetic", topo.synthetic,
                                       "plan for an hwloc synthetic topology, e.g. \"pack:2 core:8 pu:2\"");
    c_topo
        ->add_option("--xml", topo.xml,
                     "plan for another machine from its hwloc XML export (lstopo machine.xml), GPUs included")
        ->check(CLI::ExistingFile)
        ->excludes(o_synth);
    c_topo->add_option("--devices", topo.devices, "GPUs to serve on, e.g. 0-3 (default: the CPU)");
    c_topo->add_option("--front-cpus", topo.front_cpus, "pin the front here");
    c_topo->add_option("--prefill-cpus", topo.prefill_cpus, "pin prefill here (CPU serving)");
    c_topo->add_option("--decode-cpus", topo.decode_cpus, "pin decode here (CPU serving); disjoint from prefill");
    c_topo->add_option("--prefill-workers", topo.prefill_workers, "prefill processes (CPU serving)")
        ->capture_default_str()
        ->check(CLI::Range(1, 5));
    c_topo->add_option("--decode-workers", topo.decode_workers, "decode processes (CPU serving)")
        ->capture_default_str()
        ->check(CLI::Range(1, 5));
    c_topo->add_flag("--json", topo.json, "print one JSON object");

    // duet golden record / check
    auto& golden = keep<GoldenArgs>(store);
    golden.model = default_model;
    CLI::App* c_golden = app.add_subcommand("golden", "golden-logits references: the check each worker runs at start");
    c_golden->require_subcommand(1);
    CLI::App* c_gr = c_golden->add_subcommand(
        "record", "write a reference for a model from a trusted run (or, --from, from a llama.cpp logits fixture)");
    CLI::App* c_gc = c_golden->add_subcommand("check", "run the check a worker runs; exit 3 if it fails");
    for (CLI::App* c : {c_gr, c_gc}) {
        c->add_option("-m,--model", golden.model, "GGUF model file")->capture_default_str();
        c->add_option("--device", golden.device, "cpu, or cuda:N")->capture_default_str();
        c->add_option("--kv-dtype", golden.kv_dtype, "f16, int8 or fp8")->capture_default_str();
        c->add_option("--isa", golden.isa, "CPU kernel level (default: best)");
    }
    c_gr->add_option("-o,--out", golden.out, "where to write it (default: <model>.golden.json, found there by workers)");
    c_gr->add_option("--from", golden.from, "take the logits from this llama.cpp fixture (tests/fixtures/logits.json)");
    c_gr->add_option("--tolerance-mean", golden.tol_mean, "largest mean |dlogprob| per prompt")->capture_default_str();
    c_gr->add_option("--tolerance-max", golden.tol_max, "largest single |dlogprob|")->capture_default_str();
    c_gr->add_option("--tolerance-top1-gap", golden.tol_top1_gap,
                     "the top-1 must match where the reference's top-1/top-2 gap exceeds this")
        ->capture_default_str();
    c_gc->add_option("--golden", golden.golden,
                     "auto (<model>.golden.json, else built in), none, or a reference file")
        ->capture_default_str();
    c_gr->callback([&golden = golden, &rc = rc] { rc = cmd_golden_record(golden); });
    c_gc->callback([&golden = golden, &rc = rc] { rc = cmd_golden_check(golden); });

    c_ss->callback([&shm_instance = shm_instance, &shm_json = shm_json, &rc = rc] {
        rc = cmd_shm_status(shm_instance, shm_json);
    });
    c_kvi->callback([&kv_file = kv_file, &kv_json = kv_json, &rc = rc] { rc = cmd_kv_inspect(kv_file, kv_json); });
    c_kvv->callback([&kv_dir = kv_dir, &rc = rc] { rc = cmd_kv_verify(kv_dir); });
    c_topo->callback([&topo = topo, &rc = rc] { rc = cmd_topo(topo); });

    // duet trace summary
    auto& trace_file = keep<std::string>(store);
    auto& trace_json = keep<bool>(store);
    CLI::App* c_trace = app.add_subcommand("trace", "trace files (duet serve --trace, DUET_TRACE)");
    c_trace->require_subcommand(1);
    CLI::App* c_ts = c_trace->add_subcommand(
        "summary", "each process's ranges in a trace file: count, total, mean, p50, p99 and largest duration");
    c_ts->add_option("file", trace_file, "a trace file (Chrome trace-event JSON)")->required();
    c_ts->add_flag("--json", trace_json, "print a JSON array");
    c_ts->callback([&trace_file = trace_file, &trace_json = trace_json, &rc = rc] {
        rc = cmd_trace_summary(trace_file, trace_json);
    });
}

// duet serve, duet front, duet prefill, duet decode
void add_serving(CLI::App& app, Store& store, int& rc, const std::string& default_model) {
    // duet serve, duet front, duet prefill / duet decode (cli/role_flags.cpp)
    auto& serve = keep<ServeSettings>(store);
    serve.model = default_model;
    CLI::App* c_serve = app.add_subcommand("serve", "serve the OpenAI API: front, prefill and decode processes");
    add_serve_flags(*c_serve, serve);
    c_serve->add_option("--trace", serve.trace,
                        "write every role's ranges (decode steps and their phases, prefill passes, hand-offs) to this "
                        "file as Chrome trace-event JSON (Perfetto; duet trace summary)");
    auto& front = keep<FrontSettings>(store);
    front.model = default_model;
    CLI::App* c_front = app.add_subcommand("front", "the HTTP front (OpenAI API) of a running instance");
    add_front_flags(*c_front, front);
    auto& worker = keep<WorkerSettings>(store);
    worker.model = default_model;
    CLI::App* c_prefill = app.add_subcommand("prefill", "a prefill worker of a running instance");
    CLI::App* c_decode = app.add_subcommand("decode", "a decode worker of a running instance");
    add_worker_flags(*c_prefill, worker, /*prefill=*/true);
    add_worker_flags(*c_decode, worker, /*prefill=*/false);

    // duet instance: serve's settings, the roles started by systemd's units (systemd/)
    auto& inst = keep<ServeSettings>(store);
    inst.model = default_model;
    CLI::App* c_inst = app.add_subcommand(
        "instance", "create a serving instance and supervise the roles that systemd's units start (duet-instance.service)");
    add_serve_flags(*c_inst, inst);
    c_inst->callback([&inst = inst, &rc = rc] { rc = cmd_serve(inst, RoleStart::External); });
    // duet systemd generate / install
    auto& gen = keep<ServeSettings>(store);
    gen.model = default_model;
    auto& sysd = keep<SystemdArgs>(store);
    CLI::App* c_sys = app.add_subcommand("systemd", "one systemd unit per role (systemd/): generate for this box, install");
    c_sys->require_subcommand(1);
    CLI::App* c_gen = c_sys->add_subcommand(
        "generate", "write the units, drop-ins with each role's cores, NUMA node and device (the plan of duet serve "
                    "with the same flags), and duet.env");
    add_serve_flags(*c_gen, gen);
    c_gen->add_option("--out", sysd.out, "where to write them")->capture_default_str();
    c_gen->add_option("--exe", sysd.exe, "the duet binary the units run")->capture_default_str();
    c_gen->add_option("--xml", sysd.xml,
                      "plan for another machine from its hwloc XML export (lstopo machine.xml), GPUs included: "
                      "--device names its GPUs (cuda:N, by PCI bus order)");
    c_gen
        ->add_option("--gpu-memory", sysd.gpu_memory_gib,
                     "with --xml: each GPU's memory in GiB, where the export does not say it (an export made "
                     "without hwloc's CUDA backend)")
        ->check(CLI::Range(1.0, 4096.0));
    CLI::App* c_ins = c_sys->add_subcommand("install", "copy generated units into ROOT/etc/systemd/system and "
                                                       "duet.env into ROOT/etc/duet");
    c_ins->add_option("dir", sysd.out, "what duet systemd generate wrote")->capture_default_str();
    c_ins->add_option("--root", sysd.root, "a root other than / (an image, a test)");
    c_gen->callback([&gen = gen, &sysd = sysd, &rc = rc] { rc = cmd_systemd_generate(gen, sysd); });
    c_ins->callback([&sysd = sysd, &rc = rc] { rc = cmd_systemd_install(sysd); });
    c_serve->callback([&serve = serve, &rc = rc] { rc = cmd_serve(serve); });
    c_front->callback([&front = front, &rc = rc] { rc = cmd_front(front); });
    c_prefill->callback([&worker = worker, &rc = rc] { rc = cmd_worker(worker, true); });
    c_decode->callback([&worker = worker, &rc = rc] { rc = cmd_worker(worker, false); });
}

}  // namespace

int main(int argc, char** argv) {
    // cuda:N is the N-th NVIDIA GPU in PCI bus order, as `duet topo` numbers them
    // (CUDA's own default puts the fastest first). Before anything touches CUDA.
    setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID", 0);
    CLI::App app{"duet: LLM inference on one box"};
    app.require_subcommand(1);
    app.set_version_flag("--version", "duet 0.1.0");
    const std::string default_model = DUET_DEFAULT_MODEL;
    Store store;
    int rc = 0;
    for (auto add : {add_run, add_inspect_model, add_bench, add_inspect_state, add_serving})
        add(app, store, rc, default_model);
    // The chosen command runs in its callback, at the end of parse.
    try {
        app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
        return app.exit(e);
    } catch (const std::exception& e) {
        std::fprintf(stderr, "duet: %s\n", e.what());
        return 1;
    }
    return rc;
}
