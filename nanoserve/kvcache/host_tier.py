"""Host tier: a second KV block pool in host memory (pinned on CUDA), with its own hash index and
LRU, and the asynchronous copies between it and the device cache.

A copy is begun, runs on the copier (a CUDA copy stream or a worker thread), and is ended by the
caller once its handle is done. While it runs, every host block it reads or writes is pinned (the
pool cannot evict or hand it out), and a saved block is published to the host index only when
its copy has completed. The device side of the same rules (pinning the source of a save, holding
a load's destination until it is complete) belongs to the KV cache manager.
"""
from __future__ import annotations

import logging
import os
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from nanoserve.kvcache.block_pool import BlockHash, BlockKey, BlockPool, Span
from nanoserve.kvcache.native import KVKernels
from nanoserve.kvcache.transfer import MAX_COPY_BYTES, Copier, Transfer, copy_span, make_copier, paired_runs

log = logging.getLogger("nanoserve")
GiB = 1 << 30
# one cudaHostRegister range at most (driver page-table limits; vLLM chunks the same)
REGISTER_BYTES = 64 * GiB


@dataclass
class TransferStats:
    blocks_in: int = 0      # device -> host
    blocks_out: int = 0     # host -> device
    bytes_in: int = 0
    bytes_out: int = 0
    seconds_in: float = 0.0
    seconds_out: float = 0.0
    failed_in: int = 0      # saves that failed: nothing they touched was published
    failed_out: int = 0     # loads that failed: their prefix is recomputed

    @property
    def failed(self) -> int:
        return self.failed_in + self.failed_out


@dataclass(eq=False)
class HostCopy:
    """One in-flight batch of block copies and the blocks it holds."""
    handle: Transfer
    host_ids: list[int]
    dev_ids: list[int]
    keys: list[tuple[BlockHash, BlockKey]] = field(default_factory=list)  # saves: what to publish


