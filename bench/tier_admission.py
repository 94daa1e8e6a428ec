"""Admission cost of a host-tier load, on the step path, with a breakdown (bench/tier.py --admission).

The device pool is fragmented the way a busy server leaves it: free runs of every length (a few long,
hundreds of one to six blocks) between blocks in use and cached-free ones, released in shuffled order;
the host holds a prompt's whole prefix. The copier (`--copier`, see `_copier`) is by default one that
does on the engine thread what the CUDA copier's submit does but the driver's enqueue and its events (its
code cuts the batch and `copy_`s each run, in C++ where the kernels are built, of 8-byte blocks): the
admission cost is then the bookkeeping and the copies' dispatch. `--copier server` is the copier the
server makes on this machine (on CPU: its worker thread copies; the engine thread hands the batch over).
The copies are counted after. Each repetition builds the same state afresh and times one `admit`; the
breakdown is the time inside each named stage (inclusive: the load start includes the copier's submit),
the rest is the admission's own code. Also timed: digesting the prompt as it arrives
(`PrefixChains.prompt_chain`, on the engine core's intake thread since the engine has one: not step time;
an older checkout: `hash_prompt`).
Times are the engine thread's CPU time (`time.thread_time`): on a shared machine wall time mostly
measures who else was scheduled, and this is bookkeeping that never waits. A full collection runs just
before each timed admission, so its caches are cold (a forward ran before it in a server); `--warm` admits
the same prefix on a twin state first (code and numpy warm, the state's own data not).

    python bench/tier.py --admission                       # this checkout
    python bench/tier.py --admission --base /tmp/base      # and another checkout's nanoserve, side by side
    python bench/tier.py --admission --warm                # after the same admission on a twin state
    python bench/tier.py --admission --copier server       # with the copier the server uses on this machine
    python bench/tier.py --admission --copier server --device cuda   # the CUDA copier (bench/gpu_check.py)
"""
from __future__ import annotations

import gc
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

STAGES = (("match", "chains", "match"), ("match", "chains", "match_runs"), ("supply", "policy", "supply"),
          ("take blocks", "", "_take_blocks"), ("take blocks", "admitter", "_take_blocks"),
          ("load start", "copies", "begin_load"),
          ("  of it: submit", "copier", "submit"))


def _copier(kind: str, kernels, device):
    """The copier the admitted load submits to, recording what it was given, to count the copies after.
    "engine": on the engine thread, what the CUDA copier's submit does but its events (on CPU also the
    driver's enqueue): the batch cut into copies, each a `copy_` (the same code: a Python slice and call
    per copy, or the C++ batch) of 8-byte blocks, 16 KiB in all. "server": the copier the server makes on
    this device (transfer.make_copier: on CPU its worker thread copies, the engine thread only hands the
    batch over; on CUDA its submit enqueues the copies and their events on the lane)."""
    import inspect

    from nanoserve.kvcache import transfer
    from nanoserve.kvcache.transfer import Copier, Transfer, copy_blocks
    # the CUDA copier's C++ batch where this checkout has one and the kernels are built
    batch = transfer.batch_copy(kernels.copy_runs, True) if hasattr(transfer, "batch_copy") else None
    submitted: list = []

    def count() -> int:
        """The copies submitted since the last count."""
        made = sum(len(transfer.runs(s, d) if p is None else p) for s, d, p in submitted)
        submitted.clear()
        return made

    class Done(Transfer):
        def done(self) -> bool:
            return True

        def wait(self, timeout: float | None = None) -> bool:
            return True

    class EngineThreadCopier(Copier):
        def _open_lane(self, name: str) -> None:
            return None

        def submit(self, lane, src, src_ids, dst, dst_ids, pairs=None) -> Transfer:
            # (an older checkout's copy_blocks takes no pairs, and is never given any)
            copy_blocks(src, src_ids, dst, dst_ids, transfer.copy_block_async, self.max_copy_bytes,
                        **({"pairs": pairs} if pairs is not None else {}),
                        **({"batch": batch} if batch is not None else {}))
            submitted.append((src_ids, dst_ids, pairs))
            return Done()

        def drain(self) -> None:
            if device.type == "cuda":  # (its copies are enqueued, not waited for)
                import torch
                torch.cuda.synchronize(device)

    if kind == "engine":
        copier = EngineThreadCopier()
    else:  # (an older checkout's make_copier takes no kernel)
        takes_kernel = "copy_runs" in inspect.signature(transfer.make_copier).parameters
        copier = transfer.make_copier(device, **({"copy_runs": kernels.copy_runs} if takes_kernel else {}))
        submit = copier.submit

        def recorded(lane, src, src_ids, dst, dst_ids, pairs=None) -> Transfer:
            submitted.append((src_ids, dst_ids, pairs))
            return submit(lane, src, src_ids, dst, dst_ids, pairs)
        copier.submit = recorded
    copier.count = count
    return copier


