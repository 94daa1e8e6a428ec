"""Block copies between KV tiers, asynchronous, with completion handles.

One interface, two implementations:
  CudaCopier    per-block `copy_(non_blocking=True)` on a dedicated copy stream per direction
                ("lane"), ordered after the compute already enqueued by an event; completion is
                polled with `event.query()`, never `synchronize()`.
  ThreadCopier  a worker thread per lane does the same copies (memcpy releases the GIL), so on CPU
                copies overlap the model too and CI exercises the same asynchronous bookkeeping.

A block of all layers is one contiguous slab (block-major layout), so each block is one copy with
no temporary. Callers own the lifetime rules: a source block must not be overwritten and a
destination block must not be read until its transfer is `done()`.
"""
from __future__ import annotations

import queue
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import torch

BlockCopy = Callable[[torch.Tensor, torch.Tensor], None]


def copy_block(src: torch.Tensor, dst: torch.Tensor) -> None:
    dst.copy_(src)


class Transfer(ABC):
    """Completion handle of one batch of block copies."""
    error: BaseException | None = None
    seconds: float = 0.0   # time the copies took (device time on CUDA), valid once done

    @abstractmethod
    def done(self) -> bool:
        """True once the copies finished (or failed: see `error`). Never blocks."""

    @abstractmethod
    def wait(self, timeout: float | None = None) -> bool:
        """Block until done (tests, and an engine with nothing else to run). False on timeout."""

    def order_compute_after(self) -> None:
        """Make the compute stream wait for this copy before it reads the destination."""


class Copier(ABC):
    @abstractmethod
    def submit(self, lane: str, src: torch.Tensor, src_ids: Sequence[int], dst: torch.Tensor,
               dst_ids: Sequence[int]) -> Transfer:
        """Start copying blocks src[src_ids[i]] -> dst[dst_ids[i]]; copies in one lane run in order."""


# ---- CPU: worker threads ---------------------------------------------------------------------
class ThreadTransfer(Transfer):
    def __init__(self) -> None:
        self._event = threading.Event()

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)


def _worker(jobs: queue.SimpleQueue) -> None:
    while (job := jobs.get()) is not None:
        handle, fn, src, src_ids, dst, dst_ids = job
        t0 = time.perf_counter()
        try:
            for s, d in zip(src_ids, dst_ids):
                fn(src[s], dst[d])
        except BaseException as e:  # reported through the handle; the bookkeeping rolls back
            handle.error = e
        handle.seconds = time.perf_counter() - t0
        handle._event.set()


def _stop_worker(jobs: queue.SimpleQueue, worker: threading.Thread) -> None:
    jobs.put(None)
    if worker is not threading.current_thread():
        worker.join(timeout=10)


class ThreadCopier(Copier):
    """`block_copy` is injectable so tests can slow or fail copies without sleeps in this code."""

    def __init__(self, block_copy: BlockCopy = copy_block) -> None:
        self.block_copy = block_copy
        self._lanes: dict[str, queue.SimpleQueue] = {}

    def submit(self, lane, src, src_ids, dst, dst_ids) -> Transfer:
        jobs = self._lanes.get(lane)
        if jobs is None:
            jobs = self._lanes[lane] = queue.SimpleQueue()
            worker = threading.Thread(target=_worker, args=(jobs,), daemon=True, name=f"nanoserve-kv-{lane}")
            worker.start()
            # the thread ends with its copier, and is joined at interpreter exit: a daemon thread
            # killed inside a torch copy aborts the process ("terminate called ...")
            weakref.finalize(self, _stop_worker, jobs, worker)
        handle = ThreadTransfer()
        jobs.put((handle, self.block_copy, src, list(src_ids), dst, list(dst_ids)))
        return handle


# ---- CUDA: copy streams and events -----------------------------------------------------------
class CudaTransfer(Transfer):
    def __init__(self, device: torch.device, start: torch.cuda.Event, end: torch.cuda.Event) -> None:
        self.device, self.start, self.end = device, start, end
        self._done = False

    def done(self) -> bool:
        if not self._done:
            try:
                self._done = self.end.query()
            except RuntimeError as e:  # a CUDA error surfaces here: fail this transfer
                self.error, self._done = e, True
            if self._done and self.error is None:
                self.seconds = self.start.elapsed_time(self.end) / 1000
        return self._done

    def wait(self, timeout: float | None = None) -> bool:
        self.end.synchronize()  # only when the engine has nothing else to run
        return self.done()

    def order_compute_after(self) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.end)


class CudaCopier(Copier):
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._streams: dict[str, torch.cuda.Stream] = {}

    def submit(self, lane, src, src_ids, dst, dst_ids) -> Transfer:
        stream = self._streams.get(lane)
        if stream is None:
            stream = self._streams[lane] = torch.cuda.Stream(self.device)
        # after everything compute has enqueued so far: the step that wrote a saved block, and the
        # last reads of a block that is now a load's destination
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        stream.wait_event(ready)
        with torch.cuda.stream(stream):
            start.record(stream)
            for s, d in zip(src_ids, dst_ids):
                dst[d].copy_(src[s], non_blocking=True)  # one contiguous slab; pinned host side
            end.record(stream)
        return CudaTransfer(self.device, start, end)


def make_copier(device: torch.device) -> Copier:
    return CudaCopier(device) if device.type == "cuda" else ThreadCopier()
