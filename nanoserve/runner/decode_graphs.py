"""CUDA graphs of the padded pure-decode forward, one per batch-size bucket: captured largest first
into one memory pool, each writing its rows of one shared static logits output, and only attempted
once a sync-checked eager run of every bucket says nothing can make a capture fail."""
from __future__ import annotations

import contextlib
import logging
from typing import Callable, ContextManager

import torch

log = logging.getLogger("nanoserve")


def decode_buckets(max_num_seqs: int) -> list[int]:
    """nano-vLLM's buckets: 1, 2, 4, 8, then every 16, up to max_num_seqs (always included)."""
    b = [x for x in (1, 2, 4, 8) if x < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return b + [max_num_seqs]


@contextlib.contextmanager
def cuda_sync_errors():
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


class DecodeGraphs:
    def __init__(self, device: torch.device, attn: object, prepare: Callable[[int], None],
                 forward: Callable[[int], torch.Tensor | None]) -> None:
        """`prepare(bucket)`: stage a padded decode batch of that size (inputs and attention
        metadata); `forward(bucket)`: the padded decode forward, reading only persistent device
        buffers (logits, or None on tensor-parallel ranks other than 0)."""
        self.device, self.attn, self.prepare, self.forward = device, attn, prepare, forward
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: torch.Tensor | None = None  # the static output every bucket's graph writes
        self.failed: dict[int, torch.cuda.CUDAGraph] | None = None  # set by a failed capture

    def blocker(self, bucket: int, sync_guard: Callable[[], ContextManager]) -> str | None:
        """Run one bucket's padded decode forward eagerly under `sync_guard` (CUDA:
        torch.cuda.set_sync_debug_mode("error")), which raises on any host sync: a sync inside a
        capture invalidates it, and on torch < 2.12 a failed capture leaves the caching allocator
        believing a capture is underway (pytorch#180395). -> None if capture is safe, else why not.
        Also the warm-up each bucket needs before its capture."""
        if not getattr(self.attn, "graph_safe", False):
            return f"the {type(self.attn).__name__} module declares its decode path not graph-safe"
        self.prepare(bucket)
        try:
            with sync_guard(), torch.inference_mode():
                self.forward(bucket)
        except RuntimeError as e:
            return f"the decode forward syncs with the host ({e})"
        return None

    def capture(self, buckets: list[int]) -> None:
        """CUDA: capture each bucket's padded decode forward, largest first into one pool, after a
        sync-checked eager warm-up; a capture is only attempted once nothing can make it fail."""
        buckets = sorted(buckets, reverse=True)
        for b in buckets:
            why = self.blocker(b, cuda_sync_errors)
            if why is not None:
                log.warning("decode steps run eager (no CUDA graphs): %s", why)
                return
        torch.cuda.synchronize(self.device)
        with torch.inference_mode():
            first = self.forward(buckets[0])  # None on tensor-parallel ranks other than 0
            self.logits = first.clone() if first is not None else None
        stream = torch.cuda.current_stream(self.device)
        pool = torch.cuda.graph_pool_handle()
        for b in buckets:
            graph = torch.cuda.CUDAGraph()
            self.prepare(b)  # the attention metadata views of this bucket's shape
            try:
                with torch.inference_mode(), torch.cuda.graph(graph, pool=pool):
                    out = self.forward(b)
                    if self.logits is not None:
                        self.logits[:b].copy_(out)
            except Exception as e:  # noqa: BLE001 - should not happen after the check above
                self._abandon(pool, stream, e)
                return
            self.graphs[b] = graph
        log.info("captured decode CUDA graphs for batch sizes %s (%s)", sorted(self.graphs),
                 type(self.attn).__name__)

    def replay(self, bucket: int) -> torch.Tensor | None:
        """The captured forward of a staged, prepared batch of this bucket."""
        self.graphs[bucket].replay()
        return self.logits[:bucket] if self.logits is not None else None

    def _abandon(self, pool, stream, e: Exception) -> None:
        """Graphs off. No empty_cache or new capture after this: on torch < 2.12 the allocator may
        still route to the pool; end that (private API, where it exists) and restore the stream."""
        log.warning("CUDA graph capture failed (%s: %s): decode steps run eager", type(e).__name__, e)
        self.failed, self.graphs = self.graphs, {}  # kept alive: no pool release mid-failure
        with contextlib.suppress(Exception):
            torch._C._cuda_endAllocateToPool(self.device.index or torch.cuda.current_device(), pool)
        torch.cuda.set_stream(stream)
