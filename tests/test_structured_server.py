"""Structured outputs and tool calls end to end: the real `nanoserve` server (engine in its own
process) on the embedded model, the real openai client. Outputs always parse and validate, streamed or
not, greedy or sampled, n=2; tool_choice required / named give well-formed calls, their arguments
streamed in pieces as they are generated (OpenAI's delta.tool_calls shape); tool results
round-trip through the chat template; bad constraints are 400s naming the field."""
from __future__ import annotations

import json
import os

import httpx
import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletionMessageToolCall

from server_fixture import assert_error

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "address"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "address": {"type": "object", "additionalProperties": False, "required": ["city"],
                                     "properties": {"city": {"type": "string", "maxLength": 20}}}}}
ORDER = {"type": "object", "additionalProperties": False, "required": ["items", "status"], "properties": {
    "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "additionalProperties": False, "required": ["sku", "qty"],
        "properties": {"sku": {"enum": ["A1", "B2", "C3"]},
                       "qty": {"type": "integer", "minimum": 1, "maximum": 9}}}},
    "status": {"enum": ["open", "paid", "shipped"]}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": {"type": "object", "additionalProperties": False,
                                                           "required": ["city", "unit"], "properties": {
                                                               "city": {"type": "string", "maxLength": 20},
                                                               "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone",
                                         "parameters": {"type": "object", "additionalProperties": False,
                                                        "required": ["tz"], "properties": {
                                                            "tz": {"type": "string", "maxLength": 16}}}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _fmt(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}


def _streamed(stream) -> dict[int, dict]:
    """Per choice index: joined content, tool calls (their deltas joined as a client does: id, type and
    name in a call's first delta, argument pieces after it), argument pieces per call, finish reasons."""
    got: dict[int, dict] = {}
    for chunk in stream:
        for ch in chunk.choices:
            g = got.setdefault(ch.index, {"content": "", "calls": {}, "pieces": {}, "reasons": []})
            g["content"] += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                if d.index not in g["calls"]:  # the first delta of a call says what it is
                    assert d.id and d.type == "function" and d.function.name and \
                        d.function.arguments is not None
                    g["calls"][d.index] = ChatCompletionMessageToolCall(
                        id=d.id, type="function", function={"name": d.function.name, "arguments": ""})
                else:
                    assert d.id is None and d.function.name is None and d.function.arguments
                g["calls"][d.index].function.arguments += d.function.arguments
                g["pieces"][d.index] = g["pieces"].get(d.index, 0) + bool(d.function.arguments)
            if ch.finish_reason:
                g["reasons"].append(ch.finish_reason)
    for g in got.values():
        assert sorted(g["calls"]) == list(range(len(g["calls"])))  # parallel calls: indices 0, 1, ...
        g["calls"] = list(g["calls"].values())
    return got


@pytest.mark.parametrize("schema", [PERSON, ORDER], ids=["nested", "array_enum"])
def test_json_schema_chat_stream_and_not(client, model, schema):
    msgs = [{"role": "user", "content": "Give an example record as JSON."}]
    greedy = client.chat.completions.create(model=model, messages=msgs, response_format=_fmt(schema),
                                            temperature=0, max_tokens=100)
    sampled = client.chat.completions.create(model=model, messages=msgs, response_format=_fmt(schema),
                                             temperature=1.0, seed=4, n=2, max_tokens=100)
    for c in greedy.choices + sampled.choices:
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.message.content), schema)
    streamed = _streamed(client.chat.completions.create(model=model, messages=msgs,
                                                        response_format=_fmt(schema), temperature=1.0, seed=4,
                                                        n=2, max_tokens=100, stream=True))
    assert sorted(streamed) == [0, 1]
    for i, g in streamed.items():
        assert g["reasons"] == ["stop"]
        jsonschema.validate(json.loads(g["content"]), schema)
        assert g["content"] == sampled.choices[i].message.content  # same seed: same output streamed or not


