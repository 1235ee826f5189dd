#!/usr/bin/env python3
"""A full disk under --contexts-dir, through HTTP: the contexts directory on a small
tmpfs of the test's own (mounted in a mount namespace of its own: nothing outside the
test sees it), filled up; then

- an append answers 507 (insufficient storage), naming the context and not the
  server's paths, and the context is unchanged: its tokens, and a completion on it
  equals a plain completion of those tokens;
- creating a context answers 507 too, and leaves nothing behind;
- once there is room again, the same append succeeds and the context goes on exactly.

Then EIO: the contexts directory on an ext4 file system in a sparse image on that
tmpfs (a loop device), the tmpfs filled up, so that the image's writes fail in the
block layer and reach the server as EIO (what a failing disk gives):

- an append answers 500 naming the context and the I/O error, not the server's
  paths, and the context is unchanged and exact (its KV is in memory);
- once the disk is back (space freed, the file system checked and mounted again),
  a restarted server has the context as it was before the failed append, exactly,
  and appends to it.

Skipped (exit 77, saying why) where the kernel refuses a mount namespace or tmpfs;
the EIO part is reported as not run where loop devices cannot be mounted.
Usage: contexts_disk_test.py path/to/duet"""
import json
import os
import signal
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request

from duet_e2e import check, check_restarts, drain, listening_port, not_run, skip, stop

DUET = sys.argv[1]

if os.environ.get("DUET_DISK_NS") != "1":
    # Again, inside a mount namespace of its own with a 24 MiB tmpfs.
    mnt = tempfile.mkdtemp(prefix="duet-contexts-disk-")
    inner = (f"mount -t tmpfs -o size=24m,mode=0700 duet-test {mnt} && "
             f"DUET_DISK_NS=1 DUET_DISK_DIR={mnt} exec {sys.executable} {' '.join(map(repr, sys.argv))}")
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                            f"mount -t tmpfs -o size=1m duet-probe {mnt}"], capture_output=True, text=True)
    if probe.returncode != 0:
        os.rmdir(mnt)
        skip("mount", f"no mount namespace with a tmpfs here: {probe.stderr.strip()}")
    r = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", inner])
    os.rmdir(mnt)
    sys.exit(r.returncode)

cdir = os.environ["DUET_DISK_DIR"]


def start(contexts_dir):
    """A server on contexts_dir: (process, its log); `port` is its port from now on."""
    global port
    proc = subprocess.Popen([DUET, "serve", "--port", "0", "--ctx", "512", "--slots", "4", "--contexts-dir",
                             contexts_dir], stderr=subprocess.PIPE, text=True)
    port = listening_port(proc)
    check(port, "the server did not start")
    return proc, drain(proc)


port = None
serve, log = start(cdir)


def call(method, path, body=None):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method,
                                 data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def tokens(cid):
    st, j = call("GET", f"/v1/contexts/{cid}?tokens=true")
    check(st == 200, f"GET {cid}: {st} {j}")
    return j["tokens"]


def exact(cid, what):
    """A greedy completion on the context equals one on its tokens as a plain prompt."""
    st, a = call("POST", f"/v1/contexts/{cid}/completions", {"max_tokens": 8, "temperature": 0, "commit": False})
    check(st == 200, f"{what}: a completion on {cid}: {st} {a}")
    st, b = call("POST", "/v1/completions", {"prompt": tokens(cid), "max_tokens": 8, "temperature": 0})
    check(st == 200 and a["choices"][0]["text"] == b["choices"][0]["text"],
          f"{what}: {cid} continues as its tokens do: {a['choices'][0]['text']!r} vs {b['choices'][0]['text']!r}")


