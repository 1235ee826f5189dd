#!/usr/bin/env python3
"""duet's units under the real systemd, booted as PID 1 in throw-away namespaces
(scripts/systemd-container; ../shared/SYSTEMD-PID1.md says what works here):

- `duet systemd generate` and `install --root` for this machine, the duet binary and
  the model bound in read-only, a `duet` system user; `systemctl start duet.target`
  returns once every unit sent READY=1: active, the front's STATUS= text, /ready 200;
- under 8 sampled streams each (each must end exactly as an undisturbed run of the
  same request, resumed with Last-Event-ID where the front died), through systemd:
  SIGKILL of decode, of prefill, of the front; five SIGKILLs of decode in a row (the
  unit's StartLimitBurst= is not reached); SIGSTOP of decode (its watchdog fires,
  systemd kills and restarts it); `systemctl restart duet-front`. systemd's own
  NRestarts counts each death, and each worker comes back;
- systemd's NRestarts of each unit equals the deaths the test made (no watchdog fired
  on a busy worker); the swap directory is in the units' CacheDirectory=;
- SIGKILL of the instance under 8 streams: its roles run on (their Wants=; same
  pids), systemd restarts it, it takes the live segments over, and every stream ends
  as an undisturbed run; then the instance and the front killed at once (the front's
  clients resume once both are back), and the instance and decode at once (decode's
  unit restarts it before the instance is back: it waits for the recovery);
- `systemctl stop duet-instance` alone, under 8 streams, stops its roles: the front
  drains first (every stream ends whole), then the workers (exit 0, not restarted);
  the target starts them again;
- the journal is the log: the instance's warning about a death, a notice for each
  request it re-drove with its DUET_REQUEST field and the id its client was given
  (DUET_REQUEST_ID), each role's lines under its own
  SYSLOG_IDENTIFIER (duet-decode, ...) and level;
- a prefill worker on a model that fails its golden-logits check exits 3, systemd does
  not restart it (RestartPreventExitStatus=3) and reports its result, and /ready says
  why; on the right model again it serves;
- a prefill pass longer than the watchdog's period (WatchdogSec=2, scalar kernels)
  is alive: the request is served, systemd restarts nothing;
- durable contexts across a reboot of the manager: the contexts directory is kept
  (the container's /var/lib/duet), every process is gone, and after a new boot the
  context is there with the same tokens and continues as before;
- `systemctl stop duet.target`: every unit inactive (not failed), exit 0, nothing
  left in /dev/shm.

Skipped (exit 77) with the reason where the machine cannot boot one
(`scripts/systemd-container check` says why).

Usage: systemd_pid1_test.py path/to/duet path/to/model.gguf path/to/systemd-container
"""
import ctypes
import http.client
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from duet_e2e import broken_copy, check, skip, time_scale

DUET, MODEL, CONTAINER = (os.path.abspath(a) for a in sys.argv[1:4])
N = 8
MAX_TOKENS = 48 if os.environ.get("DUET_E2E_SUBSET") else 64
PORT = 8080  # the container's own network namespace: nothing else listens there
IN_MODEL = "/usr/local/share/duet/models/" + os.path.basename(MODEL)
IN_BROKEN = "/usr/local/share/duet/models/broken.gguf"
IN_DUET = "/usr/local/bin/duet"
SCALE = time_scale()

can = subprocess.run([CONTAINER, "check"], capture_output=True, text=True)
if can.returncode == 77:
    skip("systemd", can.stdout.strip())
check(can.returncode == 0, f"systemd-container check: {can.returncode} {can.stdout}{can.stderr}")

tmp = tempfile.mkdtemp(prefix="duet-pid1-test-")
ct = os.path.join(tmp, "ct")
pid1 = None


