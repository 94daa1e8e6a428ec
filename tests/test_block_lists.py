"""The pieces that make admitting a long host prefix cost per run, not per block, against plain models:
a pool's block lists with lazy removal (block_lists.py) behave as ordered sets; a prompt's chain
(prefix.chain_links) is `chain_hash` link by link; copy runs paired from two sides' spans
(transfer.paired_runs, cut_runs) are the runs `transfer.runs` finds from the ids."""
from __future__ import annotations

import random

from hypothesis import given, settings, strategies as st

from nanoserve.kvcache.block_lists import CLEAN, DIRTY, FREE, NONE, BlockList
from nanoserve.kvcache.block_pool import BlockKey, chain_hash, spans_of
from nanoserve.kvcache.prefix import chain_links
from nanoserve.kvcache.transfer import cut_runs, paired_runs, runs

N = 24


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("aropms"), st.integers(0, N - 1), st.integers(1, 6)),
                max_size=80))
def test_block_lists_are_ordered_sets_with_lazy_removal(ops) -> None:
    """Three lists over one `where`: add, remove, pop either end, move to the end, and whole runs taken
    through `where` (as BlockPool.take_spans / pin_fresh do) leave each list's live blocks, order and
    count exactly as a plain ordered model's."""
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
    keys, digests = chain_links(parent, tokens, block_size, salt)
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
