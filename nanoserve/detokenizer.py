"""Incremental detokenization with stop strings.

Text grows by `tokenizers`' DecodeStream (Rust, O(1) per token; it re-reads the previous chunk's
tokens for word-boundary spaces and holds multi-byte characters split across tokens until they
are whole). A tokenizer without a Rust backend gets the same algorithm in Python: decode from a
few tokens back (`prefix_offset`) and wait while the text ends in U+FFFD."""
from __future__ import annotations

from dataclasses import dataclass, field

from tokenizers.decoders import DecodeStream


@dataclass
class Detokenizer:
    tokenizer: object
    prompt_len: int  # the token list starts with this many prompt tokens (context for the first word)
    stop: list[str] = field(default_factory=list)
    include_stop: bool = False
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0

    def __post_init__(self) -> None:
        self.prefix_offset = max(self.prompt_len - 5, 0)
        self.read_offset = self.prompt_len
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self._backend = getattr(self.tokenizer, "backend_tokenizer", None)
        self._stream: DecodeStream | None = None

    def _delta(self, token_ids: list[int]) -> str | None:
        """Text the newest token completes, if any."""
        if self._backend is not None:
            if self._stream is None:
                self._stream = DecodeStream(ids=token_ids[self.prefix_offset:self.read_offset],
                                            skip_special_tokens=True)
            return self._stream.step(self._backend, token_ids[-1]) or None
        decode = self.tokenizer.decode
        prefix = decode(token_ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        full = decode(token_ids[self.prefix_offset:], skip_special_tokens=True)
        return None if len(full) <= len(prefix) or full.endswith("\ufffd") else full[len(prefix):]

    def step(self, token_ids: list[int], check_stop: bool = True) -> str | None:
        """Consume the newest token; returns the stop string that matched, if any (text is then
        cut before it, or after it with include_stop). `check_stop=False` (before min_tokens)
        only extends the text: a stop string completed there never matches."""
        delta = self._delta(token_ids)
        if delta is None:
            return None
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
        prefix = self.tokenizer.decode(token_ids[self.prefix_offset:self.read_offset],
                                       skip_special_tokens=True)
        if len(rest) > len(prefix):
            self.text += rest[len(prefix):]
            self.prefix_offset = self.read_offset = len(token_ids)

    def stream_text(self, finished: bool) -> str:
        """Text safe to show a streaming client: the tail that could still become a stop string
        is held back until it is decided."""
        if finished or not self.holdback:
            return self.text
        return self.text[:max(0, len(self.text) - self.holdback)]
