"""Per-core decode and cold TTFT, nanoserve vs vLLM-CPU, offline, in one run.

    python bench/decode_vs_vllm.py --runs 3 --json bench/results/decode_vs_vllm.json

Cold TTFT: one fresh prompt of each --ttft-lens length (no prefix either side has seen) with
max_tokens=1, timed around generate (nanoserve with a 2048-token step budget, set here; the CPU default
of 1024 measured the same on cold prompts: a 4000-token prompt is a fresh chunk then continuations over
the cached part; vLLM at its default chunking, its context capped at 4096, hence 4000 rather than 4096).

Decode: the time of one decode step with 8 sequences on one compute thread.
The same method on both sides, from outside the engine: generate 8 fresh prompts with max_tokens=1
(prefill and the first token) and 8 other fresh prompts of the same length with max_tokens=1+K;
the difference over K is one decode step of 8 sequences (context 256..256+K). Both use one compute
thread: vLLM's own CPU binding already gives its worker all cores but one (one on 2 cores, the
other is reserved for its scheduler); nanoserve gets torch.set_num_threads(1) and the same core.
Same dtype (`--dtype auto`'s pick) and KV budget (1 GiB); runs alternate A B, B A, ...; medians."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--ttft-lens", default="256,1024,4000", help="cold TTFT prompt lengths ('' = none)")
    ap.add_argument("--skip-decode", action="store_true", help="cold TTFT only")
    ap.add_argument("--json", default=None, metavar="FILE")
    args = ap.parse_args()
    import torch

    from export_hf import export_embedded_hf
    from offline_throughput import Nanoserve, make_prompts
    from vllm_peer import VllmOffline, auto_dtype, cpu_name
    dtype = auto_dtype()
    core = max(os.sched_getaffinity(0))  # vLLM binds its worker to the last cores, reserving the first
    peer = VllmOffline(export_embedded_hf(), dtype)
    try:
        os.sched_setaffinity(0, {core})
        torch.set_num_threads(1)
        ours = Nanoserve(argparse.Namespace(model=None, dtype=dtype, block_size=0, max_num_seqs=args.seqs,
                                            max_num_batched_tokens=max(2048, args.seqs * args.input_len),
                                            kv_cache_gb=1))
        steps: dict[str, list[float]] = {"nanoserve": [], "vllm": []}
        prefill: dict[str, list[float]] = {"nanoserve": [], "vllm": []}  # the max_tokens=1 runs
        lens = [int(x) for x in args.ttft_lens.split(",") if x]
        ttft: dict[int, dict[str, list[float]]] = {n: {"nanoserve": [], "vllm": []} for n in lens}
        for r in range(args.runs):
            for n in lens:
                for name, target in [("nanoserve", ours), ("vllm", peer)][:: 1 if r % 2 == 0 else -1]:
                    seed = 7000 + 100 * r + 10 * lens.index(n) + (name == "vllm")
                    ttft[n][name].append(target.run(make_prompts(1, n, seed), 1)["elapsed_s"] * 1e3)
                print(f"  run {r} cold TTFT {n:5d} tokens: nanoserve {ttft[n]['nanoserve'][-1]:.0f} ms, "
                      f"vLLM {ttft[n]['vllm'][-1]:.0f} ms", flush=True)
        for r in range(args.runs if not args.skip_decode else 0):
            for name, target in [("nanoserve", ours), ("vllm", peer)][:: 1 if r % 2 == 0 else -1]:
                seed = 100 * (r + 1) + (name == "vllm")
                one = target.run(make_prompts(args.seqs, args.input_len, seed), 1)["elapsed_s"]
                more = target.run(make_prompts(args.seqs, args.input_len, seed + 50), 1 + args.decode_steps)["elapsed_s"]
                steps[name].append((more - one) / args.decode_steps * 1e3)
                prefill[name].append(one * 1e3)
                print(f"  run {r} {name:9s} decode step {steps[name][-1]:.2f} ms; prefill + 1 token "
                      f"{one * 1e3:.0f} ms", flush=True)
    finally:
        peer.close()
    ttft_med = {n: {k: statistics.median(v) for k, v in d.items()} for n, d in ttft.items()}
    print(f"\n{cpu_name()}; dtype {dtype}; one compute thread")
    if lens:
        print(f"| cold TTFT (median of {args.runs}) | nanoserve ms | vLLM-CPU ms | nanoserve / vLLM |\n|---|---|---|---|")
        for n, m in ttft_med.items():
            print(f"| {n} tokens | {m['nanoserve']:.0f} | {m['vllm']:.0f} | {m['nanoserve'] / m['vllm']:.2f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu_name(), "dtype": dtype, "args": vars(args), "ttft_ms": ttft,
                                               "ttft_medians_ms": ttft_med, "steps_ms": steps, "prefill_ms": prefill},
                                              indent=1))
    if args.skip_decode:
        return 0
    med = {k: statistics.median(v) for k, v in steps.items()}
    pre = {k: statistics.median(v) for k, v in prefill.items()}
    print(f"{args.seqs} sequences, context {args.input_len}..{args.input_len + args.decode_steps}")
    print(f"decode step (median of {args.runs}): nanoserve {med['nanoserve']:.2f} ms, vLLM-CPU {med['vllm']:.2f} ms, "
          f"vLLM / nanoserve = {med['vllm'] / med['nanoserve']:.2f}x")
    print(f"prefill of {args.seqs} x {args.input_len} tokens + first token (median): nanoserve {pre['nanoserve']:.0f} ms, "
          f"vLLM-CPU {pre['vllm']:.0f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu_name(), "dtype": dtype, "args": vars(args),
                                               "ttft_ms": ttft, "ttft_medians_ms": ttft_med,
                                               "steps_ms": steps, "medians_ms": med,
                                               "prefill_ms": prefill, "prefill_medians_ms": pre}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
