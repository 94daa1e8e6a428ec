"""The GPU's quantized linear layers (layers/triton_quant.py) on CPU, under Triton's interpreter:
GGUF Q8_0 / Q4_0 / Q4_1 blocks against the gguf package's dequantization followed by a float64
matmul (decode and prefill batch sizes, ragged output sizes, split K), dequantization bit-exact,
fused parts of different types writing their own columns, embedding rows; fp8 weights (the
weight-only Triton kernel and torch._scaled_mm's fp8 x fp8 path, each against a torch reference of
the same math and against the unquantized matmul within fp8's rounding); a tiny Qwen2 served with
its projections in Q8_0 blocks through the Triton layers against the same blocks dequantized.

The interpreter runs the dots in fp32 (its bf16 dot is wrong), so with bf16 activations the
weights are not rounded to bf16 as they are on a GPU; tiling, masking, block decoding and the
split-K sum are the GPU's code. Skipped where triton does not install."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (see test_triton_attention.py)
pytest.importorskip("triton", reason="triton is not installed: its kernels cannot be interpreted on CPU")

from nanoserve.layers.quant_linear import Q4_0, Q4_1, Q8_0, QuantTensor, Scratch  # noqa: E402
from nanoserve.layers.triton_quant import (FP8, Fp8Linear, TritonQuant, TritonQuantEmbedding,  # noqa: E402
                                           TritonQuantLinear, fp8_activations, fp8_cast, q8_0_blocks,
                                           scaled_mm_works, triton_quant)

TYPES = {"Q8_0": Q8_0, "Q4_0": Q4_0, "Q4_1": Q4_1}
CPU = torch.device("cpu")
FP8_REL = 2.0 ** -4  # e4m3's relative rounding bound (3 mantissa bits), for normal values


def quantized(rows: int, cols: int, qtype: int, seed: int = 0) -> QuantTensor:
    from gguf.quants import quantize
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.05
    w[:, :32] += 0.3  # blocks with a large offset (Q4_1's min) and mixed signs
    return QuantTensor(torch.from_numpy(quantize(w, qtype)), qtype, (rows, cols))


def reference(x: torch.Tensor, w: QuantTensor) -> torch.Tensor:
    return x.double() @ w.dequantize().double().T


@pytest.fixture(scope="module")
def kernels() -> TritonQuant:
    return triton_quant(CPU)


@pytest.mark.parametrize("name", list(TYPES))
@pytest.mark.parametrize("rows,cols", [(37, 96), (100, 256)])
@pytest.mark.parametrize("tokens", [1, 5, 33])
def test_quant_linear_matches_dequantize_then_matmul(kernels, name, rows, cols, tokens):
    w = quantized(rows, cols, TYPES[name], seed=rows + cols)
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(tokens))
    want = reference(x, w)
    scale = want.abs().max().item()
    # fill=1: one program per tile; the default (8 on CPU) splits K of the decode shapes over programs
    for k in (kernels, TritonQuant(fill=1, ieee=True)):
        got = torch.empty(tokens, rows)
        k.quant_linear(x, w.data, w.qtype, got)
        assert (got.double() - want).abs().max().item() <= 2e-6 * scale * cols ** 0.5
    got16 = torch.empty(tokens, rows, dtype=torch.bfloat16)
    kernels.quant_linear(x.bfloat16(), w.data, w.qtype, got16)
    want16 = x.bfloat16().double() @ w.dequantize().double().T
    # one bf16 step of the output: the interpreter's fp32 -> bf16 cast truncates (a GPU's rounds to nearest)
    assert (got16.double() - want16).abs().max().item() <= 2 ** -7 * scale


@pytest.mark.parametrize("name", list(TYPES))
def test_dequantize_is_exactly_the_gguf_packages(kernels, name):
    w = quantized(45, 160, TYPES[name], seed=3)
    out = torch.full((45, 160), float("nan"))
    kernels.quant_dequantize(w.data, w.qtype, out)
    assert torch.equal(out, w.dequantize())
    out16 = torch.empty(45, 160, dtype=torch.bfloat16)
    kernels.quant_dequantize(w.data, w.qtype, out16)
    # the bf16 cast: to nearest on a GPU; the interpreter's truncates (drops the low 16 bits)
    ref = w.dequantize()
    truncated = (ref.view(torch.int32) & -65536).view(torch.float32).bfloat16()
    assert ((out16 == ref.bfloat16()) | (out16 == truncated)).all()


def test_fused_parts_write_their_columns_and_embedding_rows(kernels):
    # 256 inputs: the 2-row batch splits K over programs, whose partials are summed into column slices
    parts = [quantized(32, 256, Q4_0, 1), quantized(16, 256, Q8_0, 2), quantized(19, 256, Q4_1, 3)]
    bias = torch.randn(67)
    lin = TritonQuantLinear(parts, kernels, Scratch(), bias)
    for tokens in (2, 20):
        x = torch.randn(tokens, 256)
        want = torch.cat([reference(x, p) for p in parts], 1) + bias.double()
        assert torch.allclose(lin(x).double(), want, atol=1e-5)
    table = quantized(50, 64, Q8_0, 4)
    ids = torch.tensor([49, 0, 7, 7])
    assert torch.equal(TritonQuantEmbedding(table, kernels, torch.float32)(ids), table.dequantize()[ids])


def test_q8_0_blocks_are_the_gguf_quantizers_bytes():
    from gguf.quants import quantize
    w = torch.randn(9, 128) * torch.logspace(-4, 2, 9)[:, None]
    w[2, :32] = 0  # an all-zero block: d = 0
    w[3, 64:96] = 0.25
    w[3, 64] = -127.0
    w[3, 65] = 2.5  # d = 1: q = 2.5 exactly, a tie, rounded away from zero to 3
    assert torch.equal(q8_0_blocks(w), torch.from_numpy(quantize(w.numpy(), Q8_0)))


def test_bad_shapes_are_refused(kernels):
    w = quantized(8, 64, Q8_0)
    x, out = torch.randn(2, 64), torch.empty(2, 8)
    bad = [lambda: kernels.quant_linear(torch.randn(2, 96), w.data, Q8_0, out),        # K disagrees
           lambda: kernels.quant_linear(x, w.data, Q4_0, out),                         # bytes per row of Q8_0
           lambda: kernels.quant_linear(x, w.data, 12, out),                           # Q4_K: no kernel
           lambda: kernels.quant_linear(x, w.data, Q8_0, torch.empty(2, 9)),           # out size
           lambda: kernels.quant_linear(x, w.data, Q8_0, torch.empty(2, 8, dtype=torch.bfloat16)),
           lambda: kernels.quant_linear(x, w.data.view(torch.int8), Q8_0, out),
           lambda: kernels.quant_linear(torch.randn(2, 40), torch.zeros(8, 34, dtype=torch.uint8), Q8_0, out),
           lambda: kernels.quant_dequantize(w.data, Q8_0, torch.empty(8, 32)),
           lambda: kernels.fp8_linear(x, torch.zeros(8, 64, dtype=torch.uint8), torch.ones(8), out),
           lambda: Fp8Linear(torch.randn(8, 48), None, kernels, scaled_mm=False)]     # 48 inputs: not 32k
    for call in bad:
        with pytest.raises(ValueError):
            call()


def test_cuda_engines_get_these_kernels_or_none_without_triton(monkeypatch):
    import sys
    from types import SimpleNamespace

    from nanoserve.parallel.shard import _quant_kernels
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: SimpleNamespace(multi_processor_count=132))
    got = _quant_kernels(torch.device("cuda", 7))
    assert isinstance(got, TritonQuant) and got.fill == 264 and got.linear_layer is TritonQuantLinear
    monkeypatch.setitem(sys.modules, "nanoserve.layers.triton_quant", None)  # its import fails
    assert _quant_kernels(torch.device("cuda", 7)) is None


def test_fp8_option_refuses_cpu_and_fp32_in_one_line(monkeypatch):
    from nanoserve.config import EngineConfig
    with pytest.raises(ValueError, match="^--quantization fp8 needs a CUDA GPU: this run is on the CPU"):
        EngineConfig(quantization="fp8", device="cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # past the device check: the dtype's turn
    with pytest.raises(ValueError, match="^--quantization fp8 computes in bf16 or fp16"):
        EngineConfig(quantization="fp8", device="cuda", dtype="float32")
    with pytest.raises(ValueError, match="quantization must be fp8"):
        EngineConfig(quantization="int4", device="cpu")


def test_fp8_cast_rounds_each_weight_within_e4m3s_bound():
    w = torch.randn(64, 96) * torch.logspace(-3, 1, 64)[:, None]  # rows of very different ranges
    w[5] = 0  # an all-zero row stays zero
    q, s = fp8_cast(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (64,)
    back = q.float() * s[:, None]
    assert torch.equal(back[5], w[5])
    assert torch.allclose(back.abs().amax(1), w.abs().amax(1), rtol=1e-6)  # each row's max maps to 448
    # normal e4m3 values round within 2^-4; below 2^-6 * s (subnormals) within half a step, 2^-10 * s
    assert ((back - w).abs() <= FP8_REL * w.abs() + 2.0 ** -10 * s[:, None]).all()


@pytest.mark.parametrize("tokens", [1, 33])
def test_fp8_weight_only_kernel_and_scaled_mm_against_references(kernels, tokens):
    g = torch.Generator().manual_seed(tokens)
    w, x, bias = (torch.randn(80, 128, generator=g) * 0.05, torch.randn(tokens, 128, generator=g),
                  torch.randn(80))
    exact = x.double() @ w.double().T + bias.double()
    magnitude = x.double().abs() @ w.double().abs().T  # what rounding each weight (or input) by r can move
    lin = Fp8Linear(w, bias, kernels, scaled_mm=False)
    assert lin.nbytes == 80 * 128 + 80 * 4
    same_math = x.double() @ (lin.weight.double() * lin.scale.double()[:, None]).T + bias.double()
    got = lin(x).double()
    assert (got - same_math).abs().max().item() <= 1e-5 * magnitude.max().item()  # fp32 summation order
    assert ((got - exact).abs() <= FP8_REL * magnitude + 1e-4).all()
    out = torch.empty(80, 128)
    kernels.quant_dequantize(lin.weight.view(torch.uint8), FP8, out, lin.scale)
    assert torch.equal(out, lin.weight.float() * lin.scale[:, None])
    if not scaled_mm_works(CPU):
        pytest.skip("this torch has no CPU torch._scaled_mm with row-wise scales")
    fast = Fp8Linear(w.bfloat16(), bias.bfloat16(), kernels, scaled_mm=True)
    assert fast.scaled_mm
    xb = x.bfloat16()
    xq, sx = fp8_activations(xb)
    same_math = (xq.double() * sx.double()) @ (fast.weight.double() * fast.scale.double()[:, None]).T
    got = fast(xb).double()
    want = same_math + bias.bfloat16().double()
    assert (got - want).abs().max().item() <= 2 ** -7 * want.abs().max().item()  # bf16 output rounding(s)
    # activations and weights both rounded to e4m3: about twice the weight-only bound
    assert ((got - exact).abs() <= 2.2 * FP8_REL * magnitude + 2 ** -7 * exact.abs().max().item()).all()


def test_tiny_model_in_q8_0_blocks_matches_its_dequantized_twin(tiny_path, monkeypatch):
    """Both engines get the same Q8_0 blocks for every projection and the embedding: one runs them
    through the Triton layers, the other dequantizes them into its fp32 parameters; teacher-forced
    prompt logprobs (a prefill of > 16 rows) and greedy decode agree to fp32 noise. The 49k-row LM
    head stays dense: interpreted, its 768 programs a step would take most of a minute."""
    from gguf.quants import quantize

    from nanoserve import LLM, SamplingParams
    from nanoserve.models import llama
    from tests.conftest import KV_GB

    # each twin is finalized again below, from its parameters: the engine's own finalize must keep them
    monkeypatch.setattr(llama, "release_copied", lambda model: None)

    def engine(kernels) -> LLM:
        llm = LLM(model=str(tiny_path("qwen2-bias")), dtype="float32", kv_cache_gb=KV_GB,
                  enable_prefix_caching=False)
        model = llm.engine.model
        for name, t in model.weight_targets().items():
            if t.dst.dim() == 2 and name != "lm_head.weight":
                q = torch.from_numpy(quantize(t.dst.numpy(), Q8_0))
                model.quantized[name] = QuantTensor(q, Q8_0, tuple(t.dst.shape))
        model.finalize(None, kernels)
        return llm

    quant, dense = engine(triton_quant(CPU)), engine(None)
    layer = quant.engine.model.layers[0]
    assert isinstance(layer.qkv_lin, TritonQuantLinear) and layer.qkv_lin.bias is not None
    assert isinstance(quant.engine.model.embed_rows, TritonQuantEmbedding)
    prompts = [list(range(100, 130)), [5, 17, 300, 4000, 12]]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    a, b = (llm.generate([{"prompt_token_ids": p} for p in prompts], params) for llm in (quant, dense))
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for lx, ly in zip(x.prompt_logprobs[1:] + x.outputs[0].logprobs,
                          y.prompt_logprobs[1:] + y.outputs[0].logprobs):
            assert lx.token_id == ly.token_id and abs(lx.logprob - ly.logprob) < 1e-4
