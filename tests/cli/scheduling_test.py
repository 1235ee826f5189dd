#!/usr/bin/env python3
"""Scheduling under pressure end to end (src/engine/scheduling.h) on the real model:
bad priorities and timeouts refused; a request past its "timeout" ends with its
partial text, finish_reason "timeout", and its KV blocks back; a burst far past the
prefill queue's watermark answers 429 with Retry-After and retry-after-ms (no 5xx,
no crash, the server's RSS bounded) and the official openai client waits on them
and succeeds; a critical request sent behind queued batch work gets its first token
before most of it; /metrics has the families; in a small KV arena, decode preempts
(swap, or recompute) instead of failing, and every output equals its run alone; with
decode's batch slots all taken by batch streams, a critical request takes one and
ends first, and the batch texts equal their runs alone; with the KV arena over its
watermark, a standard request gets 429 with a Retry-After from the running request's
time left and a critical one passes.

Usage: scheduling_test.py path/to/duet   (with the venv's python: scripts/python-env)
"""
import collections
import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from duet_e2e import check, check_restarts, listening_port, time_scale  # noqa: E402

import openai  # noqa: E402

DUET = sys.argv[1]
INSTANCE = f"duet-sched-test-{os.getpid()}"
QUEUE = 3000  # --admit-queue-tokens
# Under sanitizers (DUET_E2E_SUBSET) every step is slower: a longer timeout still
# leaves the request time for a few tokens.
SLOW = os.environ.get("DUET_E2E_SUBSET") == "1"
TIMEOUT_S = 1.5 if SLOW else 0.4


def post(port, path, body, headers=None, timeout=300):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()


def get(port, path):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=60) as r:
        return r.read().decode()


def metric(port, pattern):
    m = re.search(pattern + r" ([0-9.e+-]+)\n", get(port, "/metrics"))
    return float(m.group(1)) if m else None


@contextlib.contextmanager
def serving(name, *args):
    """A `duet serve --port 0 --ctx 512` with `args`, its port, terminated on leaving."""
    server = subprocess.Popen([DUET, "serve", "--port", "0", "--ctx", "512", "--instance", INSTANCE + name, *args],
                              stderr=subprocess.PIPE, text=True)
    log = collections.deque(maxlen=60)  # the server's last lines, printed if the test fails
    try:
        port = listening_port(server)
        check(port, f"the server{name} did not start")
        threading.Thread(target=lambda: [log.append(l) for l in server.stderr], daemon=True).start()
        yield port, server
        check_restarts(port, 0)  # no test here kills a role
    except BaseException:
        print(f"--- the server{name}'s last lines:\n" + "".join(log), file=sys.stderr)
        raise
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()


def prompt_ids(seed, n):
    return [100 + (seed * 7919 + k * 31) % 30000 for k in range(n)]


def rss_kib(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def front_pid(server_pid):
    out = subprocess.run(["pgrep", "-P", str(server_pid), "-f", "duet front"], capture_output=True, text=True).stdout
    pids = [int(p) for p in out.split()]
    return pids[0] if pids else None


def refusals(port):
    st, _, body = post(port, "/v1/completions", {"prompt": "hi", "priority": "urgent"})
    check(st == 400 and json.loads(body)["error"]["param"] == "priority", f"a bad priority: {st} {body}")
    st, _, body = post(port, "/v1/completions", {"prompt": "hi"}, {"X-Duet-Priority": "soon"})
    check(st == 400 and "X-Duet-Priority" in body, f"a bad X-Duet-Priority: {st} {body}")
    st, _, body = post(port, "/v1/completions", {"prompt": "hi", "timeout": -1})
    check(st == 400 and json.loads(body)["error"]["param"] == "timeout", f"a bad timeout: {st} {body}")
    for p in ("critical", "batch", -3, 0, 7):
        st, _, body = post(port, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "priority": p})
        check(st == 200, f"priority {p!r}: {st} {body}")
    st, _, body = post(port, "/v1/completions", {"prompt": "hi", "max_tokens": 2}, {"X-Duet-Priority": "critical"})
    check(st == 200, f"X-Duet-Priority: critical: {st} {body}")
    print("bad priorities and timeouts: 400 naming the field; every class accepted")


