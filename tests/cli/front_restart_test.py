#!/usr/bin/env python3
"""SIGKILL of the front under 16 streams loses nothing (ISSUE: deployment, item 1):

- every SSE event carries an `id:`; after the front dies, the launcher starts a new
  one, which adopts the dead front's requests (they kept running in the workers);
- each streaming client reconnects with GET /v1/requests/{id}/events and
  Last-Event-ID and gets the rest: its whole text equals an undisturbed run's, no
  token lost or repeated;
- non-streaming clients in flight at the kill retry with the same X-Request-Id and
  get the same answer as an undisturbed run;
- the workers keep running (same pids); resuming an unknown id is 404, a second
  connection for a request being answered is 409, a bad Last-Event-ID is 400;
- a context's completion (/v1/contexts/{id}/completions) streaming at the kill is
  resumed the same way, and the new front commits it: the context then holds its
  tokens followed by the completion's prompt and output, and continues exactly as a
  fresh computation of those tokens.

Usage: front_restart_test.py path/to/duet
"""
import json
import os
import tempfile
import re
import signal
import subprocess
import sys
import threading
import time
import http.client

from duet_e2e import START_TIMEOUT, check, check_restarts, stop

DUET = sys.argv[1]
N_STREAMS = 8 if os.environ.get("DUET_E2E_SUBSET") else 16
MAX_TOKENS = 96 if os.environ.get("DUET_E2E_SUBSET") else 200  # the sanitizer run: shorter


# --port 0: the server picks a free port and says which (no check-then-bind race); a
# restarted front listens on the same one.
# --admit-slack 0: the burst tests the restart, not admission (on a loaded machine
# A1 may rightly refuse part of it).
contexts_dir = tempfile.TemporaryDirectory(prefix="duet-front-restart-")
# (Under sanitizers a start beside other e2e servers can pass the default 60 s.)
serve = subprocess.Popen([DUET, "serve", "--port", "0", "--ctx", "512", "--slots", "48", "--admit-slack", "0",
                          "--contexts-dir", contexts_dir.name,
                          *START_TIMEOUT],
                         stderr=subprocess.PIPE, text=True)
log = []
for line in serve.stderr:
    log.append(line)
    if m := re.search(r"listening on http://127\.0\.0\.1:(\d+)", line):
        port = int(m.group(1))
        break
else:
    print(f"FAIL: the server exited before listening (exit status {serve.wait()}); it said:\n" + "".join(log[-60:]),
          file=sys.stderr)
    sys.exit(1)
threading.Thread(target=lambda: [log.append(l) for l in serve.stderr], daemon=True).start()


def roles():
    out = subprocess.run(["pgrep", "-a", "-P", str(serve.pid)], capture_output=True, text=True).stdout
    found = {}
    for line in out.splitlines():
        pid, cmd = line.split(" ", 1)
        role = cmd.split()[1]
        found[role] = int(pid)
    return found


# ignore_eos: every stream runs its MAX_TOKENS, so each is still running at the kill
# (a sampled story may end early: on the AVX2 level one did, seed 1000, 2026-12-05).
def body(i, stream):
    return {"prompt": f"Story number {i}: once upon a time, in a land far away,", "max_tokens": MAX_TOKENS,
            "temperature": 0.8, "seed": 1000 + i, "stream": stream, "ignore_eos": True}


CTX = "story"
CTX_BODY = {"prompt": " And then the dragon said:", "max_tokens": MAX_TOKENS, "temperature": 0.8, "seed": 77,
            "ignore_eos": True}


def get(path):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request("GET", path)
    r = c.getresponse()
    return r.status, r.read().decode()


def post(path, payload, headers=None, timeout=300):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.request("POST", path, json.dumps(payload), {"Content-Type": "application/json", **(headers or {})})
    r = c.getresponse()
    return r.status, r.read().decode()


def read_events(resp, on_event):
    """SSE events (id, data) of an open response until [DONE]; raises when cut."""
    ev_id, text = None, ""
    for raw in resp:
        line = raw.decode().rstrip("\n")
        if line.startswith("id: "):
            ev_id = line[4:]
        elif line.startswith("data: "):
            data = line[6:]
            if data == "[DONE]":
                return text, True
            j = json.loads(data)
            check("error" not in j, f"an error event: {data}")
            for ch in j.get("choices", []):
                text += ch.get("text") or ""
            on_event(j["id"], ev_id)
    return text, False


