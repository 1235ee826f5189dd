#!/usr/bin/env python3
"""docs/ARCHITECTURE.md's concept table ("Where each concept lives") stays true: every
path it names exists, and every `name` it puts after a path (up to the next path)
occurs in that file or in its header/source sibling. A rename or a move that leaves
the table behind fails here, not in a reader's hands.

Usage: doc_pointers_test.py REPO_ROOT
"""
import os
import re
import sys

root = sys.argv[1]
doc = open(os.path.join(root, "docs/ARCHITECTURE.md")).read()
m = re.search(r"^## \d+\. Where each concept lives\n(.*?)^## ", doc, re.S | re.M)
if not m:
    print("FAIL: docs/ARCHITECTURE.md has no 'Where each concept lives' section", file=sys.stderr)
    sys.exit(1)
rows = [l for l in m.group(1).splitlines() if l.startswith("| ") and not l.startswith("| concept") and "---" not in l]
PATH = re.compile(r"((?:src|shm|kernels|bench|tests|scripts|systemd|docs)/[\w./-]+\.(?:h|cpp|cu|md|py|sh))")
NAME = re.compile(r"`([A-Za-z_][A-Za-z0-9_]*(?:::[A-Za-z_][A-Za-z0-9_]*)*)`")
failures, checked = [], 0


def texts(path):
    """The file and its sibling (.h for a .cpp and back), where a name may be."""
    out = []
    stem, ext = os.path.splitext(path)
    for p in [path] + ([stem + ".h"] if ext in (".cpp", ".cu") else [stem + ".cpp", stem + ".cu"] if ext == ".h" else []):
        full = os.path.join(root, p)
        if os.path.isfile(full):
            out.append(open(full, errors="replace").read())
    return out


for row in rows:
    cells = [c.strip() for c in row.strip("|").split("|")]
    if len(cells) < 2:
        continue
    concept, where = cells[0], cells[1]
    # Split the cell at each path: the names after a path (to the next) are its.
    parts = PATH.split(where)
    current = None
    for i, part in enumerate(parts):
        if i % 2 == 1:
            current = part
            checked += 1
            if not os.path.isfile(os.path.join(root, current)):
                failures.append(f"{concept}: {current} does not exist")
                current = None
            continue
        if current is None:
            continue
        for name in NAME.findall(part):
            if name.startswith("duet") and " " in part:  # a command (`duet bench contexts`)
                continue
            last = name.split("::")[-1]
            checked += 1
            if not any(re.search(rf"\b{re.escape(last)}\b", t) for t in texts(current)):
                failures.append(f"{concept}: `{name}` is not in {current}")
for f in failures:
    print("FAIL:", f, file=sys.stderr)
print(f"{checked} pointers checked, {len(failures)} stale")
sys.exit(1 if failures else 0)
