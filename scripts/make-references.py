#!/usr/bin/env python3
"""Write llama.cpp reference fixtures (tokenizer, logits, greedy) for duet's tests.

The reference is llama.cpp itself, driven through its Python binding:

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON \
                -DGGML_F16C=ON -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF \
                -DGGML_BLAS=OFF -DGGML_OPENMP=ON" \
    MAKEFLAGS=-j2 pip install llama-cpp-python==0.3.36
    python3 scripts/make-references.py \
        --model models/SmolLM2-135M-Instruct.Q4_1.gguf --out tests/fixtures

The CPU backend is built without AVX-512 on purpose: the AVX2 path is the
most widely run one, so the fixtures do not depend on the generating machine.
Pass --build-flags to record other flags if you build differently; the
backend's own feature report (llama_print_system_info) is recorded as well.

Nothing here is copied from llama.cpp; the script only calls its public API.
"""

import argparse
import ctypes
import datetime
import hashlib
import json
import math
import os
import sys

import numpy as np

PINNED_VERSION = "0.3.36"
# The llama.cpp commit vendored in the llama-cpp-python 0.3.36 sdist
# (llama_cpp_python-0.3.36/.git/modules/vendor/llama.cpp/HEAD).
VENDORED_LLAMA_CPP = {"0.3.36": "0c1e57098bba43ac29e6e3b677cdceebdd22334f"}
DEFAULT_BUILD_FLAGS = (
    "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON "
    "-DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF -DGGML_BLAS=OFF -DGGML_OPENMP=ON"
)

N_CTX = 512
N_BATCH = 512
N_THREADS = 2
TOP_K = 40
FIXED_ID_STRIDE = 192
GREEDY_STEPS = 64

SYSTEM_MSG = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def chatml(messages, add_generation_prompt=True):
    out = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in messages)
    if add_generation_prompt:
        out += "<|im_start|>assistant\n"
    return out


CHAT_PROMPT = chatml([("system", SYSTEM_MSG), ("user", "What is the capital of France?")])

# (text, parse_special). Special-token texts appear with both settings.
TOKENIZER_CASES = [
    ("", False),
    (" ", False),
    ("a", False),
    ("A", False),
    ("\n", False),
    ("\t", False),
    ("!", False),
    ("é", False),
    ("Hello world! 123", False),
    ("The capital of France is", False),
    ("The quick brown fox jumps over the lazy dog.", False),
    ("Hello, how are you doing today?", False),
    (" leading space", False),
    ("trailing space ", False),
    ("   three leading spaces", False),
    ("multiple    spaces   between  words", False),
    ("ends with many spaces     ", False),
    ("tab\tseparated\tvalues", False),
    ("\t\tindented with tabs", False),
    ("line one\nline two", False),
    ("para one\n\npara two", False),
    ("three newlines\n\n\nthen text", False),
    ("windows\r\nline\r\nendings\r\n", False),
    ("mixed \t \n whitespace \n\t end", False),
    ("\n\n\n\n", False),
    ("123456789", False),
    ("3.14159", False),
    ("1,000,000", False),
    ("Call 555-0123 at 10:30pm on 2024-03-15.", False),
    ("x1 y22 z333 v4444", False),
    ("café naïve Ångström résumé", False),
    ("Übermäßig große Straße in München", False),
    ("Où est la bibliothèque ? C'est là-bas, à côté de l'église.", False),
    ("¿Dónde está el baño? ¡Muchas gracias, señor!", False),
    ("我爱自然语言处理。今天天气很好！", False),
    ("日本語のテキストです。カタカナとひらがな。", False),
    ("안녕하세요, 세계! 한국어 문장입니다.", False),
    ("Emoji: 😀🎉👍", False),
    ("ZWJ family 👨‍👩‍👧‍👦 and flag 🇫🇷 🇯🇵 and skin tone 👋🏽", False),
    ("مرحبا بالعالم", False),
    ("שלום עולם", False),
    ("नमस्ते दुनिया", False),
    ("Привет, мир! Как дела?", False),
    ("Γειά σου Κόσμε αβγδ", False),
    ("def add(a, b):\n    return a + b\n", False),
    ("class Foo:\n    def __init__(self):\n        self.x = [1, 2, 3]\n", False),
    ("#include <vector>\nint main() {\n    std::vector<int> v{1, 2};\n    return v.size();\n}\n", False),
    ('{"name": "duet", "version": 1, "tags": ["a", "b"], "ok": true}', False),
    ("https://example.com/path/to/page?query=1&lang=en#section", False),
    ("user@example.org sent mail to admin@test.co.uk", False),
    ("I'm sure they'll say we've done it, but you'd've DON'T CAN'T won't.", False),
    ("It's John's book; she's 'quoted' here.", False),
    ("Wait!!! Really?! No way... Yes?!?!", False),
    ("--- *** ___ ### === +++ ~~~", False),
    ("(parentheses) [brackets] {braces} <angles>", False),
    ("e\u0301 a\u0300 n\u0303 combining marks", False),
    ("zero\u200bwidth\u200bspace and nbsp\u00a0here", False),
    ("A" * 40, False),
    ("control\x04char and \x13 (bytes with no token of their own)", False),
    ("nul\x00byte", False),
    ("<|im_start|>", True),
    ("<|im_start|>", False),
    ("<|im_end|>", True),
    ("<|im_end|>", False),
    ("<|endoftext|>", True),
    ("<|endoftext|>", False),
    ("text before<|im_end|>text after", True),
    ("text before<|im_end|>text after", False),
    ("Hello<|endoftext|> world", True),
    ("Hello<|endoftext|> world", False),
    ("<|im_start|>user\nHi<|im_end|>", True),
    (CHAT_PROMPT, True),
    (CHAT_PROMPT, False),
    (chatml([("user", "Write a haiku about the sea."), ("assistant", "Waves fold into foam,")],
            add_generation_prompt=False), True),
]

