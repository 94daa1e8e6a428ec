"""Same-run A/B of HTTP serving between this checkout and another one (e.g. a baseline made with
`git worktree add /tmp/base <rev>`): both servers up at once, each running its own checkout's code,
the same flags; a warm-up each, then --runs rounds of bench/serve_bench.py alternating the order,
fresh prompts per round (seed = round). Reports the median of each metric and the ratio.
With --sequential only one server is up at a time (started, warmed up and measured per round).
Both up, the server started first was the slower one whatever its code (same tree pair, Xeon AMX:
this/base output tok/s 0.908 with this started first, 1.061 with --base-first; 1.016 sequential),
so a both-up A/B runs both orders (--base-first) and reads their geometric mean, or uses
--sequential. Why start order matters there has not been measured.

    python bench/ab_serve.py --base /tmp/base --runs 3 --json bench/results/ab_serve.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, type=Path, help="the other checkout (the baseline)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-concurrency", type=int, default=8)
    ap.add_argument("--server-args", default="--kv-cache-gb 1", help="flags for both servers")
    ap.add_argument("--sequential", action="store_true", help="one server up at a time")
    ap.add_argument("--base-first", action="store_true", help="both up: start the base server first")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    import serve_bench
    from serve_vs_vllm import METRICS, bench_args
    from tests.server_fixture import ServerProcess

    checkouts = {"this": HERE.parent, "base": args.base.resolve()}
    raw: dict[str, list[dict]] = {k: [] for k in checkouts}
    servers: dict[str, ServerProcess] = {}

    def up(name: str) -> ServerProcess:
        servers[name] = ServerProcess(*args.server_args.split(), env={"PYTHONPATH": str(checkouts[name])},
                                      startup_timeout=600)
        asyncio.run(serve_bench.run(bench_args(args, servers[name].base_url, seed=10_000, conc=args.max_concurrency)))  # warm-up
        return servers[name]

    try:
        if not args.sequential:
            for name in (("base", "this") if args.base_first else ("this", "base")):
                up(name)
        for r in range(args.runs):
            for name in (("this", "base") if r % 2 == 0 else ("base", "this")):
                s = servers[name] if not args.sequential else up(name)
                res = asyncio.run(serve_bench.run(bench_args(args, s.base_url, seed=r, conc=args.max_concurrency)))
                if args.sequential:
                    servers.pop(name).stop()
                if res["failed"]:
                    raise RuntimeError(f"{name}: {res['failed']} requests failed: {res['first_error']}")
                raw[name].append(res)
                print(f"  round {r} {name:4s} " + "  ".join(f"{m} {f(res):.1f}" for m, f in METRICS), flush=True)
    finally:
        for s in servers.values():
            s.stop()
    med = {name: {m: statistics.median(f(s) for s in runs) for m, f in METRICS} for name, runs in raw.items()}
    print(f"\n| metric (median of {args.runs}) | this | base | this / base |\n|---|---|---|---|")
    for m, _ in METRICS:
        print(f"| {m} | {med['this'][m]:.1f} | {med['base'][m]:.1f} | {med['this'][m] / med['base'][m]:.3f} |")
    if args.json:
        args.json.write_text(json.dumps({"workload": vars(args) | {"base": str(args.base)}, "medians": med,
                                         "raw": raw}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
