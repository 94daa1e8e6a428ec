"""Linear layers with oneDNN-prepacked weights on CPU.

`F.linear` on CPU re-lays-out the weight for oneDNN on every call; packing it once at load time
makes decode-sized matmuls 1.3-4x faster (bf16 and fp32 alike, measured on the AMX Xeon this
project is developed on). Falls back to `F.linear` wherever packing is unavailable or fails its
self-check.

Prefill-sized bf16 matmuls on AMX go through `split_rows` (the C++ kernels' `linear_rows`: each
thread its own rows) where that measured faster than oneDNN's own split over the threads (SPLIT_ROWS)."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


# Where the split measured faster (2-core AMX Xeon, one matmul timed each way): 2 threads, 512-1535 rows,
# e.g. 1024 rows 2.08 vs oneDNN's 2.88 ms; at 1536 and 2048 rows oneDNN's own split is faster (2.86 vs
# 3.20, 3.65 vs 4.13 ms). Other thread counts were not measured and keep oneDNN's.
SPLIT_THREADS, SPLIT_ROWS = 2, range(512, 1536)

SplitRows = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None", int, str, "torch.Tensor | None"],
                     torch.Tensor]


class Linear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 split_rows: SplitRows | None = None) -> None:
        self.weight: torch.Tensor | None = weight  # None once released (`copies_weight`)
        self.bias, self.out_features = bias, weight.shape[0]
        self.packed = _pack(weight, bias)
        self.split_rows = split_rows if self.packed is not None else None
        # oneDNN's reorder copies the weight (bf16 and fp32 alike on the AVX-512 EPYC), but a packed tensor
        # that aliased it would be corrupted by freeing it: probed, so the model releases only true copies
        self.copies_weight = self.packed is not None and not _aliases(self.packed, weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._split(x):
            return self.split_rows(x, self.packed, self.bias, self.out_features, "none", None)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        """silu(x W^T + b), the activation applied by oneDNN to the fp32 accumulator (packed only)."""
        if self._split(x):
            return self.split_rows(x, self.packed, self.bias, self.out_features, "swish", None)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "swish", [], "")

    def times(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """(x W^T + b) * other in one oneDNN call (packed only)."""
        if self._split(x):
            return self.split_rows(x, self.packed, self.bias, self.out_features, "mul", other)
        return torch.ops.mkldnn._linear_pointwise.binary(x, other, self.packed, self.bias, "mul")

    def _split(self, x: torch.Tensor) -> bool:
        if self.split_rows is None:
            return False
        return x.shape[0] in SPLIT_ROWS and torch.get_num_threads() == SPLIT_THREADS


class GateUp:
    """silu(x G^T) * (x U^T) of a [G; U] weight as two oneDNN GEMMs whose epilogues apply silu and the
    product (packed CPU weights): no [tokens, 2 * inter] tensor written and read back by separate silu / mul
    passes."""

    def __init__(self, gate: Linear, up: Linear) -> None:
        self.gate, self.up = gate, up

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self.up.times(x, self.gate.silu(x))


def gate_up_layer(weight: torch.Tensor, split_rows: SplitRows | None = None) -> GateUp | Linear:
    """The layer of a dense [gate; up] weight: GateUp where oneDNN packs both halves, else one Linear."""
    inter = weight.shape[0] // 2
    gate, up = Linear(weight[:inter], split_rows=split_rows), Linear(weight[inter:], split_rows=split_rows)
    return GateUp(gate, up) if gate.packed is not None and up.packed is not None else Linear(weight)


@torch.no_grad()
def _aliases(packed: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the packed weight reads `weight`'s memory: output 0 with its first row set to zeros, then
    to ones (fixed values: an increment can vanish in rounding), the row put back after."""
    x = torch.ones(1, weight.shape[1], dtype=weight.dtype)
    row = weight[0].clone()
    outs = []
    for value in (0, 1):
        weight[0].fill_(value)
        outs.append(torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")[0, 0])
    weight[0].copy_(row)
    return not torch.equal(outs[0], outs[1])


def _pack(weight: torch.Tensor, bias: torch.Tensor | None):
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 32)  # hint: a decode-sized batch
        x = torch.randn(3, weight.shape[1], dtype=weight.dtype)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        ok = torch.allclose(got.float(), F.linear(x, weight, bias).float(), rtol=1e-2, atol=1e-2)
        return packed if ok else None
    except (RuntimeError, AttributeError):  # op missing in this torch build
        return None
