#!/usr/bin/env python3
"""systemd/duet.service as systemd would run it, without systemd as PID 1:

- `systemd-analyze verify` prints nothing on the unit (v252 exits 0 on unknown keys,
  so any output fails), and `systemd-analyze security --offline=yes` scores it;
- a harness plays the service manager: it reads Environment= and ExecStart= from the
  unit file (not copied here), binds a NOTIFY_SOCKET with SO_PASSCRED, exports
  WATCHDOG_USEC, and starts the command. Then: STATUS= while loading, an
  EXTEND_TIMEOUT_USEC=, READY=1 only once /ready answers 200, WATCHDOG=1 at least
  every WATCHDOG_USEC/2 while serving a request, every message from the main
  process (its roles stay silent), no WATCHDOG=1 while the launcher is stopped
  (SIGSTOP: a wedged loop trips WatchdogSec=), pings again after SIGCONT, and
  STOPPING=1 then exit 0 on SIGTERM.

Usage: systemd_test.py path/to/duet path/to/model.gguf
"""
import json
import os
import re
import shlex
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from duet_e2e import check, free_port, time_scale, unit_lines

DUET, MODEL = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
UNIT = os.path.join(os.path.dirname(__file__), "..", "..", "systemd", "duet.service")
WATCHDOG_USEC = 2_000_000


# verify and security, on a copy whose ExecStart names this build's binary (verify
# checks that the command exists).
with tempfile.TemporaryDirectory() as d:
    copy = os.path.join(d, "duet.service")
    with open(copy, "w") as f:
        f.write(open(UNIT).read().replace("/usr/local/bin/duet", DUET))
    v = subprocess.run(["systemd-analyze", "verify", copy], capture_output=True, text=True)
    check(v.returncode == 0 and not v.stdout.strip() and not v.stderr.strip(),
          f"systemd-analyze verify ({v.returncode}):\n{v.stdout}{v.stderr}")
    sec = subprocess.run(["systemd-analyze", "security", "--offline=yes", copy], capture_output=True, text=True)
    m = re.search(r"Overall exposure level for duet\.service: ([\d.]+)", sec.stdout + sec.stderr)
    check(m, f"systemd-analyze security: {sec.stdout[-500:]}{sec.stderr[-500:]}")
    print(f"systemd-analyze verify: clean; security exposure {m.group(1)}")

# The unit's environment and command line, as systemd expands them: ${VAR} whole,
# $VAR split into words; the binary and the model are this build's.
service = unit_lines(UNIT)
keys = dict(service)
check(keys.get("Type") == "notify" and keys.get("NotifyAccess") == "main", "Type=notify, NotifyAccess=main")
check("WatchdogSec" in keys and keys.get("Restart") == "on-failure", "WatchdogSec=, Restart=on-failure")
env = {}
for k, v in service:
    if k == "Environment":
        name, val = v.split("=", 1)
        env[name] = val
port = free_port()
env.update(DUET_MODEL=MODEL, DUET_PORT=str(port), DUET_ARGS="--ctx 256 --slots 4")
argv = []
for word in shlex.split(keys["ExecStart"]):
    if re.fullmatch(r"\$[A-Z_]+", word):
        argv += env[word[1:]].split()
    else:
        argv.append(re.sub(r"\$\{([A-Z_]+)\}", lambda m: env[m.group(1)], word))
check(argv[0] == "/usr/local/bin/duet", f"ExecStart runs /usr/local/bin/duet: {argv[0]}")
argv[0] = DUET

# The notify socket, with the sender's credentials on every datagram.
sock_dir = tempfile.mkdtemp(prefix="duet-notify-")
sock_path = os.path.join(sock_dir, "notify")
sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
sock.bind(sock_path)
sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
messages = []  # (monotonic time, sender pid, {key: value})
lock = threading.Lock()


def receive():
    while True:
        try:
            data, anc, _, _ = sock.recvmsg(4096, socket.CMSG_SPACE(12))
        except OSError:
            return
        pid = -1
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                pid = struct.unpack("iII", payload[:12])[0]
        fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
        with lock:
            messages.append((time.monotonic(), pid, fields))


