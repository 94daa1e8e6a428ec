"""A KV tier's state and counters as the engine reports them (torch-free: it crosses to the API process)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TierReport:
    """One KV tier's state and counters, for /metrics and logs."""
    tier: str                 # "device" | "host" | "disk"
    blocks_total: int
    blocks_in_use: int
    blocks_cached: int        # free but still findable by the prefix cache
    blocks_free: int
    block_size: int
    query_tokens: int         # prompt tokens looked up in this tier
    hit_tokens: int           # prompt tokens served from this tier
    evictions: int
    blocks_in_flight: int = 0  # held only by copies still running
    lossy_evictions: int = 0  # of `evictions`: KV dropped with no copy in another tier
    bytes_in: int = 0         # host tier: bytes copied device -> host (disk: host -> disk)
    bytes_out: int = 0        # host tier: bytes copied host -> device
    seconds_in: float = 0.0
    seconds_out: float = 0.0
    save_failures: int = 0    # host tier: saves that failed or could not start (that KV was not kept)
    load_failures: int = 0    # host tier: loads that failed or could not start (recomputed instead); disk:
    #                           reads that failed or did not verify against their checksum
