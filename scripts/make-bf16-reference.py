#!/usr/bin/env python3
"""Write tests/fixtures/bf16_weights.json: every tensor of the default model
dequantized by gguf-py (gguf.quants.dequantize, independent of duet's kernels) and
rounded to bf16 (round to nearest even), as a SHA-256 of the little-endian bf16
bytes, with a few sampled values to tell a rounding difference from a wrong value.

    $(scripts/python-env) scripts/make-bf16-reference.py \
        --model models/SmolLM2-135M-Instruct.Q4_1.gguf --out tests/fixtures/bf16_weights.json
"""

import argparse
import hashlib
import json

import gguf
import numpy as np


def to_bf16(f32: np.ndarray) -> np.ndarray:
    u = np.ascontiguousarray(f32, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    r = gguf.GGUFReader(a.model)
    out = {"model": a.model.split("/")[-1], "gguf": gguf.__version__ if hasattr(gguf, "__version__") else "0.19.0",
           "tensors": {}}
    for t in r.tensors:
        f32 = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(-1)
        b = to_bf16(f32)
        if np.isnan(f32).any():
            raise SystemExit(f"{t.name}: NaN")
        step = max(1, b.size // 8)
        out["tensors"][t.name] = {
            "type": t.tensor_type.name,
            "n": int(b.size),
            "sha256": hashlib.sha256(b.astype("<u2").tobytes()).hexdigest(),
            "samples": [[int(i), int(b[i])] for i in range(0, b.size, step)][:8],
        }
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"{len(out['tensors'])} tensors -> {a.out}")


if __name__ == "__main__":
    main()
