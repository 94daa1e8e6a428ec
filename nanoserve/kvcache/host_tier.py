"""Host tier: a second KV block pool in host memory (pinned on CUDA), with its own hash index and
LRU, and the copies between it and the device cache.

Blocks arrive here from the device LRU tail *before* their device block is needed (the manager's
cleaner), and go back on a prefix hit. While a copy reads or writes a host block, that block holds
a reference, so the pool cannot hand it out; on CPU (and, for now, on CUDA: the copy stream is
synchronised before returning) a copy is complete when the call returns.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from nanoserve.kvcache.block_pool import BlockHash, BlockKey, BlockPool


@dataclass
class TransferStats:
    blocks_in: int = 0      # device -> host
    blocks_out: int = 0     # host -> device
    bytes_in: int = 0
    bytes_out: int = 0
    seconds_in: float = 0.0
    seconds_out: float = 0.0


def copy_blocks(src: torch.Tensor, src_ids: list[int], dst: torch.Tensor, dst_ids: list[int],
                stream: torch.cuda.Stream | None) -> None:
    """Copy whole blocks (all layers, K and V: one contiguous slab each) from src to dst."""
    if stream is None:
        for s, d in zip(src_ids, dst_ids):
            dst[d].copy_(src[s])  # each block is contiguous: one memcpy, no temporary
        return
    # CUDA: order after the compute that wrote the source, batch into one gather + one transfer,
    # and wait for the copy stream so nothing reads the destination early.
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        s_idx = torch.tensor(src_ids, device=src.device)
        d_idx = torch.tensor(dst_ids, device=dst.device)
        dst.index_copy_(0, d_idx, src.index_select(0, s_idx).to(dst.device, non_blocking=True))
    stream.synchronize()


class HostTier:
    def __init__(self, num_blocks: int, device_cache: torch.Tensor) -> None:
        self.pool = BlockPool(num_blocks)
        on_cuda = device_cache.device.type == "cuda"
        self.device_cache = device_cache
        # zeros, not empty: touch every page now, at start-up, rather than page-faulting inside
        # the serving loop on each block's first copy
        self.cache = torch.zeros((num_blocks, *device_cache.shape[1:]), dtype=device_cache.dtype,
                                 pin_memory=on_cuda)
        self.block_bytes = device_cache[0].numel() * device_cache.element_size()
        self.stream = torch.cuda.Stream(device_cache.device) if on_cuda else None
        self.transfers = TransferStats()

    @property
    def num_bytes(self) -> int:
        return self.cache.numel() * self.cache.element_size()

    def lookup(self, h: BlockHash, key: BlockKey) -> int | None:
        return self.pool.lookup(h, key)

    def save(self, blocks: list[tuple[int, BlockHash, BlockKey]]) -> int:
        """Copy device blocks (with their hashes) to host. Host LRU blocks are evicted to make
        room. Returns how many were saved."""
        dev_ids, host_ids, meta = [], [], []
        for dev_block, h, key in blocks:
            if self.pool.num_available() == 0:
                break
            host_ids.append(self.pool.allocate())
            dev_ids.append(dev_block)
            meta.append((h, key))
        if not dev_ids:
            return 0
        t0 = time.perf_counter()
        copy_blocks(self.device_cache, dev_ids, self.cache, host_ids, self.stream)
        self.transfers.seconds_in += time.perf_counter() - t0
        self.transfers.blocks_in += len(dev_ids)
        self.transfers.bytes_in += len(dev_ids) * self.block_bytes
        for hb, (h, key) in zip(host_ids, meta):
            self.pool.publish(hb, h, key)  # only now: the copy is complete
            self.pool.release(hb)
        return len(dev_ids)

    def load(self, host_ids: list[int], dev_ids: list[int]) -> None:
        """Copy host blocks into (freshly allocated) device blocks; refreshes their host LRU position."""
        for hb in host_ids:
            self.pool.acquire(hb)  # pinned for the copy: cannot be evicted or reused meanwhile
        t0 = time.perf_counter()
        copy_blocks(self.cache, host_ids, self.device_cache, dev_ids, self.stream)
        self.transfers.seconds_out += time.perf_counter() - t0
        self.transfers.blocks_out += len(host_ids)
        self.transfers.bytes_out += len(host_ids) * self.block_bytes
        for hb in host_ids:
            self.pool.release(hb)
