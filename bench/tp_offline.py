"""Tensor parallelism on CPU: offline throughput of -tp 1 vs -tp N in one run, and what the
per-step broadcast of the plan costs rank 0.

    python bench/tp_offline.py                     # tp 1 vs tp 2, a Llama-shaped model with dummy weights
    python bench/tp_offline.py --runs 5 --tp 2 --num-prompts 16

The embedded model has 9 heads (2 ranks cannot split it), so the default model here is a
Llama-shaped config with random weights (`--load-format dummy`): hidden 1024, 16 heads, 8 KV
heads, 12 layers (~190M parameters), the embedded model's tokenizer. Both engines are loaded once
with the same dtype and the same total KV budget, on the same cores (tp 1 computes with every
thread torch gives it; each of the N ranks with 1/N of them); runs alternate A B A B with fresh
prompts each. Reported: medians of output tok/s and their ratio; per step: rank 0's time to send
the plan (pickle + the shared-memory channel, or gloo broadcasts), and the time spent in the
model's collectives (all-reduces and the logits gather: through shared memory on one CPU node,
`--gloo` to compare) as seen by rank 0, waits for the other ranks included. The last line is the
raw JSON."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_throughput import make_prompts  # noqa: E402


def write_model(folder: Path, args) -> Path:
    from transformers import LlamaConfig
    from nanoserve.models.loader import embedded_source, load_tokenizer, materialize
    src = materialize(embedded_source())
    tok = load_tokenizer(src)
    LlamaConfig(vocab_size=len(tok), hidden_size=args.hidden, intermediate_size=args.intermediate,
                num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


class Timed:
    """Wraps a function, accumulating its wall time (rank 0's view)."""
    def __init__(self, fn) -> None:
        self.fn, self.seconds, self.calls = fn, 0.0, 0

    def __call__(self, *a, **kw):
        t0 = time.perf_counter()
        try:
            return self.fn(*a, **kw)
        finally:
            self.seconds += time.perf_counter() - t0
            self.calls += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--kv-cache-gb", type=float, default=1.0)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--gloo", action="store_true", help="messages and collectives through gloo, not shared memory")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from nanoserve import LLM, SamplingParams
    folder = write_model(Path(tempfile.mkdtemp(prefix="tp-bench-")), args)
    kw = dict(dtype=args.dtype, load_format="dummy", kv_cache_gb=args.kv_cache_gb, enable_prefix_caching=False)
    # rank 0 lives in this process and takes its share of the cores (threads, affinity): each
    # engine's runs get back what it was built with
    placement = {1: (torch.get_num_threads(), os.sched_getaffinity(0))}
    if args.gloo:  # the slot size is rank 0's decision; 0 = no shared memory
        import nanoserve.engine.llm_engine as le
        le.shm_slot_bytes = lambda *a: 0
    engines = {1: LLM(str(folder), **kw), args.tp: LLM(str(folder), tensor_parallel_size=args.tp, **kw)}
    placement[args.tp] = (torch.get_num_threads(), os.sched_getaffinity(0))
    par = engines[args.tp].engine
    send = par.followers.channel.send = Timed(par.followers.channel.send)
    tp = par.model.tp  # the model's collectives (shared memory on one CPU node, else gloo)
    coll = {name: Timed(getattr(tp, name)) for name in ("all_reduce", "gather_logits")}
    for name, t in coll.items():
        setattr(tp, name, t)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for n, llm in engines.items():  # warm-up
        torch.set_num_threads(placement[n][0])
        os.sched_setaffinity(0, placement[n][1])
        llm.generate(make_prompts(4, 64, seed=-1), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    runs: dict[int, list[float]] = {n: [] for n in engines}
    steps = {n: [] for n in engines}
    per_step_send, per_step_coll = [], []
    for r in range(args.runs):
        prompts = make_prompts(args.num_prompts, args.input_len, seed=r)
        for n in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
            eng = engines[n].engine
            torch.set_num_threads(placement[n][0])
            os.sched_setaffinity(0, placement[n][1])
            s0, c0 = eng.stats.steps, (send.seconds, sum(t.seconds for t in coll.values()))
            t0 = time.perf_counter()
            outs = engines[n].generate(prompts, params)
            runs[n].append(time.perf_counter() - t0)
            assert all(len(o.outputs[0].token_ids) == args.output_len for o in outs)
            n_steps = eng.stats.steps - s0
            steps[n].append(n_steps)
            if n == args.tp:
                per_step_send.append((send.seconds - c0[0]) / n_steps)
                per_step_coll.append((sum(t.seconds for t in coll.values()) - c0[1]) / n_steps)
    out_tokens = args.num_prompts * args.output_len
    med = {n: statistics.median(v) for n, v in runs.items()}
    result = {
        "cpu": _cpu_name(), "dtype": str(par.dtype).removeprefix("torch."),
        "threads": {f"tp{n}": f"{t} on cpus {sorted(c)}" for n, (t, c) in placement.items()},
        "model": {k: getattr(args, k) for k in ("hidden", "intermediate", "layers", "heads", "kv_heads")},
        "workload": f"{args.num_prompts} x {args.input_len} in / {args.output_len} out",
        "output_tok_s": {f"tp{n}": out_tokens / t for n, t in med.items()},
        "ratio_tpN_over_tp1": med[1] / med[args.tp],
        "steps_per_run": {f"tp{n}": statistics.median(v) for n, v in steps.items()},
        "broadcast_us_per_step": statistics.median(per_step_send) * 1e6,
        "collectives_ms_per_step": statistics.median(per_step_coll) * 1e3,
        "collectives": "shared memory" if tp.shm is not None else "gloo",
        "runs_s": {f"tp{n}": v for n, v in runs.items()}}
    print(f"{result['cpu']}, {result['dtype']}, {result['workload']}, medians of {args.runs}:")
    for n in engines:
        print(f"  tp {n}: {out_tokens / med[n]:.1f} output tok/s")
    print(f"  tp {args.tp} / tp 1: {result['ratio_tpN_over_tp1']:.3f}x")
    print(f"  per step on rank 0: plan broadcast {result['broadcast_us_per_step']:.0f} us, "
          f"collectives ({result['collectives']}) {result['collectives_ms_per_step']:.2f} ms")
    for llm in engines.values():
        llm.close()
    line = json.dumps(result)
    if args.json:
        Path(args.json).write_text(line + "\n")
    print(line)


def _cpu_name() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


if __name__ == "__main__":
    main()
