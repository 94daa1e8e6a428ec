"""Latency of the offline engine: cold TTFT at given prompt lengths, and the decode step at given
batch sizes and context lengths; optionally against vLLM-CPU or another checkout, and where the
time goes inside nanoserve's forward pass.

    python bench/latency.py --ttft-lens 1024,4000 --decode-batch 8,32 --decode-ctx 256
    python bench/latency.py --threads 1 --peer vllm --runs 3      # per core, against vLLM-CPU
    python bench/latency.py --threads 2 --base /tmp/base --decode-batch ''   # A/B of cold TTFT
    python bench/latency.py --threads 1 --breakdown --decode-batch ''        # where a prefill's time goes
    python bench/latency.py --tp-wire --decode-batch 1,32    # a tensor-parallel step message's codec

Cold TTFT: one fresh prompt (random token ids, no prefix any side has seen) with max_tokens=1, timed
around generate; median of --prompts prompts per length and run. Decode step: --decode-steps K; the
time of generating a batch of fresh prompts with max_tokens 1+K minus that of another batch of the
same shape with max_tokens 1, over K: one decode step at context ctx..ctx+K, measured the same way
from outside any engine; the max_tokens=1 run is also reported (prefill of the batch + first token).
Runs alternate the sides (A B, B A, ...); every side gets the same prompts in a run; medians of --runs.

--threads N: N compute threads pinned to the last N cores (where vLLM's CPU binding puts its
worker, keeping the first for its scheduler); default: torch's own. vLLM-CPU keeps its own binding
(bench/peers.py, --vllm-cores). --base: every run of either side is a fresh process of this script
with that checkout's nanoserve. --breakdown: every call of each part of nanoserve's forward pass
is timed (the linear layers by projection, norms, RoPE, KV write, attention, LM head; the rest is
the attention backend's Python and copies, batch building, scheduling and sampling).
--tp-wire: encode + decode of the decode step that rank 0 sends to the other tensor-parallel ranks
(a batch of rows 16 blocks past --decode-ctx each), with the typed codec and with pickle (what it
replaced), median of 20,000; no model is loaded.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

from common import ROOT, alternated, auto_dtype, comparison_table, cpu_name, run_in_tree, token_prompts, write_json
from peers import VllmOffline, add_peer_args, peer_config


def timed(fn, acc: dict[str, float], label: str):
    def wrapper(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            acc[label] += time.perf_counter() - t
    return wrapper


class Timed:
    """Proxy for an object whose listed methods add their time to `acc[label]`."""

    def __init__(self, target, acc: dict[str, float], labels: dict[str, str]) -> None:
        self._target, self._acc, self._labels = target, acc, labels

    def __getattr__(self, name: str):
        fn = getattr(self._target, name)
        return timed(fn, self._acc, self._labels[name]) if name in self._labels and callable(fn) else fn

    def __call__(self, *a, **kw):
        return self.__getattr__("__call__")(*a, **kw)


class Breakdown:
    """Times the parts of nanoserve's forward pass (C++ kernels and linear layers are synchronous on CPU)."""

    def __init__(self, llm) -> None:
        eng, self.acc = llm.engine, defaultdict(float)
        model, attn, acc = eng.model, eng.runner.attn, self.acc
        for layer in model.layers:
            for attr, label in [("qkv_lin", "linear qkv"), ("o_lin", "linear o"), ("gate_lin", "linear gate+up"),
                                ("up_lin", "linear gate+up"), ("gate_up_lin", "linear gate+up"),
                                ("down_lin", "linear down")]:
                if getattr(layer, attr, None) is not None:
                    labels = dict.fromkeys(("__call__", "silu", "times"), label)
                    setattr(layer, attr, Timed(getattr(layer, attr), acc, labels))
        model.lm_head_lin = Timed(model.lm_head_lin, acc, {"__call__": "lm head"})
        if model.kernels is not None:
            model.kernels = Timed(model.kernels, acc, {"add_rms_norm": "add+rmsnorm", "rope_": "rope"})
            attn.kernels = Timed(attn.kernels, acc, {"write_kv": "kv write", "paged_prefill_attention": "attention",
                                                     "paged_decode_attention": "attention"})
        attn.forward = timed(attn.forward, acc, "_attn_forward")
        model.forward = timed(model.forward, acc, "_model")
        eng.runner.run = timed(eng.runner.run, acc, "_runner")

    def parts(self, total: float) -> dict[str, float]:
        acc = self.acc
        parts = {k: v for k, v in acc.items() if not k.startswith("_")}
        inner = sum(v for k, v in parts.items() if k not in ("attention", "kv write"))
        parts["attention backend: Python, copies"] = (acc["_attn_forward"] - parts.get("attention", 0)
                                                      - parts.get("kv write", 0))
        parts["model: other (embed, views, Python)"] = acc["_model"] - inner - acc["_attn_forward"]
        parts["runner: batch building"] = acc["_runner"] - acc["_model"]
        parts["engine: schedule, sample, output"] = total - acc["_runner"]
        acc.clear()
        return parts


