"""HTTP serving, nanoserve vs vLLM-CPU, side by side in one run (entry point: bench/serve_vs_vllm.sh).

Both servers are up at once on 127.0.0.1 with the same model (the embedded SmolLM2, exported to an
HF folder for vLLM), the same dtype (the one nanoserve's `--dtype auto` picks on this CPU) and the
same 1 GiB KV budget. One unmeasured warm-up run each, then --runs rounds of bench/serve_bench.py,
the order alternating (A B, B A, ...) so machine drift hits both alike. Every round has fresh
prompts (seed = round; both servers get the same ones in a round, and no round can hit a prefix an
earlier one cached). Reports the median of each metric over the rounds, the ratio of medians, and
writes all raw summaries as JSON. Several concurrencies (--max-concurrency 8,32) share the two
servers and run one after the other, each with its own warm-up and rounds; --num-prompts defaults
to max(32, 2 x concurrency).

    python bench/serve_vs_vllm.py --runs 3 --max-concurrency 8,32 --json bench/results/serve_vs_vllm.json
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

METRICS = [("output tok/s", lambda s: s["output_throughput"]), ("mean TTFT ms", lambda s: s["ttft_ms"]["mean"]),
           ("mean TPOT ms", lambda s: s["tpot_ms"]["mean"]), ("median TPOT ms", lambda s: s["tpot_ms"]["median"]),
           ("mean E2EL ms", lambda s: s["e2el_ms"]["mean"])]


def bench_args(args, base_url: str, seed: int, conc: int) -> argparse.Namespace:
    return argparse.Namespace(base_url=base_url, model=None, api_key=None, num_prompts=num_prompts(args, conc),
                              input_len=args.input_len, output_len=args.output_len, prefix_len=0,
                              max_concurrency=conc, request_rate=float("inf"), seed=seed,
                              timeout=600.0, warmup=True)


def num_prompts(args, conc: int) -> int:
    return args.num_prompts or max(32, 2 * conc)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=None, help="default: max(32, 2 x concurrency)")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-concurrency", default="8", help="one or more, comma-separated")
    ap.add_argument("--nanoserve-args", default="", help="extra nanoserve flags, e.g. '--cpu-threads 2'")
    ap.add_argument("--peer-first", action="store_true",
                    help="start vLLM before nanoserve (with both up, start order shifted an A/B of two "
                         "nanoserve trees by 6-10%%: bench/ab_serve.py)")
    ap.add_argument("--json", default=str(HERE / "results" / "serve_vs_vllm.json"))
    args = ap.parse_args()
    import serve_bench
    from export_hf import export_embedded_hf
    from vllm_peer import VllmServer, auto_dtype, cpu_name
    from tests.server_fixture import ServerProcess

    dtype, hf = auto_dtype(), export_embedded_hf()
    concs = [int(c) for c in args.max_concurrency.split(",")]
    print(f"{cpu_name()}; dtype {dtype}; {args.input_len} in / {args.output_len} out per request, "
          f"concurrency {concs}", flush=True)
    start = {"nanoserve": lambda: ServerProcess("--dtype", dtype, "--kv-cache-gb", "1", *args.nanoserve_args.split(),
                                                startup_timeout=600),
             "vllm": lambda: VllmServer(hf, dtype, port=8100, kv_cache_gb=1)}
    first, second = ("vllm", "nanoserve") if args.peer_first else ("nanoserve", "vllm")
    up = {first: start[first]()}
    try:
        up[second] = start[second]()
    except BaseException:
        up[first].stop()
        raise
    ns, vl = up["nanoserve"], up["vllm"]
    servers = {"nanoserve": ns.base_url, "vllm": vl.base_url}
    raw: dict[int, dict[str, list[dict]]] = {c: {k: [] for k in servers} for c in concs}
    try:
        for i, c in enumerate(concs):
            for name, url in servers.items():  # warm-up, not counted
                asyncio.run(serve_bench.run(bench_args(args, url, 10_000 + i, c)))
            for r in range(args.runs):
                for name in (list(servers) if r % 2 == 0 else list(servers)[::-1]):
                    # fresh prompts: no round (nor concurrency) can hit a prefix an earlier one cached
                    s = asyncio.run(serve_bench.run(bench_args(args, servers[name], 100 * i + r, c)))
                    if s["failed"]:
                        raise RuntimeError(f"{name}: {s['failed']} requests failed: {s['first_error']}")
                    raw[c][name].append(s)
                    print(f"  concurrency {c} round {r} {name:9s} " + "  ".join(f"{m} {f(s):.1f}" for m, f in METRICS),
                          flush=True)
    finally:
        ns.stop()
        vl.stop()
    med = {c: {name: {m: statistics.median(f(s) for s in runs) for m, f in METRICS} for name, runs in rc.items()}
           for c, rc in raw.items()}
    for c in concs:
        print(f"\nconcurrency {c}, {num_prompts(args, c)} requests")
        print(f"| metric (median of {args.runs}) | nanoserve | vLLM-CPU | nanoserve / vLLM |\n|---|---|---|---|")
        for m, _ in METRICS:
            a, b = med[c]["nanoserve"][m], med[c]["vllm"][m]
            print(f"| {m} | {a:.1f} | {b:.1f} | {a / b:.2f}x |")
    out = {"cpu": cpu_name(), "dtype": dtype, "workload": vars(args),
           "by_concurrency": {c: {"num_prompts": num_prompts(args, c), "medians": med[c], "raw": raw[c]} for c in concs}}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    print(f"raw results: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
