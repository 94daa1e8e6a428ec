"""KV cache manager: maps sequences to device blocks, with prefix caching over hash-chained full
blocks. The scheduler talks only to this class; it never touches tensors.

With a host tier, the prompt's chain of full blocks is matched block by block against the device
index, then the blocks being loaded, then the host index. Host hits start a copy into newly
allocated device blocks; the sequence is LOADING until every copy it needs has completed
(`load_state`), and only then are those device blocks published. Concurrent requests on the same
host prefix share the copy in flight. The parts: the chains and their matching (`prefix`), the
copies and the clean/dirty flags (`copies`), allocation and the lossless policy: when to defer,
when KV may be dropped, what the cleaner saves (`policy`), admitting a waiting sequence (`admission`);
with a disk tier below the host, its reads, writes and index (`disk_tier`).
Nothing here ever waits for a copy except `complete_loads`, `complete_saves`, `complete_reads`,
`wait_for_transfer`, `persist` and `close`.
"""
from __future__ import annotations

import logging

from nanoserve.kvcache.admission import Admission, Admitter
from nanoserve.kvcache.block_pool import BlockPool
from nanoserve.kvcache.copies import LoadState, TierCopies
from nanoserve.kvcache.disk_tier import DiskTier
from nanoserve.kvcache.tier_stats import HitStats, PrefixCacheStats, tier_reports
from nanoserve.kvcache.host_tier import HostTier
from nanoserve.kvcache.policy import Supply, TierPolicy
from nanoserve.kvcache.native import KVKernels
from nanoserve.kvcache.prefix import PrefixChains, PrefixHit, Tier
from nanoserve.kvcache.report import TierReport
from nanoserve.sequence import Sequence

