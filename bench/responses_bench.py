#!/usr/bin/env python3
"""A 10-turn conversation on `duet serve --contexts-dir`, two ways in the same run,
one request at a time, greedy, streamed:

- responses: each turn is client.responses.create(input=<the turn's question>,
  previous_response_id=<the last turn's>): the server continues the stored context;
- history: each turn is client.chat.completions.create(messages=<the whole
  conversation so far>), as a client that keeps the conversation itself resends it
  (the server's prefix cache spares the repeated part while it holds it).

Each way on a server of its own (one after the other, so that neither warms the
other's prefix cache). Per turn:
the prompt tokens the server computed (input less cached, from usage) and the time
to the first token. Before turn 6 each server is SIGKILLed (every process) and
restarted, as after a crash: the responses continue from the contexts on disk, the
history is computed again from nothing (the prefix cache is memory).

With --llama BIN_DIR the history way runs a third time, on llama-server (the pinned
build of scripts/build-llama-cpp; same model, threads, context; one slot, its prompt
cache on as by default), which keeps nothing between requests (its /v1/responses
stores no response: FACTS.md), so resending is how a client continues there; it is
SIGKILLed and restarted before turn 6 too. Its "computed" is its own count of prompt
tokens evaluated (timings.prompt_n).

Usage: responses_bench.py path/to/duet [--turns N] [--tokens T] [--llama BIN_DIR]
       (the venv's python: scripts/python-env)
"""
import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import openai

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "cli"))
from duet_e2e import drain, free_port, kill_server  # noqa: E402

QUESTIONS = ["Tell me about the history of Paris.", "What about its museums?", "Which one is the largest?",
             "What can I see there?", "How long would a visit take?", "What else is nearby?",
             "Where should I eat?", "What is a typical dish?", "How do I get there from the airport?",
             "Summarize our conversation."]


class Server:
    def __init__(self, duet, instance, cdir):
        self.instance = instance
        self.p = subprocess.Popen([duet, "serve", "--port", "0", "--ctx", "4096", "--instance", instance,
                                   "--contexts-dir", cdir], stderr=subprocess.PIPE, text=True, start_new_session=True)
        for line in self.p.stderr:
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
            if m:
                self.port = int(m.group(1))
                break
        drain(self.p)
        self.c = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", max_retries=0,
                               timeout=600)
        self.model = self.c.models.list().data[0].id

    def kill(self):
        kill_server(self.p, self.instance)

    def stop(self):
        self.p.send_signal(signal.SIGTERM)
        self.p.wait(60)


class LlamaServer:
    """llama-server on the default model, the machine's threads, one slot, 4096 of
    context (duet's --ctx), answering what duet's Server does."""

    def __init__(self, bin_dir):
        self.port = free_port()
        n = str(os.cpu_count())
        self.p = subprocess.Popen([os.path.join(bin_dir, "llama-server"), "-m", MODEL, "-t", n, "-tb", n, "-np", "1",
                                   "-c", "4096", "--host", "127.0.0.1", "--port", str(self.port)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        drain(self.p)
        for _ in range(1200):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5)
                break
            except Exception:
                if self.p.poll() is not None:
                    raise SystemExit("llama-server exited")
                time.sleep(0.1)
        self.c = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", max_retries=0,
                               timeout=600)
        self.model = "default"

    def kill(self):
        self.p.kill()
        self.p.wait()

    def stop(self):
        self.p.terminate()
        self.p.wait(60)


MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "models", "SmolLM2-135M-Instruct.Q4_1.gguf")


