"""The typed plan of the C++ CPU layer loop (csrc/decoder_stack.cpp's DecoderStack): a model's decoder layers
as data, and one step's attention arguments. csrc/module.cpp reads every field below by name, so these
classes are where the loop's inputs are defined, once; it refuses a projection `kind` it does not know,
naming it. Built by models/llama_plan.py (the layers) and layers/attention.py (the step)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass(frozen=True)
class QuantPart:
    """One part of a quantized projection (layers/quant_linear.py's QuantTensor): its output columns."""
    blocks: torch.Tensor  # GGUF blocks [rows, bytes], or packed groups of 16 rows
    qtype: int  # the kernels' type id (+ PACKED for a packed matrix)
    start: int  # its first output column
    rows: int  # its output columns


@dataclass(frozen=True)
class QuantProjection:
    """QuantLinear: its parts' kernels on steps of at most max_kernel_rows rows; larger steps dequantize its
    weight (in row chunks of dequant_chunk weights where it is larger) for an ordinary GEMM."""
    kind: ClassVar[str] = "quant"
    parts: tuple[QuantPart, ...]
    in_features: int
    out_features: int
    bias: torch.Tensor | None
    fused_glu: bool  # silu(gate) * up of its [gate; up] in one kernel call (quant_linear_glu)
    max_kernel_rows: int
    dequant_chunk: int


@dataclass(frozen=True)
class OneDnnProjection:
    """layers/linear.py's Linear on a weight oneDNN packed: one matmul call, its epilogue applying silu or a
    product where asked; steps of split_rows[0] to split_rows[1] rows on split_rows[2] threads split by rows
    (linear_rows)."""
    kind: ClassVar[str] = "onednn"
    packed: torch.Tensor
    bias: torch.Tensor | None
    out_features: int
    split_rows: tuple[int, int, int] | None


@dataclass(frozen=True)
class TorchProjection:
    """A Linear whose weight oneDNN did not pack: F.linear."""
    kind: ClassVar[str] = "torch"
    weight: torch.Tensor
    bias: torch.Tensor | None


@dataclass(frozen=True)
class GateUpProjection:
    """layers/linear.py's GateUp: silu(x G^T) * (x U^T) as two oneDNN calls, the gate's epilogue silu, the
    up's the product."""
    kind: ClassVar[str] = "onednn_gate_up"
    gate: OneDnnProjection
    up: OneDnnProjection


Projection = QuantProjection | OneDnnProjection | TorchProjection | GateUpProjection


@dataclass(frozen=True)
class LayerPlan:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: Projection
    o: Projection
    gate_up: Projection  # [gate; up]: only act(gate) * up is asked of it
    down: Projection
    # Qwen3's and Gemma 3's per-head norms of q and k [head_dim], before RoPE (both or neither)
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    # Gemma 3's norms of the attention's (after the all-reduce) and the MLP's outputs, before the residual
    # adds them
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None
    local_rope: bool = False  # RoPE from the forward's local (cos, sin) (Gemma 3's windowed layers)


@dataclass(frozen=True)
class StackPlan:
    heads: int  # this rank's
    kv_heads: int
    head_dim: int
    eps: float
    # steps of at most this many rows take the C++ norm and RoPE, larger ones torch's rms_norm and rotate
    # (element by element, without AVX-512, they pay only on decode-sized steps)
    fused_rows: int
    layers: tuple[LayerPlan, ...]
    # tensor parallel: the sum over the ranks of o_proj's and of down_proj's output, in place (called with
    # the GIL); None on one rank
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None
    # the MLP's gate activation (layers/glu.py's ACTIVATIONS): "silu", or "gelu_pytorch_tanh" (Gemma 3), which
    # takes the [gate; up] projection's plain output
    act: str = "silu"


@dataclass(frozen=True)
class KernelStep:
    """One step's attention arguments (layers/attention.py's TorchAttention with the C++ kernels): the new
    tokens' cache slots, the decodes (the first num_decodes tokens) and the prefill chunks after them."""
    cache: torch.Tensor
    slot_blocks: torch.Tensor
    slot_offsets: torch.Tensor
    num_decodes: int
    decode_tables: torch.Tensor | None
    decode_context: torch.Tensor | None
    prefill_tables: torch.Tensor | None
    prefill_starts: torch.Tensor | None
    prefill_lens: torch.Tensor | None
    prefill_context: torch.Tensor | None
    scale: float
    amx: bool
    windows: tuple[int, ...] = ()  # each layer's sliding window (0: plain causal); empty: none anywhere
