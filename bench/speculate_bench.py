#!/usr/bin/env python3
"""Speculative decoding's speed in `duet serve`, against the same server without
drafts in the same run, and llama.cpp's llama-server with and without its own
draft-free speculation. Each server (a binary and its flags) is started once per
round, rounds alternating, so that drift on a shared machine falls on every column
alike.

Two prompt sets:
  default     tests/cli/speculate_test.py's 4 input-grounded and 3 open prompts as
              completions: one stream, greedy, --tokens tokens (ignore_eos).
  --corpus F  bench/speculate_corpus.jsonl (bench/speculate_corpus.py): chat prompts
              of five kinds (rewrite, summarize, code_edit, extraction, open), the
              first --per-kind of each, greedy, up to --tokens tokens (each answer
              ends where the model ends it), --streams at once.
Reported per kind: decode tokens/s per stream (output tokens after the first over
the time after the first), its ratio against the first server of the same kind
(duet or llama), drafts kept / checked (duet's /metrics), and how many outputs
differ from that first server's (duet's contract: none).

Usage: speculate_bench.py --server NAME=DUET[:FLAGS] ... [--rounds N] [--corpus F]
  e.g. speculate_bench.py --server off=build/duet:--draft-tokens=0 \
                          --server paced8=build/duet:--draft-tokens=8 \
                          --server llama=llama:LLAMA_BIN \
                          --server llama-ngram=llama:LLAMA_BIN:--spec-type=ngram-simple
       (the venv's python: scripts/python-env; LLAMA_BIN: scripts/build-llama-cpp's
       output, a folder holding llama-server; FLAGS comma-separated, --x=y)
"""
import argparse
import concurrent.futures
import json
import os
import re
import subprocess
import sys
import time
import urllib.request

import openai

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(ROOT, "tests", "cli"))
from duet_e2e import drain, free_port, listening_port, stop  # noqa: E402
from speculate_prompts import GROUNDED, OPEN  # noqa: E402

MODEL = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")


def metric(port, name):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    m = re.search(rf"^{re.escape(name)} (\d+)$", text, re.M)
    return int(m.group(1)) if m else 0


def drafts(port, outcome, drafter=None):
    """duet_draft_tokens_total of an outcome, of one drafter or summed over both."""
    return sum(metric(port, f'duet_draft_tokens_total{{drafter="{d}",outcome="{outcome}"}}') or 0
               for d in ((drafter,) if drafter else ("sequence", "pool")))


