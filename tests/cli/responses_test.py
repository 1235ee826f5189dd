#!/usr/bin/env python3
"""The Responses API through the official `openai` client against `duet serve`:

- responses.create whole and streamed: the documented event order (created,
  in_progress, the message item and its part added, text deltas, their ends,
  completed), sequence numbers from 0 in steps of one, and the deltas concatenate to
  what the same request answers whole;
- a conversation by previous_response_id with --contexts-dir: each turn's usage
  shows the earlier turns' tokens were not computed again (cached_tokens at least
  the previous turn's input and output); instructions changed midway are honoured
  (the conversation rendered anew);
- function calls: tool_choice required gives a function_call item valid against its
  schema (jsonschema); its arguments streamed as function_call_arguments deltas equal
  the whole; the tool's result sent back as a function_call_output item continues
  the conversation to a message;
- text.format json_schema: the text validates;
- GET and DELETE /v1/responses/{id}; store false is not kept; a response pushed out
  by --responses-max is 404, and so is its context;
- SIGKILL of every process, then a restart on the same --contexts-dir: every stored
  response reads back the same, and continuing one gives the same text as before the
  kill, its earlier turns read from disk, not computed again; a response context no
  stored response refers to is removed; a previous response whose context was removed
  continues, rendered anew;
- without --contexts-dir: stored in memory (said at start), previous_response_id
  works;
- what cannot be honoured is a 400 naming it.

Usage: responses_test.py path/to/duet   (run with the venv's python)
"""
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import jsonschema
import openai

from duet_e2e import START_TIMEOUT, check, check_restarts, drain, kill_server, stop

DUET = sys.argv[1]


class Server:
    def __init__(self, instance, extra=()):
        self.instance = instance
        self.p = subprocess.Popen([DUET, "serve", "--port", "0", "--ctx", "2048", "--instance", instance, "--grace", "5",
                                   *START_TIMEOUT, *extra],
                                  stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.said = []
        self.port = None
        for line in self.p.stderr:
            self.said.append(line)
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
            if m:
                self.port = int(m.group(1))
                break
        check(self.port, "the server did not start:\n" + "".join(self.said[-30:]))
        self.log = drain(self.p)
        self.c = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", max_retries=0,
                               timeout=600)
        self.model = self.c.models.list().data[0].id

    def status(self, path):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=30) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    def kill_all(self):  # SIGKILL of the whole process group: launcher, front, workers
        kill_server(self.p, self.instance)

    def stop(self):
        stop(self.p, instance=self.instance)


def stream_of(c, **kw):
    """A stream's events (type, the event), checked for order and numbering."""
    evs = list(c.responses.create(stream=True, **kw))
    types = [e.type for e in evs]
    check([e.sequence_number for e in evs] == list(range(len(evs))), f"sequence numbers: {types}")
    check(types[:2] == ["response.created", "response.in_progress"], f"the stream opens: {types[:3]}")
    check(types[-1] in ("response.completed", "response.incomplete"), f"the stream ends: {types[-1]}")
    return evs


def text_of_stream(evs):
    types = [e.type for e in evs]
    deltas = "".join(e.delta for e in evs if e.type == "response.output_text.delta")
    if deltas:
        order = [t for t in types if t in ("response.output_item.added", "response.content_part.added",
                                           "response.output_text.done", "response.content_part.done",
                                           "response.output_item.done")]
        check(order == ["response.output_item.added", "response.content_part.added", "response.output_text.done",
                        "response.content_part.done", "response.output_item.done"], f"a message's events: {order}")
        done = [e for e in evs if e.type == "response.output_text.done"][0]
        check(done.text == deltas, f"output_text.done {done.text!r} != the deltas {deltas!r}")
    return deltas, evs[-1].response


TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                         "required": ["city"], "additionalProperties": False}}]

