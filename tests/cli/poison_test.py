#!/usr/bin/env python3
"""A request its workers keep dying on fails alone (issue 35: "quarantine a request
only when deaths follow it"), driven from outside as a crash would be:

- `duet serve` with the scalar kernels and no prefix cache, so that prefill holds a
  long prompt for seconds each time it takes it; the prefill worker is SIGKILLed
  whenever it holds that request (/metrics says it holds one, /proc gives its pid),
  three times in a row, before it made a token;
- the client gets a 500 that says why (its worker died 3 times in a row without
  progress), the launcher's log says the request was failed, not re-driven;
- a stream that was in decode meanwhile (never held by a dead worker) ends as an
  undisturbed run of it, and the next request is served: nothing else failed, and
  /metrics counts exactly one restart a kill.

A kill that came after the worker handed the request on (the launcher's log says
it re-drove nothing) is not a death with it: the request is then answered, and the
test tries a fresh one, three times at most.

Usage: poison_test.py path/to/duet
"""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

from duet_e2e import check, check_restarts, child_pids, drain, listening_port_and_instance, stop, time_scale

DUET = sys.argv[1]
SCALE = time_scale()
# No prefix cache: each pass publishes the prompt's full blocks, and a worker that takes
# the request again after a death would find all but the last few tokens there, hold it
# for a short pass, and be done between two looks of the loop below (seen under load at
# the third death). Without it every take computes the whole prompt again: seconds.
proc = subprocess.Popen([DUET, "serve", "--port", "0", "--ctx", "1024", "--slots", "8", "--isa", "scalar",
                         "--grace", "5", "--no-prefix-cache"], stderr=subprocess.PIPE, text=True, start_new_session=True)
port, instance = listening_port_and_instance(proc)
log = drain(proc, keep=400)


def post(body, timeout=600):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout * SCALE) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


last_status = ["(none yet)"]


def prefill_pid():
    """The live prefill worker's pid (duet_e2e.child_pids), or None."""
    pids = child_pids(proc.pid, "prefill")
    return pids[0] if pids else None


def prefill_holding():
    """The running prefill worker's pid while it holds work, else None. Looked up
    without starting a process (/metrics' duet_worker_requests, and /proc): a
    `duet shm status` a look waited seconds to be scheduled on a loaded machine
    (CI, 2026-12-07: the request was prefilled and answered between two looks).

    The pid is read before /metrics and again after, and must be the same: /metrics
    may still show the worker just killed (its registry slot, holding the request,
    until the launcher recovers it), and a pid read after it may be its successor,
    still starting and holding nothing; killing that one is not a death with the
    request (seen under load: the request was then answered). The launcher
    recovers a dead worker before it starts the next, so a pid seen before /metrics
    and alive after it is the process /metrics described."""
    before = prefill_pid()
    if before is None:
        last_status[0] = "no prefill process"
        return None
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
            text = r.read().decode()
    except OSError as e:
        last_status[0] = f"/metrics: {e}"
        return None
    m = re.search(r'^duet_worker_requests\{role="prefill",worker="0"\} (\d+)$', text, re.M)
    pid = prefill_pid()
    last_status[0] = f"prefill requests {m.group(1) if m else '(not up)'}, pid {before} then {pid}"
    return pid if m and int(m.group(1)) > 0 and pid == before else None


def died_with_requests(pid):
    """The running requests the launcher found with prefill `pid` when it died (re-driven
    or failed), from its log line (which drain's thread may read late)."""
    pat = re.compile(rf"prefill \(pid {pid}\) died .*re-drove (\d+) requests(, failed (\d+))?")
    end = time.monotonic() + 30 * SCALE
    while time.monotonic() < end:
        for line in list(log):
            m = pat.search(line)
            if m:
                return int(m.group(1)) + int(m.group(3) or 0)
        time.sleep(0.05)
    check(False, f"the launcher never said that prefill pid {pid} died; the log's end:\n" + "".join(list(log)[-20:]))


