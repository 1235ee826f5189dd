#!/usr/bin/env python3
"""Contexts on a GPU arena, end to end (ctest label `gpu`; exit 77, skipped, where
there is no GPU or the build has no CUDA).

`duet serve --device cuda:0 --contexts-dir D`: the front keeps the contexts on the
arena's host mirror and copies their blocks to and from device memory
(src/kv/kv_stage.h, CudaKvStage). A context is created, appended to and completed
on; its completion equals `/v1/completions` on the context's tokens (or parts from
it only at a near tie: cuBLAS may pick another algorithm for another batch shape);
an export and its import continue alike; after SIGKILL of every process and a
restart on the same directory the context is listed with its tokens, its KV is read
back from its log through the mirror (restored, not prefilled), and its completion
is the one before the kill.

With two GPUs or more visible (nvidia-smi -L), the same runs on two GPU pairs
(`--device cuda:0,cuda:1`): the store keeps the contexts in GPU 0's arena and every
request of a context is bound to GPU 0's pair (RequestParams::bind_arena), also while
plain prompts keep that pair busier than the other; a context request computed on
GPU 1 would read arena 0's block ids in arena 1, and its text would differ.

Usage: gpu_contexts_test.py path/to/duet
"""
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_test as st  # noqa: E402
import gpu_serve_test as gs  # noqa: E402  (gpu_available, same_or_near_tie; its main() does not run)
from duet_e2e import not_run, skip  # noqa: E402

DUET = sys.argv[1]
INSTANCE = f"duet-gpu-contexts-test-{os.getpid()}"


def ready(port):
    for _ in range(600):
        if st.request(port, "GET", "/ready")[0] == 200:
            return
        time.sleep(0.1)
    st.fail("not ready")


def ok(port, method, path, body=None, want=(200, 201)):
    code, out = st.request(port, method, path, body)
    st.check(code in want, f"{method} {path}: {code} {out[:400]}")
    return json.loads(out) if out else {}


GREEDY = {"max_tokens": 16, "temperature": 0, "commit": False}


def n_gpus():
    """GPUs this process may use: CUDA_VISIBLE_DEVICES when set, else nvidia-smi's list."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return sum(1 for line in r.stdout.splitlines() if line.startswith("GPU ")) if r.returncode == 0 else 0


def while_busy(port, fn):
    """fn() while four plain long prompts keep a pair busy (unbound: the router puts
    them on the shortest queue, so both pairs are loaded in turn)."""
    stop = threading.Event()

    def load():
        while not stop.is_set():
            st.request(port, "POST", "/v1/completions",
                       {"prompt": "Describe the weather in detail. " * 40, "max_tokens": 8, "temperature": 0})

    threads = [threading.Thread(target=load, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        return fn()
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)


def main():
    if not gs.gpu_available():
        skip("gpu", "no CUDA device here (or a build without CUDA)")
    devices = ["cuda:0", "cuda:1"] if n_gpus() > 1 else ["cuda:0"]
    if len(devices) == 1:
        not_run("gpus2", "one GPU: contexts on two GPU pairs")
    device = ",".join(devices)
    cdir = tempfile.mkdtemp(prefix="duet-gpu-contexts-")
    saved = {}

    def first(port, server):
        ready(port)
        j = ok(port, "POST", "/v1/contexts", {"id": "g", "prompt": "The history of the graphics processor began"})
        st.check(j["usage"]["prefilled_tokens"] == j["n_tokens"], f"create: {j}")
        n0 = j["n_tokens"]
        j = ok(port, "POST", "/v1/contexts/g/append", {"prompt": " with arcade machines, and then"})
        st.check(j["usage"]["prefilled_tokens"] == j["n_tokens"] - n0, f"only the appended tokens computed: {j}")
        tokens = ok(port, "GET", "/v1/contexts/g?tokens=true")["tokens"]
        got = ok(port, "POST", "/v1/contexts/g/completions", GREEDY)["choices"][0]["text"]
        gs.same_or_near_tie(port, tokens, {"max_tokens": 16, "temperature": 0}, got, "the context's completion")
        # Export and import: the copy continues as the original.
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/contexts/g/export", timeout=120) as r:
            blob = r.read()
        code, out = st.request(port, "POST", "/v1/contexts/import?id=h", raw=blob)
        st.check(code == 201, f"import: {code} {out[:300]}")
        got_h = ok(port, "POST", "/v1/contexts/h/completions", GREEDY)["choices"][0]["text"]
        st.check(got_h == got, f"the import continues as the original: {got_h!r} != {got!r}")
        if len(devices) > 1:
            # Context work under load on two pairs: every completion and append
            # still computed where the context's blocks are.
            def busy():
                for i in range(3):
                    t = ok(port, "POST", "/v1/contexts/g/completions", GREEDY)["choices"][0]["text"]
                    st.check(t == got, f"under load, completion {i}: {t!r} != {got!r}")
                ok(port, "POST", "/v1/contexts", {"id": "g2", "prompt": "Rivers carry water from the mountains"})
                j = ok(port, "POST", "/v1/contexts/g2/append", {"prompt": " down to the sea, where"})
                t2 = ok(port, "GET", "/v1/contexts/g2?tokens=true")["tokens"]
                c2 = ok(port, "POST", "/v1/contexts/g2/completions", GREEDY)["choices"][0]["text"]
                return j, t2, c2
            j, t2, c2 = while_busy(port, busy)
            gs.same_or_near_tie(port, t2, {"max_tokens": 16, "temperature": 0}, c2, "a context made under load")
            ok(port, "DELETE", "/v1/contexts/g2")
        saved.update(tokens=tokens, text=got)
        # SIGKILL of every process of the instance (the launcher and its roles).
        pids = subprocess.run(["pgrep", "-P", str(server.pid)], capture_output=True, text=True).stdout.split()
        for p in [server.pid, *map(int, pids)]:
            try:
                os.kill(int(p), signal.SIGKILL)
            except ProcessLookupError:
                pass
        server.wait()

    st.serving(INSTANCE, first, ("--device", device, "--contexts-dir", cdir, *gs.M))

    def second(port, server):
        ready(port)
        j = ok(port, "GET", "/v1/contexts/g?tokens=true")
        st.check(j["tokens"] == saved["tokens"] and not j["resident"], f"listed, on disk: {j}")
        j = ok(port, "POST", "/v1/contexts/g/completions", dict(GREEDY, max_tokens=16))
        st.check(j["choices"][0]["text"] == saved["text"], f"after the restart: {j['choices'][0]['text']!r} != "
                                                           f"{saved['text']!r}")
        st.check(j["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(saved["tokens"]) - 1,
                 f"restored from the log, not prefilled: {j['usage']}")

    st.serving(INSTANCE + "-2", second, ("--device", device, "--contexts-dir", cdir, *gs.M))
    subprocess.run(["rm", "-rf", cdir])
    print(f"contexts on a GPU arena ({device}): create, append, completion, export/import, SIGKILL and restore: ok")


if __name__ == "__main__":
    main()
