"""C++ extension modules built once per install, loaded by every later start.

A build lives in its own directory of this install (`kernels_dir()`: inside the venv, never a directory
that another install shares), named by a key over the sources and headers, the compiler flags, the
instruction-set features the compiler may use, torch's version and Python's ABI. Its manifest
(`build.json`) records the features a CPU needs to run it, so a CPU that lacks one never loads it.

A start that finds no build of its own target builds one: under an `fcntl.flock` (the OS releases it
when its holder dies, so a killed build never blocks the next start), in a temporary directory renamed
into place when complete (a half-written build is never found). Without a compiler it loads the
richest prebuilt baseline this CPU can run (the Docker image ships them), else returns None.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Iterator

log = logging.getLogger("nanoserve")

# Instruction-set flags as /proc/cpuinfo spells them (x86): what a build's compiler macros are read as
ISA_FLAGS = frozenset(
    "sse sse2 pni ssse3 sse4_1 sse4_2 sse4a avx avx2 fma f16c bmi1 bmi2 abm popcnt movbe aes pclmulqdq "
    "vpclmulqdq vaes gfni sha_ni adx rdrand rdseed xsave xsaveopt xsavec xsaves clflushopt clwb fsgsbase "
    "rdpid avx512f avx512bw avx512cd avx512dq avx512vl avx512ifma avx512vbmi avx512_vbmi2 avx512_vnni "
    "avx512_bitalg avx512_vpopcntdq avx512_bf16 avx512_fp16 avx_vnni amx_tile amx_bf16 amx_int8".split())
# compiler macros spelled otherwise in cpuinfo
MACRO_FLAGS = {"sse3": "pni", "bmi": "bmi1", "lzcnt": "abm", "pclmul": "pclmulqdq", "sha": "sha_ni",
               "rdrnd": "rdrand"}
# Named targets the Docker image prebuilds, for machines without a compiler (DESIGN decision 11)
BASELINES = {
    "x86-64-v3": ("-march=x86-64-v3",),  # AVX2 + FMA + F16C
    "x86-64-v4": ("-march=x86-64-v4", "-mprefer-vector-width=512"),  # + AVX-512 F/BW/CD/DQ/VL
    "x86-64-v4-bf16": ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mgfni",
                       "-mprefer-vector-width=512"),
}
COMMON_CFLAGS = ("-O3", "-ffp-contract=off", "-fopenmp", "-fopenmp-simd")
MANIFEST = "build.json"
# the features a kernel path depends on: what a build's log line names
SHOWN_FLAGS = frozenset("avx2 fma f16c avx512f avx512bw avx512_vnni avx512_bf16 avx512_fp16 avx_vnni "
                        "amx_tile amx_bf16 amx_int8".split())
DEFAULT_SECONDS = 60  # a first build's announced duration, before this install has timed one (2 cores)


@dataclass(frozen=True)
class Target:
    """What a build is compiled for: its gcc flags and the features a CPU needs to run it."""
    name: str  # "native", a BASELINES name, or a -march value ($NANOSERVE_CPU_MARCH)
    cflags: tuple[str, ...]
    requires: frozenset[str]

    def describe(self) -> str:
        shown = sorted(self.requires & SHOWN_FLAGS)
        return f"{self.name} ({' '.join(shown) or 'no vector extensions'})"


@dataclass(frozen=True)
class Module:
    """One extension module: its name prefix and the C++ sources compiled into it (ninja compiles them side
    by side); its key covers them and every header beside them (what they include)."""
    prefix: str
    sources: tuple[Path, ...]

    def key_files(self) -> list[Path]:
        folders = sorted({source.parent for source in self.sources})
        return [*self.sources, *sorted(header for folder in folders for header in folder.glob("*.h"))]


def cpu_flags() -> frozenset[str]:
    """This CPU's instruction-set flags (empty where /proc/cpuinfo cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split()) & ISA_FLAGS


def compiler() -> str | None:
    cxx = os.environ.get("CXX", "c++")
    return cxx if shutil.which(cxx) and shutil.which("ninja") else None


