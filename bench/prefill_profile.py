"""Where a cold prefill's time goes, end to end: one fresh prompt per length, offline `LLM`, the
server's thread count (one compute thread, pinned to one core, as bench/decode_vs_vllm.py runs it).

    python bench/prefill_profile.py --lens 1024,4000 --runs 3 --json bench/results/prefill_profile.json

Every call of each part of the forward pass is timed (perf_counter around it; CPU ops are
synchronous): the linear layers by projection, the fused norm / RoPE / KV-write kernels, the
attention kernel, the LM head; `engine` is the rest of the generate call (scheduling, batch
building, sampling, detokenization, Python between the parts). Then one run per length under
torch.profiler lists the ATen ops outside those parts (embedding, copies, ...). Medians of --runs
fresh prompts; nanoserve's default chunking (2048 tokens: a 4000-token prompt is a fresh chunk,
then a chunk over cached context).

With --decode N: the same parts for one decode step of N sequences instead (N fresh prompts of
--decode-input tokens generated with max_tokens 1+K minus max_tokens 1, over K=--decode-steps).

    python bench/prefill_profile.py --decode 32 --runs 3"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def timed(fn, acc: dict[str, float], label: str):
    """fn, its time per call added to acc[label]."""
    def wrapper(*a, **kw):
        t = time.perf_counter()
        out = fn(*a, **kw)
        acc[label] += time.perf_counter() - t
        return out
    return wrapper


class Timed:
    """Proxy for an object whose listed methods are timed into `acc[label]`."""

    def __init__(self, target, acc: dict[str, float], labels: dict[str, str]) -> None:
        self._target, self._acc, self._labels = target, acc, labels

    def __getattr__(self, name: str):
        fn = getattr(self._target, name)
        if name not in self._labels or not callable(fn):
            return fn
        return timed(fn, self._acc, self._labels[name])

    def __call__(self, *a, **kw):
        return self.__getattr__("__call__")(*a, **kw)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lens", default="1024,4000")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--top", type=int, default=12, help="ATen ops listed from the profiler run")
    ap.add_argument("--decode", type=int, default=0, metavar="N", help="profile a decode step of N sequences")
    ap.add_argument("--decode-input", type=int, default=256)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--json", default=None, metavar="FILE")
    args = ap.parse_args()
    import torch

    from nanoserve import LLM, SamplingParams
    from offline_throughput import make_prompts
    from vllm_peer import cpu_name
    if args.threads == 1:  # vLLM's worker and nanoserve's engine each get one core of two
        os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
    torch.set_num_threads(args.threads)
    llm = LLM(None, dtype=args.dtype, enable_prefix_caching=False, kv_cache_gb=1,
              **({"max_num_seqs": args.decode} if args.decode else {}))
    eng = llm.engine
    model, attn = eng.model, eng.runner.attn
    acc: dict[str, float] = defaultdict(float)
    for layer in model.layers:
        for attr, label in [("qkv_lin", "linear qkv"), ("o_lin", "linear o"), ("gate_lin", "linear gate+up"),
                            ("up_lin", "linear gate+up"), ("gate_up_lin", "linear gate+up"), ("down_lin", "linear down")]:
            if getattr(layer, attr) is not None:
                setattr(layer, attr, Timed(getattr(layer, attr), acc, {"__call__": label, "silu": label, "times": label}))
    model.lm_head_lin = Timed(model.lm_head_lin, acc, {"__call__": "lm head"})
    if model.kernels is not None:
        model.kernels = Timed(model.kernels, acc, {"add_rms_norm": "add+rmsnorm", "rope_": "rope"})
        attn.kernels = Timed(attn.kernels, acc, {"write_kv": "kv write", "paged_prefill_attention": "attention",
                                                 "paged_decode_attention": "attention"})
    attn.forward = timed(attn.forward, acc, "_attn_forward")
    model.forward = timed(model.forward, acc, "_model")
    eng.runner.run = timed(eng.runner.run, acc, "_runner")
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    lens = [int(x) for x in args.lens.split(",")] if not args.decode else [args.decode]
    llm.generate(make_prompts(1, max(lens), -3), params)  # warm-up: kernel build, oneDNN / brgemm JIT

    def measure(prompts, max_tokens: int) -> dict[str, float]:
        acc.clear()
        t = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        total = time.perf_counter() - t
        parts = {k: v for k, v in acc.items() if not k.startswith("_")}
        inner = sum(v for k, v in parts.items() if k not in ("attention", "kv write"))
        parts["attention backend: Python, copies"] = acc["_attn_forward"] - parts.get("attention", 0.0) - parts.get("kv write", 0.0)
        parts["model: other (embed, views, Python)"] = acc["_model"] - inner - acc["_attn_forward"]
        parts["runner: batch building"] = acc["_runner"] - acc["_model"]
        parts["engine: schedule, sample, output"] = total - acc["_runner"]
        parts["total"] = total
        return parts
    rows: dict[int, list[dict[str, float]]] = {n: [] for n in lens}
    for r in range(args.runs):
        for n in lens:
            if args.decode:  # (1 + K tokens) - (1 token), over K: one decode step's parts
                one = measure(make_prompts(n, args.decode_input, 900 + 10 * r), 1)
                more = measure(make_prompts(n, args.decode_input, 950 + 10 * r), 1 + args.decode_steps)
                parts = {k: (more.get(k, 0.0) - one.get(k, 0.0)) / args.decode_steps for k in more}
            else:
                parts = measure(make_prompts(1, n, 900 + 10 * r + lens.index(n)), 1)
            rows[n].append({k: v * 1e3 for k, v in parts.items()})
            print(f"  run {r} {n:5d} {'sequences' if args.decode else 'tokens'}: {rows[n][-1]['total']:.1f} ms", flush=True)
    med = {n: {k: statistics.median(row[k] for row in rs) for k in rs[0]} for n, rs in rows.items()}
    print(f"\n{cpu_name()}; dtype {model.embed.dtype}; {torch.get_num_threads()} compute thread(s); "
          + (f"one decode step of {args.decode} sequences (context ~{args.decode_input}), " if args.decode else
             "cold prefill + 1 token, ") + f"medians of {args.runs} (ms, share of total)")
    keys = sorted(med[lens[0]], key=lambda k: (k == "total", -med[lens[0]][k]))
    unit = "sequences" if args.decode else "tokens"
    print("| part | " + " | ".join(f"{n} {unit}" for n in lens) + " |\n|---|" + "---|" * len(lens))
    for k in keys:
        print(f"| {k} | " + " | ".join(f"{med[n][k]:.1f} ({100 * med[n][k] / med[n]['total']:.0f}%)" for n in lens) + " |")
    ops = {}
    for n in lens if not args.decode else []:  # the ATen ops outside the timed parts
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            llm.generate(make_prompts(1, n, 5000 + n), params)
        avg = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:args.top]
        ops[n] = [(e.key, e.count, e.self_cpu_time_total / 1e3) for e in avg]
        print(f"\ntorch.profiler, {n} tokens: top ATen ops by self time (ms; the C++ kernels are not ATen ops)")
        for key, count, ms in ops[n]:
            print(f"  {key:60s} {count:6d} calls {ms:8.1f} ms")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"cpu": cpu_name(), "dtype": str(model.embed.dtype), "args": vars(args),
                                               "runs_ms": rows, "medians_ms": med, "profiler_top_ops": ops}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
