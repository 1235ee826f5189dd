#!/usr/bin/env python3
"""duet as one systemd unit per role, without systemd as PID 1 (no systemd here):

- `duet systemd generate` writes the units of systemd/ (ExecStart naming this build),
  a drop-in per role with its cores / NUMA node / device, the target's and the
  instance's Wants=, and duet.env; `systemd-analyze verify` prints nothing on any of
  them; `duet systemd install --root` puts them in place (duet.env 0600);
- a harness plays the service manager: it reads each unit's Environment=,
  EnvironmentFile= (the generated duet.env), drop-ins and ExecStart= (with %i), gives
  each unit a NOTIFY_SOCKET of its own and WATCHDOG_USEC, starts duet-instance, waits
  for its READY=1, then starts prefill@0, decode@0 and the front (READY=1 from each,
  the front's once it listens) and restarts a unit that dies after its RestartSec=;
  it makes each unit's CacheDirectory= (under its own directory): the swap directory
  the instance makes there is the one both workers are given and see;
- SIGKILL of the front under 8 streams: the workers keep running (same pids), the
  restarted front adopts the requests, every client resumes with Last-Event-ID and
  gets exactly an undisturbed run's text;
- SIGKILL of decode under 8 streams: the instance recovers it and re-drives its
  requests, the restarted unit takes them, every stream completes identically;
- WATCHDOG=1 from every unit while serving; none from decode while it is stopped
  (SIGSTOP), again after SIGCONT;
- SIGTERM to each unit, roles first: STOPPING=1, exit 0, the segments gone.

The played manager runs only where the real one cannot boot (scripts/systemd-container
check: not root, namespaces refused): where it can, systemd_pid1_e2e drives the same
paths and more through systemd itself, and this test ends after the units' checks.

Usage: systemd_roles_test.py path/to/duet path/to/model.gguf [path/to/systemd-container]
"""
import glob
import http.client
import json
import os
import re
import shlex
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time

from duet_e2e import check, free_port, unit_lines

DUET, MODEL = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
WATCHDOG_USEC = 2_000_000
N = 4 if os.environ.get("DUET_E2E_SUBSET") else 8  # the sanitizer run: 4 (front_restart_e2e has 16)
MAX_TOKENS = 96 if os.environ.get("DUET_E2E_SUBSET") else 200


tmp = tempfile.mkdtemp(prefix="duet-units-test-")
gen = os.path.join(tmp, "gen")
port = free_port()
instance = f"duet-units-{os.getpid()}"
g = subprocess.run([DUET, "systemd", "generate", "--out", gen, "--exe", DUET, "--model", MODEL, "--port", str(port),
                    "--ctx", "512", "--slots", "32", "--instance", instance], capture_output=True, text=True)
check(g.returncode == 0, f"generate: {g.stdout}{g.stderr}")
units = ["duet.target", "duet-instance.service", "duet-front.service", "duet-prefill@0.service", "duet-decode@0.service"]
for u in units[1:]:
    base = re.sub(r"@\d+\.", "@.", u)
    check(os.path.exists(os.path.join(gen, base)), f"{base} written")
    check(os.path.exists(os.path.join(gen, u + ".d", "placement.conf")) or u == "duet-instance.service",
          f"{u}'s placement drop-in")
env_mode = stat.S_IMODE(os.stat(os.path.join(gen, "duet.env")).st_mode)
check(env_mode == 0o600, f"duet.env mode {oct(env_mode)}")
os.chdir(gen)
v = subprocess.run(["systemd-analyze", "verify", *units], capture_output=True, text=True)
check(v.returncode == 0 and not v.stdout.strip() and not v.stderr.strip(),
      f"systemd-analyze verify of the generated units ({v.returncode}):\n{v.stdout}{v.stderr}")
scores = {}
for u in units[1:]:
    sec = subprocess.run(["systemd-analyze", "security", "--offline=yes", u], capture_output=True, text=True)
    m = re.search(r"Overall exposure level for \S+: ([\d.]+)", sec.stdout + sec.stderr)
    check(m, f"security of {u}: {sec.stdout[-300:]}{sec.stderr[-300:]}")
    scores[u] = float(m.group(1))
