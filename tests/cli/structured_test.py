#!/usr/bin/env python3
"""Structured outputs through the official `openai` client against `duet serve`:
every schema of the corpus (schema_corpus.py, every honoured keyword) answered
greedy and not streamed, and sampled and streamed, on chat and completions; every
output validated by the `jsonschema` package (not by duet) and ending with
finish_reason "stop"; a stream's deltas concatenate to what the same request
answers whole; json_object; llama.cpp's json_schema and grammar fields; each
unsupported keyword a 400 naming it; and a constrained stream through a SIGKILL of
decode, re-driven, identical.

Usage: structured_test.py path/to/duet   (run with the venv's python)
"""
import concurrent.futures
import json
import os
import re
import signal
import subprocess
import sys
import urllib.request

import jsonschema
import openai

from duet_e2e import START_TIMEOUT, check, check_restarts, drain, listening_port, stop
from schema_corpus import corpus, unsupported

DUET = sys.argv[1]
INSTANCE = f"duet-structured-test-{os.getpid()}"
SUBSET = bool(os.environ.get("DUET_E2E_SUBSET"))

DATE_TIME = re.compile(r"^\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$")
TIME = re.compile(r"^\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$")
DURATION = re.compile(r"^P(?!$)(\d+Y)?(\d+M)?(\d+W)?(\d+D)?(T(?=\d)(\d+H)?(\d+M)?(\d+(\.\d+)?S)?)?$")
HOSTNAME = re.compile(r"^(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}"
                      r"[A-Za-z0-9])?)*$")
FORMATS = jsonschema.FormatChecker()
# Formats whose checkers need packages jsonschema leaves optional: RFC 3339 and
# ISO 8601's grammar, by hand.
for name, rx in (("date-time", DATE_TIME), ("time", TIME), ("duration", DURATION), ("hostname", HOSTNAME)):
    FORMATS.checks(name)(lambda v, rx=rx: not isinstance(v, str) or bool(rx.match(v)))


def valid(schema, text, what):
    try:
        value = json.loads(text)
    except ValueError as e:
        check(False, f"{what}: not JSON ({e}): {text!r}")
    try:
        jsonschema.Draft202012Validator(schema, format_checker=FORMATS).validate(value)
    except jsonschema.ValidationError as e:
        check(False, f"{what}: {text!r} does not validate: {e.message}")
    return value


server = subprocess.Popen([DUET, "serve", "--port", "0", "--ctx", "1024", "--instance", INSTANCE,
                           *START_TIMEOUT], stderr=subprocess.PIPE, text=True)
