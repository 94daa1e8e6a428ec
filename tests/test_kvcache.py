"""Block accounting: property tests on the pool and the prefix cache, and engine-level invariants
after every step of random workloads with aborts and preemption."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings, strategies as st

from nanoserve import LLM, SamplingParams
from nanoserve.kvcache.block_pool import BlockKey, BlockPool, chain_hash
from nanoserve.kvcache.manager import KVCacheManager
from nanoserve.sampling_params import SamplingParams as SP
from nanoserve.sequence import Sequence

ops = st.lists(st.tuples(st.sampled_from(["alloc", "release", "publish", "lookup"]), st.integers(0, 10**6)),
               max_size=200)


@given(ops)
@settings(max_examples=200, deadline=None)
def test_block_pool_accounting(script):
    pool = BlockPool(8)
    held: list[int] = []
    for op, x in script:
        if op == "alloc" and pool.num_available():
            b = pool.allocate()
            assert pool.ref_count[b] == 1 and pool.block_hash[b] is None
            held.append(b)
        elif op == "release" and held:
            pool.release(held.pop(x % len(held)))
        elif op == "publish" and held:
            b = held[x % len(held)]
            pool.publish(b, chain_hash(None, (x % 5,)), BlockKey.of(None, (x % 5,)))
        elif op == "lookup":
            b = pool.lookup(chain_hash(None, (x % 5,)), BlockKey.of(None, (x % 5,)))
            if b is not None:
                assert pool.block_key[b] == BlockKey.of(None, (x % 5,))
                pool.acquire(b)
                held.append(b)
        pool.check_invariants()
        assert pool.stats().in_use == len(set(held))
    for b in held:
        pool.release(b)
    pool.check_invariants()
    assert pool.stats().in_use == 0


def test_lru_evicts_oldest_and_cached_blocks_stay_findable():
    pool = BlockPool(3)
    blocks = [pool.allocate() for _ in range(3)]
    for i, b in enumerate(blocks):
        pool.publish(b, chain_hash(None, (i,)), BlockKey.of(None, (i,)))
    for b in blocks:  # released in order: blocks[0] is the least recently used
        pool.release(b)
    assert pool.lookup(chain_hash(None, (0,)), BlockKey.of(None, (0,))) == blocks[0]
    assert pool.allocate() == blocks[0]  # evicted first ...
    assert pool.lookup(chain_hash(None, (0,)), BlockKey.of(None, (0,))) is None  # ... and no longer findable
    assert pool.lookup(chain_hash(None, (1,)), BlockKey.of(None, (1,))) == blocks[1]


def test_digest_collision_is_caught_by_parent_and_token_check():
    pool = BlockPool(2)
    b = pool.allocate()
    forged = b"x" * 32  # pretend two different chain links produced the same digest
    pool.publish(b, forged, BlockKey.of(b"p" * 32, (1, 2)))
    assert pool.lookup(forged, BlockKey.of(b"p" * 32, (1, 2))) == b
    assert pool.lookup(forged, BlockKey.of(b"p" * 32, (3, 4))) is None   # other tokens
    assert pool.lookup(forged, BlockKey.of(b"q" * 32, (1, 2))) is None   # same tokens, other parent
    assert pool.lookup(forged, BlockKey.of(None, (1, 2))) is None


def test_chain_digest_depends_on_parent_tokens_and_salt():
    a = chain_hash(None, (1, 2))
    assert len(a) == 32 and a == chain_hash(None, (1, 2))
    assert chain_hash(a, (3,)) != chain_hash(chain_hash(None, (1, 3)), (3,))
    assert chain_hash(None, (1, 2), b"salt") != a
    assert chain_hash(None, (256,)) != chain_hash(None, (1, 0))  # fixed-width token encoding


@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=20), min_size=1, max_size=12))
@settings(max_examples=100, deadline=None)
def test_prefix_matching_reuses_only_equal_prefixes(prompts):
    kv = KVCacheManager(num_blocks=64, block_size=2)
    for i, prompt in enumerate(prompts):
        s = Sequence(i, str(i), 0, prompt, SP(), 4, frozenset())
        assert kv.admit(s, len(prompt))
        cached = s.num_computed_tokens
        assert cached < len(prompt)  # at least one token is always computed
        # every reused block holds exactly this prompt's tokens at that position
        for j in range(cached // 2):
            assert kv.pool.block_key[s.block_table[j]].token_ids == tuple(prompt[2 * j:2 * j + 2])
        s.num_computed_tokens = len(prompt)
        kv.publish_computed(s)
        kv.free(s)
        kv.check_invariants()
    assert kv.pool.stats().in_use == 0


def test_forced_digest_collision_never_shares_kv(monkeypatch):
    """Even if every block digest collided, two chains whose blocks hold equal tokens under
    different parents never share a block: the stored parent is compared on lookup."""
    from nanoserve.kvcache import prefix as prefix_mod
    real = prefix_mod.chain_links

    def colliding(parent, tokens, block_size, salt, digests_of=None):
        keys, digests = real(parent, tokens, block_size, salt, digests_of)
        return keys, [b"\0" * 32] * len(digests)
    monkeypatch.setattr(prefix_mod, "chain_links", colliding)
    kv = KVCacheManager(num_blocks=16, block_size=2)
    victim = Sequence(0, "v", 0, [1, 2, 3, 4, 9], SP(), 4, frozenset())
    assert kv.admit(victim, 5)
    victim.num_computed_tokens = 5
    kv.publish_computed(victim)
    attacker = Sequence(1, "a", 0, [7, 8, 3, 4, 9], SP(), 4, frozenset())  # same 2nd block, other parent
    assert kv.admit(attacker, 5)
    assert attacker.num_computed_tokens == 0 and not set(attacker.block_table) & set(victim.block_table)


def _kv_oracle(tokens: list[int], j: int, block: int) -> tuple[int, ...]:
    """What block j's KV is a function of: the whole prefix up to its end."""
    return tuple(tokens[:(j + 1) * block])