def boot():
    """Boots the container; the test's own threads talk HTTP inside its network."""
    global pid1
    b = subprocess.run([CONTAINER, "boot", ct, os.path.join(tmp, "tree"), "--bind", f"{DUET}:{IN_DUET}",
                        "--bind", f"{MODEL}:{IN_MODEL}", "--bind", f"{os.path.join(tmp, 'broken.gguf')}:{IN_BROKEN}",
                        "duet"], capture_output=True, text=True, timeout=300)
    check(b.returncode == 0, f"boot: {b.returncode}\n{b.stdout}{b.stderr}")
    pid1 = int(b.stdout.split()[-1])
    # setns(2) on this thread: threads made after it (the clients) are in it too.
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/proc/{pid1}/ns/net", os.O_RDONLY)
    rc = libc.setns(fd, 0x40000000)  # CLONE_NEWNET
    os.close(fd)
    check(rc == 0, f"setns into the container's network: errno {ctypes.get_errno()}")


def inside(*argv, timeout=120):
    return subprocess.run(["nsenter", "-t", str(pid1), "-a", *argv], capture_output=True, text=True, timeout=timeout)


def systemctl(*args, timeout=300):
    r = inside("systemctl", *args, timeout=timeout)
    check(r.returncode == 0, f"systemctl {' '.join(args)}: {r.returncode} {r.stdout}{r.stderr}\n{journal(40)}")
    return r.stdout


def show(unit, *props):
    out = inside("systemctl", "show", unit, "-p", ",".join(props)).stdout
    return dict(l.split("=", 1) for l in out.splitlines() if "=" in l)


def journal(lines=30, *args):
    return inside("journalctl", "--no-pager", "-n", str(lines), *args).stdout


def journal_json(*args):
    out = inside("journalctl", "--no-pager", "-o", "json", *args).stdout
    return [json.loads(l) for l in out.splitlines() if l.strip()]


def wait_for(what, cond, timeout):
    end = time.monotonic() + timeout * SCALE
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.1)
    check(False, f"{what}: not within {timeout * SCALE:.0f} s\n{journal(40)}")


def call(method, path, payload=None, timeout=300):
    c = http.client.HTTPConnection("127.0.0.1", PORT, timeout=timeout)
    c.request(method, path, json.dumps(payload) if payload is not None else None,
              {"Content-Type": "application/json"} if payload is not None else {})
    r = c.getresponse()
    return r.status, r.read().decode()


def ready():
    try:
        return call("GET", "/ready", timeout=5)[0] == 200
    except (ConnectionError, OSError, http.client.HTTPException):
        return False


ROLES = ("duet-instance.service", "duet-front.service", "duet-prefill@0.service", "duet-decode@0.service")


def all_active():
    return all(show(u, "ActiveState")["ActiveState"] == "active" for u in ROLES)


def body(i, stream, max_tokens=MAX_TOKENS):
    return {"prompt": f"Tale {i}: long ago, beyond the mountains,", "max_tokens": max_tokens, "temperature": 0.7,
            "seed": 77 + i, "stream": stream}


def read_events(resp, state, first_event):
    text = ""
    for raw in resp:
        line = raw.decode().rstrip("\n")
        if line.startswith("id: "):
            state["ev"] = line[4:]
        elif line.startswith("data: "):
            if line == "data: [DONE]":
                return text, True
            j = json.loads(line[6:])
            check("error" not in j, f"an error event: {line}")
            state["id"] = j["id"]
            first_event.set()
            for ch in j["choices"]:
                text += ch.get("text") or ""
    return text, False


