"""Bad input raises a clear InvalidRequest naming the field, and the engine keeps serving."""
from __future__ import annotations

import pytest

from conftest import KV_GB
from nanoserve import LLM, InvalidRequest, SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=256, kv_cache_gb=KV_GB)


def ok(llm):
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 3


@pytest.mark.parametrize("prompt, params, param, text", [
    ("", SamplingParams(max_tokens=4), "prompt", "empty"),
    ([], SamplingParams(max_tokens=4), "prompt", "at least one token"),
    ([1, 2, 10**9], SamplingParams(max_tokens=4), "prompt", "out of vocabulary"),
    ([1, -3], SamplingParams(max_tokens=4), "prompt", "out of vocabulary"),
    ("word " * 300, SamplingParams(max_tokens=4), "prompt", "maximum context length is 256"),
    ("Hello", SamplingParams(max_tokens=1000), "max_tokens", "maximum context length is 256"),
])
def test_bad_prompt(llm, prompt, params, param, text):
    with pytest.raises(InvalidRequest, match=text) as e:
        llm.generate([prompt], params)
    assert e.value.param == param
    ok(llm)


@pytest.mark.parametrize("kwargs, param", [
    (dict(max_tokens=-1), "max_tokens"), (dict(temperature=-0.5), "temperature"), (dict(top_p=0), "top_p"),
    (dict(n=0), "n"), (dict(top_k=-5), "top_k"), (dict(logprobs=50), "logprobs"),
])
def test_bad_sampling_params(kwargs, param):
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param


def test_bad_request_in_a_batch_queues_nothing(llm):
    with pytest.raises(InvalidRequest):
        llm.generate(["fine", ""], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished()
    ok(llm)


def test_unknown_model_lists_where_it_looked():
    with pytest.raises(InvalidRequest) as e:
        LLM("no-such-model-xyz")
    msg = str(e.value)
    assert "no-such-model-xyz" in msg and "looked in" in msg and "local store" in msg and "To get it" in msg
    assert e.value.param == "model"


# The KV-budget checks below do not depend on the architecture (the budget is in blocks, every tiny model
# allows 512 positions): one tiny model serves them (every architecture's forward: test_correctness).
@pytest.fixture(scope="module")
def tiny_model(tiny_path):
    return tiny_path("llama-gqa-tied")


def test_request_larger_than_kv_budget_is_rejected(tiny_model):
    llm = LLM(str(tiny_model), dtype="float32", block_size=4, num_kv_blocks=8)  # 32 tokens in all
    assert llm.engine.max_model_len == 32
    with pytest.raises(InvalidRequest, match="maximum context length"):
        llm.generate([list(range(100, 120))], SamplingParams(max_tokens=20))
    out = llm.generate([list(range(100, 110))], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 20


def test_implicit_context_length_capped_by_kv_warns(tiny_model, caplog):
    with caplog.at_level("WARNING", logger="nanoserve"):
        llm = LLM(str(tiny_model), dtype="float32", block_size=4, num_kv_blocks=8)
    assert llm.engine.max_model_len == 32
    assert any("32" in r.getMessage() and "512" in r.getMessage() for r in caplog.records
               if r.levelname == "WARNING"), [r.getMessage() for r in caplog.records]


def test_explicit_context_length_beyond_kv_refuses_to_start(tiny_model):
    with pytest.raises(ValueError, match=r"--max-model-len 64 does not fit the KV cache: it holds 32 tokens"):
        LLM(str(tiny_model), dtype="float32", block_size=4, num_kv_blocks=8, max_model_len=64)
    with pytest.raises(ValueError, match="max_position_embeddings 512"):
        LLM(str(tiny_model), dtype="float32", max_model_len=513, kv_cache_gb=KV_GB)
    assert LLM(str(tiny_model), dtype="float32", block_size=4, num_kv_blocks=8,
               max_model_len=32).engine.max_model_len == 32


def test_dtype_env_var_forces_auto(monkeypatch):
    import torch

    from nanoserve.config import EngineConfig
    cpu = torch.device("cpu")
    monkeypatch.setenv("NANOSERVE_DTYPE", "float32")
    assert EngineConfig().resolved_dtype(cpu) == torch.float32
    assert EngineConfig(dtype="bfloat16").resolved_dtype(cpu) == torch.bfloat16  # explicit wins
    monkeypatch.setenv("NANOSERVE_DTYPE", "bfloat16")
    assert EngineConfig().resolved_dtype(cpu) == torch.bfloat16
    monkeypatch.setenv("NANOSERVE_DTYPE", "fp8")
    with pytest.raises(ValueError, match="NANOSERVE_DTYPE"):
        EngineConfig().resolved_dtype(cpu)