def timeouts(port):
    held_before = metric(port, r'duet_kv_blocks\{state="held"\}')
    body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "temperature": 0, "timeout": TIMEOUT_S}
    t0 = time.time()
    st, _, text = post(port, "/v1/completions", body)
    took = time.time() - t0
    check(st == 200, f"a timed-out request: {st} {text}")
    j = json.loads(text)
    ch = j["choices"][0]
    check(ch["finish_reason"] == "timeout", f"finish_reason {ch['finish_reason']!r}")
    check(0 < j["usage"]["completion_tokens"] < 400 and ch["text"], f"its partial text: {j['usage']} {ch['text']!r}")
    check(took < TIMEOUT_S + 4 * time_scale(), f"it ended {took:.2f} s after it was sent")
    # Streamed: the last chunk says "timeout".
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                 data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    reasons = []
    with urllib.request.urlopen(req, timeout=60) as r:
        for line in r:
            line = line.decode().strip()
            if line.startswith("data: {"):
                reasons.append(json.loads(line[6:])["choices"][0]["finish_reason"])
    check(reasons and reasons[-1] == "timeout", f"the stream's finish reasons {reasons[-3:]}")
    # Its blocks go back at once (the arena's held count returns to where it was).
    deadline = time.time() + 5
    while time.time() < deadline and metric(port, r'duet_kv_blocks\{state="held"\}') != held_before:
        time.sleep(0.05)
    check(metric(port, r'duet_kv_blocks\{state="held"\}') == held_before, "the timed-out request's blocks are free")
    check(metric(port, "duet_requests_timed_out_total") >= 2, "duet_requests_timed_out_total")
    print(f"timeout: partial text ({j['usage']['completion_tokens']} tokens), finish_reason timeout, blocks freed")


