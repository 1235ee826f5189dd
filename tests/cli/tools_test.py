#!/usr/bin/env python3
"""Tool calls through the official `openai` client against `duet serve` (SmolLM2:
the hermes format): tool_choice required and a named function give calls whose
arguments validate (the `jsonschema` package, not duet) against the function's
schema, finish_reason "tool_calls"; auto with a response_format gives a call alone
or content its schema takes alone; parallel_tool_calls false gives one call, and a
question that needs two calls gets both in one answer (their results sent back); a
stream's delta.tool_calls reassemble byte for byte into the whole answer's calls,
for every choice mode and for a call cut by max_tokens; a sampled request with a
seed is the same twice; the whole flow (a call, the tool's result sent back as a
tool message, the final answer); tool_choice none; /v1/models and the start log
name the format; what cannot be honoured is a 400 naming it; and a call streamed
through decode's SIGKILL is re-driven identical.

Usage: tools_test.py path/to/duet   (run with the venv's python)
"""
import json
import os
import re
import signal
import subprocess
import sys
import urllib.request

import jsonschema
import openai

from duet_e2e import START_TIMEOUT, check, check_restarts, drain, stop

DUET = sys.argv[1]
INSTANCE = f"duet-tools-test-{os.getpid()}"
SUBSET = bool(os.environ.get("DUET_E2E_SUBSET"))

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 40},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add", "description": "Adds two integers",
        "parameters": {"type": "object", "properties": {
            "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
            "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
            "required": ["a", "b"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "now", "description": "The time now"}},
]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object", "properties": {},
                                                                      "additionalProperties": False})
           for t in TOOLS}
MSGS = [{"role": "system", "content": "You are a helpful assistant with tools."},
        {"role": "user", "content": "What is the weather in Paris, in celsius? And what is 17 plus 25?"}]


def valid_calls(calls, what, names=None, cut=False):
    """Every call valid against its function's schema; with cut (finish_reason length),
    the last call's arguments may stop anywhere: they must only start an object."""
    check(calls, f"{what}: no calls")
    if cut:
        check(calls[-1].function.arguments.startswith("{"), f"{what}: the cut call {calls[-1]}")
        calls = calls[:-1]
    for call in calls:
        check(call.type == "function" and call.id, f"{what}: {call}")
        name = call.function.name
        check(name in SCHEMAS and (names is None or name in names), f"{what}: a call of {name!r}")
        try:
            args = json.loads(call.function.arguments)
        except ValueError as e:
            check(False, f"{what}: arguments not JSON ({e}): {call.function.arguments!r}")
        try:
            jsonschema.Draft202012Validator(SCHEMAS[name]).validate(args)
        except jsonschema.ValidationError as e:
            check(False, f"{what}: {name} {call.function.arguments!r}: {e.message}")


def streamed(c, **kw):
    """A stream's content, calls (id, name, arguments from the deltas) and finish reason."""
    content, calls, finish = [], {}, None
    for ev in c.chat.completions.create(stream=True, **kw):
        for ch in ev.choices:
            if ch.delta.content:
                content.append(ch.delta.content)
            for d in ch.delta.tool_calls or []:
                if d.id is not None:  # a call's first delta: id, type, name
                    check(d.index not in calls and d.type == "function" and d.function.name,
                          f"a call's first delta: {d}")
                    calls[d.index] = [d.id, d.function.name, ""]
                check(d.index in calls, f"a delta of call {d.index} before its first: {d}")
                check(d.id is None or calls[d.index][0] == d.id, f"a second id for call {d.index}")
                calls[d.index][2] += d.function.arguments or ""
            if ch.finish_reason:
                finish = ch.finish_reason
    check(sorted(calls) == list(range(len(calls))), f"call indexes {sorted(calls)}")
    return "".join(content), [tuple(calls[i]) for i in range(len(calls))], finish


