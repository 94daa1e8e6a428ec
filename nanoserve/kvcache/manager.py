"""KV cache manager: maps sequences to device blocks, with prefix caching over hash-chained full
blocks. The scheduler talks only to this class; it never touches tensors.

A second (host) tier plugs in behind `match_prefix` / `free`: the device tier is asked first,
then the host tier for the blocks that follow (see kvcache/host_tier.py when it exists).
"""
from __future__ import annotations

from dataclasses import dataclass

from nanoserve.kvcache.block_pool import BlockPool, PoolStats, chain_hash
from nanoserve.sequence import Sequence


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0     # prompt tokens found


@dataclass
class TierReport:
    """One KV tier's state and counters, for /metrics and logs."""
    tier: str                 # "device" | "host"
    blocks_total: int
    blocks_in_use: int
    blocks_cached: int        # free but still findable by the prefix cache
    blocks_free: int
    block_size: int
    query_tokens: int         # prompt tokens looked up in this tier
    hit_tokens: int           # prompt tokens served from this tier
    evictions: int
    bytes_in: int = 0         # host tier: bytes copied device -> host
    bytes_out: int = 0        # host tier: bytes copied host -> device
    seconds_in: float = 0.0
    seconds_out: float = 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.device_stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """Chain hashes of the first `num_blocks` full blocks, extending the sequence's memo."""
        bs, hashes = self.block_size, seq.block_hashes
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(chain_hash(hashes[-1] if hashes else None, tuple(seq.token_ids[i * bs:(i + 1) * bs])))
        return hashes[:num_blocks]

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached device blocks for the sequence's leading full blocks. At least one token is left
        to compute, so the last prompt position always produces logits."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits: list[int] = []
        bs = self.block_size
        for i, h in enumerate(self._hashes(seq, max_blocks)):
            block = self.pool.lookup(h, tuple(seq.token_ids[i * bs:(i + 1) * bs]))
            if block is None:
                break
            hits.append(block)
        return hits

    def admit(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Give a waiting sequence its cached prefix and blocks for `num_new_tokens` more tokens.
        Returns False (and changes nothing) if the pool cannot supply them."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        hits = self.match_prefix(seq)
        num_cached = len(hits) * self.block_size
        num_new_tokens = min(num_new_tokens, seq.num_tokens - num_cached)
        # Hits sitting in the LRU count as available, but acquiring them removes them from it.
        need = self.blocks_needed(num_cached + num_new_tokens) - len(hits)
        cached_free_hits = sum(1 for b in hits if self.pool.ref_count[b] == 0)
        if self.pool.num_available() - cached_free_hits < need:
            return False
        for b in hits:
            self.pool.acquire(b)
        seq.block_table = hits + [self.pool.allocate() for _ in range(need)]
        seq.num_computed_tokens = num_cached
        if not seq.admitted:
            seq.admitted = True
            seq.num_cached_tokens = seq.num_device_cached_tokens = num_cached
            self.device_stats.queries += seq.num_prompt_tokens
            self.device_stats.hits += num_cached
        return True

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow a running sequence's block table to hold `num_new_tokens` more tokens."""
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if need > self.pool.num_available():
            return False
        seq.block_table.extend(self.pool.allocate() for _ in range(need))
        return True

    def publish_computed(self, seq: Sequence) -> None:
        """Publish the full blocks whose KV has now been written."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        bs = self.block_size
        for i, h in enumerate(self._hashes(seq, num_full)):
            block = seq.block_table[i]
            if self.pool.block_hash[block] is None:
                self.pool.publish(block, h, tuple(seq.token_ids[i * bs:(i + 1) * bs]))

    def free(self, seq: Sequence) -> None:
        """Release every block; tail blocks first so the LRU evicts them before shared prefixes."""
        for block in reversed(seq.block_table):
            self.pool.release(block)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def usage(self) -> float:
        return self.pool.stats().in_use / max(1, self.pool.num_blocks)

    def stats(self) -> PoolStats:
        return self.pool.stats()

    def reports(self) -> list[TierReport]:
        st = self.pool.stats()
        return [TierReport("device", st.total, st.in_use, st.cached_free, st.free, self.block_size,
                           self.device_stats.queries, self.device_stats.hits, self.pool.num_evictions)]

    def check_invariants(self) -> None:
        self.pool.check_invariants()
