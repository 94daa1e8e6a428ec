"""Two-tier prefix cache benchmark: long-document QA and multi-round QA.

longdoc: D documents of L tokens; request i asks `doc[i % D] + question_i`; R rounds, round-robin, so a
device tier holding a quarter of the documents (LRU) never has the next one.
multiround (LMCache's multi-round QA shape): U users, each with its own context of L tokens, talking
for R rounds; each prompt is the user's context + every earlier question and answer (the answer
tokens the engine generated) + a new question; users are served concurrently (closed loop). The
device holds about a quarter of the conversations, the host all of them. Configs, side by side
in one run: prefix caching off, device only, device + host, and the control "device-big": device
only with a KV budget of device + host (what the same memory buys without a tier). Reports per
round TTFT (mean/p50/p90), time, prompt and output throughput separately (prompt tok/s counts
cached prompt tokens too: it is not work done) and the fraction of prompt tokens served by each
tier; offline, also other requests' decode rate in steps while a host load is in flight vs not;
then the no-reuse workload (unique prompts) with the host tier on vs off. Offline, each round also
prints where the engine's time went (bench/tier_breakdown.py: forward, admission, inline waits for
copies, the cleaner, deferrals), stored in the JSON as `breakdown`. TTFT's mean and
percentiles as bench/common.py defines them; the workloads are bench/common.py's docqa and
multiround (`longdoc` here is docqa).

    python bench/tier.py                       # offline engine
    python bench/tier.py --target server       # the same through the HTTP server (streaming)
    python bench/tier.py --target server --configs device,host,vllm --docs 16 --doc-len 1536 \\
        --rounds 2 --concurrency 4 --output-len 16       # long-document QA, vLLM-CPU at equal device KV
    python bench/tier.py --workload multiround --concurrency 4,8,16 --json /tmp/tier_c{c}.json
                                                     # one JSON per concurrency
    python bench/tier.py --table bench/results/tier_multiround_c*.json   # the docs' table
    python bench/tier.py --admission --base /tmp/base    # admitting a host prefix: cost per stage, copies
    python bench/tier.py --restart --runs 3 --concurrency 8   # round 2 after a SIGTERM: disk vs recompute

Per config and concurrency (rounds after the first): share of prompt tokens from each tier, the
share of *reusable* prompt tokens (full blocks some earlier request had computed) served from
cache, lossy evictions (cached KV dropped with no copy anywhere), mean and p90 TTFT, output tok/s.

The "vllm" config (server target only) is vLLM-CPU's server (bench/peers.py: --vllm-venv,
--vllm-cores) with the device tier's token budget (`--num-gpu-blocks-override`, its CPU blocks being
128 tokens; the device budget is rounded to 128 tokens for every config) and its own prefix cache,
in the dtype nanoserve's `--dtype auto` picks.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import tier_admission
import tier_breakdown
import tier_restart
from common import RequestResult, Workload, auto_dtype, cpu_name, distribution_ms, write_json
from peers import ServerSpec, add_peer_args, peer_config, start

GiB = 1 << 30


def summarize(name: str, rnd: int, done: list[RequestResult], elapsed: float, reusable: int,
              lossy: int | None) -> dict:
    ttft = distribution_ms([d.ttft for d in done])
    prompt = sum(d.prompt_tokens for d in done)
    cached = sum(d.device_cached + d.host_cached for d in done)
    row = {"config": name, "round": rnd, "ttft_mean_ms": ttft["mean"], "ttft_p50_ms": ttft["median"],
           "ttft_p90_ms": ttft["p90"], "ttft_ms": sorted(d.ttft * 1e3 for d in done), "time_s": elapsed,
           "prompt_tok_s": prompt / elapsed,
           "output_tok_s": sum(d.output_tokens for d in done) / elapsed,
           "device_hit": sum(d.device_cached for d in done) / prompt,
           "host_hit": sum(d.host_cached for d in done) / prompt,
           "reusable_tokens": reusable, "reusable_hit": cached / reusable if reusable else None,
           "lossy_evictions": lossy}
    reuse = f" of reusable {row['reusable_hit']:.1%}" if reusable else ""
    print(f"{name:14s} round {rnd}: TTFT mean {row['ttft_mean_ms']:8.1f} ms  p50 {row['ttft_p50_ms']:8.1f}  "
          f"p90 {row['ttft_p90_ms']:8.1f}  time {elapsed:6.2f}s  prompt {row['prompt_tok_s']:7.1f} tok/s  "
          f"output {row['output_tok_s']:6.1f} tok/s  "
          f"hits: device {row['device_hit']:.0%} host {row['host_hit']:.0%}{reuse}  lossy evictions {lossy}",
          flush=True)
    return row


# ---- offline engine ----------------------------------------------------------------------
class OfflineTarget:
    def __init__(self, args, cfg: dict) -> None:
        from nanoserve.config import EngineConfig
        from nanoserve.engine.llm_engine import LLMEngine
        from nanoserve.sampling_params import SamplingParams
        self.args = args
        self.eng = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, **cfg))
        self.breakdown = tier_breakdown.Breakdown(self.eng)
        self.params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        import torch
        self.cores = f"offline engine in this process, {torch.get_num_threads()} compute thread(s)"
        # others' decode steps, split by whether a host load was in flight: [steps, decode tokens, seconds]
        self.decode = {"loading": [0, 0, 0.0], "idle": [0, 0, 0.0]}

    def round(self, rnd: int, prompts) -> list[RequestResult]:
        eng, pending, done = self.eng, list(enumerate(prompts)), []
        while pending or eng.has_unfinished():
            while pending and len(eng.requests) < self.args.concurrency:  # closed loop
                i, p = pending.pop(0)
                eng.add(eng.make_request(f"{rnd}-{i}", p, self.params))
            t0 = time.perf_counter()
            decoding = sum(1 for s in eng.scheduler.running if s.prompt_done)
            outs = eng.step()
            if decoding:
                row = self.decode["loading" if eng.scheduler.loading else "idle"]
                row[0] += 1
                row[1] += decoding
                row[2] += time.perf_counter() - t0
            for out in outs:
                if out.finished:
                    done.append(RequestResult(
                        True, prompt_tokens=len(out.prompt_token_ids),
                        output_tokens=len(out.outputs[0].token_ids),
                        ttft=out.metrics["first_token"] - out.metrics["arrival"],
                        device_cached=out.num_device_cached_tokens, host_cached=out.num_host_cached_tokens,
                        index=int(out.request_id.split("-")[1]), output_ids=list(out.outputs[0].token_ids)))
        eng.check_invariants()
        return sorted(done, key=lambda d: d.index)

    def lossy(self) -> int | None:
        """Device blocks whose KV was dropped with no copy anywhere (None: the engine has no such count)."""
        return getattr(self.eng.kv.reports()[0], "lossy_evictions", None)

    def close(self) -> None:
        for r in self.eng.kv.reports():
            if r.tier == "host":
                print(f"  host tier: {r.bytes_in / 2**20:.0f} MiB in ({r.seconds_in:.2f}s), "
                      f"{r.bytes_out / 2**20:.0f} MiB out ({r.seconds_out:.2f}s), "
                      f"{self.eng.kv.num_deferred} admissions deferred for saves")
                for k, (steps, toks, secs) in self.decode.items():
                    if steps:
                        print(f"  others' decode, host load {'in flight' if k == 'loading' else 'none':9s}: "
                              f"{steps} steps, {steps / secs:6.1f} steps/s, {toks / secs:7.1f} decode tok/s")


# ---- HTTP server -----------------------------------------------------------------------------
def cli_flags(cfg: dict) -> list[str]:
    flags = ["--kv-cache-gb", str(cfg["kv_cache_gb"]), "--max-num-seqs", str(cfg["max_num_seqs"])]
    if cfg.get("host_cache_gb"):
        flags += ["--host-cache-gb", str(cfg["host_cache_gb"])]
    if cfg.get("disk_cache_gb"):
        flags += ["--disk-cache-gb", str(cfg["disk_cache_gb"]), "--disk-cache-dir", cfg["disk_cache_dir"]]
    if cfg.get("host_offload_watermark"):
        flags += ["--host-offload-watermark", str(cfg["host_offload_watermark"])]
    if not cfg.get("enable_prefix_caching", True):
        flags.append("--no-enable-prefix-caching")
    return flags


def metric(url: str, name: str, tier: str) -> float | None:
    """One per-tier sample of a nanoserve server's /metrics (None if it has none)."""
    import httpx
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(f"nanoserve:{name}{{") and f'tier="{tier}"' in line:
            return float(line.split()[-1])
    return None


