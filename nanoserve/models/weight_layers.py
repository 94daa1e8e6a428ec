"""How a loaded checkpoint's projection weights become layers: GGUF blocks kept quantized grouped into
the model's fused projections (`quant_layers`), and dense parameters released where their layers compute on
packed copies (`release_copied`)."""
from __future__ import annotations

import torch
from torch import nn

from nanoserve.layers.linear import GateUp, Linear
from nanoserve.layers.quant_linear import QuantEmbedding, QuantLinear, QuantTensor, Scratch

# the checkpoint tensors behind each (fused) projection, in row order
QUANT_GROUPS = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                "o": ("self_attn.o_proj",), "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
                "down": ("mlp.down_proj",)}


def release_copied(model: nn.Module) -> None:
    """Frees each projection parameter whose every layer computes on its own packed copy (oneDNN's
    reorder on CPU): otherwise a dense CPU model holds its weights twice (an 8B bf16 checkpoint: 32 GB
    instead of 16). A tied LM head's table stays: the embedding reads it."""
    owners = [] if model.tied else [(model.lm_head, [model.lm_head_lin])]
    for layer in model.layers:
        mlp = layer.gate_up_lin
        owners += [(layer.qkv, [layer.qkv_lin]), (layer.o, [layer.o_lin]), (layer.down, [layer.down_lin]),
                   (layer.gate_up, [mlp.gate, mlp.up] if isinstance(mlp, GateUp) else [mlp])]
    for param, lins in owners:
        if param.numel() and all(isinstance(lin, Linear) and lin.copies_weight for lin in lins):
            for lin in lins:
                lin.weight = None
            param.data = param.data.new_empty(0)


def quant_layers(model: nn.Module, kernels) -> dict:
    """{layer index: {"qkv"|"o"|"gate_up"|"down": QuantLinear}, "lm_head": QuantLinear} for the
    projections whose every checkpoint tensor was kept in blocks; the parameters they replace are
    released (never written: their pages were never touched). A group with only some tensors kept,
    and everything when there are no kernels, is dequantized into its parameter instead."""
    kept, model.quantized = model.quantized, {}
    if not kept:
        return {}
    targets, out, scratch = model.weight_targets(), {}, Scratch()
    # device kernels (layers/triton_quant.py) bring their own layer classes and read only some types
    linear = getattr(kernels, "linear_layer", QuantLinear)
    embedding = getattr(kernels, "embedding_layer", QuantEmbedding)
    if (types := getattr(kernels, "qtypes", None)) is not None:
        for n, w in list(kept.items()):
            if w.qtype not in types:
                targets[n].dst.copy_(kept.pop(n).dequantize())
    device = model.embed.device

    def moved(w: QuantTensor) -> QuantTensor:  # the blocks go to the device once, in the kernels' layout
        w = w if w.data.device == device else QuantTensor(w.data.to(device), w.qtype, w.shape)
        return w.packed_for(kernels)

    def take(names: list[str], param: torch.Tensor, bias: torch.Tensor | None = None) -> QuantLinear | None:
        if kernels is None or not all(n in kept for n in names):
            for n in names:
                if n in kept:
                    targets[n].dst.copy_(kept.pop(n).dequantize())
            return None
        param.data = param.data.new_empty(0)
        return linear([moved(kept.pop(n)) for n in names], kernels, scratch, bias)

    for i, layer in enumerate(model.layers):
        out[i] = {}
        for attr, group in QUANT_GROUPS.items():
            bias = layer.qkv_bias if attr == "qkv" else None
            lin = take([f"layers.{i}.{g}.weight" for g in group], getattr(layer, attr), bias)
            if lin is not None:
                out[i][attr] = lin
    if kernels is not None:
        table = kept.pop("embed_tokens.weight", None)
        table = table if table is None else moved(table)
        head = table if model.tied else kept.pop("lm_head.weight", None)
        if head is not None:
            out["lm_head"] = linear([moved(head)], kernels, scratch)
            model.lm_head.data = model.lm_head.data.new_empty(0)
        if table is not None:
            model.embed_rows = embedding(table, kernels, model.embed.dtype)
            model.embed.data = model.embed.data.new_empty(0)
    for n, w in kept.items():  # no kernels
        targets[n].dst.copy_(w.dequantize())
    return out


def replace_linears(model: nn.Module, make) -> None:
    """Each dense projection (not one kept in GGUF blocks) rebuilt by `make(weight, bias)` (fp8:
    layers/triton_quant.py), its parameter released. The LM head stays: every logit depends on it,
    for a few percent of the weight bytes."""
    model.stack = None  # it calls the layers being replaced; the torch loop calls the device kernels' ones
    for layer in model.layers:
        if isinstance(layer.gate_up_lin, GateUp):  # CPU's two packed GEMMs: one layer for make()
            layer.gate_up_lin = Linear(layer.gate_up)
        for attr, name, bias in (("qkv_lin", "qkv", layer.qkv_bias), ("o_lin", "o", None),
                                 ("gate_up_lin", "gate_up", None), ("down_lin", "down", None)):
            lin, param = getattr(layer, attr), getattr(layer, name)
            if isinstance(lin, Linear) and lin.weight is param:
                setattr(layer, attr, make(param, bias))
                param.data = param.data.new_empty(0)
