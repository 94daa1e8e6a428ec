"""Tool calling on the API side, without a server: the tool-call parsers (Hermes / Qwen tags, Llama
3.x JSON), the constraints tool_choice implies, stream hold-back, and tools reaching a chat template
(one that renders them, and the fallback for one that does not)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import jsonschema
import pytest

from nanoserve.chat import render_chat
from nanoserve.server.tools import ToolMode, render_tools_into_messages, template_renders_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, TIME]


def calls(text: str, parallel: bool = True):
    content, tcs = ToolMode(TOOLS, "auto", parallel=parallel).extract(text)
    return content, [(c.function.name, json.loads(c.function.arguments)) for c in tcs]


def test_hermes_tags():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n' \
           '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    assert calls(text) == ("Let me check.", [("get_weather", {"city": "Paris"}), ("get_time", {})])
    assert calls(text, parallel=False)[1] == [("get_weather", {"city": "Paris"})]


def test_llama3_json():
    assert calls('{"name": "get_weather", "parameters": {"city": "Oslo"}}') == (None, [("get_weather", {"city": "Oslo"})])
    assert calls('<|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": '
                 '{"city": "Rome"}}')[1] == [("get_time", {}), ("get_weather", {"city": "Rome"})]


@pytest.mark.parametrize("text", [
    "Just text.", '{"name": "no_such_tool", "parameters": {}}', '{"name": "get_weather", "parameters": [1]}',
    '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>', '{"name": "get_weather"',
])
def test_malformed_or_unknown_calls_stay_content(text):
    assert calls(text) == (text, [])


def test_required_and_named_constraints_and_extraction():
    req = ToolMode(TOOLS, "required", parallel=False)
    schema = json.loads(req.constraint().value)
    out = '[{"name": "get_weather", "parameters": {"city": "Lima"}}]'
    jsonschema.validate(json.loads(out), schema)
    with pytest.raises(jsonschema.ValidationError):  # one call at most without parallel_tool_calls
        jsonschema.validate(json.loads(out) * 2, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "parameters": {}}], schema)
    assert req.extract(out)[1][0].function.name == "get_weather"
    req.constraint().validate()
    named = ToolMode(TOOLS, "named", "get_weather")
    assert json.loads(named.constraint().value) == WEATHER["function"]["parameters"]
    content, tcs = named.extract('{"city": "Lima"}')
    assert content is None and tcs[0].function.name == "get_weather"
    assert json.loads(tcs[0].function.arguments) == {"city": "Lima"}


def test_stream_hold_back():
    auto = ToolMode(TOOLS, "auto")
    assert auto.streamable("Hello there", False) == len("Hello there")
    assert auto.streamable("Hello <tool", True) == len("Hello ")        # a tag may be starting
    assert auto.streamable("Hi <tool_call>{", True) == len("Hi ")
    assert auto.streamable('  {"name"', False) == 0                     # maybe a Llama 3.x call
    assert auto.streamable("<|python", False) == 0
    assert ToolMode(TOOLS, "required").streamable("[{", False) == 0


HERMES_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<call>{{ c.function.name }} {{ c.function.arguments | tojson }}</call>{% endfor %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_tools_reach_a_template_that_renders_them(tmp_path, embedded_dir):
    from transformers import AutoTokenizer
    path = tmp_path / "t.jinja"
    path.write_text(HERMES_TEMPLATE)
    llm = SimpleNamespace(config=SimpleNamespace(chat_template=str(path)),
                          tokenizer=AutoTokenizer.from_pretrained(embedded_dir))
    assert template_renders_tools(llm)
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
            {"role": "tool", "content": "12 C", "tool_call_id": "c1"}]
    text = render_chat(llm, msgs, tools=TOOLS)
    assert text == ('<tools>get_weather;get_time;</tools><|user|>weather?<|assistant|>'
                    '<call>get_weather {"city": "Oslo"}</call><|tool|>12 C<|assistant|>')


def test_fallback_writes_tools_calls_and_results_into_messages():
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
            {"role": "tool", "content": "12 C", "tool_call_id": "c1"}]
    out = render_tools_into_messages(msgs, TOOLS)
    assert out[0]["role"] == "system" and '"get_weather"' in out[0]["content"] and "<tools>" in out[0]["content"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' == out[2]["content"]
    assert out[3] == {"role": "tool", "content": "<tool_response>\n12 C\n</tool_response>"}
    assert msgs[1]["tool_calls"]  # the caller's messages are not modified