class ServerTarget:
    def __init__(self, args, cfg: dict) -> None:
        self.args = args
        if "vllm_blocks" in cfg:
            self.server = start(ServerSpec("vllm", "vllm"), peer_config(args, args.dtype),
                                num_blocks=cfg["vllm_blocks"])
        else:
            flags = cli_flags(cfg) + (["--model", args.model] if args.model else [])
            self.server = start(ServerSpec("nanoserve", "nanoserve", flags=flags),
                                peer_config(args, args.dtype))
        self.cores = self.server.cores
        import httpx
        self.model = httpx.get(self.server.base_url + "/models").json()["data"][0]["id"]

    def lossy(self) -> int | None:
        value = metric(self.server.url, "kv_lossy_evictions_total", "device")
        return None if value is None else int(value)

    def round(self, rnd: int, prompts) -> list[RequestResult]:
        import httpx

        from serve import send_round

        async def run() -> list[RequestResult]:
            async with httpx.AsyncClient(timeout=600) as client:
                return await send_round(client, self.server.base_url + "/completions", self.model, prompts,
                                        self.args.output_len, self.args.concurrency)
        done = asyncio.run(run())
        if failed := [d.error for d in done if not d.ok]:
            raise RuntimeError(f"{len(failed)} requests failed: {failed[0]}")
        return done

    def close(self) -> None:
        self.server.stop()