def start(server, streams):
    """(process, port, is_duet) of a server: duet serve, or llama-server on the same
    model and CPUs with a slot per stream."""
    _, binary, flags = server
    if binary != "llama":
        inst = f"duet-speculate-bench-{os.getpid()}"
        p = subprocess.Popen([binary, "serve", "--port", "0", "--ctx", "1024", "--instance", inst, *flags],
                             stderr=subprocess.PIPE, text=True)
        port = listening_port(p)
        drain(p)
        return p, port, True
    bin_dir, flags = flags[0], flags[1:]
    port = free_port()
    n = str(os.cpu_count())
    p = subprocess.Popen([os.path.join(bin_dir, "llama-server"), "-m", MODEL, "-t", n, "-tb", n, "-np", str(streams),
                          "-c", str(4096 * streams), "--host", "127.0.0.1", "--port", str(port), *flags],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    drain(p)
    for _ in range(1200):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
            return p, port, False
        except Exception:
            if p.poll() is not None:
                raise SystemExit(f"llama-server {' '.join(flags)} exited")
            time.sleep(0.1)
    raise SystemExit("llama-server did not start")


def one(c, model, job, tokens):
    """A streamed request: (output tokens, seconds after the first token, text)."""
    kind, body = job
    first, text, n = None, "", 0
    if body.get("messages"):
        it = c.chat.completions.create(model=model, messages=body["messages"], max_tokens=tokens, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    else:
        it = c.completions.create(model=model, prompt=body["prompt"], max_tokens=tokens, temperature=0, stream=True,
                                  stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    for ev in it:
        if ev.usage:
            n = ev.usage.completion_tokens
        if not ev.choices:
            continue
        d = ev.choices[0].delta.content if body.get("messages") else ev.choices[0].text
        if d:
            text += d
            if first is None:
                first = time.monotonic()
    end = time.monotonic()
    if not n:  # an event may carry several tokens (duet's verify rows): events are no count
        raise SystemExit(f"no usage in the stream of {body}")
    return n, (end - first if first else 0.0), text


def run(server, jobs, streams, tokens):
    """{kind: (tokens after the first, seconds after the first, kept, checked, [texts])}"""
    p, port, duet = start(server, streams)
    try:
        # Retried as the client retries by default (Retry-After): eight long prompts at
        # once on a fresh duet, whose prefill rate is still being measured, may get
        # admission's 429. Only the rate after the first token is measured.
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=8, timeout=600)
        model = c.models.list().data[0].id
        out = {}
        for kind in dict.fromkeys(k for k, _ in jobs):
            mine = [j for j in jobs if j[0] == kind]
            a0, r0 = (drafts(port, "accepted"), drafts(port, "rejected")) if duet else (0, 0)
            with concurrent.futures.ThreadPoolExecutor(max_workers=streams) as ex:
                res = list(ex.map(lambda j: one(c, model, j, tokens), mine))
            a1, r1 = (drafts(port, "accepted"), drafts(port, "rejected")) if duet else (0, 0)
            out[kind] = (sum(max(n - 1, 0) for n, _, _ in res), sum(t for _, t, _ in res), a1 - a0,
                         (a1 - a0) + (r1 - r0), [t for _, _, t in res])
        return out
    finally:
        stop(p)


def main():
    sys.stdout.reconfigure(line_buffering=True)
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", action="append", required=True,
                    help="NAME=DUET[:FLAG,...] or NAME=llama:BIN_DIR[:FLAG,...] (flags: --x=y)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--corpus", help="a JSONL corpus (bench/speculate_corpus.jsonl)")
    ap.add_argument("--per-kind", type=int, default=20)
    ap.add_argument("--streams", type=int, default=1)
    a = ap.parse_args()
    servers = []
    for s in a.server:
        name, rest = s.split("=", 1)
        binary, _, flags = rest.partition(":")
        flags = flags.split(",") if flags else []
        if binary == "llama":  # llama:BIN_DIR[:FLAGS]
            bin_dir, _, more = rest[len("llama:"):].partition(":")
            flags = [bin_dir] + [x for f in more.split(",") if f for x in f.split("=", 1)]  # it takes no --x=y
        servers.append((name, binary, [f for f in flags if f]))
    if a.corpus:
        rows = [json.loads(l) for l in open(a.corpus, encoding="utf-8")]
        jobs, seen = [], {}
        for r in rows:
            if seen.get(r["kind"], 0) < a.per_kind:
                seen[r["kind"]] = seen.get(r["kind"], 0) + 1
                jobs.append((r["kind"], {"messages": r["messages"]}))
    else:
        if a.streams != 1:
            raise SystemExit("--streams needs --corpus")
        jobs = [("grounded", {"prompt": p}) for p in GROUNDED] + [("open", {"prompt": p}) for p in OPEN]
    kinds = list(dict.fromkeys(k for k, _ in jobs))
    res = {name: {k: [] for k in kinds} for name, _, _ in servers}
    for r in range(a.rounds):
        for srv in servers:
            t0 = time.monotonic()
            for k, v in run(srv, jobs, a.streams, a.tokens).items():
                res[srv[0]][k].append(v)
            print(f"round {r + 1}, {srv[0]}: {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
        if r + 1 < a.rounds:
            report(a, servers, kinds, res, r + 1)  # so far, in case the run is cut short
    report(a, servers, kinds, res, a.rounds)


def report(a, servers, kinds, res, rounds):
    # Each server against the first of its kind (duet or llama).
    base = {}
    for name, binary, _ in servers:
        base.setdefault(binary == "llama", name)
    what = "chat corpus " + os.path.basename(a.corpus) + f", {a.per_kind} of each kind" if a.corpus else \
        "completions, ignore_eos"
    print(f"{a.streams} stream(s), greedy, up to {a.tokens} tokens, {what}; decode tokens/s per stream (after the "
          f"first token), sums over {rounds} round(s); ratio and outputs differing against "
          + " and ".join(sorted(set(base.values()))))
    print("| server | prompts | tokens/s | ratio | drafts kept / checked | outputs differing |")
    print("|---|---|---:|---:|---|---:|")

    for name, binary, flags in servers:
        ref = base[binary == "llama"]
        for k in kinds + ["all"]:
            ks = kinds if k == "all" else [k]
            tps = sum(sum(x[0] for x in res[name][q]) for q in ks) / max(
                sum(sum(x[1] for x in res[name][q]) for q in ks), 1e-9)
            b = sum(sum(x[0] for x in res[ref][q]) for q in ks) / max(
                sum(sum(x[1] for x in res[ref][q]) for q in ks), 1e-9)
            acc = sum(x[2] for q in ks for x in res[name][q])
            chk = sum(x[3] for q in ks for x in res[name][q])
            diff = sum(t != u for q in ks for x, y in zip(res[name][q], res[ref][q]) for t, u in zip(x[4], y[4]))
            n = sum(len(x[4]) for q in ks for x in res[name][q])
            shown = " ".join(f for f in flags if not os.path.isdir(f))
            print(f"| {name} ({shown}) | {k} | {tps:.1f} | {tps / max(b, 1e-9):.2f} | "
                  f"{f'{acc} / {chk}' if binary != 'llama' else ''} | {diff} of {n} |")


if __name__ == "__main__":
    main()
