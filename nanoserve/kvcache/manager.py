"""KV cache manager: maps sequences to device blocks, with prefix caching over hash-chained full
blocks. The scheduler talks only to this class; it never touches tensors.

With a host tier, the prompt's chain of full blocks is matched block by block against the device
index, then the blocks being loaded, then the host index. Host hits start a copy into newly
allocated device blocks; the sequence is LOADING until every copy it needs has completed
(`load_state`), and only then are those device blocks published. Concurrent requests on the same
host prefix share the copy in flight. The copies and the clean/dirty flags are `copies.TierCopies`.

The policy, lossless by design: allocation takes free, then clean blocks (LRU, O(1)). When only
dirty blocks are left, the host has room and no save has been failing, nothing evicts them:
admission *defers* (starts saves for the shortfall, oldest dirty first, and answers False: the
request is asked again next step while the running ones keep decoding), and a running sequence
sits out the step (`Supply.DEFER`); only without room on host is KV dropped (`Supply.LOSSY`,
counted in `lossy_evictions`). After each step's scheduling the engine calls
`offload_cold_blocks`, which saves the oldest dirty blocks until a demand-sized target of blocks
is reusable without loss (recent allocations per step plus what the next waiting requests need;
`offload_watermark` overrides it), so those saves overlap the forward and deferral stays rare.
Nothing here ever waits for a copy except `complete_loads`, `wait_for_transfer` and `close`.
"""
from __future__ import annotations

import enum
import logging
import os
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass
from typing import NamedTuple

from nanoserve.kvcache.block_pool import BlockHash, BlockKey, BlockPool, chain_hash
from nanoserve.kvcache.copies import Load, LoadState, TierCopies
from nanoserve.kvcache.host_tier import HostTier
from nanoserve.kvcache.report import TierReport
from nanoserve.sequence import Sequence

log = logging.getLogger("nanoserve")
__all__ = ["KVCacheManager", "LoadState", "PrefixHit", "Supply", "Tier"]


class Supply(enum.Enum):
    """How a request for device blocks can be met this step."""
    LOSSLESS = "lossless"  # from free and clean blocks
    DEFER = "defer"        # saves in flight (or just started) will make it lossless: ask next step
    LOSSY = "lossy"        # only by dropping KV that exists nowhere else (no room on host)
    SHORT = "short"        # not at all: the blocks are in use


class Tier(str, enum.Enum):
    DEVICE = "device"    # cached on device
    LOADING = "loading"  # a device block a load in flight is filling
    HOST = "host"        # cached on host only


