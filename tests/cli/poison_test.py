#!/usr/bin/env python3
"""A request its workers keep dying on fails alone (issue 35: "quarantine a request
only when deaths follow it"), driven from outside as a crash would be:

- `duet serve` with the scalar kernels, so that prefill holds a long prompt for
  seconds; the prefill worker is SIGKILLed whenever it holds that request, three
  times in a row, before it made a token;
- the client gets a 500 that says why (its worker died 3 times in a row without
  progress), the launcher's log says the request was failed, not re-driven;
- a stream that was in decode meanwhile (never held by a dead worker) ends as an
  undisturbed run of it, and the next request is served: nothing else failed, and
  /metrics counts exactly the three restarts.

Usage: poison_test.py path/to/duet
"""
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

from duet_e2e import check, check_restarts, drain, listening_port_and_instance, stop, time_scale

DUET = sys.argv[1]
SCALE = time_scale()
proc = subprocess.Popen([DUET, "serve", "--port", "0", "--ctx", "1024", "--slots", "8", "--isa", "scalar",
                         "--grace", "5"], stderr=subprocess.PIPE, text=True, start_new_session=True)
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


def prefill_holding():
    """The running prefill worker's pid while it holds work, else None."""
    out = subprocess.run([DUET, "shm", "status", instance, "--json"], capture_output=True, text=True)
    if out.returncode != 0:
        return None
    for p in json.loads(out.stdout)["processes"]:
        if p["role"] == "prefill" and p["state"] == "running" and p.get("load_items", 0) > 0:
            return p["pid"]
    return None


try:
    bystander_body = {"prompt": "The old lighthouse keeper said", "max_tokens": 48, "temperature": 0}
    st, ref = post(bystander_body)
    check(st == 200, f"the bystander's undisturbed run: {st} {ref}")
    # A prompt of ~200 tokens: seconds of scalar prefill, each time it is taken.
    poison_body = {"prompt": " ".join(f"entry {i} of the ledger," for i in range(25)), "max_tokens": 4,
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
    poison = threading.Thread(target=lambda: got.update(poison=post(poison_body)))
    poison.start()
    killed = []
    for k in range(3):
        end = time.monotonic() + 120 * SCALE
        pid = None
        while time.monotonic() < end and (pid is None or pid in killed):
            pid = prefill_holding()
            time.sleep(0.05)
        check(pid is not None and pid not in killed, f"death {k + 1}: no prefill worker took the request again")
        subprocess.run(["kill", "-KILL", str(pid)])
        killed.append(pid)
    poison.join(300 * SCALE)
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
    check_restarts(port, 3)
    print(f"poison request: prefill (pids {killed}) SIGKILLed each time it held it, failed alone at the third death "
          "with a 500 naming why; the bystander identical, the next request served, 3 restarts: ok")
finally:
    stop(proc, grace=30, instance=instance if "instance" in dir() else None)