# Byte strings that are not valid UTF-8 (so cannot be JSON strings): llama.cpp
# turns each invalid sequence into U+FFFD but passes encoded surrogates through.
TOKENIZER_BYTE_CASES = [
    b"\xff",
    b"a\xffb",
    b"\xc3",
    b"caf\xc3",
    b"\xc3(",
    b"\x80\x80",
    b"\xed\xa0\x80",
    b"\xf0\x9f\x98",
]

LOGIT_PROMPTS = [
    ("chat", CHAT_PROMPT, True),
    ("capital", "The capital of France is", False),
    ("code", "def fibonacci(n):\n    if n < 2:\n        return n\n    return", False),
    ("paragraph",
     "The history of the printing press begins in the fifteenth century, when Johannes "
     "Gutenberg, a goldsmith from Mainz, combined several existing technologies into a "
     "single system for producing books. Movable metal type, oil-based ink, and a screw "
     "press adapted from those used to make wine allowed a small workshop to print "
     "hundreds of identical pages in a day. Within fifty years, presses had spread to "
     "more than two hundred cities across Europe, and millions of volumes were in "
     "circulation. The consequences were profound: scholars could compare the same text "
     "in different places, vernacular languages gained standard spellings, and new "
     "ideas travelled faster than any authority could suppress them. Historians still "
     "debate how much the press caused the Reformation and the Scientific Revolution, "
     "but few doubt that it changed",
     False),
]

GREEDY_PROMPTS = [
    ("chat", CHAT_PROMPT, True),
    ("chat_story", chatml([("system", SYSTEM_MSG),
                           ("user", "Tell me a short story about a robot who learns to paint.")]), True),
    ("capital", "The capital of France is", False),
    ("code", "def fibonacci(n):\n    if n < 2:\n        return n\n    return", False),
]


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def f32(x):
    """Shortest decimal that round-trips the float32 value (keeps files small)."""
    return float(np.format_float_positional(np.float32(x), unique=True, trim="-"))


def log_sum_exp(row):
    r = row.astype(np.float64)
    m = r.max()
    return float(m + math.log(np.exp(r - m).sum()))


