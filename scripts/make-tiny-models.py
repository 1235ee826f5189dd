#!/usr/bin/env python3
"""Write tiny random Llama-family GGUF models and their float64 reference logits.

    python3 scripts/make-tiny-models.py --out DIR          # needs gguf==0.19.0, numpy
    python3 scripts/make-tiny-models.py --check-real MODEL.gguf --fixture tests/fixtures/logits.json

The real default model exercises one combination only (llama, Q4_1 + Q8_0, tied
output, head_dim = n_embd / n_head, GQA 3, full rotary). Each model here
exercises paths it does not: qwen2 biases and NEOX RoPE, an untied output head,
rope_freqs factors, partial rotary, head_dim != n_embd / n_head, GQA ratios 1, 2
and 4, and every weight type the engine claims (F32, F16, BF16, Q4_0, Q4_1,
Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K).

For each model DIR gets <name>.gguf and <name>.json. The json holds the token ids,
the hyper-parameters the file declares, the rotary inverse frequencies, and the
logits at every position, from a float64 forward pass written here from the math
(no code from duet or llama.cpp). The reference reads the written file back with
gguf-py's GGUFReader and dequantizes with gguf-py, so it uses the weights exactly
as stored. The json also holds "noise": how far (max and rms, in standard
deviations of the logits) the same forward pass lands from the exact logits when
it rounds the way llama.cpp's CPU backend does (8-bit activations for quantized
weights, f16 Q/K/V and attention probabilities): the scale of error an engine
that rounds like llama.cpp should show, from which tests/tiny_models_test.cpp
sets its limits. DIR also gets broken variants (bad-*.gguf) and an unbroken
control (ok-base.gguf) for the loader's error paths; bad-models.json lists them
with the error text expected.

--check-real runs the same float64 forward on a real GGUF file and compares it
with llama.cpp's logits stored in tests/fixtures/logits.json: a check of this
reference itself, against an implementation it shares nothing with.

Everything is deterministic (fixed seeds): rerunning writes the same bytes.
"""

import argparse
import json
import os
import sys

import numpy as np

import gguf
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize, quantize

QK_K = 256

# ---------------------------------------------------------------------------
# Weight construction


def rand_q45_k(rng, rows, cols, sigma, bits):
    """Random valid Q4_K (bits 4) or Q5_K (bits 5) blocks (gguf-py cannot quantize
    to them; any valid block is a valid weight). Per 32-value sub-block: value =
    d*sc*q - dmin*m with q random (Q5_K: a random qh bit on top of the nibble); sc
    in [32, 63] and m ~ sc * mean(q) / (dmin / d), with dmin = 8 d (Q4_K) or 16 d
    (Q5_K), keep each sub-block's mean near 0; d is set for a standard deviation
    near sigma (q's is 4.6 or 9.2)."""
    assert cols % QK_K == 0 and bits in (4, 5)
    nb = rows * cols // QK_K
    q_mean, q_sd, dmin_d = (7.5, 4.6, 8.0) if bits == 4 else (15.5, 9.2, 16.0)
    d = (sigma / (47.5 * q_sd)) * rng.uniform(0.7, 1.3, nb)
    dmin = dmin_d * d
    sc = rng.integers(32, 64, (nb, 8))
    m = np.clip(np.round(sc * q_mean / dmin_d) + rng.integers(-2, 3, (nb, 8)), 0, 63).astype(np.int64)
    scales = np.zeros((nb, 12), np.uint8)
    for j in range(4):  # the 6-bit packing of ggml's get_scale_min_k4
        scales[:, j] = (sc[:, j] & 63) | ((sc[:, j + 4] >> 4) << 6)
        scales[:, j + 4] = (m[:, j] & 63) | ((m[:, j + 4] >> 4) << 6)
        scales[:, j + 8] = (sc[:, j + 4] & 15) | ((m[:, j + 4] & 15) << 4)
    blk = np.concatenate(
        [
            d.astype(np.float16).view(np.uint8).reshape(nb, 2),
            dmin.astype(np.float16).view(np.uint8).reshape(nb, 2),
            scales,
            rng.integers(0, 256, (nb, 128 if bits == 4 else 32 + 128), dtype=np.uint8),  # (Q5_K: qh[32]) qs[128]
        ],
        axis=1,
    )
    assert blk.shape[1] == (144 if bits == 4 else 176)
    # The packing round-trips through gguf-py's own unpacking.
    usc, um = gguf.quants.Q4_K.get_scale_min(scales)
    assert (usc == sc).all() and (um == m).all()
    return blk.reshape(rows, -1)


