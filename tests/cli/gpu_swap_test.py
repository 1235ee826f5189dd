#!/usr/bin/env python3
"""Preemption on a GPU arena, by swap and by recompute (ctest label `gpu`; exit 77,
skipped, where there is no GPU or the build has no CUDA).

`duet serve --device cuda:0 --kv-blocks 24`: an arena of 384 tokens and four greedy
requests that need 45 blocks together. Decode preempts instead of failing. With a
swap root (the default) the victims' KV goes device -> page-locked host -> a blob
and back (kv/kv_stage.h staged_blob_write / staged_blob_import): at least one swap,
swapped bytes counted, no blob left behind. Its prefill rate is not measured yet
when the four run (under 2048 prompt tokens), so choose_preemption picks swap. With
`--swap-root ""`, recompute only. No request fails; every text equals the same
request run alone, or parts from it at a near tie (cuBLAS may pick another algorithm
for another batch shape: gpu_serve_test.same_or_near_tie).

Usage: gpu_swap_test.py path/to/duet
"""
import json
import os
import re
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_test as st  # noqa: E402
import gpu_serve_test as gs  # noqa: E402  (gpu_available, same_or_near_tie, M)
from duet_e2e import skip  # noqa: E402

DUET = sys.argv[1]
INSTANCE = f"duet-gpu-swap-test-{os.getpid()}"


def metric(port, name):
    code, text = st.request(port, "GET", "/metrics")
    st.check(code == 200, f"/metrics: {code}")
    m = re.search("^" + re.escape(name) + r" ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def prompt_ids(seed, n):
    return [100 + (seed * 7919 + k * 31) % 30000 for k in range(n)]


def pressure(swap):
    mode = "swap" if swap else "recompute"
    swap_dir = f"/var/tmp/duet-swap-{INSTANCE}-{mode}"

    def test(port, server):
        params = {"max_tokens": 140, "ignore_eos": True, "temperature": 0}
        prompts = [prompt_ids(300 + i, 40) for i in range(4)]
        results = [None] * 4

        def one(i):
            results[i] = st.request(port, "POST", "/v1/completions", dict(params, prompt=prompts[i]))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        t0 = time.time()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.time() - t0
        for i, (code, body) in enumerate(results):
            st.check(code == 200, f"request {i} under KV pressure: {code} {body[:300]}")
        n = metric(port, f'duet_requests_preempted_total{{mode="{mode}"}}')
        other = metric(port, 'duet_requests_preempted_total{mode="%s"}' % ("recompute" if swap else "swap"))
        st.check(n >= 1, f"no preemption by {mode} ({n}; {other} by the other mode): the arena was not small enough")
        if swap:
            st.check(metric(port, "duet_swapped_bytes_total") > 0, "swapped bytes are counted")
            left = [f for f in os.listdir(swap_dir) if f.endswith(".kvblob")]
            st.check(not left, f"every swapped blob was read back and removed: {left}")
        else:
            st.check(other == 0, f"swapping is off, yet {other} swaps")
        st.check(metric(port, "duet_requests_failed_total") == 0, "no request failed")
        # Each alone, on the same server, after the pressure: the reference.
        for i, (code, body) in enumerate(results):
            got = json.loads(body)["choices"][0]["text"]
            gs.same_or_near_tie(port, prompts[i], params, got, f"request {i} preempted by {mode}")
        print(f"GPU KV pressure: {int(n)} preemptions by {mode}, no failure, outputs as run alone ({wall:.2f} s)")
        # SIGTERM: the launcher drains and removes its swap directory (serving's
        # SIGKILL, for a server still running, would leave it).
        server.terminate()
        st.check(server.wait(timeout=60) == 0, "SIGTERM: a clean exit")

    st.serving(INSTANCE + "-" + mode, test,
               ("--device", "cuda:0", "--kv-blocks", "24", "--slots", "8", "--admit-kv", "0",
                *(["--swap-root", "/var/tmp"] if swap else ["--swap-root", ""]), *gs.M))
    st.check(not os.path.exists(swap_dir), f"the launcher removed its swap directory {swap_dir}")


def main():
    if not gs.gpu_available():
        skip("gpu", "no CUDA device here (or a build without CUDA)")
    pressure(swap=True)
    pressure(swap=False)
    print("preemption on a GPU arena, by swap through page-locked host memory and by recompute: ok")


if __name__ == "__main__":
    main()