# Bounded, not only printed: no higher than measured with systemd 252 (Debian 12) on
# 2026-12-06, 1.4, and 1.8 for the front, which listens on the network (3.2 and 3.4
# before the system call filter, ProtectProc=, PrivateMounts= and IPAddressDeny=;
# systemd_pid1_e2e runs these units under the real systemd). Another systemd may
# score otherwise: then measure again and say so here.
bound = {u: 1.8 if u == "duet-front.service" else 1.4 for u in scores}
check(all(scores[u] <= bound[u] + 1e-9 for u in scores), f"systemd-analyze security exposure above {bound}: {scores}")
print(f"generate: units, drop-ins, duet.env (0600); verify clean; security exposure {scores} (bounded)")
root = os.path.join(tmp, "root")
ins = subprocess.run([DUET, "systemd", "install", gen, "--root", root], capture_output=True, text=True)
check(ins.returncode == 0 and os.path.exists(os.path.join(root, "etc/systemd/system/duet-prefill@0.service.d/placement.conf"))
      and stat.S_IMODE(os.stat(os.path.join(root, "etc/duet/duet.env")).st_mode) == 0o600,
      f"install --root: {ins.stdout}{ins.stderr}")
print("install --root: units under etc/systemd/system, duet.env under etc/duet (0600): ok")
# The swap root: only under the units' CacheDirectory= (elsewhere they could not write
# and would quietly recompute), or "" (recompute: no worker is given a directory).
for bad in ("/tmp", "/srv/swap", "/var/cache/duet/a b"):
    b = subprocess.run([DUET, "systemd", "generate", "--out", os.path.join(tmp, "bad"), "--exe", DUET, "--model", MODEL,
                        "--port", str(port), "--swap-root", bad], capture_output=True, text=True)
    check(b.returncode != 0 and "--swap-root" in b.stderr, f"generate --swap-root {bad!r} refused: {b.stderr}")
none = os.path.join(tmp, "noswap")
b = subprocess.run([DUET, "systemd", "generate", "--out", none, "--exe", DUET, "--model", MODEL, "--port", str(port),
                    "--swap-root", ""], capture_output=True, text=True)
check(b.returncode == 0 and not any("--swap-dir" in open(f).read()
                                    for f in glob.glob(os.path.join(none, "*.d", "*.conf"))),
      f"generate --swap-root '': no worker given a swap directory: {b.stderr}")
print("generate --swap-root: /tmp, /srv/swap and a path with a space refused; '' gives no swap directory: ok")
if len(sys.argv) > 3 and subprocess.run([sys.argv[3], "check"], capture_output=True).returncode == 0:
    print("the units under a manager: systemd_pid1_e2e, under the real systemd (it boots here): not played here")
    shutil.rmtree(tmp, ignore_errors=True)
    sys.exit(0)
CACHE = os.path.join(tmp, "var-cache")  # the harness's /var/cache


