"""Offline throughput: N random-token prompts (default 32 x 256 in / 128 out, ignore_eos).

    python bench/offline_throughput.py                 # nanoserve alone
    python bench/offline_throughput.py --peer vllm     # vLLM CPU alternated with it, and the ratio

Each timed run uses fresh prompts (seed = run index; the peer gets the same ones in the same
round, so neither side can hit a prefix cached by an earlier run). With --peer, both engines are
loaded once with the same dtype (the one `--dtype auto` picks on this CPU) and the same 1 GiB KV
budget, and their runs alternate A B A B ... so machine drift hits both alike. Prints the medians
and the ratio of medians; the last line is the raw JSON (also written with --json)."""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def make_prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]


class Nanoserve:
    def __init__(self, args) -> None:
        from nanoserve import LLM, SamplingParams
        kw = dict(max_num_seqs=args.max_num_seqs, kv_cache_gb=args.kv_cache_gb)
        if args.block_size:
            kw["block_size"] = args.block_size
        if args.max_num_batched_tokens:  # else the engine's default
            kw["max_num_batched_tokens"] = args.max_num_batched_tokens
        self.llm = LLM(args.model, dtype=args.dtype, enable_prefix_caching=False, **kw)
        self.SamplingParams = SamplingParams
        self.llm.generate(make_prompts(4, 64, seed=-1), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))

    def run(self, prompts: list[list[int]], output_len: int) -> dict:
        params = self.SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        t0 = time.perf_counter()
        outs = self.llm.generate(prompts, params)
        elapsed = time.perf_counter() - t0
        assert all(len(o.outputs[0].token_ids) == output_len for o in outs)
        return {"elapsed_s": elapsed, "output_tokens": len(prompts) * output_len,
                "prompt_tokens": sum(map(len, prompts))}


def summarize(runs: list[dict]) -> dict:
    el = statistics.median(r["elapsed_s"] for r in runs)
    out, total = runs[0]["output_tokens"], runs[0]["output_tokens"] + runs[0]["prompt_tokens"]
    return {"elapsed_s": el, "output_tok_s": out / el, "total_tok_s": total / el, "runs_s": [r["elapsed_s"] for r in runs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="nanoserve --model (default: embedded SmolLM2-135M)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="auto", help="with --peer: auto resolves here and both use it")
    ap.add_argument("--block-size", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: nanoserve's own")
    ap.add_argument("--kv-cache-gb", type=int, default=1, help="KV budget of each side (vLLM takes whole GiB)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--peer", choices=["vllm"], default=None)
    ap.add_argument("--hf-dir", default=None, help="HF folder for the peer (default: exported embedded model)")
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the raw results here")
    args = ap.parse_args()
    from vllm_peer import VllmOffline, auto_dtype, cpu_name
    if args.dtype == "auto":
        args.dtype = auto_dtype()
    print(f"workload: {args.num_prompts} prompts x {args.input_len} tokens in, {args.output_len} out; "
          f"dtype {args.dtype}; {cpu_name()}", flush=True)
    ours = Nanoserve(args)
    peer = None
    if args.peer == "vllm":
        from export_hf import export_embedded_hf
        peer = VllmOffline(args.hf_dir or export_embedded_hf(), args.dtype, args.kv_cache_gb)
    runs: dict[str, list[dict]] = {"nanoserve": [], "vllm": []}
    try:
        for r in range(args.repeats):
            prompts = make_prompts(args.num_prompts, args.input_len, seed=r)
            order = [("nanoserve", ours), ("vllm", peer)][:: 1 if r % 2 == 0 else -1]
            for name, target in order:
                if target is not None:
                    runs[name].append(target.run(prompts, args.output_len))
                    print(f"  run {r} {name:9s} {runs[name][-1]['elapsed_s']:.2f}s", flush=True)
    finally:
        if peer is not None:
            peer.close()
    result = {"cpu": cpu_name(), "dtype": args.dtype, "workload": vars(args),
              **{k: dict(summarize(v), runs=v) for k, v in runs.items() if v}}
    for name in ("nanoserve", "vllm"):
        if name in result:
            s = result[name]
            print(f"{name:9s}: {s['output_tok_s']:.1f} output tok/s, {s['total_tok_s']:.1f} total tok/s "
                  f"(median of {len(s['runs_s'])}: {s['elapsed_s']:.2f}s)")
    if "vllm" in result:
        ratios = [v["elapsed_s"] / n["elapsed_s"] for n, v in zip(runs["nanoserve"], runs["vllm"])]
        result["ratio_output_tok_s"] = result["nanoserve"]["output_tok_s"] / result["vllm"]["output_tok_s"]
        print(f"ratio nanoserve/vllm (median / median): {result['ratio_output_tok_s']:.2f}x; per round "
              f"{', '.join(f'{x:.2f}' for x in ratios)}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
