"""Pure-torch stand-in for flash-attn 2.8's `flash_attn_varlen_func` and `flash_attn_with_kvcache`.

Same signatures and semantics as flash_attn/flash_attn_interface.py (and the checks of
csrc/flash_attn/flash_api.cpp), so the flash backend's index math runs, and is tested, where no
GPU or flash-attn is present:
- causal masks align to the bottom-right corner: query i of a sequence with seqlen_q queries and
  seqlen_k keys sees keys j <= i + seqlen_k - seqlen_q; a row with nothing visible outputs 0;
- window_size (left, right), -1 meaning unbounded: query i sees keys j with
  i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right; causal=True sets right to 0
  (as flash_api.cpp does), so causal local attention of w keys is window_size=(w - 1, 0);
- GQA: query head h reads KV head h // (H / H_kv);
- softmax_scale=None means 1/sqrt(head_dim);
- int32 `cu_seqlens_*` / `cache_seqlens` / `block_table`, last dims contiguous, paged page size a
  multiple of 256, fp16/bf16 only: the same errors as upstream (RuntimeError, upstream's
  TORCH_CHECK type). `FlashReference(allow_fp32=True)` lifts the dtype rule for fp32 tests.
- Only the block-table columns a sequence needs are read: unused columns may hold anything.

Beyond upstream, with `validate=True` (the default) it also raises where upstream would silently
read out of bounds (a block id outside the cache, a sequence longer than max_seqlen_*); those
checks sync, so `validate=False` gives a sync-free `flash_attn_with_kvcache` that CUDA graphs can
capture. Not implemented (they raise NotImplementedError): dropout, softcap,
ALiBi, rotary, cache_leftpad, returning attention probabilities. Attention is computed in fp32.
"""
from __future__ import annotations

import math

import torch

_HALF = (torch.float16, torch.bfloat16)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise RuntimeError(msg)


def _unsupported(**kw) -> None:
    bad = [k for k, (v, default) in kw.items() if v != default and v is not None]
    if bad:
        raise NotImplementedError(f"flash reference does not implement {', '.join(bad)}")


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
            k_len: torch.Tensor | int, window_size: tuple[int, int] = (-1, -1)) -> torch.Tensor:
    """q [B, Sq, H, D], k/v [B, Sk, Hkv, D] with the first k_len keys valid -> [B, Sq, H, D]."""
    left, right = window_size
    if causal:
        right = 0
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    g = h // hk
    qf = q.float().reshape(b, sq, hk, g, d).permute(0, 2, 3, 1, 4)         # [B, Hkv, g, Sq, D]
    kf = k.float().permute(0, 2, 3, 1).unsqueeze(2)                        # [B, Hkv, 1, D, Sk]
    scores = torch.matmul(qf, kf) * scale                                   # [B, Hkv, g, Sq, Sk]
    j = torch.arange(sk, device=q.device)
    k_len = torch.as_tensor(k_len, device=q.device).view(-1, 1, 1)         # [B or 1, 1, 1]
    visible = j.view(1, 1, sk) < k_len                                      # [B, 1, Sk]
    diag = torch.arange(sq, device=q.device).view(1, sq, 1) + k_len - sq   # bottom-right aligned
    if right >= 0:
        visible = visible & (j.view(1, 1, sk) <= diag + right)
    if left >= 0:
        visible = visible & (j.view(1, 1, sk) >= diag - left)
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)                   # fully masked row -> 0
    out = torch.matmul(probs, v.float().permute(0, 2, 1, 3).unsqueeze(2))  # [B, Hkv, g, Sq, Dv]
    return out.permute(0, 3, 1, 2, 4).reshape(b, sq, h, v.shape[-1]).to(q.dtype)


