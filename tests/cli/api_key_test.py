#!/usr/bin/env python3
"""`duet serve --api-key`: every route but /health and /ready answers 401 (OpenAI's
error JSON, WWW-Authenticate: Bearer) without the key or with another; with it, 200.
/metrics asks for it unless --public-metrics. An import is refused before its body
is read. The key reaches the front through its environment, never its arguments
(/proc/<pid>/cmdline of every duet process). The official openai client with the key
works, and without it raises AuthenticationError.

Usage: api_key_test.py path/to/duet   (run with the venv's python of scripts/python-env)
"""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import openai

from duet_e2e import drain

DUET = sys.argv[1]
KEY = "sk-duet-test-Zq8"


def check(cond, msg):
    if not cond:
        print("FAIL:", msg, file=sys.stderr)
        sys.exit(1)


def start(extra, env=None):
    inst = f"duet-apikey-test-{os.getpid()}-{len(extra)}"
    p = subprocess.Popen([DUET, "serve", "--port", "0", "--ctx", "256", "--slots", "4", "--instance", inst, *extra],
                         stderr=subprocess.PIPE, text=True, env=env)
    for line in p.stderr:
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
        if m:
            drain(p)
            return p, int(m.group(1)), inst
    check(False, "the server exited before listening")


def call(port, method, path, key=None, body=None, raw=None):
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = key
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def import_status(port, size):
    """The status a POST of `size` bytes to /v1/contexts/import without a key gets, read
    before the body is sent (Expect: 100-continue): a refusal may close the connection
    while a body is still being written, which a plain client cannot tell from a crash."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(f"POST /v1/contexts/import?id=x HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {size}\r\n"
                  "Content-Type: application/octet-stream\r\nExpect: 100-continue\r\n\r\n".encode())
        f = s.makefile("rb")
        status = int(f.readline().split()[1])
        if status == 100:  # the server wants the body first: send it, then read the answer
            while f.readline().strip():
                pass
            s.sendall(b"\0" * size)
            status = int(f.readline().split()[1])
        return status


def stop(p):
    p.send_signal(signal.SIGTERM)
    check(p.wait(60) == 0, "serve exited cleanly")


p, port, inst = start(["--api-key", KEY])
try:
    body = {"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0}
    for key in (None, "", "Bearer wrong", f"Bearer {KEY}x", KEY, f"Basic {KEY}"):
        st, h, out = call(port, "POST", "/v1/completions", key, body)
        j = json.loads(out)
        check(st == 401 and j["error"]["code"] == "invalid_api_key" and h.get("WWW-Authenticate") == "Bearer",
              f"key {key!r}: {st} {out!r}")
    st, _, out = call(port, "POST", "/v1/completions", f"Bearer {KEY}", body)
    check(st == 200 and json.loads(out)["choices"], f"the right key: {st} {out!r}")
    for path in ("/v1/models", "/metrics", "/v1/contexts"):
        check(call(port, "GET", path)[0] == 401, f"{path} without the key")
    check(call(port, "GET", "/v1/models", f"Bearer {KEY}")[0] == 200, "/v1/models with the key")
    for path in ("/health", "/ready"):
        check(call(port, "GET", path)[0] in (200, 503), f"{path} stays open")
    st = import_status(port, 4 << 20)
    check(st == 401, f"an import without the key: {st}")
    # The key is in no child's arguments (the launcher was given it on its own
    # command line here; DUET_API_KEY is the way to keep it out of that one too).
    children = 0
    for pid in [int(x) for x in os.listdir("/proc") if x.isdigit() and int(x) != p.pid]:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if b"duet" in cmd and inst.encode() in cmd:
            children += 1
            check(KEY.encode() not in cmd, f"the key shows in pid {pid}'s arguments: {cmd!r}")
    check(children >= 3, f"front, prefill and decode found: {children}")
    # The official client.
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
    r = c.chat.completions.create(model="", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    check(r.choices[0].message.content is not None, "the client with the key")
    bad = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="nope", max_retries=0)
    try:
        bad.completions.create(model="", prompt="x", max_tokens=1)
        check(False, "a wrong key was accepted")
    except openai.AuthenticationError as e:
        check(e.status_code == 401, "AuthenticationError")
    print("--api-key: 401 without it, 200 with it, /health and /ready open, not in argv, the client: ok")
finally:
    stop(p)

# From the environment, and /metrics public.
env = dict(os.environ, DUET_API_KEY=KEY)
p, port, _ = start(["--public-metrics"], env)
try:
    check(call(port, "GET", "/metrics")[0] == 200, "--public-metrics")
    check(call(port, "GET", "/v1/models")[0] == 401, "DUET_API_KEY sets the key")
    check(call(port, "GET", "/v1/models", f"Bearer {KEY}")[0] == 200, "DUET_API_KEY's key passes")
    print("DUET_API_KEY and --public-metrics: ok")
finally:
    stop(p)
