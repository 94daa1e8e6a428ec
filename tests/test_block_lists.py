"""The pieces that make admitting a long host prefix cost per run, not per block, against plain models:
a pool's block lists with lazy removal (block_lists.py) behave as ordered sets; a prompt's chain
(prefix.chain_links) is `chain_hash` link by link; copy runs paired from two sides' spans
(transfer.paired_runs, cut_runs) are the runs `transfer.runs` finds from the ids; a chain matched a
run at a time (chain_runs.stored_runs) is the link-by-link lookup; `canonical` swaps equal objects only."""
from __future__ import annotations

import random

from hypothesis import given, settings, strategies as st

from nanoserve.kernels import cpu_kernels
from nanoserve.kvcache.block_lists import CLEAN, DIRTY, FREE, NONE, BlockList
from nanoserve.kvcache.block_pool import BlockKey, BlockPool, chain_hash, spans_of
from nanoserve.kvcache.chain_runs import canonical, stored_runs
from nanoserve.kvcache.native import KVKernels
from nanoserve.kvcache.prefix import chain_links
from nanoserve.kvcache.transfer import cut_runs, paired_runs, runs

N = 24


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("aropms"), st.integers(0, N - 1), st.integers(1, 6)),
                max_size=80))
def test_block_lists_are_ordered_sets_with_lazy_removal(ops) -> None:
    """Three lists over one `where`: add, remove, pop either end, move to the end, and whole runs taken
    through `where` (as extents.allocate_spans and block_pool.pin_fresh do) leave each list's live blocks,
    order and count exactly as a plain ordered model's."""
    where = bytearray(N)
    lists = {code: BlockList(where, code) for code in (FREE, CLEAN, DIRTY)}
    model: dict[int, list[int]] = {code: [] for code in lists}
    rng = random.Random(len(ops))
    for op, b, k in ops:
        code = rng.choice(list(lists))
        lst, mod = lists[code], model[code]
        if op == "a" and where[b] == NONE:
            lst.add(b)
            mod.append(b)
        elif op == "r" and b in lst:
            lst.remove(b)
            mod.remove(b)
        elif op in "op" and mod:
            got = lst.pop(oldest=op == "o")
            assert got == mod.pop(0 if op == "o" else -1)
        elif op == "m" and b in lst:
            lst.move_to_end(b)
            mod.remove(b)
            mod.append(b)
        elif op == "s":  # a run [b, b + k) leaves whatever list each block is on, through `where`
            for c, other in lists.items():
                n = where.count(c, b, min(N, b + k))
                other.dropped(n)
                model[c] = [x for x in model[c] if not b <= x < b + k]
            where[b:b + k] = bytes(len(where[b:b + k]))
        for c, other in lists.items():
            assert list(other) == model[c] and len(other) == len(model[c]) and bool(other) == bool(model[c])
            assert all((x in other) == (where[x] == c) for x in range(N))


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 1 << 40), max_size=70), st.sampled_from([1, 4, 16]),
       st.one_of(st.none(), st.binary(min_size=32, max_size=32)), st.binary(max_size=64))
def test_chain_links_are_chain_hash_link_by_link(tokens, block_size, parent, salt) -> None:
    """In Python, and through the C++ kernel where it is built: the same keys and digests."""
    keys, digests = chain_links(parent, tokens, block_size, salt)
    kernels = cpu_kernels.built()
    if kernels is not None:
        assert chain_links(parent, tokens, block_size, salt, kernels.chain_digests) == (keys, digests)
    assert len(keys) == len(digests) == len(tokens) // block_size
    for i, (key, h) in enumerate(zip(keys, digests)):
        ids = tuple(tokens[i * block_size:(i + 1) * block_size])
        assert key == BlockKey.of(parent, ids) and key.token_ids == ids
        assert h == chain_hash(parent, ids, salt) == chain_hash(parent, key.tokens, salt)
        parent = h


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_paired_runs_are_the_runs_of_the_ids(data) -> None:
    n = data.draw(st.integers(1, 60))
    src = data.draw(st.permutations(range(80)))[:n]
    dst = sorted(data.draw(st.permutations(range(90)))[:n])
    span = data.draw(st.sampled_from([0, 3, 7, 1000]))
    src_spans, dst_spans = spans_of(src, n + 1), spans_of(dst, n + 1)
    pairs = paired_runs(src_spans, dst_spans)
    assert pairs == runs(src, dst)
    assert cut_runs(pairs, span or 1 << 30) == runs(src, dst, span)