try:
    port = listening_port(server)
    check(port, "the server did not start")
    drain(server)
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
    model = c.models.list().data[0].id

    schemas = corpus()
    check(len(schemas) >= 50, f"the corpus has {len(schemas)} schemas")
    if SUBSET:  # under ASan, where xgrammar is not instrumented (cmake/xgrammar.cmake): duet's mask path
        schemas = schemas[::10]
    # A small model may write a string the schema leaves unbounded until max_tokens:
    # such an output ("length") is a prefix the grammar allowed, not a value to
    # validate. Which outputs do depends on the kernel level's last bits (on AVX2 a
    # sampled "event" did, 2026-12-05), so up to a tenth of them may; the rest must
    # stop and validate.
    # Each schema's four requests in order, four schemas at a time: the server batches
    # them (an output does not depend on its batch), which shortens this test on the
    # 2-core build machines.
    def one_schema(i, name, schema, prompt):
        """Checks one schema's outputs; returns those cut by max_tokens."""
        cut = []
        rf = {"type": "json_schema", "json_schema": {"name": name.replace("-", "_"), "schema": schema, "strict": True}}
        msgs = [{"role": "system", "content": "Answer in JSON."}, {"role": "user", "content": prompt}]
        # Greedy, whole; chat and (every other schema) completions.
        whole = c.chat.completions.create(model=model, messages=msgs, max_tokens=400, temperature=0,
                                          response_format=rf).choices[0]
        check(whole.finish_reason in ("stop", "length"), f"{name} greedy: finish_reason {whole.finish_reason}: "
                                                         f"{whole.message.content!r}")
        if whole.finish_reason == "stop":
            valid(schema, whole.message.content, f"{name} greedy")
        else:
            cut.append(f"{name} greedy")
        # The same request streamed: the deltas are the whole answer.
        parts, finish = [], None
        for ev in c.chat.completions.create(model=model, messages=msgs, max_tokens=400, temperature=0,
                                            response_format=rf, stream=True):
            for ch in ev.choices:
                parts.append(ch.delta.content or "")
                finish = ch.finish_reason or finish
        check("".join(parts) == whole.message.content and finish == whole.finish_reason,
              f"{name}: streamed {''.join(parts)!r} ({finish}) != whole {whole.message.content!r}")
        # Sampled, streamed, seeded; and the same seed again gives the same output.
        kw = dict(model=model, max_tokens=400, temperature=0.7, top_p=0.9, seed=100 + i, frequency_penalty=1.0)
        if i % 2:
            kw.update(prompt=f"Answer in JSON. {prompt}\n", extra_body={"response_format": rf})
            text = "".join(ch.text for ev in c.completions.create(stream=True, **kw) for ch in ev.choices)
            again = c.completions.create(**kw).choices[0]
            check(again.finish_reason in ("stop", "length"), f"{name} sampled (completions): {again.finish_reason}")
            check(again.text == text, f"{name} sampled: the seed's output differs: {text!r} vs {again.text!r}")
            finish = again.finish_reason
        else:
            text = "".join(ch.delta.content or "" for ev in c.chat.completions.create(
                messages=msgs, response_format=rf, stream=True, **kw) for ch in ev.choices)
            again = c.chat.completions.create(messages=msgs, response_format=rf, **kw).choices[0]
            check(again.finish_reason in ("stop", "length"), f"{name} sampled: {again.finish_reason}")
            check(again.message.content == text, f"{name} sampled: the seed's output differs")
            finish = again.finish_reason
        if finish == "stop":
            valid(schema, text, f"{name} sampled")
        else:
            cut.append(f"{name} sampled")
        return cut

    # The first schema request, alone: prefill and decode both compile its grammar
    # ahead (GrammarSet::prefetch): prefill while it computes the prompt, decode while
    # prefill has it, so that neither stalls the other requests' passes for it.
    def grammar_compiles():
        page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
        return {(m[1], m[2]): int(m[3]) for m in re.finditer(
            r'^duet_worker_grammar_compiles_total\{role="(\w+)",worker="0",where="(\w+)"\} (\d+)$', page, re.M)}
    before = grammar_compiles()
    check(before.get(("decode", "step")) == 0 and before.get(("decode", "ahead")) == 0,
          f"/metrics before any schema: {before}")
    # A long system message: prefill takes long enough that decode's scan (once a
    # millisecond) and its compile thread get to the request first on a loaded machine.
    name, schema, prompt = schemas[0]
    long_system = "Answer in JSON. " + " ".join(f"Rule {k}: keep every value short and exact." for k in range(40))
    first = c.chat.completions.create(
        model=model, max_tokens=400, temperature=0,
        messages=[{"role": "system", "content": long_system}, {"role": "user", "content": prompt}],
        response_format={"type": "json_schema", "json_schema": {"name": "first", "schema": schema}}).choices[0]
    check(first.finish_reason in ("stop", "length"), f"{name}: finish_reason {first.finish_reason}")
    after = grammar_compiles()
    check(after.get(("prefill", "step")) == 0 and after.get(("prefill", "ahead")) == 1
          and after.get(("decode", "step")) == 0 and after.get(("decode", "ahead")) == 1,
          f"grammar compiles after the first schema request: {after}")
    print(f"the first schema: compiled ahead by prefill and by decode: {after}")

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(one_schema, i, *s) for i, s in enumerate(schemas)]
        try:
            cut = [label for f in futures for label in f.result()]
        except BaseException:
            pool.shutdown(cancel_futures=True)
            raise
    n = len(schemas)
    check(len(cut) <= max(1, 2 * n // 10), f"{len(cut)} of {2 * n} outputs cut by max_tokens: {cut}")
    print(f"{n} schemas: greedy, streamed and sampled outputs all validate (jsonschema), finish_reason stop; "
          f"{len(cut)} of {2 * n} cut by max_tokens ({', '.join(cut) or 'none'})")

    # json_object, and llama.cpp's fields on the completions API.
    out = c.chat.completions.create(model=model, max_tokens=300, temperature=0, response_format={"type": "json_object"},
                                    messages=[{"role": "user", "content": 'Repeat exactly: {"cat": "Tom", "age": 3}'}]).choices[0]
    check(out.finish_reason == "stop" and isinstance(json.loads(out.message.content), dict),
          f"json_object: {out.message.content!r}")
    out = c.completions.create(model=model, prompt="A colour: ", max_tokens=20, temperature=0,
                               extra_body={"json_schema": {"enum": ["red", "green"]}}).choices[0]
    check(json.loads(out.text) in ("red", "green") and out.finish_reason == "stop", f"json_schema field: {out.text!r}")
    out = c.completions.create(model=model, prompt="Is the sky blue? Answer: ", max_tokens=8, temperature=0,
                               extra_body={"grammar": 'root ::= ("yes" | "no") "."'}).choices[0]
    check(out.text in ("yes.", "no.") and out.finish_reason == "stop", f"grammar field: {out.text!r}")
    # max_tokens cuts a constrained output like any other: "length".
    out = c.chat.completions.create(model=model, max_tokens=3, temperature=0, response_format={"type": "json_object"},
                                    messages=[{"role": "user", "content": "A long JSON object."}]).choices[0]
    check(out.finish_reason == "length", f"cut by max_tokens: {out.finish_reason}")
    print("json_object, llama.cpp's json_schema and grammar, and max_tokens: ok")

    # Each unsupported keyword: a 400 naming response_format and the keyword.
    msgs = [{"role": "system", "content": "Answer in JSON."}, {"role": "user", "content": schemas[-1][2]}]
    for schema, word in unsupported():
        try:
            c.chat.completions.create(model=model, max_tokens=4, messages=msgs, response_format={
                "type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
            check(False, f"accepted: {schema}")
        except openai.BadRequestError as e:
            check(e.body.get("param") == "response_format" and word in e.body.get("message", ""),
                  f"{schema}: {e.body}")
    print(f"{len(unsupported())} unsupported keywords: each a 400 naming it")

    # Decode killed in the middle of a constrained, sampled stream: re-driven, and the
    # grammar's state rebuilt from the output, so the stream is the one without a kill.
    schema = {"type": "array", "items": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False}, "minItems": 8, "maxItems": 8}
    kw = dict(model=model, prompt="Eight people as JSON: ", max_tokens=500, temperature=0.8, seed=9,
              extra_body={"json_schema": schema})
    want = c.completions.create(**kw).choices[0]
    check(want.finish_reason == "stop", f"the reference stream: {want.finish_reason}")
    valid(schema, want.text, "the reference stream")
    status = subprocess.run([DUET, "shm", "status", INSTANCE, "--json"], capture_output=True, text=True, check=True)
    decode = [p["pid"] for p in json.loads(status.stdout)["processes"] if p["role"] == "decode"]
    parts, killed = [], None
    for ev in c.completions.create(stream=True, **kw):
        parts.extend(ch.text for ch in ev.choices)
        if killed is None and len(parts) >= 20:
            os.kill(decode[0], signal.SIGKILL)
            killed = len(parts)
    check(killed is not None, "the stream ended before decode was killed")
    check("".join(parts) == want.text, f"after decode's SIGKILL: {''.join(parts)!r} != {want.text!r}")
    print(f"a constrained stream through decode's SIGKILL at {killed} parts: re-driven, identical, valid")
    check_restarts(port, 1)
finally:
    stop(server)
print("ok")