def parse_unit(name):
    """(environment, argv, restart_sec) of a unit as systemd would run it here."""
    base = re.sub(r"@(\d+)\.", "@.", name)
    inst = re.search(r"@(\d+)\.", name)
    files = [os.path.join(gen, base)] + sorted(glob.glob(os.path.join(gen, name + ".d", "*.conf")))
    env, exec_start, restart_sec, cache_dirs = {}, None, 0.1, []
    for f in files:
        for k, val in unit_lines(f):
            if k == "CacheDirectory":
                cache_dirs += val.split()
            if k == "Environment":
                for word in shlex.split(val):
                    a, b = word.split("=", 1)
                    env[a] = b
            elif k == "EnvironmentFile":
                check(val.lstrip("-") == "/etc/duet/duet.env", f"{name}: EnvironmentFile {val}")
                for l in open(os.path.join(gen, "duet.env")):
                    l = l.strip()
                    if l and not l.startswith("#"):
                        a, b = l.split("=", 1)
                        env[a] = shlex.split(b)[0] if b else ""
            elif k == "ExecStart":
                exec_start = val
            elif k == "RestartSec":
                restart_sec = float(val[:-2]) / 1000 if val.endswith("ms") else float(val)
    check(exec_start, f"{name}: ExecStart")
    argv = []
    for word in shlex.split(exec_start.replace("%i", inst.group(1) if inst else "")):
        if re.fullmatch(r"\$[A-Z_]+", word):
            argv += env.get(word[1:], "").split()
        else:
            argv.append(re.sub(r"\$\{([A-Z_]+)\}", lambda m: env[m.group(1)], word))
    # CacheDirectory=: systemd makes /var/cache/<name> (0700) for the unit; the
    # harness makes it under its own directory and points the arguments there.
    for d in cache_dirs:
        os.makedirs(os.path.join(CACHE, d), mode=0o700, exist_ok=True)
        argv = [a.replace(f"/var/cache/{d}", os.path.join(CACHE, d)) for a in argv]
    return env, argv, restart_sec, cache_dirs


class Unit:
    """One unit under the harness: its notify socket, its messages, its process."""

    def __init__(self, name):
        self.name = name
        self.env, self.argv, self.restart_sec, self.cache_dirs = parse_unit(name)
        self.path = os.path.join(tmp, name.replace("@", "_") + ".sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.messages, self.lock, self.proc, self.log = [], threading.Lock(), None, []
        self.keep_running = True
        threading.Thread(target=self.receive, daemon=True).start()

    def receive(self):
        while True:
            try:
                data, anc, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(12))
            except OSError:
                return
            pid = next((struct.unpack("iII", p[:12])[0] for lv, k, p in anc
                        if lv == socket.SOL_SOCKET and k == socket.SCM_CREDENTIALS), -1)
            fields = dict(l.split("=", 1) for l in data.decode().splitlines() if "=" in l)
            with self.lock:
                self.messages.append((time.monotonic(), pid, fields))

    def start(self):
        env = dict(os.environ, NOTIFY_SOCKET=self.path, WATCHDOG_USEC=str(WATCHDOG_USEC))
        env.pop("WATCHDOG_PID", None)
        self.started = time.monotonic()
        self.proc = subprocess.Popen(self.argv, env=env, stderr=subprocess.PIPE, text=True)
        p = self.proc
        threading.Thread(target=lambda: [self.log.append(l) for l in p.stderr], daemon=True).start()

    def since(self, t, key, value="1"):
        with self.lock:
            return [m for m in self.messages if m[0] >= t and m[2].get(key) == value]

    def wait_ready(self, timeout=120):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.since(self.started, "READY"):
                return
            check(self.proc.poll() is None, f"{self.name} exited ({self.proc.returncode}) before READY=1:\n"
                  + "".join(self.log[-20:]))
            time.sleep(0.02)
        check(False, f"{self.name}: no READY=1 in {timeout} s")

    def supervise(self):
        """Restart=on-failure: a process that dies unasked is started again after RestartSec=."""
        def loop():
            while self.keep_running:
                p = self.proc
                rc = p.wait()
                if not self.keep_running or rc == 0:
                    return
                time.sleep(self.restart_sec)
                if self.keep_running:
                    self.start()
        threading.Thread(target=loop, daemon=True).start()

    def stop(self):
        self.keep_running = False
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(60)
        return rc


def body(i, stream):
    return {"prompt": f"Tale {i}: long ago, beyond the mountains,", "max_tokens": MAX_TOKENS, "temperature": 0.7,
            "seed": 77 + i, "stream": stream}


