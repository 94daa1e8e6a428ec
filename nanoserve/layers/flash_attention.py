"""flash-attn paged backend.

Block layout [block_size, kv_heads, head_dim] inside the block-major cache
[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]; each layer's K and V are strided
views of it (flash-attn needs only the last dim contiguous: the cache is never copied).
Per layer: one indexed store of the step's new K/V, then
- any step with a prefill chunk: one `flash_attn_varlen_func(..., block_table=...)`;
- pure-decode steps: one `flash_attn_with_kvcache(q[:, None], ..., cache_seqlens, block_table)`.

The flash functions come from an injected module-like object (`flash_attn` itself, or
`nanoserve.layers.flash_ref.FlashReference` in tests and wherever flash-attn is absent), so the
index math here runs and is tested on CPU. Metadata is int32 in persistent buffers, filled from
host staging (pinned on CUDA) with one copy per field per step, so the decode path can be
captured in a CUDA graph and replayed with new contents.
"""
from __future__ import annotations

from types import ModuleType

import numpy as np
import torch

from nanoserve.layers.attention import AttentionBackend, AttentionBatch

FLASH_PAGE_MULTIPLE = 256  # flash-attn 2's paged kernels need page_block_size % 256 == 0


def import_flash_attn() -> ModuleType | None:
    try:
        import flash_attn
    except ImportError:
        return None
    return flash_attn


class Staged:
    """A persistent device tensor plus its host staging twin (the same tensor on CPU)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        self.dev = torch.zeros(shape, dtype=dtype, device=device)
        self.host = self.dev if device.type == "cpu" else torch.zeros(shape, dtype=dtype, pin_memory=True)
        self.np = self.host.numpy()

    def upload(self, n: int) -> torch.Tensor:
        """Copy the first n rows host -> device; returns the device view. Reusing the pinned host
        buffer next step is safe: the sampler syncs once per step, after this copy has run."""
        if self.host is not self.dev:
            self.dev[:n].copy_(self.host[:n], non_blocking=True)
        return self.dev[:n]


class FlashAttention(AttentionBackend):
    def __init__(self, kv_cache: torch.Tensor, num_heads: int, scale: float, *, flash,
                 max_seqs: int, max_blocks_per_seq: int, scratch_block: int) -> None:
        super().__init__(kv_cache, num_heads, scale)
        self.flash = flash
        self.block_size = kv_cache.shape[3]
        if self.block_size % FLASH_PAGE_MULTIPLE:
            raise ValueError(f"the flash attention backend needs a block size that is a multiple of "
                             f"{FLASH_PAGE_MULTIPLE} (flash-attn 2's paged KV kernels), got {self.block_size}")
        self.max_width = max_blocks_per_seq
        self.scratch_block = scratch_block  # never handed out: padded rows write and read here
        dev = kv_cache.device
        self.tables = Staged((max_seqs, max_blocks_per_seq), torch.int32, dev)
        self.seq_lens = Staged((max_seqs,), torch.int32, dev)
        self.cu_q = Staged((max_seqs + 1,), torch.int32, dev)
        self.cu_k = Staged((max_seqs + 1,), torch.int32, dev)
        self.decode_with_varlen = False  # set when with_kvcache cannot be graph-captured

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
        if self.decode_only and not self.decode_with_varlen:
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

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        k_cache, v_cache = self.kv_cache[:, layer, 0], self.kv_cache[:, layer, 1]  # [N, bs, kh, D] views
        b = self.batch
        # index_put_ with int64 indices: in place, and the block stride (past 2^31 elements on
        # 8B-sized caches) never passes through int32 arithmetic
        k_cache[b.slot_blocks, b.slot_offsets] = k
        v_cache[b.slot_blocks, b.slot_offsets] = v
        if self.decode_only and not self.decode_with_varlen:
            out = self.flash.flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache,
                                                     cache_seqlens=self.cache_seqlens,
                                                     block_table=self.block_table,
                                                     softmax_scale=self.scale, causal=True)
            return out.squeeze(1)
        return self.flash.flash_attn_varlen_func(q, k_cache, v_cache, self.cu_seqlens_q, self.cu_seqlens_k,
                                                 self.max_seqlen_q, self.max_seqlen_k,
                                                 softmax_scale=self.scale, causal=True,
                                                 block_table=self.block_table)


def resolve_attention(choice: str, device: torch.device, dtype: torch.dtype, block_size: int,
                      flash_module=None) -> tuple[type[AttentionBackend], object | None, int]:
    """-> (backend class, flash module or None, block size) for `--attention-backend` and
    `--block-size` (0 = the backend's default: 256 with flash, 16 with torch on CPU, 256 on CUDA).
    `auto` is flash when a `flash_attn` module (or an injected stand-in) is there and the device
    is CUDA. The flash backend itself is not tied to CUDA: any module with flash-attn 2.8's API
    works (the tests run it on CPU through nanoserve.layers.flash_ref)."""
    from nanoserve.layers.attention import TorchAttention
    if choice not in ("auto", "flash", "torch"):
        raise ValueError(f"attention backend must be auto|flash|torch, got {choice!r}")
    module = flash_module
    if choice != "torch" and module is None:
        module = import_flash_attn()
    use_flash = choice == "flash" or (choice == "auto" and module is not None and device.type == "cuda")
    if not use_flash:
        return TorchAttention, None, block_size or (256 if device.type == "cuda" else 16)
    if module is None:
        raise ValueError("--attention-backend flash needs the flash-attn package (pip install flash-attn, "
                         "version 2.8); it does not import here. Use --attention-backend torch")
    if dtype == torch.float32 and not getattr(module, "supports_fp32", False):
        raise ValueError("flash-attn computes in fp16/bf16 only: use --dtype bfloat16 (or float16) with "
                         "--attention-backend flash, or --attention-backend torch for fp32")
    block_size = block_size or FLASH_PAGE_MULTIPLE
    if block_size % FLASH_PAGE_MULTIPLE:
        raise ValueError(f"--block-size {block_size} does not work with the flash attention backend: "
                         f"flash-attn 2's paged KV kernels need a multiple of {FLASH_PAGE_MULTIPLE} "
                         f"(leave --block-size at 0 for {FLASH_PAGE_MULTIPLE})")
    return FlashAttention, module, block_size
