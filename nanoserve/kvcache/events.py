"""KV cache events for routers: which blocks each tier holds, as vLLM publishes them, so that a prefix-aware
router in front of several replicas (NVIDIA Dynamo's KV router, llm-d's KV cache manager) can follow
nanoserve unchanged.

The wire format is vLLM's (vllm/distributed/kv_events.py): a batch is a msgpack array
[ts, [event, ...]], each event a tagged array: ["BlockStored", block_hashes, parent_block_hash,
token_ids, block_size, lora_id, medium], ["BlockRemoved", block_hashes, medium], ["AllBlocksCleared"].
A block's hash is its 32-byte keyed chain digest (block_pool.chain_hash): stable for the process, and
unforgeable without the key, which is never sent. The parent of a chain's first block is None; under a
cache_salt it is the salt's root digest, which no event stores: salted chains never join unsalted ones in
a router's tree, as they never share KV here. The device tier's medium is "GPU" on every device, as
routers expect it; the host tier's is "CPU".

The pools record events as they publish and drop blocks (pure Python, the engine thread); the engine
takes them once a step and hands them to its publisher (engine/kv_events.py)."""
from __future__ import annotations

import time

import msgspec

from nanoserve.kvcache.block_pool import BlockHash, BlockKey, BlockPool

MEDIUM_DEVICE, MEDIUM_HOST, MEDIUM_DISK = "GPU", "CPU", "DISK"


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class KVEventLog:
    """The events of one engine since they were last taken. Consecutive events of one kind and medium
    merge into one (a prefill's blocks stored in order, an eviction run), as vLLM batches them."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._events: list[KVCacheEvent] = [AllBlocksCleared()]  # a restarted replica forgets everything

    def watch(self, device: BlockPool, host: BlockPool | None, disk: BlockPool | None = None) -> None:
        device.events = (self, MEDIUM_DEVICE)
        if host is not None:
            host.events = (self, MEDIUM_HOST)
        if disk is not None:
            disk.events = (self, MEDIUM_DISK)

    def stored(self, h: BlockHash, key: BlockKey, medium: str) -> None:
        parent, last = key.parent, self._events[-1] if self._events else None
        if isinstance(last, BlockStored) and last.medium == medium and last.block_hashes[-1] == parent:
            last.block_hashes.append(h)
            last.token_ids.extend(key.token_ids)
            return
        self._events.append(BlockStored([h], parent, list(key.token_ids), self.block_size, None, medium))

    def removed(self, h: BlockHash, medium: str) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved) and last.medium == medium:
            last.block_hashes.append(h)
        else:
            self._events.append(BlockRemoved([h], medium))

    def take(self) -> KVEventBatch | None:
        if not self._events:
            return None
        batch, self._events = KVEventBatch(time.time(), self._events), []
        return batch
