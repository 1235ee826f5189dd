#!/usr/bin/env python3
"""`duet serve` driven by the official `openai` Python client (PyPI, pinned in
scripts/python-env), unchanged: chat and completions, streamed and not, agreeing
with each other; usage; seed reproducibility at temperature > 0; and the client's
own exception types for our error responses.

Usage: openai_client_test.py path/to/duet   (run with the venv's python)
"""
import os
import re
import signal
import subprocess
import sys

import openai

DUET = sys.argv[1]
INSTANCE = f"duet-openai-test-{os.getpid()}"


def check(cond, msg):
    if not cond:
        print("FAIL:", msg, file=sys.stderr)
        sys.exit(1)


server = subprocess.Popen([DUET, "serve", "--port", "0", "--ctx", "512", "--instance", INSTANCE],
                          stderr=subprocess.PIPE, text=True)
try:
    port = None
    for line in server.stderr:
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
        if m:
            port = int(m.group(1))
            break
    check(port, "the server did not start")
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    model = c.models.list().data[0].id

    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    whole = c.chat.completions.create(model=model, messages=msgs, max_tokens=32, temperature=0)
    content = whole.choices[0].message.content
    check(content, "chat content")
    check(whole.usage.prompt_tokens > 0 and whole.usage.completion_tokens > 0, "usage")
    parts = []
    usage = None
    for ev in c.chat.completions.create(model=model, messages=msgs, max_tokens=32, temperature=0, stream=True,
                                        stream_options={"include_usage": True}):
        if ev.choices and ev.choices[0].delta.content:
            parts.append(ev.choices[0].delta.content)
        if ev.usage:
            usage = ev.usage
    check("".join(parts) == content, f"stream {''.join(parts)!r} != whole {content!r}")
    check(usage and usage.completion_tokens == whole.usage.completion_tokens, "stream usage")
    print("chat, streamed and whole: ok")

    comp = c.completions.create(model=model, prompt="The capital of France is", max_tokens=12, temperature=0)
    check(comp.choices[0].text and comp.choices[0].finish_reason in ("stop", "length"), "completion")
    a = c.completions.create(model=model, prompt="Once upon a time", max_tokens=24, temperature=0.9, seed=42)
    b = c.completions.create(model=model, prompt="Once upon a time", max_tokens=24, temperature=0.9, seed=42)
    check(a.choices[0].text == b.choices[0].text, "same seed, same text")
    print("completions, seed reproducibility: ok")

    two = c.chat.completions.create(model=model, messages=msgs, max_tokens=32, temperature=0, n=2,
                                    logprobs=True, top_logprobs=2)
    check([ch.index for ch in two.choices] == [0, 1], "n=2 indexes")
    check(all(ch.message.content == content for ch in two.choices), "n=2 greedy choices equal the n=1 answer")
    check(two.usage.completion_tokens == 2 * whole.usage.completion_tokens, "n=2 usage")
    check(two.usage.prompt_tokens_details.cached_tokens > 0, "n=2: the prompt's blocks came from the cache")
    lp = two.choices[0].logprobs.content
    check(len(lp) == two.usage.completion_tokens // 2 and all(len(e.top_logprobs) == 2 for e in lp), "chat logprobs")
    check(all(e.logprob == max(t.logprob for t in e.top_logprobs) for e in lp), "greedy picks the top token")
    clp = c.completions.create(model=model, prompt="The capital of France is", max_tokens=4, temperature=0,
                               logprobs=3).choices[0].logprobs
    check(len(clp.tokens) == 4 and len(clp.top_logprobs[0]) == 3 and clp.token_logprobs[0] <= 0, "completion logprobs")
    print("n = 2 and logprobs through the client: ok")

    try:
        c.completions.create(model=model, prompt="x", max_tokens=-5)
        check(False, "negative max_tokens accepted")
    except openai.BadRequestError as e:
        check(e.status_code == 400, "400")
    try:
        c.chat.completions.create(model="no-such-model", messages=msgs)
        check(False, "unknown model accepted")
    except openai.NotFoundError as e:
        check(e.status_code == 404, "404")
    print("errors as the client's exceptions: ok")
finally:
    server.send_signal(signal.SIGTERM)
    rc = server.wait(60)
check(rc == 0, f"serve exited with {rc}")
