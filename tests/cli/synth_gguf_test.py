#!/usr/bin/env python3
"""`duet model synth` read by the `gguf` package (PyPI, pinned in scripts/python-env),
a reader independent of duet's: the metadata and tensor table a Llama-family loader
needs, with the values of the shapes asked for (written out here from the models'
configs), and the data section exactly as long as the tensors say.

Usage: synth_gguf_test.py path/to/duet   (run with the venv's python)
"""
import os
import subprocess
import sys
import tempfile

import gguf

from duet_e2e import check

DUET = sys.argv[1]
Q = gguf.GGMLQuantizationType


def synth(shape, qtype, path):
    subprocess.run([DUET, "model", "synth", "--shape", shape, "--type", qtype, "-o", path], check=True,
                   capture_output=True)
    return gguf.GGUFReader(path)


def field(r, key):
    f = r.fields[key]
    if f.types and f.types[0] == gguf.GGUFValueType.STRING and len(f.types) == 1:
        return bytes(f.parts[f.data[0]]).decode()
    return f.parts[f.data[0]][0] if len(f.data) == 1 else [f.parts[i] for i in f.data]


with tempfile.TemporaryDirectory() as d:
    # tiny: 2 layers, 256 wide, 4 heads (2 KV), 512 FFN, 512 tokens, Q4_K.
    r = synth("tiny", "q4_k", os.path.join(d, "tiny.gguf"))
    check(field(r, "general.architecture") == "llama", "architecture")
    for key, want in [("llama.block_count", 2), ("llama.embedding_length", 256), ("llama.feed_forward_length", 512),
                      ("llama.attention.head_count", 4), ("llama.attention.head_count_kv", 2),
                      ("llama.vocab_size", 512)]:
        check(field(r, key) == want, f"{key}: {field(r, key)} != {want}")
    check(field(r, "tokenizer.ggml.model") == "gpt2", "a byte-level BPE tokenizer")
    check(len(r.fields["tokenizer.ggml.tokens"].data) == 512, "512 token texts")
    names = [t.name for t in r.tensors]
    check(len(names) == 2 * 9 + 3, f"{len(names)} tensors")
    t = {t.name: t for t in r.tensors}
    for name, shape in [("token_embd.weight", [256, 512]), ("blk.0.attn_q.weight", [256, 256]),
                        ("blk.0.attn_k.weight", [256, 128]), ("blk.1.ffn_down.weight", [512, 256]),
                        ("blk.1.ffn_gate.weight", [256, 512]), ("output.weight", [256, 512])]:
        check(list(t[name].shape) == shape, f"{name}: shape {list(t[name].shape)} != {shape}")
        check(t[name].tensor_type == Q.Q4_K, f"{name}: {t[name].tensor_type}")
    check(t["blk.0.attn_norm.weight"].tensor_type == Q.F32 and list(t["blk.0.attn_norm.weight"].shape) == [256],
          "norms: f32 vectors")
    end = max(x.data_offset + x.n_bytes for x in r.tensors)
    check(end <= os.path.getsize(os.path.join(d, "tiny.gguf")) < end + 32, "the data section ends with the tensors")
    print("tiny, Q4_K: metadata and tensor table as the gguf package reads them: ok")

    # smollm2-135m: the default model's shape, output head tied (no output.weight), Q8_0.
    r = synth("smollm2-135m", "q8_0", os.path.join(d, "smollm2.gguf"))
    t = {t.name: t for t in r.tensors}
    check("output.weight" not in t, "tied: no output head of its own")
    check(list(t["token_embd.weight"].shape) == [576, 49152], "token_embd 576 x 49152")
    check(list(t["blk.29.ffn_up.weight"].shape) == [576, 1536] and "blk.30.ffn_up.weight" not in t, "30 layers")
    check(list(t["blk.0.attn_k.weight"].shape) == [576, 192], "3 KV heads of 64")
    check(sum(int(x.n_elements) for x in r.tensors) == 134_515_008, "SmolLM2-135M's 134,515,008 parameters")
    print("smollm2-135m, Q8_0: the default model's shape and parameter count: ok")
