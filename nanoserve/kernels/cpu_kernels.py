"""C++ CPU kernels (nanoserve/kernels/csrc/cpu_kernels.cpp), built once per install for this CPU (nanoserve/kernels/
build.py: `make install` and the Docker image build them; a start that finds none builds them first, announced).

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

`quant()` serves GGUF weights kept in their blocks: csrc/quant_kernels.cpp (Q4_0/Q4_1/Q8_0) and
csrc/kquant_kernels.cpp (Q4_K/Q6_K), two modules behind one router (`QuantKernels`).

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
SOURCE = Path(__file__).resolve().parent / "csrc" / "cpu_kernels.cpp"
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


def _target() -> str:
    # NANOSERVE_CPU_MARCH (e.g. haswell) builds another instruction set's code path on this machine,
    # to test the AVX2 / scalar fallbacks
    return os.environ.get("NANOSERVE_CPU_MARCH", "native")


MODULES = {"nanoserve_cpu": SOURCE, "nanoserve_quant": QUANT_SOURCE, "nanoserve_kquant": KQUANT_SOURCE}


def _build(prefix: str, source: Path):
    if os.environ.get("NANOSERVE_CPU_KERNELS", "1") == "0":
        return None
    try:
        loaded = build.load_or_build(build.Module(prefix, source), _target())
    except Exception as e:  # noqa: BLE001 - any build problem means: use the torch path
        log.warning("CPU kernels (%s) unavailable, using the torch path (%s: %s)", source.name, type(e).__name__,
                    str(e).strip().splitlines()[-1] if str(e).strip() else "")
        return None
    if loaded is None:
        log.warning("CPU kernels (%s) unavailable: no compiler and no prebuilt build this CPU runs; using the "
                    "torch path", source.name)
        return None
    module, target = loaded
    module.build_target = target  # which build a start runs, for its log (describe)
    return module


def prepare() -> None:
    """Builds every module this install lacks for this CPU, side by side, announced by one line before and
    one after; a start calls it before the model loads, so a build is never a silent wait inside a step."""
    if os.environ.get("NANOSERVE_CPU_KERNELS", "1") == "0":
        return
    try:
        todo = [build.Module(p, src) for p, src in MODULES.items() if build.missing(build.Module(p, src), _target())]
    except Exception:  # noqa: BLE001 - loading reports the same problem, once per module
        return
    if not todo:
        return
    root = build.kernels_dir()
    target = build.target_for(_target(), build.compiler() or "c++")
    log.info("building CPU kernels for %s: once per install, about %.0f s", target.describe(),
             build.estimate_seconds(root) or build.DEFAULT_SECONDS)
    t0 = time.monotonic()
    from concurrent.futures import ThreadPoolExecutor

    def one(module: build.Module) -> str:
        try:
            build.ensure_built(module, _target(), root, announce=False)
            return module.prefix
        except Exception as e:  # noqa: BLE001 - that module falls back to torch, logged when it loads
            return f"{module.prefix} failed ({type(e).__name__})"
    with ThreadPoolExecutor(len(todo)) as pool:  # each build is a ninja subprocess: they run side by side
        done = list(pool.map(one, todo))
    log.info("built CPU kernels in %.1f s: %s, into %s", time.monotonic() - t0, ", ".join(done), root)


def gemm_amx(module: Any) -> bool:
    """Whether prefill-sized GEMMs take AMX tiles here: the kernels' answer (oneDNN can pack bf16 for
    AMX), unless $NANOSERVE_CPU_AMX=0/1 decides, so that any CPU runs the decisions made for AMX (packed
    weights leave large steps to dequantize + GEMM; bf16 GEMMs split by rows) and CI covers them. The
    prefill attention's tiles follow the hardware alone: its AMX and VDPBF16PS paths give other bits."""
    forced = os.environ.get("NANOSERVE_CPU_AMX")
    if forced in ("0", "1"):
        return forced == "1"
    return module is not None and bool(module.amx() if hasattr(module, "amx") else module.gemm_prefill())


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
    return (f"{text}; GGUF kept in blocks: {quant_kernels.isa()}, {'packed' if quant_kernels.packs() else 'block'} "
            f"layout, {activations} activations, K-quants {'yes' if quant_kernels.kquants is not None else 'no'}")
