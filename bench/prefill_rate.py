"""Prefill attention FLOP rate against the linear layers' FLOP rate, in one prefill, same run.

    python bench/prefill_rate.py --tokens 1536 --runs 3 --json bench/results/prefill_rate.json

The embedded model (SmolLM2-135M: 9 heads, 3 KV heads, head_dim 64) prefills one fresh prompt of
--tokens tokens (max_tokens=1, chunked at --chunk tokens: later chunks attend over cached context);
every attention call and every linear-layer call of that prefill is timed (perf_counter around
each call) and its useful FLOPs counted: causal attention 4 * head_dim * heads * visible pairs,
linear 2 * rows * weight elements. Attention runs three ways, alternated per round with fresh
prompts: the C++ kernel with AMX tiles (where the CPU has them), the C++ kernel on fp32 GEMMs,
and the torch path (PyTorch's CPU SDPA). Medians over --runs; threads: torch's default."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1536)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--json", default=None, metavar="FILE")
    args = ap.parse_args()
    import torch

    from nanoserve import LLM, SamplingParams
    from nanoserve.layers import linear
    from offline_throughput import make_prompts
    from vllm_peer import cpu_name
    llm = LLM(None, dtype=args.dtype, enable_prefix_caching=False, max_num_batched_tokens=args.chunk)
    eng = llm.engine
    attn, kernels, model = eng.runner.attn, eng.runner.attn.kernels, eng.model
    acc = {"attn_s": 0.0, "attn_flop": 0.0, "lin_s": 0.0, "lin_flop": 0.0}

    def timed(fn, kind, flops):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            out = fn(*a, **kw)
            acc[kind + "_s"] += time.perf_counter() - t
            acc[kind + "_flop"] += flops(*a, **kw)
            return out
        return wrapper

    def attn_flops(q, *_):
        b = attn.batch
        pairs = sum(n * c - n * (n - 1) / 2 for n, c in zip(b.query_lens, b.context_lens))
        return 4 * q.shape[-1] * q.shape[1] * pairs

    attn.forward = timed(attn.forward, "attn", attn_flops)
    lin_flops = lambda self, x, *_: 2 * x.shape[0] * self.weight.numel()  # noqa: E731
    for name in ("__call__", "silu", "times"):
        setattr(linear.Linear, name, timed(getattr(linear.Linear, name), "lin", lin_flops))
    modes = {"kernel+AMX": (kernels, True), "kernel fp32 GEMM": (kernels, False), "torch SDPA": (None, True)}
    if kernels is None or not kernels.amx():
        modes.pop("kernel+AMX")
    if kernels is None:
        modes.pop("kernel fp32 GEMM")
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate(make_prompts(1, args.tokens, 1), params)  # warm-up (kernel build, brgemm JIT)
    res: dict[str, dict[str, list[float]]] = {m: {"attn": [], "lin": [], "total_ms": []} for m in modes}
    for r in range(args.runs):
        for i, (mode, (kern, amx)) in enumerate(list(modes.items())[:: 1 if r % 2 == 0 else -1]):
            attn.kernels, attn.amx = kern, amx
            acc.update(dict.fromkeys(acc, 0.0))
            t = time.perf_counter()
            llm.generate(make_prompts(1, args.tokens, 1000 * r + i + 7), params)
            res[mode]["total_ms"].append((time.perf_counter() - t) * 1e3)
            res[mode]["attn"].append(acc["attn_flop"] / acc["attn_s"] / 1e9)
            res[mode]["lin"].append(acc["lin_flop"] / acc["lin_s"] / 1e9)
            print(f"  run {r} {mode:17s} attention {res[mode]['attn'][-1]:6.0f} GFLOP/s ({acc['attn_s'] * 1e3:.0f} ms)  "
                  f"linear {res[mode]['lin'][-1]:6.0f} GFLOP/s ({acc['lin_s'] * 1e3:.0f} ms)  "
                  f"prefill {res[mode]['total_ms'][-1]:.0f} ms", flush=True)
    attn.kernels, attn.amx = kernels, True
    print(f"\n{cpu_name()}; dtype {model.embed.dtype}; {args.tokens}-token prefill, chunks of {args.chunk}, "
          f"{torch.get_num_threads()} threads; medians of {args.runs}")
    print("| attention | attention GFLOP/s | linear GFLOP/s | attention / linear | prefill ms |\n|---|---|---|---|---|")
    med = {}
    for mode, v in res.items():
        med[mode] = {k: statistics.median(x) for k, x in v.items()}
        m = med[mode]
        print(f"| {mode} | {m['attn']:.0f} | {m['lin']:.0f} | {m['attn'] / m['lin']:.2f} | {m['total_ms']:.0f} |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"cpu": cpu_name(), "dtype": str(model.embed.dtype), "args": vars(args),
                                               "threads": torch.get_num_threads(), "raw": res, "medians": med}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
