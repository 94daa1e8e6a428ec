"""The OpenAI Responses API (/v1/responses) end to end: the real server on the embedded model (the
session's default server), the real openai client and its `responses.stream` helper, which checks the
event sequence; every body and event is also validated strictly against the installed openai package's
types. Plus the store's bounds and the request translation, without a server."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from openai._models import construct_type
from openai.lib.streaming.responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from openai.types.responses.response_create_params import ResponseCreateParamsBase
from pydantic import TypeAdapter

from nanoserve.outputs import CompletionOutput, RequestOutput
from nanoserve.server.api_error import APIError
from nanoserve.server.response_store import ResponseStore, StoredResponse
from nanoserve.server.responses_api_objects import ResponseObject
from nanoserve.server.responses_api_render import ResponseBuilder
from nanoserve.server.responses_api_protocol import (IGNORED_FIELDS, IMPLEMENTED_FIELDS, NOT_IMPLEMENTED,
                                                     chat_body, input_messages, parse_responses_request)
from nanoserve.server.tools import ToolMode
from server_fixture import assert_error

WEATHER = {"type": "function", "name": "get_weather",
           "description": "Current weather in a city", "strict": True,
           "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                          "properties": {"city": {"type": "string", "maxLength": 12}}}}
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99}}}
EVENTS = TypeAdapter(ResponseStreamEvent)


def _raw_stream(server, body: dict) -> list[dict]:
    """Every event of a streamed response, each validated against the openai package's event types."""
    events = []
    with httpx.stream("POST", server.base_url + "/responses", json={**body, "stream": True},
                      timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        kind = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                assert event["type"] == kind
                EVENTS.validate_python(event)
                events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    return events


def test_text_stream_then_the_stored_response(server, client, model):
    events = _raw_stream(server, {"model": model, "input": "Name a color.", "max_output_tokens": 6,
                                  "temperature": 0, "metadata": {"k": "v"}})
    types = [e["type"] for e in events]
    assert types[2:4] == ["response.output_item.added", "response.content_part.added"]
    final = events[-1]["response"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done",
                          f"response.{final['status']}"] and final["status"] in ("completed", "incomplete")
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == events[-4]["text"] == final["output"][0]["content"][0]["text"] and deltas
    assert events[-2]["item"]["status"] == final["status"]  # the message is cut off when the response is
    u = final["usage"]
    assert u["output_tokens"] <= 6 and u["total_tokens"] == u["input_tokens"] + u["output_tokens"]
    assert u["output_tokens_details"]["reasoning_tokens"] == 0 and \
        u["input_tokens_details"]["cached_tokens"] >= 0
    if final["status"] == "incomplete":
        assert final["incomplete_details"] == {"reason": "max_output_tokens"} and u["output_tokens"] == 6
    stored = httpx.get(f"{server.base_url}/responses/{final['id']}").json()
    assert stored == final and stored["metadata"] == {"k": "v"}
    got = client.responses.retrieve(final["id"])  # through the client too: the same object, parsed
    assert got.output_text == deltas and Response.model_validate(stored).model_dump() == got.model_dump()


def test_messages_and_instructions_make_the_chat_prompt(server, client, model):
    """system/developer/user/assistant messages and instructions reach the model as the chat template
    renders them: the input token count is the chat prompt's."""
    items = [{"role": "developer", "content": "Answer in French."},
             {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
             {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "Bonjour"}]},
             {"role": "user", "content": "Count to three."}]
    r = client.responses.create(model=model, input=items, instructions="Be brief.", max_output_tokens=2,
                                temperature=0)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "system", "content": "Answer in French."},
            {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Bonjour"},
            {"role": "user", "content": "Count to three."}]
    assert r.usage.input_tokens == \
        httpx.post(server.url + "/tokenize", json={"messages": chat}).json()["count"]
    assert r.instructions == "Be brief." and r.output_text


def test_json_schema_output(client, model):
    fmt = {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}
    with client.responses.stream(model=model, input="Invent a person.", text=fmt, max_output_tokens=40,
                                 temperature=0) as stream:
        final = stream.get_final_response()
    assert final.status == "completed" and final.text.format.type == "json_schema"
    jsonschema.validate(json.loads(final.output_text), PERSON)


def test_function_call_round_trip(server, client, model):
    ask = "What is the weather in Paris?"
    with client.responses.stream(model=model, input=ask, tools=[WEATHER], max_output_tokens=30, temperature=0,
                                 tool_choice={"type": "function", "name": "get_weather"}) as stream:
        events = list(stream)
        first = stream.get_final_response()
    call = first.output[0]
    assert first.status == "completed" and len(first.output) == 1 and call.type == "function_call"
    assert call.name == "get_weather" and call.call_id.startswith("call_") and \
        call.parsed_arguments is not None
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 1 and "".join(deltas) == call.arguments  # streamed as generated, not in one piece
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == [call.arguments]
    # the client runs the tool and sends its result back, with the call, as input
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees and sunny"}
    answer = client.responses.create(model=model, input=[{"role": "user", "content": ask},
                                                         call.model_dump(exclude_none=True), result],
                                     tools=[WEATHER], max_output_tokens=3, temperature=0)
    assert answer.output and answer.usage.input_tokens > first.usage.input_tokens
    # the same turn through previous_response_id: only the result is new input
    chained = client.responses.create(model=model, previous_response_id=first.id, input=[result],
                                      tools=[WEATHER], max_output_tokens=3, temperature=0)
    assert chained.usage.input_tokens == answer.usage.input_tokens  # the same conversation
    # its prefix reused
    assert chained.usage.input_tokens_details.cached_tokens > chained.usage.input_tokens // 2
    assert chained.previous_response_id == first.id


