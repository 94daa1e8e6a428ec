"""A sequence: one generated choice of a request, with the KV ranges it owns.

Ownership of KV (mirrors mini-SGLang's table):
  block_table[i] holds tokens [i*B, (i+1)*B). Blocks [0, num_cached_blocks) came from the prefix
  cache (shared, read-only, ref-counted). Every block after that was allocated for this sequence;
  a full one is published to the prefix cache once its KV has been written (num_computed_tokens
  passed its end). The last, partial block is private. On finish/abort/preemption every block is
  released (ref count -1); published ones stay findable in the cache until reused.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nanoserve.outputs import TokenLogprob
from nanoserve.sampling_params import SamplingParams

if TYPE_CHECKING:  # the API process renders TokenLogprob from here and stays torch-free
    import torch


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    LOADING = "loading"  # admitted, holding its blocks, waiting for its prefix to arrive from host
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    seq_id: int
    request_id: str
    index: int                       # choice index within the request (n > 1)
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int                  # resolved against max_model_len
    eos_token_ids: frozenset[int]
    generator: torch.Generator | None = None
    parent: Sequence | None = None   # n > 1: siblings wait until the parent's prompt is cached
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0     # tokens whose KV a launched step computes (done, or in flight)
    num_inflight_tokens: int = 0     # of those, the ones the step still in flight computes
    num_pending: int = 0             # tokens sampled by launched steps, not yet known here
    num_published_blocks: int = 0    # leading full blocks already in the prefix cache
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chain digests of the leading full blocks
    block_keys: list[tuple] = field(default_factory=list)    # their kvcache BlockKeys (parent digest, tokens)
    num_cached_tokens: int = 0       # prompt tokens reused from the cache at first admission
    num_device_cached_tokens: int = 0
    num_host_cached_tokens: int = 0
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=lambda: [None])  # token 0 has none
    num_preemptions: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    admitted: bool = False           # cache stats are counted once, at first admission

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Known tokens and those still being sampled (a step one ahead reads the latter from the device)."""
        return len(self.token_ids) + self.num_pending

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs still to compute (the first choice of a request carries them)."""
        return (self.params.prompt_logprobs is not None and self.index == 0
                and len(self.prompt_logprobs) < self.num_prompt_tokens)

    @property
    def prompt_done(self) -> bool:
        """The prompt's KV is written (not only launched): its blocks are published."""
        return self.num_computed_tokens - self.num_inflight_tokens >= self.num_prompt_tokens
