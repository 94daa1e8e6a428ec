"""Asynchronous tier copies: loads as a scheduler state, saves published only when complete, pins
held for exactly the life of a copy, failures (at admission or inside a copy) releasing
everything. Copies are slowed by gates the test opens, never by sleeps: nothing here depends on
the machine's speed."""
from __future__ import annotations

import random
import zlib
from array import array
from collections import Counter

import pytest
import torch
from hypothesis import given, settings, strategies as st

from nanoserve import LLM, SamplingParams
from nanoserve.kvcache.host_tier import HostTier, alloc_host_cache, host_memory_available
from nanoserve.kvcache.manager import KVCacheManager, LoadState
from nanoserve.kvcache.transfer import Copier, ThreadCopier, Transfer, copy_blocks
from nanoserve.scheduler import Scheduler
from nanoserve.sequence import Sequence, SeqStatus
from bench.gpu_check import check_round_trip, forget_device_cache
from tests.conftest import hf_greedy
from tests.test_host_tier import GatedCopy


# ---- exact round trip (the same check bench/gpu_check.py runs on CUDA) ---------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_random_blocks_exact_cpu(dtype):
    assert check_round_trip("cpu", dtype) > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_random_blocks_exact_cuda(dtype):
    assert check_round_trip("cuda", dtype, num_blocks=64) > 0


