"""vLLM (CPU build) as a benchmark peer: offline `LLM.generate` over token-id prompts, run in vLLM's own venv.

This file is both the parent-side API (stdlib only) and, with `--child JOB.json`, the script the vLLM
interpreter runs, so the two sides cannot drift apart.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time

VLLM_PYTHON = os.environ.get("NANOSERVE_VLLM_PYTHON", "/tmp/vllm-cpu/bin/python")
MARKER = "NANOSERVE_VLLM_RESULT "


def run_vllm_offline(
    hf_dir: str,
    prompt_token_ids: list[list[int]],
    max_tokens: int,
    ignore_eos: bool = True,
    kv_cache_gb: float = 1.0,
) -> dict:
    # vLLM parses VLLM_CPU_KVCACHE_SPACE with int(); a fractional value would crash the child.
    if kv_cache_gb < 1 or kv_cache_gb != int(kv_cache_gb):
        raise ValueError(f"kv_cache_gb must be a whole number of GiB >= 1, got {kv_cache_gb}")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(int(kv_cache_gb))}
    job = {"hf_dir": hf_dir, "prompts": prompt_token_ids, "max_tokens": max_tokens, "ignore_eos": ignore_eos}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
    try:
        proc = subprocess.run(
            [VLLM_PYTHON, os.path.abspath(__file__), "--child", f.name],
            env=env, capture_output=True, text=True,
        )
    finally:
        os.unlink(f.name)
    lines = [l for l in proc.stdout.splitlines() if l.startswith(MARKER)]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout)[-4000:]
        raise RuntimeError(f"vLLM child failed (rc={proc.returncode}, python={VLLM_PYTHON}):\n{tail}")
    return json.loads(lines[-1][len(MARKER):])


def _child(job_path: str) -> None:
    from vllm import LLM, SamplingParams  # only importable in the vLLM venv

    with open(job_path) as f:
        job = json.load(f)
    t0 = time.perf_counter()
    llm = LLM(model=job["hf_dir"], dtype="bfloat16", max_model_len=4096, seed=0)
    startup_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=job["ignore_eos"])
    prompts = [{"prompt_token_ids": ids} for ids in job["prompts"]]
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    out_toks = sum(len(o.outputs[0].token_ids) for o in outs)
    in_toks = sum(len(o.prompt_token_ids) for o in outs)
    res = {
        "elapsed_s": elapsed, "output_tokens": out_toks, "prompt_tokens": in_toks,
        "output_tok_s": out_toks / elapsed, "total_tok_s": (out_toks + in_toks) / elapsed,
        "startup_s": startup_s,
    }
    print(MARKER + json.dumps(res), flush=True)


def default_prompts(n: int = 32, length: int = 256, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        _child(sys.argv[2])
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from export_hf import DEFAULT_OUT, export_embedded_hf

        hf = export_embedded_hf(DEFAULT_OUT)
        print(json.dumps(run_vllm_offline(hf, default_prompts(), max_tokens=128), indent=2))
