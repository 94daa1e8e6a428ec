"""KV cache manager: maps sequences to device blocks, with prefix caching over hash-chained full
blocks. The scheduler talks only to this class; it never touches tensors.

With a host tier, the prompt's chain of full blocks is matched block by block against the device
index, then the blocks being loaded, then the host index. Host hits start a copy into newly
allocated device blocks; the sequence is LOADING until every copy it needs has completed
(`load_state`), and only then are those device blocks published. Concurrent requests on the same
host prefix share the copy in flight.

The policy, lossless by design: a cached device block is *clean* when the host holds its KV too
(a save completed, a load landed, or it was computed again while on host) and *dirty* otherwise;
the host clears it when it evicts that chain. Allocation takes free, then clean blocks (LRU, O(1)).
When only dirty blocks are left, the host has room and no save has been failing, nothing evicts
them: admission *defers* (starts saves for the shortfall, oldest dirty first, and answers False:
the request is asked again next step while the running ones keep decoding), and a running
sequence sits out the step (`Supply.DEFER`); only without room on host is KV dropped
(`Supply.LOSSY`, counted in `lossy_evictions`). After each step's scheduling the engine calls
`offload_cold_blocks`, which saves the oldest dirty blocks until a demand-sized target of blocks
is reusable without loss (recent allocations per step plus what the next waiting requests need;
`offload_watermark` overrides it), so those saves overlap the forward and deferral stays rare.
Nothing here ever waits for a copy: copies are ended by `poll_transfers`, which never blocks.

Who holds what while a copy runs (all released when the copy is ended, whatever happened to the
sequences meanwhile):
  load  host source blocks: pinned (host pool);  device destination blocks: pinned (device pool),
        plus one reference per sequence whose table holds them
  save  device source blocks: pinned;  host destination blocks: pinned, unpublished
Copies are ended by `poll_transfers`, which never blocks.
"""
from __future__ import annotations

import enum
import logging
import os
import time
from collections import Counter, deque
from collections.abc import Collection
from dataclasses import dataclass, field

from nanoserve.kvcache.block_pool import BlockHash, BlockKey, BlockPool, PoolStats, chain_hash
from nanoserve.kvcache.host_tier import HostCopy, HostTier
from nanoserve.kvcache.report import TierReport
from nanoserve.sequence import Sequence

log = logging.getLogger("nanoserve")


