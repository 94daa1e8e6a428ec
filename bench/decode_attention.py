"""The CPU decode attention kernel alone (kernels/cpu_kernels.py `paged_decode_attention`), as a decode
step calls it: every layer in turn over a huge-page KV cache of random blocks (random block tables, so
nothing is laid out better than an engine's would be), --batch sequences at --ctx tokens each. Per
batch size: ms for all layers (median of --repeats), ns per key per KV head, and the K/V bytes read
per second. The kernel build follows the environment like the engine's (NANOSERVE_CPU_MARCH=haswell
measures the AVX2 build on an AVX-512 machine).

    python bench/decode_attention.py --batch 1 32 --threads 1
    python bench/decode_attention.py --dtype float32 --base /tmp/base   # A/B against another checkout
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import alternated, cpu_name, run_in_tree, write_json  # noqa: E402


def measure(args, batch: int) -> dict:
    import torch

    from nanoserve.kernels import cpu_kernels, hugepages
    torch.set_num_threads(args.threads)
    kernels = cpu_kernels.load()
    if kernels is None:
        raise SystemExit("no CPU kernels in this build")
    dtype = getattr(torch, args.dtype)
    bs, d, kh = args.block_size, args.head_dim, args.kv_heads
    per_seq = -(-args.ctx // bs)
    n = batch * per_seq + 1
    shape = (n, args.layers, 2, kh, bs, d)
    cache = hugepages.zeros(n * args.layers * 2 * kh * bs * d * dtype.itemsize).view(dtype).view(shape)
    g = torch.Generator().manual_seed(batch)
    for b in range(n):  # in slices: a whole fp32 randn of a large cache would double the memory
        cache[b].copy_(torch.randn(shape[1:], generator=g))
    tables = (torch.randperm(n - 1, generator=g)[:batch * per_seq] + 1).view(batch, per_seq).contiguous()
    ctx = torch.full((batch,), args.ctx, dtype=torch.long)
    q = torch.randn(batch, args.heads, d, generator=g).to(dtype)
    out = torch.empty_like(q)

    def step() -> float:
        t = time.perf_counter()
        for layer in range(args.layers):
            kernels.paged_decode_attention(q, cache, layer, tables, ctx, d ** -0.5, out)
        return time.perf_counter() - t

    step()
    sec = statistics.median(step() for _ in range(args.repeats))
    keys = args.layers * batch * kh * args.ctx
    return {"step_ms": sec * 1e3, "ns_per_key_per_kv_head": sec / keys * 1e9,
            "kv_read_gb_s": keys * 2 * d * dtype.itemsize / sec / 1e9}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--ctx", type=int, default=320)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=9, help="query heads (default: the embedded model's)")
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--runs", type=int, default=3, help="with --base: fresh processes per side, alternated")
    ap.add_argument("--base", type=Path, default=None, help="another checkout: each side a fresh process")
    ap.add_argument("--one-run", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.one_run is not None:
        print(json.dumps({str(b): measure(args, b) for b in args.batch}))
        return 0
    sides = {"this tree": Path(__file__).resolve().parent.parent}
    if args.base:
        sides["base"] = args.base.resolve()
    argv, skip = [], False  # the child gets this command's arguments but the side and the output file
    for a in sys.argv[1:]:
        if not skip and a.split("=")[0] not in ("--base", "--json"):
            argv.append(a)
        skip = not skip and a in ("--base", "--json")
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    for r in range(args.runs if args.base else 1):
        for name in alternated(list(sides), r):
            runs[name].append(run_in_tree(sides[name], "decode_attention.py", [*argv, "--one-run", str(r)]))
    print(f"{cpu_name()}; {args.dtype}, {args.threads} thread(s), {args.heads}/{args.kv_heads} heads of "
          f"{args.head_dim}, blocks of {args.block_size}, ctx {args.ctx}, {args.layers} layers; medians")
    result = {"cpu": cpu_name(), "args": {k: str(v) for k, v in vars(args).items()}, "sides": {}}
    print("| side | batch | ms a step (all layers) | ns / key / KV head | K/V read GB/s |\n|---|---|---|---|---|")
    for name, rs in runs.items():
        result["sides"][name] = {}
        for b in map(str, args.batch):
            m = {k: statistics.median(r[b][k] for r in rs) for k in rs[0][b]}
            result["sides"][name][b] = m
            print(f"| {name} | {b} | {m['step_ms']:.2f} | {m['ns_per_key_per_kv_head']:.2f} | {m['kv_read_gb_s']:.1f} |")
    write_json(args.json, result)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
