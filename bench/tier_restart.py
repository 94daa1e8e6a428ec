"""A cache that survives a restart (bench/tier.py --restart): document QA, round 1, SIGTERM, a new server,
round 2 (new questions on the same documents).

Two sides with identical flags (device KV for a quarter of the documents, a host tier and a disk tier
that hold them all), one server up at a time: "disk" restarts on the directory its first server wrote,
"recompute" on an empty one (the control: everything is computed again). Per side and run: round 2's mean
TTFT, the share of its prompt tokens served from disk (the server's own counters), how long the SIGTERM
took (the disk tier writes what it lacks and its index) and the restarted server's start. Fresh documents
every run (seeded by the run); the medians over runs are what the summary prints.

    python bench/tier.py --restart --runs 3 --docs 16 --doc-len 1536 --concurrency 8 --json FILE
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

GiB = 1 << 30


def add_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("restart (--restart)")
    g.add_argument("--restart", action="store_true", help="the warm-restart scenario (server target)")
    g.add_argument("--runs", type=int, default=3, help="--restart: runs per side (fresh documents each)")


def _side(args, cfg: dict, first_dir: Path, second_dir: Path, wl, run: int) -> dict:
    """Round 1 on a server writing `first_dir`, SIGTERM, round 2 on a server reading `second_dir`."""
    from tier import ServerTarget, metric, summarize

    def server(directory: Path) -> tuple[ServerTarget, float]:
        t0 = time.perf_counter()
        target = ServerTarget(args, dict(cfg, disk_cache_dir=str(directory)))
        return target, time.perf_counter() - t0

    state = wl.new_state()
    target, _ = server(first_dir)
    try:
        prompts = wl.prompts(0, state)
        wl.observe(0, state, prompts, target.round(0, prompts))
    finally:
        t0 = time.perf_counter()
        target.close()  # SIGTERM to the group, as a deploy stops it
        stop_s = time.perf_counter() - t0
    target, start_s = server(second_dir)
    try:
        prompts = wl.prompts(1, state)
        t0 = time.perf_counter()
        done = target.round(1, prompts)
        row = summarize(f"run {run}", 1, done, time.perf_counter() - t0, 0, None)
        prompt_tokens = sum(d.prompt_tokens for d in done)
        disk_hits = metric(target.server.url, "prefix_cache_hits_total", "disk") or 0.0
        row["disk_hit"] = disk_hits / prompt_tokens
    finally:
        target.close()
    row.update(stop_s=stop_s, start_s=start_s, cores=target.cores)
    print(f"    disk hits {row['disk_hit']:.1%}  shutdown {stop_s:.1f}s  restart {start_s:.1f}s", flush=True)
    return row


def main(args, cpu: str) -> None:
    from common import write_json
    from tier import workload
    args.target, args.rounds = "server", 2
    bytes_per_token = 30 * 2 * 3 * 64 * (2 if args.dtype == "bfloat16" else 4)  # the embedded model
    conv_tokens = args.doc_len + args.question_len + args.output_len
    device_tokens = -(-int(args.docs * args.doc_len / 4 + args.concurrency * conv_tokens) // 128) * 128
    tiers_gb = round(1.5 * args.docs * conv_tokens * bytes_per_token / GiB, 4)
    cfg = dict(kv_cache_gb=round((device_tokens + 8) * bytes_per_token / GiB, 6),
               max_num_seqs=args.concurrency, host_cache_gb=tiers_gb, disk_cache_gb=tiers_gb)
    print(f"restart: {args.docs} docs x {args.doc_len} tokens, concurrency {args.concurrency}, {args.runs} "
          f"run(s); device KV {device_tokens} tokens, host and disk {tiers_gb} GiB each; dtype {args.dtype}; "
          f"{cpu}", flush=True)
    rows: dict[str, list[dict]] = {"disk": [], "recompute": []}
    with tempfile.TemporaryDirectory(prefix="nanoserve-restart-") as tmp:
        for run in range(args.runs):
            wl = workload(argparse.Namespace(**{**vars(args), "rounds": 2}), "docqa", seed=100 + run)
            for side in ("disk", "recompute"):
                print(f"  {side}:", flush=True)
                first = Path(tmp) / f"{side}-{run}"
                second = first if side == "disk" else Path(tmp) / f"{side}-{run}-empty"
                rows[side].append(_side(args, cfg, first, second, wl, run))
    summary = {side: {k: statistics.median(r[k] for r in rs)
                      for k in ("ttft_mean_ms", "ttft_p90_ms", "disk_hit", "stop_s", "start_s")}
               for side, rs in rows.items()}
    summary["ttft_ratio_recompute_over_disk"] = statistics.median(
        c["ttft_mean_ms"] / d["ttft_mean_ms"] for d, c in zip(rows["disk"], rows["recompute"]))
    print("\nround 2 after a restart (medians over runs):")
    for side in rows:
        s = summary[side]
        print(f"  {side:10s} TTFT mean {s['ttft_mean_ms']:8.1f} ms  p90 {s['ttft_p90_ms']:8.1f} ms  "
              f"from disk {s['disk_hit']:.1%}  shutdown {s['stop_s']:.1f}s  restart {s['start_s']:.1f}s")
    print(f"  mean TTFT recompute / disk: {summary['ttft_ratio_recompute_over_disk']:.2f}x")
    write_json(args.json, {"cpu": cpu, "dtype": args.dtype, "scenario": "restart",
                           "args": {k: v for k, v in vars(args).items() if k != "table"},
                           "summary": summary, "rows": rows})
