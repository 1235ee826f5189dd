#!/usr/bin/env python3
"""Speculation's identity over a corpus: the 200 chat prompts of
bench/speculate_corpus.jsonl (rewrite, summarize, code edits, extraction: output
that copies its input; and open requests), through the official `openai` client,
give the same answers token for token and log-prob for log-prob from a server
with drafts on (the default) as from one with --draft-tokens 0:

  - greedy and seeded sampling, each prompt one at a time and eight at once (verify
    rows batched with other sequences' rows);
  - with a JSON schema (response_format) on the extraction prompts: a grammar mask
    on the verify rows, greedy;
  - the reference server runs decode on one core (--no-lend-cores), the other lends
    it prefill's (two threads while prompts are not being computed): the invariance
    contract says a thread count changes no logit. /metrics must show that decode
    computed on two threads for much of the one-at-a-time run, or the comparison
    of thread counts did not happen.

The drafts must be there to test anything: /metrics counts the kept ones, and the
input-grounded prompts must keep many.

Usage: speculate_corpus_test.py path/to/duet   (run with the venv's python)
"""
import concurrent.futures
import json
import os
import re
import subprocess
import sys
import time
import urllib.request

import openai

from duet_e2e import START_TIMEOUT, check, check_restarts, drain, listening_port, stop

DUET = sys.argv[1]
CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "speculate_corpus.jsonl")
TOKENS = 40
MODES = [{"temperature": 0}, {"temperature": 0.8, "seed": 3}]
SCHEMA = {"type": "json_schema", "json_schema": {"name": "orders", "strict": True, "schema": {
    "type": "object", "additionalProperties": False, "required": ["orders"],
    "properties": {"orders": {"type": "array", "items": {
        "type": "object", "additionalProperties": False, "required": ["name", "item", "quantity"],
        "properties": {"name": {"type": "string"}, "item": {"type": "string"}, "quantity": {"type": "integer"}}}}}}}}

ROWS = [json.loads(l) for l in open(CORPUS, encoding="utf-8")]
check(len(ROWS) >= 200, f"the corpus has {len(ROWS)} prompts")


def start(name, *flags):
    inst = f"duet-speculate-corpus-{os.getpid()}-{name}"
    p = subprocess.Popen([DUET, "serve", "--port", "0", "--ctx", "2048", "--instance", inst, *flags, *START_TIMEOUT],
                         stderr=subprocess.PIPE, text=True)
    port = listening_port(p)
    check(port, f"the server {name} did not start")
    drain(p)
    return p, port


def kept_drafts(port):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    return sum(int(v) for v in re.findall(r'^duet_draft_tokens_total\{drafter="\w+",outcome="accepted"\} (\d+)$',
                                          text, re.M))


def decode_borrowed_seconds(port):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    return sum(float(v) for v in re.findall(r'^duet_worker_borrowed_seconds_total\{role="decode",worker="\d+"\} (\S+)$',
                                            text, re.M))


def outcome(r):
    """What must not change with drafts: the text, the finish reason, every token's
    log-prob and its top two."""
    ch = r.choices[0]
    lps = [(t.token, t.logprob, sorted((x.token, x.logprob) for x in t.top_logprobs)) for t in ch.logprobs.content]
    return ch.message.content, ch.finish_reason, lps


def jobs():
    out = [(i, m) for i in range(len(ROWS)) for m in range(len(MODES))]
    out += [(i, "schema") for i, r in enumerate(ROWS) if r["kind"] == "extraction"]
    return out


def run(port, todo, parallel):
    # Eight long prompts at once can be refused for now (429: their first tokens would
    # miss the standard class's target); the client waits the Retry-After it names.
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=20, timeout=600)
    model = c.models.list().data[0].id

    def one(job):
        i, mode = job
        kw = dict(model=model, messages=ROWS[i]["messages"], max_tokens=TOKENS, logprobs=True, top_logprobs=2)
        if mode == "schema":
            kw.update(temperature=0, response_format=SCHEMA, max_tokens=96)
        else:
            kw.update(MODES[mode])
        return outcome(c.chat.completions.create(**kw))

    with concurrent.futures.ThreadPoolExecutor(max_workers=parallel) as ex:
        return list(ex.map(one, todo))


todo = jobs()
server, port = start("ref", "--draft-tokens", "0", "--no-lend-cores")
try:
    want = run(port, todo, 1)
    check(kept_drafts(port) == 0, "drafts on the reference server")
    check_restarts(port, 0)
finally:
    stop(server)
print(f"reference: {len(todo)} completions, drafts off, decode on one core")

server, port = start("spec")
try:
    for parallel in (1, 8):
        before, borrowed, t0 = kept_drafts(port), decode_borrowed_seconds(port), time.monotonic()
        got = run(port, todo, parallel)
        wall, borrowed = time.monotonic() - t0, decode_borrowed_seconds(port) - borrowed
        for (i, mode), w, g in zip(todo, want, got):
            check(w == g, f"{ROWS[i]['kind']} prompt {i}, mode {mode}, {parallel} at a time: with drafts\n{g[0]!r}\n"
                          f"without\n{w[0]!r}")
        kept = kept_drafts(port) - before
        check(kept >= len(todo) * 4, f"{parallel} at a time: only {kept} drafted tokens kept")
        if parallel == 1:
            check(borrowed >= 0.25 * wall,
                  f"decode computed on prefill's core too for {borrowed:.1f} s of {wall:.1f} s: too little for a "
                  "comparison of one thread with two")
        print(f"{len(todo)} completions {parallel} at a time: identical with drafts on ({kept} drafted tokens kept; "
              f"decode on two threads for {borrowed:.1f} s of {wall:.1f} s)")
    check_restarts(port, 0)
finally:
    stop(server)
print("ok")
