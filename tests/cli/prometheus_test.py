#!/usr/bin/env python3
"""/metrics as a Prometheus user sees it: the exact Content-Type of the text format,
`promtool check metrics` silent on the page (HELP and TYPE on every family, names,
buckets), then a real `prometheus` (Debian's package) scraping `duet serve` once a
second: the target is up with no scrape error, and duet's counters and histogram
buckets read back through Prometheus' HTTP API, `le` bounds as written ("5e-06").

Usage: prometheus_test.py path/to/duet
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

from duet_e2e import check, check_restarts, drain, free_port, listening_port

DUET = sys.argv[1]


def get(url, timeout=60):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.headers, r.read().decode()


for tool in ("prometheus", "promtool"):
    check(shutil.which(tool), f"{tool} not found (scripts/install-deps installs Debian's prometheus)")

tmp = tempfile.mkdtemp(prefix="duet-prometheus-test-")
inst = f"duet-prom-test-{os.getpid()}"
serve = subprocess.Popen([DUET, "serve", "--port", "0", "--ctx", "256", "--slots", "4", "--instance", inst,
                          "--contexts-dir", os.path.join(tmp, "contexts")], stderr=subprocess.PIPE, text=True)
prom = None
try:
    port = listening_port(serve)
    check(port, "the server exited before listening")
    drain(serve)
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):  # /ready: the workers are up
        try:
            if get(base + "/ready")[0] == 200:
                break
        except Exception:
            pass
        time.sleep(0.2)
    req = urllib.request.Request(base + "/v1/completions", method="POST", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"prompt": "The capital of France is", "max_tokens": 4,
                                                  "temperature": 0}).encode())
    with urllib.request.urlopen(req, timeout=120) as r:
        check(r.status == 200, f"a completion: {r.status}")

    st, headers, page = get(base + "/metrics")
    check(st == 200 and headers.get("Content-Type") == "text/plain; version=0.0.4",
          f"/metrics Content-Type: {headers.get('Content-Type')!r}")
    lint = subprocess.run(["promtool", "check", "metrics"], input=page, capture_output=True, text=True)
    check(lint.returncode == 0 and not lint.stdout.strip() and not lint.stderr.strip(),
          f"promtool check metrics ({lint.returncode}):\n{lint.stdout}{lint.stderr}")
    check('le="5e-06"' in page and "4.9999" not in page, "bucket bounds as written")
    print("content type, promtool check metrics: ok")

    prom_port = free_port()
    with open(os.path.join(tmp, "prometheus.yml"), "w") as f:
        f.write(f"global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
                f"scrape_configs:\n  - job_name: duet\n    static_configs:\n      - targets: ['127.0.0.1:{port}']\n")
    prom = subprocess.Popen(["prometheus", f"--config.file={tmp}/prometheus.yml", f"--storage.tsdb.path={tmp}/tsdb",
                             f"--web.listen-address=127.0.0.1:{prom_port}"],
                            stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, "prometheus.log"), "w"))
    api = f"http://127.0.0.1:{prom_port}/api/v1"

    def query(q):
        try:
            st, _, body = get(f"{api}/query?query={urllib.parse.quote(q)}", timeout=5)
        except Exception:
            return None
        j = json.loads(body)
        return j["data"]["result"] if j.get("status") == "success" else None

    deadline = time.time() + 90
    requests = None
    while time.time() < deadline:
        r = query("duet_requests_total")
        if r:
            requests = float(r[0]["value"][1])
            break
        time.sleep(0.5)
    check(requests is not None and requests >= 1,
          f"duet_requests_total through Prometheus: {requests}\n{open(os.path.join(tmp, 'prometheus.log')).read()[-2000:]}")
    targets = json.loads(get(f"{api}/targets")[2])["data"]["activeTargets"]
    check(len(targets) == 1 and targets[0]["health"] == "up" and not targets[0]["lastError"],
          f"the scrape target: {targets}")
    ttft = query('duet_time_to_first_token_seconds_count')
    check(ttft and float(ttft[0]["value"][1]) >= 1, f"the TTFT histogram's count: {ttft}")
    bucket = query('duet_time_to_first_token_seconds_bucket{le="5e-06"}')
    check(bucket and len(bucket) == 1, f"the 5e-06 bucket by its written bound: {bucket}")
    top = query('duet_time_to_first_token_seconds_bucket{le="+Inf"}')
    check(top and float(top[0]["value"][1]) >= 1, f"the +Inf bucket: {top}")
    q = query('histogram_quantile(0.5, duet_time_to_first_token_seconds_bucket)')
    check(q and 0 < float(q[0]["value"][1]) < 100, f"histogram_quantile over duet's buckets: {q}")
    ctx = query('duet_contexts')
    check(ctx and {s["metric"]["state"] for s in ctx} == {"resident", "on_disk"}, f"duet_contexts: {ctx}")
    print(f"prometheus scraping duet serve: ok (requests {requests:.0f}, TTFT median {float(q[0]['value'][1]):.3f} s)")
    check_restarts(port, 0)
finally:
    if prom:
        prom.terminate()
        try:
            prom.wait(30)
        except subprocess.TimeoutExpired:
            prom.kill()
    serve.send_signal(signal.SIGTERM)
    try:
        serve.wait(60)
    except subprocess.TimeoutExpired:
        serve.kill()
    shutil.rmtree(tmp, ignore_errors=True)
