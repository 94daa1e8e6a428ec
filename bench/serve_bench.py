"""Online serving benchmark for any OpenAI-compatible server (nanoserve, vLLM, SGLang, ...).

    python bench/serve_bench.py --base-url http://127.0.0.1:8000/v1 --num-prompts 32 \
        --input-len 128 --output-len 64 --max-concurrency 8

Sends streaming /v1/completions requests (random-word prompts, `ignore_eos` so every request
generates exactly --output-len tokens) and reports the metrics `vllm bench serve` reports, with
the same definitions:
  - request throughput  = completed requests / benchmark duration
  - output token throughput = total generated tokens / duration; total = (prompt + generated) / duration
  - TTFT = request sent -> first streamed token
  - TPOT = (E2E latency - TTFT) / (output tokens - 1), per request with more than one output token
  - ITL  = time between consecutive streamed chunks, pooled over all requests
  - E2EL = request sent -> last chunk
each as mean / median / p99 (ms). Token counts come from the server's `usage` (stream_options.
include_usage), so the client needs no tokenizer. Only the standard library and httpx are needed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

import httpx

WORDS = ("time year people way day man thing woman life child world school state family student group "
         "country problem hand part place case week company system program question work government number "
         "night point home water room mother area money story fact month lot right study book eye job word "
         "business issue side kind head house service friend father power hour game line end member law car "
         "city community name president team minute idea kid body information back parent face others level "
         "office door health person art war history party result change morning reason research girl guy "
         "moment air teacher force education").split()


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    cached_tokens: int = 0


def make_prompts(n: int, input_len: int, prefix_len: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    prefix = " ".join(rng.choice(WORDS) for _ in range(prefix_len))
    out = []
    for _ in range(n):
        body = " ".join(rng.choice(WORDS) for _ in range(max(1, input_len - prefix_len)))
        out.append(f"{prefix} {body}".strip())
    return out


async def one_request(client: httpx.AsyncClient, url: str, headers: dict, model: str, prompt: str,
                      output_len: int) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    res = Result()
    start = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"])
                    return res
                now = time.perf_counter()
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    if res.ttft == 0.0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                usage = chunk.get("usage")
                if usage:
                    res.prompt_tokens = usage.get("prompt_tokens", 0)
                    res.output_tokens = usage.get("completion_tokens", 0)
                    res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0
        res.e2el = last - start
        res.ok = res.ttft > 0
        if not res.ok:
            res.error = "no token received"
    except Exception as e:  # a failed request is counted, not fatal
        res.error = f"{type(e).__name__}: {e}"
    return res


def _stats(xs: list[float]) -> dict:
    if not xs:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    s = sorted(xs)
    k = (len(s) - 1) * 0.99  # numpy.percentile's default (linear), as vllm bench serve uses
    lo = int(k)
    p99 = s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (k - lo)
    return {"mean": statistics.fmean(s) * 1000, "median": statistics.median(s) * 1000, "p99": p99 * 1000}


async def run(args) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=httpx.Limits(
            max_connections=None, max_keepalive_connections=None)) as client:
        model = args.model
        if model is None:
            r = await client.get(args.base_url.rstrip("/") + "/models", headers=headers)
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        prompts = make_prompts(args.num_prompts, args.input_len, args.prefix_len, args.seed)
        url = args.base_url.rstrip("/") + "/completions"
        if args.warmup:
            await one_request(client, url, headers, model, prompts[0], 4)
        sem = asyncio.Semaphore(args.max_concurrency or len(prompts))
        rng = random.Random(args.seed)

        async def limited(p):
            async with sem:
                return await one_request(client, url, headers, model, p, args.output_len)

        t0 = time.perf_counter()
        tasks = []
        for p in prompts:
            tasks.append(asyncio.create_task(limited(p)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpot = [(r.e2el - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    summary = {
        "model": model, "base_url": args.base_url, "num_prompts": len(prompts), "completed": len(ok),
        "failed": len(results) - len(ok), "first_error": next((r.error for r in results if r.error), ""),
        "input_len": args.input_len, "output_len": args.output_len, "prefix_len": args.prefix_len,
        "max_concurrency": args.max_concurrency, "request_rate": args.request_rate,
        "duration_s": duration, "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "cached_prompt_tokens": sum(r.cached_tokens for r in ok),
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_ms": _stats([r.ttft for r in ok]), "tpot_ms": _stats(tpot),
        "itl_ms": _stats([x for r in ok for x in r.itl]), "e2el_ms": _stats([r.e2el for r in ok]),
    }
    return summary


def print_summary(s: dict) -> None:
    print(f"============ Serving Benchmark Result ({s['base_url']}) ============")
    rows = [("Successful requests", s["completed"]), ("Failed requests", s["failed"]),
            ("Benchmark duration (s)", f"{s['duration_s']:.2f}"),
            ("Total input tokens", s["total_input_tokens"]), ("Total generated tokens", s["total_output_tokens"]),
            ("Cached prompt tokens", s["cached_prompt_tokens"]),
            ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{s['output_throughput']:.2f}"),
            ("Total token throughput (tok/s)", f"{s['total_token_throughput']:.2f}")]
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2EL")):
        for stat in ("mean", "median", "p99"):
            rows.append((f"{stat.capitalize()} {name} (ms)", f"{s[key][stat]:.2f}"))
    for k, v in rows:
        print(f"{k:<40}{v:>14}")
    if s["first_error"]:
        print(f"first error: {s['first_error']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="OpenAI-compatible base URL (…/v1)")
    p.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128, help="prompt length in words (~tokens)")
    p.add_argument("--output-len", type=int, default=64, help="tokens generated per request (ignore_eos)")
    p.add_argument("--prefix-len", type=int, default=0, help="words of prefix shared by every prompt")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: all)")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrival rate in req/s (default: inf = all at once)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    p.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the one warm-up request")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the summary as JSON")
    args = p.parse_args(argv)
    summary = asyncio.run(run(args))
    print_summary(summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
