"""Greedy outputs match HF transformers (fp32, same weights) in every scheduling regime."""
from __future__ import annotations

import pytest

from nanoserve import LLM, SamplingParams
from tests.conftest import KV_GB, hf_greedy, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def tiny_case(tiny_model):
    prompts = random_prompts(6, 3, 70, seed=1)
    return tiny_model, prompts, hf_greedy(tiny_model, prompts, GREEDY.max_tokens)


def test_matches_hf_mixed_batch(tiny_case):
    path, prompts, expected = tiny_case
    llm = LLM(str(path), dtype="float32", block_size=16, kv_cache_gb=KV_GB)
    assert run(llm, prompts) == expected
    # same prompts again: full-block prefix hits, identical tokens
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert sum(o.num_cached_tokens for o in outs) > 0
    llm.engine.check_invariants()
    assert llm.engine.kv.pool.stats().in_use == 0


def test_matches_hf_chunked_prefill(tiny_case):
    path, prompts, expected = tiny_case
    llm = LLM(str(path), dtype="float32", block_size=4, max_num_batched_tokens=7, kv_cache_gb=KV_GB)
    assert run(llm, prompts) == expected


def test_matches_hf_under_preemption(tiny_case):
    path, prompts, expected = tiny_case
    # 30 blocks of 4 tokens: the longest request alone needs ~21, six together far more
    llm = LLM(str(path), dtype="float32", block_size=4, num_kv_blocks=30)
    assert run(llm, prompts) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    llm.engine.check_invariants()
    assert llm.engine.kv.pool.stats().in_use == 0


def test_matches_hf_without_prefix_caching(tiny_path):
    """One architecture: without the cache a first run computes what test_matches_hf_mixed_batch's first
    run computes on every architecture; that nothing is reused does not depend on the model."""
    path, prompts = tiny_path("llama-gqa-tied"), random_prompts(6, 3, 70, seed=1)
    llm = LLM(str(path), dtype="float32", enable_prefix_caching=False, kv_cache_gb=KV_GB)
    assert run(llm, prompts) == hf_greedy(path, prompts, GREEDY.max_tokens)
    assert all(o.num_cached_tokens == 0 for o in llm.generate(prompts, GREEDY))


def test_prompt_logprobs_match_hf(tiny_case):
    """Prompt logprobs (computed chunk by chunk, never from the prefix cache) equal HF's."""
    import torch
    from transformers import AutoModelForCausalLM
    path, prompts, _ = tiny_case
    llm = LLM(str(path), dtype="float32", block_size=4, max_num_batched_tokens=16, kv_cache_gb=KV_GB)
    llm.generate(prompts, GREEDY)  # warm the prefix cache: prompt logprobs must not use it
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        with torch.no_grad():
            lp = torch.log_softmax(ref(torch.tensor([prompt])).logits[0].float(), dim=-1)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for k in range(1, len(prompt)):
            got = out.prompt_logprobs[k]
            assert got.token_id == prompt[k]
            assert got.logprob == pytest.approx(float(lp[k - 1, prompt[k]]), abs=1e-4)
            assert [t for t, _ in got.top] == lp[k - 1].topk(2).indices.tolist()
        assert out.num_cached_tokens == 0


@pytest.fixture(scope="module")
def embedded_llm_fp32(embedded_dir):
    return LLM(dtype="float32", block_size=16, kv_cache_gb=KV_GB)  # 16 everywhere (CUDA's torch default: 256)


def test_embedded_model_matches_hf_from_gguf(embedded_llm_fp32):
    """Reference: transformers' own GGUF loader (its dequantization and Q/K un-permutation)."""
    import torch
    from transformers import AutoModelForCausalLM
    from nanoserve.models.loader import embedded_source
    src = embedded_source()
    ref = AutoModelForCausalLM.from_pretrained(src.path, gguf_file=src.gguf_file, dtype=torch.float32)
    tok = embedded_llm_fp32.tokenizer
    texts = ["The capital of France is", "def fibonacci(n):",  # 5 and 6 tokens; the last two 22 and 30:
             "Once upon a time, in a land far away, there lived a king who had three daughters. The youngest",
             "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"]  # a full 16-token block each, and tokens after it
    prompts = [tok.encode(t) for t in texts]
    assert all(len(p) > 16 for p in prompts[2:])
    # 5 tokens: the prefill and 4 decode steps through the file's weights (HF recomputes every token)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    expected = hf_greedy(ref, prompts, params.max_tokens)
    assert run(embedded_llm_fp32, prompts, params) == expected
    outs = embedded_llm_fp32.generate(prompts, params)  # now with prefix-cache hits: the blocks just computed
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(o.num_cached_tokens > 0 for o in outs[2:])
