"""The tiers' counters and their reports. Prefix-cache hits: a sequence's usage numbers and the tier
counters, counted once per request at its first admission, and only once every block it was promised is
on device (a load that fails was a miss, not a hit). Reports: each tier's blocks, hits, evictions and
copies, as /metrics and the logs show them."""
from __future__ import annotations

from dataclasses import dataclass, field

from nanoserve.kvcache.block_pool import BlockPool
from nanoserve.kvcache.disk_tier import DiskTier
from nanoserve.kvcache.host_tier import HostTier
from nanoserve.kvcache.report import TierReport
from nanoserve.sequence import Sequence


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0     # prompt tokens found


@dataclass
class HitStats:
    device: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    host: PrefixCacheStats | None = None  # None without a host tier
    disk: PrefixCacheStats | None = None  # None without a disk tier
    # first admissions whose loads are in flight: seq id -> (sequence, cached tokens, of them from host,
    # of those read from disk for it)
    unconfirmed: dict[int, tuple[Sequence, int, int, int]] = field(default_factory=dict)

    def admitted(self, seq: Sequence, num_cached: int, host_tokens: int, loading: bool,
                 disk_tokens: int = 0) -> None:
        """A sequence got its prefix: count it now, or once its loads land (`loading`)."""
        if seq.admitted:
            return
        if loading:
            self.unconfirmed[seq.seq_id] = (seq, num_cached, host_tokens, disk_tokens)
        else:
            self._count(seq, num_cached, host_tokens, disk_tokens)

    def loads_ended(self, seq_id: int, failed: bool) -> None:
        stats = self.unconfirmed.pop(seq_id, None)
        if stats is not None and not failed:
            self._count(*stats)

    def forget(self, seq_id: int) -> None:
        self.unconfirmed.pop(seq_id, None)

    def _count(self, seq: Sequence, num_cached: int, host_tokens: int, disk_tokens: int) -> None:
        seq.admitted = True
        seq.num_cached_tokens = num_cached
        seq.num_device_cached_tokens = num_cached - host_tokens
        seq.num_host_cached_tokens = host_tokens
        self.device.queries += seq.num_prompt_tokens
        self.device.hits += num_cached - host_tokens
        if self.host is not None:
            self.host.queries += seq.num_prompt_tokens - (num_cached - host_tokens)
            self.host.hits += host_tokens
        if self.disk is not None:  # read from disk into host for this request, then loaded as host hits
            self.disk.queries += seq.num_prompt_tokens - (num_cached - disk_tokens)
            self.disk.hits += disk_tokens


def tier_reports(pool: BlockPool, hits: HitStats, host: HostTier | None, block_size: int,
                 save_submit_failures: int, load_submit_failures: int,
                 disk: DiskTier | None = None) -> list[TierReport]:
    st = pool.stats()
    out = [TierReport("device", st.total, st.in_use, st.cached_free, st.free, block_size,
                      hits.device.queries, hits.device.hits, pool.num_evictions, st.in_flight,
                      lossy_evictions=pool.num_lossy_evictions)]
    if host is not None and hits.host is not None:
        hs, t = host.pool.stats(), host.transfers
        out.append(TierReport("host", hs.total, hs.in_use, hs.cached_free, hs.free, block_size,
                              hits.host.queries, hits.host.hits, host.pool.num_evictions, hs.in_flight,
                              host.pool.num_lossy_evictions, t.bytes_in, t.bytes_out, t.seconds_in,
                              t.seconds_out, t.failed_in + save_submit_failures,
                              t.failed_out + load_submit_failures))
    if disk is not None and hits.disk is not None:
        ds, d, bb = disk.pool.stats(), disk.stats, host.block_bytes
        out.append(TierReport("disk", ds.total, ds.in_use, ds.cached_free, ds.free, block_size,
                              hits.disk.queries, hits.disk.hits, disk.pool.num_evictions, ds.in_flight,
                              d.lossy_evictions, d.blocks_written * bb, d.blocks_read * bb,
                              d.seconds_written, d.seconds_read, d.write_failures, d.read_failures))
    return out
