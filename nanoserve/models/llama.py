"""Llama-family decoder (Llama 2/3/3.1, Mistral, SmolLM2, Qwen2, Qwen3, Gemma 3) reading and writing the
paged KV cache through an attention backend. The family's variations are the config's
(models/model_config.py): Qwen3's and Gemma 3's per-head q/k RMSNorm, Gemma 3's norms after attention and
MLP with (1 + w) weights (kept here as 1 + w, as llama.cpp's GGUF stores them), tanh-GELU gate, embedding
scaled by sqrt(hidden), attention scale, and sliding-window layers with their own RoPE base (windows: the
attention backend's). Q/K/V and gate/up projections are fused into one matmul each; `load_weights` maps HF
names onto the fused slices.

One forward per device: on CPU with the C++ kernels the layers run as csrc/decoder_stack.cpp's loop, from the
typed plan models/llama_plan.py makes of them; everywhere else (CUDA, CPU without the kernels or with head
dims their attention does not serve) as `_layers`, torch ops and the layers' own calls; on CUDA, for the
Llama layer, with the small ops fused into Triton kernels
(models/fused_loop.py; $NANOSERVE_FUSED_OPS=0: off).

Tensor parallel (distributed/parallel.py): a rank holds its heads' rows of QKV, its columns of
o_proj, its slice of gate/up and of down, and its rows of the embedding and LM head; the
constructor's sizes are this rank's, and `weight_targets` says which slice of each checkpoint
tensor the rank reads, so no rank ever holds a full tensor it does not use."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.distributed.parallel import TensorParallel, shard_heads, split, vocab_rows
from nanoserve.heap import trim_heap
from nanoserve.layers import hugepages
from nanoserve.layers.attention import AttentionBackend
from nanoserve.kernels.cpu_kernels import gemm_amx
from nanoserve.layers.glu import ACTIVATIONS, glu
from nanoserve.layers.linear import Linear, gate_up_layer
from nanoserve.layers.quant_linear import QuantEmbedding, QuantTensor
from nanoserve.layers.rotary import RotaryEmbedding, rotate
from nanoserve.models.fused_loop import fused_layers, fused_ops
from nanoserve.models.llama_plan import cpu_stack
from nanoserve.models.model_config import ModelConfig
from nanoserve.models.weight_layers import quant_layers, release_copied


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
        """`cfg`: a ModelConfig, or a transformers config (read through ModelConfig, as config.json is)."""
        super().__init__()
        self.cfg = cfg = cfg if isinstance(cfg, ModelConfig) else ModelConfig.from_dict(cfg.to_dict())
        if cfg.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden activation {cfg.hidden_act!r} is not supported "
                             f"({', '.join(ACTIVATIONS)})")
        self.windows = cfg.layer_windows  # the attention backend's (runner/model_runner.py)
        self.tp = tp = tp or TensorParallel()
        self.hidden = cfg.hidden_size
        self.num_layers = cfg.num_hidden_layers
        total_heads = cfg.num_attention_heads
        self.total_kv_heads = total_kv = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.heads = shard_heads(total_heads, total_kv, tp.size, tp.rank)
        self.num_heads, self.num_kv_heads = self.heads.num_heads, self.heads.num_kv_heads  # this rank's
        self.eps = cfg.rms_norm_eps
        self.vocab_size = cfg.vocab_size
        self.vocab_start, self.vocab_end, vocab_rows_here = vocab_rows(self.vocab_size, tp.size, tp.rank)
        self.tied = cfg.tie_word_embeddings
        qkv_bias = cfg.attention_bias or cfg.model_type == "qwen2"
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.inter_start, inter_end = split(cfg.intermediate_size, tp.size, tp.rank, "intermediate size")
        self.inter = inter_end - self.inter_start
        kw = dict(dtype=dtype, device=device)

        def p(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, **kw), requires_grad=False)

        self.embed = p(vocab_rows_here, self.hidden)
        self.layers = nn.ModuleList(self._layer_params(p, qkv_bias) for _ in range(self.num_layers))
        self.norm = p(self.hidden)
        self.lm_head = self.embed if self.tied else p(vocab_rows_here, self.hidden)
        for table in (self.embed, self.lm_head):  # the last rank's padding rows: zero logits, cut later
            table[self.vocab_end - self.vocab_start:].zero_()
        self.rotary = RotaryEmbedding(self.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                      cfg.rope_scaling, dtype, device)
        # Gemma 3's windowed layers: their own base, unscaled
        self.local_rotary = None if cfg.rope_local_theta is None else RotaryEmbedding(
            self.head_dim, cfg.max_position_embeddings, cfg.rope_local_theta, None, dtype, device)
        self.scale = (cfg.query_pre_attn_scalar or self.head_dim) ** -0.5
        # Gemma scales the embedding by sqrt(hidden) rounded to the model's dtype, as transformers does
        self.embed_scale = float(torch.tensor(self.hidden ** 0.5, dtype=dtype)) if cfg.gemma else None
        # GGUF blocks kept as they are (layers/quant_linear.py), by checkpoint name; finalize() builds
        # their layers
        self.quantized: dict[str, QuantTensor] = {}
        self.embed_rows: QuantEmbedding | None = None
        self.stack = None  # the C++ layer loop, which finalize() builds where the CPU kernels are loaded

    def _layer_params(self, p, qkv_bias: bool) -> nn.Module:
        """One layer's (this rank's) parameters, made by `p(*shape)`; None where the architecture has none."""
        layer, hid, qkv, inter = nn.Module(), self.hidden, self.q_size + 2 * self.kv_size, self.inter
        layer.input_norm, layer.post_norm = p(hid), p(hid)
        layer.qkv, layer.qkv_bias = p(qkv, hid), p(qkv) if qkv_bias else None
        layer.o, layer.gate_up, layer.down = p(hid, self.q_size), p(2 * inter, hid), p(hid, inter)
        layer.q_norm = p(self.head_dim) if self.cfg.qk_norm else None
        layer.k_norm = p(self.head_dim) if self.cfg.qk_norm else None
        layer.attn_out_norm = p(hid) if self.cfg.gemma else None  # Gemma's norms of the branches' outputs
        layer.mlp_out_norm = p(hid) if self.cfg.gemma else None
        return layer

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
            "mlp.down_proj.weight": ("down", None, (hid, total_inter), 1, i0),
            "self_attn.q_norm.weight": ("q_norm", None, (d,), 0, 0),
            "self_attn.k_norm.weight": ("k_norm", None, (d,), 0, 0)}
        # Gemma: its post_attention norm is of the attention's output; the MLP's input norm is "pre_"
        if self.cfg.gemma:
            per_layer.update({"post_attention_layernorm.weight": ("attn_out_norm", None, (hid,), 0, 0),
                              "pre_feedforward_layernorm.weight": ("post_norm", None, (hid,), 0, 0),
                              "post_feedforward_layernorm.weight": ("mlp_out_norm", None, (hid,), 0, 0)})
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
            if self.cfg.gemma and name.endswith("norm.weight"):  # HF's Gemma norm weight w scales by 1 + w
                t.dst.add_(1.0)
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
        silu = self.cfg.hidden_act == "silu"
        for i, layer in enumerate(self.layers):
            q = quant.get(i, {})
            layer.qkv_lin = q.get("qkv") or Linear(layer.qkv, layer.qkv_bias, rows)
            layer.o_lin = q.get("o") or Linear(layer.o, split_rows=rows)
            # GateUp's oneDNN epilogue is SiLU's: a GELU model's [gate; up] is one Linear
            layer.gate_up_lin = q.get("gate_up") or (gate_up_layer(layer.gate_up, rows) if silu
                                                     else Linear(layer.gate_up, split_rows=rows))
            layer.down_lin = q.get("down") or Linear(layer.down, split_rows=rows)
        self.lm_head_lin = quant.get("lm_head") or Linear(self.lm_head)
        release_copied(self)
        # the kept blocks, which every decode step streams whole, on huge pages (a CPU model's only)
        kept = [lin for q in quant.values() for lin in (q.values() if isinstance(q, dict) else [q])]
        hugepages.relocate([p.data for lin in kept for p in getattr(lin, "parts", ())]
                           + ([self.embed_rows.table.data] if self.embed_rows is not None else []))
        trim_heap()  # what the load freed (packing, relocating, released parameters)
        self.stack = cpu_stack(self, kernels)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                logits_indices: torch.Tensor) -> torch.Tensor | None:
        """input_ids/positions [T] -> logits [len(logits_indices), vocab] in fp32 (on rank 0 of a
        tensor-parallel group; None on the others)."""
        x = self._embed(input_ids)
        if self.embed_scale is not None:
            x.mul_(self.embed_scale)
        cos, sin = self.rotary.cos_sin(positions)
        local = None if self.local_rotary is None else self.local_rotary.cos_sin(positions)
        # the C++ loop wherever the attention backend is the C++ kernels' (TorchAttention, for the head dims
        # they serve), which then gives the step's arguments
        step = attn.kernel_step() if self.stack is not None else None
        if step is not None:
            residual = self.stack.forward(x, cos, sin, step, local)
        elif (ops := fused_ops(x.device)) is not None and self.cfg.llama_layer:
            residual = fused_layers(self, x, cos, sin, attn, ops)
        else:
            residual = self._layers(x, (cos, sin), local, attn)
        x = F.rms_norm(residual[logits_indices], (self.hidden,), self.norm, self.eps)
        return self.tp.gather_logits(self.lm_head_lin(x).float(), self.vocab_size)

    def _layers(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                local_rope: tuple[torch.Tensor, torch.Tensor] | None, attn: AttentionBackend) -> torch.Tensor:
        """The decoder layers over the embedded tokens x (updated in place): the last layer's residual
        stream. The torch loop: every device's but a CPU model's with the C++ kernels (its `stack`).
        `local_rope`: the windowed layers' (cos, sin) where their RoPE base differs."""
        h, d, hk, hid, eps = self.num_heads, self.head_dim, self.num_kv_heads, (self.hidden,), self.eps
        k_end, act, local_layers = self.q_size + self.kv_size, self.cfg.hidden_act, self.cfg.local_rope_layers
        residual = x
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv_lin(F.rms_norm(residual, hid, layer.input_norm, eps))
            qk = qkv[:, :k_end].view(-1, h + hk, d)
            if layer.q_norm is not None:
                qk = torch.cat((F.rms_norm(qk[:, :h], (d,), layer.q_norm, eps),
                                F.rms_norm(qk[:, h:], (d,), layer.k_norm, eps)), dim=1)
            qk = rotate(qk, *(local_rope if local_layers[i] else rope))
            o = attn.forward(qk[:, :h], qk[:, h:], qkv[:, k_end:].view(-1, hk, d), i)
            out = self.tp.all_reduce(layer.o_lin(o.view(-1, h * d)))
            residual.add_(out if layer.attn_out_norm is None
                          else F.rms_norm(out, hid, layer.attn_out_norm, eps))
            x = F.rms_norm(residual, hid, layer.post_norm, eps)
            out = self.tp.all_reduce(layer.down_lin(glu(layer.gate_up_lin, x, act)))
            residual.add_(out if layer.mlp_out_norm is None
                          else F.rms_norm(out, hid, layer.mlp_out_norm, eps))
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