def workload(args, kind: str, reuse: bool = True, seed: int = 0) -> Workload:
    n = args.users if kind == "multiround" else args.docs
    return Workload(kind, n, args.doc_len, args.question_len, args.output_len, args.rounds, reuse, seed)


def run_side_by_side(args, configs: dict[str, dict], wl: Workload, rounds: int) -> dict[str, list[dict]]:
    """All configs up at once, rounds interleaved (A0 B0 A1 B1 ...): machine drift hits them alike."""
    cls = OfflineTarget if args.target == "offline" else ServerTarget
    targets = {name: cls(args, cfg) for name, cfg in configs.items()}
    for name, target in targets.items():
        print(f"  {name}: {target.cores}", flush=True)
    rows: dict[str, list[dict]] = {name: [] for name in configs}
    states = {name: wl.new_state() for name in configs}
    last_lossy = {name: t.lossy() for name, t in targets.items()}
    try:
        for rnd in range(rounds):
            for name, target in targets.items():
                prompts = wl.prompts(rnd, states[name])
                reusable = sum(wl.reusable(p, states[name]) for p in prompts)
                t0 = time.perf_counter()
                done = target.round(rnd, prompts)
                elapsed = time.perf_counter() - t0
                lossy = target.lossy()
                delta = None if lossy is None else lossy - last_lossy[name]
                last_lossy[name] = lossy
                rows[name].append(summarize(name, rnd, done, elapsed, reusable, delta))
                if (bd := getattr(target, "breakdown", None)) is not None:  # offline: time per stage
                    rows[name][-1]["breakdown"] = bd.take()
                    tier_breakdown.show(name, rnd, rows[name][-1]["breakdown"])
                wl.observe(rnd, states[name], prompts, done)
    finally:
        for target in targets.values():
            target.close()
    return rows


def later_summary(rows: list[dict]) -> dict:
    """Rounds after the first, pooled: hit shares weighted by tokens, TTFT over all their requests."""
    later = [r for r in rows if r["round"] > 0]
    if not later:
        return {}
    ttft = [t / 1e3 for r in later for t in r["ttft_ms"]]
    reusable = sum(r["reusable_tokens"] for r in later)
    lossy = [r["lossy_evictions"] for r in rows]
    return {"device_hit": statistics.mean(r["device_hit"] for r in later),
            "host_hit": statistics.mean(r["host_hit"] for r in later),
            "reusable_hit": (sum(r["reusable_hit"] * r["reusable_tokens"] for r in later
                                 if r["reusable_tokens"]) / reusable) if reusable else None,
            "lossy_evictions": None if None in lossy else sum(lossy),
            "ttft_mean_ms": distribution_ms(ttft)["mean"], "ttft_p90_ms": distribution_ms(ttft)["p90"],
            "output_tok_s": statistics.median(r["output_tok_s"] for r in later),
            "prompt_tok_s": statistics.median(r["prompt_tok_s"] for r in later)}


