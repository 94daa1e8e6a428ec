"""A load's device blocks come as few runs as the free blocks allow, and take nothing from the prefix
cache that per-block allocation would not: the same cached blocks are evicted, as many, in LRU order.
Real pools, a real manager and host tier; the copier counts the copies its batches are cut into."""
from __future__ import annotations

import random

import torch
from hypothesis import given, settings, strategies as st

from nanoserve import SamplingParams
from nanoserve.kvcache.block_pool import BlockKey, BlockPool, spans_of
from nanoserve.kvcache.extents import allocate_extents, choose_extents, free_runs
from nanoserve.kvcache.host_tier import HostTier
from nanoserve.kvcache.manager import KVCacheManager
from nanoserve.kvcache.prefix import PrefixMatch
from nanoserve.kvcache.transfer import ThreadCopier
from nanoserve.sequence import Sequence

BS = 16


def _fragment(pool: BlockPool, rng: random.Random, num_free: int) -> None:
    """Free runs (eight long, the rest 1-6 blocks) between 1-8 blocks in use or cached-free, released
    in shuffled order: the LIFO free list scatters over the pool."""
    blocks = sorted(pool.allocate() for _ in range(pool.num_blocks))
    long_runs, free, keep, i = [512, 384, 320, 256, 200, 160, 128, 100], [], [], 0
    while i < pool.num_blocks and len(free) < num_free:
        length = long_runs.pop() if long_runs and rng.random() < 0.05 else rng.randint(1, 6)
        length = min(length, num_free - len(free))
        free += blocks[i:i + length]
        used = rng.randint(1, 8)
        keep += blocks[i + length:i + length + used]
        i += length + used
    keep += blocks[i:]
    rng.shuffle(free)
    for j, b in enumerate(keep):
        if j % 2:
            pool.publish(b, rng.randbytes(32), BlockKey.of(None, (j,)))
            pool.release(b)
    for b in free:
        pool.release(b)


class CountingCopy:
    def __init__(self) -> None:
        self.copies = 0

    def __call__(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.copies += 1
        dst.copy_(src)


def test_a_2048_block_load_into_a_fragmented_pool_is_at_most_16_copies():
    n, count = 2048, CountingCopy()
    device = torch.zeros(8192, 1, 2, 1, BS, 1)  # tiny blocks: no copy is cut at a span
    host = HostTier(n + 64, device, ThreadCopier(count))
    kv = KVCacheManager(8192, BS, host=host)
    rng = random.Random(0)
    _fragment(kv.pool, rng, 4096)
    runs_before = len(free_runs(kv.pool.where)[0])
    cached_before = set(kv.pool.lru())
    prompt = [rng.randrange(32000) for _ in range((n + 1) * BS)]
    seq = Sequence(1, "1", 0, prompt, SamplingParams(), 16, frozenset())
    kv.hash_prompt(seq)
    for h, key in zip(seq.block_hashes[:n], seq.block_keys[:n]):  # the prefix, on host only
        hb = host.pool.allocate_pinned()
        host.pool.publish(hb, h, key)
        host.pool.unpin(hb)
    assert runs_before > 500  # the pool is fragmented: hundreds of free runs
    assert kv.admit(seq, 4 * BS)
    kv.complete_loads(seq, 30.0)
    assert kv.load_state(seq).value == "ready"
    assert count.copies <= 16, f"{count.copies} copies"
    assert set(kv.pool.lru()) == cached_before  # no cached block was evicted: free blocks sufficed
    assert all(device[b].eq(0).all() for b in seq.block_table[:n])  # what host held (zeros) landed
    kv.check_invariants()
    kv.free(seq)
    kv.check_invariants()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from("fuc"), min_size=1, max_size=80), st.integers(0, 90), st.booleans(),
       st.randoms(use_true_random=False))
def test_extent_allocation_takes_fewest_runs_and_evicts_what_per_block_allocation_would(
        layout, n, lossy_ok, rnd):
    """`layout`: per block free (f), in use (u) or cached-free (c); cached ones published in a random
    LRU order. Two identical pools: one allocates block by block, the other as extents."""
    def build() -> BlockPool:
        pool = BlockPool(len(layout))
        for _ in layout:  # every block handed out, so each can be put in the state its letter names
            pool.allocate()
        order = list(range(len(layout)))
        random.Random(len(layout)).shuffle(order)
        for b in order:
            if layout[b] == "c":
                pool.publish(b, bytes([b % 256, b // 256]) * 16, BlockKey.of(None, (b,)))
                if b % 3 == 0:
                    pool.mark_clean(b, True)
                pool.release(b)
            elif layout[b] == "f":
                pool.release(b)
        return pool
    a, b = build(), build()
    if n > a.num_available(lossless=not lossy_ok):
        try:
            allocate_extents(b, n, lossy_ok)
            raise AssertionError("allocated past the pool")
        except RuntimeError:
            b.check_invariants()
            assert b.stats() == a.stats()  # all or nothing
            return
    runs = free_runs(b.where)
    per_block = sorted(a.allocate(lossy_ok) for _ in range(n))
    ext = allocate_extents(b, n, lossy_ok)
    assert ext == sorted(set(ext)) and len(ext) == n
    assert all(b.ref_count[x] == 1 for x in ext)
    evicted_a = {x for x in per_block if layout[x] == "c"}
    assert {x for x in ext if layout[x] == "c"} == evicted_a  # the same cached victims
    assert (a.num_evictions, a.num_lossy_evictions) == (b.num_evictions, b.num_lossy_evictions)
    # the fewest runs: no k longest free runs hold the free blocks taken when k+1 are needed
    taken_free = [x for x in ext if layout[x] == "f"]
    lengths = sorted(runs[1].tolist(), reverse=True)
    used = len(spans_of(taken_free, len(taken_free))) if taken_free else 0
    assert used == 0 or sum(lengths[:used - 1]) < len(taken_free)
    for pool in (a, b):
        pool.check_invariants()
        for x in (per_block if pool is a else ext):
            pool.release(x)
        pool.check_invariants()


def test_choose_extents_best_fit_keeps_long_runs_long():
    starts, lengths = free_runs(bytearray(b"\1" * 10 + b"\0" + b"\1" * 3 + b"\0" + b"\1" * 5))
    assert choose_extents(starts, lengths, 12) == [(0, 10), (11, 2)]  # the rest: the smallest run holding 2
    assert choose_extents(starts, lengths, 4) == [(15, 4)]             # the 5-run, not the 10-run
    assert choose_extents(starts, lengths, 100) == [(0, 10), (11, 3), (15, 5)]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from("DLH"), max_size=30))
def test_prefix_match_runs_round_trip(tiers):
    from nanoserve.kvcache.prefix import Tier
    hits = [({"D": Tier.DEVICE, "L": Tier.LOADING, "H": Tier.HOST}[t], i) for i, t in enumerate(tiers)]
    m = PrefixMatch.of_hits(hits)
    assert m.hits() == hits and len(m) == len(hits)
    assert m.of(Tier.HOST) == [b for t, b in hits if t is Tier.HOST]
