"""Prefix-cache hit accounting per tier: a sequence's usage numbers and the tier counters, counted once
per request at its first admission, and only once every block it was promised is on device (a load that
fails was a miss, not a hit)."""
from __future__ import annotations

from dataclasses import dataclass, field

from nanoserve.sequence import Sequence


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0     # prompt tokens found


@dataclass
class HitStats:
    device: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    host: PrefixCacheStats | None = None  # None without a host tier
    # first admissions whose loads are in flight: seq id -> (sequence, cached tokens, of them from host)
    unconfirmed: dict[int, tuple[Sequence, int, int]] = field(default_factory=dict)

    def admitted(self, seq: Sequence, num_cached: int, host_tokens: int, loading: bool) -> None:
        """A sequence got its prefix: count it now, or once its loads land (`loading`)."""
        if seq.admitted:
            return
        if loading:
            self.unconfirmed[seq.seq_id] = (seq, num_cached, host_tokens)
        else:
            self._count(seq, num_cached, host_tokens)

    def loads_ended(self, seq_id: int, failed: bool) -> None:
        stats = self.unconfirmed.pop(seq_id, None)
        if stats is not None and not failed:
            self._count(*stats)

    def forget(self, seq_id: int) -> None:
        self.unconfirmed.pop(seq_id, None)

    def _count(self, seq: Sequence, num_cached: int, host_tokens: int) -> None:
        seq.admitted = True
        seq.num_cached_tokens = num_cached
        seq.num_device_cached_tokens = num_cached - host_tokens
        seq.num_host_cached_tokens = host_tokens
        self.device.queries += seq.num_prompt_tokens
        self.device.hits += num_cached - host_tokens
        if self.host is not None:
            self.host.queries += seq.num_prompt_tokens - (num_cached - host_tokens)
            self.host.hits += host_tokens
