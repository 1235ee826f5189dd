#!/usr/bin/env python3
"""Cores lent between roles (duet serve's default, --no-lend-cores turns it off;
WorkerOptions::borrow_cpus) on
the real model: with one worker of each role, decode computes on prefill's cores too
while prefill holds no request, and prefill on decode's while decode holds none.
A decode-only load (one long greedy generation) and a prefill-only load (a long
prompt, one token) each borrow the other role's cores (duet_worker_borrowed_*), and
a mixed load (streams decoding while long prompts arrive) gives every core back,
but to a critical prompt's passes, which claim decode's cores (decode steps aside,
duet_worker_yielded_*), and (with a tight standard TTFT target) to prompts that
would miss it on prefill's core alone while the streams are ahead of their pace:
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


def metric(port, name, role, extra=""):
    m = re.search(rf'^{name}{{role="{role}",worker="0"{extra}}} ([0-9.e+-]+)', st.request(port, "GET", "/metrics")[1],
                  re.M)
    return float(m.group(1)) if m else None


def missed(port):
    """Prefill's claims that got no cores, by why (for a failure's message)."""
    return {why: metric(port, "duet_worker_claims_missed_total", "prefill", f',why="{why}"')
            for why in ("declined", "unanswered")}


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
    mixed_texts, critical_s = mixed(port, long_prompt)
    return decode_tps, prefill_s, texts + mixed_texts, critical_s


def mixed(port, long_prompt, critical=True):
    """Streams decode while long prompts are prefilled, one of them critical (its
    passes claim decode's cores: decode steps aside; WorkerBase::claim_cores) unless
    `critical` is false. (texts, the critical prompt's latency)."""
    got = [None] * 6
    critical_s = [0.0]

    def one(i):
        if i < 2 or i == 5:  # stream 5 runs long: decode holds work whenever the critical prompt is computed
            got[i] = st.stream(port, "/v1/completions", {"prompt": f"Story {i}:", "max_tokens": 48 if i < 2 else 400,
                                                         "temperature": 0, "ignore_eos": True, "stream": True})[0]
        else:
            time.sleep(0.3 if i < 4 else 0.6)
            body = {"prompt": f"{i} " + long_prompt, "max_tokens": 4, "temperature": 0}
            if i == 4 and critical:
                body["priority"] = "critical"
            t0 = time.time()
            c, b = st.request(port, "POST", "/v1/completions", body)
            if i == 4:
                critical_s[0] = time.time() - t0
            st.check(c == 200, f"mixed {i}: {c} {b}")
            got[i] = json.loads(b)["choices"][0]["text"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return got, critical_s[0]


def risk_slo(decode_tps, prefill_s):
    """(--slo, --prefill-pass-ms) for the server with prompts at risk, from a 300-token
    prompt's time on one core and the tokens per second of one stream (on the server
    without lending, measured just before). The TTFT target: 0.7 of the prompt's time,
    so that it misses it on prefill's core alone. The inter-token target (and the
    pass cut with it): long enough for a claimed pass of the prompt's fifth in 3/4 of
    it (decode's yield budget is capped at 2 s, so a pass at 1.5 s: kClaimMinTokens,
    16, need at least 11 tokens a second), and for kClaimSteps (4) of decode's
    steps (about 10 of one stream's tokens); at least 250 ms. On the 2-core CI machine
    (2026-12-04): 0.92 s and 143 tokens/s, 645 ms / 461 ms; under ASan 7.9 s and 19
    tokens/s, 5555 ms / 3968 ms."""
    ttft_ms = max(200, int(700 * prefill_s))
    itl_ms = max(250, int(10_000 / max(decode_tps, 1.0)), int(500 * prefill_s))
    return f"standard={ttft_ms}ms/{itl_ms}ms", itl_ms


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
        # The critical prompt arrived while decode held streams: its passes claimed
        # decode's cores, and decode stepped aside for them.
        yields = metric(port, "duet_worker_yielded_cores_total", "decode")
        yield_s = metric(port, "duet_worker_yielded_seconds_total", "decode")
        if not (yields and yields >= 1 and yield_s > 0):
            st.check(False, f"decode stepped aside for critical passes: {yields} times (claims missed: {missed(port)})")
        results["borrowed"] = (dec, dec_s, pre, pre_s, yields, yield_s)

    def plain(port, server):
        results["plain"] = loads(port)
        st.check(not metric(port, "duet_worker_borrowed_cores_total", "decode"), "no lending with --no-lend-cores")
        st.check(not metric(port, "duet_worker_yielded_cores_total", "decode"), "no claims with --no-lend-cores")

    def at_risk(port, server):
        # A standard TTFT target under the 300-token prompt's time on one core (0.7
        # of it): the prompts are at risk from the start, and claim
        # decode's cores while its streams are ahead of their inter-token target
        # (C6); nothing here is critical. The targets are scaled from the server
        # without lending (risk_slo), so that they hold under sanitizers too.
        long_prompt = " ".join(f"w{i % 50}" for i in range(120))
        # Prefill's rate is measured first (kRateEvidenceTokens: 2048 prompt tokens);
        # without it no prompt is known to be at risk.
        warm = [threading.Thread(target=st.request, args=(port, "POST", "/v1/completions",
                                                          {"prompt": f"warm {i} " + long_prompt, "max_tokens": 1}))
                for i in range(8)]
        for t in warm:
            t.start()
        for t in warm:
            t.join()
        # Up to three tries: decode rightly declines a claim while its streams are not
        # ahead of their pace (C6), which a machine loaded by other tests can make
        # them (2026-12-04, the release suite at -j2 beside serve_e2e: 2 declined, 0
        # yields; alone it passed). A broken claim path yields in none of them.
        results["risk"] = []
        for attempt in range(3):
            texts, _ = mixed(port, long_prompt, critical=False)
            results["risk"].append(texts)
            yields = metric(port, "duet_worker_yielded_cores_total", "decode")
            if yields and yields >= 1:
                break
            print(f"try {attempt + 1}: no yield for prompts at risk (claims missed: {missed(port)})")
        if not (yields and yields >= 1):
            st.check(False, f"decode stepped aside for prompts at risk: {yields} times in 3 tries "
                     f"(targets {results['risk_slo']}; claims missed: {missed(port)})")
        results["risk_yields"] = yields

    st.serving(f"duet-lend-test-{os.getpid()}", lending)  # the default
    st.serving(f"duet-lend-plain-{os.getpid()}", plain, ("--no-lend-cores",))
    results["risk_slo"] = risk_slo(*results["plain"][:2])
    st.serving(f"duet-lend-risk-{os.getpid()}", at_risk, ("--slo", results["risk_slo"][0],
                                                          "--prefill-pass-ms", str(results["risk_slo"][1])))
    lend, plain_r = results["lend"], results["plain"]
    st.check(lend[2] == plain_r[2], f"texts differ with lending:\n{lend[2]}\n{plain_r[2]}")
    # The same requests but for the critical class of one (sampling does not depend on it).
    for texts in results["risk"]:
        st.check(texts == plain_r[2][-6:], f"texts differ with claims for prompts at risk:\n{texts}\n{plain_r[2][-6:]}")
    dec, dec_s, pre, pre_s, yields, yield_s = results["borrowed"]
    print(f"lent cores: decode took prefill's {int(dec)} times ({dec_s:.2f} s), prefill took decode's {int(pre)} times "
          f"({pre_s:.2f} s); decode stepped aside for critical passes {int(yields)} times ({yield_s:.2f} s); every "
          f"text identical to a server without lending")
    print(f"the critical 300-token prompt among streams: {lend[3]:.2f} s lending, {plain_r[3]:.2f} s without; "
          f"decode stepped aside {int(results['risk_yields'])} times for standard prompts at risk "
          f"(targets {results['risk_slo'][0]})")
    print(f"decode-only: {lend[0]:.1f} tokens/s lending, {plain_r[0]:.1f} without ({lend[0] / plain_r[0]:.2f}x); "
          f"a 300-token prompt: {lend[1]:.2f} s lending, {plain_r[1]:.2f} s without ({plain_r[1] / lend[1]:.2f}x)")


if __name__ == "__main__":
    main()
