"""Offline throughput: --num-prompts random-token prompts (default 32 x 256 in / 128 out, greedy,
ignore_eos) through the offline `LLM`, timed around generate; output and total token throughput as
bench/common.py defines them, medians of --repeats runs.

    python bench/throughput.py                          # nanoserve alone
    python bench/throughput.py --peer vllm              # vLLM-CPU's offline LLM alternated with it
    python bench/throughput.py --base /tmp/base         # A/B against another checkout's nanoserve

Each timed run has fresh prompts (seed = run index; every side gets the same ones in a run, so none
can hit a prefix cached by an earlier run), and the sides alternate A B, B A, ... so drift of the
machine hits both alike. With --peer vllm both engines are loaded once, with the same dtype (the one
`--dtype auto` picks on this CPU) and the same KV budget, each with its own thread defaults (stated
in the output). With --base (a checkout, e.g. `git worktree add /tmp/base <rev>`) every run of
either side is a fresh process of this script with that tree's nanoserve. The last line is the
result as JSON (also written with --json).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, OtherTree, alternate, auto_dtype, child_argv, cpu_name, token_prompts, write_json
from peers import VllmOffline, add_peer_args, peer_config


class Nanoserve:
    def __init__(self, args) -> None:
        import torch

        from nanoserve import LLM, SamplingParams
        # unset options stay out (the engine's defaults), so a --base tree without an option still runs
        kw = {k: getattr(args, k) for k in ("block_size", "max_num_batched_tokens", "tensor_parallel_size",
                                            "gguf_dequantize") if getattr(args, k)}
        self.llm = LLM(args.model, dtype=args.dtype, enable_prefix_caching=False,
                       max_num_seqs=args.max_num_seqs, kv_cache_gb=args.kv_cache_gb, **kw)
        self.SamplingParams = SamplingParams
        self.cores = f"offline LLM, {torch.get_num_threads()} compute thread(s)"
        self.llm.generate(token_prompts(4, 64, seed=-1),
                          SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))

    def run(self, prompts: list[list[int]], output_len: int) -> dict:
        params = self.SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        t0 = time.perf_counter()
        outs = self.llm.generate(prompts, params)
        elapsed = time.perf_counter() - t0
        assert all(len(o.outputs[0].token_ids) == output_len for o in outs)
        return {"elapsed_s": elapsed, "output_tokens": len(prompts) * output_len,
                "prompt_tokens": sum(map(len, prompts))}


class Tree(OtherTree):
    """nanoserve from a checkout, a fresh process per run (`--one-run PROMPTS.json`)."""

    def run(self, prompts: list[list[int]], output_len: int) -> dict:
        with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
            json.dump(prompts, f)
            f.flush()
            return self.run_child("--one-run", f.name)


def summarize(runs: list[dict]) -> dict:
    el = statistics.median(r["elapsed_s"] for r in runs)
    out, total = runs[0]["output_tokens"], runs[0]["output_tokens"] + runs[0]["prompt_tokens"]
    return {"elapsed_s": el, "output_tok_s": out / el, "total_tok_s": total / el,
            "runs_s": [r["elapsed_s"] for r in runs]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="nanoserve --model (default: the embedded SmolLM2-135M)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="auto", help="auto resolves here and every side uses it")
    ap.add_argument("--block-size", type=int, default=0, help="default: nanoserve's own")
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: nanoserve's own")
    ap.add_argument("--tensor-parallel-size", type=int, default=None, help="nanoserve -tp (CPU: gloo ranks)")
    ap.add_argument("--kv-cache-gb", type=int, default=1,
                    help="KV budget of each side (vLLM takes whole GiB)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gguf-dequantize", action="store_true",
                    help="nanoserve --gguf-dequantize (a GGUF's weights as floats)")
    ap.add_argument("--peer", choices=["vllm"], default=None, help="alternate with vLLM-CPU's offline LLM")
    ap.add_argument("--base", type=Path, default=None, help="alternate with this checkout's nanoserve")
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the result here")
    ap.add_argument("--one-run", default=None, help=argparse.SUPPRESS)  # child: these prompts once, JSON out
    add_peer_args(ap)
    args = ap.parse_args()
    if args.dtype == "auto":
        args.dtype = auto_dtype()
    prompts = lambda r: token_prompts(args.num_prompts, args.input_len, seed=r)  # noqa: E731
    if args.one_run is not None:
        print(json.dumps(Nanoserve(args).run(json.loads(Path(args.one_run).read_text()), args.output_len)))
        return 0
    print(f"workload: {args.num_prompts} prompts x {args.input_len} tokens in, {args.output_len} out; "
          f"dtype {args.dtype}; {cpu_name()}", flush=True)
    child = child_argv(sys.argv[1:])
    sides = {"nanoserve": Tree(ROOT, "throughput.py", child) if args.base else Nanoserve(args)}
    if args.base:
        sides["base"] = Tree(args.base.resolve(), "throughput.py", child)
    try:
        if args.peer == "vllm":
            sides["vllm"] = VllmOffline(peer_config(args, args.dtype, args.kv_cache_gb))

        def one(name: str, r: int) -> dict:
            res = sides[name].run(prompts(r), args.output_len)
            print(f"  run {r} {name:9s} {res['elapsed_s']:.2f}s", flush=True)
            return res
        runs = alternate(list(sides), args.repeats, one)
    finally:
        if "vllm" in sides:
            sides["vllm"].close()
    result = {"cpu": cpu_name(), "dtype": args.dtype, "workload": vars(args),
              "cores": {k: s.cores for k, s in sides.items()},
              **{k: dict(summarize(v), runs=v) for k, v in runs.items()}}
    for name in sides:
        s = result[name]
        print(f"{name:9s}: {s['output_tok_s']:.1f} output tok/s, {s['total_tok_s']:.1f} total tok/s "
              f"(median of {len(s['runs_s'])}: {s['elapsed_s']:.2f}s); {sides[name].cores}")
    for other in list(sides)[1:]:
        result[f"ratio_output_tok_s_nanoserve_over_{other}"] = ratio = (
            result["nanoserve"]["output_tok_s"] / result[other]["output_tok_s"])
        per_run = [o["elapsed_s"] / n["elapsed_s"] for n, o in zip(runs["nanoserve"], runs[other])]
        print(f"ratio nanoserve / {other} (median / median): {ratio:.3f}x; "
              f"per run {', '.join(f'{x:.2f}' for x in per_run)}")
    write_json(args.json, result)
    print(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