class Supply(enum.Enum):
    """How a request for device blocks can be met this step."""
    LOSSLESS = "lossless"  # from free and clean blocks
    DEFER = "defer"        # saves in flight (or just started) will make it lossless: ask next step
    LOSSY = "lossy"        # only by dropping KV that exists nowhere else (no room on host)
    SHORT = "short"        # not at all: the blocks are in use


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
        # override of the cleaner's target (device blocks reusable without loss); 0 = from demand
        self.offload_watermark = min(offload_watermark, num_blocks)
        self.saves: list[HostCopy] = []
        self.loads: list[_Load] = []
        self.loading: dict[BlockHash, tuple[int, BlockKey, _Load]] = {}  # device block being loaded
        self._waiting_on: dict[int, set[_Load]] = {}  # seq id -> loads it still needs
        self._failed: set[int] = set()                # seq ids whose load failed
        # first admission's cache stats, counted once its loads have landed: seq id -> (cached, host)
        self._unconfirmed: dict[int, tuple[Sequence, int, int]] = {}
        self._allocs = 0                               # device blocks allocated, ever
        self._allocs_seen = 0
        self._recent_allocs: deque[int] = deque(maxlen=16)  # per cleaner call (= per step)
        self._save_failures_in_row = 0  # failed submits/copies since the last save that landed
        self.num_deferred = 0               # admissions / running steps deferred for saves
        self.num_save_submit_failures = 0   # optional saves that could not start (skipped)
        self.num_load_submit_failures = 0   # loads that could not start (treated as host misses)
        self.num_lossy_with_room = 0        # lossy evictions while the host had room (saves failing)
        self.num_avoidable_lossy = 0        # ... and saves were not failing: the policy says never
        self._warned_lossy = False
        if host is not None:  # each tier tells the other when a chain stops being findable in it
            self.pool.on_unpublish = self._device_dropped
            host.pool.on_unpublish = self._host_dropped

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

    def match_prefix(self, seq: Sequence, use_host: bool = True) -> list[tuple[str, int]]:
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
            elif use_host and self.host is not None and (hb := self.host.lookup(h, key)) is not None:
                hits.append(("host", hb))
            else:
                break
        return hits

    def admit(self, seq: Sequence, num_new_tokens: int, reserve: int = 0, use_host: bool = True) -> bool:
        """Give a waiting sequence its cached prefix and blocks for `num_new_tokens` more tokens;
        host hits start loading (see `load_state`). Returns False (and changes nothing the caller
        holds) if the blocks cannot be had now, or only by dropping uncopied KV while saves can
        avoid that: those saves are started and the answer may change next step. `reserve`: blocks
        to leave reusable without loss (the running sequences' next tokens). If anything raises,
        every block and pin taken is released; a load that cannot start is a host miss."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        self.poll_transfers()  # the only copy ends in here: before the match, never after it
        hits = self.match_prefix(seq, use_host)
        num_cached = len(hits) * self.block_size
        num_new = min(num_new_tokens, seq.num_tokens - num_cached)
        need = self.blocks_needed(num_cached + num_new) - sum(1 for t, _ in hits if t != "host")
        host_hits = [b for t, b in hits if t == "host"]
        # device hits sitting in an LRU: acquiring them takes them out of what allocation can use
        supply = self._supply(need, reserve, [b for t, b in hits if t == "device"], host_hits)
        if supply is Supply.SHORT or supply is Supply.DEFER:
            self.num_deferred += supply is Supply.DEFER
            return False
        lossy_ok = supply is Supply.LOSSY
        table: list[int | None] = [None] * len(hits)
        loads: list[tuple[int, int]] = []  # (block index, host block)
        shared: set[_Load] = set()
        # host room for saves, not counting this request's own host hits (they stay)
        room = self._host_room() - sum(1 for hb in host_hits if hb in self.host.pool.dirty) if host_hits else \
            self._host_room()
        lossy_before = self.pool.num_lossy_evictions
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
                table[i] = self._allocate(lossy_ok)
            while len(table) < len(hits) + need - len(loads):
                table.append(self._allocate(lossy_ok))
        except BaseException:
            self._release(table)
            raise
        if loads:
            # the host hits are still the ones matched: nothing since the match touched the host
            # pool but `_supply`, which pinned them around the saves it started
            try:
                shared.add(self._begin_load(seq, [(i, hb, table[i]) for i, hb in loads]))
            except Exception:
                self._release(table)
                self.num_load_submit_failures += 1
                log.exception("KV load from host could not start; recomputing the prefix instead")
                return self.admit(seq, num_new_tokens, reserve, use_host=False)
        self._note_lossy(lossy_before, room)
        for ld in shared:  # registered right after the match: no copy has ended in between
            ld.waiters.add(seq.seq_id)
        if shared:
            self._waiting_on[seq.seq_id] = shared
        seq.block_table = table
        seq.num_computed_tokens = num_cached
        if not seq.admitted:
            host_tokens = len(loads) * self.block_size
            if shared:
                self._unconfirmed[seq.seq_id] = (seq, num_cached, host_tokens)
            else:
                self._count_hits(seq, num_cached, host_tokens)
        return True

    def _count_hits(self, seq: Sequence, num_cached: int, host_tokens: int) -> None:
        """A sequence's first admission, once every block it was promised is on device: its usage
        numbers and the per-tier hit counters."""
        seq.admitted = True
        seq.num_cached_tokens = num_cached
        seq.num_device_cached_tokens = num_cached - host_tokens
        seq.num_host_cached_tokens = host_tokens
        self.device_stats.queries += seq.num_prompt_tokens
        self.device_stats.hits += num_cached - host_tokens
        if self.host is not None:
            self.host_stats.queries += seq.num_prompt_tokens - (num_cached - host_tokens)
            self.host_stats.hits += host_tokens

    def _release(self, table: list[int | None]) -> None:
        for b in table:
            if b is not None:
                self.pool.release(b)

    def _allocate(self, lossy_ok: bool) -> int:
        self._allocs += 1
        return self.pool.allocate(lossy_ok)

    def _host_room(self) -> int:
        return self.host.room() if self.host is not None else 0

    def _note_lossy(self, before: int, room: int) -> None:
        """Count lossy evictions made while the host had `room` (measured before allocating), and
        log the first one."""
        n = self.pool.num_lossy_evictions - before
        if n and room:
            self.num_lossy_with_room += n
            self.num_avoidable_lossy += n * (self._save_failures_in_row < 3)
            if not self._warned_lossy:
                self._warned_lossy = True
                log.warning("dropped %d uncopied KV block(s) while the host tier had room (saves to host "
                            "kept failing); nanoserve:kv_lossy_evictions_total counts every such block", n)

    # ---- the lossless policy ----------------------------------------------------------------
    def _pending_saves(self, exclude: Collection[int] = ()) -> int:
        """Device blocks that saves in flight will make clean and reusable (unreferenced now)."""
        return sum(1 for c in self.saves for b in c.dev_ids if not self.pool.ref_count[b] and b not in exclude)

    def _supply(self, need: int, reserve: int = 0, hits: Collection[int] = (),
                protect: Collection[int] = ()) -> Supply:
        """How `need` more device blocks can be had; `hits`: device blocks the caller acquires
        first; `reserve`: blocks to leave lossless beyond `need`. Starts saves when they turn a
        lossy allocation into a lossless one next step (`protect`: host blocks they must not evict,
        pinned meanwhile)."""
        pool = self.pool
        lossless = pool.num_available(lossless=True) - sum(1 for b in hits if b in pool.clean)
        total = lossless + len(pool.dirty) - sum(1 for b in hits if b in pool.dirty)
        if need + reserve <= lossless:
            return Supply.LOSSLESS
        if self.host is None:  # a single tier: dropping the oldest cached KV is the only way
            return Supply.LOSSY if need <= total else Supply.SHORT
        pending = self._pending_saves(hits)
        if need > total + pending:
            return Supply.SHORT
        started, failures = 0, self.num_save_submit_failures
        # after 3 failed saves in a row only the cleaner tries again (a success re-enables this)
        if need + reserve > lossless + pending and self._save_failures_in_row < 3:
            started = self._save_dirty(need + reserve - lossless - pending, protect)
            lossless = pool.num_available(lossless=True) - sum(1 for b in hits if b in pool.clean)
        if need <= lossless:
            return Supply.LOSSLESS  # only the reserve is short: its saves (if any) are under way
        if started or pending:
            return Supply.DEFER
        if self.num_save_submit_failures > failures:
            return Supply.DEFER  # a save could not start just now: try again next step
        return Supply.LOSSY if need <= total else Supply.SHORT

    def _save_dirty(self, n: int, protect: Collection[int] = ()) -> int:
        """Start saving up to `n` of the oldest dirty device blocks (marking clean, without a copy,
        those the host already holds). Returns how many copies were started. A save that cannot
        start is logged, counted and skipped: it was optional."""
        host, pool = self.host, self.pool
        dev_ids, keys, already = [], [], []
        for block in pool.dirty:  # oldest first: the next to be evicted
            if len(dev_ids) + len(already) >= n:
                break
            h, key = pool.block_hash[block], pool.block_key[block]
            if host.lookup(h, key) is not None:
                already.append(block)
            else:
                dev_ids.append(block)
                keys.append((h, key))
        for block in already:
            self._twin(block)
        if not dev_ids or not host.room():
            return 0
        for hb in protect:
            host.pool.pin(hb)
        try:
            copy = host.begin_save(dev_ids, keys)
        except Exception:
            self.num_save_submit_failures += 1
            self._save_failures_in_row += 1
            log.exception("KV save to host could not start; skipped")
            return 0
        finally:
            for hb in protect:
                host.pool.unpin(hb)
        if copy is None:
            return 0
        for db in copy.dev_ids:
            pool.pin(db)
        self.saves.append(copy)
        return len(copy.dev_ids)

    def _twin(self, block: int) -> None:
        """Device block `block` and the host block of the same chain hold the same KV."""
        h = self.pool.block_hash[block]
        hb = self.host.pool.index.get(h)
        if hb is not None:
            self.pool.mark_clean(block, True)
            self.host.pool.mark_clean(hb, True)

    def _device_dropped(self, h: BlockHash, evicted: bool) -> None:
        if (hb := self.host.pool.index.get(h)) is not None:
            self.host.pool.mark_clean(hb, False)  # the host copy is the only one now

    def _host_dropped(self, h: BlockHash, evicted: bool) -> None:
        if (b := self.pool.index.get(h)) is not None:
            self.pool.mark_clean(b, False)  # the device copy is the only one now

    def demand_of(self, seq: Sequence, budget: int) -> int:
        """Device blocks admitting `seq` now would take: its host hits plus its first chunk."""
        hits = self.match_prefix(seq)
        on_host = sum(1 for t, _ in hits if t == "host")
        cached = len(hits) * self.block_size
        return on_host + self.blocks_needed(min(budget, seq.num_tokens - cached))

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
        ok = self.host.end_save(copy)
        self._save_failures_in_row = 0 if ok else self._save_failures_in_row + 1
        for db, (h, key) in zip(copy.dev_ids, copy.keys):
            if ok and self.pool.block_hash[db] == h:
                self._twin(db)  # now clean: evicting it loses nothing
            self.pool.unpin(db)

    def _end_load(self, ld: _Load) -> None:
        self.loads.remove(ld)
        ok = self.host.end_load(ld.copy)
        if ok:
            ld.copy.handle.order_compute_after()
        for db, (h, key) in zip(ld.copy.dev_ids, ld.keys):
            del self.loading[h]
            if ok and self.pool.publish(db, h, key):  # the KV is on device only now: findable from here on
                self._twin(db)
            self.pool.unpin(db)
        for sid in ld.waiters:
            pending = self._waiting_on[sid]
            pending.discard(ld)
            if not ok:
                self._failed.add(sid)
            if not pending:
                del self._waiting_on[sid]
                stats = self._unconfirmed.pop(sid, None)
                if stats is not None and sid not in self._failed:
                    self._count_hits(*stats)  # every load it was promised has landed

    def complete_loads(self, seq: Sequence, timeout: float = 1.0) -> None:
        """Wait (up to `timeout` each) for the loads `seq` waits on, then end what is done: its
        state is then READY, FAILED, or still LOADING if a copy is slow."""
        for ld in list(self._waiting_on.get(seq.seq_id, ())):
            ld.copy.handle.wait(timeout)
        self.poll_transfers()

    def wait_for_transfer(self, timeout: float | None = None) -> None:
        """Block until the oldest load (else save) completes, or `timeout`: for an engine with
        nothing it can run, instead of spinning."""
        if self.loads:
            self.loads[0].copy.handle.wait(timeout)
        elif self.saves:
            self.saves[0].handle.wait(timeout)
        self.poll_transfers()

    def drain_transfers(self) -> None:
        """Wait for every copy in flight and end it (tests, benchmarks, shutdown)."""
        while self.saves or self.loads:
            self.wait_for_transfer()

    def close(self, timeout: float = 30.0) -> None:
        """Engine shutdown: end every copy, then release the host pool (unpinning it on CUDA). A
        copy still running after `timeout` leaves the pool registered: a leak, not a corruption."""
        deadline = time.monotonic() + timeout
        while (self.saves or self.loads) and time.monotonic() < deadline:
            self.wait_for_transfer(max(0.0, deadline - time.monotonic()))
        if self.saves or self.loads:
            log.error("KV copies still running at shutdown; the host pool is left as it is")
        elif self.host is not None:
            self.host.close()

    def offload_cold_blocks(self, demand: int = 0) -> int:
        """The cleaner: start saving the oldest dirty cached device blocks until the target number
        of blocks is reusable without loss (free, clean, or clean once a save in flight ends).
        Target: `offload_watermark` if set, else the most blocks allocated in one step lately plus
        `demand` (what the caller expects the next step to need). Returns the copies started."""
        self._recent_allocs.append(self._allocs - self._allocs_seen)
        self._allocs_seen = self._allocs
        if self.host is None:
            return 0
        self.poll_transfers()
        target = self.offload_watermark or min(self.num_blocks, max(self._recent_allocs) + demand)
        short = target - self.pool.num_available(lossless=True) - self._pending_saves()
        return self._save_dirty(short) if short > 0 else 0

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> Supply:
        """Grow a running sequence's block table to hold `num_new_tokens` more tokens. LOSSLESS or
        LOSSY: done; DEFER: nothing taken, saves will free blocks (skip it this step); SHORT:
        nothing taken (preempt someone)."""
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if need <= 0:
            return Supply.LOSSLESS
        supply = self._supply(need)
        if supply is Supply.DEFER:
            self.num_deferred += 1
        if supply in (Supply.LOSSLESS, Supply.LOSSY):
            before, room = self.pool.num_lossy_evictions, self._host_room()
            seq.block_table.extend(self._allocate(supply is Supply.LOSSY) for _ in range(need))
            self._note_lossy(before, room)
        return supply

    def publish_computed(self, seq: Sequence) -> None:
        """Publish the full blocks whose KV has now been written."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        for i, h in enumerate(self._hashes(seq, num_full)):
            block = seq.block_table[i]
            if self.pool.block_hash[block] is None:
                if self.pool.publish(block, h, self._block_key(seq, i)) and self.host is not None:
                    self._twin(block)  # computed again while its KV was on host: clean already

    def free(self, seq: Sequence) -> None:
        """Release every block; tail blocks first so the LRU evicts them before shared prefixes."""
        for block in reversed(seq.block_table):
            self.pool.release(block)  # a block still loading stays pinned by its copy
        seq.block_table = []
        seq.num_computed_tokens = 0
        for ld in self._waiting_on.pop(seq.seq_id, ()):
            ld.waiters.discard(seq.seq_id)
        self._failed.discard(seq.seq_id)
        self._unconfirmed.pop(seq.seq_id, None)

    def usage(self) -> float:
        return self.pool.stats().in_use / max(1, self.pool.num_blocks)

    def stats(self) -> PoolStats:
        return self.pool.stats()

    def reports(self) -> list[TierReport]:
        st = self.pool.stats()
        out = [TierReport("device", st.total, st.in_use, st.cached_free, st.free, self.block_size,
                          self.device_stats.queries, self.device_stats.hits, self.pool.num_evictions,
                          st.in_flight, lossy_evictions=self.pool.num_lossy_evictions)]
        if self.host is not None:
            hs, t = self.host.pool.stats(), self.host.transfers
            out.append(TierReport("host", hs.total, hs.in_use, hs.cached_free, hs.free, self.block_size,
                                  self.host_stats.queries, self.host_stats.hits, self.host.pool.num_evictions,
                                  hs.in_flight, self.host.pool.num_lossy_evictions, t.bytes_in, t.bytes_out,
                                  t.seconds_in, t.seconds_out))
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
        assert set(self._unconfirmed) <= set(self._waiting_on), "hit stats held for a sequence not loading"
        if self.host is not None:
            self.host.pool.check_invariants()
            dev, host = self.pool, self.host.pool
            for b in range(dev.num_blocks):  # clean <=> the other tier holds the same chain
                h = dev.block_hash[b]
                if h is not None and dev.index.get(h) == b:
                    assert dev.is_clean[b] == (h in host.index), f"device block {b} clean flag is wrong"
            for hb in range(host.num_blocks):
                h = host.block_hash[hb]
                if h is not None and host.index.get(h) == hb:
                    assert host.is_clean[hb] == (h in dev.index), f"host block {hb} clean flag is wrong"
            assert self.host.pool.stats().in_use == 0, "host blocks are held by copies (pins), never referenced"
            host_pins = Counter(b for c in self.saves for b in c.host_ids)
            host_pins.update(b for ld in self.loads for b in ld.copy.host_ids)
            assert all(self.host.pool.pins[b] == host_pins[b] for b in range(self.host.pool.num_blocks)), (
                "host block pinned without a copy in flight (or the reverse)")
        else:
            assert not (self.saves or self.loads)
