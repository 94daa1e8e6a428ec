"""Triton paged attention backend: needs nothing beyond a CUDA build of torch (which ships Triton).

Same cache layout and step metadata as the flash backend (it reuses FlashAttention.prepare:
int32 block tables, cu_seqlens, cache_seqlens in persistent staged buffers), three kernels:
- `_store_kv`: each new token's K and V into its (block, offset) slot (unless the caller stored them:
  `kv_written`, as in FlashAttention);
- `_prefill`: varlen causal attention of each sequence's query chunk over its paged context
  (bottom-right aligned: query i of a chunk of n sees keys 0..ctx-n+i), any mix of fresh
  prefills, chunk continuations, prefix hits and decodes; when the query tiles are too few
  programs to fill the GPU (a short suffix over a long cached prefix), the keys are split into
  chunks too, merged as below;
- `_decode` + `_combine`: pure-decode steps, split-KV: each program takes one chunk of a row's
  keys (at most `decode_chunk`, fewer when a small batch needs more programs to fill the GPU),
  a partial softmax per chunk, then a log-sum-exp merge; so one long row becomes many programs
  instead of a long tail. No host reads, a grid fixed by the batch size and the table's width,
  hence CUDA-graph capturable.
Sliding windows (AttentionBackend): a layer's WINDOW masks keys at or before qpos - WINDOW, and each
program starts at its first query's window, so keys wholly out of it are never read (decode splits the
window's keys, not the whole row's). Without a window WINDOW is 2^30, past any context.
Any block size: each key's address is computed per token (block = table[pos // bs]), so 16-token
blocks give fine prefix-cache granularity. Only the table columns a sequence needs are read.
On CPU it runs under TRITON_INTERPRET=1 (how CI tests it); fp32 dots use IEEE precision.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from nanoserve.layers.flash_attention import FlashAttention
from nanoserve.layers.staging import Staging


@triton.jit
def _store_kv(k, v, k_cache, v_cache, blocks, offsets, sk_t, sk_h, sv_t, sv_h, sc_b, sc_t, sc_h,
              KH, D, KH_P: tl.constexpr, D_P: tl.constexpr):
    t = tl.program_id(0)
    h = tl.arange(0, KH_P)[:, None]
    d = tl.arange(0, D_P)[None, :]
    m = (h < KH) & (d < D)
    blk = tl.load(blocks + t).to(tl.int64)
    off = tl.load(offsets + t).to(tl.int64)
    dst = blk * sc_b + off * sc_t + h * sc_h + d
    tl.store(k_cache + dst, tl.load(k + t * sk_t + h * sk_h + d, mask=m), mask=m)
    tl.store(v_cache + dst, tl.load(v + t * sv_t + h * sv_h + d, mask=m), mask=m)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """IEEE: fp32 operands (CUDA would use tf32), or any operands under the interpreter, whose
    bf16 dot is wrong (it multiplies the raw bits): upcast there, so CPU tests cover bf16 caches."""
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _tile(qv, m_i, l_i, acc, k_cache, v_cache, table_row, pos, valid, visible, d, D, BS, sc_b, sc_t, head_off,
          scale, IEEE: tl.constexpr):
    """One online-softmax step over the keys at positions `pos` (those `valid` exist; `visible`
    [rows, keys] may be attended): gather them from the paged cache, update (max, sum, acc)."""
    blk = tl.load(table_row + pos // BS, mask=valid, other=0).to(tl.int64)  # only needed columns
    base = blk * sc_b + (pos % BS).to(tl.int64) * sc_t + head_off
    kvmask = valid[:, None] & (d[None, :] < D)
    kt = tl.load(k_cache + base[:, None] + d[None, :], mask=kvmask, other=0.0)
    s = tl.where(visible, _dot(qv, tl.trans(kt), IEEE) * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet: no NaN
    alpha = tl.exp(m_i - m_ref)
    p = tl.exp(s - m_ref[:, None])
    vt = tl.load(v_cache + base[:, None] + d[None, :], mask=kvmask, other=0.0)
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + _dot(p.to(vt.dtype), vt, IEEE)


@triton.jit
def _prefill(q, k_cache, v_cache, out, part_acc, part_ml, tables, cu_q, cu_k, scale, sq_t, sq_h, so_t, so_h,
             sc_b, sc_t, sc_h, st_b, H, G, D, BS, CHUNKS, KCHUNK, WINDOW, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, D_P: tl.constexpr, IEEE: tl.constexpr):
    """CHUNKS == 1: the tile's output. Else this program takes keys [sp * KCHUNK, +KCHUNK) and
    writes partials for `_combine` (a query that sees none of them: max -inf)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    mt = tl.program_id(2) // CHUNKS
    sp = tl.program_id(2) % CHUNKS
    q0 = tl.load(cu_q + b)
    qlen = tl.load(cu_q + b + 1) - q0
    ctx = tl.load(cu_k + b + 1) - tl.load(cu_k + b)
    if mt * BLOCK_M >= qlen:
        return
    i = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D_P)
    qmask = (i[:, None] < qlen) & (d[None, :] < D)
    rows = (q0 + i).to(tl.int64)
    qv = tl.load(q + rows[:, None] * sq_t + h * sq_h + d[None, :], mask=qmask, other=0.0)
    qpos = ctx - qlen + i                      # absolute position of each query
    kvh = h // G
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_P], tl.float32)
    # before the first query's window: unseen
    lo = tl.maximum(sp * KCHUNK, ctx - qlen + mt * BLOCK_M - WINDOW + 1)
    # past the last query: unseen
    hi = tl.minimum(tl.minimum(ctx, ctx - qlen + (mt + 1) * BLOCK_M), lo + KCHUNK)
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < hi
        m_i, l_i, acc = _tile(qv, m_i, l_i, acc, k_cache, v_cache, tables + b * st_b, pos, valid,
                              valid[None, :] & (pos[None, :] <= qpos[:, None]) &
                              (pos[None, :] > qpos[:, None] - WINDOW), d, D, BS, sc_b, sc_t,
                              kvh * sc_h, scale, IEEE)
    if CHUNKS == 1:
        # rows past the chunk (not stored) may see no key under a window: no 0 / 0 there
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out + rows[:, None] * so_t + h * so_h + d[None, :], o.to(out.dtype.element_ty), mask=qmask)
    else:
        at = (rows * H + h) * CHUNKS + sp
        tl.store(part_acc + at[:, None] * D_P + d[None, :], acc, mask=qmask)
        tl.store(part_ml + at * 2, m_i, mask=i < qlen)
        tl.store(part_ml + at * 2 + 1, l_i, mask=i < qlen)


