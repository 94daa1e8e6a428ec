"""The two-tier policy, lossless by design: clean blocks (KV also on host) are evicted first, uncopied
KV is dropped only when the host has no room, admission and running sequences defer while saves make
room, the cleaner sizes its target from demand, and copy-path failures stay scoped. Copies complete
when the test says (in any order) or behind gates: nothing here depends on the machine's speed."""
from __future__ import annotations

import random
import threading
from collections import Counter

import pytest
import torch
from hypothesis import given, settings, strategies as st

from nanoserve import LLM, SamplingParams
from nanoserve.kvcache.block_pool import BlockKey, BlockPool, chain_hash
from nanoserve.kvcache.host_tier import HostTier
from nanoserve.kvcache.manager import KVCacheManager, LoadState, Supply
from nanoserve.kvcache.transfer import CudaTransfer, DeviceFault, ThreadCopier, runs
from nanoserve.scheduler import Scheduler
from nanoserve.sequence import Sequence
from tests.conftest import hf_greedy
from tests.test_host_tier import GatedCopy
from bench.gpu_check import forget_device_cache
from tests.test_transfer import ADD, FakeEngine, ManualCopier, run_ops


def _key(i: int) -> tuple[bytes, BlockKey]:
    return chain_hash(None, (i,)), BlockKey.of(None, (i,))


# ---- the pool: two LRUs ------------------------------------------------------------------------
def test_clean_blocks_are_evicted_first_and_dirty_ones_only_when_allowed():
    pool = BlockPool(4)
    blocks = [pool.allocate() for _ in range(4)]
    for i, b in enumerate(blocks):
        pool.publish(b, *_key(i))
        pool.release(b)  # LRU order: 0 1 2 3
    pool.mark_clean(blocks[2], True)
    pool.mark_clean(blocks[3], True)
    assert pool.num_available(lossless=True) == 2 and pool.num_available() == 4
    assert pool.allocate(lossy_ok=False) == blocks[2]  # the oldest clean one, not the oldest one
    assert pool.allocate(lossy_ok=False) == blocks[3]
    with pytest.raises(RuntimeError):
        pool.allocate(lossy_ok=False)  # only dirty ones left
    assert pool.num_evictions == 2 and pool.num_lossy_evictions == 0
    assert pool.allocate() == blocks[0] and pool.num_lossy_evictions == 1
    pool.check_invariants()


def test_pinned_blocks_leave_the_lrus_and_come_back_clean_or_dirty():
    pool = BlockPool(3)
    b = pool.allocate()
    pool.publish(b, *_key(0))
    pool.release(b)
    pool.pin(b)  # a save of a dirty block
    assert pool.num_available() == 2 and pool.lookup(*_key(0)) == b  # unavailable, still findable
    pool.mark_clean(b, True)
    pool.unpin(b)
    assert list(pool.clean) == [b] and not pool.dirty
    pool.check_invariants()
    # keep_clean (the host taking a save) never evicts a clean block
    pool.allocate(), pool.allocate()
    with pytest.raises(RuntimeError):
        pool.allocate(keep_clean=True)


# ---- deferral instead of loss ------------------------------------------------------------------
def _fill_device_with_dirty(kv: KVCacheManager, tokens: list[int], seq_id: int = 100) -> None:
    seq = Sequence(seq_id, "fill", 0, tokens, SamplingParams(), 1, frozenset())
    assert kv.admit(seq, len(tokens))
    seq.num_computed_tokens = len(tokens)
    kv.publish_computed(seq)
    kv.free(seq)


