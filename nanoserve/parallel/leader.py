"""The other tensor-parallel ranks, seen from the engine (rank 0): starting the ones on this node,
the messages they get (parallel/messages.py: typed, never pickled), and the KV copies they mirror.

One scheduler, N workers. Rank 0 plans each step (runner/step_plan.py) and broadcasts it before its
own forward; the ranks meet in the model's collectives. Block ids are the same on every rank (each
holds its heads' slice of every block), so the prefix cache and the host tier's bookkeeping exist
once, on rank 0; a host-tier copy that rank 0 begins is sent to the workers with the next message,
and they run it before that step's forward. Its completion handle is done only when rank 0's own
copy has finished and every worker has reported its part (`Followers.after`): a block is
published only when all ranks hold it, and a copy that failed anywhere failed everywhere."""
from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from nanoserve.config import EngineConfig
from nanoserve.distributed.channel import MessageChannel
from nanoserve.distributed.parallel import ParallelFault, Rendezvous, TensorParallel, leave
from nanoserve.distributed.shm import ShmChannel
from nanoserve.parallel.placement import compute_process_env
from nanoserve.parallel.messages import CopyCommand, Message, Step, Stop, encode
from nanoserve.kvcache.transfer import Copier, Transfer
from nanoserve.runner.step_plan import StepPlan

log = logging.getLogger("nanoserve")


# ---- rank 0's side of the copies -----------------------------------------------------------------
class Followers:
    """Sends each step's plan and the copies begun since the last message; collects the copy acks.
    The runner's StepListener."""

    def __init__(self, channel: MessageChannel | ShmChannel, tp: TensorParallel) -> None:
        self.channel, self.tp = channel, tp
        self.pending: list[tuple[CopyCommand, CopyAck]] = []
        self.in_flight: list[CopyAck] = []
        self.failed = False  # set by the engine on a ParallelFault: the ranks are out of step

    def send(self, msg: Message) -> None:
        self.channel.send(encode(msg))

    def before(self, plan: StepPlan | None) -> None:
        self.send(Step(plan, [cmd for cmd, _ in self.pending]))
        self.in_flight, self.pending = [ack for _, ack in self.pending], []

    def after(self) -> None:
        """Every rank has run the message's copies: a failure anywhere marks the copy failed."""
        if self.in_flight:
            flags = self.tp.reduce_flags([0] * len(self.in_flight))
            for ack, failed in zip(self.in_flight, flags):
                ack.acked, ack.failed = True, bool(failed)
            self.in_flight = []

    def flush(self) -> None:
        """Send pending copies now (rank 0 waits for one and has no step to run)."""
        if self.pending:
            self.before(None)
            self.after()

    def stop(self) -> None:
        self.send(Stop())


@dataclass
class CopyAck:
    """Rank 0's record of what the workers reported for one copy."""
    acked: bool = False
    failed: bool = False


class ParallelTransfer(Transfer):
    def __init__(self, local: Transfer, ack: CopyAck, followers: Followers) -> None:
        self.local, self.ack, self.followers = local, ack, followers

    @property
    def error(self) -> BaseException | None:
        if self.local.error is not None:
            return self.local.error
        return RuntimeError("the KV copy failed on another tensor-parallel rank") if self.ack.failed else None

    @property
    def seconds(self) -> float:
        return self.local.seconds

    def done(self) -> bool:
        return self.ack.acked and self.local.done()

    def wait(self, timeout: float | None = None) -> bool:
        if not self.ack.acked:
            self.followers.flush()
        return self.local.wait(timeout)

    def order_compute_after(self) -> None:
        self.local.order_compute_after()


class ParallelCopier(Copier):
    """Rank 0's copier under tensor parallelism: its own copy, plus the same block ids for the
    workers (which pass them to their own slices of the two tiers)."""

    def __init__(self, local: Copier, followers: Followers) -> None:
        super().__init__()
        self.local, self.followers = local, followers

    def _open_lane(self, name: str):  # pragma: no cover - lanes are the local copier's
        raise NotImplementedError

    def submit(self, lane, src, src_ids, dst, dst_ids, pairs=None) -> Transfer:
        handle = self.local.submit(lane, src, src_ids, dst, dst_ids, pairs)
        ack = CopyAck()
        self.followers.pending.append((CopyCommand(lane, list(src_ids), list(dst_ids)), ack))
        return ParallelTransfer(handle, ack, self.followers)

    def drain(self) -> None:
        self.local.drain()


# ---- starting the workers of this node -------------------------------------------------------------
@dataclass(frozen=True)
class WorkerSpec:
    rank: int
    rendezvous: Rendezvous
    device_index: int | None      # CUDA: the local GPU; None on CPU
    threads: int | None           # CPU compute threads
    cpus: tuple[int, ...] | None  # CPU affinity; None = inherited
    parent_pid: int | None        # die with the process that started it (this node's launcher)
    log_level: str = "info"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_worker(spec: WorkerSpec) -> subprocess.Popen:
    """With this process's import path: names in the config (flash_attn_module) resolve the same."""
    path = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
    env = compute_process_env()
    env["PYTHONPATH"] = path + os.pathsep + os.environ.get("PYTHONPATH", "")
    return subprocess.Popen([sys.executable, "-m", "nanoserve.parallel.worker", json.dumps(asdict(spec))],
                            env=env)


