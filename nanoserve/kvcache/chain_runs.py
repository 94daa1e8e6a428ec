"""Matching a chain against a tier a run at a time, and making a new prompt's chain share the objects a
tier already stores for it.

A tier that stores a chain in consecutive blocks (the host: saves land in chain order, copies.chain_order)
holds its digests side by side in `pool.block_hash`. So after one index lookup, the rest of a run is
found by comparing a slice of `block_hash` with a slice of the prompt's digests: `block_hash[b] == h`
means what `index[h] == b` means (a pool publishes a digest in both or neither: block_pool.publish).
A 2,048-link prefix in a few runs is a few lookups and list comparisons, and comes with its runs, which
the load's pins and copies use as they are.

Those comparisons, and the key comparisons that verify a match, are by identity first: `canonical`,
run where a request arrives (the engine core's intake thread), swaps a prompt's digests and keys for
the equal objects a tier holds. An object swapped is equal by value, so a match is the same either
way; one whose block was evicted meanwhile is compared by value, as any other.
"""
from __future__ import annotations

from nanoserve.kvcache.block_pool import BlockHash, BlockKey, BlockPool

Span = tuple[int, int]  # blocks [start, stop)


def stored_runs(pool: BlockPool, hashes: list[BlockHash], start: int) -> tuple[list[int], list[Span]]:
    """The blocks of `pool` holding links `start`, `start + 1`, ... of the chain `hashes`, up to the first
    link it lacks, and those blocks as runs of consecutive ids."""
    index, stored, n = pool.index, pool.block_hash, len(hashes)
    blocks: list[int] = []
    spans: list[Span] = []
    i = start
    while i < n and (b := index.get(hashes[i])) is not None:
        k = _common(stored, b, hashes, i, min(n - i, pool.num_blocks - b))
        blocks += range(b, b + k)
        spans.append((b, b + k))
        i += k
    return blocks, spans


def _common(stored: list, b: int, hashes: list[BlockHash], i: int, most: int) -> int:
    """How many of stored[b:], hashes[i:] are equal from the start (at least one: the lookup found it),
    at most `most`: the whole slice first (the usual case), else galloping then halving, so each element
    is compared about twice."""
    if stored[b:b + most] == hashes[i:i + most]:
        return most
    k, step = 1, 16
    while k + step < most and stored[b + k:b + k + step] == hashes[i + k:i + k + step]:
        k, step = k + step, step * 2
    hi = min(most, k + step)  # stored[b + k:b + hi] differs somewhere, the part before k does not
    while hi - k > 1:
        mid = (k + hi) // 2
        if stored[b + k:b + mid] == hashes[i + k:i + mid]:
            k = mid
        else:
            hi = mid
    return k


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