def _fragment(kv, rng: random.Random, num_free: int) -> None:
    """Free runs (eight long ones, the rest 1-6 blocks) between 1-8 blocks in use or cached-free, until
    `num_free` blocks are free; then released in shuffled order."""
    pool, n = kv.pool, kv.pool.num_blocks
    blocks = sorted(pool.allocate() for _ in range(n))
    long_runs = [512, 384, 320, 256, 200, 160, 128, 100]
    free, i = [], 0
    keep = set()
    while i < n:
        length = long_runs.pop() if long_runs and rng.random() < 0.05 else rng.randint(1, 6)
        length = min(length, num_free - len(free), n - i)
        free += blocks[i:i + length]
        i += length
        used = rng.randint(1, 8)
        keep.update(blocks[i:i + used])
        i += used
        if len(free) >= num_free:
            keep.update(blocks[i:])
            break
    rng.shuffle(free)
    for j, b in enumerate(sorted(keep)):
        if j % 2:  # cached-free: published, then released
            pool.publish(b, rng.randbytes(32), (None, (j,)))
            pool.release(b)
    for b in free:
        pool.release(b)


def _setup(args, seed: int):
    """A manager over a fragmented device pool, a sequence whose whole prefix is on host, and another
    request with the same prompt, not hashed yet (the one admitted)."""
    import torch

    from nanoserve.kvcache.host_tier import HostTier
    from nanoserve.kvcache.manager import KVCacheManager
    from nanoserve.sampling_params import SamplingParams
    from nanoserve.sequence import Sequence
    bs, n = args.block_size, args.load_blocks
    where = torch.device(getattr(args, "device", "cpu"))
    device = torch.zeros(args.pool_blocks, 1, 2, 1, 1, 1, device=where)  # 8-byte blocks: no span cut
    kernels = _kernels()
    host = HostTier(n + 64, device, _copier(args.copier, kernels, where))
    host.copier.submit("load", host.cache, [], device, []).wait()  # its lane open, as in a server
    host.copier.count()
    kv = KVCacheManager(args.pool_blocks, bs, host=host)
    # the C++ kernels the engine uses where built (an older checkout: those it has, where it takes them)
    if hasattr(kv.pool, "kernels"):  # the pools carry them
        from nanoserve.kvcache.native import KVKernels
        kv.pool.kernels = host.pool.kernels = KVKernels(**vars(kernels))
    if hasattr(kv.chains, "digests_of"):
        kv.chains.digests_of = kernels.chain_digests
    if hasattr(kv.policy, "free_extents"):
        kv.policy.free_extents = kernels.free_extents
    rng = random.Random(seed)
    _fragment(kv, rng, args.free_blocks)
    prompt = [rng.randrange(32000) for _ in range((n + 1) * bs)]
    seq = Sequence(1, "1", 0, prompt, SamplingParams(), 16, frozenset())
    kv.hash_prompt(seq)
    for h, key in zip(seq.block_hashes[:n], seq.block_keys[:n]):  # the prefix, on host only
        hb = host.pool.allocate_pinned()
        host.pool.publish(hb, h, key)
        host.pool.unpin(hb)
    fresh = Sequence(2, "2", 0, prompt, SamplingParams(), 16, frozenset())  # digests not taken yet
    return kv, seq, fresh


def _kernels():
    """What native.KVKernels.of(cpu_kernels.built()) holds, for any checkout (None where it lacks one)."""
    from types import SimpleNamespace
    from nanoserve.kernels import cpu_kernels
    module = cpu_kernels.built()
    names = ("chain_digests", "free_extents", "copy_runs", "stored_runs")
    return SimpleNamespace(**{name: getattr(module, name, None) for name in names})


def _timed(owner, name: str, sink: dict[str, float], label: str) -> None:
    fn: Callable = getattr(owner, name)

    def wrapper(*a, **k):
        t0 = time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            sink[label] = sink.get(label, 0.0) + time.thread_time() - t0
    setattr(owner, name, wrapper)


def _hash(kv, fresh) -> None:
    if hasattr(kv.chains, "prompt_chain"):  # as the engine core's intake builds the request
        fresh.block_keys, fresh.block_hashes = kv.chains.prompt_chain(fresh.prompt_token_ids, None)
    else:
        kv.hash_prompt(fresh)


