"""KV cache manager: maps sequences to device blocks, with prefix caching over hash-chained full
blocks. The scheduler talks only to this class; it never touches tensors.

With a host tier, the prompt's chain of full blocks is matched block by block against the device
index, then the host index; host hits are copied into newly allocated device blocks at admission
(they count as computed only once copied). Before each step, `offload_cold_blocks` copies the
device LRU's oldest cached blocks to host, so that evicting them later loses nothing and never
waits for a copy; blocks that never get near eviction are never copied.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from nanoserve.kvcache.block_pool import BlockHash, BlockKey, BlockPool, PoolStats, chain_hash
from nanoserve.kvcache.host_tier import HostTier
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
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 host: HostTier | None = None, offload_watermark: int = 0,
                 hash_salt: bytes | None = None) -> None:
        self.block_size = block_size
        # per-process random key for block digests: clients cannot predict or collide them offline
        self.hash_salt = os.urandom(32) if hash_salt is None else hash_salt
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.device_stats = PrefixCacheStats()
        self.host = host
        self.host_stats = PrefixCacheStats()
        # blocks that must be reusable without losing cached KV (free, or cached and already on
        # host) at the start of each step: about one step's worth of allocations
        self.offload_watermark = min(offload_watermark, num_blocks)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _block_tokens(self, seq: Sequence, i: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])

    def _block_key(self, seq: Sequence, i: int) -> BlockKey:
        return BlockKey(seq.block_hashes[i - 1] if i else None, self._block_tokens(seq, i))

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[BlockHash]:
        """Chain digests of the first `num_blocks` full blocks, extending the sequence's memo
        (each full block is hashed once per sequence)."""
        hashes = seq.block_hashes
        while len(hashes) < num_blocks:
            hashes.append(chain_hash(hashes[-1] if hashes else None, self._block_tokens(seq, len(hashes)),
                                     self.hash_salt))
        return hashes[:num_blocks]

    def match_prefix(self, seq: Sequence) -> list[tuple[str, int]]:
        """(tier, block) for the sequence's leading cached full blocks, each looked up on device,
        then on host. At least one token is left to compute, so the last prompt position always
        produces logits."""
        if not self.enable_prefix_caching or seq.wants_prompt_logprobs:
            return []  # prompt logprobs need logits at every prompt position: compute them all
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits: list[tuple[str, int]] = []
        for i, h in enumerate(self._hashes(seq, max_blocks)):
            key = self._block_key(seq, i)
            block = self.pool.lookup(h, key)
            if block is not None:
                hits.append(("device", block))
            elif self.host is not None and (hb := self.host.lookup(h, key)) is not None:
                hits.append(("host", hb))
            else:
                break
        return hits

    def admit(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Give a waiting sequence its cached prefix and blocks for `num_new_tokens` more tokens.
        Returns False (and changes nothing) if the pool cannot supply them."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        hits = self.match_prefix(seq)
        dev_hits = [b for tier, b in hits if tier == "device"]
        num_cached = len(hits) * self.block_size
        num_new_tokens = min(num_new_tokens, seq.num_tokens - num_cached)
        need = self.blocks_needed(num_cached + num_new_tokens) - len(dev_hits)
        # device hits sitting in the LRU count as available, but acquiring them removes them from it
        cached_free_hits = sum(1 for b in dev_hits if self.pool.ref_count[b] == 0)
        if self.pool.num_available() - cached_free_hits < need:
            return False
        for b in dev_hits:
            self.pool.acquire(b)
        table: list[int] = []
        loads: list[tuple[int, int, int]] = []  # (block index, host block, device block)
        for i, (tier, b) in enumerate(hits):
            table.append(b if tier == "device" else self.pool.allocate())
            if tier == "host":
                loads.append((i, b, table[-1]))
        if loads:
            self.host.load([hb for _, hb, _ in loads], [db for _, _, db in loads])
            for i, _, db in loads:  # the copy is complete: the device block now holds this KV
                self.pool.publish(db, seq.block_hashes[i], self._block_key(seq, i))
        table.extend(self.pool.allocate() for _ in range(need - len(loads)))
        seq.block_table = table
        seq.num_computed_tokens = num_cached
        if not seq.admitted:
            seq.admitted = True
            host_tokens = len(loads) * self.block_size
            seq.num_cached_tokens = num_cached
            seq.num_device_cached_tokens = num_cached - host_tokens
            seq.num_host_cached_tokens = host_tokens
            self.device_stats.queries += seq.num_prompt_tokens
            self.device_stats.hits += num_cached - host_tokens
            if self.host is not None:
                self.host_stats.queries += seq.num_prompt_tokens - (num_cached - host_tokens)
                self.host_stats.hits += host_tokens
        return True

    def offload_cold_blocks(self) -> int:
        """Copy to host the oldest cached device blocks not yet there, until `offload_watermark`
        blocks can be reused without losing KV. Returns the number of blocks copied."""
        if self.host is None:
            return 0
        reusable = len(self.pool.free)
        to_save = []
        for block in self.pool.lru:  # oldest first: the next to be evicted
            if reusable >= self.offload_watermark:
                break
            reusable += 1
            h, key = self.pool.block_hash[block], self.pool.block_key[block]
            if self.host.lookup(h, key) is None:
                to_save.append((block, h, key))
        return self.host.save(to_save)

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
        for i, h in enumerate(self._hashes(seq, num_full)):
            block = seq.block_table[i]
            if self.pool.block_hash[block] is None:
                self.pool.publish(block, h, self._block_key(seq, i))

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
        out = [TierReport("device", st.total, st.in_use, st.cached_free, st.free, self.block_size,
                          self.device_stats.queries, self.device_stats.hits, self.pool.num_evictions)]
        if self.host is not None:
            hs, t = self.host.pool.stats(), self.host.transfers
            out.append(TierReport("host", hs.total, hs.in_use, hs.cached_free, hs.free, self.block_size,
                                  self.host_stats.queries, self.host_stats.hits, self.host.pool.num_evictions,
                                  t.bytes_in, t.bytes_out, t.seconds_in, t.seconds_out))
        return out

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        if self.host is not None:
            self.host.pool.check_invariants()
            assert self.host.pool.stats().in_use == 0, "host block still pinned after its copy"
