"""Tool calling on the API side: what a `tool_choice` constrains the output to, the streamer that turns
generated text into content and tool calls as it arrives (Hermes / Qwen `<tool_call>` tags and Llama 3.x
JSON, the --tool-call-parser formats), and how tools reach a chat template that does not render them
itself. The engine only sees a grammar.

- `required`: the output is constrained to a JSON array of {"name", "parameters"} objects, one schema
  branch per tool (one call at most when parallel_tool_calls is false);
- a named function: the output is constrained to that function's parameters (the arguments);
- `auto` (--enable-auto-tool-choice): free text read in the parser's format; text that is not a call of a
  known tool stays content (a malformed call is never returned as one in a whole response)."""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Union

from nanoserve.server.responses import FunctionCall, ToolCall
from nanoserve.structured import StructuredSpec

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"  # Llama 3.x: a call may follow it


def _params(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


@dataclass
class ToolMode:
    """How a chat request's output relates to its tools. `choice`: "auto" | "required" | "named"."""
    tools: list[dict]
    choice: str
    name: str | None = None
    parallel: bool = True
    parser: str | None = None  # auto: the format calls are read in (config.TOOL_CALL_PARSERS)

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
        """(content, tool calls) of a finished choice's text: the streamer's result, so streamed and
        whole responses agree; a call that is not well-formed (arguments not a JSON object) makes the
        whole text content."""
        streamer = ToolCallStreamer(self)
        events = streamer.feed(text) + streamer.finish()
        calls = streamer.tool_calls()
        if not calls or not all(isinstance(_json(c.function.arguments), dict) for c in calls):
            return text, []
        content = "".join(e.text for e in events if isinstance(e, ContentDelta))
        return content if content.strip() else None, calls

    def call(self, obj) -> ToolCall | None:
        """A call of a known tool with object arguments, or None."""
        if not isinstance(obj, dict) or obj.get("name") not in {t["function"]["name"] for t in self.tools}:
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            args = _json(args)
        return _tool_call(obj["name"], args) if isinstance(args, dict) else None


def _json(text: str):
    try:
        return json.loads(text)
    except (ValueError, TypeError):
        return None


def _tool_call(name: str, args: dict) -> ToolCall:
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}",
                    function=FunctionCall(name=name, arguments=json.dumps(args, ensure_ascii=False)))


# ---- streaming ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ContentDelta:
    """Plain text of the choice (auto mode only)."""
    text: str


@dataclass(frozen=True)
class CallStarted:
    """A call begins: its position among the choice's calls, a fresh id, the function's name."""
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    """The next piece of call `index`'s arguments: JSON text, as generated."""
    index: int
    text: str


@dataclass(frozen=True)
class CallDone:
    """Call `index` ended; `arguments` is all of its arguments text (incomplete only when the output
    ended inside it, e.g. cut off by max_tokens: the finish reason says so)."""
    index: int
    arguments: str


ToolEvent = Union[ContentDelta, CallStarted, ArgumentsDelta, CallDone]
# the head of a call object, up to the first character of its arguments
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)')


