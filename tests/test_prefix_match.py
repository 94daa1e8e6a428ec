"""The whole-tier match (`PrefixChains.match_runs`: list passes for the usual shape, numpy for any other)
finds what the link-by-link walk finds, whatever mix of device hits, loads in flight and host hits."""
from __future__ import annotations

import random

import pytest
import torch

from nanoserve import SamplingParams
from nanoserve.kvcache.host_tier import HostTier
from nanoserve.kvcache.manager import KVCacheManager
from nanoserve.kvcache.native import KVKernels
from nanoserve.kvcache.prefix import PrefixMatch
from nanoserve.kvcache.transfer import Copier, Transfer
from nanoserve.sequence import Sequence
from tests.test_cpu_kernels import kernels  # noqa: F401 - the module fixture (skips without a toolchain)

BS = 2


class Pending(Transfer):
    def done(self) -> bool:
        return False

    def wait(self, timeout: float | None = None) -> bool:
        return False


class NeverCopier(Copier):
    """Loads stay in flight: the match must find them as loading."""

    def _open_lane(self, name: str) -> None:
        return None

    def submit(self, lane, src, src_ids, dst, dst_ids, pairs=None) -> Transfer:
        return Pending()


def _match_is_the_walk(states: list[str], rng: random.Random, kernels, fast: bool | None = None) -> None:
    """Per link a state (D: on device and host, d: on device only, L: a load in flight fills it, H: on host,
    -: nowhere):
    the whole-tier match equals the walk, with and without the host; `fast`: whether the list-pass path
    (`_match_plain`) must be the one that answers."""
    n = len(states)
    host = HostTier(64, torch.zeros(64, 1, 2, 1, BS, 1), NeverCopier(), kernels=KVKernels.of(kernels))
    kv = KVCacheManager(64, BS, host=host, kernels=KVKernels.of(kernels))
    seq = Sequence(1, "1", 0, [rng.randrange(100) for _ in range((n + 1) * BS)], SamplingParams(), 4,
                   frozenset())
    kv.hash_prompt(seq)
    loads: list[list[int]] = []
    for i, s in enumerate(states):
        h, key = seq.block_hashes[i], seq.block_keys[i]
        if s in "DH" or s == "L":
            hb = host.pool.allocate_pinned()
            host.pool.publish(hb, h, key)
            host.pool.unpin(hb)
        if s in "Dd":
            db = kv.pool.allocate()
            kv.pool.publish(db, h, key)
            kv.pool.release(db)
        if s == "L":  # consecutive loading links share a load, as a request's would
            if loads and loads[-1][-1] == i - 1 and rng.random() < 0.7:
                loads[-1].append(i)
            else:
                loads.append([i])
    for links in loads:
        hashes = [seq.block_hashes[i] for i in links]
        kv.copies.begin_load(hashes, [seq.block_keys[i] for i in links],
                             [host.pool.index[h] for h in hashes], [kv.pool.allocate() for _ in links])
    for h in seq.block_hashes:
        kv.copies._refresh(h)  # the clean flags, as the tiers keep them
    kv.check_invariants()  # (HostTier.on_device among them)
    if fast is not None:
        plain = kv.chains._match_plain(seq.block_hashes, seq.block_keys, host, None)
        assert (plain is not None) == fast, states
    for use_host in (True, False):
        want = PrefixMatch.of_hits(kv.chains._walk(seq, use_host))
        got = kv.chains.match_runs(seq, use_host)
        assert (got.blocks, got.runs) == (want.blocks, want.runs), states


@pytest.mark.parametrize("native", [False, True], ids=["python", "kernels"])
@pytest.mark.parametrize("seed", range(30))
def test_match_runs_is_the_walk(seed: int, native: bool, request) -> None:
    """Also with the C++ run finding (chain_runs.stored_runs)."""
    rng = random.Random(seed)
    states = [rng.choice("DLHH-" if seed % 3 else "DH-") for _ in range(24)]
    if seed % 2:  # the usual shape: device hits, then host hits (the list-pass path), then misses
        states.sort(key="DLH-".index)
    _match_is_the_walk(states, rng, request.getfixturevalue("kernels") if native else None)


@pytest.mark.parametrize("native", [False, True], ids=["python", "kernels"])
@pytest.mark.parametrize("shape", ["HHDHH-", "HHHHD", "HHH-D", "HHHHHD-H", "DHHDH", "HHHHHH", "HDDDD",
                                   "HHHd", "HHdH-", "HHHdd", "DDHHH-", "H-HH"])
def test_a_chain_starting_on_host_with_device_links_is_the_walk(shape: str, native: bool, request) -> None:
    """A chain whose first link is on host only: the match asks the device about the host run's links by
    a byte per host block (HostTier.on_device), and about the link past the run; a device link inside or
    right after the run makes it another shape (the list-pass path declines it), which the walk must agree
    with. (D is on host too: inside a host run.)"""
    fast = shape in ("HHH-D", "HHHHHH", "DDHHH-", "H-HH")
    _match_is_the_walk(list(shape), random.Random(0), request.getfixturevalue("kernels") if native else None,
                       fast)
