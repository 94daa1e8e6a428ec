"""A sequence's chain of full blocks and where each link is cached.

Each full block is named by a keyed digest of (parent digest, its tokens), computed once per
sequence (when the request arrives, for the prompt) and kept with its `BlockKey`, so that matching
a long prompt in a step costs dictionary lookups, not hashing. A match walks the chain and takes
each link from the device index, then the loads in flight, then the host index, stopping at the
first miss.
"""
from __future__ import annotations

import enum
import hashlib
import os

from nanoserve.kvcache.block_pool import BlockHash, BlockKey, BlockPool, chain_hash
from nanoserve.kvcache.copies import TierCopies
from nanoserve.sequence import Sequence


class Tier(str, enum.Enum):
    DEVICE = "device"    # cached on device
    LOADING = "loading"  # a device block a load in flight is filling
    HOST = "host"        # cached on host only


# (tier, block): a host block for Tier.HOST, else a device block. A plain tuple: a long prefix is
# thousands of hits, and building a NamedTuple each was a third of admitting one.
PrefixHit = tuple[Tier, int]


class PrefixChains:
    def __init__(self, block_size: int, pool: BlockPool, copies: TierCopies | None, enabled: bool = True,
                 hash_salt: bytes | None = None) -> None:
        self.block_size, self.pool, self.copies, self.enabled = block_size, pool, copies, enabled
        # per-process random key for block digests: clients cannot predict or collide them offline
        self.hash_salt = os.urandom(32) if hash_salt is None else hash_salt

    def hashes(self, seq: Sequence, num_blocks: int) -> list[BlockHash]:
        """Chain digests of the first `num_blocks` full blocks, extending the sequence's memo of
        digests and keys (`seq.block_keys`)."""
        hashes, keys, bs = seq.block_hashes, seq.block_keys, self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            key = BlockKey(hashes[-1] if hashes else self._root(seq),
                           tuple(seq.token_ids[i * bs:(i + 1) * bs]))
            hashes.append(chain_hash(key.parent, key.tokens, self.hash_salt))
            keys.append(key)
        return hashes if len(hashes) == num_blocks else hashes[:num_blocks]  # no copy each step

    def _root(self, seq: Sequence) -> BlockHash | None:
        """The parent of a chain's first block: none, or a keyed digest of the request's cache_salt, so
        chains under different salts share no block (lookups compare the parent too, not only digests)."""
        salt = seq.params.cache_salt
        if salt is None:
            return None
        return hashlib.blake2b(salt.encode(), digest_size=32, key=self.hash_salt[:64],
                               person=b"cache_salt").digest()

    def hash_prompt(self, seq: Sequence) -> None:
        if self.enabled:
            self.hashes(seq, (seq.num_tokens - 1) // self.block_size)

    def match(self, seq: Sequence, use_host: bool = True) -> list[PrefixHit]:
        """The sequence's leading cached full blocks. At least one token is left to compute, so the
        last prompt position always produces logits."""
        if not self.enabled or seq.wants_prompt_logprobs:
            return []  # prompt logprobs need logits at every prompt position: compute them all
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
