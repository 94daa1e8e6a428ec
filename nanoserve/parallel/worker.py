"""A tensor-parallel worker (ranks 1..N-1): joins the group, builds its shard exactly as the engine
does (model_setup.build_shard), then runs whatever rank 0 sends, in order: each step's KV copies
(on its own slices of the two tiers), then the step's forward. It never decides anything.

It stops on Stop (exit 0), and on a message that does not decode as the one expected (exit 2:
malformed, truncated or of another version; parallel/messages.py), running nothing of it.
Anything else that goes wrong ends the process with a non-zero code: rank 0 then sees a closed
connection inside its next collective and fails its requests, rather than run on with ranks that
disagree. Started by rank 0 on its own node, by `nanoserve --node-rank K` on the others:
`python -m nanoserve.parallel.worker SPEC_JSON`."""
from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import torch

from nanoserve.config import EngineConfig
from nanoserve.distributed.parallel import Rendezvous, join, leave
from nanoserve.parallel.shard import build_shard, host_blocks
from nanoserve.parallel.placement import die_with_parent
from nanoserve.parallel.messages import CopyCommand, MessageError, Setup, Step, Stop, decode
from nanoserve.parallel.leader import WorkerSpec
from nanoserve.kvcache.host_tier import alloc_host_cache
from nanoserve.kernels import cpu_kernels
from nanoserve.kvcache.native import KVKernels
from nanoserve.kvcache.transfer import (BatchCopy, BlockCopy, batch_copy, copy_block_async,
                                        copy_block_memmove, copy_blocks)
from nanoserve.models.loader import ModelSource, load_config

log = logging.getLogger("nanoserve.worker")


def run_copies(copies: list[CopyCommand], device_cache: torch.Tensor, host_cache: torch.Tensor | None,
               copy: BlockCopy = copy_block_memmove, batch: BatchCopy | None = None) -> list[int]:
    """Run this rank's part of rank 0's copies, in order, before the step's forward (on CUDA on the
    compute stream, so the forward is ordered after them). `copy`, `batch`: as rank 0's copier copies
    (`copies_for`). -> 1 per failed copy."""
    failed = []
    for cmd in copies:
        try:
            if host_cache is None:
                raise RuntimeError("a KV copy arrived but this rank has no host tier")
            src, dst = (device_cache, host_cache) if cmd.lane == "save" else (host_cache, device_cache)
            copy_blocks(src, cmd.src_ids, dst, cmd.dst_ids, copy, batch=batch)
            failed.append(0)
        except Exception:  # reported to rank 0 through the ack; the block is not published
            log.exception("KV %s of %d blocks failed", cmd.lane, len(cmd.src_ids))
            failed.append(1)
    return failed


def _next(channel, expect: type | tuple[type, ...]) -> Setup | Step | Stop:
    """The next message, decoded as one of `expect` (MessageError if it is not one: nothing of it runs)."""
    try:
        data = channel.recv()
    except ValueError as e:  # a corrupt frame length
        raise MessageError(str(e)) from None
    except RuntimeError as e:  # rank 0's connection closed: it is gone, so is this engine
        raise RankZeroGone(str(e)) from None
    return decode(data, expect)


class RankZeroGone(Exception):
    pass


def copies_for(device: torch.device) -> tuple[BlockCopy, BatchCopy | None]:
    """How this rank copies, as rank 0's copier does on the same device (transfer.make_copier): on CUDA the
    C++ batch where built (each run enqueued with no Python slice), else per run; on CPU memmoves (not
    torch's copy_, whose OpenMP team spins beside the model's: transfer.copy_block_memmove)."""
    if device.type == "cuda":
        return copy_block_async, batch_copy(KVKernels.of(cpu_kernels.built()).copy_runs, non_blocking=True)
    return copy_block_memmove, None


def serve(spec: WorkerSpec) -> int:
    device = torch.device("cuda", spec.device_index) if spec.device_index is not None else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    tp, channel = join(spec.rendezvous, spec.rank, device)
    setup = _next(channel, Setup)
    config = EngineConfig(**setup.config)
    source = ModelSource(setup.model_name, Path(setup.model_path))
    shard = build_shard(config, source, load_config(source), device, getattr(torch, setup.dtype), tp)
    blocks = host_blocks(config, shard.layout, tp.size)
    host_cache = (alloc_host_cache((blocks, *shard.runner.kv_cache.shape[1:]), shard.layout.dtype,
                                   pin=device.type == "cuda")[0] if blocks else None)
    log.info("rank %d ready: %d KV blocks, %d host blocks", tp.rank, shard.num_blocks, blocks)
    copy, batch = copies_for(device)
    with torch.inference_mode():
        while not isinstance(msg := _next(channel, (Step, Stop)), Stop):
            flags = run_copies(msg.copies, shard.runner.kv_cache, host_cache, copy, batch)
            if msg.plan is not None:
                shard.runner.execute(msg.plan)
            if msg.copies:
                tp.reduce_flags(flags)
    leave()
    return 0


def main(argv: list[str]) -> int:
    d = json.loads(argv[1])
    d["rendezvous"] = Rendezvous(**d["rendezvous"])
    d["cpus"] = tuple(d["cpus"]) if d["cpus"] is not None else None
    spec = WorkerSpec(**d)
    if spec.parent_pid is not None:
        die_with_parent(spec.parent_pid)
    logging.basicConfig(level=spec.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s %(name)s [tp-rank-{spec.rank}]: %(message)s")
    if spec.cpus is not None:
        os.sched_setaffinity(0, spec.cpus)
    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    try:
        return serve(spec)
    except RankZeroGone as e:
        log.error("rank 0 is gone (%s); exiting", str(e).split(" This is")[0])
        return 1
    except MessageError as e:  # not rank 0's plan, or not this version's: run nothing of it
        log.error("tensor-parallel rank %d stops: %s", spec.rank, e)
        return 2
    except Exception:
        log.exception("tensor-parallel rank %d failed", spec.rank)
        return 1


if __name__ == "__main__":
    code = main(sys.argv)
    if code:
        # stopped without leave(): the process group's threads still run, and their destructors at
        # interpreter exit can abort the process ("terminate called without an active exception",
        # SIGABRT) instead of exiting with the code that names the reason
        logging.shutdown()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
