"""C++ CPU kernels (nanoserve/kernels/csrc/, one extension module), built once per install for this CPU
(nanoserve/kernels/build.py: `make install` and the Docker image build them; a start that finds none builds
them first, announced).

`paged_decode_attention` attends one query token per sequence over its KV blocks in place: the
torch path must first gather every block into a contiguous tensor (an index_select that copies all
of a layer's context, then two small bmm calls that each cost more in call overhead than in math);
this kernel reads each K and V row once, two passes (scores, softmax, weighted V), accumulating in
fp32 (bf16: both passes' products in VDPBF16PS, the probabilities rounded to bf16 for the second). On the
embedded model at 8 sequences x ~300 tokens, one core, it alone took the decode step from ~57 to
~49 ms. `add_rms_norm`, `rope_` and `write_kv` each replace several small eager ops of a layer (a
decode step of a small model is as much per-op overhead as math); bench/latency.py
measures the whole step. `paged_prefill_attention` attends every prefill chunk of a step (fresh or
over cached context) flash-style on GEMM tiles (bf16 on AMX, `gemm_amx()`, or on AVX512_BF16 through
VDPBF16PS; fp32 elsewhere).

`quant()` serves GGUF weights kept in their blocks: csrc/quant_blocks.cpp and quant_packed.cpp
(Q4_0/Q4_1/Q5_0/Q8_0) and csrc/kquants.cpp (Q4_K/Q6_K), behind one router (`QuantKernels`).

Without a compiler or a prebuilt build, or with NANOSERVE_CPU_KERNELS=0, `load()` returns None and the
torch path runs; tests compare the two."""
from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nanoserve.kernels import build
from nanoserve.layers.quant_linear import BLOCKS, PACKED, Q4_K, Q6_K

log = logging.getLogger("nanoserve")
# One module, its sources compiled side by side: one translation unit with pybind11's headers (module.cpp),
# the kernels' with ATen's core alone (measured here: 2 s of headers a compile, against 14 s with both)
MODULE = build.Module("nanoserve_cpu", tuple(sorted(Path(__file__).resolve().parent.glob("csrc/*.cpp"))))
K_TYPES = frozenset({Q4_K, Q6_K})  # the K-quant kernels' types; every other kept type is the blocks kernels'


@dataclass(frozen=True)
class QuantKernels:
    """The quantized-weight kernels: `quant_linear` / `quant_dequantize` / `quant_rows` / `quant_pack` go to
    the kernels of the weight's type (qtype, + PACKED for a packed matrix), as do `packs` / `int8_activations`
    given a type; any other attribute is the blocks kernels'. Both are the one module's, unless `kquants` is
    None: then K-quant weights are dequantized at load."""
    blocks: Any
    kquants: Any | None

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

    def quant_dequantize(self, w: torch.Tensor, qtype: int, out: torch.Tensor) -> None:
        self._module(qtype).quant_dequantize(w, qtype, out)

    def quant_rows(self, w: torch.Tensor, qtype: int, rows: int, ids: torch.Tensor,
                   out: torch.Tensor) -> None:
        self._module(qtype).quant_rows(w, qtype, rows, ids, out)

    def quant_pack(self, w: torch.Tensor, qtype: int) -> torch.Tensor:
        return self._module(qtype).quant_pack(w, qtype)

    def packs(self, qtype: int | None = None) -> bool:
        """Whether matrices of `qtype` (default: the blocks module's types) have a packed layout here."""
        if (qtype or 0) & ~PACKED not in K_TYPES:
            return self.blocks.packs()
        return callable(getattr(self.kquants, "packs", None)) and self.kquants.packs()

    def gemm_prefill(self) -> bool:
        """Whether packed matrices leave prefill-sized steps to the dequantize + GEMM path (AMX tiles)."""
        return gemm_amx(self.blocks)

    def int8_activations(self, qtype: int | None = None) -> bool:
        return self._module(qtype or 0).int8_activations()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("blocks", "kquants"):  # copy / pickle probing a half-built one
            raise AttributeError(name)
        return getattr(self.blocks, name)


@functools.cache
def load():
    """The compiled module, or None (no compiler, disabled, or the build failed: logged once)."""
    return _build(MODULE)


def built():
    """`load()` where this install has built the module for this CPU, else None, quietly and without
    building it: a CUDA engine builds no CPU kernels, but uses the ones `make install` built for its
    prompt hashing (without them, Python's hashlib hashes)."""
    if os.environ.get("NANOSERVE_CPU_KERNELS", "1") == "0":
        return None
    try:
        spot = build.find(MODULE, _target())
        ready = (spot is not None and spot[2].requires <= build.cpu_flags()
                 and (spot[0] / build.MANIFEST).exists())
    except Exception:  # noqa: BLE001 - nothing usable here: the Python path runs
        return None
    return load() if ready else None