@triton.jit
def _chunk_len(ctx, FILL, CHUNK: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys per decode program for a row of `ctx` keys: the row spread over FILL programs (so a
    small batch still fills the GPU), but never more than CHUNK (so a long row spreads over more
    programs rather than making a few long ones that the whole step waits for)."""
    return tl.minimum(CHUNK, tl.cdiv(tl.cdiv(ctx, FILL), BLOCK_N) * BLOCK_N)


@triton.jit
def _decode(q, k_cache, v_cache, part_acc, part_ml, tables, lens, scale, sq_t, sq_h, sc_b, sc_t, sc_h, st_b,
            H, G, D, BS, FILL, CHUNKS, WINDOW, CHUNK: tl.constexpr, G_P: tl.constexpr, D_P: tl.constexpr,
            BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """The row's visible keys (its last WINDOW, or all) split into chunks."""
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    ctx = tl.load(lens + row)
    keys = tl.minimum(ctx, WINDOW)
    per = _chunk_len(keys, FILL, CHUNK, BLOCK_N)
    if sp * per >= keys:  # past this row's last chunk (the grid covers the longest row the table holds)
        return
    start = ctx - keys + sp * per
    end = tl.minimum(ctx, start + per)
    g = tl.arange(0, G_P)
    d = tl.arange(0, D_P)
    qmask = (g[:, None] < G) & (d[None, :] < D)
    heads = kvh * G + g
    qv = tl.load(q + row * sq_t + heads[:, None] * sq_h + d[None, :], mask=qmask, other=0.0)
    m_i = tl.full([G_P], float("-inf"), tl.float32)
    l_i = tl.zeros([G_P], tl.float32)
    acc = tl.zeros([G_P, D_P], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < end
        m_i, l_i, acc = _tile(qv, m_i, l_i, acc, k_cache, v_cache, tables + row * st_b, pos, valid,
                              valid[None, :], d, D, BS, sc_b, sc_t, kvh * sc_h, scale, IEEE)
    # partials [rows, H, CHUNKS, D_P] and [rows, H, CHUNKS, 2] (max, sum); only used chunks are written
    hmask = g < G
    at = (row * H + heads).to(tl.int64) * CHUNKS + sp
    tl.store(part_acc + at[:, None] * D_P + d[None, :], acc, mask=hmask[:, None])
    tl.store(part_ml + at * 2, m_i, mask=hmask)
    tl.store(part_ml + at * 2 + 1, l_i, mask=hmask)


@triton.jit
def _combine(part_acc, part_ml, out, lens, so_t, so_h, H, D, FILL, CHUNKS, WINDOW, CHUNK: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, D_P: tl.constexpr, DECODE: tl.constexpr):
    """Log-sum-exp merge of one (row, head)'s chunk partials, BLOCK_C chunks at a time. DECODE:
    only the chunks `_decode` wrote for this row; prefill: all (a chunk the query saw nothing of
    has max -inf, sum 0: weight 0)."""
    row = tl.program_id(0)
    h = tl.program_id(1)
    if DECODE:
        keys = tl.minimum(tl.load(lens + row), WINDOW)
        used = tl.cdiv(keys, _chunk_len(keys, FILL, CHUNK, BLOCK_N))
    else:
        used = CHUNKS
    d = tl.arange(0, D_P)
    base = (row * H + h).to(tl.int64) * CHUNKS
    m_run = tl.full([1], float("-inf"), tl.float32)
    l_run = tl.zeros([1], tl.float32)
    acc = tl.zeros([D_P], tl.float32)
    for c0 in range(0, used, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        ok = c < used
        at = base + c
        m = tl.load(part_ml + at * 2, mask=ok, other=float("-inf"))
        m_new = tl.maximum(m_run, tl.max(m, 0))  # chunk 0 always has keys: finite from the start
        alpha = tl.exp(m_run - m_new)
        w = tl.exp(m - m_new)
        l_run = l_run * alpha + tl.sum(tl.load(part_ml + at * 2 + 1, mask=ok, other=0.0) * w, 0)
        a = tl.load(part_acc + at[:, None] * D_P + d[None, :], mask=ok[:, None], other=0.0)
        acc = acc * alpha + tl.sum(a * w[:, None], 0)
        m_run = m_new
    o = acc / l_run
    tl.store(out + row * so_t + h * so_h + d, o.to(out.dtype.element_ty), mask=d < D)


# Keys per decode program, at most. Arithmetic for the H200 case of the GPU review (not measured):
# a 32768-token row, 8 KV heads of dim 128, bf16 -> K+V are 8 * 128 * 2 B * 2 = 4 KiB per token.
# At 1024 keys a program reads 1024 * 512 B = 512 KiB (one KV head), and the row is 32 chunks * 8
# heads = 256 programs, about two per SM on 132 SMs: its 128 MiB per layer spread over the whole
# GPU (>= 28 us a layer at 4.8 TB/s, whatever the split). The old split count from rows * kv_heads
# alone (2 at 17 or 32 rows) gave 16 programs of 16384 keys (8 MiB each): 16 SMs carried the row.
DECODE_CHUNK = 1024
NO_WINDOW = 1 << 30  # the kernels' WINDOW for a layer without one: more keys than any context


def _p2(n: int, floor: int = 1) -> int:
    return max(floor, triton.next_power_of_2(n))


class TritonAttention(FlashAttention):
    """Paged attention in Triton kernels; metadata, padding and staging as FlashAttention's."""
    PAGE_MULTIPLE = 1  # any block size

    def __init__(self, kv_cache: torch.Tensor, num_heads: int, scale: float, *, flash=None,
                 max_seqs: int, max_blocks_per_seq: int, scratch_block: int,
                 staging: Staging | None = None, decode_chunk: int = DECODE_CHUNK,
                 windows: tuple[int, ...] = ()) -> None:
        super().__init__(kv_cache, num_heads, scale, flash=None, max_seqs=max_seqs,
                         max_blocks_per_seq=max_blocks_per_seq, scratch_block=scratch_block, staging=staging,
                         windows=windows)
        dev = kv_cache.device
        self.ieee = kv_cache.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"
        self.sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 4
        big = dev.type == "cuda" and not self.ieee
        self.block_m, self.block_n = (64, 64) if big else (32, 32)
        if decode_chunk % self.block_n:
            raise ValueError(f"decode_chunk {decode_chunk} is not a multiple of the key tile {self.block_n}")
        self.decode_chunk = decode_chunk

    @property
    def graph_safe(self) -> bool:
        return True

    def _decode_chunks(self, rows: int, kv_heads: int, max_keys: int) -> tuple[int, int]:
        """-> (fill, chunks). fill: programs per (row, kv head) for about two waves on the GPU, what
        a row shorter than fill * decode_chunk is spread over. chunks: the grid's programs per (row,
        kv head), enough for any row of up to max_keys; programs past a row's last chunk exit.
        max_keys comes from the block table's width: in an eager step the longest row's blocks, in
        a padded (graph) step the width max_model_len fixes, which a replay cannot outgrow. The
        price is empty programs on graph replays: at max_model_len 32768, bucket 32, 8 KV heads,
        32 * 8 * 32 = 8192 programs a layer, of which a batch of short rows (fill 2) uses at most
        512 and the rest read one int and return (131072: 32768 programs; their cost on the GPU
        is not measured). A device-built work list would launch only used chunks; not done."""
        fill = min(32, -(-2 * self.sms // (rows * kv_heads)))
        return fill, max(fill, -(-max_keys // self.decode_chunk))

    def _prefill_chunks(self, heads: int, query_lens: list[int], window: int = 0) -> tuple[int, int]:
        """-> (chunks, keys per chunk) for a step with prefill: key chunks only when the query tiles
        (times heads) are too few for about two waves on the GPU, e.g. a short suffix over a long
        cached prefix, and no more chunks than the longest context has decode_chunk-key pieces; so
        the partials stay small (chunks * programs stays near two waves). From host lists: prefill
        steps are not graph-captured. H200 arithmetic (not measured): one 16-token suffix over a
        32768-token prefix, 32 heads: 9 chunks of 3648 keys, 288 programs instead of 32.
        Not done: a long-context row among many tiles still walks all its keys in its programs.
        A window shorter than the longest context: one chunk (each program walks at most the window plus
        its tile's rows; chunks of the whole context would mostly be out of it)."""
        if 0 < window < self.max_seqlen_k:
            return 1, -(-self.max_seqlen_k // self.block_n) * self.block_n
        programs = heads * sum(-(-n // self.block_m) for n in query_lens)
        chunks = max(1, min(-(-2 * self.sms // programs), -(-self.max_seqlen_k // self.decode_chunk)))
        per = -(-self.max_seqlen_k // chunks)
        return chunks, -(-per // self.block_n) * self.block_n

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                kv_written: bool = False) -> torch.Tensor:
        """kv_written: as FlashAttention's (the step's K/V already at their slots: no `_store_kv`)."""
        k_cache, v_cache = self.kv_cache[:, layer, 0], self.kv_cache[:, layer, 1]  # [N, bs, kh, D] views
        b = self.batch
        t, h, d = q.shape
        kh = k.shape[1]
        g = h // kh
        sc = k_cache.stride()
        if not kv_written:
            _store_kv[(t,)](k, v, k_cache, v_cache, b.slot_blocks, b.slot_offsets, k.stride(0), k.stride(1),
                            v.stride(0), v.stride(1), sc[0], sc[1], sc[2], kh, d, KH_P=_p2(kh), D_P=_p2(d))
        out = torch.empty_like(q)
        table = self.block_table
        window = self.window(layer) or NO_WINDOW
        if self.decode_only:
            rows = t
            fill, chunks = self._decode_chunks(rows, kh, min(window, table.shape[1] * self.block_size))
            d_p = _p2(d, 16)
            part_acc = torch.empty(rows, h, chunks, d_p, dtype=torch.float32, device=q.device)
            part_ml = torch.empty(rows, h, chunks, 2, dtype=torch.float32, device=q.device)
            _decode[(rows, kh, chunks)](q, k_cache, v_cache, part_acc, part_ml, table, self.cache_seqlens,
                                        self.scale, q.stride(0), q.stride(1), sc[0], sc[1], sc[2],
                                        table.stride(0), h, g, d, self.block_size, fill, chunks, window,
                                        CHUNK=self.decode_chunk, G_P=_p2(g, 16), D_P=d_p,
                                        BLOCK_N=self.block_n, IEEE=self.ieee)
            _combine[(rows, h)](part_acc, part_ml, out, self.cache_seqlens, out.stride(0), out.stride(1),
                                h, d, fill, chunks, window, CHUNK=self.decode_chunk, BLOCK_N=self.block_n,
                                BLOCK_C=16, D_P=d_p, DECODE=True)
            return out
        n, d_p = len(b.query_lens), _p2(d, 16)
        chunks, kchunk = self._prefill_chunks(h, b.query_lens, self.window(layer))
        # one chunk: the kernel writes `out` itself, the partials' pointers go unused
        part_acc = torch.empty(t, h, chunks, d_p, dtype=torch.float32, device=q.device) if chunks > 1 else out
        part_ml = torch.empty(t, h, chunks, 2, dtype=torch.float32, device=q.device) if chunks > 1 else out
        grid = (n, h, triton.cdiv(self.max_seqlen_q, self.block_m) * chunks)
        _prefill[grid](q, k_cache, v_cache, out, part_acc, part_ml, table, self.cu_seqlens_q,
                       self.cu_seqlens_k, self.scale, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
                       sc[0], sc[1], sc[2], table.stride(0), h, g, d, self.block_size, chunks, kchunk, window,
                       BLOCK_M=self.block_m, BLOCK_N=self.block_n, D_P=d_p, IEEE=self.ieee)
        if chunks > 1:
            _combine[(t, h)](part_acc, part_ml, out, self.cu_seqlens_k, out.stride(0), out.stride(1), h, d, 1,
                             chunks, window, CHUNK=self.decode_chunk, BLOCK_N=self.block_n, BLOCK_C=16,
                             D_P=d_p, DECODE=False)
        return out
