#!/usr/bin/env python3
"""The golden-logits gate (engine/golden.h) end to end:

- the default model passes the built-in reference (llama.cpp's logits), in
  `duet golden check` and in every worker of `duet serve`, which serves;
- a copy of the model with one flipped byte in a weight (past the 256 bytes per
  tensor the fingerprint reads, so the built-in reference still names it) fails:
  `duet golden check` exits 3 with the reason, and `duet serve` never listens and
  exits 3 (what systemd's RestartPreventExitStatus=3 does not restart), its worker
  saying why;
- a reference recorded for another model (--golden FILE) fails as such; a missing
  reference file is an error before anything starts; --golden none skips it;
- `duet golden record` writes a reference the model then passes, and refuses to
  write one for the broken copy against llama.cpp's fixture.

Usage: golden_test.py path/to/duet path/to/model.gguf path/to/tests/fixtures
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from duet_e2e import broken_copy, check, free_port

DUET, MODEL, FIXTURES = sys.argv[1], os.path.abspath(sys.argv[2]), sys.argv[3]


def serve(model, *extra, timeout=240):
    """Runs duet serve until it listens (then SIGTERM) or exits; (exit code, stderr, listened)."""
    p = subprocess.Popen([DUET, "serve", "--model", model, "--port", "0", "--ctx", "256", "--slots", "4", *extra],
                         stderr=subprocess.PIPE, text=True)
    lines, listened = [], False
    for line in p.stderr:
        lines.append(line)
        if "listening on http" in line:
            listened = True
            p.terminate()
    return p.wait(timeout), "".join(lines), listened


tmp = tempfile.mkdtemp(prefix="duet-golden-test-")
try:
    ok = subprocess.run([DUET, "golden", "check", "-m", MODEL], capture_output=True, text=True)
    check(ok.returncode == 0 and ok.stdout.startswith("passed: ") and "llama.cpp" in ok.stdout,
          f"the default model against the built-in reference: {ok.returncode} {ok.stdout}{ok.stderr}")
    print("duet golden check, the default model:", ok.stdout.strip())

    broken = os.path.join(tmp, "broken.gguf")
    broken_copy(DUET, MODEL, broken)
    bad = subprocess.run([DUET, "golden", "check", "-m", broken], capture_output=True, text=True)
    check(bad.returncode == 3 and bad.stdout.startswith("FAILED: ") and "mean |dlogprob|" in bad.stdout,
          f"the broken copy: {bad.returncode} {bad.stdout}{bad.stderr}")
    print("duet golden check, one flipped weight byte:", bad.stdout.strip()[:160], "...")

    rc, log, listened = serve(broken)
    check(not listened and rc == 3, f"serve on the broken copy: exit {rc}, listened {listened}\n{log[-3000:]}")
    check("golden check FAILED" in log and "failed its golden-logits check" in log, f"the reason in the log:\n{log[-3000:]}")
    print("duet serve on the broken copy: never listens, exit 3, the reason logged: ok")

    # One unit per role (duet instance, front, workers as systemd starts them): the
    # broken worker exits 3 and is not restarted; the front's /ready says why, and
    # /metrics counts it.
    inst_name = f"duet-golden-test-{os.getpid()}"
    port = free_port()
    procs = [subprocess.Popen([DUET, "instance", "--model", broken, "--instance", inst_name, "--ctx", "256",
                               "--slots", "4"], stderr=subprocess.DEVNULL)]
    try:
        for _ in range(200):
            if os.path.exists(f"/dev/shm/duet.{inst_name}"):
                break
            time.sleep(0.05)
        procs.append(subprocess.Popen([DUET, "front", "--instance", inst_name, "--model", broken, "--port", str(port)],
                                      stderr=subprocess.DEVNULL))
        worker = subprocess.run([DUET, "prefill", "--instance", inst_name, "--model", broken, "--index", "0"],
                                capture_output=True, text=True, timeout=120)
        check(worker.returncode == 3, f"the broken prefill worker: exit {worker.returncode}")
        ready = None
        for _ in range(200):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=5) as r:
                    ready = (r.status, r.read().decode())
            except urllib.error.HTTPError as e:
                ready = (e.code, e.read().decode())
            except OSError:
                time.sleep(0.05)
                continue
            break
        check(ready and ready[0] == 503 and "golden-logits check" in json.loads(ready[1])["reason"]
              and "prefill 0" in json.loads(ready[1])["reason"], f"/ready: {ready}")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            check("duet_golden_check_failures_total 1\n" in r.read().decode(), "the metric")
        print("per-role units: the broken worker exits 3; /ready 503 says why; duet_golden_check_failures_total 1: ok")
    finally:
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()

    rc, log, listened = serve(broken, "--golden", "none")
    check(listened, f"--golden none serves even the broken copy:\n{log[-2000:]}")
    rc, log, listened = serve(MODEL)
    check(listened and log.count("golden check passed") == 2, f"serve on the model: both workers pass\n{log[-2000:]}")
    print("duet serve on the model: both workers pass, it serves; --golden none skips the check: ok")

    # A reference of another model: take the built-in one's JSON and change its fingerprint.
    ref = json.load(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "golden",
                                      "SmolLM2-135M-Instruct.Q4_1.json")))
    ref["model_fingerprint"] = "0x0123456789abcdef"
    other = os.path.join(tmp, "other.golden.json")
    json.dump(ref, open(other, "w"))
    rc, log, listened = serve(MODEL, "--golden", other)
    check(not listened and rc == 3 and "the reference is for model 0x0123456789abcdef" in log,
          f"another model's reference: exit {rc}\n{log[-2000:]}")
    rc, log, listened = serve(MODEL, "--golden", os.path.join(tmp, "missing.json"))
    check(not listened and rc == 1 and "--golden: cannot read the golden reference" in log,
          f"a missing reference: exit {rc}\n{log[-2000:]}")
    print("another model's reference: exit 3; a missing file: refused before starting: ok")

    mine = os.path.join(tmp, "mine.golden.json")
    rec = subprocess.run([DUET, "golden", "record", "-m", MODEL, "--out", mine], capture_output=True, text=True)
    check(rec.returncode == 0 and os.path.exists(mine), f"golden record: {rec.stderr}")
    again = subprocess.run([DUET, "golden", "check", "-m", MODEL, "--golden", mine], capture_output=True, text=True)
    check(again.returncode == 0 and "mean 0.000 worst 0.000" in again.stdout,
          f"the model against its own recording: {again.stdout}{again.stderr}")
    refused = subprocess.run([DUET, "golden", "record", "-m", broken, "--from", os.path.join(FIXTURES, "logits.json"),
                              "--out", os.path.join(tmp, "x.json")], capture_output=True, text=True)
    check(refused.returncode == 1 and "nothing written" in refused.stderr and not os.path.exists(os.path.join(tmp, "x.json")),
          f"record --from for the broken copy: {refused.returncode} {refused.stderr}")
    print("duet golden record: its own reference passes exactly; a broken copy's is refused: ok")
finally:
    shutil.rmtree(tmp, ignore_errors=True)
