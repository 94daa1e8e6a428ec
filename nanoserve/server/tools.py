"""Tool calling on the API side: what a `tool_choice` constrains the output to, how tools reach a chat
template that does not render them itself, and the parsers that turn generated text into tool calls
(Hermes / Qwen `<tool_call>` tags and Llama 3.x JSON). The engine only sees a grammar.

- `required`: the output is constrained to a JSON array of {"name", "parameters"} objects, one schema
  branch per tool (one call at most when parallel_tool_calls is false);
- a named function: the output is constrained to that function's parameters (the arguments);
- `auto`: free text, parsed afterwards; text that is not a well-formed call of a known tool stays
  content (a malformed call is never returned as one)."""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from pathlib import Path

from nanoserve.server.responses import FunctionCall, ToolCall
from nanoserve.structured import StructuredSpec

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"  # Llama 3.x: a call may follow it
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def _params(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


@dataclass
class ToolMode:
    """How a chat request's output relates to its tools. `choice`: "auto" | "required" | "named"."""
    tools: list[dict]
    choice: str
    name: str | None = None
    parallel: bool = True

    def constraint(self) -> StructuredSpec | None:
        if self.choice == "named":
            tool = next(t for t in self.tools if t["function"]["name"] == self.name)
            return StructuredSpec("json", json.dumps(_params(tool), sort_keys=True), "tool_choice")
        if self.choice == "required":
            calls = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                      "properties": {"name": {"const": t["function"]["name"]}, "parameters": _params(t)}}
                     for t in self.tools]
            schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
            if not self.parallel:
                schema["maxItems"] = 1
            return StructuredSpec("json", json.dumps(schema, sort_keys=True), "tools")
        return None

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a finished choice's text."""
        if self.choice == "named":
            args = _json(text)
            return (None, [_tool_call(self.name, args)]) if isinstance(args, dict) else (text, [])
        if self.choice == "required":
            calls = [self._call(c) for c in _json(text) or []] if isinstance(_json(text), list) else [None]
            return (None, calls) if calls and None not in calls else (text, [])
        return self._parse_auto(text)

    def _call(self, obj) -> ToolCall | None:
        """A call of a known tool with object arguments, or None."""
        if not isinstance(obj, dict) or obj.get("name") not in {t["function"]["name"] for t in self.tools}:
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            args = _json(args)
        return _tool_call(obj["name"], args) if isinstance(args, dict) else None

    def _parse_auto(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if HERMES_OPEN in text:  # Hermes / Qwen: content, then <tool_call>{json}</tool_call> blocks
            calls = [self._call(_json(body)) for body in _HERMES.findall(text)]
            content = text[:text.index(HERMES_OPEN)].strip() or None
        else:  # Llama 3.x: the whole output is {"name", "parameters"} (several joined by ";")
            body = text.strip().removeprefix(PYTHON_TAG).strip()
            if not body.startswith("{"):
                return text, []
            calls = [self._call(_json(part)) for part in _split_json_objects(body)]
            content = None
        calls = calls if self.parallel else calls[:1]
        if not calls or None in calls:
            return text, []
        return content, calls  # type: ignore[return-value]

    def streamable(self, held: str, started: bool) -> int:
        """How many leading characters of the held-back text can stream as content now (`started`:
        content was already sent). A possible call is held until the choice ends."""
        if self.choice != "auto":
            return 0
        if not started:
            lead = held.lstrip()
            if not lead or lead.startswith("{") or PYTHON_TAG.startswith(lead[:len(PYTHON_TAG)]):
                return 0  # maybe a Llama 3.x call: wait for more text
        at = held.find(HERMES_OPEN)
        if at >= 0:
            return at
        for k in range(min(len(held), len(HERMES_OPEN) - 1), 0, -1):  # a tag may be starting
            if HERMES_OPEN.startswith(held[-k:]):
                return len(held) - k
        return len(held)


def _json(text: str):
    try:
        return json.loads(text)
    except (ValueError, TypeError):
        return None


def _split_json_objects(body: str) -> list[str]:
    parts, dec, at = [], json.JSONDecoder(), 0
    while at < len(body):
        try:
            _, end = dec.raw_decode(body, at)
        except ValueError:
            return [body[at:]]  # not JSON: _call rejects it
        parts.append(body[at:end])
        at = end
        while at < len(body) and body[at] in " \n\t;":
            at += 1
    return parts


def _tool_call(name: str, args: dict) -> ToolCall:
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}",
                    function=FunctionCall(name=name, arguments=json.dumps(args, ensure_ascii=False)))


# ---- chat templates --------------------------------------------------------------------------------
def template_renders_tools(llm) -> bool:
    """Whether the model's chat template (or --chat-template) uses `tools` itself."""
    path = llm.config.chat_template
    src = Path(path).read_text() if path else (getattr(llm.tokenizer, "chat_template", None) or "")
    return "tools" in src


def render_tools_into_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """For a template that ignores `tools`: describe them in a system message (Hermes format) and write
    earlier calls and results as Hermes text, so the conversation still carries them."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = "\n".join(f"{HERMES_OPEN}\n" + json.dumps({"name": c["function"]["name"],
                                                              "arguments": c["function"]["arguments"]})
                              + f"\n{HERMES_CLOSE}" for c in m.pop("tool_calls"))
            m["content"] = ((m.get("content") or "") + "\n" + calls).strip()
        if m["role"] == "tool":
            m["content"] = f"<tool_response>\n{m.get('content', '')}\n</tool_response>"
            m.pop("tool_call_id", None)
        out.append(m)
    if not tools:
        return out
    sig = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    text = ("You may call one or more functions to assist with the user query. The function signatures are "
            f"within <tools></tools> XML tags:\n<tools>\n{sig}\n</tools>\nFor each function call, return a json "
            "object with the function name and arguments within <tool_call></tool_call> XML tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
    if out and out[0]["role"] == "system":
        out[0] = dict(out[0], content=f"{out[0]['content']}\n\n{text}")
    else:
        out.insert(0, {"role": "system", "content": text})
    return out