def streams_through(what, disturb, offset, max_tokens=MAX_TOKENS):
    """N streams; `disturb()` once the first has an event (the others in prefill or
    decode); each resumes with Last-Event-ID if cut; each must equal an undisturbed
    run of its request."""
    refs = [None] * N

    def ref(i):
        st, out = call("POST", "/v1/completions", body(offset + i, False, max_tokens))
        check(st == 200, f"reference {i}: {st} {out[:300]}")
        refs[i] = json.loads(out)["choices"][0]["text"]
    ts = [threading.Thread(target=ref, args=(i,)) for i in range(N)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    first_event, got = threading.Event(), [None] * N

    def client(i):
        state, text, done = {}, "", False
        try:
            c = http.client.HTTPConnection("127.0.0.1", PORT, timeout=120)
            c.request("POST", "/v1/completions", json.dumps(body(offset + i, True, max_tokens)),
                      {"Content-Type": "application/json"})
            text, done = read_events(c.getresponse(), state, first_event)
        except (ConnectionError, OSError, http.client.HTTPException):
            pass
        end = time.time() + 120 * SCALE
        while not done and "id" in state and time.time() < end:
            try:
                c = http.client.HTTPConnection("127.0.0.1", PORT, timeout=120)
                c.request("GET", f"/v1/requests/{state['id']}/events", headers={"Last-Event-ID": state["ev"]})
                r = c.getresponse()
                if r.status == 200:
                    more, done = read_events(r, state, first_event)
                    text += more
                    continue
                r.read()
            except (ConnectionError, OSError, http.client.HTTPException):
                pass
            time.sleep(0.1)
        got[i] = text if done else None

    ts = [threading.Thread(target=client, args=(i,)) for i in range(N)]
    [t.start() for t in ts]
    check(first_event.wait(180 * SCALE), f"{what}: no stream started")
    disturb()
    [t.join(600) for t in ts]
    bad = [i for i in range(N) if got[i] != refs[i]]
    check(not bad, f"{what}: streams {bad} differ from undisturbed runs: {got[bad[0]]!r} vs {refs[bad[0]]!r}\n{journal(40)}"
          if bad else "")


def restarts(unit):
    return int(show(unit, "NRestarts")["NRestarts"])


def main_pid(unit):
    return int(show(unit, "MainPID")["MainPID"])


def killed_and_back(unit, signal, what, offset, expect_restart=True):
    """`signal` to the unit's main process under N streams; systemd restarts it; the
    streams end as undisturbed runs."""
    before, pid = restarts(unit), main_pid(unit)
    check(pid > 0, f"{unit}: no main PID")
    t0 = time.monotonic()
    streams_through(what, lambda: systemctl("kill", "-s", signal, "--kill-who=main", unit), offset)
    wait_for(f"{unit} restarted", lambda: restarts(unit) == before + 1 and all_active() and ready(), 120)
    check(main_pid(unit) != pid, f"{unit}: same main PID after {signal}")
    print(f"{what}: systemd restarted {unit} (NRestarts {before + 1}), {N} streams identical to undisturbed runs "
          f"({time.monotonic() - t0:.1f} s): ok")


try:
    # The units as `duet systemd generate` writes them for this machine, pointing at
    # the paths the binary and the model are bound to inside.
    gen, tree = os.path.join(tmp, "gen"), os.path.join(tmp, "tree")
    g = subprocess.run([DUET, "systemd", "generate", "--out", gen, "--exe", IN_DUET, "--model", MODEL,
                        "--port", str(PORT), "--ctx", "512", "--slots", "32", "--instance", "duet",
                        "--contexts-dir", "/var/lib/duet/contexts"], capture_output=True, text=True)
    check(g.returncode == 0, f"generate: {g.stdout}{g.stderr}")
    env_file = os.path.join(gen, "duet.env")
    env = open(env_file).read()
    check(MODEL in env, f"duet.env names the model: {env}")
    with open(env_file, "w") as f:
        f.write(env.replace(MODEL, IN_MODEL))
    ins = subprocess.run([DUET, "systemd", "install", gen, "--root", tree], capture_output=True, text=True)
    check(ins.returncode == 0, f"install --root: {ins.stdout}{ins.stderr}")
    # A copy of the model that fails its golden check, read by a drop-in below.
    broken_copy(DUET, MODEL, os.path.join(tmp, "broken.gguf"))

    t0 = time.monotonic()
    boot()
    booted = time.monotonic() - t0
    t0 = time.monotonic()
    systemctl("start", "duet.target")
    started = time.monotonic() - t0
    check(all_active(), f"every unit active after start:\n{journal(40)}")
    status = show("duet-front.service", "StatusText")["StatusText"]
    check(status.startswith("serving on http://127.0.0.1:8080"), f"the front's STATUS=: {status!r}")
    check(ready(), "/ready once duet.target started")
    print(f"boot {booted:.1f} s; systemctl start duet.target {started:.1f} s: every unit active, "
          f"front STATUS={status!r}, /ready 200: ok")

    killed_and_back("duet-decode@0.service", "SIGKILL", "SIGKILL of decode", 0)
    killed_and_back("duet-prefill@0.service", "SIGKILL", "SIGKILL of prefill", 100)
    # The journal is the log: the instance's warning about each death, a notice for
    # each request it re-drove (as many as its warnings count; the DUET_REQUEST field
    # finds one request's story), the roles' own lines by name and level.
    def deaths(n_kills):
        warnings = journal_json("-u", "duet-instance.service", "-p", "warning")
        gone = [e for e in warnings if "(pid" in e.get("MESSAGE", "") and "is gone" in e["MESSAGE"]]
        check(len(gone) == n_kills and
              all(e.get("PRIORITY") == "4" and e.get("SYSLOG_IDENTIFIER") == "duet-serve" for e in gone),
              f"journalctl -u duet-instance -p warning: {[e.get('MESSAGE') for e in warnings][-5:]}")
        return sum(int(re.search(r"re-drove (\d+) requests", e["MESSAGE"]).group(1)) for e in gone)
    kills = 2
    counted = deaths(kills)
    # A kill re-drives only what its worker held at that instant: with the answers in
    # the prefix cache and the draft pool (the references ran first), the streams can
    # pass through a worker between the first event and the kill. Then decode is
    # killed again, on other prompts, until a death has re-driven something to look at.
    while counted == 0 and kills < 5:
        killed_and_back("duet-decode@0.service", "SIGKILL", "SIGKILL of decode, again", 1000 + 10 * kills)
        kills += 1
        counted = deaths(kills)
    redriven = [e for e in journal_json("-u", "duet-instance.service")
                if "DUET_REQUEST" in e and "re-driven" in e.get("MESSAGE", "")]
    check(counted > 0 and len(redriven) >= counted and all(e.get("PRIORITY") == "5" for e in redriven),
          f"re-driven requests in the journal: {len(redriven)} notices, {counted} counted by the deaths")
    story = journal_json(f"DUET_REQUEST={redriven[0]['DUET_REQUEST']}")
    check(story and all(e["DUET_REQUEST"] == redriven[0]["DUET_REQUEST"] for e in story), f"one request's story: {story}")
    # ... and by the id its client was given (the streams' completions: cmpl-...).
    check(all(e.get("DUET_REQUEST_ID", "").startswith("cmpl-") for e in redriven),
          f"DUET_REQUEST_ID on each re-drive notice: {[e.get('DUET_REQUEST_ID') for e in redriven]}")
    by_id = journal_json(f"DUET_REQUEST_ID={redriven[0]['DUET_REQUEST_ID']}")
    check(by_id and all(e["DUET_REQUEST_ID"] == redriven[0]["DUET_REQUEST_ID"] for e in by_id),
          f"journalctl DUET_REQUEST_ID=: {by_id}")
    own = journal_json("-u", "duet-decode@0.service", "-t", "duet-decode")
    check(any("golden check passed" in e.get("MESSAGE", "") and e.get("PRIORITY") == "6" for e in own),
          f"decode's own lines as duet-decode: {[e.get('MESSAGE') for e in own][-3:]}")
    print(f"journal: {kills} deaths at warning, {counted} re-driven requests each a notice with DUET_REQUEST "
          f"(journalctl DUET_REQUEST={redriven[0]['DUET_REQUEST']}) and the client's id "
          f"(DUET_REQUEST_ID={redriven[0]['DUET_REQUEST_ID']}), duet-decode's own lines at info: ok")
    killed_and_back("duet-front.service", "SIGKILL", "SIGKILL of the front", 200)

    # A burst: decode SIGKILLed five times in a row, each time once it is back.
    unit = "duet-decode@0.service"
    before = restarts(unit)

    def five_kills():
        for _ in range(5):
            pid = main_pid(unit)
            systemctl("kill", "-s", "SIGKILL", "--kill-who=main", unit)
            wait_for("decode back", lambda: main_pid(unit) not in (0, pid)
                     and show(unit, "ActiveState")["ActiveState"] == "active", 60)
    t0 = time.monotonic()
    streams_through("five SIGKILLs of decode", five_kills, 50, max_tokens=2 * MAX_TOKENS)
    wait_for("decode serving", lambda: all_active() and ready(), 60)
    check(restarts(unit) == before + 5, f"NRestarts of decode {restarts(unit)}, want {before + 5}")
    print(f"five SIGKILLs of decode in a row: restarted each time (StartLimitBurst= not reached), {N} streams "
          f"identical ({time.monotonic() - t0:.1f} s): ok")

    # SIGSTOP: no WATCHDOG=1 for WatchdogSec=; systemd kills it (SIGABRT) and restarts it.
    unit = "duet-decode@0.service"
    before, pid = restarts(unit), main_pid(unit)
    t0 = time.monotonic()
    streams_through("SIGSTOP of decode", lambda: systemctl("kill", "-s", "SIGSTOP", "--kill-who=main", unit), 300)
    wait_for("decode restarted", lambda: restarts(unit) == before + 1 and all_active() and ready(), 120)
    check("Watchdog timeout" in journal(200, "-u", unit), f"the journal of {unit} names the watchdog:\n{journal(30, '-u', unit)}")
    print(f"SIGSTOP of decode: watchdog timeout, killed and restarted by systemd (NRestarts {before + 1}), "
          f"{N} streams identical ({time.monotonic() - t0:.1f} s): ok")

    unit = "duet-front.service"
    pid = main_pid(unit)
    streams_through("systemctl restart duet-front", lambda: systemctl("restart", unit), 400)
    check(main_pid(unit) != pid and all_active(), "the front restarted")
    print(f"systemctl restart duet-front under {N} streams: resumed with Last-Event-ID, identical: ok")

    # Every death systemd counted is one this test made (a watchdog that fired on a
    # busy worker, or a crash, would show here), and the swap directory of preempted
    # requests is the instance's, in the units' shared CacheDirectory=.
    # (`systemctl restart` starts the front's count again.)
    counts = {u: restarts(u) for u in ROLES}
    check(counts == {"duet-instance.service": 0, "duet-front.service": 0, "duet-prefill@0.service": 1,
                     "duet-decode@0.service": 7 + kills - 2}, f"NRestarts: {counts} ({kills - 2} kills again)")
    swap = inside("stat", "-c", "%a %U", "/var/cache/duet/duet-swap-duet")
    check(swap.returncode == 0 and swap.stdout.split() == ["700", "duet"], f"the swap directory: {swap.stdout}{swap.stderr}")
    check("no swap directory" not in journal(400), "a worker does not see the swap directory")
    print(f"NRestarts {counts}: the deaths this test made, no other; swap directory /var/cache/duet/duet-swap-duet "
          "(0700, duet), seen by the workers: ok")

    # The instance: its roles run on through its death, and its successor takes the
    # requests in flight over.
    inst = "duet-instance.service"
    workers = {u: main_pid(u) for u in ROLES}
    before = restarts(inst)
    t0 = time.monotonic()
    # Streams long enough to outlast the restart (RestartSec=1): the new instance
    # takes requests in flight over, which its journal line counts.
    long = 3 * MAX_TOKENS
    streams_through("SIGKILL of the instance", lambda: systemctl("kill", "-s", "SIGKILL", "--kill-who=main", inst), 500,
                    max_tokens=long)
    wait_for("the instance back", lambda: restarts(inst) == before + 1 and all_active() and ready(), 120)
    now = {u: main_pid(u) for u in ROLES}
    check(now[inst] != workers[inst] and all(now[u] == workers[u] for u in ROLES if u != inst),
          f"only the instance restarted: {workers} -> {now}")
    took = [int(m.group(1)) for e in journal_json("-u", inst, "-p", "warning")
            if (m := re.search(r"taken over from pid \d+ \(gone\), whose roles ran on: (\d+) requests in flight",
                               e.get("MESSAGE", "")))]
    check(len(took) == 1 and took[0] > 0, f"the instance took requests in flight over: {took}\n{journal(20, '-u', inst)}")
    print(f"SIGKILL of the instance: restarted (NRestarts {before + 1}), its roles ran on (same pids), it took the "
          f"instance over with {took[0]} requests in flight; {N} streams identical ({time.monotonic() - t0:.1f} s): ok")

    for other, offset in (("duet-front.service", 600), ("duet-decode@0.service", 700)):
        before = {u: restarts(u) for u in (inst, other)}
        t0 = time.monotonic()

        def both():
            systemctl("kill", "-s", "SIGKILL", "--kill-who=main", inst)
            systemctl("kill", "-s", "SIGKILL", "--kill-who=main", other)
        streams_through(f"SIGKILL of the instance and {other}", both, offset, max_tokens=long)
        wait_for(f"the instance and {other} back",
                 lambda: all(restarts(u) == before[u] + 1 for u in before) and all_active() and ready(), 120)
        print(f"SIGKILL of the instance and {other} at once: both restarted, {N} streams identical "
              f"({time.monotonic() - t0:.1f} s): ok")

    # Stopped alone (an operator's `systemctl stop`, not a crash), it stops its roles:
    # the front first, which drains its streams while the workers still compute them.
    t0 = time.monotonic()
    streams_through("systemctl stop duet-instance", lambda: systemctl("stop", inst), 800)
    for u in ROLES:
        s = show(u, "ActiveState", "Result")
        check(s["ActiveState"] == "inactive" and s["Result"] == "success", f"{u} after stopping the instance: {s}")
    shm = inside("ls", "-A", "/dev/shm").stdout.split()
    check(not shm, f"/dev/shm after stopping the instance: {shm}")
    systemctl("start", "duet.target")
    wait_for("serving again", lambda: all_active() and ready(), 120)
    print(f"systemctl stop duet-instance under {N} streams: each ended whole (the front drained first), every "
          f"role stopped with it (exit 0, not restarted), /dev/shm empty ({time.monotonic() - t0:.1f} s); "
          "duet.target starts them again: ok")

    # The golden gate under systemd: exit 3 is not restarted, and says why.
    unit = "duet-prefill@0.service"
    dropin = "/run/systemd/system/duet-prefill@0.service.d"
    r = inside("sh", "-c", f"mkdir -p {dropin} && printf '%s\\n' '[Service]' 'ExecStart=' "
               f"'ExecStart={IN_DUET} prefill --instance ${{DUET_INSTANCE}} --model {IN_BROKEN} --index %i $DUET_WORKER_ARGS' "
               f"> {dropin}/broken.conf")
    check(r.returncode == 0, f"the broken drop-in: {r.stderr}")
    systemctl("daemon-reload")
    before = restarts(unit)
    inside("systemctl", "restart", unit)  # fails: the unit exits 3
    wait_for("prefill failed", lambda: show(unit, "ActiveState")["ActiveState"] == "failed", 120)
    time.sleep(3)  # RestartSec=1: a restart would have come by now
    s = show(unit, "ActiveState", "Result", "ExecMainStatus", "NRestarts")
    check(s["ActiveState"] == "failed" and s["Result"] == "exit-code" and s["ExecMainStatus"] == "3"
          and int(s["NRestarts"]) == 0, f"the broken prefill: {s}")
    st, why = call("GET", "/ready")
    check(st == 503 and "golden" in why, f"/ready with prefill failed: {st} {why}")
    errors = journal_json("-u", unit, "-p", "err")
    check(any("golden check FAILED" in e.get("MESSAGE", "") and e.get("SYSLOG_IDENTIFIER") == "duet-prefill"
              for e in errors), f"journalctl -u {unit} -p err says why:\n{journal(20, '-u', unit)}")
    inside("rm", "-rf", dropin)
    systemctl("daemon-reload")
    systemctl("reset-failed", unit)
    systemctl("start", unit)
    wait_for("prefill back", lambda: all_active() and ready(), 120)
    print(f"golden check failed: prefill exit 3, {s['Result']}, not restarted; /ready {st}: {why.strip()[:90]}; "
          "on the right model again it serves: ok")

    # A pass longer than the watchdog's period is alive: the worker pings while its
    # layers go by (WorkerBase::watch_liveness), not only between steps. Prefill with
    # WatchdogSec=2 and the scalar kernels (a prompt of ~450 tokens, one pass, takes
    # seconds): the request is served and systemd restarts nothing.
    dropin = "/run/systemd/system/duet-prefill@0.service.d"
    r = inside("sh", "-c", f"mkdir -p {dropin} && printf '%s\\n' '[Service]' 'WatchdogSec=2' "
               f"'Environment=DUET_ISA=scalar' > {dropin}/slow.conf")
    check(r.returncode == 0, f"the slow drop-in: {r.stderr}")
    systemctl("daemon-reload")
    systemctl("restart", unit)
    wait_for("prefill back, scalar", lambda: all_active() and ready(), 120)
    before = restarts(unit)
    long_prompt = " ".join(f"item {i}," for i in range(30))  # 140 tokens: one pass of seconds
    t0 = time.monotonic()
    st, out = call("POST", "/v1/completions", {"prompt": long_prompt, "max_tokens": 1, "temperature": 0})
    took = time.monotonic() - t0
    check(st == 200, f"a long prompt under WatchdogSec=2: {st} {out[:300]}")
    check(took > 3, f"the pass took {took:.1f} s: not longer than the watchdog's period, so this proves nothing")
    check(restarts(unit) == before and "Watchdog timeout" not in journal(200, "-u", unit),
          f"prefill killed by its watchdog during a long pass:\n{journal(30, '-u', unit)}")
    inside("rm", "-rf", dropin)
    systemctl("daemon-reload")
    systemctl("restart", unit)
    wait_for("prefill back", lambda: all_active() and ready(), 120)
    print(f"a prefill pass of {took:.1f} s under WatchdogSec=2: pinged while it computed, not restarted: ok")

    # A durable context across a reboot of the manager.
    ctx_prompt = {"id": "kept", "prompt": "The three rules of the old lighthouse keeper were"}
    st, out = call("POST", "/v1/contexts", ctx_prompt)
    check(st in (200, 201), f"create a context: {st} {out}")
    st, out = call("POST", "/v1/contexts/kept/completions", {"max_tokens": 24, "temperature": 0, "commit": True})
    check(st == 200, f"a committed context completion: {st} {out}")
    st, before_ctx = call("GET", "/v1/contexts/kept?tokens=true")
    check(st == 200, f"the context: {st} {before_ctx}")
    st, next_text = call("POST", "/v1/contexts/kept/completions", {"max_tokens": 24, "temperature": 0, "commit": False})
    check(st == 200, f"a context completion: {st} {next_text}")
    stop = subprocess.run([CONTAINER, "stop", ct], capture_output=True, text=True)
    check(stop.returncode == 0, f"power off: {stop.stdout}{stop.stderr}")
    check(not os.path.exists(f"/proc/{pid1}"), "the manager is gone")
    boot()
    systemctl("start", "duet.target")
    wait_for("serving after the reboot", lambda: all_active() and ready(), 120)
    st, after_ctx = call("GET", "/v1/contexts/kept?tokens=true")
    check(st == 200 and json.loads(after_ctx)["tokens"] == json.loads(before_ctx)["tokens"],
          f"the context after the reboot: {st} {after_ctx[:300]} vs {before_ctx[:300]}")
    st, again = call("POST", "/v1/contexts/kept/completions", {"max_tokens": 24, "temperature": 0, "commit": False})
    check(st == 200 and json.loads(again)["choices"][0]["text"] == json.loads(next_text)["choices"][0]["text"],
          f"the context continues as before the reboot: {again} vs {next_text}")
    print(f"reboot of the manager: context 'kept' ({len(json.loads(after_ctx)['tokens'])} tokens) there with the "
          "same tokens, continues identically: ok")

    t0 = time.monotonic()
    systemctl("stop", "duet.target", "duet-instance.service")
    for u in ROLES:
        s = show(u, "ActiveState", "Result", "ExecMainStatus")
        check(s["ActiveState"] == "inactive" and s["Result"] == "success" and s["ExecMainStatus"] == "0",
              f"{u} after stop: {s}")
    shm = inside("ls", "-A", "/dev/shm").stdout.split()
    check(not shm, f"/dev/shm after stop: {shm}")
    print(f"systemctl stop duet.target: every unit inactive, exit 0 ({time.monotonic() - t0:.1f} s), /dev/shm empty: ok")
finally:
    subprocess.run([CONTAINER, "stop", ct], capture_output=True)
    shutil.rmtree(tmp, ignore_errors=True)
