#!/usr/bin/env python3
"""golden/ still holds llama.cpp's reference, not duet's own recording: every prompt
of each golden file has the same ids as tests/fixtures/logits.json (made by
llama.cpp, tests/fixtures/README.md), and at each of its positions the same top ids
with log-probabilities equal to that fixture's logit - lse. A golden file rewritten
from duet's output (whose logits differ from llama.cpp's by up to ~1.4) fails here.

Usage: golden_reference_test.py GOLDEN_DIR FIXTURES_DIR"""
import glob
import json
import os
import sys

from duet_e2e import check

golden_dir, fixtures = sys.argv[1], sys.argv[2]
ref = {p["name"]: p for p in json.load(open(os.path.join(fixtures, "logits.json")))["prompts"]}
files = sorted(glob.glob(os.path.join(golden_dir, "*.json")))
check(files, f"no golden file in {golden_dir}")
n = 0
for path in files:
    g = json.load(open(path))
    check("llama.cpp" in g.get("source", ""), f"{path}: its source names llama.cpp: {g.get('source')!r}")
    check(g["prompts"], f"{path}: no prompt")
    for p in g["prompts"]:
        r = ref.get(p["name"])
        check(r is not None, f"{path}: prompt {p['name']!r} is not in logits.json")
        check(p["ids"] == r["ids"], f"{path}: prompt {p['name']!r}: its ids differ from logits.json's")
        rpos = {q["pos"]: q for q in r["positions"]}
        check(p["positions"], f"{path}: prompt {p['name']!r} has no position")
        for q in p["positions"]:
            rq = rpos.get(q["pos"])
            check(rq is not None, f"{path}: {p['name']} position {q['pos']} is not in logits.json")
            want = [(i, logit - rq["lse"]) for i, logit in rq["top"]][:len(q["logprobs"])]
            check(len(q["logprobs"]) >= 10, f"{path}: {p['name']} position {q['pos']}: {len(q['logprobs'])} log-probs")
            got = [(i, lp) for i, lp in q["logprobs"]]
            check([i for i, _ in got] == [i for i, _ in want],
                  f"{path}: {p['name']} position {q['pos']}: top ids {[i for i, _ in got][:8]} != llama.cpp's "
                  f"{[i for i, _ in want][:8]}")
            worst = max(abs(a[1] - b[1]) for a, b in zip(got, want))
            check(worst < 1e-4, f"{path}: {p['name']} position {q['pos']}: a log-prob {worst:.2g} off llama.cpp's")
            n += 1
print(f"{len(files)} golden file(s), {n} positions: llama.cpp's log-probs (logits.json), ok")
