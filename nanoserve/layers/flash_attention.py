"""flash-attn paged backend.

Block layout [block_size, kv_heads, head_dim] inside the block-major cache
[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]; each layer's K and V are strided
views of it (flash-attn needs only the last dim contiguous: the cache is never copied).
Per layer: one indexed store of the step's new K/V (skipped when the caller stored them: a fused
RoPE + KV write, `kv_destination` and `forward(..., kv_written=True)`), then
- any step with a prefill chunk: one `flash_attn_varlen_func(..., block_table=...)`;
- pure-decode steps: one `flash_attn_with_kvcache(q[:, None], ..., cache_seqlens, block_table)`.
A layer with a sliding window of w keys passes `window_size=(w - 1, 0)`: flash-attn's query i (bottom-right
aligned) then sees keys [i + seqlen_k - seqlen_q - (w - 1), i + seqlen_k - seqlen_q], w keys with itself.

The flash functions come from an injected module-like object (`flash_attn` itself, or
`tests/flash_ref.py` in tests and wherever flash-attn is absent), so the
index math here runs and is tested on CPU. Metadata is int32 in persistent buffers, filled from
host staging (pinned on CUDA) with one copy per field per step, so the decode path can be
captured in a CUDA graph and replayed with new contents.
"""
from __future__ import annotations

import logging
from types import ModuleType

import numpy as np
import torch

from nanoserve.config import import_by_name
from nanoserve.layers.attention import AttentionBackend, AttentionBatch
from nanoserve.layers.staging import Staging

log = logging.getLogger("nanoserve")

FLASH_PAGE_MULTIPLE = 256  # flash-attn 2's paged kernels need page_block_size % 256 == 0


def import_flash_attn(name: str = "flash_attn") -> tuple[ModuleType | None, str | None]:
    """-> (flash_attn, None), or (None, why not); `name` is "module" or "module:attribute". A build
    for another torch or CUDA raises RuntimeError/OSError (or worse) at import, not ImportError:
    any failure means "not available"."""
    try:
        flash_attn = import_by_name(name)
    except Exception as e:  # noqa: BLE001 - whatever a broken build raises
        if not isinstance(e, ImportError):
            log.warning("flash_attn is installed but does not import (%s: %s): not using it",
                        type(e).__name__, e)
        return None, f"{type(e).__name__}: {e}"
    return flash_attn, None


def flash_works(module, device: torch.device) -> str | None:
    """None if one tiny varlen call runs on `device`, else why not (a wheel without kernels for
    this GPU's architecture imports fine and fails at the first launch)."""
    try:
        x = torch.randn(4, 2, 64, dtype=torch.bfloat16, device=device)
        cu = torch.tensor([0, 4], dtype=torch.int32, device=device)
        module.flash_attn_varlen_func(x, x, x, cu, cu, 4, 4, causal=True)
    except Exception as e:  # noqa: BLE001
        log.warning("flash_attn imports but a test call fails (%s: %s): not using it", type(e).__name__, e)
        return f"{type(e).__name__}: {e}"
    return None


