#!/usr/bin/env python3
"""Cores lent between roles (duet serve's default, --no-lend-cores turns it off;
WorkerOptions::borrow_cpus) on
the real model: with one worker of each role, decode computes on prefill's cores too
while prefill holds no request, and prefill on decode's while decode holds none.
A decode-only load (one long greedy generation) and a prefill-only load (a long
prompt, one token) each borrow the other role's cores (duet_worker_borrowed_*), and
a mixed load (streams decoding while long prompts arrive) gives every core back:
every text, greedy, equals the same request's on a server without lending (the
kernels' results do not depend on the thread count). Prints tokens per second of
both loads with and without lending (not asserted: a CI machine's other tests share
the cores; bench/RESULTS.md has the measured figures).

Usage: lend_cores_test.py path/to/duet
"""
import json
import os
import re
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_test as st  # noqa: E402

DUET = sys.argv[1]
N_DECODE = 64 if os.environ.get("DUET_E2E_SUBSET") else 160


def metric(port, name, role):
    m = re.search(rf'^{name}{{role="{role}",worker="0"}} ([0-9.e+-]+)', st.request(port, "GET", "/metrics")[1], re.M)
    return float(m.group(1)) if m else None


def loads(port):
    """(decode tokens/s, prefill seconds of a long prompt, texts) on an idle server."""
    long_prompt = " ".join(f"w{i % 50}" for i in range(120))  # about 300 tokens
    texts = []
    first, times = [], []

    def progress(_):
        times.append(time.time())

    text, _ = st.stream(port, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": N_DECODE,
                                                  "temperature": 0, "ignore_eos": True, "stream": True}, progress)
    texts.append(text)
    decode_tps = (len(times) - 2) / (times[-1] - times[1]) if len(times) > 3 else 0.0
    t0 = time.time()
    code, body = st.request(port, "POST", "/v1/completions", {"prompt": long_prompt, "max_tokens": 1, "temperature": 0})
    prefill_s = time.time() - t0
    st.check(code == 200, f"the long prompt: {code} {body}")
    texts.append(json.loads(body)["choices"][0]["text"])
    # Mixed: two streams decode while long prompts are prefilled.
    got = [None] * 4

    def one(i):
        if i < 2:
            got[i] = st.stream(port, "/v1/completions", {"prompt": f"Story {i}:", "max_tokens": 48, "temperature": 0,
                                                         "ignore_eos": True, "stream": True})[0]
        else:
            time.sleep(0.3)
            c, b = st.request(port, "POST", "/v1/completions", {"prompt": f"{i} " + long_prompt, "max_tokens": 4,
                                                                "temperature": 0})
            st.check(c == 200, f"mixed {i}: {c} {b}")
            got[i] = json.loads(b)["choices"][0]["text"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    texts += got
    return decode_tps, prefill_s, texts


def main():
    results = {}

    def lending(port, server):
        results["lend"] = loads(port)
        dec = metric(port, "duet_worker_borrowed_cores_total", "decode")
        pre = metric(port, "duet_worker_borrowed_cores_total", "prefill")
        dec_s = metric(port, "duet_worker_borrowed_seconds_total", "decode")
        pre_s = metric(port, "duet_worker_borrowed_seconds_total", "prefill")
        st.check(dec and dec >= 1 and dec_s > 0, f"decode borrowed prefill's cores: {dec} times, {dec_s} s")
        st.check(pre and pre >= 1 and pre_s > 0, f"prefill borrowed decode's cores: {pre} times, {pre_s} s")
        results["borrowed"] = (dec, dec_s, pre, pre_s)

    def plain(port, server):
        results["plain"] = loads(port)
        st.check(not metric(port, "duet_worker_borrowed_cores_total", "decode"), "no lending with --no-lend-cores")

    st.serving(f"duet-lend-test-{os.getpid()}", lending)  # the default
    st.serving(f"duet-lend-plain-{os.getpid()}", plain, ("--no-lend-cores",))
    lend, plain_r = results["lend"], results["plain"]
    st.check(lend[2] == plain_r[2], f"texts differ with lending:\n{lend[2]}\n{plain_r[2]}")
    dec, dec_s, pre, pre_s = results["borrowed"]
    print(f"lent cores: decode took prefill's {int(dec)} times ({dec_s:.2f} s), prefill took decode's {int(pre)} times "
          f"({pre_s:.2f} s); every text identical to a server without lending")
    print(f"decode-only: {lend[0]:.1f} tokens/s lending, {plain_r[0]:.1f} without ({lend[0] / plain_r[0]:.2f}x); "
          f"a 300-token prompt: {lend[1]:.2f} s lending, {plain_r[1]:.2f} s without ({plain_r[1] / lend[1]:.2f}x)")


if __name__ == "__main__":
    main()