def burst(port, server_pid, n=48):
    """n requests of 400 prompt tokens at once: about QUEUE / 400 are admitted, the
    rest get 429 with a computed Retry-After."""
    fp = front_pid(server_pid)
    rss0 = rss_kib(fp) if fp else 0
    results = [None] * n

    def one(i):
        results[i] = post(port, "/v1/completions",
                          {"prompt": prompt_ids(1000 + i, 400), "max_tokens": 2, "priority": "batch"})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    codes = [r[0] for r in results]
    check(all(c in (200, 429) for c in codes), f"only 200 and 429: {sorted(set(codes))}")
    ok, refused = codes.count(200), codes.count(429)
    check(ok >= 1 and refused >= n // 2, f"{ok} admitted, {refused} refused of {n}")
    for st, headers, body in results:
        if st != 429:
            continue
        h = {k.lower(): v for k, v in headers.items()}
        ms = int(h.get("retry-after-ms", "0"))
        secs = int(h.get("retry-after", "0"))
        check(ms >= 1 and secs == max(1, (ms + 999) // 1000), f"Retry-After {secs} s and retry-after-ms {ms}")
        e = json.loads(body)["error"]
        check(e["type"] == "rate_limit_error" and e["code"] in ("queue_full", "slo_unreachable"), f"the 429 {e}")
    rss1 = rss_kib(fp) if fp else 0
    if not SLOW:  # ASan's quarantine holds freed memory: not the front's own growth
        check(rss1 - rss0 < 64 * 1024, f"the front's RSS grew {rss1 - rss0} KiB under the burst")
    check(metric(port, r'duet_requests_rejected_total\{reason="queue"\}') >= 1, "rejections by reason")
    print(f"burst of {n}: {ok} admitted, {refused} refused with Retry-After; front RSS {rss0} -> {rss1} KiB")


def client_waits(port):
    """The official client, max_retries on, sent while a burst fills the queue: it
    gets a 429, waits what retry-after-ms says, and succeeds."""
    for attempt in range(5):
        seen = []  # (status, time, retry-after-ms)

        def hook(r):
            seen.append((r.status_code, time.time(), r.headers.get("retry-after-ms")))

        # The queue falls a whole prompt (400 tokens) at a time, when its prefill
        # ends, while Retry-After assumes a steady drain at the measured rate: the
        # client comes back before the next prompt is done and is refused again
        # (at least 1 s later each time). At ~450 tokens/s that is a retry or two;
        # under ASan (~40 tokens/s, 10 s a prompt) it was 22 in a row on
        # 2026-12-04; 8 were too few for a release run on a loaded 2-core Zen 1 on
        # 2026-12-06.
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=64,
                          http_client=openai.DefaultHttpxClient(event_hooks={"response": [hook]}, timeout=300))
        filler = [threading.Thread(target=post, args=(port, "/v1/completions",
                                                      {"prompt": prompt_ids(5000 + 50 * attempt + i, 400),
                                                       "max_tokens": 2, "priority": "batch"}))
                  for i in range(16)]
        for t in filler:
            t.start()
        deadline = time.time() + 10
        while time.time() < deadline and (metric(port, r'duet_class_queued_prompt_tokens\{class="batch"\}') or 0) < QUEUE:
            time.sleep(0.005)
        r = c.completions.create(model=c.models.list().data[0].id, prompt=prompt_ids(9000 + attempt, 400),
                                 max_tokens=2, extra_body={"priority": "batch"})
        for t in filler:
            t.join()
        check(r.choices[0].text is not None, "the client's completion")
        statuses = [s for s, _, _ in seen if s in (200, 429)]
        if 429 in statuses:
            check(statuses[-1] == 200, f"the client ends with a success: {statuses}")
            i = statuses.index(429)
            t429 = [t for s, t, _ in seen if s in (200, 429)][i]
            wait_ms = int([m for s, _, m in seen if s in (200, 429)][i])
            t_next = [t for s, t, _ in seen if s in (200, 429)][i + 1]
            check(t_next - t429 >= wait_ms / 1000 * 0.9 - 0.05,
                  f"the client retried {1000 * (t_next - t429):.0f} ms after a retry-after-ms of {wait_ms}")
            print(f"openai client: 429 (retry-after-ms {wait_ms}), retried after {1000 * (t_next - t429):.0f} ms, "
                  f"then {statuses[-1]} ({len(statuses)} responses)")
            return
    check(False, "no 429 could be provoked for the client in 5 tries")


def critical_first(port):
    """Batch work queued, then one critical request: earliest deadline first serves it
    before most of the batch work (a batch deadline is 300 s away, a critical one 1 s)."""
    firsts = {}
    t0 = time.time()

    def stream_first(name, body):
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                     data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            r = urllib.request.urlopen(req, timeout=300)
        except urllib.error.HTTPError as e:
            firsts.setdefault(name, f"HTTP {e.code}")
            return
        with r:
            for line in r:  # the first event with a token's text (the stream's head has none)
                if line.startswith(b"data: {"):
                    ch = json.loads(line[6:])["choices"][0]
                    if ch["text"] or ch["finish_reason"]:
                        firsts.setdefault(name, time.time() - t0)

    batch = [threading.Thread(target=stream_first,
                              args=(f"b{i}", {"prompt": prompt_ids(7000 + i, 400), "max_tokens": 2,
                                              "priority": "batch"})) for i in range(6)]
    for t in batch:
        t.start()
    deadline = time.time() + 10
    while time.time() < deadline and (metric(port, r'duet_class_queued_prompt_tokens\{class="batch"\}') or 0) < 1600:
        time.sleep(0.005)
    crit = threading.Thread(target=stream_first, args=("critical", {"prompt": prompt_ids(7100, 400), "max_tokens": 2,
                                                                    "priority": "critical"}))
    crit.start()
    for t in batch + [crit]:
        t.join()
    refused = {k: v for k, v in firsts.items() if isinstance(v, str)}
    check(not refused, f"refused: {refused}")
    later = sum(1 for k, v in firsts.items() if k != "critical" and v > firsts["critical"])
    check(later >= 3, f"the critical request's first token came before only {later} of 6 batch requests': {firsts}")
    print(f"critical behind 6 batch requests: first token before {later} of them")


def critical_stops_a_pass(port):
    """A critical request that arrives while prefill computes a standard prompt stops
    that pass between layers (WorkerOptions::pass_interrupt): the pass counter moves,
    the critical request's first token comes before the standard one's, and both
    texts equal their runs alone (the stopped pass is computed again, exactly)."""
    def served():
        text = get(port, "/metrics")
        return sum(float(v) for v in re.findall(r'^duet_worker_served_total\{role="prefill",[^}]*\} (\S+)$', text, re.M))

    before = metric(port, "duet_prefill_passes_interrupted_total")
    check(before is not None, "/metrics has duet_prefill_passes_interrupted_total")
    std_body = {"prompt": prompt_ids(7200, 480), "max_tokens": 4, "temperature": 0}
    crit_body = {"prompt": prompt_ids(7300, 24), "max_tokens": 4, "temperature": 0, "priority": "critical"}
    got, ends = {}, {}
    t0 = time.time()

    def send(name, body):
        st, _, text = post(port, "/v1/completions", body)
        ends[name] = time.time() - t0
        got[name] = (st, text)

    n0 = served()
    std = threading.Thread(target=send, args=("standard", std_body))
    std.start()
    deadline = time.time() + 60
    while served() == n0 and time.time() < deadline:  # prefill took it: its (first) pass runs now
        time.sleep(0.002)
    crit = threading.Thread(target=send, args=("critical", crit_body))
    crit.start()
    std.join()
    crit.join()
    for name, (st, text) in got.items():
        check(st == 200, f"{name}: {st} {text}")
    after = metric(port, "duet_prefill_passes_interrupted_total")
    check(after >= before + 1, f"the standard prompt's pass was not stopped ({before} -> {after} passes interrupted)")
    check(ends["critical"] < ends["standard"], f"the critical request ended after the standard one: {ends}")
    for name, body in (("standard", std_body), ("critical", crit_body)):
        st, _, text = post(port, "/v1/completions", body)  # alone (its prompt cached now: exact all the same)
        check(st == 200 and json.loads(text)["choices"][0]["text"] == json.loads(got[name][1])["choices"][0]["text"],
              f"{name}: its text after a stopped pass differs from its run alone: {got[name][1]} vs {text}")
    print(f"a critical request stopped a standard prompt's pass ({int(after - before)} stopped), ended first "
          f"({ends['critical']:.2f} s vs {ends['standard']:.2f} s), texts as run alone")


def kv_pressure(swap):
    """A small arena (--kv-blocks 24: 384 tokens) and four requests needing 45 blocks
    together: decode preempts instead of failing, by swap (the default: the KV is
    written out and read back) or, with --swap-root "", by recompute; every output
    equals the same request's output run alone."""
    mode = "swap" if swap else "recompute"
    swap_dir = f"/var/tmp/duet-swap-{INSTANCE}-kv"
    # --admit-kv 0: the four are to overfill the arena (preemption is tested, not A3;
    # on a loaded machine the last one sent could find the others holding it).
    with serving("-kv", "--slots", "8", "--kv-blocks", "24", "--admit-kv", "0",
                 *([] if swap else ["--swap-root", ""])) as (port, server):
        # A request whose KV the whole arena cannot hold is refused at once, naming
        # its prompt (it could never run): 384 prompt tokens fill the 24 blocks; a
        # second token's position is one too many. The boundary cases run.
        st, _, text = post(port, "/v1/completions", {"prompt": prompt_ids(7, 384), "max_tokens": 2})
        err = json.loads(text).get("error", {}) if st != 200 else {}
        check(st == 400 and err.get("param") == "prompt" and err.get("code") == "context_length_exceeded"
              and "takes 385 positions" in err.get("message", "") and "at most 384" in err.get("message", ""),
              f"384 prompt tokens and a second token in a 384-token arena: {st} {text}")
        for n, m in ((384, 1), (383, 2)):
            st, _, text = post(port, "/v1/completions", {"prompt": prompt_ids(7, n), "max_tokens": m})
            check(st == 200, f"{n} prompt tokens, max_tokens {m}, in a 384-token arena: {st} {text}")
        bodies = [{"prompt": prompt_ids(300 + i, 40), "max_tokens": 140, "ignore_eos": True, "temperature": 0.8,
                   "seed": 11 + i, "priority": ["batch", "standard", "critical", "batch"][i]} for i in range(4)]
        alone = []
        for b in bodies:
            st, _, text = post(port, "/v1/completions", b)
            check(st == 200, f"alone: {st} {text}")
            alone.append(json.loads(text)["choices"][0]["text"])
        results = [None] * len(bodies)

        def one(i):
            results[i] = post(port, "/v1/completions", bodies[i])

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
        t0 = time.time()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.time() - t0
        for i, (st, _, text) in enumerate(results):
            check(st == 200, f"request {i} under KV pressure: {st} {text}")
            got = json.loads(text)["choices"][0]["text"]
            check(got == alone[i], f"request {i} under KV pressure differs from its run alone:\n{got!r}\n{alone[i]!r}")
        n = metric(port, f'duet_requests_preempted_total\\{{mode="{mode}"\\}}')
        other = metric(port, f'duet_requests_preempted_total\\{{mode="{"recompute" if swap else "swap"}"\\}}')
        check(n and n >= 1, f"no preemption by {mode} happened ({n}, {other} by the other mode): the arena was not "
                            "small enough")
        if not swap:
            check(other == 0, f"swapping is off, yet {other} swaps")
        else:
            check(metric(port, "duet_swapped_bytes_total") > 0, "swapped bytes are counted")
            left = [f for f in os.listdir(swap_dir) if f.endswith(".kvblob")]
            check(not left, f"every swapped blob was read back and removed: {left} left in {swap_dir}")
        check(metric(port, "duet_requests_failed_total") == 0, "no request failed")
        print(f"KV pressure: {int(n)} preemptions by {mode}, no failure, every output identical to its run alone "
              f"({wall:.2f} s for the four)")
    check(not os.path.exists(swap_dir), f"the launcher removed its swap directory {swap_dir}")


def batch_slots():
    """--max-batch 2: two batch streams take both of decode's slots; a critical request
    takes one of them (that batch stream is preempted, by swap or recompute, and
    resumes), ends before either batch stream, and both batch texts equal their runs
    alone."""
    n_batch = 100 if SLOW else 160
    with serving("-slots", "--slots", "8", "--max-batch", "2", "--admit-slack", "0") as (port, server):
        bodies = [{"prompt": prompt_ids(500 + i, 30), "max_tokens": n_batch, "ignore_eos": True, "temperature": 0.8,
                   "seed": 21 + i, "priority": "batch"} for i in range(2)]
        alone = []
        for b in bodies:
            st, _, text = post(port, "/v1/completions", b)
            check(st == 200, f"alone: {st} {text}")
            alone.append(json.loads(text)["choices"][0]["text"])
        got, ended, tokens = [""] * 2, [None] * 2, [0] * 2

        def stream(i):
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                         data=json.dumps({**bodies[i], "stream": True}).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=600) as r:
                for line in r:
                    if line.startswith(b"data: {"):
                        ch = json.loads(line[6:])["choices"][0]
                        got[i] += ch["text"] or ""
                        tokens[i] += 1
            ended[i] = time.time()

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        deadline = time.time() + 120
        while time.time() < deadline and min(tokens) < 4:
            time.sleep(0.01)
        check(min(tokens) >= 4, f"the batch streams did not start: {tokens}")
        st, _, text = post(port, "/v1/completions", {"prompt": prompt_ids(600, 20), "max_tokens": 8,
                                                     "ignore_eos": True, "temperature": 0, "priority": "critical"})
        crit_end = time.time()
        check(st == 200, f"the critical request: {st} {text}")
        for t in threads:
            t.join()
        check(all(e is not None and crit_end < e for e in ended),
              "the critical request ended after a batch stream: it waited for a slot to end")
        for i in range(2):
            check(got[i] == alone[i], f"batch stream {i}, preempted for a slot, differs from its run alone:\n"
                                      f"{got[i]!r}\n{alone[i]!r}")
        n = (metric(port, r'duet_requests_preempted_total\{mode="swap"\}') or 0) + \
            (metric(port, r'duet_requests_preempted_total\{mode="recompute"\}') or 0)
        check(n >= 1, "no preemption happened")
        check(metric(port, "duet_requests_failed_total") == 0, "no request failed")
        print(f"decode's slots: a critical request took a batch stream's slot ({int(n)} preemption(s)), ended "
              f"{min(ended) - crit_end:.2f} s before the first batch stream; batch texts identical to their runs alone")


def kv_watermark():
    """A3: --kv-blocks 24 and --admit-kv 0.5 (over at 12 blocks held, open again at 9).
    One long request holds more than half of the arena: a standard request is refused
    with 429 (reason kv) and a Retry-After computed from the time the long one needs
    to end; a critical one is admitted; once the long one ended, standard requests
    are admitted again."""
    # Without drafts: the long request's repetitive output would be drafted and end
    # too soon to be seen holding its blocks, and its events counted as tokens here
    # would carry several tokens each.
    with serving("-kvw", "--slots", "8", "--kv-blocks", "24", "--admit-kv", "0.5", "--admit-slack", "0",
                 "--draft-tokens", "0") as (port, server):
        n_long = 300
        times = []

        def long_stream():
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                         data=json.dumps({"prompt": prompt_ids(800, 40), "max_tokens": n_long,
                                                          "ignore_eos": True, "temperature": 0, "stream": True}).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=600) as r:
                for line in r:
                    if line.startswith(b"data: {") and json.loads(line[6:])["choices"][0]["text"]:
                        times.append(time.time())

        t = threading.Thread(target=long_stream)
        t.start()
        deadline = time.time() + 300
        # 40 + 180 positions: 14 blocks of 16, past 12 (the sampler reads every 50 ms).
        while time.time() < deadline and len(times) < 180:
            time.sleep(0.01)
        check(len(times) >= 180, f"the long request did not get going: {len(times)} tokens")
        time.sleep(0.2)
        small = {"prompt": prompt_ids(801, 10), "max_tokens": 4, "temperature": 0}
        st, headers, text = post(port, "/v1/completions", {**small, "priority": "standard"})
        done = len(times)
        check(st == 429, f"a standard request while the arena is over its watermark: {st} {text}")
        check(json.loads(text)["error"]["code"] == "kv_full", f"the reason: {text}")
        ms = int(headers.get("retry-after-ms", "0"))
        itl = (times[-1] - times[10]) / (len(times) - 11)
        predicted = (n_long - done) * itl * 1000
        check(0.2 * predicted <= ms <= 5 * predicted,
              f"retry-after-ms {ms} is not the long request's time left ({n_long - done} tokens at {itl * 1000:.1f} ms: "
              f"{predicted:.0f} ms)")
        check(int(headers.get("Retry-After", "0")) == (ms + 999) // 1000, f"Retry-After: {headers}")
        st, _, text = post(port, "/v1/completions", {**small, "priority": "critical"})
        check(st == 200, f"a critical request passes the KV watermark: {st} {text}")
        t.join()
        time.sleep(0.2)  # the next sample of the arena
        st, _, text = post(port, "/v1/completions", {**small, "priority": "standard"})
        check(st == 200, f"the long request ended: standard requests are admitted again: {st} {text}")
        check(metric(port, r'duet_requests_rejected_total\{reason="kv"\}') >= 1, "counted by reason")
        print(f"KV watermark: a standard request refused while one request held the arena, Retry-After {ms} ms "
              f"(its {n_long - done} tokens left: {predicted:.0f} ms), a critical one admitted, admission open again "
              "after it ended")


def main():
    # Under sanitizers prefill runs ~10x slower: 2400 batch tokens queued would
    # predict past a 60 s target and A1 would refuse the batch work critical_first
    # needs queued (it did: 5 of 6 refused). The batch target is scaled with it.
    # The batch target is far (300 s): critical_first's six batch prompts (2400 tokens)
    # must be admitted, and on a 2-core machine busy with serve_e2e's worker restarts
    # the measured prefill rate predicted past 60 s and A1 rightly refused one
    # (2026-12-06). What the test checks is the order, not that admission.
    slo = "critical=1s/1s,standard=30s/1s,batch=" + ("600s/20s" if SLOW else "300s/2s")
    with serving("", "--slots", "64", "--admit-queue-tokens", str(QUEUE), "--slo", slo) as (port, server):
        refusals(port)
        timeouts(port)
        burst(port, server.pid)
        client_waits(port)
        critical_first(port)
        critical_stops_a_pass(port)
        for fam in ("duet_requests_rejected_total", "duet_class_time_to_first_token_seconds",
                    "duet_class_slo_met_total", "duet_prefill_rate_tokens_per_second"):
            check(f"# TYPE {fam} " in get(port, "/metrics"), f"/metrics has {fam}")
        # On prefill's own cores, or (every pass lent or claimed) on both.
        own = metric(port, r'duet_prefill_rate_tokens_per_second\{window="best"\}')
        wide = metric(port, r'duet_prefill_wide_rate_tokens_per_second\{window="best"\}')
        check((own or 0) > 0 or (wide or 0) > 0, f"prefill's rate was measured: {own} own, {wide} with decode's cores")
        check(server.poll() is None, "the server is still up")
    # Under sanitizers too: there, on 2026-12-03, decode's last sequence failed while
    # prefill held the blocks of prompts it had set aside (fixed: PrefillWorker::
    # set_aside; serving_test's ALoneDecodeSequenceGetsTheBlocksOfAPromptThatWaits
    # replays that interleaving step by step).
    kv_pressure(swap=True)
    batch_slots()
    kv_watermark()
    if not SLOW:  # the recompute path under sanitizers: serving_test and the swap run's fallbacks
        kv_pressure(swap=False)
    print("scheduling e2e: ok")


if __name__ == "__main__":
    main()
