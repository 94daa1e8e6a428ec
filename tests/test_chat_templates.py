"""Real models' chat templates (tests/fixtures, see its README for where they come from) behind the API:
Qwen3's (renders tools itself, `enable_thinking` through chat_template_kwargs) and Gemma 3's (a system
message folded into the first user turn, roles that must alternate, no tools of its own: they reach it
in the Hermes format and the tool results as user turns). First the rendering with the embedded model's
tokenizer, then the real server started with --chat-template and the real openai client; the embedded
SmolLM2 model runs behind both templates (only the prompt text changes), structured outputs make it
answer with a call in the Hermes format."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest

from nanoserve.chat import check_template_kwargs, render_chat
from nanoserve.sampling_params import InvalidRequest
from nanoserve.server.chat_prompt import chat_prompt, fold_tool_turns, takes_tool_turns
from nanoserve.server.tools import ToolMode
from server_fixture import ServerProcess, assert_error
from tests.conftest import KV_GB

FIXTURES = Path(__file__).parent / "fixtures"
QWEN3, GEMMA3 = FIXTURES / "qwen3_chat_template.jinja", FIXTURES / "gemma3_chat_template.jinja"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "required": ["city"],
                                                           "properties": {"city": {"type": "string"}}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
ROUND_TRIP = ASK + [{"role": "assistant", "content": "", "tool_calls": [CALL]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"}]
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
THINK_OFF = "<|im_start|>assistant\n<think>\n\n</think>\n\n"


def _llm(tokenizer, template: Path | None) -> SimpleNamespace:
    """What render_chat reads of an engine: its config's --chat-template and its tokenizer."""
    return SimpleNamespace(config=SimpleNamespace(chat_template=str(template) if template else None),
                           tokenizer=tokenizer)


@pytest.fixture(scope="module")
def tok(embedded_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(embedded_dir)


# ---- rendering -------------------------------------------------------------------------------------
def test_qwen3_enable_thinking_false_adds_the_empty_think_block(tok):
    qwen = _llm(tok, QWEN3)
    head = "<|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n"
    assert render_chat(qwen, ASK, template_kwargs={"enable_thinking": False}) == head + THINK_OFF
    for kwargs in (None, {}, {"enable_thinking": True}):
        assert render_chat(qwen, ASK, template_kwargs=kwargs) == head + "<|im_start|>assistant\n"


@pytest.mark.parametrize("kwargs", [{"tools": []}, {"add_generation_prompt": False}, {"messages": []},
                                    {"tokenize": True}, {"chat_template": "x"}, "enable_thinking", [1]])
def test_template_kwargs_that_are_not_template_options_are_refused(tok, kwargs):
    with pytest.raises(InvalidRequest) as e:
        render_chat(_llm(tok, QWEN3), ASK, template_kwargs=kwargs)
    assert e.value.param == "chat_template_kwargs"
    assert check_template_kwargs({"enable_thinking": False, "custom": [1]}) == \
        {"enable_thinking": False, "custom": [1]}


def test_qwen3_renders_tools_calls_and_results_in_its_own_sections(tok):
    qwen = _llm(tok, QWEN3)
    text = chat_prompt(qwen, ROUND_TRIP, [WEATHER])
    assert text.startswith("<|im_start|>system\n# Tools\n\nYou may call one or more functions")
    assert f"<tools>\n{json.dumps(WEATHER)}\n</tools>" in text  # the template's own tool section
    assert text.endswith(f"<|im_start|>assistant\n{HERMES_CALL}<|im_end|>\n"
                         "<|im_start|>user\n<tool_response>\n18 C and sunny\n</tool_response><|im_end|>\n"
                         "<|im_start|>assistant\n")
    assert takes_tool_turns(qwen) and takes_tool_turns(_llm(tok, None))  # SmolLM2's own template too


def test_gemma3_folds_the_system_message_into_the_first_user_turn(tok):
    gemma = _llm(tok, GEMMA3)
    convo = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Capital of France?"}]
    assert render_chat(gemma, convo) == (
        f"{tok.bos_token}<start_of_turn>user\nAnswer briefly.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n<start_of_turn>user\nCapital of France?<end_of_turn>\n"
        "<start_of_turn>model\n")
    with pytest.raises(InvalidRequest, match="alternate") as e:  # two user turns in a row
        render_chat(gemma, convo[:2] + convo[3:])
    assert e.value.param == "messages"


def test_gemma3_gets_tools_in_the_hermes_format_and_results_as_user_turns(tok):
    gemma = _llm(tok, GEMMA3)
    assert not takes_tool_turns(gemma)
    two_calls = ROUND_TRIP[:1] + [dict(ROUND_TRIP[1], tool_calls=[CALL, dict(CALL, id="call_2")]),
                                  ROUND_TRIP[2], dict(ROUND_TRIP[2], tool_call_id="call_2", content="19 C")]
    text = chat_prompt(gemma, [{"role": "system", "content": "Be brief."}] + two_calls, [WEATHER])
    first_turn = text.split("<end_of_turn>")[0]
    assert first_turn.startswith(f"{tok.bos_token}<start_of_turn>user\nBe brief.\n\nYou may call one or more")
    assert json.dumps(WEATHER) in first_turn and first_turn.endswith("What is the weather in Paris?")
    assert text.endswith(f"<start_of_turn>model\n{HERMES_CALL}\n{HERMES_CALL}<end_of_turn>\n"
                         "<start_of_turn>user\n<tool_response>\n18 C and sunny\n</tool_response>\n"
                         "<tool_response>\n19 C\n</tool_response><end_of_turn>\n<start_of_turn>model\n")
    # the format that prompt asks for is what the hermes parser reads
    content, calls = ToolMode([WEATHER], "auto", parser="hermes").extract(HERMES_CALL)
    assert content is None and [(c.function.name, json.loads(c.function.arguments)) for c in calls] == \
        [("get_weather", {"city": "Paris"})]


def test_fold_tool_turns_keeps_turns_alternating():
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
            {"role": "tool", "content": "r1", "tool_call_id": "x"}, {"role": "tool", "content": "r2"},
            {"role": "user", "content": "and?"}, {"role": "assistant", "content": "b"}]
    assert fold_tool_turns(msgs) == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                                     {"role": "user", "content": "r1\nr2\nand?"},
                                     {"role": "assistant", "content": "b"}]
    assert msgs[2]["role"] == "tool"  # the caller's messages are not modified


