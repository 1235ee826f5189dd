#!/usr/bin/env python3
"""Decode speed with and without a schema on `duet serve`, measured in the same run:
for each schema of the corpus (tests/cli/schema_corpus.py), a greedy streamed chat
completion constrained by it, then the same prompt unconstrained with max_tokens set
to the constrained answer's length and ignore_eos (the same number of tokens, so
the two differ only by the grammar). Decode rate: tokens from the second on over their
time (the second is decode's first, after it took the request and, with a schema,
compiled it: that gap is reported apart), one request at a time. Prints a Markdown
table and the median ratio (the issue's goal: no more than 5% slower).

With --llama BIN_DIR the same requests go to llama-server (the pinned build of
scripts/build-llama-cpp) on the same model, threads and context, after duet, in
the same run: its `response_format` json_schema is its grammar sampler's.

With --bystander: a plain stream's inter-token gaps while the schemas' requests
run beside it; with --prompt-bystander: plain prompts' times to first token.

Usage: structured_bench.py path/to/duet [--schemas N] [--llama BIN_DIR]
       [--bystander | --prompt-bystander]
       (the venv's python: scripts/python-env)
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

import openai

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "cli"))
from duet_e2e import drain, free_port, listening_port, stop  # noqa: E402
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


MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "models", "SmolLM2-135M-Instruct.Q4_1.gguf")


def start_duet(duet):
    """(process, port) of `duet serve` with its defaults."""
    p = subprocess.Popen([duet, "serve", "--port", "0", "--ctx", "1024", "--instance",
                          f"duet-structured-bench-{os.getpid()}"], stderr=subprocess.PIPE, text=True)
    port = listening_port(p)
    drain(p)
    return p, port


def start_llama(bin_dir):
    """(process, port) of llama-server on the same model, threads and context, one slot."""
    port = free_port()
    n = str(os.cpu_count())
    p = subprocess.Popen([os.path.join(bin_dir, "llama-server"), "-m", MODEL, "-t", n, "-tb", n, "-np", "1",
                          "-c", "1024", "--host", "127.0.0.1", "--port", str(port)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    drain(p)
    for _ in range(1200):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
            return p, port
        except Exception:
            if p.poll() is not None:
                raise SystemExit("llama-server exited")
            time.sleep(0.1)
    raise SystemExit("llama-server did not start")


def measure(port, schemas):
    """Rows (schema, tokens, tok/s with, without, gap with, without) and the ratios."""
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
    model = c.models.list().data[0].id
    rows, ratios = [], []
    for name, schema, prompt in corpus()[:schemas]:
        msgs = [{"role": "system", "content": "Answer in JSON."}, {"role": "user", "content": prompt}]
        rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
        opts = dict(model=model, messages=msgs, temperature=0, stream=True, stream_options={"include_usage": True})
        try:
            with_rate, with_gap, n = rate(c.chat.completions.create(max_tokens=400, response_format=rf, **opts))
        except openai.BadRequestError:  # llama-server's converter refuses a schema
            continue
        if not with_rate or n < 8:
            continue
        free_rate, free_gap, m = rate(c.chat.completions.create(max_tokens=n, extra_body={"ignore_eos": True},
                                                                **opts))
        if not free_rate:
            continue
        ratios.append(with_rate / free_rate)
        rows.append((name, n, with_rate, free_rate, with_gap, free_gap))
    return rows, ratios


def grammar_metrics(port):
    """/metrics' grammar compiles by (role, where): (count, seconds); {} if it has none."""
    page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    out = {}
    for m in re.finditer(r'^duet_worker_grammar_compile(s|_seconds)_total\{role="(\w+)",worker="\d+",where="(\w+)"\} '
                         r'(\S+)$', page, re.M):
        n, sec = out.get((m[2], m[3]), (0, 0.0))
        out[(m[2], m[3])] = (n + int(m[4]), sec) if m[1] == "s" else (n, sec + float(m[4]))
    return out


def bystander(port, schemas, constrained):
    """A plain greedy stream's gaps between tokens (ms) while the corpus's requests run
    one after another beside it, with their schema (constrained) or without: what a
    request's grammar costs the other streams of its decode worker."""
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
    model = c.models.list().data[0].id
    runs, running, done = [], threading.Event(), threading.Event()

    def stream():
        while not done.is_set():  # re-issued when it reaches the context's end
            runs.append([])
            for ev in c.completions.create(model=model, prompt="Once upon a time", max_tokens=900, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True}):
                runs[-1].append(time.perf_counter())
                running.set()
                if done.is_set():
                    break
    t = threading.Thread(target=stream)
    t.start()
    running.wait(60)
    time.sleep(0.2)
    start = time.perf_counter()
    for name, schema, prompt in corpus()[:schemas]:
        msgs = [{"role": "system", "content": "Answer in JSON."}, {"role": "user", "content": prompt}]
        kw = dict(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}) \
            if constrained else {}
        c.chat.completions.create(model=model, messages=msgs, temperature=0, max_tokens=16, **kw)
    end = time.perf_counter()
    done.set()
    t.join()
    return sorted((b - a) * 1e3 for times in runs for a, b in zip(times, times[1:]) if start <= a and b <= end)


