"""The CUDA decoder loop with its small ops fused into Triton kernels (layers/triton_fused.py): the Llama
layer's torch loop (`LlamaModel._layers`) with the same roundings, to the bounds the fused ops state."""
from __future__ import annotations

import os
from types import ModuleType

import torch
from torch import nn

from nanoserve.layers.attention import AttentionBackend
from nanoserve.layers.backend_choice import triton_usable
from nanoserve.layers.flash_attention import FlashAttention
from nanoserve.layers.glu import glu


def fused_ops(device: torch.device) -> ModuleType | None:
    """layers/triton_fused.py where `_layers` runs its fused loop, else None: on CUDA when Triton imports.
    $NANOSERVE_FUSED_OPS=0 turns them off (the A/B of a GPU run), =1 asks for them wherever Triton runs
    (CPU: under TRITON_INTERPRET=1, for tests) and fails where it does not."""
    forced = os.environ.get("NANOSERVE_FUSED_OPS", "")
    if forced not in ("", "0", "1"):
        raise ValueError(f"$NANOSERVE_FUSED_OPS must be 0 or 1, got {forced!r}")
    if forced == "0" or (forced == "" and device.type != "cuda"):
        return None
    if (why := triton_usable(device)) is not None:
        if forced == "1":
            raise ValueError(f"NANOSERVE_FUSED_OPS=1: {why}")
        return None
    from nanoserve.layers import triton_fused
    return triton_fused


def fused_layers(model: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 attn: AttentionBackend, ops: ModuleType) -> torch.Tensor:
    """`LlamaModel._layers` with the small ops fused (`ops`: layers/triton_fused.py): each residual add
    with the RMSNorm after it (a layer's input norm takes the previous layer's MLP add), RoPE in
    place in the QKV output with the step's K/V stored into a paged backend's cache (which then skips
    its own store), SiLU·mul. The torch loop's roundings, to the bounds the fused ops state."""
    m, h, hk, d = model, model.num_heads, model.num_kv_heads, model.head_dim
    paged = isinstance(attn, FlashAttention)  # Triton's too: their forward takes kv_written
    residual = x
    x = ops.add_rms_norm(residual, None, m.layers[0].input_norm, m.eps)
    for i, layer in enumerate(m.layers):
        dest = attn.kv_destination(i) if paged else None
        q, k, v = ops.rope_kv(layer.qkv_lin(x), cos, sin, h, hk, dest)
        o = attn.forward(q, k, v, i, kv_written=True) if paged else attn.forward(q, k, v, i)
        x = ops.add_rms_norm(residual, m.tp.all_reduce(layer.o_lin(o.view(-1, h * d))), layer.post_norm,
                             m.eps)
        mlp = m.tp.all_reduce(layer.down_lin(glu(layer.gate_up_lin, x, "silu", ops.silu_mul)))
        if i + 1 < len(m.layers):
            x = ops.add_rms_norm(residual, mlp, m.layers[i + 1].input_norm, m.eps)
        else:
            residual.add_(mlp)
    return residual