def test_llm_chat_passes_chat_template_kwargs(tiny_path):
    from nanoserve.llm import LLM
    from nanoserve.sampling_params import SamplingParams
    with LLM(str(tiny_path("llama-gqa-tied")), dtype="float32", kv_cache_gb=KV_GB,
             chat_template=str(QWEN3)) as llm:
        params = SamplingParams(max_tokens=2, temperature=0)
        off, plain = (llm.chat(ASK, params, chat_template_kwargs=kw)[0]
                      for kw in ({"enable_thinking": False}, None))
        assert off.prompt.endswith(THINK_OFF) and not plain.prompt.endswith(THINK_OFF)
        assert len(off.prompt_token_ids) > len(plain.prompt_token_ids) and len(off.outputs[0].token_ids) == 2
        with pytest.raises(InvalidRequest) as e:
            llm.chat(ASK, params, chat_template_kwargs={"tools": []})
        assert e.value.param == "chat_template_kwargs"


# ---- through the server ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen3(tiny_path):
    """A Qwen3 model (the tiny random one: the SmolLM2 tokenizer, so prompts render as with the embedded
    model) served with Qwen3's template."""
    s = ServerProcess("--model", str(tiny_path("qwen3-qk-norm")), "--chat-template", str(QWEN3),
                      "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def gemma3():
    s = ServerProcess("--chat-template", str(GEMMA3), "--enable-auto-tool-choice", "--tool-call-parser",
                      "hermes")
    yield s
    s.stop()


def _prompt(server: ServerProcess, messages: list[dict], **extra) -> tuple[str, int]:
    """The prompt text a chat request with these messages gets, and its token count (/tokenize)."""
    r = httpx.post(server.url + "/tokenize", json={"messages": messages, **extra}, timeout=60)
    assert r.status_code == 200, r.text
    tokens = r.json()["tokens"]
    text = httpx.post(server.url + "/detokenize", json={"tokens": tokens}, timeout=60).json()["prompt"]
    return text, len(tokens)


def _model(client) -> str:
    return client.models.list().data[0].id


def _forced_call(client, messages: list[dict], **kw):
    """A chat completion with tool_choice auto whose output is constrained to a Hermes call."""
    regex = HERMES_CALL.replace("{", r"\{").replace("}", r"\}")
    return client.chat.completions.create(model=_model(client), messages=messages, tools=[WEATHER],
                                          max_tokens=40, temperature=0,
                                          extra_body={"structured_outputs": {"regex": regex}}, **kw)


def test_server_enable_thinking_through_chat_template_kwargs(qwen3):
    client = qwen3.client()
    off, n_off = _prompt(qwen3, ASK, chat_template_kwargs={"enable_thinking": False})
    on, n_on = _prompt(qwen3, ASK, chat_template_kwargs={"enable_thinking": True})
    plain, n_plain = _prompt(qwen3, ASK)
    assert off.endswith(THINK_OFF) and on == plain and plain.endswith("<|im_start|>assistant\n")
    assert off == plain + THINK_OFF.removeprefix("<|im_start|>assistant\n") and n_off > n_plain == n_on
    for kwargs, n in (({"enable_thinking": False}, n_off), (None, n_plain)):
        r = client.chat.completions.create(model=_model(client), messages=ASK, max_tokens=2, temperature=0,
                                           extra_body={"chat_template_kwargs": kwargs} if kwargs else None)
        assert r.usage.prompt_tokens == n  # the chat request rendered the same prompt


@pytest.mark.parametrize("kwargs", ["enable_thinking", [1], 3, {"tools": []},
                                    {"add_generation_prompt": True}])
def test_server_refuses_bad_chat_template_kwargs(qwen3, kwargs):
    body = {"messages": ASK, "max_tokens": 2, "chat_template_kwargs": kwargs}
    assert_error(httpx.post(qwen3.base_url + "/chat/completions", json=body, timeout=60), 400,
                 "chat_template_kwargs")
    assert_error(httpx.post(qwen3.url + "/tokenize", json=body, timeout=60), 400, "chat_template_kwargs")
    client = qwen3.client()
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=_model(client), messages=ASK, max_tokens=2,
                                               extra_body={"chat_template_kwargs": kwargs})