def detokenize(llama_cpp, vocab, ids, unparse_special):
    """llama_detokenize straight from the C API (no Python-side BOS/space fix-ups)."""
    arr = (llama_cpp.llama_token * max(1, len(ids)))(*ids)
    cap = 64 + 64 * len(ids)
    buf = ctypes.create_string_buffer(cap)
    n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, cap, False, unparse_special)
    if n < 0:
        raise RuntimeError(f"llama_detokenize needed {-n} bytes, had {cap}")
    return buf.raw[:n]


def token_piece(llama_cpp, vocab, tok, special):
    buf = ctypes.create_string_buffer(256)
    n = llama_cpp.llama_token_to_piece(vocab, tok, buf, 256, 0, special)
    if n < 0:
        raise RuntimeError(f"piece of token {tok} needs {-n} bytes")
    return buf.raw[:n]


def make_meta(args, llama_cpp, what, extra):
    version = getattr(llama_cpp, "__version__", "unknown")
    meta = {
        "what": what,
        "model_file": os.path.basename(args.model),
        "model_sha256": args.model_sha256,
        "llama_cpp_python_version": version,
        "llama_cpp_commit": VENDORED_LLAMA_CPP.get(version),
        "build_flags": args.build_flags,
        "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "produced_by": "python3 scripts/make-references.py --model "
                       f"models/{os.path.basename(args.model)} --out tests/fixtures",
    }
    meta.update(extra)
    return meta


def write_json(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {path} ({os.path.getsize(path)} bytes)")


def tokenizer_fixture(args, llama_cpp, llm, vocab):
    cases = []
    for text, special in TOKENIZER_CASES:
        ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=special)
        cases.append({"text": text, "parse_special": special, "ids": [int(t) for t in ids]})
    byte_cases = []
    for raw in TOKENIZER_BYTE_CASES:
        ids = llm.tokenize(raw, add_bos=False, special=False)
        byte_cases.append({"bytes_hex": raw.hex(), "parse_special": False,
                           "ids": [int(t) for t in ids]})

    # Byte-level BPE: most bytes have a token whose piece is that byte alone (this
    # vocabulary lacks 21 of them: bytes that never occur in valid UTF-8 and a few
    # control characters; llama.cpp drops such input bytes). Pick some that are
    # not valid UTF-8 on their own.
    n_vocab = llm.n_vocab()
    single_byte = {}
    for tok in range(n_vocab):
        p = token_piece(llama_cpp, vocab, tok, False)
        if len(p) == 1 and p[0] not in single_byte:
            single_byte[p[0]] = tok
    enc = lambda s: [int(t) for t in llm.tokenize(s.encode(), add_bos=False, special=False)]

    detok_inputs = [
        ("single byte 0xC3 (UTF-8 lead byte alone)", [single_byte[0xC3]]),
        ("single byte 0xA9 (UTF-8 continuation alone)", [single_byte[0xA9]]),
        ("bytes C3 A9 as two tokens = 'é'", [single_byte[0xC3], single_byte[0xA9]]),
        ("bytes F0 9F 98 as three tokens (truncated emoji)",
         [single_byte[0xF0], single_byte[0x9F], single_byte[0x98]]),
        ("bytes F0 9F 98 80 as four tokens = U+1F600",
         [single_byte[0xF0], single_byte[0x9F], single_byte[0x98], single_byte[0x80]]),
        ("single byte 0x80 (continuation alone)", [single_byte[0x80]]),
        ("byte 0xF4 then 'A' (lead byte cut short)", [single_byte[0xF4], enc("A")[0]]),
        ("specials 0 1 2", [0, 1, 2]),
        ("ChatML prompt ids", [int(t) for t in llm.tokenize(
            CHAT_PROMPT.encode(), add_bos=False, special=True)]),
        ("leading-space word first", enc(" Hello world")),
        ("Hello world! 123", enc("Hello world! 123")),
        ("emoji ZWJ", enc("👨‍👩‍👧‍👦 🇫🇷")),
        ("CJK", enc("我爱自然语言处理")),
        ("whitespace runs", enc("a  b\n\n\nc\r\n\td")),
        ("code", enc("def f(x):\n    return x * 2\n")),
    ]
    detok = []
    for note, ids in detok_inputs:
        plain = detokenize(llama_cpp, vocab, ids, False)
        special = detokenize(llama_cpp, vocab, ids, True)
        wrapper = llm.detokenize(ids)
        if wrapper != plain:
            note += " (llm.detokenize differs: " + wrapper.hex() + ")"
        detok.append({"note": note, "ids": ids, "bytes_hex": plain.hex(),
                      "bytes_hex_special": special.hex()})

    meta = make_meta(args, llama_cpp, "tokenizer", {
        "how": "ids = llm.tokenize(text.encode('utf-8'), add_bos=False, special=parse_special); "
               "detok uses llama_detokenize(vocab, ids, remove_special=false, unparse_special=false "
               "for bytes_hex / true for bytes_hex_special); bytes are hex because they may be "
               "invalid UTF-8",
        "n_vocab": n_vocab,
        "bos_id": int(llama_cpp.llama_vocab_bos(vocab)),
        "eos_id": int(llama_cpp.llama_vocab_eos(vocab)),
        "single_byte_token_ids": {f"{b:02x}": t for b, t in sorted(single_byte.items())},
        "bytes_without_token": [f"{b:02x}" for b in range(256) if b not in single_byte],
        "cases_bytes": "input given as hex bytes because it is not valid UTF-8",
    })
    write_json(os.path.join(args.out, "tokenizer.json"),
               {"meta": meta, "cases": cases, "cases_bytes": byte_cases, "detok": detok})