tmp = tempfile.mkdtemp(prefix="duet-responses-")
cdir = os.path.join(tmp, "contexts")
instance = f"duet-responses-test-{os.getpid()}"
s = Server(instance, ["--contexts-dir", cdir, "--responses-max", "10"])
kills = 0
try:
    check(any("stored responses are durable contexts" in l for l in s.said), "the start log says where responses go")
    c, model = s.c, s.model
    # Whole and streamed.
    kw = dict(model=model, input="What is the capital of France?", instructions="Answer in one sentence.",
              max_output_tokens=40, temperature=0)
    r1 = c.responses.create(**kw)
    check(r1.status == "completed" and r1.output_text and r1.object == "response", f"a response: {r1}")
    check(r1.usage.input_tokens > 0 and r1.usage.output_tokens > 0, f"usage: {r1.usage}")
    text, final = text_of_stream(stream_of(c, **dict(kw, store=False)))
    check(text == r1.output_text and final.output_text == r1.output_text,
          f"streamed {text!r} != whole {r1.output_text!r}")
    print("a response, whole and streamed (events in order, deltas = the whole text): ok")

    # A conversation by previous_response_id: the earlier turns are not computed again.
    turns = [r1]
    for q in ("And of Italy?", "And of Spain?"):
        prev = turns[-1]
        r = c.responses.create(model=model, input=q, previous_response_id=prev.id, instructions=kw["instructions"],
                               max_output_tokens=40, temperature=0)
        before = prev.usage.input_tokens + prev.usage.output_tokens
        check(r.usage.input_tokens_details.cached_tokens >= before,
              f"turn {len(turns) + 1}: cached {r.usage.input_tokens_details.cached_tokens} of "
              f"{r.usage.input_tokens} input tokens; the earlier turns had {before}")
        check(r.previous_response_id == prev.id and r.output_text, f"turn {len(turns) + 1}: {r}")
        turns.append(r)
    print("a 3-turn conversation by previous_response_id: each turn computes only its new input "
          f"(cached {[t.usage.input_tokens_details.cached_tokens for t in turns]} of "
          f"{[t.usage.input_tokens for t in turns]}): ok")
    # Other instructions: the conversation is rendered anew (not continued from the KV).
    other = c.responses.create(model=model, input="And of Germany?", previous_response_id=turns[-1].id,
                               instructions="Answer with one word.", max_output_tokens=20, temperature=0)
    check(other.usage.input_tokens_details.cached_tokens < turns[-1].usage.input_tokens,
          f"other instructions: {other.usage}")

    # Function calls, whole and streamed; the result sent back.
    fkw = dict(model=model, input="What is the weather in Oslo?", tools=TOOLS, tool_choice="required",
               parallel_tool_calls=False, max_output_tokens=60, temperature=0)
    f1 = c.responses.create(**fkw)
    calls = [o for o in f1.output if o.type == "function_call"]
    check(len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id, f"a call: {f1.output}")
    jsonschema.validate(json.loads(calls[0].arguments), TOOLS[0]["parameters"])
    evs = stream_of(c, **dict(fkw, store=False))
    args = "".join(e.delta for e in evs if e.type == "response.function_call_arguments.delta")
    check(args == calls[0].arguments, f"streamed arguments {args!r} != {calls[0].arguments!r}")
    added = [e for e in evs if e.type == "response.output_item.added"]
    check(added and added[0].item.type == "function_call" and added[0].item.name == "get_weather",
          f"a call's item: {added}")
    f2 = c.responses.create(model=model, previous_response_id=f1.id, tools=TOOLS, max_output_tokens=40,
                            temperature=0, input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                                   "output": json.dumps({"celsius": 12, "sky": "rain"})}])
    check(f2.status == "completed" and f2.output, f"after the tool's result: {f2}")
    check(f2.usage.input_tokens_details.cached_tokens >= f1.usage.input_tokens, f"the call's turn reused: {f2.usage}")
    print("function calls: valid, streamed = whole, the result sent back continues: ok")

    # A JSON schema.
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "country": {"type": "string", "maxLength": 20}},
              "required": ["city", "country"], "additionalProperties": False}
    j = c.responses.create(model=model, input="A city and its country, as JSON.", max_output_tokens=80,
                           temperature=0, text={"format": {"type": "json_schema", "name": "place", "schema": schema}})
    jsonschema.validate(json.loads(j.output_text), schema)

    # GET, DELETE, store false.
    got = c.responses.retrieve(turns[1].id)
    check(got.output_text == turns[1].output_text and got.id == turns[1].id, f"GET: {got}")
    tmp_r = c.responses.create(model=model, input="Hi", max_output_tokens=5, temperature=0)
    c.responses.delete(tmp_r.id)
    check(s.status(f"/v1/responses/{tmp_r.id}") == 404 and s.status(f"/v1/contexts/{tmp_r.id}") == 404,
          "a deleted response and its context are gone")
    unstored = c.responses.create(model=model, input="Hi", max_output_tokens=5, temperature=0, store=False)
    check(s.status(f"/v1/responses/{unstored.id}") == 404, "store false is not kept")
    try:
        c.responses.create(model=model, input="x", previous_response_id=unstored.id, max_output_tokens=4)
        check(False, "continued a response that was not stored")
    except openai.NotFoundError as e:
        check(e.body.get("param") == "previous_response_id", f"{e.body}")
    print("GET, DELETE (its context too), store false: ok")

    # A previous response whose context was removed (through /v1/contexts): the stored
    # conversation is rendered anew.
    req = urllib.request.Request(f"http://127.0.0.1:{s.port}/v1/contexts/{turns[0].id}", method="DELETE")
    urllib.request.urlopen(req, timeout=30).read()
    lost = c.responses.create(model=model, input="And of Italy?", previous_response_id=turns[0].id,
                              instructions=kw["instructions"], max_output_tokens=40, temperature=0, store=False)
    check(lost.output_text, f"continued without its context: {lost}")
    print("a previous response whose context is gone: rendered anew: ok")

    # Refusals.
    for field, extra in (("max_output_tokens", {"max_output_tokens": 0}),("background", {"background": True}), ("tools", {"tools": [{"type": "web_search"}]}),
                         ("reasoning", {"reasoning": {"effort": "low"}}), ("conversation", {"conversation": "c1"}),
                         ("input", {"input": [{"type": "input_image", "image_url": "x"}]}),
                         ("frobnicate", {"extra_body": {"frobnicate": 1}})):
        try:
            c.responses.create(**dict(dict(model=model, input="x", max_output_tokens=4), **extra))
            check(False, f"{field} accepted")
        except openai.BadRequestError as e:
            check(e.body.get("param") == field, f"{field}: {e.body}")
    check(s.status(f"/v1/responses/{turns[1].id}?stream=true") == 400, "a query on GET is refused")
    print("refusals name the field: ok")

    # SIGKILL of every process; a restart on the same directory.
    want = c.responses.create(model=model, input="And of Portugal?", previous_response_id=turns[-1].id,
                              instructions=kw["instructions"], max_output_tokens=40, temperature=0, store=False)
    stored = {r.id: c.responses.retrieve(r.id).model_dump() for r in turns + [f1]}
    # A response's context no stored response refers to (as a death between the two
    # leaves): the restart removes it.
    req = urllib.request.Request(f"http://127.0.0.1:{s.port}/v1/contexts", method="POST",
                                 data=json.dumps({"id": "resp_orphan", "tokens": [1, 2, 3]}).encode(),
                                 headers={"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=30).read()
    s.kill_all()
    s = Server(instance, ["--contexts-dir", cdir, "--responses-max", "10"])
    c = s.c
    for rid, body in stored.items():
        check(c.responses.retrieve(rid).model_dump() == body, f"{rid} reads back the same after the SIGKILL")
    check(s.status("/v1/contexts/resp_orphan") == 404 and any("no stored response refers to" in l for l in s.said),
          "the context no response refers to is removed at the restart")
    again = c.responses.create(model=model, input="And of Portugal?", previous_response_id=turns[-1].id,
                               instructions=kw["instructions"], max_output_tokens=40, temperature=0, store=False)
    check(again.output_text == want.output_text,
          f"continued after the SIGKILL: {again.output_text!r} != before it {want.output_text!r}")
    check(again.usage.input_tokens_details.cached_tokens >= turns[-1].usage.input_tokens,
          f"after the restart the earlier turns come from disk: {again.usage}")
    print(f"SIGKILL of every process and a restart: {len(stored)} responses read back the same, a continuation "
          f"equals the one before the kill (cached {again.usage.input_tokens_details.cached_tokens} of "
          f"{again.usage.input_tokens}): ok")

    # --responses-max 10 (7 stored before, read back since): 11 more push out the 7, then the first of them.
    made = [c.responses.create(model=model, input=f"Count to {i}.", max_output_tokens=4, temperature=0)
            for i in range(11)]
    check(s.status(f"/v1/responses/{made[0].id}") == 404 and s.status(f"/v1/contexts/{made[0].id}") == 404,
          "the least recently used response is gone past --responses-max, and its context")
    check(s.status(f"/v1/responses/{made[-1].id}") == 200, "the newest is kept")
    print("--responses-max: the least recently used response and its context go: ok")
    check_restarts(s.port, 0)
except SystemExit:
    print("".join(s.log), file=sys.stderr)
    raise
finally:
    s.stop()

# Without --contexts-dir: in memory.
m = Server(f"duet-responses-mem-{os.getpid()}")
try:
    check(any("stored responses are kept in memory" in l for l in m.said), "the start log says responses are in memory")
    a = m.c.responses.create(model=m.model, input="Name a colour.", max_output_tokens=10, temperature=0)
    b = m.c.responses.create(model=m.model, input="Another one?", previous_response_id=a.id, max_output_tokens=10,
                             temperature=0)
    check(b.output_text and m.c.responses.retrieve(a.id).output_text == a.output_text, f"in memory: {b}")
    print("without --contexts-dir: stored in memory, previous_response_id works: ok")
finally:
    m.stop()
print("ok")
