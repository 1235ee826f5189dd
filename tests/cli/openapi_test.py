#!/usr/bin/env python3
"""Every shape `duet serve` answers with validates against OpenAI's published OpenAPI
document (tests/fixtures/openai-openapi: its schemas, unchanged; the `jsonschema`
package as the validator, not duet): chat completions whole (plain, logprobs, n = 2,
tool calls, a JSON schema's answer) and every chunk of their streams (the usage chunk
too), completions whole and streamed (logprobs, echo), Responses objects (plain, a
JSON schema, function calls, cut by max_output_tokens, stored and read back) and
every event of their streams, /v1/models, and the errors of refused requests. Each body is read raw over HTTP, before any client library could
fill in what is missing.

Usage: openapi_test.py path/to/duet   (run with the venv's python)
"""
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

import jsonschema

from duet_e2e import check, check_restarts, drain, listening_port, stop

DUET = sys.argv[1]
HERE = os.path.dirname(os.path.abspath(__file__))
DOC = json.load(open(os.path.join(HERE, "..", "fixtures", "openai-openapi", "subset.json")))


def json_schema(o):
    """OpenAPI's schema as JSON Schema: the document is OpenAPI 3.1 (JSON Schema
    2020-12) but still writes 3.0's "nullable": true in places, which JSON Schema does
    not know: such a schema also takes null."""
    if isinstance(o, list):
        return [json_schema(v) for v in o]
    if not isinstance(o, dict):
        return o
    out = {k: json_schema(v) for k, v in o.items() if k != "nullable"}
    return {"anyOf": [{"type": "null"}, out]} if o.get("nullable") is True else out


DOC = json_schema(DOC)


def validator(name):
    # The root holds the components, so that "#/components/schemas/..." resolves.
    return jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{name}", "components": DOC["components"]})


SCHEMAS = {n: validator(n) for n in ("CreateChatCompletionResponse", "CreateChatCompletionStreamResponse",
                                     "CreateCompletionResponse", "ErrorResponse", "ListModelsResponse", "Response",
                                     "ResponseStreamEvent")}
counts = {n: 0 for n in SCHEMAS}


# Each stream event's own schema, by its type (for a message that says what is wrong
# rather than that no branch of the union matched).
EVENT_SCHEMAS = {s["properties"]["type"]["enum"][0]: n for n, s in DOC["components"]["schemas"].items()
                 if n.endswith("Event") and len(s.get("properties", {}).get("type", {}).get("enum", [])) == 1}


def conforms(name, body, what):
    errors = sorted(SCHEMAS[name].iter_errors(body), key=lambda e: list(e.absolute_path))
    if errors and name == "ResponseStreamEvent" and body.get("type") in EVENT_SCHEMAS:
        errors = sorted(validator(EVENT_SCHEMAS[body["type"]]).iter_errors(body), key=lambda e: list(e.absolute_path))
        check(errors, f"{what}: its own schema takes it, the union does not: {json.dumps(body)[:500]}")
    check(not errors, f"{what} does not conform to OpenAI's {name}: " +
          "; ".join(f"at /{'/'.join(map(str, e.absolute_path))}: {e.message[:200]}" for e in errors[:5]) +
          f"\n{json.dumps(body)[:1500]}")
    counts[name] += 1


