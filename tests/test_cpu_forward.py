"""The CPU forward: csrc/decoder_stack.cpp's layer loop (the plan models/llama_plan.py builds) against
models/llama.py's torch loop, on the same weights and the same random steps: decodes alone, prefill chunks
alone (fresh and over cached context), both; with NANOSERVE_CPU_AMX=1 packed weights leave steps beyond
PACKED_MAX_ROWS rows to dequantize + GEMM (in row chunks: DEQUANT_CHUNK made small), as the block layout
does beyond GEMV_MAX_ROWS on AVX2 builds.

The stack makes the torch loop's calls in its order, so with torch's norm and RoPE (a plan of fused_rows 0)
it writes the same K/V and gives the same logits, bit for bit. With the C++ norm and RoPE kernels (the plan
the model builds) the only other arithmetic is the norm's (RoPE is bit-exact with rotate: test_cpu_kernels):
its fp32 sum of squares in another order, a few ulp of fp32, which bf16 rounding turns into an occasional
flip of the last bit that the bf16 ops after it carry on. Measured on this test's models (2 layers, random
weights, activations of O(1)): logits within 2.2e-6 (fp32) and 4.8e-2 (bf16, a few ulp of the logits) of
the largest |logit|; asserted 1e-5 and 0.1.

Qwen3's and Gemma 3's layers (conftest's tiny models: per-head q/k norms; Gemma's output norms, tanh-GELU
gate, local RoPE table on its windowed layer), also with Gemma's MLP kept in Q8_0 blocks (a QuantLinear whose
fused SiLU GLU kernel the GELU gate must not take), likewise: bit for bit with torch's ops, within the bounds
with the C++ kernels (the per-head norm's sum order too: measured 1.1e-6 and 2.5e-2)."""
from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import ClassVar

import pytest
import torch

from nanoserve.kernels import cpu_kernels
from nanoserve.layers import quant_linear
from nanoserve.layers.attention import AttentionBatch, TorchAttention
from nanoserve.layers.quant_linear import PACKED_MAX_ROWS, QuantLinear, QuantTensor
from nanoserve.models.llama import LlamaModel
from nanoserve.models.llama_plan import projection_plan, stack_plan
from tests.test_gguf_quantized import _gguf_model, _write_gguf

HID, INTER, HEADS, KV, D, VOCAB, LAYERS = 256, 512, 4, 2, 64, 64, 2
BOUND = {torch.float32: 1e-5, torch.bfloat16: 0.1}  # of the largest |logit|: the C++ norm's rounding


@pytest.fixture(scope="module")
def kernels():
    k, q = cpu_kernels.load(), cpu_kernels.quant()
    if k is None or q is None:
        pytest.skip("no C++ toolchain: the torch loop is the only one")
    return k


def _model(tmp_path, dtype: torch.dtype, variant: str):
    """A random 2-layer GGUF llama: QKV of three block types (three kernel calls into column slices) with a
    bias, gate/up of one (the fused GLU kernel); "mixed": a dense o_proj (oneDNN), gate/up of two types (two
    calls, then silu * up), no bias; "dense": every block dequantized into oneDNN layers (gate and up two
    GEMMs with epilogues)."""
    from gguf import GGMLQuantizationType as T
    from transformers import LlamaConfig
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HID, intermediate_size=INTER, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV, tie_word_embeddings=True,
                      attention_bias=variant != "mixed")
    types = {"token_embd.weight": ((VOCAB, HID), T.Q8_0), "output_norm.weight": ((HID,), T.F32)}
    layer = {"attn_norm.weight": ((HID,), T.F32), "ffn_norm.weight": ((HID,), T.F32),
             "attn_q.weight": ((HID, HID), T.Q4_0), "attn_k.weight": ((KV * D, HID), T.Q8_0),
             "attn_v.weight": ((KV * D, HID), T.Q4_1),
             "attn_output.weight": ((HID, HID), T.F16 if variant == "mixed" else T.Q4_1),
             "ffn_gate.weight": ((INTER, HID), T.Q4_1),
             "ffn_up.weight": ((INTER, HID), T.Q8_0 if variant == "mixed" else T.Q4_1),
             "ffn_down.weight": ((HID, INTER), T.Q8_0)}
    if variant != "mixed":
        layer |= {f"attn_{x}.bias": ((n,), T.F32) for x, n in (("q", HID), ("k", KV * D), ("v", KV * D))}
    types |= {f"blk.{i}.{name}": spec for i in range(LAYERS) for name, spec in layer.items()}
    path = _write_gguf(tmp_path / f"{variant}.gguf", types, scale=HID ** -0.5)  # activations of O(1)
    return _gguf_model(path, cfg, dtype, variant != "dense", cpu_kernels.load(), cpu_kernels.quant())