def table(paths: list[str]) -> None:
    """Markdown rows from result files, one a config; TTFT also as a ratio to the same run's
    device-big control."""
    print("| result | workload | conc | config | prompt tokens from device / host | reusable tokens from "
          "cache | lossy evictions | mean TTFT (vs device-big) | p90 TTFT | output tok/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for path in paths:
        d = json.loads(Path(path).read_text())
        a, summary = d["args"], d.get("summary", {})
        big = (summary.get("device-big") or {}).get("ttft_mean_ms")
        for name, s in summary.items():
            if not s:
                continue
            reuse = f"{s['reusable_hit']:.1%}" if s.get("reusable_hit") is not None else "-"
            lossy = "n/a" if s.get("lossy_evictions") is None else s["lossy_evictions"]
            vs = f" ({s['ttft_mean_ms'] / big:.2f}x)" if big else ""
            print(f"| {Path(path).stem} | {a['workload']} | {a['concurrency']} | {name} | "
                  f"{s['device_hit']:.0%} / {s['host_hit']:.0%} | {reuse} | {lossy} | "
                  f"{s['ttft_mean_ms']:.0f} ms{vs} | {s['ttft_p90_ms']:.0f} ms | {s['output_tok_s']:.1f} |")
        if "noreuse_ratio" in d:
            print(f"| {Path(path).stem} | no reuse | {a['concurrency']} | throughput host on / off | "
                  f"{d['noreuse_ratio']:.3f} | | | | | |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", choices=["offline", "server"], default="offline")
    ap.add_argument("--workload", choices=["longdoc", "docqa", "multiround"], default="longdoc",
                    help="longdoc and docqa are the same workload")
    ap.add_argument("--model", default=None, help="tier budgets below are sized for the embedded model")
    ap.add_argument("--docs", type=int, default=16, help="longdoc: documents")
    ap.add_argument("--users", type=int, default=16, help="multiround: users (conversations)")
    ap.add_argument("--doc-len", type=int, default=1024, help="tokens per document / per user context")
    ap.add_argument("--question-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--noreuse-rounds", type=int, default=5)
    ap.add_argument("--concurrency", default="2", help="one or more, comma-separated: one run each")
    ap.add_argument("--configs", default="off,device,host,device-big,noreuse",
                    help="comma-separated: off (no prefix caching), device, host (device + host tier), "
                         "device-big (device only with both budgets), noreuse (unique prompts, host on vs "
                         "off), vllm (server)")
    ap.add_argument("--json", default=None, metavar="FILE",
                    help="write the rows here; {c} in FILE is the concurrency (one file each)")
    ap.add_argument("--table", nargs="+", default=None, metavar="JSON",
                    help="print the markdown table of these results and exit")
    ap.add_argument("--host-offload-watermark", type=int, default=0, help="blocks (0: nanoserve's default)")
    add_peer_args(ap)
    tier_admission.add_args(ap)
    tier_restart.add_args(ap)
    args = ap.parse_args()
    if args.table:
        return table(args.table)
    if args.admission:
        return tier_admission.main(args)
    args.dtype = auto_dtype()
    if args.restart:
        return tier_restart.main(argparse.Namespace(**{**vars(args), "concurrency": int(args.concurrency)}),
                                 cpu_name())
    wanted = args.configs.split(",")
    if "vllm" in wanted and args.target != "server":
        ap.error("the vllm config needs --target server")
    concs = [int(c) for c in args.concurrency.split(",")]
    if len(concs) > 1 and args.json and "{c}" not in args.json:
        ap.error("several concurrencies: --json needs {c} in its name")
    for conc in concs:
        run_one(argparse.Namespace(**{**vars(args), "concurrency": conc}), wanted, cpu_name())


def run_one(args, wanted: list[str], cpu: str) -> None:
    # device: a quarter of the contexts plus room for the running requests; host: all of them
    # the embedded model: K and V of 3 heads of 64, 30 layers
    bytes_per_token = 30 * 2 * 3 * 64 * (2 if args.dtype == "bfloat16" else 4)
    n = args.users if args.workload == "multiround" else args.docs
    turns = args.rounds if args.workload == "multiround" else 1
    conv_tokens = args.doc_len + turns * (args.question_len + args.output_len)
    device_tokens = -(-int(n * args.doc_len / 4 + args.concurrency * conv_tokens) // 128) * 128
    device_gb = (device_tokens + 8) * bytes_per_token / GiB  # + half a block: float rounding never loses one
    host_gb = 1.5 * n * conv_tokens * bytes_per_token / GiB
    base = dict(kv_cache_gb=round(device_gb, 6), max_num_seqs=args.concurrency)
    host = dict(base, host_cache_gb=round(host_gb, 4))
    if args.host_offload_watermark:
        host["host_offload_watermark"] = args.host_offload_watermark
    configs = {"off": dict(base, enable_prefix_caching=False), "device": base, "host": host,
               "device-big": dict(base, kv_cache_gb=round(device_gb + host_gb, 4)),
               "vllm": {"vllm_blocks": device_tokens // 128}}
    what = (f"{args.users} users x {args.doc_len}-token contexts" if args.workload == "multiround"
            else f"{args.docs} docs x {args.doc_len} tokens")
    print(f"workload {args.workload}: {what}, {args.rounds} rounds, concurrency {args.concurrency}; "
          f"device KV {device_tokens} tokens = {device_gb:.3f} GiB (~{n // 4} of {n} contexts + the running "
          f"requests), host {host_gb:.3f} GiB; target {args.target}; dtype {args.dtype}; {cpu}", flush=True)
    results = run_side_by_side(args, {k: v for k, v in configs.items() if k in wanted},
                               workload(args, args.workload), args.rounds)
    out: dict = {"cpu": cpu, "dtype": args.dtype,
                 "args": {k: v for k, v in vars(args).items() if k != "table"}}
    if "noreuse" in wanted:
        unique = workload(argparse.Namespace(**{**vars(args), "rounds": args.noreuse_rounds}), "longdoc",
                          reuse=False, seed=1)
        nr = run_side_by_side(args, {"noreuse-off": base, "noreuse-host": host}, unique, args.noreuse_rounds)
        results.update(nr)
        ratios = [o["time_s"] / h["time_s"] for h, o in zip(nr["noreuse-host"], nr["noreuse-off"])]
        out["noreuse_ratio"] = statistics.median(ratios)
        print(f"  no reuse: throughput host on / off = {out['noreuse_ratio']:.3f} (median of per-round "
              f"ratios {', '.join(f'{r:.3f}' for r in ratios)})")
    out["summary"] = {k: later_summary(v) for k, v in results.items() if not k.startswith("noreuse")}
    out["rows"] = results
    print("\nsummary (rounds after the first):")
    for k, s in out["summary"].items():
        if s:
            reuse = f"{s['reusable_hit']:.1%}" if s["reusable_hit"] is not None else "-"
            print(f"  {k:14s} TTFT mean {s['ttft_mean_ms']:8.1f} ms  p90 {s['ttft_p90_ms']:8.1f} ms  "
                  f"hits device {s['device_hit']:.0%} host {s['host_hit']:.0%}  reusable from cache {reuse}  "
                  f"lossy {s['lossy_evictions']}  output {s['output_tok_s']:.1f} tok/s")
    for other in ("device-big", "device", "vllm"):
        if out["summary"].get(other) and out["summary"].get("host"):
            print(f"  TTFT mean host / {other}: "
                  f"{out['summary']['host']['ttft_mean_ms'] / out['summary'][other]['ttft_mean_ms']:.2f}x")
    write_json(args.json and args.json.replace("{c}", str(args.concurrency)), out)


if __name__ == "__main__":
    main()