class FlashReference:
    """Object with the two upstream functions as methods: pass it wherever the `flash_attn`
    module is expected (the flash backend takes the module by injection)."""

    def __init__(self, allow_fp32: bool = False, validate: bool = True) -> None:
        self.allow_fp32 = allow_fp32
        self.validate = validate

    @property
    def supports_fp32(self) -> bool:
        return self.allow_fp32

    @property
    def graph_safe(self) -> bool:
        """Only `validate=False` may be captured in a CUDA graph: the validating checks sync."""
        return not self.validate

    def _check_dtypes(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        ok = q.dtype in _HALF or (self.allow_fp32 and q.dtype == torch.float32)
        _check(ok, "FlashAttention only support fp16 and bf16 data type")
        _check(k.dtype == q.dtype, "query and key must have the same dtype")
        _check(v.dtype == q.dtype, "query and value must have the same dtype")
        for t in (q, k, v):
            _check(t.stride(-1) == 1, "Input tensor must have contiguous last dimension")

    def _check_heads(self, q_heads: int, kv_heads: int, head_dim: int) -> None:
        _check(head_dim <= 256, "FlashAttention forward only supports head dimension at most 256")
        _check(q_heads % kv_heads == 0, "Number of heads in key/value must divide number of heads in query")

    @staticmethod
    def _check_table(block_table: torch.Tensor, k_cache: torch.Tensor, batch: int) -> int:
        _check(block_table.dtype == torch.int32, "block_table must have dtype torch.int32")
        _check(block_table.stride(-1) == 1, "block_table must have contiguous last dimension")
        _check(block_table.dim() == 2 and block_table.shape[0] == batch,
               "block_table must have shape (batch_size, max_num_blocks_per_seq)")
        page = k_cache.shape[1]
        _check(page % 256 == 0, "Paged KV cache block size must be divisible by 256")
        return page

    def _gather(self, cache: torch.Tensor, table_row: torch.Tensor, n: int) -> torch.Tensor:
        """First n tokens of one sequence from a paged cache [N, page, Hkv, D]."""
        page = cache.shape[1]
        blocks = table_row[:-(-n // page)].long()
        if self.validate and blocks.numel():
            _check(bool(((blocks >= 0) & (blocks < cache.shape[0])).all()), "block_table entry out of range")
        return cache.index_select(0, blocks).flatten(0, 1)[:n]

    # ---- the upstream API -------------------------------------------------------------------
    def flash_attn_varlen_func(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                               softcap=0.0, alibi_slopes=None, deterministic=False,
                               return_attn_probs=False, block_table=None):
        _unsupported(dropout_p=(dropout_p, 0.0), softcap=(softcap, 0.0), alibi_slopes=(alibi_slopes, None),
                     return_attn_probs=(return_attn_probs, False))
        self._check_dtypes(q, k, v)
        _check(cu_seqlens_q.dtype == torch.int32, "cu_seqlens_q must have dtype int32")
        _check(cu_seqlens_k.dtype == torch.int32, "cu_seqlens_k must have dtype int32")
        _check(cu_seqlens_q.is_contiguous() and cu_seqlens_k.is_contiguous(), "cu_seqlens must be contiguous")
        batch = cu_seqlens_q.numel() - 1
        _check(batch > 0, "batch size must be positive")
        _check(cu_seqlens_k.numel() == batch + 1, "cu_seqlens_k must have shape (batch_size + 1)")
        paged = block_table is not None
        kv_heads = k.shape[2] if paged else k.shape[1]
        self._check_heads(q.shape[1], kv_heads, q.shape[2])
        if paged:
            self._check_table(block_table, k, batch)
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        out = torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype, device=q.device)
        for b in range(batch):
            sq, sk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
            if self.validate:
                _check(0 <= sq <= max_seqlen_q and 0 <= sk <= max_seqlen_k,
                       f"sequence {b}: seqlen_q {sq} / seqlen_k {sk} exceed max_seqlen_q {max_seqlen_q} / "
                       f"max_seqlen_k {max_seqlen_k}")
            if sq == 0:
                continue
            if paged:
                kb, vb = self._gather(k, block_table[b], sk), self._gather(v, block_table[b], sk)
            else:
                kb, vb = k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]]
            out[cq[b]:cq[b + 1]] = _attend(q[None, cq[b]:cq[b + 1]], kb[None], vb[None], scale, causal, sk,
                                           tuple(window_size))[0]
        return out

    def flash_attn_with_kvcache(self, q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                                cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None,
                                block_table=None, softmax_scale=None, causal=False, window_size=(-1, -1),
                                softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                                return_softmax_lse=False):
        _check(k_cache.stride(-1) == 1, "k_cache must have contiguous last dimension")
        _check(v_cache.stride(-1) == 1, "v_cache must have contiguous last dimension")
        _unsupported(rotary_cos=(rotary_cos, None), rotary_sin=(rotary_sin, None),
                     cache_leftpad=(cache_leftpad, None), softcap=(softcap, 0.0),
                     alibi_slopes=(alibi_slopes, None),
                     return_softmax_lse=(return_softmax_lse, False))
        self._check_dtypes(q, k_cache, v_cache)
        batch, sq, h, d = q.shape
        _check(batch > 0, "batch size must be positive")
        self._check_heads(h, k_cache.shape[2], d)
        paged = block_table is not None
        if isinstance(cache_seqlens, int):  # upstream fills k_cache.shape[0] entries (sic)
            cache_seqlens = torch.full((k_cache.shape[0],), cache_seqlens, dtype=torch.int32,
                                       device=k_cache.device)
        if paged:
            _check(cache_batch_idx is None, "Paged KVcache does not support cache_batch_idx")
            page = self._check_table(block_table, k_cache, batch)
            width = block_table.shape[1]
            seqlen_cache = width * page
        else:
            seqlen_cache = k_cache.shape[1]
        if cache_seqlens is not None:
            _check(cache_seqlens.dtype == torch.int32, "seqlens_k must have dtype int32")
            _check(cache_seqlens.is_contiguous(), "seqlens_k must be contiguous")
            _check(tuple(cache_seqlens.shape) == (batch,), "seqlens_k must have shape (batch_size)")
            lens = cache_seqlens.long()
        else:
            lens = torch.full((batch,), seqlen_cache, dtype=torch.long, device=q.device)
        if paged:
            # Read only the columns each sequence needs (the rest may be stale or poisoned); the
            # masked gather keeps this sync-free, so CUDA graphs can capture it.
            total = lens + (k.shape[1] if k is not None else 0)
            need = -(-total // page)
            cols = torch.arange(width, device=q.device)
            table = torch.where(cols[None] < need[:, None], block_table.long(), 0)
            if self.validate:
                _check(bool(((table >= 0) & (table < k_cache.shape[0])).all()),
                       "block_table entry out of range")
                _check(bool((total <= seqlen_cache).all()), "cache_seqlens exceed the block table's capacity")

            def view(cache: torch.Tensor) -> torch.Tensor:  # [B, width * page, Hkv, D] (a gathered copy)
                return cache[table].flatten(1, 2)
        else:
            idx = (cache_batch_idx.long() if cache_batch_idx is not None
                   else torch.arange(batch, device=q.device))

            def view(cache: torch.Tensor) -> torch.Tensor:
                return cache[idx]
        if k is not None:  # append the new keys/values in place, at cache_seqlens
            _check(v is not None, "If key is supplied, value must also be passed in")
            pos = lens[:, None] + torch.arange(k.shape[1], device=q.device)            # [B, S_new]
            if paged:
                blk = table.gather(1, pos // page)
                k_cache[blk, pos % page] = k
                v_cache[blk, pos % page] = v
            else:
                k_cache[idx[:, None], pos] = k
                v_cache[idx[:, None], pos] = v
            lens = lens + k.shape[1]
        scale = softmax_scale if softmax_scale is not None else d ** -0.5
        return _attend(q, view(k_cache), view(v_cache), scale, causal, lens, tuple(window_size))


_STRICT = FlashReference()
# Module-level functions with upstream's names and rules (fp16/bf16 only), as `flash_attn` has.
flash_attn_varlen_func = _STRICT.flash_attn_varlen_func
flash_attn_with_kvcache = _STRICT.flash_attn_with_kvcache


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                    causal: bool = True, window: int = 0) -> torch.Tensor:
    """Dense textbook attention for one sequence, q [Sq, H, D], k/v [Sk, Hkv, D]: the
    independent oracle the reference itself is tested against (loops, no masking tricks). `window` > 0
    (causal only): the query on key diagonal p sees keys p - window + 1 .. p."""
    sq, h, d = q.shape
    sk, hk = k.shape[0], k.shape[1]
    scale = scale if scale is not None else 1 / math.sqrt(d)
    out = torch.zeros(sq, h, v.shape[-1], dtype=torch.float64)
    for i in range(sq):
        last = i + sk - sq if causal else sk - 1
        first = max(0, last - window + 1) if causal and window > 0 else 0
        if last < 0:
            continue
        for head in range(h):
            kv = head // (h // hk)
            s = (k[first:last + 1, kv].double() @ q[i, head].double()) * scale
            out[i, head] = torch.softmax(s, 0) @ v[first:last + 1, kv].double()
    return out


# Selected by name, as the engine imports flash-attn:
#   LLM(attention_backend="flash", flash_attn_module="tests.flash_ref:FP32")
FP32 = FlashReference(allow_fp32=True)                          # validating checks sync: eager only
FP32_GRAPH_SAFE = FlashReference(allow_fp32=True, validate=False)
GRAPH_SAFE = FlashReference(validate=False)                     # fp16/bf16 only, as upstream


class _ClaimsGraphSafe(FlashReference):
    graph_safe = True  # but validate=True syncs: the runner's eager check must find out


SYNCING = _ClaimsGraphSafe(allow_fp32=True)
