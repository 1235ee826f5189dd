#!/usr/bin/env python3
"""TTFT and ITL over prompt length x output length (the capacity-planning picture of
issue "Scheduling"): one `duet serve` is started, and for every cell of the grid
REPS requests of that shape are sent one at a time (an idle server: the figures are
the floor a loaded server adds its queueing to), streamed, and timed: TTFT from the
request to the first token's event, ITL as the mean gap between later events. Writes
heatmap.json and heatmap.png (two panels, medians) to OUT.

    bench/heatmap.py path/to/duet OUT [--prompts 32,128,512,1536] [--outputs 16,64,256] [--reps 3] [--args ...]
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
import urllib.request


def stream_times(port, prompt_ids, n_out):
    body = {"prompt": prompt_ids, "max_tokens": n_out, "ignore_eos": True, "temperature": 0, "stream": True}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    times = []
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if line.startswith(b"data: {") and json.loads(line[6:])["choices"][0].get("text"):
                times.append(time.perf_counter())
    ttft = times[0] - t0
    itl = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else float("nan")
    return ttft, itl


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("duet")
    ap.add_argument("out")
    ap.add_argument("--prompts", default="32,128,512,1536")
    ap.add_argument("--outputs", default="16,64,256")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--args", default="", help="more duet serve arguments")
    a = ap.parse_args()
    prompts = [int(x) for x in a.prompts.split(",")]
    outputs = [int(x) for x in a.outputs.split(",")]
    os.makedirs(a.out, exist_ok=True)
    server = subprocess.Popen([a.duet, "serve", "--port", "0", "--ctx", "2048", *a.args.split()],
                              stderr=subprocess.PIPE, text=True)
    try:
        port = None
        for line in server.stderr:
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
            if m:
                port = int(m.group(1))
                break
        if not port:
            sys.exit("heatmap: the server did not start")
        cells = []
        for p in prompts:
            for n in outputs:
                ttfts, itls = [], []
                for r in range(a.reps):
                    # A prompt of its own for every request: no prefix cached from another
                    # cell or repetition (it made later cells' TTFT the cache's, not prefill's).
                    seed = (p * 131 + n) * 17 + r
                    ids = [100 + (seed * 7919 + k * 31 + (k * k) % 997) % 30000 for k in range(p)]
                    t, i = stream_times(port, ids, n)
                    ttfts.append(t)
                    itls.append(i)
                cell = {"prompt": p, "output": n, "ttft_s": statistics.median(ttfts), "itl_s": statistics.median(itls)}
                cells.append(cell)
                print(f"prompt {p:5d}, output {n:4d}: TTFT {cell['ttft_s'] * 1000:7.1f} ms, "
                      f"ITL {cell['itl_s'] * 1000:6.2f} ms", flush=True)
    finally:
        server.terminate()
        server.wait(timeout=60)
    with open(os.path.join(a.out, "heatmap.json"), "w") as f:
        json.dump({"prompts": prompts, "outputs": outputs, "reps": a.reps, "cells": cells}, f, indent=1)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, title in ((axes[0], "ttft_s", "TTFT (ms, median)"), (axes[1], "itl_s", "ITL (ms, median)")):
        grid = [[next(c[key] for c in cells if c["prompt"] == p and c["output"] == n) * 1000 for n in outputs]
                for p in prompts]
        im = ax.imshow(grid, cmap="viridis", origin="lower", aspect="auto")
        ax.set_xticks(range(len(outputs)), [str(n) for n in outputs])
        ax.set_yticks(range(len(prompts)), [str(p) for p in prompts])
        ax.set_xlabel("output tokens")
        ax.set_ylabel("prompt tokens")
        ax.set_title(title)
        for y, row in enumerate(grid):
            for x, v in enumerate(row):
                ax.text(x, y, f"{v:.0f}" if key == "ttft_s" else f"{v:.1f}", ha="center", va="center", color="w")
        fig.colorbar(im, ax=ax)
    fig.suptitle("duet serve, idle server, SmolLM2-135M Q4_1")
    fig.tight_layout()
    fig.savefig(os.path.join(a.out, "heatmap.png"), dpi=110)


if __name__ == "__main__":
    main()
