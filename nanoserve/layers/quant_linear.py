"""Linear layers and embedding tables whose weights stay in GGUF blocks (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K).

Decode is weight-streaming bound: a Q4_1 weight is 0.625 bytes, a bf16 one 2, an fp32 one 4. The
kernels (csrc/quant.h) read the blocks and dequantize them in registers with exact products, so
results equal "dequantize, then matmul in fp32" up to rounding and summation order. Where the kernels
have an AVX-512 build (`packs()`), Q4_0/Q4_1/Q5_0/Q8_0 matrices are rearranged once at load into groups
of 16 interleaved rows (the same bytes; csrc/quant_blocks.h): one vector then holds one weight of 16
rows, and the GEMV runs at about the memory's speed. Q4_K/Q6_K likewise (csrc/kquant.h; Q4_K's scales
unpacked: 148 bytes a 256 weights, not 144).

Packed matrices take every step on the kernel (beyond PACKED_MAX_ROWS rows only where the GEMM has
AMX); block-layout ones up to GEMV_MAX_ROWS rows (decode). Larger steps dequantize the weight (in row
chunks of DEQUANT_CHUNK weights where it is larger) into a scratch tensor in the activation dtype and
run the ordinary GEMM (oneDNN): there the FLOPs dominate and the dequantization is a few percent of
the step.
Embedding lookups dequantize only the rows they read."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

Q4_0, Q4_1, Q5_0, Q8_0 = 2, 3, 6, 8  # GGML type ids of the types kept quantized
Q4_K, Q6_K = 12, 14
# (weights, bytes) of one block, by type
BLOCKS = {Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q8_0: (32, 34), Q4_K: (256, 144), Q6_K: (256, 210)}
TYPE_NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q8_0: "Q8_0", Q4_K: "Q4_K", Q6_K: "Q6_K"}
# Above this many rows a block-layout matrix (AVX2, scalar builds) is dequantized for the GEMM
GEMV_MAX_ROWS = 12
# Packed matrices take every step on the kernel: without AMX it is faster than dequantize + oneDNN
# GEMM at every size measured (one thread, 3072x576 Q4_1: int8 activations 22.6 vs 36.1 ms at 2048
# rows, fp32 70 vs 83 ms), and a token's numerics then do not depend on its step's size. With AMX
# (`gemm_prefill()`, not measured against the kernel) steps beyond this many rows take the GEMM
PACKED_MAX_ROWS = 64
# A prefill GEMM dequantizes at most this many weights (elements) at a time: larger weights (a 1B
# model's gate/up, 33M) go through in row chunks, so the scratch stays a few MB
DEQUANT_CHUNK = 4 << 20
PACKABLE = (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K)  # types with a packed layout (where their module `packs`)
# bytes of one block's share of a packed group, where not the block's own (Q4_K's scales and mins
# unpacked to a byte each: csrc/kquant.h)
PACKED_BYTES = {Q4_K: 148}
PACKED = 256  # qtype + PACKED names a packed matrix to the kernels
GROUP = 16  # rows per packed group


@dataclass(frozen=True)
class QuantTensor:
    """A [rows, cols] weight matrix as GGUF blocks: `data` is [rows, cols / block weights * block
    bytes] uint8 (memory-mapped from the file where it could stay so), or, `packed`, the kernels' interleaved
    layout [ceil(rows / 16), 16 * that]."""
    data: torch.Tensor
    qtype: int
    shape: tuple[int, int]
    packed: bool = False

    def __post_init__(self) -> None:
        rows, cols = self.shape
        qk, nbytes = BLOCKS.get(self.qtype, (0, 0))
        packed_bytes = PACKED_BYTES.get(self.qtype, nbytes)
        want = ((-(-rows // GROUP), cols // qk * packed_bytes * GROUP) if self.packed and qk
                else (rows, cols // (qk or 1) * nbytes))
        misshapen = not qk or cols % qk or tuple(self.data.shape) != want
        if misshapen or self.packed and self.qtype not in PACKABLE:
            raise ValueError(f"not a {TYPE_NAMES.get(self.qtype, self.qtype)} [{rows}, {cols}] "
                             f"{'packed ' if self.packed else ''}block matrix: data {tuple(self.data.shape)}")

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def kernel_type(self) -> int:
        """The type id the kernels take for this layout."""
        return self.qtype + PACKED if self.packed else self.qtype

    def get_shape(self) -> tuple[int, int]:  # the lazy-slice protocol the model's loader reads
        return self.shape

    def packed_for(self, kernels: Any) -> QuantTensor:
        """This matrix in the layout `kernels` computes on fastest (itself where that is the blocks')."""
        packs = getattr(kernels, "packs", None)
        if self.packed or self.qtype not in PACKABLE or not callable(packs) or \
                not (packs(self.qtype) if self.qtype in (Q4_K, Q6_K) else packs()):
            return self
        packed = kernels.quant_pack(self.data.contiguous(), self.qtype)
        return QuantTensor(packed, self.qtype, self.shape, packed=True)

    def rows(self, start: int, stop: int) -> QuantTensor:
        """Rows [start, stop) (a multiple of 16 apart from the end when packed)."""
        if not self.packed:
            return QuantTensor(self.data[start:stop], self.qtype, (stop - start, self.shape[1]))
        if start % GROUP or (stop % GROUP and stop != self.shape[0]):
            raise ValueError(f"packed rows are taken 16 at a time, not [{start}, {stop})")
        data = self.data[start // GROUP:-(-stop // GROUP)]
        return QuantTensor(data, self.qtype, (stop - start, self.shape[1]), True)

    def dequantize(self) -> torch.Tensor:
        """fp32 [rows, cols] by the gguf package (the reference this layer is tested against)."""
        import numpy as np
        from gguf.quants import dequantize
        if self.packed:
            raise ValueError("a packed matrix is dequantized by its kernels (quant_dequantize)")
        return torch.from_numpy(np.array(dequantize(self.data.numpy(), self.qtype), dtype=np.float32))

    def __getitem__(self, index) -> torch.Tensor:
        """A slice, dequantized (tensor-parallel shards, mixed-type fused weights)."""
        return self.dequantize()[index]


@dataclass
class Scratch:
    """One dequantization buffer shared by every layer of a model (layers run one at a time), so
    prefill GEMMs hold at most one layer's weight in the activation dtype."""
    buf: torch.Tensor = field(default_factory=lambda: torch.empty(0))

    def take(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        if self.buf.numel() < n or self.buf.dtype != dtype:
            self.buf = torch.empty(n, dtype=dtype)
        return self.buf[:n]


def merged(parts: list[QuantTensor]) -> list[QuantTensor]:
    """Parts of one type as one matrix (their rows stacked: the same bytes), so a decode step makes
    one kernel call for a fused QKV or gate/up instead of one per part (the embedded model: 121 calls a
    step instead of 210, each with its own activation preparation and thread fork). Packed parts
    stack only in whole groups of 16 rows."""
    if len(parts) < 2 or len({(p.qtype, p.packed) for p in parts}) != 1 or \
            (parts[0].packed and any(p.shape[0] % GROUP for p in parts)):
        return parts
    rows = sum(p.shape[0] for p in parts)
    first = parts[0]
    data = torch.cat([p.data for p in parts])
    return [QuantTensor(data, first.qtype, (rows, first.shape[1]), first.packed)]


class QuantLinear:
    """x W^T (+ b) where W is the row-concatenation of `parts` (fused QKV, gate/up), each part in
    its own block type; every part writes its columns of one output."""

    def __init__(self, parts: list[QuantTensor], kernels: Any, scratch: Scratch,
                 bias: torch.Tensor | None = None) -> None:
        cols = {p.shape[1] for p in parts}
        if len(cols) != 1:
            raise ValueError(f"parts disagree on the input size: {sorted(cols)}")
        self.parts, self.kernels, self.scratch, self.bias = merged(parts), kernels, scratch, bias
        self.in_features = cols.pop()
        self.out_features = sum(p.shape[0] for p in parts)
        parts = self.parts
        self.offsets = [sum(p.shape[0] for p in parts[:i]) for i in range(len(parts))]
        if not all(p.packed for p in parts):
            self.max_kernel_rows = GEMV_MAX_ROWS
        elif getattr(kernels, "gemm_prefill", lambda: False)():
            self.max_kernel_rows = PACKED_MAX_ROWS
        else:
            self.max_kernel_rows = 1 << 62
        glu = getattr(kernels, "glu", None)
        self.fused_glu = (len(parts) == 1 and bias is None and self.out_features % (2 * GROUP) == 0
                          and glu is not None and glu(parts[0].kernel_type))

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        gemm = rows > self.max_kernel_rows
        if gemm and self.out_features * self.in_features <= DEQUANT_CHUNK:
            return F.linear(x, self.dequantized(x.dtype), self.bias)
        out = torch.empty(rows, self.out_features, dtype=x.dtype)
        if gemm:
            step = max(GROUP, DEQUANT_CHUNK // self.in_features // GROUP * GROUP)
            for part, start in zip(self.parts, self.offsets):
                for r in range(0, part.shape[0], step):
                    chunk = part.rows(r, min(r + step, part.shape[0]))
                    n = chunk.shape[0]
                    w = self.scratch.take(n * self.in_features, x.dtype).view(n, self.in_features)
                    self.kernels.quant_dequantize(chunk.data, chunk.kernel_type, w)
                    out[:, start + r:start + r + n] = F.linear(x, w)
            return out if self.bias is None else out.add_(self.bias)
        for part, start in zip(self.parts, self.offsets):
            dst = out if len(self.parts) == 1 else out[:, start:start + part.shape[0]]
            self.kernels.quant_linear(x, part.data, part.kernel_type, dst)
        return out if self.bias is None else out.add_(self.bias)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(x G^T) * (x U^T) for this layer's W = [G; U] (a gate/up projection): one kernel call where
        the packed kernel fuses it (the product rounded once, no [rows, 2 * inter] output to write and read
        back)."""
        if self.fused_glu and x.shape[0] <= self.max_kernel_rows:
            out = torch.empty(x.shape[0], self.out_features // 2, dtype=x.dtype)
            self.kernels.quant_linear_glu(x, self.parts[0].data, self.parts[0].kernel_type, out)
            return out
        gate, up = self(x).chunk(2, dim=-1)
        return F.silu(gate) * up

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole weight in `dtype`, in the shared scratch buffer (valid until the next call)."""
        rows, cols = self.out_features, self.in_features
        w = self.scratch.take(rows * cols, dtype).view(rows, cols)
        for part, start in zip(self.parts, self.offsets):
            self.kernels.quant_dequantize(part.data, part.kernel_type, w[start:start + part.shape[0]])
        return w


class QuantEmbedding:
    """Embedding rows read from blocks: a lookup dequantizes only the rows it reads."""

    def __init__(self, table: QuantTensor, kernels: Any, dtype: torch.dtype) -> None:
        self.table, self.kernels, self.dtype = table, kernels, dtype

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        out = torch.empty(ids.shape[0], self.table.shape[1], dtype=self.dtype)
        if self.table.packed:
            self.kernels.quant_rows(self.table.data, self.table.kernel_type, self.table.shape[0], ids, out)
        else:
            self.kernels.quant_dequantize(self.table.data.index_select(0, ids), self.table.qtype, out)
        return out
