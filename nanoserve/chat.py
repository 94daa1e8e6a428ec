"""Chat templating with the model's own template (or --chat-template)."""
from __future__ import annotations

from pathlib import Path

from nanoserve.sampling_params import InvalidRequest


def render_chat(engine, messages: list[dict], add_generation_prompt: bool = True) -> str:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list", param="messages")
    template = Path(engine.config.chat_template).read_text() if engine.config.chat_template else None
    tok = engine.tokenizer
    if template is None and not getattr(tok, "chat_template", None):
        raise InvalidRequest("this model has no chat template; pass --chat-template FILE", param="messages")
    try:
        return tok.apply_chat_template(messages, chat_template=template, tokenize=False,
                                       add_generation_prompt=add_generation_prompt)
    except Exception as e:  # the template's own error says what is wrong with the messages
        raise InvalidRequest(f"chat template failed on these messages: {e}", param="messages") from e
