"""The decoder layer's small ops fused into Triton kernels, for the torch loop on CUDA (models/llama.py):
- `add_rms_norm`: the residual add and the RMSNorm after it (the residual updated in place);
- `silu_mul`: silu(gate) * up of a [gate; up] projection's output;
- `rope_kv`: RoPE on Q and K, in place in the QKV projection's output, with the step's K and V stored
  into a paged backend's cache at its slots (so the backend skips its own store).
Each rounds where the torch ops it replaces round, in the same order, so its output is theirs to the
bit except where a reduction or a transcendental is computed another way: RMSNorm's sum of squares
(fp32 either way, another summation order) and SiLU's exp. tests/test_triton_fused.py states and asserts
the bounds. No host reads and shapes fixed by the inputs' shapes: CUDA-graph capturable. On CPU they run
under TRITON_INTERPRET=1 (tests). Launched with FMA contraction off: a fused multiply-add rounds once
where the torch ops round twice."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# a stored K/V's place: the layer's K and V caches as [blocks, block_size, kv_heads, head_dim] views
# (any strides, the last dim contiguous) and each new token's block and offset
KVDestination = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
EXACT = dict(enable_fp_fusion=False)


@triton.jit
def _rounded(x, DT: tl.constexpr):
    """fp32 x rounded to DT (nearest, ties to even), kept in fp32. bf16 by its bits: the interpreter's
    fp32 -> bf16 cast truncates; on CUDA this is what cvt.rn computes, for a few integer ops."""
    if DT == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        return (((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(DT).to(tl.float32)


@triton.jit
def _add_rms_norm(res, delta, w, out, s_res, s_delta, s_out, N, eps, HAS_DELTA: tl.constexpr,
                  BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    m = c < N
    r = tl.load(res + row * s_res + c, mask=m, other=0.0)
    dt: tl.constexpr = res.dtype.element_ty
    x = r.to(tl.float32)
    if HAS_DELTA:  # rounded to the residual's dtype once, as torch's add_ does
        x = _rounded(x + tl.load(delta + row * s_delta + c, mask=m, other=0.0).to(tl.float32), dt)
        tl.store(res + row * s_res + c, x.to(dt), mask=m)
    rstd = tl.rsqrt(tl.sum(x * x, 0) / N + eps)
    y = x * rstd * tl.load(w + c, mask=m, other=0.0).to(tl.float32)  # F.rms_norm: one rounding at the end
    tl.store(out + row * s_out + c, _rounded(y, dt).to(dt), mask=m)


@triton.jit
def _silu_mul(gu, out, s_gu, s_out, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < N
    g = tl.load(gu + row * s_gu + c, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu + row * s_gu + N + c, mask=m, other=0.0).to(tl.float32)
    dt: tl.constexpr = out.dtype.element_ty
    s = _rounded(g / (1.0 + tl.exp(-g)), dt)  # F.silu's rounding, then the mul's
    tl.store(out + row * s_out + c, _rounded(s * u, dt).to(dt), mask=m)


@triton.jit
def _rope_kv(qkv, cos, sin, k_cache, v_cache, blocks, offsets, s_t, s_cs, sc_b, sc_t, sc_h, H, KH, HALF,
             WRITE: tl.constexpr, QK_P: tl.constexpr, KH_P: tl.constexpr, HALF_P: tl.constexpr,
             D_P: tl.constexpr):
    """One token: its H + KH rotated heads in place (rotate-half: the first and second halves of each
    head are a pair), then with WRITE its KH key and KH value heads into the caches."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, QK_P)[:, None]
    j = tl.arange(0, HALF_P)[None, :]
    m = (h < H + KH) & (j < HALF)
    at = qkv + t * s_t + h * (2 * HALF) + j
    dt: tl.constexpr = qkv.dtype.element_ty
    x1 = tl.load(at, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(at + HALF, mask=m, other=0.0).to(tl.float32)
    c = tl.load(cos + t * s_cs + j, mask=j < HALF, other=0.0).to(tl.float32)
    s = tl.load(sin + t * s_cs + j, mask=j < HALF, other=0.0).to(tl.float32)
    # rotary.rotate's roundings: each product to the tables' dtype, then their difference / sum
    o1 = _rounded(_rounded(x1 * c, dt) - _rounded(x2 * s, dt), dt).to(dt)
    o2 = _rounded(_rounded(x2 * c, dt) + _rounded(x1 * s, dt), dt).to(dt)
    tl.store(at, o1, mask=m)
    tl.store(at + HALF, o2, mask=m)
    if WRITE:
        slot = tl.load(blocks + t).to(tl.int64) * sc_b + tl.load(offsets + t).to(tl.int64) * sc_t
        km = m & (h >= H)
        dst = k_cache + slot + (h - H) * sc_h + j
        tl.store(dst, o1, mask=km)
        tl.store(dst + HALF, o2, mask=km)
        hv = tl.arange(0, KH_P)[:, None]
        d = tl.arange(0, D_P)[None, :]
        vm = (hv < KH) & (d < 2 * HALF)
        v = tl.load(qkv + t * s_t + (H + KH) * (2 * HALF) + hv * (2 * HALF) + d, mask=vm)
        tl.store(v_cache + slot + hv * sc_h + d, v, mask=vm)


def _p2(n: int) -> int:
    return triton.next_power_of_2(n)


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """residual [T, N] += delta (in place; None: no add), -> rms_norm(residual) * weight, a new [T, N]:
    `residual.add_(delta); F.rms_norm(residual, (N,), weight, eps)` in one pass."""
    t, n = residual.shape
    if residual.stride(-1) != 1 or (delta is not None and (delta.shape != residual.shape
                                                           or delta.stride(-1) != 1)):
        raise ValueError("add_rms_norm takes [T, N] rows with a contiguous last dim, delta shaped alike")
    out = torch.empty_like(residual)
    block = _p2(n)
    d = residual if delta is None else delta
    _add_rms_norm[(t,)](residual, d, weight, out, residual.stride(0), d.stride(0), out.stride(0), n, eps,
                        HAS_DELTA=delta is not None, BLOCK=block, num_warps=max(1, min(16, block // 256)),
                        **EXACT)
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] ([gate | up] columns) -> silu(gate) * up, [T, I]."""
    t, n2 = gate_up.shape
    if n2 % 2 or gate_up.stride(-1) != 1:
        raise ValueError(f"silu_mul takes [T, 2I] rows, the last dim contiguous; got {tuple(gate_up.shape)}")
    n = n2 // 2
    out = torch.empty(t, n, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, _p2(n))
    _silu_mul[(t, triton.cdiv(n, block))](gate_up, out, gate_up.stride(0), out.stride(0), n, BLOCK=block,
                                         num_warps=4, **EXACT)
    return out


def rope_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
            dest: KVDestination | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [T, (heads + 2 kv_heads) * D], the QKV projection's output: Q and K heads rotated in place
    by cos/sin [T, 1, D/2] (RotaryEmbedding.cos_sin), as rotary.rotate computes them; with `dest`
    (a paged backend's kv_destination) the rotated K and V also stored at the step's slots.
    -> (q [T, heads, D], k [T, kv_heads, D], v [T, kv_heads, D]): views of qkv."""
    t, width = qkv.shape
    d = width // (heads + 2 * kv_heads)
    if d * (heads + 2 * kv_heads) != width or d % 2 or qkv.stride(-1) != 1:
        raise ValueError(f"rope_kv: {tuple(qkv.shape)} is not [T, ({heads} + 2 * {kv_heads}) * D], D even")
    if cos.shape != (t, 1, d // 2) or sin.stride() != cos.stride() or cos.stride(-1) != 1:
        raise ValueError(f"rope_kv: cos/sin {tuple(cos.shape)} are not [{t}, 1, {d // 2}] alike")
    k_cache, v_cache, blocks, offsets = dest if dest is not None else (qkv, qkv, qkv, qkv)
    sc = k_cache.stride() if dest is not None else (0, 0, 0, 1)
    if dest is not None and (v_cache.stride() != sc or sc[-1] != 1 or k_cache.shape[2:] != (kv_heads, d)
                             or blocks.shape != (t,) or offsets.shape != (t,)):
        raise ValueError("rope_kv: the caches are not [blocks, block_size, kv_heads, D] views alike, "
                         "or the slots are not one per token")
    _rope_kv[(t,)](qkv, cos, sin, k_cache, v_cache, blocks, offsets, qkv.stride(0), cos.stride(0),
                   sc[0], sc[1], sc[2], heads, kv_heads, d // 2, WRITE=dest is not None,
                   QK_P=_p2(heads + kv_heads), KH_P=_p2(kv_heads), HALF_P=_p2(d // 2), D_P=_p2(d),
                   num_warps=4, **EXACT)
    q_end, k_end = heads * d, (heads + kv_heads) * d
    return (qkv[:, :q_end].view(t, heads, d), qkv[:, q_end:k_end].view(t, kv_heads, d),
            qkv[:, k_end:].view(t, kv_heads, d))
