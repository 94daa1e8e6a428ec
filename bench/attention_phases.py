"""Per-phase time of the C++ paged prefill attention kernel (pack K/V, load Q, QK^T GEMM, softmax,
PV GEMM, store O), on the shapes one cold prefill of the embedded model gives it, one thread.

    python bench/attention_phases.py --runs 5 --json bench/results/attention_phases.json

Builds a second copy of nanoserve/csrc/cpu_kernels.cpp with -DNS_PHASE_TIMES (a clock read at the
end of each phase of each tile, summed over threads) next to the normal build, and times both on
the same random paged cache: `kernel` is the normal build's wall time per call (the number that
counts), `timed build` the instrumented one's, whose phases add up to it. Also PyTorch's SDPA on
the same query/keys (the torch path: the chunk itself causally, or its gathered context with a
mask). Cases: a fresh 1024-token prompt, a fresh 2048-token chunk, and the 1952-token chunk that
completes a 4000-token prompt over its cached first 2048 (nanoserve's default chunking); and one
decode step's attention for --decode-seqs sequences of --decode-ctx tokens (the decode kernel:
phases q.k, softmax, p.V; torch path: gather + bmm), with the K/V bytes it reads per second.
Useful FLOPs: 4 * head_dim * heads * visible (query, key) pairs. Medians of --runs calls."""
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
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head_dim (default: the embedded model)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--decode-seqs", type=int, default=32)
    ap.add_argument("--decode-ctx", type=int, default=270)
    ap.add_argument("--define", default="", help="extra -D flags for the timed build (A/B of a variant), e.g. NS_QROWS=256")
    ap.add_argument("--json", default=None, metavar="FILE")
    args = ap.parse_args()
    import torch
    from torch.utils.cpp_extension import load as build

    from nanoserve.layers import cpu_kernels
    from nanoserve.layers.attention import AttentionBatch, TorchAttention
    from vllm_peer import cpu_name
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    fast = cpu_kernels.load()
    assert fast is not None, "the C++ kernels did not build"
    defines = [f"-D{x}" for x in args.define.split(",") if x]
    timed = build("nanoserve_cpu_phases" + "".join(x.replace("=", "_")[1:] for x in defines), sources=[str(cpu_kernels.SOURCE)],
                  extra_cflags=["-O3", "-march=native", "-mprefer-vector-width=512", "-ffp-contract=off",
                                "-fopenmp", "-fopenmp-simd", "-DNS_PHASE_TIMES", *defines], extra_ldflags=["-fopenmp"])
    h, kh, d = (int(x) for x in args.heads.split(","))
    bs = args.block_size
    cases = {"fresh 1024": [(1024, 1024)], "fresh 2048": [(2048, 2048)], "1952 over 4000": [(1952, 4000)],
             f"decode {args.decode_seqs} x {args.decode_ctx}": [(1, args.decode_ctx)] * args.decode_seqs}
    g = torch.Generator().manual_seed(0)
    res: dict[str, dict] = {}
    for name, seqs in cases.items():
        nblk = [-(-ctx // bs) for _, ctx in seqs]
        cache = torch.randn(sum(nblk) + 1, 1, 2, kh, bs, d, generator=g).to(dtype)
        perm = torch.randperm(sum(nblk) + 1, generator=g).tolist()
        tables = [[perm.pop() for _ in range(b)] for b in nblk]
        blocks = torch.tensor([t[p // bs] for (n, ctx), t in zip(seqs, tables) for p in range(ctx - n, ctx)])
        offs = torch.tensor([p % bs for n, ctx in seqs for p in range(ctx - n, ctx)])
        lens, ctxs = [n for n, _ in seqs], [c for _, c in seqs]
        decode = all(n == 1 for n in lens)
        batch = AttentionBatch(lens, ctxs, tables, len(seqs) if decode else 0, blocks, offs)
        q = torch.randn(sum(lens), h, d, generator=g).to(dtype)
        k = cache[:, 0, 0].permute(0, 2, 1, 3)[blocks, offs]
        v = cache[:, 0, 1].permute(0, 2, 1, 3)[blocks, offs]
        kv_bytes = 2 * sum(ctxs) * kh * d * cache.element_size()
        flops = sum(4 * d * h * (n * ctx - n * (n - 1) / 2) for n, ctx in seqs)
        times: dict[str, list[float]] = {"kernel": [], "timed build": [], "torch SDPA": []}
        phases: list[dict[str, float]] = []
        outs = {}
        for r in range(args.runs + 1):  # the first round warms up (brgemm JIT, page faults)
            for mode, kern in (("kernel", fast), ("timed build", timed), ("torch SDPA", None)):
                attn = TorchAttention(cache, h, d ** -0.5, kern)
                attn.prepare(batch)
                if kern is timed:
                    timed.phase_times()
                t = time.perf_counter()
                outs[mode] = attn.forward(q, k, v, 0)
                if r:
                    times[mode].append(time.perf_counter() - t)
                    if kern is timed:
                        phases.append(timed.phase_times())
        torch.testing.assert_close(outs["kernel"].float(), outs["torch SDPA"].float(), atol=3e-2, rtol=3e-2)
        med = {m: statistics.median(t) * 1e3 for m, t in times.items()}
        ph = {p: statistics.median(x[p] for x in phases) * 1e3 for p in phases[0]}
        ph = {p: v for p, v in ph.items() if any(x[p] for x in phases)}
        res[name] = {"sequences": seqs, "kv_gb_per_s": {m: kv_bytes / t / 1e6 for m, t in med.items()}, "gflop": flops / 1e9, "ms": times, "medians_ms": med,
                     "gflops": {m: flops / t / 1e6 for m, t in med.items()}, "phases_ms": ph}
        print(f"{name}: kernel {med['kernel']:.1f} ms ({flops / med['kernel'] / 1e6:.0f} GFLOP/s), timed build "
              f"{med['timed build']:.1f} ms, torch path {med['torch SDPA']:.1f} ms ({flops / med['torch SDPA'] / 1e6:.0f} "
              f"GFLOP/s); kernel reads K/V at {kv_bytes / med['kernel'] / 1e6:.1f} GB/s", flush=True)
        print("   " + ", ".join(f"{p} {v:.1f} ms ({100 * v / sum(ph.values()):.0f}%)" for p, v in ph.items()), flush=True)
    print(f"\n{cpu_name()}; {args.dtype}; heads {h}/{kh}, head_dim {d}; {args.threads} thread(s); "
          f"AMX {'on' if fast.amx() else 'off'}; medians of {args.runs}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"cpu": cpu_name(), "args": vars(args), "cases": res}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
