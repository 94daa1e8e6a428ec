"""`BlockPool.pin_many`'s fast paths (runs of consecutive blocks, scattered blocks, runs the caller knows)
leave the pool exactly as pinning the blocks one by one does: pins, held count, both LRUs in order."""
from __future__ import annotations

import copy
import random

import pytest

from nanoserve.kvcache.block_pool import BlockKey, BlockPool, spans_of


def _pool(rng: random.Random, n: int) -> BlockPool:
    """Blocks in every state: in use (some published), cached-free clean and dirty, free, pinned."""
    pool = BlockPool(n)
    blocks = [pool.allocate() for _ in range(n)]
    for b in blocks:
        if rng.random() < 0.7:
            pool.publish(b, rng.randbytes(32), BlockKey.of(None, (b,)), clean=rng.random() < 0.5)
    rng.shuffle(blocks)
    for b in blocks:
        if rng.random() < 0.8:
            pool.release(b)
    for b in rng.sample(range(n), n // 10):
        if pool.ref_count[b] or pool.is_cached_free(b):
            pool.pin(b)
    pool.check_invariants()
    return pool


def _state(pool: BlockPool) -> tuple:
    return (list(pool.pins), list(pool.ref_count), list(pool.clean), list(pool.dirty), list(pool.free),
            pool.num_held)


@pytest.mark.parametrize("seed", range(40))
def test_pin_many_is_pin_one_by_one(seed: int) -> None:
    rng = random.Random(seed)
    pool = _pool(rng, rng.choice((64, 300)))
    ok = [b for b in range(pool.num_blocks) if pool.ref_count[b] or pool.is_cached_free(b)]
    if rng.random() < 0.5:  # runs of consecutive blocks, in some order
        lo = rng.randrange(len(ok))
        blocks = ok[lo:lo + rng.randint(1, 80)]
        runs = [list(g) for g in _split(blocks)]
        rng.shuffle(runs)
        blocks = [b for r in runs for b in r]
    else:
        blocks = rng.sample(ok, rng.randint(1, min(80, len(ok))))
    one = copy.deepcopy(pool)
    for b in blocks:
        one.pin(b)
    many = copy.deepcopy(pool)
    many.pin_many(blocks, spans_of(blocks, len(blocks) + 1) if rng.random() < 0.5 else None)
    many.check_invariants()
    assert _state(many) == _state(one)


def _split(blocks: list[int]) -> list[list[int]]:
    """Ascending blocks as runs of consecutive ones, at most 12 long (a long run is cut too)."""
    runs: list[list[int]] = []
    for b in blocks:
        if runs and runs[-1][-1] + 1 == b and len(runs[-1]) < 12:
            runs[-1].append(b)
        else:
            runs.append([b])
    return runs


def test_pin_many_of_a_free_block_raises_and_changes_nothing() -> None:
    pool = BlockPool(16)
    for b in range(8):
        pool.publish(pool.allocate(), bytes([b]) * 32, BlockKey.of(None, (b,)))
    for b in range(8):
        pool.release(b)
    before = _state(pool)
    with pytest.raises(AssertionError):
        pool.pin_many(list(range(4, 12)))  # 8.. are free: nothing to copy
    assert _state(pool) == before
