"""The copies in flight between the device pool and the host tier, who waits for them, and the clean
flags that tie the two tiers: a cached block is *clean* when the other tier holds the same chain
(a save landed, a load landed, or it was computed again while on host), so evicting it loses
nothing. Each tier tells the other when a chain stops being findable in it, so the flags stay exact.

Who holds what while a copy runs (all released when the copy is ended, whatever happened to the
sequences meanwhile):
  load  host source blocks: pinned (host pool);  device destination blocks: pinned (device pool),
        plus one reference per sequence whose table holds them (the manager's)
  save  device source blocks: pinned;  host destination blocks: pinned, unpublished
Nothing here waits for a copy except `wait_*` and `close`; copies are ended by `poll`.
"""
from __future__ import annotations

import enum
import logging
import time
from collections import Counter, deque
from collections.abc import Collection
from dataclasses import dataclass, field
from itertools import repeat
from typing import TYPE_CHECKING

import numpy as np

from nanoserve.kvcache.block_pool import BlockHash, BlockKey, BlockPool, pin_taken
from nanoserve.kvcache.host_tier import HostCopy, HostTier

if TYPE_CHECKING:
    from nanoserve.kvcache.disk_tier import DiskTier

log = logging.getLogger("nanoserve")


class LoadState(enum.Enum):
    READY = "ready"      # every block the sequence holds has its KV on device
    LOADING = "loading"  # a copy from host it depends on is still running
    FAILED = "failed"    # a copy it depended on failed: free it and recompute


@dataclass(eq=False)
class Load:
    copy: HostCopy
    hashes: list[BlockHash]  # per link (as copy.dev_ids): the chain digest and key it loads
    keys: list[BlockKey]
    waiters: set[int] = field(default_factory=set)  # seq ids holding its destination blocks
    # digest -> link, built only when a match first meets the load in flight (another request while it
    # runs): the admission that starts it, on the step path, does no per-link work for it
    _links: dict[BlockHash, int] | None = field(default=None, repr=False)

    def links(self) -> dict[BlockHash, int]:
        if self._links is None:
            self._links = dict(zip(self.hashes, range(len(self.hashes))))
        return self._links


def chain_order(blocks: list[int], pool: BlockPool) -> list[int]:
    """Published blocks reordered so each chain runs parent before child, depth first. The LRU holds
    a freed sequence tail first; saved in table order, a chain lands in ascending host blocks and
    later loads back as a few long copies instead of one per block."""
    batch = {pool.block_hash[b] for b in blocks}
    children: dict[BlockHash, list[int]] = {}
    roots = []
    for b in blocks:
        parent = pool.block_key[b].parent
        if parent in batch:
            children.setdefault(parent, []).append(b)
        else:
            roots.append(b)
    out: list[int] = []
    for root in roots:
        stack = [root]
        while stack:
            b = stack.pop()
            out.append(b)
            stack.extend(reversed(children.get(pool.block_hash[b], ())))
    return out


def loading_links(loading: dict[BlockHash, Load],
                  hashes: list[BlockHash]) -> tuple[np.ndarray, list[BlockKey | None]]:
    """Per digest: the device block a load in flight fills with it (-1: none), and its stored key. In
    passes per load (a digest is in one load at most), not per link: a second request on a prefix in
    flight matches thousands of links here."""
    n = len(hashes)
    blocks = np.full(n, -1, np.int64)
    keys: list[BlockKey | None] = [None] * n
    per_link = list(map(loading.get, hashes))
    lds = set(per_link) - {None}
    if len(lds) == 1 and _one_piece(per_link, hashes, lds.pop(), blocks, keys):
        return blocks, keys
    for ld in set(per_link) - {None}:
        pos = np.fromiter(map(ld.links().get, hashes, repeat(-1)), np.int64, n)
        at = (pos >= 0).nonzero()[0]
        src = pos[at]
        blocks[at] = np.array(ld.copy.dev_ids, np.int64)[src]
        deque(map(keys.__setitem__, at.tolist(), map(ld.keys.__getitem__, src.tolist())), maxlen=0)
    return blocks, keys


