"""nanoserve's serving at several step token budgets (--max-num-batched-tokens), one server up at a
time, rounds alternated (A B / B A), fresh prompts per round, medians computed here.

    python bench/step_budget.py --budgets 1024,2048 --max-concurrency 8,32 --runs 3 \\
        --json bench/results/step_budget.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", default="1024,2048")
    ap.add_argument("--max-concurrency", default="8,32")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--server-args", default="--kv-cache-gb 1")
    ap.add_argument("--json", default=None, metavar="FILE")
    args = ap.parse_args()
    import serve_bench
    from serve_vs_vllm import METRICS
    from tests.server_fixture import ServerProcess
    from vllm_peer import cpu_name

    budgets = [int(b) for b in args.budgets.split(",")]
    raw: dict[int, dict[int, list[dict]]] = {}
    for c in (int(c) for c in args.max_concurrency.split(",")):
        raw[c] = {b: [] for b in budgets}
        for r in range(args.runs):
            for b in budgets if r % 2 == 0 else budgets[::-1]:
                srv = ServerProcess(*args.server_args.split(), "--max-num-batched-tokens", str(b), startup_timeout=600)
                try:
                    run = argparse.Namespace(base_url=srv.base_url, model=None, api_key=None,
                                             num_prompts=max(32, 2 * c), input_len=args.input_len,
                                             output_len=args.output_len, prefix_len=0, max_concurrency=c,
                                             request_rate=float("inf"), seed=1000 * c + r, timeout=600.0, warmup=True)
                    s = asyncio.run(serve_bench.run(run))
                finally:
                    srv.stop()
                if s["failed"]:
                    raise RuntimeError(f"budget {b}: {s['failed']} requests failed: {s['first_error']}")
                raw[c][b].append(s)
                print(f"  concurrency {c} round {r} budget {b:5d} " + "  ".join(f"{m} {f(s):.1f}" for m, f in METRICS),
                      flush=True)
    print(f"\n{cpu_name()}; {args.input_len} in / {args.output_len} out per request; medians of {args.runs}")
    print("| concurrency | budget | " + " | ".join(m for m, _ in METRICS) + " |\n|---|---|" + "---|" * len(METRICS))
    med = {}
    for c, by_budget in raw.items():
        for b, runs in by_budget.items():
            med[f"{c}/{b}"] = {m: statistics.median(f(s) for s in runs) for m, f in METRICS}
            print(f"| {c} | {b} | " + " | ".join(f"{med[f'{c}/{b}'][m]:.1f}" for m, _ in METRICS) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu_name(), "workload": vars(args), "medians": med,
                                               "raw": {str(c): {str(b): v for b, v in rb.items()} for c, rb in raw.items()}},
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
