"""Prompts for speculative decoding: input-grounded ones, whose output copies their
input (prompt lookup's drafts are kept), and open ones (its drafts rarely are).
Shared by tests/cli/speculate_test.py and bench/speculate_bench.py."""

GROUNDED = [
    "Copy this list exactly.\nList: apple, banana, cherry, date, elderberry, fig, grape, honeydew, kiwi, lemon, "
    "mango.\nCopy: apple, banana,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef add(a, b):\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick brown",
    "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. Monday, Tuesday,",
]
OPEN = ["Tell me a short story about a cat.", "Why is the sky blue?", "Write a haiku about rain."]
