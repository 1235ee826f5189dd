#!/usr/bin/env python3
"""Streams come back whole after the front dies or the client drops, at any point:

- kill-and-resume, RUNS times in a row (DUET_RESUME_RUNS, default 20; 6 under the
  sanitizers): a stream of 80 tokens (greedy, or sampled with a seed), the front
  SIGKILLed after k events (k varied from the first event to past the stream's end),
  the client closing its connection just before the kill in every other run (the
  race that cut streams short and called them "stop": the old front cancelled the
  request on the closed connection before it died), the stream resumed with
  Last-Event-ID once /health answers: its text (a chat's tool calls too), finish
  reason and [DONE] equal an undisturbed run's; the launcher restarted the front exactly once per kill;
- a client that drops with the front alive resumes within --resume-grace and gets
  the rest exactly; so does one whose stream ended while it read nothing (its last
  events written, or the front killed as it wrote them);
- a client that drops and never comes back: its request is cancelled once the grace
  has passed and its KV blocks and slot are freed (the time measured);
- a resume of an unknown or expired request is 404 and names the grace;
- a request without a stream whose client closed its connection is cancelled then,
  not computed to its end.

Usage: front_resume_test.py path/to/duet"""
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

from duet_e2e import START_TIMEOUT, check, listening_port, stop, time_scale

DUET = sys.argv[1]
SUBSET = os.environ.get("DUET_E2E_SUBSET") == "1"
RUNS = int(os.environ.get("DUET_RESUME_RUNS", "6" if SUBSET else "20"))
GRACE_S = 2
MAX_TOKENS = 80

serve = subprocess.Popen([DUET, "serve", "--port", "0", "--ctx", "2048", "--slots", "8", "--resume-grace", str(GRACE_S),
                          *START_TIMEOUT], stderr=subprocess.PIPE, text=True)
port = listening_port(serve)
log = []
if port is None:
    print(f"FAIL: the server exited before listening ({serve.wait()})", file=sys.stderr)
    sys.exit(1)
threading.Thread(target=lambda: [log.append(l) for l in serve.stderr], daemon=True).start()

