#!/usr/bin/env python3
"""bench/plot_serve.py survives a reference server that produced no figure (a
distribution with no samples is null in its JSON): the table marks the missing
figures instead of stopping with a TypeError, and still prints the rest.

Usage: plot_serve_test.py path/to/plot_serve.py
"""
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from duet_e2e import check  # noqa: E402


def run(label, itl, ttft):
    def d(v):
        return {"n": 0 if v is None else 5, "mean": v, "p50": v, "p90": v, "p99": v, "max": v}
    return {"label": label, "server": label,
            "options": {"scenario": "mixed", "streams": 8, "stream_prompt": 64, "stream_output": 256,
                        "prompt": [1024, 2048], "rate": 0.15, "output": [16, 16], "duration_s": 60, "warmup_s": 10},
            "summary": {"itl_streams_ms": d(itl), "ttft_ms": d(ttft), "output_tokens_per_s": 12.0, "completed": 3,
                        "errors": 0},
            "requests": []}


with tempfile.TemporaryDirectory() as tmp:
    a, b = os.path.join(tmp, "duet.json"), os.path.join(tmp, "ref.json")
    json.dump(run("duet", 20.0, 1000.0), open(a, "w"))
    json.dump(run("llama-server", None, 2000.0), open(b, "w"))  # null: what NaN becomes in the JSON
    p = subprocess.run([sys.executable, sys.argv[1], a, b], capture_output=True, text=True)
    check(p.returncode == 0, f"plot_serve.py exited {p.returncode}: {p.stderr}")
    check("— (none measured)" in p.stdout, f"the missing figures are marked:\n{p.stdout}")
    check("| TTFT of long prompts p50, ms | 1000.00 | 2000.00 | **0.50** |" in p.stdout,
          f"the figures both have still get their ratio:\n{p.stdout}")
    print("plot_serve.py with a reference that measured nothing: ok")
