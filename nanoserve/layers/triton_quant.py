"""Weight-only quantized linear layers on the GPU, in Triton: GGUF Q8_0 / Q4_0 / Q4_1 blocks kept as
the file has them (moved to the device once), and fp8 (e4m3) weights with per-output-channel scales
(`--quantization fp8`).

One GEMM kernel serves every batch size: each program streams its [BLOCK_N, BLOCK_K] weight tile
as bytes, dequantizes it in registers (a GGUF block's fp16 scale is two bytes at a 2-byte-aligned
offset inside the uint8 row: loaded and bitcast), and runs tl.dot in the activation dtype with
fp32 accumulation over M tiles of the activations. Decode (M <= 16) takes one 16-row tile and,
when the output tiles are too few to fill the GPU, splits K over more programs (fp32 partials,
summed after). Prefill goes through the same kernel with 64/128-row tiles rather than the CPU's
"dequantize the weight into a scratch copy, then GEMM": the dequantization then costs once per
M tile, in registers, instead of a write and re-read of the whole bf16 weight per call, there is
no layer-sized scratch, and no host sync or allocation depends on M (CUDA graphs). Whether a
dequantize + cuBLAS path beats it for long prefills is measured by bench/gpu_check.py's `quant`
section, not assumed.

fp8 weights: torch._scaled_mm with per-token dynamic fp8 activations where the GPU has fp8 tensor
cores (compute capability >= 8.9, probed once), else the same Triton kernel with fp8 bytes as
32-byte header-less "blocks": e4m3 bits are widened to fp16 by shifting (no fp8 conversion
instruction is needed, so pre-Ada GPUs and the interpreter run it), the scale applied to the fp32
accumulator. On CPU all of it runs under TRITON_INTERPRET=1 (tests); dots then run in fp32."""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanoserve.layers.quant_linear import Q4_0, Q4_1, Q8_0, TYPE_NAMES, QuantEmbedding, QuantLinear

FP8 = -1  # not a GGML type: [N, K] float8_e4m3fn bits as uint8, per-row fp32 scales beside them
LAYOUT = {Q8_0: (34, 2), Q4_0: (18, 2), Q4_1: (20, 4), FP8: (32, 0)}  # bytes per 32 weights, header bytes
FP8_MAX = 448.0  # largest finite float8_e4m3fn


