"""KV cache manager: maps sequences to device blocks, with prefix caching over hash-chained full
blocks. The scheduler talks only to this class; it never touches tensors.

With a host tier, the prompt's chain of full blocks is matched block by block against the device
index, then the blocks being loaded, then the host index. Host hits start a copy into newly
allocated device blocks; the sequence is LOADING until every copy it needs has completed
(`load_state`), and only then are those device blocks published. Concurrent requests on the same
host prefix share the copy in flight. Before each step, `offload_cold_blocks` starts copies of the
device LRU's oldest cached blocks to host, so that evicting them later loses nothing; they are
published on host when complete, and their device blocks are pinned (not reusable) until then.

Who holds what while a copy runs (all released when the copy is ended, whatever happened to the
sequences meanwhile):
  load  host source blocks: pinned (host pool);  device destination blocks: pinned (device pool),
        plus one reference per sequence whose table holds them
  save  device source blocks: pinned;  host destination blocks: pinned, unpublished
Copies are ended by `poll_transfers`, which never blocks.
"""
from __future__ import annotations

import enum
import os
from collections import Counter
from dataclasses import dataclass, field

from nanoserve.kvcache.block_pool import BlockHash, BlockKey, BlockPool, PoolStats, chain_hash
from nanoserve.kvcache.host_tier import HostCopy, HostTier
from nanoserve.kvcache.report import TierReport
from nanoserve.sequence import Sequence


class LoadState(enum.Enum):
    READY = "ready"      # every block the sequence holds has its KV on device
    LOADING = "loading"  # a copy from host it depends on is still running
    FAILED = "failed"    # a copy it depended on failed: free it and recompute