def test_previous_response_id_then_get_and_delete(server, client, model):
    first = client.responses.create(model=model, input="My name is Ada.", instructions="Be brief.",
                                    max_output_tokens=3, temperature=0)
    second = client.responses.create(model=model, input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=3, temperature=0, store=False)
    convo = [{"role": "user", "content": "My name is Ada."},
             {"role": "assistant", "content": first.output_text},
             {"role": "user", "content": "What is my name?"}]  # instructions are not carried over
    assert second.usage.input_tokens == \
        httpx.post(server.url + "/tokenize", json={"messages": convo}).json()["count"]
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    assert_error(httpx.get(f"{server.base_url}/responses/{second.id}"), 404)  # store: false
    client.responses.delete(first.id)
    for call in (lambda: client.responses.retrieve(first.id), lambda: client.responses.delete(first.id),
                 lambda: client.responses.create(model=model, input="Hi", previous_response_id=first.id)):
        with pytest.raises(openai.NotFoundError):
            call()


TOOL_BAD_SCHEMA = dict(WEATHER, parameters={"type": "object", "properties": {"a": {"$ref": "#/nope"}}})


@pytest.mark.parametrize("body, status, param", [
    ({"model": "no-such-model"}, 404, "model"),
    ({"previous_response_id": "resp_unknown"}, 404, "previous_response_id"),
    ({"tools": [TOOL_BAD_SCHEMA]}, 400, "tools"),
    ({"tools": [TOOL_BAD_SCHEMA], "tool_choice": "required"}, 400, "tools"),
    ({"tools": [dict(WEATHER, parameters=[1])]}, 400, "tools"),
    ({"tools": [{"type": "web_search"}]}, 400, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, 400, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "file_search"}}, 400, "tool_choice"),
    ({"background": True}, 400, "background"),
    ({"reasoning": {"effort": "high"}}, 400, "reasoning"),
    ({"include": ["message.output_text.logprobs"]}, 400, "include"),
    ({"truncation": "auto"}, 400, "truncation"),
    ({"no_such_field": 1}, 400, "no_such_field"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "bogus"}}}}, 400,
     "text.format"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, 400,
     "input"),
    ({"input": []}, 400, "input"),
    ({"max_output_tokens": 0}, 400, "max_output_tokens"),
])
def test_bad_requests_get_an_error_naming_the_field(server, model, body, status, param):
    resp = httpx.post(server.base_url + "/responses", json={"model": model, "input": "Hi", **body},
                      timeout=60)
    assert_error(resp, status, param)


def test_errors_through_the_client_and_the_server_keeps_serving(client, model):
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input="Hi")
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.responses.create(model=model, input="Hi", tools=[TOOL_BAD_SCHEMA], tool_choice="required")
    assert client.responses.create(model=model, input="Hi", max_output_tokens=1).output


# ---- without a server ---------------------------------------------------------------------------------
def test_every_openai_request_field_is_implemented_ignored_or_refused():
    known = set(IMPLEMENTED_FIELDS) | set(IGNORED_FIELDS) | set(NOT_IMPLEMENTED)
    assert set(ResponseCreateParamsBase.__annotations__) - known == set()
    for name in IGNORED_FIELDS:
        parse_responses_request({"input": "x", name: None})
    harmless = {"background": False, "background_options": None, "conversation": None,
                "context_management": [], "include": [], "prompt": None, "reasoning": None,
                "max_tool_calls": None, "top_logprobs": 0, "truncation": "disabled", "moderation": None,
                "image": None, "access_programs": None}
    assert set(harmless) == set(NOT_IMPLEMENTED)
    parse_responses_request({"input": "x", **harmless})
    parse_responses_request({"input": "x", "reasoning": {"effort": None, "summary": None}})
    with pytest.raises(APIError) as e:
        parse_responses_request({"input": "x", "conversation": "conv_1"})
    assert e.value.param == "conversation"


def test_requests_become_chat_bodies():
    req = parse_responses_request({"input": "q", "instructions": "be brief", "max_output_tokens": 5,
                                   "tools": [WEATHER],
                                   "tool_choice": {"type": "function", "name": "get_weather"},
                                   "text": {"format": {"type": "json_object"}}})
    body = chat_body(req, input_messages(req.input))
    assert body["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q"}]
    assert body["max_completion_tokens"] == 5 and body["response_format"] == {"type": "json_object"}
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert body["tools"][0]["function"]["parameters"] == WEATHER["parameters"]
    # no tools: fine
    assert "tool_choice" not in chat_body(parse_responses_request({"tool_choice": "auto"}), [])
    schema = chat_body(parse_responses_request({"text": {"format": {"type": "json_schema", "name": "p",
                                                                    "schema": PERSON}}}), [])
    assert schema["response_format"]["json_schema"]["schema"] == PERSON


