"""Two-tier prefix cache benchmark: the long-document QA workload.

D documents of L tokens; request i asks `doc[i % D] + question_i`; R rounds, round-robin, so a
device tier holding a quarter of the documents (LRU) never has the next one. Configs, side by side
in one run: prefix caching off, device only, device + host, and the control "device-big": device
only with a KV budget of device + host (what the same memory buys without a tier). Reports per
round TTFT (mean/p50/p90), time, prompt and output throughput separately (prompt tok/s counts
cached prompt tokens too: it is not work done) and the fraction of prompt tokens served by each
tier; offline, also other requests' decode rate in steps while a host load is in flight vs not;
then the no-reuse workload (unique prompts) with the host tier on vs off.

    python bench/tier_bench.py                       # offline engine
    python bench/tier_bench.py --target server       # the same through the HTTP server (streaming)
    python bench/tier_bench.py --target server --configs device,host,vllm --docs 16 --doc-len 1536 \
        --rounds 2 --concurrency 4 --output-len 16       # long-document QA, vLLM-CPU at equal device KV

The "vllm" config (server target only) is vLLM-CPU's server with the device tier's token budget
(`--num-gpu-blocks-override`, its CPU blocks being 128 tokens; the device budget is rounded to 128
tokens for every config) and its own prefix cache, in the dtype nanoserve's `--dtype auto` picks.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

GiB = 1 << 30


@dataclass
class Done:
    prompt_tokens: int
    output_tokens: int
    ttft: float
    device_cached: int
    host_cached: int


def workload(args, reuse: bool, seed: int = 0) -> list[list[list[int]]]:
    """Rounds of token-id prompts."""
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(100, 40000) for _ in range(n)]  # noqa: E731
    docs = [tok(args.doc_len) for _ in range(args.docs)]
    return [[(docs[i] if reuse else tok(args.doc_len)) + tok(args.question_len) for i in range(args.docs)]
            for _ in range(args.rounds)]


def summarize(name: str, rnd: int, done: list[Done], elapsed: float) -> dict:
    ttft = sorted(d.ttft * 1000 for d in done)
    prompt = sum(d.prompt_tokens for d in done)
    row = {"config": name, "round": rnd, "ttft_mean_ms": statistics.mean(ttft),
           "ttft_p50_ms": statistics.median(ttft), "ttft_p90_ms": ttft[int(0.9 * (len(ttft) - 1))],
           "time_s": elapsed, "prompt_tok_s": prompt / elapsed,
           "output_tok_s": sum(d.output_tokens for d in done) / elapsed,
           "device_hit": sum(d.device_cached for d in done) / prompt,
           "host_hit": sum(d.host_cached for d in done) / prompt}
    print(f"{name:14s} round {rnd}: TTFT mean {row['ttft_mean_ms']:8.1f} ms  p50 {row['ttft_p50_ms']:8.1f}  "
          f"p90 {row['ttft_p90_ms']:8.1f}  time {elapsed:6.2f}s  prompt {row['prompt_tok_s']:7.1f} tok/s  "
          f"output {row['output_tok_s']:6.1f} tok/s  "
          f"hits: device {row['device_hit']:.0%} host {row['host_hit']:.0%}", flush=True)
    return row


# ---- offline engine ----------------------------------------------------------------------
class OfflineTarget:
    def __init__(self, args, cfg: dict) -> None:
        from nanoserve.config import EngineConfig
        from nanoserve.engine.llm_engine import LLMEngine
        from nanoserve.sampling_params import SamplingParams
        self.args = args
        self.eng = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, **cfg))
        self.params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        # others' decode steps, split by whether a host load was in flight: [steps, decode tokens, seconds]
        self.decode = {"loading": [0, 0, 0.0], "idle": [0, 0, 0.0]}

    def round(self, rnd: int, prompts) -> list[Done]:
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
                    done.append(Done(len(out.prompt_token_ids), len(out.outputs[0].token_ids),
                                     out.metrics["first_token"] - out.metrics["arrival"],
                                     out.num_device_cached_tokens, out.num_host_cached_tokens))
        eng.check_invariants()
        return done

    def close(self) -> None:
        for r in self.eng.kv.reports():
            if r.tier == "host":
                print(f"  host tier: {r.bytes_in / 2**20:.0f} MiB in ({r.seconds_in:.2f}s), "
                      f"{r.bytes_out / 2**20:.0f} MiB out ({r.seconds_out:.2f}s), "
                      f"{self.eng.kv.num_transfer_waits} allocations waited for a copy")
                for k, (steps, toks, secs) in self.decode.items():
                    if steps:
                        print(f"  others' decode, host load {'in flight' if k == 'loading' else 'none':9s}: "
                              f"{steps} steps, {steps / secs:6.1f} steps/s, {toks / secs:7.1f} decode tok/s")


# ---- HTTP server -----------------------------------------------------------------------------
def cli_flags(cfg: dict) -> list[str]:
    flags = ["--kv-cache-gb", str(cfg["kv_cache_gb"]), "--max-num-seqs", str(cfg["max_num_seqs"])]
    if cfg.get("host_cache_gb"):
        flags += ["--host-cache-gb", str(cfg["host_cache_gb"])]
    if cfg.get("host_offload_watermark"):
        flags += ["--host-offload-watermark", str(cfg["host_offload_watermark"])]
    if not cfg.get("enable_prefix_caching", True):
        flags.append("--no-prefix-caching")
    return flags


class ServerTarget:
    def __init__(self, args, cfg: dict) -> None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.server_fixture import ServerProcess
        self.args = args
        if "vllm_blocks" in cfg:
            from export_hf import export_embedded_hf
            from vllm_peer import VllmServer
            self.server = VllmServer(export_embedded_hf(), args.dtype, port=8100, num_blocks=cfg["vllm_blocks"])
        else:
            self.server = ServerProcess(*cli_flags(cfg), "--dtype", args.dtype,
                                        *(["--model", args.model] if args.model else []))
        import httpx
        self.model = httpx.get(self.server.base_url + "/models").json()["data"][0]["id"]

    async def _one(self, client, prompt) -> Done:
        body = {"model": self.model, "prompt": prompt, "max_tokens": self.args.output_len, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        t0 = time.perf_counter()
        ttft, usage = None, {}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:500]}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and ttft is None:
                    ttft = time.perf_counter() - t0
                usage = chunk.get("usage") or usage
        det = usage.get("prompt_tokens_details") or {}
        device = det.get("device_cached_tokens", det.get("cached_tokens") or 0)  # vLLM: only cached_tokens
        return Done(usage["prompt_tokens"], usage["completion_tokens"], ttft or 0.0, device,
                    det.get("host_cached_tokens", 0))

    def round(self, rnd: int, prompts) -> list[Done]:
        import httpx

        async def run() -> list[Done]:
            sem = asyncio.Semaphore(self.args.concurrency)
            async with httpx.AsyncClient(base_url=self.server.url, timeout=600) as client:
                async def limited(p):
                    async with sem:
                        return await self._one(client, p)
                return await asyncio.gather(*(limited(p) for p in prompts))
        return asyncio.run(run())

    def close(self) -> None:
        self.server.stop()


def run_side_by_side(args, configs: dict[str, dict], rounds) -> dict[str, list[dict]]:
    """All configs up at once, rounds interleaved (A0 B0 A1 B1 ...): machine drift hits them alike."""
    cls = OfflineTarget if args.target == "offline" else ServerTarget
    targets = {name: cls(args, cfg) for name, cfg in configs.items()}
    rows: dict[str, list[dict]] = {name: [] for name in configs}
    try:
        for rnd, prompts in enumerate(rounds):
            for name, target in targets.items():
                t0 = time.perf_counter()
                done = target.round(rnd, prompts)
                rows[name].append(summarize(name, rnd, done, time.perf_counter() - t0))
    finally:
        for target in targets.values():
            target.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", choices=["offline", "server"], default="offline")
    ap.add_argument("--model", default=None, help="tier budgets below are sized for the embedded model")
    ap.add_argument("--docs", type=int, default=16)
    ap.add_argument("--doc-len", type=int, default=1024)
    ap.add_argument("--question-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--noreuse-rounds", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--configs", default="off,device,host,device-big,noreuse")
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the raw rows here")
    ap.add_argument("--host-offload-watermark", type=int, default=0, help="blocks (0: nanoserve's default)")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from vllm_peer import auto_dtype, cpu_name
    args.dtype = auto_dtype()
    wanted = args.configs.split(",")
    if "vllm" in wanted and args.target != "server":
        ap.error("the vllm config needs --target server")
    # device: a quarter of the documents plus room for the running requests; host: all of them
    bytes_per_token = 30 * 2 * 3 * 64 * (2 if args.dtype == "bfloat16" else 4)  # embedded model: K+V, 30 layers
    req_tokens = args.doc_len + args.question_len + args.output_len
    device_tokens = -(-int(args.docs * args.doc_len / 4 + args.concurrency * req_tokens) // 128) * 128
    device_gb = (device_tokens + 8) * bytes_per_token / GiB  # + half a block: float rounding never loses one
    host_gb = 1.5 * args.docs * req_tokens * bytes_per_token / GiB
    base = dict(kv_cache_gb=round(device_gb, 6), max_num_seqs=args.concurrency)
    configs = {"off": dict(base, enable_prefix_caching=False), "device": base,
               "host": dict(base, host_cache_gb=round(host_gb, 4), host_offload_watermark=args.host_offload_watermark),
               "device-big": dict(base, kv_cache_gb=round(device_gb + host_gb, 4)),
               "vllm": {"vllm_blocks": device_tokens // 128}}
    print(f"workload: {args.docs} docs x {args.doc_len} tokens, {args.rounds} rounds, concurrency "
          f"{args.concurrency}; device KV {device_tokens} tokens = {device_gb:.3f} GiB (~{args.docs // 4} docs), "
          f"host {host_gb:.3f} GiB; target {args.target}; dtype {args.dtype}; {cpu_name()}", flush=True)
    results = run_side_by_side(args, {k: v for k, v in configs.items() if k in wanted}, workload(args, reuse=True))
    if "noreuse" in wanted:
        unique = workload(argparse.Namespace(**{**vars(args), "rounds": args.noreuse_rounds}), reuse=False, seed=1)
        results.update(run_side_by_side(args, {"noreuse-off": base, "noreuse-host": configs["host"]}, unique))
    print("\nsummary (rounds after the first):")
    later = {k: [r for r in v if r["round"] > 0] for k, v in results.items()}
    for k, rows in later.items():
        if rows:
            print(f"  {k:14s} TTFT mean {statistics.mean(r['ttft_mean_ms'] for r in rows):8.1f} ms  "
                  f"hits device {statistics.mean(r['device_hit'] for r in rows):.0%} "
                  f"host {statistics.mean(r['host_hit'] for r in rows):.0%}  "
                  f"prompt {statistics.median(r['prompt_tok_s'] for r in rows):.1f} tok/s  "
                  f"output {statistics.median(r['output_tok_s'] for r in rows):.1f} tok/s")
    for other in ("device", "vllm"):
        if other in later and "host" in later and later["host"]:
            ratio = statistics.mean(r["ttft_mean_ms"] for r in later[other]) / statistics.mean(
                r["ttft_mean_ms"] for r in later["host"])
            print(f"  TTFT mean {other} / nanoserve device+host: {ratio:.1f}x")
    if "noreuse-off" in results:
        ratios = [o["time_s"] / h["time_s"] for h, o in zip(results["noreuse-host"], results["noreuse-off"])]
        print(f"  no reuse: throughput host on / off = {statistics.median(ratios):.3f} (median of per-round "
              f"ratios {', '.join(f'{r:.3f}' for r in ratios)})")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu_name(), "dtype": args.dtype, "args": vars(args),
                                               "rows": results}, indent=1))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