def test_json_object_and_guided_fields_on_completions(client, model):
    r = client.chat.completions.create(model=model,
                                       messages=[{"role": "user", "content": "A JSON object, please."}],
                                       response_format={"type": "json_object"}, temperature=0, max_tokens=60)
    c = r.choices[0]
    assert c.finish_reason in ("stop", "length")
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.message.content), dict)
    else:  # cut off by max_tokens: still a prefix of an object
        assert c.message.content.startswith("{")
    comp = client.completions.create(model=model, prompt="The order, as JSON:", max_tokens=80, temperature=0,
                                     n=2, extra_body={"response_format": _fmt(ORDER)})
    for ch in comp.choices:
        jsonschema.validate(json.loads(ch.text), ORDER)
    rx = client.completions.create(model=model, prompt="Call me at", max_tokens=12, temperature=0.9, seed=1,
                                   extra_body={"guided_regex": r"\d{3}-\d{4}"})
    assert len(rx.choices[0].text) == 8 and rx.choices[0].text[3] == "-" and \
        rx.choices[0].finish_reason == "stop"
    choice = client.completions.create(model=model, prompt="Is the sky blue?", max_tokens=5, temperature=0,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert choice.choices[0].text in ("yes", "no")
    gj = client.completions.create(model=model, prompt="Person:", max_tokens=80, temperature=0,
                                   extra_body={"guided_json": PERSON})
    jsonschema.validate(json.loads(gj.choices[0].text), PERSON)


def _check_calls(calls, allowed: set[str]) -> None:
    assert calls
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for tc in calls:
        assert tc.type == "function" and tc.id.startswith("call_") and tc.function.name in allowed
        jsonschema.validate(json.loads(tc.function.arguments), by_name[tc.function.name])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_tool_choice_required_and_named(client, model, choice):
    allowed = {"get_weather", "get_time"} if choice == "required" else {"get_time"}
    for temperature, n in ((0, 1), (1.0, 2)):
        r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice=choice, n=n,
                                           seed=9, temperature=temperature, max_tokens=80)
        for c in r.choices:
            assert c.finish_reason == "tool_calls" and c.message.content is None
            _check_calls(c.message.tool_calls, allowed)
    streamed = _streamed(client.chat.completions.create(model=model, messages=ASK, tools=TOOLS,
                                                        tool_choice=choice, n=2, seed=9, temperature=1.0,
                                                        max_tokens=80, stream=True))
    for i, g in streamed.items():
        assert g["reasons"] == ["tool_calls"] and g["content"] == ""
        _check_calls(g["calls"], allowed)  # the joined pieces validate against the tool's schema
        assert all(g["pieces"][k] > 1 for k in range(len(g["calls"]))), g["pieces"]  # streamed as generated
        assert [tc.function.arguments for tc in g["calls"]] == [tc.function.arguments for tc in
                                                                r.choices[i].message.tool_calls]
    single = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, temperature=0, max_tokens=80)
    assert len(single.choices[0].message.tool_calls) == 1


def test_tool_auto_stream_matches_non_stream(client, model):
    """With auto the model may answer or call; either way the stream carries the same content and calls."""
    plain = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, temperature=0,
                                           max_tokens=24)
    c = plain.choices[0]
    streamed = _streamed(client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, temperature=0,
                                                        max_tokens=24, stream=True))[0]
    assert streamed["reasons"] == [c.finish_reason]
    assert streamed["content"] == (c.message.content or "")
    assert [t.function.name for t in streamed["calls"]] == [t.function.name for t in c.message.tool_calls]
    if c.message.tool_calls:
        _check_calls(c.message.tool_calls, {"get_weather", "get_time"})


def test_tool_message_round_trip(server, client, model):
    call = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS,
                                          tool_choice={"type": "function",
                                                       "function": {"name": "get_weather"}},
                                          temperature=0, max_tokens=60).choices[0].message
    tc = call.tool_calls[0]
    convo = ASK + [{"role": "assistant", "content": None, "tool_calls": [tc.model_dump()]},
                   {"role": "tool", "tool_call_id": tc.id, "content": "18 degrees and sunny"}]
    prompt = httpx.post(server.url + "/tokenize", json={"messages": convo}, timeout=60).json()["tokens"]
    text = httpx.post(server.url + "/detokenize", json={"tokens": prompt}, timeout=60).json()["prompt"]
    assert "18 degrees and sunny" in text and '"get_weather"' in text
    assert json.dumps(json.loads(tc.function.arguments)) in text  # the call's arguments went back in
    answer = client.chat.completions.create(model=model, messages=convo, tools=TOOLS, temperature=0,
                                            max_tokens=8)
    # the tools' description is added to the same conversation
    assert answer.usage.prompt_tokens > len(prompt)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/nope"}}}}}], "tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "x"}, "tools"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_grammar": "start: nothing_defined"}, "guided_grammar"),
])
def test_bad_constraints_are_400_naming_the_field(server, client, model, body, param):
    r = httpx.post(server.base_url + "/chat/completions", json={"messages": ASK, "max_tokens": 4, **body},
                   timeout=60)
    assert_error(r, 400, param)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=ASK, max_tokens=4, extra_body=body)


def test_api_process_runs_without_torch(server, client, model):
    """The API process (HTTP, tokenization, chat templates, tool and grammar checks) runs no model, so it
    never loads torch (~250 MB resident); the engine process does, with glibc's malloc on huge pages.
    Checked after it served a constrained chat, a tool call and a bad constraint."""
    client.chat.completions.create(model=model, messages=ASK, max_tokens=20, response_format=_fmt(PERSON))
    client.chat.completions.create(model=model, messages=ASK, max_tokens=30, tools=TOOLS,
                                   tool_choice="required")
    bad = httpx.post(server.base_url + "/chat/completions", timeout=60, json={
        "model": model, "messages": ASK, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}})
    assert_error(bad, 400, "response_format")
    with open(f"/proc/{server.proc.pid}/maps") as f:
        assert "libtorch" not in f.read()
    engines = [open(f"/proc/{pid}/maps").read() for pid in server.children]
    assert engines and all("libtorch" in maps for maps in engines)
    # and computes with glibc's malloc on huge pages (engine/placement.compute_process_env)
    want = "GLIBC_TUNABLES=" + os.environ.get("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")  # a user's is kept
    envs = [open(f"/proc/{pid}/environ", "rb").read().split(b"\0") for pid in server.children]
    assert all(want.encode() in env for env in envs)