@functools.cache
def target_for(name: str, cxx: str) -> Target:
    """The target `name` names: native (this CPU, as the compiler sees it), a baseline, or a -march value."""
    wide = ("-mprefer-vector-width=512",) if name == "native" else ()
    cflags = BASELINES.get(name) or (f"-march={name}", *wide)
    out = subprocess.run([cxx, *cflags, "-dM", "-E", "-x", "c++", os.devnull], capture_output=True, text=True,
                         check=True).stdout
    macros = {m.lower() for m in re.findall(r"#define __([A-Z0-9_]+)__ 1$", out, re.M)}
    by_spelling = {f.replace("_", ""): f for f in ISA_FLAGS}
    requires = {MACRO_FLAGS.get(m) or by_spelling.get(m.replace("_", "")) for m in macros} - {None}
    return Target(name, tuple(cflags), frozenset(requires))


@functools.cache
def _version(cxx: str) -> str:
    return subprocess.run([cxx, "-dumpfullversion"], capture_output=True, text=True).stdout.strip()


def install_dir() -> Path:
    return Path(sys.prefix) / "lib" / "nanoserve-kernels"


def kernels_dir() -> Path:
    """Where this install's builds go: $NANOSERVE_KERNELS_DIR, else inside the venv (sys.prefix), else,
    where the venv is read-only (a container's user), a per-install directory of the user's cache."""
    if env := os.environ.get("NANOSERVE_KERNELS_DIR"):
        return Path(env)
    own = install_dir()
    with contextlib.suppress(OSError):
        own.mkdir(parents=True, exist_ok=True)
    if os.access(own, os.W_OK):
        return own
    install = hashlib.sha256(sys.prefix.encode()).hexdigest()[:12]
    return Path.home() / ".cache" / "nanoserve" / "kernels" / install


def _digest(module: Module) -> str:
    h = hashlib.sha256()
    for f in module.key_files():
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def _abi() -> dict[str, str]:
    import torch
    return {"torch": torch.__version__, "python": sysconfig.get_config_var("SOABI") or sys.version}


def build_key(module: Module, target: Target, cxx_version: str) -> str:
    parts = [_digest(module), *target.cflags, *COMMON_CFLAGS, *sorted(target.requires), cxx_version,
             *_abi().values()]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _import(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _load_dir(directory: Path) -> tuple[ModuleType, dict] | None:
    """The module a finished build directory holds, or None where its manifest is missing or unreadable."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return _import(manifest["name"], directory / manifest["file"]), manifest


@contextlib.contextmanager
def build_lock(root: Path, prefix: str) -> Iterator[None]:
    """One builder of `prefix` at a time in this install; a start that finds one at work says whom it waits
    for."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{prefix}.lock", "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            log.info("waiting for the CPU kernels (%s) that process %s is building", prefix,
                     f.read().strip() or "?")
            fcntl.flock(f, fcntl.LOCK_EX)
        f.truncate(0)
        f.write(str(os.getpid()))
        f.flush()
        try:
            yield
        finally:
            f.truncate(0)
            fcntl.flock(f, fcntl.LOCK_UN)


def _compile(module: Module, target: Target, name: str, final: Path) -> None:
    """Builds in a fresh directory beside `final`, renamed into place once whole (the caller holds the
    lock). Compiles without importing: a baseline may be built on a CPU that cannot run it."""
    from torch.utils.cpp_extension import _write_ninja_file_and_build_library as build_library
    for stale in final.parent.glob(f".tmp-{module.prefix}-*"):  # left by a builder that died
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{module.prefix}-", dir=final.parent))
    t0 = time.monotonic()
    build_library(name, [str(source) for source in module.sources], [*target.cflags, *COMMON_CFLAGS], None,
                  None, ["-fopenmp"], None, str(tmp), False, False, False)
    so = tmp / f"{name}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"
    so = so if so.exists() else tmp / f"{name}.so"
    for f in tmp.iterdir():  # the objects and ninja files are not needed to load it
        if f != so:
            shutil.rmtree(f) if f.is_dir() else f.unlink()
    manifest = {"name": name, "file": so.name, "target": target.name, "cflags": list(target.cflags),
                "requires": sorted(target.requires), "digest": _digest(module),
                "seconds": round(time.monotonic() - t0, 1), **_abi()}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    for f in (tmp, *tmp.iterdir()):  # mkdtemp's 0700 would hide it from other users (a container's)
        f.chmod(0o755 if f.is_dir() or f == so else 0o644)
    os.rename(tmp, final)