def post(payload, headers=None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    c.request("POST", "/v1/completions", json.dumps(payload), {"Content-Type": "application/json", **(headers or {})})
    r = c.getresponse()
    return r.status, r.read().decode()


def read_events(resp, state):
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
            state["n"] = state.get("n", 0) + 1
            if state["n"] == 3 and "barrier" in state:
                state["barrier"].wait(120)
            for ch in j["choices"]:
                text += ch.get("text") or ""
    return text, False


def streams_through(kill, offset):
    """N streams; `kill()` once each has 3 events; each resumes if cut. Their texts."""
    refs = [None] * N
    def ref(i):
        st, out = post(body(offset + i, False))
        check(st == 200, f"reference {i}: {st} {out[:300]}")
        refs[i] = json.loads(out)["choices"][0]["text"]
    ts = [threading.Thread(target=ref, args=(i,)) for i in range(N)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    barrier = threading.Barrier(N + 1)
    got = [None] * N

    def client(i):
        state = {"barrier": barrier}
        text, done = "", False
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            c.request("POST", "/v1/completions", json.dumps(body(offset + i, True)), {"Content-Type": "application/json"})
            text, done = read_events(c.getresponse(), state)
        except (ConnectionError, OSError, http.client.HTTPException):
            pass
        state.pop("barrier", None)
        end = time.time() + 60
        while not done and time.time() < end:
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
                c.request("GET", f"/v1/requests/{state['id']}/events", headers={"Last-Event-ID": state["ev"]})
                r = c.getresponse()
                if r.status == 200:
                    more, done = read_events(r, state)
                    text += more
                    break
                r.read()
            except (ConnectionError, OSError, http.client.HTTPException):
                pass
            time.sleep(0.1)
        got[i] = text if done else None

    ts = [threading.Thread(target=client, args=(i,)) for i in range(N)]
    [t.start() for t in ts]
    barrier.wait(180)
    kill()
    [t.join(300) for t in ts]
    bad = [i for i in range(N) if got[i] != refs[i]]
    check(not bad, f"streams {bad} differ from undisturbed runs: {got[bad[0]]!r} vs {refs[bad[0]]!r}" if bad else "")


roles = {}
try:
    try:
        inst = Unit("duet-instance.service")
        check(inst.argv[:2] == [DUET, "instance"] and "--prefill-workers" in inst.argv, f"instance argv: {inst.argv}")
        # Preempted requests' KV is swapped in the units' shared CacheDirectory= (each
        # unit's /var/tmp is private): the instance makes duet-swap-<instance> there,
        # and every worker is told that directory.
        swap_dir = os.path.join(CACHE, "duet", f"duet-swap-{instance}")
        check(inst.argv[inst.argv.index("--swap-root") + 1] == os.path.join(CACHE, "duet") and inst.cache_dirs == ["duet"],
              f"the instance's swap root is its CacheDirectory=: {inst.argv} {inst.cache_dirs}")
        inst.start()
        inst.wait_ready()
        inst.supervise()
        for name in ("duet-prefill@0.service", "duet-decode@0.service", "duet-front.service"):
            roles[name] = Unit(name)
            roles[name].start()
        for u in roles.values():
            u.wait_ready()
            u.supervise()
        for name in ("duet-prefill@0.service", "duet-decode@0.service"):
            u = roles[name]
            check(u.cache_dirs == ["duet"] and u.argv[u.argv.index("--swap-dir") + 1] == swap_dir,
                  f"{name}: the swap directory in its CacheDirectory=: {u.argv} {u.cache_dirs}")
            check(not any("no swap directory" in l for l in u.log), f"{name} sees the swap directory:\n" + "".join(u.log))
        check(os.path.isdir(swap_dir) and stat.S_IMODE(os.stat(swap_dir).st_mode) == 0o700,
              f"the instance made {swap_dir} (0700)")
        print(f"swap directory: {swap_dir}, under the units' CacheDirectory=duet, seen by both workers: ok")
        front, decode = roles["duet-front.service"], roles["duet-decode@0.service"]
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        c.request("GET", "/ready")
        check(c.getresponse().status == 200, "/ready after every unit's READY=1")
        print("harness: duet-instance READY=1, then prefill@0, decode@0 and the front READY=1; /ready 200: ok")

        pids = {n: u.proc.pid for n, u in roles.items()}
        streams_through(lambda: front.proc.send_signal(signal.SIGKILL), 0)
        check(roles["duet-prefill@0.service"].proc.pid == pids["duet-prefill@0.service"]
              and decode.proc.pid == pids["duet-decode@0.service"] and front.proc.pid != pids["duet-front.service"],
              "the workers kept their pids, the front was restarted")
        print(f"SIGKILL of duet-front under {N} streams: restarted, every stream resumed identical, workers kept: ok")

        streams_through(lambda: decode.proc.send_signal(signal.SIGKILL), 100)
        check(decode.proc.pid != pids["duet-decode@0.service"], "decode restarted by its unit")
        check(any("decode" in l and "re-drove" in l for l in inst.log), "the instance recovered decode:\n"
              + "".join(inst.log[-10:]))
        print(f"SIGKILL of duet-decode@0 under {N} streams: recovered by the instance, re-driven, identical: ok")

        # Watchdog: every unit pings while serving; decode not while stopped.
        t0 = time.monotonic()
        time.sleep(2.5)
        t1 = time.monotonic()
        for u in [inst, *roles.values()]:
            pings = [m[0] for m in u.since(t0, "WATCHDOG") if m[0] <= t1]
            gaps = [b - a for a, b in zip([t0] + pings, pings + [t1])]
            check(pings and max(gaps) < WATCHDOG_USEC / 2e6, f"{u.name}: WATCHDOG=1 gaps {gaps}")
            check({m[1] for m in u.messages} <= {u.proc.pid} | {m[1] for m in u.messages if m[0] < u.started},
                  f"{u.name}: messages from its own process only")
        decode.proc.send_signal(signal.SIGSTOP)
        s0 = time.monotonic()
        time.sleep(WATCHDOG_USEC / 1e6 + 0.5)
        s1 = time.monotonic()
        quiet = [m for m in decode.since(s0 + 0.05, "WATCHDOG") if m[0] <= s1]
        front_pings = [m for m in front.since(s0, "WATCHDOG") if m[0] <= s1]
        decode.proc.send_signal(signal.SIGCONT)
        check(not quiet and front_pings, f"decode stopped: {len(quiet)} pings (want 0); the front's: {len(front_pings)}")
        end = time.monotonic() + 5
        while time.monotonic() < end and not decode.since(s1, "WATCHDOG"):
            time.sleep(0.05)
        check(decode.since(s1, "WATCHDOG"), "decode pings again after SIGCONT")
        print(f"watchdog: every unit pings within {WATCHDOG_USEC / 2e6:.0f} s; none from a stopped decode: ok")

        # systemctl stop duet.target: the roles first (they are ordered after the instance).
        for name in ("duet-front.service", "duet-decode@0.service", "duet-prefill@0.service"):
            u = roles[name]
            t = time.monotonic()
            rc = u.stop()
            check(rc == 0 and u.since(t, "STOPPING"), f"{name}: exit {rc}, STOPPING=1 {bool(u.since(t, 'STOPPING'))}")
        t = time.monotonic()
        rc = inst.stop()
        check(rc == 0 and inst.since(t, "STOPPING"), f"the instance: exit {rc}")
        check(not glob.glob(f"/dev/shm/duet.{instance}*"), "the instance's segments are gone")
        check(not os.path.exists(swap_dir), f"the instance removed {swap_dir}")
        print("stop: each role STOPPING=1 and exit 0, then the instance; its segments gone: ok")
    except SystemExit:
        for u in [*roles.values()] + ([inst] if "inst" in dir() else []):
            print(f"--- {u.name}\n" + "".join(u.log[-15:]), file=sys.stderr)
        raise
finally:
    for u in list(roles.values()) + ([inst] if "inst" in dir() else []):
        u.keep_running = False
        if u.proc and u.proc.poll() is None:
            u.proc.send_signal(signal.SIGCONT)
            u.proc.kill()
            u.proc.wait()
    shutil.rmtree(tmp, ignore_errors=True)
