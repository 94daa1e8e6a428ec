"""Attention backends over the paged KV cache.

The cache is one tensor per tier, block-major: [num_blocks, num_layers, 2, *block_shape], so one
block of all layers is contiguous and moves between tiers in one copy. The layout *inside* a block
belongs to the backend: the torch backend uses [kv_heads, block_size, head_dim] (head-major: a
gather over (block, head) rows yields K as [seqs, heads, tokens, dim], ready for bmm with no
copy); flash-attn needs [block_size, kv_heads, head_dim].

`prepare(batch)` builds the step's metadata once; `forward(q, k, v, layer)` writes the new K/V into
the cache and attends. The runner orders each batch decodes first (one query token each), then
prefill chunks, so decodes are attended together.

Sliding windows (Gemma 3, Mistral): `windows[layer]` > 0 makes that layer's query at absolute position p
see only keys p - window < j <= p (HF transformers' sliding mask: `window` keys, itself included); 0 is
plain causal, and an empty tuple means no layer has a window. The cache still holds every position; only
the attention math changes (the kernels skip blocks wholly out of the window).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanoserve.kernels.plan import KernelStep


@dataclass
class AttentionBatch:
    """One step, sequences in batch order; the first `num_decodes` have exactly one query token."""
    query_lens: list[int]
    context_lens: list[int]           # tokens visible to each sequence after this step
    block_tables: list[list[int]]
    num_decodes: int
    slot_blocks: torch.Tensor         # [num_tokens] block of each new token
    slot_offsets: torch.Tensor        # [num_tokens] offset inside that block


class AttentionBackend(ABC):
    def __init__(self, kv_cache: torch.Tensor, num_heads: int, scale: float,
                 windows: tuple[int, ...] = ()) -> None:
        self.kv_cache = kv_cache
        self.num_heads = num_heads
        self.scale = scale
        windows = tuple(int(w or 0) for w in windows)  # None (HF's "no window") reads as 0
        if windows and len(windows) != kv_cache.shape[1]:
            raise ValueError(f"{len(windows)} sliding windows for a cache of {kv_cache.shape[1]} layers")
        if any(w < 0 for w in windows):
            raise ValueError(f"sliding windows must be >= 0 (0: none), got {windows}")
        self.windows = windows if any(windows) else ()

    def window(self, layer: int) -> int:
        """That layer's sliding window in keys, 0 for plain causal attention."""
        return self.windows[layer] if self.windows else 0

    @staticmethod
    @abstractmethod
    def block_shape(block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, int, int]:
        """Shape of one layer's K (or V) within a block."""

    @abstractmethod
    def prepare(self, batch: AttentionBatch) -> None: ...

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] for the step's new tokens -> [T, H, D]."""

    def kernel_step(self) -> KernelStep | None:
        """This step's arguments for the C++ layer loop (csrc/decoder_stack.cpp), where this backend is the
        CPU kernels' it calls; else None (the model's torch loop calls `forward`)."""
        return None


@dataclass
class _Prefill:
    start: int
    end: int
    context_len: int
    blocks: torch.Tensor | None  # None: no earlier context, attend the chunk itself causally


