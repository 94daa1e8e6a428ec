"""A chat request's prompt text: its messages, tools and template kwargs through the model's chat
template (nanoserve/chat.py), with what that template cannot take rewritten first.

- A template that renders `tools` itself (Qwen, Hermes, Llama 3.x) gets them, and the calls and tool
  results of earlier turns, as they are.
- Otherwise (Gemma 3, SmolLM2) the tools are described in the system message and earlier calls and
  results are written as Hermes text (tools.render_tools_into_messages), so `--tool-call-parser hermes`
  reads the calls the model makes. A template that refuses a "tool" turn, such as Gemma 3's (its roles
  must alternate user / model), gets each run of tool results as one user turn instead, as Qwen's
  template writes them."""
from __future__ import annotations

from typing import Any

from nanoserve.chat import render_chat
from nanoserve.sampling_params import InvalidRequest
from nanoserve.server.tools import render_tools_into_messages, template_renders_tools

# The smallest conversation with a tool turn in it: what a template that can take one renders.
_TOOL_TURN_PROBE = ({"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                    {"role": "tool", "content": "r"})


def chat_prompt(llm, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool = True,
                continue_final_message: bool = False, template_kwargs: dict[str, Any] | None = None) -> str:
    """The prompt text (InvalidRequest naming the parameter when the template refuses the request)."""
    if not template_renders_tools(llm):
        messages, tools = render_tools_into_messages(messages, tools), None
        if any(m["role"] == "tool" for m in messages) and not takes_tool_turns(llm):
            messages = fold_tool_turns(messages)
    return render_chat(llm, messages, add_generation_prompt, continue_final_message, tools, template_kwargs)


def takes_tool_turns(llm) -> bool:
    """Whether the chat template renders a message of role "tool" (Gemma 3's raises on one)."""
    try:
        render_chat(llm, [dict(m) for m in _TOOL_TURN_PROBE])
    except InvalidRequest:
        return False
    return True


def fold_tool_turns(messages: list[dict]) -> list[dict]:
    """Tool results as user turns, each run of them (and a user turn right after) joined into one, so
    that turns still alternate between the user and the assistant."""
    out: list[dict] = []
    last_was_tool = False
    for m in messages:
        tool = m["role"] == "tool"
        m = {"role": "user", "content": m.get("content") or ""} if tool else dict(m)
        if out and m["role"] == "user" and out[-1]["role"] == "user" and (tool or last_was_tool):
            out[-1]["content"] = f"{out[-1]['content']}\n{m['content']}"
        else:
            out.append(m)
        last_was_tool = tool
    return out