def eval_prompt(llm, ids):
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[: len(ids), :], dtype=np.float32)


def log_softmax(rows):
    r = rows.astype(np.float64)
    m = r.max(axis=1, keepdims=True)
    return r - m - np.log(np.exp(r - m).sum(axis=1, keepdims=True))


def self_consistency(llm, ids, batch_scores):
    """How far llama.cpp's own decode path (one token per llm.eval) lands from its
    prefill path (all ids in one batch): the scale of noise a test must tolerate."""
    llm.reset()
    for t in ids:
        llm.eval([t])
    inc = np.array(llm.scores[: len(ids), :], dtype=np.float32)
    diff = np.abs(inc - batch_scores)
    la, lb = log_softmax(batch_scores), log_softmax(inc)
    kl = (np.exp(la) * (la - lb)).sum(axis=1)
    return {
        "max_abs_diff": f32(diff.max()),
        "mean_abs_diff": f32(diff.mean()),
        "max_kl": round(float(kl.max()), 7),
        "argmax_agree": int((inc.argmax(axis=1) == batch_scores.argmax(axis=1)).sum()),
        "n_positions": len(ids),
        "first_differing_pos": int(np.argmax(diff.max(axis=1) > 0)) if diff.max() > 0 else None,
    }


def logits_fixture(args, llama_cpp, llm):
    n_vocab = llm.n_vocab()
    fixed_ids = list(range(0, n_vocab, FIXED_ID_STRIDE))
    prompts = []
    for name, text, special in LOGIT_PROMPTS:
        ids = [int(t) for t in llm.tokenize(text.encode(), add_bos=False, special=special)]
        n = len(ids)
        scores = eval_prompt(llm, ids)
        positions = sorted({0, n // 4, n // 2, (3 * n) // 4, n - 1})
        rows = []
        for pos in positions:
            row = scores[pos]
            order = np.argsort(-row, kind="stable")[:TOP_K]
            rows.append({
                "pos": pos,
                "top": [[int(i), f32(row[i])] for i in order],
                "fixed": [f32(row[i]) for i in fixed_ids],
                "max": f32(row.max()),
                "lse": round(log_sum_exp(row), 6),
            })
        prompts.append({"name": name, "text": text, "ids": ids, "positions": rows,
                        "incremental_vs_batch": self_consistency(llm, ids, scores)})

    meta = make_meta(args, llama_cpp, "logits", {
        "how": "Llama(n_ctx=512, n_batch=512, n_ubatch=512, n_threads=2, logits_all=True, "
               "flash_attn=False, KV cache f16); llm.reset(); llm.eval(ids) as one batch; "
               "row pos of llm.scores is the logit vector after feeding ids[0..pos]",
        "n_vocab": n_vocab,
        "top_k": TOP_K,
        "top": "[id, logit] pairs, descending logit, an exact tie broken by the lower id",
        "fixed_ids": {"start": 0, "stride": FIXED_ID_STRIDE, "count": len(fixed_ids)},
        "lse": "log(sum(exp(logits))) in float64 over all n_vocab logits",
        "precision": "llama.cpp quantizes activations to Q8_1 for Q4_1 dot products "
                     "(Q8_0 for Q8_0 weights) and stores K/V as f16, so an engine that "
                     "computes in f32 will not match bit for bit; compare with a tolerance "
                     "and compare rankings away from near-ties",
        "incremental_vs_batch": "per prompt: the same ids fed one llm.eval([id]) at a time, "
                                "compared over all positions with the batch logits stored "
                                "here (KL is KL(batch || incremental) in nats). llama.cpp's "
                                "two paths differ by this much themselves",
    })
    write_json(os.path.join(args.out, "logits.json"), {"meta": meta, "prompts": prompts})


def greedy_fixture(args, llama_cpp, llm):
    runs = []
    for name, text, special in GREEDY_PROMPTS:
        ids = [int(t) for t in llm.tokenize(text.encode(), add_bos=False, special=special)]
        llm.reset()
        llm.eval(ids)
        out, gap, top2 = [], [], []
        for _ in range(GREEDY_STEPS):
            row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
            order = np.argsort(-row, kind="stable")[:2]
            t1, t2 = int(order[0]), int(order[1])
            out.append(t1)
            top2.append(t2)
            gap.append(f32(row[t1] - row[t2]))
            llm.eval([t1])
        text_out = detokenize(llama_cpp, llm._model.vocab, out, True)
        runs.append({"name": name, "prompt_ids": ids, "ids": out, "second_ids": top2,
                     "gap": gap, "min_gap": min(gap),
                     "text": text_out.decode("utf-8", errors="replace")})

    meta = make_meta(args, llama_cpp, "greedy", {
        "how": "Llama(n_ctx=512, n_batch=512, n_threads=2, logits_all=True, flash_attn=False); "
               "llm.eval(prompt_ids) as one batch, then 64 steps of: argmax over the last "
               "logit row (lowest id wins an exact tie), llm.eval([argmax]) one token at a "
               "time. Generation does not stop at EOS (ids 0 and 2).",
        "steps": GREEDY_STEPS,
        "gap": "logit(top1) - logit(top2) at each step; a divergence at a step with a small "
               "gap is explained by a near-tie, one at a large gap is a bug",
        "text": "detokenized output, special tokens rendered, for reading only",
    })
    write_json(os.path.join(args.out, "greedy.json"), {"meta": meta, "runs": runs})


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--build-flags", default=DEFAULT_BUILD_FLAGS,
                    help="CMAKE_ARGS the llama-cpp-python install was built with (recorded)")
    ap.add_argument("--only", choices=["tokenizer", "logits", "greedy"], action="append")
    args = ap.parse_args()

    import llama_cpp
    if getattr(llama_cpp, "__version__", None) != PINNED_VERSION:
        print(f"warning: llama-cpp-python {llama_cpp.__version__} installed, fixtures were "
              f"pinned to {PINNED_VERSION}", file=sys.stderr)
    info = llama_cpp.llama_print_system_info().decode(errors="replace")
    if "AVX512 = 1" in info:
        print("warning: this llama.cpp build uses AVX-512; the recorded flags say otherwise",
              file=sys.stderr)

    args.model_sha256 = sha256_file(args.model)
    os.makedirs(args.out, exist_ok=True)
    llm = llama_cpp.Llama(model_path=args.model, n_ctx=N_CTX, n_batch=N_BATCH, n_ubatch=N_BATCH,
                          n_threads=N_THREADS, n_threads_batch=N_THREADS, logits_all=True,
                          flash_attn=False, seed=0, verbose=False)
    vocab = llm._model.vocab
    todo = args.only or ["tokenizer", "logits", "greedy"]
    if "tokenizer" in todo:
        tokenizer_fixture(args, llama_cpp, llm, vocab)
    if "logits" in todo:
        logits_fixture(args, llama_cpp, llm)
    if "greedy" in todo:
        greedy_fixture(args, llama_cpp, llm)


if __name__ == "__main__":
    main()
