"""Attention backends over the paged KV cache.

The cache is one tensor per tier, block-major: [num_blocks, num_layers, 2, block_size, kv_heads,
head_dim]. A backend gets per-layer strided views of it. `prepare(batch)` builds the step's
metadata once; `forward(q, k, v, layer)` writes the new K/V into the cache and attends.

The runner orders each batch decodes first (one query token, already-cached context), then
prefill chunks, so the torch backend can attend all decodes with one gather and one SDPA call.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionBatch:
    """What a backend needs to know about one step. Sequences are in batch order; the first
    `num_decodes` have exactly one query token."""
    query_lens: list[int]
    context_lens: list[int]           # tokens visible to each sequence after this step
    block_tables: list[list[int]]
    num_decodes: int
    slot_blocks: torch.Tensor         # [num_tokens] block of each new token
    slot_offsets: torch.Tensor        # [num_tokens] offset inside that block


class AttentionBackend(ABC):
    def __init__(self, kv_cache: torch.Tensor, num_heads: int, scale: float) -> None:
        self.kv_cache = kv_cache
        self.num_heads = num_heads
        self.scale = scale
        self.block_size = kv_cache.shape[3]

    @abstractmethod
    def prepare(self, batch: AttentionBatch) -> None: ...

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] for the step's new tokens -> [T, H, D]."""


@dataclass
class _Prefill:
    start: int
    end: int
    context_len: int
    blocks: torch.Tensor | None  # None: no earlier context, attend the chunk itself causally


class TorchAttention(AttentionBackend):
    """CPU (and any device) backend: SDPA on gathered blocks. Decodes are batched: one index_select
    per layer fetches every decode's blocks at once, padded to the longest context and masked."""

    def prepare(self, batch: AttentionBatch) -> None:
        self.batch = batch
        dev = self.kv_cache.device
        bs = self.block_size
        nd = batch.num_decodes
        self.dec_tables = self.dec_mask = None
        if nd:
            max_blocks = max(-(-c // bs) for c in batch.context_lens[:nd])
            table = torch.zeros(nd, max_blocks, dtype=torch.long)
            for i, bt in enumerate(batch.block_tables[:nd]):
                n = -(-batch.context_lens[i] // bs)
                table[i, :n] = torch.tensor(bt[:n])
            self.dec_tables = table.to(dev).view(-1)
            ctx = torch.tensor(batch.context_lens[:nd], device=dev)
            pos = torch.arange(max_blocks * bs, device=dev)
            self.dec_mask = (pos[None, :] < ctx[:, None]).view(nd, 1, 1, -1)
            self.dec_max_blocks = max_blocks
        self.prefills: list[_Prefill] = []
        start = nd
        for qlen, ctx, bt in zip(batch.query_lens[nd:], batch.context_lens[nd:], batch.block_tables[nd:]):
            blocks = None if ctx == qlen else torch.tensor(bt[:-(-ctx // bs)], device=dev)
            self.prefills.append(_Prefill(start, start + qlen, ctx, blocks))
            start += qlen

    def _layer_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        kv = self.kv_cache[:, layer]
        return kv[:, 0], kv[:, 1]  # [num_blocks, block_size, Hkv, D] each, strided

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        k_cache, v_cache = self._layer_cache(layer)
        b = self.batch
        # Indexed assignment writes in place (index_put_); `cache[idx].copy_()` would not.
        k_cache[b.slot_blocks, b.slot_offsets] = k
        v_cache[b.slot_blocks, b.slot_offsets] = v
        out = torch.empty_like(q)
        nd = b.num_decodes
        if nd:
            kh, d = k.shape[1], k.shape[2]
            kd = k_cache.index_select(0, self.dec_tables).view(nd, -1, kh, d).transpose(1, 2)
            vd = v_cache.index_select(0, self.dec_tables).view(nd, -1, kh, d).transpose(1, 2)
            qd = q[:nd].unsqueeze(2)  # [nd, H, 1, D]
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=self.dec_mask, scale=self.scale,
                                               enable_gqa=True)
            out[:nd] = o.squeeze(2)
        for p in self.prefills:
            qp = q[p.start:p.end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            if p.blocks is None:
                kp = k[p.start:p.end].transpose(0, 1).unsqueeze(0)
                vp = v[p.start:p.end].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=self.scale,
                                                   enable_gqa=True)
            else:
                kh, d = k.shape[1], k.shape[2]
                kp = k_cache.index_select(0, p.blocks).view(-1, kh, d)[:p.context_len]
                vp = v_cache.index_select(0, p.blocks).view(-1, kh, d)[:p.context_len]
                n = p.end - p.start
                # query i (absolute position ctx-n+i) sees keys 0..ctx-n+i
                mask = torch.ones(n, p.context_len, dtype=torch.bool, device=q.device).tril(p.context_len - n)
                o = F.scaled_dot_product_attention(qp, kp.transpose(0, 1).unsqueeze(0),
                                                   vp.transpose(0, 1).unsqueeze(0), attn_mask=mask,
                                                   scale=self.scale, enable_gqa=True)
            out[p.start:p.end] = o.squeeze(0).transpose(0, 1)
        return out