def rand_q6_k(rng, rows, cols, sigma):
    """Random valid Q6_K blocks: random 6-bit values (ql, qh), 16 signed scales of
    magnitude 8..32, d set for a standard deviation near sigma."""
    assert cols % QK_K == 0
    nb = rows * cols // QK_K
    mag = rng.integers(8, 33, (nb, 16))
    sign = np.where(rng.random((nb, 16)) < 0.5, -1, 1)
    scales = (mag * sign).astype(np.int8)
    d = (sigma / (np.sqrt(np.mean(mag.astype(np.float64) ** 2, axis=1)) * 18.5)) * rng.uniform(0.8, 1.2, nb)
    blk = np.concatenate(
        [
            rng.integers(0, 256, (nb, 192), dtype=np.uint8),  # ql[128], qh[64]
            scales.view(np.uint8),
            d.astype(np.float16).view(np.uint8).reshape(nb, 2),
        ],
        axis=1,
    )
    assert blk.shape[1] == 210
    return blk.reshape(rows, -1)


def make_weight(rng, qt, rows, cols, sigma):
    """A [rows, cols] weight (cols contiguous) as the array GGUFWriter stores."""
    if qt in (QT.Q4_K, QT.Q5_K):
        return rand_q45_k(rng, rows, cols, sigma, 4 if qt == QT.Q4_K else 5)
    if qt == QT.Q8_1:  # an activation type, never a weight: only the loader's refusal reads it
        return rng.integers(0, 256, (rows, cols // 32 * gguf.GGML_QUANT_SIZES[qt][1]), dtype=np.uint8)
    if qt == QT.Q6_K:
        return rand_q6_k(rng, rows, cols, sigma)
    w = rng.normal(0.0, sigma, (rows, cols)).astype(np.float32)
    if qt == QT.F32:
        return w
    if qt == QT.F16:
        return w.astype(np.float16)
    return quantize(w, qt)  # BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: uint8 [rows, row bytes]


# ---------------------------------------------------------------------------
# The models


def spec(name, arch, **kw):
    s = dict(
        name=name, arch=arch, n_vocab=320, n_embd=128, n_layer=2, n_ff=256, n_head=4, n_head_kv=2,
        key_length=None, rot_dim=None, rope_base=10000.0, rms_eps=1e-5, n_ctx_train=2048,
        types={}, default_type=QT.F32, embd_type=None, output_type=None, bias=False, rope_freqs=None,
        n_tokens=20, seed=0,
    )
    s.update(kw)
    return s


MODELS = [
    # K-quants: every row a multiple of 256. Tied output in Q6_K.
    spec("llama-q4k-q6k", "llama", n_embd=256, n_ff=512, n_head=4, n_head_kv=2, n_vocab=384,
         types=dict(attn_q=QT.Q4_K, attn_k=QT.Q6_K, attn_v=QT.Q4_K, attn_output=QT.Q6_K,
                    ffn_gate=QT.Q4_K, ffn_up=QT.Q6_K, ffn_down=QT.Q4_K),
         embd_type=QT.Q6_K, seed=1),
    # Q5_K_M's mix: Q5_K for most matrices and the (tied) embedding, Q6_K for
    # attn_v and ffn_down.
    spec("llama-q5k-q6k", "llama", n_embd=256, n_ff=512, n_head=4, n_head_kv=2, n_vocab=384,
         types=dict(attn_v=QT.Q6_K, ffn_down=QT.Q6_K), default_type=QT.Q5_K, embd_type=QT.Q5_K, seed=7),
    # Q4_0 / Q8_0 with Q4_1 mixed in (so Q8_0 and Q8_1 activations alternate
    # within a layer), untied Q6_K output head, GQA 4.
    spec("llama-q40-q80-untied", "llama", n_embd=256, n_ff=384, n_head=8, n_head_kv=2,
         types=dict(attn_q=QT.Q4_0, attn_k=QT.Q8_0, attn_v=QT.Q4_1, attn_output=QT.Q8_0,
                    ffn_gate=QT.Q4_0, ffn_up=QT.Q4_1, ffn_down=QT.Q8_0),
         embd_type=QT.Q8_0, output_type=QT.Q6_K, seed=2),
    # Q5_0 and Q5_1: what llama.cpp writes for Q4_K_M / Q5_K_M matrices whose rows
    # are not a multiple of 256 (SmolLM2's 576), with Q8_0 for the embedding.
    spec("llama-q50-q51", "llama", n_embd=192, n_ff=320, n_head=6, n_head_kv=2,
         types=dict(attn_q=QT.Q5_0, attn_k=QT.Q5_1, attn_v=QT.Q8_0, attn_output=QT.Q5_1,
                    ffn_gate=QT.Q5_0, ffn_up=QT.Q5_1, ffn_down=QT.Q5_0),
         embd_type=QT.Q8_0, seed=8),
    # qwen2: q/k/v biases, NEOX RoPE, F16 weights, tied output.
    spec("qwen2-f16-bias", "qwen2", n_vocab=300, n_embd=128, n_ff=256, n_head=4, n_head_kv=2,
         default_type=QT.F16, embd_type=QT.F16, bias=True, rope_base=1000000.0, rms_eps=1e-6, seed=3),
    # head_dim 32 with n_embd 96 and 4 heads (key_length != n_embd / n_head),
    # BF16 and F32 weights, untied F32 output.
    spec("llama-bf16-f32-headdim", "llama", n_vocab=256, n_embd=96, n_ff=160, n_head=4, n_head_kv=2,
         key_length=32,
         types=dict(attn_q=QT.BF16, attn_k=QT.F32, attn_v=QT.BF16, attn_output=QT.F32,
                    ffn_gate=QT.BF16, ffn_up=QT.F32, ffn_down=QT.BF16),
         embd_type=QT.BF16, output_type=QT.F32, seed=4),
    # Llama 3 style rope_freqs factors and partial rotary (16 of 32 dims), Q4_1,
    # one KV head for 4 query heads. The factors hit fast pairs too (Llama 3's
    # hit only slow ones), so that ignoring them moves angles by radians within
    # 20 positions, not by rounding-sized amounts.
    spec("llama-q41-ropefreqs-partial", "llama", n_embd=128, n_ff=256, n_head=4, n_head_kv=1,
         rot_dim=16, rope_base=10000.0, default_type=QT.Q4_1, embd_type=QT.Q4_1,
         rope_freqs=[2.0, 0.5, 0.25, 1.0, 4.0, 0.125, 1.0, 8.0], seed=5),
    # GQA ratio 1 (plain multi-head attention), Q8_0 everywhere.
    spec("llama-q80-mha", "llama", n_vocab=256, n_embd=128, n_ff=288, n_head=4, n_head_kv=4,
         default_type=QT.Q8_0, embd_type=QT.Q8_0, rms_eps=1e-6, seed=6),
]


def head_dim(s):
    return s["key_length"] if s["key_length"] is not None else s["n_embd"] // s["n_head"]


def write_model(path, s, overrides=None):
    """Writes the model of spec s. overrides (broken variants): 'drop' tensor
    names to leave out, 'shape' {name: (rows, cols)}, 'type' {name: qt},
    'kv' {key: value or None to drop}, 'arch' to write instead."""
    o = overrides or {}
    rng = np.random.default_rng(s["seed"])
    arch = o.get("arch", s["arch"])
    E, F, V, NH, NKV = s["n_embd"], s["n_ff"], s["n_vocab"], s["n_head"], s["n_head_kv"]
    HD = head_dim(s)
    Q, KV = NH * HD, NKV * HD
    w = gguf.GGUFWriter(path, arch)
    kv = {
        "general.name": ("str", s["name"]),
        f"{arch}.context_length": ("u32", s["n_ctx_train"]),
        f"{arch}.embedding_length": ("u32", E),
        f"{arch}.block_count": ("u32", s["n_layer"]),
        f"{arch}.feed_forward_length": ("u32", F),
        f"{arch}.attention.head_count": ("u32", NH),
        f"{arch}.attention.head_count_kv": ("u32", NKV),
        f"{arch}.rope.freq_base": ("f32", s["rope_base"]),
        f"{arch}.attention.layer_norm_rms_epsilon": ("f32", s["rms_eps"]),
        f"{arch}.vocab_size": ("u32", V),
    }
    if s["key_length"] is not None:
        kv[f"{arch}.attention.key_length"] = ("u32", HD)
        kv[f"{arch}.attention.value_length"] = ("u32", HD)
    if s["rot_dim"] is not None:
        kv[f"{arch}.rope.dimension_count"] = ("u32", s["rot_dim"])
    for k, v in o.get("kv", {}).items():
        if v is None:
            kv.pop(k.replace("{arch}", arch), None)
        else:
            kv[k.replace("{arch}", arch)] = v
    for k, (t, v) in kv.items():
        {"str": w.add_string, "u32": w.add_uint32, "f32": w.add_float32}[t](k, v)

    # Scales: projections ~ 1/sqrt(n_in) so that q.k/sqrt(hd) and the residual
    # updates are O(1); the output head (token_embd when tied) gives logits of
    # standard deviation ~ 3, peaked enough for top-1 checks, not one-hot.
    tensors = []  # (name, array as GGUFWriter takes it, type)

    def mat(name, qt, rows, cols, sigma):
        rows, cols = o.get("shape", {}).get(name, (rows, cols))
        qt = o.get("type", {}).get(name, qt)
        tensors.append((name, make_weight(rng, qt, rows, cols, sigma), qt))

    def vec(name, values):
        qt = o.get("type", {}).get(name, QT.F32)
        n = o.get("shape", {}).get(name, (len(values), 1))[0]
        values = np.resize(np.asarray(values, np.float32), n)
        tensors.append((name, values if qt == QT.F32 else values.astype(np.float16), qt))

    embd_type = s["embd_type"] or s["default_type"]
    tied = s["output_type"] is None
    mat("token_embd.weight", embd_type, V, E, 3.0 / np.sqrt(E) if tied else 1.0)
    for l in range(s["n_layer"]):
        p = f"blk.{l}."
        vec(p + "attn_norm.weight", 1.0 + 0.1 * rng.standard_normal(E))
        t = lambda m: s["types"].get(m, s["default_type"])
        mat(p + "attn_q.weight", t("attn_q"), Q, E, 1.5 / np.sqrt(E))
        mat(p + "attn_k.weight", t("attn_k"), KV, E, 1.5 / np.sqrt(E))
        mat(p + "attn_v.weight", t("attn_v"), KV, E, 1.0 / np.sqrt(E))
        if s["bias"]:
            vec(p + "attn_q.bias", 0.5 * rng.standard_normal(Q))
            vec(p + "attn_k.bias", 0.5 * rng.standard_normal(KV))
            vec(p + "attn_v.bias", 0.2 * rng.standard_normal(KV))
        mat(p + "attn_output.weight", t("attn_output"), E, Q, 0.7 / np.sqrt(Q))
        vec(p + "ffn_norm.weight", 1.0 + 0.1 * rng.standard_normal(E))
        mat(p + "ffn_gate.weight", t("ffn_gate"), F, E, 1.0 / np.sqrt(E))
        mat(p + "ffn_up.weight", t("ffn_up"), F, E, 1.0 / np.sqrt(E))
        mat(p + "ffn_down.weight", t("ffn_down"), E, F, 1.0 / np.sqrt(F))
    vec("output_norm.weight", 1.0 + 0.1 * rng.standard_normal(E))
    if s["output_type"] is not None:
        mat("output.weight", s["output_type"], V, E, 3.0 / np.sqrt(E))
    if s["rope_freqs"] is not None:
        vec("rope_freqs.weight", s["rope_freqs"])

    drop = set(o.get("drop", []))
    for name, arr, qt in tensors:
        if name in drop:
            continue
        plain = arr.dtype in (np.float32, np.float16)
        w.add_tensor(name, arr, raw_dtype=None if plain else qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ---------------------------------------------------------------------------
# The float64 reference, from the file


class GgufModel:
    """Hyper-parameters and dequantized float64 weights of a GGUF file."""

    def __init__(self, path):
        r = gguf.GGUFReader(path)
        self.meta = {}
        for k, f in r.fields.items():
            if not f.types or f.types[0] == gguf.GGUFValueType.ARRAY:
                continue
            self.meta[k] = f.contents()
        self.t = {}      # name -> float64 array [rows, cols] (numpy order: ne reversed)
        self.type = {}   # name -> GGMLQuantizationType
        self.q4_1_min = {}  # Q4_1 / Q5_1 name -> [rows, blocks] block minimums m (for the noise model)
        for t in r.tensors:
            raw = np.asarray(t.data)
            a = dequantize(raw, t.tensor_type).astype(np.float64)
            ne = [int(x) for x in t.shape]  # ne[0] first
            self.t[t.name] = a.reshape(list(reversed(ne)) if len(ne) > 1 else ne)
            self.type[t.name] = QT(t.tensor_type)
            if t.tensor_type in (QT.Q4_1, QT.Q5_1):
                blocks = raw.reshape(-1, 20 if t.tensor_type == QT.Q4_1 else 24)  # f16 d, f16 m, then the values
                self.q4_1_min[t.name] = blocks[:, 2:4].copy().view(np.float16).astype(np.float64).reshape(ne[1], -1)
        arch = self.meta["general.architecture"]
        g = lambda k, d=None: self.meta.get(f"{arch}.{k}", d)
        self.arch = arch
        self.E = int(g("embedding_length"))
        self.L = int(g("block_count"))
        self.F = int(g("feed_forward_length"))
        self.NH = int(g("attention.head_count"))
        self.NKV = int(g("attention.head_count_kv", self.NH))
        self.HD = int(g("attention.key_length", self.E // self.NH))
        self.rot = int(g("rope.dimension_count", self.HD))
        self.base = float(g("rope.freq_base", 10000.0))
        self.eps = float(g("attention.layer_norm_rms_epsilon"))
        self.V = self.t["token_embd.weight"].shape[0]
        # llama.cpp's rope type per architecture: llama rotates consecutive pairs
        # (its converter permutes q/k rows to make that right); qwen2 is not
        # permuted and rotates (x[i], x[i + rot/2]) ("NEOX").
        self.neox = {"llama": False, "qwen2": True}[arch]
        i = np.arange(self.rot // 2, dtype=np.float64)
        inv = self.base ** (-2.0 * i / self.rot)
        if "rope_freqs.weight" in self.t:
            inv = inv / self.t["rope_freqs.weight"]
        self.inv_freq = inv
        self.out_name = "output.weight" if "output.weight" in self.t else "token_embd.weight"


# The noise model: llama.cpp's CPU rounding, from its documented scheme (not from
# its code nor duet's), so a test can tell how far from the exact logits an
# engine that rounds like llama.cpp is expected to land. Before a product with
# quantized weights the activations are rounded to 8 bits: per 32 values for
# Q4_0 / Q5_0 / Q8_0 (Q8_0: d = f16(amax/127)) and Q4_1 / Q5_1 (Q8_1: also s = f16(d * sum q),
# which meets the weight block minimum), per 256 for the K-quants (Q8_K: d =
# amax/127 in f32), q = round-half-even(x * 127/amax) in f32. Q, K and V are
# rounded to f16 (K/V cache in f16) and so are the attention probabilities.


def f16(x):
    return np.asarray(x, np.float64).astype(np.float16).astype(np.float64)


def q8_round(x, blk, f16_scale):
    """Per block of blk values: (q, d) with x ~ q * d."""
    shape = x.shape
    xb = x.astype(np.float32).reshape(-1, blk)
    amax = np.abs(xb).max(axis=1, keepdims=True)
    safe = np.where(amax > 0, amax, np.float32(1))
    iscale = np.where(amax > 0, np.float32(127) / safe, np.float32(0)).astype(np.float32)
    q = np.round((xb * iscale).astype(np.float64))  # numpy rounds half to even
    if f16_scale:
        d = f16(amax / np.float32(127))
    else:
        d = np.where(amax > 0, (np.float32(1) / np.where(iscale > 0, iscale, 1)).astype(np.float32), 0).astype(np.float64)
    return q.reshape(shape[:-1] + (-1, blk)), d.reshape(shape[:-1] + (-1, 1))


def matmul(m, x, name, sim):
    """x [T, n_in] times weight `name` transposed, rounding x as the engine would if sim."""
    W = m.t[name]
    if not sim:
        return x @ W.T
    qt = m.type[name]
    if qt in (QT.Q4_0, QT.Q5_0, QT.Q8_0, QT.Q4_1, QT.Q5_1):
        q, d = q8_round(x, 32, True)
        y = (q * d).reshape(x.shape) @ W.T
        if qt in (QT.Q4_1, QT.Q5_1):  # the minimum term meets s = f16(d * sum q), not sum(q * d)
            e = f16(d[..., 0] * q.sum(axis=-1)) - d[..., 0] * q.sum(axis=-1)  # [T, blocks]
            y = y + e @ m.q4_1_min[name].T
        return y
    if qt in (QT.Q4_K, QT.Q5_K, QT.Q6_K):
        q, d = q8_round(x, QK_K, False)
        return (q * d).reshape(x.shape) @ W.T
    return x.astype(np.float32).astype(np.float64) @ W.T  # F32 / F16 / BF16: f32 activations


def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, pos, m):
    """x [T, heads, HD]; rotates the first m.rot dims of each head."""
    ang = pos[:, None] * m.inv_freq[None, :]  # [T, rot/2]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    y = x.copy()
    if m.neox:
        h = m.rot // 2
        a, b = x[..., :h], x[..., h : m.rot]
        y[..., :h] = a * c - b * s
        y[..., h : m.rot] = a * s + b * c
    else:
        a, b = x[..., 0 : m.rot : 2], x[..., 1 : m.rot : 2]
        y[..., 0 : m.rot : 2] = a * c - b * s
        y[..., 1 : m.rot : 2] = a * s + b * c
    return y


def forward(m, ids, sim=False):
    """Logits [T, V] after each prefix of ids, in float64; exact, or with the
    noise model's rounding when sim."""
    T = len(ids)
    pos = np.arange(T, dtype=np.float64)
    x = m.t["token_embd.weight"][np.asarray(ids)]
    group = m.NH // m.NKV
    mask = np.triu(np.full((T, T), -np.inf), 1)
    r16 = f16 if sim else (lambda a: a)
    for l in range(m.L):
        p = f"blk.{l}."
        h = rms_norm(x, m.t[p + "attn_norm.weight"], m.eps)
        q, k, v = (matmul(m, h, p + f"attn_{n}.weight", sim) for n in "qkv")
        if p + "attn_q.bias" in m.t:
            q, k, v = q + m.t[p + "attn_q.bias"], k + m.t[p + "attn_k.bias"], v + m.t[p + "attn_v.bias"]
        q = r16(rope(q.reshape(T, m.NH, m.HD), pos, m))
        k = r16(rope(k.reshape(T, m.NKV, m.HD), pos, m))
        v = r16(v.reshape(T, m.NKV, m.HD))
        att = np.empty((T, m.NH, m.HD))
        for hh in range(m.NH):
            kv = hh // group
            sc = q[:, hh, :] @ k[:, kv, :].T / np.sqrt(m.HD) + mask
            sc = np.exp(sc - sc.max(axis=1, keepdims=True))
            att[:, hh, :] = r16(sc / sc.sum(axis=1, keepdims=True)) @ v[:, kv, :]
        x = x + matmul(m, att.reshape(T, -1), p + "attn_output.weight", sim)
        h = rms_norm(x, m.t[p + "ffn_norm.weight"], m.eps)
        g, u = matmul(m, h, p + "ffn_gate.weight", sim), matmul(m, h, p + "ffn_up.weight", sim)
        x = x + matmul(m, g / (1.0 + np.exp(-g)) * u, p + "ffn_down.weight", sim)
    return matmul(m, rms_norm(x, m.t["output_norm.weight"], m.eps), m.out_name, sim)


# ---------------------------------------------------------------------------
# Broken variants: (file, spec, overrides, what Model::load's error must contain)

BASE_BAD = spec("bad", "llama", n_vocab=64, n_embd=64, n_ff=96, n_head=4, n_head_kv=2, n_layer=2, seed=9)

BAD = [
    ("ok-base", BASE_BAD, {}, None),  # the unbroken base: must load
    ("bad-missing-tensor", BASE_BAD, dict(drop=["blk.1.ffn_up.weight"]),
     "tensor 'blk.1.ffn_up.weight' is missing"),
    ("bad-wrong-shape", BASE_BAD, dict(shape={"blk.0.attn_k.weight": (48, 64)}),
     "tensor 'blk.0.attn_k.weight' has shape [64, 48, 1, 1], expected [64, 32]"),
    ("bad-arch", BASE_BAD, dict(arch="gpt2"), "architecture 'gpt2' is not supported"),
    ("bad-gqa", BASE_BAD, dict(kv={"{arch}.attention.head_count_kv": ("u32", 3)}),
     "head_count 4 is not a multiple of head_count_kv 3"),
    ("bad-missing-key", BASE_BAD, dict(kv={"{arch}.block_count": None}),
     "metadata key 'llama.block_count' is missing"),
    ("bad-key-type", BASE_BAD, dict(kv={"{arch}.attention.head_count": ("str", "4")}),
     "metadata key 'llama.attention.head_count' should be an integer"),
    ("bad-weight-type", BASE_BAD, dict(type={"blk.0.ffn_down.weight": QT.Q8_1}),
     "tensor 'blk.0.ffn_down.weight' has type 9 (Q8_1), which duet does not support"),
    ("bad-rot-dim", BASE_BAD, dict(kv={"{arch}.rope.dimension_count": ("u32", 48)}),
     "rope dimension 48 does not fit head size 16"),
    ("bad-norm-type", BASE_BAD, dict(type={"blk.0.attn_norm.weight": QT.F16}),
     "tensor 'blk.0.attn_norm.weight' should be F32"),
    ("bad-vocab-size", BASE_BAD, dict(kv={"{arch}.vocab_size": ("u32", 65)}),
     "vocab_size 65 disagrees with token_embd.weight rows 64"),
    ("bad-output-shape", dict(BASE_BAD, output_type=QT.F32), dict(shape={"output.weight": (63, 64)}),
     "tensor 'output.weight' has shape [64, 63, 1, 1], expected [64, 64]"),
    ("bad-rope-freqs", dict(BASE_BAD, rope_freqs=[1.0] * 8), dict(shape={"rope_freqs.weight": (5, 1)}),
     "rope_freqs.weight should be F32 with 8 values"),
    ("bad-missing-bias", dict(BASE_BAD, arch="qwen2", bias=True), dict(drop=["blk.1.attn_v.bias"]),
     "tensor 'blk.1.attn_v.bias' is missing"),
]


def write_json(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, separators=(",", ":"))
    os.replace(tmp, path)


def make_all(out):
    os.makedirs(out, exist_ok=True)
    for s in MODELS:
        gpath = os.path.join(out, s["name"] + ".gguf")
        write_model(gpath, s)
        m = GgufModel(gpath)
        ids = np.random.default_rng(100 + s["seed"]).integers(0, s["n_vocab"], s["n_tokens"]).tolist()
        logits = forward(m, ids)
        std = float(np.std(logits))
        assert 0.5 < std < 20, f"{s['name']}: logits std {std} is not a useful test"
        err = (forward(m, ids, sim=True) - logits) / std
        noise = dict(max_sd=float(np.abs(err).max()), rms_sd=float(np.sqrt(np.mean(err * err))))
        write_json(os.path.join(out, s["name"] + ".json"), {
            "name": s["name"],
            "arch": m.arch,
            "config": dict(n_vocab=m.V, n_embd=m.E, n_layer=m.L, n_ff=m.F, n_head=m.NH, n_head_kv=m.NKV,
                           head_dim=m.HD, rot_dim=m.rot, rope_base=m.base, rms_eps=m.eps,
                           tied_output="output.weight" not in m.t, qkv_bias="blk.0.attn_q.bias" in m.t),
            "types": {n: t.name for n, t in m.type.items()},
            "inv_freq": m.inv_freq.tolist(),
            "ids": ids,
            "logits": logits.tolist(),
            "noise": noise,
        })
        print(f"{s['name']}: logits std {std:.3f}, noise model max {noise['max_sd']:.4f} sd, "
              f"rms {noise['rms_sd']:.5f} sd", file=sys.stderr)
    bad = []
    for name, s, o, msg in BAD:
        write_model(os.path.join(out, name + ".gguf"), s, o)
        bad.append({"file": name + ".gguf", "error": msg})
    write_json(os.path.join(out, "bad-models.json"), bad)


def check_real(model_path, fixture_path):
    """This reference on a real model vs llama.cpp's stored logits (prompts up to
    40 tokens), exact and with the noise model's rounding. The noise model is an
    independent draw of llama.cpp-like rounding, not a replica of llama.cpp's run:
    expect it about as far from llama.cpp as the exact logits, not closer."""
    m = GgufModel(model_path)
    fx = json.load(open(fixture_path))
    start, stride = fx["meta"]["fixed_ids"]["start"], fx["meta"]["fixed_ids"]["stride"]
    for sim in (False, True):
        worst_mean = worst_max = 0.0
        for p in fx["prompts"]:
            if len(p["ids"]) > 40:
                continue
            logits = forward(m, p["ids"], sim=sim)
            for at in p["positions"]:
                l = logits[at["pos"]]
                mx = l.max()
                lse = mx + np.log(np.exp(l - mx).sum())
                ref_lse = at["lse"]
                pairs = [(t[0], t[1]) for t in at["top"]]
                pairs += [(start + k * stride, v) for k, v in enumerate(at["fixed"])]
                d = np.array([abs((l[i] - lse) - (v - ref_lse)) for i, v in pairs])
                worst_mean, worst_max = max(worst_mean, d.mean()), max(worst_max, d.max())
                top = int(np.argmax(l))
                print(f"{'noise model' if sim else 'exact'} {p['name']} pos {at['pos']}: |dlogprob| mean "
                      f"{d.mean():.4f} max {d.max():.4f}, lse {lse:.4f} vs {ref_lse:.4f}, top-1 {top} vs "
                      f"{at['top'][0][0]} (llama.cpp gap {at['top'][0][1] - at['top'][1][1]:.3f})")
        print(f"{'noise model' if sim else 'exact'}: worst mean |dlogprob| {worst_mean:.4f}, worst max {worst_max:.4f}")


def write_real_f64(model_path, fixture_path, out_path):
    """float64 logits of a real model at the positions and ids that llama.cpp's
    logits fixture stores, so a test can ask how far duet and llama.cpp each are
    from exact arithmetic."""
    m = GgufModel(model_path)
    fx = json.load(open(fixture_path))
    start, stride = fx["meta"]["fixed_ids"]["start"], fx["meta"]["fixed_ids"]["stride"]
    prompts = []
    for p in fx["prompts"]:
        logits = forward(m, p["ids"], sim=False)
        pos_out = []
        for at in p["positions"]:
            l = logits[at["pos"]]
            mx = l.max()
            lse = float(mx + np.log(np.exp(l - mx).sum()))
            pos_out.append({"pos": at["pos"], "lse": lse,
                            "top": [[t[0], float(l[t[0]])] for t in at["top"]],
                            "fixed": [float(l[start + k * stride]) for k in range(len(at["fixed"]))],
                            "argmax": int(np.argmax(l))})
        prompts.append({"name": p["name"], "ids": p["ids"], "positions": pos_out})
    from importlib.metadata import version
    meta = {"what": "float64 reference logits of the real model at the positions and ids of logits.json",
            "model_sha256": fx["meta"]["model_sha256"],
            "produced_by": "scripts/make-tiny-models.py --write-real-f64 tests/fixtures/logits_f64.json "
                           "--check-model models/SmolLM2-135M-Instruct.Q4_1.gguf",
            "how": "numpy float64 forward pass (this script's forward(), exact mode) on weights dequantized by "
                   "gguf-py " + version("gguf") + "; no code shared with duet or llama.cpp"}
    write_json(out_path, {"meta": meta, "prompts": prompts})


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="directory for the tiny models and their references")
    ap.add_argument("--check-real", metavar="GGUF", help="compare this reference with llama.cpp on a real model")
    ap.add_argument("--fixture", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures",
                                                      "logits.json"))
    ap.add_argument("--write-real-f64", metavar="JSON", help="with --check-model: write float64 logits of a real model")
    ap.add_argument("--check-model", metavar="GGUF", help="the real model for --write-real-f64")
    a = ap.parse_args()
    from importlib.metadata import version
    if version("gguf") != "0.19.0":
        print(f"warning: gguf {version('gguf')} is not the pinned 0.19.0 (scripts/python-env)", file=sys.stderr)
    if a.check_real:
        check_real(a.check_real, a.fixture)
    if a.write_real_f64:
        write_real_f64(a.check_model, a.fixture, a.write_real_f64)
    if a.out:
        make_all(a.out)
    if not a.out and not a.check_real and not a.write_real_f64:
        ap.error("give --out DIR and/or --check-real GGUF")


if __name__ == "__main__":
    main()
