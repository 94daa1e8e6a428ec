"""Llama-family decoder (Llama 2/3/3.1, Mistral, SmolLM2, Qwen2) reading and writing the paged KV
cache through an attention backend. Q/K/V and gate/up projections are fused into one matmul each;
`load_weights` maps HF names onto the fused slices."""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.layers.attention import AttentionBackend
from nanoserve.layers.linear import Linear
from nanoserve.layers.rotary import RotaryEmbedding, rotate


FUSED_MAX_ROWS = 32


class LlamaModel(nn.Module):
    def __init__(self, cfg, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.cfg = cfg
        self.hidden = cfg.hidden_size
        self.num_layers = cfg.num_hidden_layers
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or self.hidden // self.num_heads
        self.eps = cfg.rms_norm_eps
        self.vocab_size = cfg.vocab_size
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        qkv_bias = bool(getattr(cfg, "attention_bias", False)) or cfg.model_type == "qwen2"
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        inter = cfg.intermediate_size
        self.inter = inter
        kw = dict(dtype=dtype, device=device)

        def p(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, **kw), requires_grad=False)

        self.embed = p(self.vocab_size, self.hidden)
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
        self.lm_head = self.embed if self.tied else p(self.vocab_size, self.hidden)
        scaling = getattr(cfg, "rope_scaling", None)
        theta = getattr(cfg, "rope_theta", None) or (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        if scaling is None:
            params = getattr(cfg, "rope_parameters", None) or {}
            if params.get("rope_type", "default") != "default":
                scaling = params
        self.rotary = RotaryEmbedding(self.head_dim, cfg.max_position_embeddings, theta, scaling, dtype, device)
        self.scale = self.head_dim ** -0.5

    def weight_targets(self) -> dict[str, torch.Tensor]:
        """HF tensor name -> the parameter (or the rows of a fused one) it fills. Checked to cover
        every element of every parameter exactly once, so a complete checkpoint leaves nothing unset."""
        q, kv, inter = self.q_size, self.kv_size, self.inter
        per_layer = {  # HF suffix: (our parameter, rows of it or None for all)
            "input_layernorm.weight": ("input_norm", None), "post_attention_layernorm.weight": ("post_norm", None),
            "self_attn.q_proj.weight": ("qkv", (0, q)), "self_attn.k_proj.weight": ("qkv", (q, q + kv)),
            "self_attn.v_proj.weight": ("qkv", (q + kv, q + 2 * kv)),
            "self_attn.q_proj.bias": ("qkv_bias", (0, q)), "self_attn.k_proj.bias": ("qkv_bias", (q, q + kv)),
            "self_attn.v_proj.bias": ("qkv_bias", (q + kv, q + 2 * kv)), "self_attn.o_proj.weight": ("o", None),
            "mlp.gate_proj.weight": ("gate_up", (0, inter)), "mlp.up_proj.weight": ("gate_up", (inter, 2 * inter)),
            "mlp.down_proj.weight": ("down", None)}
        targets = {"embed_tokens.weight": self.embed, "norm.weight": self.norm}
        if not self.tied:
            targets["lm_head.weight"] = self.lm_head
        for i, layer in enumerate(self.layers):
            for suffix, (attr, rows) in per_layer.items():
                if (param := getattr(layer, attr)) is not None:
                    targets[f"layers.{i}.{suffix}"] = param if rows is None else param[rows[0]:rows[1]]
        filled = {id(p): 0 for p in self.parameters()}
        for t in targets.values():
            base = t._base if t._base is not None else t
            filled[id(base)] += t.numel()
        assert all(filled[id(p)] == p.numel() for p in self.parameters()), "weight table misses a parameter"
        return targets

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into our (fused) parameters; refuse unknown, misshapen or missing ones."""
        targets, loaded = self.weight_targets(), set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name or (self.tied and name == "lm_head.weight"):
                continue
            dst = targets.get(name)
            if dst is None:
                raise ValueError(f"unexpected weight {name!r}")
            if dst.shape != tensor.shape:
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(tensor)
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

    def finalize(self, kernels=None) -> None:
        """After loading: wrap the projection weights in (CPU-prepacked) linear layers; `kernels`
        (layers/cpu_kernels.py, given for CPU models only) fuses each residual add with the RMSNorm
        after it and applies RoPE in place; the attention backend takes it from here too."""
        self.kernels = kernels
        for layer in self.layers:
            layer.qkv_lin = Linear(layer.qkv, layer.qkv_bias)
            layer.o_lin = Linear(layer.o)
            # Packed (CPU): gate and up as two GEMMs whose epilogues apply silu and the product, so
            # no [tokens, 2 * inter] tensor is written and read back by separate silu / mul passes.
            gate, up = Linear(layer.gate_up[:self.inter]), Linear(layer.gate_up[self.inter:])
            layer.gate_up_lin = None if gate.packed is not None and up.packed is not None else Linear(layer.gate_up)
            layer.gate_lin, layer.up_lin = (gate, up) if layer.gate_up_lin is None else (None, None)
            layer.down_lin = Linear(layer.down)
        self.lm_head_lin = Linear(self.lm_head)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                logits_indices: torch.Tensor) -> torch.Tensor:
        """input_ids/positions [T] -> logits [len(logits_indices), vocab] in fp32."""
        x = F.embedding(input_ids, self.embed)
        h, d, hk = self.num_heads, self.head_dim, self.num_kv_heads
        k_end = self.q_size + self.kv_size
        residual, delta = x, None  # residual += delta happens inside the next norm
        cos, sin = self.rotary.cos_sin(positions)
        for i, layer in enumerate(self.layers):
            x = self._add_norm(delta, residual, layer.input_norm)
            qkv = layer.qkv_lin(x)
            if self._fused(qkv):  # in place, bit-exact with rotate()
                self.kernels.rope_(qkv, h + hk, d, cos, sin)
                q = qkv[:, :self.q_size].view(-1, h, d)
                k = qkv[:, self.q_size:k_end].view(-1, hk, d)
            else:
                qk = rotate(qkv[:, :k_end].view(-1, h + hk, d), cos, sin)
                q, k = qk[:, :h], qk[:, h:]
            v = qkv[:, k_end:].view(-1, hk, d)
            o = attn.forward(q, k, v, i)
            x = self._add_norm(layer.o_lin(o.view(-1, h * d)), residual, layer.post_norm)
            if layer.gate_up_lin is None:
                delta = layer.down_lin(layer.up_lin.times(x, layer.gate_lin.silu(x)))
            else:
                gate, up = layer.gate_up_lin(x).chunk(2, dim=-1)
                delta = layer.down_lin(F.silu(gate) * up)
        residual.add_(delta)
        x = F.rms_norm(residual[logits_indices], (self.hidden,), self.norm, self.eps)
        return self.lm_head_lin(x).float()

    def _fused(self, x: torch.Tensor) -> bool:
        """The fused C++ norm and RoPE win at every batch size with AVX-512 (measured on 2048
        rows: 0.6 vs 5.4 ms for the norm, 0.6 vs 2.4 ms for RoPE); without it they go element by
        element and only pay on decode-sized batches, where per-op overhead dominates."""
        return self.kernels is not None and (self.kernels.vectorized or x.shape[0] <= FUSED_MAX_ROWS)

    def _add_norm(self, delta: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """residual += delta (in place), then RMSNorm(residual) * weight."""
        if self._fused(residual):
            return self.kernels.add_rms_norm(delta, residual, weight, self.eps)
        if delta is not None:
            residual.add_(delta)
        return F.rms_norm(residual, (self.hidden,), weight, self.eps)
