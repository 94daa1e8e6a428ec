"""Where device blocks come from, lossless by design.

Allocation takes free, then clean blocks (LRU, O(1)). When only dirty blocks are left, the host has
room and no save has been failing, nothing evicts them: admission *defers* (starts saves for the
shortfall, oldest dirty first, and answers False: the request is asked again next step while the
running ones keep decoding), and a running sequence sits out the step (`Supply.DEFER`); only without
room on host is KV dropped (`Supply.LOSSY`, counted in `lossy_evictions`). After each step's
scheduling the engine runs the cleaner (`clean`), which saves the oldest dirty blocks until a
demand-sized target of blocks is reusable without loss (recent allocations per step plus what the
next waiting requests need; `offload_watermark` overrides it), so those saves overlap the forward
and deferral stays rare.
"""
from __future__ import annotations

import enum
import logging
from collections import deque
from collections.abc import Collection

from nanoserve.kvcache.block_pool import BlockPool, Span
from nanoserve.kvcache.copies import TierCopies
from nanoserve.kvcache.extents import allocate_spans

log = logging.getLogger("nanoserve")


class Supply(enum.Enum):
    """How a request for device blocks can be met this step."""
    LOSSLESS = "lossless"  # from free and clean blocks
    DEFER = "defer"        # saves in flight (or just started) will make it lossless: ask next step
    LOSSY = "lossy"        # only by dropping KV that exists nowhere else (no room on host)
    SHORT = "short"        # not at all: the blocks are in use


class TierPolicy:
    def __init__(self, pool: BlockPool, copies: TierCopies | None, offload_watermark: int = 0) -> None:
        self.pool, self.copies = pool, copies
        # 0 = the cleaner's target from demand
        self.offload_watermark = min(offload_watermark, pool.num_blocks)
        self._allocs = 0                                    # device blocks allocated, ever
        self._allocs_seen = 0
        self._recent_allocs: deque[int] = deque(maxlen=16)  # per step
        self.num_deferred = 0               # admissions / running steps deferred for saves
        self.num_lossy_with_room = 0        # lossy evictions while the host had room (saves failing)
        self.num_avoidable_lossy = 0        # ... and saves were not failing: the policy says never
        self._warned_lossy = False

    def allocate(self, lossy_ok: bool) -> int:
        self._allocs += 1
        return self.pool.allocate(lossy_ok)

    def allocate_extents(self, n: int, lossy_ok: bool) -> tuple[list[int], list[Span] | None]:
        """A load's destinations: `n` blocks, ascending, as few runs as the free blocks allow (and those
        runs, unless an eviction made some: extents.allocate_spans)."""
        self._allocs += n
        return allocate_spans(self.pool, n, lossy_ok)

    def host_room(self, exclude: Collection[int] = ()) -> int:
        return self.copies.host.room(exclude) if self.copies is not None else 0

    def note_lossy(self, before: int, room: int) -> None:
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

    def supply(self, need: int, reserve: int = 0, hits: Collection[int] = (),
               protect: Collection[int] = ()) -> Supply:
        """How `need` more device blocks can be had; `hits`: device blocks the caller acquires
        first; `reserve`: blocks to leave lossless beyond `need`. Starts saves when they turn a
        lossy allocation into a lossless one next step (`protect`: host blocks they must not evict,
        pinned meanwhile)."""
        supply = self._supply(need, reserve, hits, protect)
        self.num_deferred += supply is Supply.DEFER
        return supply

    def _supply(self, need: int, reserve: int, hits: Collection[int], protect: Collection[int]) -> Supply:
        pool, copies = self.pool, self.copies
        clean_hits, dirty_hits = pool.count_cached_free(hits)
        lossless = pool.num_available(lossless=True) - clean_hits
        total = lossless + len(pool.dirty) - dirty_hits
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
            lossless = pool.num_available(lossless=True) - pool.count_cached_free(hits)[0]
        if need <= lossless:
            return Supply.LOSSLESS  # only the reserve is short: its saves (if any) are under way
        if started or pending or copies.host_blocks_being_written():
            return Supply.DEFER  # (host blocks being written to disk are room for saves once written)
        if copies.num_save_submit_failures > failures:
            return Supply.DEFER  # a save could not start just now: try again next step
        return Supply.LOSSY if need <= total else Supply.SHORT

    def end_step(self) -> None:
        """Record the step's allocations: the cleaner's target follows the largest lately."""
        self._recent_allocs.append(self._allocs - self._allocs_seen)
        self._allocs_seen = self._allocs

    def clean(self, demand: int = 0) -> int:
        """The cleaner: start saving the oldest dirty cached device blocks until the target number
        of blocks is reusable without loss (free, clean, or clean once a save in flight ends).
        Target: `offload_watermark` if set, else the most blocks allocated in one step lately plus
        `demand` (what the caller expects the next step to need). Returns the copies started."""
        target = self.offload_watermark or min(self.pool.num_blocks,
                                               max(self._recent_allocs, default=0) + demand)
        short = target - self.pool.num_available(lossless=True) - self.copies.pending_saves()
        return self.copies.save_dirty(short) if short > 0 else 0
