"""Matching a chain against a tier a run at a time, and making a new prompt's chain share the objects a
tier already stores for it.

A tier that stores a chain in consecutive blocks (the host: saves land in chain order, copies.chain_order)
holds its keys side by side in `pool.block_key`. So after one index lookup, the rest of a run is found
by comparing a slice of `block_key` with a slice of the prompt's keys: a block holding a link's key
(parent digest and tokens) is published under that link's digest, which the key determines (a pool sets
a block's key only when it publishes the block: block_pool.publish), so `block_key[b] == key` means
what `pool.lookup(h, key) == b` means, the verified lookup. A 2,048-link prefix in a few runs is a few
lookups and list comparisons, verified as found, and comes with its runs, which the load's pins and
copies use as they are.

Those comparisons are by identity first: `canonical`,
run where a request arrives (the engine core's intake thread), swaps a prompt's digests and keys for
the equal objects a tier holds. An object swapped is equal by value, so a match is the same either
way; one whose block was evicted meanwhile is compared by value, as any other.
"""
from __future__ import annotations

from nanoserve.kvcache.block_pool import BlockHash, BlockKey, BlockPool, Span, most_spans


def stored_runs(pool: BlockPool, hashes: list[BlockHash], keys: list[BlockKey],
                start: int) -> tuple[list[int], list[Span] | None]:
    """The blocks `pool.lookup` finds for links `start`, `start + 1`, ... of the chain (`hashes`, `keys`),
    up to the first link it does not, and those blocks as runs of consecutive ids; None for the runs
    when they are short (a host tier that had to scatter the chain): a run costs ~3 us of slices and
    comparisons, a lookup ~30 ns, so past a few runs shorter than 128 on average the rest is looked up
    link by link. The pool's C++ kernel, where built, finds the same runs with no list slice (native.py): a
    slice increfs each key it copies, thousands of objects another request left cold."""
    if pool.kernels.stored_runs is not None:
        spans = pool.kernels.stored_runs(pool.index, pool.block_key, hashes, keys, start)
        found: list[int] = []
        for s, e in spans:
            found += range(s, e)
        return found, spans if len(spans) <= most_spans(len(found)) else None
    index, stored, n = pool.index, pool.block_key, len(hashes)
    blocks: list[int] = []
    spans: list[Span] = []
    i = start
    while i < n and (b := index.get(hashes[i])) is not None and stored[b] == keys[i]:
        if len(spans) >= 4 and i - start < 128 * len(spans):  # runs shorter than 128 on average
            rest = list(map(index.get, hashes[i:]))
            rest = rest[:rest.index(None)] if None in rest else rest
            found = list(map(stored.__getitem__, rest))
            if found != keys[i:i + len(found)]:  # a digest whose key differs: a miss there
                rest = rest[:next(j for j, (got, key) in enumerate(zip(found, keys[i:])) if got != key)]
            return blocks + rest, None
        k = _common(stored, b, keys, i, min(n - i, pool.num_blocks - b))
        blocks += range(b, b + k)
        spans.append((b, b + k))
        i += k
    return blocks, spans


def _common(stored: list, b: int, links: list, i: int, most: int) -> int:
    """How many of stored[b:], links[i:] are equal from the start (at least one: the lookup found it),
    at most `most`: slices of doubling length while they match, then halving the one that does not, so
    each element is compared about twice and a short run costs a short comparison."""
    k, step = 1, 16
    while k < most:
        end = min(most, k + step)
        if stored[b + k:b + end] == links[i + k:i + end]:
            k, step = end, step * 2
            continue
        while end - k > 1:  # stored[b + k:b + end] differs somewhere, the part before k does not
            mid = (k + end) // 2
            if stored[b + k:b + mid] == links[i + k:i + mid]:
                k = mid
            else:
                end = mid
        return k
    return most


def canonical(pools: list[BlockPool], keys: list[BlockKey], hashes: list[BlockHash]) -> None:
    """Swap, in place, each link's key and digest for the objects the first of `pools` holding that
    chain stores, where they are equal (checked here, by value). Safe on a thread beside the engine's:
    a pool changing meanwhile only leaves a link unswapped. In list passes: a pool holding none of the
    links costs one lookup pass."""
    todo = list(range(len(hashes)))
    for pool in pools:
        found = list(map(pool.index.get, map(hashes.__getitem__, todo)))
        if found.count(None) == len(found):
            continue
        rest = []
        for i, b in zip(todo, found):
            if b is None:
                rest.append(i)
                continue
            key, h = pool.block_key[b], pool.block_hash[b]
            if key == keys[i] and h == hashes[i]:
                keys[i], hashes[i] = key, h
        todo = rest
