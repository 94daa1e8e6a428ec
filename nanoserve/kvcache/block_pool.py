"""Block bookkeeping for one KV tier: ref counts, a hash index of full blocks, an LRU of free
cached blocks. Pure Python, no tensors: the tensors live with the runner (device) or the host tier.

Block keys: `chain_hash` is a keyed cryptographic digest (blake2b) of the parent block's digest and
this block's token ids, so a digest names a whole prefix and cannot be forged or predicted by a
client (the key is a per-process random salt). A lookup also compares the stored `BlockKey`
(parent digest + tokens): a hit is a verified chain link, never a digest match alone.

Every block is in exactly one state:
  in use      ref_count > 0
  in flight   ref_count == 0 but pinned by a tier copy that reads or writes it: not reusable until
              the copy completes. A published one stays in `lru` at its place (and findable), but
              `allocate` passes over it; an unpublished one is in `held`.
  cached-free ref_count == 0, hash published, unpinned, in `lru` (findable until it is reused)
  free        ref_count == 0, no hash, in `free`
Sequences hold references; copies hold pins. A block can be both referenced and pinned.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import NamedTuple

BlockHash = bytes


class BlockKey(NamedTuple):
    """What a cached block's KV is a function of: the prefix before it (as its digest) and its tokens."""
    parent: BlockHash | None
    tokens: tuple[int, ...]


def chain_hash(parent: BlockHash | None, tokens: tuple[int, ...], salt: bytes = b"") -> BlockHash:
    h = hashlib.blake2b(digest_size=32, key=salt[:64])
    h.update(parent if parent is not None else b"\0" * 32)
    h.update(array("q", tokens).tobytes())
    return h.digest()


