"""Llama-family decoder (Llama 2/3/3.1, Mistral, SmolLM2, Qwen2) reading and writing the paged KV
cache through an attention backend. Q/K/V and gate/up projections are fused into one matmul each;
`load_weights` maps HF names onto the fused slices.

One forward per device: on CPU with the C++ kernels the layers run as csrc/decoder_stack.cpp's loop, from the
typed plan models/llama_plan.py makes of them; everywhere else (CUDA, CPU without the kernels or with head
dims their attention does not serve) as `_layers`, torch ops and the layers' own calls; on CUDA with the
small ops fused into Triton kernels (`fused_layers`, layers/triton_fused.py; $NANOSERVE_FUSED_OPS=0: off).

Tensor parallel (distributed/parallel.py): a rank holds its heads' rows of QKV, its columns of
o_proj, its slice of gate/up and of down, and its rows of the embedding and LM head; the
constructor's sizes are this rank's, and `weight_targets` says which slice of each checkpoint
tensor the rank reads, so no rank ever holds a full tensor it does not use."""
from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.distributed.parallel import TensorParallel, shard_heads, split, vocab_rows
from nanoserve.heap import trim_heap
from nanoserve.layers import hugepages
from nanoserve.layers.attention import AttentionBackend
from nanoserve.layers.backend_choice import triton_usable
from nanoserve.layers.flash_attention import FlashAttention
from nanoserve.kernels.cpu_kernels import gemm_amx
from nanoserve.layers.linear import GateUp, Linear, gate_up_layer
from nanoserve.layers.quant_linear import QuantEmbedding, QuantLinear, QuantTensor, Scratch
from nanoserve.layers.rotary import RotaryEmbedding, rotate
from nanoserve.models.llama_plan import cpu_stack

# the checkpoint tensors behind each (fused) projection, in row order
QUANT_GROUPS = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                "o": ("self_attn.o_proj",), "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
                "down": ("mlp.down_proj",)}


@dataclass(frozen=True)
class WeightTarget:
    """Where one checkpoint tensor goes: `dst` (a parameter or rows of a fused one) receives
    `src.narrow(dim, start, dst.shape[dim])` of a tensor whose full shape is `full_shape`."""
    dst: torch.Tensor
    full_shape: tuple[int, ...]
    dim: int = 0
    start: int = 0