threading.Thread(target=receive, daemon=True).start()
child_env = dict(os.environ, NOTIFY_SOCKET=sock_path, WATCHDOG_USEC=str(WATCHDOG_USEC))
child_env.pop("WATCHDOG_PID", None)
proc = subprocess.Popen(argv, env=child_env, stderr=subprocess.PIPE, text=True)
threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()


def wait_for(pred, timeout, what):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with lock:
            for m in messages:
                if pred(m[2]):
                    return m
        check(proc.poll() is None, f"the service exited ({proc.returncode}) waiting for {what}")
        time.sleep(0.02)
    check(False, f"no {what} within {timeout} s")


def ready_status():
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except Exception:
        return None


try:
    wait_for(lambda f: f.get("STATUS", "").startswith("loading"), 60, "STATUS=loading")
    wait_for(lambda f: "EXTEND_TIMEOUT_USEC" in f, 60, "EXTEND_TIMEOUT_USEC")
    ready = wait_for(lambda f: f.get("READY") == "1", 300, "READY=1")
    check(ready_status() == 200, "/ready answers 200 once READY=1 was sent")
    with lock:
        before = [m for m in messages if m[0] < ready[0]]
    check(all("READY" not in m[2] for m in before), "READY=1 once")
    print(f"notify: STATUS while loading, EXTEND_TIMEOUT_USEC, READY=1 with /ready 200 ({ready[2].get('STATUS')}): ok")

    # Serving a request: pings at least every WATCHDOG_USEC / 2.
    t0 = time.monotonic()
    body = {"prompt": "Once upon a time", "max_tokens": 48, "temperature": 0}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        check(r.status == 200, "a completion")
    time.sleep(max(0.0, 3.0 - (time.monotonic() - t0)))
    t1 = time.monotonic()
    with lock:
        pings = [m[0] for m in messages if m[2].get("WATCHDOG") == "1" and t0 <= m[0] <= t1]
    gaps = [b - a for a, b in zip([t0] + pings, pings + [t1])]
    # Half the interval, as sd_watchdog_enabled(3) asks; under a sanitizer on a loaded
    # machine up to the interval itself, past which systemd would kill the service.
    check(pings and max(gaps) < min(time_scale() * WATCHDOG_USEC / 2e6, WATCHDOG_USEC / 1e6),
          f"WATCHDOG=1 gaps while serving: {gaps}")
    with lock:
        senders = {m[1] for m in messages}
    check(senders == {proc.pid}, f"every message from the main process {proc.pid}: {senders}")
    print(f"watchdog: {len(pings)} pings in {t1 - t0:.1f} s, largest gap {max(gaps):.2f} s, all from the main pid: ok")
    with lock:
        serving = [m[2]["STATUS"] for m in messages if m[0] > ready[0] and m[2].get("STATUS", "").startswith("serving:")]
    check(serving, "STATUS= lines while serving")
    print(f"STATUS while serving: {serving[-1]!r}: ok")

    # A wedged supervision loop: no ping while stopped.
    os.kill(proc.pid, signal.SIGSTOP)
    s0 = time.monotonic()
    time.sleep(WATCHDOG_USEC / 1e6 + 0.5)
    s1 = time.monotonic()
    with lock:
        during = [m for m in messages if m[2].get("WATCHDOG") == "1" and s0 + 0.05 < m[0] <= s1]
    check(not during, f"pings while the launcher was stopped: {len(during)}")
    os.kill(proc.pid, signal.SIGCONT)
    end = time.monotonic() + 5
    resumed = False
    while time.monotonic() < end and not resumed:
        with lock:
            resumed = any(m[2].get("WATCHDOG") == "1" and m[0] > s1 for m in messages)
        time.sleep(0.05)
    check(resumed, "pings resume after SIGCONT")
    print(f"wedged (SIGSTOP {s1 - s0:.1f} s > WatchdogSec {WATCHDOG_USEC / 1e6:.0f} s): no WATCHDOG=1; resumed after: ok")

    proc.send_signal(signal.SIGTERM)
    wait_for(lambda f: f.get("STOPPING") == "1", 30, "STOPPING=1")
    check(proc.wait(90) == 0, f"exit 0 after SIGTERM: {proc.returncode}")
    print("SIGTERM: STOPPING=1, exit 0: ok")
finally:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait()
    sock.close()
    os.unlink(sock_path)
    os.rmdir(sock_dir)