def test_admission_defers_and_saves_instead_of_dropping_uncopied_kv():
    bs = 2
    device = torch.zeros(6, 1, 2, 1, bs, 1)
    copier = ManualCopier()
    kv = KVCacheManager(6, bs, host=HostTier(16, device, copier))
    _fill_device_with_dirty(kv, list(range(12)))  # six dirty cached blocks, nothing on host
    assert kv.pool.stats().cached_free == 6 and not kv.pool.clean
    seq = Sequence(1, "1", 0, [50, 51, 52, 53, 54], SamplingParams(), 1, frozenset())
    assert not kv.admit(seq, 5)  # would need 3 dirty evictions: defer, and save them
    assert kv.policy.num_deferred == 1 and len(kv.copies.saves) == 1 and len(kv.copies.saves[0].dev_ids) == 3
    assert kv.pool.num_evictions == 0 and not seq.block_table
    kv.check_invariants()
    assert not kv.admit(seq, 5)  # the saves are still running: defer again, start nothing more
    assert len(kv.copies.saves) == 1
    copier.pending[0].run()
    assert kv.admit(seq, 5)
    assert kv.pool.num_evictions == 3 and kv.pool.num_lossy_evictions == 0
    kv.check_invariants()
    # the evicted blocks' KV is on host: their prefix comes back from there
    probe = Sequence(2, "2", 0, list(range(12)) + [99], SamplingParams(), 1, frozenset())
    assert [t for t, _ in kv.match_prefix(probe)] == ["device"] * 3 + ["host"] * 3  # tails were older


def test_without_host_room_the_oldest_dirty_block_is_dropped_and_counted():
    bs = 2
    device = torch.zeros(6, 1, 2, 1, bs, 1)
    copier = ManualCopier()
    kv = KVCacheManager(6, bs, host=HostTier(2, device, copier))
    _fill_device_with_dirty(kv, list(range(12)))
    kv.offload_watermark = 6
    assert kv.offload_cold_blocks() == 2  # the host takes two
    while copier.pending:
        copier.pending[0].run()
    kv.poll_transfers()
    # host full of twins: nothing gains by evicting one
    assert len(kv.pool.clean) == 2 and kv.host.room() == 0
    seq = Sequence(1, "1", 0, [50, 51, 52, 53, 54, 55, 56], SamplingParams(), 1, frozenset())
    assert kv.admit(seq, 7)  # needs 4: two clean, then two dirty, since the host has no room
    assert kv.pool.num_lossy_evictions == 2 and kv.policy.num_lossy_with_room == 0
    assert kv.reports()[0].lossy_evictions == 2
    kv.check_invariants()


def test_host_hits_survive_the_saves_their_own_admission_starts():
    """The review's R1: the prefix being admitted is the host LRU tail, and the saves admission
    starts must evict host blocks. The matched host hits are pinned around those saves."""
    bs = 2
    device = torch.zeros(4, 1, 2, 1, bs, 1)
    copier = ManualCopier()
    kv = KVCacheManager(4, bs, host=HostTier(4, device, copier))
    doc = [1, 2, 3, 4, 5, 6]
    _fill_device_with_dirty(kv, doc + [7])
    kv.offload_watermark = 4
    kv.offload_cold_blocks()
    while copier.pending:
        copier.pending[0].run()
    kv.poll_transfers()
    kv.offload_watermark = 0
    forget_device_cache(kv.pool)  # the document is on host only (3 blocks, host-only: the host LRU tail)
    _fill_device_with_dirty(kv, [20, 21, 22, 23, 24, 25, 26, 27], seq_id=101)  # four dirty device blocks
    seq = Sequence(1, "1", 0, doc + [9], SamplingParams(), 1, frozenset())
    assert not kv.admit(seq, 7)  # 3 host hits + 1 block: defer; the save has room for one block only
    assert [t for t, _ in kv.match_prefix(seq)] == ["host"] * 3  # the hits were not its victims
    kv.check_invariants()
    while copier.pending:
        copier.pending[0].run()
    for _ in range(4):
        if kv.admit(seq, 7):
            break
        while copier.pending:
            copier.pending[0].run()
    assert seq.block_table and seq.num_computed_tokens == 6
    while copier.pending:
        copier.pending[0].run()
    kv.poll_transfers()
    assert kv.load_state(seq) is LoadState.READY and kv.host_stats.hits == 6
    kv.check_invariants()


