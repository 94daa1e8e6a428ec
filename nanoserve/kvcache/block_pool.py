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
the free blocks as the fewest runs, and the evictions `allocate` would make. The three lists
(block_lists.py) let a load take its blocks out of them a run at a time, not a block at a time.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import deque
from dataclasses import dataclass
from collections.abc import Callable, Collection, Iterable
from itertools import repeat
from typing import NamedTuple, Protocol

import numpy as np

from nanoserve.kvcache.block_lists import CLEAN, DIRTY, FREE, NONE, BlockList
from nanoserve.kvcache.native import KVKernels

BlockHash = bytes
Span = tuple[int, int]  # blocks [start, stop)


class BlockKey(NamedTuple):
    """What a cached block's KV is a function of: the prefix before it (as its digest) and its tokens, as
    int64 in native byte order (one bytes object: compared with one memcmp, a fifth of a tuple's memory)."""
    parent: BlockHash | None
    tokens: bytes

    @classmethod
    def of(cls, parent: BlockHash | None, token_ids: Iterable[int]) -> BlockKey:
        return cls(parent, array("q", token_ids).tobytes())

    @property
    def token_ids(self) -> tuple[int, ...]:
        return tuple(array("q", self.tokens))


def chain_hash(parent: BlockHash | None, tokens: bytes | Iterable[int], salt: bytes = b"") -> BlockHash:
    """The keyed digest of a block: its parent's digest and its tokens (BlockKey.tokens, or the ids)."""
    h = hashlib.blake2b(digest_size=32, key=salt[:64])
    h.update(parent if parent is not None else b"\0" * 32)
    h.update(tokens if isinstance(tokens, bytes) else array("q", tokens).tobytes())
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
    def __init__(self, num_blocks: int, kernels: KVKernels = KVKernels()) -> None:
        self.num_blocks = num_blocks
        self.kernels = kernels  # the C++ bookkeeping kernels where built (native.py): matching, extents
        self.ref_count = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.block_key: list[BlockKey | None] = [None] * num_blocks
        self.is_clean = [False] * num_blocks  # published, and its KV is also in another tier
        self.index: dict[BlockHash, int] = {}
        self.where = bytearray(num_blocks)  # which list holds each block (block_lists.py)
        self.clean = BlockList(self.where, CLEAN)  # cached-free, unpinned, clean; oldest first
        self.dirty = BlockList(self.where, DIRTY)  # cached-free, unpinned, dirty; oldest first
        # never-cached blocks, used as a stack: the most recently released is reused first (its memory is
        # warm: on CPU the KV cache's pages are only resident once written, and a queue would fault in a
        # fresh page run after run until the whole pool had been touched, ~10% of a prefill's time)
        self.free = BlockList(self.where, FREE, range(num_blocks - 1, -1, -1))
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
        return self.where[block] >= CLEAN

    def count_cached_free(self, blocks: Collection[int]) -> tuple[int, int]:
        """How many of `blocks` are in the clean LRU, and in the dirty one."""
        codes = bytes(map(self.where.__getitem__, blocks))
        return codes.count(CLEAN), codes.count(DIRTY)

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
            (self.clean if self.is_clean[block] else self.dirty).remove(block)

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
            block = self.free.pop(oldest=False)
        else:
            lru = self.dirty if keep_clean else self.clean or (self.dirty if lossy_ok else None)
            if not lru:
                raise RuntimeError("BlockPool exhausted: the caller must check num_available() first")
            block = lru.pop(oldest=True)
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
            (self.clean if self.is_clean[block] else self.dirty).add(block)
        else:
            self.free.add(block)

    def pin(self, block: int) -> None:
        """Hold a block for a copy: it cannot be reused (evicted or allocated) until unpinned."""
        if self.ref_count[block] == 0 and not self.pins[block]:
            assert self.is_cached_free(block), f"pinning block {block}, which is free (nothing to copy)"
            self._unpark(block)
            self.num_held += 1
        self.pins[block] += 1

    def pin_many(self, blocks: list[int], spans: list[Span] | None = None) -> list[Span] | None:
        """`pin` each of `blocks` (distinct), in a few passes when none is pinned yet (a load's blocks:
        its sources cached-free on host, its destinations just allocated), else one by one. `spans`:
        the blocks as runs [start, stop), in order, if the caller knows them. Returns those runs (found
        here if not given; None when the blocks are scattered), for the copies to use too."""
        if spans is None and blocks:
            spans = spans_of(blocks, most_spans(len(blocks)))
        if not pin_fresh(self, blocks, spans):
            _pin_one_by_one(self, blocks)
        return spans

    def unpin(self, block: int) -> None:
        """End a copy's hold; an unreferenced cached block rejoins its LRU as most recently used
        (a copy just used it)."""
        assert self.pins[block] > 0, f"unpin of unpinned block {block}"
        self.pins[block] -= 1
        if self.ref_count[block] == 0 and not self.pins[block]:
            self.num_held -= 1
            self._park(block)

    def mark_clean(self, block: int, clean: bool) -> None:
        """Record whether another tier holds this published block's KV too (a cached-free one moves to
        the other LRU, as its newest)."""
        if self.block_hash[block] is None or self.is_clean[block] == clean:
            return
        src, dst = (self.dirty, self.clean) if clean else (self.clean, self.dirty)
        self.is_clean[block] = clean
        if block in src:
            src.remove(block)
            dst.add(block)

    def touch(self, block: int) -> None:
        """Mark a cached-free block most recently used."""
        if self.where[block] >= CLEAN:
            (self.clean if self.where[block] == CLEAN else self.dirty).move_to_end(block)

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
        self.free.remove(block)
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
        for lst in (self.free, self.clean, self.dirty):
            live = list(lst)
            assert len(live) == len(set(live)) == len(lst), "a block list's count is stale"
            assert self.where.count(lst.code) == len(lst), "a block list disagrees with `where`"
        for h, b in self.index.items():
            assert self.block_hash[b] == h, f"index points at block {b} whose hash changed"
        # the converse (chain_runs.stored_runs matches by block_key alone): a block has a digest and a key
        # exactly when the index holds it
        assert sum(h is not None for h in self.block_hash) == len(self.index), "a digest outside the index"
        assert all((k is None) == (h is None) for k, h in zip(self.block_key, self.block_hash)), (
            "a key without a digest")