def prompt_bystander(port, schemas, constrained):
    """Plain prompts' times to first token (ms; ~300-token prompts, each new to the
    prefix cache, one token asked) while the corpus's requests run beside them, with
    their schema (constrained) or without: what a request's grammar costs the other
    prompts in prefill's hands."""
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
    model = c.models.list().data[0].id
    times, done, errors = [], threading.Event(), []
    body = " ".join(f"Item {k} is a short line of plain text." for k in range(30))

    def prompts():
        k = 0
        try:
            while not done.is_set():
                k += 1
                t0 = time.perf_counter()
                c.completions.create(model=model, prompt=f"Request {k}. {body}", max_tokens=1, temperature=0)
                times.append((t0, time.perf_counter()))
        except Exception as e:  # noqa: BLE001  (reported below, not lost with the thread)
            errors.append(e)
    t = threading.Thread(target=prompts)
    t.start()
    time.sleep(0.5)
    start = time.perf_counter()
    for name, schema, prompt in corpus()[:schemas]:
        msgs = [{"role": "system", "content": "Answer in JSON."}, {"role": "user", "content": prompt}]
        kw = dict(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}) \
            if constrained else {}
        c.chat.completions.create(model=model, messages=msgs, temperature=0, max_tokens=4, **kw)
    end = time.perf_counter()
    done.set()
    t.join()
    if errors:
        raise RuntimeError(f"a plain prompt failed: {errors[0]!r}")
    got = sorted((b - a) * 1e3 for a, b in times if start <= a and b <= end)
    if not got:
        raise RuntimeError("no plain prompt ended while the schema requests ran")
    return got


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("duet")
    ap.add_argument("--schemas", type=int, default=100)
    ap.add_argument("--llama", help="llama-server's directory: the same requests after duet's")
    ap.add_argument("--bystander", action="store_true",
                    help="instead: a plain stream's inter-token gaps while the schemas' requests run beside it, "
                         "with their schemas and without (each on a fresh server, so every schema is new to it)")
    ap.add_argument("--prompt-bystander", action="store_true",
                    help="instead: plain prompts' times to first token while the schemas' requests run beside "
                         "them, with their schemas and without (each on a fresh server)")
    args = ap.parse_args()
    if args.prompt_bystander or args.bystander:
        # (what is measured, its unit's name, the role whose compiles matter, quantiles)
        measure_fn, unit, role, qs, digits = (
            (prompt_bystander, "prompts", "prefill", (0.5, 0.9), 1) if args.prompt_bystander
            else (bystander, "gaps", "decode", (0.5, 0.9, 0.99), 2))
        heads = " | ".join(["p50 ms"] + [f"p{round(f * 100)}" for f in qs[1:]])
        print(f"| requests beside | {unit} | {heads} | max | grammar compiles: {role} step (s) | {role} ahead (s) |\n"
              f"|---|---:|{'---:|' * len(qs)}---:|---:|---:|")
        for constrained in (False, True):
            server, port = start_duet(args.duet)
            try:
                g = measure_fn(port, args.schemas, constrained)
                m = grammar_metrics(port)
            finally:
                stop(server)
            cells = " | ".join(f"{g[min(len(g) - 1, int(f * len(g)))]:.{digits}f}" for f in qs)
            step, ahead = m.get((role, "step"), (None, None)), m.get((role, "ahead"), (None, None))
            fmt = lambda v: "-" if v[0] is None else f"{v[0]} ({v[1]:.3f})"  # noqa: E731
            print(f"| {'with schemas' if constrained else 'without'} | {len(g)} | {cells} | {g[-1]:.{digits}f} | "
                  f"{fmt(step)} | {fmt(ahead)} |")
        return
    runs = [("duet", lambda: start_duet(args.duet))]
    if args.llama:
        runs.append(("llama-server", lambda: start_llama(args.llama)))
    medians = []
    for label, start in runs:
        server, port = start()
        try:
            rows, ratios = measure(port, args.schemas)
        finally:
            stop(server)
        print(f"\n{label}:\n\n| schema | tokens | tok/s with schema | tok/s without | ratio | 1st→2nd token ms with "
              "| without |\n|---|---:|---:|---:|---:|---:|---:|")
        for name, n, w, f, wg, fg in rows:
            print(f"| {name} | {n} | {w:.1f} | {f:.1f} | {w / f:.3f} | {wg:.1f} | {fg:.1f} |")
        medians.append((label, len(ratios), statistics.median(ratios), statistics.median(r[2] for r in rows),
                        statistics.median(r[3] for r in rows), statistics.median(r[4] for r in rows),
                        statistics.median(r[5] for r in rows)))
    print("\n| server | schemas | median ratio with / without | median tok/s with | without "
          "| median 1st→2nd token ms with | without |\n|---|---:|---:|---:|---:|---:|---:|")
    for label, n, ratio, w, f, wg, fg in medians:
        print(f"| {label} | {n} | {ratio:.3f} | {w:.1f} | {f:.1f} | {wg:.1f} | {fg:.1f} |")


if __name__ == "__main__":
    main()
