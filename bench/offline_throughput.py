"""Offline throughput: N random-token prompts (default 32 x 256 in / 128 out, ignore_eos).

    python bench/offline_throughput.py                 # nanoserve alone
    python bench/offline_throughput.py --peer vllm     # plus vLLM CPU on the same workload, and the ratio

Prints output tokens/s and total tokens/s (median over --repeats timed runs, after one warm-up)."""
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


def bench_nanoserve(args, prompts) -> dict:
    from nanoserve import LLM, SamplingParams
    kw = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    if args.block_size:
        kw["block_size"] = args.block_size
    llm = LLM(args.model, dtype=args.dtype, enable_prefix_caching=False, **kw)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm-up
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        times.append(time.perf_counter() - t0)
        assert all(len(o.outputs[0].token_ids) == args.output_len for o in outs)
    el = statistics.median(times)
    out_tokens = len(prompts) * args.output_len
    total = out_tokens + sum(map(len, prompts))
    return {"elapsed_s": el, "output_tok_s": out_tokens / el, "total_tok_s": total / el, "runs_s": times}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="nanoserve --model (default: embedded SmolLM2-135M)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--block-size", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--peer", choices=["vllm"], default=None)
    ap.add_argument("--hf-dir", default=None, help="HF folder for the peer (default: exported embedded model)")
    args = ap.parse_args()
    prompts = make_prompts(args.num_prompts, args.input_len)
    print(f"workload: {args.num_prompts} prompts x {args.input_len} tokens in, {args.output_len} out")
    ours = bench_nanoserve(args, prompts)
    print(f"nanoserve: {ours['output_tok_s']:.1f} output tok/s, {ours['total_tok_s']:.1f} total tok/s "
          f"(median of {args.repeats}: {ours['elapsed_s']:.2f}s)")
    result = {"nanoserve": ours}
    if args.peer == "vllm":
        from export_hf import export_embedded_hf
        from vllm_peer import run_vllm_offline
        hf_dir = args.hf_dir or export_embedded_hf(str(Path.home() / ".cache/nanoserve/smollm2-hf"))
        peer = run_vllm_offline(hf_dir, prompts, args.output_len)
        result["vllm"] = peer
        print(f"vllm-cpu:  {peer['output_tok_s']:.1f} output tok/s, {peer['total_tok_s']:.1f} total tok/s")
        print(f"ratio nanoserve/vllm: output {ours['output_tok_s'] / peer['output_tok_s']:.2f}x, "
              f"total {ours['total_tok_s'] / peer['total_tok_s']:.2f}x")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
