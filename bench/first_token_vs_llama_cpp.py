#!/usr/bin/env python3
"""One GGUF file, three readings of it: duet serve, llama.cpp's llama-server and
an exact float64 forward pass (scripts/make-tiny-models.py's, weights dequantized
by gguf-py). For each raw prompt (no chat template) the next token's five most
likely tokens and their probabilities, from each; then the largest gap between
duet's and llama.cpp's probability of a token either lists (0 where one does not
list it), and on how many prompts their most likely token is the same.

Neither engine matches the float64 pass: both round activations to 8 bits before
each product with quantized weights. What this shows is that duet reads a weight
type the way llama.cpp does: its gap to llama.cpp on a new type should be no
larger than on the default model, whose kernels other tests pin to llama.cpp.

    python bench/first_token_vs_llama_cpp.py MODEL.gguf [--duet build/duet]
        [--llama-server BIN] [--threads 2]

(python: the venv of scripts/python-env; llama-server: scripts/build-llama-cpp.)
"""

import argparse
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time

import numpy as np
from openai import OpenAI

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "To make a cup of tea, first",
]


def reference_module():
    spec = importlib.util.spec_from_file_location("tiny", os.path.join(ROOT, "scripts", "make-tiny-models.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def wait_up(port, proc):
    c = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
    for _ in range(600):
        if proc.poll() is not None:
            sys.exit(f"server on port {port} exited with {proc.returncode}")
        try:
            c.models.list()
            return c
        except Exception:
            time.sleep(0.2)
    sys.exit(f"server on port {port} did not start")


def first_tokens(c):
    """Per prompt: {token text: probability} of the next token's top 5."""
    mid = c.models.list().data[0].id
    out = []
    for p in PROMPTS:
        r = c.completions.create(model=mid, prompt=p, max_tokens=1, temperature=0, logprobs=5)
        lp = r.choices[0].logprobs
        if lp.top_logprobs is not None:  # the OpenAI layout
            out.append({k: math.exp(v) for k, v in lp.top_logprobs[0].items()})
        else:  # llama-server's: a chat-style content list
            out.append({t["token"]: math.exp(t["logprob"]) for t in lp.content[0]["top_logprobs"]})
    return out


def serve(cmd, port):
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        return first_tokens(wait_up(port, proc))
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--duet", default=os.path.join(ROOT, "build", "duet"))
    ap.add_argument("--llama-server")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--port", type=int, default=18190)
    a = ap.parse_args()
    llama = a.llama_server or os.path.join(
        subprocess.check_output([os.path.join(ROOT, "scripts", "build-llama-cpp")], text=True).strip(), "llama-server")

    got = {
        "duet": serve([a.duet, "serve", "-m", a.model, "--port", str(a.port)], a.port),
        "llama.cpp": serve([llama, "-m", a.model, "--port", str(a.port + 1), "-t", str(a.threads), "-c", "2048",
                            "-np", "1"], a.port + 1),
    }
    ref = reference_module()
    m = ref.GgufModel(a.model)
    gap, same_top1 = 0.0, 0
    for i, p in enumerate(PROMPTS):
        ids = json.loads(subprocess.check_output([a.duet, "tokenize", "-m", a.model, p], text=True))
        logits = ref.forward(m, ids)[-1]
        prob = np.exp(logits - logits.max())
        prob /= prob.sum()
        print(f"{p!r}")
        print(f"  float64   {[round(float(v), 3) for v in np.sort(prob)[::-1][:5]]}")
        for name, rows in got.items():
            print(f"  {name:9} {[round(v, 3) for v in sorted(rows[i].values(), reverse=True)]}")
        # Over the tokens either lists: one the other does not list counts at 0 there.
        d, l = got["duet"][i], got["llama.cpp"][i]
        for t in set(d) | set(l):
            gap = max(gap, abs(d.get(t, 0.0) - l.get(t, 0.0)))
        same_top1 += max(d, key=d.get) == max(l, key=l.get)
    print(json.dumps({"model": os.path.basename(a.model), "max_prob_gap_duet_llama_cpp": round(gap, 4),
                      "same_top1": f"{same_top1} of {len(PROMPTS)}"}))


if __name__ == "__main__":
    main()
