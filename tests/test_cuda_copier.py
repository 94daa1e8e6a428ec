"""The CUDA copier's submit (kvcache/transfer.py: CudaCopier, CudaTransfer) on CPU, with torch.cuda's streams
and events replaced by stand-ins that log what is enqueued where: the copies are ordered after what the
compute stream enqueued so far, run on their lane between the timing events (in one C++ call where the
kernels are built), `end` is recorded even after a failing copy, the compute stream waits for `end`
before reading a load's blocks, a sticky error while polling is a DeviceFault, `wait` polls until `end` or
its timeout, and `drain` synchronizes every lane."""
from __future__ import annotations

import contextlib

import pytest
import torch

from nanoserve.kvcache import transfer
from nanoserve.kvcache.transfer import CudaCopier, DeviceFault
from tests.test_cpu_kernels import kernels  # noqa: F401 - the module fixture (skips without a toolchain)


class Log:
    """What the stand-ins did, in order; `dst` is the copies' destination, read when `end` is recorded."""

    def __init__(self, dst: torch.Tensor) -> None:
        self.ops: list[tuple] = []
        self.dst = dst
        self.current: FakeStream = FakeStream(self, "compute")


class FakeStream:
    def __init__(self, log: Log, name: str) -> None:
        self.log, self.name = log, name

    def wait_event(self, event: FakeEvent) -> None:
        self.log.ops.append(("wait", self.name, event.name))

    def synchronize(self) -> None:
        self.log.ops.append(("synchronize", self.name))


class FakeEvent:
    made = 0

    def __init__(self, log: Log, enable_timing: bool = False) -> None:
        FakeEvent.made += 1
        self.log, self.name, self.timing = log, f"event{FakeEvent.made}", enable_timing
        self.fault: str | None = None
        self.pending = False  # query() says not yet

    def record(self, stream: FakeStream | None = None) -> None:
        stream = stream or self.log.current
        # (the copies run at once on CPU: what `end` sees in dst is what the lane enqueued before it)
        self.log.ops.append(("record", self.name, stream.name, self.log.dst.clone()))

    def query(self) -> bool:
        if self.fault:
            raise RuntimeError(self.fault)
        return not self.pending

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.timing and end.timing, "timing asked of events made without it"
        return 2.5  # ms

    def synchronize(self) -> None:
        self.log.ops.append(("synchronize", self.name))
        self.pending = False


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's Stream, Event, current_stream and stream() as stand-ins over one Log."""
    dst = torch.zeros(16, 2)
    log = Log(dst)

    @contextlib.contextmanager
    def stream(s: FakeStream):
        saved, log.current = log.current, s
        try:
            yield
        finally:
            log.current = saved
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: FakeStream(log, "lane"))
    monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing=False: FakeEvent(log, enable_timing))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: log.current)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    copy_async = transfer.copy_block_async  # each copy logs the stream it was enqueued on

    def logged_copy(src: torch.Tensor, dst: torch.Tensor) -> None:
        log.ops.append(("copy", log.current.name))
        copy_async(src, dst)
    monkeypatch.setattr(transfer, "copy_block_async", logged_copy)
    return log


def _submit(log: Log, copy_runs, src_ids: list[int], dst_ids: list[int]):
    src = torch.arange(32, dtype=torch.float32).reshape(16, 2)
    copier = CudaCopier(torch.device("cpu"), max_copy_bytes=3 * 8, copy_runs=copy_runs)  # spans of 3 blocks
    if copier.batch is not None:  # the C++ batch: one call for all the runs, logged like a copy
        batch = copier.batch

        def logged_batch(*args) -> None:
            log.ops.append(("copy", log.current.name))
            batch(*args)
        copier.batch = logged_batch
    handle = copier.submit("load", src, src_ids, log.dst, dst_ids)
    return src, handle


