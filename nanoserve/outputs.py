"""What the engine returns for a request (offline API and server alike)."""
from __future__ import annotations

from dataclasses import dataclass, field



@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token_id, logprob), best first


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None   # "stop" | "length" | "abort" | "error" | None (running)
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None
    stream_text: str = ""             # prefix of `text` that is final (stop-string hold-back)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    num_device_cached_tokens: int = 0
    num_host_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None  # first entry None (nothing precedes it)
    metrics: dict[str, float] = field(default_factory=dict)  # arrival, first_token, finished (monotonic)