def test_running_sequence_sits_out_a_step_rather_than_drop_kv():
    bs = 2
    device = torch.zeros(4, 1, 2, 1, bs, 1)
    copier = ManualCopier()
    kv = KVCacheManager(4, bs, host=HostTier(8, device, copier))
    sched = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=8)
    _fill_device_with_dirty(kv, [10, 11, 12, 13, 14, 15])  # 3 dirty cached blocks
    seq = Sequence(1, "1", 0, [1], SamplingParams(), 8, frozenset())
    sched.add(seq)
    assert sched.schedule().scheduled  # admitted into the free block
    seq.num_computed_tokens = 1
    seq.token_ids += [2]
    seq.num_computed_tokens = 2
    seq.token_ids += [3]  # its next token needs a new block: only dirty ones are left
    out = sched.schedule()
    assert not out.scheduled and not out.num_preempted and kv.copies.saves and kv.policy.num_deferred == 1
    sched.wait_for_transfers(timeout=5)  # nothing was scheduled: the engine waits on the save
    assert not copier.pending
    assert sched.schedule().scheduled and kv.pool.num_lossy_evictions == 0
    sched.check_invariants()


def test_cleaner_target_follows_demand_and_the_watermark_overrides_it():
    bs = 2
    device = torch.zeros(8, 1, 2, 1, bs, 1)
    copier = ManualCopier()
    kv = KVCacheManager(8, bs, host=HostTier(16, device, copier))
    _fill_device_with_dirty(kv, list(range(16)))  # 8 allocations, all dirty now
    assert kv.offload_cold_blocks(demand=0) == 8  # the last step allocated 8: keep 8 reusable
    while copier.pending:
        copier.pending[0].run()
    kv.poll_transfers()
    assert len(kv.pool.clean) == 8
    kv3 = KVCacheManager(8, bs, host=HostTier(16, torch.zeros(8, 1, 2, 1, bs, 1), ManualCopier()),
                         offload_watermark=2)
    _fill_device_with_dirty(kv3, list(range(16)))
    assert kv3.offload_cold_blocks(demand=8) == 2  # the override wins over demand


def test_inline_loads_run_a_host_hit_in_the_step_that_admits_it():
    """CPU engines wait for a new admission's host copy (a memcpy on the worker thread) and schedule
    it at once; without inline loads it joins a step later."""
    for inline in (False, True):
        eng = FakeEngine(dev_blocks=8, host_blocks=16, watermark=0)
        eng.put_doc_on_host(0)
        eng.host.copier = ThreadCopier()
        eng.sched.inline_loads = inline
        eng.sched.inline_load_wait = 60.0  # the copy ends long before: the test does not depend on speed
        eng.add(0, [1, 2], 1)
        seq = eng.seqs[-1]
        out = eng.sched.schedule()
        assert [s.seq for s in out.scheduled] == ([seq] if inline else [])
        if inline:
            assert seq.num_host_cached_tokens == 8 and eng.kv.host_stats.hits == 8
            assert out.scheduled[0].num_tokens == seq.num_tokens - 8  # only what the host did not hold
        else:
            assert eng.sched.loading == [seq]
        eng.check()
        eng.kv.drain_transfers()


def test_waiting_host_hits_count_in_the_demand():
    eng = FakeEngine(dev_blocks=8, host_blocks=16, watermark=0)
    eng.put_doc_on_host(0)
    eng.add(0, [1, 2], 1)
    # document 0: 4 blocks on host, plus one block for the rest of the prompt
    assert eng.sched.kv_demand() == 5


