"""Disk tier: the third prefix-cache level, below the host tier, in one file of fixed-size slots
(disk_store.py) that outlives the process.

Write-through: every block published on host (a save from device that landed) is written to disk by
the store's writer thread unless the disk holds its chain already; the host block is pinned
meanwhile. With a disk tier a host block is *clean* when its chain is on disk (not "on device"), and
the host evicts clean blocks first: dropping one loses nothing. The disk's own LRU is the last level.

Reads: a waiting request whose chain continues on disk past its device and host hits gets those links
read into fresh host blocks (pinned; checksums verified on the reader thread) and is asked again once
they are published on host; from there they load to device as any host hit does. A block that fails
its checksum or cannot be read is dropped from the disk index and counted: the request recomputes it.

Restart: `persist` (shutdown) writes every host block not on disk yet, then the index (chains, keys,
checksums) under a fingerprint of weights, dtype, layout and hash key; `restore` (start) reads it back
only if the fingerprint matches. Slots rewritten after the last index was saved (a crash) fail their
checksum, which binds a slot's bytes to its chain: a miss, never another chain's KV.
"""
from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from nanoserve.kvcache.block_pool import BlockHash, BlockKey, BlockPool
from nanoserve.kvcache.disk_store import DiskIO, DiskStore, IndexEntry
from nanoserve.kvcache.extents import allocate_extents
from nanoserve.kvcache.host_tier import HostTier

log = logging.getLogger("nanoserve")
# what the KV bytes mean beyond the weights and layout: bump it with any change to the numerics that write
# them (RoPE, norms, the attention's rounding), so an older server's blocks are not read back as equal
KV_FORMAT = b"nanoserve-kv-disk/1\0"


@dataclass(eq=False)
class DiskCopy:
    """One batch of block copies between host blocks and disk slots, and what it holds (pins on both)."""
    io: DiskIO
    host_ids: list[int]
    slots: list[int]
    keys: list[tuple[BlockHash, BlockKey]]
    seq_id: int = -1  # a read: the request it is for


@dataclass
class DiskStats:
    blocks_written: int = 0
    blocks_read: int = 0        # read back and verified
    read_failures: int = 0      # failed checksum or read: dropped, recomputed
    write_failures: int = 0
    seconds_written: float = 0.0
    seconds_read: float = 0.0
    restored: int = 0           # blocks found in the index at start
    lossy_evictions: int = 0    # slots reused whose chain no other tier held


