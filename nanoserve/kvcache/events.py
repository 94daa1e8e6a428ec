"""KV cache events for routers: which blocks each tier holds, as vLLM publishes them, so that a prefix-aware
router in front of several replicas (NVIDIA Dynamo's KV router, llm-d's KV cache manager) can follow
nanoserve unchanged.

The wire format is vLLM 0.32's (vllm/distributed/kv_events.py), which its own decoder reads: a batch is a
msgpack array [ts, [event, ...], data_parallel_rank], each event a map tagged by its "type" (BlockStored,
BlockRemoved, AllBlocksCleared) with vLLM's field names; fields vLLM leaves at their defaults are left
out, the others sent as vLLM fills them (lora_id and lora_name null: no LoRA here; group_idx 0: one KV
cache group; extra_keys one entry per block). A block's hash is its keyed chain digest
(block_pool.chain_hash), unforgeable without the key, which is never sent: as a 64-bit int (its last 8
bytes, big-endian: vLLM's default) or the 32 bytes, by $VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES (read into the
engine's config). Media: the device tier is "GPU" on every device, as routers expect; the host tier is
"CPU"; the disk tier "STORAGE".

Salted chains (cache_salt): vLLM announces a salted chain's first block with parent None and the salt in
its extra_keys, so a router that checks parents roots the chain. nanoserve's cache is shared by tenants
and the event stream is not theirs to read, so the raw salt is never published: the extra key is the
salt's keyed digest (prefix.PrefixChains.salt_id, hex), which names the salt to a router (equal salts,
equal ids, for the process and, with a disk tier, across restarts) without revealing or letting anyone
test guesses of it. The chain's parent inside nanoserve (the salt's root digest) is recognized by its
keyed mark, so no state is kept per salt.

The pools record events as they publish and drop blocks (pure Python, the engine thread); the engine
takes them after each step and while idle, and hands them to its publisher (engine/kv_events.py)."""
from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import msgspec

from nanoserve.kvcache.block_pool import BlockHash, BlockKey, BlockPool

MEDIUM_DEVICE, MEDIUM_HOST, MEDIUM_DISK = "GPU", "CPU", "STORAGE"
WireHash = bytes | int


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[WireHash]
    parent_block_hash: WireHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[WireHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


class KVEventLog:
    """The events of one engine since they were last taken. Consecutive events of one kind and medium
    merge into one (a prefill's blocks stored in order, an eviction run), as vLLM batches them.
    `salt_id`: the published id of a salted chain's root (a parent no block has), else None."""

    def __init__(self, block_size: int, int_hashes: bool, salt_id: Callable[[BlockHash], str | None]) -> None:
        self.block_size, self.int_hashes, self.salt_id = block_size, int_hashes, salt_id
        self._events: list[KVCacheEvent] = [AllBlocksCleared()]  # a restarted replica forgets everything
        self._tail: BlockHash | None = None  # the last block of the last event, if it stored a run

    def wire(self, h: BlockHash) -> WireHash:
        return int.from_bytes(h[-8:], "big") if self.int_hashes else h

    def watch(self, device: BlockPool, host: BlockPool | None, disk: BlockPool | None = None) -> None:
        """Record what these tiers store and drop from now on, after what they hold already (a disk index
        restored at start)."""
        for pool, medium in ((device, MEDIUM_DEVICE), (host, MEDIUM_HOST), (disk, MEDIUM_DISK)):
            if pool is not None:
                self.announce(pool, medium)
                pool.events = (self, medium)

    def announce(self, pool: BlockPool, medium: str) -> None:
        """Store events for every block the pool holds, each chain parent first (a router that checks
        parents drops a block whose parent it has not seen)."""
        children: dict[BlockHash | None, list[int]] = defaultdict(list)
        for h, block in pool.index.items():
            parent = pool.block_key[block].parent
            children[parent if parent in pool.index else None].append(block)
        todo = children[None][::-1]
        while todo:  # depth first, so a chain goes out as one run
            block = todo.pop()
            h = pool.block_hash[block]
            self.stored(h, pool.block_key[block], medium)
            todo += children[h][::-1]

    def stored(self, h: BlockHash, key: BlockKey, medium: str) -> None:
        parent, last = key.parent, self._events[-1] if self._events else None
        if parent is not None and parent == self._tail and isinstance(last, BlockStored) and last.medium == medium:
            last.block_hashes.append(self.wire(h))
            last.token_ids.extend(key.token_ids)
            last.extra_keys.append(None)
        else:
            salt = self.salt_id(parent) if parent is not None else None
            self._events.append(BlockStored(
                [self.wire(h)], None if parent is None or salt else self.wire(parent), list(key.token_ids),
                self.block_size, None, medium, None, [(salt,) if salt else None], 0))
        self._tail = h

    def removed(self, h: BlockHash, medium: str) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved) and last.medium == medium:
            last.block_hashes.append(self.wire(h))
        else:
            self._events.append(BlockRemoved([self.wire(h)], medium, 0))
        self._tail = None

    def take(self) -> KVEventBatch | None:
        if not self._events:
            return None
        batch, self._events, self._tail = KVEventBatch(time.time(), self._events, 0), [], None
        return batch
