#!/usr/bin/env python3
"""`duet serve` end to end over HTTP (Python standard library and curl only).

Starts the server on a free port, then checks: health, readiness and models; greedy
completions equal `duet run`'s text; chat streamed and not streamed agree, with usage;
stop strings; OpenAI-style errors with the right status codes; a SIGKILLed decode
worker in the middle of a stream (the stream completes with exactly the text of an
undisturbed run, /metrics counts the restart and the re-drive, the KV blocks all come
back); SIGTERM drains, exits 0 and leaves nothing in /dev/shm.

Usage: serve_test.py path/to/duet
"""
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

DUET = sys.argv[1]
INSTANCE = f"duet-serve-test-{os.getpid()}"


def fail(msg):
    print("FAIL:", msg, file=sys.stderr)
    sys.exit(1)


def check(cond, msg):
    if not cond:
        fail(msg)


def request(port, method, path, body=None, raw=None):
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def stream(port, path, body, progress=None):
    """Returns (text, events) of an SSE response; progress(text so far) after each event."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    text, events = "", []
    with urllib.request.urlopen(req, timeout=120) as r:
        check(r.headers.get("Content-Type", "").startswith("text/event-stream"), "SSE content type")
        for line in r:
            line = line.decode().rstrip("\n")
            if not line.startswith("data: "):
                continue
            payload = line[6:]
            events.append(payload)
            if payload == "[DONE]":
                break
            ev = json.loads(payload)
            for ch in ev.get("choices", []):
                if "delta" in ch:
                    text += ch["delta"].get("content") or ""
                else:
                    text += ch.get("text", "")
            if progress:
                progress(text)
    return text, events


def shm_processes():
    out = subprocess.run([DUET, "shm", "status", INSTANCE, "--json"], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main():
    server = subprocess.Popen([DUET, "serve", "--port", "0", "--ctx", "512", "--instance", INSTANCE, "--grace", "10"],
                              stderr=subprocess.PIPE, text=True)
    try:
        port = None
        deadline = time.time() + 120
        while time.time() < deadline:
            line = server.stderr.readline()
            if not line:
                fail("the server exited before listening")
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
            if m:
                port = int(m.group(1))
                break
        check(port, "no 'listening on' line")
        run(port, server)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        for d in ("/dev/shm", "/dev/hugepages"):
            for f in (f"duet.{INSTANCE}", f"duet.{INSTANCE}.kv"):
                if os.path.exists(os.path.join(d, f)):
                    os.unlink(os.path.join(d, f))


def run(port, server):
    # Health, readiness, models.
    check(request(port, "GET", "/health") == (200, '{"status":"ok"}'), "health")
    for _ in range(100):
        if request(port, "GET", "/ready")[0] == 200:
            break
        time.sleep(0.1)
    check(request(port, "GET", "/ready")[0] == 200, "ready")
    st, body = request(port, "GET", "/v1/models")
    model = json.loads(body)["data"][0]["id"]
    check(st == 200 and model, "models")
    print("health, ready, models: ok")

    # Greedy completions equal duet run's text.
    prompt = "The capital of France is"
    st, body = request(port, "POST", "/v1/completions",
                       {"model": model, "prompt": prompt, "max_tokens": 24, "temperature": 0})
    check(st == 200, f"completion: {st} {body}")
    c = json.loads(body)
    run_text = subprocess.run([DUET, "run", "-p", prompt, "-n", "24", "--temperature", "0", "-t", "1"],
                              capture_output=True, text=True, check=True).stdout
    check(run_text.endswith("\n"), "duet run ends its output with a newline")
    check(c["choices"][0]["text"] == run_text[:-1], f"server {c['choices'][0]['text']!r} != duet run {run_text[:-1]!r}")
    check(c["usage"]["prompt_tokens"] > 0 and c["usage"]["completion_tokens"] > 0, "usage")
    print("completion equals duet run: ok")

    # Chat, streamed and not.
    chat = {"messages": [{"role": "user", "content": "Name three colors."}], "max_tokens": 40, "temperature": 0}
    st, body = request(port, "POST", "/v1/chat/completions", chat)
    check(st == 200, f"chat: {st} {body}")
    whole = json.loads(body)
    content = whole["choices"][0]["message"]["content"]
    check(content and whole["choices"][0]["message"]["role"] == "assistant", "chat message")
    text, events = stream(port, "/v1/chat/completions", dict(chat, stream=True, stream_options={"include_usage": True}))
    check(events[-1] == "[DONE]", "stream ends with [DONE]")
    check(text == content, f"streamed {text!r} != whole {content!r}")
    usage = json.loads(events[-2])["usage"]
    check(usage == whole["usage"], f"stream usage {usage} != {whole['usage']}")
    print("chat streamed and whole agree, with usage: ok")

    # Stop strings: cut at the first occurrence, finish_reason "stop".
    check(len(content) >= 8, f"need a longer answer: {content!r}")
    stop = content[len(content) // 2:len(content) // 2 + 3]
    st, body = request(port, "POST", "/v1/chat/completions", dict(chat, stop=[stop]))
    s = json.loads(body)["choices"][0]
    check(s["message"]["content"] == content[:content.index(stop)], f"stop: {s['message']['content']!r}")
    check(s["finish_reason"] == "stop", "stop reason")
    print("stop strings: ok")

    # Errors.
    cases = [
        (b"{not json", 400, None),
        (json.dumps({"prompt": "x", "model": "no-such-model"}).encode(), 404, "model_not_found"),
        (json.dumps({"prompt": "x", "max_tokens": -1}).encode(), 400, None),
        (json.dumps({"prompt": "x", "temperature": "hot"}).encode(), 400, None),
        (json.dumps({"prompt": "word " * 3000}).encode(), 400, "context_length_exceeded"),
        (json.dumps({"prompt": "x", "max_tokens": 10000}).encode(), 400, "context_length_exceeded"),
        (json.dumps({"prompt": ["a", "b"]}).encode(), 400, None),
    ]
    for raw, status, code in cases:
        st, body = request(port, "POST", "/v1/completions", raw=raw)
        check(st == status, f"{raw[:40]!r}: status {st}, expected {status}: {body[:200]}")
        err = json.loads(body)["error"]
        check(err["message"] and err["type"], f"error shape: {body}")
        if code:
            check(err["code"] == code, f"error code {err['code']}, expected {code}")
    check(request(port, "GET", "/nope")[0] == 404, "unknown route")
    # A body over the 1 MiB limit: 413 (curl, which reads the early answer while sending).
    with open(f"/tmp/{INSTANCE}.big", "wb") as f:
        f.write(b"x" * (2 << 20))
    big = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-X", "POST", "--data-binary",
                          f"@/tmp/{INSTANCE}.big", f"http://127.0.0.1:{port}/v1/completions"],
                         capture_output=True, text=True)
    os.unlink(f"/tmp/{INSTANCE}.big")
    check(big.stdout == "413", f"oversized body: {big.stdout}")
    curl = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-X", "POST",
                           f"http://127.0.0.1:{port}/v1/chat/completions", "-d", '{"messages": 3}'],
                          capture_output=True, text=True)
    check(curl.stdout == "400", f"curl: {curl.stdout}")
    print("errors: ok")

    # 64 concurrent streaming clients (continuous batching): all complete, all correct.
    import threading
    ref_body = {"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}
    ref = json.loads(request(port, "POST", "/v1/completions", ref_body)[1])["choices"][0]["text"]
    results = [None] * 64

    def client(i):
        try:
            results[i] = stream(port, "/v1/completions", dict(ref_body, stream=True))[0]
        except Exception as e:  # reported below
            results[i] = f"error: {e}"
    threads = [threading.Thread(target=client, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    bad = [r for r in results if r != ref]
    check(not bad, f"{len(bad)} of 64 concurrent streams differ, e.g. {bad[:1]!r} != {ref!r}")
    print("64 concurrent streams: ok")

    # SIGKILL decode in the middle of a stream: the stream completes with the same text.
    story = {"messages": [{"role": "user", "content": "Write a long story about a brave little dragon."}],
             "max_tokens": 200, "temperature": 0}
    st, body = request(port, "POST", "/v1/chat/completions", story)
    want = json.loads(body)["choices"][0]["message"]["content"]
    check(len(want) > 200, f"need a long answer: {want!r}")
    # Blocks nobody holds are free or cached (the prefix cache keeps finished
    # prompts' full blocks until their room is needed): the baseline is "none held".
    def reclaimable():
        return [(a["held"], a["free"] + a["cached"] == a["blocks"]) for a in shm_processes()["arenas"]]
    baseline = reclaimable()
    check(all(held == 0 and whole for held, whole in baseline), f"idle arena: {baseline}")
    import threading
    got = {}
    seen = threading.Event()
    t = threading.Thread(target=lambda: got.update(text=stream(
        port, "/v1/chat/completions", dict(story, stream=True), lambda txt: len(txt) > 40 and seen.set())[0]))
    t.start()
    check(seen.wait(120), "the stream did not start")  # decode is producing tokens now
    decode = [p["pid"] for p in shm_processes()["processes"] if p["role"] == "decode"]
    check(len(decode) == 1, f"one decode worker: {decode}")
    os.kill(decode[0], signal.SIGKILL)
    t.join(120)
    check(got.get("text") == want, f"after the kill: {got.get('text', '')[:120]!r}... != {want[:120]!r}...")
    metrics = request(port, "GET", "/metrics")[1]
    restarts = int(re.search(r"^duet_worker_restarts_total (\d+)", metrics, re.M).group(1))
    redriven = int(re.search(r"^duet_requests_redriven_total (\d+)", metrics, re.M).group(1))
    check(restarts >= 1 and redriven >= 1, f"metrics: restarts {restarts}, redriven {redriven}")
    for _ in range(100):
        if reclaimable() == baseline:
            break
        time.sleep(0.05)
    check(reclaimable() == baseline, f"every KV block free or cached again: {reclaimable()}")
    print(f"decode killed mid-stream: identical text, {restarts} restart(s), {redriven} re-drive(s): ok")

    # SIGTERM: drain, exit 0, nothing left in /dev/shm.
    server.send_signal(signal.SIGTERM)
    check(server.wait(60) == 0, f"exit status {server.returncode}")
    for d in ("/dev/shm", "/dev/hugepages"):
        left = [f for f in os.listdir(d) if INSTANCE in f] if os.path.isdir(d) else []
        check(not left, f"left in {d}: {left}")
    print("SIGTERM: clean exit, no segments left: ok")


if __name__ == "__main__":
    main()
