#!/usr/bin/env python3
"""Speculative decoding's speed in `duet serve`: one stream, greedy, 128 tokens
(ignore_eos), tokens/s after the first token, on input-grounded prompts (output that
copies its input) and open ones (tests/cli/speculate_test.py's), against a server
without drafts in the same run. Each binary or flag set is a server of its own,
started once per round, rounds alternating, so that drift on a shared machine
falls on every column alike.

Usage: speculate_bench.py --server NAME=DUET[:FLAGS] ... [--rounds N]
  e.g. speculate_bench.py --server off=build/duet:--draft-tokens=0 \
                          --server paced8=build/duet:--draft-tokens=8
       (the venv's python: scripts/python-env)
"""
import argparse
import os
import re
import subprocess
import sys
import time
import urllib.request

import openai

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "cli"))
from duet_e2e import drain, listening_port, stop  # noqa: E402
from speculate_prompts import GROUNDED, OPEN  # noqa: E402

def metric(port, name):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    m = re.search(rf"^{re.escape(name)} (\d+)$", text, re.M)
    return int(m.group(1)) if m else 0


def drafts(port, outcome, drafter=None):
    """duet_draft_tokens_total of an outcome, of one drafter or summed over both."""
    return sum(metric(port, f'duet_draft_tokens_total{{drafter="{d}",outcome="{outcome}"}}') or 0
               for d in ((drafter,) if drafter else ("sequence", "pool")))


def run(duet, flags, tokens):
    inst = f"duet-speculate-bench-{os.getpid()}"
    p = subprocess.Popen([duet, "serve", "--port", "0", "--ctx", "1024", "--instance", inst, *flags],
                         stderr=subprocess.PIPE, text=True)
    port = listening_port(p)
    drain(p)
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
        model = c.models.list().data[0].id
        out = {}
        for name, prompts in (("grounded", GROUNDED), ("open", OPEN)):
            a0 = drafts(port, "accepted")
            r0 = drafts(port, "rejected")
            n, secs = 0, 0.0
            for prompt in prompts:
                first = None
                for ev in c.completions.create(model=model, prompt=prompt, max_tokens=tokens, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True}):
                    if first is None and ev.choices and ev.choices[0].text:
                        first = time.monotonic()
                end = time.monotonic()
                n += tokens - 1
                secs += end - first
            out[name] = (n / secs, drafts(port, "accepted") - a0,
                         drafts(port, "rejected") - r0)
        return out
    finally:
        stop(p)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", action="append", required=True, help="NAME=DUET[:FLAG,FLAG...] (flags: --x=y)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    a = ap.parse_args()
    servers = []
    for s in a.server:
        name, rest = s.split("=", 1)
        duet, _, flags = rest.partition(":")
        servers.append((name, duet, [f for f in flags.split(",") if f]))
    res = {name: {"grounded": [], "open": []} for name, _, _ in servers}
    for _ in range(a.rounds):
        for name, duet, flags in servers:
            for k, v in run(duet, flags, a.tokens).items():
                res[name][k].append(v)
    base = servers[0][0]
    print(f"one stream, greedy, {a.tokens} tokens, tokens/s after the first token, mean of {a.rounds} rounds; "
          f"ratio against {base}")
    print("| server | prompts | tokens/s | ratio | drafts kept / checked |")
    print("|---|---|---:|---:|---|")
    for name, _, flags in servers:
        for k in ("grounded", "open"):
            tps = sum(v[0] for v in res[name][k]) / a.rounds
            b = sum(v[0] for v in res[base][k]) / a.rounds
            acc = sum(v[1] for v in res[name][k])
            rej = sum(v[2] for v in res[name][k])
            print(f"| {name} ({' '.join(flags)}) | {k} | {tps:.1f} | {tps / b:.2f} | {acc} / {acc + rej} |")


if __name__ == "__main__":
    main()
