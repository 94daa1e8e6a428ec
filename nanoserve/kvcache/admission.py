"""Admitting a waiting sequence: its prefix matched across the tiers, device blocks for the matched links
and its first chunk, loads from host started for host hits, reads from disk for a chain that continues
there. All or nothing: if anything raises, every block and pin taken is released, and a load that cannot
start is a host miss (the prefix is recomputed)."""
from __future__ import annotations

import enum
import logging
from itertools import islice

from nanoserve.kvcache.block_pool import BlockPool
from nanoserve.kvcache.copies import Load, TierCopies
from nanoserve.kvcache.policy import Supply, TierPolicy
from nanoserve.kvcache.prefix import PrefixChains, PrefixMatch, Tier
from nanoserve.kvcache.tier_stats import HitStats
from nanoserve.sequence import Sequence

log = logging.getLogger("nanoserve")


class Admission(enum.Enum):
    """A waiting sequence's answer from `admit`; true only when admitted."""
    ADMITTED = "admitted"
    WAIT_FOR_SAVES = "wait for saves"  # only by dropping uncopied KV: saves started, ask again
    WAIT_FOR_DISK = "wait for disk"    # its prefix continues on disk: reads to host started, ask again
    NO_ROOM = "no room"

    def __bool__(self) -> bool:
        return self is Admission.ADMITTED


class Admitter:
    def __init__(self, block_size: int, pool: BlockPool, chains: PrefixChains, policy: TierPolicy,
                 copies: TierCopies | None, hits: HitStats) -> None:
        self.block_size, self.pool, self.chains, self.policy, self.copies, self.hits = (
            block_size, pool, chains, policy, copies, hits)
        self.disk = copies.disk if copies is not None else None
        self.num_load_submit_failures = 0   # loads that could not start (treated as host misses)

    def admit(self, seq: Sequence, num_new_tokens: int, reserve: int = 0, use_host: bool = True) -> Admission:
        """Give a waiting sequence its cached prefix and blocks for `num_new_tokens` more tokens;
        host hits start loading (see `load_state`). Not admitted (nothing the caller holds changed):
        NO_ROOM if the blocks cannot be had now; WAIT_FOR_SAVES if only by dropping uncopied KV while
        saves can avoid that: those saves are started and the answer may change; WAIT_FOR_DISK while
        the chain's continuation is read from disk into host (disk_tier.py). `reserve`: blocks
        to leave reusable without loss (the running sequences' next tokens). If anything raises,
        every block and pin taken is released; a load that cannot start is a host miss."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        match = self.chains.match_runs(seq, use_host)
        if use_host and self._fetch_from_disk(seq, match):
            return Admission.WAIT_FOR_DISK
        num_cached = len(match) * self.block_size
        num_new = min(num_new_tokens, seq.num_tokens - num_cached)
        host_hits = match.of(Tier.HOST)
        need = -(-(num_cached + num_new) // self.block_size) - len(match) + len(host_hits)
        # device hits sitting in an LRU: acquiring them takes them out of what allocation can use
        supply = self.policy.supply(need, reserve, match.of(Tier.DEVICE), host_hits)
        if supply is Supply.SHORT or supply is Supply.DEFER:
            return Admission.NO_ROOM if supply is Supply.SHORT else Admission.WAIT_FOR_SAVES
        # host room for saves, not counting this request's own host hits; read only if lossy, taken before
        room = self.policy.host_room(host_hits) if supply is Supply.LOSSY else 0
        lossy_before = self.pool.num_lossy_evictions
        table, shared, spans = self._take_blocks(seq, match, need, supply is Supply.LOSSY)
        if host_hits:
            # the host hits are still the ones matched: nothing since the match touched the host
            # pool but `_supply`, which pinned them around the saves it started
            try:
                shared.add(self.copies.begin_load(match.links(Tier.HOST, seq.block_hashes),
                                                  match.links(Tier.HOST, seq.block_keys), host_hits,
                                                  match.links(Tier.HOST, table), spans, match.host_spans))
            except Exception:
                self._release(table)
                self.num_load_submit_failures += 1
                log.exception("KV load from host could not start; recomputing the prefix instead")
                return self.admit(seq, num_new_tokens, reserve, use_host=False)
        self.policy.note_lossy(lossy_before, room)
        if shared:  # registered right after the match: no copy has ended in between
            self.copies.wait_on(seq.seq_id, shared)
        seq.block_table = table
        seq.num_computed_tokens = num_cached
        # the leading device hits are published; a load publishes its blocks when it lands
        seq.num_published_blocks = match.runs[0][2] if match.runs and match.runs[0][0] is Tier.DEVICE else 0
        from_disk = 0
        if self.disk is not None:
            from_disk = min(self.disk.forget(seq.seq_id), len(host_hits))  # after begin_load: it pins them
        self.hits.admitted(seq, num_cached, len(host_hits) * self.block_size, loading=bool(shared),
                           disk_tokens=from_disk * self.block_size)
        return Admission.ADMITTED

    def _fetch_from_disk(self, seq: Sequence, match: PrefixMatch) -> int:
        """Start reading the prompt's chain past `match` from disk to host, where it continues there;
        the links being read (0: admit now)."""
        limit = (seq.num_tokens - 1) // self.block_size
        if self.disk is None or not self.chains.enabled or seq.wants_prompt_logprobs or len(match) >= limit:
            return 0
        return self.disk.fetch(seq.seq_id, seq.block_hashes[:limit], seq.block_keys[:limit], len(match),
                               match.of(Tier.HOST))

    def _take_blocks(self, seq: Sequence, match: PrefixMatch, need: int,
                     lossy_ok: bool) -> tuple[list[int], set[Load], list[tuple[int, int]] | None]:
        """The block table for the matched links plus `need` new blocks (host links get fresh
        destination blocks), the loads in flight it shares, and the host links' blocks as runs
        (when known: extents.allocate_spans). All or nothing."""
        table: list[int | None] = [None] * len(match)
        shared: set[Load] = set()
        try:
            # hits on device first: allocating could otherwise evict one of them from the LRU
            for tier, lo, hi in match.runs:
                if tier is not Tier.HOST:
                    for i in range(lo, hi):
                        self.pool.acquire(match.blocks[i])
                        table[i] = match.blocks[i]
                    if tier is Tier.LOADING:
                        shared.update(self.copies.loads_of(seq.block_hashes[lo:hi]))
            # a load's destinations: the fewest runs of free blocks, ascending in table order; with
            # the host side in chain order (copies.chain_order) each run on both sides is one copy
            num_load = sum(hi - lo for tier, lo, hi in match.runs if tier is Tier.HOST)
            blocks, spans = self.policy.allocate_extents(num_load, lossy_ok) if num_load else ([], None)
            dest = iter(blocks)  # in table order, so the host links' blocks are `blocks` as they are
            for tier, lo, hi in match.runs:
                if tier is Tier.HOST:
                    table[lo:hi] = blocks if hi - lo == len(blocks) else list(islice(dest, hi - lo))
            table.extend(self.policy.allocate(lossy_ok) for _ in range(need - num_load))
        except BaseException:
            self._release(table)
            raise
        return table, shared, spans

    def _release(self, table: list[int | None]) -> None:
        for b in table:
            if b is not None:
                self.pool.release(b)

