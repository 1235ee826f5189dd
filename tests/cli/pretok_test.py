#!/usr/bin/env python3
"""The Llama-3 and Qwen2 pre-tokenizers against Hugging Face's `tokenizers` (the
reference: the library those models' tokenizer.json files are written for). A
GGUF holding the real model's vocabulary and merges with tokenizer.ggml.pre set to
llama-bpe or qwen2 is tokenized by `duet tokenize --jsonl`; the same vocabulary and
merges in a `tokenizers` BPE model, behind the pre-tokenizer each model's
tokenizer.json declares (a Split on its published regex, isolated, then ByteLevel
without its own regex), tokenize the same texts. Every text's ids must be equal:
hand-picked texts for each branch of the regexes (contractions in any case, digit
runs, whitespace runs before newlines and at the end, punctuation runs, scripts
without spaces, emoji, combining marks, Unicode spaces) and 300 random strings over
a pool of such characters. The real model's vocabulary gains the 2- and 3-digit
strings as tokens, so that how digits are grouped shows in the ids.

Qwen2's tokenizer.json also declares an NFC normalizer, which llama.cpp (and so
duet) does not apply: the texts here are NFC already, so the comparison is of the
pre-tokenizer and the BPE alone.

Usage: pretok_test.py path/to/duet [model.gguf]   (run with the venv's python; the
default model is the repository's models/SmolLM2-135M-Instruct.Q4_1.gguf)
"""
import json
import os
import random
import subprocess
import sys
import tempfile
import unicodedata

from tokenizers import Regex, Tokenizer, models, pre_tokenizers

from duet_e2e import check
from vocab_gguf import vocab_of, write_vocab_gguf

DUET = sys.argv[1]
MODEL = sys.argv[2] if len(sys.argv) > 2 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                                           "models", "SmolLM2-135M-Instruct.Q4_1.gguf")

# The pre-tokenizer regexes of Meta-Llama-3's and Qwen2's tokenizer.json.
PATTERNS = {
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+",
}
# Llama-3's BPE takes a word that is a token whole as that token (ignore_merges);
# Qwen2's merges every word.
IGNORE_MERGES = {"llama-bpe": True, "qwen2": False}

TEXTS = [
    "Hello world", "It's", "IT'S", "I'LL go, you'D stay, we'Re here, they'VE left, I'M in", "don't 's 't",
    "1", "12", "123", "1234", "1234567", "3.14159", "1,000,000", "x2y33z444", "٣٤٥ and ١٢",
    "a  b", "a   b", "a \n\nb", "a\n\n\nb", "  leading", "trailing  ", "trailing \n", " \n ", "\t\tx", "\r\n\r\n",
    "x \t \n y", "end   ", "\n", " ", "",
    "!!!", "...?!", "hello!!!\n\n", " (a) [b] {c}", "--flag=value", "a.b.c", "$100.00 & 5%", "«quoted»", "—dash—",
    "def f(x):\n    return x**2\n", '{"a": [1, 2], "b": null}', "<tool_call>\n{}\n</tool_call>", "path/to/file.txt",
    "https://example.com/a?b=c&d=e#f", "user@example.org",
    "你好世界", "日本語のテキスト", "한국어 텍스트", "مرحبا بالعالم", "שלום עולם", "नमस्ते दुनिया", "Привет, мир!",
    "Ελληνικά κείμενα", "café naïve résumé", "Straße ÆØÅ", "👍🏽 ok", "👨‍👩‍👧 family", "🙂🙂🙂", "a🙂b",
    "x\u00a0y", "x\u3000y", "x\u2009y", "x\u200by", "\u0301accent", "ÅΩ", "ǅ titlecase",
    "'s'S's", "O'Neil's", "rock'n'roll", "I've've", "'", "''", "'ll", " 's",
]

POOL = (list("abcXYZ019 '\n\t\r.,!?-_()\"") + ["  ", "\n\n", "'s", "'LL", "'d", "é", "ß", "你", "好", "🙂", "👍🏽",
        "\u00a0", "\u3000", "١", "٣", "Ω", "ǅ", "—", "ا", "ל", "न", "्", "\u0301"])


def nfc(s):
    return unicodedata.normalize("NFC", s) == s


def texts():
    rng = random.Random(42)
    out = list(TEXTS)
    while len(out) < len(TEXTS) + 300:
        t = "".join(rng.choice(POOL) for _ in range(rng.randint(1, 24)))
        if nfc(t):
            out.append(t)
    return out


def reference(pre, tokens, merges):
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges],
                     ignore_merges=IGNORE_MERGES[pre])
    tk = Tokenizer(bpe)
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PATTERNS[pre]), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return tk


tokens, types, merges = vocab_of(MODEL)
# SmolLM2's vocabulary has single digits only, where digit runs would not show how a
# pre-tokenizer groups digits (Llama-3 by threes, Qwen2 one by one): the 2- and
# 3-digit strings are added as tokens, with their merges, to both sides.
for a in "0123456789":
    for b in "0123456789":
        tokens.append(a + b)
        types.append(1)
        merges.append(f"{a} {b}")
for a in "0123456789":
    for bc in (x + y for x in "0123456789" for y in "0123456789"):
        tokens.append(a + bc)
        types.append(1)
        merges.append(f"{a} {bc}")
all_texts = texts()
check(all(nfc(t) for t in all_texts), "every text is NFC")
with tempfile.TemporaryDirectory() as tmp:
    for pre in PATTERNS:
        path = os.path.join(tmp, f"{pre}.gguf")
        write_vocab_gguf(path, pre, tokens, types, merges)
        got = subprocess.run([DUET, "tokenize", "-m", path, "--parse-special", "0", "--jsonl"],
                             input="".join(json.dumps(t) + "\n" for t in all_texts), capture_output=True, text=True)
        check(got.returncode == 0, f"duet tokenize --jsonl ({pre}): {got.stderr}")
        ids = [json.loads(line) for line in got.stdout.splitlines()]
        check(len(ids) == len(all_texts), f"{pre}: {len(ids)} lines for {len(all_texts)} texts")
        tk = reference(pre, tokens, merges)
        bad = [(t, d, tk.encode(t, add_special_tokens=False).ids) for t, d in zip(all_texts, ids)
               if d != tk.encode(t, add_special_tokens=False).ids]
        for t, d, want in bad[:5]:
            print(f"{pre}: {t!r}: duet {d} ({[tokens[i] for i in d]}), tokenizers {want} "
                  f"({[tokens[i] for i in want]})", file=sys.stderr)
        check(not bad, f"{pre}: {len(bad)} of {len(all_texts)} texts tokenized differently from tokenizers")
        print(f"{pre}: {len(all_texts)} texts ({len(TEXTS)} hand-picked, the rest random): ids equal to "
              f"tokenizers {pre} pre-tokenizer and BPE: ok")
print("ok")
