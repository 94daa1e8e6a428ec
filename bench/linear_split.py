"""The embedded model's four projections (qkv, o, gate / up, down) as one prefill of N rows, bf16:
one thread, oneDNN's own split over 2 threads, and the row split (`linear_rows`: each thread its own
rows, one single-threaded oneDNN call each). Medians of --runs timings of --reps passes; the row
range where layers/linear.py uses the split comes from this.

    python bench/linear_split.py --rows 256,512,1024,1536,2048
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
SHAPES = [(960, 576), (576, 576), (1536, 576), (576, 1536)]  # (out, in): qkv, o, gate or up, down


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="256,512,768,1024,1280,1536,2048")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    from nanoserve.layers import cpu_kernels
    from nanoserve.layers.linear import Linear
    from vllm_peer import cpu_name
    kernels = cpu_kernels.load()
    if kernels is None or not kernels.amx():
        print("needs the C++ kernels and AMX (the split is only used there)")
        return 1
    g = torch.Generator().manual_seed(0)
    lins = [Linear((torch.randn(n, k, generator=g) * 0.02).bfloat16()) for n, k in SHAPES]

    def timed(xs: list[torch.Tensor], split: bool) -> float:
        t = time.perf_counter()
        for _ in range(args.reps):
            for lin, x in zip(lins, xs):
                kernels.linear_rows(x, lin.packed, None, lin.weight.shape[0], "none", None) if split else lin(x)
        return (time.perf_counter() - t) / args.reps * 1e3

    print(f"{cpu_name()}; bf16; ms per pass over the four projections (GFLOP/s), medians of {args.runs}")
    print("| rows | 1 thread | oneDNN, 2 threads | row split, 2 threads |\n|---|---|---|---|")
    with torch.inference_mode():
        for m in (int(r) for r in args.rows.split(",")):
            xs = [torch.randn(m, k, generator=g).bfloat16() for _, k in SHAPES]
            flops = sum(2 * m * n * k for n, k in SHAPES)
            cells = []
            for threads, split in ((1, False), (2, False), (2, True)):
                torch.set_num_threads(threads)
                timed(xs, split)  # warm-up: oneDNN builds its kernels for this shape
                ms = statistics.median(timed(xs, split) for _ in range(args.runs))
                cells.append(f"{ms:.2f} ({flops / ms / 1e6:.0f})")
            print(f"| {m} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
