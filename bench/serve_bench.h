// `duet bench serve`: a streaming-aware load generator for any server that speaks
// OpenAI's /v1/completions with SSE (duet serve, llama.cpp's llama-server, vLLM).
//
// Requests carry their prompt as token ids (so lengths are exact on every server)
// drawn from a seeded generator, ask for greedy decoding with ignore_eos (so output
// lengths are exact too) and stream_options.include_usage. Times are taken when a
// server-sent event's bytes are parsed: TTFT is request start -> first event with
// text; inter-token latency (ITL) is the gap between successive text events.
//
// Scenarios:
//   poisson  requests arrive at --rate per second (exponential gaps), prompt and
//            output lengths uniform in their ranges.
//   mixed    --streams long-running decode streams (short prompt, long output,
//            each re-issued when it ends) while long prompts keep arriving at
//            --rate per second: what chunked prefill and disaggregation are for.
//   overload Poisson arrivals in steps of --step seconds at each multiple of
//            --capacity (requests/s) in --ramp, each request of a class drawn from
//            --classes (critical/standard/batch percentages, sent as "priority":
//            servers without classes ignore it). Per step and class: sent, completed,
//            refused (429), and those that met the class's targets (--slo, the
//            syntax of duet serve's: TTFT, and mean inter-token latency); SLO
//            attainment counts refused requests in its denominator, and goodput is
//            the requests that met their targets per second of the step.
#pragma once

#include <cstdint>
#include <string>

namespace duet {

struct ServeBenchOptions {
    std::string host = "127.0.0.1";
    int port = 8080;
    std::string model;  // "" : the first of GET /v1/models
    std::string scenario = "mixed";
    std::string label;  // names this run in the JSON and the plot (default: the server header)
    double duration_s = 60;  // arrivals stop after this
    double warmup_s = 5;     // requests that start earlier are not counted
    double rate = 0.2;       // arrivals per second (poisson; mixed: the long prompts)
    int prompt_min = 1024, prompt_max = 2048;
    int output_min = 16, output_max = 16;
    int streams = 8;          // mixed: decode streams
    int stream_prompt = 64;   // mixed: their prompt tokens
    int stream_output = 256;  // mixed: their output tokens per request
    double slo_ttft_ms = 5000, slo_tpot_ms = 100;  // goodput: requests within both
    int token_lo = 1000, token_hi = 30000;         // prompt token ids are drawn from [lo, hi)
    uint64_t seed = 1;
    double timeout_s = 600;  // per request
    bool retry = true;       // a 429 is waited on (Retry-After) and sent again; not in overload
    std::string json_path;   // write the whole record here
    // overload
    double capacity = 1;                    // requests/s at 1x
    std::string ramp = "0.5,1,1.5,2,3";     // multiples of capacity, one step each
    double step_s = 30;                     // seconds per step
    std::string classes = "20/60/20";       // critical/standard/batch, percent
    std::string slo;                        // duet serve's --slo syntax; "": its defaults
};

int cmd_bench_serve(const ServeBenchOptions& o);

}  // namespace duet