def same_as_whole(c, what, **kw):
    """The request whole, then streamed: the same content, calls and finish reason."""
    whole = c.chat.completions.create(**kw).choices[0]
    content, calls, finish = streamed(c, **kw)
    want = [(t.function.name, t.function.arguments) for t in whole.message.tool_calls or []]
    check([(n, a) for _, n, a in calls] == want, f"{what}: streamed calls {calls} != whole {want}")
    check(content == (whole.message.content or ""), f"{what}: streamed {content!r} != {whole.message.content!r}")
    check(finish == whole.finish_reason, f"{what}: finish {finish} != {whole.finish_reason}")
    return whole


server = subprocess.Popen([DUET, "serve", "--port", "0", "--ctx", "2048", "--instance", INSTANCE,
                           *START_TIMEOUT], stderr=subprocess.PIPE, text=True)
try:
    port, said = None, []
    for line in server.stderr:
        said.append(line)
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
        if m:
            port = int(m.group(1))
            break
    check(port, "the server did not start")
    drain(server)
    check(any("tool calls in the hermes format" in line for line in said),
          "the start log names the tool format:\n" + "".join(said))
    models = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30))
    check(models["data"][0].get("tool_format") == "hermes", f"/v1/models: {models}")
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
    model = c.models.list().data[0].id
    base = dict(model=model, messages=MSGS, tools=TOOLS, max_tokens=160)

    # required and a named function: calls only, valid against the function's schema.
    for choice, names in (("required", None), ({"type": "function", "function": {"name": "add"}}, {"add"}),
                          ({"type": "function", "function": {"name": "now"}}, {"now"})):
        # (Under the sanitizers, DUET_E2E_SUBSET: one call each, the parallel case once.)
        for parallel in ((False,) if SUBSET and choice != "required" else (True, False)):
            kw = dict(base, tool_choice=choice, parallel_tool_calls=parallel, temperature=0)
            what = f"tool_choice {choice}, parallel {parallel}"
            whole = same_as_whole(c, what, **kw)
            # (A small model may repeat a call until max_tokens where several are allowed.)
            check(whole.finish_reason == "tool_calls" or (parallel and whole.finish_reason == "length"),
                  f"{what}: finish {whole.finish_reason}")
            check(whole.message.content is None, f"{what}: content {whole.message.content!r}")
            valid_calls(whole.message.tool_calls, what, names, cut=whole.finish_reason == "length")
            check(parallel or len(whole.message.tool_calls) == 1, f"{what}: {len(whole.message.tool_calls)} calls")
            check(len({t.id for t in whole.message.tool_calls}) == len(whole.message.tool_calls), f"{what}: ids")
    print("required and named: calls valid against their schemas, streamed = whole, one without parallel: ok")

    # auto: text or calls, whatever the model writes, the calls valid; streamed = whole.
    whole = same_as_whole(c, "auto", **dict(base, temperature=0))
    if whole.message.tool_calls:
        valid_calls(whole.message.tool_calls, "auto")
    else:
        check(whole.message.content and whole.finish_reason == "stop", f"auto: {whole}")

    # auto with a response_format: calls alone, or content its schema takes alone.
    # Which one the model picks is its own; a bias on '<' (token 44, the first of
    # "<tool_call>") takes each branch for sure: -100 bans calls, +100 opens one.
    answer = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                               "answer": {"type": "integer"}},
              "required": ["city", "answer"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": answer, "strict": True}}
    kw = dict(base, tool_choice="auto", response_format=fmt, temperature=0, parallel_tool_calls=False)
    content = same_as_whole(c, "auto + response_format, calls banned", **dict(kw, logit_bias={"44": -100}))
    check(not content.message.tool_calls and content.finish_reason == "stop", f"content branch: {content}")
    jsonschema.validate(json.loads(content.message.content), answer)
    call = same_as_whole(c, "auto + response_format, a call opened", **dict(kw, logit_bias={"44": 100}))
    check(call.finish_reason == "tool_calls" and call.message.content is None, f"call branch: {call}")
    valid_calls(call.message.tool_calls, "auto + response_format")
    check(len(call.message.tool_calls) == 1, f"parallel false: {call.message.tool_calls}")
    free = c.chat.completions.create(**dict(base, tool_choice="auto", temperature=0,
                                            response_format={"type": "json_object"})).choices[0]
    if free.message.tool_calls:
        valid_calls(free.message.tool_calls, "auto + json_object")
    else:
        check(isinstance(json.loads(free.message.content), dict), f"auto + json_object: {free}")
    # json_object's content is any object, not only {}: calls banned, a prompt that
    # asks for fields.
    obj = c.chat.completions.create(**dict(base, tool_choice="auto", temperature=0, logit_bias={"44": -100},
                                           response_format={"type": "json_object"}, messages=[
        {"role": "user", "content": "Describe Paris as a JSON object with the keys name, country and population."}]))
    got = json.loads(obj.choices[0].message.content)
    check(isinstance(got, dict) and got, f"auto + json_object, calls banned: {obj.choices[0]}")
    print(f"auto + response_format: content valid against its schema ({content.message.content}), or a call "
          f"alone ({call.message.tool_calls[0].function.name}); json_object: "
          f"{'a call' if free.message.tool_calls else 'an object'}: ok")

    # Sampled with a seed: the same twice, streamed or not; n = 2: calls in each choice.
    kw = dict(base, tool_choice="required", temperature=0.9, seed=11)
    a = c.chat.completions.create(**kw).choices[0].message.tool_calls
    b = c.chat.completions.create(**kw).choices[0].message.tool_calls
    valid_calls(a, "sampled")
    check([(t.function.name, t.function.arguments) for t in a] ==
          [(t.function.name, t.function.arguments) for t in b], f"the same seed: {a} != {b}")
    same_as_whole(c, "sampled", **kw)
    two = c.chat.completions.create(n=2, **kw).choices
    for ch in two:
        valid_calls(ch.message.tool_calls, f"choice {ch.index} of 2")
    print("auto, sampled with a seed (the same twice, streamed = whole), n = 2: ok")

    # A call cut by max_tokens: "length", the arguments it has, streamed = whole.
    cut = same_as_whole(c, "cut", **dict(base, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                         temperature=0, max_tokens=24))
    check(cut.finish_reason == "length" and len(cut.message.tool_calls or []) == 1, f"cut: {cut}")
    check(cut.message.tool_calls[0].function.arguments.startswith("{"), f"cut: {cut}")

    # The whole flow: the call, the tool's result sent back, the final answer.
    first = c.chat.completions.create(**dict(base, temperature=0, tool_choice={
        "type": "function", "function": {"name": "get_weather"}})).choices[0].message
    history = MSGS + [first.model_dump(exclude_none=True)]
    for t in first.tool_calls:
        history.append({"role": "tool", "tool_call_id": t.id, "content": json.dumps({"temperature": 18, "sky": "clear"})})
    final = c.chat.completions.create(model=model, messages=history, tools=TOOLS, tool_choice="none", temperature=0,
                                      max_tokens=60)
    check(final.choices[0].message.content and not final.choices[0].message.tool_calls, f"final: {final}")
    check(final.choices[0].finish_reason in ("stop", "length"), f"final: {final.choices[0].finish_reason}")
    again = c.chat.completions.create(model=model, messages=history, tools=TOOLS, temperature=0, max_tokens=60)
    if again.choices[0].message.tool_calls:
        valid_calls(again.choices[0].message.tool_calls, "after the result")
    # Without tools, the history's calls and results are still written in the format.
    plain = c.chat.completions.create(model=model, messages=history, temperature=0, max_tokens=30)
    check(plain.usage.prompt_tokens == final.usage.prompt_tokens < again.usage.prompt_tokens,
          "the tool list is shown with tool_choice auto, left out with none and without tools")
    print(f"the flow: call, tool result, final answer ({final.choices[0].message.content[:60]!r}...): ok")

    # Parallel calls: a question that needs two gets two in one answer (greedy: the
    # model's own choice, the same every run), streamed as indexes 0 and 1 that
    # reassemble into the whole answer's; both results sent back, a final answer.
    two_cities = [MSGS[0], {"role": "user", "content": "What is the weather in Paris and in London, in celsius?"}]
    pair = same_as_whole(c, "parallel calls", **dict(base, messages=two_cities, tool_choice="required",
                                                     parallel_tool_calls=True, temperature=0))
    calls = pair.message.tool_calls or []
    check(pair.finish_reason == "tool_calls" and len(calls) >= 2, f"parallel calls: {pair}")
    valid_calls(calls, "parallel calls", {"get_weather"})
    check(len({t.id for t in calls}) == len(calls), f"parallel calls: ids {[t.id for t in calls]}")
    cities = {json.loads(t.function.arguments)["city"] for t in calls}
    check({"Paris", "London"} <= cities, f"parallel calls: one for each city: {cities}")
    history = two_cities + [pair.message.model_dump(exclude_none=True)]
    for t, temp in zip(calls, (18, 11, 9, 7)):
        history.append({"role": "tool", "tool_call_id": t.id, "content": json.dumps({"temperature": temp})})
    final = c.chat.completions.create(model=model, messages=history, tools=TOOLS, tool_choice="none", temperature=0,
                                      max_tokens=60)
    check(final.choices[0].message.content and not final.choices[0].message.tool_calls, f"final: {final}")
    print(f"parallel calls: {len(calls)} in one answer ({sorted(cities)}), streamed = whole, both results back: ok")

    # tool_choice none: text only, the tools not shown.
    none = c.chat.completions.create(**dict(base, tool_choice="none", temperature=0, max_tokens=30))
    check(not none.choices[0].message.tool_calls and none.choices[0].message.content, f"none: {none}")
    no_tools = c.chat.completions.create(model=model, messages=MSGS, temperature=0, max_tokens=30)
    check(none.choices[0].message.content == no_tools.choices[0].message.content, "none: as without tools")

    # What cannot be honoured: a 400 naming the field.
    def refused(param, word, **kw):
        try:
            c.chat.completions.create(**dict(base, max_tokens=4, **kw))
        except openai.BadRequestError as e:
            check(e.body.get("param") == param and word in e.body.get("message", ""), f"{kw}: {e.body}")
            return
        check(False, f"accepted: {kw}")
    refused("tools", "web_search_preview", tools=[{"type": "web_search_preview"}])
    refused("tools", "uniqueItems", tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "array", "uniqueItems": True}}}}}])
    refused("tool_choice", "nope", tool_choice={"type": "function", "function": {"name": "nope"}})
    refused("grammar", "tools", extra_body={"grammar": 'root ::= "x"'})
    refused("messages", "tool_call_id", messages=MSGS + [{"role": "tool", "content": "x"}])
    print("refusals name the field: ok")

    # Decode killed in the middle of a sampled stream of calls: re-driven, the calls'
    # grammar rebuilt from the output, the stream the one without a kill.
    kw = dict(base, tool_choice="required", temperature=0.8, seed=5, max_tokens=200)
    want = c.chat.completions.create(**kw).choices[0].message
    want_calls = [(t.function.name, t.function.arguments) for t in want.tool_calls]
    status = subprocess.run([DUET, "shm", "status", INSTANCE, "--json"], capture_output=True, text=True, check=True)
    decode = [p["pid"] for p in json.loads(status.stdout)["processes"] if p["role"] == "decode"]
    calls, killed, n = {}, None, 0
    for ev in c.chat.completions.create(stream=True, **kw):
        for ch in ev.choices:
            for d in ch.delta.tool_calls or []:
                calls.setdefault(d.index, [d.function.name, ""])[1] += d.function.arguments or ""
                n += 1
        if killed is None and n >= 6:
            os.kill(decode[0], signal.SIGKILL)
            killed = n
    check(killed is not None, "the stream ended before decode was killed")
    got = [tuple(calls[i]) for i in sorted(calls)]
    check(got == want_calls, f"after decode's SIGKILL: {got} != {want_calls}")
    print(f"calls streamed through decode's SIGKILL at {killed} deltas: re-driven, identical")
    check_restarts(port, 1)
finally:
    stop(server)
print("ok")