# ---- property: random workloads, every step checked ---------------------------------------------
OPS = st.lists(st.one_of(
    ADD, ADD, ADD, st.tuples(st.just("step")), st.tuples(st.just("step")), st.tuples(st.just("step")),
    st.tuples(st.just("complete"), st.integers(0, 7), st.integers(0, 6).map(lambda x: x == 0)),
    st.tuples(st.just("complete_all")), st.tuples(st.just("abort"), st.integers(0, 20)),
    st.tuples(st.just("fail_submit")),
), min_size=10, max_size=80)


class PolicyEngine(FakeEngine):
    """The property test's engine with the cleaner sized from demand (no watermark), checking the
    policy after every step: invariants, no uncopied KV dropped while the host had room and saves
    were working, and (with a host big enough for everything) no lossy eviction at all unless
    saves were failing."""

    def __init__(self, host_blocks: int) -> None:
        super().__init__(dev_blocks=8, host_blocks=host_blocks, watermark=0)
        self.steps_waited = Counter()  # seq id -> steps at the head of the queue, copies all done

    def check(self) -> None:
        super().check()
        assert self.kv.policy.num_avoidable_lossy == 0, "uncopied KV dropped while the host had room"
        self.counts["lossy"] = self.kv.pool.num_lossy_evictions
        self.counts["deferred"] = self.kv.policy.num_deferred

    def finish_all(self) -> None:
        """As FakeEngine's, but also: with every copy completed at once, no request waits at the
        head of the queue for more than a few steps (deferral always ends)."""
        for _ in range(1000):
            if not self.sched_busy():
                break
            while self.copier.pending:
                self.complete(0, False)
            head = self.sched.waiting[0].seq_id if self.sched.waiting else None
            self.step()
            self.check()
            if head is not None and self.sched.waiting and self.sched.waiting[0].seq_id == head and \
                    not self.sched.running and not self.sched.loading:
                self.steps_waited[head] += 1
                assert self.steps_waited[head] < 6, f"request {head} waits forever"
        super().finish_all()


@pytest.mark.parametrize("host_blocks", [4, 40])
def test_property_policy_random_workloads(host_blocks):
    totals = Counter()

    @given(OPS)
    @settings(max_examples=120, deadline=None, derandomize=True)
    def prop(ops):
        eng = PolicyEngine(host_blocks)
        run_ops(eng, ops)
        if host_blocks >= 40 and not eng.copier.fail_next_submit and eng.kv.copies.save_failures_in_row == 0 \
                and not eng.counts["failed_copies"] and not eng.kv.num_save_submit_failures:
            assert eng.kv.pool.num_lossy_evictions == 0, "host holds everything: nothing may be lost"
        totals.update(eng.counts)

    prop()
    assert totals["host_hit_tokens"] > 0 and totals["loading_seen"] > 0 and totals["deferred"] > 0
    if host_blocks < 40:
        assert totals["lossy"] > 0  # a small host runs out of room: the lossy path is exercised too


def test_seeded_policy_workloads_reach_every_path():
    totals = Counter()
    for seed in range(30):
        rng = random.Random(seed)
        ops = []
        for _ in range(60):
            kind = rng.choice(["add", "add", "step", "step", "step", "complete", "complete_all", "abort",
                               "fail_submit"])
            if kind == "add":
                ops.append(("add", rng.randrange(3), [rng.randrange(10) for _ in range(rng.randrange(4))],
                            rng.randint(1, 3)))
            elif kind == "complete":
                ops.append(("complete", rng.randrange(8), rng.random() < 0.15))
            elif kind == "abort":
                ops.append((kind, rng.randrange(20)))
            else:
                ops.append((kind,))
        eng = PolicyEngine(40 if seed % 2 else 6)
        run_ops(eng, ops)
        totals.update(eng.counts)
    assert totals["host_hit_tokens"] > 0 and totals["deferred"] > 0 and totals["failed_copies"] > 0


