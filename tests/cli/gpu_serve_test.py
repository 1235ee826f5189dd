#!/usr/bin/env python3
"""`duet serve --device cuda:0` end to end (ctest label `gpu`; exit 77, skipped,
where there is no GPU or the build has no CUDA).

Prefill and decode are two processes on one GPU sharing its KV arena (device memory
created by the first worker, its fd kept by the launcher's fd keeper): greedy
completions equal `duet run --device cuda:0` in one process; 12 concurrent streams
give the texts of undisturbed requests; a decode worker SIGKILLed while it holds
streams loses nothing (the arena outlives it, its requests are re-driven); every KV
block comes back; SIGTERM stops it all and leaves nothing in /dev/shm. The same with
legacy CUDA IPC sharing, and with per-role arenas on the one GPU (prefill's and
decode's, each hand-off copied between them layer by layer: the path of a hand-off
between two GPUs, which needs a second GPU to run for real), and those per-role
arenas with an int8 KV cache. Requests with a logit_bias, a min_tokens or a JSON
schema, sampled on the device, give the host sampler's tokens.

"The same text" on a GPU: cuBLAS may pick another algorithm for another batch size
(a batch of 12 against a batch of 1), so logits differ in the last bits and a greedy
choice between two nearly tied tokens may go the other way. A text that parts from
the reference is accepted only where the reference's two best tokens at that point
are within 0.3 in log-probability (a near tie), never otherwise.

Usage: gpu_serve_test.py path/to/duet
"""
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_test as st  # noqa: E402  (helpers; its main() does not run on import)
from duet_e2e import not_run, skip  # noqa: E402

DUET = sys.argv[1]
INSTANCE = f"duet-gpu-serve-test-{os.getpid()}"
MODEL = os.environ.get("DUET_MODEL")  # the tests' model (ctest sets it); else duet's default
M = ["-m", MODEL] if MODEL else []


def gpu_available():
    r = subprocess.run([DUET, "run", "--device", "cuda:0", "-p", "Hi", "-n", "1", *M], capture_output=True, text=True)
    if r.returncode == 0:
        return True
    for why in ("no such device", "built without CUDA"):
        if why in r.stderr:
            print(f"skipped: {r.stderr.strip()}")
            return False
    st.fail(f"duet run --device cuda:0 failed: {r.stderr[-800:]}")


def same_or_near_tie(port, prompt, params, got, what):
    """got must be the text of an undisturbed request, or part from it at a near tie."""
    code, body = st.request(port, "POST", "/v1/completions", dict(params, prompt=prompt, logprobs=2))
    st.check(code == 200, f"reference completion: {code} {body}")
    c = json.loads(body)["choices"][0]
    want = c["text"]
    if got == want:
        return True
    a, b = got.encode(), want.encode()
    k = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), min(len(a), len(b)))
    offsets = c["logprobs"]["text_offset"]
    i = max([j for j, off in enumerate(offsets) if off <= k] or [0])
    top = sorted(c["logprobs"]["top_logprobs"][i].values(), reverse=True)
    margin = top[0] - top[1] if len(top) > 1 else float("inf")
    st.check(margin < 0.3, f"{what}: {got!r} parts from {want!r} at token {i}, where the margin is {margin:.3f}")
    print(f"{what}: parts from the reference at token {i}, a near tie (margin {margin:.3f})")
    return False


def constrained_on_device(port):
    """Decode samples a request with a logit_bias, a min_tokens not yet reached or a
    JSON schema on the device (the bias and bans as edits, the grammar's mask as a
    bitset; no logits copied); asking for log-probabilities sends the same request's
    rows to the host sampler instead. Both must give the same tokens: greedy and
    seeded, one request at a time (the same pass sizes, so the same logits)."""
    def tokenize(text):
        code, body = st.request(port, "POST", "/tokenize", {"prompt": text, "add_special_tokens": False})
        st.check(code == 200, f"tokenize: {code} {body}")
        return json.loads(body)["tokens"]

    prompt = "The capital of France is"
    code, body = st.request(port, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0})
    st.check(code == 200, f"completion: {code} {body}")
    first = tokenize(json.loads(body)["choices"][0]["text"])[0]
    blue = tokenize(" blue")[0]
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "people": {"type": "integer"}},
              "required": ["city", "people"], "additionalProperties": False}
    cases = [
        ("/v1/completions", {"prompt": prompt, "max_tokens": 12, "logit_bias": {str(first): -100}}),
        ("/v1/completions", {"prompt": prompt, "max_tokens": 12, "logit_bias": {str(blue): 100}}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 24,
                                  "min_tokens": 16}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Paris as JSON."}], "max_tokens": 48,
                                  "response_format": {"type": "json_schema",
                                                      "json_schema": {"name": "city", "schema": schema}}}),
    ]
    for path, body in cases:
        for sampling in ({"temperature": 0}, {"temperature": 0.8, "seed": 7}):
            req = dict(body, **sampling)
            host = dict(req, logprobs=1) if path == "/v1/completions" else dict(req, logprobs=True, top_logprobs=1)
            texts = []
            for r in (req, host):
                code, out = st.request(port, "POST", path, r)
                st.check(code == 200, f"{path} {r}: {code} {out}")
                ch = json.loads(out)["choices"][0]
                texts.append((ch["text"] if "text" in ch else ch["message"]["content"], ch["finish_reason"]))
            st.check(texts[0] == texts[1], f"{path} {req}: the device's {texts[0]!r} != the host's {texts[1]!r}")
    print(f"logit_bias, min_tokens and a JSON schema sampled on the device: the host sampler's tokens "
          f"({2 * len(cases)} requests): ok")


