"""What the end-to-end test scripts of tests/cli share (imported from the script's own
folder, which Python puts first on sys.path)."""
import re
import socket
import sys


def check(cond, msg):
    """Fails the test with `msg` (on stderr, exit 1) unless cond holds."""
    if not cond:
        print("FAIL:", msg, file=sys.stderr)
        sys.exit(1)


def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def unit_lines(path):
    """(key, value) of a systemd unit file's [Service] section, continuation lines joined."""
    out, section = [], None
    for line in open(path).read().replace("\\\n", " ").splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            section = line
            continue
        if section == "[Service]" and "=" in line:
            k, v = line.split("=", 1)
            out.append((k.strip(), v.strip()))
    return out


def listening_port(proc):
    """The port `duet serve` (started with stderr=PIPE, text=True) announces, or None
    if it exits first."""
    for line in proc.stderr:
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
        if m:
            return int(m.group(1))
    return None


def listening_port_and_instance(proc):
    """(port, instance) that `duet serve` (started with stderr=PIPE, text=True)
    announces; fails the test with what it printed if it exits first."""
    head = []
    for line in proc.stderr:
        head.append(line)
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+) \(model \S+, instance (\S+?)[,)]", line)
        if m:
            return int(m.group(1)), m.group(2)
    check(False, "the server exited before listening:\n" + "".join(head))


# Extra `duet serve` arguments for every e2e server: with other e2e servers starting
# on the same two cores (under sanitizers, or a loaded release run: responses_e2e on
# 2026-12-06), the roles' start (each worker's golden check first) can pass the
# default --start-timeout (60 s), and the launcher gives up before listening. The
# bound is for a hang, not a speed.
START_TIMEOUT = ("--start-timeout", "300")


def time_scale():
    """DUET_TIME_SCALE (default 1; the sanitizer runs of `make test` set 4): every time
    bound a test sets is multiplied by it (tests/time_scale.h says why)."""
    import os
    try:
        return max(1.0, float(os.environ.get("DUET_TIME_SCALE", "1")))
    except ValueError:
        return 1.0


def required(what):
    """Whether DUET_REQUIRE (a comma list: avx2, avx512, io_uring, gpu, gpus2) names
    `what` (tests/require.h says why)."""
    import os
    return what in os.environ.get("DUET_REQUIRE", "").split(",")


def skip(what, why):
    """Ends the test as skipped (exit 77, ctest's SKIP_RETURN_CODE here) saying why, or
    fails it where DUET_REQUIRE names `what`."""
    check(not required(what), f"DUET_REQUIRE names {what}: {why}")
    print(f"SKIPPED: {why}")
    sys.exit(77)


def not_run(what, why):
    """A part of a test that cannot run here: says so, or fails where DUET_REQUIRE
    names `what`."""
    check(not required(what), f"DUET_REQUIRE names {what}: {why}")
    print(f"not run: {why}")


def child_pids(launcher_pid, role):
    """The live processes of `role` ("prefill", "decode", "front") that the launcher
    `launcher_pid` started, from /proc: its threads' `children` files, then each
    child's arguments (`duet <role> ...`; a zombie, or a child not yet exec'd, is
    left out). A handful of files, no process started: a look that ran `duet shm
    status` took seconds on a loaded machine, long enough for what it looked for to
    change before the test acted on it."""
    import os
    kids = []
    try:
        for task in os.listdir(f"/proc/{launcher_pid}/task"):
            with open(f"/proc/{launcher_pid}/task/{task}/children") as f:
                kids += f.read().split()
    except OSError:
        pass
    out = []
    for d in kids:
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
            with open(f"/proc/{d}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # state, ppid, ...
        if fields[0] != "Z" and int(fields[1]) == launcher_pid and len(argv) > 1 and argv[1] == role.encode():
            out.append(int(d))
    return out


def running_workers(duet, instance, role, wait_s=60):
    """The pids of `role` workers of `instance` that run (not those starting), by `duet
    shm status`; waits up to wait_s (widened by the time scale) for at least one: a
    worker restarted after a kill loads and checks its model first."""
    import json
    import subprocess
    import time
    end = time.monotonic() + wait_s * time_scale()
    while True:
        out = subprocess.run([duet, "shm", "status", instance, "--json"], capture_output=True, text=True, check=True)
        pids = [p["pid"] for p in json.loads(out.stdout)["processes"] if p["role"] == role and p["state"] == "running"]
        if pids or time.monotonic() > end:
            return pids
        time.sleep(0.1)


def drain(proc, keep=200):
    """Reads the rest of proc.stderr (text) on a daemon thread, so that a server that
    logs a lot never blocks on a full pipe; returns the list of its last `keep` lines."""
    import collections
    import threading
    lines = collections.deque(maxlen=keep)
    threading.Thread(target=lambda: [lines.append(l) for l in proc.stderr], daemon=True).start()
    return lines


def check_restarts(port, kills):
    """/metrics' duet_worker_restarts_total equals the kills this test made: a role
    that died on its own (a crash, an abort on a sanitizer report) is restarted and
    its requests re-driven, so its test could pass without this. A kill the launcher
    has not reaped yet (the last one, as a stream ended) is waited for, up to 30 s."""
    import re
    import time
    import urllib.request
    deadline = time.monotonic() + 30 * time_scale()
    while True:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
        m = re.search(r"^duet_worker_restarts_total (\d+)$", text, re.M)
        check(m, "/metrics has no duet_worker_restarts_total")
        if int(m.group(1)) >= kills or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    check(int(m.group(1)) == kills, f"{m.group(1)} role restarts for the {kills} kill(s) this test made: "
                                    "a role died on its own (its log says why)")


def kill_server(proc, instance):
    """SIGKILL of a `duet serve` started with start_new_session (its process group:
    launcher, front, workers), as after a crash; its shared-memory segments removed,
    as a machine's restart would."""
    import os
    import signal
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for f in (f"duet.{instance}", f"duet.{instance}.kv"):
        for d in ("/dev/shm", "/dev/hugepages"):
            if os.path.exists(os.path.join(d, f)):
                os.unlink(os.path.join(d, f))


def stop(proc, grace=60, instance=None):
    """SIGTERM to a server, SIGKILL if it has not exited after `grace` seconds (with
    `instance`, of its whole process group, its segments removed: kill_server)."""
    import signal
    import subprocess
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        if instance is None:
            proc.kill()
        else:
            kill_server(proc, instance)


def broken_copy(duet, model, dst):
    """A copy of the Q4_1 model at `dst` that fails its golden-logits check: the high
    byte of a block's f16 scale, 100 blocks into layer 0's Wq, one bit flipped (past
    the 256 bytes per tensor the model's fingerprint reads, so the built-in reference
    still names the copy)."""
    import shutil
    import subprocess
    out = subprocess.run([duet, "info", "-m", model], capture_output=True, text=True, check=True).stdout
    m = re.search(r"^\s+blk\.0\.attn_q\.weight\s+(\S+)\s+.*?(\d+) bytes at (\d+)$", out, re.M)
    check(m and m.group(1) == "Q4_1" and int(m.group(2)) > 2100, f"blk.0.attn_q.weight in duet info: {m and m.groups()}")
    at = int(m.group(3)) + 100 * 20 + 1
    shutil.copy(model, dst)
    with open(dst, "r+b") as f:
        f.seek(at)
        b = f.read(1)[0]
        f.seek(at)
        f.write(bytes([b ^ 0x40]))