def measure(args) -> dict:
    rows: dict[str, list[float]] = {}
    copies = []
    for rep in range(args.repeat):
        kv, seq, fresh = _setup(args, seed=rep % 3)
        sink: dict[str, float] = {}
        for label, attr, name in STAGES:
            owner = kv.host.copier if attr == "copier" else getattr(kv, attr, None) if attr else kv
            if owner is not None and hasattr(owner, name):  # (an older checkout has no admitter)
                _timed(owner, name, sink, label)
        gc.collect()
        gc.freeze()  # (nor is a collection of the setup hashing's cost)
        t0 = time.thread_time()
        _hash(kv, fresh)  # at arrival, before the step: not what warms the admission's caches
        hashed = time.thread_time() - t0
        twin = _setup(args, seed=rep % 3) if args.warm else None
        gc.collect()
        gc.freeze()  # a collection walking the whole setup is not admission cost: a server's heap is older
        if twin is not None:  # the same admission on a twin state just before: code and numpy warm
            _hash(twin[0], twin[2])
            twin[0].admit(twin[2], args.block_size * 4)
            twin[0].host.copier.count()
        t1 = time.thread_time()
        admitted = kv.admit(fresh, args.block_size * 4)  # its digests and keys are its own objects
        t2 = time.thread_time()
        gc.unfreeze()
        assert admitted and kv.load_state(fresh).value == "loading", "the prefix did not start loading"
        copies.append(kv.host.copier.count())
        kv.host.copier.drain()  # (the server copier's worker copies meanwhile)
        for label, v in {"hash prompt": hashed, "admit": t2 - t1, **sink}.items():
            rows.setdefault(label, []).append(v * 1e3)
        kv.poll_transfers()
        kv.free(fresh)
        kv.check_invariants()
    return {"ms": {k: statistics.median(v) for k, v in rows.items()},
            "ms_min": {k: min(v) for k, v in rows.items()}, "copies": statistics.median(copies),
            "kernels": sorted(k for k, v in vars(_kernels()).items() if v is not None)}


def main(args) -> None:
    from common import OtherTree, child_argv, cpu_name, write_json
    import sys
    if args.raw:  # one side's child process of an A/B
        print(json.dumps(measure(args)))
        return
    # each side a fresh process per round, with the engine process's environment (run_in_tree); this
    # checkout too (measured in-process instead, its rounds read ~5% slower than an identical child's)
    argv = child_argv(sys.argv[1:]) + ["--raw"]
    sides = {"this": OtherTree(Path(__file__).resolve().parent.parent, "tier.py", argv)}
    if args.base:
        sides = {"base": OtherTree(Path(args.base), "tier.py", argv), **sides}
    results: dict[str, list[dict]] = {k: [] for k in sides}
    for _ in range(args.rounds):  # alternated: drift hits both alike
        for name, tree in sides.items():
            results[name].append(tree.run_child())
    print(f"admission of a {args.load_blocks}-block host prefix ({args.block_size}-token blocks) into a "
          f"{args.pool_blocks}-block device pool with {args.free_blocks} free blocks, fragmented; "
          f"copier: {args.copier} on {args.device}; engine-thread CPU ms, median and min of "
          f"{args.repeat} x {args.rounds} rounds; "
          f"{cpu_name()}")
    labels = [k for k in ("admit", "match", "supply", "take blocks", "load start", "  of it: submit",
                          "hash prompt") if any(k in r["ms"] for rs in results.values() for r in rs)]
    print(f"{'ms':16s}" + "".join(f"{name + ' median':>14s}{name + ' min':>12s}" for name in sides))
    for label in labels:
        print(f"{label:16s}" + "".join(
            f"{statistics.median(r['ms'][label] for r in rs if label in r['ms']):14.3f}"
            f"{min(r['ms_min'][label] for r in rs if label in r['ms']):12.3f}"
            if any(label in r["ms"] for r in rs) else f"{'-':>14s}{'-':>12s}" for rs in results.values()))
    print(f"{'copies':16s}" + "".join(f"{statistics.median(r['copies'] for r in rs):14.0f}{'':12s}"
                                      for rs in results.values()))
    for name, rs in results.items():  # (a checkout whose kernels are not built runs its Python)
        print(f"{name}: C++ kernels {', '.join(rs[0]['kernels']) or 'none (not built)'}")
    write_json(args.json, {"cpu": cpu_name(), "args": vars(args), "results": results})


def add_args(ap) -> None:
    g = ap.add_argument_group("--admission")
    g.add_argument("--admission", action="store_true",
                   help="time admitting a host prefix (see tier_admission.py)")
    g.add_argument("--load-blocks", type=int, default=2048)
    g.add_argument("--pool-blocks", type=int, default=8192)
    g.add_argument("--free-blocks", type=int, default=4096)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--repeat", type=int, default=15)
    g.add_argument("--base", default=None, help="another checkout: its nanoserve, side by side")
    g.add_argument("--warm", action="store_true",
                   help="admit the same prefix on a twin state just before each timed admission (no full "
                        "collection between): code and numpy warm, as in a busy server's scheduling pass")
    g.add_argument("--copier", choices=("engine", "server"), default="engine",
                   help="engine: each copy dispatched on the engine thread, as the CUDA copier's submit does "
                        "(default); server: the copier the server makes on this machine")
    g.add_argument("--device", default="cpu", help="where the device pool is (cuda: pinned host blocks, "
                                                   "with --copier server the CUDA copier)")
    g.add_argument("--raw", action="store_true", help=argparse_suppress())


def argparse_suppress() -> str:
    import argparse
    return argparse.SUPPRESS
