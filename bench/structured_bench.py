#!/usr/bin/env python3
"""Decode speed with and without a schema on `duet serve`, measured in the same run:
for each schema of the corpus (tests/cli/schema_corpus.py), a greedy streamed chat
completion constrained by it, then the same prompt unconstrained with max_tokens set
to the constrained answer's length and ignore_eos (the same number of tokens, so
the two differ only by the grammar). Decode rate: tokens from the second on over their
time (the second is decode's first, after it took the request and, with a schema,
compiled it: that gap is reported apart), one request at a time. Prints a Markdown table and the median
ratio (the issue's goal: no more than 5% slower).

Usage: structured_bench.py path/to/duet [--schemas N] [--threads T]
       (the venv's python: scripts/python-env)
"""
import argparse
import os
import statistics
import subprocess
import sys
import time

import openai

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "cli"))
from duet_e2e import drain, listening_port, stop  # noqa: E402
from schema_corpus import corpus  # noqa: E402


def rate(stream):
    """(tokens/s from the second token on, the gap from the first token to the second
    in ms, tokens): the first comes from prefill; before the second, decode takes
    the request (and, with a schema, compiles it if it has not yet)."""
    times, tokens = [], 0
    for ev in stream:
        for ch in ev.choices:
            if ch.delta.content:
                times.append(time.perf_counter())
        if ev.usage:
            tokens = ev.usage.completion_tokens
    # A chunk is a token's text, except where the text waits for the rest of a UTF-8
    # character: chunks, counted the same way with and without a schema.
    if len(times) < 3:
        return None, None, tokens
    return (len(times) - 2) / (times[-1] - times[1]), (times[1] - times[0]) * 1e3, tokens


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("duet")
    ap.add_argument("--schemas", type=int, default=100)
    args = ap.parse_args()
    server = subprocess.Popen([args.duet, "serve", "--port", "0", "--ctx", "1024", "--instance",
                               f"duet-structured-bench-{os.getpid()}"], stderr=subprocess.PIPE, text=True)
    try:
        port = listening_port(server)
        drain(server)
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
        model = c.models.list().data[0].id
        rows, ratios = [], []
        for name, schema, prompt in corpus()[: args.schemas]:
            msgs = [{"role": "system", "content": "Answer in JSON."}, {"role": "user", "content": prompt}]
            rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
            opts = dict(model=model, messages=msgs, temperature=0, stream=True,
                        stream_options={"include_usage": True})
            with_rate, with_gap, n = rate(c.chat.completions.create(max_tokens=400, response_format=rf, **opts))
            if not with_rate or n < 8:
                continue
            free_rate, free_gap, m = rate(c.chat.completions.create(max_tokens=n, extra_body={"ignore_eos": True},
                                                                    **opts))
            if not free_rate:
                continue
            ratios.append(with_rate / free_rate)
            rows.append((name, n, with_rate, free_rate, with_gap, free_gap))
        print("| schema | tokens | tok/s with schema | tok/s without | ratio | 1st→2nd token ms with | without |\n"
              "|---|---:|---:|---:|---:|---:|---:|")
        for name, n, w, f, wg, fg in rows:
            print(f"| {name} | {n} | {w:.1f} | {f:.1f} | {w / f:.3f} | {wg:.1f} | {fg:.1f} |")
        print(f"\nmedian ratio (with / without) over {len(ratios)} schemas: {statistics.median(ratios):.3f}; "
              f"median 1st→2nd token gap {statistics.median(r[4] for r in rows):.1f} ms with, "
              f"{statistics.median(r[5] for r in rows):.1f} ms without")
    finally:
        stop(server)


if __name__ == "__main__":
    main()