@triton.jit
def _half(p, mask):
    lo = tl.load(p, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(p + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _tile(w, rows, kb, mask, RB, QT: tl.constexpr, BB: tl.constexpr, HDR: tl.constexpr):
    """fp32 weights [len(rows), len(kb), 32] of 32-weight blocks `kb` of `rows` (masked: 0), with
    the gguf package's arithmetic (d * q, d * q + m); fp8: the e4m3 value, its row scale not applied."""
    i = tl.arange(0, 32)[None, None, :]
    base = w + rows.to(tl.int64)[:, None] * RB + kb * BB  # [BN, KB] block starts
    m3 = mask[:, :, None]
    if QT == 8:  # Q8_0: fp16 d, 32 x int8
        q = tl.load(base[:, :, None] + HDR + i, mask=m3, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        return q * _half(base, mask)[:, :, None]
    elif QT == -1:  # fp8 e4m3: sign to fp16's sign, exponent + mantissa 7 bits up; = value / 2^8 exactly
        b = tl.load(base[:, :, None] + i, mask=m3, other=0).to(tl.int32)
        h = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.uint16)
        return h.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    else:  # Q4_0 / Q4_1: weight j < 16 is byte j's low nibble, weight j + 16 its high one
        b = tl.load(base[:, :, None] + HDR + (i % 16), mask=m3, other=0).to(tl.int32)
        nib = (b >> ((i // 16) * 4)) & 0xF
        if QT == 2:
            return (nib - 8).to(tl.float32) * _half(base, mask)[:, :, None]
        else:
            return nib.to(tl.float32) * _half(base, mask)[:, :, None] + _half(base + 2, mask)[:, :, None]


@triton.jit
def _gemm(x, w, scale, out, part, M, N, NB, sx, so, RB, QT: tl.constexpr, BB: tl.constexpr, HDR: tl.constexpr,
          KB: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr):
    """out[M, N] = x[M, 32 NB] W^T; program (m tile, n tile, K split). SPLIT > 1: fp32 partials
    [SPLIT, M, N] into `part`."""
    pm = tl.program_id(0)
    pn = tl.program_id(1)
    ps = tl.program_id(2)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    mmask = rm < M
    nmask = rn < N
    per = tl.cdiv(tl.cdiv(NB, SPLIT), KB) * KB  # blocks per split
    lo = ps * per
    hi = tl.minimum(NB, lo + per)
    acc = tl.zeros((BM, BN), tl.float32)
    for kb0 in range(lo, hi, KB):
        kb = kb0 + tl.arange(0, KB)
        wt = tl.reshape(_tile(w, rn, kb[None, :], nmask[:, None] & (kb < hi)[None, :], RB, QT, BB, HDR),
                        (BN, KB * 32))
        k = kb0 * 32 + tl.arange(0, KB * 32)
        xt = tl.load(x + rm.to(tl.int64)[:, None] * sx + k[None, :],
                     mask=mmask[:, None] & (k < hi * 32)[None, :], other=0.0)
        if IEEE:  # fp32 activations, or the interpreter (whose bf16 dot is wrong)
            acc += tl.dot(xt.to(tl.float32), tl.trans(wt), input_precision="ieee")
        else:
            acc += tl.dot(xt, tl.trans(wt.to(xt.dtype)))
    if QT == -1:
        acc = acc * tl.load(scale + rn, mask=nmask, other=0.0)[None, :]
    if SPLIT == 1:
        tl.store(out + rm.to(tl.int64)[:, None] * so + rn[None, :], acc.to(out.dtype.element_ty),
                 mask=mmask[:, None] & nmask[None, :])
    else:
        tl.store(part + (ps * M + rm).to(tl.int64)[:, None] * N + rn[None, :], acc,
                 mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _reduce(part, out, M, N, so, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """out = sum of the SPLIT fp32 partials, in out's dtype: one launch (a sum and a cast would be two
    kernels, each a few microseconds of a decode GEMV that takes not many more)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < M * N
    acc = tl.zeros((BLOCK,), tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(part + s * M * N + i, mask=mask, other=0.0)
    tl.store(out + (i // N).to(tl.int64) * so + i % N, acc.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _dequant(w, scale, out, N, NB, so, RB, QT: tl.constexpr, BB: tl.constexpr, HDR: tl.constexpr,
             KB: tl.constexpr, BN: tl.constexpr):
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    kb = tl.program_id(1) * KB + tl.arange(0, KB)
    mask = (rn < N)[:, None] & (kb < NB)[None, :]
    t = _tile(w, rn, kb[None, :], mask, RB, QT, BB, HDR)
    if QT == -1:
        t = t * tl.load(scale + rn, mask=rn < N, other=0.0)[:, None, None]
    k = kb[None, :, None] * 32 + tl.arange(0, 32)[None, None, :]
    tl.store(out + rn.to(tl.int64)[:, None, None] * so + k, t.to(out.dtype.element_ty), mask=mask[:, :, None])


@dataclass(frozen=True)
class TritonQuant:
    """The CPU quant kernels' interface (`quant_linear`, `quant_dequantize`) for device tensors,
    plus fp8; `fill`: programs that fill the device (K is split below that); `ieee`: fp32 dots."""
    fill: int
    ieee: bool
    # the GGUF types these kernels read; models/llama.quant_layers dequantizes a group holding any other
    # kept type (Q5_0, the K-quants) into its parameter at load
    qtypes: tuple[int, ...] = (Q8_0, Q4_0, Q4_1)

    @property
    def linear_layer(self) -> type:  # what models/llama.quant_layers builds with these kernels
        return TritonQuantLinear

    @property
    def embedding_layer(self) -> type:
        return TritonQuantEmbedding

    def quant_linear(self, x: torch.Tensor, w: torch.Tensor, qtype: int, out: torch.Tensor) -> None:
        self._gemm(x, w, qtype, out, None)

    def fp8_linear(self, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
        """out = (x (w * scale[:, None])^T); w: float8_e4m3fn [N, K], scale fp32 [N]."""
        if w.dtype != torch.float8_e4m3fn or scale.shape != (w.shape[0],) or scale.dtype != torch.float32:
            raise ValueError(f"fp8 weight {w.dtype} {tuple(w.shape)} with scales {scale.dtype} "
                             f"{tuple(scale.shape)}")
        self._gemm(x, w.view(torch.uint8), FP8, out, scale)

    def quant_dequantize(self, w: torch.Tensor, qtype: int, out: torch.Tensor,
                         scale: torch.Tensor | None = None) -> None:
        n, nb = _check_blocks(w, qtype, out.shape[1] if out.dim() == 2 else -1)
        if tuple(out.shape) != (n, nb * 32) or out.stride(1) != 1 or out.device != w.device:
            raise ValueError(f"dequantize: out {tuple(out.shape)} for {n} rows of {nb * 32} weights")
        bb, hdr = LAYOUT[qtype]
        grid = (triton.cdiv(n, 16), triton.cdiv(nb, 4))
        _dequant[grid](w, scale if scale is not None else w, out, n, nb, out.stride(0), w.stride(0),
                       QT=qtype, BB=bb, HDR=hdr, KB=4, BN=16)

    def _gemm(self, x: torch.Tensor, w: torch.Tensor, qtype: int, out: torch.Tensor,
              scale: torch.Tensor | None) -> None:
        m, k = x.shape
        n, nb = _check_blocks(w, qtype, k)
        if (x.stride(1) != 1 or tuple(out.shape) != (m, n) or out.stride(1) != 1 or out.dtype != x.dtype
                or x.dtype not in (torch.float32, torch.bfloat16, torch.float16)
                or not x.device == w.device == out.device):
            raise ValueError(f"quant linear: x {x.dtype} {tuple(x.shape)} -> out {out.dtype} "
                             f"{tuple(out.shape)}, weight [{n}, {k}] on {w.device}")
        if m == 0:
            return
        bm, bn, kb, warps = (16, 64, 4, 4) if m <= 16 else (64, 64, 2, 4) if m <= 64 else (128, 128, 2, 8)
        tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
        split = max(1, min(triton.cdiv(nb, kb), self.fill // tiles)) if tiles < self.fill else 1
        part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
        bb, hdr = LAYOUT[qtype]
        _gemm[(triton.cdiv(m, bm), triton.cdiv(n, bn), split)](
            x, w, scale if scale is not None else w, out, part, m, n, nb, x.stride(0), out.stride(0),
            w.stride(0), QT=qtype, BB=bb, HDR=hdr, KB=kb, BM=bm, BN=bn, SPLIT=split,
            IEEE=self.ieee or x.dtype == torch.float32, num_warps=warps)
        if split > 1:
            _reduce[(triton.cdiv(m * n, 1024),)](part, out, m, n, out.stride(0), SPLIT=split, BLOCK=1024)


def _check_blocks(w: torch.Tensor, qtype: int, cols: int) -> tuple[int, int]:
    """(rows, 32-weight blocks per row) of a block matrix for `cols` inputs, else ValueError."""
    if qtype not in LAYOUT:
        raise ValueError(f"no Triton kernel for GGML type {TYPE_NAMES.get(qtype, qtype)}")
    bb = LAYOUT[qtype][0]
    if (w.dtype != torch.uint8 or w.dim() != 2 or cols <= 0 or cols % 32 or w.shape[1] != cols // 32 * bb
            or w.stride(1) != 1):
        raise ValueError(f"not a {TYPE_NAMES.get(qtype, 'fp8')} block matrix of {cols} columns: "
                         f"{w.dtype} {tuple(w.shape)}")
    return w.shape[0], cols // 32


@functools.cache
def triton_quant(device: torch.device) -> TritonQuant:
    """The kernels for `device` (a CPU "device" runs them under TRITON_INTERPRET=1: tests)."""
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return TritonQuant(fill=2 * sms, ieee=interpret)


class TritonQuantLinear(QuantLinear):
    """QuantLinear on device tensors: every batch size through the Triton GEMM (module docstring)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype, device=x.device)
        for part, start in zip(self.parts, self.offsets):
            self.kernels.quant_linear(x, part.data, part.qtype, out[:, start:start + part.shape[0]])
        return out if self.bias is None else out.add_(self.bias)


class TritonQuantEmbedding(QuantEmbedding):
    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        out = torch.empty(ids.shape[0], self.table.shape[1], dtype=self.dtype, device=ids.device)
        self.kernels.quant_dequantize(self.table.data.index_select(0, ids), self.table.qtype, out)
        return out


def q8_0_blocks(w: torch.Tensor) -> torch.Tensor:
    """[rows, cols] weights -> GGUF Q8_0 blocks [rows, cols / 32 * 34] uint8 on w's device, byte for
    byte the gguf package's quantizer (its round-half-away-from-zero included): benchmarks and tests
    make kept weights with it without that package."""
    rows, cols = w.shape
    b = w.float().reshape(rows, cols // 32, 32)
    d = b.abs().amax(-1, keepdim=True) / 127
    v = b * torch.where(d == 0, 0.0, 1 / d)
    a = v.abs()
    q = (torch.sign(v) * (a.floor() + (2 * (a - a.floor())).floor())).to(torch.int8)
    return torch.cat([d.half().view(torch.uint8), q.view(torch.uint8)], -1).reshape(rows, cols // 32 * 34)


def fp8_cast(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, fp32 per-row scales): each row scaled so its largest |w| is 448."""
    w = weight.float()
    scale = (w.abs().amax(1) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def fp8_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token dynamic fp8: (x / s as float8_e4m3fn, s [M, 1] fp32) with s = max|x_row| / 448."""
    s = (x.abs().amax(1, keepdim=True).float() / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), s


@functools.cache
def scaled_mm_works(device: torch.device) -> bool:
    """torch._scaled_mm with row-wise scales and bf16 output runs here: fp8 tensor cores (compute
    capability >= 8.9) and a torch build that has the row-wise kernel for them; probed once."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        return False
    try:
        a = torch.ones(16, 32, device=device).to(torch.float8_e4m3fn)
        got = torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1, device=device),
                               scale_b=torch.full((1, 16), 2.0, device=device), out_dtype=torch.bfloat16)
        return bool((got == 64).all())
    except (RuntimeError, NotImplementedError):
        return False


class Fp8Linear:
    """x W^T (+ b) with W cast once to fp8 e4m3 and per-output-channel scales. `scaled_mm`: fp8 x fp8
    tensor-core GEMM (bf16 activations only: the row-wise kernel writes bf16), else weight-only."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernels: TritonQuant,
                 scaled_mm: bool) -> None:
        n, k = weight.shape
        self.weight, self.scale = fp8_cast(weight)
        self.bias, self.kernels = bias, kernels
        self.scaled_mm = scaled_mm and weight.dtype == torch.bfloat16 and n % 16 == 0 and k % 16 == 0
        if k % 32 and not self.scaled_mm:
            raise ValueError(f"fp8 weight-only kernel needs a multiple of 32 inputs, got {k}")

    @property
    def nbytes(self) -> int:
        return self.weight.numel() + 4 * self.scale.numel()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.scaled_mm:
            xq, sx = fp8_activations(x)
            out = torch._scaled_mm(xq, self.weight.t(), scale_a=sx, scale_b=self.scale.view(1, -1),
                                   out_dtype=x.dtype)
        else:
            out = torch.empty(x.shape[0], self.weight.shape[0], dtype=x.dtype, device=x.device)
            self.kernels.fp8_linear(x, self.weight, self.scale, out)
        return out if self.bias is None else out.add_(self.bias)


def fp8_maker(device: torch.device):
    """What models/weight_layers.replace_linears calls for `--quantization fp8`: (weight, bias) ->
    Fp8Linear."""
    kernels, fast = triton_quant(device), scaled_mm_works(device)
    return lambda weight, bias: Fp8Linear(weight, bias, kernels, fast)