class _JsonEnd:
    """Where a JSON value that opens with `{` or `[` closes, fed piece by piece."""

    def __init__(self, depth: int = 0) -> None:
        self.depth, self.in_string, self.escape = depth, False, False

    def feed(self, text: str) -> int | None:
        """The index just past the closing bracket in `text`, or None while it is still open."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    return i + 1
        return None


class ToolCallStreamer:
    """One choice's generated text, fed as it arrives, as content and tool-call events, so that argument
    text goes out while it is generated (chat `delta.tool_calls`, Responses `function_call_arguments`):

        streamer = ToolCallStreamer(mode)
        for text in deltas:
            handle(streamer.feed(text))   # [ContentDelta | CallStarted | ArgumentsDelta | CallDone, ...]
        handle(streamer.finish())         # the choice ended: what was held back, an open call closed

    Per call: one CallStarted, ArgumentsDelta pieces whose concatenation is its arguments as generated,
    one CallDone; calls are indexed 0, 1, ... (only the first is kept without parallel_tool_calls);
    `tool_calls()` lists those started. Formats: named (the whole output is the arguments), required (a
    JSON array of {"name", "parameters"}: the grammar fixes it), auto with the mode's parser: `hermes`
    (content, then <tool_call>{"name", "arguments"}</tool_call> blocks) or `llama3_json` (the output is
    {"name", "parameters"} objects separated by ";", optionally after <|python_tag|>).

    In auto mode text is held back only while it may still be a call. A call streams once its name (a
    known tool) and the `{` opening its arguments are seen; a call with its keys in another order goes
    out whole when it ends; text that turns out not to be a call (an unknown tool, arguments that are
    not an object, no call format) reaches the client as content. Arguments already sent are never
    taken back: a call the output ends inside stays incomplete (extract() treats it as content)."""

    def __init__(self, mode: ToolMode) -> None:
        self.mode = mode
        self.fmt = {"named": "args", "required": "array"}.get(mode.choice, mode.parser or "hermes")
        self.state = {"args": "args", "hermes": "content"}.get(self.fmt, "lead")
        self.buf = ""              # text not consumed yet
        self.held = ""             # trailing whitespace of content (dropped when a call follows)
        self.raw = ""              # text of the call being read, until it streams or is parsed whole
        self.lead = ""             # llama3_json: what preceded the first call (content if it is none)
        self.names = {t["function"]["name"] for t in mode.tools}
        self.calls: list[list[str]] = []   # [id, name, arguments] of the calls started
        self.open = self.closed = False
        self.scan = _JsonEnd()

    def feed(self, text: str) -> list[ToolEvent]:
        out: list[ToolEvent] = []
        if self.fmt == "args" and not self.calls:
            self._start(self.mode.name or "", out)
        self.buf += text
        self._run(out)
        return out

    def finish(self) -> list[ToolEvent]:
        out: list[ToolEvent] = []
        self.closed = True
        self._run(out)
        if self.state == "head":  # the output ended inside a call that never streamed: parse it whole
            self._whole(self.raw, "", out)
        elif self.state == "tail":
            self.buf = ""
        self._say(self.buf, out)
        if self.open:
            self._end(out)
        if self.held and not self.calls:
            out.append(ContentDelta(self.held))
        self.buf = self.held = ""
        return out

    def tool_calls(self) -> list[ToolCall]:
        return [ToolCall(id=i, function=FunctionCall(name=n, arguments=a)) for i, n, a in self.calls]

    # -- events -------------------------------------------------------------------------------------
    def _muted(self) -> bool:  # a second call without parallel_tool_calls: read, not sent
        return not self.mode.parallel and len(self.calls) > 1

    def _start(self, name: str, out: list[ToolEvent]) -> None:
        self.calls.append([f"call_{uuid.uuid4().hex[:24]}", name, ""])
        self.open = True
        if not self._muted():
            out.append(CallStarted(len(self.calls) - 1, self.calls[-1][0], name))

    def _args(self, text: str, out: list[ToolEvent]) -> None:
        self.calls[-1][2] += text
        if text and not self._muted():
            out.append(ArgumentsDelta(len(self.calls) - 1, text))

    def _end(self, out: list[ToolEvent]) -> None:
        self.open = False
        if self._muted():
            self.calls.pop()
        else:
            out.append(CallDone(len(self.calls) - 1, self.calls[-1][2]))

    def _say(self, text: str, out: list[ToolEvent]) -> None:
        """Content, its trailing whitespace held back (a call may follow)."""
        text = self.held + text
        body = text.rstrip()
        self.held = text[len(body):]
        if body:
            out.append(ContentDelta(body))

    def _whole(self, body: str, tail: str, out: list[ToolEvent]) -> None:
        """A call read to its end without streaming (keys in another order, or cut off): sent whole if it
        is one, else its text (`tail`: its closing text) is content and, in llama3_json, so is the rest."""
        call = self.mode.call(_json(body.strip().removeprefix(HERMES_OPEN)))
        self.raw = ""
        if call is None:
            self._say(self.lead + body + tail, out)
            if self.fmt == "llama3_json":
                self.state = "text"
            return
        self._start(call.function.name, out)
        self._args(call.function.arguments, out)
        self._end(out)

    # -- states: each consumes from self.buf; False to wait for more text ------------------------------
    def _run(self, out: list[ToolEvent]) -> None:
        while self.buf and getattr(self, "_in_" + self.state)(out):
            pass

    def _in_text(self, out: list[ToolEvent]) -> bool:
        self._say(self.buf, out)
        self.buf = ""
        return False

    def _in_content(self, out: list[ToolEvent]) -> bool:
        """hermes: content until a <tool_call> tag (a tag that may be starting is held)."""
        at = self.buf.find(HERMES_OPEN)
        if at < 0:
            keep = next((k for k in range(min(len(self.buf), len(HERMES_OPEN) - 1), 0, -1)
                         if HERMES_OPEN.startswith(self.buf[-k:])), 0) if not self.closed else 0
            self._say(self.buf[:len(self.buf) - keep], out)
            self.buf = self.buf[len(self.buf) - keep:]
            return False
        self._say(self.buf[:at], out)
        self.raw, self.buf, self.state = HERMES_OPEN, self.buf[at + len(HERMES_OPEN):], "head"
        return True

    def _in_lead(self, out: list[ToolEvent]) -> bool:
        """llama3_json: an optional <|python_tag|>, then `{`; required: `[`. Anything else is content."""
        lead = self.buf.lstrip()
        if self.fmt == "llama3_json":
            if not self.closed and PYTHON_TAG.startswith(lead):
                return False  # empty, or a tag that may be starting
            lead = lead.removeprefix(PYTHON_TAG).lstrip()
        if not lead:
            return False
        if lead[0] != ("{" if self.fmt == "llama3_json" else "["):
            self.state = "text"
            return True
        self.lead, self.buf = self.buf[:len(self.buf) - len(lead)], lead[self.fmt == "array":]
        self.state = "between"
        return True

    def _in_between(self, out: list[ToolEvent]) -> bool:
        """Before a call of llama3_json / the array: separators, then `{`; the array ends at `]`."""
        rest = self.buf.lstrip(" \t\r\n;,")
        if not rest:
            self.buf = ""
            return False
        if rest[0] == "{":
            self.buf, self.state, self.scan = rest, "head", _JsonEnd()
            return True
        self.buf = rest if self.fmt == "llama3_json" else ""
        self.state = "text" if self.fmt == "llama3_json" else "between"
        return self.fmt == "llama3_json"

    def _in_head(self, out: list[ToolEvent]) -> bool:
        """A call until it can stream (its name and the start of its arguments seen), or to its end."""
        start = len(self.raw)
        self.raw += self.buf
        self.buf = ""
        body = self.raw.removeprefix(HERMES_OPEN) if self.fmt == "hermes" else self.raw.lstrip()
        m = _HEAD.match(body)
        if m and body[m.end()] == "{" and (name := _json(f'"{m.group(1)}"')) in self.names:
            self._start(name, out)
            self.buf, self.raw, self.lead, self.state, self.scan = body[m.end():], "", "", "args", _JsonEnd()
            return True
        if self.fmt == "hermes":
            end = self.raw.find(HERMES_CLOSE)
            if end < 0:
                return False
            self.buf = self.raw[end + len(HERMES_CLOSE):]
            self._whole(self.raw[:end], HERMES_CLOSE, out)
            self.state = "content"
            return True
        end = self.scan.feed(self.raw[start:])
        if end is None:
            return False
        self.buf, self.state = self.raw[start + end:], "between"
        self._whole(self.raw[:start + end], "", out)
        self.lead = ""
        return True

    def _in_args(self, out: list[ToolEvent]) -> bool:
        end = self.scan.feed(self.buf)
        if end is None:
            self._args(self.buf, out)
            self.buf = ""
            return False
        self._args(self.buf[:end], out)
        self._end(out)
        self.buf = self.buf[end:]
        self.state, self.scan = "text" if self.fmt == "args" else "tail", _JsonEnd(depth=1)
        return True

    def _in_tail(self, out: list[ToolEvent]) -> bool:
        """After a call's arguments: the rest of its object (and the hermes closing tag), discarded."""
        if self.fmt == "hermes":
            at = self.buf.find(HERMES_CLOSE)
            if at < 0:
                self.buf = self.buf[-(len(HERMES_CLOSE) - 1):]
                return False
            self.buf, self.state = self.buf[at + len(HERMES_CLOSE):], "content"
            return True
        end = self.scan.feed(self.buf)
        if end is None:
            self.buf = ""
            return False
        self.buf, self.state = self.buf[end:], "between"
        return True


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
            f"within <tools></tools> XML tags:\n<tools>\n{sig}\n</tools>\nFor each function call, return a "
            "json object with the function name and arguments within <tool_call></tool_call> XML tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
    if out and out[0]["role"] == "system":
        out[0] = dict(out[0], content=f"{out[0]['content']}\n\n{text}")
    else:
        out.insert(0, {"role": "system", "content": text})
    return out