def _chain_pool(rng: random.Random, n: int,
                longest: int = 9) -> tuple[BlockPool, list[bytes], list[BlockKey]]:
    """A pool holding a chain's links in runs of 1..`longest` consecutive blocks from random places (runs
    overlapping earlier ones are cut short), with other chains' blocks between; the chain (digests,
    keys) past what it holds."""
    pool = BlockPool(n)
    links = [rng.randbytes(32) for _ in range(n)]
    keys = [BlockKey.of(links[i - 1] if i else None, (i,)) for i in range(n)]
    blocks = [pool.allocate() for _ in range(n)]
    pos, i = rng.sample(range(n), n), 0
    while i < n * 2 // 3:  # runs of 1-9 links in consecutive blocks from random places
        k = rng.randint(1, longest)
        b = pos.pop()
        for j in range(k):
            if i + j < n and b + j < n and pool.block_hash[b + j] is None:
                pool.publish(blocks[b + j], links[i + j], keys[i + j])
        i += k
    for b in blocks:
        if rng.random() < 0.3 and pool.block_hash[b] is None:
            pool.publish(b, rng.randbytes(32), BlockKey.of(None, (-b,)))  # another chain's
        pool.release(b)
    pool.check_invariants()
    return pool, [bytes(h) for h in links], [BlockKey(k.parent, bytes(k.tokens)) for k in keys]


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000), st.integers(0, 30), st.sampled_from([3, 9, 70, 400]),
       st.sampled_from([60, 600]))
def test_stored_runs_are_the_link_by_link_lookups(seed, start, longest, n) -> None:
    """Short runs (then the rest link by link, no runs) and long ones (galloping, then halving); in Python,
    and through the C++ kernel where it is built (its keys compared by value here: no object is shared)."""
    rng = random.Random(seed)
    pool, hashes, keys = _chain_pool(rng, n, longest)
    if rng.random() < 0.5:  # a link whose digest is stored under another key (a collision): a miss there
        forged = rng.randrange(n)
        keys[forged] = BlockKey(keys[forged].parent, b"\xff" * 8)
    walk = []
    for h, key in zip(hashes[start:], keys[start:]):
        if (b := pool.lookup(h, key)) is None:
            break
        walk.append(b)
    # the pool's kernels: none, then the C++ ones where built (test_kv_kernels checks they are)
    built = cpu_kernels.built()
    for pool.kernels in (KVKernels(), *([KVKernels.of(built)] if built is not None else [])):
        blocks, spans = stored_runs(pool, hashes, keys, start)
        assert blocks == walk
        if spans is None:
            continue
        assert [b for s, e in spans for b in range(s, e)] == walk
        assert all(e > s for s, e in spans) and all(a[1] != b[0] for a, b in zip(spans, spans[1:]))


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000))
def test_canonical_swaps_equal_objects_only(seed) -> None:
    rng = random.Random(seed)
    pool, hashes, keys = _chain_pool(rng, 40)
    forged = rng.choice([i for i, h in enumerate(hashes) if h in pool.index] or [None])
    if forged is not None:  # a request whose link has the stored digest but other tokens
        keys[forged] = BlockKey(keys[forged].parent, b"\xff" * 8)  # (no link has token -1)
    before_keys, before_hashes = list(keys), list(hashes)
    canonical([BlockPool(4), pool], keys, hashes)
    assert keys == before_keys and hashes == before_hashes  # equal values, whatever was swapped
    for i, h in enumerate(hashes):
        b = pool.index.get(h)
        same = b is not None and i != forged
        if same:
            assert keys[i] is pool.block_key[b] and h is pool.block_hash[b]
        else:
            assert keys[i] is before_keys[i]