def most_spans(num_blocks: int) -> int:
    """The most runs that blocks are handled as (a slice per run) before per-block passes cost less."""
    return num_blocks // 8 + 1


def spans_of(blocks: list[int], most: int) -> list[Span] | None:
    """`blocks` as the maximal runs of consecutive ascending ids, [start, stop) in list order; None if
    there are more than `most`."""
    a = np.array(blocks, dtype=np.int64)
    cuts = ((a[1:] - a[:-1]) != 1).nonzero()[0]
    if len(cuts) >= most:
        return None
    bounds = [0, *(cuts + 1).tolist(), len(blocks)]
    return [(blocks[lo], blocks[hi - 1] + 1) for lo, hi in zip(bounds[:-1], bounds[1:])]


def pin_fresh(pool: BlockPool, blocks: list[int], spans: list[Span] | None) -> bool:
    """`pool.pin_many` when no block is pinned yet (else False, nothing done). A load's blocks are mostly
    a few runs of consecutive ids (`spans`; extents.py, copies.chain_order): then each pass is a slice per
    run, and the unreferenced blocks leave their LRU through `where` (block_lists.py), a slice per run too."""
    if not blocks:
        return True
    if spans is None:  # scattered: per-run slices would cost more than per-block passes
        return _pin_scattered(pool, blocks)
    pins, where = pool.pins, pool.where
    if any(any(pins[s:e]) for s, e in spans):
        return False
    # unreferenced and unpinned: in an LRU unless free (the invariants), so this is `pin`'s assertion
    assert not any(where.count(FREE, s, e) for s, e in spans), "pinning a free block (nothing to copy)"
    clean = dirty = 0
    for s, e in spans:
        clean += where.count(CLEAN, s, e)
        dirty += where.count(DIRTY, s, e)
        where[s:e] = bytes(e - s)  # (the referenced ones are on no list already)
        pins[s:e] = [1] * (e - s)
    _unparked(pool, clean, dirty)
    return True


def pin_taken(pool: BlockPool, blocks: list[int], spans: list[Span] | None) -> None:
    """`pool.pin_many(blocks)`; given as runs (`spans`), blocks extents.allocate_spans just took: in use, on
    no list, pinned by nothing, so a slice per run with nothing to move or check (check_invariants is)."""
    if spans is None:
        pool.pin_many(blocks)
        return
    for s, e in spans:
        pool.pins[s:e] = [1] * (e - s)


def _pin_scattered(pool: BlockPool, blocks: list[int]) -> bool:
    """`pin_fresh` over blocks in no particular order: a few whole-list passes."""
    pins, where = pool.pins, pool.where
    if any(map(pins.__getitem__, blocks)):
        return False
    codes = bytes(map(where.__getitem__, blocks))
    assert FREE not in codes, "pinning a free block (nothing to copy)"
    deque(map(where.__setitem__, blocks, repeat(NONE)), maxlen=0)
    deque(map(pins.__setitem__, blocks, repeat(1)), maxlen=0)
    _unparked(pool, codes.count(CLEAN), codes.count(DIRTY))
    return True


def _pin_one_by_one(pool: BlockPool, blocks: list[int]) -> None:
    """`pool.pin_many` when some block is pinned already: all or none."""
    done: list[int] = []
    try:
        for b in blocks:
            pool.pin(b)
            done.append(b)
    except BaseException:
        for b in done:
            pool.unpin(b)
        raise


def _unparked(pool: BlockPool, clean: int, dirty: int) -> None:
    """That many blocks left the clean and dirty LRUs through `where`: they are held now."""
    pool.clean.dropped(clean)
    pool.dirty.dropped(dirty)
    pool.num_held += clean + dirty
