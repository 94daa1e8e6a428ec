"""Tool calling on the API side, without a server: the tool-call parsers (Hermes / Qwen tags, Llama
3.x JSON), the constraints tool_choice implies, the streamer's events fed in any pieces (arguments as
generated, only possible calls held back), and tools reaching a chat template (one that renders them,
and the fallback for one that does not)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import jsonschema
import pytest

from nanoserve.chat import render_chat
from nanoserve.server.tools import (ArgumentsDelta, CallDone, CallStarted, ContentDelta, ToolCallStreamer,
                                    ToolMode, render_tools_into_messages, template_renders_tools)

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {}}}}
TOOLS = [WEATHER, TIME]


def calls(text: str, parallel: bool = True, parser: str | None = None):
    parser = parser or ("hermes" if "<tool_call>" in text or not text.lstrip().startswith(("{", "<|"))
                        else "llama3_json")
    content, tcs = ToolMode(TOOLS, "auto", parallel=parallel, parser=parser).extract(text)
    return content, [(c.function.name, json.loads(c.function.arguments)) for c in tcs]


def test_hermes_tags():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n' \
           '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    assert calls(text) == ("Let me check.", [("get_weather", {"city": "Paris"}), ("get_time", {})])
    assert calls(text, parallel=False)[1] == [("get_weather", {"city": "Paris"})]


def test_llama3_json():
    assert calls('{"name": "get_weather", "parameters": {"city": "Oslo"}}') == \
        (None, [("get_weather", {"city": "Oslo"})])
    assert calls('<|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_weather", '
                 '"parameters": {"city": "Rome"}}')[1] == \
        [("get_time", {}), ("get_weather", {"city": "Rome"})]


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


def stream(mode: ToolMode, text: str, piece: int) -> tuple[str, list[tuple[str, str]], list]:
    """Feed `text` `piece` characters at a time: (content, [(name, arguments)], events), checking the
    event order: each call started once, then its argument pieces, then done with their concatenation."""
    s = ToolCallStreamer(mode)
    events = [e for i in range(0, len(text), piece) for e in s.feed(text[i:i + piece])] + s.finish()
    content, calls, done = "", {}, set()
    for e in events:
        if isinstance(e, ContentDelta):
            content += e.text
        elif isinstance(e, CallStarted):
            assert e.index == len(calls) and e.id.startswith("call_") and not done - set(range(e.index))
            calls[e.index] = [e.name, ""]
        elif isinstance(e, ArgumentsDelta):
            assert e.index in calls and e.index not in done and e.text
            calls[e.index][1] += e.text
        else:
            assert isinstance(e, CallDone) and e.index not in done and e.arguments == calls[e.index][1]
            done.add(e.index)
    assert done == set(calls)
    return content, [tuple(c) for c in calls.values()], events


HERMES_TWO = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par{is}\\""}}\n'
              '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
LLAMA_TWO = ('<|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_weather", '
             '"parameters": {"city": "Rome"}}')
CASES = [  # (mode, text, content, calls)
    (ToolMode(TOOLS, "auto", parser="hermes"), HERMES_TWO, "Let me check.",
     [("get_weather", '{"city": "Par{is}\\""}'), ("get_time", "{}")]),
    (ToolMode(TOOLS, "auto", parser="hermes", parallel=False), HERMES_TWO, "Let me check.",
     [("get_weather", '{"city": "Par{is}\\""}')]),
    (ToolMode(TOOLS, "auto", parser="hermes"), "Hi <toolbox> and <tool_call>{\"name\": \"nope\", "
     "\"arguments\": {}}</tool_call>",
     "Hi <toolbox> and <tool_call>{\"name\": \"nope\", \"arguments\": {}}</tool_call>", []),
    (ToolMode(TOOLS, "auto", parser="hermes"),
     '<tool_call>{"arguments": {"city": "X"}, "name": "get_weather"}'
     "</tool_call>", "", [("get_weather", '{"city": "X"}')]),  # keys in another order: sent whole
    (ToolMode(TOOLS, "auto", parser="llama3_json"), LLAMA_TWO, "",
     [("get_time", "{}"), ("get_weather", '{"city": "Rome"}')]),
    (ToolMode(TOOLS, "auto", parser="llama3_json"), '  {"name": "no_such_tool", "parameters": {}} ok',
     '  {"name": "no_such_tool", "parameters": {}} ok', []),
    (ToolMode(TOOLS, "auto", parser="llama3_json"), "Plain {text}.", "Plain {text}.", []),
    (ToolMode(TOOLS, "required"), '[{"name":"get_weather","parameters":{"city":"Lima"}},'
     '{"name":"get_time","parameters":{}}]', "", [("get_weather", '{"city":"Lima"}'), ("get_time", "{}")]),
    (ToolMode(TOOLS, "named", "get_weather"), '{"city":"Lima"}', "", [("get_weather", '{"city":"Lima"}')]),
]


@pytest.mark.parametrize("mode, text, content, want", CASES, ids=[
    "hermes", "hermes_single", "hermes_not_calls", "hermes_other_key_order", "llama3", "llama3_unknown_tool",
    "llama3_text", "required", "named"])
def test_streamer_events_in_any_pieces(request, mode, text, content, want):
    """Streamed piece by piece (1, 2, 5 characters or all at once) the same content and calls come out,
    arguments as generated, and extract() (the non-streamed answer) agrees."""
    for piece in (1, 2, 5, len(text)):
        got_content, got_calls, events = stream(mode, text, piece)
        assert (got_content, got_calls) == (content, want), piece
    if want and "other_key_order" not in request.node.name:  # arguments go out as they arrive, not at the end
        assert sum(isinstance(e, ArgumentsDelta) for e in stream(mode, text, 1)[2]) >= len(want[0][1])
    extracted_content, tcs = mode.extract(text)
    assert [(c.function.name, c.function.arguments) for c in tcs] == want
    assert extracted_content == (content or None if want else text)


def test_streamer_holds_back_only_what_may_be_a_call():
    hermes = ToolCallStreamer(ToolMode(TOOLS, "auto", parser="hermes"))
    assert hermes.feed("Hello <tool") == [ContentDelta("Hello")]   # a tag may be starting; whitespace held
    assert hermes.feed("kit> yes") == [ContentDelta(" <toolkit> yes")]
    llama = ToolCallStreamer(ToolMode(TOOLS, "auto", parser="llama3_json"))
    assert llama.feed("  <|pyth") == [] and llama.feed('on_tag|>{"na') == []  # maybe a call
    started = llama.feed('me": "get_weather", "parameters": {"ci')
    assert [type(e) for e in started] == [CallStarted, ArgumentsDelta] and started[1].text == '{"ci'
    named = ToolCallStreamer(ToolMode(TOOLS, "named", "get_weather"))
    assert [type(e) for e in named.feed('{"city": "Li')] == [CallStarted, ArgumentsDelta]
    assert named.finish() == [CallDone(0, '{"city": "Li')]  # cut off: closed incomplete
    assert ToolMode(TOOLS, "named", "get_weather").extract('{"city": "Li') == ('{"city": "Li', [])


HERMES_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<call>{{ c.function.name }} {{ c.function.arguments | tojson }}</call>"
    "{% endfor %}"
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
                {"id": "c1", "type": "function",
                 "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
            {"role": "tool", "content": "12 C", "tool_call_id": "c1"}]
    text = render_chat(llm, msgs, tools=TOOLS)
    assert text == ('<tools>get_weather;get_time;</tools><|user|>weather?<|assistant|>'
                    '<call>get_weather {"city": "Oslo"}</call><|tool|>12 C<|assistant|>')


def test_fallback_writes_tools_calls_and_results_into_messages():
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
            {"role": "tool", "content": "12 C", "tool_call_id": "c1"}]
    out = render_tools_into_messages(msgs, TOOLS)
    assert out[0]["role"] == "system" and '"get_weather"' in out[0]["content"] and \
        "<tools>" in out[0]["content"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' == \
        out[2]["content"]
    assert out[3] == {"role": "tool", "content": "<tool_response>\n12 C\n</tool_response>"}
    assert msgs[1]["tool_calls"]  # the caller's messages are not modified
