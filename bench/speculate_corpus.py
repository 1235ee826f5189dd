#!/usr/bin/env python3
"""Makes bench/speculate_corpus.jsonl: chat prompts for speculative decoding's
benchmark (bench/speculate_bench.py --corpus) and its identity test
(tests/cli/speculate_corpus_test.py), 40 of each kind:

  rewrite     a paragraph with up to 4 seeded spelling mistakes (two neighbouring
              letters swapped; equal letters change nothing), to be written out
              corrected
  summarize   one or two paragraphs, to be summarized
  code_edit   a Python function, a variable renamed or a docstring added
  extraction  order records, each customer's items to be listed
  open        open questions and requests (stories, explanations, ideas)

The first four are input-grounded: a good answer copies much of its input, which is
where drafts from the prompt are kept. The paragraphs and functions are duet's own
text (its docs and Python scripts at the commit that ran this), so the corpus needs
nothing from outside; the order records and the open requests are drawn from word
lists below. Everything is seeded: the same tree gives the same file. The file is
committed, so the benchmark does not move when the docs change; run this again only
to change the corpus, and say so in bench/RESULTS.md.

Usage: speculate_corpus.py [--per-kind 40] [--out bench/speculate_corpus.jsonl]
"""
import argparse
import ast
import glob
import json
import os
import random
import re

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
KINDS = ("rewrite", "summarize", "code_edit", "extraction", "open")


def paragraphs():
    """Prose paragraphs (list items joined) of duet's markdown docs and benchmark
    notes: 250 to 800 characters, no headings, tables or code, in file order."""
    out = []
    files = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")) + glob.glob(os.path.join(ROOT, "src", "**", "*.md"),
                                                                             recursive=True)
                   + [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "bench", "RESULTS.md")])
    for path in files:
        text = open(path, encoding="utf-8").read()
        text = re.sub(r"```.*?```", "", text, flags=re.S)
        for block in re.split(r"\n\s*\n", text):
            lines = [l.strip() for l in block.strip().splitlines()]
            if not lines or any(l.startswith(("#", "|", ">", "<")) for l in lines):
                continue
            p = " ".join(re.sub(r"^([-*]|\d+\.)\s+", "", l) for l in lines)
            if 250 <= len(p) <= 800 and p.count("`") <= 8:
                out.append(p)
    return out


def functions():
    """Top-level Python functions of duet's scripts and tests, 6 to 30 lines, with
    the names they assign (renaming candidates), in file order."""
    out = []
    files = sorted(glob.glob(os.path.join(ROOT, "tests", "cli", "*.py")) + glob.glob(os.path.join(ROOT, "bench", "*.py"))
                   + glob.glob(os.path.join(ROOT, "scripts", "*.py")))
    for path in files:
        if os.path.basename(path) == os.path.basename(__file__):
            continue
        src = open(path, encoding="utf-8").read()
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        lines = src.splitlines()
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.decorator_list:
                continue
            body = lines[node.lineno - 1:node.end_lineno]
            if not 6 <= len(body) <= 30 or max(len(l) for l in body) > 110:
                continue
            names = sorted({t.id for n in ast.walk(node) if isinstance(n, (ast.Assign, ast.For))
                            for t in ast.walk(n.targets[0] if isinstance(n, ast.Assign) else n.target)
                            if isinstance(t, ast.Name) and len(t.id) > 1})
            out.append(("\n".join(body), node.name, names))
    return out


def misspell(rng, text, n):
    """Swaps two neighbouring letters in n distinct words of 5 letters or more."""
    words = text.split(" ")
    cands = [i for i, w in enumerate(words) if re.fullmatch(r"[A-Za-z]{5,}", w)]
    for i in rng.sample(cands, min(n, len(cands))):
        w = words[i]
        k = rng.randrange(1, len(w) - 2)
        words[i] = w[:k] + w[k + 1] + w[k] + w[k + 2:]
    return " ".join(words)


FIRST = ["Ada", "Bruno", "Chen", "Dalia", "Emeka", "Fatima", "Goran", "Hana", "Ines", "Jonas", "Kiri", "Lena",
         "Mateo", "Noor", "Oskar", "Priya", "Quentin", "Rosa", "Sven", "Tariq", "Ulla", "Viktor", "Wen", "Yusuf"]
LAST = ["Abara", "Berg", "Costa", "Dubois", "Eriksen", "Fischer", "Garcia", "Haddad", "Ivanova", "Jensen", "Kowalski",
        "Lindqvist", "Moreau", "Novak", "Okafor", "Petrov", "Rossi", "Sato", "Tanaka", "Varga", "Weber", "Zhang"]
