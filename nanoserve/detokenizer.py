"""Incremental detokenization with stop strings.

Decoding only the tail of the token list keeps each step O(1); decoding from a few tokens back
(`prefix_offset`) keeps word-boundary spaces right, and waiting while the text ends in U+FFFD keeps
multi-byte characters split across tokens from being emitted half-done."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Detokenizer:
    tokenizer: object
    prompt_len: int
    stop: list[str] = field(default_factory=list)
    include_stop: bool = False
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0

    def __post_init__(self) -> None:
        self.prefix_offset = max(self.prompt_len - 5, 0)
        self.read_offset = self.prompt_len
        self.holdback = max((len(s) for s in self.stop), default=1) - 1

    def step(self, token_ids: list[int], check_stop: bool = True) -> str | None:
        """Consume the newest token; returns the stop string that matched, if any (text is then
        cut before it, or after it with include_stop). `check_stop=False` (before min_tokens)
        only extends the text: a stop string completed there never matches."""
        decode = self.tokenizer.decode
        prefix = decode(token_ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        full = decode(token_ids[self.prefix_offset:], skip_special_tokens=True)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        start = max(0, len(self.text) - self.holdback)
        self.text += delta
        for s in self.stop if check_stop else ():
            idx = self.text.find(s, start)
            if idx >= 0:
                self.text = self.text[:idx + (len(s) if self.include_stop else 0)]
                return s
        return None

    def flush(self, token_ids: list[int]) -> None:
        """At the end, emit whatever a trailing incomplete character left pending."""
        rest = self.tokenizer.decode(token_ids[self.prefix_offset:], skip_special_tokens=True)
        prefix = self.tokenizer.decode(token_ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        if len(rest) > len(prefix):
            self.text += rest[len(prefix):]
            self.prefix_offset = self.read_offset = len(token_ids)

    def stream_text(self, finished: bool) -> str:
        """Text safe to show a streaming client: the tail that could still become a stop string
        is held back until it is decided."""
        if finished or not self.holdback:
            return self.text
        return self.text[:max(0, len(self.text) - self.holdback)]
