"""Block copies between KV tiers, asynchronous, with completion handles.

One interface, two implementations:
  CudaCopier    `copy_(non_blocking=True)` on a dedicated copy stream per direction ("lane"),
                ordered after the compute already enqueued by an event; completion is polled with
                `event.query()`, never `synchronize()` in the step. A CUDA error surfacing there
                is a `DeviceFault` (fatal: the context is unusable), not one failed copy.
  ThreadCopier  a worker thread per lane does the same copies (memcpy releases the GIL), so on CPU
                copies overlap the model too and CI exercises the same asynchronous bookkeeping.

A block of all layers is one contiguous slab (block-major layout), so each block is one copy with
no temporary, and a run of consecutive blocks on both sides is one copy too (`runs`: small blocks
are copied in batches, not one launch each). A copy never holds more than one *span* of blocks
(`copy_span`, at most `MAX_COPY_BYTES`) and never crosses a multiple of the span on either side;
the host pool is pinned in ranges of whole spans (host_tier.alloc_host_cache), so no copy crosses
a pinned range (the driver rejects one that does: `invalid argument`).

A copy that fails (or cannot be enqueued) stops its batch at the failing run; the handle still
completes only after the runs already started, so callers release nothing a copy may still touch.
Callers own the lifetime rules: a source block must not be overwritten and a destination block must
not be read until its transfer is `done()`.
"""
from __future__ import annotations

import ctypes
import math
import queue
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import numpy as np
import torch

from nanoserve.kvcache.block_pool import Span
from nanoserve.kvcache.native import CopyRuns

BlockCopy = Callable[[torch.Tensor, torch.Tensor], None]
Run = tuple[int, int, int]  # (src start, dst start, number of blocks)
BatchCopy = Callable[[torch.Tensor, torch.Tensor, list[Run], int], None]  # (src, dst, runs, span)
# one DMA at most: multi-MiB copies already run at full PCIe/NVLink-C2C bandwidth (vLLM's offloading
# moves whole multi-MiB blocks per copy), and a bounded copy keeps one load from monopolising a lane
MAX_COPY_BYTES = 64 << 20


class DeviceFault(BaseException):
    """A device error seen while polling a copy: the device context is unusable, so this is not an
    `Exception` a per-request handler could swallow; the engine loop stops on it."""


def copy_block(src: torch.Tensor, dst: torch.Tensor) -> None:
    dst.copy_(src)


SPLIT_COPY_BYTES = 8 << 20  # a CPU copy above this runs as two memmoves on two threads


def copy_block_memmove(src: torch.Tensor, dst: torch.Tensor) -> None:
    """CPU: a run of blocks as memmoves (GIL released) on the calling worker thread, and above
    SPLIT_COPY_BYTES half of it on a second plain thread. Not torch's `copy_`: it gives the worker an
    OpenMP team of its own whose threads spin after each copy beside the model's (on 2 cores that cost
    the server ~30% of its decode throughput with the host tier on, docqa at concurrency 8). Two threads,
    because a load into KV pages never written yet (a fresh server) is mostly page faults, taken twice
    as fast by two (one thread: a restart's round-2 TTFT ~1.4x)."""
    if not (src.device.type == dst.device.type == "cpu" and src.dtype == dst.dtype and src.shape == dst.shape
            and src.is_contiguous() and dst.is_contiguous()):
        dst.copy_(src)
        return
    n, d, s = src.numel() * src.element_size(), dst.data_ptr(), src.data_ptr()
    if n <= SPLIT_COPY_BYTES:
        ctypes.memmove(d, s, n)
        return
    half = n // 2 // 4096 * 4096
    other = threading.Thread(target=ctypes.memmove, args=(d + half, s + half, n - half), daemon=True)
    other.start()
    ctypes.memmove(d, s, half)
    other.join()