def run_responses(duet, turns, tokens):
    """The conversation by previous_response_id, the server SIGKILLed and restarted
    before turn 6: per turn (input, computed, TTFT s, the answer)."""
    cdir = tempfile.mkdtemp(prefix="duet-responses-bench-")
    instance = f"duet-responses-bench-{os.getpid()}"
    s = Server(duet, instance, cdir)
    rows, prev = [], None
    try:
        for t in range(turns):
            if t == 5:
                s.kill()
                s = Server(duet, instance, cdir)
            t0, first, last = time.perf_counter(), None, None
            for ev in s.c.responses.create(model=s.model, input=QUESTIONS[t % len(QUESTIONS)],
                                           previous_response_id=prev, instructions="You are a helpful guide.",
                                           max_output_tokens=tokens, temperature=0, stream=True):
                if ev.type == "response.output_text.delta" and first is None:
                    first = time.perf_counter() - t0
                if ev.type in ("response.completed", "response.incomplete"):
                    last = ev.response
            prev = last.id
            u = last.usage
            rows.append((u.input_tokens, u.input_tokens - u.input_tokens_details.cached_tokens, first,
                         last.output_text))
    finally:
        s.stop()
    return rows


def run_history(start, turns, tokens):
    """The conversation resent whole each turn (chat completions, each answer as it
    came), on a server of its own (start() makes it), SIGKILLed and restarted before
    turn 6."""
    s = start()
    rows = []
    history = [{"role": "system", "content": "You are a helpful guide."}]
    try:
        for t in range(turns):
            if t == 5:
                s.kill()
                s = start()
            history.append({"role": "user", "content": QUESTIONS[t % len(QUESTIONS)]})
            t0, first, usage, answer, timings = time.perf_counter(), None, None, "", None
            for ev in s.c.chat.completions.create(model=s.model, messages=history, max_tokens=tokens, temperature=0,
                                                  stream=True, stream_options={"include_usage": True}):
                for ch in ev.choices:
                    if ch.delta.content:
                        if first is None:
                            first = time.perf_counter() - t0
                        answer += ch.delta.content
                if ev.usage:
                    usage = ev.usage
                timings = (ev.model_extra or {}).get("timings", timings)  # llama-server's
            history.append({"role": "assistant", "content": answer})
            cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
            computed = timings["prompt_n"] if timings else usage.prompt_tokens - cached
            rows.append((usage.prompt_tokens, computed, first))
    finally:
        s.stop()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("duet")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--llama", help="llama-server's directory: the history way on it too, after duet's")
    args = ap.parse_args()
    resp = run_responses(args.duet, args.turns, args.tokens)
    cdir = tempfile.mkdtemp(prefix="duet-history-bench-")
    hist = run_history(lambda: Server(args.duet, f"duet-history-bench-{os.getpid()}", cdir), args.turns, args.tokens)
    llama = run_history(lambda: LlamaServer(args.llama), args.turns, args.tokens) if args.llama else None
    head = "| turn | responses: input | computed | TTFT ms | history: input | computed | TTFT ms |"
    rule = "|---|---|---|---|---|---|---|"
    if llama:
        head += " llama-server history: input | computed | TTFT ms |"
        rule += "---|---|---|"
    print(head)
    print(rule)
    for t, ((ri, rc, rt, _), (hi, hc, ht)) in enumerate(zip(resp, hist), 1):
        mark = " (after the SIGKILL)" if t == 6 else ""
        row = f"| {t}{mark} | {ri} | {rc} | {rt * 1e3:.0f} | {hi} | {hc} | {ht * 1e3:.0f} |"
        if llama:
            li, lc, lt = llama[t - 1]
            row += f" {li} | {lc} | {lt * 1e3:.0f} |"
        print(row)
    print(f"\ncomputed prompt tokens in all: responses {sum(r[1] for r in resp)}, history {sum(h[1] for h in hist)}"
          + (f", llama-server history {sum(x[1] for x in llama)}" if llama else ""))
    for name, rows in (("responses", resp), ("history", hist)) + ((("llama-server", llama),) if llama else ()):
        tt = sorted(r[2] for r in rows[1:])
        print(f"{name}: TTFT of turns 2-{len(rows)} median {tt[len(tt) // 2] * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