def _one_piece(per_link: list[Load | None], hashes: list[BlockHash], ld: Load, blocks: np.ndarray,
               keys: list[BlockKey | None]) -> bool:
    """`loading_links` when the links `ld` loads are one piece of both chains, contiguous on each side
    (the usual: a request on the prefix another one is loading), as slices; False if they are not."""
    lo = per_link.index(ld)
    m = per_link.count(ld)
    j = ld.hashes.index(hashes[lo])
    if per_link[lo:lo + m].count(ld) != m or ld.hashes[j:j + m] != hashes[lo:lo + m]:
        return False
    blocks[lo:lo + m] = ld.copy.dev_ids[j:j + m]
    keys[lo:lo + m] = ld.keys[j:j + m]
    return True


class TierCopies:
    def __init__(self, pool: BlockPool, host: HostTier, disk: DiskTier | None = None) -> None:
        self.pool, self.host, self.disk = pool, host, disk
        self.saves: list[HostCopy] = []
        self.loads: list[Load] = []  # in flight, each filling device blocks with chain links
        self._loading: dict[BlockHash, Load] = {}  # see `loading`; `_unindexed`: loads not in it yet
        self._unindexed: list[Load] = []
        self.waiting_on: dict[int, set[Load]] = {}  # seq id -> loads it still needs
        self.failed: set[int] = set()                # seq ids whose load failed
        self.save_failures_in_row = 0  # failed submits/copies since the last save that landed
        self.num_save_submit_failures = 0   # optional saves that could not start (skipped)
        # a chain dropped from one tier: its twins' flags follow
        pool.on_unpublish = host.pool.on_unpublish = lambda h, evicted: self._refresh(h)
        if disk is not None:  # host blocks written through to disk; reads from it publish on host
            disk.on_change = self._refresh

    # ---- clean flags ------------------------------------------------------------------------------
    def twin(self, block: int) -> None:
        """Device block `block` may now be held by a tier below too: its flags and its twins' follow."""
        self._refresh(self.pool.block_hash[block])

    def _refresh(self, h: BlockHash) -> None:
        """The clean flags of chain `h`'s blocks from which tiers hold it: a device block is clean when
        the host or the disk holds it; a host block when the disk does (with a disk tier), else when the
        device does (evicting it would gain nothing)."""
        dev, on_host = self.pool.index.get(h), self.host.pool.index.get(h)
        on_disk = self.disk is not None and h in self.disk.pool.index
        if dev is not None:
            self.pool.mark_clean(dev, on_host is not None or on_disk)
        if on_host is not None:  # (a disk whose writes failed takes no more: the host keeps its own rule)
            self.host.pool.mark_clean(on_host, on_disk if self.host.backed else dev is not None)
            self.host.on_device[on_host] = dev is not None

    # ---- saves --------------------------------------------------------------------------------------
    def pending_saves(self, exclude: Collection[int] = ()) -> int:
        """Device blocks that saves in flight will make clean and reusable (unreferenced now)."""
        return sum(1 for c in self.saves for b in c.dev_ids
                   if not self.pool.ref_count[b] and b not in exclude)

    def host_blocks_being_written(self) -> int:
        """Host blocks pinned by writes to disk: clean, and room for saves, once those land."""
        return sum(len(c.host_ids) for c in self.disk.writes) if self.host.backed else 0

    def save_dirty(self, n: int, protect: Collection[int] = ()) -> int:
        """Start saving up to `n` of the oldest dirty device blocks (marking clean, without a copy,
        those the host already holds); `protect`: host blocks the save must not evict. Returns how
        many copies were started. A save that cannot start is logged, counted and skipped: it was
        optional."""
        host, pool = self.host, self.pool
        dev_ids, already = [], []
        for block in pool.dirty:  # oldest first: the next to be evicted
            if len(dev_ids) + len(already) >= n:
                break
            h, key = pool.block_hash[block], pool.block_key[block]
            on_disk = self.disk is not None and self.disk.pool.lookup(h, key) is not None
            (already if host.lookup(h, key) is not None or on_disk else dev_ids).append(block)
        for block in already:
            self.twin(block)
        if not dev_ids or not host.room():
            return 0
        dev_ids = chain_order(dev_ids, pool)
        keys = [(pool.block_hash[b], pool.block_key[b]) for b in dev_ids]
        for hb in protect:
            host.pool.pin(hb)
        try:
            copy = host.begin_save(dev_ids, keys)
        except Exception:
            self.num_save_submit_failures += 1
            self.save_failures_in_row += 1
            log.exception("KV save to host could not start; skipped")
            return 0
        finally:
            for hb in protect:
                host.pool.unpin(hb)
        if copy is None:
            return 0
        for db in copy.dev_ids:
            pool.pin(db)
        self.saves.append(copy)
        return len(copy.dev_ids)

    def _end_save(self, copy: HostCopy) -> None:
        self.saves.remove(copy)
        ok = self.host.end_save(copy)
        self.save_failures_in_row = 0 if ok else self.save_failures_in_row + 1
        for db, (h, key) in zip(copy.dev_ids, copy.keys):
            if ok:
                self._refresh(h)  # the device block (if it still holds h) is clean: evicting it loses nothing
            self.pool.unpin(db)
        if ok and self.disk is not None:
            self.disk.write_back(copy.host_ids)  # write-through: the host block is clean once on disk

    # ---- loads --------------------------------------------------------------------------------------
    def loading_block(self, h: BlockHash, key: BlockKey) -> int | None:
        """The device block a load in flight is filling with this chain's KV."""
        ld = self.loading().get(h)
        if ld is None:
            return None
        i = ld.links()[h]
        return ld.copy.dev_ids[i] if ld.keys[i] == key else None

    def begin_load(self, hashes: list[BlockHash], keys: list[BlockKey], host_ids: list[int],
                   dev_ids: list[int], dev_spans: list[tuple[int, int]] | None = None,
                   host_spans: list[tuple[int, int]] | None = None) -> Load:
        """Start copying host blocks into device blocks, link i being (hashes[i], keys[i], host_ids[i],
        dev_ids[i]); the device blocks are pinned until the copy ends (they survive their sequence
        being freed meanwhile). In whole-list passes: a load can be thousands of blocks; the lists are
        handed over (kept by the load). `dev_spans`, `host_spans`: the blocks as runs [start, stop), in
        order, when the caller has them (extents.allocate_spans: just taken; chain_runs.stored_runs)."""
        copy = self.host.begin_load(host_ids, dev_ids, dev_spans, host_spans)
        ld = Load(copy, hashes, keys)  # the caller's lists, handed over
        pin_taken(self.pool, copy.dev_ids, dev_spans)
        self.loads.append(ld)
        self._unindexed.append(ld)
        return ld

    def wait_on(self, seq_id: int, loads: set[Load]) -> None:
        for ld in loads:
            ld.waiters.add(seq_id)
        self.waiting_on[seq_id] = loads

    def loading(self) -> dict[BlockHash, Load]:
        """Digest -> the load in flight filling a device block with that chain. A load joins when a match
        first asks, not when it starts: its admission registers no link, nor ever does one ending first."""
        for ld in self._unindexed:
            self._loading.update(dict.fromkeys(ld.hashes, ld))  # one entry per digest, no tuple per link
        self._unindexed.clear()
        return self._loading

    def loads_of(self, hashes: list[BlockHash]) -> set[Load]:
        """The loads in flight that fill device blocks with any of these chains."""
        return set(map(self.loading().get, hashes)) - {None}

    def state(self, seq_id: int) -> LoadState:
        if seq_id in self.failed:
            return LoadState.FAILED
        return LoadState.LOADING if self.waiting_on.get(seq_id) else LoadState.READY

    def forget(self, seq_id: int) -> None:
        for ld in self.waiting_on.pop(seq_id, ()):
            ld.waiters.discard(seq_id)
        self.failed.discard(seq_id)

    def _end_load(self, ld: Load) -> list[int]:
        self.loads.remove(ld)
        if ld in self._unindexed:
            self._unindexed.remove(ld)
        else:
            deque(map(self._loading.pop, ld.hashes), maxlen=0)
        ok = self.host.end_load(ld.copy)
        if ok:
            ld.copy.handle.order_compute_after()
        for db, h, key in zip(ld.copy.dev_ids, ld.hashes, ld.keys):
            if ok and self.pool.publish(db, h, key):  # the KV is on device only now: findable from here on
                self.twin(db)
            self.pool.unpin(db)
        settled = []
        for sid in ld.waiters:
            pending = self.waiting_on[sid]
            pending.discard(ld)
            if not ok:
                self.failed.add(sid)
            if not pending:
                del self.waiting_on[sid]
                settled.append(sid)
        return settled

    # ---- ending copies ------------------------------------------------------------------------------
    def poll(self) -> list[int]:
        """End every copy whose handle is done (never blocks). Returns the sequences that no longer
        wait for any load (see `state`: READY, or FAILED if one of them failed)."""
        for c in [c for c in self.saves if c.handle.done()]:
            self._end_save(c)
        settled = [sid for ld in [ld for ld in self.loads if ld.copy.handle.done()]
                   for sid in self._end_load(ld)]
        if self.disk is not None:
            self.disk.poll()
        return settled

    def wait_for(self, seq_id: int | None, timeout: float) -> None:
        """Wait (up to `timeout` in all) for the loads `seq_id` waits on (None: every save); then poll."""
        deadline = time.monotonic() + timeout
        copies = list(self.saves) if seq_id is None else [ld.copy for ld in self.waiting_on.get(seq_id, ())]
        for c in copies:
            c.handle.wait(max(0.0, deadline - time.monotonic()))

    def wait_oldest(self, timeout: float | None = None) -> None:
        """Block until the oldest load (else save, else disk read or write) completes, or `timeout`; the
        caller polls after."""
        if self.loads:
            self.loads[0].copy.handle.wait(timeout)
        elif self.saves:
            self.saves[0].handle.wait(timeout)
        elif self.disk is not None and (io := self.disk.reads or self.disk.writes):
            io[0].io.wait(timeout)

    def close(self, timeout: float = 30.0) -> None:
        """End every copy, then release the host pool (unpinning it on CUDA). A copy still running
        after `timeout` leaves the pool registered: a leak, not a corruption."""
        deadline = time.monotonic() + timeout
        while (self.saves or self.loads) and time.monotonic() < deadline:
            self.wait_oldest(max(0.0, deadline - time.monotonic()))
            self.poll()
        if self.saves or self.loads:
            log.error("KV copies still running at shutdown; the host pool is left as it is")
        else:
            if self.disk is not None:
                self.disk.close()  # its writes read the host pool
            self.host.close()

    def check_invariants(self) -> None:
        """Every pin accounted for by a copy in flight; clean <=> the other tier holds the chain."""
        dev, host = self.pool, self.host.pool
        dev_pins = Counter(b for c in self.saves for b in c.dev_ids)
        dev_pins.update(b for ld in self.loads for b in ld.copy.dev_ids)
        assert all(dev.pins[b] == dev_pins[b] for b in range(dev.num_blocks)), (
            "device block pinned without a copy in flight (or the reverse)")
        loading = self.loading()
        assert len(loading) == sum(len(ld.hashes) for ld in self.loads) and all(
            loading.get(h) is ld for ld in self.loads for h in ld.hashes), "loading index is stale"
        assert all(ld in self.loads for lds in self.waiting_on.values() for ld in lds), (
            "waiting on an ended load")
        host.check_invariants()
        _check_flags(dev, self.host, self.disk.pool.index if self.disk is not None else {})
        assert host.stats().in_use == 0, "host blocks are held by copies (pins), never referenced"
        host_pins = Counter(b for c in self.saves for b in c.host_ids)
        host_pins.update(b for ld in self.loads for b in ld.copy.host_ids)
        if self.disk is not None:
            self.disk.check_invariants()
            host_pins.update(b for c in self.disk.reads + self.disk.writes for b in c.host_ids)
            host_pins.update(b for staged in self.disk.staged.values() for b in staged)
        assert all(host.pins[b] == host_pins[b] for b in range(host.num_blocks)), (
            "host block pinned without a copy in flight (or the reverse)")


def _check_flags(dev: BlockPool, host: HostTier, disk: Collection[BlockHash]) -> None:
    """Clean <=> the other tier holds the chain (the host's: the disk, or without one the device); a host
    block's on-device byte <=> the device holds its chain."""
    host_below = (lambda h: h in disk) if host.backed else (lambda h: h in dev.index)
    for a, below, name in ((dev, lambda h: h in host.pool.index or h in disk, "device"),
                           (host.pool, host_below, "host")):
        for blk in range(a.num_blocks):
            h = a.block_hash[blk]
            if h is not None and a.index.get(h) == blk:
                assert a.is_clean[blk] == below(h), f"{name} block {blk} clean flag is wrong"
                assert a is dev or host.on_device[blk] == (h in dev.index), (
                    f"host block {blk}'s on-device byte is wrong")
