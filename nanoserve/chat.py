"""Chat templating with the model's own template (or --chat-template)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from nanoserve.sampling_params import InvalidRequest

# What render_chat passes to the template itself, and apply_chat_template's own keyword arguments: a
# caller's template kwargs may not replace them (they would silently change the prompt's messages,
# tools or tokenization rather than set one of the template's options, such as Qwen3's enable_thinking).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "conversations", "tools", "documents", "chat_template",
    "add_generation_prompt", "continue_final_message", "tokenize", "sanitize_control_tokens", "padding",
    "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs"})


def check_template_kwargs(kwargs: Any) -> dict[str, Any]:
    """`chat_template_kwargs` validated: an object whose keys are not the reserved ones ({} for None)."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise InvalidRequest("chat_template_kwargs must be an object", param="chat_template_kwargs")
    clash = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if clash:
        raise InvalidRequest(f"chat_template_kwargs may not set {', '.join(map(repr, clash))}: the server "
                             "passes it to the template itself", param="chat_template_kwargs")
    return kwargs


def render_chat(engine, messages: list[dict], add_generation_prompt: bool = True,
                continue_final_message: bool = False, tools: list[dict] | None = None,
                template_kwargs: dict[str, Any] | None = None) -> str:
    """`continue_final_message` leaves the last (assistant) message open so the model continues it
    (vLLM / transformers semantics); it excludes `add_generation_prompt`. `template_kwargs` are extra
    variables of the template (vLLM's chat_template_kwargs, e.g. {"enable_thinking": False})."""
    extra = check_template_kwargs(template_kwargs)
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list", param="messages")
    if continue_final_message and add_generation_prompt:
        raise InvalidRequest("continue_final_message and add_generation_prompt cannot both be true; "
                             "send add_generation_prompt: false", param="continue_final_message")
    template = Path(engine.config.chat_template).read_text() if engine.config.chat_template else None
    tok = engine.tokenizer
    if template is None and not getattr(tok, "chat_template", None):
        raise InvalidRequest("this model has no chat template; pass --chat-template FILE", param="messages")
    try:
        return tok.apply_chat_template(messages, chat_template=template, tools=tools, tokenize=False,
                                       add_generation_prompt=add_generation_prompt,
                                       continue_final_message=continue_final_message, **extra)
    except Exception as e:  # the template's own error says what is wrong with the messages
        raise InvalidRequest(f"chat template failed on these messages: {e}", param="messages") from e