def _prebuilt(root: Path, module: Module, cpu: frozenset[str]) -> tuple[ModuleType, dict] | None:
    """The richest finished build of this source that this CPU can run, whatever its target."""
    fits = []
    dirs = [root] if os.environ.get("NANOSERVE_KERNELS_DIR") else list(dict.fromkeys([root, install_dir()]))
    for manifest_path in (m for d in dirs for m in d.glob(f"{module.prefix}_*/{MANIFEST}")):
        with contextlib.suppress(OSError, ValueError, KeyError):
            m = json.loads(manifest_path.read_text())
            same = m["digest"] == _digest(module) and {k: m[k] for k in _abi()} == _abi()
            if same and set(m["requires"]) <= cpu:
                fits.append((len(m["requires"]), manifest_path.parent))
    for _, directory in sorted(fits, reverse=True):
        if (found := _load_dir(directory)) is not None:
            return found
    return None


def estimate_seconds(root: Path, prefix: str | None = None) -> float | None:
    """How long this install's earlier builds took (the longest), for the line that announces a build."""
    times = []
    for manifest_path in root.glob(f"{prefix or ''}*/{MANIFEST}"):
        with contextlib.suppress(OSError, ValueError, KeyError):
            times.append(float(json.loads(manifest_path.read_text())["seconds"]))
    return max(times) if times else None


def find(module: Module, target_name: str, root: Path | None = None) -> tuple[Path, str, Target] | None:
    """Where the build of `module` for `target_name` lives, its extension name and the target; None
    without a compiler (then only prebuilt builds can be loaded)."""
    cxx = compiler()
    if cxx is None:
        return None
    target = target_for(target_name, cxx)
    name = f"{module.prefix}_{build_key(module, target, _version(cxx))}"
    return (root or kernels_dir()) / name, name, target


def missing(module: Module, target_name: str = "native", root: Path | None = None) -> bool:
    """Whether loading `module` for `target_name` would compile it first."""
    spot = find(module, target_name, root)
    return spot is not None and spot[2].requires <= cpu_flags() and not (spot[0] / MANIFEST).exists()


def ensure_built(module: Module, target_name: str = "native", root: Path | None = None,
                 announce: bool = True) -> tuple[Path, Target]:
    """The build directory of `module` for `target_name`, compiled now under the lock where missing,
    whatever this CPU runs (baselines are built for other machines). `announce`: a line before and
    after a build (callers building several say it once)."""
    root = root or kernels_dir()
    spot = find(module, target_name, root)
    if spot is None:
        raise RuntimeError("no C++ compiler (or no ninja): nothing can be built")
    final, name, target = spot
    if (final / MANIFEST).exists():
        return final, target
    with build_lock(root, module.prefix):
        if (final / MANIFEST).exists():  # the builder we waited for made it
            return final, target
        if announce:
            log.info("building CPU kernels (%s) for %s: once per install, about %.0f s",
                     module.prefix, target.describe(), estimate_seconds(root) or DEFAULT_SECONDS)
        t0 = time.monotonic()
        _compile(module, target, name, final)
        if announce:
            log.info("built CPU kernels (%s) in %.1f s into %s", module.prefix, time.monotonic() - t0, final)
    return final, target


def load_or_build(module: Module, target_name: str = "native", root: Path | None = None,
                  announce: bool = True) -> tuple[ModuleType, str] | None:
    """`module` for this CPU and its target's name: the build for `target_name`, built now if missing;
    without a compiler (or for a target this CPU cannot run) the richest prebuilt one this CPU runs.
    None where neither exists."""
    root = root or kernels_dir()
    spot = find(module, target_name, root)
    if spot is not None and not spot[2].requires <= cpu_flags():
        log.warning("this CPU lacks %s of the %s build's features: looking for a prebuilt one",
                    " ".join(sorted(spot[2].requires - cpu_flags())), target_name)
        spot = None
    if spot is None:
        found = _prebuilt(root, module, cpu_flags())
        return None if found is None else (found[0], found[1]["target"])
    final, target = ensure_built(module, target_name, root, announce)
    found = _load_dir(final)
    if found is None:
        raise RuntimeError(f"the build in {final} has no readable manifest")
    return found[0], target.name
