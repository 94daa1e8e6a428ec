"""The kernels' build (nanoserve/kernels/build.py) with real compiles of a tiny module, in real processes:
a builder killed mid-build never blocks the next start, a start waits only for a live builder, two installs
never rebuild each other's kernels, and a build for features this CPU lacks is never loaded. The Dockerfile
builds them in its build stage (read from its steps: no Docker daemon here)."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from nanoserve.kernels import build

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(build.compiler() is None, reason="needs a C++ compiler and ninja")

TINY = r"""
#include <Python.h>
#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)
#define STR2(x) #x
#define STR(x) STR2(x)
static PyObject* answer(PyObject*, PyObject*) { return PyLong_FromLong(42); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, ""}, {nullptr, nullptr, 0, nullptr}};
static PyModuleDef def = {PyModuleDef_HEAD_INIT, STR(TORCH_EXTENSION_NAME), nullptr, -1, methods};
PyMODINIT_FUNC CAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&def); }
"""

# Loads the tiny module as a start loads the kernels, and reports what it found
LOAD = """
import json, logging, sys
logging.basicConfig(level=logging.INFO, format="%(message)s")
from pathlib import Path
from nanoserve.kernels import build
found = build.load_or_build(build.Module("tiny", (Path(sys.argv[1]),)))
print(json.dumps(found and {"answer": found[0].answer(), "target": found[1], "file": found[0].__file__}))
"""

# Compiles slowly: the test sees the build under way (the file `$SLOW_MARK` appears) and can kill it
SLOW_CXX = """#!/bin/sh
case " $* " in *" -c "*) touch "$SLOW_MARK"; sleep "${SLOW_SECONDS:-30}";; esac
exec c++ "$@"
"""


@pytest.fixture
def tiny(tmp_path) -> Path:
    src = tmp_path / "src" / "tiny.cpp"
    src.parent.mkdir()
    src.write_text(TINY)
    return src


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("NANOSERVE_KERNELS_DIR", "CXX")}
    env["PYTHONPATH"] = str(ROOT)
    return {**env, **extra}


def _start(python: str, src: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen([python, "-c", LOAD, str(src)], env=_env(**env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[dict, str]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1]), err


def _slow_cxx(tmp_path: Path) -> Path:
    cxx = tmp_path / "slow-c++"
    cxx.write_text(SLOW_CXX)
    cxx.chmod(0o755)
    return cxx


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_a_builder_killed_mid_build_leaves_nothing_that_blocks_the_next_start(tmp_path, tiny):
    root = tmp_path / "kernels"
    mark = tmp_path / "compiling"
    builder = _start(sys.executable, tiny, NANOSERVE_KERNELS_DIR=str(root), CXX=str(_slow_cxx(tmp_path)),
                     SLOW_MARK=str(mark))
    _wait_for(mark, builder)  # the compiler runs: the lock is held, a temporary build directory exists
    assert list(root.glob(".tmp-tiny-*"))
    os.killpg(builder.pid, signal.SIGKILL)
    builder.wait()
    got, err = _finish(_start(sys.executable, tiny, NANOSERVE_KERNELS_DIR=str(root)))
    assert got["answer"] == 42 and "building CPU kernels (tiny)" in err and "waiting" not in err
    assert not list(root.glob(".tmp-tiny-*"))  # the dead builder's half is gone
    assert [p.name for p in root.glob("tiny_*")] == [Path(got["file"]).parent.name]


def test_a_start_waits_for_a_live_builder_and_loads_its_build(tmp_path, tiny):
    root = tmp_path / "kernels"
    mark = tmp_path / "compiling"
    builder = _start(sys.executable, tiny, NANOSERVE_KERNELS_DIR=str(root), CXX=str(_slow_cxx(tmp_path)),
                     SLOW_MARK=str(mark), SLOW_SECONDS="3")
    _wait_for(mark, builder)
    waiter = _start(sys.executable, tiny, NANOSERVE_KERNELS_DIR=str(root))
    built, built_log = _finish(builder)
    got, err = _finish(waiter)
    assert f"waiting for the CPU kernels (tiny) that process {builder.pid} is building" in err
    assert "building CPU kernels" in built_log and "building CPU kernels" not in err
    assert got == built


def _install(tmp_path: Path, name: str) -> str:
    """A second install of the package: its own venv (sys.prefix), seeing this one's packages."""
    venv = tmp_path / name
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c",
                                "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "outer.pth").write_text(f"import site; site.addsitedir({sysconfig.get_path('purelib')!r})\n")
    return str(venv / "bin" / "python")


