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

SUPPORTED_ARCHS = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"}

# transformers' defaults (LlamaConfig(), MistralConfig(), Qwen2Config()) for the keys read here
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, max_position_embeddings=2048, eos_token_id=2),
    "mistral": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096 * 32,
                    eos_token_id=2),
    "qwen2": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, max_position_embeddings=32768, eos_token_id=None),
}


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

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """From config.json's keys: the legacy `rope_theta` / `rope_scaling` pair or transformers 5's
        `rope_parameters` (which holds both). Raises InvalidRequest for an architecture we do not run."""
        kind = d.get("model_type")
        archs = tuple(d.get("architectures") or ())
        if kind not in DEFAULTS:
            raise InvalidRequest(f"architecture {list(archs) or kind} is not supported "
                                 f"(supported: {sorted(SUPPORTED_ARCHS)})", param="model")
        # an explicit null means "derive it" (kv heads, head_dim) except for eos_token_id, where it means none
        get = {**DEFAULTS[kind], **{k: v for k, v in d.items() if v is not None}}.get
        heads, hidden = get("num_attention_heads"), get("hidden_size")
        # as transformers 5 converts them: a legacy rope_scaling wins over rope_parameters, and the base comes
        # from the winner, else the top-level rope_theta
        params = d.get("rope_scaling") or d.get("rope_parameters") or {}
        scaling = params if params.get("rope_type", params.get("type", "default")) != "default" else None
        return cls(model_type=kind, architectures=archs, vocab_size=get("vocab_size"), hidden_size=hidden,
                   intermediate_size=get("intermediate_size"), num_hidden_layers=get("num_hidden_layers"),
                   num_attention_heads=heads, num_key_value_heads=get("num_key_value_heads", heads),
                   head_dim=get("head_dim", hidden // heads),
                   max_position_embeddings=get("max_position_embeddings"),
                   rms_norm_eps=get("rms_norm_eps", 1e-6),
                   rope_theta=float(params.get("rope_theta") or get("rope_theta") or 10000.0),
                   rope_scaling=scaling, tie_word_embeddings=bool(get("tie_word_embeddings", False)),
                   attention_bias=bool(get("attention_bias", False)),
                   eos_token_id=d["eos_token_id"] if "eos_token_id" in d else DEFAULTS[kind]["eos_token_id"])


def read_model_config(folder: Path) -> ModelConfig:
    try:
        d = json.loads((folder / "config.json").read_text())
    except FileNotFoundError:
        raise InvalidRequest(f"{folder} has no config.json", param="model") from None
    except ValueError as e:
        raise InvalidRequest(f"{folder / 'config.json'} is not valid JSON: {e}", param="model") from None
    return ModelConfig.from_dict(d)