def on_gpu(port, server, instance=INSTANCE, weights_shared=True, n_arenas=1, decode_on="cuda:0", kv_dtype="f16"):
    for _ in range(600):
        if st.request(port, "GET", "/ready")[0] == 200:
            break
        time.sleep(0.1)
    st.check(st.request(port, "GET", "/ready")[0] == 200, "ready")
    # Both workers on the GPU, with one copy of the weights between them (where the
    # GPU can export device memory as an fd; the legacy IPC mode is for GPUs that
    # cannot, where each keeps a private copy and says so).
    said = "".join(server.early_lines)
    for role, dev in (("prefill", "cuda:0"), ("decode", decode_on)):
        st.check(re.search(rf"duet {role}: {dev} ", said), f"{role} is not on {dev}: {said[-1500:]}")
        if weights_shared and decode_on == "cuda:0":
            st.check(re.search(rf"duet {role}: {dev} .*\(shared on the GPU\)", said),
                     f"{role} does not say it uses the shared weights: {said[-1500:]}")

    def procs():
        return json.loads(subprocess.run([DUET, "shm", "status", instance, "--json"], capture_output=True, text=True,
                                         check=True).stdout)

    st.check(len(procs()["arenas"]) == n_arenas, f"arenas: {procs()['arenas']}")
    st.check(procs()["kv_dtype"] == kv_dtype, f"kv_dtype {procs()['kv_dtype']}")
    # Two processes on one GPU give one process's greedy text.
    for prompt in ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"):
        code, body = st.request(port, "POST", "/v1/completions",
                                {"prompt": prompt, "max_tokens": 32, "temperature": 0, "ignore_eos": True})
        st.check(code == 200, f"completion: {code} {body}")
        text = json.loads(body)["choices"][0]["text"]
        run = subprocess.run([DUET, "run", "--device", "cuda:0", "-p", prompt, "-n", "32", "--temperature", "0",
                              "--ignore-eos", "--kv-dtype", kv_dtype, *M], capture_output=True, text=True,
                             check=True).stdout
        # One sequence on both sides (batch 1, graph bucket 1): the same kernels, the same text.
        st.check(text == run[:-1], f"{prompt!r}: server {text!r} != duet run {run[:-1]!r}")
    print("greedy completions on the GPU (prefill and decode processes) equal duet run --device cuda:0: ok")
    if instance == INSTANCE:
        constrained_on_device(port)

    # Concurrent streams, and a decode worker killed while it holds them.
    prompts = [f"Story {i}: the shared arena on the GPU holds every block, and" for i in range(12)]
    params = {"max_tokens": 48, "temperature": 0, "ignore_eos": True}
    threads, got, started = st.start_streams(port, prompts, params, lambda txt: len(txt) > 10)
    st.check(started.wait(120), "no stream started")
    victim = None
    for _ in range(500):
        busy = [p for p in procs()["processes"] if p["role"] == "decode" and p["load_items"] > 0]
        if busy:
            victim = busy[0]
            break
        time.sleep(0.01)
    st.check(victim, "no decode worker held a sequence")
    os.kill(victim["pid"], signal.SIGKILL)
    for t in threads:
        t.join(300)
    st.check(all(g is not None and not g.startswith("error:") for g in got), f"streams: {got}")
    parted = sum(not same_or_near_tie(port, p, params, g, f"stream {i}") for i, (p, g) in enumerate(zip(prompts, got)))
    st.check(parted <= 2, f"{parted} of {len(prompts)} streams parted from the reference (near ties, but so many?)")
    restarts = st.counter(port, "duet_worker_restarts_total")
    st.check(restarts == 1, f"restarts {restarts}")
    for _ in range(100):
        arenas = procs()["arenas"]
        if all(a["held"] == 0 for a in arenas):
            break
        time.sleep(0.05)
    st.check(all(a["held"] == 0 and a["free"] + a["cached"] == a["blocks"] for a in arenas), f"arena: {arenas}")
    print("12 streams, decode SIGKILLed mid-stream: the undisturbed texts (or parting at a near tie), KV blocks all back: ok")

    server.send_signal(signal.SIGTERM)
    st.check(server.wait(60) == 0, f"exit status {server.returncode} after SIGTERM")
    left = [f for f in os.listdir("/dev/shm") if instance in f]
    st.check(not left, f"left in /dev/shm: {left}")
    print("SIGTERM: clean exit, nothing left: ok")


