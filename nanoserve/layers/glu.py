"""The gated MLP's activation over a [gate; up] projection: act(gate) * up, SiLU (Llama, Qwen) or tanh-GELU
(Gemma 3)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from nanoserve.layers.linear import GateUp
from nanoserve.layers.quant_linear import QuantLinear

ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


def glu(lin: object, x: torch.Tensor, act: str = "silu", of_output=None) -> torch.Tensor:
    """act(gate) * up of a [gate; up] projection `lin` of x. SiLU: the layer's own where it fuses it (GateUp's
    oneDNN epilogues, QuantLinear's GLU kernel), else `of_output` of its output (default: from its halves).
    GELU: from the halves of its output (a GateUp, which has no unfused output, is never built for it)."""
    if act == "silu" and isinstance(lin, (GateUp, QuantLinear)):
        return lin.silu_mul(x)
    if act == "silu" and of_output is not None:
        return of_output(lin(x))
    gate, up = lin(x).chunk(2, dim=-1)
    return (F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")) * up
