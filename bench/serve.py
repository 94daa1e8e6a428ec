"""Online serving benchmark for any OpenAI-compatible server (nanoserve, vLLM, SGLang, llama.cpp, ...).

A running server:
    python bench/serve.py --base-url http://127.0.0.1:8000/v1 --num-prompts 32 --input-len 256 \\
        --output-len 64 --max-concurrency 8
Servers started here (bench/peers.py), all up at once, side by side: a warm-up each, then --runs
rounds alternated (A B, B A, ...), fresh prompts per round (the same ones for every server in a
round, so no round can hit a prefix an earlier one cached), medians and ratios to the first:
    python bench/serve.py --server nanoserve --server vllm --runs 3 --max-concurrency 8,32
    python bench/serve.py --server this=nanoserve --server base=nanoserve@/tmp/base --sequential
    python bench/serve.py --server "b1024=nanoserve --max-num-batched-tokens 1024" \\
        --server "b2048=nanoserve --max-num-batched-tokens 2048" --sequential
The servers start in the order given (with both up, the one started first measured 6-10% slower
in a nanoserve-vs-nanoserve A/B); --sequential keeps one up at a time, started per round.
--memory: each server's resident memory instead (its process group's VmRSS after one completion of
--input-len token ids and --output-len tokens, a fresh start per run, alternated), e.g.
    python bench/serve.py --memory --kv-cache-gb 0.25 --output-len 32 --runs 3 --server kept=nanoserve \\
        --server "dequantized=nanoserve --gguf-dequantize" --server llamacpp --llamacpp-slots 4 \\
        --llamacpp-ctx 4096

Workloads (streaming /v1/completions, greedy, `ignore_eos`: every request generates --output-len):
  random         --num-prompts random-word prompts of --input-len words (~tokens)
  shared-prefix  the same with the first --prefix-len words shared by all
  docqa          --docs documents of --doc-len tokens, asked round-robin for --rounds rounds
  multiround     --users conversations of --doc-len-token contexts, --rounds turns each
  schema-arrival --streams completions decode --output-len tokens; once each has --settle, a chat
                 request with a JSON schema arrives: the streams' gaps before it and until its first
                 token, for the first constrained request after start-up, a new schema and a cached
                 one (--runs each; --server: one server at a time), e.g.
                   python bench/serve.py --workload schema-arrival --server this=nanoserve \\
                       --server base=nanoserve@/tmp/base --runs 5 --output-len 160 --input-len 64
(docqa and multiround send token ids; their metrics pool every round.) Metrics as defined in
bench/common.py (vLLM's `benchmark_serving` ones); token counts come from the server's `usage`, so
the client needs no tokenizer. --json writes every run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

import httpx

from common import (HEADLINE, RequestResult, Workload, alternate, alternated, auto_dtype, comparison_table,
                    cpu_name, print_serving_metrics, serving_metrics, token_prompts, word_prompts, write_json)
from peers import ServerSpec, add_peer_args, peer_config, start


async def stream_completion(client: httpx.AsyncClient, url: str, model: str, prompt: str | list[int],
                            output_len: int, headers: dict | None = None) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    res = RequestResult()
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, headers=headers or {}) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
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
                if usage := chunk.get("usage"):
                    res.prompt_tokens = usage.get("prompt_tokens", 0)
                    res.output_tokens = usage.get("completion_tokens", 0)
                    det = usage.get("prompt_tokens_details") or {}
                    # nanoserve splits its cached tokens by tier; vLLM reports only cached_tokens
                    res.host_cached = det.get("host_cached_tokens", 0) or 0
                    res.device_cached = det.get("device_cached_tokens",
                                                (det.get("cached_tokens") or 0) - res.host_cached)
        res.e2el = last - start
        res.ok = res.ttft > 0
        res.error = "" if res.ok else "no token received"
    except Exception as e:  # a failed request is counted, not fatal
        res.error = f"{type(e).__name__}: {e}"
    return res


async def send_round(client: httpx.AsyncClient, url: str, model: str, prompts: list, output_len: int,
                     concurrency: int | None, request_rate: float = float("inf"), seed: int = 0,
                     headers: dict | None = None) -> list[RequestResult]:
    """All prompts, at most `concurrency` in flight, arriving all at once or as a Poisson process."""
    import random
    sem, rng = asyncio.Semaphore(concurrency or len(prompts)), random.Random(seed)

    async def limited(i: int, p) -> RequestResult:
        async with sem:
            res = await stream_completion(client, url, model, p, output_len, headers)
            res.index = i
            return res
    tasks = []
    for i, p in enumerate(prompts):
        tasks.append(asyncio.create_task(limited(i, p)))
        if request_rate != float("inf"):
            await asyncio.sleep(rng.expovariate(request_rate))
    return list(await asyncio.gather(*tasks))


def num_prompts(args, conc: int | None) -> int:
    return args.num_prompts or max(32, 2 * (conc or 16))


def workload_rounds(args, seed: int):
    """(prompts of each round, one at a time; a function the round's results are reported to)."""
    if args.workload in ("random", "shared-prefix"):
        prefix = args.prefix_len or (args.input_len // 2 if args.workload == "shared-prefix" else 0)
        yield word_prompts(num_prompts(args, args.conc), args.input_len, prefix, seed), None
        return
    n = args.users if args.workload == "multiround" else args.docs
    wl = Workload(args.workload, n, args.doc_len, args.question_len, args.output_len, args.rounds, seed=seed)
    state = wl.new_state()
    for rnd in range(args.rounds):
        prompts = wl.prompts(rnd, state)
        yield prompts, lambda done, rnd=rnd, prompts=prompts: wl.observe(rnd, state, prompts, done)


async def run(args, base_url: str, seed: int, warmup: bool = True) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=httpx.Limits(
            max_connections=None, max_keepalive_connections=None)) as client:
        model = args.model
        if model is None:
            r = await client.get(base_url.rstrip("/") + "/models", headers=headers)
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        url = base_url.rstrip("/") + "/completions"
        if warmup:
            await stream_completion(client, url, model, "warm up", 4, headers)
        results, ttft_by_round, t0 = [], [], time.perf_counter()
        for prompts, observe in workload_rounds(args, seed):
            done = await send_round(client, url, model, prompts, args.output_len, args.conc,
                                    args.request_rate, seed, headers)
            if observe:
                observe(done)
            results += done
            ok = [r.ttft for r in done if r.ok]
            ttft_by_round.append(statistics.fmean(ok) * 1e3 if ok else 0)
        duration = time.perf_counter() - t0
    return {"base_url": base_url, "model": model, "workload": args.workload, "seed": seed,
            "max_concurrency": args.conc, "num_requests": len(results),
            "mean_ttft_ms_by_round": ttft_by_round, **serving_metrics(results, duration)}


# ---- schema-arrival: what a request with a new JSON schema does to the streams already decoding ----
def fresh_schema(rng) -> dict:
    """A realistic schema no server has compiled yet: property names, enums and patterns drawn per call."""
    word = lambda: "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(8))  # noqa: E731
    props = {}
    for i in range(24):
        pattern = f"^[a-{rng.choice('fkpz')}]{{2,6}}-[0-9]{{3}}$"
        props[f"{word()}_{i}"] = [{"type": "string", "maxLength": 24}, {"enum": [word() for _ in range(12)]},
                                  {"type": "integer", "minimum": 0, "maximum": rng.randrange(10, 10_000)},
                                  {"type": "string", "pattern": pattern}][i % 4]
    # a large enum: its compile is a good part of a step
    props["tag"] = {"enum": [word() for _ in range(2000)]}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


async def token_times(client: httpx.AsyncClient, url: str, body: dict, times: list[float]) -> None:
    """Streams `body`, appending the arrival time of every chunk that carries text to `times`."""
    async with client.stream("POST", url, json={**body, "stream": True}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}")
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                ch = (json.loads(line[6:]).get("choices") or [{}])[0]
                if ch.get("text") or (ch.get("delta") or {}).get("content"):
                    times.append(time.perf_counter())


async def schema_trial(client: httpx.AsyncClient, base: str, model: str, args, schema: dict,
                       seed: int) -> dict:
    """--streams completions decode; once each has --settle tokens, one chat request constrained by
    `schema` arrives. Gaps between the streams' tokens: before it (the normal step) and from its
    arrival until its first token (what the arrival cost them)."""
    streams: list[list[float]] = [[] for _ in range(args.streams)]
    body = {"model": model, "max_tokens": args.output_len, "temperature": 0.0, "ignore_eos": True}
    tasks = [asyncio.create_task(token_times(client, base + "/completions", {**body, "prompt": p}, t))
             for p, t in zip(word_prompts(args.streams, args.input_len, 0, seed), streams)]
    while min(len(t) for t in streams) < args.settle:
        await asyncio.sleep(0.01)
    arrival, first = time.perf_counter(), []
    await token_times(client, base + "/chat/completions", {
        "model": model, "max_tokens": 8, "temperature": 0.0,
        "messages": [{"role": "user", "content": "A record:"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}}, first)
    await asyncio.gather(*tasks)
    normal, around = [], []
    for t in streams:
        for a, b in zip(t[args.settle // 2:], t[args.settle // 2 + 1:]):
            if b < arrival:
                normal.append(b - a)
            elif a < first[0]:
                around.append(b - a)
    return {"normal_median_ms": statistics.median(normal) * 1e3, "normal_max_ms": max(normal) * 1e3,
            "around_median_ms": statistics.median(around) * 1e3, "around_max_ms": max(around) * 1e3,
            "arrival_to_first_token_ms": (first[0] - arrival) * 1e3}


async def schema_arrival(args, base_url: str, seed: int) -> dict:
    """The first constrained request after start-up, then --runs alternated pairs: a new schema, and
    the same schema again (compiled already: the control, whose gaps carry only its prefill)."""
    import random
    rng, base = random.Random(seed), base_url.rstrip("/")
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout)) as client:
        model = args.model or (await client.get(base + "/models")).json()["data"][0]["id"]
        # the chat template's first use is not the grammar's
        await client.post(base + "/chat/completions", json={
            "model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "A record:"}]})
        first = await schema_trial(client, base, model, args, fresh_schema(rng), seed)
        out: dict = {"first": first, "new": [], "cached": []}
        for r in range(args.runs):
            schema = fresh_schema(rng)
            out["new"].append(await schema_trial(client, base, model, args, schema, seed + 2 * r + 1))
            out["cached"].append(await schema_trial(client, base, model, args, schema, seed + 2 * r + 2))
    for kind in ("new", "cached"):
        out[kind + "_median"] = {m: statistics.median(t[m] for t in out[kind]) for m in out["first"]}
    return out


def print_schema_arrival(label: str, res: dict) -> None:
    print(f"  {label}: ms                  normal gap median / max   gaps after arrival median / max   "
          "arrival -> its first token")
    for kind, row in (("first constrained", res["first"]), ("new schema (median)", res["new_median"]),
                      ("cached schema (median)", res["cached_median"])):
        print(f"    {kind:24s} {row['normal_median_ms']:8.1f} / {row['normal_max_ms']:6.1f}"
              f"      {row['around_median_ms']:8.1f} / {row['around_max_ms']:6.1f}"
              f"      {row['arrival_to_first_token_ms']:8.1f}", flush=True)


def compare_schema_arrival(args, specs: list[ServerSpec], cfg) -> dict:
    """One server at a time, started fresh, so "first" is its first grammar."""
    out = {"cpu": cpu_name(), "dtype": cfg.dtype, "args": vars(args), "servers": {}}
    for s in specs:
        srv = start(s, cfg)
        try:
            out["servers"][s.label] = res = asyncio.run(schema_arrival(args, srv.base_url, args.seed))
            res["cores"] = srv.cores
        finally:
            srv.stop()
        print_schema_arrival(s.label, res)
    print(f"schema-arrival, {args.streams} streams; {cpu_name()}; dtype {cfg.dtype}")
    for label, res in out["servers"].items():
        print_schema_arrival(label, res)
    return out


async def one_completion(args, base_url: str) -> RequestResult:
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout)) as client:
        model = args.model or (await client.get(base_url + "/models")).json()["data"][0]["id"]
        return await stream_completion(client, base_url + "/completions", model,
                                       token_prompts(1, args.input_len)[0], args.output_len)


def compare_memory(args, specs: list[ServerSpec], cfg) -> dict:
    """Each server started fresh in every run (alternated), sent one completion of --input-len token ids
    and --output-len tokens, then its resident memory: VmRSS summed over its process group (the API
    process and the engine process for nanoserve), each process listed; medians and ratios to the first."""
    by_label = {s.label: s for s in specs}

    def one(label: str, r: int) -> dict:
        srv = start(by_label[label], cfg)
        try:
            res = asyncio.run(one_completion(args, srv.base_url))
            if not res.ok:
                raise RuntimeError(f"{label}: {res.error}")
            time.sleep(1)  # what the response's last steps freed
            rows = srv.processes()
        finally:
            srv.stop()
        total = sum(rss for _, rss, _ in rows)
        print(f"run {r} {label}: {total:.0f} MB over {len(rows)} process(es)", flush=True)
        for _, rss, cmd in rows:
            print(f"    {rss:7.0f} MB  {cmd[:90]}")
        return {"total_mb": total, "processes": rows}
    runs = alternate(list(by_label), args.runs, one)
    totals = {label: [x["total_mb"] for x in rs] for label, rs in runs.items()}
    med = {label: statistics.median(v) for label, v in totals.items()}
    first = specs[0].label
    print(f"\nresident memory after one completion; {cpu_name()}; dtype {cfg.dtype}; "
          f"kv-cache-gb {cfg.kv_cache_gb}")
    for label, v in totals.items():
        per_run = ", ".join(f"{x / f:.2f}" for x, f in zip(v, totals[first]))
        print(f"  {label}: median {med[label]:.0f} MB (runs {' / '.join(f'{x:.0f}' for x in v)}); "
              f"/ {first}: {med[label] / med[first]:.2f}x (per run {per_run})")
    return {"cpu": cpu_name(), "dtype": cfg.dtype, "kv_cache_gb": cfg.kv_cache_gb, "args": vars(args),
            "runs_mb": totals, "median_mb": med,
            "ratio_over_first": {label: med[label] / med[first] for label in med},
            "processes": {label: rs[-1]["processes"] for label, rs in runs.items()}}


def compare(args, specs: list[ServerSpec]) -> dict:
    cfg = peer_config(args, auto_dtype(), args.kv_cache_gb)
    if args.workload == "schema-arrival":
        return compare_schema_arrival(args, specs, cfg)
    if args.memory:
        return compare_memory(args, specs, cfg)
    concs = [int(c) for c in args.max_concurrency.split(",")] if args.max_concurrency else [None]
    labels = [s.label for s in specs]
    servers, cores = {}, {}
    try:
        if not args.sequential:
            for s in specs:
                servers[s.label] = start(s, cfg)
        raw: dict = {c: {label: [] for label in labels} for c in concs}
        for i, c in enumerate(concs):
            args.conc = c
            for label, srv in servers.items():  # warm-up, not counted
                cores[label] = srv.cores
                asyncio.run(run(args, srv.base_url, 10_000 + i))
            for r in range(args.runs):
                for s in alternated(specs, r):
                    if args.sequential:
                        servers[s.label] = start(s, cfg)
                        asyncio.run(run(args, servers[s.label].base_url, 10_000 + i))
                    srv = servers[s.label]
                    cores[s.label] = srv.cores
                    res = asyncio.run(run(args, srv.base_url, 100 * i + r))
                    if args.sequential:
                        servers.pop(s.label).stop()
                    if res["failed"]:
                        raise RuntimeError(f"{s.label}: {res['failed']} requests failed: "
                                           f"{res['first_error']}")
                    raw[c][s.label].append(res)
                    print(f"  concurrency {c} round {r} {s.label:10s} "
                          + "  ".join(f"{m} {f(res):.1f}" for m, f in HEADLINE.items()), flush=True)
    finally:
        for srv in servers.values():
            srv.stop()
    out = {"cpu": cpu_name(), "dtype": cfg.dtype, "cores": cores, "args": vars(args), "by_concurrency": {}}
    for c in concs:
        med = {label: {m: statistics.median(f(s) for s in raw[c][label]) for m, f in HEADLINE.items()}
               for label in labels}
        print(f"\n{args.workload}, concurrency {c}; {cpu_name()}; dtype {cfg.dtype}")
        for s in specs:
            print(f"  {s.label} ({s.kind}): {cores[s.label]}")
        print(comparison_table({m: {label: med[label][m] for label in labels} for m in HEADLINE},
                               f"metric (median of {args.runs})"))
        out["by_concurrency"][c] = {"medians": med, "raw": raw[c]}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default=None, help="a running server's OpenAI root (…/v1)")
    p.add_argument("--server", action="append", default=[], metavar="SPEC",
                   help="start this server here: KIND or LABEL=KIND[@TREE] [FLAGS], KIND nanoserve|vllm|"
                        "llamacpp (repeat to compare; the first is the reference of the ratios)")
    p.add_argument("--runs", type=int, default=3, help="with --server: alternated rounds")
    p.add_argument("--sequential", action="store_true", help="with --server: one server up at a time")
    p.add_argument("--memory", action="store_true",
                   help="with --server: each server's resident memory after one completion")
    p.add_argument("--kv-cache-gb", type=float, default=1.0, help="with --server: every server's KV budget")
    p.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--workload", default="random",
                   choices=["random", "shared-prefix", "docqa", "multiround", "schema-arrival"])
    p.add_argument("--streams", type=int, default=8,
                   help="schema-arrival: completions decoding when it arrives")
    p.add_argument("--settle", type=int, default=24, help="schema-arrival: tokens each stream has before it")
    p.add_argument("--num-prompts", type=int, default=None, help="random: default max(32, 2 x concurrency)")
    p.add_argument("--input-len", type=int, default=256, help="random: prompt length in words (~tokens)")
    p.add_argument("--prefix-len", type=int, default=0, help="words shared by every prompt (shared-prefix: "
                                                              "default half of --input-len)")
    p.add_argument("--docs", type=int, default=16, help="docqa: documents")
    p.add_argument("--users", type=int, default=16, help="multiround: conversations")
    p.add_argument("--doc-len", type=int, default=1024,
                   help="docqa / multiround: tokens per document or context")
    p.add_argument("--question-len", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2, help="docqa / multiround")
    p.add_argument("--output-len", type=int, default=64, help="tokens generated per request (ignore_eos)")
    p.add_argument("--max-concurrency", default=None, help="most requests in flight (default: all); "
                                                           "with --server, several comma-separated")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrival rate in req/s (default: inf = all at once)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    p.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the warm-up request")
    p.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON")
    add_peer_args(p)
    args = p.parse_args(argv)
    if bool(args.base_url) == bool(args.server):
        p.error("give either --base-url or --server")
    if args.server:
        out = compare(args, [ServerSpec.parse(s) for s in args.server])
        write_json(args.json, out)
        return 0
    args.conc = int(args.max_concurrency) if args.max_concurrency else None
    if args.workload == "schema-arrival":
        res = asyncio.run(schema_arrival(args, args.base_url, args.seed))
        print_schema_arrival(args.base_url, res)
        write_json(args.json, res)
        return 0
    summary = asyncio.run(run(args, args.base_url, args.seed, args.warmup))
    print_serving_metrics(summary, args.base_url)
    write_json(args.json, summary)
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