def cpu_slices(cpus: list[int], ranks: int) -> list[tuple[int, ...] | None]:
    """Disjoint CPU sets for this node's ranks when there are enough cores, else None (share)."""
    if len(cpus) < ranks:
        return [None] * ranks
    per = len(cpus) // ranks
    return [tuple(cpus[r * per:(r + 1) * per]) for r in range(ranks)]


class LocalWorkers:
    """The worker processes this node started. A watchdog thread notices a death within a quarter
    second and kills the other ranks: rank 0 may be blocked in a collective with a live rank that
    itself waits for the dead one (gloo took 10 s to notice in one of three tries), and with every
    peer gone the collective fails at once. Nothing could continue anyway."""

    def __init__(self, procs: dict[int, subprocess.Popen], poll_s: float = 0.25) -> None:
        self.procs = procs
        self.stopping = threading.Event()
        self.first_death: dict[int, int] = {}  # what the watchdog saw, before it stopped the rest
        self.on_death: Callable[[], None] | None = None  # e.g. fail the shared-memory waits at once
        if procs:
            threading.Thread(target=self._watch, args=(poll_s,), daemon=True,
                             name="nanoserve-tp-watchdog").start()

    def _watch(self, poll_s: float) -> None:
        while not self.stopping.wait(poll_s):
            if dead := {r: c for r, c in self.dead().items() if c != 0}:  # 0: stopped by rank 0
                self.first_death = dead
                log.error("tensor-parallel %s; stopping the other ranks", self.describe())
                if self.on_death is not None:
                    self.on_death()
                for p in self.procs.values():
                    if p.poll() is None:
                        p.kill()
                return

    def dead(self) -> dict[int, int]:
        return {r: p.returncode for r, p in self.procs.items() if p.poll() is not None}

    def describe(self) -> str:
        dead = self.first_death or self.dead()
        return (", ".join(f"rank {r} exited with code {c}" for r, c in dead.items()) if dead
                else "all local workers still running")

    def stop(self, timeout: float = 10.0) -> None:
        self.stopping.set()
        deadline = time.monotonic() + timeout
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def shm_slot_bytes(config: EngineConfig, hf_config, device: torch.device) -> int:
    """All ranks on one CPU node: shared-memory collectives, a slot holding the largest all-reduce
    (a full step's hidden states) and a full batch's logits shard, in fp32 (capped: larger ones go
    through gloo). 0 otherwise."""
    if config.nnodes > 1 or device.type != "cpu":
        return 0
    rows = max(config.step_tokens, config.max_num_seqs)
    shard = -(-hf_config.vocab_size // config.tensor_parallel_size)
    return min(4 * max(rows * hf_config.hidden_size, config.max_num_seqs * shard), 64 << 20)


def plan_node(config: EngineConfig, rank0_device: torch.device, slot_bytes: int = 0) -> list[WorkerSpec]:
    """Specs for this node's worker ranks. Node 0 holds ranks 0..per_node-1 (rank 0 is the
    engine itself); node k holds the next per_node."""
    n, nodes = config.tensor_parallel_size, config.nnodes
    per_node = n // nodes
    first = config.node_rank * per_node
    port = config.master_port or free_port()
    rv = Rendezvous(config.master_addr, port, n, config.distributed_timeout, slot_bytes)
    cuda = rank0_device.type == "cuda"
    cpus = sorted(os.sched_getaffinity(0))
    threads = None if cuda else max(1, torch.get_num_threads() // per_node)
    slices = [None] * per_node if cuda else cpu_slices(cpus, per_node)
    return [WorkerSpec(r, rv, (r - first) if cuda else None, threads, slices[r - first], os.getpid(),
                       logging.getLevelName(log.getEffectiveLevel()).lower())
            for r in range(first, first + per_node)]


def run_node_workers(config: EngineConfig) -> int:
    """A node other than 0 (`nanoserve --nnodes M --node-rank K`): start its ranks and wait. Their
    exit codes are the node's: non-zero as soon as one fails (a supervisor restarts it)."""
    local = LocalWorkers({s.rank: start_worker(s) for s in plan_node(config, config.resolved_device())})
    log.info("node %d: tensor-parallel ranks %s started; waiting for rank 0 at %s:%d", config.node_rank,
             sorted(local.procs), config.master_addr, config.master_port)
    try:
        while not (dead := local.dead()) or len(dead) < len(local.procs):
            if any(code != 0 for code in dead.values()):
                break
            time.sleep(0.5)
    finally:
        for p in local.procs.values():
            if p.poll() is None:
                p.kill()
    codes = local.dead()
    log.info("node %d: ranks exited: %s", config.node_rank, codes)
    return max((abs(c) for c in codes.values()), default=0)


def stop_workers(followers: Followers, local: LocalWorkers | None) -> None:
    """Stop every rank (they exit 0), wait for this node's, leave the group."""
    failed = followers.failed or (local is not None and bool(local.first_death or local.dead()))
    if local is not None:
        local.stopping.set()  # they exit now: not a death
    if not failed:  # after a failure the broadcast could wait on a dead peer: kill ours instead
        try:
            followers.stop()
        except Exception:  # a rank is gone already: the others exit on the closed connection
            log.warning("could not reach every tensor-parallel rank to stop it")
    if local is not None:
        local.stop(timeout=0 if failed else 10)
    leave()


def describe_fault(e: BaseException, local: LocalWorkers | None) -> ParallelFault:
    where = local.describe() if local is not None else "no local workers"
    return ParallelFault(f"a tensor-parallel step failed ({where}): {type(e).__name__}: {e}")
