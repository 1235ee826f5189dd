#!/usr/bin/env python3
"""Write a smaller copy of a Llama-family GGUF for GPU checks: its first N layers
(tokenizer, metadata, embeddings, output head and tensor types unchanged; the block
count set to N). The default model is 98 MB; its first 12 layers, 59 MB, fit what a
session can carry to a lent GPU machine, which has no network to fetch the model.
The GPU tests compare the CUDA backend with the CPU backend on the same file, so
any Llama-family model serves; this one is the default model's own weights.

    $(scripts/python-env) scripts/make-gpu-check-model.py \\
        --model models/SmolLM2-135M-Instruct.Q4_1.gguf --layers 12 \\
        --out models/gpu-check/SmolLM2-135M-Instruct.Q4_1.first12.gguf
    MODEL=models/gpu-check/SmolLM2-135M-Instruct.Q4_1.first12.gguf scripts/gpu-check REPORT_DIR
"""

import argparse
import os
import re

import gguf


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    r = gguf.GGUFReader(a.model)
    arch = r.fields[gguf.Keys.General.ARCHITECTURE].contents()
    n_key = f"{arch}.block_count"
    have = r.fields[n_key].contents()
    if not 1 <= a.layers <= have:
        raise SystemExit(f"--layers must be between 1 and the model's {have}")
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    w = gguf.GGUFWriter(a.out, arch=arch, endianess=r.endianess)
    for field in r.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter
        val_type = field.types[0]
        sub_type = field.types[-1] if val_type == gguf.GGUFValueType.ARRAY else None
        value = a.layers if field.name == n_key else field.contents()
        w.add_key_value(field.name, value, val_type, sub_type=sub_type)

    def kept(name):
        m = re.match(r"blk\.(\d+)\.", name)
        return m is None or int(m.group(1)) < a.layers

    tensors = [t for t in r.tensors if kept(t.name)]
    for t in tensors:
        w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in tensors:
        w.write_tensor_data(t.data, tensor_endianess=r.endianess)
    w.close()
    print(f"{a.out}: {len(tensors)} of {len(r.tensors)} tensors, {a.layers} of {have} layers, "
          f"{os.path.getsize(a.out) / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