try:
    try:
        # Undisturbed answers, for comparison (the same seeds: the same text).
        refs = [None] * N_STREAMS
        def ref(i):
            st, out = post("/v1/completions", body(i, False))
            check(st == 200, f"reference {i}: {st} {out}")
            refs[i] = json.loads(out)["choices"][0]["text"]
        ts = [threading.Thread(target=ref, args=(i,)) for i in range(N_STREAMS)]
        [t.start() for t in ts]
        [t.join() for t in ts]
        # A durable context, and its completion undisturbed (commit: false leaves it as it is).
        st, out = post("/v1/contexts", {"id": CTX, "prompt": "Once upon a time, a dragon lived in a cave by the sea."})
        check(st == 201, f"create the context: {st} {out}")
        st, out = get(f"/v1/contexts/{CTX}?tokens=true")
        ctx_tokens0 = json.loads(out)["tokens"]
        st, out = post(f"/v1/contexts/{CTX}/completions", {**CTX_BODY, "commit": False})
        check(st == 200, f"the context's completion, undisturbed: {st} {out}")
        ctx_ref = json.loads(out)
        ctx_ref_text = ctx_ref["choices"][0]["text"]
        before = roles()
        check({"front", "prefill", "decode"} <= set(before), f"roles: {before}")

        results = [None] * (N_STREAMS + 1)  # the last: the context's completion
        # The kill comes once both retriers are in flight, every stream has its first
        # event (its id: the front has it) and every stream has 3 (tokens: cut
        # mid-stream), or, sooner, once the stream furthest on has a third of its
        # tokens (counted by the events' ids): the first prompt prefilled runs alone
        # while the others are prefilled, and under a sanitizer on a loaded machine it
        # ended before the last one had 3 events (CI of 2026-12-03). Then the others
        # are cut while queued or prefilled; both kinds resume.
        progress = threading.Condition()
        seen = {"started": 0, "mid": 0, "retriers": 0, "lead": 0}
        cut_at = [0] * (N_STREAMS + 1)  # events each stream had when cut

        def count(key):
            with progress:
                seen[key] += 1
                progress.notify_all()
        cut_seen = [False] * (N_STREAMS + 1)

        def streamer(i):
            path, payload = ("/v1/completions", body(i, True)) if i < N_STREAMS else (
                f"/v1/contexts/{CTX}/completions", {**CTX_BODY, "stream": True, "stream_options": {"include_usage": True}})
            state = {"id": None, "ev": None, "n": 0}
            def on_event(rid, ev_id):
                state["id"], state["ev"] = rid, ev_id
                state["n"] += 1
                if state["n"] == 1:
                    count("started")
                elif state["n"] == 3:
                    count("mid")
                # The lead in tokens (the id: the output tokens the event covers), not
                # events: drafts kept from the reference runs' outputs bring several
                # tokens an event, and the first stream prefilled could end in fewer
                # events than a third of its tokens.
                made = int(ev_id.split(".")[0]) if ev_id else 0
                if made > seen["lead"]:
                    with progress:
                        seen["lead"] = max(seen["lead"], made)
                        progress.notify_all()
            text, done = "", False
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
                c.request("POST", path, json.dumps(payload), {"Content-Type": "application/json"})
                r = c.getresponse()
                check(r.status == 200, f"stream {i}: {r.status}")
                text, done = read_events(r, on_event)
            except Exception:
                pass
            if done:  # it ended before the kill (ignore_eos: only if the kill came late)
                results[i] = (text, state)
                return
            cut_seen[i] = True
            cut_at[i] = state["n"]
            check(state["id"] and state["ev"] is not None, f"stream {i}: events carry ids ({state})")
            deadline = time.time() + 60
            while time.time() < deadline:  # until the new front listens
                try:
                    if i == 0:  # a malformed Last-Event-ID first: 400, and the request stays resumable
                        c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
                        c.request("GET", f"/v1/requests/{state['id']}/events", headers={"Last-Event-ID": "1.x"})
                        r = c.getresponse()
                        if r.status in (502, 503):
                            raise ConnectionError("not up yet")
                        check(r.status == 400 and "Last-Event-ID" in r.read().decode(), f"a bad Last-Event-ID: {r.status}")
                        errors_seen.add(400)
                    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
                    c.request("GET", f"/v1/requests/{state['id']}/events", headers={"Last-Event-ID": state["ev"]})
                    r = c.getresponse()
                    if r.status == 200:
                        if i == 1:  # a second connection for it meanwhile: 409
                            c2 = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                            c2.request("GET", f"/v1/requests/{state['id']}/events")
                            r2 = c2.getresponse()
                            check(r2.status == 409, f"a second resume: {r2.status}")
                            errors_seen.add(409)
                        more, done = read_events(r, on_event)
                        check(done, f"stream {i}: the resumed stream ends with [DONE]")
                        results[i] = (text + more, state)
                        return
                    check(r.status in (502, 503), f"stream {i}: resume answered {r.status} {r.read()[:300]}")
                except (ConnectionError, OSError):
                    pass
                time.sleep(0.1)
            check(False, f"stream {i}: no resume within 60 s")

        retried = [None] * 2
        errors_seen = set()

        def retrier(k):
            i = k  # the same bodies as streams 0 and 1, not streamed
            xid = f"test-xid-{os.getpid()}-{k}"
            counted = False
            try:
                # In flight at the kill: sent before the kill.
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
                c.request("POST", "/v1/completions", json.dumps(body(i, False)),
                          {"Content-Type": "application/json", "X-Request-Id": xid})
                time.sleep(0.3)
                count("retriers")
                counted = True
                r = c.getresponse()
                retried[k] = ("first try", json.loads(r.read())["choices"][0]["text"])
                return
            except Exception:
                if not counted:
                    count("retriers")
            deadline = time.time() + 60
            while time.time() < deadline:
                try:
                    st, out = post("/v1/completions", body(i, False), {"X-Request-Id": xid})
                    if st == 200:
                        retried[k] = ("retried", json.loads(out)["choices"][0]["text"])
                        return
                except (ConnectionError, OSError):
                    pass
                time.sleep(0.1)

        threads = [threading.Thread(target=streamer, args=(i,)) for i in range(N_STREAMS + 1)]
        threads += [threading.Thread(target=retrier, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        with progress:
            check(progress.wait_for(lambda: seen["started"] == N_STREAMS + 1 and seen["retriers"] == 2 and (
                seen["mid"] == N_STREAMS + 1 or seen["lead"] >= MAX_TOKENS // 3), 180), f"the streams did not start: {seen}")
        os.kill(before["front"], signal.SIGKILL)
        for t in threads:
            t.join(240)
        check(all(r is not None for r in results), f"streams without a result: {[i for i, r in enumerate(results) if r is None]}")
        bad = [i for i in range(N_STREAMS) if results[i][0] != refs[i]]
        check(results[N_STREAMS][0] == ctx_ref_text,
              f"the context's completion, resumed, differs from its undisturbed run: {results[N_STREAMS][0]!r} != {ctx_ref_text!r}")
        check(not bad, f"streams {bad} differ from undisturbed runs, e.g. {results[bad[0]][0]!r} != {refs[bad[0]]!r}"
              if bad else "")
        check(sum(cut_seen) == N_STREAMS + 1, f"every stream was cut by the kill: {cut_seen}")
        check(max(cut_at) >= 3, f"a stream was cut mid-stream: events at the cut {cut_at}")
        print(f"SIGKILL of the front under {N_STREAMS} streams (events each had when cut: {cut_at}): every stream "
              f"resumed with Last-Event-ID, texts identical to undisturbed runs: ok")
        for k in range(2):
            check(retried[k] is not None and retried[k][1] == refs[k], f"X-Request-Id retry {k}: {retried[k]} vs {refs[k]!r}")
        check(any(r[0] == "retried" for r in retried), f"a non-streaming request was cut by the kill: {retried}")
        print(f"non-streaming requests in flight, retried with X-Request-Id: {[r[0] for r in retried]}, "
              f"answers identical: ok")
        after = roles()
        check(after["prefill"] == before["prefill"] and after["decode"] == before["decode"]
              and after["front"] != before["front"], f"workers kept (same pids), a new front: {before} -> {after}")
        print("workers kept running (same pids), a new front serves: ok")
        check_restarts(port, 1)

        # The resumed completion of the context was committed by the new front: the
        # context is its tokens, the completion's prompt and its output, and it goes on
        # exactly as one fresh computation of those tokens (greedy, 8 tokens).
        st, out = get(f"/v1/contexts/{CTX}?tokens=true")
        check(st == 200, f"the context after the restart: {st} {out}")
        after_tokens = json.loads(out)["tokens"]
        u = ctx_ref["usage"]
        added = u["prompt_tokens"] - len(ctx_tokens0) + u["completion_tokens"]
        check(after_tokens[:len(ctx_tokens0)] == ctx_tokens0 and len(after_tokens) == len(ctx_tokens0) + added,
              f"the context holds {len(after_tokens)} tokens, {len(ctx_tokens0)} + {added} expected")
        st, out = post(f"/v1/contexts/{CTX}/completions", {"max_tokens": 8, "temperature": 0, "commit": False})
        check(st == 200, f"continue the context: {st} {out}")
        cont = json.loads(out)["choices"][0]["text"]
        st, out = post("/v1/completions", {"prompt": after_tokens, "max_tokens": 8, "temperature": 0})
        check(st == 200, f"the same tokens as a prompt: {st} {out}")
        check(cont == json.loads(out)["choices"][0]["text"],
              f"the committed context continues as its tokens do: {cont!r} != {json.loads(out)['choices'][0]['text']!r}")
        print(f"a context's completion cut by the kill: resumed identical, committed by the new front "
              f"({len(ctx_tokens0)} + {added} tokens), continues exactly: ok")

        # Errors: an unknown id, a bad Last-Event-ID.
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        c.request("GET", "/v1/requests/cmpl-nope/events")
        r = c.getresponse()
        check(r.status == 404 and "request_not_found" in r.read().decode(), f"unknown id: {r.status}")
        st, out = post("/v1/completions", {"prompt": "x", "max_tokens": 1}, {"X-Request-Id": "y" * 201})
        check(st == 400 and "X-Request-Id" in out, f"a long X-Request-Id: {st} {out}")
        check(errors_seen == {400, 409}, f"a bad Last-Event-ID (400) and a second connection (409) seen: {errors_seen}")
        print("unknown request id: 404; a bad Last-Event-ID: 400; a second connection: 409; an X-Request-Id over "
              "200 characters: 400: ok")
    except SystemExit:
        print("".join(log[-40:]), file=sys.stderr)
        raise
finally:
    stop(serve)