class Nanoserve:
    def __init__(self, args) -> None:
        import torch

        from nanoserve import LLM, SamplingParams
        batched = {"max_num_batched_tokens": args.max_num_batched_tokens} if args.max_num_batched_tokens else {}
        self.llm = LLM(args.model, dtype=args.dtype, enable_prefix_caching=False, kv_cache_gb=1,
                       max_num_seqs=max(args.batches + [1]), **batched)
        self.SamplingParams = SamplingParams
        self.breakdown = Breakdown(self.llm) if args.breakdown else None
        self.cores = f"{torch.get_num_threads()} compute thread(s) on cpus {sorted(os.sched_getaffinity(0))}"
        self.run(token_prompts(1, max(args.lens + [300]), seed=-3), 1)  # warm-up: kernel build, oneDNN JIT

    def run(self, prompts: list[list[int]], max_tokens: int) -> dict:
        params = self.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        self.llm.generate(prompts, params)
        elapsed = time.perf_counter() - t0
        return {"elapsed_s": elapsed, **({"parts_s": self.breakdown.parts(elapsed)} if self.breakdown else {})}


class OtherTree:
    """nanoserve from a checkout: each run a fresh process of this script (`--one-run R`)."""

    def __init__(self, tree: Path, argv: list[str]) -> None:
        self.tree, self.argv, self.cores = tree, argv, f"a fresh process of {tree} per run"

    def measure(self, args, r: int) -> dict:
        return run_in_tree(self.tree, "latency.py", [*self.argv, "--one-run", str(r)])


