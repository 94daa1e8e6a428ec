"""The disk tier under the real manager, scheduler, host tier and file store: a stand-in model writes each
block's KV as a function of its whole prefix and checks every block it attends to, so a block read back
wrong (from disk, after a restart, after a corruption) fails the run. Nothing depends on the machine's
speed: copies and file I/O run on their real threads and are waited for."""
from __future__ import annotations

import errno
import os
import random
import threading
from pathlib import Path

import pytest
import torch

from nanoserve import SamplingParams
from nanoserve.kvcache.disk_store import DiskStore, load_or_create_key
from nanoserve.kvcache.disk_tier import DiskTier, disk_fingerprint
from nanoserve.kvcache.host_tier import HostTier
from nanoserve.kvcache.manager import KVCacheManager
from nanoserve.kvcache.transfer import ThreadCopier
from nanoserve.scheduler import Scheduler
from nanoserve.sequence import Sequence
from tests.test_tier_copies import BS, _run

DOCS = [[rng.randrange(100) for _ in range(13)] for rng in map(random.Random, range(6))]  # 6 full blocks each


def _tiers(directory: Path, dev_blocks: int = 16, host_blocks: int = 12, disk_slots: int = 64,
           layout: str = "test"):
    """A device pool, host tier and disk tier in `directory`, as an engine starts them (restore last)."""
    device = torch.zeros(dev_blocks, 1, 2, 1, BS, 1)
    host = HostTier(host_blocks, device, ThreadCopier())
    store = DiskStore(directory, disk_slots, host.block_bytes)
    key = load_or_create_key(directory)
    disk = DiskTier(store, host, disk_fingerprint(b"weights", layout, key), key)
    kv = KVCacheManager(dev_blocks, BS, host=host, hash_salt=key, disk=disk)
    disk.restore()
    return device, kv, disk, Scheduler(kv, max_num_seqs=3, max_num_batched_tokens=16)


def _serve(device, kv, sched, docs, rounds: int = 1) -> None:
    for r in range(rounds):
        _run(device, kv, sched, [doc + [d, r] for d, doc in enumerate(docs)])


def test_blocks_evicted_from_host_come_back_from_disk(tmp_path):
    """Six documents on a 16-block device and a 12-block host: every host block is written through to
    disk, the host evicts written ones first, and later rounds read them back from disk, verified."""
    device, kv, disk, sched = _tiers(tmp_path / "kv")
    _serve(device, kv, sched, DOCS, rounds=3)
    assert disk.stats.blocks_written > 0 and disk.stats.blocks_read > 0
    assert disk.stats.read_failures == 0 and kv.host.pool.num_lossy_evictions == 0
    report = {r.tier: r for r in kv.reports()}["disk"]
    assert report.hit_tokens == kv.hits.disk.hits > 0 and report.bytes_out > 0
    kv.close()