class LlamaModel(nn.Module):
    def __init__(self, cfg, dtype: torch.dtype, device: torch.device,
                 tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp = tp or TensorParallel()
        self.hidden = cfg.hidden_size
        self.num_layers = cfg.num_hidden_layers
        total_heads = cfg.num_attention_heads
        self.total_kv_heads = total_kv = getattr(cfg, "num_key_value_heads", None) or total_heads
        self.head_dim = getattr(cfg, "head_dim", None) or self.hidden // total_heads
        self.heads = shard_heads(total_heads, total_kv, tp.size, tp.rank)
        self.num_heads, self.num_kv_heads = self.heads.num_heads, self.heads.num_kv_heads  # this rank's
        self.eps = cfg.rms_norm_eps
        self.vocab_size = cfg.vocab_size
        self.vocab_start, self.vocab_end, vocab_rows_here = vocab_rows(self.vocab_size, tp.size, tp.rank)
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        qkv_bias = bool(getattr(cfg, "attention_bias", False)) or cfg.model_type == "qwen2"
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.inter_start, inter_end = split(cfg.intermediate_size, tp.size, tp.rank, "intermediate size")
        inter = inter_end - self.inter_start
        self.inter = inter
        kw = dict(dtype=dtype, device=device)

        def p(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, **kw), requires_grad=False)

        self.embed = p(vocab_rows_here, self.hidden)
        self.layers = nn.ModuleList()
        for _ in range(self.num_layers):
            layer = nn.Module()
            layer.input_norm = p(self.hidden)
            layer.qkv = p(self.q_size + 2 * self.kv_size, self.hidden)
            layer.qkv_bias = p(self.q_size + 2 * self.kv_size) if qkv_bias else None
            layer.o = p(self.hidden, self.q_size)
            layer.post_norm = p(self.hidden)
            layer.gate_up = p(2 * inter, self.hidden)
            layer.down = p(self.hidden, inter)
            self.layers.append(layer)
        self.norm = p(self.hidden)
        self.lm_head = self.embed if self.tied else p(vocab_rows_here, self.hidden)
        for table in (self.embed, self.lm_head):  # the last rank's padding rows: zero logits, cut later
            table[self.vocab_end - self.vocab_start:].zero_()
        scaling = getattr(cfg, "rope_scaling", None)
        params = getattr(cfg, "rope_parameters", None) or {}
        theta = getattr(cfg, "rope_theta", None) or params.get("rope_theta", 10000.0)
        if scaling is None and params.get("rope_type", "default") != "default":
            scaling = params
        self.rotary = RotaryEmbedding(self.head_dim, cfg.max_position_embeddings, theta, scaling, dtype,
                                      device)
        self.scale = self.head_dim ** -0.5
        # GGUF blocks kept as they are (layers/quant_linear.py), by checkpoint name; finalize() builds
        # their layers
        self.quantized: dict[str, QuantTensor] = {}
        self.embed_rows: QuantEmbedding | None = None
        self.stack = None  # the C++ layer loop, which finalize() builds where the CPU kernels are loaded

    def weight_targets(self) -> dict[str, WeightTarget]:
        """HF tensor name -> where (and which slice of it) this rank loads. Checked to cover every
        element of every parameter exactly once (vocab padding aside), so a complete checkpoint
        leaves nothing unset."""
        d, hid, hs = self.head_dim, self.hidden, self.heads
        q, kv, inter = self.q_size, self.kv_size, self.inter
        total_q, total_kv = self.cfg.num_attention_heads * d, self.total_kv_heads * d
        q0, kv0, i0 = hs.q_start * d, hs.kv_start * d, self.inter_start
        total_inter = self.cfg.intermediate_size
        per_layer = {  # HF suffix: (our parameter, its rows or None for all, full shape, slice dim, start)
            "input_layernorm.weight": ("input_norm", None, (hid,), 0, 0),
            "post_attention_layernorm.weight": ("post_norm", None, (hid,), 0, 0),
            "self_attn.q_proj.weight": ("qkv", (0, q), (total_q, hid), 0, q0),
            "self_attn.k_proj.weight": ("qkv", (q, q + kv), (total_kv, hid), 0, kv0),
            "self_attn.v_proj.weight": ("qkv", (q + kv, q + 2 * kv), (total_kv, hid), 0, kv0),
            "self_attn.q_proj.bias": ("qkv_bias", (0, q), (total_q,), 0, q0),
            "self_attn.k_proj.bias": ("qkv_bias", (q, q + kv), (total_kv,), 0, kv0),
            "self_attn.v_proj.bias": ("qkv_bias", (q + kv, q + 2 * kv), (total_kv,), 0, kv0),
            "self_attn.o_proj.weight": ("o", None, (hid, total_q), 1, q0),
            "mlp.gate_proj.weight": ("gate_up", (0, inter), (total_inter, hid), 0, i0),
            "mlp.up_proj.weight": ("gate_up", (inter, 2 * inter), (total_inter, hid), 0, i0),
            "mlp.down_proj.weight": ("down", None, (hid, total_inter), 1, i0)}
        real_vocab = self.vocab_end - self.vocab_start
        table = lambda p: WeightTarget(p[:real_vocab], (self.vocab_size, hid), 0,  # noqa: E731
                                       self.vocab_start)
        targets = {"embed_tokens.weight": table(self.embed), "norm.weight": WeightTarget(self.norm, (hid,))}
        if not self.tied:
            targets["lm_head.weight"] = table(self.lm_head)
        for i, layer in enumerate(self.layers):
            for suffix, (attr, rows, full, dim, start) in per_layer.items():
                if (param := getattr(layer, attr)) is not None:
                    dst = param if rows is None else param[rows[0]:rows[1]]
                    targets[f"layers.{i}.{suffix}"] = WeightTarget(dst, full, dim, start)
        filled = {id(p): 0 for p in self.parameters()}
        for t in targets.values():
            base = t.dst._base if t.dst._base is not None else t.dst
            filled[id(base)] += t.dst.numel()
        padding = {id(p): p[real_vocab:].numel() for p in (self.embed, self.lm_head)}
        assert all(filled[id(p)] + padding.get(id(p), 0) == p.numel() for p in self.parameters()), \
            "weight table misses a parameter"
        return targets

    def load_weights(self, weights: Iterable[tuple[str, object]]) -> None:
        """Copy HF-named tensors into our (fused, sharded) parameters; refuse unknown, misshapen
        or missing ones. A weight is a tensor or a lazy safetensors slice (`get_shape()` and
        indexing): then only this rank's slice is read from the file."""
        targets, loaded = self.weight_targets(), set()
        for name, src in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name or (self.tied and name == "lm_head.weight"):
                continue
            t = targets.get(name)
            if t is None:
                raise ValueError(f"unexpected weight {name!r}")
            shape = tuple(src.shape) if isinstance(src, torch.Tensor) else tuple(src.get_shape())
            if shape != t.full_shape:
                raise ValueError(f"weight {name!r} has shape {shape}, expected {t.full_shape}")
            if isinstance(src, QuantTensor) and not self.tp.enabled:
                self.quantized[name] = src  # a shard gets it dequantized (its slice) below
                loaded.add(name)
                continue
            index = [slice(None)] * len(shape)
            index[t.dim] = slice(t.start, t.start + t.dst.shape[t.dim])
            t.dst.copy_(src[tuple(index)])
            loaded.add(name)
        if missing := sorted(targets.keys() - loaded):
            raise ValueError(f"checkpoint is incomplete: {len(missing)} of {len(targets)} tensors missing, "
                             f"e.g. {missing[:3]}")

    def init_dummy(self, seed: int) -> None:
        """Random weights generated where they live (an 8B model needs no 16 GB file): norms 1,
        everything else N(0, 0.02), for speed measurements only."""
        gen = torch.Generator(device=self.embed.device).manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm"):
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02, generator=gen)

    def finalize(self, kernels=None, quant_kernels=None) -> None:
        """After loading: wrap the projection weights in (CPU-prepacked) linear layers, or in
        quantized ones where the checkpoint's blocks were kept (`quant_kernels`: their kernels; without
        them the blocks are dequantized here); with `kernels` (kernels/cpu_kernels.py, given for CPU models
        only) the layers' C++ loop is built (`stack`)."""
        self.kernels = kernels
        quant = quant_layers(self, quant_kernels)
        # bf16 on AMX: prefill-sized GEMMs split by rows over the threads (layers/linear.py); in fp32,
        # and without AMX (not measured), oneDNN's own split
        split = kernels is not None and gemm_amx(kernels) and self.embed.dtype == torch.bfloat16
        rows = kernels.linear_rows if split else None
        for i, layer in enumerate(self.layers):
            q = quant.get(i, {})
            layer.qkv_lin = q.get("qkv") or Linear(layer.qkv, layer.qkv_bias, rows)
            layer.o_lin = q.get("o") or Linear(layer.o, split_rows=rows)
            layer.gate_up_lin = q.get("gate_up") or gate_up_layer(layer.gate_up, rows)
            layer.down_lin = q.get("down") or Linear(layer.down, split_rows=rows)
        self.lm_head_lin = quant.get("lm_head") or Linear(self.lm_head)
        release_copied(self)
        # the kept blocks, which every decode step streams whole, on huge pages (a CPU model's only)
        kept = [lin for q in quant.values() for lin in (q.values() if isinstance(q, dict) else [q])]
        hugepages.relocate([p.data for lin in kept for p in getattr(lin, "parts", ())]
                           + ([self.embed_rows.table.data] if self.embed_rows is not None else []))
        trim_heap()  # what the load freed (packing, relocating, released parameters)
        self.stack = cpu_stack(self, kernels)

    def replace_linears(self, make) -> None:
        """Each dense projection (not one kept in GGUF blocks) rebuilt by `make(weight, bias)` (fp8:
        layers/triton_quant.py), its parameter released. The LM head stays: every logit depends on it,
        for a few percent of the weight bytes."""
        self.stack = None  # it calls the layers being replaced; the torch loop calls the device kernels' ones
        for layer in self.layers:
            if isinstance(layer.gate_up_lin, GateUp):  # CPU's two packed GEMMs: one layer for make()
                layer.gate_up_lin = Linear(layer.gate_up)
            for attr, name, bias in (("qkv_lin", "qkv", layer.qkv_bias), ("o_lin", "o", None),
                                     ("gate_up_lin", "gate_up", None), ("down_lin", "down", None)):
                lin, param = getattr(layer, attr), getattr(layer, name)
                if isinstance(lin, Linear) and lin.weight is param:
                    setattr(layer, attr, make(param, bias))
                    param.data = param.data.new_empty(0)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                logits_indices: torch.Tensor) -> torch.Tensor | None:
        """input_ids/positions [T] -> logits [len(logits_indices), vocab] in fp32 (on rank 0 of a
        tensor-parallel group; None on the others)."""
        x = self._embed(input_ids)
        cos, sin = self.rotary.cos_sin(positions)
        # the C++ loop wherever the attention backend is the C++ kernels' (TorchAttention, for the head dims
        # they serve), which then gives the step's arguments
        step = attn.kernel_step() if self.stack is not None else None
        residual = self._layers(x, cos, sin, attn) if step is None else self.stack.forward(x, cos, sin, step)
        x = F.rms_norm(residual[logits_indices], (self.hidden,), self.norm, self.eps)
        return self.tp.gather_logits(self.lm_head_lin(x).float(), self.vocab_size)

    def _layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn: AttentionBackend) -> torch.Tensor:
        """The decoder layers over the embedded tokens x (updated in place): the last layer's residual
        stream. The torch loop: every device's but a CPU model's with the C++ kernels (its `stack`)."""
        if (ops := fused_ops(x.device)) is not None:
            return fused_layers(self, x, cos, sin, attn, ops)
        h, d, hk = self.num_heads, self.head_dim, self.num_kv_heads
        k_end = self.q_size + self.kv_size
        residual = x
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv_lin(F.rms_norm(residual, (self.hidden,), layer.input_norm, self.eps))
            qk = rotate(qkv[:, :k_end].view(-1, h + hk, d), cos, sin)
            o = attn.forward(qk[:, :h], qk[:, h:], qkv[:, k_end:].view(-1, hk, d), i)
            residual.add_(self.tp.all_reduce(layer.o_lin(o.view(-1, h * d))))
            x = F.rms_norm(residual, (self.hidden,), layer.post_norm, self.eps)
            residual.add_(self.tp.all_reduce(layer.down_lin(silu_mul(layer.gate_up_lin, x))))
        return residual

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_rows is not None:
            return self.embed_rows(input_ids)
        if not self.tp.enabled:
            return F.embedding(input_ids, self.embed)
        local = input_ids - self.vocab_start  # ids in another rank's rows contribute zeros
        outside = (local < 0) | (local >= self.vocab_end - self.vocab_start)
        x = F.embedding(local.masked_fill(outside, 0), self.embed)
        return self.tp.all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0))


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


def fused_layers(model: LlamaModel, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
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
        mlp = m.tp.all_reduce(layer.down_lin(silu_mul(layer.gate_up_lin, x, ops.silu_mul)))
        if i + 1 < len(m.layers):
            x = ops.add_rms_norm(residual, mlp, m.layers[i + 1].input_norm, m.eps)
        else:
            residual.add_(mlp)
    return residual


def silu_mul(lin: object, x: torch.Tensor, of_output=None) -> torch.Tensor:
    """silu(gate) * up of a [gate; up] projection: the layer's own where it fuses it (GateUp's oneDNN
    epilogues, QuantLinear's GLU kernel), else `of_output` of its output (default: from its halves)."""
    if isinstance(lin, (GateUp, QuantLinear)):
        return lin.silu_mul(x)
    if of_output is not None:
        return of_output(lin(x))
    gate, up = lin(x).chunk(2, dim=-1)
    return F.silu(gate) * up


def release_copied(model: LlamaModel) -> None:
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


def quant_layers(model: LlamaModel, kernels) -> dict:
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