@dataclass
class PoolStats:
    total: int
    in_use: int
    cached_free: int
    free: int
    in_flight: int = 0  # unreferenced, but pinned by a copy


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_count = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.block_key: list[BlockKey | None] = [None] * num_blocks
        self.index: dict[BlockHash, int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.free: deque[int] = deque(range(num_blocks))
        self.pins = [0] * num_blocks
        self.held: set[int] = set()  # unreferenced, pinned, not in the LRU
        self.pinned_in_lru = 0
        self.num_evictions = 0

    def num_available(self) -> int:
        return len(self.free) + len(self.lru) - self.pinned_in_lru

    def lookup(self, h: BlockHash, key: BlockKey) -> int | None:
        """The cached block published under digest `h` with exactly this parent and tokens."""
        block = self.index.get(h)
        if block is None or self.block_key[block] != key:
            return None
        return block

    def acquire(self, block: int) -> None:
        if self.ref_count[block] == 0:
            if block in self.lru:
                del self.lru[block]
                self.pinned_in_lru -= self.pins[block] > 0
            else:
                self.held.discard(block)
        self.ref_count[block] += 1

    def allocate(self) -> int:
        """A block with ref count 1: a never-cached one first, else the least recently used cached
        one that no copy is using."""
        if self.free:
            block = self.free.popleft()
        else:
            block = next((b for b in self.lru if not self.pins[b]), None)  # pinned ones: oldest, few
            if block is None:
                raise RuntimeError("BlockPool exhausted: the caller must check num_available() first")
            del self.lru[block]
            self._unpublish(block)
            self.num_evictions += 1
        self.ref_count[block] = 1
        return block

    def release(self, block: int) -> None:
        assert self.ref_count[block] > 0, f"double free of block {block}"
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            self._park(block)

    def _park(self, block: int) -> None:
        """An unreferenced block goes where its state says."""
        if self.block_hash[block] is not None:
            self.lru[block] = None
            self.pinned_in_lru += self.pins[block] > 0
        elif self.pins[block]:
            self.held.add(block)
        else:
            self.free.append(block)

    def pin(self, block: int) -> None:
        """Hold a block for a copy: it cannot be reused (evicted or allocated) until unpinned."""
        if self.ref_count[block] == 0 and not self.pins[block]:
            assert block in self.lru, f"pinning block {block}, which is free (nothing to copy)"
            self.pinned_in_lru += 1
        self.pins[block] += 1

    def unpin(self, block: int) -> None:
        """End a copy's hold; an unreferenced cached block keeps its LRU place."""
        assert self.pins[block] > 0, f"unpin of unpinned block {block}"
        self.pins[block] -= 1
        if self.ref_count[block] == 0 and not self.pins[block]:
            if block in self.lru:
                self.pinned_in_lru -= 1
            else:
                self.held.remove(block)
                self._park(block)

    def touch(self, block: int) -> None:
        """Mark a cached-free block most recently used."""
        if block in self.lru:
            self.lru.move_to_end(block)

    def allocate_pinned(self) -> int:
        """A block for a copy to write: pinned, unreferenced, unpublished (the caller publishes it
        once the copy is complete)."""
        block = self.allocate()
        self.ref_count[block] = 0
        self.pins[block] = 1
        self.held.add(block)
        return block

    def publish(self, block: int, h: BlockHash, key: BlockKey) -> bool:
        """Make a written, full block findable. False if an equal block is already indexed
        (the duplicate then stays private and returns to the free list when released)."""
        if h in self.index or self.block_hash[block] is not None:
            return False
        self.index[h] = block
        self.block_hash[block] = h
        self.block_key[block] = key
        if self.ref_count[block] == 0:  # an unreferenced copy destination: into the LRU, as newest
            self.held.discard(block)
            self._park(block)
        return True

    def unpublish(self, block: int) -> None:
        """Stop a block being findable (its content is not trusted)."""
        if block in self.lru:
            del self.lru[block]
            self.pinned_in_lru -= self.pins[block] > 0
            self._unpublish(block)
            self._park(block)
        else:
            self._unpublish(block)

    def _unpublish(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None and self.index.get(h) == block:
            del self.index[h]
        self.block_hash[block] = None
        self.block_key[block] = None

    def reset_cache(self) -> None:
        """Forget every cached-free block (e.g. when prefix caching is turned off); blocks a copy
        is using are left alone."""
        for block in [b for b in self.lru if not self.pins[b]]:
            del self.lru[block]
            self._unpublish(block)
            self.free.append(block)

    def stats(self) -> PoolStats:
        in_use = sum(1 for r in self.ref_count if r > 0)
        in_flight = len(self.held) + self.pinned_in_lru
        return PoolStats(self.num_blocks, in_use, len(self.lru) - self.pinned_in_lru, len(self.free), in_flight)

    def check_invariants(self) -> None:
        in_use = [b for b, r in enumerate(self.ref_count) if r > 0]
        assert all(r >= 0 for r in self.ref_count), "negative ref count"
        assert all(p >= 0 for p in self.pins), "negative pin count"
        assert len(in_use) + len(self.lru) + len(self.free) + len(self.held) == self.num_blocks, (
            f"block accounting: {len(in_use)} in use + {len(self.lru)} cached-free + "
            f"{len(self.free)} free + {len(self.held)} held != {self.num_blocks}")
        assert not set(in_use) & (set(self.lru) | set(self.free) | self.held), "in-use block on a free list"
        assert not set(self.lru) & set(self.free), "block both cached-free and free"
        assert not self.held & (set(self.lru) | set(self.free)), "held block on a free list"
        assert all(self.pins[b] > 0 and self.block_hash[b] is None for b in self.held), "bad held block"
        assert self.pinned_in_lru == sum(1 for b in self.lru if self.pins[b]), "pinned LRU count"
        assert not any(self.pins[b] for b in self.free), "pinned block on the free list"
        assert all(self.block_hash[b] is not None for b in self.lru), "unhashed block in the LRU"
        assert all(self.block_hash[b] is None for b in self.free), "hashed block on the free list"
        for h, b in self.index.items():
            assert self.block_hash[b] == h, f"index points at block {b} whose hash changed"
