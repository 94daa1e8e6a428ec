"""Per-request sampling parameters (the vLLM / OpenAI set), validated at construction."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from nanoserve.errors import InvalidRequest  # noqa: F401 - also importable from here
from nanoserve.structured import StructuredSpec

# Bounds on list-valued fields: each costs work per generated token (stop strings are searched in
# the held-back text, logit biases are applied per step), so none may grow without limit.
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 512
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 1024
MAX_LOGPROBS = 20
MAX_CACHE_SALT_CHARS = 1024
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what torch.Generator.manual_seed accepts


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16       # None = up to the context length
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                    # 0 or -1 = off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None       # top-N alternatives per generated token (0 = sampled token only)
    prompt_logprobs: int | None = None  # the same for every prompt token (computes the whole prompt)
    logit_bias: dict[int, float] = field(default_factory=dict)
    include_stop_str_in_output: bool = False
    structured: StructuredSpec | None = None  # constrained decoding (JSON schema, regex, choice, grammar)
    cache_salt: str | None = None  # prefix-cache namespace: only requests with the same salt share KV

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        finite = all(math.isfinite(getattr(self, f)) for f in (
            "temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"))
        checks = [
            ("n", self.n >= 1, "must be >= 1"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, "must be >= 1"),
            ("min_tokens", self.min_tokens >= 0, "must be >= 0"),
            ("min_tokens", self.max_tokens is None or self.min_tokens <= self.max_tokens,
             "must be <= max_tokens"),
            ("temperature", 0.0 <= self.temperature <= 100.0, "must be in [0, 100]"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", self.top_k >= 0, "must be -1, 0 (off) or a positive integer"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]"),
            ("repetition_penalty", 0.0 < self.repetition_penalty <= 2.0, "must be in (0, 2]"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
             f"must be in [0, {MAX_LOGPROBS}]"),
            ("prompt_logprobs", self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
             f"must be in [0, {MAX_LOGPROBS}]"),
            ("seed", self.seed is None or SEED_RANGE[0] <= self.seed <= SEED_RANGE[1],
             "must fit in 64 bits"),
            ("stop", len(self.stop) <= MAX_STOP_STRINGS
             and all(len(x) <= MAX_STOP_STRING_CHARS for x in self.stop),
             f"must be at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_STRING_CHARS} characters"),
            ("stop_token_ids", len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS
             and all(isinstance(t, int) and 0 <= t < 1 << 31 for t in self.stop_token_ids),
             f"must be at most {MAX_STOP_TOKEN_IDS} token ids"),
            ("logit_bias", len(self.logit_bias) <= MAX_LOGIT_BIAS
             and all(isinstance(k, int) and 0 <= k < 1 << 31 and math.isfinite(v) and -100 <= v <= 100
                     for k, v in self.logit_bias.items()),
             f"must map at most {MAX_LOGIT_BIAS} token ids to values in [-100, 100]"),
            ("cache_salt", self.cache_salt is None or 0 < len(self.cache_salt) <= MAX_CACHE_SALT_CHARS,
             f"must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters"),
        ]
        if not finite:  # NaN passes no range check below, but say plainly what is wrong
            name = next(f for f in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                                    "repetition_penalty") if not math.isfinite(getattr(self, f)))
            raise InvalidRequest(f"{name} must be a finite number, got {getattr(self, name)!r}", param=name)
        for name, ok, why in checks:
            if not ok:
                raise InvalidRequest(f"{name} {why}, got {getattr(self, name)!r}", param=name)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)
