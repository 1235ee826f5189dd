#!/usr/bin/env python3
"""SIGKILL of the `duet serve` launcher under load (what the OOM killer does): every
role it started dies with it at once (the front does not drain holding the port),
the clients' streams end instead of hanging, and the next start reclaims the
instance's segments that no live process holds and serves on the same port.

Usage: launcher_kill_test.py path/to/duet
"""
import glob
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

from duet_e2e import check

DUET = sys.argv[1]


def start(port):
    p = subprocess.Popen([DUET, "serve", "--port", str(port), "--ctx", "512", "--slots", "8", "--grace", "30"],
                         stderr=subprocess.PIPE, text=True)
    lines = []
    for line in p.stderr:
        lines.append(line)
        if m := re.search(r"listening on http://127\.0\.0\.1:(\d+)", line):
            threading.Thread(target=lambda: [lines.append(l) for l in p.stderr], daemon=True).start()
            return p, lines, int(m.group(1))
    check(False, "the server exited before listening:\n" + "".join(lines))


def children(pid):
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def port_open(port):
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


# Port 0: the server picks a free one and says which (no check-then-bind race); the
# second start takes the same one again.
first, _, port = start(0)
roles = children(first.pid)
check(len(roles) >= 3, f"front, prefill and decode under the launcher: {roles}")
# Default instance names carry the test's shm scope (ctest sets DUET_SHM_SCOPE).
scope = os.environ.get("DUET_SHM_SCOPE", "")
segments = glob.glob(f"/dev/shm/duet.{scope + '.' if scope else ''}serve-{first.pid}*")
check(segments, "the instance's segments in /dev/shm")

# Load: 4 long streams, each past its first token when the launcher dies.
body = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "stream": True}
ended = [None] * 4
started = threading.Barrier(5)


def client(i):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    signalled = False
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            for line in r:
                if not signalled and line.startswith(b"data: "):
                    signalled = True
                    started.wait(120)
                if line.strip() == b"data: [DONE]":
                    ended[i] = "done"
                    return
        ended[i] = "closed" if signalled else "never started"
    except Exception as e:  # reset or cut: what a client of a dead server sees
        ended[i] = f"error {type(e).__name__}" if signalled else f"never started ({type(e).__name__})"
    finally:
        if not signalled:
            started.wait(120)


threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
for t in threads:
    t.start()
started.wait(120)
first.send_signal(signal.SIGKILL)
first.wait()
t0 = time.time()
while time.time() - t0 < 5 and (any(alive(p) for p in roles) or port_open(port)):
    time.sleep(0.05)
gone = time.time() - t0
check(not any(alive(p) for p in roles), f"roles alive 5 s after the launcher's SIGKILL: "
      f"{[p for p in roles if alive(p)]}")
check(not port_open(port), "the port still accepts 5 s after the launcher's SIGKILL")
for t in threads:
    t.join(30)
check(all(e and e != "done" and not e.startswith("never started") for e in ended),
      f"the streams, each past its first event, end cut: {ended}")
check(all(os.path.exists(s) for s in segments), "the dead instance's segments are left (stale)")
print(f"launcher SIGKILL: {len(roles)} roles and the port gone in {gone:.2f} s, streams cut ({ended[0]}): ok")

second, log, _ = start(port)
try:
    check(not any(os.path.exists(s) for s in segments), f"stale segments reclaimed: {segments}")
    check(any("stale shared-memory segment" in l for l in log), "the start says it removed stale segments")
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", method="POST",
                                 data=json.dumps({"prompt": "The capital of France is", "max_tokens": 4,
                                                  "temperature": 0}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        check(r.status == 200 and json.loads(r.read())["choices"], "the restarted server serves")
    print("a new start reclaims the stale segments and serves on the same port: ok")
finally:
    second.send_signal(signal.SIGTERM)
    try:
        check(second.wait(60) == 0, "the second serve exits cleanly")
    except subprocess.TimeoutExpired:
        second.kill()
        check(False, "the second serve did not stop")
