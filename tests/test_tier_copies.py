"""Tier copies that fit the memory they touch: every copy stays inside one pinned host range and one
span, a failing copy releases nothing before the part of its batch already started has finished,
and a chain saved in table order loads back as a few long copies. Copies run on the real worker
thread behind gates the test opens; nothing here depends on the machine's speed."""
from __future__ import annotations

import random
import threading

import torch

from nanoserve import SamplingParams
from nanoserve.kvcache.block_pool import BlockKey, chain_hash
from nanoserve.kvcache.host_tier import HostTier
from nanoserve.kvcache.manager import KVCacheManager
from nanoserve.kvcache.transfer import ThreadCopier
from nanoserve.scheduler import Scheduler
from nanoserve.sequence import Sequence
from tests.test_transfer import _oracle

BS = 2  # tokens per block


class RangeCheckingCopy:
    """A block copy that, like the CUDA driver, rejects a copy whose host side is not inside one
    pinned range, and records every copy as (direction, host start, blocks, device start)."""

    def __init__(self) -> None:
        self.tier: HostTier | None = None
        self.copies: list[tuple[str, int, int, int]] = []
        self.rejected: list[tuple[int, int]] = []

    def _block(self, t: torch.Tensor, base: torch.Tensor) -> int:
        return (t.data_ptr() - base.data_ptr()) // (base[0].numel() * base.element_size())

    def __call__(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        host = self.tier.cache
        saving = dst.untyped_storage().data_ptr() == host.untyped_storage().data_ptr()
        slab, other = (dst, src) if saving else (src, dst)
        lo, n = self._block(slab, host), slab.shape[0]
        if not any(a <= lo and lo + n <= b for a, b in self.tier.pinned_ranges):
            self.rejected.append((lo, n))
            raise RuntimeError("CUDA error: invalid argument (copy crosses a pinned range)")
        self.copies.append(("save" if saving else "load", lo, n, self._block(other, self.tier.device_cache)))
        dst.copy_(src)


def _engine(dev_blocks: int, host_blocks: int, block_copy, max_copy_blocks: int, range_blocks: int):
    device = torch.zeros(dev_blocks, 1, 2, 1, BS, 1)
    block_bytes = device[0].numel() * device.element_size()
    host = HostTier(host_blocks, device,
                    ThreadCopier(block_copy, max_copy_bytes=max_copy_blocks * block_bytes),
                    register_bytes=range_blocks * block_bytes)
    kv = KVCacheManager(dev_blocks, BS, host=host)
    return device, host, kv, Scheduler(kv, max_num_seqs=3, max_num_batched_tokens=16)


def _run(device: torch.Tensor, kv: KVCacheManager, sched: Scheduler, prompts: list[list[int]]) -> None:
    """Serve `prompts` to the end; the stand-in model writes each block's KV as a function of its
    whole prefix and checks every block it attends to, so a wrong or missing copy is caught."""
    seqs = [Sequence(i, str(i), 0, p, SamplingParams(), 2, frozenset()) for i, p in enumerate(prompts)]
    for seq in seqs:
        sched.add(seq)
    for _ in range(1000):
        if not (sched.waiting or sched.running or sched.loading):
            break
        out = sched.schedule()
        kv.offload_cold_blocks(sched.kv_demand())
        if not out.scheduled:
            sched.wait_for_transfers(5.0)
            continue
        for s in out.scheduled:
            seq, start = s.seq, s.seq.num_computed_tokens
            for j in range(start // BS):
                assert device[seq.block_table[j]].eq(_oracle(seq.token_ids[:(j + 1) * BS])).all()
            end = start + s.num_tokens
            for j in range(start // BS, end // BS):
                device[seq.block_table[j]] = _oracle(seq.token_ids[:(j + 1) * BS])
            seq.num_computed_tokens = end
            kv.publish_computed(seq)
        for s in out.scheduled:
            seq = s.seq
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(sum(seq.token_ids[-2:]) % 10)
                if seq.num_output_tokens >= seq.max_tokens:
                    sched.finish(seq)
        sched.check_invariants()
    assert all(s.is_finished for s in seqs), "workload never drained"
    kv.drain_transfers()
    sched.check_invariants()


def test_copies_stay_inside_pinned_ranges_and_still_merge():
    """Small pinned ranges (8 blocks) and spans (4 blocks): documents pushed to host and loaded back
    through the manager never produce a copy the driver would reject, and runs still merge."""
    copy = RangeCheckingCopy()
    device, host, kv, sched = _engine(16, 40, copy, max_copy_blocks=4, range_blocks=9)
    copy.tier = host
    assert host.pinned_ranges == [(0, 8), (8, 16), (16, 24), (24, 32), (32, 40)]  # whole spans: 9 -> 8
    rng = random.Random(0)
    docs = [[rng.randrange(100) for _ in range(13)] for _ in range(5)]
    for _ in range(3):  # 5 documents of 6 full blocks on a 16-block device: each round reloads from host
        _run(device, kv, sched, [doc + [d] for d, doc in enumerate(docs)])
    assert copy.rejected == [] and host.transfers.failed == 0
    assert kv.host_stats.hits > 0 and host.transfers.blocks_in > 0
    assert max(n for _, _, n, _ in copy.copies) > 1  # runs merge up to a span
    assert all(n <= 4 and (lo % 4) + n <= 4 for _, lo, n, _ in copy.copies)  # never across a span
    loads = [c for c in copy.copies if c[0] == "load"]
    assert len(loads) < sum(n for _, _, n, _ in loads)  # fewer copies than blocks loaded


def test_a_failing_copy_holds_its_blocks_until_the_started_part_has_finished():
    """Run 1 of a save is held open, run 2 fails: the handle is not done (nothing released) while
    run 1 still copies, then reports the error; nothing is published and every pin is released."""
    gate, started = threading.Event(), threading.Event()
    calls = []

    def copy(src: torch.Tensor, dst: torch.Tensor) -> None:
        calls.append(src.shape[0])
        if len(calls) == 1:
            started.set()
            assert gate.wait(60)
            dst.copy_(src)
        else:
            raise RuntimeError("CUDA error: invalid argument")
    device = torch.randn(8, 1, 2, 1, BS, 1)
    tier = HostTier(8, device, ThreadCopier(copy))
    keys = [(chain_hash(None, (i,)), BlockKey.of(None, (i,))) for i in range(3)]
    save = tier.begin_save([0, 1, 5], keys)  # runs: blocks 0-1, then block 5
    assert started.wait(60)
    assert not save.handle.done() and all(tier.pool.pins[b] == 1 for b in save.host_ids)
    gate.set()
    assert save.handle.wait(60) and save.handle.error is not None and calls == [2, 1]
    assert tier.end_save(save) is False
    assert all(tier.lookup(*k) is None for k in keys) and not any(tier.pool.pins)
    assert tier.transfers.failed_in == 1 and tier.pool.stats().free == 8


def test_a_chain_saved_in_table_order_loads_back_in_few_copies():
    """A freed sequence sits in the LRU tail first; its save still lands in ascending host blocks in
    table order, so saving and then loading its 6 blocks is one copy each way, not six."""
    copy = RangeCheckingCopy()
    device, host, kv, sched = _engine(16, 32, copy, max_copy_blocks=64, range_blocks=64)
    copy.tier = host
    doc = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9]  # 6 full blocks + 1 token
    _run(device, kv, sched, [doc])
    kv.offload_watermark = kv.num_blocks
    kv.offload_cold_blocks()
    kv.drain_transfers()
    saves = [c for c in copy.copies if c[0] == "save"]
    assert sum(n for _, _, n, _ in saves) >= 6 and len(saves) == 1
    for block in kv.pool.lru():  # the document is on host only now
        kv.pool.unpublish(block)
    kv.offload_watermark = 0
    _run(device, kv, sched, [doc + [7]])
    loads = [c for c in copy.copies if c[0] == "load"]
    assert sum(n for _, _, n, _ in loads) == 6 and len(loads) == 1
    assert kv.host_stats.hits == 6 * BS


def test_cpu_admission_waits_for_its_saves_instead_of_deferring_a_step():
    """A request that needs dirty blocks saved first: with inline copies (CPU) the scheduler waits
    for those saves and runs it in the same step; without (CUDA) it is deferred to a later step.
    Either way nothing is dropped."""
    for inline in (False, True):
        device, host, kv, sched = _engine(6, 16, lambda src, dst: dst.copy_(src), 64, 64)
        seq = Sequence(100, "fill", 0, list(range(12)), SamplingParams(), 1, frozenset())
        assert kv.admit(seq, 12)
        seq.num_computed_tokens = 12
        kv.publish_computed(seq)
        kv.free(seq)  # six dirty cached blocks, nothing on host
        sched.inline_loads = inline
        sched.inline_load_wait = 60.0  # the memcpy ends long before: nothing depends on speed
        new = Sequence(1, "1", 0, [50, 51, 52, 53, 54], SamplingParams(), 1, frozenset())
        sched.add(new)
        out = sched.schedule()
        assert [s.seq for s in out.scheduled] == ([new] if inline else [])
        assert kv.policy.num_deferred == 1 and kv.pool.num_lossy_evictions == 0
        kv.drain_transfers()
        if not inline:
            assert [s.seq for s in sched.schedule().scheduled] == [new]
        sched.check_invariants()
