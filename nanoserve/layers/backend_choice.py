"""`--attention-backend` and `--block-size` -> (backend class, flash module or None, block size).

auto: flash-attn when it imports and a test call runs (CUDA only), else the Triton paged backend
on CUDA, else the torch backend. The flash backend is not tied to CUDA: any module with
flash-attn 2.8's API works (tests run it on CPU through the stand-in tests/flash_ref.py,
selected by name). The Triton
backend runs on CUDA, and on CPU only under TRITON_INTERPRET=1 (how CI tests its kernels)."""
from __future__ import annotations

import os

import torch

from nanoserve.layers.attention import AttentionBackend, TorchAttention
from nanoserve.layers.flash_attention import (FLASH_PAGE_MULTIPLE, FlashAttention, flash_works,
                                              import_flash_attn)

CHOICES = ("auto", "flash", "triton", "torch")


def triton_usable(device: torch.device) -> str | None:
    """None if the Triton backend can run on `device`, else why not."""
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return "the Triton backend runs on CUDA (on CPU only under TRITON_INTERPRET=1, for tests)"
    if device.type not in ("cpu", "cuda"):
        return f"the Triton backend does not run on {device.type}"
    try:
        import triton  # noqa: F401
    except Exception as e:  # noqa: BLE001 - a broken install is "not available"
        return f"triton does not import ({type(e).__name__}: {e})"
    return None


def resolve_attention(choice: str, device: torch.device, dtype: torch.dtype, block_size: int,
                      flash_name: str = "flash_attn") -> tuple[type[AttentionBackend], object | None, int]:
    """Block size 0 = the backend's default: 256 with flash (its paged kernels need a multiple of
    256), 16 with Triton (fine prefix-cache granularity), 16 with torch on CPU, 256 on CUDA."""
    if choice not in CHOICES:
        raise ValueError(f"attention backend must be {'|'.join(CHOICES)}, got {choice!r}")
    module, why = None, None
    if choice in ("auto", "flash"):
        module, why = import_flash_attn(flash_name)
    if choice == "auto" and module is not None and device.type == "cuda":
        why = flash_works(module, device)
        module = module if why is None else None
    if choice == "flash" or (choice == "auto" and module is not None and device.type == "cuda"):
        return FlashAttention, _check_flash(module, why, dtype, block_size), block_size or FLASH_PAGE_MULTIPLE
    if choice == "triton" or (choice == "auto" and device.type == "cuda" and triton_usable(device) is None):
        why = triton_usable(device)
        if why is not None:
            raise ValueError(f"--attention-backend triton: {why}")
        from nanoserve.layers.triton_attention import TritonAttention
        return TritonAttention, None, block_size or 16
    return TorchAttention, None, block_size or (256 if device.type == "cuda" else 16)


def _check_flash(module, why: str | None, dtype: torch.dtype, block_size: int):
    if module is None:
        raise ValueError(f"--attention-backend flash needs the flash-attn package (version 2.8); it is not "
                         f"usable here ({why}). Use --attention-backend triton or torch")
    if dtype == torch.float32 and not getattr(module, "supports_fp32", False):
        raise ValueError("flash-attn computes in fp16/bf16 only: use --dtype bfloat16 (or float16) with "
                         "--attention-backend flash, or --attention-backend triton/torch for fp32")
    if block_size % FLASH_PAGE_MULTIPLE:
        raise ValueError(f"--block-size {block_size} does not work with the flash attention backend: "
                         f"flash-attn 2's paged KV kernels need a multiple of {FLASH_PAGE_MULTIPLE} "
                         f"(leave --block-size at 0 for {FLASH_PAGE_MULTIPLE})")
    return module
