#!/usr/bin/env python3
"""`duet serve` driven by the official `openai` Python client (PyPI, pinned in
scripts/python-env), unchanged: chat and completions, streamed and not, agreeing
with each other; usage; seed reproducibility at temperature > 0; and the client's
own exception types for our error responses; a conversation sent back whole finds
its first answer's blocks in the prefix cache, and answers as a server without one.

Usage: openai_client_test.py path/to/duet   (run with the venv's python)
"""
import json
import os
import re
import signal
import shutil
import subprocess
import sys
import tempfile
import urllib.request

import openai

from duet_e2e import check_restarts, drain, listening_port, running_workers

DUET = sys.argv[1]
INSTANCE = f"duet-openai-test-{os.getpid()}"


def check(cond, msg):
    if not cond:
        print("FAIL:", msg, file=sys.stderr)
        sys.exit(1)


CONTEXTS = tempfile.mkdtemp(prefix="duet-openai-contexts-")
server = subprocess.Popen([DUET, "serve", "--port", "0", "--ctx", "512", "--instance", INSTANCE, "--contexts-dir", CONTEXTS],
                          stderr=subprocess.PIPE, text=True)
try:
    port = None
    for line in server.stderr:
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
        if m:
            port = int(m.group(1))
            break
    check(port, "the server did not start")
    drain(server)
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

    # A conversation sent back whole, as chat clients do: decode published the first
    # answer's blocks, so the second turn takes them from the prefix cache (more than
    # the first prompt's), and its answer is, token and logprob, the one a server
    # without a prefix cache computes (KV depends on the tokens alone).
    story = [{"role": "user", "content": "Tell me a story about a lighthouse keeper and a storm."}]
    t1 = c.chat.completions.create(model=model, messages=story, max_tokens=64, temperature=0)
    check(t1.usage.completion_tokens >= 40, f"a first answer long enough to fill answer blocks: {t1.usage}")
    story += [{"role": "assistant", "content": t1.choices[0].message.content},
              {"role": "user", "content": "What happened next?"}]
    kw = dict(model=model, messages=story, max_tokens=24, temperature=0.8, seed=3, logprobs=True, top_logprobs=2)
    t2 = c.chat.completions.create(**kw)
    cached = t2.usage.prompt_tokens_details.cached_tokens
    check(cached > t1.usage.prompt_tokens, f"the first answer's blocks serve the second turn: {cached} cached, "
                                           f"first prompt {t1.usage.prompt_tokens}, now {t2.usage.prompt_tokens}")
    plain = subprocess.Popen([DUET, "serve", "--port", "0", "--ctx", "512", "--no-prefix-cache", "--instance",
                              INSTANCE + "-nc"], stderr=subprocess.PIPE, text=True)
    try:
        plain_port = listening_port(plain)
        check(plain_port, "the server without a prefix cache did not start")
        drain(plain)
        pc = openai.OpenAI(base_url=f"http://127.0.0.1:{plain_port}/v1", api_key="none", max_retries=0)
        want = pc.chat.completions.create(**kw)
    finally:
        plain.send_signal(signal.SIGTERM)
        plain.wait(60)
    check(want.usage.prompt_tokens_details.cached_tokens == 0, f"--no-prefix-cache: {want.usage}")
    check(t2.choices[0].message.content == want.choices[0].message.content
          and [(e.token, e.logprob) for e in t2.choices[0].logprobs.content]
          == [(e.token, e.logprob) for e in want.choices[0].logprobs.content],
          f"with the cached answer blocks: {t2.choices[0].message.content!r}; computed: "
          f"{want.choices[0].message.content!r}")
    print(f"a conversation sent back: {cached} of {t2.usage.prompt_tokens} prompt tokens cached (the first prompt "
          f"had {t1.usage.prompt_tokens}), the answer identical to a server without a cache: ok")

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

    # Every parameter honoured or refused (docs/API.md's table): the client's own
    # BadRequestError, naming the field, for one it would otherwise drop.
    def refused(param, **kw):
        try:
            kw.setdefault("max_tokens", 4)
            if "messages" in kw:
                c.chat.completions.create(model=model, **kw)
            else:
                c.completions.create(model=model, prompt=kw.pop("prompt", "x"), **kw)
        except openai.BadRequestError as e:
            check(e.status_code == 400 and e.body and e.body.get("param") == param, f"{param}: {e.body}")
            return e.body["message"]
        check(False, f"{param} accepted: {kw}")
    check("'uniqueItems' at /properties/tags is not supported" in refused(
        "response_format", messages=msgs, response_format={"type": "json_schema", "json_schema": {
            "name": "t", "schema": {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}}}),
          "an unsupported schema keyword is named, with where it is")
    check(refused("frobnicate", extra_body={"frobnicate": 1}) == "Unrecognized request argument supplied: frobnicate",
          "OpenAI's words for an unknown field")
    refused("suffix", suffix=" and so on.")
    refused("tools", messages=msgs, tools=[{"type": "web_search_preview"}])
    refused("functions", messages=msgs, functions=[{"name": "f", "parameters": {}}])
    refused("messages", messages=[{"role": "user", "content": "hi", "name": "bob"}])
    refused("echo", echo=True, logprobs=1)
    c.chat.completions.create(model=model, messages=msgs, max_tokens=2, user="u1", metadata={"a": "b"},
                              response_format={"type": "text"})  # ignored as OpenAI does, or asking for nothing
    print("refused parameters name themselves (the client's BadRequestError): ok")

    # logit_bias (OpenAI's meaning: added to the logits before sampling): -100 bans
    # the token greedy decoding chose first, +100 forces one token at every step.
    def tokenize(text):
        req = urllib.request.Request(f"http://127.0.0.1:{port}/tokenize", method="POST", data=json.dumps(
            {"prompt": text, "add_special_tokens": False}).encode())
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read().decode())["tokens"]
    plain = comp.choices[0].text
    first = tokenize(plain)[0]
    for stream in (False, True):
        def text_of(**kw):
            r = c.completions.create(model=model, prompt="The capital of France is", max_tokens=12, temperature=0,
                                     stream=stream, **kw)
            return "".join(ev.choices[0].text for ev in r if ev.choices) if stream else r.choices[0].text
        banned = text_of(logit_bias={str(first): -100})
        check(banned != plain and tokenize(banned)[0] != first, f"-100 on {first}: {banned!r} (plain {plain!r})")
        blue = tokenize(" blue")
        check(len(blue) == 1, f"' blue' is one token: {blue}")
        forced = text_of(logit_bias={str(blue[0]): 100})
        check(forced == " blue" * 12, f"+100 on ' blue': {forced!r}")
        check(text_of(logit_bias={str(blue[0]): 0.0}) == plain, "a zero bias changes nothing")
        # A table of any size up to the request data's bound (kept in the request's
        # slot, not its fixed parameters): the entry that matters after 299 others.
        filler = [str(t) for t in range(1000, 1400) if t not in (first, blue[0])][:299]
        big = dict.fromkeys(filler, 0.0)
        big[str(first)] = -100
        check(text_of(logit_bias=big) == banned, f"the 300th entry bans {first} as the only one does")
        big = dict.fromkeys(filler[:150], 0.0)
        big[str(blue[0])] = 100
        big.update(dict.fromkeys(filler[150:], 0.0))
        check(text_of(logit_bias=big) == " blue" * 12, "an entry in the middle of 300 forces ' blue'")
    # Who picks a biased row does not change its tokens: without log-probabilities the
    # backend's sampler picks it (on a GPU, on the device), with them the worker's
    # host pick does; greedy and seeded.
    for kw in ({"temperature": 0}, {"temperature": 0.9, "seed": 5}):
        bias = {str(first): -100, str(blue[0]): 3.5}
        r1 = c.completions.create(model=model, prompt="The capital of France is", max_tokens=16, logit_bias=bias, **kw)
        r2 = c.completions.create(model=model, prompt="The capital of France is", max_tokens=16, logit_bias=bias,
                                  logprobs=1, **kw)
        check(r1.choices[0].text == r2.choices[0].text, f"{kw}: the backend picked {r1.choices[0].text!r}, the host "
              f"{r2.choices[0].text!r}")
    try:
        c.completions.create(model=model, prompt="x", max_tokens=1,
                             logit_bias={str(t): 1 for t in range(9000)})
        check(False, "a logit_bias table past the request data's bound was accepted")
    except openai.BadRequestError as e:
        check(e.body.get("param") == "logit_bias" and e.body.get("code") == "request_data_too_large"
              and "65536" in e.body.get("message", ""), f"the bound named: {e.body}")
    print(f"logit_bias: -100 bans token {first}, +100 forces ' blue', whole and streamed, from tables of 1 to 300 "
          "entries, the same tokens whoever picks them; 9000 refused naming the bound: ok")

    # echo: the prompt's text, then the completion (the plain one computed above).
    prompt = "The capital of France is"
    echoed = c.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, echo=True)
    check(echoed.choices[0].text == prompt + comp.choices[0].text, f"echo: {echoed.choices[0].text!r}")
    streamed = "".join(ev.choices[0].text for ev in c.completions.create(
        model=model, prompt=prompt, max_tokens=12, temperature=0, echo=True, stream=True) if ev.choices)
    check(streamed == echoed.choices[0].text, f"echo streamed: {streamed!r}")
    # best_of: of the candidates (n = best_of with the same seed gives the same ones),
    # the one with the highest mean log-probability per token, computed here.
    cands = c.completions.create(model=model, prompt="Once upon a time", max_tokens=10, temperature=1.0, seed=7, n=4,
                                 logprobs=0)
    means = [sum(ch.logprobs.token_logprobs) / len(ch.logprobs.token_logprobs) for ch in cands.choices]
    best = max(range(4), key=lambda i: (means[i], -i))
    check(len({ch.text for ch in cands.choices}) > 1, f"the candidates differ: {[ch.text for ch in cands.choices]}")
    one = c.completions.create(model=model, prompt="Once upon a time", max_tokens=10, temperature=1.0, seed=7, best_of=4)
    check(len(one.choices) == 1 and one.choices[0].text == cands.choices[best].text and one.choices[0].logprobs is None,
          f"best_of 4: {one.choices[0].text!r}, want {cands.choices[best].text!r} (means {means})")
    check(one.usage.completion_tokens == cands.usage.completion_tokens, "best_of's usage counts every candidate")
    two_best = c.completions.create(model=model, prompt="Once upon a time", max_tokens=10, temperature=1.0, seed=7,
                                    best_of=4, n=2)
    order = sorted(range(4), key=lambda i: (-means[i], i))[:2]
    check([ch.text for ch in two_best.choices] == [cands.choices[i].text for i in order] and
          [ch.index for ch in two_best.choices] == [0, 1], f"best_of 4, n 2: {two_best.choices}")
    print(f"echo (whole and streamed) and best_of (means {[round(m, 3) for m in means]}): ok")

    # Finish reasons, whole and streamed, as the worker that chose the last token
    # said (engine/token_step.h): an end-of-generation token "stop", max_tokens
    # "length" (ignore_eos too), a stop string "stop".
    colors = [{"role": "user", "content": "Name three colors."}]  # SmolLM2 ends this one itself

    def finishes(**kw):
        whole = c.chat.completions.create(model=model, messages=colors, temperature=0, **kw)
        last = [ev.choices[0].finish_reason for ev in c.chat.completions.create(
            model=model, messages=colors, temperature=0, stream=True, **kw) if ev.choices and ev.choices[0].finish_reason]
        check(last == [whole.choices[0].finish_reason], f"{kw}: streamed {last}, whole {whole.choices[0].finish_reason}")
        return whole.choices[0].finish_reason, whole.usage.completion_tokens, whole.choices[0].message.content
    reason, n_eog, said = finishes(max_tokens=200)
    check(reason == "stop" and n_eog < 200, f"an eog ends the answer: {reason}, {n_eog} tokens")
    check(finishes(max_tokens=3)[:2] == ("length", 3), "max_tokens: length")
    reason, n, _ = finishes(max_tokens=n_eog + 20, extra_body={"ignore_eos": True})
    check((reason, n) == ("length", n_eog + 20), f"ignore_eos: {reason}, {n} tokens")
    # min_tokens (vLLM's): no eog before it; the text so far is the same greedy text.
    reason, n_min, longer = finishes(max_tokens=n_eog + 40, extra_body={"min_tokens": n_eog + 10})
    check(n_min >= n_eog + 10 and longer.startswith(said) and len(longer) > len(said),
          f"min_tokens {n_eog + 10}: {n_min} tokens, {longer!r} after {said!r}")
    word = said.split()[1]
    reason, n, cut = finishes(max_tokens=200, stop=[word])
    check(reason == "stop" and word not in cut and said.startswith(cut), f"stop string {word!r}: {reason}, {cut!r}")
    print(f"finish reasons whole and streamed (eog after {n_eog} tokens, length, ignore_eos, stop string), "
          f"min_tokens {n_eog + 10} ({n_min} tokens): ok")

    # Stop strings with min_tokens, against vLLM's rule applied here to the token texts
    # of the same greedy run without stops: from output number min_tokens on, the first
    # output whose text completes a stop string (ending in that output's text, begun
    # anywhere) ends it, the text cut before the stop string that begins first, and
    # usage counts that output. The worker ends such a request itself (finish "stop"
    # from the worker, not a cancel by the front: the cancelled count stays).
    def cancelled_total():
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
            return int(re.search(r"^duet_requests_cancelled_total (\d+)$", r.read().decode(), re.M).group(1))
    count = "Count from one to one hundred: one, two, three,"
    free = c.completions.create(model=model, prompt=count, max_tokens=24, temperature=0, logprobs=0)
    pieces = free.choices[0].logprobs.tokens
    check("".join(pieces) == free.choices[0].text and free.choices[0].text.startswith(" four, five"),
          f"the count: {pieces}")

    def expected(stops, min_tokens):
        text = ""
        for n, piece in enumerate(pieces, 1):
            before = len(text)
            text += piece
            if n < min_tokens:
                continue
            at = [text.find(x, max(0, before - len(x) + 1)) for x in stops]
            at = [a for a in at if a >= 0]
            if at:
                return text[:min(at)], n, "stop"
        return text, len(pieces), "length"
    cancelled0 = cancelled_total()
    cases = [([","], 0), ([","], 2), ([","], 3), ([","], 4), ([","], 7), ([" six", ","], 4), ([", fi", " fiv"], 2),
             (["seven,"], 1), (["x"], 5)]
    for stops, min_tokens in cases:
        want = expected(stops, min_tokens)
        whole = c.completions.create(model=model, prompt=count, max_tokens=24, temperature=0, stop=stops,
                                     extra_body={"min_tokens": min_tokens})
        got = (whole.choices[0].text, whole.usage.completion_tokens, whole.choices[0].finish_reason)
        check(got == want, f"stop {stops}, min_tokens {min_tokens}: {got}, want {want}")
        evs = list(c.completions.create(model=model, prompt=count, max_tokens=24, temperature=0, stop=stops,
                                        stream=True, extra_body={"min_tokens": min_tokens}))
        streamed = ("".join(e.choices[0].text for e in evs if e.choices),
                    [e.choices[0].finish_reason for e in evs if e.choices and e.choices[0].finish_reason])
        check(streamed == (want[0], [want[2]]), f"stop {stops}, min_tokens {min_tokens} streamed: {streamed}, want {want}")
    check(cancelled_total() == cancelled0, f"stop strings ended by cancels: {cancelled_total() - cancelled0}")
    print(f"stop strings with min_tokens ({len(cases)} cases, whole and streamed) as vLLM's rule over the token "
          f"texts; ended by the worker (no cancel): ok")

    # A context through the client: its completions route as base_url (extra_body for
    # the contexts API's own fields), created and read with plain HTTP.
    def http(method, path, body=None):
        req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method,
                                     data=json.dumps(body).encode() if body is not None else None)
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read().decode())
    http("POST", "/v1/contexts", {"id": "doc", "prompt": "The capital of France is"})
    cc = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1/contexts/doc", api_key="none", max_retries=0)
    r1 = cc.completions.create(model=model, prompt=" Paris. The capital of Italy is", max_tokens=6, temperature=0)
    tokens = http("GET", "/v1/contexts/doc?tokens=true")["tokens"]
    plain = c.completions.create(model=model, prompt=tokens[:-6], max_tokens=6, temperature=0)
    check(r1.choices[0].text == plain.choices[0].text, f"context {r1.choices[0].text!r} vs plain {plain.choices[0].text!r}")
    cc.completions.create(model=model, prompt=" Rome.", max_tokens=4, temperature=0, extra_body={"commit": False})
    check(http("GET", "/v1/contexts/doc?tokens=true")["tokens"] == tokens, "commit false through extra_body")
    print("a context through the client: ok")

    # A chat through a context, as the official client sends it: extra_body names the
    # context, each turn sends only its new messages, and the reply joins the context.
    # The context then holds the tokens of the whole conversation rendered at once
    # (ChatML, written out here: SmolLM2's template), and a plain chat completion of
    # the whole conversation answers the next turn as the context does.
    http("POST", "/v1/contexts", {"id": "chat", "messages": [{"role": "system", "content": "Be brief."}]})
    history = [{"role": "system", "content": "Be brief."}]
    for q in ["What is the capital of France?", "And of Italy?", "Which one is larger?"]:
        turn = [{"role": "user", "content": q}]
        r = c.chat.completions.create(model=model, messages=turn, max_tokens=12, temperature=0,
                                      extra_body={"context": "chat"})
        whole = c.chat.completions.create(model=model, messages=history + turn, max_tokens=12, temperature=0)
        check(r.choices[0].message.content == whole.choices[0].message.content,
              f"turn {q!r}: through the context {r.choices[0].message.content!r}, "
              f"whole conversation {whole.choices[0].message.content!r}")
        check(r.usage.prompt_tokens_details.cached_tokens > 0 or len(history) == 1,
              f"the context's blocks serve the turn: {r.usage}")
        history += turn + [{"role": "assistant", "content": r.choices[0].message.content}]
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in history)
    want = http("POST", "/tokenize", {"prompt": text, "add_special_tokens": False,
                                     "parse_special": True})["tokens"]
    got = http("GET", "/v1/contexts/chat?tokens=true")["tokens"]
    check(got == want, f"the context holds the whole conversation's tokens:\n{got}\nvs\n{want}")
    print("a chat through a context with extra_body: ok (3 turns, the whole conversation's tokens)")
    # A biased stream survives decode's SIGKILL: the bias rides in the request slot,
    # so the re-driven request picks exactly as before. Killed while decode holds
    # the request with most of its tokens to make (its own gauges, read just before).
    def metric(name):
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
        m = re.search(rf"^{re.escape(name)} (\d+)$", text, re.M)
        return int(m.group(1)) if m else 0
    # The table (40 entries: in the request's data) is read again by the decode
    # worker that takes the re-driven request.
    bias = {str(t): 0.0 for t in range(1000, 1040) if t not in (first, blue[0])}
    bias.update({str(first): -100, str(blue[0]): 5})
    biased = dict(model=model, prompt="The capital of France is", max_tokens=200, temperature=0.8, seed=3,
                  logit_bias=bias, extra_body={"ignore_eos": True})
    want = c.completions.create(**biased).choices[0].text
    # A look and its kill are not one act: a stream that decode finished in between
    # (drafted from `want` in its pool, on a loaded machine) is asked for again,
    # three times at most.
    kills = 0
    for attempt in range(3):
        decode = running_workers(DUET, INSTANCE, "decode")  # after a missed kill: its successor, once it runs
        check(len(decode) == 1, f"one running decode worker: {decode}")
        redriven = metric("duet_requests_redriven_total")
        parts, killed = [], None
        for ev in c.completions.create(stream=True, **biased):
            parts.extend(ch.text for ch in ev.choices)
            if killed is None:
                held = metric('duet_worker_requests{role="decode",worker="0"}')
                made = metric('duet_worker_tokens{role="decode",worker="0"}')
                if held == 1:
                    os.kill(decode[0], signal.SIGKILL)
                    killed = made
                    kills += 1
        check("".join(parts) == want, f"after decode's SIGKILL: {''.join(parts)!r} != {want!r}")
        if killed is not None and metric("duet_requests_redriven_total") == redriven + 1:
            break
        print(f"attempt {attempt + 1}: the biased stream was not killed in decode's hands; again", flush=True)
        killed = None
    check(killed is not None, "three attempts: decode was never killed while it held the biased request")
    print(f"logit_bias through decode's SIGKILL (at {killed} tokens held): re-driven, identical: ok")
    check_restarts(port, kills)
finally:
    server.send_signal(signal.SIGTERM)
    rc = server.wait(60)
shutil.rmtree(CONTEXTS, ignore_errors=True)
check(rc == 0, f"serve exited with {rc}")
