"""Cold TTFT of the offline engine (fresh random-token prompts, max_tokens=1, no prefix caching), and
with --base a same-run A/B against another checkout (e.g. `git worktree add /tmp/base <rev>`): each
run is a fresh process of that checkout's nanoserve, the two alternated, medians computed here.

    python bench/cold_ttft.py --threads 2 --runs 3 [--base /tmp/base] [--budget 1024]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path


def measure(args) -> dict[int, float]:
    import torch
    from nanoserve import LLM, SamplingParams
    torch.set_num_threads(args.threads)
    budget = {"max_num_batched_tokens": args.budget} if args.budget else {}  # else the tree's own default
    llm = LLM(None, kv_cache_gb=1, enable_prefix_caching=False, **budget)
    rng, params = random.Random(args.seed), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    ids = lambda n: {"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(n)]}  # noqa: E731
    llm.generate([ids(300)], params)  # warm-up
    out = {}
    for n in (int(x) for x in args.lens.split(",")):
        times = []
        for _ in range(args.prompts):
            t = time.perf_counter()
            llm.generate([ids(n)], params)
            times.append((time.perf_counter() - t) * 1e3)
        out[n] = statistics.median(times)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lens", default="1024,4000")
    ap.add_argument("--prompts", type=int, default=3, help="fresh prompts per length and run (median)")
    ap.add_argument("--budget", type=int, default=None, help="--max-num-batched-tokens (default: the engine's)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--base", type=Path, default=None, help="the other checkout (the baseline)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # child: one run, JSON out
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args)))
        return 0
    here = Path(__file__).resolve().parent.parent
    trees = {"this": here, **({"base": args.base.resolve()} if args.base else {})}
    got: dict[str, list[dict]] = {k: [] for k in trees}
    for r in range(args.runs):
        for name in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
            cmd = [sys.executable, str(Path(__file__).resolve()), "--one", "--threads", str(args.threads),
                   "--lens", args.lens, "--prompts", str(args.prompts), "--seed", str(r)]
            cmd += ["--budget", str(args.budget)] if args.budget else []
            out = subprocess.run(cmd, cwd=trees[name], env=dict(os.environ, PYTHONPATH=str(trees[name])),
                                 capture_output=True, text=True, check=True).stdout
            got[name].append(json.loads(out.strip().splitlines()[-1]))
            print(f"  run {r} {name}: " + ", ".join(f"{n} tokens {ms:.0f} ms" for n, ms in got[name][-1].items()), flush=True)
    for n in args.lens.split(","):
        med = {k: statistics.median(run[n] for run in v) for k, v in got.items()}
        ratio = f", this / base {med['this'] / med['base']:.2f}x" if "base" in med else ""
        print(f"{n} tokens, {args.threads} thread(s), median of {args.runs}: "
              + ", ".join(f"{k} {v:.0f} ms" for k, v in med.items()) + ratio)
    return 0


if __name__ == "__main__":
    sys.exit(main())