def test_two_installs_started_in_turn_never_rebuild(tmp_path, tiny):
    a, b = _install(tmp_path, "venv-a"), _install(tmp_path, "venv-b")
    starts = [(python, *_finish(_start(python, tiny))) for python in (a, b, a, b)]
    built = ["building CPU kernels (tiny)" in err for _, _, err in starts]
    assert built == [True, True, False, False]
    for python, got, _ in starts:  # each install's build lives in its own venv
        assert got["answer"] == 42 and got["file"].startswith(str(Path(python).parent.parent / "lib"))
    assert starts[0][1]["file"] == starts[2][1]["file"] != starts[1][1]["file"] == starts[3][1]["file"]


def test_a_build_for_features_this_cpu_lacks_is_never_loaded(tmp_path, tiny):
    lacking = sorted(build.ISA_FLAGS - build.cpu_flags())
    if not lacking or "avx2" not in build.cpu_flags():
        pytest.skip("needs an x86 CPU with AVX2 that lacks some listed feature")
    root = tmp_path / "kernels"
    module = build.Module("tiny", (tiny,))
    fits, _ = build.ensure_built(module, "x86-64-v3", root)
    richer = root / "tiny_richer"  # a build whose manifest asks for more than this CPU has
    shutil.copytree(fits, richer)
    manifest = json.loads((richer / build.MANIFEST).read_text())
    (richer / build.MANIFEST).write_text(json.dumps({**manifest, "target": "richer",
                                                     "requires": [*manifest["requires"], *lacking]}))
    env = {"CXX": str(tmp_path / "no-compiler")}  # a machine without a compiler: only prebuilt builds load
    got, err = _finish(_start(sys.executable, tiny, NANOSERVE_KERNELS_DIR=str(root), **env))
    assert got["target"] == "x86-64-v3" and "building" not in err
    shutil.rmtree(fits)
    got, _ = _finish(_start(sys.executable, tiny, NANOSERVE_KERNELS_DIR=str(root), **env))
    assert got is None  # nothing this CPU runs is left: none, never the richer build


def test_a_native_build_names_this_cpus_features_and_a_baseline_only_its_own():
    cxx = build.compiler()
    native, v3 = build.target_for("native", cxx), build.target_for("x86-64-v3", cxx)
    if "avx2" not in build.cpu_flags():
        pytest.skip("not an x86 CPU with AVX2")
    assert v3.requires >= {"avx2", "fma", "f16c"} and not any(f.startswith("avx512") for f in v3.requires)
    assert native.requires <= build.cpu_flags() and v3.requires <= native.requires
    from nanoserve.kernels.cpu_kernels import MODULE
    assert build.build_key(MODULE, native, "12") != build.build_key(MODULE, v3, "12")


def _stages(dockerfile: str) -> list[tuple[str, list[str]]]:
    """(image, its RUN/COPY steps with continuations joined) per stage; images with the ARG defaults."""
    args: dict[str, str] = {}
    stages: list[tuple[str, list[str]]] = []
    for step in re.split(r"\n(?=[A-Z]+ )", dockerfile.replace("\\\n", " ")):
        if step.startswith("ARG ") and not stages and "=" in step:
            name, _, value = step[4:].strip().partition("=")
            args[name] = value
        elif step.startswith("FROM "):
            image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], step.split()[1])
            stages.append((image, []))
        elif stages and step.startswith(("RUN ", "COPY ")):
            stages[-1][1].append(step)
    return stages


def test_the_dockerfile_builds_the_kernels_in_a_stage_with_a_compiler_and_ships_them():
    stages = _stages((ROOT / "Dockerfile").read_text())
    assert len(stages) == 2
    (build_image, build_steps), (run_image, run_steps) = stages
    assert build_image == "python:3.11" and run_image == "python:3.11-slim"  # the full image carries gcc
    joined = " ".join(build_steps)
    assert "pip install ." in joined and "python -m nanoserve.kernels --baselines" in joined
    assert joined.index("pip install .") < joined.index("nanoserve.kernels")
    assert any(s.startswith("COPY --from=build /opt/venv /opt/venv")
               for s in run_steps)  # the runtime carries them
    assert not any("nanoserve.kernels" in s or "pip install" in s for s in run_steps)  # and builds nothing