# ---- host memory ------------------------------------------------------------------------------
def host_memory_available(proc: str = "/proc/meminfo", cgroup: str = "/sys/fs/cgroup") -> int:
    """Bytes this process may still take: MemAvailable, capped by the container's cgroup limit
    (v2 `memory.max`, v1 `memory/memory.limit_in_bytes`) minus what the cgroup already uses."""
    avail = 8 * GiB
    try:
        for line in open(proc):
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    root = Path(cgroup)
    for limit_f, usage_f in (("memory.max", "memory.current"),
                             ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            limit = (root / limit_f).read_text().strip()
            usage = int((root / usage_f).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 1 << 60:  # "max" / a huge v1 number mean unlimited
            avail = min(avail, max(0, int(limit) - usage))
        break
    return avail


class HostCache(NamedTuple):
    cache: torch.Tensor
    release: Callable[[], None]
    # block ranges [lo, hi), each one cudaHostRegister range; laid out (not registered) on CPU too,
    # so CPU tests check every copy against them
    ranges: list[tuple[int, int]]


def alloc_host_cache(shape: tuple[int, ...], dtype: torch.dtype, pin: bool,
                     max_copy_bytes: int = MAX_COPY_BYTES, register_bytes: int = REGISTER_BYTES) -> HostCache:
    """Host KV pool, the call that unpins it (also run when the tensor is collected; the owner
    calls it first, once no copy can still target the memory), and its pinned ranges. Pinned with
    cudaHostRegister on a plain allocation, not `pin_memory=True` (the caching host allocator rounds
    up to a power of two: 48 GiB would pin 64), in ranges of whole copy spans so that no copy
    (`transfer.copy_blocks`) crosses one. Pages are touched in parallel first, at start-up, so no
    copy page-faults inside the serving loop."""
    t0 = time.perf_counter()
    cache = torch.empty(shape, dtype=dtype)
    flat = cache.view(-1).view(torch.uint8)
    num_blocks = shape[0]
    block_bytes = flat.numel() // max(1, num_blocks)
    pieces = [(o, min(o + GiB, flat.numel())) for o in range(0, flat.numel(), GiB)]
    with ThreadPoolExecutor(min(len(pieces), os.cpu_count() or 1) or 1) as ex:  # fill_ releases the GIL
        list(ex.map(lambda c: flat[c[0]:c[1]].zero_(), pieces))
    span = copy_span(block_bytes, max_copy_bytes)
    per_range = max(1, register_bytes // (span * block_bytes)) * span
    ranges = [(lo, min(lo + per_range, num_blocks)) for lo in range(0, num_blocks, per_range)]
    release: Callable[[], None] = lambda: None  # noqa: E731
    if pin:
        cudart = torch.cuda.cudart()
        base = flat.data_ptr()
        registered = []
        try:
            for lo, hi in ranges:
                torch.cuda.check_error(cudart.cudaHostRegister(base + lo * block_bytes,
                                                               (hi - lo) * block_bytes, 0))
                registered.append(base + lo * block_bytes)
        except Exception:
            for p in registered:
                cudart.cudaHostUnregister(p)
            raise
        release = weakref.finalize(cache, _unregister, registered)
    gib = flat.numel() / GiB
    dt = time.perf_counter() - t0
    # the engine's start-up log has the tier's line; this one is per rank, and its rate is for tuning
    log.debug("host KV pool: %.2f GiB %s in %.1fs (%.2f s/GiB, %d range(s))", gib,
              "pinned" if pin else "allocated", dt, dt / max(gib, 1e-9), len(ranges))
    return HostCache(cache, release, ranges)


def _unregister(ptrs: list[int]) -> None:
    cudart = torch.cuda.cudart()
    for p in ptrs:
        cudart.cudaHostUnregister(p)


# ---- the tier ------------------------------------------------------------------------------------
class HostTier:
    def __init__(self, num_blocks: int, device_cache: torch.Tensor, copier: Copier | None = None,
                 register_bytes: int = REGISTER_BYTES, kernels: KVKernels = KVKernels()) -> None:
        self.pool = BlockPool(num_blocks, kernels)
        self.device_cache = device_cache
        self.copier = copier or make_copier(device_cache.device)
        self.cache, self._release, self.pinned_ranges = alloc_host_cache(
            (num_blocks, *device_cache.shape[1:]), device_cache.dtype, device_cache.device.type == "cuda",
            self.copier.max_copy_bytes, register_bytes)
        self.block_bytes = device_cache[0].numel() * device_cache.element_size()
        self.transfers = TransferStats()
        # a disk tier below (disk_tier.py): then a clean host block is one whose chain is on disk
        self.backed = False
        # per published block: the device index holds its chain too (copies.TierCopies keeps it), so a
        # match scans a byte per host link for device hits, not the device index (prefix.py)
        self.on_device = bytearray(num_blocks)

    @property
    def num_bytes(self) -> int:
        return self.cache.numel() * self.cache.element_size()

    def lookup(self, h: BlockHash, key: BlockKey) -> int | None:
        return self.pool.lookup(h, key)

    def close(self) -> None:
        """Let every copy submitted so far finish, then unpin the pool: unregistering memory a DMA
        still targets would corrupt the host heap. The caller ends its copies' bookkeeping first."""
        self.copier.drain()
        self._release()

    def room(self, exclude: Collection[int] = ()) -> int:
        """Blocks a save can take: free ones, and cached ones whose KV is on host only (the host
        LRU drops those). Blocks whose twin is on device are kept: evicting one gains nothing. With a
        disk below, every unpinned block: clean ones (on disk) go first. `exclude`: cached blocks not
        to count (a request's own host hits)."""
        pool = self.pool
        clean, dirty = pool.count_cached_free(exclude) if exclude else (0, 0)
        if self.backed:
            return len(pool.free) + len(pool.dirty) + len(pool.clean) - dirty - clean
        return len(pool.free) + len(pool.dirty) - dirty

    def begin_save(self, dev_ids: list[int], keys: list[tuple[BlockHash, BlockKey]]) -> HostCopy | None:
        """Start copying device blocks to host, as many as the host has room for. The caller keeps
        the device blocks unchanged until the copy ends. None if nothing could be started."""
        host_ids: list[int] = []
        try:
            while len(host_ids) < len(dev_ids) and self.room():
                host_ids.append(self.pool.allocate_pinned(keep_clean=not self.backed))
            if not host_ids:
                return None
            n = len(host_ids)
            host_ids.sort()  # `dev_ids` come in chain order: a chain lands in ascending host blocks, few runs
            handle = self.copier.submit("save", self.device_cache, dev_ids[:n], self.cache, host_ids)
        except BaseException:
            for hb in host_ids:
                self.pool.unpin(hb)
            raise
        return HostCopy(handle, host_ids, list(dev_ids[:n]), list(keys[:n]))

    def _count(self, copy: HostCopy, direction: str) -> bool:
        """Transfer counters for an ended copy ("in": a save, "out": a load); True if it succeeded."""
        t, n = self.transfers, len(copy.host_ids)
        if copy.handle.error is not None:
            setattr(t, f"failed_{direction}", getattr(t, f"failed_{direction}") + 1)
            return False
        for name, v in (("blocks", n), ("bytes", n * self.block_bytes), ("seconds", copy.handle.seconds)):
            setattr(t, f"{name}_{direction}", getattr(t, f"{name}_{direction}") + v)
        return True

    def end_save(self, copy: HostCopy) -> bool:
        """Publish a completed save (if it succeeded) and release its host blocks."""
        ok = self._count(copy, "in")
        for hb, (h, key) in zip(copy.host_ids, copy.keys):
            if ok:
                self.pool.publish(hb, h, key)
            self.pool.unpin(hb)  # unpublished (failed or duplicate): back to the free list
        if not ok:
            log.error("KV save to host failed; %d blocks dropped", len(copy.host_ids),
                      exc_info=copy.handle.error)
        return ok

    def begin_load(self, host_ids: list[int], dev_ids: list[int],
                   dev_spans: list[Span] | None = None, host_spans: list[Span] | None = None) -> HostCopy:
        """Start copying host blocks into device blocks the caller holds and keeps unread until
        the copy ends. The host blocks are pinned meanwhile. `dev_spans`: `dev_ids` as runs [start,
        stop) in order, when known (`host_spans` likewise): the copies are then cut per run, not per
        block. The copy keeps both lists: the caller hands them over."""
        host_spans = self.pool.pin_many(host_ids, host_spans)  # all or none
        try:
            pairs = paired_runs(host_spans, dev_spans) if host_spans and dev_spans else None
            handle = self.copier.submit("load", self.cache, host_ids, self.device_cache, dev_ids, pairs)
        except BaseException:
            for hb in host_ids:
                self.pool.unpin(hb)
            raise
        return HostCopy(handle, host_ids, dev_ids)

    def end_load(self, copy: HostCopy) -> bool:
        """Release a completed load's host blocks (most recently used now). A failed load also
        unpublishes them, so the prefix is recomputed rather than retried forever."""
        ok = self._count(copy, "out")
        for hb in copy.host_ids:
            if not ok:
                self.pool.unpublish(hb)
            self.pool.unpin(hb)
            self.pool.touch(hb)  # a hit: most recently used
        if not ok:
            log.error("KV load from host failed; %d blocks will be recomputed", len(copy.host_ids),
                      exc_info=copy.handle.error)
        return ok

    # blocking forms: for tests and benchmarks, never the serving loop
    def save(self, blocks: list[tuple[int, BlockHash, BlockKey]]) -> int:
        copy = self.begin_save([b for b, _, _ in blocks], [(h, k) for _, h, k in blocks])
        if copy is None:
            return 0
        copy.handle.wait()
        return len(copy.host_ids) if self.end_save(copy) else 0

    def load(self, host_ids: list[int], dev_ids: list[int]) -> bool:
        copy = self.begin_load(host_ids, dev_ids)
        copy.handle.wait()
        ok = self.end_load(copy)
        if ok:
            copy.handle.order_compute_after()
        return ok
