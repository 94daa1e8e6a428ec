"""One quantized GEMV (or a few-row GEMM) through the CPU kernels, as the layer runs it: G weight-rows/s
per core (N*K*rows / seconds / threads), median of --repeats timings, each the mean of enough calls to take
~0.2 s. Weights are random valid blocks (K-quants: random super-blocks; Q4_0: gguf's quantizer),
laid out as the layer lays them out (`QuantTensor.packed_for`: packed where the build packs the type).

    python bench/quant_gemv.py --threads 1 --repeats 5
    python bench/quant_gemv.py --threads 2 --rows 1 8 --dtype float32
    python bench/quant_gemv.py --layer --rows 512 2048 --shapes 2048x2048   # prefill, as the layer runs it
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from nanoserve.kernels import cpu_kernels  # noqa: E402
from nanoserve.layers.quant_linear import Q4_0, Q4_1, Q4_K, Q6_K, Q8_0, QuantLinear, QuantTensor, Scratch  # noqa: E402

TYPES = {"Q4_0": Q4_0, "Q4_1": Q4_1, "Q8_0": Q8_0, "Q4_K": Q4_K, "Q6_K": Q6_K}
SHAPES = [(1536, 768), (8192, 2048)]  # (N, K): small (K-quants need K % 256 == 0: not 576); a 1B model gate/up


def weights(rows: int, cols: int, qtype: int, seed: int = 0) -> QuantTensor:
    g = np.random.default_rng(seed)
    if qtype in (Q4_0, Q4_1, Q8_0):
        from gguf.quants import quantize
        return QuantTensor(torch.from_numpy(quantize(g.standard_normal((rows, cols), dtype=np.float32) * 0.05, qtype)),
                           qtype, (rows, cols))
    nbytes = 144 if qtype == Q4_K else 210
    b = g.integers(0, 256, (rows, cols // 256, nbytes), dtype=np.uint8)
    d = g.uniform(1e-4, 3e-4, (rows, cols // 256)).astype(np.float16).view(np.uint8).reshape(rows, -1, 2)
    if qtype == Q4_K:
        b[..., 0:2], b[..., 2:4] = d, d
    else:
        b[..., 208:210] = d
    return QuantTensor(torch.from_numpy(b.reshape(rows, -1)), qtype, (rows, cols))


def seconds_per_call(fn, budget: float = 0.2) -> float:
    fn()
    n, t0 = 1, time.perf_counter()
    fn()
    one = time.perf_counter() - t0
    n = max(1, int(budget / max(one, 1e-6)))
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rows", type=int, nargs="+", default=[1], help="x rows per call (decode: 1..64)")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--types", nargs="+", default=list(TYPES), choices=list(TYPES))
    ap.add_argument("--layer", action="store_true",
                    help="time QuantLinear (its own path choice: beyond a few rows the block layout dequantizes for "
                         "the GEMM) instead of the kernel call")
    ap.add_argument("--kquant-source", default=None,
                    help="build this kquant_kernels.cpp as the K-quant module (before/after: `git show REV:path`)")
    ap.add_argument("--shapes", nargs="+", default=[f"{n}x{k}" for n, k in SHAPES], help="NxK")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    k = cpu_kernels.quant()
    if args.kquant_source and k is not None:
        k = cpu_kernels.QuantKernels(k.blocks, cpu_kernels._build("nanoserve_kquant_alt", Path(args.kquant_source)))
    if k is None:
        print("no CPU kernels")
        return 1
    dtype = getattr(torch, args.dtype)
    print(f"isa {k.isa()}, int8 activations {k.int8_activations()}, threads {args.threads}, x {args.dtype}, "
          f"median of {args.repeats}, {'QuantLinear' if args.layer else 'kernel call'}")
    print("| type | N x K | rows | layout | bytes/weight | ms/call | G weight-rows/s/core |\n|---|---|---|---|---|---|---|")
    for shape in args.shapes:
        n, kk = map(int, shape.split("x"))
        for name in args.types:
            w = weights(n, kk, TYPES[name]).packed_for(k)
            for rows in args.rows:
                x = torch.randn(rows, kk).to(dtype)
                out = torch.empty(rows, n, dtype=dtype)
                lin = QuantLinear([w], k, Scratch())
                call = (lambda: lin(x)) if args.layer else (lambda: k.quant_linear(x, w.data, w.kernel_type, out))
                times = [seconds_per_call(call) for _ in range(args.repeats)]
                t = statistics.median(times)
                print(f"| {name} | {n}x{kk} | {rows} | {'packed' if w.packed else 'blocks'} | "
                      f"{w.nbytes / (n * kk):.4f} | {t * 1e3:.3f} | {n * kk * rows / t / args.threads / 1e9:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
