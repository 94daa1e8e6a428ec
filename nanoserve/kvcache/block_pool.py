"""Block bookkeeping for one KV tier: ref counts, a hash index of full blocks, an LRU of free
cached blocks. Pure Python, no tensors: the tensors live with the runner (device) or the host tier.

Block keys: `chain_hash` is a keyed cryptographic digest (blake2b) of the parent block's digest and
this block's token ids, so a digest names a whole prefix and cannot be forged or predicted by a
client (the key is a per-process random salt). A lookup also compares the stored `BlockKey`
(parent digest + tokens): a hit is a verified chain link, never a digest match alone.

Every block is in exactly one state:
  in use      ref_count > 0
  in flight   ref_count == 0 but pinned by a tier copy that reads or writes it: in `held`, not
              reusable until the copy completes (a published one stays findable meanwhile)
  cached-free ref_count == 0, hash published, unpinned: findable until it is reused; in `clean`
              if another tier also holds its KV (evicting it loses nothing), else in `dirty`
  free        ref_count == 0, no hash, in `free`
Sequences hold references; copies hold pins. A block can be both referenced and pinned.

`allocate` takes a free block, else the least recently used clean one, and a dirty one (dropping
KV that exists nowhere else: a lossy eviction, counted) only when the caller allows it. Both are
O(1): pinned blocks are never in the two LRUs. A load's destinations come from extents.py instead:
the free blocks as the fewest runs, and the evictions `allocate` would make.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass
from collections.abc import Callable
from itertools import chain, compress, repeat
from operator import not_
from typing import NamedTuple, Protocol

import numpy as np

BlockHash = bytes


class BlockKey(NamedTuple):
    """What a cached block's KV is a function of: the prefix before it (as its digest) and its tokens."""
    parent: BlockHash | None
    tokens: tuple[int, ...]


def chain_hash(parent: BlockHash | None, tokens: tuple[int, ...], salt: bytes = b"") -> BlockHash:
    h = hashlib.blake2b(digest_size=32, key=salt[:64])
    h.update(parent if parent is not None else b"\0" * 32)
    h.update(array("q", tokens).tobytes())
    return h.digest()


class EventSink(Protocol):
    """Told what a tier stores and drops (kvcache/events.py's log, for routers)."""
    def stored(self, h: BlockHash, key: BlockKey, medium: str) -> None: ...
    def removed(self, h: BlockHash, medium: str) -> None: ...


