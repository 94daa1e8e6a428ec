"""A Llama model's decoder layers as the C++ CPU layer loop's typed plan (kernels/plan.py): the one place
where a CPU layer's parts are mapped onto what csrc/decoder_stack.cpp runs. A projection class this
planner does not know is refused here, naming it: a new layer kind needs its plan kind (kernels/plan.py,
read by csrc/module.cpp) before a CPU model can hold it."""
from __future__ import annotations

from types import ModuleType

from torch import nn

from nanoserve.kernels.plan import (GateUpProjection, LayerPlan, OneDnnProjection, Projection, QuantPart,
                                    QuantProjection, StackPlan, TorchProjection)
from nanoserve.layers import quant_linear
from nanoserve.layers.linear import SPLIT_ROWS, SPLIT_THREADS, GateUp, Linear
from nanoserve.layers.quant_linear import QuantLinear

# Without AVX-512 the C++ norm and RoPE go element by element: they beat torch's ops only on decode-sized
# steps, up to this many rows
FUSED_MAX_ROWS = 32


def cpu_stack(model: nn.Module, kernels: ModuleType | None) -> object | None:
    """The C++ layer loop (csrc/decoder_stack.cpp's DecoderStack) of a finalized CPU LlamaModel, or None
    without the C++ kernels (the model's torch loop runs)."""
    return None if kernels is None else kernels.DecoderStack(stack_plan(model, kernels))


def stack_plan(model: nn.Module, kernels: ModuleType) -> StackPlan:
    """The plan of a finalized LlamaModel's layers (this rank's heads under tensor parallelism)."""
    layers = tuple(LayerPlan(layer.input_norm, layer.post_norm, projection_plan(layer.qkv_lin),
                             projection_plan(layer.o_lin), projection_plan(layer.gate_up_lin),
                             projection_plan(layer.down_lin), layer.q_norm, layer.k_norm, layer.attn_out_norm,
                             layer.mlp_out_norm, local)
                   for layer, local in zip(model.layers, model.cfg.local_rope_layers))
    return StackPlan(model.num_heads, model.num_kv_heads, model.head_dim, model.eps,
                     1 << 62 if kernels.vectorized else FUSED_MAX_ROWS, layers,
                     model.tp.all_reduce if model.tp.enabled else None, model.cfg.hidden_act)


def projection_plan(lin: object) -> Projection:
    """One projection layer's plan, by its exact class (a subclass computes otherwise:
    layers/triton_quant.py's run on CUDA). Any other class is refused, naming it."""
    if type(lin) is QuantLinear:
        parts = tuple(QuantPart(p.data, p.kernel_type, start, p.shape[0])
                      for p, start in zip(lin.parts, lin.offsets))
        return QuantProjection(parts, lin.in_features, lin.out_features, lin.bias, lin.fused_glu,
                               lin.max_kernel_rows, quant_linear.DEQUANT_CHUNK)
    if type(lin) is GateUp:
        return GateUpProjection(onednn_plan(lin.gate), onednn_plan(lin.up))
    if type(lin) is Linear:
        return TorchProjection(lin.weight, lin.bias) if lin.packed is None else onednn_plan(lin)
    raise TypeError(f"the CPU layer loop has no plan for a {type(lin).__name__} projection: give it a kind "
                    "(kernels/plan.py, read by csrc/module.cpp) and map it here")


def onednn_plan(lin: Linear) -> OneDnnProjection:
    split = (SPLIT_ROWS.start, SPLIT_ROWS.stop, SPLIT_THREADS) if lin.split_rows is not None else None
    return OneDnnProjection(lin.packed, lin.bias, lin.out_features, split)