@functools.cache
def quant() -> QuantKernels | None:
    """The GGUF quantized-weight kernels, or None like `load()`."""
    module = load()
    return None if module is None else QuantKernels(module, kquant())


def kquant():
    """The module that serves K-quant weights (the one module), or None like `load()`."""
    return load()


def keeps(qtype: int) -> bool:
    """Whether a GGUF loader keeps tensors of this GGML type in blocks. Q4_0/Q4_1/Q5_0/Q8_0 are kept even
    without kernels (the model dequantizes them after loading, on any device); the K-quants only when
    their own module built, since nothing else computes on them. Asking about a K-quant builds (or
    finds) that module."""
    return qtype in BLOCKS and (qtype not in K_TYPES or kquant() is not None)


def _target() -> str:
    # NANOSERVE_CPU_MARCH (e.g. haswell) builds another instruction set's code path on this machine,
    # to test the AVX2 / scalar fallbacks
    return os.environ.get("NANOSERVE_CPU_MARCH", "native")


def _build(spec: build.Module):
    if os.environ.get("NANOSERVE_CPU_KERNELS", "1") == "0":
        return None
    try:
        loaded = build.load_or_build(spec, _target())
    except Exception as e:  # noqa: BLE001 - any build problem means: use the torch path
        log.warning("CPU kernels (%s) unavailable, using the torch path (%s: %s)", spec.prefix,
                    type(e).__name__, str(e).strip().splitlines()[-1] if str(e).strip() else "")
        return None
    if loaded is None:
        log.warning("CPU kernels (%s) unavailable: no compiler and no prebuilt build this CPU runs; using "
                    "the torch path", spec.prefix)
        return None
    module, target = loaded
    module.build_target = target  # which build a start runs, for its log (describe)
    return module


def prepare() -> None:
    """Builds the module where this install lacks it for this CPU, announced by one line before and one
    after; a start calls it before the model loads, so a build is never a silent wait inside a step."""
    if os.environ.get("NANOSERVE_CPU_KERNELS", "1") == "0":
        return
    try:
        if not build.missing(MODULE, _target()):
            return
    except Exception:  # noqa: BLE001 - loading reports the same problem
        return
    root = build.kernels_dir()
    target = build.target_for(_target(), build.compiler() or "c++")
    log.info("building CPU kernels for %s: once per install, about %.0f s", target.describe(),
             build.estimate_seconds(root) or build.DEFAULT_SECONDS)
    t0 = time.monotonic()
    try:
        build.ensure_built(MODULE, _target(), root, announce=False)
    except Exception as e:  # noqa: BLE001 - the torch path runs, logged when the module loads
        log.info("CPU kernels failed to build (%s)", type(e).__name__)
        return
    log.info("built CPU kernels in %.1f s into %s", time.monotonic() - t0, root)


def gemm_amx(module: Any) -> bool:
    """Whether prefill-sized GEMMs take AMX tiles here: the kernels' answer (oneDNN can pack bf16 for
    AMX), unless $NANOSERVE_CPU_AMX=0/1 decides, so that any CPU runs the decisions made for AMX (packed
    weights leave large steps to dequantize + GEMM; bf16 GEMMs split by rows) and CI covers them. The
    prefill attention's tiles follow the hardware alone: its AMX and VDPBF16PS paths give other bits."""
    forced = os.environ.get("NANOSERVE_CPU_AMX")
    if forced in ("0", "1"):
        return forced == "1"
    return module is not None and bool(module.amx())


def describe() -> str:
    """The CPU kernels a start chose, for its log: the build loaded and the paths it takes on this CPU."""
    kernels, quant_kernels = load(), quant()
    if kernels is None:
        return "torch fallback (no C++ build)"
    bf16_build = quant_kernels is not None and "bf16" in quant_kernels.isa()  # built with AVX512_BF16
    tiles = "AMX" if kernels.amx() else "VDPBF16PS" if bf16_build else "fp32"
    text = (f"C++ {kernels.build_target} build; bf16 prefill attention on {tiles} tiles; "
            f"prefill GEMMs {'on AMX tiles' if gemm_amx(kernels) else 'by oneDNN'}")
    if quant_kernels is None:
        return text + "; GGUF weights dequantized (no quantized kernels)"
    activations = "int8 (VNNI)" if quant_kernels.int8_activations() else "fp32"
    layout = "packed" if quant_kernels.packs() else "block"
    kquants = "yes" if quant_kernels.kquants is not None else "no"
    return (f"{text}; GGUF kept in blocks: {quant_kernels.isa()}, {layout} layout, {activations} "
            f"activations, K-quants {kquants}")