@dataclass
class PoolStats:
    total: int
    in_use: int
    cached_free: int
    free: int
    in_flight: int = 0  # unreferenced, but pinned by a copy
    clean: int = 0      # of cached_free: also held by another tier


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_count = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.block_key: list[BlockKey | None] = [None] * num_blocks
        self.is_clean = [False] * num_blocks  # published, and its KV is also in another tier
        self.index: dict[BlockHash, int] = {}
        self.clean: OrderedDict[int, None] = OrderedDict()  # cached-free, unpinned, clean; oldest first
        self.dirty: OrderedDict[int, None] = OrderedDict()  # cached-free, unpinned, dirty; oldest first
        # never-cached blocks, a stack: the most recently released is reused first (its memory is warm: on
        # CPU the KV cache's pages are only resident once written, and a queue would fault in a fresh
        # page run after run until the whole pool had been touched, ~10% of a prefill's time); a dict
        # (insertion order, popitem takes the last) so that a load can take blocks from anywhere in it
        self.free: dict[int, None] = dict.fromkeys(range(num_blocks - 1, -1, -1))
        self.free_map = bytearray(b"\1" * num_blocks)  # 1 where free: the runs a load is cut from
        self.pins = [0] * num_blocks
        # unreferenced and pinned (a count: a load pins thousands at once; `held` lists them)
        self.num_held = 0
        self.num_evictions = 0        # cached blocks reused, clean or not
        self.num_lossy_evictions = 0  # dirty ones: their KV was dropped
        # called with (hash, evicted) when a block stops being findable: another tier's clean marks
        self.on_unpublish: Callable[[BlockHash, bool], None] | None = None
        # (the engine's KV event log, this tier's medium): routers told what the tier holds (events.py)
        self.events: tuple[EventSink, str] | None = None

    def num_available(self, lossless: bool = False) -> int:
        """Blocks `allocate` can hand out now (with `lossless`: without dropping KV)."""
        return len(self.free) + len(self.clean) + (0 if lossless else len(self.dirty))

    def is_cached_free(self, block: int) -> bool:
        return block in self.clean or block in self.dirty

    def lru(self) -> list[int]:
        """Cached-free blocks, oldest first within each LRU (clean ones first: evicted first)."""
        return [*self.clean, *self.dirty]

    def lookup(self, h: BlockHash, key: BlockKey) -> int | None:
        """The cached block published under digest `h` with exactly this parent and tokens."""
        block = self.index.get(h)
        if block is None or self.block_key[block] != key:
            return None
        return block

    def _unpark(self, block: int) -> None:
        """Take an unreferenced block out of whichever list holds it."""
        if self.pins[block]:
            self.num_held -= 1
        else:
            (self.clean if self.is_clean[block] else self.dirty).pop(block)

    def acquire(self, block: int) -> None:
        if self.ref_count[block] == 0:
            self._unpark(block)
        self.ref_count[block] += 1

    def allocate(self, lossy_ok: bool = True, keep_clean: bool = False) -> int:
        """A block with ref count 1: a never-cached one first (the last released), else the least recently
        used clean one, else (only if `lossy_ok`) the least recently used dirty one. No pinned block is a
        candidate. `keep_clean` (the host tier taking a save): never a clean block, since evicting
        one only moves the lack of a copy to its twin in the other tier."""
        if self.free:
            block, _ = self.free.popitem()
            self.free_map[block] = 0
        else:
            lru = self.dirty if keep_clean else self.clean or (self.dirty if lossy_ok else None)
            if not lru:
                raise RuntimeError("BlockPool exhausted: the caller must check num_available() first")
            block, _ = lru.popitem(last=False)
            self.num_evictions += 1
            self.num_lossy_evictions += lru is self.dirty
            self._unpublish(block, evicted=True)
        self.ref_count[block] = 1
        return block

    def release(self, block: int) -> None:
        assert self.ref_count[block] > 0, f"double free of block {block}"
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            self._park(block)

    def _park(self, block: int) -> None:
        """An unreferenced block goes where its state says (a cached one as most recently used)."""
        if self.pins[block]:
            self.num_held += 1
        elif self.block_hash[block] is not None:
            (self.clean if self.is_clean[block] else self.dirty)[block] = None
        else:
            self.free[block] = None
            self.free_map[block] = 1

    def pin(self, block: int) -> None:
        """Hold a block for a copy: it cannot be reused (evicted or allocated) until unpinned."""
        if self.ref_count[block] == 0 and not self.pins[block]:
            assert self.is_cached_free(block), f"pinning block {block}, which is free (nothing to copy)"
            self._unpark(block)
            self.num_held += 1
        self.pins[block] += 1

    def pin_many(self, blocks: list[int], spans: list[tuple[int, int]] | None = None) -> None:
        """`pin` each of `blocks` (distinct), in a few passes when none is pinned yet (a load's blocks:
        its sources cached-free on host, its destinations just allocated), else one by one. `spans`:
        the blocks as runs [start, stop), in order, if the caller knows them."""
        if pin_fresh(self, blocks, spans):
            return
        done: list[int] = []
        try:
            for b in blocks:
                self.pin(b)
                done.append(b)
        except BaseException:
            for b in done:
                self.unpin(b)
            raise

    def unpin(self, block: int) -> None:
        """End a copy's hold; an unreferenced cached block rejoins its LRU as most recently used
        (a copy just used it)."""
        assert self.pins[block] > 0, f"unpin of unpinned block {block}"
        self.pins[block] -= 1
        if self.ref_count[block] == 0 and not self.pins[block]:
            self.num_held -= 1
            self._park(block)

    def mark_clean(self, block: int, clean: bool) -> None:
        """Record whether another tier holds this published block's KV too (keeps its LRU place)."""
        if self.block_hash[block] is None or self.is_clean[block] == clean:
            return
        src, dst = (self.dirty, self.clean) if clean else (self.clean, self.dirty)
        self.is_clean[block] = clean
        if block in src:
            del src[block]
            dst[block] = None

    def touch(self, block: int) -> None:
        """Mark a cached-free block most recently used."""
        for lru in (self.clean, self.dirty):
            if block in lru:
                lru.move_to_end(block)

    def allocate_pinned(self, keep_clean: bool = False) -> int:
        """A block for a copy to write: pinned, unreferenced, unpublished (the caller publishes it
        once the copy is complete)."""
        block = self.allocate(lossy_ok=True, keep_clean=keep_clean)
        self.hold_allocated([block])
        return block

    def hold_allocated(self, blocks: list[int]) -> None:
        """Blocks just allocated (ref count 1) become held by a copy instead: pinned, unreferenced."""
        for b in blocks:
            self.ref_count[b], self.pins[b] = 0, 1
        self.num_held += len(blocks)

    def publish(self, block: int, h: BlockHash, key: BlockKey, clean: bool = False) -> bool:
        """Make a written, full block findable. False if an equal block is already indexed
        (the duplicate then stays private and returns to the free list when released)."""
        if h in self.index or self.block_hash[block] is not None:
            return False
        self.index[h] = block
        self.block_hash[block] = h
        self.block_key[block] = key
        self.is_clean[block] = clean
        if self.events is not None:
            self.events[0].stored(h, key, self.events[1])
        return True

    def restore(self, block: int, h: BlockHash, key: BlockKey) -> bool:
        """Publish free `block` as cached-free, most recently used (a tier's index read back at start)."""
        if block not in self.free or h in self.index:
            return False
        del self.free[block]
        self.free_map[block] = 0
        self.publish(block, h, key)
        self._park(block)
        return True

    def unpublish(self, block: int) -> None:
        """Stop a block being findable (its content is not trusted)."""
        cached_free = self.is_cached_free(block)
        if cached_free:
            self._unpark(block)
        self._unpublish(block, evicted=False)
        if cached_free:
            self._park(block)

    def _unpublish(self, block: int, evicted: bool) -> None:
        h = self.block_hash[block]
        if h is not None and self.index.get(h) == block:
            del self.index[h]
            if self.events is not None:
                self.events[0].removed(h, self.events[1])
            if self.on_unpublish is not None:
                self.on_unpublish(h, evicted)
        self.block_hash[block] = None
        self.block_key[block] = None
        self.is_clean[block] = False

    def stats(self) -> PoolStats:
        in_use = sum(1 for r in self.ref_count if r > 0)
        return PoolStats(self.num_blocks, in_use, len(self.clean) + len(self.dirty), len(self.free),
                         self.num_held, len(self.clean))

    @property
    def held(self) -> set[int]:
        """Unreferenced pinned blocks (not reusable until their copies end)."""
        return {b for b, p in enumerate(self.pins) if p and not self.ref_count[b]}

    def check_invariants(self) -> None:
        held = self.held
        assert len(held) == self.num_held, f"held count {self.num_held} != {len(held)} held blocks"
        in_use = [b for b, r in enumerate(self.ref_count) if r > 0]
        lru = set(self.clean) | set(self.dirty)
        assert all(r >= 0 for r in self.ref_count), "negative ref count"
        assert all(p >= 0 for p in self.pins), "negative pin count"
        assert len(in_use) + len(lru) + len(self.free) + len(held) == self.num_blocks, (
            f"block accounting: {len(in_use)} in use + {len(lru)} cached-free + "
            f"{len(self.free)} free + {len(held)} held != {self.num_blocks}")
        assert not set(self.clean) & set(self.dirty), "block both clean and dirty"
        assert not set(in_use) & (lru | set(self.free) | held), "in-use block on a free list"
        assert not lru & set(self.free), "block both cached-free and free"
        assert not held & (lru | set(self.free)), "held block on a free list"
        assert all(self.pins[b] > 0 for b in held), "unpinned held block"
        assert not any(self.pins[b] for b in lru | set(self.free)), "pinned block on a free list"
        assert all(self.block_hash[b] is not None for b in lru), "unhashed block in the LRU"
        assert all(self.is_clean[b] for b in self.clean) and not any(self.is_clean[b] for b in self.dirty), (
            "block in the wrong LRU")
        assert not any(self.is_clean[b] for b in range(self.num_blocks) if self.block_hash[b] is None), (
            "unpublished block marked clean")
        assert all(self.block_hash[b] is None for b in self.free), "hashed block on the free list"
        assert [b for b in range(self.num_blocks) if self.free_map[b]] == sorted(self.free), \
            "free map is stale"
        for h, b in self.index.items():
            assert self.block_hash[b] == h, f"index points at block {b} whose hash changed"


