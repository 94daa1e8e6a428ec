"""The C++ bookkeeping kernels of a KV load (kernels/csrc/kv_runs.cpp, kvcache/native.py) against the Python
they replace: `free_extents` chooses choose_extents(free_runs(...))'s extents for any pool state (runs of
every length class, ties, too few free blocks) and allocates what `allocate_spans` allocates in Python;
`copy_runs` copies what copy_blocks' per-run slices copy, and raises at the first bad run with the ones
before it done; KVKernels takes a built module's three."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from nanoserve.kvcache import extents, transfer
from nanoserve.kvcache.block_lists import FREE
from nanoserve.kvcache.block_pool import BlockKey, BlockPool
from nanoserve.kvcache.native import KVKernels
from tests.test_cpu_kernels import kernels  # noqa: F401 - the module fixture (skips without a toolchain)


def _where(rng: random.Random, n: int) -> bytearray:
    """Block states as a pool's `where` holds them: free runs of every length class between others."""
    out = bytearray()
    while len(out) < n:
        out += bytes([FREE]) * rng.choice([1, 1, 2, 3, 4, 7, 8, 9, 16, 31, 32, 33, 100, 257])
        out += bytes(rng.choice([0, 2, 3]) for _ in range(rng.randint(1, 5)))
    return out[:n]


@settings(max_examples=400, deadline=None)
@given(st.integers(0, 10_000), st.integers(0, 700), st.integers(-2, 800))
def test_free_extents_are_choose_extents(kernels, seed, size, n) -> None:
    rng = random.Random(seed)
    where = _where(rng, size) if seed % 4 else bytearray(rng.choice([0, FREE]) for _ in range(size))
    assert kernels.free_extents(where, FREE, n) == extents.choose_extents(*extents.free_runs(where), n)


def test_free_extents_refuses_what_is_not_a_byte_buffer(kernels) -> None:
    with pytest.raises(TypeError, match="one-dimensional byte buffer"):
        kernels.free_extents(memoryview(bytes(8)).cast("B", (2, 4)), FREE, 1)
    with pytest.raises(ValueError, match="code must be a byte"):
        kernels.free_extents(bytearray(8), 256, 1)



@pytest.mark.parametrize("seed", range(6))
def test_allocate_spans_with_the_kernel_is_the_python_one(kernels, seed) -> None:
    """Two pools in the same state allocate the same blocks and runs, and keep the same accounting."""
    rng = random.Random(seed)
    pools = [BlockPool(600, KVKernels.of(kernels)), BlockPool(600)]
    for pool in pools:
        taken = [pool.allocate() for _ in range(600)]
        for b in random.Random(seed).sample(taken, 350):
            pool.release(b)
    for _ in range(4):
        n = rng.randint(1, len(pools[0].free))
        got = [extents.allocate_spans(pool, n, True) for pool in pools]
        assert got[0] == got[1]
        assert pools[0].where == pools[1].where and list(pools[0].free) == list(pools[1].free)
        assert pools[0].ref_count == pools[1].ref_count and len(pools[0].free) == len(pools[1].free)
    pools[0].check_invariants()


def _python_copy(src, dst, runs, span) -> None:
    block_bytes = src[0].numel() * src.element_size()
    transfer.copy_blocks(src, None, dst, None, transfer.copy_block, span * block_bytes, pairs=runs)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([1, 3, 8, 64]), st.booleans())
def test_copy_runs_copies_what_the_per_run_slices_copy(kernels, seed, span, non_blocking) -> None:
    rng = random.Random(seed)
    src = torch.randn(96, 2, 3)
    runs, s, d = [], 0, 0
    while True:  # disjoint runs on each side, in any order on the destination
        n = rng.randint(0, 9)
        if s + n > 96 or d + n > 96:
            break
        runs.append((s, d, n))
        s, d = s + n + rng.randint(0, 3), d + n + rng.randint(0, 3)
    rng.shuffle(runs)
    want, got = torch.zeros(96, 2, 3), torch.zeros(96, 2, 3)
    _python_copy(src, want, runs, span)
    kernels.copy_runs(src, got, runs, span, non_blocking)
    assert torch.equal(got, want)


