"""The OpenAI Responses API request (`POST /v1/responses`): which fields it implements, which it accepts
and ignores on purpose, which it refuses, and its translation into a chat-completions body, so that a
Responses request runs through the same chat template, tool modes and output constraints as a chat one.

Unlike chat completions, a field this module does not know is refused (as OpenAI does), so a field that
would change the answer is never accepted silently."""
from __future__ import annotations

import json
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from nanoserve.server.api_error import APIError
from nanoserve.server.protocol import parse

# Accepted and ignored on purpose: none of them changes what the client gets back (chat's list is
# protocol.ACCEPTED_IGNORED).
IGNORED_FIELDS = {
    "user": "an end-user id for the provider's abuse monitoring", "safety_identifier": "the same, newer name",
    "service_tier": "a processing tier: there is one", "prompt_cache_key": "a hint for prefix-cache routing: "
    "the prefix cache needs none", "prompt_cache_retention": "the same cache's lifetime",
    "prompt_cache_options": "explicit cache writes and their lifetime: the prefix cache is automatic",
    "stream_options": "include_obfuscation pads stream events against length side channels: none are padded",
}

# Known fields that nanoserve does not implement, each with the test for its harmless value: any other
# value is a 400 naming the field. (Built-in tools and the other tool_choice kinds are refused where the
# tools are read.)
NOT_IMPLEMENTED: dict[str, Callable[[Any], bool]] = {
    "background": lambda v: not v,
    "background_options": lambda v: v is None,
    "conversation": lambda v: v is None,
    "context_management": lambda v: not v,
    "include": lambda v: not v,
    "prompt": lambda v: v is None,
    "reasoning": lambda v: v is None or isinstance(v, dict) and all(x in (None, "none") for x in v.values()),
    "max_tool_calls": lambda v: v is None,
    "top_logprobs": lambda v: not v,
    "truncation": lambda v: v in (None, "disabled"),
    "moderation": lambda v: v is None,
    "image": lambda v: v is None,
    "access_programs": lambda v: v is None,
}

IMPLEMENTED_FIELDS = ("model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools",
                      "tool_choice", "parallel_tool_calls", "text", "stream", "store", "previous_response_id",
                      "metadata")

# chat-completions parameter -> the Responses parameter a client wrote (errors name the latter)
_PARAM_NAMES = {"messages": "input", "response_format": "text.format",
                "max_completion_tokens": "max_output_tokens",
                "max_tokens": "max_output_tokens", "prompt": "input"}


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")  # items echoed back from an output carry more fields


class TextFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Lenient):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the default; low/high would change the answer


class ResponsesRequest(_Lenient):
    model: str | None = None
    input: str | list[dict] | None = None
    instructions: str | None = None
    max_output_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None

    def format(self) -> TextFormat:
        return self.text.format if self.text and self.text.format else TextFormat(type="text")

    def echo_tool_choice(self) -> str | dict:
        return self.tool_choice if self.tool_choice is not None else "auto"


def parse_responses_request(obj: Any) -> ResponsesRequest:
    """The validated request; a 400 naming the field for an unknown field or one not implemented."""
    if not isinstance(obj, dict):
        raise APIError("the request body must be a JSON object")
    for name, value in obj.items():
        if name in NOT_IMPLEMENTED:
            if not NOT_IMPLEMENTED[name](value):
                raise APIError(f"'{name}' is not supported by this server; the request was not run",
                               param=name, code="unsupported_parameter")
        elif name not in IMPLEMENTED_FIELDS and name not in IGNORED_FIELDS:
            raise APIError(f"Unknown parameter: '{name}'.", param=name, code="unknown_parameter")
    return parse(ResponsesRequest, obj)


# ---- input items -> chat messages ---------------------------------------------------------------------
def _text_of(content: Any, where: str, allowed: tuple[str, ...]) -> str:
    """The text of a message's content: a string or a list of text parts (other parts are a 400)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(f"{where}: content must be a string or a list of parts", param="input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in allowed or not isinstance(part.get("text" if kind != "refusal" else "refusal"), str):
            raise APIError(f"{where}.content[{j}]: only text parts ({', '.join(allowed)}) are supported, got "
                           f"type {kind!r}", param="input", code="unsupported_content")
        texts.append(part["text" if kind != "refusal" else "refusal"])
    return "".join(texts)


def input_messages(items: str | list[dict] | None) -> list[dict]:
    """Chat messages (as the chat endpoint takes them) for a Responses `input`: messages of any role,
    `function_call` items (merged into the assistant turn they belong to) and `function_call_output`."""
    if items is None:
        return []
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    for i, item in enumerate(items):
        where, kind = f"input[{i}]", item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(f"{where}.role must be user, assistant, system or developer, got {role!r}",
                               param="input")
            parts = ("output_text", "refusal", "input_text") if role == "assistant" else ("input_text",)
            out.append({"role": "system" if role == "developer" else role,
                        "content": _text_of(item.get("content"), where, parts)})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise APIError(f"{where}: a function_call needs string call_id, name and arguments",
                               param="input")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant":  # the calls of one turn share one assistant message
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise APIError(f"{where}: a function_call_output needs the call_id it answers", param="input")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _text_of(item.get("output"), where, ("input_text",))})
        else:
            raise APIError(f"{where}.type {kind!r} is not supported (message, function_call and "
                           "function_call_output are)", param="input", code="unsupported_parameter")
    return out


def _chat_tool(i: int, tool: Any) -> dict:
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind != "function":
        raise APIError(f"tools[{i}]: the tool type {kind!r} is not supported (function tools are; built-in "
                       "tools are not)", param="tools", code="unsupported_parameter")
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def _chat_tool_choice(choice: str | dict | None) -> str | dict | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(f"tool_choice {json.dumps(choice)} is not supported (none, auto, required or "
                   '{"type": "function", "name": ...} are)', param="tool_choice",
                   code="unsupported_parameter")


def chat_body(req: ResponsesRequest, messages: list[dict]) -> dict:
    """The chat-completions body that asks the model what `req` asks, over `messages` (the whole
    conversation: a previous response's turns, then this input; `instructions` go first)."""
    if req.instructions:
        messages = [{"role": "system", "content": req.instructions}] + messages
    body: dict[str, Any] = {"messages": messages, "stream": bool(req.stream)}
    for name in ("temperature", "top_p", "parallel_tool_calls"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    if req.tools:
        body["tools"] = [_chat_tool(i, t) for i, t in enumerate(req.tools)]
    choice = _chat_tool_choice(req.tool_choice)
    # OpenAI takes these without tools
    if choice is not None and (req.tools or choice not in ("auto", "none")):
        body["tool_choice"] = choice
    fmt = req.format()
    if fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise APIError("text.format.schema is required for type json_schema", param="text.format")
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name or "output", "schema": fmt.schema_, "strict": fmt.strict}}
    return body


def renamed(e: APIError) -> APIError:
    """A chat-path error, naming the Responses field the client sent instead of the chat one."""
    new = _PARAM_NAMES.get(e.param or "")
    if new is None:
        return e
    return APIError(e.message.replace(e.param, new), e.status, e.type, new, e.code, e.headers)