class FlashAttention(AttentionBackend):
    PAGE_MULTIPLE = FLASH_PAGE_MULTIPLE
    def __init__(self, kv_cache: torch.Tensor, num_heads: int, scale: float, *, flash,
                 max_seqs: int, max_blocks_per_seq: int, scratch_block: int,
                 staging: Staging | None = None, windows: tuple[int, ...] = ()) -> None:
        super().__init__(kv_cache, num_heads, scale, windows)
        self.flash = flash
        self.block_size = kv_cache.shape[3]
        if self.block_size % self.PAGE_MULTIPLE:
            raise ValueError(f"the flash attention backend needs a block size that is a multiple of "
                             f"{self.PAGE_MULTIPLE} (flash-attn 2's paged KV kernels), got {self.block_size}")
        self.max_width = max_blocks_per_seq
        self.scratch_block = scratch_block  # never handed out: padded rows write and read here
        staging = staging or Staging(kv_cache.device)
        self.tables = staging.buffer((max_seqs, max_blocks_per_seq), torch.int32)
        self.seq_lens = staging.buffer((max_seqs,), torch.int32)
        self.cu_q = staging.buffer((max_seqs + 1,), torch.int32)
        self.cu_k = staging.buffer((max_seqs + 1,), torch.int32)

    @property
    def graph_safe(self) -> bool:
        """Whether the decode forward may be captured: the real flash-attn is sync-free there; a
        stand-in says so itself (the reference's validating checks sync)."""
        return bool(getattr(self.flash, "graph_safe", True))

    @staticmethod
    def block_shape(block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, int, int]:
        return (block_size, num_kv_heads, head_dim)

    def prepare(self, batch: AttentionBatch, pad_to: int | None = None) -> None:
        """`pad_to`: pure-decode only; pad to that many rows (each pointing at the scratch block)
        and use the full table width, so every tensor the forward reads has a fixed shape and
        address: what a captured CUDA graph replays."""
        self.batch = batch
        n, bs = len(batch.query_lens), self.block_size
        if max(n, pad_to or 0) > self.seq_lens.dev.shape[0]:
            raise ValueError(f"{max(n, pad_to or 0)} rows in one step exceed the backend's "
                             f"{self.seq_lens.dev.shape[0]} (max_num_seqs)")
        self.decode_only = batch.num_decodes == n
        # no sequence has earlier context: attend the chunk's own K/V, not the paged cache (the
        # paged varlen kernel is flash-attn's split-KV one; plain varlen is its faster forward)
        self.fresh = pad_to is None and batch.query_lens == batch.context_lens
        if pad_to is not None and not (self.decode_only and pad_to >= n):
            raise ValueError("padding applies to pure-decode steps with at most pad_to rows")
        rows = pad_to or n
        need = [-(-c // bs) for c in batch.context_lens]
        width = self.max_width if pad_to is not None else max(need)
        if width > self.max_width:
            raise ValueError(f"a sequence needs {width} blocks, more than the backend's {self.max_width}")
        t = self.tables.np
        for i, (table, k) in enumerate(zip(batch.block_tables, need)):
            t[i, :k] = table[:k]  # columns past k keep stale ids: the kernels never read them
        lens = self.seq_lens.np
        lens[:n] = batch.context_lens
        if rows > n:
            t[n:rows, 0] = self.scratch_block
            lens[n:rows] = 1
        self.block_table = self.tables.upload(rows)[:, :width]
        if self.decode_only:
            self.cache_seqlens = self.seq_lens.upload(rows)
            return
        cq, ck = self.cu_q.np, self.cu_k.np
        cq[0] = ck[0] = 0
        np.cumsum(batch.query_lens, out=cq[1:n + 1])
        np.cumsum(lens[:rows], out=ck[1:rows + 1])
        if rows > n:
            cq[n + 1:rows + 1] = cq[n] + np.arange(1, rows - n + 1)
        self.cu_seqlens_q = self.cu_q.upload(rows + 1)
        self.cu_seqlens_k = self.cu_k.upload(rows + 1)
        self.max_seqlen_q = max(batch.query_lens) if pad_to is None else 1
        # padded (graph) steps bake this int into the graph: use the table's capacity
        self.max_seqlen_k = max(batch.context_lens) if pad_to is None else width * bs

    def kv_destination(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(K cache, V cache, slot blocks, slot offsets): this layer's caches as [blocks, block_size,
        kv_heads, head_dim] views and the prepared step's block and offset of each new token, for a caller
        that stores the step's K/V itself (layers/triton_fused.py's rope_kv) and then calls
        `forward(..., kv_written=True)`."""
        b = self.batch
        return self.kv_cache[:, layer, 0], self.kv_cache[:, layer, 1], b.slot_blocks, b.slot_offsets

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                kv_written: bool = False) -> torch.Tensor:
        """kv_written: k and v are already stored at the step's slots (kv_destination); they are still
        read where a fresh prefill attends its own K/V."""
        k_cache, v_cache = self.kv_cache[:, layer, 0], self.kv_cache[:, layer, 1]  # [N, bs, kh, D] views
        b = self.batch
        # index_put_ with int64 indices: in place, and the block stride (past 2^31 elements on
        # 8B-sized caches) never passes through int32 arithmetic
        if not kv_written:
            k_cache[b.slot_blocks, b.slot_offsets] = k
            v_cache[b.slot_blocks, b.slot_offsets] = v
        window = self.window(layer)
        window_size = (window - 1, 0) if window else (-1, -1)  # (-1, -1): no window
        if self.decode_only:
            out = self.flash.flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache,
                                                     cache_seqlens=self.cache_seqlens,
                                                     block_table=self.block_table,
                                                     softmax_scale=self.scale, causal=True,
                                                     window_size=window_size)
            return out.squeeze(1)
        if self.fresh:
            return self.flash.flash_attn_varlen_func(q, k, v, self.cu_seqlens_q, self.cu_seqlens_q,
                                                     self.max_seqlen_q, self.max_seqlen_q,
                                                     softmax_scale=self.scale, causal=True,
                                                     window_size=window_size)
        return self.flash.flash_attn_varlen_func(q, k_cache, v_cache, self.cu_seqlens_q, self.cu_seqlens_k,
                                                 self.max_seqlen_q, self.max_seqlen_k,
                                                 softmax_scale=self.scale, causal=True,
                                                 window_size=window_size, block_table=self.block_table)