def test_copy_runs_raises_at_the_first_bad_run_with_the_ones_before_done(kernels) -> None:
    src, dst = torch.arange(10.0), torch.zeros(10)
    with pytest.raises(IndexError, match=r"\[8, 13\) -> \[8, 13\) is outside pools of 10 -> 10 blocks"):
        kernels.copy_runs(src, dst, [(0, 0, 2), (8, 8, 5), (4, 4, 2)], 64, False)
    assert dst.tolist() == [0.0, 1.0] + [0.0] * 8
    for run in [(10, 0, 1), (0, 10, 1), (9, 0, 2), (0, 9, 2)]:  # (IndexError as transfer.copy_blocks raises)
        with pytest.raises(IndexError, match="outside pools"):
            kernels.copy_runs(src, dst, [run], 64, False)
    assert dst.tolist() == [0.0, 1.0] + [0.0] * 8
    with pytest.raises(RuntimeError, match="negative"):
        kernels.copy_runs(src, dst, [(-1, 0, 1)], 64, False)


def test_copy_blocks_batch_is_the_per_run_copy(kernels) -> None:
    """What the CUDA copier's submit runs (`batch_copy`, non-blocking), on CPU tensors: with ids and with
    pairs, cut at the copy span, the same result as copy_blocks' Python loop."""
    src = torch.randn(40, 4)
    ids = ([3, 4, 5, 9, 10, 20, 21, 22, 23], [7, 8, 9, 0, 1, 30, 31, 32, 33])
    batch = transfer.batch_copy(kernels.copy_runs, non_blocking=True)
    for pairs in (None, transfer.runs(*ids)):
        want, got = torch.zeros(40, 4), torch.zeros(40, 4)
        transfer.copy_blocks(src, ids[0], want, ids[1], transfer.copy_block, 2 * 16, pairs)
        transfer.copy_blocks(src, ids[0], got, ids[1], transfer.copy_block, 2 * 16, pairs, batch)
        assert torch.equal(got, want) and want.abs().sum() > 0
    assert transfer.batch_copy(None, True) is None


def test_kv_kernels_of_a_module(kernels) -> None:
    assert KVKernels.of(None) == KVKernels()
    k = KVKernels.of(kernels)
    assert (k.chain_digests, k.free_extents, k.copy_runs, k.stored_runs) == (
        kernels.chain_digests, kernels.free_extents, kernels.copy_runs, kernels.stored_runs)


def test_stored_runs_kernel_finds_maximal_runs_and_refuses_a_bad_index(kernels) -> None:
    """The runs themselves (the Python path gives none for scattered ones): each maximal, in chain order;
    an index naming a block outside the pool, or a negative start, raises instead of reading past a list."""
    pool = BlockPool(8)
    hashes = [bytes([i]) * 32 for i in range(6)]
    keys = [BlockKey(None, bytes([i])) for i in range(6)]
    for b, i in ((4, 0), (5, 1), (1, 2), (2, 3), (6, 4)):  # links 0-4 in three runs, link 5 nowhere
        pool.publish(b, hashes[i], BlockKey(None, bytes([i])))  # (an equal key, not the same object)
    assert kernels.stored_runs(pool.index, pool.block_key, hashes, keys, 0) == [(4, 6), (1, 3), (6, 7)]
    assert kernels.stored_runs(pool.index, pool.block_key, hashes, keys, 3) == [(2, 3), (6, 7)]
    assert kernels.stored_runs(pool.index, pool.block_key, hashes, keys, 6) == []
    with pytest.raises(ValueError, match="outside the pool"):
        kernels.stored_runs({hashes[0]: 8}, pool.block_key, hashes, keys, 0)
    with pytest.raises(ValueError, match="start must be >= 0"):
        kernels.stored_runs(pool.index, pool.block_key, hashes, keys, -1)