def post(path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            data = r.read().decode()
            return r.status, data
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def events(data):
    out = []
    for line in data.splitlines():
        if line.startswith("data: ") and line[6:] != "[DONE]":
            out.append(json.loads(line[6:]))
    return out


server = subprocess.Popen([DUET, "serve", "--port", "0", "--ctx", "1024", "--instance", f"duet-openapi-{os.getpid()}"],
                          stderr=subprocess.PIPE, text=True)
try:
    port = listening_port(server)
    check(port, "the server did not start")
    log = drain(server)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as r:
        conforms("ListModelsResponse", json.loads(r.read()), "/v1/models")
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colours."}]
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                               "parameters": {"type": "object", "properties": {
                                                   "city": {"type": "string"}}, "required": ["city"]}}}]
    chats = {
        "plain": {"messages": msgs, "max_tokens": 16, "temperature": 0},
        "logprobs, n = 2": {"messages": msgs, "max_tokens": 8, "temperature": 0.7, "seed": 1, "n": 2,
                            "logprobs": True, "top_logprobs": 3},
        "tool calls": {"messages": msgs, "max_tokens": 60, "temperature": 0, "tools": tools,
                       "tool_choice": "required"},
        "a JSON schema": {"messages": msgs, "max_tokens": 60, "temperature": 0, "response_format": {
            "type": "json_schema", "json_schema": {"name": "colours", "schema": {
                "type": "array", "items": {"type": "string"}, "maxItems": 3}}}},
        "cut by max_tokens": {"messages": msgs, "max_tokens": 2, "temperature": 0},
    }
    for what, body in chats.items():
        st, data = post("/v1/chat/completions", body)
        check(st == 200, f"chat, {what}: {st} {data[:300]}")
        conforms("CreateChatCompletionResponse", json.loads(data), f"chat, {what}")
        st, data = post("/v1/chat/completions", dict(body, stream=True, stream_options={"include_usage": True}))
        check(st == 200, f"chat stream, {what}: {st} {data[:300]}")
        chunks = events(data)
        check(len(chunks) >= 2, f"chat stream, {what}: {len(chunks)} chunks")
        for i, ch in enumerate(chunks):
            conforms("CreateChatCompletionStreamResponse", ch, f"chat stream, {what}, chunk {i}")
    print(f"chat: {len(chats)} kinds of answer, whole and every chunk of their streams: ok")

    completions = {
        "plain": {"prompt": "The sky is", "max_tokens": 8, "temperature": 0},
        "logprobs": {"prompt": "The sky is", "max_tokens": 6, "temperature": 0, "logprobs": 2},
        "echo, n = 2": {"prompt": "The sky is", "max_tokens": 4, "temperature": 0.5, "seed": 3, "n": 2, "echo": True},
    }
    for what, body in completions.items():
        st, data = post("/v1/completions", body)
        check(st == 200, f"completions, {what}: {st} {data[:300]}")
        conforms("CreateCompletionResponse", json.loads(data), f"completions, {what}")
        st, data = post("/v1/completions", dict(body, stream=True))
        check(st == 200, f"completions stream, {what}: {st} {data[:300]}")
        for i, ch in enumerate(events(data)):
            # The document has no schema of its own for the completions API's stream
            # chunks, which OpenAI sends as this object with finish_reason null until
            # the last: null is put aside there, the rest validated.
            for c in ch["choices"]:
                if c["finish_reason"] is None:
                    c["finish_reason"] = "stop"
            conforms("CreateCompletionResponse", ch, f"completions stream, {what}, chunk {i}")
    print(f"completions: {len(completions)} kinds of answer, whole and streamed: ok")

    rtools = [{"type": "function", "name": "get_weather", "description": "Weather in a city",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
    responses = {
        "plain": {"input": "Name three colours.", "instructions": "Be brief.", "max_output_tokens": 24,
                  "temperature": 0},
        "a JSON schema": {"input": "Name three colours.", "max_output_tokens": 60, "temperature": 0,
                          "text": {"format": {"type": "json_schema", "name": "colours", "schema": {
                              "type": "array", "items": {"type": "string"}, "maxItems": 3}}}},
        "function calls": {"input": "Weather in Oslo and Rome?", "tools": rtools, "tool_choice": "required",
                           "max_output_tokens": 80, "temperature": 0},
        "cut by max_output_tokens": {"input": "Tell me a story.", "max_output_tokens": 3, "temperature": 0},
    }
    for what, body in responses.items():
        st, data = post("/v1/responses", body)
        check(st == 200, f"responses, {what}: {st} {data[:300]}")
        resp = json.loads(data)
        conforms("Response", resp, f"responses, {what}")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/responses/{resp['id']}", timeout=30) as r:
            conforms("Response", json.loads(r.read()), f"responses, {what}, read back")
        st, data = post("/v1/responses", dict(body, stream=True))
        check(st == 200, f"responses stream, {what}: {st} {data[:300]}")
        evs = events(data)
        check(len(evs) >= 4, f"responses stream, {what}: {len(evs)} events")
        for i, ev in enumerate(evs):
            conforms("ResponseStreamEvent", ev, f"responses stream, {what}, event {i} ({ev.get('type')})")
    print(f"responses: {len(responses)} kinds of answer, whole, read back, and every event of their streams: ok")

    refused = {
        "/v1/chat/completions": [{"messages": msgs, "frobnicate": 1}, {"messages": []},
                                 {"messages": msgs, "tools": [{"type": "web_search_preview"}]},
                                 {"messages": msgs, "model": "no-such-model"}],
        "/v1/completions": [{"prompt": "x", "max_tokens": -1}, {"prompt": "x", "suffix": "y"}],
        "/v1/responses": [{"input": "x", "background": True}, {"input": "x", "tools": [{"type": "web_search"}]},
                          {"input": "x", "previous_response_id": "resp_none"}],
    }
    for path, bodies in refused.items():
        for body in bodies:
            st, data = post(path, body)
            check(400 <= st < 500, f"{path} {body}: {st}")
            conforms("ErrorResponse", json.loads(data), f"the error of {path} {body}")
    print("errors: ok")
    check_restarts(port, 0)
finally:
    stop(server)
print("validated against OpenAI's OpenAPI document: " + ", ".join(f"{n} x{c}" for n, c in counts.items()))
print("ok")