log = logging.getLogger("nanoserve")
__all__ = ["Admission", "KVCacheManager", "LoadState", "PrefixHit", "Supply", "Tier"]


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 host: HostTier | None = None, offload_watermark: int = 0,
                 hash_salt: bytes | None = None, disk: DiskTier | None = None,
                 kernels: KVKernels = KVKernels()) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, kernels)
        self.enable_prefix_caching = enable_prefix_caching
        self.host, self.disk = host, disk
        self.hits = HitStats(host=PrefixCacheStats() if host is not None else None,
                             disk=PrefixCacheStats() if disk is not None else None)
        self.device_stats, self.host_stats = self.hits.device, self.hits.host or PrefixCacheStats()
        self.copies = TierCopies(self.pool, host, disk) if host is not None else None
        self.chains = PrefixChains(block_size, self.pool, self.copies, enable_prefix_caching, hash_salt,
                                   kernels.chain_digests)
        self.policy = TierPolicy(self.pool, self.copies, offload_watermark)
        self.admitter = Admitter(block_size, self.pool, self.chains, self.policy, self.copies, self.hits)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def offload_watermark(self) -> int:
        """Override of the cleaner's target (device blocks reusable without loss); 0 = from demand."""
        return self.policy.offload_watermark

    @offload_watermark.setter
    def offload_watermark(self, blocks: int) -> None:
        self.policy.offload_watermark = min(blocks, self.num_blocks)

    @property
    def num_save_submit_failures(self) -> int:
        return self.copies.num_save_submit_failures if self.copies is not None else 0

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def hash_prompt(self, seq: Sequence) -> None:
        """Digest the prompt's full blocks when the request arrives, not in the step admitting it."""
        self.chains.hash_prompt(seq)

    def match_prefix(self, seq: Sequence, use_host: bool = True) -> list[PrefixHit]:
        return self.chains.match(seq, use_host)

    def admit(self, seq: Sequence, num_new_tokens: int, reserve: int = 0, use_host: bool = True) -> Admission:
        """Give a waiting sequence its cached prefix and blocks for `num_new_tokens` more tokens (see
        admission.py); host hits start loading (see `load_state`)."""
        self.poll_transfers()  # the only copy ends in here: before the match, never after it
        return self.admitter.admit(seq, num_new_tokens, reserve, use_host)

    def demand_of(self, seq: Sequence, budget: int) -> int:
        """Device blocks admitting `seq` now would take: its host hits plus its first chunk."""
        match = self.chains.match_runs(seq)
        on_host = sum(hi - lo for t, lo, hi in match.runs if t is Tier.HOST)
        cached = len(match) * self.block_size
        return on_host + self.blocks_needed(min(budget, seq.num_tokens - cached))

    def offload_cold_blocks(self, demand: int = 0) -> int:
        """The cleaner, once per step: see `policy.TierPolicy.clean`."""
        self.policy.end_step()
        if self.copies is None:
            return 0
        self.poll_transfers()
        return self.policy.clean(demand)

    # ---- copies in flight ---------------------------------------------------------------------
    def load_state(self, seq: Sequence) -> LoadState:
        return self.copies.state(seq.seq_id) if self.copies is not None else LoadState.READY

    def poll_transfers(self) -> None:
        """End every copy whose handle is done (never blocks)."""
        if self.copies is not None:
            for sid in self.copies.poll():  # every load that sequence was promised has ended
                self.hits.loads_ended(sid, failed=sid in self.copies.failed)

    def complete_loads(self, seq: Sequence, timeout: float) -> None:
        """Wait (up to `timeout` in all) for the loads `seq` waits on, then end what is done: its
        state is then READY, FAILED, or still LOADING if a copy is slow."""
        if self.copies is not None:
            self.copies.wait_for(seq.seq_id, timeout)
            self.poll_transfers()

    def complete_reads(self, timeout: float) -> None:
        """Wait (up to `timeout`) for the oldest disk read in flight, then end what is done."""
        if self.disk is not None and self.disk.reads:
            self.disk.reads[0].io.wait(timeout)
            self.poll_transfers()

    def persist(self) -> None:
        """Shutdown, with a disk tier: device KV that exists nowhere else is saved to host, every host
        block written to disk, and the disk index saved for the next start. Blocks (seconds)."""
        if self.disk is None:
            return
        self.poll_transfers()
        # rounds of what the host has room for: each save lands, is written through to disk, and its host
        # blocks (clean then) make room for the next round. At most as many saves as there were dirty
        # blocks (a disk smaller than the device evicts what it just took), none once a copy fails.
        budget, failures = len(self.pool.dirty), self.copies.save_failures_in_row
        while budget > 0 and self.pool.dirty and not self.disk.degraded and failures == 0:
            if not (started := self.copies.save_dirty(len(self.pool.dirty))):
                break
            budget -= started
            self.complete_saves(60.0)
            self.disk.drain()
            failures = self.copies.save_failures_in_row + self.disk.write_failures_in_row
        self.complete_saves(60.0)
        self.disk.persist()

    def complete_saves(self, timeout: float) -> None:
        """Wait (up to `timeout` in all) for the saves in flight, then end what is done."""
        if self.copies is not None:
            self.copies.wait_for(None, timeout)  # the saves
            self.poll_transfers()

    def wait_for_transfer(self, timeout: float | None = None) -> None:
        """Block until the oldest load (else save) completes, or `timeout`: for an engine with
        nothing it can run, instead of spinning."""
        if self.copies is not None:
            self.copies.wait_oldest(timeout)
            self.poll_transfers()

    def drain_transfers(self) -> None:
        """Wait for every copy in flight and end it (tests, benchmarks, shutdown)."""
        while self.copies is not None and (self.copies.saves or self.copies.loads or (
                self.disk is not None and (self.disk.reads or self.disk.writes))):
            self.wait_for_transfer()

    def close(self, timeout: float = 30.0) -> None:
        """Engine shutdown: end every copy, then release the host pool."""
        if self.copies is not None:
            self.copies.close(timeout)

    # ---- running sequences --------------------------------------------------------------------
    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> Supply:
        """Grow a running sequence's block table to hold `num_new_tokens` more tokens. LOSSLESS or
        LOSSY: done; DEFER: nothing taken, saves will free blocks (skip it this step); SHORT:
        nothing taken (preempt someone)."""
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if need <= 0:
            return Supply.LOSSLESS
        supply = self.policy.supply(need)
        if supply in (Supply.LOSSLESS, Supply.LOSSY):
            before, room = self.pool.num_lossy_evictions, self.policy.host_room()
            seq.block_table.extend(self.policy.allocate(supply is Supply.LOSSY) for _ in range(need))
            self.policy.note_lossy(before, room)
        return supply

    def publish_computed(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """Publish the full blocks among the first `num_tokens` (default: every computed one) whose KV has
        now been written: only those not published yet (a step hashes and looks at its newly full blocks,
        not the whole table)."""
        if not self.enable_prefix_caching:
            return
        num_tokens = seq.num_computed_tokens if num_tokens is None else num_tokens
        first, num_full = seq.num_published_blocks, num_tokens // self.block_size
        if num_full <= first:
            return
        hashes = self.chains.hashes(seq, num_full)
        for i in range(first, num_full):
            block = seq.block_table[i]
            if self.pool.block_hash[block] is None:
                if self.pool.publish(block, hashes[i], seq.block_keys[i]) and self.copies is not None:
                    self.copies.twin(block)  # computed again while its KV was on host: clean already
        seq.num_published_blocks = num_full

    def free(self, seq: Sequence) -> None:
        """Release every block; tail blocks first so the LRU evicts them before shared prefixes."""
        for block in reversed(seq.block_table):
            self.pool.release(block)  # a block still loading stays pinned by its copy
        seq.block_table = []
        seq.num_computed_tokens = seq.num_published_blocks = 0
        if self.copies is not None:
            self.copies.forget(seq.seq_id)
        if self.disk is not None:
            self.disk.forget(seq.seq_id)
        self.hits.forget(seq.seq_id)

    def reports(self) -> list[TierReport]:
        return tier_reports(self.pool, self.hits, self.host, self.block_size, self.num_save_submit_failures,
                            self.admitter.num_load_submit_failures, self.disk)

    def check_invariants(self) -> None:
        """Pool accounting per tier, pins and clean flags (copies.py), and held hit stats."""
        self.pool.check_invariants()
        if self.copies is not None:
            self.copies.check_invariants()
            assert set(self.hits.unconfirmed) <= set(self.copies.waiting_on), "hit stats held, not loading"
        else:
            assert not any(self.pool.pins) and not self.hits.unconfirmed

    def held_references(self) -> int:
        """Device block references held (the scheduler checks them against its sequences' tables)."""
        return sum(self.pool.ref_count)

    @property
    def num_deferred(self) -> int:
        """Admissions and running steps deferred so far for saves to finish (benchmarks, tests)."""
        return self.policy.num_deferred