def copy_block_async(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Enqueued on the current CUDA stream (pinned host side); a plain copy on CPU."""
    dst.copy_(src, non_blocking=True)


def copy_span(block_bytes: int, max_copy_bytes: int = MAX_COPY_BYTES) -> int:
    """Blocks one copy may hold; runs are cut at its multiples, pinned ranges are made of whole spans."""
    return max(1, max_copy_bytes // max(1, block_bytes))


def copy_blocks(src: torch.Tensor, src_ids: Sequence[int], dst: torch.Tensor, dst_ids: Sequence[int],
                copy: BlockCopy = copy_block, max_copy_bytes: int = MAX_COPY_BYTES,
                pairs: list[Run] | None = None, batch: BatchCopy | None = None) -> None:
    """src[src_ids[i]] -> dst[dst_ids[i]], one `copy` per run consecutive on both sides within a span.
    `pairs`: those runs (uncut by spans) when the caller knows them (`paired_runs`); the ids are then
    not read. `batch`: the C++ kernel that cuts and copies all runs in one call (`batch_copy`), in place
    of `copy`. Raises at the first failing run (the runs before it are done, or queued on CUDA)."""
    span = copy_span(math.prod(src.shape[1:]) * src.element_size(), max_copy_bytes)
    if batch is not None:
        batch(src, dst, runs(src_ids, dst_ids) if pairs is None else pairs, span)
        return
    for s, d, n in (runs(src_ids, dst_ids, span) if pairs is None else cut_runs(pairs, span)):
        # checked: a slice past a pool's end is short, and a copy into it broadcasts without an error
        if min(s, d, n) < 0 or s + n > len(src) or d + n > len(dst):
            raise IndexError(f"a copy of blocks [{s}, {s + n}) -> [{d}, {d + n}) is outside pools of "
                             f"{len(src)} -> {len(dst)} blocks")
        copy(src[s:s + n], dst[d:d + n])


def batch_copy(copy_runs: CopyRuns | None, non_blocking: bool) -> BatchCopy | None:
    """`copy_blocks`' `batch` from the C++ `copy_runs` (native.py), None without it: the runs cut and each
    copied with `copy_` (`non_blocking`: enqueued on the current CUDA stream) without a Python slice per
    run, whose dispatch on a cold cache costs several microseconds apiece."""
    if copy_runs is None:
        return None
    return lambda src, dst, pairs, span: copy_runs(src, dst, pairs, span, non_blocking)  # (positional only)


def paired_runs(src_spans: list[Span], dst_spans: list[Span]) -> list[Run]:
    """Two cuts of the same blocks in order into runs of consecutive ids, one per side: the runs
    consecutive on both. Per run, not per block: a load's sides come as runs (extents.py, spans_of)."""
    out: list[Run] = []
    i = j = 0
    (s, s_end), (d, d_end) = src_spans[0], dst_spans[0]
    while True:
        n = min(s_end - s, d_end - d)
        out.append((s, d, n))
        s, d = s + n, d + n
        if s == s_end:
            i += 1
            if i == len(src_spans):
                if d != d_end or j != len(dst_spans) - 1:
                    raise ValueError("paired_runs: the destination has more blocks than the source")
                return out
            s, s_end = src_spans[i]
        if d == d_end:
            j += 1
            if j == len(dst_spans):
                raise ValueError("paired_runs: the source has more blocks than the destination")
            d, d_end = dst_spans[j]


def cut_runs(pairs: list[Run], span: int) -> list[Run]:
    """Runs also ended before either side reaches a multiple of `span` (as `runs` cuts them)."""
    out: list[Run] = []
    for s, d, n in pairs:
        while n:
            k = min(n, span - s % span, span - d % span)
            out.append((s, d, k))
            s, d, n = s + k, d + k, n - k
    return out


def runs(src_ids: Sequence[int], dst_ids: Sequence[int], span: int = 0) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) of the maximal runs consecutive on both sides; with `span`, a
    run also ends before either side reaches a multiple of it. Vectorized: a load of thousands of
    blocks is cut here on the step path (CUDA submits from the engine thread)."""
    n = len(src_ids)
    if not n:
        return []
    # ufuncs and array methods only: numpy's Python-level wrappers (diff, flatnonzero) cost more than
    # the arrays' work here, a few runs of a few thousand blocks
    s, d = np.array(src_ids, np.int64), np.array(dst_ids, np.int64)
    cut = (s[1:] - s[:-1] != 1) | (d[1:] - d[:-1] != 1)
    if span:
        cut |= (s[1:] % span == 0) | (d[1:] % span == 0)
    starts = [0, *(cut.nonzero()[0] + 1).tolist()]
    lengths = [b - a for a, b in zip(starts, starts[1:] + [n])]
    return list(zip(s[starts].tolist(), d[starts].tolist(), lengths))


def copy_or_error(src: torch.Tensor, src_ids: Sequence[int], dst: torch.Tensor, dst_ids: Sequence[int],
                  copy: BlockCopy, max_copy_bytes: int, pairs: list[Run] | None = None,
                  batch: BatchCopy | None = None) -> BaseException | None:
    """`copy_blocks`, with its failure returned for the handle instead of raised: both copiers then
    complete the handle after whatever part of the batch was started, never before."""
    try:
        copy_blocks(src, src_ids, dst, dst_ids, copy, max_copy_bytes, pairs, batch)
    except Exception as e:
        return e
    return None


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
    def __init__(self, max_copy_bytes: int = MAX_COPY_BYTES) -> None:
        self._lanes: dict[str, object] = {}
        self.max_copy_bytes = max_copy_bytes  # the host tier pins its pool in ranges of whole spans of it

    def _lane(self, name: str):
        if (lane := self._lanes.get(name)) is None:
            lane = self._lanes[name] = self._open_lane(name)
        return lane

    @abstractmethod
    def _open_lane(self, name: str):
        """What runs one lane's copies in order (a worker's queue, a CUDA stream)."""

    @abstractmethod
    def submit(self, lane: str, src: torch.Tensor, src_ids: Sequence[int], dst: torch.Tensor,
               dst_ids: Sequence[int], pairs: list[Run] | None = None) -> Transfer:
        """Start copying blocks src[src_ids[i]] -> dst[dst_ids[i]]; copies in one lane run in order.
        `pairs`: the ids as runs, when the caller knows them (`copy_blocks`). A failing copy does not
        raise here: the handle reports it once the batch has stopped."""

    def drain(self) -> None:
        """Block until every copy submitted so far has finished (shutdown)."""


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
        handle, fn, max_copy_bytes, src, src_ids, dst, dst_ids, pairs = job
        t0 = time.perf_counter()
        try:
            handle.error = copy_or_error(src, src_ids, dst, dst_ids, fn, max_copy_bytes, pairs)
        except BaseException as e:  # even so the handle completes: the bookkeeping rolls back
            handle.error = e
        handle.seconds = time.perf_counter() - t0
        handle._event.set()


def _stop_worker(jobs: queue.SimpleQueue, worker: threading.Thread) -> None:
    jobs.put(None)
    if worker is not threading.current_thread():
        worker.join(timeout=10)


class ThreadCopier(Copier):
    """`block_copy` is injectable so tests can slow or fail copies without sleeps in this code."""

    def __init__(self, block_copy: BlockCopy = copy_block_memmove,
                 max_copy_bytes: int = MAX_COPY_BYTES) -> None:
        super().__init__(max_copy_bytes)
        self.block_copy = block_copy
        self._last: dict[str, Transfer] = {}  # lanes are FIFO: the last one done means all are

    def drain(self) -> None:
        for handle in self._last.values():
            handle.wait()

    def _open_lane(self, name: str) -> queue.SimpleQueue:
        jobs: queue.SimpleQueue = queue.SimpleQueue()
        worker = threading.Thread(target=_worker, args=(jobs,), daemon=True, name=f"nanoserve-kv-{name}")
        worker.start()
        # the thread ends with its copier, and is joined at interpreter exit: a daemon thread
        # killed inside a torch copy aborts the process ("terminate called ...")
        weakref.finalize(self, _stop_worker, jobs, worker)
        return jobs

    def submit(self, lane, src, src_ids, dst, dst_ids, pairs=None) -> Transfer:
        handle = self._last[lane] = ThreadTransfer()
        ids = (list(src_ids), list(dst_ids)) if pairs is None else ((), ())  # (the caller's may change)
        self._lane(lane).put((handle, self.block_copy, self.max_copy_bytes, src, ids[0], dst, ids[1], pairs))
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
            except RuntimeError as e:  # sticky CUDA error (maybe from compute): nothing is trustworthy
                raise DeviceFault(f"CUDA error while polling a KV copy: {e}") from e
            if self._done:
                self.seconds = self.start.elapsed_time(self.end) / 1000
        return self._done

    def wait(self, timeout: float | None = None) -> bool:
        """Only when the engine has nothing else to run; polls, so `timeout` is honoured."""
        if timeout is None:
            self.end.synchronize()
            return self.done()
        deadline = time.monotonic() + timeout
        while not self.done():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.0005)
        return True

    def order_compute_after(self) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.end)


class CudaCopier(Copier):
    def __init__(self, device: torch.device, max_copy_bytes: int = MAX_COPY_BYTES,
                 copy_runs: CopyRuns | None = None) -> None:
        super().__init__(max_copy_bytes)
        self.device = device
        self.batch = batch_copy(copy_runs, non_blocking=True)  # a submit's copies in one C++ call

    def _open_lane(self, name: str) -> torch.cuda.Stream:
        return torch.cuda.Stream(self.device)

    def drain(self) -> None:
        for stream in self._lanes.values():
            stream.synchronize()

    def submit(self, lane, src, src_ids, dst, dst_ids, pairs=None) -> Transfer:
        stream = self._lane(lane)
        # after everything compute has enqueued so far: the step that wrote a saved block, and the
        # last reads of a block that is now a load's destination
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        stream.wait_event(ready)
        with torch.cuda.stream(stream):
            start.record(stream)
            # contiguous slabs inside one pinned range each; a failure still records `end` after the
            # runs already queued, so nothing they touch is released before the DMA has finished
            error = copy_or_error(src, src_ids, dst, dst_ids, copy_block_async, self.max_copy_bytes, pairs,
                                  self.batch)
            end.record(stream)
        handle = CudaTransfer(self.device, start, end)
        handle.error = error
        return handle


def make_copier(device: torch.device, copy_runs: CopyRuns | None = None) -> Copier:
    """CUDA: `copy_runs`, the C++ kernel where built, submits each batch in one call (the CPU copier's
    worker copies with memmove instead: see `copy_block_memmove`)."""
    return CudaCopier(device, copy_runs=copy_runs) if device.type == "cuda" else ThreadCopier()
