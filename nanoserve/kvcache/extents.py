"""Free blocks as extents: which runs of consecutive free blocks a load's destinations are cut from.

A load copies a chain of host blocks into device blocks; each run consecutive on both sides is one
copy. Ordinary allocation takes the most recently released free block (warm memory, block_pool.py),
which scatters a load over the pool: 2,048 blocks placed among 4,096 free ones made ~1,100 copies.
A load instead takes whole free runs, longest first, and the rest of its blocks from the smallest
run that holds them (best fit): the fewest runs any choice of free blocks can make, and the long
runs that are left stay long.

Only free blocks are chosen this way. Cached-free blocks are never evicted to join two runs: a load
evicts exactly the blocks (and as many) that per-block allocation would, so the device prefix cache
loses nothing to contiguity; when free space is scattered, the load is as many copies as it has runs.
"""
from __future__ import annotations

import numpy as np

from nanoserve.kvcache.block_lists import FREE
from nanoserve.kvcache.block_pool import BlockPool, Span

Extent = tuple[int, int]  # (first block, number of blocks)


_IS_FREE = bytes.maketrans(bytes(range(256)), bytes(int(i == FREE) for i in range(256)))


def free_runs(where: bytearray) -> tuple[np.ndarray, np.ndarray]:
    """(starts, lengths) of the maximal runs of free blocks (`where[b]` is FREE when b is free). Few array
    operations, none of numpy's Python-level wrappers (diff, flatnonzero): on the step path, once per
    load, each numpy call costs ~5-10 us on a cold cache, more than the arrays' work."""
    free = np.frombuffer(b"\0" + where.translate(_IS_FREE) + b"\0", np.int8)  # padded: runs start and end
    edges = (free[1:] != free[:-1]).nonzero()[0]  # alternately a run's start and its end
    starts = edges[::2]
    return starts, edges[1::2] - starts


def choose_extents(starts: np.ndarray, lengths: np.ndarray, n: int) -> list[Extent]:
    """At most `n` blocks (all of them if fewer are free) as the fewest extents: the longest runs whole,
    then the rest from the start of the smallest run that holds it. Ascending by first block."""
    if n <= 0 or not len(starts):
        return []
    order = (-lengths).argsort(kind="stable")
    longest = lengths[order]
    cum = longest.cumsum()
    whole = int(cum.searchsorted(n))  # runs taken whole: the first `whole` of `order`
    chosen = list(zip(starts[order[:whole]].tolist(), longest[:whole].tolist()))
    rest = n - (int(cum[whole - 1]) if whole else 0)
    if whole < len(order) and rest > 0:
        # every run from `whole` on is no longer than order[whole], which holds `rest`: the last
        # of them that holds it is the smallest that does
        fits = whole + int(np.count_nonzero(longest[whole:] >= rest)) - 1
        chosen.append((int(starts[order[fits]]), rest))
    chosen.sort()
    return chosen


def extent_blocks(extents: list[Extent]) -> list[int]:
    blocks: list[int] = []
    for s, n in extents:
        blocks += range(s, s + n)
    return blocks


def allocate_extents(pool: BlockPool, n: int, lossy_ok: bool = True) -> list[int]:
    """`n` blocks of `pool` with ref count 1, ascending: its free ones as the fewest runs, then the
    cached ones `pool.allocate` would evict, as many as it would. All or nothing."""
    return allocate_spans(pool, n, lossy_ok)[0]


def allocate_spans(pool: BlockPool, n: int, lossy_ok: bool = True) -> tuple[list[int], list[Span] | None]:
    """`allocate_extents`, and its blocks as runs [start, stop) when they are whole extents (no eviction):
    pinning the blocks then goes run by run without finding the runs again (block_pool.pin_taken).
    The pool's C++ kernel chooses the same extents, where built (native.py). (Taking them is a few slices
    per extent: a C++ take, tried, read 0.015 ms slower in an admission, its per-item list writes against
    the slices' bulk ones.)"""
    if n > pool.num_available(lossless=not lossy_ok):
        raise RuntimeError("BlockPool exhausted: the caller must check num_available() first")
    k = min(n, len(pool.free))
    kernels = pool.kernels
    extents = (kernels.free_extents(pool.where, FREE, k) if kernels.free_extents is not None
               else choose_extents(*free_runs(pool.where), k))
    spans = [(s, s + k) for s, k in extents]
    blocks = extent_blocks(extents)
    for s, e in spans:  # free runs become blocks in use, a slice per run
        assert pool.where.count(FREE, s, e) == e - s, "taking a block that is not free"
        pool.where[s:e] = bytes(e - s)
        pool.ref_count[s:e] = [1] * (e - s)
    pool.free.dropped(len(blocks))
    if len(blocks) < n:  # every free block is taken: the rest are LRU evictions, as ever
        return sorted(blocks + [pool.allocate(lossy_ok) for _ in range(n - len(blocks))]), None
    return blocks, spans