# ---- the real engine, default flags ---------------------------------------------------------------
def test_engine_long_documents_concurrently_lose_nothing_with_default_flags(tiny_path):
    """16 documents round-robin, 4 at a time, device for a few of them, host for all, no watermark:
    every later round gets its whole reusable prefix from cache, nothing is dropped, and the
    greedy output matches HF (fp32). One architecture: the policy's work depends on token counts only
    (each architecture's greedy tokens through the host tier: test_host_tier)."""
    tiny_model = tiny_path("llama-gqa-tied")
    rng = random.Random(11)
    docs = [[rng.randrange(100, 5000) for _ in range(40)] for _ in range(12)]
    llm = LLM(str(tiny_model), dtype="float32", block_size=4, num_kv_blocks=60, host_cache_gb=0.02,
              max_num_seqs=4)
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    prompts = [d + [rng.randrange(100, 5000) for _ in range(2)] for d in docs]
    expected = hf_greedy(tiny_model, prompts, 3)
    for rnd in range(2):
        outs = llm.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in outs] == expected, f"round {rnd}"
        eng.check_invariants()
    assert all(o.num_cached_tokens == (len(p) - 1) // 4 * 4 for o, p in zip(outs, prompts))
    assert sum(o.num_host_cached_tokens for o in outs) > 0
    dev, host = eng.kv.reports()
    assert dev.lossy_evictions == 0 and dev.evictions > 0 and eng.kv.policy.num_lossy_with_room == 0
    eng.close()


# ---- the copy path --------------------------------------------------------------------------------
def test_consecutive_blocks_are_copied_as_one_run_exactly():
    assert runs([3, 4, 5, 9, 1, 2], [0, 1, 2, 3, 7, 8]) == [(3, 0, 3), (9, 3, 1), (1, 7, 2)]
    device = torch.randn(10, 2, 3)
    seen = []

    def copy(src, dst):
        seen.append(src.shape[0])
        dst.copy_(src)
    tier = HostTier(10, device, ThreadCopier(copy))
    keys = [_key(i) for i in range(5)]
    assert tier.save([(b, *k) for b, k in zip([2, 3, 4, 7, 8], keys)]) == 5
    assert sorted(seen) == [2, 3]  # two runs, not five copies
    for b, k in zip([2, 3, 4, 7, 8], keys):
        assert torch.equal(tier.cache[tier.lookup(*k)], device[b])


class _FakeEvent:
    def __init__(self, query=lambda: False):
        self._query = query

    def query(self):
        return self._query()

    def elapsed_time(self, other):
        return 1.0

    def synchronize(self):
        raise AssertionError("a bounded wait must not synchronize")


def test_cuda_transfer_wait_honours_its_timeout_and_device_errors_are_fatal():
    t = CudaTransfer(torch.device("cpu"), _FakeEvent(), _FakeEvent())
    assert t.wait(timeout=0.01) is False and not t.done()  # never completes: returns, does not block

    def broken():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    bad = CudaTransfer(torch.device("cpu"), _FakeEvent(), _FakeEvent(broken))
    with pytest.raises(DeviceFault):
        bad.done()
    assert not issubclass(DeviceFault, Exception)  # no per-request handler swallows it
    ok = CudaTransfer(torch.device("cpu"), _FakeEvent(), _FakeEvent(lambda: True))
    assert ok.wait(timeout=1) and ok.seconds == 0.001


def test_host_close_waits_for_copies_in_flight_before_releasing():
    device = torch.randn(4, 1, 2, 1, 2, 2)
    gated = GatedCopy(device, all_copies=True)
    tier = HostTier(4, device, ThreadCopier(gated))
    released = threading.Event()
    real_release = tier._release
    tier._release = lambda: (real_release(), released.set())
    copy = tier.begin_save([0, 1], [_key(0), _key(1)])
    assert gated.started.wait(60)
    closer = threading.Thread(target=tier.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive() and not released.is_set()  # the save still runs: the pool stays pinned
    gated.gate.set()
    closer.join(60)
    assert released.is_set() and copy.handle.done()
