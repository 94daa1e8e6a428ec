"""Same-run A/B of the C++ attention kernels between this checkout and another one (e.g. a baseline
made with `git worktree add /tmp/base <rev>`): both checkouts' nanoserve/csrc/cpu_kernels.cpp are
built (as the server builds them) and called alternately, on one thread, on the same random paged
cache and queries: the prefill kernel on a fresh prompt of each --fresh length and on --chunk tokens
completing a --context-token prompt over its cached start, and the decode kernel on --decode-seqs
sequences of --decode-ctx tokens. Useful FLOPs as in bench/attention_phases.py.

    python bench/kernel_ab.py --base /tmp/base --runs 7 --json bench/results/kernel_ab.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
HERE = Path(__file__).resolve().parent.parent
FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffp-contract=off", "-fopenmp", "-fopenmp-simd"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, type=Path, help="the other checkout (the baseline)")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head_dim (default: the embedded model)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--fresh", default="1024,1536", help="fresh prompt lengths")
    ap.add_argument("--chunk", default="1952,4000", help="chunk tokens, context tokens (0,0: none)")
    ap.add_argument("--decode-seqs", type=int, default=32)
    ap.add_argument("--decode-ctx", type=int, default=270)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    import hashlib

    import torch
    from torch.utils.cpp_extension import load as build

    from vllm_peer import cpu_name
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    mods = {}
    for side, root in (("this", HERE), ("base", args.base.resolve())):
        src = root / "nanoserve" / "csrc" / "cpu_kernels.cpp"
        mods[side] = build(f"nanoserve_ab_{hashlib.sha256(src.read_bytes()).hexdigest()[:12]}", sources=[str(src)],
                           extra_cflags=FLAGS, extra_ldflags=["-fopenmp"])
    h, kh, d = (int(x) for x in args.heads.split(","))
    bs = args.block_size
    cases = {f"fresh {n}": [(n, n)] for n in (int(x) for x in args.fresh.split(",") if x)}
    n, ctx = (int(x) for x in args.chunk.split(","))
    if n:
        cases[f"{n} over {ctx}"] = [(n, ctx)]
    if args.decode_seqs:
        cases[f"decode {args.decode_seqs} x {args.decode_ctx}"] = [(1, args.decode_ctx)] * args.decode_seqs
    g = torch.Generator().manual_seed(0)
    res: dict[str, dict] = {}
    for name, seqs in cases.items():
        nblk = [-(-c // bs) for _, c in seqs]
        cache = torch.randn(sum(nblk) + 1, 1, 2, kh, bs, d, generator=g).to(dtype)
        perm = torch.randperm(sum(nblk) + 1, generator=g).tolist()
        tables = torch.tensor([[perm.pop() for _ in range(b)] + [0] * (max(nblk) - b) for b in nblk])
        lens, ctxs = torch.tensor([a for a, _ in seqs]), torch.tensor([c for _, c in seqs])
        q = torch.randn(int(lens.sum()), h, d, generator=g).to(dtype)
        flops = sum(4 * d * h * (a * c - a * (a - 1) / 2) for a, c in seqs)
        decode = bool((lens == 1).all())

        def call(mod):
            if decode:
                return mod.paged_decode_attention(q, cache, 0, tables, ctxs, d ** -0.5)
            out = torch.empty_like(q)
            starts = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)[:-1]])
            mod.paged_prefill_attention(q, out, cache, 0, tables, starts, lens, ctxs, d ** -0.5, True)
            return out

        times: dict[str, list[float]] = {s: [] for s in mods}
        outs = {}
        for r in range(args.runs + 1):  # round 0 warms up (brgemm JIT, page faults)
            for side in (("this", "base") if r % 2 else ("base", "this")):
                t = time.perf_counter()
                outs[side] = call(mods[side])
                if r:
                    times[side].append(time.perf_counter() - t)
        diff = (outs["this"].float() - outs["base"].float()).abs().max().item()
        med = {s: statistics.median(t) * 1e3 for s, t in times.items()}
        res[name] = {"sequences": seqs, "gflop": flops / 1e9, "ms": times, "medians_ms": med,
                     "ratio": med["this"] / med["base"], "max_abs_diff": diff}
        print(f"{name}: this {med['this']:.2f} ms ({flops / med['this'] / 1e6:.0f} GFLOP/s), base {med['base']:.2f} ms "
              f"({flops / med['base'] / 1e6:.0f} GFLOP/s): {med['this'] / med['base']:.3f}x the time; "
              f"max |this - base| {diff:.2e}", flush=True)
    print(f"\n{cpu_name()}; {args.dtype}; heads {h}/{kh}, head_dim {d}; {args.threads} thread(s); medians of {args.runs}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"cpu": cpu_name(), "args": {k: str(v) for k, v in vars(args).items()},
                                         "cases": res}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