filler = os.path.join(cdir, "filler")
try:
    st, j = call("POST", "/v1/contexts", {"id": "a", "tokens": list(range(1000, 1040))})
    check(st == 201, f"create a: {st} {j}")
    before = tokens("a")
    # Fill the disk: what is left, in 64 KiB writes, until ENOSPC.
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    st, j = call("POST", "/v1/contexts/a/append", {"tokens": list(range(2000, 2030))})
    msg = j.get("error", {}).get("message", "")
    check(st == 507, f"an append on a full disk: {st} {j}")
    check("context 'a'" in msg and cdir not in msg, f"the 507 names the context, not the server's paths: {msg!r}")
    check(tokens("a") == before, "the context is unchanged after the failed append")
    exact("a", "after a failed append")
    st, j = call("POST", "/v1/contexts", {"id": "b", "tokens": list(range(3000, 3040))})
    check(st == 507 and cdir not in json.dumps(j), f"a new context on a full disk: {st} {j}")
    st, j = call("GET", "/v1/contexts/b")
    check(st == 404, f"the refused context is not there: {st} {j}")
    check(not [f for f in os.listdir(cdir) if f.startswith("b.")], f"no file of it is left: {os.listdir(cdir)}")
    print(f"a full disk: an append answers 507 ({msg[:100]}...), the context unchanged and exact; "
          "a create answers 507 and leaves nothing: ok")
    os.unlink(filler)
    st, j = call("POST", "/v1/contexts/a/append", {"tokens": list(range(2000, 2030))})
    check(st == 200, f"the append once there is room: {st} {j}")
    check(tokens("a") == before + list(range(2000, 2030)), "the context after the append")
    exact("a", "after the append that had room")
    print("room again: the same append succeeds and the context goes on exactly: ok")
    check_restarts(port, 0)
except SystemExit:
    print("".join(log), file=sys.stderr)
    raise
finally:
    if os.path.exists(filler):
        os.unlink(filler)
    stop(serve)


def fill():
    """Fills the tmpfs: what is left, in 64 KiB writes, until ENOSPC (unbuffered: no
    rest for close to write again)."""
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError:
            pass


def run(*cmd):
    return subprocess.run(cmd, capture_output=True, text=True)


img, fs = os.path.join(cdir, "eio.img"), os.path.join(cdir, "eio")
os.mkdir(fs)
run("truncate", "-s", "64M", img)
made = run("mkfs.ext4", "-q", "-F", img)
mounted = made.returncode == 0 and run("mount", "-o", "loop", img, fs).returncode == 0
if not mounted:
    not_run("loop", f"EIO: no ext4 on a loop device here ({made.stderr.strip() or 'mount -o loop failed'})")
    print("ok")
    sys.exit(0)
edir = os.path.join(fs, "contexts")
os.mkdir(edir)
serve, log = start(edir)
try:
    added = list(range(2000, 2030))
    st, j = call("POST", "/v1/contexts", {"id": "e", "tokens": list(range(1000, 1040))})
    check(st == 201, f"create e: {st} {j}")
    before = tokens("e")
    fill()
    st, j = call("POST", "/v1/contexts/e/append", {"tokens": added})
    msg = j.get("error", {}).get("message", "")
    check(st == 500, f"an append on a disk that answers EIO: {st} {j}")
    check("context 'e'" in msg and "Input/output error" in msg and cdir not in msg,
          f"the 500 names the context and the error, not the server's paths: {msg!r}")
    check(tokens("e") == before, "the context is unchanged after the failed append")
    exact("e", "after an append that met EIO")
    print(f"EIO: an append answers 500 ({msg[:110]}...), the context unchanged and exact: ok")
except SystemExit:
    print("".join(log), file=sys.stderr)
    raise
finally:
    stop(serve)
    if os.path.exists(filler):
        os.unlink(filler)
# The disk back: checked (the journal was aborted on the failed writes) and mounted again.
check(run("umount", fs).returncode == 0, "umount the image")
fsck = run("e2fsck", "-f", "-y", img)
check(fsck.returncode in (0, 1), f"e2fsck: {fsck.returncode} {fsck.stdout[-300:]} {fsck.stderr[-300:]}")
check(run("mount", "-o", "loop", img, fs).returncode == 0, "mount the image again")
serve, log = start(edir)
try:
    check(tokens("e") == before, "restarted on the disk that came back: the context as before the failed append")
    exact("e", "restarted after EIO")
    st, j = call("POST", "/v1/contexts/e/append", {"tokens": added})
    check(st == 200 and tokens("e") == before + added, f"the append once the disk is back: {st} {j}")
    exact("e", "after the append on the disk that came back")
    check_restarts(port, 0)
    print("the disk back: a restarted server has the context as it was, exactly, and appends to it: ok")
except SystemExit:
    print("".join(log), file=sys.stderr)
    raise
finally:
    stop(serve)
    run("umount", fs)
print("ok")
