"""Linear layers with oneDNN-prepacked weights on CPU.

`F.linear` on CPU re-lays-out the weight for oneDNN on every call; packing it once at load time
makes decode-sized matmuls 1.3-4x faster (bf16 and fp32 alike, measured on the AMX Xeon this
project is developed on). Falls back to `F.linear` wherever packing is unavailable or fails its
self-check."""
from __future__ import annotations

import torch
import torch.nn.functional as F


class Linear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight, self.bias = weight, bias
        # keep `weight` referenced: the packed tensor may alias its storage (freeing the
        # original corrupts the packed weight)
        self.packed = _pack(weight, bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        """silu(x W^T + b), the activation applied by oneDNN to the fp32 accumulator (packed only)."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "swish", [], "")

    def times(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """(x W^T + b) * other in one oneDNN call (packed only)."""
        return torch.ops.mkldnn._linear_pointwise.binary(x, other, self.packed, self.bias, "mul")


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