BODIES = [
    {"prompt": "Count from one to one hundred: one, two, three,", "max_tokens": MAX_TOKENS, "temperature": 0},
    {"prompt": "Once upon a time, in a land far away,", "max_tokens": MAX_TOKENS, "temperature": 0.8, "seed": 7},
    # Ends early by a stop string (finish "stop" from the text, not the token).
    {"prompt": "Count from one to one hundred: one, two, three,", "max_tokens": MAX_TOKENS, "temperature": 0,
     "stop": [" nine"]},
    # Chat with tool calls: the deltas' calls (names and arguments; ids are the
    # request's own) continue where the kill cut them.
    {"messages": [{"role": "user", "content": "The weather in Oslo and in Rome?"}], "max_tokens": MAX_TOKENS,
     "temperature": 0.8, "seed": 3, "tool_choice": "required", "tools": [
         {"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]},
]


def front_pid():
    out = subprocess.run(["pgrep", "-a", "-P", str(serve.pid)], capture_output=True, text=True).stdout
    for line in out.splitlines():
        pid, cmd = line.split(" ", 1)
        if cmd.split()[1] == "front":
            return int(pid)
    return None


def read_events(resp, stop_after=None):
    """What a stream gave: its response id, text, finish reason, last event id, events,
    and whether it ended with [DONE]; stops reading after `stop_after` events."""
    st = {"id": None, "text": "", "calls": {}, "fin": None, "ev": None, "n": 0, "done": False}
    for raw in resp:
        line = raw.decode().rstrip("\n")
        if line.startswith("id: "):
            st["ev"] = line[4:]
        elif line.startswith("data: "):
            data = line[6:]
            if data == "[DONE]":
                st["done"] = True
                return st
            j = json.loads(data)
            check("error" not in j, f"an error event: {data}")
            st["id"] = j["id"]
            for ch in j.get("choices", []):
                st["text"] += ch.get("text") or ""
                delta = ch.get("delta") or {}
                st["text"] += delta.get("content") or ""
                for call in delta.get("tool_calls") or []:  # name once, then arguments, per call
                    c = st["calls"].setdefault(call["index"], ["", ""])
                    if "id" in call:
                        c[0] += call["function"]["name"]
                    c[1] += call["function"].get("arguments") or ""
                st["fin"] = ch.get("finish_reason") or st["fin"]
            st["n"] += 1
            if stop_after is not None and st["n"] >= stop_after:
                return st
    return st


def outcome(*parts):
    """The text, the calls (each name and arguments, the parts' deltas joined) and the
    finish reason of a stream read in parts."""
    calls = {}
    for st in parts:
        for i, (name, args) in st["calls"].items():
            c = calls.setdefault(i, ["", ""])
            c[0] += name
            c[1] += args
    return "".join(st["text"] for st in parts), [tuple(calls[i]) for i in sorted(calls)], \
        next((st["fin"] for st in reversed(parts) if st["fin"]), None)


def start_stream(body):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    c.request("POST", "/v1/chat/completions" if "messages" in body else "/v1/completions",
              json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
    r = c.getresponse()
    check(r.status == 200, f"a stream: {r.status}")
    return c, r


def resume(rid, last):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    c.request("GET", f"/v1/requests/{rid}/events", headers={"Last-Event-ID": last})
    return c.getresponse()


def resume_rest(st, ref, what):
    """Resumes a cut stream from its last event id: answered 200, the rest ends with
    [DONE], and the whole (text, calls, finish reason) equals `ref`."""
    rr = resume(st["id"], st["ev"])
    if rr.status != 200:
        check(False, f"{what}: resume answered {rr.status} {rr.read()[:300]}")
    more = read_events(rr)
    check(more["done"] and outcome(st, more) == ref, f"{what}: resumed {outcome(st, more)!r} != {ref!r}")


def healthy():
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        c.request("GET", "/health")
        return c.getresponse().status == 200
    except OSError:
        return False


def metrics():
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("GET", "/metrics")
    return c.getresponse().read().decode()


def metric(text, name):
    m = re.search(rf"^{re.escape(name)} (\d+)$", text, re.M)
    check(m, f"/metrics has no {name}")
    return int(m.group(1))


try:
    refs = []
    for b in BODIES:
        c, r = start_stream(b)
        st = read_events(r)
        check(st["done"] and (st["text"] or st["calls"]), f"reference {b}: {st}")
        refs.append(outcome(st))
    check(refs[2][2] == "stop" and len(refs[2][0]) < len(refs[0][0]), f"the stop string ends it: {refs[2]}")
    check(refs[3][1] and refs[3][1][0][0] == "get_weather" and refs[3][1][0][1].startswith("{")
          and refs[3][2] in ("tool_calls", "length"), f"the tool-call stream: {refs[3]}")
    kills = 0
    last_kill = 0.0
    for run in range(RUNS):
        b = run % len(BODIES)
        k = 1 + (run * 7) % 40  # events before the kill: from the first to past the end
        close_first = run % 2 == 1
        # The launcher gives up on a role that dies 5 times within 10 s: 4 gaps of 2.6 s.
        time.sleep(max(0.0, last_kill + 2.6 - time.monotonic()))
        c, r = start_stream(BODIES[b])
        st = read_events(r, stop_after=k)
        pid = front_pid()
        check(pid, "the front runs")
        if close_first:
            c.close()
        os.kill(pid, signal.SIGKILL)
        kills += 1
        last_kill = time.monotonic()
        c.close()
        t0 = time.monotonic()
        while not healthy():
            check(time.monotonic() - t0 < 60 * time_scale(), f"run {run}: no front 60 s after the kill")
            time.sleep(0.05)
        if st["done"]:  # the whole stream arrived before the kill
            check(outcome(st) == refs[b], f"run {run}: an undisturbed stream differs: {st} {refs[b]}")
            continue
        rr = resume(st["id"], st["ev"])
        if rr.status != 200:
            check(False, f"run {run} (k={k}, client gone first: {close_first}): resume answered {rr.status} "
                         f"{rr.read()[:300]}")
        more = read_events(rr)
        check(more["done"], f"run {run}: the resumed stream ends with [DONE]: cut at {st}, then {more}")
        got = outcome(st, more)
        check(got == refs[b], f"run {run} (body {b}, k={k}, client gone first: {close_first}, cut at event "
                              f"{st['ev']}): resumed {got!r} != undisturbed {refs[b]!r}")
    print(f"{RUNS} kill-and-resume runs in a row (kills after 1-40 events, half with the client gone first): "
          f"every stream identical to its undisturbed run, text and finish reason: ok")
    m = metrics()
    check(metric(m, "duet_worker_restarts_total") == kills,
          f"restarts {metric(m, 'duet_worker_restarts_total')} for {kills} kills")
    print(f"the launcher restarted the front once per kill ({kills}) and nothing else: ok")

    # The client drops, the front lives: it comes back within the grace.
    c, r = start_stream(BODIES[1])
    st = read_events(r, stop_after=5)
    c.close()
    time.sleep(0.5)
    resume_rest(st, refs[1], "a resume after the client dropped")
    print("a client that dropped its connection (front alive) resumes within the grace, identical: ok")

    # The stream ends while its client reads nothing (its end written into the
    # connection, or about to be), then the client drops it unread; the second time the
    # front dies too, at once. The request's slots are kept for the grace after it
    # ended, so either way the rest comes back: before, the front freed them as the
    # stream ended and the resume answered 404.
    for kill_front in (False, True):
        c, r = start_stream(BODIES[0])
        st = read_events(r, stop_after=3)
        t0 = time.monotonic()
        while metric(metrics(), "duet_requests_in_flight") != 0:
            check(time.monotonic() - t0 < 30 * time_scale(), "the stream did not end within 30 s")
            time.sleep(0.05)
        if not kill_front:
            time.sleep(0.3)  # its last events written
        c.close()
        if kill_front:
            os.kill(front_pid(), signal.SIGKILL)
            kills += 1
            t0 = time.monotonic()
            while not healthy():
                check(time.monotonic() - t0 < 60 * time_scale(), "no front 60 s after the kill")
                time.sleep(0.05)
        resume_rest(st, refs[0], f"a resume of an ended stream (front killed: {kill_front})")
    check(metric(metrics(), "duet_worker_restarts_total") == kills, "a restart other than the front's kills")
    # Kept slots give way: more short streams in a row than the server has slots
    # (--slots 8), each kept for the grace after it ended, are all answered.
    for i in range(12):
        c, r = start_stream({"prompt": f"Say {i}:", "max_tokens": 2, "temperature": 0})
        check(read_events(r)["done"], f"short stream {i} of 12 did not end")
        c.close()
    print("a stream that ended while its client read nothing resumes after the client drops it, the front alive "
          "and the front killed, identical; 12 streams in a row on 8 slots kept for resumes: ok")

    # The client drops and never comes back: cancelled once the grace has passed, its
    # KV blocks and slot freed. A long stream, so that it still runs then.
    m0 = metrics()
    held0 = int(re.search(r'^duet_kv_blocks\{state="held"\} (\d+)$', m0, re.M).group(1))
    cancelled0 = metric(m0, "duet_requests_cancelled_total")
    c, r = start_stream({"prompt": "Once upon a time", "max_tokens": 1900, "ignore_eos": True, "temperature": 0})
    st = read_events(r, stop_after=3)
    c.close()
    t_drop = time.monotonic()
    freed = None
    while time.monotonic() - t_drop < 30 * time_scale():
        m = metrics()
        held = int(re.search(r'^duet_kv_blocks\{state="held"\} (\d+)$', m, re.M).group(1))
        if metric(m, "duet_requests_cancelled_total") > cancelled0 and held <= held0 \
                and metric(m, "duet_requests_in_flight") == 0:
            freed = time.monotonic() - t_drop
            break
        time.sleep(0.1)
    check(freed is not None, "the dropped stream was not cancelled and freed within 30 s")
    check(freed >= GRACE_S * 0.9, f"cancelled {freed:.2f} s after the drop, before the grace ({GRACE_S} s)")
    print(f"a client gone for good: its request cancelled and its KV freed {freed:.2f} s after the drop "
          f"(--resume-grace {GRACE_S}): ok")
    rr = resume(st["id"], st["ev"])
    body = rr.read().decode()
    check(rr.status == 404 and "disconnected" in body, f"a resume past the grace: {rr.status} {body[:300]}")
    print("a resume past the grace: 404, saying what is resumable: ok")

    # A request that does not stream, its client gone: cancelled when the connection
    # closes, not computed to its end (1900 tokens) for nobody. The front writes
    # nothing to it before the end, so only a watch on the connection sees it go.
    m0 = metrics()
    cancelled0, tokens0 = metric(m0, "duet_requests_cancelled_total"), metric(m0, "duet_generated_tokens_total")
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    c.request("POST", "/v1/completions", json.dumps({"prompt": "Once upon a time", "max_tokens": 1900,
                                                     "ignore_eos": True, "temperature": 0}),
              {"Content-Type": "application/json"})
    time.sleep(0.5)
    c.close()
    t_drop = time.monotonic()
    gone = None
    while time.monotonic() - t_drop < 60 * time_scale():
        m = metrics()
        if metric(m, "duet_requests_cancelled_total") > cancelled0 and metric(m, "duet_requests_in_flight") == 0:
            gone = time.monotonic() - t_drop
            break
        time.sleep(0.1)
    tokens = metric(metrics(), "duet_generated_tokens_total") - tokens0
    check(gone is not None and tokens < 1900,
          f"a request without a stream, its client gone: cancelled {gone is not None}, {tokens} tokens computed")
    print(f"a request without a stream whose client left: cancelled {gone:.2f} s after, at {tokens} of 1900 "
          f"tokens: ok")
except SystemExit:
    print("".join(log[-40:]), file=sys.stderr)
    raise
finally:
    stop(serve)
