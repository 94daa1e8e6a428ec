"""C++ CPU kernels (nanoserve/csrc/cpu_kernels.cpp), compiled on first use with
torch.utils.cpp_extension (gcc + ninja) and cached on disk (TORCH_EXTENSIONS_DIR) under a name
keyed by the source's bytes, this CPU's flags (the code is built with -march=native) and torch's
version.

`paged_decode_attention` attends one query token per sequence over its KV blocks in place: the
torch path must first gather every block into a contiguous tensor (an index_select that copies all
of a layer's context, then two small bmm calls that each cost more in call overhead than in math);
this kernel reads each K and V row once, two passes (scores, softmax, weighted V), accumulating in
fp32 (bf16: both passes' products in VDPBF16PS, the probabilities rounded to bf16 for the second). On the
embedded model at 8 sequences x ~300 tokens, one core, it alone took the decode step from ~57 to
~49 ms. `add_rms_norm`, `rope_` and `write_kv` each replace several small eager ops of a layer (a
decode step of a small model is as much per-op overhead as math); bench/latency.py
measures the whole step. `paged_prefill_attention` attends every prefill chunk of a step (fresh or
over cached context) flash-style on GEMM tiles (bf16 on AMX, `amx()`, or on AVX512_BF16 through
VDPBF16PS; fp32 elsewhere).
The experiment bench/prefill_rate.py (at c256b25) measured its FLOP rate against the linear layers' and PyTorch's SDPA.

`quant()` serves GGUF weights kept in their blocks: csrc/quant_kernels.cpp (Q4_0/Q4_1/Q8_0) and
csrc/kquant_kernels.cpp (Q4_K/Q6_K), two modules behind one router (`QuantKernels`).

Without a compiler, or with NANOSERVE_CPU_KERNELS=0, `load()` returns None and the torch path runs;
tests compare the two."""
from __future__ import annotations

import functools
import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nanoserve.layers.quant_linear import BLOCKS, PACKED, Q4_K, Q6_K

log = logging.getLogger("nanoserve")
SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "cpu_kernels.cpp"
QUANT_SOURCE = SOURCE.with_name("quant_kernels.cpp")
KQUANT_SOURCE = SOURCE.with_name("kquant_kernels.cpp")
K_TYPES = frozenset({Q4_K, Q6_K})  # served by the K-quant module, every other kept type by the blocks one


@dataclass(frozen=True)
class QuantKernels:
    """The quantized-weight kernels as one module: `quant_linear` / `quant_dequantize` / `quant_rows` /
    `quant_pack` go to the module of the weight's type (qtype, + PACKED for a packed matrix), as do
    `packs` / `int8_activations` given a type; any other attribute is the blocks module's."""
    blocks: Any
    kquants: Any | None  # None: its build failed, and K-quant weights are dequantized at load

    def _module(self, qtype: int) -> Any:
        if qtype & ~PACKED not in K_TYPES:
            return self.blocks
        if self.kquants is None:
            raise RuntimeError(f"quantized type {qtype} has no kernel (the K-quant kernels did not build)")
        return self.kquants

    def quant_linear(self, x: torch.Tensor, w: torch.Tensor, qtype: int, out: torch.Tensor) -> None:
        self._module(qtype).quant_linear(x, w, qtype, out)

    def glu(self, qtype: int) -> bool:
        """Whether `quant_linear_glu` (silu(gate) * up from one packed [gate; up] matrix) serves this type."""
        return bool(qtype & PACKED) and hasattr(self._module(qtype), "quant_linear_glu")

    def quant_linear_glu(self, x: torch.Tensor, w: torch.Tensor, qtype: int, out: torch.Tensor) -> None:
        self._module(qtype).quant_linear_glu(x, w, qtype, out)

    def entry_points(self, qtype: int) -> tuple[Any, Any]:
        """(quant_linear, quant_linear_glu) of the type's module as capsules, for the C++ decoder stack."""
        return self._module(qtype).entry_points()

    def quant_dequantize(self, w: torch.Tensor, qtype: int, out: torch.Tensor) -> None:
        self._module(qtype).quant_dequantize(w, qtype, out)

    def quant_rows(self, w: torch.Tensor, qtype: int, rows: int, ids: torch.Tensor, out: torch.Tensor) -> None:
        self._module(qtype).quant_rows(w, qtype, rows, ids, out)

    def quant_pack(self, w: torch.Tensor, qtype: int) -> torch.Tensor:
        return self._module(qtype).quant_pack(w, qtype)

    def packs(self, qtype: int | None = None) -> bool:
        """Whether matrices of `qtype` (default: the blocks module's types) have a packed layout here."""
        if (qtype or 0) & ~PACKED not in K_TYPES:
            return self.blocks.packs()
        return callable(getattr(self.kquants, "packs", None)) and self.kquants.packs()

    def int8_activations(self, qtype: int | None = None) -> bool:
        return self._module(qtype or 0).int8_activations()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("blocks", "kquants"):  # copy / pickle probing a half-built one
            raise AttributeError(name)
        return getattr(self.blocks, name)


