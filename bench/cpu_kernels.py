"""The CPU kernels alone, as the engine calls them, with no engine around them:

  attention    paged decode attention (`paged_decode_attention`) as a decode step calls it: every
               layer in turn over a huge-page KV cache of random blocks (random block tables, so
               nothing is laid out better than an engine's would be), --batch sequences at --ctx
               tokens each: ms for all layers (median of --repeats), ns per key per KV head, and the
               K/V bytes read per second.
  gemv         one quantized GEMV (or a few-row GEMM) as the layer runs it: G weight-rows/s per core
               (N*K*rows / seconds / threads), median of --repeats timings, each the mean of enough
               calls to take ~0.2 s. Weights are random valid blocks (K-quants: random super-blocks;
               Q4_0/Q4_1/Q5_0/Q8_0: gguf's quantizer), laid out as the layer lays them out
               (`QuantTensor.packed_for`: packed where the build packs the type). --layer times
               QuantLinear instead of the kernel call (its own path choice: beyond a few rows the
               block layout dequantizes for the GEMM).
  quant-error  accuracy of a GGUF served from its blocks: teacher-forced prompt logprobs of the kept
               model and of the dequantized one, in fp32 and bf16, each against the dequantized model
               in fp32 (the HF-exact reference); mean and max |d logprob| over every prompt token after
               the first. In fp32 the kept model's products are exact (summation-order noise); in bf16
               on AVX512_VNNI CPUs its activations are rounded to int8 per 32-block, and the
               dequantized model in bf16 shows bf16's own share.

The kernel build follows the environment as the engine's does (NANOSERVE_CPU_MARCH=haswell measures
the AVX2 build on an AVX-512 machine). --base TREE: every run of either side is a fresh process with
that checkout's nanoserve, sides alternated over --runs; medians.

    python bench/cpu_kernels.py attention --batch 1 32 --threads 1
    python bench/cpu_kernels.py attention --dtype float32 --base /tmp/base --runs 3
    python bench/cpu_kernels.py gemv --threads 1 --repeats 5
    python bench/cpu_kernels.py gemv --layer --rows 512 2048 --shapes 2048x2048  # prefill, as the layer runs
    python bench/cpu_kernels.py quant-error [--model /tmp/random-1b-Q4_0.gguf]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: no thread spins on a shared core

from common import ROOT, OtherTree, alternate, child_argv, cpu_name, random_kquant, write_json  # noqa: E402

GEMV_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K")
# (N, K): small (K-quants need K % 256 == 0, so not the embedded model's 576); a 1B model's gate/up
GEMV_SHAPES = ("1536x768", "8192x2048")
PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "Once upon a time, in a land far away, there lived", "1, 2, 3, 4,",
           "The quick brown fox jumps over the lazy dog. " * 8]


def kernel_module(args, loader: str):
    """The CPU kernels' module `cpu_kernels.<loader>()` gives, torch on --threads threads."""
    import torch

    from nanoserve.kernels import cpu_kernels
    torch.set_num_threads(args.threads)
    module = getattr(cpu_kernels, loader)()
    if module is None:
        raise SystemExit("no CPU kernels in this build")
    return module