def main():
    if not gpu_available():
        skip("gpu", "no CUDA device here (or a build without CUDA)")
    st.serving(INSTANCE, on_gpu, ("--device", "cuda:0", *M))
    # The same with the legacy sharing (cudaIpc handles, the arena held by the launcher).
    os.environ["DUET_KV_SHARING"] = "ipc"
    ipc = INSTANCE + "-ipc"
    st.serving(ipc, lambda port, server: on_gpu(port, server, ipc, weights_shared=False), ("--device", "cuda:0", *M))
    print("the same with legacy CUDA IPC sharing: ok")
    # Per-role arenas on one GPU: prefill and decode each with an arena of its own,
    # every hand-off copying the request's KV device to device, layer by layer, as
    # the pass that ends the prompt writes it (the path of a hand-off between GPUs).
    del os.environ["DUET_KV_SHARING"]
    split = INSTANCE + "-split"
    st.serving(split, lambda port, server: on_gpu(port, server, split, n_arenas=2),
               ("--device", "cuda:0,cuda:0", "--kv-arenas", "per-role", *M))
    print("the same with per-role arenas on one GPU (hand-offs copied device to device): ok")
    # An int8 KV cache (a scale per token and head row), hand-offs copying the
    # quantized blocks and their scales.
    q8 = INSTANCE + "-int8"
    st.serving(q8, lambda port, server: on_gpu(port, server, q8, n_arenas=2, kv_dtype="int8"),
               ("--device", "cuda:0,cuda:0", "--kv-arenas", "per-role", "--kv-dtype", "int8", *M))
    print("the same with an int8 KV cache: ok")
    # Under CUDA MPS (--mps): the launcher's own control daemon, in a private
    # directory of its own; the roles' CUDA contexts open under its server
    # (server.log appears there while serving), the same checks hold, and at exit the
    # daemon has ended and its directory is gone.
    if shutil.which("nvidia-cuda-mps-control"):
        mps = INSTANCE + "-mps"
        pattern = os.path.join(tempfile.gettempdir(), f"duet-mps-{mps}-*")
        seen = {}

        def server_log_while_serving(port, server):
            for _ in range(600):
                if st.request(port, "GET", "/ready")[0] == 200:
                    break
                time.sleep(0.1)
            homes = glob.glob(pattern)
            st.check(len(homes) == 1, f"--mps: the daemon's directory: {homes}")
            # A completion, so that both roles have opened their contexts.
            code, _ = st.request(port, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
            st.check(code == 200, f"--mps: completion {code}")
            logs = os.listdir(os.path.join(homes[0], "log"))
            st.check("server.log" in logs, f"--mps: no MPS server started (its logs: {logs})")
            seen["home"] = homes[0]
            on_gpu(port, server, mps)

        st.serving(mps, server_log_while_serving, ("--device", "cuda:0", "--mps", *M))
        st.check(not os.path.exists(seen["home"]), f"--mps: {seen['home']} left after exit")
        st.check(not glob.glob(pattern), f"--mps: left after exit: {glob.glob(pattern)}")
        print("the same under CUDA MPS (--mps): its server ran the roles; daemon and directory gone at exit: ok")
    else:
        not_run("mps", "no nvidia-cuda-mps-control here: --mps")
    # Two GPUs: prefill on cuda:0, decode on cuda:1, each hand-off copied over NVLink
    # (or staged through host memory without peer access).
    if subprocess.run([DUET, "run", "--device", "cuda:1", "-p", "Hi", "-n", "1", *M], capture_output=True).returncode == 0:
        two = INSTANCE + "-two"
        st.serving(two, lambda port, server: on_gpu(port, server, two, n_arenas=2, decode_on="cuda:1"),
                   ("--device", "cuda:0,cuda:1", "--kv-arenas", "per-role", *M))
        print("per-role arenas on two GPUs (prefill cuda:0, decode cuda:1): ok")
    else:
        not_run("gpus2", "one GPU: the hand-off between two GPUs")


if __name__ == "__main__":
    main()
