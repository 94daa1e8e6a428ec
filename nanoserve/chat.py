"""Chat templating with the model's own template (or --chat-template)."""
from __future__ import annotations

from pathlib import Path

from nanoserve.sampling_params import InvalidRequest


def render_chat(engine, messages: list[dict], add_generation_prompt: bool = True,
                continue_final_message: bool = False, tools: list[dict] | None = None) -> str:
    """`continue_final_message` leaves the last (assistant) message open so the model continues it
    (vLLM / transformers semantics); it excludes `add_generation_prompt`."""
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
                                       continue_final_message=continue_final_message)
    except Exception as e:  # the template's own error says what is wrong with the messages
        raise InvalidRequest(f"chat template failed on these messages: {e}", param="messages") from e