@given(st.lists(st.tuples(st.integers(0, 2), st.lists(st.integers(0, 2), min_size=1, max_size=9)),
                min_size=2, max_size=16))
@settings(max_examples=60, deadline=None)
def test_reused_blocks_hold_kv_of_the_whole_prefix(requests):
    """Simulated KV content per block = the prefix it was computed under; every reused block must
    carry exactly the reusing prompt's prefix. Shared stems make hits certain, checked below."""
    block = 2
    kv = KVCacheManager(num_blocks=12, block_size=block)
    content: dict[int, tuple[int, ...]] = {}
    stems = [[5, 6, 7, 8], [5, 6, 1, 1], [9, 9, 7, 8]]  # equal blocks under different parents
    hits = 0
    for i, (stem, tail) in enumerate([(0, [1])] + requests + [(0, [2])]):
        prompt = stems[stem] + tail
        s = Sequence(i, str(i), 0, prompt, SP(), 4, frozenset())
        if not kv.admit(s, len(prompt)):
            continue
        for j in range(s.num_computed_tokens // block):
            assert content[s.block_table[j]] == _kv_oracle(prompt, j, block), (prompt, j)
            hits += 1
        for j in range(s.num_computed_tokens // block, len(s.block_table)):
            content[s.block_table[j]] = _kv_oracle(prompt, j, block)  # "compute" the rest
        s.num_computed_tokens = len(prompt)
        kv.publish_computed(s)
        kv.free(s)
        kv.check_invariants()
    assert hits >= 2  # the first and last requests share stem 0's two full blocks


def _random_workload(path, steps: int, arrivals: int) -> None:
    """Requests arrive at random over the first `arrivals` steps (half sharing a 12-token prefix, some
    forked n=2, sampled), a tenth of the steps abort a live one; 24 blocks of 4 tokens force preemption.
    The schedule depends on the random generator alone, not on the model's tokens."""
    eng = LLM(str(path), dtype="float32", block_size=4, num_kv_blocks=24, max_num_batched_tokens=24).engine
    rng = random.Random(0)
    shared = [rng.randrange(100, 5000) for _ in range(12)]
    live: list[str] = []
    for step in range(steps):
        if step < arrivals and rng.random() < 0.6:
            rid = f"req{step}"
            prompt = (shared if rng.random() < 0.5 else []) + [rng.randrange(100, 5000)
                                                               for _ in range(rng.randint(1, 20))]
            eng.add_request(rid, prompt, SamplingParams(temperature=0.8, max_tokens=rng.randint(1, 40),
                                                        n=rng.choice([1, 1, 2]), seed=step, ignore_eos=True))
            live.append(rid)
        if live and rng.random() < 0.1:
            eng.abort(live.pop(rng.randrange(len(live))))
        for out in eng.step():
            if out.finished and out.request_id in live:
                live.remove(out.request_id)
        eng.check_invariants()
    while eng.has_unfinished():
        eng.step()
        eng.check_invariants()
    assert eng.kv.pool.stats().in_use == 0
    assert eng.scheduler.num_preemptions > 0  # the budget was tight enough to exercise preemption


def test_engine_invariants_random_workload_with_aborts(tiny_path):
    """The long workload (150 steps, ~500 with the drain, ~100 preemptions) on one architecture: block
    accounting is the same for every one (the schedule does not depend on the tokens)."""
    _random_workload(tiny_path("llama-gqa-tied"), steps=150, arrivals=100)


def test_engine_invariants_short_random_workload_on_every_architecture(tiny_model):
    """Each architecture's forward under the same kind of workload, shorter: forks, aborts, prefix hits
    and preemption (7 of them) in ~50 steps."""
    _random_workload(tiny_model, steps=25, arrivals=15)


pin_ops = st.lists(st.tuples(st.sampled_from(["alloc", "release", "publish", "pin", "unpin", "lookup"]),
                             st.integers(0, 10**6)), max_size=200)


@given(pin_ops)
@settings(max_examples=200, deadline=None)
def test_block_pool_pins_keep_blocks_from_reuse(script):
    """Copies pin blocks: a pinned block is never handed out by `allocate`, keeps its content key,
    and the accounting (in use + cached + free + in flight) holds throughout."""
    pool = BlockPool(6)
    held: list[int] = []
    pinned: list[int] = []
    for op, x in script:
        if op == "alloc" and pool.num_available():
            b = pool.allocate()
            assert not pool.pins[b] and pool.ref_count[b] == 1
            held.append(b)
        elif op == "release" and held:
            pool.release(held.pop(x % len(held)))
        elif op == "publish" and held:
            b = held[x % len(held)]
            pool.publish(b, chain_hash(None, (x % 5,)), BlockKey.of(None, (x % 5,)))
        elif op == "pin":
            cands = [b for b in set(held) | set(pool.lru()) | pool.held]
            if cands:
                b = sorted(cands)[x % len(cands)]
                pool.pin(b)
                pinned.append(b)
        elif op == "unpin" and pinned:
            pool.unpin(pinned.pop(x % len(pinned)))
        elif op == "lookup":
            b = pool.lookup(chain_hash(None, (x % 5,)), BlockKey.of(None, (x % 5,)))
            if b is not None:
                pool.acquire(b)
                held.append(b)
        pool.check_invariants()
        st_ = pool.stats()
        assert st_.in_use == len(set(held))
        assert st_.in_use + st_.cached_free + st_.free + st_.in_flight == pool.num_blocks
        assert st_.in_flight == len({b for b in pinned if b not in held})
        # what allocate could hand out never includes a pinned block
        assert not set(pool.lru()) & set(pinned) and not set(pool.free) & set(pinned)
    for b in held:
        pool.release(b)
    for b in pinned:
        pool.unpin(b)
    pool.check_invariants()
    assert pool.stats().in_use == 0 and pool.stats().in_flight == 0


def test_cpu_kv_cache_is_zeros_resident_only_once_written():
    """The CPU KV cache comes from calloc: zeros, yet a 256 MiB cache adds next to nothing to the
    resident set until blocks are written (torch.zeros would write every byte at start-up)."""
    import os

    import torch

    from nanoserve.runner.model_runner import zeros_untouched

    def resident() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    before = resident()
    kv = zeros_untouched((2, 4, 2, 1024, 16, 64), torch.bfloat16, torch.device("cpu"))  # 256 MiB
    assert kv.shape == (2, 4, 2, 1024, 16, 64) and kv.dtype == torch.bfloat16 and kv.is_contiguous()
    assert resident() - before < 32 << 20
    assert not kv[1, 3].any()  # reads back zeros (and makes that part resident)
    kv[0, 0, 0, 0].fill_(1.0)
    assert kv[0, 0, 0, 0].float().sum().item() == 16 * 64 and kv.float().sum().item() == 16 * 64