class PrefixHit(NamedTuple):
    tier: Tier
    block: int  # a host block for Tier.HOST, else a device block


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0     # prompt tokens found


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
        self.copies = TierCopies(self.pool, host) if host is not None else None
        # override of the cleaner's target (device blocks reusable without loss); 0 = from demand
        self.offload_watermark = min(offload_watermark, num_blocks)
        # first admission's cache stats, counted once its loads have landed: seq id -> (cached, host)
        self._unconfirmed: dict[int, tuple[Sequence, int, int]] = {}
        self._allocs = 0                               # device blocks allocated, ever
        self._allocs_seen = 0
        self._recent_allocs: deque[int] = deque(maxlen=16)  # per cleaner call (= per step)
        self.num_deferred = 0               # admissions / running steps deferred for saves
        self.num_load_submit_failures = 0   # loads that could not start (treated as host misses)
        self.num_lossy_with_room = 0        # lossy evictions while the host had room (saves failing)
        self.num_avoidable_lossy = 0        # ... and saves were not failing: the policy says never
        self._warned_lossy = False

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_save_submit_failures(self) -> int:
        return self.copies.num_save_submit_failures if self.copies is not None else 0

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _block_tokens(self, seq: Sequence, i: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])

    def _block_key(self, seq: Sequence, i: int) -> BlockKey:
        return seq.block_keys[i]

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[BlockHash]:
        """Chain digests of the first `num_blocks` full blocks, extending the sequence's memo of
        digests and keys (each full block is hashed once per sequence)."""
        hashes, keys = seq.block_hashes, seq.block_keys
        while len(hashes) < num_blocks:
            key = BlockKey(hashes[-1] if hashes else None, self._block_tokens(seq, len(hashes)))
            hashes.append(chain_hash(key.parent, key.tokens, self.hash_salt))
            keys.append(key)
        return hashes[:num_blocks]

    def hash_prompt(self, seq: Sequence) -> None:
        """Digest the prompt's full blocks when the request arrives, so that admitting a long
        prompt in a step costs lookups, not thousands of hashes."""
        if self.enable_prefix_caching:
            self._hashes(seq, (seq.num_tokens - 1) // self.block_size)

    def match_prefix(self, seq: Sequence, use_host: bool = True) -> list[PrefixHit]:
        """The sequence's leading cached full blocks, each looked up on device, then among the
        loads in flight, then on host. At least one token is left to compute, so the last prompt
        position always produces logits."""
        if not self.enable_prefix_caching or seq.wants_prompt_logprobs:
            return []  # prompt logprobs need logits at every prompt position: compute them all
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits: list[PrefixHit] = []
        for i, h in enumerate(self._hashes(seq, max_blocks)):
            key = self._block_key(seq, i)
            if (block := self.pool.lookup(h, key)) is not None:
                hits.append(PrefixHit(Tier.DEVICE, block))
            elif self.copies is not None and (block := self.copies.loading_block(h, key)) is not None:
                hits.append(PrefixHit(Tier.LOADING, block))
            elif use_host and self.host is not None and (block := self.host.lookup(h, key)) is not None:
                hits.append(PrefixHit(Tier.HOST, block))
            else:
                break
        return hits

    def admit(self, seq: Sequence, num_new_tokens: int, reserve: int = 0, use_host: bool = True) -> bool:
        """Give a waiting sequence its cached prefix and blocks for `num_new_tokens` more tokens;
        host hits start loading (see `load_state`). Returns False (and changes nothing the caller
        holds) if the blocks cannot be had now, or only by dropping uncopied KV while saves can
        avoid that: those saves are started and the answer may change next step. `reserve`: blocks
        to leave reusable without loss (the running sequences' next tokens). If anything raises,
        every block and pin taken is released; a load that cannot start is a host miss."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        self.poll_transfers()  # the only copy ends in here: before the match, never after it
        hits = self.match_prefix(seq, use_host)
        num_cached = len(hits) * self.block_size
        num_new = min(num_new_tokens, seq.num_tokens - num_cached)
        host_hits = [b for t, b in hits if t is Tier.HOST]
        need = self.blocks_needed(num_cached + num_new) - len(hits) + len(host_hits)
        # device hits sitting in an LRU: acquiring them takes them out of what allocation can use
        supply = self._supply(need, reserve, [b for t, b in hits if t is Tier.DEVICE], host_hits)
        if supply is Supply.SHORT or supply is Supply.DEFER:
            self.num_deferred += supply is Supply.DEFER
            return False
        # host room for saves, not counting this request's own host hits (they stay)
        room = self._host_room() - sum(1 for hb in host_hits if hb in self.host.pool.dirty) if host_hits else \
            self._host_room()
        lossy_before = self.pool.num_lossy_evictions
        table, shared = self._take_blocks(seq, hits, need, supply is Supply.LOSSY)
        if host_hits:
            # the host hits are still the ones matched: nothing since the match touched the host
            # pool but `_supply`, which pinned them around the saves it started
            try:
                shared.add(self.copies.begin_load(
                    [(seq.block_hashes[i], self._block_key(seq, i), b, table[i])
                     for i, (t, b) in enumerate(hits) if t is Tier.HOST]))
            except Exception:
                self._release(table)
                self.num_load_submit_failures += 1
                log.exception("KV load from host could not start; recomputing the prefix instead")
                return self.admit(seq, num_new_tokens, reserve, use_host=False)
        self._note_lossy(lossy_before, room)
        if shared:  # registered right after the match: no copy has ended in between
            self.copies.wait_on(seq.seq_id, shared)
        seq.block_table = table
        seq.num_computed_tokens = num_cached
        if not seq.admitted:
            if shared:
                self._unconfirmed[seq.seq_id] = (seq, num_cached, len(host_hits) * self.block_size)
            else:
                self._count_hits(seq, num_cached, len(host_hits) * self.block_size)
        return True

    def _take_blocks(self, seq: Sequence, hits: list[PrefixHit], need: int,
                     lossy_ok: bool) -> tuple[list[int], set[Load]]:
        """The block table for `hits` plus `need` new blocks (host hits get fresh destination
        blocks), and the loads in flight it shares. All or nothing."""
        table: list[int | None] = [None] * len(hits)
        shared: set[Load] = set()
        try:
            # hits on device first: allocating could otherwise evict one of them from the LRU
            for i, (tier, b) in enumerate(hits):
                if tier is not Tier.HOST:
                    self.pool.acquire(b)
                    table[i] = b
                    if tier is Tier.LOADING:
                        shared.add(self.copies.load_of(seq.block_hashes[i]))
            # a load's destinations ascending in table order: with the host side in chain order
            # (copies.chain_order) consecutive blocks on both sides become one copy
            to_load = [i for i, (tier, _) in enumerate(hits) if tier is Tier.HOST]
            for i in to_load:
                table[i] = self._allocate(lossy_ok)
            for i, b in zip(to_load, sorted(table[i] for i in to_load)):
                table[i] = b
            table.extend(self._allocate(lossy_ok) for _ in range(need - sum(t is Tier.HOST for t, _ in hits)))
        except BaseException:
            self._release(table)
            raise
        return table, shared

    def _count_hits(self, seq: Sequence, num_cached: int, host_tokens: int) -> None:
        """A sequence's first admission, once every block it was promised is on device: its usage
        numbers and the per-tier hit counters."""
        seq.admitted = True
        seq.num_cached_tokens = num_cached
        seq.num_device_cached_tokens = num_cached - host_tokens
        seq.num_host_cached_tokens = host_tokens
        self.device_stats.queries += seq.num_prompt_tokens
        self.device_stats.hits += num_cached - host_tokens
        if self.host is not None:
            self.host_stats.queries += seq.num_prompt_tokens - (num_cached - host_tokens)
            self.host_stats.hits += host_tokens

    def _release(self, table: list[int | None]) -> None:
        for b in table:
            if b is not None:
                self.pool.release(b)

    def _allocate(self, lossy_ok: bool) -> int:
        self._allocs += 1
        return self.pool.allocate(lossy_ok)

    def _host_room(self) -> int:
        return self.host.room() if self.host is not None else 0

    def _note_lossy(self, before: int, room: int) -> None:
        """Count lossy evictions made while the host had `room` (measured before allocating), and
        log the first one."""
        n = self.pool.num_lossy_evictions - before
        if n and room:
            self.num_lossy_with_room += n
            self.num_avoidable_lossy += n * (self.copies.save_failures_in_row < 3)
            if not self._warned_lossy:
                self._warned_lossy = True
                log.warning("dropped %d uncopied KV block(s) while the host tier had room (saves to host "
                            "kept failing); nanoserve:kv_lossy_evictions_total counts every such block", n)

    # ---- the lossless policy ----------------------------------------------------------------
    def _supply(self, need: int, reserve: int = 0, hits: Collection[int] = (),
                protect: Collection[int] = ()) -> Supply:
        """How `need` more device blocks can be had; `hits`: device blocks the caller acquires
        first; `reserve`: blocks to leave lossless beyond `need`. Starts saves when they turn a
        lossy allocation into a lossless one next step (`protect`: host blocks they must not evict,
        pinned meanwhile)."""
        pool, copies = self.pool, self.copies
        lossless = pool.num_available(lossless=True) - sum(1 for b in hits if b in pool.clean)
        total = lossless + len(pool.dirty) - sum(1 for b in hits if b in pool.dirty)
        if need + reserve <= lossless:
            return Supply.LOSSLESS
        if copies is None:  # a single tier: dropping the oldest cached KV is the only way
            return Supply.LOSSY if need <= total else Supply.SHORT
        pending = copies.pending_saves(hits)
        if need > total + pending:
            return Supply.SHORT
        started, failures = 0, copies.num_save_submit_failures
        # after 3 failed saves in a row only the cleaner tries again (a success re-enables this)
        if need + reserve > lossless + pending and copies.save_failures_in_row < 3:
            started = copies.save_dirty(need + reserve - lossless - pending, protect)
            lossless = pool.num_available(lossless=True) - sum(1 for b in hits if b in pool.clean)
        if need <= lossless:
            return Supply.LOSSLESS  # only the reserve is short: its saves (if any) are under way
        if started or pending:
            return Supply.DEFER
        if copies.num_save_submit_failures > failures:
            return Supply.DEFER  # a save could not start just now: try again next step
        return Supply.LOSSY if need <= total else Supply.SHORT

    def demand_of(self, seq: Sequence, budget: int) -> int:
        """Device blocks admitting `seq` now would take: its host hits plus its first chunk."""
        hits = self.match_prefix(seq)
        on_host = sum(1 for t, _ in hits if t is Tier.HOST)
        cached = len(hits) * self.block_size
        return on_host + self.blocks_needed(min(budget, seq.num_tokens - cached))

    def offload_cold_blocks(self, demand: int = 0) -> int:
        """The cleaner: start saving the oldest dirty cached device blocks until the target number
        of blocks is reusable without loss (free, clean, or clean once a save in flight ends).
        Target: `offload_watermark` if set, else the most blocks allocated in one step lately plus
        `demand` (what the caller expects the next step to need). Returns the copies started."""
        self._recent_allocs.append(self._allocs - self._allocs_seen)
        self._allocs_seen = self._allocs
        if self.copies is None:
            return 0
        self.poll_transfers()
        target = self.offload_watermark or min(self.num_blocks, max(self._recent_allocs) + demand)
        short = target - self.pool.num_available(lossless=True) - self.copies.pending_saves()
        return self.copies.save_dirty(short) if short > 0 else 0

    # ---- copies in flight ---------------------------------------------------------------------
    def load_state(self, seq: Sequence) -> LoadState:
        return self.copies.state(seq.seq_id) if self.copies is not None else LoadState.READY

    def poll_transfers(self) -> None:
        """End every copy whose handle is done (never blocks)."""
        if self.copies is not None:
            for sid in self.copies.poll():
                stats = self._unconfirmed.pop(sid, None)
                if stats is not None and sid not in self.copies.failed:
                    self._count_hits(*stats)  # every load it was promised has landed

    def complete_loads(self, seq: Sequence, timeout: float) -> None:
        """Wait (up to `timeout` in all) for the loads `seq` waits on, then end what is done: its
        state is then READY, FAILED, or still LOADING if a copy is slow."""
        if self.copies is not None:
            self.copies.wait_for(seq.seq_id, timeout)
            self.poll_transfers()

    def wait_for_transfer(self, timeout: float | None = None) -> None:
        """Block until the oldest load (else save) completes, or `timeout`: for an engine with
        nothing it can run, instead of spinning."""
        if self.copies is not None:
            self.copies.wait_oldest(timeout)
            self.poll_transfers()

    def drain_transfers(self) -> None:
        """Wait for every copy in flight and end it (tests, benchmarks, shutdown)."""
        while self.copies is not None and (self.copies.saves or self.copies.loads):
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
        supply = self._supply(need)
        if supply is Supply.DEFER:
            self.num_deferred += 1
        if supply in (Supply.LOSSLESS, Supply.LOSSY):
            before, room = self.pool.num_lossy_evictions, self._host_room()
            seq.block_table.extend(self._allocate(supply is Supply.LOSSY) for _ in range(need))
            self._note_lossy(before, room)
        return supply

    def publish_computed(self, seq: Sequence) -> None:
        """Publish the full blocks whose KV has now been written."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        for i, h in enumerate(self._hashes(seq, num_full)):
            block = seq.block_table[i]
            if self.pool.block_hash[block] is None:
                if self.pool.publish(block, h, self._block_key(seq, i)) and self.copies is not None:
                    self.copies.twin(block)  # computed again while its KV was on host: clean already

    def free(self, seq: Sequence) -> None:
        """Release every block; tail blocks first so the LRU evicts them before shared prefixes."""
        for block in reversed(seq.block_table):
            self.pool.release(block)  # a block still loading stays pinned by its copy
        seq.block_table = []
        seq.num_computed_tokens = 0
        if self.copies is not None:
            self.copies.forget(seq.seq_id)
        self._unconfirmed.pop(seq.seq_id, None)

    def reports(self) -> list[TierReport]:
        st = self.pool.stats()
        out = [TierReport("device", st.total, st.in_use, st.cached_free, st.free, self.block_size,
                          self.device_stats.queries, self.device_stats.hits, self.pool.num_evictions,
                          st.in_flight, lossy_evictions=self.pool.num_lossy_evictions)]
        if self.host is not None:
            hs, t = self.host.pool.stats(), self.host.transfers
            out.append(TierReport("host", hs.total, hs.in_use, hs.cached_free, hs.free, self.block_size,
                                  self.host_stats.queries, self.host_stats.hits, self.host.pool.num_evictions,
                                  hs.in_flight, self.host.pool.num_lossy_evictions, t.bytes_in, t.bytes_out,
                                  t.seconds_in, t.seconds_out, t.failed_in + self.num_save_submit_failures,
                                  t.failed_out + self.num_load_submit_failures))
        return out

    def check_invariants(self) -> None:
        """Pool accounting per tier, pins and clean flags (copies.py), and held hit stats."""
        self.pool.check_invariants()
        if self.copies is not None:
            self.copies.check_invariants()
            assert set(self._unconfirmed) <= set(self.copies.waiting_on), "hit stats held for a sequence not loading"
        else:
            assert not any(self.pool.pins) and not self._unconfirmed
