"""Decode-step time of the engine inside the server under HTTP load vs offline, in one run.

    python bench/decode_step.py                       # offline, server --engine-process, --no-engine-process
    python bench/decode_step.py --repeats 3 --json out.json

Workload (the issue-10 one): 32 requests x ~256 prompt tokens / 64 output tokens (ignore_eos), at
most 8 in flight, so decode steps run 8 sequences (fewer at the tail).
  - offline: LLM in this process (max_num_seqs 8), every engine step timed here;
  - server: `nanoserve` started per mode, loaded by bench/serve_bench.py (streaming, concurrency 8);
    step times come from /metrics (`nanoserve:engine_step_seconds{kind="decode"}`, scraped before
    and after the load): the mean is exact (sum / count), the median is read from the histogram's
    x1.25 buckets (linear inside a bucket, so within ~10%).
"decode" steps are steps that could only be one token per running sequence (no prompt work
pending: nanoserve.engine.core.step_kind), the same rule offline and in the server.
Both sides get the same compute threads (--cpu-threads, default: the server's default placement).
All three are set up first, then loaded in turn (A B C A B C ...); medians over --repeats rounds
(fresh prompts per run: a different seed, so no cross-run prefix hits)."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import serve_bench  # noqa: E402

STEP = "nanoserve:engine_step_seconds"


def step_histogram(url: str, kind: str = "decode") -> tuple[list[tuple[float, float]], float, float]:
    """(cumulative buckets [(le, count)], sum, count) of the decode-step histogram."""
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(url + "/metrics", timeout=30).text
    buckets, total, n = [], 0.0, 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.labels.get("kind") != kind:
                continue
            if s.name == STEP + "_bucket":
                buckets.append((float(s.labels["le"]), s.value))
            elif s.name == STEP + "_sum":
                total = s.value
            elif s.name == STEP + "_count":
                n = s.value
    return sorted(buckets), total, n


def hist_median(before: list, after: list) -> float:
    cum = [(le, a - b) for (le, a), (_, b) in zip(after, before)]
    n = cum[-1][1] if cum else 0
    if not n:
        return float("nan")
    prev_le, prev_c = 0.0, 0.0
    for le, c in cum:
        if c >= n / 2:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * (n / 2 - prev_c) / max(c - prev_c, 1e-9)
        prev_le, prev_c = le, c
    return float("nan")


class Offline:
    def __init__(self, args) -> None:
        import torch

        from nanoserve import LLM, SamplingParams
        torch.set_num_threads(args.cpu_threads)
        self.llm = LLM(args.model, dtype=args.dtype, kv_cache_gb=args.kv_cache_gb, max_num_seqs=args.concurrency)
        self.llm.generate(["warm up"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))

    def load(self, args, seed: int) -> dict:
        import torch

        from nanoserve import SamplingParams
        from nanoserve.engine.core import step_kind
        eng = self.llm.engine
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        for i, p in enumerate(serve_bench.make_prompts(args.num_prompts, args.input_len, 0, seed)):
            eng.add_request(f"b{seed}-{i}", p, params)
        decode, t0 = [], time.perf_counter()
        with torch.inference_mode():
            while eng.has_unfinished():
                kind = step_kind(eng)
                ts = time.perf_counter()
                eng.step()
                if kind == "decode":
                    decode.append(time.perf_counter() - ts)
        elapsed = time.perf_counter() - t0
        return {"decode_median_ms": statistics.median(decode) * 1e3,
                "decode_mean_ms": statistics.fmean(decode) * 1e3, "decode_steps": len(decode),
                "output_tok_s": args.num_prompts * args.output_len / elapsed}

    def stop(self) -> None:
        pass


class Server:
    def __init__(self, args, mode_flag: str) -> None:
        port = serve_bench_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "nanoserve.server.cli", "--port", str(port), "--kv-cache-gb",
               str(args.kv_cache_gb), "--dtype", args.dtype, "--cpu-threads", str(args.cpu_threads),
               "--log-level", "warning", mode_flag] + (["--model", args.model] if args.model else [])
        self.proc = subprocess.Popen(cmd)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("server did not become healthy")

    def load(self, args, seed: int) -> dict:
        httpx.post(self.url + "/v1/completions", timeout=120,  # warm-up, before the first scrape
                   json={"prompt": "warm up", "max_tokens": 4, "ignore_eos": True}).raise_for_status()
        before = step_histogram(self.url)
        ns = argparse.Namespace(base_url=self.url + "/v1", model=None, api_key=None, num_prompts=args.num_prompts,
                                input_len=args.input_len, output_len=args.output_len, prefix_len=0,
                                max_concurrency=args.concurrency, request_rate=float("inf"), seed=seed,
                                timeout=600.0, warmup=False)
        summary = asyncio.run(serve_bench.run(ns))
        after = step_histogram(self.url)
        n = after[2] - before[2]
        assert summary["failed"] == 0, summary["first_error"]
        return {"decode_median_ms": hist_median(before[0], after[0]) * 1e3,
                "decode_mean_ms": (after[1] - before[1]) / max(n, 1) * 1e3, "decode_steps": int(n),
                "output_tok_s": summary["output_throughput"], "mean_tpot_ms": summary["tpot_ms"]["mean"]}

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(120)


def serve_bench_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    from nanoserve.engine.placement import plan_placement
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="nanoserve --model (default: embedded SmolLM2-135M)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--kv-cache-gb", type=float, default=1.0)
    ap.add_argument("--cpu-threads", type=int, default=None,
                    help="engine compute threads, offline and in the server (default: the server's default)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--json", default=None, metavar="FILE", help="write the raw runs and the medians here")
    args = ap.parse_args()
    args.cpu_threads = args.cpu_threads or plan_placement("cpu", None, True).engine_threads
    # all three set up at once (an idle server takes no CPU), then runs alternated A B C A B C ...
    setups: dict = {}
    try:
        setups["offline"] = Offline(args)
        for mode in ("--engine-process", "--no-engine-process"):
            setups[f"server {mode}"] = Server(args, mode)
        runs: dict[str, list[dict]] = {name: [] for name in setups}
        for r in range(args.repeats):
            for i, (name, setup) in enumerate(setups.items()):
                runs[name].append(setup.load(args, seed=1000 * (r + 1) + i))
    finally:
        for setup in setups.values():
            setup.stop()
    med = {name: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for name, rs in runs.items()}
    off = med["offline"]["decode_mean_ms"]
    print(f"decode step, {args.concurrency} sequences, {args.cpu_threads} compute thread(s), cpus "
          f"{sorted(os.sched_getaffinity(0))}, medians of {args.repeats} run(s)")
    print(f"{'setup':<30}{'median ms':>11}{'mean ms':>10}{'vs offline':>12}{'steps':>7}{'out tok/s':>11}")
    for name, m in med.items():
        print(f"{name:<30}{m['decode_median_ms']:>11.2f}{m['decode_mean_ms']:>10.2f}"
              f"{m['decode_mean_ms'] / off:>11.2f}x{m['decode_steps']:>7.0f}{m['output_tok_s']:>11.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs, "medians": med}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
