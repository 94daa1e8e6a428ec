"""What the model code reads of a checkpoint's config.json, read without transformers: importing its
config classes costs a process ~80 MB of resident memory and ~1.5 s (bench/latency.py --load-stages)
for a dozen numbers. A missing key takes transformers' default for that model_type (tests/test_model_files.py
compares them), so a config.json written with transformers' `use_diff` reads the same here as there."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanoserve.sampling_params import InvalidRequest

SUPPORTED_ARCHS = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                   "Gemma3ForCausalLM"}

# transformers' defaults (LlamaConfig(), MistralConfig(), Qwen2Config(), Qwen3Config(), Gemma3TextConfig())
# for the keys read here
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, max_position_embeddings=2048, eos_token_id=2),
    "mistral": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096 * 32,
                    eos_token_id=2, sliding_window=4096),
    "qwen2": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, max_position_embeddings=32768, eos_token_id=None),
    "qwen3": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, head_dim=128, max_position_embeddings=32768, eos_token_id=None),
    "gemma3_text": dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                        max_position_embeddings=131072, eos_token_id=1, rope_theta=1e6, sliding_window=4096,
                        query_pre_attn_scalar=256, hidden_activation="gelu_pytorch_tanh",
                        tie_word_embeddings=True),
}
GEMMA_LOCAL_THETA = 10000.0  # Gemma 3's windowed layers' RoPE base (transformers' rope_local_base_freq)
GEMMA_WINDOW_PATTERN = 6  # every 6th Gemma 3 layer is global unless config.json lists layer_types


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    architectures: tuple[str, ...]
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None          # rope_type (or legacy `type`) and its parameters; None: plain RoPE
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_id: int | list[int] | None
    hidden_act: str = "silu"                      # the MLP's gate activation: silu or gelu_pytorch_tanh
    query_pre_attn_scalar: float | None = None    # attention scale 1/sqrt(this); None: 1/sqrt(head_dim)
    layer_windows: tuple[int, ...] = ()           # per layer: sliding window in tokens, 0 = global
    rope_local_theta: float | None = None         # the windowed layers' RoPE base where it differs (Gemma 3)

    @property
    def qk_norm(self) -> bool:
        """Q and K each RMS-normed per head before RoPE (Qwen3, Gemma 3)."""
        return self.model_type in ("qwen3", "gemma3_text")

    @property
    def local_rope_layers(self) -> tuple[bool, ...]:
        """Per layer: whether its RoPE is the windowed layers' own base (Gemma 3's windowed layers)."""
        if self.rope_local_theta is None or not self.layer_windows:
            return (False,) * self.num_hidden_layers
        return tuple(w > 0 for w in self.layer_windows)

    @property
    def llama_layer(self) -> bool:
        """Whether the layers are Llama's own (what the fused CUDA loop runs): no q/k norms, no Gemma norms,
        SiLU."""
        return not (self.qk_norm or self.gemma) and self.hidden_act == "silu"

    @property
    def gemma(self) -> bool:
        """Gemma 3's layer: norms after attention and MLP too, (1 + w) norm weights, the embedding scaled
        by sqrt(hidden)."""
        return self.model_type == "gemma3_text"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """From config.json's keys: the legacy `rope_theta` / `rope_scaling` pair or transformers 5's
        `rope_parameters` (which holds both). Raises InvalidRequest for an architecture we do not run."""
        kind = d.get("model_type")
        archs = tuple(d.get("architectures") or ())
        if kind not in DEFAULTS or (archs and not set(archs) & SUPPORTED_ARCHS):
            raise InvalidRequest(f"architecture {list(archs) or kind} is not supported "
                                 f"(supported: {sorted(SUPPORTED_ARCHS)})", param="model")
        # an explicit null means "derive it" (kv heads, head_dim) except for eos_token_id, where it means none
        get = {**DEFAULTS[kind], **{k: v for k, v in d.items() if v is not None}}.get
        heads, hidden = get("num_attention_heads"), get("hidden_size")
        # as transformers 5 converts them: a legacy rope_scaling wins over rope_parameters, and the base comes
        # from the winner, else the top-level rope_theta
        params = d.get("rope_scaling") or d.get("rope_parameters") or {}
        local = params.get("sliding_attention") or {}  # transformers 5's Gemma 3: a dict per layer type
        params = params.get("full_attention", params)
        scaling = params if params.get("rope_type", params.get("type", "default")) != "default" else None
        gemma = kind == "gemma3_text"
        return cls(model_type=kind, architectures=archs, vocab_size=get("vocab_size"), hidden_size=hidden,
                   intermediate_size=get("intermediate_size"), num_hidden_layers=get("num_hidden_layers"),
                   num_attention_heads=heads, num_key_value_heads=get("num_key_value_heads", heads),
                   head_dim=get("head_dim", hidden // heads),
                   max_position_embeddings=get("max_position_embeddings"),
                   rms_norm_eps=get("rms_norm_eps", 1e-6),
                   rope_theta=float(params.get("rope_theta") or get("rope_theta") or 10000.0),
                   rope_scaling=scaling, tie_word_embeddings=bool(get("tie_word_embeddings", False)),
                   attention_bias=bool(get("attention_bias", False)),
                   eos_token_id=d["eos_token_id"] if "eos_token_id" in d else DEFAULTS[kind]["eos_token_id"],
                   hidden_act=get("hidden_activation") or get("hidden_act", "silu"),
                   query_pre_attn_scalar=get("query_pre_attn_scalar"),
                   # an explicit null (Mistral v0.2 on) is no window, not the default, as for eos_token_id
                   layer_windows=layer_windows(kind, get, get("num_hidden_layers"), (
                       d["sliding_window"] if "sliding_window" in d else get("sliding_window")) or 0),
                   rope_local_theta=float(local.get("rope_theta") or get("rope_local_base_freq")
                                          or GEMMA_LOCAL_THETA) if gemma else None)


def layer_windows(kind: str, get, num_layers: int, window: int) -> tuple[int, ...]:
    """Each layer's sliding window (0: global), as transformers masks them: `layer_types` where config.json
    lists them, else Gemma 3's pattern (every `sliding_window_pattern`-th layer global), Mistral's window on
    every layer, Qwen's on the layers from `max_window_layers` on where `use_sliding_window`. () where no
    layer is windowed."""
    if types := get("layer_types"):
        if len(types) != num_layers:
            raise InvalidRequest(f"config.json lists {len(types)} layer_types for {num_layers} layers",
                                 param="model")
        windows = [window if t == "sliding_attention" else 0 for t in types]
    elif kind == "gemma3_text":
        every = get("sliding_window_pattern") or get("_sliding_window_pattern") or GEMMA_WINDOW_PATTERN
        windows = [0 if (i + 1) % every == 0 else window for i in range(num_layers)]
    elif kind == "mistral":
        windows = [window] * num_layers
    elif kind in ("qwen2", "qwen3") and get("use_sliding_window"):
        first = get("max_window_layers", 28)  # transformers' default
        windows = [window if i >= first else 0 for i in range(num_layers)]
    else:
        windows = []
    return tuple(windows) if any(windows) else ()


def read_model_config(folder: Path) -> ModelConfig:
    try:
        d = json.loads((folder / "config.json").read_text())
    except FileNotFoundError:
        raise InvalidRequest(f"{folder} has no config.json", param="model") from None
    except ValueError as e:
        raise InvalidRequest(f"{folder / 'config.json'} is not valid JSON: {e}", param="model") from None
    return ModelConfig.from_dict(d)