try:
    bystander_body = {"prompt": "The old lighthouse keeper said", "max_tokens": 48, "temperature": 0}
    st, ref = post(bystander_body)
    check(st == 200, f"the bystander's undisturbed run: {st} {ref}")
    # A prompt of ~380 tokens: seconds of scalar prefill, each time it is taken (with
    # ~190, under load, a look and its kill often came after the hand-off).
    poison_body = {"prompt": " ".join(f"entry {i} of the ledger," for i in range(50)), "max_tokens": 4,
                   "temperature": 0}
    got, in_decode = {}, threading.Event()

    def stream_bystander():
        # Streamed: its first token comes from prefill, every later one from decode,
        # so once the second is here prefill holds nothing of it, and only the poison
        # request is there to be killed on. (The first alone is not enough: under
        # ASan the hand-off can outlast it, and a death then is the bystander's too.)
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                     data=json.dumps(dict(bystander_body, stream=True)).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        text, chunks = "", 0
        with urllib.request.urlopen(req, timeout=600 * SCALE) as r:
            for line in r:
                line = line.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "choices" not in event:  # an error event ends the stream
                    got["by"] = (r.status, event)
                    in_decode.set()
                    return
                text += event["choices"][0].get("text") or ""
                chunks += 1
                if chunks >= 2:
                    in_decode.set()
        got["by"] = (r.status, {"choices": [{"text": text}]})
    bystander = threading.Thread(target=stream_bystander)
    bystander.start()
    # Its second token arrived and no error ended its stream. (It may even have
    # finished already, when this thread ran late: got["by"] then holds its text,
    # which the end of the test compares.)
    check(in_decode.wait(120 * SCALE) and ("by" not in got or "choices" in got["by"][1]),
          f"the bystander's second token: {got.get('by')}")
    # A look and its kill are not one act: the worker may hand the request to decode
    # between them (under load the look itself takes long), and then the kill is
    # not a death with it, its output grows and it is answered. The launcher's line
    # for each death says whether the dead worker held it; after such a miss the
    # request runs to its end and a fresh one is tried, up to three times.
    killed, deaths = [], 0
    for attempt in range(3):
        got.pop("poison", None)
        poison = threading.Thread(target=lambda: got.update(poison=post(poison_body)))
        poison.start()
        deaths = 0
        while deaths < 3:
            end = time.monotonic() + 120 * SCALE
            pid = None
            while time.monotonic() < end and (pid is None or pid in killed) and poison.is_alive():
                pid = prefill_holding()
                time.sleep(0.05)
            if not poison.is_alive():
                break  # answered before a worker was seen holding it again: a look missed it
            # Said whole where it fails: what the workers last showed, the log's end.
            check(pid is not None and pid not in killed,
                  f"death {deaths + 1}: no prefill worker took the request again in 120 s; last status: "
                  f"{last_status[0]}; the log's end:\n" + "".join(list(log)[-20:]))
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
            if died_with_requests(pid) == 0:
                break  # it had handed the request on
            deaths += 1
        poison.join(300 * SCALE)
        if deaths == 3:
            break
        print(f"attempt {attempt + 1}: a look or a kill missed the request after {deaths} deaths with it; "
              "a fresh request again", flush=True)
    check(deaths == 3, f"three attempts, none with three deaths in a row with the request (pids killed: {killed})")
    bystander.join(300 * SCALE)
    st, body = got.get("poison", (None, None))
    check(st == 500 and "died 3 times in a row" in body["error"]["message"],
          f"the poison request after 3 deaths: {st} {body}")
    # The launcher logs the failure before the front can answer it, but the log is
    # read by drain's thread, which a loaded machine may not have run yet: wait for it.
    named = time.monotonic() + 30 * SCALE
    while not any("failed, not re-driven" in l for l in list(log)) and time.monotonic() < named:
        time.sleep(0.05)
    check(any("failed, not re-driven" in l for l in list(log)), "the launcher's log names the failed request:\n"
          + "".join(list(log)[-10:]))
    st, by = got.get("by", (None, None))
    check(st == 200 and "choices" in by and by["choices"][0]["text"] == ref["choices"][0]["text"],
          f"the bystander stream: {st} {by} vs {ref}")
    st, after = post({"prompt": "Hello", "max_tokens": 4, "temperature": 0})
    check(st == 200, f"a request after the quarantine: {st} {after}")
    check_restarts(port, len(killed))
    print(f"poison request: prefill (pids {killed}) SIGKILLed each time it held it, failed alone at the third death "
          f"with a 500 naming why; the bystander identical, the next request served, {len(killed)} restarts: ok")
finally:
    stop(proc, grace=30, instance=instance if "instance" in dir() else None)
