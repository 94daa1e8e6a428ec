"""The API process's view of the model: tokenizer, config and metadata, never the weights.

`check_prompt` is the request validation shared by LLMEngine.make_request (in-process) and the
API side of the engine-core process, so both refuse the same prompts with the same messages."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nanoserve.config import EngineConfig
from nanoserve.sampling_params import InvalidRequest, SamplingParams


@dataclass(frozen=True)
class ModelInfo:
    """What the engine reports about the loaded model (the handshake of the engine-core process)."""
    model_name: str
    source_path: str          # HF folder the tokenizer is read from (a GGUF is materialized first)
    vocab_size: int
    max_model_len: int
    max_token_chars: int      # longest text one token stands for (cheap prompt-length refusal)
    eos_token_ids: tuple[int, ...]


@dataclass
class PromptRequest:
    """A validated, tokenized request as the API process sends it to the engine-core process."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)


def check_prompt(info: ModelInfo, tokenize: Callable[[str, bool], list[int]], prompt: str | list[int],
                 params: SamplingParams, add_special_tokens: bool = True) -> tuple[str | None, list[int], int]:
    """Validate and tokenize; returns (text or None, token ids, resolved max_tokens). Raises
    InvalidRequest naming the bad field."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequest("prompt must not be empty", param="prompt")
        if len(prompt) > info.max_model_len * info.max_token_chars:  # refused without tokenizing it
            raise InvalidRequest(
                f"This model's maximum context length is {info.max_model_len} tokens, and a prompt of "
                f"{len(prompt)} characters has more tokens than that.", param="prompt",
                code="context_length_exceeded")
        text, ids = prompt, tokenize(prompt, add_special_tokens)
    else:
        text, ids = None, list(prompt)
    if not ids:
        raise InvalidRequest("prompt must contain at least one token", param="prompt")
    vocab = info.vocab_size
    bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
    if bad:
        raise InvalidRequest(f"token id {bad[0]!r} is out of vocabulary (valid: 0..{vocab - 1})",
                             param="prompt")
    n, limit = len(ids), info.max_model_len
    max_tokens = params.max_tokens if params.max_tokens is not None else limit - n
    if params.min_tokens > max(max_tokens, 0):
        raise InvalidRequest(f"min_tokens {params.min_tokens} exceeds the tokens left for the completion "
                             f"({max_tokens})", param="min_tokens")
    if n + max(max_tokens, 1) > limit:
        raise InvalidRequest(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{n + max_tokens} tokens ({n} in the prompt, {max_tokens} for the completion). "
            "Please reduce the length of the prompt or max_tokens.",
            param="prompt" if n >= limit else "max_tokens", code="context_length_exceeded")
    return text, ids, max_tokens


class Frontend:
    """Tokenizer + metadata the HTTP layer needs (also `config` and `tokenizer` for render_chat).
    `make_request` returns what the engine in use accepts: an LLMEngine Request in-process, a
    PromptRequest for the engine-core process."""

    def __init__(self, config: EngineConfig, tokenizer: Any, info: ModelInfo,
                 make_request: Callable[..., Any] | None = None) -> None:
        self.config, self.tokenizer, self.info = config, tokenizer, info
        self.model_name = info.model_name
        self.vocab_size = info.vocab_size
        self.max_model_len = info.max_model_len
        self.max_token_chars = info.max_token_chars
        self._make = make_request or self._prompt_request

    @classmethod
    def of_engine(cls, engine: Any) -> Frontend:
        """The in-process case: the LLMEngine itself validates and builds its requests."""
        return cls(engine.config, engine.tokenizer, model_info(engine), engine.make_request)

    def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)

    def make_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                     add_special_tokens: bool = True) -> Any:
        return self._make(request_id, prompt, params, add_special_tokens)

    def _prompt_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                        add_special_tokens: bool = True) -> PromptRequest:
        text, ids, _ = check_prompt(self.info, self.tokenize, prompt, params, add_special_tokens)
        return PromptRequest(request_id, text, ids, params)


def model_info(engine: Any) -> ModelInfo:
    return ModelInfo(engine.model_name, str(engine.source.path), engine.model.vocab_size, engine.max_model_len,
                     engine.max_token_chars, tuple(sorted(engine.eos_token_ids)))