ITEMS = ["desk lamp", "USB cable", "notebook", "coffee grinder", "rain jacket", "water bottle", "keyboard",
         "phone case", "backpack", "tea kettle", "bike light", "yoga mat", "desk chair", "monitor stand",
         "headphones", "wall clock", "frying pan", "sketchbook", "umbrella", "thermos"]
CITIES = ["Lisbon", "Oslo", "Lagos", "Osaka", "Quito", "Tallinn", "Perth", "Tunis", "Lyon", "Krakow", "Seoul"]


def orders(rng):
    lines = []
    for k in range(rng.randrange(5, 9)):
        name = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
        item = rng.choice(ITEMS)
        qty = rng.randrange(1, 6)
        price = rng.randrange(300, 9000) / 100
        lines.append(f"Order {1000 + rng.randrange(9000)}: {name} from {rng.choice(CITIES)} bought {qty} x {item} "
                     f"at {price:.2f} EUR on 2026-{rng.randrange(1, 13):02d}-{rng.randrange(1, 29):02d}.")
    return "\n".join(lines)


TOPICS = ["a lighthouse keeper", "the first snow of winter", "a robot learning to paint", "an old bicycle",
          "a city at night", "a lost key", "the ocean", "a library that never closes", "a fox in a garden",
          "a train journey", "a forgotten letter", "the moon", "a baker at dawn", "a mountain village",
          "a chess game", "a small boat in a storm", "an orchard in autumn", "a clockmaker", "a desert road",
          "a market on Sunday"]
QUESTIONS = ["Why do leaves change colour in autumn?", "How does a refrigerator keep food cold?",
             "What makes a good friend?", "Why do we dream?", "How do bees make honey?",
             "What is the difference between weather and climate?", "Why is exercise good for the brain?",
             "How do airplanes stay in the air?", "What should I know before adopting a dog?",
             "Why do cats purr?", "How can I get better at remembering names?", "What causes thunder?",
             "How do vaccines work?", "Why is the ocean salty?", "How do I start learning to cook?",
             "What makes music sound sad or happy?", "Why do onions make people cry?",
             "How does a compass work?", "What is a good way to plan a week?", "Why do stars twinkle?"]
FORMS = ["Write a short story about {}.", "Write a poem about {}.", "Describe {} in a few sentences.",
         "Give me three ideas for a painting of {}."]


def make(per_kind, seed):
    rng = random.Random(seed)
    paras = paragraphs()
    funcs = [f for f in functions() if f[2]]
    out = []
    for i, p in enumerate(rng.sample(paras, per_kind)):
        out.append({"kind": "rewrite", "messages": [{"role": "user", "content":
                    "Correct the spelling mistakes in this paragraph and write the whole paragraph out again:\n\n"
                    + misspell(rng, p, 4)}]})
    for i in range(per_kind):
        a, b = rng.sample(paras, 2)
        text = a if rng.random() < 0.5 else a + "\n\n" + b
        out.append({"kind": "summarize", "messages": [{"role": "user", "content":
                    "Summarize the following text in two or three sentences.\n\n" + text}]})
    for i, (body, name, names) in enumerate(rng.sample(funcs, per_kind)):
        if i % 4 == 3:
            ask = f"Add a one-line docstring to the function `{name}` and show the whole function."
        else:
            old = rng.choice(names)
            ask = f"Rename the variable `{old}` to `{old}_value` in this function and show the whole function."
        out.append({"kind": "code_edit", "messages": [{"role": "user", "content":
                    ask + "\n\n```python\n" + body + "\n```"}]})
    for i in range(per_kind):
        ask = rng.choice(["List each customer's name with the item they bought, one per line.",
                          "Extract every order number with its customer and city, one per line.",
                          "Write each order as a JSON object with the fields name, item, quantity and price, "
                          "one per line."])
        out.append({"kind": "extraction", "messages": [{"role": "user", "content":
                    ask + "\n\n" + orders(rng)}]})
    opens = [q for q in QUESTIONS] + [f.format(t) for t in TOPICS for f in FORMS]
    for q in rng.sample(opens, per_kind):
        out.append({"kind": "open", "messages": [{"role": "user", "content": q}]})
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--per-kind", type=int, default=40)
    ap.add_argument("--seed", type=int, default=34)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "speculate_corpus.jsonl"))
    a = ap.parse_args()
    rows = make(a.per_kind, a.seed)
    with open(a.out, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"{len(rows)} prompts ({a.per_kind} of each of {', '.join(KINDS)}) -> {a.out}")


if __name__ == "__main__":
    main()
