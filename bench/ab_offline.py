"""Same-run A/B of offline throughput between this checkout and another one (e.g. a baseline made
with `git worktree add /tmp/base <rev>`): runs bench/offline_throughput.py from each checkout in
turn, alternating, and reports the medians and their ratio.

    python bench/ab_offline.py --base /tmp/base --runs 3 -- --num-prompts 16 --output-len 64 --repeats 1
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def run_once(checkout: Path, bench_args: list[str]) -> float:
    env = dict(os.environ, PYTHONPATH=str(checkout))  # that checkout's nanoserve, not the installed one
    out = subprocess.run([sys.executable, str(checkout / "bench" / "offline_throughput.py"), *bench_args],
                         cwd=checkout, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["nanoserve"]["output_tok_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, type=Path, help="the other checkout (the baseline)")
    ap.add_argument("--runs", type=int, default=3, help="alternated runs per side")
    ap.add_argument("--json", type=Path, default=None, help="write the raw numbers here")
    ap.add_argument("bench_args", nargs="*", help="arguments for offline_throughput.py (after --)")
    args = ap.parse_args()
    sides = {"this": HERE, "base": args.base.resolve()}
    runs: dict[str, list[float]] = {k: [] for k in sides}
    for i in range(args.runs):
        for name in (("this", "base") if i % 2 else ("base", "this")):
            runs[name].append(run_once(sides[name], args.bench_args))
            print(f"run {i + 1} {name}: {runs[name][-1]:.1f} output tok/s", flush=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    result = {"runs": runs, "median": med, "ratio_this_over_base": med["this"] / med["base"],
              "bench_args": args.bench_args}
    print(f"median output tok/s: this {med['this']:.1f}, base {med['base']:.1f}, "
          f"ratio {result['ratio_this_over_base']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