@pytest.mark.parametrize("field", [{"tools": [WEATHER]},
                                   {"chat_template_kwargs": {"enable_thinking": False}}])
def test_tokenize_refuses_what_only_messages_use_beside_a_prompt(qwen3, field):
    """Given with `prompt`, these would be dropped: refused, naming the field."""
    r = httpx.post(qwen3.url + "/tokenize", json={"prompt": "hi", **field}, timeout=60)
    assert_error(r, 400, next(iter(field)))


def test_server_qwen3_tools_and_hermes_calls(qwen3):
    client = qwen3.client()
    text, n = _prompt(qwen3, ASK, tools=[WEATHER])
    assert "# Tools\n\nYou may call" in text and f"<tools>\n{json.dumps(WEATHER)}\n</tools>" in text
    r = _forced_call(client, ASK)
    assert r.usage.prompt_tokens == n  # the template rendered the tools, once
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == \
        [("get_weather", {"city": "Paris"})]
    streamed = [ch for chunk in _forced_call(client, ASK, stream=True) for ch in chunk.choices]
    assert [ch.finish_reason for ch in streamed if ch.finish_reason] == ["tool_calls"]
    assert "".join(d.function.arguments or "" for ch in streamed for d in ch.delta.tool_calls or []) == \
        c.message.tool_calls[0].function.arguments
    call = c.message.tool_calls[0]
    convo = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                   {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
    text, n = _prompt(qwen3, convo, tools=[WEATHER])
    assert text.endswith(f"<|im_start|>assistant\n{HERMES_CALL}<|im_end|>\n"
                         "<|im_start|>user\n<tool_response>\n18 C and sunny\n</tool_response><|im_end|>\n"
                         "<|im_start|>assistant\n")
    answer = client.chat.completions.create(model=_model(client), messages=convo, tools=[WEATHER],
                                            max_tokens=4, temperature=0)
    assert answer.usage.prompt_tokens == n


def test_server_gemma3_system_message_and_template_errors(gemma3):
    client = gemma3.client()
    convo = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi"}]
    text, n = _prompt(gemma3, convo)
    assert "<start_of_turn>user\nAnswer briefly.\n\nHi<end_of_turn>\n<start_of_turn>model\n" in text
    r = client.chat.completions.create(model=_model(client), messages=convo, max_tokens=4, temperature=0)
    assert r.usage.prompt_tokens == n and r.choices[0].finish_reason in ("stop", "length")
    bad = {"messages": convo + [{"role": "user", "content": "again"}], "max_tokens": 2}
    err = assert_error(httpx.post(gemma3.base_url + "/chat/completions", json=bad, timeout=60), 400,
                       "messages")
    assert "alternate" in err["message"]  # the template's own words, not a 500


def test_server_gemma3_tools_round_trip(gemma3):
    client = gemma3.client()
    c = _forced_call(client, ASK).choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls[0].function.name == "get_weather"
    call = c.message.tool_calls[0]
    convo = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                   {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
    text, n = _prompt(gemma3, convo, tools=[WEATHER])
    assert f"<start_of_turn>model\n{HERMES_CALL}<end_of_turn>\n<start_of_turn>user\n<tool_response>\n" \
           "18 C and sunny\n</tool_response><end_of_turn>\n<start_of_turn>model\n" in text
    answer = client.chat.completions.create(model=_model(client), messages=convo, tools=[WEATHER],
                                            max_tokens=4, temperature=0)
    assert answer.usage.prompt_tokens == n