def test_restart_reads_the_saved_index_and_every_block_verifies(tmp_path):
    """persist() at shutdown, a new manager on the same directory: the prompts' blocks come from disk
    (none recomputed but each prompt's last partial block), every block equal to the oracle's."""
    device, kv, disk, sched = _tiers(tmp_path / "kv")
    _serve(device, kv, sched, DOCS)
    kv.persist()
    kv.close()
    device, kv, disk, sched = _tiers(tmp_path / "kv", host_blocks=48)  # room for 3 whole prompts
    assert disk.stats.restored >= len(DOCS) * 6
    _serve(device, kv, sched, DOCS)
    full_blocks = sum((len(doc) + 2 - 1) // BS for doc in DOCS)  # all but each prompt's last token
    # from disk (through host); a request preempted while its load ran finds those blocks on device later
    assert kv.hits.device.hits + kv.hits.disk.hits == full_blocks * BS
    assert kv.hits.host.hits == kv.hits.disk.hits >= full_blocks * BS // 2
    assert disk.stats.read_failures == 0
    kv.close()


def test_a_corrupted_block_is_recomputed_never_served(tmp_path):
    """One flipped byte in the data file: that block fails its checksum (counted), the request
    recomputes it, and the stand-in model sees correct KV everywhere."""
    device, kv, disk, sched = _tiers(tmp_path / "kv")
    _serve(device, kv, sched, DOCS[:2])
    kv.persist()
    kv.close()
    data = tmp_path / "kv" / "blocks.dat"
    raw = bytearray(data.read_bytes())
    raw[disk.store.slot_bytes * 3 + 1] ^= 0xFF  # slot 3's second byte
    data.write_bytes(bytes(raw))
    device, kv, disk, sched = _tiers(tmp_path / "kv")
    _serve(device, kv, sched, DOCS[:2])
    assert disk.stats.read_failures == 1 and disk.stats.blocks_read > 0
    assert {r.tier: r for r in kv.reports()}["disk"].load_failures == 1
    kv.close()


@pytest.mark.parametrize("change", ["layout", "key"])
def test_an_index_from_another_layout_or_key_is_discarded(tmp_path, change):
    device, kv, disk, sched = _tiers(tmp_path / "kv")
    _serve(device, kv, sched, DOCS[:1])
    kv.persist()
    kv.close()
    if change == "key":
        (tmp_path / "kv" / "hash_key").unlink()
    device, kv, disk, sched = _tiers(tmp_path / "kv", layout="other" if change == "layout" else "test")
    assert disk.stats.restored == 0 and disk.pool.stats().cached_free == 0
    _serve(device, kv, sched, DOCS[:1])  # still correct, from scratch
    kv.close()


def test_after_a_crash_the_older_index_serves_no_rewritten_slot(tmp_path, caplog):
    """A crash (a SIGKILL: no index saved) after the disk LRU rewrote slots of the index saved before: at
    the next start that index names chains those slots no longer hold. Each fails its checksum (counted,
    logged) and is recomputed; the slots not rewritten still serve."""
    device, kv, disk, sched = _tiers(tmp_path / "kv", disk_slots=24)
    _serve(device, kv, sched, DOCS[:3])
    kv.persist()
    kv.close()
    device, kv, disk, sched = _tiers(tmp_path / "kv", disk_slots=24)
    _serve(device, kv, sched, DOCS[3:])  # new chains written through to a full disk: old slots reused
    rewritten = disk.stats.blocks_written
    kv.close()  # no persist: the index on disk is still the first run's
    device, kv, disk, sched = _tiers(tmp_path / "kv", disk_slots=24, host_blocks=48)
    _serve(device, kv, sched, DOCS[:3])
    assert rewritten > 0 and 0 < disk.stats.read_failures <= rewritten and disk.stats.blocks_read > 0
    assert "checksum" in caplog.text
    kv.close()


def test_a_request_gone_while_its_read_runs_leaves_no_pin(tmp_path):
    """Aborted while its prefix is being read: the read lands, publishes on host, and holds nothing."""
    device, kv, disk, sched = _tiers(tmp_path / "kv")
    _serve(device, kv, sched, DOCS[:2])
    kv.persist()
    kv.close()
    device, kv, disk, sched = _tiers(tmp_path / "kv")
    gate, reads = threading.Event(), disk.store._file.reads
    disk.store._file.reads = lambda *a: (gate.wait(60), reads(*a))
    seq = Sequence(0, "0", 0, DOCS[0] + [0, 0], SamplingParams(), 2, frozenset())
    sched.add(seq)
    sched.inline_disk_wait = 0.0
    sched.schedule()
    assert disk.reads and seq in sched.waiting  # passed over while its blocks are read
    sched.finish(seq)
    gate.set()
    kv.drain_transfers()
    sched.check_invariants()
    assert not disk.staged and not any(kv.host.pool.pins) and disk.stats.blocks_read > 0
    kv.close()


def test_writes_that_keep_failing_leave_the_tier_read_only_and_serving(tmp_path, monkeypatch, caplog):
    """A full disk (every write ENOSPC): after three failed batches no write starts, the host keeps its
    blocks as without a disk, and the workload still drains with correct KV; what the disk held still
    reads."""
    device, kv, disk, sched = _tiers(tmp_path / "kv")
    _serve(device, kv, sched, DOCS[:3])
    written = disk.stats.blocks_written

    def full(*a):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "pwritev", full)
    _serve(device, kv, sched, DOCS, rounds=2)
    assert disk.degraded and not kv.host.backed and "keep failing" in caplog.text
    assert disk.stats.blocks_written == written and disk.stats.blocks_read > 0
    kv.persist()  # ends, and saves the index of what the disk holds
    kv.close()


def test_persist_ends_when_the_disk_is_smaller_than_the_device(tmp_path):
    """Each write then evicts a slot another device block needs: persist saves each dirty block at most
    about once and ends."""
    device, kv, disk, sched = _tiers(tmp_path / "kv", dev_blocks=32, host_blocks=4, disk_slots=8)
    _serve(device, kv, sched, DOCS[:3])
    kv.persist()
    assert disk.stats.blocks_written <= 3 * 8 + 8 and len(disk.pool.index) == 8
    kv.close()