@functools.cache
def load():
    """The compiled module, or None (no compiler, disabled, or the build failed: logged once)."""
    return _build("nanoserve_cpu", SOURCE)


@functools.cache
def quant() -> QuantKernels | None:
    """The GGUF quantized-weight kernels, or None like `load()` when the blocks module is unavailable."""
    blocks = _blocks()
    return None if blocks is None else QuantKernels(blocks, kquant())


@functools.cache
def _blocks():
    return _build("nanoserve_quant", QUANT_SOURCE)


@functools.cache
def kquant():
    """The K-quant kernels alone (csrc/kquant_kernels.cpp), or None like `load()`."""
    return _build("nanoserve_kquant", KQUANT_SOURCE)


def keeps(qtype: int) -> bool:
    """Whether a GGUF loader keeps tensors of this GGML type in blocks. Q4_0/Q4_1/Q8_0 are kept even
    without kernels (the model dequantizes them after loading, on any device); the K-quants only when
    their own module built, since nothing else computes on them. Asking about a K-quant builds (or
    finds) that module."""
    return qtype in BLOCKS and (qtype not in K_TYPES or kquant() is not None)


def _build(prefix: str, source: Path):
    if os.environ.get("NANOSERVE_CPU_KERNELS", "1") == "0":
        return None
    # NANOSERVE_CPU_MARCH (e.g. haswell) builds another instruction set's code path on this machine,
    # to test the AVX2 / scalar fallbacks
    march = os.environ.get("NANOSERVE_CPU_MARCH", "native")
    try:
        from torch.utils.cpp_extension import load as build
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
        headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))  # what the sources include
        key = hashlib.sha256(source.read_bytes() + headers +
                             (flags + torch.__version__ + march.replace("native", "")).encode()).hexdigest()[:12]
        wide = ["-mprefer-vector-width=512"] if march == "native" else []
        return build(f"{prefix}_{key}", sources=[str(source)],
                     extra_cflags=["-O3", f"-march={march}", *wide, "-ffp-contract=off",
                                   "-fopenmp", "-fopenmp-simd"],
                     extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # noqa: BLE001 - any build problem means: use the torch path
        log.warning("CPU kernels (%s) unavailable, using the torch path (%s: %s)", source.name, type(e).__name__,
                    str(e).strip().splitlines()[-1] if str(e).strip() else "")
        return None


def build_all() -> None:
    """Build (or find) every module before anything uses them: `make test` runs this first, since its two
    pytest workers would otherwise both wait on one ~35 s build at the start of the suite."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(3) as pool:  # each build is a ninja subprocess: they run side by side
        built = list(pool.map(lambda f: f(), (load, _blocks, kquant)))
    print("CPU kernels:", ", ".join(m.__name__ if m else "unavailable (torch path)" for m in built))