def _tiny(path, dtype: torch.dtype, quant_mlp: bool) -> LlamaModel:
    """A tiny HF checkpoint (conftest's TINY_CONFIGS: the shapes this file's steps assume) as a finalized CPU
    model; `quant_mlp`: its gate/up/down kept as Q8_0 blocks (QuantLinear layers)."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import quantize
    from safetensors.torch import load_file
    from transformers import AutoConfig
    state = load_file(path / "model.safetensors")
    if quant_mlp:
        for name, w in state.items():
            if ".mlp." in name:
                blocks = torch.from_numpy(quantize(w.float().numpy(), T.Q8_0))
                state[name] = QuantTensor(blocks, int(T.Q8_0), tuple(w.shape))
    model = LlamaModel(AutoConfig.from_pretrained(path), dtype, torch.device("cpu"))
    assert (model.cfg.num_attention_heads, model.cfg.num_key_value_heads, model.head_dim,
            model.num_layers) == (HEADS, KV, D, LAYERS)
    model.load_weights(state.items())
    model.finalize(cpu_kernels.load(), cpu_kernels.quant())
    return model


def _step(seed: int, kind: str, dtype: torch.dtype, bs: int = 16):
    """A random step of `kind` (decode, prefill, mixed) over a cache of random K/V for the cached part."""
    rnd = random.Random(seed)
    decodes = [rnd.randint(1, 150) for _ in range(rnd.randint(1, 3) if kind != "prefill" else 0)]
    chunks = []
    for _ in range(rnd.randint(1, 3) if kind != "decode" else 0):
        n = rnd.choice([1, 16, 43, 65, 130, rnd.randint(1, 200)])
        chunks.append((n, n if rnd.random() < 0.4 else n + rnd.randint(1, 300)))
    lens, ctxs = [1] * len(decodes) + [n for n, _ in chunks], decodes + [c for _, c in chunks]
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(sum(-(-c // bs) for c in ctxs) + 2, LAYERS, 2, KV, bs, D, generator=g).to(dtype)
    perm = torch.randperm(cache.shape[0], generator=g).tolist()
    tables = [[perm.pop() for _ in range(-(-c // bs))] for c in ctxs]
    slots = [(t[p // bs], p % bs) for t, n, c in zip(tables, lens, ctxs) for p in range(c - n, c)]
    batch = AttentionBatch(lens, ctxs, tables, len(decodes), torch.tensor([b for b, _ in slots]),
                           torch.tensor([o for _, o in slots]))
    positions = torch.tensor([p for n, c in zip(lens, ctxs) for p in range(c - n, c)])
    ids = torch.randint(0, VOCAB, (len(positions),), generator=g)
    return cache, batch, ids, positions


def _forward(model, stack, cache, batch, ids, positions, kernels, windows: tuple[int, ...] = ()
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits of every token, the cache written) of one step through `stack`, or the torch loop (None)."""
    attn = TorchAttention(cache.clone(), HEADS, D ** -0.5, kernels, windows=windows)
    attn.prepare(batch)
    model.stack = stack
    return model.forward(ids, positions, attn, torch.arange(len(ids))), attn.kv_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", ["quantized", "mixed", "dense"])
def test_the_cpu_stack_makes_the_torch_loops_calls(tmp_path, monkeypatch, kernels, dtype, variant):
    monkeypatch.setenv("NANOSERVE_CPU_AMX", "1")  # packed weights: steps beyond PACKED_MAX_ROWS dequantize
    monkeypatch.setattr(quant_linear, "DEQUANT_CHUNK", 40 * HID)  # gate/up and down in chunks of 32 rows
    model = _model(tmp_path, dtype, variant)
    stack, exact = model.stack, kernels.DecoderStack(replace(stack_plan(model, kernels), fused_rows=0))
    assert stack is not None and isinstance(model.layers[0].o_lin, QuantLinear) == (variant == "quantized")
    rows, worst = [], 0.0
    with torch.inference_mode():
        for seed in range(18):
            step = _step(seed, ("decode", "prefill", "mixed")[seed % 3], dtype)
            logits, cache = _forward(model, None, *step, kernels)
            same = zip(_forward(model, exact, *step, kernels), (logits, cache))
            assert all(torch.equal(a, b) for a, b in same), seed
            fused_logits = _forward(model, stack, *step, kernels)[0]
            worst = max(worst, ((fused_logits - logits).abs().max() / logits.abs().max()).item())
            rows.append(len(step[2]))
    assert worst <= BOUND[dtype], worst
    kernel_rows = {lin.max_kernel_rows for layer in model.layers for lin in (layer.qkv_lin, layer.down_lin)
                   if isinstance(lin, QuantLinear)}
    assert all(min(rows) <= n <= PACKED_MAX_ROWS < max(rows) for n in kernel_rows)  # steps within and beyond


