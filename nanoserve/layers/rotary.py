"""Rotary position embedding (HF's rotate-half layout), with Llama 3 and linear scaling."""
from __future__ import annotations

import math

import torch


def inv_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind in ("default", None):
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope scaling type {kind!r} is not supported (supported: default, linear, llama3)")


class RotaryEmbedding:
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None,
                 dtype: torch.dtype, device: torch.device) -> None:
        inv_freq = inv_frequencies(head_dim, theta, scaling).float()
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        # cos/sin of the half dimension; q*cos + rotate_half(q)*sin on the two halves.
        self.cos = freqs.cos().to(dtype=dtype, device=device)
        self.sin = freqs.sin().to(dtype=dtype, device=device)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-step tables [T, 1, D/2], computed once and shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] (Q and K heads together: one pass instead of two). layers/triton_fused.py's
    rope_kv rounds as this does (each product, then the sum): a change here is a change there."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