def spans_of(blocks: list[int], most: int) -> list[tuple[int, int]] | None:
    """`blocks` as the maximal runs of consecutive ascending ids, [start, stop) in list order; None if
    there are more than `most`."""
    a = np.array(blocks, dtype=np.int64)
    cuts = ((a[1:] - a[:-1]) != 1).nonzero()[0]
    if len(cuts) >= most:
        return None
    bounds = [0, *(cuts + 1).tolist(), len(blocks)]
    return [(blocks[lo], blocks[hi - 1] + 1) for lo, hi in zip(bounds[:-1], bounds[1:])]


def pin_fresh(pool: BlockPool, blocks: list[int], spans: list[tuple[int, int]] | None = None) -> bool:
    """`pool.pin_many` when no block is pinned yet (else False, nothing done). A load's blocks are mostly
    a few runs of consecutive ids (extents.py, copies.chain_order): then each pass is per run, on list
    slices, and only taking unreferenced blocks out of their LRU is per block."""
    if not blocks:
        return True
    spans = spans or spans_of(blocks, len(blocks) // 8 + 1)
    if spans is None:  # scattered: per-run slices would cost more than per-block passes
        return _pin_scattered(pool, blocks)
    pins, refs = pool.pins, pool.ref_count
    if any(any(pins[s:e]) for s, e in spans):
        return False
    # the unreferenced ones, as whole runs where a run is (clean/dirty flags then come as slices too)
    unref: list[range | list[int]] = []
    for s, e in spans:
        r = refs[s:e]
        if not any(r):
            unref.append(range(s, e))
        elif not all(r):
            unref.append(list(compress(range(s, e), map(not_, r))))
    flags: list[bool] = []
    for part in unref:
        flags += (pool.is_clean[part.start:part.stop] if isinstance(part, range)
                  else map(pool.is_clean.__getitem__, part))
    # unreferenced and unpinned: in an LRU unless free (the invariants), so this is `pin`'s assertion
    assert not any(pool.free_map.find(1, p.start, p.stop) >= 0 if isinstance(p, range)
                   else any(map(pool.free_map.__getitem__, p)) for p in unref), (
        "pinning a free block (nothing to copy)")
    _unpark_all(pool, list(chain.from_iterable(unref)) if len(unref) != 1 else unref[0], flags)
    for s, e in spans:
        pins[s:e] = [1] * (e - s)
    return True


def _pin_scattered(pool: BlockPool, blocks: list[int]) -> bool:
    """`pin_fresh` over blocks in no particular order: a few whole-list passes."""
    pins, refs = pool.pins, pool.ref_count
    if any(map(pins.__getitem__, blocks)):
        return False
    unref = (list(compress(blocks, map((0).__eq__, map(refs.__getitem__, blocks))))
             if any(map(refs.__getitem__, blocks)) else blocks)
    assert not any(map(pool.free_map.__getitem__, unref)), "pinning a free block (nothing to copy)"
    _unpark_all(pool, unref, list(map(pool.is_clean.__getitem__, unref)))
    deque(map(pins.__setitem__, blocks, repeat(1)), maxlen=0)
    return True


def _unpark_all(pool: BlockPool, unref, flags: list[bool]) -> None:
    """Take unreferenced, unpinned, cached-free blocks (`flags`: their clean flags) out of their LRUs:
    they are held now."""
    clean = unref if all(flags) else list(compress(unref, flags)) if any(flags) else ()
    dirty = () if clean is unref else unref if not clean else list(compress(unref, map(not_, flags)))
    deque(map(pool.clean.pop, clean), maxlen=0)
    deque(map(pool.dirty.pop, dirty), maxlen=0)
    pool.num_held += len(unref)