class TorchAttention(AttentionBackend):
    """CPU (and any device) backend. On CPU the C++ kernels of kernels/cpu_kernels.py read the
    blocks in place: one call attends all decodes, one all prefill chunks (fresh prompts, prefix
    hits and continuations alike: their new K/V are written to the cache first). Without them (no
    compiler, another device, NANOSERVE_CPU_KERNELS=0): decodes by one gather per layer of K and V
    of every decoding sequence, then two bmm calls (for a single query, CPU SDPA is no faster);
    prefill chunks by SDPA per sequence, on the chunk itself or on its gathered context."""

    def __init__(self, kv_cache: torch.Tensor, num_heads: int, scale: float, kernels=None,
                 windows: tuple[int, ...] = ()) -> None:
        """`kernels`: kernels/cpu_kernels.py's module (CPU caches only), or None for the torch path."""
        super().__init__(kv_cache, num_heads, scale, windows)
        # the kernels serve the head dims they are built for (64 and 128: the Llama family's, 256: Gemma 3's);
        # a model of any other runs this backend's torch path, and with it the model's torch loop
        self.kernels = kernels if kernels is not None and kv_cache.shape[-1] in kernels.head_dims else None
        self.amx = True  # prefill GEMMs on AMX tiles where the CPU has them (tests turn it off)
        # chunks over cached context: CPU SDPA takes the bool mask with GQA; CUDA needs the bias
        self.causal_bias = kv_cache.device.type != "cpu"

    @staticmethod
    def block_shape(block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, int, int]:
        return (num_kv_heads, block_size, head_dim)

    def prepare(self, batch: AttentionBatch) -> None:
        self.batch = batch
        dev = self.kv_cache.device
        _, _, _, kh, bs, _ = self.kv_cache.shape
        nd = batch.num_decodes
        if nd:
            max_blocks = max(-(-c // bs) for c in batch.context_lens[:nd])
            table = torch.zeros(nd, max_blocks, dtype=torch.long)
            for i, bt in enumerate(batch.block_tables[:nd]):
                n = -(-batch.context_lens[i] // bs)
                table[i, :n] = torch.tensor(bt[:n])
            if self.kernels is not None:
                self.dec_table, self.dec_ctx = table, torch.tensor(batch.context_lens[:nd])
            else:
                self._prepare_gather(table, batch.context_lens[:nd])
        self.prefills: list[_Prefill] = []
        self.pre_args: tuple[torch.Tensor, ...] | None = None
        lens, ctxs, tables = batch.query_lens[nd:], batch.context_lens[nd:], batch.block_tables[nd:]
        if self.kernels is not None and lens:  # one kernel call attends every prefill chunk in place
            nblk = [-(-c // bs) for c in ctxs]
            table = torch.tensor([bt[:n] + [0] * (max(nblk) - n) for bt, n in zip(tables, nblk)])
            starts = torch.tensor([0] + lens[:-1]).cumsum(0)
            self.pre_args = (table, starts, torch.tensor(lens), torch.tensor(ctxs))
            return
        start = nd
        for qlen, ctx, bt in zip(lens, ctxs, tables):
            blocks = None if ctx == qlen else torch.tensor(bt[:-(-ctx // bs)], device=dev)
            self.prefills.append(_Prefill(start, start + qlen, ctx, blocks))
            start += qlen

    def kernel_step(self) -> KernelStep | None:
        if self.kernels is None:
            return None
        b, nd = self.batch, self.batch.num_decodes
        decodes = (self.dec_table, self.dec_ctx) if nd else (None, None)
        return KernelStep(self.kv_cache, b.slot_blocks, b.slot_offsets, nd, *decodes,
                          *(self.pre_args or (None,) * 4), self.scale, self.amx, self.windows)

    def _prepare_gather(self, table: torch.Tensor, context_lens: list[int]) -> None:
        # Rows of the whole cache viewed as [N * layers * 2 * kh, bs * D] (a free view: the
        # tensor is contiguous), ordered [k/v, seq, head, block]: one index_select per layer
        # then yields K and V as [2, seq * head, tokens, D], ready for bmm.
        dev = self.kv_cache.device
        _, n_layers, _, kh, bs, _ = self.kv_cache.shape
        nd, max_blocks = table.shape
        rows = table.unsqueeze(1) * (n_layers * 2 * kh) + torch.arange(kh).view(1, kh, 1)
        rows = torch.stack((rows, rows + kh)).view(1, -1)
        self.dec_rows = (rows + (torch.arange(n_layers) * 2 * kh).view(-1, 1)).to(dev)
        ctx = torch.tensor(context_lens, device=dev)[:, None]
        pos = torch.arange(max_blocks * bs, device=dev)[None, :]
        self.dec_bias: dict[int, torch.Tensor] = {}  # by window: a key past the context or before the window
        for w in set(self.windows or (0,)):
            hidden = (pos >= ctx) | (pos < ctx - w) if w else pos >= ctx
            bias = torch.zeros(nd, max_blocks * bs, dtype=self.kv_cache.dtype, device=dev)
            self.dec_bias[w] = bias.masked_fill_(hidden, float("-inf")).view(nd, 1, 1, -1)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        b = self.batch
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous; q may be a strided view
        nd = b.num_decodes
        window = self.window(layer)
        if self.kernels is not None:  # they read q's strided rows in place and write straight into out
            self.kernels.write_kv(k, v, self.kv_cache, layer, b.slot_blocks, b.slot_offsets)
            if nd:
                self.kernels.paged_decode_attention(q[:nd], self.kv_cache, layer, self.dec_table,
                                                    self.dec_ctx, self.scale, out[:nd], window)
            if self.pre_args is not None:
                self.kernels.paged_prefill_attention(q[nd:], out[nd:], self.kv_cache, layer, *self.pre_args,
                                                     self.scale, self.amx, window)
            return out
        k_cache, v_cache = self.kv_cache[:, layer, 0], self.kv_cache[:, layer, 1]  # [N, kh, bs, D]
        # indexed assignment writes in place (index_put_); `cache[idx].copy_()` would not
        k_cache[b.slot_blocks, :, b.slot_offsets] = k
        v_cache[b.slot_blocks, :, b.slot_offsets] = v
        if nd:
            out[:nd] = self._decode(q[:nd], layer)
        for p in self.prefills:
            qp = q[p.start:p.end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            if p.blocks is None:
                kp = k[p.start:p.end].transpose(0, 1).unsqueeze(0)
                vp = v[p.start:p.end].transpose(0, 1).unsqueeze(0)
            else:
                kp, vp = self._gather_context(k_cache, p), self._gather_context(v_cache, p)
            if p.blocks is None and not 0 < window < p.end - p.start:
                o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=self.scale,
                                                   enable_gqa=True)
            else:
                o = self._attend_context(qp, kp, vp, window)
            out[p.start:p.end] = o.squeeze(0).transpose(0, 1)
        return out

    def _attend_context(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        window: int = 0) -> torch.Tensor:
        """A chunk q [1, H, n, D] over its whole context k/v [1, kh, ctx, D]: query i (absolute
        position ctx-n+i) sees keys 0..ctx-n+i, or with a window only the last `window` of them."""
        n, ctx = q.shape[2], k.shape[2]
        if 0 < window < ctx:
            return self._attend_window(q, k, v, window)
        if self.causal_bias:
            # a bool mask, or GQA, makes SDPA on CUDA fall back to its math kernel (at 32k, tens of
            # GB of temporaries); the lower-right causal bias over expanded heads keeps the
            # efficient kernels
            # imported here: torch.nn.attention.bias pulls in torch._dynamo (and with it triton), a
            # second of start-up the CPU path never needs
            from torch.nn.attention.bias import causal_lower_right
            g = q.shape[1] // k.shape[1]
            return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1),
                                                  attn_mask=causal_lower_right(n, ctx), scale=self.scale)
        mask = torch.ones(n, ctx, dtype=torch.bool, device=q.device).tril(ctx - n)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True)

    def _attend_window(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
        """_attend_context's sliding-window case: query i sees keys ctx-n+i-window < j <= ctx-n+i. The
        band as an explicit mask (a float bias over expanded heads on CUDA, where a bool mask with GQA
        falls back to SDPA's math kernel anyway; this path is CUDA's fallback only)."""
        n, ctx = q.shape[2], k.shape[2]
        ones = torch.ones(n, ctx, dtype=torch.bool, device=q.device)
        mask = ones.tril(ctx - n) & ones.triu(ctx - n - window + 1)
        if not self.causal_bias:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True)
        g = q.shape[1] // k.shape[1]
        bias = torch.zeros(n, ctx, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
        return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1),
                                              attn_mask=bias, scale=self.scale)

    @staticmethod
    def _gather_context(cache: torch.Tensor, p: _Prefill) -> torch.Tensor:
        """[1, kh, context_len, D] from the sequence's blocks."""
        g = cache.index_select(0, p.blocks)  # [nblk, kh, bs, D]
        kh, d = g.shape[1], g.shape[3]
        return g.transpose(0, 1).reshape(kh, -1, d)[:, :p.context_len].unsqueeze(0)

    def _decode(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        nd, h, d = q.shape
        kh = self.kv_cache.shape[3]
        g = h // kh
        tiles = self.kv_cache.view(-1, self.kv_cache.shape[4] * d)
        kv = tiles.index_select(0, self.dec_rows[layer]).view(2, nd * kh, -1, d)
        qg = (q * self.scale).view(nd * kh, g, d)
        scores = torch.bmm(qg, kv[0].transpose(1, 2)).view(nd, kh, g, -1) + self.dec_bias[self.window(layer)]
        probs = scores.float().softmax(dim=-1).to(q.dtype).view(nd * kh, g, -1)
        return torch.bmm(probs, kv[1]).view(nd, h, d)