def measure(side, args, r: int) -> dict:
    """One run of every measurement on one side: ms, and the parts (ms) with --breakdown."""
    if isinstance(side, OtherTree):
        return side.measure(args, r)
    out: dict = {"ttft_ms": {}, "decode_step_ms": {}, "prefill_ms": {}, "parts_ms": {}}
    for i, n in enumerate(args.lens):
        runs = [side.run(token_prompts(1, n, seed=1000 * r + 10 * i + k), 1) for k in range(args.prompts)]
        best = sorted(runs, key=lambda x: x["elapsed_s"])[len(runs) // 2]
        out["ttft_ms"][str(n)] = best["elapsed_s"] * 1e3
        if "parts_s" in best:
            out["parts_ms"][f"ttft {n}"] = ({k: v * 1e3 for k, v in best["parts_s"].items()}
                                            | {"total": best["elapsed_s"] * 1e3})
    for b in args.batches:
        for c in args.contexts:
            key, seed = f"{b} x {c}", 5000 + 1000 * r + b + c
            one = side.run(token_prompts(b, c, seed), 1)
            more = side.run(token_prompts(b, c, seed + 500), 1 + args.decode_steps)
            out["decode_step_ms"][key] = (more["elapsed_s"] - one["elapsed_s"]) / args.decode_steps * 1e3
            out["prefill_ms"][key] = one["elapsed_s"] * 1e3
            if "parts_s" in one:
                parts = {k: (more["parts_s"].get(k, 0) - v) / args.decode_steps * 1e3
                         for k, v in one["parts_s"].items()}
                out["parts_ms"][f"decode {key}"] = parts | {"total": out["decode_step_ms"][key]}
    return out


def tp_wire(batches: list[int], ctx: int, reps: int = 20_000) -> None:
    import pickle
    from nanoserve.engine.tp_messages import Step, decode, encode
    from nanoserve.runner.step_plan import StepPlan

    def median_us(fn) -> float:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter_ns()
            fn()
            times.append(time.perf_counter_ns() - t0)
        return statistics.median(times) / 1000
    for b in batches:
        blocks = ctx // 16 + 1
        tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(b)]
        pos = [ctx - i % 5 for i in range(b)]
        step = Step(StepPlan([1000 + i for i in range(b)], pos, [t[p // 16] for t, p in zip(tables, pos)],
                             [p % 16 for p in pos], [], [1] * b, [p + 1 for p in pos], tables, b, None), [])
        assert decode(encode(step)) == step
        typed, pickled = len(encode(step)), len(pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL))
        t = median_us(lambda: decode(encode(step)))
        p = median_us(lambda: pickle.loads(pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)))
        print(f"batch {b}, {blocks}-block tables: typed {t:.1f} us ({typed} B), pickle {p:.1f} us ({pickled} B); "
              f"{cpu_name()}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="nanoserve --model (default: the embedded SmolLM2-135M)")
    ap.add_argument("--dtype", default="auto", help="auto resolves here and every side uses it")
    ap.add_argument("--ttft-lens", default="256,1024,4000", help="cold TTFT prompt lengths ('' = none)")
    ap.add_argument("--prompts", type=int, default=1, help="fresh prompts per length and run (median)")
    ap.add_argument("--decode-batch", default="8", help="decode batch sizes ('' = none)")
    ap.add_argument("--decode-ctx", default="256", help="decode context lengths")
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: nanoserve's own")
    ap.add_argument("--threads", type=int, default=None, help="compute threads, pinned to the last cores")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--peer", choices=["vllm"], default=None, help="alternate with vLLM-CPU's offline LLM")
    ap.add_argument("--base", type=Path, default=None, help="alternate with this checkout's nanoserve")
    ap.add_argument("--breakdown", action="store_true", help="time the parts of nanoserve's forward pass")
    ap.add_argument("--tp-wire", action="store_true", help="time the tensor-parallel step message codec and exit")
    ap.add_argument("--json", default=None, metavar="FILE")
    ap.add_argument("--one-run", type=int, default=None, help=argparse.SUPPRESS)  # child: one run, JSON out
    add_peer_args(ap)
    args = ap.parse_args()
    args.lens = [int(x) for x in args.ttft_lens.split(",") if x]
    args.batches = [int(x) for x in args.decode_batch.split(",") if x]
    args.contexts = [int(x) for x in args.decode_ctx.split(",") if x]
    if args.tp_wire:
        return tp_wire(args.batches, args.contexts[0]) or 0
    if args.dtype == "auto":
        args.dtype = auto_dtype()
    sides: dict = {}
    if args.peer == "vllm" and args.one_run is None:  # started before this process pins itself
        sides["vllm"] = VllmOffline(peer_config(args, args.dtype))
    try:
        if args.threads:
            import torch
            os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[-args.threads:])
            torch.set_num_threads(args.threads)
        if args.one_run is not None:
            print(json.dumps(measure(Nanoserve(args), args, args.one_run)))
            return 0
        child = [a for a in sys.argv[1:] if a not in ("--json", args.json, "--base", str(args.base))]
        sides = {"nanoserve": OtherTree(ROOT, child) if args.base else Nanoserve(args), **sides}
        if args.base:
            sides["base"] = OtherTree(args.base.resolve(), child)
        runs: dict[str, list[dict]] = {k: [] for k in sides}
        for r in range(args.runs):
            for name in alternated(list(sides), r):
                runs[name].append(m := measure(sides[name], args, r))
                print(f"  run {r} {name:9s} " + "  ".join(
                    f"{what} {k}: {v:.1f} ms" for what in ("ttft_ms", "decode_step_ms") for k, v in m[what].items()),
                    flush=True)
    finally:
        if "vllm" in sides:
            sides["vllm"].close()
    med = {name: {what: {k: statistics.median(x[what][k] for x in rs) for k in rs[0][what]}
                  for what in ("ttft_ms", "decode_step_ms", "prefill_ms")} for name, rs in runs.items()}
    print(f"\n{cpu_name()}; dtype {args.dtype}; medians of {args.runs}")
    for name, side in sides.items():
        print(f"  {name}: {side.cores}")
    rows = {f"{title}, {k}{unit}": {n: med[n][what][k] for n in sides}
            for title, what, unit in (("cold TTFT", "ttft_ms", " tokens"), ("decode step", "decode_step_ms", ""),
                                      ("prefill + first token", "prefill_ms", ""))
            for k in med["nanoserve"][what]}
    if rows:
        print(comparison_table(rows, "measurement (ms)"))
    parts = {}
    if args.breakdown and runs["nanoserve"][0]["parts_ms"]:
        rs = runs["nanoserve"]
        parts = {case: {k: statistics.median(x["parts_ms"][case][k] for x in rs) for k in rs[0]["parts_ms"][case]}
                 for case in rs[0]["parts_ms"]}
        cases = list(parts)
        print("\nnanoserve, where the time goes (ms, share of the total), medians\n| part | " + " | ".join(cases)
              + " |\n" + "|---" * (1 + len(cases)) + "|")
        for k in sorted(parts[cases[0]], key=lambda k: (k == "total", -parts[cases[0]][k])):
            print(f"| {k} | " + " | ".join(
                f"{parts[c].get(k, 0):.1f} ({100 * parts[c].get(k, 0) / parts[c]['total']:.0f}%)" for c in cases) + " |")
    write_json(args.json, {"cpu": cpu_name(), "dtype": args.dtype, "args": vars(args),
                           "cores": {k: s.cores for k, s in sides.items()}, "runs": runs, "medians": med,
                           "parts_ms": parts})
    return 0


if __name__ == "__main__":
    sys.exit(main())
