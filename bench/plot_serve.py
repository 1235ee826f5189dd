#!/usr/bin/env python3
"""Plots and compares `duet bench serve --json` runs (scripts/bench-serve).

    plot_serve.py A.json B.json [--metrics duet-metrics.txt] [--png out.png]

The first file is duet, the second the reference: the Markdown table printed on
stdout gives each figure of both and their ratio (first / second). --metrics reads
duet's /metrics text and adds the server-side histograms' quantiles (hand-off
latency, the front's per-request and per-event cost).
"""
import argparse
import json
import math
import re


def load(path):
    with open(path) as f:
        return json.load(f)


def gaps(run, streams_only):
    warm = run["options"]["warmup_s"]
    out = []
    for r in run["requests"]:
        if r["start"] < warm or r["error"] or (streams_only and not r["stream"]):
            continue
        ev = r["events"]
        out += [(b - a) * 1e3 for a, b in zip(ev, ev[1:])]
    return sorted(out)


def ttfts(run):
    warm = run["options"]["warmup_s"]
    return sorted((r["events"][0] - r["start"]) * 1e3 for r in run["requests"]
                  if r["start"] >= warm and not r["error"] and r["events"] and not r["stream"])


def hist_quantiles(text, name, qs=(0.5, 0.9, 0.99)):
    """Quantiles (seconds) of a Prometheus histogram, linear inside a bucket."""
    buckets = []
    for m in re.finditer(r'^%s_bucket\{le="([^"]+)"\} (\S+)$' % re.escape(name), text, re.M):
        le = math.inf if m.group(1) == "+Inf" else float(m.group(1))
        buckets.append((le, float(m.group(2))))
    if not buckets or buckets[-1][1] == 0:
        return None
    total = buckets[-1][1]
    res = []
    for q in qs:
        rank, lo, prev = q * total, 0.0, 0.0
        for le, cum in buckets:
            if cum >= rank and cum > prev:
                hi = le if le != math.inf else lo
                res.append(lo + (hi - lo) * (rank - prev) / (cum - prev))
                break
            lo, prev = le, cum
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("duet")
    ap.add_argument("reference")
    ap.add_argument("--metrics")
    ap.add_argument("--probe-metrics", help="/metrics of a duet serve that got one request at a time")
    ap.add_argument("--png")
    a = ap.parse_args()
    d, r = load(a.duet), load(a.reference)
    ds, rs = d["summary"], r["summary"]
    dl, rl = d["label"], r["label"]

    def row(name, dv, rv, target=""):
        # A figure a server did not produce (no samples: null in its JSON, e.g. a
        # reference that collapsed under the load) is marked, never a crash.
        def fig(v):
            return f"{v:.2f}" if isinstance(v, (int, float)) and v == v else "— (none measured)"
        ok = all(isinstance(v, (int, float)) and v == v for v in (dv, rv)) and rv
        ratio = f"**{dv / rv:.2f}**" if ok else "—"
        print(f"| {name} | {fig(dv)} | {fig(rv)} | {ratio} | {target} |")

    o = d["options"]
    print(f"Scenario {o['scenario']}: {o['streams']} decode streams ({o['stream_prompt']}-token prompts, "
          f"{o['stream_output']} tokens each) + prompts of {o['prompt'][0]}-{o['prompt'][1]} tokens at "
          f"{o['rate']}/s ({o['output'][0]} tokens each), {o['duration_s']:.0f} s, first {o['warmup_s']:.0f} s "
          f"not counted.\n")
    print(f"| figure | {dl} | {rl} | ratio | target |")
    print("|---|---|---|---|---|")
    for key, name, target in [("itl_streams_ms", "decode streams' inter-token latency", "")]:
        for p in ("p50", "p90", "p99", "max"):
            row(f"{name} {p}, ms", ds[key][p], rs[key][p], "≤ 0.5" if p == "p99" else "")
    for p in ("p50", "p90", "max"):
        row(f"TTFT of long prompts {p}, ms", ds["ttft_ms"][p], rs["ttft_ms"][p], "≤ 0.6 (lending on)" if p == "p50" else "")
    row("output tokens/s", ds["output_tokens_per_s"], rs["output_tokens_per_s"])
    row("completed requests", ds["completed"], rs["completed"])
    print(f"\nLong prompts measured: {ds['ttft_ms']['n']} ({dl}), {rs['ttft_ms']['n']} ({rl}); "
          f"errors: {ds['errors']} ({dl}), {rs['errors']} ({rl}).")
    for label, summ in ((dl, ds), (rl, rs)):
        if summ.get("retries"):
            print(f"{label}: {summ['retried_requests']} requests refused (429) and sent again after their "
                  f"Retry-After ({summ['retries']} retries in all; TTFT counts from the first try).")

    if a.metrics:
        text = open(a.metrics).read()
        print(f"\n{dl}'s own histograms (/metrics, bucket-interpolated):\n")
        print("| histogram | p50 | p90 | p99 |")
        print("|---|---|---|---|")
        for name in ("duet_handoff_latency_seconds", "duet_queue_time_seconds", "duet_prefill_time_seconds",
                     "duet_front_admit_seconds", "duet_front_stream_event_seconds",
                     "duet_inter_token_latency_seconds"):
            q = hist_quantiles(text, name)
            if q:
                print(f"| {name} | " + " | ".join(f"{x * 1e6:.1f} µs" if x < 1e-3 else f"{x * 1e3:.2f} ms"
                                                  for x in q) + " |")

    if a.probe_metrics:
        q = hist_quantiles(open(a.probe_metrics).read(), "duet_handoff_latency_seconds")
        if q:
            print(f"\nHand-off with decode idle (requests one at a time): p50 {q[0] * 1e6:.1f} µs, "
                  f"p90 {q[1] * 1e6:.1f} µs, p99 {q[2] * 1e6:.1f} µs (target p50 ≤ 50 µs).")

    if a.png:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
        for run, style in ((d, "-"), (r, "--")):
            g = gaps(run, True)
            if g:
                ax[0].plot(g, [(i + 1) / len(g) for i in range(len(g))], style, label=run["label"])
            t = ttfts(run)
            if t:
                ax[1].plot(t, [(i + 1) / len(t) for i in range(len(t))], style, marker=".", label=run["label"])
        ax[0].set_xscale("log")
        ax[0].set_xlabel("inter-token latency of the decode streams (ms)")
        ax[0].set_ylabel("fraction ≤ x")
        ax[0].grid(True, which="both", alpha=0.3)
        ax[0].legend()
        ax[1].set_xlabel("TTFT of the long prompts (ms)")
        ax[1].set_ylabel("fraction ≤ x")
        ax[1].grid(True, alpha=0.3)
        ax[1].legend()
        fig.suptitle(f"mixed load: {o['streams']} decode streams + {o['prompt'][0]}-{o['prompt'][1]}-token "
                     f"prompts at {o['rate']}/s")
        fig.tight_layout()
        fig.savefig(a.png, dpi=110)


if __name__ == "__main__":
    main()