@dataclass(eq=False)
class _Load:
    copy: HostCopy
    keys: list[tuple[BlockHash, BlockKey]]
    waiters: set[int] = field(default_factory=set)  # seq ids holding its destination blocks


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0     # prompt tokens found


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 host: HostTier | None = None, offload_watermark: int = 0,
                 hash_salt: bytes | None = None) -> None:
        self.block_size = block_size
        # per-process random key for block digests: clients cannot predict or collide them offline
        self.hash_salt = os.urandom(32) if hash_salt is None else hash_salt
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.device_stats = PrefixCacheStats()
        self.host = host
        self.host_stats = PrefixCacheStats()
        # blocks that must be reusable without losing cached KV (free, or cached and already on
        # host) at the start of each step: about one step's worth of allocations
        self.offload_watermark = min(offload_watermark, num_blocks)
        self.saves: list[HostCopy] = []
        self.loads: list[_Load] = []
        self.loading: dict[BlockHash, tuple[int, BlockKey, _Load]] = {}  # device block being loaded
        self._waiting_on: dict[int, set[_Load]] = {}  # seq id -> loads it still needs
        self._failed: set[int] = set()                # seq ids whose load failed
        self.num_transfer_waits = 0  # times an allocation had to wait for a copy to free blocks

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _block_tokens(self, seq: Sequence, i: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])

    def _block_key(self, seq: Sequence, i: int) -> BlockKey:
        return BlockKey(seq.block_hashes[i - 1] if i else None, self._block_tokens(seq, i))

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[BlockHash]:
        """Chain digests of the first `num_blocks` full blocks, extending the sequence's memo
        (each full block is hashed once per sequence)."""
        hashes = seq.block_hashes
        while len(hashes) < num_blocks:
            hashes.append(chain_hash(hashes[-1] if hashes else None, self._block_tokens(seq, len(hashes)),
                                     self.hash_salt))
        return hashes[:num_blocks]

    def match_prefix(self, seq: Sequence) -> list[tuple[str, int]]:
        """(tier, block) for the sequence's leading cached full blocks, each looked up on device,
        then on host. At least one token is left to compute, so the last prompt position always
        produces logits."""
        if not self.enable_prefix_caching or seq.wants_prompt_logprobs:
            return []  # prompt logprobs need logits at every prompt position: compute them all
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits: list[tuple[str, int]] = []
        for i, h in enumerate(self._hashes(seq, max_blocks)):
            key = self._block_key(seq, i)
            block = self.pool.lookup(h, key)
            if block is not None:
                hits.append(("device", block))
            elif (ld := self.loading.get(h)) is not None and ld[1] == key:
                hits.append(("loading", ld[0]))
            elif self.host is not None and (hb := self.host.lookup(h, key)) is not None:
                hits.append(("host", hb))
            else:
                break
        return hits

    def admit(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Give a waiting sequence its cached prefix and blocks for `num_new_tokens` more tokens;
        host hits start loading (see `load_state`). Returns False (and changes nothing) if the pool
        cannot supply them. If anything raises, every block and pin taken is released."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        self.poll_transfers()
        while True:  # ending a copy changes what matches and what is free: match again after one
            hits = self.match_prefix(seq)
            on_device = [b for tier, b in hits if tier != "host"]
            num_cached = len(hits) * self.block_size
            num_new = min(num_new_tokens, seq.num_tokens - num_cached)
            need = self.blocks_needed(num_cached + num_new) - len(on_device)
            # device hits sitting in the LRU count as available, but acquiring them removes them from it
            cached_free_hits = sum(1 for b in on_device if b in self.pool.lru and not self.pool.pins[b])
            if self.pool.num_available() >= need + cached_free_hits:
                break
            if not self._wait_for_blocks():
                return False
        table: list[int | None] = [None] * len(hits)
        loads: list[tuple[int, int]] = []  # (block index, host block)
        shared: set[_Load] = set()
        try:
            # hits on device first: allocating could otherwise evict one of them from the LRU
            for i, (tier, b) in enumerate(hits):
                if tier == "host":
                    loads.append((i, b))
                else:
                    self.pool.acquire(b)
                    table[i] = b
                    if tier == "loading":
                        shared.add(self.loading[seq.block_hashes[i]][2])
            for i, _ in loads:
                table[i] = self.pool.allocate()
            while len(table) < len(hits) + need - len(loads):
                table.append(self.pool.allocate())
            if loads:
                shared.add(self._begin_load(seq, [(i, hb, table[i]) for i, hb in loads]))
        except BaseException:
            for b in table:
                if b is not None:
                    self.pool.release(b)
            raise
        for ld in shared:
            ld.waiters.add(seq.seq_id)
        if shared:
            self._waiting_on[seq.seq_id] = shared
        seq.block_table = table
        seq.num_computed_tokens = num_cached
        if not seq.admitted:
            seq.admitted = True
            host_tokens = len(loads) * self.block_size
            seq.num_cached_tokens = num_cached
            seq.num_device_cached_tokens = num_cached - host_tokens
            seq.num_host_cached_tokens = host_tokens
            self.device_stats.queries += seq.num_prompt_tokens
            self.device_stats.hits += num_cached - host_tokens
            if self.host is not None:
                self.host_stats.queries += seq.num_prompt_tokens - (num_cached - host_tokens)
                self.host_stats.hits += host_tokens
        return True

    def _begin_load(self, seq: Sequence, blocks: list[tuple[int, int, int]]) -> _Load:
        """Start copying (block index, host block, device block) for `seq`; the device blocks are
        pinned until the copy ends (they survive the sequence being freed meanwhile)."""
        assert self.host is not None
        keys = [(seq.block_hashes[i], self._block_key(seq, i)) for i, _, _ in blocks]
        copy = self.host.begin_load([hb for _, hb, _ in blocks], [db for _, _, db in blocks])
        ld = _Load(copy, keys)
        for db, (h, key) in zip(copy.dev_ids, keys):
            self.pool.pin(db)
            self.loading[h] = (db, key, ld)
        self.loads.append(ld)
        return ld

    def load_state(self, seq: Sequence) -> LoadState:
        if seq.seq_id in self._failed:
            return LoadState.FAILED
        return LoadState.LOADING if self._waiting_on.get(seq.seq_id) else LoadState.READY

    def poll_transfers(self) -> None:
        """End every copy whose handle is done (never blocks)."""
        if self.saves:
            done = [c for c in self.saves if c.handle.done()]
            for c in done:
                self._end_save(c)
        if self.loads:
            for ld in [ld for ld in self.loads if ld.copy.handle.done()]:
                self._end_load(ld)

    def _end_save(self, copy: HostCopy) -> None:
        self.saves.remove(copy)
        self.host.end_save(copy)
        for db in copy.dev_ids:
            self.pool.unpin(db)  # keeps its LRU place: now clean, evicting it loses nothing

    def _end_load(self, ld: _Load) -> None:
        self.loads.remove(ld)
        ok = self.host.end_load(ld.copy)
        if ok:
            ld.copy.handle.order_compute_after()
        for db, (h, key) in zip(ld.copy.dev_ids, ld.keys):
            del self.loading[h]
            if ok:  # the KV is on device only now: findable from here on
                self.pool.publish(db, h, key)
            self.pool.unpin(db)
        for sid in ld.waiters:
            pending = self._waiting_on[sid]
            pending.discard(ld)
            if not pending:
                del self._waiting_on[sid]
            if not ok:
                self._failed.add(sid)

    def wait_for_transfer(self, timeout: float | None = None) -> None:
        """Block until the oldest load completes (or `timeout`): for an engine with nothing else
        to run, instead of spinning."""
        if self.loads:
            self.loads[0].copy.handle.wait(timeout)
        elif self.saves:
            self.saves[0].handle.wait(timeout)
        self.poll_transfers()

    def drain_transfers(self) -> None:
        """Wait for every copy in flight and end it (tests, benchmarks, shutdown)."""
        while self.saves or self.loads:
            self.wait_for_transfer()

    def _wait_for_blocks(self) -> bool:
        """Short of blocks: wait for one copy whose end frees some (a save of cold blocks, a load
        whose sequences are gone) -- rare, and cheaper than preempting. False if there is none."""
        copy = next((c for c in self.saves), None) or next(
            (ld.copy for ld in self.loads if not ld.waiters), None)
        if copy is None:
            return False
        self.num_transfer_waits += 1
        copy.handle.wait()
        self.poll_transfers()
        return True

    def _reclaim(self, need: int) -> bool:
        """Whether `need` more blocks can be allocated, after waiting for copies if they hold them."""
        self.poll_transfers()
        while self.pool.num_available() < need:
            if not self._wait_for_blocks():
                return False
        return True

    def offload_cold_blocks(self) -> int:
        """Start copying to host the oldest cached device blocks not yet there, until
        `offload_watermark` blocks can be reused without losing KV (counting those whose saves
        are in flight). Returns the number of blocks whose copy was started."""
        if self.host is None:
            return 0
        self.poll_transfers()
        reusable = len(self.pool.free) + sum(len(c.dev_ids) for c in self.saves)
        dev_ids, keys = [], []
        for block in self.pool.lru:  # oldest first: the next to be evicted
            if reusable >= self.offload_watermark:
                break
            if self.pool.pins[block]:
                continue  # being saved: counted above
            reusable += 1
            h, key = self.pool.block_hash[block], self.pool.block_key[block]
            if self.host.lookup(h, key) is None:
                dev_ids.append(block)
                keys.append((h, key))
        if not dev_ids:
            return 0
        copy = self.host.begin_save(dev_ids, keys)
        if copy is None:
            return 0
        for db in copy.dev_ids:
            self.pool.pin(db)
        self.saves.append(copy)
        return len(copy.dev_ids)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow a running sequence's block table to hold `num_new_tokens` more tokens."""
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if need > 0 and not self._reclaim(need):
            return False
        seq.block_table.extend(self.pool.allocate() for _ in range(need))
        return True

    def publish_computed(self, seq: Sequence) -> None:
        """Publish the full blocks whose KV has now been written."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        for i, h in enumerate(self._hashes(seq, num_full)):
            block = seq.block_table[i]
            if self.pool.block_hash[block] is None:
                self.pool.publish(block, h, self._block_key(seq, i))

    def free(self, seq: Sequence) -> None:
        """Release every block; tail blocks first so the LRU evicts them before shared prefixes."""
        for block in reversed(seq.block_table):
            self.pool.release(block)  # a block still loading stays pinned by its copy
        seq.block_table = []
        seq.num_computed_tokens = 0
        for ld in self._waiting_on.pop(seq.seq_id, ()):
            ld.waiters.discard(seq.seq_id)
        self._failed.discard(seq.seq_id)

    def usage(self) -> float:
        return self.pool.stats().in_use / max(1, self.pool.num_blocks)

    def stats(self) -> PoolStats:
        return self.pool.stats()

    def reports(self) -> list[TierReport]:
        st = self.pool.stats()
        out = [TierReport("device", st.total, st.in_use, st.cached_free, st.free, self.block_size,
                          self.device_stats.queries, self.device_stats.hits, self.pool.num_evictions,
                          st.in_flight)]
        if self.host is not None:
            hs, t = self.host.pool.stats(), self.host.transfers
            out.append(TierReport("host", hs.total, hs.in_use, hs.cached_free, hs.free, self.block_size,
                                  self.host_stats.queries, self.host_stats.hits, self.host.pool.num_evictions,
                                  hs.in_flight, t.bytes_in, t.bytes_out, t.seconds_in, t.seconds_out))
        return out

    def check_invariants(self) -> None:
        """Pool accounting per tier, and every pin accounted for by a copy in flight."""
        self.pool.check_invariants()
        dev_pins = Counter(b for c in self.saves for b in c.dev_ids)
        dev_pins.update(b for ld in self.loads for b in ld.copy.dev_ids)
        assert all(self.pool.pins[b] == dev_pins[b] for b in range(self.pool.num_blocks)), (
            "device block pinned without a copy in flight (or the reverse)")
        assert {db for db, _, _ in self.loading.values()} == {b for ld in self.loads for b in ld.copy.dev_ids}
        assert all(ld in self.loads for lds in self._waiting_on.values() for ld in lds), "waiting on an ended load"
        if self.host is not None:
            self.host.pool.check_invariants()
            assert self.host.pool.stats().in_use == 0, "host blocks are held by copies (pins), never referenced"
            host_pins = Counter(b for c in self.saves for b in c.host_ids)
            host_pins.update(b for ld in self.loads for b in ld.copy.host_ids)
            assert all(self.host.pool.pins[b] == host_pins[b] for b in range(self.host.pool.num_blocks)), (
                "host block pinned without a copy in flight (or the reverse)")
        else:
            assert not (self.saves or self.loads)
