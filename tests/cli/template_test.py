#!/usr/bin/env python3
"""duet's chat templates against a jinja2 render of the Jinja template each one
stands for (the reference: what Hugging Face's apply_chat_template does, with its
environment: sandboxed, trim_blocks, lstrip_blocks). duet does not run Jinja; it
recognises a model's tokenizer.chat_template and writes the format itself
(src/model/chat_template.h). For each template duet ships support for — the real
model's own (SmolLM2), Meta-Llama-3-8B-Instruct's, Qwen2-Instruct's and plain
ChatML — a GGUF with the real tokenizer and that template is rendered by
`duet chat-template` (which detects the format from the template, as serving does)
and by jinja2, over conversations with system messages or none, several turns,
contents with blanks and newlines around them, non-ASCII and empty contents, other
roles, with and without the generation prompt: every text must be equal.

Usage: template_test.py path/to/duet [model.gguf]   (run with the venv's python)
"""
import json
import os
import subprocess
import sys
import tempfile

from jinja2.sandbox import ImmutableSandboxedEnvironment

from duet_e2e import check
from vocab_gguf import chat_template_of, vocab_of, write_vocab_gguf

DUET = sys.argv[1]
MODEL = sys.argv[2] if len(sys.argv) > 2 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                                           "models", "SmolLM2-135M-Instruct.Q4_1.gguf")

# Published chat templates (each model's tokenizer_config.json), with the special
# tokens their renders take.
TEMPLATES = {
    "llama3": ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
               "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
               "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
               "{{ content }}{% endfor %}{% if add_generation_prompt %}"
               "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}",
               {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
    "qwen2": ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
              "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + "
              "message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
              {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"}),
    "chatml": ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
               "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
               "{% endif %}",
               {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}),
}

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."},
     {"role": "user", "content": "And 3+3?"}],
    [{"role": "system", "content": "  padded system \n"}, {"role": "user", "content": "\n\n  spaced out  \n"},
     {"role": "assistant", "content": " \t answer\t "}, {"role": "user", "content": "next"}],
    [{"role": "user", "content": "日本語とemoji 🙂, «quotes», naïve"}],
    [{"role": "user", "content": ""}],
    [{"role": "user", "content": "multi\nline\n\ntext"}, {"role": "assistant", "content": ""}],
]


def env():
    e = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(msg):
        raise ValueError(msg)
    e.globals["raise_exception"] = raise_exception
    return e


def conversations(name):
    out = list(CONVERSATIONS)
    # Roles beyond the three: a tool result (ChatML formats pass any role; Llama 3 names it ipython).
    out.append([{"role": "user", "content": "Add 2 and 3"}, {"role": "assistant", "content": "calling"},
                {"role": "ipython" if name == "llama3" else "tool", "content": "5"}])
    return out


tokens, types, merges = vocab_of(MODEL)
cases = {"smollm2 (the model's own)": (chat_template_of(MODEL), {"bos_token": "<|im_start|>",
                                                                   "eos_token": "<|im_end|>"})}
cases.update(TEMPLATES)
n = 0
with tempfile.TemporaryDirectory() as tmp:
    for name, (jinja, special) in cases.items():
        path = os.path.join(tmp, "t.gguf")
        write_vocab_gguf(path, "smollm", tokens, types, merges, chat_template=jinja)
        convs = [(c, gen) for c in conversations(name.split()[0]) for gen in (True, False)]
        got = subprocess.run([DUET, "chat-template", "-m", path], capture_output=True, text=True,
                             input="".join(json.dumps({"messages": c, "add_generation_prompt": g}) + "\n"
                                           for c, g in convs))
        check(got.returncode == 0, f"{name}: duet chat-template: {got.stderr}")
        texts = [json.loads(line) for line in got.stdout.splitlines()]
        check(len(texts) == len(convs), f"{name}: {len(texts)} texts for {len(convs)} conversations")
        t = env().from_string(jinja)
        for (conv, gen), text in zip(convs, texts):
            want = t.render(messages=conv, add_generation_prompt=gen, **special)
            check(text == want, f"{name}, {conv}, generation prompt {gen}:\nduet   {text!r}\njinja2 {want!r}")
            n += 1
        print(f"{name}: {len(convs)} renders equal to jinja2's: ok")
print(f"{n} renders: ok")
