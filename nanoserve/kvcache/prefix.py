"""A sequence's chain of full blocks and where each link is cached.

Each full block is named by a keyed digest of (parent digest, its tokens), computed once per
sequence (when the request arrives, for the prompt: on the engine core's intake thread) and kept with
its `BlockKey`, so that matching a long prompt in a step costs dictionary lookups, not hashing. A match
takes each link from the device index, then the loads in flight, then the host index, stopping at the
first miss. (Not only the chain's leading links can be on device: a prefix loaded from host is clean
and the LRU evicts clean blocks first, so a conversation's front often leaves the device before its
tail.) It is done a whole tier at a time (one lookup pass over the device index when the chain starts
there; the host's links a run of consecutive host blocks at a time, found and verified by their keys,
chain_runs.py, with a byte per host block saying whether the device holds it too, so a chain starting on
host is never looked up in the device index link by link; a verifying key comparison per run of the other
tiers) rather than link by link: a 2,048-block prefix is matched in a few C-level passes. A run whose keys
do not all verify (a digest collision: never seen) sends the match to the link-by-link walk.
"""
from __future__ import annotations

import enum
import hashlib
import os
from array import array
from collections import deque
from dataclasses import dataclass
from functools import partial
from itertools import chain, repeat

import numpy as np

from nanoserve.kvcache.block_pool import BlockHash, BlockKey, BlockPool, Span
from nanoserve.kvcache.chain_runs import canonical, stored_runs
from nanoserve.kvcache.copies import TierCopies, loading_links
from nanoserve.kvcache.native import ChainDigests
from nanoserve.sequence import Sequence


class Tier(str, enum.Enum):
    DEVICE = "device"    # cached on device
    LOADING = "loading"  # a device block a load in flight is filling
    HOST = "host"        # cached on host only


# (tier, block): a host block for Tier.HOST, else a device block. A plain tuple: a long prefix is
# thousands of hits, and building a NamedTuple each was a third of admitting one.
PrefixHit = tuple[Tier, int]


@dataclass
class PrefixMatch:
    """A sequence's leading cached blocks: per link its block (device, or host for Tier.HOST), and the
    links as runs of one tier each, (tier, first link, end link) in chain order."""
    blocks: list[int]
    runs: list[tuple[Tier, int, int]]
    # the host links' blocks as runs [start, stop) of consecutive ids, when the match found them so
    host_spans: list[tuple[int, int]] | None = None

    def __len__(self) -> int:
        return len(self.blocks)

    def of(self, tier: Tier) -> list[int]:
        """The blocks of one tier, in chain order."""
        return self.links(tier, self.blocks)

    def links(self, tier: Tier, per_link: list) -> list:
        """`per_link` (a list indexed by link) at the links of one tier, in chain order."""
        mine = [(lo, hi) for t, lo, hi in self.runs if t is tier]
        if len(mine) == 1:  # the usual case: one slice, no chaining
            return per_link[mine[0][0]:mine[0][1]]
        return list(chain.from_iterable(per_link[lo:hi] for t, lo, hi in self.runs if t is tier))

    def hits(self) -> list[PrefixHit]:
        return [(t, b) for t, lo, hi in self.runs for b in self.blocks[lo:hi]]

    @staticmethod
    def of_hits(hits: list[PrefixHit]) -> PrefixMatch:
        runs: list[tuple[Tier, int, int]] = []
        for i, (t, _) in enumerate(hits):
            if runs and runs[-1][0] is t:
                runs[-1] = (t, runs[-1][1], i + 1)
            else:
                runs.append((t, i, i + 1))
        return PrefixMatch([b for _, b in hits], runs)


_TIERS = (Tier.DEVICE, Tier.LOADING, Tier.HOST)
_NO_PARENT = b"\0" * 32


def chain_links(parent: BlockHash | None, token_ids: list[int], block_size: int, salt: bytes,
                digests_of: ChainDigests | None = None) -> tuple[list[BlockKey], list[BlockHash]]:
    """The keys and digests (`chain_hash`) of the full blocks of `token_ids`, the first one's parent being
    `parent`. The tokens are converted once and sliced per block. `digests_of`: the C++ kernel
    (cpu_kernels' chain_digests: the same digests, the GIL released); else the keyed hash state is copied,
    not keyed again, per block. Each digest's `hash()` is taken here, where a request arrives, not in
    the step's first index lookup."""
    data, step = array("q", token_ids).tobytes(), 8 * block_size
    ends = range(step, len(data) + 1, step)
    if digests_of is not None:
        joined = digests_of(data, block_size, parent, salt[:64])
        digests = [joined[i:i + 32] for i in range(0, len(joined), 32)]
    else:
        keyed, digests = hashlib.blake2b(digest_size=32, key=salt[:64]), []
        for end in ends:
            h = keyed.copy()
            h.update(digests[-1] if digests else parent if parent is not None else _NO_PARENT)
            h.update(data[end - step:end])
            digests.append(h.digest())
    # (tuple.__new__ through C: a NamedTuple's own __new__ is a Python call per key)
    tokens = [data[e - step:e] for e in ends]
    keys = list(map(partial(tuple.__new__, BlockKey), zip([parent, *digests], tokens)))
    deque(map(hash, digests), maxlen=0)
    return keys, digests