def attention(args) -> dict:
    import torch

    from nanoserve.layers import hugepages
    kernels = kernel_module(args, "load")
    dtype = getattr(torch, args.dtype)
    bs, d, kh = args.block_size, args.head_dim, args.kv_heads
    cases = {}
    for batch in args.batch:
        per_seq = -(-args.ctx // bs)
        n = batch * per_seq + 1
        shape = (n, args.layers, 2, kh, bs, d)
        cache = hugepages.zeros(n * args.layers * 2 * kh * bs * d * dtype.itemsize).view(dtype).view(shape)
        g = torch.Generator().manual_seed(batch)
        for b in range(n):  # in slices: a whole fp32 randn of a large cache would double the memory
            cache[b].copy_(torch.randn(shape[1:], generator=g))
        tables = (torch.randperm(n - 1, generator=g)[:batch * per_seq] + 1).view(batch, per_seq)
        tables = tables.contiguous()
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
        cases[f"batch {batch}"] = {"ms a step (all layers)": sec * 1e3,
                                   "ns / key / KV head": sec / keys * 1e9,
                                   "K/V read GB/s": keys * 2 * d * dtype.itemsize / sec / 1e9}
    about = (f"{args.dtype}, {args.threads} thread(s), {args.heads}/{args.kv_heads} heads of "
             f"{args.head_dim}, blocks of {args.block_size}, ctx {args.ctx}, {args.layers} layers")
    return {"about": about, "cases": cases}


def gemv_weights(rows: int, cols: int, name: str, seed: int = 0):
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from nanoserve.layers.quant_linear import QuantTensor
    qtype = GGMLQuantizationType[name]
    rng = np.random.default_rng(seed)
    if name.endswith("_K"):
        blocks = random_kquant(rows, cols, qtype, rng)
    else:
        blocks = quantize(rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(0.05), qtype)
    return QuantTensor(torch.from_numpy(blocks), int(qtype), (rows, cols))


def seconds_per_call(fn, budget: float = 0.2) -> float:
    fn()
    t0 = time.perf_counter()
    fn()
    n = max(1, int(budget / max(time.perf_counter() - t0, 1e-6)))
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def gemv(args) -> dict:
    import torch

    from nanoserve.layers.quant_linear import QuantLinear, Scratch
    k = kernel_module(args, "quant")
    dtype = getattr(torch, args.dtype)
    cases = {}
    for shape in args.shapes:
        n, kk = map(int, shape.split("x"))
        for name in args.types:
            w = gemv_weights(n, kk, name).packed_for(k)
            for rows in args.rows:
                x = torch.randn(rows, kk).to(dtype)
                out = torch.empty(rows, n, dtype=dtype)
                lin = QuantLinear([w], k, Scratch())
                call = ((lambda: lin(x)) if args.layer
                        else (lambda: k.quant_linear(x, w.data, w.kernel_type, out)))
                t = statistics.median(seconds_per_call(call) for _ in range(args.repeats))
                label = f"{name} {n}x{kk}, {rows} row(s), {'packed' if w.packed else 'blocks'}"
                cases[label] = {"bytes / weight": w.nbytes / (n * kk), "ms / call": t * 1e3,
                                "G weight-rows/s/core": n * kk * rows / t / args.threads / 1e9}
    about = (f"isa {k.isa()}, int8 activations {k.int8_activations()}, {args.threads} thread(s), "
             f"x {args.dtype}, median of {args.repeats}, {'QuantLinear' if args.layer else 'kernel call'}")
    return {"about": about, "cases": cases}


def prompt_logprobs(model: str | None, **kw) -> list[list[float]]:
    from nanoserve import LLM, SamplingParams
    llm = LLM(model, kv_cache_gb=0.2, enable_prefix_caching=False, **kw)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
        return [[t.logprob for t in o.prompt_logprobs[1:]] for o in outs]
    finally:
        llm.close()


def quant_error(args) -> dict:
    ref = prompt_logprobs(args.model, dtype="float32", gguf_dequantize=True)
    cases = {}
    for name, kw in (("kept, fp32", dict(dtype="float32")), ("kept, bf16", dict(dtype="bfloat16")),
                     ("dequantized, bf16", dict(dtype="bfloat16", gguf_dequantize=True))):
        got = prompt_logprobs(args.model, **kw)
        d = [abs(a - b) for x, y in zip(got, ref) for a, b in zip(x, y)]
        cases[name] = {"mean |d logprob|": sum(d) / len(d), "max |d logprob|": max(d)}
    return {"about": f"against the dequantized model in fp32, {sum(map(len, ref))} prompt tokens",
            "cases": cases}


MEASURE = {"attention": attention, "gemv": gemv, "quant-error": quant_error}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="{attention,gemv,quant-error}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--runs", type=int, default=3,
                        help="with --base: fresh processes per side, alternated")
    common.add_argument("--base", type=Path, default=None, help="another checkout: each side a fresh process")
    common.add_argument("--json", default=None, metavar="FILE", help="also write the result here")
    common.add_argument("--one-run", action="store_true", help=argparse.SUPPRESS)  # child: JSON out
    a = sub.add_parser("attention", parents=[common], help="paged decode attention")
    a.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    a.add_argument("--ctx", type=int, default=320)
    a.add_argument("--layers", type=int, default=30)
    a.add_argument("--heads", type=int, default=9, help="query heads (default: the embedded model's)")
    a.add_argument("--kv-heads", type=int, default=3)
    a.add_argument("--head-dim", type=int, default=64)
    a.add_argument("--block-size", type=int, default=16)
    a.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    a.add_argument("--threads", type=int, default=1)
    a.add_argument("--repeats", type=int, default=7)
    g = sub.add_parser("gemv", parents=[common], help="one quantized GEMV / few-row GEMM")
    g.add_argument("--threads", type=int, default=1)
    g.add_argument("--repeats", type=int, default=5)
    g.add_argument("--rows", type=int, nargs="+", default=[1], help="x rows per call (decode: 1..64)")
    g.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    g.add_argument("--types", nargs="+", default=list(GEMV_TYPES), choices=GEMV_TYPES)
    g.add_argument("--shapes", nargs="+", default=list(GEMV_SHAPES), metavar="NxK")
    g.add_argument("--layer", action="store_true", help="time QuantLinear instead of the kernel call")
    q = sub.add_parser("quant-error", parents=[common], help="a GGUF's logprobs, kept vs dequantized")
    q.add_argument("--model", default=None, help="a GGUF file (default: the embedded SmolLM2-135M)")
    return ap.parse_args()


def main() -> int:
    args = parse_args()
    measure = MEASURE[args.cmd]
    if args.one_run:
        print(json.dumps(measure(args)))
        return 0
    sides = {"this tree": OtherTree(ROOT, "cpu_kernels.py", [*child_argv(sys.argv[1:]), "--one-run"])}
    if args.base:
        sides["base"] = OtherTree(args.base.resolve(), "cpu_kernels.py", sides["this tree"].argv)
    runs = alternate(list(sides), args.runs if args.base else 1,
                     lambda name, r: sides[name].run_child() if args.base else measure(args))
    first = runs["this tree"][0]
    metrics = list(next(iter(first["cases"].values())))
    print(f"{cpu_name()}; {first['about']}" + (f"; medians of {args.runs} runs" if args.base else ""))
    print(f"| side | case | {' | '.join(metrics)} |\n" + "|---" * (2 + len(metrics)) + "|")
    result = {"cpu": cpu_name(), "args": {k: str(v) for k, v in vars(args).items()},
              "about": {name: rs[0]["about"] for name, rs in runs.items()}, "sides": {}}
    for name, rs in runs.items():
        med = {case: {m: statistics.median(r["cases"][case][m] for r in rs) for m in metrics}
               for case in rs[0]["cases"]}
        result["sides"][name] = med
        for case, m in med.items():
            print(f"| {name} | {case} | " + " | ".join(f"{v:.4g}" for v in m.values()) + " |")
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
