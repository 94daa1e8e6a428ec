"""CPU placement: which cores the API process and the engine get, and how many compute threads;
the engine-side processes' environment and lifetime (they die with the process that started them).

On CPU the engine's torch threads and the API process (HTTP, JSON, tokenization, SSE) would otherwise
fight over the same cores, and a decode step stalls whenever the API side runs. With the engine in
its own process the API keeps one core and the engine gets the others, from 3 cores on. On 2 cores
keeping one for the API halves the compute, and sharing it costs far less: there the engine computes
on both and shares one with the API (`bench/serve.py`
at concurrency 32, one session: 478 output tok/s against 322 with one engine thread)."""
from __future__ import annotations

import ctypes
import logging
import os
import signal
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    from nanoserve.config import EngineConfig

log = logging.getLogger("nanoserve.placement")


SHARE_CORES_UP_TO = 2  # on machines this small the engine computes on every core by default
HEAP_ON_HUGE_PAGES = "glibc.malloc.hugetlb=1"


def compute_process_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of an engine or worker process: glibc's malloc advises what it maps
    MADV_HUGEPAGE (layers/hugepages.py says why). That reaches what relocate() cannot, oneDNN's opaque
    prepacked weights: the embedded model dequantized, one thread, batch-1 decode step 23.3 -> 22.0 ms
    (bench/latency.py --gguf-dequantize with and without it, two runs each). A GLIBC_TUNABLES already
    set is the user's and stays as it is; other C libraries ignore it."""
    env = dict(os.environ if env is None else env)
    env.setdefault("GLIBC_TUNABLES", HEAP_ON_HUGE_PAGES)
    return env


@dataclass(frozen=True)
class CpuPlacement:
    engine_threads: int | None = None           # torch compute threads; None = torch's default
    engine_cpus: tuple[int, ...] | None = None  # affinity of the engine process; None = unchanged
    api_cpus: tuple[int, ...] | None = None     # affinity of the API process; None = unchanged

    def describe(self) -> str:
        where = (f"API process on cpus {list(self.api_cpus)}, engine process on cpus {list(self.engine_cpus)}"
                 if self.engine_cpus is not None else "no CPU affinity set")
        threads = self.engine_threads if self.engine_threads is not None else "torch default"
        return f"{where}; engine compute threads: {threads}"


@dataclass(frozen=True)
class PlacementRequest:
    """What the server asks for. The engine side plans it (`engine_placement`): only there is the device
    known, since deciding it imports torch, which the API process never does."""
    cpu_threads: int | None = None


def engine_placement(config: EngineConfig, request: PlacementRequest | None,
                     engine_process: bool) -> CpuPlacement:
    """The plan for an engine about to load its model; None asks for none (affinity and threads unchanged)."""
    if request is None:
        return CpuPlacement()
    try:
        device = config.resolved_device().type
    except ValueError:  # no such device: the engine's start reports it to the client
        return CpuPlacement(request.cpu_threads)
    return plan_placement(device, request.cpu_threads, engine_process)


def plan_placement(device: str, cpu_threads: int | None, engine_process: bool,
                   cpus: list[int] | None = None) -> CpuPlacement:
    """`cpu_threads` None = on CPU all cores but one when there are >= 3, both of 2 with the engine in
    its own process (in the API's process two threads measured worse: a 70 ms decode step against
    51 ms with one, experiment `bench/decode_step.py` at c256b25), and elsewhere torch decides.
    Affinity is split only with the engine in its own process (threads of one process cannot be
    kept apart from torch's compute pool by a per-process setting), and only when the engine's
    threads fit the cores left after the API's one: asking for every core means sharing them."""
    if cpu_threads is not None and cpu_threads < 1:
        raise ValueError(f"--cpu-threads must be >= 1, got {cpu_threads}")
    if device != "cpu":
        return CpuPlacement(cpu_threads)
    cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    share = engine_process and len(cpus) <= SHARE_CORES_UP_TO
    threads = cpu_threads or (len(cpus) if share else max(1, len(cpus) - 1))
    if engine_process and len(cpus) >= 2 and threads < len(cpus):
        return CpuPlacement(threads, tuple(cpus[1:]), (cpus[0],))
    return CpuPlacement(threads)


def apply_engine_placement(p: CpuPlacement) -> None:
    import torch
    if p.engine_cpus is not None:
        os.sched_setaffinity(0, p.engine_cpus)
    if p.engine_threads is not None:
        torch.set_num_threads(p.engine_threads)


def apply_api_placement(p: CpuPlacement) -> None:
    if p.api_cpus is not None:
        os.sched_setaffinity(0, p.api_cpus)


def die_with_parent(parent_pid: int) -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: the idle parent-pid check still stops it
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)