class PrefixChains:
    def __init__(self, block_size: int, pool: BlockPool, copies: TierCopies | None, enabled: bool = True,
                 hash_salt: bytes | None = None, digests_of: ChainDigests | None = None) -> None:
        self.block_size, self.pool, self.copies, self.enabled = block_size, pool, copies, enabled
        self.digests_of = digests_of  # the C++ chain hashing, where the kernels are built
        # per-process random key for block digests: clients cannot predict or collide them offline
        self.hash_salt = os.urandom(32) if hash_salt is None else hash_salt

    def hashes(self, seq: Sequence, num_blocks: int) -> list[BlockHash]:
        """Chain digests of the first `num_blocks` full blocks, extending the sequence's memo of
        digests and keys (`seq.block_keys`)."""
        hashes, bs = seq.block_hashes, self.block_size
        if len(hashes) < num_blocks:
            start = len(hashes)
            keys, digests = chain_links(hashes[-1] if hashes else self._root(seq.params.cache_salt),
                                        seq.token_ids[start * bs:num_blocks * bs], bs, self.hash_salt,
                                        self.digests_of)
            seq.block_keys += keys
            hashes += digests
        return hashes if len(hashes) == num_blocks else hashes[:num_blocks]  # no copy each step

    def _root(self, salt: str | None) -> BlockHash | None:
        """The parent of a chain's first block: none, or a keyed digest of the request's cache_salt, so
        chains under different salts share no block (lookups compare the parent too, not only digests).
        Its second half is a keyed mark of its first (the salt's id), so a root is told from a block's
        digest without remembering salts (`salt_id`)."""
        if salt is None:
            return None
        ident = hashlib.blake2b(salt.encode(), digest_size=16, key=self.hash_salt[:64],
                                person=b"cache_salt").digest()
        return ident + self._root_mark(ident)

    def _root_mark(self, ident: bytes) -> bytes:
        return hashlib.blake2b(ident, digest_size=16, key=self.hash_salt[:64], person=b"salt root").digest()

    def salt_id(self, parent: BlockHash) -> str | None:
        """For KV events: the salt's id (hex of its keyed digest) if `parent` is a salted chain's root,
        else None (a block's digest: carrying the mark by chance is a 2**-128 event)."""
        return parent[:16].hex() if parent[16:] == self._root_mark(parent[:16]) else None

    def hash_prompt(self, seq: Sequence) -> None:
        if self.enabled:
            self.hashes(seq, (seq.num_tokens - 1) // self.block_size)

    def prompt_chain(self, token_ids: list[int],
                     cache_salt: str | None) -> tuple[list[BlockKey], list[BlockHash]] | None:
        """What `hash_prompt` gives a sequence with this prompt (keys, digests), for a request's sequences
        to start with (`Sequence.block_keys`, `block_hashes`), their objects swapped for the equal ones the
        tiers hold (chain_runs.canonical). Safe on a thread beside the engine's (it reads the key, and
        the pools only to swap equal objects), so the engine core hashes an arriving prompt on its
        intake thread, not in the loop. None when prefix caching is off."""
        if not self.enabled:
            return None
        n = (len(token_ids) - 1) // self.block_size
        keys, digests = chain_links(self._root(cache_salt), token_ids[:n * self.block_size], self.block_size,
                                    self.hash_salt, self.digests_of)
        canonical([self.pool] + ([self.copies.host.pool] if self.copies is not None else []), keys, digests)
        return keys, digests

    def match(self, seq: Sequence, use_host: bool = True) -> list[PrefixHit]:
        """The sequence's leading cached full blocks, link by link (see `match_runs`)."""
        return self.match_runs(seq, use_host).hits()

    def match_runs(self, seq: Sequence, use_host: bool = True) -> PrefixMatch:
        """The sequence's leading cached full blocks. At least one token is left to compute, so the
        last prompt position always produces logits."""
        if not self.enabled or seq.wants_prompt_logprobs:
            # prompt logprobs need logits at every prompt position: compute them all
            return PrefixMatch([], [])
        hashes = self.hashes(seq, (seq.num_tokens - 1) // self.block_size)
        copies = self.copies
        host = copies.host if copies is not None and use_host else None
        loading = copies if copies is not None and copies.loads else None
        loading_keys = None
        found = self._match_plain(hashes, seq.block_keys, host, loading)
        if found is None:
            found, loading_keys = self._match_tiers(hashes, host)
        if self._verified(seq, found, host, loading_keys):
            return found
        return PrefixMatch.of_hits(self._walk(seq, use_host))

    def _match_plain(self, hashes: list[BlockHash], keys: list[BlockKey], host,
                     loading: TierCopies | None) -> PrefixMatch | None:
        """The usual shape in list passes: device hits, then host hits, then a miss, with no load in
        flight among the links past the device ones. None when the chain is shaped otherwise."""
        index, n = self.pool.index, len(hashes)
        if n and hashes[0] in index:  # device hits at the start: one lookup pass
            dev = list(map(index.get, hashes))
            p = dev.index(None) if None in dev else n
            if p == n:
                return PrefixMatch(dev, [(Tier.DEVICE, 0, n)])
            if dev.count(None) != n - p:  # a device hit past a miss
                return None
            del dev[p:]
        else:  # (a host hit's usual case) the device is asked below about the host run's links only
            dev, p = [], 0
        if loading is not None and not loading.loading().keys().isdisjoint(hashes[p:]):
            return None
        runs = [(Tier.DEVICE, 0, p)] if p else []
        if host is None:  # link p is in no tier: the match ends there
            return PrefixMatch(dev, runs)
        on_host, spans = stored_runs(host.pool, hashes, keys, p)
        if not on_host:
            return PrefixMatch(dev, runs)
        end = p + len(on_host)
        if end < n and hashes[end] in index:  # the chain goes on on device past its host run
            return None
        if not p and self._on_device(host, hashes, end, spans):  # a host link on device too
            return None
        return PrefixMatch(dev + on_host if dev else on_host, runs + [(Tier.HOST, p, end)], spans)

    def _on_device(self, host, hashes: list[BlockHash], end: int, spans: list[Span] | None) -> bool:
        """Whether the device holds any of the first `end` links, which the host holds (in `spans`, when
        found as runs): a byte scan per run (HostTier.on_device), else one pass over the device index."""
        if spans is None:
            return not self.pool.index.keys().isdisjoint(hashes[:end])
        marks = host.on_device
        return any(marks.find(1, s, e) >= 0 for s, e in spans)

    def _match_tiers(self, hashes: list[BlockHash], host) -> tuple[PrefixMatch, list | None]:
        """Any shape: a tier code per link (numpy), then the runs; and the loads' keys per link."""
        n, copies = len(hashes), self.copies
        # per link: 0 device, 1 loading, 2 host, 3 miss; the first index holding it wins
        block = np.fromiter(map(self.pool.index.get, hashes, repeat(-1)), np.int64, n)
        tier = np.where(block >= 0, 0, 3)
        loading_keys = None
        if copies is not None and copies.loads:
            loading, loading_keys = loading_links(copies.loading(), hashes)
            block, tier = self._fill(block, tier, loading, 1)
        if host is not None and (tier == 3).any():
            on_host = np.fromiter(map(host.pool.index.get, hashes, repeat(-1)), np.int64, n)
            block, tier = self._fill(block, tier, on_host, 2)
        end = int(np.argmax(tier == 3)) if (tier == 3).any() else n
        cuts = np.flatnonzero(np.diff(tier[:end])) + 1
        bounds = [0, *cuts.tolist(), end] if end else [0]
        runs = [(_TIERS[int(tier[lo])], lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]
        return PrefixMatch(block[:end].tolist(), runs), loading_keys

    @staticmethod
    def _fill(block: np.ndarray, tier: np.ndarray, found: np.ndarray,
              code: int) -> tuple[np.ndarray, np.ndarray]:
        take = (tier == 3) & (found >= 0)
        return np.where(take, found, block), np.where(take, code, tier)

    def _verified(self, seq: Sequence, found: PrefixMatch, host, loading_keys: list | None) -> bool:
        """Every link's stored key is the sequence's: parent digest and tokens (one list comparison per run,
        by identity first)."""
        keys = seq.block_keys
        for t, lo, hi in found.runs:
            if t is Tier.DEVICE:
                stored = list(map(self.pool.block_key.__getitem__, found.blocks[lo:hi]))
            elif t is Tier.LOADING:
                stored = loading_keys[lo:hi]
            elif found.host_spans is not None:  # (then this is the one host run) found by its keys
                continue
            else:
                stored = list(map(host.pool.block_key.__getitem__, found.blocks[lo:hi]))
            if stored != keys[lo:hi]:
                return False
        return True

    def _walk(self, seq: Sequence, use_host: bool) -> list[PrefixHit]:
        """The match link by link: the reference `match_runs` falls back on."""
        copies = self.copies
        host = copies.host if copies is not None and use_host else None
        hits: list[PrefixHit] = []
        device, loading, on_host = Tier.DEVICE, Tier.LOADING, Tier.HOST
        for h, key in zip(self.hashes(seq, (seq.num_tokens - 1) // self.block_size), seq.block_keys):
            if (block := self.pool.lookup(h, key)) is not None:
                hits.append((device, block))
            elif copies is not None and (block := copies.loading_block(h, key)) is not None:
                hits.append((loading, block))
            elif host is not None and (block := host.lookup(h, key)) is not None:
                hits.append((on_host, block))
            else:
                break
        return hits