@pytest.mark.parametrize("native", [False, True], ids=["python", "kernels"])
def test_submit_orders_the_copies_between_the_compute_stream_and_its_events(fake_cuda, native, request):
    log = fake_cuda
    copy_runs = request.getfixturevalue("kernels").copy_runs if native else None
    src_ids, dst_ids = [0, 1, 2, 3, 4, 9, 10], [5, 6, 7, 8, 9, 1, 2]
    src, handle = _submit(log, copy_runs, src_ids, dst_ids)
    records = [op for op in log.ops if op[0] == "record"]
    ready, start, end = (op[1] for op in records)
    kinds = [op[:3] for op in log.ops]
    copies = 1 if native else len(transfer.runs(src_ids, dst_ids, 3))  # (spans of 3 blocks: 5 runs)
    assert native or copies == 5
    # after what compute enqueued so far: `ready` on compute, the lane waits for it, then start, the copies
    # on the lane (not on compute, in line with the model), end
    assert kinds == [("record", ready, "compute"), ("wait", "lane", ready), ("record", start, "lane"),
                     *[("copy", "lane")] * copies, ("record", end, "lane")]
    before_start, at_end = records[1][3], records[2][3]
    assert not before_start.any()  # nothing copied before `start`
    assert torch.equal(at_end[dst_ids], src[src_ids])  # every copy enqueued before `end`
    assert handle.error is None and handle.done() and handle.seconds == pytest.approx(2.5e-3)
    handle.order_compute_after()  # the compute stream waits for `end` before reading the blocks
    assert log.ops[-1][:3] == ("wait", "compute", end)


@pytest.mark.parametrize("native", [False, True], ids=["python", "kernels"])
def test_a_failing_copy_still_records_end_after_the_copies_before_it(fake_cuda, native, request):
    """A destination past the pool: the runs before it are enqueued, `end` is recorded after them (nothing
    they touch may be released before it), and the handle carries the error instead of raising."""
    log = fake_cuda
    copy_runs = request.getfixturevalue("kernels").copy_runs if native else None
    src, handle = _submit(log, copy_runs, [0, 1, 5], [3, 4, 40])
    end = [op for op in log.ops if op[0] == "record"][-1]
    assert end[2] == "lane" and torch.equal(end[3][[3, 4]], src[[0, 1]])
    assert handle.error is not None and handle.done()


def test_a_sticky_cuda_error_while_polling_is_a_device_fault(fake_cuda):
    _, handle = _submit(fake_cuda, None, [0], [0])
    handle.end.fault = "CUDA error: an illegal memory access was encountered"
    with pytest.raises(DeviceFault, match="illegal memory access"):
        handle.done()


def test_the_batch_is_the_c_kernel_given_positionally(kernels):
    """`batch_copy` hands copy_runs its arguments positionally: the kernel is a fast-call function that takes
    no keywords."""
    src, dst = torch.arange(8.0).reshape(8, 1), torch.zeros(8, 1)
    transfer.batch_copy(kernels.copy_runs, True)(src, dst, [(0, 4, 3)], 64)
    assert torch.equal(dst[4:7], src[0:3])
    with pytest.raises(TypeError):
        kernels.copy_runs(src, dst, [(0, 4, 3)], 64, non_blocking=True)


def test_wait_polls_until_end_or_its_timeout_and_drain_synchronizes_every_lane(fake_cuda):
    log = fake_cuda
    _, load = _submit(log, None, [0], [0])
    load.end.pending = True
    assert load.wait(timeout=0.01) is False and not load.done()  # (`end` not reached: the timeout answers)
    load.end.pending = False
    assert load.wait(timeout=0.01) and load.seconds == pytest.approx(2.5e-3)
    _, other = _submit(log, None, [1], [1])
    other.end.pending = True
    assert other.wait() and ("synchronize", other.end.name) in log.ops  # no timeout: blocks on `end`
    copier = CudaCopier(torch.device("cpu"))
    copier.submit("load", log.dst, [0], log.dst, [1])
    copier.submit("save", log.dst, [2], log.dst, [3])
    log.ops.clear()
    copier.drain()
    assert log.ops == [("synchronize", "lane")] * 2  # each lane opened, once
