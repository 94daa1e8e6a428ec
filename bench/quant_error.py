"""Accuracy of a GGUF served from its blocks: teacher-forced prompt logprobs of the kept model and of
the dequantized one, in fp32 and bf16, each against the dequantized model in fp32 (the HF-exact
reference); mean and max |d logprob| over every prompt token after the first.

    python bench/quant_error.py                      # the embedded SmolLM2-135M Q4_1
    python bench/quant_error.py --model /tmp/random-1b-Q4_0.gguf

In fp32 the kept model's products are exact (summation-order noise); in bf16 on AVX512_VNNI CPUs its
activations are rounded to int8 per 32-block, and the dequantized model in bf16 shows bf16's own share.
"""
from __future__ import annotations

import argparse

from common import cpu_name

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away, there lived",
           "1, 2, 3, 4,", "The quick brown fox jumps over the lazy dog. " * 8]


def prompt_logprobs(model: str | None, **kw) -> list[list[float]]:
    from nanoserve import LLM, SamplingParams
    llm = LLM(model, kv_cache_gb=0.2, enable_prefix_caching=False, **kw)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
        return [[t.logprob for t in o.prompt_logprobs[1:]] for o in outs]
    finally:
        llm.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a GGUF file (default: the embedded SmolLM2-135M)")
    args = ap.parse_args()
    ref = prompt_logprobs(args.model, dtype="float32", gguf_dequantize=True)
    print(f"{cpu_name()}; against the dequantized model in fp32, {sum(map(len, ref))} prompt tokens")
    print("| side | mean abs d logprob | max |\n|---|---|---|")
    for name, kw in (("kept, fp32", dict(dtype="float32")), ("kept, bf16", dict(dtype="bfloat16")),
                     ("dequantized, bf16", dict(dtype="bfloat16", gguf_dequantize=True))):
        got = prompt_logprobs(args.model, **kw)
        d = [abs(a - b) for x, y in zip(got, ref) for a, b in zip(x, y)]
        print(f"| {name} | {sum(d) / len(d):.2e} | {max(d):.2e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
