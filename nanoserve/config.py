"""Engine configuration: one dataclass, validated once, passed down explicitly."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass
class EngineConfig:
    model: str | None = None          # None = embedded default (SmolLM2-135M-Instruct)
    tokenizer: str | None = None      # defaults to the model's own
    dtype: str = "auto"               # auto | float32 | bfloat16 | float16
    device: str = "auto"              # auto | cpu | cuda
    block_size: int = 0               # 0 = backend default
    kv_cache_gb: float | None = None  # device KV budget; None = pick from free memory
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None  # exact device block count (tests); overrides kv_cache_gb
    host_cache_gb: float = 0.0        # second tier; 0 = off
    host_offload_watermark: int = 0   # override of the cleaner's target (blocks); 0 = from demand
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None = model's own, capped by KV capacity
    enable_prefix_caching: bool = True
    chat_template: str | None = None  # path to a Jinja file overriding the model's template
    seed: int = 0
    attention_backend: str = "auto"   # auto | flash | torch; auto = flash iff flash_attn imports and device is CUDA
    flash_module: object | None = None  # Python API only: stand-in for the flash_attn module (tests: FlashReference)
    enforce_eager: bool = False       # no CUDA graphs for decode steps
    load_format: str = "auto"         # auto | dummy (random weights, as vLLM's --load-format dummy: benchmarks)

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto|float32|bfloat16|float16, got {self.dtype!r}")
        if self.attention_backend not in ("auto", "flash", "torch"):
            raise ValueError(f"attention_backend must be auto|flash|torch, got {self.attention_backend!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto|dummy, got {self.load_format!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto|cpu|cuda, got {self.device!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.host_cache_gb < 0:
            raise ValueError("host_cache_gb must be >= 0")
        if self.host_cache_gb and not self.enable_prefix_caching:
            raise ValueError("--host-cache-gb needs prefix caching; drop --no-prefix-caching")

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda was asked for but torch sees no CUDA device")
        return torch.device(self.device)

    def resolved_dtype(self, device: torch.device) -> torch.dtype:
        """An explicit dtype wins; `auto` honours $NANOSERVE_DTYPE (so a whole test suite or a
        deployment can force one), else picks by hardware."""
        dtype = self.dtype if self.dtype != "auto" else os.environ.get("NANOSERVE_DTYPE", "auto")
        if dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"$NANOSERVE_DTYPE must be auto|float32|bfloat16|float16, got {dtype!r}")
        if dtype != "auto":
            return getattr(torch, dtype)
        if device.type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32


def cpu_has_fast_bf16() -> bool:
    """AVX-512 BF16 or AMX makes bf16 matmuls faster than fp32 on CPU; without them bf16 is emulated."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return any(f in flags for f in (" avx512_bf16", " amx_bf16"))