def test_input_items_become_chat_messages():
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    msgs = input_messages([{"role": "user", "content": "q"}, {"role": "assistant", "content": "let me see"},
                           call, dict(call, call_id="c2"), {"type": "function_call_output", "call_id": "c1",
                                                            "output": "r"}])
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool"]
    assert [c["id"] for c in msgs[1]["tool_calls"]] == ["c1", "c2"] and msgs[2]["tool_call_id"] == "c1"
    with pytest.raises(APIError):
        input_messages([{"type": "item_reference", "id": "msg_1"}])


def test_store_is_bounded_by_count_and_bytes_oldest_first():
    entry = StoredResponse(json.dumps({"output": []}), [{"role": "user", "content": "x" * 100}])
    store = ResponseStore(max_count=3, max_bytes=10 * entry.size)
    for i in range(5):
        store.put(f"r{i}", entry)
    assert list(store.entries) == ["r2", "r3", "r4"] and store.bytes == 3 * entry.size
    with pytest.raises(APIError) as e:
        store.get("r0", param="previous_response_id")
    assert e.value.status == 404 and e.value.param == "previous_response_id"
    store = ResponseStore(max_count=100, max_bytes=int(2.5 * entry.size))
    for i in range(4):
        store.put(f"r{i}", entry)
    assert list(store.entries) == ["r2", "r3"] and store.bytes <= store.max_bytes
    assert not store.put("huge", StoredResponse("{}", [{"content": "x" * store.max_bytes}]))
    store.delete("r2")
    assert list(store.entries) == ["r3"] and store.bytes == entry.size


def _events_of(builder: ResponseBuilder, texts: list[str], finish: str,
               tokens: int = 5) -> tuple[list[dict], list]:
    """Feed the builder one choice's growing text, the last output finished with `finish`; every event
    goes through the openai client's own stream state (the checks `responses.stream` makes), whose
    events come back too."""
    state, events, parsed = ResponseStreamState(input_tools=[WEATHER], text_format=openai.omit), [], []
    outs = [CompletionOutput(0, t, list(range(tokens)), None, stream_text=t) for t in texts[:-1]]
    outs.append(CompletionOutput(0, texts[-1], list(range(tokens)), finish))
    for sse in builder.opening() + [s for c in outs for s in builder.update(
            RequestOutput("r", None, [1, 2, 3], [c], c.finish_reason is not None, num_cached_tokens=2))]:
        event = json.loads(sse.split("data: ", 1)[1])
        EVENTS.validate_python(event)
        parsed += state.handle_event(construct_type(type_=ResponseStreamEvent, value=event))
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events, parsed


def _builder(mode: ToolMode | None, kept: list) -> ResponseBuilder:
    skeleton = ResponseObject(id="resp_1", created_at=0, status="in_progress", model="m", tools=[WEATHER])
    return ResponseBuilder(skeleton, mode, kept.append)


def test_auto_tool_choice_content_then_a_streamed_call():
    mode = ToolMode([{"type": "function", "function": {k: WEATHER[k] for k in ("name", "parameters")}}],
                    "auto", parser="hermes")
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    kept: list = []
    events, parsed = _events_of(_builder(mode, kept), [text[:k] for k in range(4, len(text), 7)] + [text],
                                "stop")
    final = parsed[-1].response
    assert [o.type for o in final.output] == ["message", "function_call"] and final.status == "completed"
    assert final.output[0].content[0].text == "Let me check." and \
        final.usage.input_tokens_details.cached_tokens == 2
    call = final.output[1]
    assert json.loads(call.arguments) == {"city": "Paris"} and call.parsed_arguments == {"city": "Paris"}
    assert len([e for e in events if e["type"] == "response.function_call_arguments.delta"]) > 1
    assert [r.model_dump(mode="json") for r in kept] == [events[-1]["response"]]  # stored once, as sent


def test_cut_off_call_is_incomplete_and_a_failure_is_reported():
    mode = ToolMode([{"type": "function", "function": {"name": "get_weather"}}], "named", "get_weather")
    kept: list = []
    events, _ = _events_of(_builder(mode, kept), ['{"ci', '{"city": "Pa'], "length")
    assert events[-1]["type"] == "response.incomplete"
    final = events[-1]["response"]
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [(o["type"], o["status"], o["arguments"]) for o in final["output"]] == [
        ("function_call", "incomplete", '{"city": "Pa')]
    assert len(kept) == 1
    failing = _builder(None, kept)
    failing.opening()
    failing.update(RequestOutput("r", None, [1], [CompletionOutput(0, "Hi", [7])], False))
    events = [json.loads(s.split("data: ", 1)[1])
              for s in failing.fail("the engine died", "service_unavailable")]
    assert [e["type"] for e in events] == ["error", "response.failed"] and len(kept) == 1  # not stored
    assert events[1]["response"]["error"]["message"] == "the engine died"
