"""The tensor-parallel group as rank 0's engine holds it: starting this node's other ranks and joining
them, the one guard every call that meets them goes through, and stopping them (also at interpreter
exit: an offline LLM nobody closed must not leave its workers waiting). A single rank is a group of one
with nothing to start or guard."""
from __future__ import annotations

import dataclasses
import logging
import os
import weakref
from collections.abc import Callable
from typing import Any

import torch

from nanoserve.config import EngineConfig
from nanoserve.distributed.parallel import TensorParallel, join
from nanoserve.kvcache.transfer import Copier
from nanoserve.parallel.leader import (Followers, LocalWorkers, ParallelCopier, describe_fault, plan_node,
                                       shm_slot_bytes, start_worker, stop_workers)
from nanoserve.parallel.messages import Setup

log = logging.getLogger("nanoserve")


class Ranks:
    def __init__(self) -> None:
        self.tp = TensorParallel()
        self.followers: Followers | None = None
        self.local: LocalWorkers | None = None
        self._stop: Callable[[], Any] | None = None

    @classmethod
    def start(cls, config: EngineConfig, device: torch.device, hf_config, setup: Setup) -> Ranks:
        """Start this node's other ranks, join them as rank 0, send them the settings."""
        ranks = cls()
        specs = plan_node(config, device, shm_slot_bytes(config, hf_config, device))
        if device.type == "cpu" and specs[0].threads is not None:
            torch.set_num_threads(specs[0].threads)
            if specs[0].cpus is not None:
                os.sched_setaffinity(0, specs[0].cpus)
        ranks.local = LocalWorkers({s.rank: start_worker(s) for s in specs[1:]})
        try:
            ranks.tp, channel = join(specs[0].rendezvous, 0, device)
        except BaseException:
            ranks.local.stop(timeout=0)
            raise
        if ranks.tp.shm is not None:  # fail the shared-memory waits at once
            shm = ranks.tp.shm
            ranks.local.on_death = lambda: (shm.abort(), channel.abort())
        ranks.followers = Followers(channel, ranks.tp)
        ranks._stop = weakref.finalize(ranks, stop_workers, ranks.followers, ranks.local)
        ranks.followers.send(setup)
        log.info("tensor parallel: %d ranks (%d on this node), collectives through %s", ranks.tp.size,
                 len(specs), "NCCL" if device.type == "cuda" else "shared memory" if ranks.tp.shm else "gloo")
        return ranks

    @staticmethod
    def setup_message(config: EngineConfig, name: str, path: str, dtype: torch.dtype) -> Setup:
        return Setup(dataclasses.asdict(config), name, path, str(dtype).removeprefix("torch."))

    def guard(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args), where any failure is fatal to the group (ParallelFault): the other ranks may be
        inside a collective rank 0 will never join."""
        if self.followers is None:
            return fn(*args)
        try:
            return fn(*args)
        except Exception as e:
            self.followers.failed = True
            raise describe_fault(e, self.local) from e

    def check(self) -> None:
        """Raise ParallelFault if a worker of this node has exited (an idle engine's periodic check; a busy
        one notices in its next collective)."""
        if self.followers is not None and self.local is not None and self.local.dead():
            raise describe_fault(RuntimeError("a worker process exited"), self.local)

    def copier(self, local: Copier) -> Copier:
        """The host tier's copier: the workers mirror every copy rank 0 begins."""
        return local if self.followers is None else ParallelCopier(local, self.followers)

    def close(self) -> None:
        if self._stop is not None:
            self._stop()
        elif self.local is not None:  # started, never joined
            self.local.stop(timeout=0)
        self.followers = None