def weights_digest(path: Path) -> bytes:
    """The weight files under `path` (a file or a folder): names, sizes, modification times, what a hub
    snapshot's links point to (content-addressed blob names), and their first and last MiB: a changed
    checkpoint changes it without reading gigabytes at every start."""
    h = hashlib.sha256()
    files = sorted(p for p in (path.rglob("*") if path.is_dir() else [path]) if p.is_file())
    for f in files:
        st = f.stat()
        name = f.relative_to(path) if path.is_dir() else f.name
        h.update(f"{name}\0{f.resolve().name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            fh.seek(max(0, st.st_size - (1 << 20)))
            h.update(fh.read(1 << 20))
    return h.digest()


def disk_fingerprint(weights: bytes, layout: str, hash_key: bytes) -> bytes:
    """What a disk index must have been written under to be read back: the weights, the KV layout
    (dtype, block size, per-block shape, backend) and the hash key (as a digest: the index file never
    holds the key)."""
    key_digest = hashlib.sha256(b"nanoserve hash key\0" + hash_key).digest()
    return hashlib.sha256(KV_FORMAT + weights + layout.encode() + key_digest).digest()


class DiskTier:
    def __init__(self, store: DiskStore, host: HostTier, fingerprint: bytes, hash_key: bytes) -> None:
        """`hash_key`: the chain-digest key kept with the store (the prefix cache hashes with it)."""
        self.store, self.host, self.fingerprint, self.hash_key = store, host, fingerprint, hash_key
        self.pool = BlockPool(store.num_slots)
        self.checksums: list[bytes] = [b""] * store.num_slots
        self.writes: list[DiskCopy] = []
        self.reads: list[DiskCopy] = []
        self.writing: set[BlockHash] = set()
        self.reading: dict[BlockHash, BlockKey] = {}
        self.fetched: dict[int, int] = {}  # seq id -> blocks read from disk for it, not admitted yet
        # seq id -> host blocks read for it, published and kept pinned until it is admitted (or freed):
        # else the next saves to host could evict them (clean: on disk) before it is asked again
        self.staged: dict[int, list[int]] = {}
        self.stats = DiskStats()
        # told when a chain is stored on or dropped from disk, or read into host: the clean flags of its
        # blocks in the other tiers follow (copies.py owns them)
        self.on_change: Callable[[BlockHash], None] = lambda h: None
        self.pool.on_unpublish = self._dropped
        host.backed = True  # host clean = on disk: the host LRU evicts those first
        self.write_failures_in_row = 0
        self.degraded = False  # writes kept failing: no more are started (reads of what it holds go on)

    def _dropped(self, h: BlockHash, evicted: bool) -> None:
        self.stats.lossy_evictions += evicted and h not in self.host.pool.index
        self.on_change(h)

    def _take_slots(self, n: int) -> list[int]:
        """`n` slots for a write, pinned, as few runs as the free slots allow (large sequential writes);
        the disk LRU gives up its oldest when none is free."""
        slots = allocate_extents(self.pool, n, lossy_ok=True)
        self.pool.hold_allocated(slots)
        return slots

    # ---- writes -------------------------------------------------------------------------------------
    def write_back(self, host_ids: list[int]) -> int:
        """Write these host blocks' KV to disk, those published and not on disk (or being written) yet;
        marks clean the ones the disk already holds. Returns the blocks whose write started."""
        hp, todo = self.host.pool, []
        if self.degraded:
            return 0
        for hb in host_ids:
            h = hp.block_hash[hb]
            if h is None or hp.index.get(h) != hb or h in self.writing:
                continue
            if h in self.pool.index:
                self.on_change(h)
            else:
                todo.append(hb)
        todo = todo[:self.pool.num_available()]  # the rest stays host-only (dirty): slots are all in flight
        if not todo:
            return 0
        keys = [(hp.block_hash[hb], hp.block_key[hb]) for hb in todo]
        slots = self._take_slots(len(todo))
        for hb in todo:
            hp.pin(hb)
        try:
            io = self.store.write(self.host.cache, todo, slots, [h for h, _ in keys])
        except BaseException:
            self._release(todo, slots)
            raise
        self.writes.append(DiskCopy(io, todo, slots, keys))
        self.writing.update(h for h, _ in keys)
        return len(todo)

    def _release(self, host_ids: list[int], slots: list[int]) -> None:
        for hb in host_ids:
            self.host.pool.unpin(hb)
        for s in slots:
            self.pool.unpin(s)

    def _end_write(self, c: DiskCopy) -> None:
        self.writes.remove(c)
        for i, (slot, (h, key)) in enumerate(zip(c.slots, c.keys)):
            self.writing.discard(h)
            if c.io.ok[i] and self.pool.publish(slot, h, key):
                self.checksums[slot] = c.io.checksums[i]
                self.stats.blocks_written += 1
                self.on_change(h)
            self.stats.write_failures += not c.io.ok[i]
        self.stats.seconds_written += c.io.seconds
        self._release(c.host_ids, c.slots)
        self.write_failures_in_row = 0 if all(c.io.ok) else self.write_failures_in_row + 1
        if self.write_failures_in_row >= 3 and not self.degraded:
            self._degrade(c.io.error)

    def _degrade(self, error: BaseException | None) -> None:
        """Writes keep failing (a full or read-only disk): start none any more, and let the host keep its
        blocks as it does without a disk (clean = the device holds them), so saves from device are not
        deferred for writes that never land. What the disk holds is still read."""
        log.error("disk KV cache: writes to %s keep failing (%s); it takes no more blocks until restarted "
                  "(reads of what it holds go on)", self.store.directory, error or "short write")
        self.degraded, self.host.backed = True, False
        for h in list(self.host.pool.index):
            self.on_change(h)

    # ---- reads --------------------------------------------------------------------------------------
    def fetch(self, seq_id: int, hashes: list[BlockHash], keys: list[BlockKey], start: int,
              protect: list[int]) -> int:
        """Start reading the links from `start` on that are on disk (up to the first that is not) into
        host blocks, as many as the host has room for; `protect`: host blocks that allocation must not
        evict (the same request's host hits). Returns the links of that run it waits for: being read, or
        for room that other waiting requests hold (0: none, admit it now)."""
        hp, pending, todo = self.host.pool, 0, []
        for h, key in zip(hashes[start:], keys[start:]):
            if self.reading.get(h) == key:
                pending += 1
            elif (slot := self.pool.lookup(h, key)) is not None and h not in hp.index:
                todo.append((slot, h, key))
            else:
                break
        for hb in protect:
            hp.pin(hb)
        try:  # at most half the host held for waiting requests: saves from device keep their room
            held = self._held_for_requests()
            fits = max(0, min(self.host.room(), hp.num_blocks // 2 - sum(held.values())))
            # short of room while others hold theirs: wait for them to be admitted rather than read half of
            # it; one that holds some already never waits for room (two such would wait for each other)
            waits = max(0, len(todo) - fits) if sum(held.values()) and not held.get(seq_id) else 0
            todo = todo[:fits]
            host_ids = [hp.allocate_pinned(keep_clean=False) for _ in todo]
        finally:
            for hb in protect:
                hp.unpin(hb)
        if not todo:
            return pending + waits
        host_ids.sort()  # ascending host blocks in chain order: the later load to device is a few copies
        slots = [s for s, _, _ in todo]
        self.pool.pin_many(slots)
        try:
            io = self.store.read(self.host.cache, host_ids, slots, [h for _, h, _ in todo],
                                 [self.checksums[s] for s in slots])
        except BaseException:
            self._release(host_ids, slots)
            raise
        self.reads.append(DiskCopy(io, host_ids, slots, [(h, k) for _, h, k in todo], seq_id))
        self.reading.update((h, k) for _, h, k in todo)
        self.fetched[seq_id] = self.fetched.get(seq_id, 0) + len(todo)
        return pending + len(todo) + waits

    def _held_for_requests(self) -> dict[int, int]:
        """Host blocks per waiting request: read for it (staged) or being read."""
        held = {sid: len(blocks) for sid, blocks in self.staged.items()}
        for c in self.reads:
            held[c.seq_id] = held.get(c.seq_id, 0) + len(c.host_ids)
        return held

    def _end_read(self, c: DiskCopy) -> None:
        self.reads.remove(c)
        hp, kept = self.host.pool, []
        for i, (hb, slot, (h, key)) in enumerate(zip(c.host_ids, c.slots, c.keys)):
            del self.reading[h]
            if not c.io.ok[i]:
                self.pool.unpublish(slot)  # never trusted again; the request recomputes it
                self.stats.read_failures += 1
                if c.seq_id in self.fetched:
                    self.fetched[c.seq_id] -= 1  # not a hit
            elif hp.publish(hb, h, key, clean=True):
                self.stats.blocks_read += 1
                kept.append(hb)
                self.on_change(h)
        self.stats.seconds_read += c.io.seconds
        if c.seq_id < 0:  # its request is gone: the blocks are the host LRU's at once
            kept = []
        elif kept:
            self.staged.setdefault(c.seq_id, []).extend(kept)
        held = set(kept)
        self._release([hb for hb in c.host_ids if hb not in held], c.slots)

    def forget(self, seq_id: int) -> int:
        """The request was admitted (its loads pin what they copy) or is gone: its staged blocks go back to
        the host LRU, and a read still in flight for it publishes its blocks without holding them. Returns
        the blocks read and verified for it (its first admission counts them as disk hits)."""
        for hb in self.staged.pop(seq_id, ()):
            self.host.pool.unpin(hb)
        for c in self.reads:
            if c.seq_id == seq_id:
                c.seq_id = -1
        return self.fetched.pop(seq_id, 0)

    # ---- ending copies ----------------------------------------------------------------------------
    def poll(self) -> None:
        """End every read and write that is done (never blocks)."""
        for c in [c for c in self.reads if c.io.done()]:
            self._end_read(c)
        for c in [c for c in self.writes if c.io.done()]:
            self._end_write(c)

    def drain(self) -> None:
        self.store.drain()
        self.poll()

    # ---- restart ---------------------------------------------------------------------------------
    def restore(self) -> int:
        """Read the index a previous run saved (if its fingerprint matches): its blocks are cached on disk."""
        for e in self.store.load_index(self.fingerprint) or ():
            if self.pool.restore(e.slot, e.chain, BlockKey.of(e.parent, e.tokens)):
                self.checksums[e.slot] = e.checksum
                self.stats.restored += 1
        if self.stats.restored:
            log.info("disk KV cache: %d blocks from %s", self.stats.restored, self.store.directory)
        return self.stats.restored

    def persist(self) -> int:
        """Write every host block not on disk yet, wait for all writes, save the index (oldest first).
        Shutdown only: it blocks. Returns the blocks the index holds."""
        hp = self.host.pool
        self.write_back([b for b in range(hp.num_blocks) if hp.block_hash[b] is not None])
        self.drain()
        entries = [IndexEntry(s, self.pool.block_hash[s], self.pool.block_key[s].parent,
                              self.pool.block_key[s].token_ids, self.checksums[s]) for s in self.pool.lru()]
        self.store.save_index(entries, self.fingerprint)
        log.info("disk KV cache: %d blocks saved in %s", len(entries), self.store.directory)
        return len(entries)

    def close(self) -> None:
        """After the last write: stop the store's threads (before the host pool they read is released)."""
        self.drain()
        self.store.close()

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        held = [s for c in self.reads + self.writes for s in c.slots]
        assert sorted(held) == sorted(s for s in range(self.pool.num_blocks) if self.pool.pins[s]), (
            "disk slot pinned without a copy in flight (or the reverse)")
        assert not any(self.pool.is_clean), "disk blocks are never clean (the last level)"
        assert not any(self.pool.ref_count), "disk slots are held by copies (pins), never referenced"