def test_the_cpu_stack_attends_each_layers_window(tmp_path, kernels):
    """Per-layer sliding windows (KernelStep.windows) reach the stack's attention calls: with torch's norm
    and RoPE it gives the torch loop's logits and cache bit for bit, and those differ from the windowless
    ones (so neither ignores the windows)."""
    model = _model(tmp_path, torch.float32, "dense")
    exact = kernels.DecoderStack(replace(stack_plan(model, kernels), fused_rows=0))
    windows = (3, 40)
    with torch.inference_mode():
        for seed in range(6):
            step = _step(seed, ("decode", "prefill", "mixed")[seed % 3], torch.float32)
            loop = _forward(model, None, *step, kernels, windows)
            stack = _forward(model, exact, *step, kernels, windows)
            assert all(torch.equal(a, b) for a, b in zip(stack, loop))
            hidden = max(step[1].context_lens) > min(windows)  # some token has keys out of its window
            assert torch.equal(_forward(model, None, *step, kernels)[0], loop[0]) != hidden, seed


def test_a_layer_kind_the_cpu_loop_does_not_know_fails_loudly(tmp_path, kernels):
    class Fp4Linear:  # a projection layer that the planner has no plan for
        pass

    @dataclass(frozen=True)
    class Fp4Projection:  # a plan kind that the C++ loop has no projection for
        kind: ClassVar[str] = "fp4"
        weight: torch.Tensor

    with pytest.raises(TypeError, match="no plan for a Fp4Linear projection"):
        projection_plan(Fp4Linear())
    model = _model(tmp_path, torch.float32, "quantized")
    plan = stack_plan(model, kernels)
    layer = replace(plan.layers[0], o=Fp4Projection(torch.zeros(1)))
    with pytest.raises(ValueError, match="no projection kind 'fp4' \\(Fp4Projection\\)"):
        kernels.DecoderStack(replace(plan, layers=(layer, *plan.layers[1:])))
    kernels.DecoderStack(plan)  # the model's own plan builds


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["qwen3-qk-norm", "gemma3-window", "gemma3-window-q8"])
def test_the_cpu_stack_runs_qwen3_and_gemma3_layers(tiny_path, kernels, dtype, name):
    model = _tiny(tiny_path(name.removesuffix("-q8")), dtype, name.endswith("-q8"))
    plan = stack_plan(model, kernels)
    assert all(layer.q_norm is not None for layer in plan.layers)
    gemma = name.startswith("gemma3")
    assert [layer.local_rope for layer in plan.layers] == ([True, False] if gemma else [False, False])
    assert all((layer.mlp_out_norm is not None) == gemma for layer in plan.layers)
    # kept blocks; where the kernels fuse a GLU for them (AVX-512) it is SiLU's, which the stack must not take
    assert all(isinstance(layer.gate_up_lin, QuantLinear) == name.endswith("-q8") for layer in model.layers)
    stack, exact = model.stack, kernels.DecoderStack(replace(plan, fused_rows=0))
    worst = 0.0
    with torch.inference_mode():
        for seed in range(6):
            step = _step(seed, ("decode", "prefill", "mixed")[seed % 3], dtype)
            logits, cache = _forward(model, None, *step, kernels, model.windows)
            same = zip(_forward(model, exact, *step, kernels, model.windows), (logits, cache))
            assert all(torch.equal(a, b) for a, b in same), seed
            fused_logits = _forward(model, stack, *step, kernels, model.windows)[0]
            worst = max(worst, ((fused_logits - logits).abs().max() / logits.abs().max()).item())
    assert worst <= BOUND[dtype], worst
