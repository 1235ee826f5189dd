#!/usr/bin/env python3
"""`duet serve --trace FILE` (src/base/trace.h) as a user of Perfetto would take it:

- while requests run and decode is SIGKILLed once (its replacement opens the file
  again), every role writes its ranges into the one file; after SIGTERM it is a JSON
  array that parses strictly (Python's json, not duet's reader);
- each process is named (front, prefill 0, decode 0 twice: two pids), decode steps
  and prefill passes are there, and every decode phase (plan, forward, emit) lies
  inside a decode step of its own thread;
- `duet trace summary --json` gives, for decode steps and prefill passes, the count
  and total this script computes from the events itself; and it reads a file whose
  writer was killed (no closing bracket, a trailing comma).

Usage: trace_test.py path/to/duet
"""
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from duet_e2e import START_TIMEOUT, check, drain, listening_port_and_instance, stop, time_scale

DUET = sys.argv[1]
SCALE = time_scale()
tmp = tempfile.mkdtemp(prefix="duet-trace-")
path = os.path.join(tmp, "serve.json")
proc = subprocess.Popen([DUET, "serve", "--port", "0", "--ctx", "1024", "--trace", path, *START_TIMEOUT],
                        stderr=subprocess.PIPE, text=True, start_new_session=True)
port, instance = listening_port_and_instance(proc)
drain(proc)


def post(body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300 * SCALE) as r:
        return json.loads(r.read())


def decode_pid():
    out = subprocess.run([DUET, "shm", "status", instance, "--json"], capture_output=True, text=True)
    for p in json.loads(out.stdout)["processes"] if out.returncode == 0 else []:
        if p["role"] == "decode" and p["state"] == "running":
            return p["pid"]
    return None


try:
    post({"prompt": "The first request", "max_tokens": 16, "temperature": 0})
    # Decode killed while a long request runs: re-driven to its replacement.
    long = threading.Thread(target=lambda: post({"prompt": "Once upon a time", "max_tokens": 200,
                                                  "temperature": 0, "ignore_eos": True}))
    long.start()
    time.sleep(0.5 * SCALE)
    first = decode_pid()
    check(first is not None, "no running decode worker")
    os.kill(first, signal.SIGKILL)
    long.join(300 * SCALE)
    end = time.monotonic() + 60 * SCALE
    while time.monotonic() < end and decode_pid() in (None, first):
        time.sleep(0.1)
    post({"prompt": "After the restart", "max_tokens": 16, "temperature": 0})
finally:
    stop(proc, grace=60, instance=instance if "instance" in dir() else None)

text = open(path).read()
try:
    events = json.loads(text)  # strict: the file is closed
    torn = []
except ValueError as e:
    # Only a process killed inside a write may tear a line (base/trace.h): decode,
    # its last one. Everything else must parse, line by line.
    events, torn = [], []
    for line in text.splitlines():
        line = line.rstrip(",")
        if line in ("[", "]"):
            continue
        try:
            events.append(json.loads(line))
        except ValueError:
            torn.append(line)
    check(len(torn) <= 1, f"the trace file does not parse after a clean stop ({e}): torn lines {torn[:3]}")
check(isinstance(events, list) and events, "the trace is a JSON array of events")
names = {}
for e in events:
    if e.get("ph") == "M" and e.get("name") == "process_name":
        names.setdefault(e["args"]["name"], set()).add(e["pid"])
check({"front", "prefill 0", "decode 0"} <= set(names), f"process names: {names}")
check(len(names["decode 0"]) == 2 and first in names["decode 0"],
      f"decode 0's pids: {names['decode 0']} (killed {first}: it and its replacement)")
complete = [e for e in events if e.get("ph") == "X"]
for e in complete:
    check(isinstance(e["ts"], (int, float)) and e["dur"] >= 0 and e["pid"] > 0 and e["tid"] > 0, f"an event: {e}")
by = lambda pids, name: [e for e in complete if e["pid"] in pids and e["name"] == name]  # noqa: E731
steps = by(names["decode 0"], "decode step")
passes = by(names["prefill 0"], "prefill pass")
check(len(steps) >= 20, f"{len(steps)} decode steps")
check(len(passes) >= 3, f"{len(passes)} prefill passes")
check(all(len(by(names["decode 0"] & {pid}, "decode step")) > 0 for pid in names["decode 0"]),
      "decode steps from both decode processes")
for phase in ("decode plan", "decode forward", "decode emit"):
    found = by(names["decode 0"], phase)
    check(len(found) >= len(steps) - 2, f"{len(found)} {phase} ranges for {len(steps)} steps")
    # The killed process's last step never ended: its phases stand alone.
    last_end = max(s["ts"] + s["dur"] for s in steps if s["pid"] == first)
    for e in found:
        if e["pid"] == first and e["ts"] >= last_end:
            continue
        inside = any(s["pid"] == e["pid"] and s["tid"] == e["tid"] and s["ts"] <= e["ts"]
                     and e["ts"] + e["dur"] <= s["ts"] + s["dur"] + 0.001 for s in steps)
        check(inside, f"{phase} at {e['ts']} is inside no decode step of its thread")

# The summary against this script's own count and total.
out = subprocess.run([DUET, "trace", "summary", path, "--json"], capture_output=True, text=True)
check(out.returncode == 0, f"duet trace summary: {out.returncode} {out.stderr}")
rows = {(r["process"], r["name"]): r for r in json.loads(out.stdout)}
for (process, name), mine in ((("decode 0", "decode step"), steps), (("prefill 0", "prefill pass"), passes)):
    r = rows.get((process, name))
    total = sum(e["dur"] for e in mine) / 1000
    check(r and r["count"] == len(mine) and abs(r["total_ms"] - total) <= 1e-6 * max(1.0, total),
          f"summary of {process} / {name}: {r} against {len(mine)} events, {total:.3f} ms")
# A file whose writers were killed: no "trace end", no closing bracket, and a line
# torn by a write cut short.
cut = text[:text.rindex('{"name":"trace end"')]
check(cut.endswith(",\n"), f"an unclosed file ends in a comma: {cut[-40:]!r}")
open(path, "w").write(cut + '{"name":"decode step","ph":"X","ts":12')
out = subprocess.run([DUET, "trace", "summary", path], capture_output=True, text=True)
check(out.returncode == 0 and re.search(r"^\| decode 0 \| decode step \| %d \|" % len(steps), out.stdout, re.M)
      and "%d torn line(s) skipped" % (len(torn) + 1) in out.stderr,
      f"the summary of an unclosed file with a torn line:\n{out.stdout}{out.stderr}")
print(f"trace: {len(torn)} torn lines, {len(complete)} ranges from {sum(len(p) for p in names.values())} processes "
      f"({', '.join(sorted(names))}), {len(steps)} decode steps with their phases nested, {len(passes)} prefill "
      "passes; the summary matches; an unclosed file is read: ok")