# ---- host memory ------------------------------------------------------------------------------
def test_host_memory_honours_cgroup_limits(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 100000000 kB\nMemAvailable: 50000000 kB\n")
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text("4294967296\n")
    (v2 / "memory.current").write_text("1073741824\n")
    assert host_memory_available(str(meminfo), str(v2)) == 3 << 30
    (v2 / "memory.max").write_text("max\n")
    assert host_memory_available(str(meminfo), str(v2)) == 50000000 * 1024
    v1 = tmp_path / "v1" / "memory"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text(str(2 << 30))
    (v1 / "memory.usage_in_bytes").write_text(str(1 << 30))
    assert host_memory_available(str(meminfo), str(tmp_path / "v1")) == 1 << 30
    assert host_memory_available(str(meminfo), str(tmp_path / "none")) == 50000000 * 1024


def test_host_pool_is_exact_size_and_zeroed():
    cache, release, ranges = alloc_host_cache((5, 3, 7), torch.float32, pin=False, max_copy_bytes=100,
                                              register_bytes=200)  # spans of 1 block, ranges of 2
    release()  # unpinned: nothing to release, and callable
    assert cache.shape == (5, 3, 7) and cache.numel() * 4 == 5 * 3 * 7 * 4 and not cache.any()
    assert ranges == [(0, 2), (2, 4), (4, 5)]


# ---- a deterministic copier for the property test ---------------------------------------------
class ManualTransfer(Transfer):
    def __init__(self, run) -> None:
        self._run, self._done = run, False

    def done(self) -> bool:
        return self._done

    def wait(self, timeout: float | None = None) -> bool:
        if not self._done:
            self._run()
        return True


class ManualCopier(Copier):
    """Copies happen only when the test completes them (in any order), so a block read before
    its copy completed, or overwritten while a copy used it, shows up as wrong KV content."""

    def __init__(self) -> None:
        super().__init__()
        self.pending: list[ManualTransfer] = []
        self.fail_next_submit = False
        self.checks: list = []  # callables run just before a copy executes

    def _open_lane(self, name: str) -> None:
        return None  # copies run when the test completes them, in any order: no lanes

    def submit(self, lane, src, src_ids, dst, dst_ids, pairs=None) -> Transfer:
        if self.fail_next_submit:
            self.fail_next_submit = False
            raise RuntimeError("injected submit failure")
        check = self.on_submit(lane, list(src_ids), list(dst_ids))

        def run(fail: bool = False) -> None:
            check()
            if fail:
                handle.error = RuntimeError("injected copy failure")
            else:
                for s, d in zip(src_ids, dst_ids):
                    dst[d].copy_(src[s])
            handle._done = True
            self.pending.remove(handle)

        handle = ManualTransfer(run)
        handle.run = run
        self.pending.append(handle)
        return handle

    def on_submit(self, lane, src_ids, dst_ids):
        return lambda: None


def _oracle(prefix: list[int]) -> float:
    """Block j's KV is a function of the whole prefix tokens[0:(j+1)*B], not of its own tokens."""
    return float(zlib.crc32(array("q", prefix).tobytes()) % 1_000_003)


DOCS = [[(7 * d + 3 * i) % 10 for i in range(8)] for d in range(3)]


class FakeEngine:
    """Scheduler + KV manager + a model that writes oracle KV and checks every block it reads."""

    def __init__(self, dev_blocks: int = 8, host_blocks: int = 8, bs: int = 2, watermark: int = 8) -> None:
        self.bs = bs
        self.device = torch.zeros(dev_blocks, 1, 2, 1, bs, 1)
        self.copier = ManualCopier()
        self.host = HostTier(host_blocks, self.device, self.copier)
        self.watermark = watermark
        self.kv = KVCacheManager(dev_blocks, bs, host=self.host, offload_watermark=watermark)
        self.sched = Scheduler(self.kv, max_num_seqs=3, max_num_batched_tokens=8)
        self.copier.on_submit = self._guard
        self.seqs: list[Sequence] = []
        self.counts = Counter()

    def _guard(self, lane, src_ids, dst_ids):
        """At submit, remember what the copy's blocks hold; when it runs, they must still hold it
        and still be pinned (a host block evicted mid-load, or a saved device block reused, fails)."""
        src_pool = self.kv.pool if lane == "save" else self.host.pool
        keys = [src_pool.block_key[b] for b in src_ids]

        def check() -> None:
            assert [src_pool.block_key[b] for b in src_ids] == keys, f"{lane} source reused mid-copy"
            assert all(src_pool.pins[b] > 0 for b in src_ids), f"{lane} source unpinned mid-copy"
            dst_pool = self.host.pool if lane == "save" else self.kv.pool
            assert all(dst_pool.pins[b] > 0 for b in dst_ids), f"{lane} destination unpinned mid-copy"
        return check

    def add(self, doc: int, suffix: list[int], max_tokens: int) -> None:
        seq = Sequence(len(self.seqs), str(len(self.seqs)), 0, DOCS[doc] + suffix, SamplingParams(),
                       max_tokens, frozenset())
        self.seqs.append(seq)
        self.sched.add(seq)

    def abort(self, i: int, loading_only: bool = False) -> None:
        live = [s for s in self.seqs
                if not s.is_finished and (s.status is SeqStatus.LOADING or not loading_only)]
        if live:
            seq = live[i % len(live)]
            self.counts["abort_" + seq.status.value] += 1
            self.sched.finish(seq)

    def complete(self, i: int, fail: bool) -> None:
        if self.copier.pending:
            self.copier.pending[i % len(self.copier.pending)].run(fail)
            self.counts["failed_copies"] += fail

    def step(self) -> None:
        try:
            self.kv.offload_cold_blocks()
            out = self.sched.schedule()
        except RuntimeError as e:  # an injected failure: the engine fails the request it admitted
            assert "injected" in str(e)
            if self.sched.waiting:
                self.sched.finish(self.sched.waiting[0])
            return
        loading = {b for ld in self.kv.copies.loads for b in ld.copy.dev_ids}
        bs = self.bs
        for s in out.scheduled:
            seq, start = s.seq, s.seq.num_computed_tokens
            assert not loading & set(seq.block_table), "scheduled while a block it holds is loading"
            for j in range(start // bs):  # every full block it attends to holds this prefix's KV
                want = _oracle(seq.token_ids[:(j + 1) * bs])
                assert self.device[seq.block_table[j]].eq(want).all(), f"seq {seq.seq_id} block {j}"
            end = start + s.num_tokens
            for j in range(start // bs, end // bs):
                self.device[seq.block_table[j]] = _oracle(seq.token_ids[:(j + 1) * bs])
            seq.num_computed_tokens = end
            self.kv.publish_computed(seq)
        for s in out.scheduled:
            seq = s.seq
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(sum(seq.token_ids[-2:]) % 10)  # a token that depends on the prefix
                if seq.num_output_tokens >= seq.max_tokens:
                    self.sched.finish(seq)
        self.counts["host_hit_tokens"] = self.kv.host_stats.hits
        self.counts["hit_tokens"] = self.kv.device_stats.hits + self.kv.host_stats.hits
        self.counts["loading_seen"] += len(self.sched.loading)

    def put_doc_on_host(self, doc: int) -> None:
        """Run a request on a document, save every cached device block, then forget the device
        copies: the document's blocks are on host only."""
        self.add(doc, [1], 1)
        self.finish_all()
        self.kv.offload_watermark = self.kv.num_blocks
        self.kv.offload_cold_blocks()
        self.kv.drain_transfers()
        self.kv.offload_watermark = self.watermark
        forget_device_cache(self.kv.pool)

    def check(self) -> None:
        self.sched.check_invariants()

    def sched_busy(self) -> bool:
        return bool(self.sched.waiting or self.sched.running or self.sched.loading)

    def finish_all(self) -> None:
        for _ in range(1000):
            if not self.sched_busy():
                break
            while self.copier.pending:
                self.complete(0, False)
            self.step()
            self.check()
        assert not self.sched_busy(), "workload never drained"
        self.kv.drain_transfers()
        self.check()
        dev, host = self.kv.reports()
        assert dev.blocks_in_use == 0 and dev.blocks_in_flight == 0 and host.blocks_in_flight == 0


# the longest request (8 + 3 prompt tokens, 3 generated) fits the 8-block device on its own
ADD = st.tuples(st.just("add"), st.integers(0, 2), st.lists(st.integers(0, 9), max_size=3), st.integers(1, 3))
OPS = st.lists(st.one_of(
    ADD, ADD, st.tuples(st.just("step")), st.tuples(st.just("step")), st.tuples(st.just("step")),
    st.tuples(st.just("complete"), st.integers(0, 7), st.integers(0, 4).map(lambda x: x == 0)),
    st.tuples(st.just("complete_all")),
    st.tuples(st.just("abort"), st.integers(0, 20)), st.tuples(st.just("abort_loading"), st.integers(0, 20)),
    st.tuples(st.just("fail_submit")),
), min_size=10, max_size=60)


def run_ops(eng: FakeEngine, ops) -> None:
    for op in ops:
        if op[0] == "add":
            eng.add(op[1], op[2], op[3])
        elif op[0] == "step":
            eng.step()
        elif op[0] == "complete":
            eng.complete(op[1], op[2])
        elif op[0] in ("abort", "abort_loading"):
            eng.abort(op[1], op[0] == "abort_loading")
        elif op[0] == "complete_all":
            while eng.copier.pending:
                eng.complete(0, False)
        else:
            eng.copier.fail_next_submit = True
        eng.check()
    eng.copier.fail_next_submit = False
    eng.finish_all()


def test_property_random_workloads_keep_kv_content_and_pins():
    """Random adds / steps / aborts / copy completions (in any order, some failing, some failing
    to start) over shared document prefixes, an 8-block device and an 8-block host. Asserted on
    every step: KV content of every block read (oracle on the whole prefix), nothing scheduled
    while a block it holds is loading, copy sources unchanged and pinned until their copy runs,
    all accounting invariants; at the end nothing held. And hits really happened."""
    totals = Counter()

    @given(OPS)
    @settings(max_examples=200, deadline=None, derandomize=True)  # the hit counts below must not be luck
    def prop(ops):
        eng = FakeEngine()
        run_ops(eng, ops)
        totals.update(eng.counts)
        totals["examples"] += 1

    prop()
    assert totals["hit_tokens"] > 0 and totals["host_hit_tokens"] > 0 and totals["loading_seen"] > 0


def test_seeded_random_workloads_reach_every_path():
    """The same checks over longer seeded workloads (hypothesis favours short ones), asserting
    that host hits, aborts while loading and failed copies all happened."""
    totals = Counter()
    for seed in range(40):
        rng = random.Random(seed)
        ops = []
        for _ in range(50):
            kind = rng.choice(["add", "add", "step", "step", "step", "complete", "complete_all",
                               "abort_loading", "abort"])
            if kind == "add":
                ops.append(("add", rng.randrange(3), [rng.randrange(10) for _ in range(rng.randrange(4))],
                            rng.randint(1, 3)))
            elif kind == "complete":
                ops.append(("complete", rng.randrange(8), rng.random() < 0.15))
            elif kind.startswith("abort"):
                ops.append((kind, rng.randrange(20)))
            else:
                ops.append((kind,))
        eng = FakeEngine()
        run_ops(eng, ops)
        totals.update(eng.counts)
    assert totals["host_hit_tokens"] > 0 and totals["loading_seen"] > 0
    assert totals["abort_loading"] > 0 and totals["failed_copies"] > 0


def test_fake_engine_scripted_host_hit_shared_load_and_abort():
    """A scripted run of the property test's machinery that must produce a host hit shared by two
    requests, one aborted while loading."""
    eng = FakeEngine()
    eng.put_doc_on_host(0)
    eng.add(0, [2, 3], 2)
    eng.add(0, [4], 2)
    eng.add(0, [5], 2)
    eng.step()  # all three admitted: one copy-in, shared
    assert len(eng.sched.loading) == 3 and len(eng.kv.copies.loads) == 1
    assert eng.kv.host_stats.hits == 0  # hits count once the load has landed, not before
    eng.abort(2)  # the third live one: seqs[3], while loading
    eng.check()
    eng.step()
    assert len(eng.sched.loading) == 2  # still loading: nothing read early
    eng.complete(0, False)
    eng.step()
    assert not eng.sched.loading and len(eng.sched.running) == 2
    assert eng.seqs[1].num_host_cached_tokens > 0 and eng.seqs[2].num_host_cached_tokens == 0
    assert eng.seqs[2].num_device_cached_tokens == eng.seqs[1].num_host_cached_tokens  # shared the load
    assert eng.seqs[3].num_cached_tokens == 0 and eng.kv.host_stats.hits == eng.seqs[1].num_host_cached_tokens
    eng.finish_all()


# ---- exception safety at the manager level -------------------------------------------------
def _manager_with_prefix_on_host(copier: Copier | None = None):
    bs = 2
    device = torch.zeros(6, 1, 2, 1, bs, 1)
    kv = KVCacheManager(6, bs, host=HostTier(8, device, copier or ThreadCopier()), offload_watermark=6)
    seq = Sequence(0, "0", 0, [1, 2, 3, 4, 5, 6, 7], SamplingParams(), 4, frozenset())
    assert kv.admit(seq, 7)
    seq.num_computed_tokens = 7
    kv.publish_computed(seq)
    kv.free(seq)
    kv.offload_cold_blocks()
    kv.drain_transfers()
    forget_device_cache(kv.pool)  # device forgets: the prefix is on host only
    return kv


def test_admission_failure_anywhere_releases_every_block_and_pin(monkeypatch):
    for fail_at in range(5):
        kv = _manager_with_prefix_on_host()
        calls = Counter()
        real = kv.pool.allocate

        def flaky(*a, **k):
            calls["n"] += 1
            if calls["n"] > fail_at:
                raise RuntimeError("injected allocation failure")
            return real(*a, **k)
        monkeypatch.setattr(kv.pool, "allocate", flaky)
        seq = Sequence(1, "1", 0, [1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(), 4, frozenset())
        raised = False
        try:
            kv.admit(seq, 8)
        except RuntimeError:
            raised = True
        monkeypatch.undo()
        if raised:
            assert not seq.block_table and kv.load_state(seq) is LoadState.READY
        else:
            kv.drain_transfers()
            kv.free(seq)
        kv.drain_transfers()
        kv.check_invariants()
        dev, host = kv.reports()
        assert dev.blocks_in_use == 0 and dev.blocks_in_flight == 0 and host.blocks_in_flight == 0
    assert raised is False  # the last round allocated everything it needed


def test_failed_copy_submission_is_a_host_miss_or_a_skipped_save():
    """A load that cannot start is a host miss (the prefix is recomputed, nothing is held, no host
    hit is counted); a save that cannot start is logged, counted and skipped: it was optional."""
    copier = ThreadCopier()
    kv = _manager_with_prefix_on_host(copier)
    real = copier.submit

    def broken(*a, **k):
        raise RuntimeError("injected submit failure")
    copier.submit = broken
    seq = Sequence(1, "1", 0, [1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(), 4, frozenset())
    assert kv.admit(seq, 8)
    assert kv.load_state(seq) is LoadState.READY and seq.num_computed_tokens == 0 and not kv.copies.loads
    assert kv.admitter.num_load_submit_failures == 1 and kv.host_stats.hits == 0 and seq.num_host_cached_tokens == 0
    kv.check_invariants()
    kv.free(seq)
    dev, host = kv.reports()
    assert dev.blocks_in_use == 0 and host.blocks_in_flight == 0
    # a save that cannot start leaves device and host blocks unpinned too
    s2 = Sequence(2, "2", 0, [9, 9, 9, 9, 9], SamplingParams(), 4, frozenset())
    assert kv.admit(s2, 5)
    s2.num_computed_tokens = 5
    kv.publish_computed(s2)
    kv.free(s2)
    assert kv.offload_cold_blocks() == 0 and kv.num_save_submit_failures == 1
    kv.check_invariants()
    assert not kv.copies.saves and kv.pool.stats().in_flight == 0 and kv.host.pool.stats().in_flight == 0
    copier.submit = real  # and saving works again afterwards
    assert kv.offload_cold_blocks() > 0
    kv.drain_transfers()
    kv.check_invariants()
    assert kv.pool.stats().clean > 0


def test_failed_copies_publish_nothing_and_the_sequence_recomputes():
    eng = FakeEngine()
    eng.put_doc_on_host(0)
    eng.add(0, [2], 3)  # document 0 comes from host: that load fails
    eng.step()
    assert len(eng.sched.loading) == 1
    eng.complete(0, True)
    eng.step()  # back to waiting, then admitted again: nothing on host any more, so it recomputes
    assert not eng.sched.loading and eng.host.transfers.failed == 1
    eng.check()
    eng.finish_all()  # content checked on every step
    index_before = dict(eng.host.pool.index)
    eng.kv.offload_watermark = eng.kv.num_blocks
    assert eng.kv.offload_cold_blocks() > 0
    eng.complete(0, True)  # the save fails
    eng.kv.poll_transfers()
    assert eng.host.pool.index == index_before and eng.host.transfers.failed == 2
    eng.check()
    assert eng.kv.pool.stats().in_flight == 0 and eng.host.pool.stats().in_flight == 0


# ---- the real engine with slowed copies --------------------------------------------------------
@pytest.fixture(scope="module")
def one_tiny(tiny_path):
    return tiny_path("llama-gqa-tied")


def _engine_with_doc_on_host(path, num_kv_blocks: int = 40):
    rng = random.Random(5)
    doc = [rng.randrange(100, 5000) for _ in range(40)]
    llm = LLM(str(path), dtype="float32", block_size=4, num_kv_blocks=num_kv_blocks, host_cache_gb=0.01,
              max_num_seqs=4)
    eng = llm.engine
    gated = GatedCopy(eng.runner.kv_cache)
    gated.gate.set()
    eng.kv.host.copier = ThreadCopier(gated)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate([doc + [7]], params)
    for i in range(4):  # push the document off the device
        llm.generate([[rng.randrange(100, 5000) for _ in range(43)]], params)
    eng.kv.drain_transfers()
    probe = eng.make_request("probe", doc + [9], params).seqs[0]
    assert [t for t, _ in eng.kv.match_prefix(probe)].count("host") >= 5
    return llm, eng, gated, doc, rng


def test_other_requests_keep_decoding_while_a_host_prefix_loads(one_tiny):
    llm, eng, gated, doc, rng = _engine_with_doc_on_host(one_tiny)
    other = [rng.randrange(100, 5000) for _ in range(6)]
    question = doc + [11, 12, 13]
    expected = hf_greedy(one_tiny, [question, other], 6)
    eng.add_request("other", other, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    eng.step()  # its prefill
    gated.gate.clear()
    gated.started.clear()
    eng.add_request("loader", question, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    other_seq, loader = eng.requests["other"].seqs[0], eng.requests["loader"].seqs[0]
    eng.step()
    assert gated.started.wait(60) and loader.status is SeqStatus.LOADING
    before = other_seq.num_output_tokens
    for _ in range(8):  # the copy is held: the loader waits, the other request decodes every step
        eng.step()
        eng.check_invariants()
    assert loader.status is SeqStatus.LOADING and loader.num_output_tokens == 0
    assert other_seq.num_output_tokens - before == 8
    gated.gate.set()
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] = o
        eng.check_invariants()
    assert outs["loader"].outputs[0].token_ids == expected[0]
    assert outs["other"].outputs[0].token_ids[:6] == expected[1]
    assert outs["loader"].num_host_cached_tokens > 0
    eng.kv.drain_transfers()
    eng.check_invariants()
    assert eng.kv.pool.stats().in_use == 0


def test_abort_while_loading_frees_everything_after_the_copy(one_tiny):
    llm, eng, gated, doc, _ = _engine_with_doc_on_host(one_tiny)
    gated.gate.clear()
    gated.started.clear()
    eng.add_request("loader", doc + [3], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    eng.step()
    assert gated.started.wait(60)
    eng.abort("loader")
    eng.check_invariants()
    dev, host = eng.kv.reports()
    # the copy holds them
    assert dev.blocks_in_use == 0 and dev.blocks_in_flight > 0 and host.blocks_in_flight > 0
    gated.gate.set()
    eng.kv.drain_transfers()
    eng.check_invariants()
    dev, host = eng.kv.reports()
    assert dev.blocks_in_use == 0 and dev.blocks_in_flight == 0 and host.blocks_in_flight == 0
    # the aborted load still completed: its blocks are now findable on device
    probe = eng.make_request("probe", doc + [9], SamplingParams(max_tokens=1)).seqs[0]
    assert [t for t, _ in eng.kv.match_prefix(probe)][:10] == ["device"] * 10


def test_failed_load_recomputes_with_identical_output(one_tiny):
    llm, eng, gated, doc, _ = _engine_with_doc_on_host(one_tiny)
    question = doc + [21, 22]
    expected = hf_greedy(one_tiny, [question], 5)[0]
    gated.gate.clear()
    gated.fail = RuntimeError
    eng.add_request("loader", question, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    eng.step()
    gated.gate.set()
    out = None
    while eng.has_unfinished():
        for o in eng.step():
            out = o
        eng.check_invariants()
    assert out.outputs[0].token_ids == expected
    assert eng.kv.host.transfers.failed == 1
    eng.kv.drain_transfers()
    eng.check_invariants()


def test_cpu_copies_are_exact_split_or_not():
    """The CPU copier's memmoves: below and above the size split over two threads (an odd size, so the
    halves are uneven), into a slab of a bigger pool, touching nothing outside it."""
    from nanoserve.kvcache.transfer import SPLIT_COPY_BYTES, copy_block_memmove
    for blocks in (3, SPLIT_COPY_BYTES // (2 * 4099) + 7):
        src = torch.randn(blocks + 4, 4099).to(torch.bfloat16)
        dst = torch.zeros_like(src)
        copy_block_memmove(src[1:blocks + 1], dst[2:blocks + 2])
        assert torch.equal(dst[2:blocks + 2], src[1:blocks + 1])
        assert not dst[:2].any() and not dst[blocks + 2:].any()


def test_copy_blocks_refuses_a_run_past_a_pool_with_the_runs_before_it_done() -> None:
    """In Python as in the C++ batch (test_kv_kernels): a run past either pool's end raises, the runs before
    it copied. (Unchecked, the slice past the end is short, and a one-block copy into an empty slice
    broadcasts: nothing copied, no error.)"""
    src, dst = torch.arange(20.0).reshape(10, 2), torch.zeros(10, 2)
    with pytest.raises(IndexError, match="outside pools of 10 -> 10 blocks"):
        copy_blocks(src, [], dst, [], pairs=[(0, 0, 2), (3, 10, 1), (4, 4, 2)])
    assert torch.equal(dst[:2], src[:2]) and not dst[2:].any()
    with pytest.raises(IndexError):
        copy_blocks(src, [9, 10], dst, [0, 1])
    with pytest.raises(IndexError):  # a negative length: empty slices, a silent no-op unchecked
        copy_blocks(src, [], dst, [], pairs=[(0, 0, -1)])
