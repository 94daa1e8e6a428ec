"""K-quant weights (Q4_K, Q6_K) kept in their blocks (csrc/kquant_kernels.cpp behind
kernels/cpu_kernels.QuantKernels, layers/quant_linear.py) against the gguf package's dequantization
followed by a float64 matmul: random but valid super-blocks (gguf cannot quantize to K types), fp32 and
bf16 activations, ragged row counts, token counts on both sides of the GEMV/GEMM switch; the
dequantizer bit for bit; batch invariance bit for bit; refused shapes; the loader keeping the blocks
only where the kernels built. The packed layout (AVX-512): pack -> dequantize and row lookups bit for
bit, fp32 x to summation-order noise, bf16 x (int8 on VNNI) within the int8 rounding's bound element by
element and exactly as the rounded blocks give it. AVX-512 without BF16, AVX2 and scalar builds are
checked by an opt-in test (NANOSERVE_TEST_ISAS=1: three ~30 s builds, then cached), Q5_0 blocks with them."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from nanoserve.kernels import cpu_kernels
from nanoserve.layers.quant_linear import (GEMV_MAX_ROWS, Q4_K, Q6_K, QuantEmbedding, QuantLinear,
                                           QuantTensor, Scratch)
from tests.test_cpu_kernels import built_or_skip

TYPES = {"Q4_K": Q4_K, "Q6_K": Q6_K}


@pytest.fixture(scope="module")
def kernels():
    k = cpu_kernels.quant()
    return built_or_skip(k if k is not None and k.kquants is not None else None,
                         "K-quant GGUF weights are dequantized at load")


def k_blocks(rows: int, cols: int, qtype: int, seed: int = 0) -> np.ndarray:
    """Random super-blocks whose fp16 scales are finite and give weights of ~0.05 (the scales, mins,
    nibbles and 6-bit values are random bytes: every pattern is valid)."""
    g = np.random.default_rng(seed)
    nbytes = 144 if qtype == Q4_K else 210
    b = g.integers(0, 256, (rows, cols // 256, nbytes), dtype=np.uint8)
    if qtype == Q4_K:
        d = g.uniform(1e-4, 3e-4, (rows, cols // 256)).astype(np.float16)
        b[..., 0:2] = d.view(np.uint8).reshape(rows, -1, 2)
        # mins centre the weights
        b[..., 2:4] = (d * 7).astype(np.float16).view(np.uint8).reshape(rows, -1, 2)
    else:
        b[..., 208:210] = (g.uniform(2e-5, 8e-5, (rows, cols // 256)).astype(np.float16)
                           .view(np.uint8).reshape(rows, -1, 2))
    return b.reshape(rows, -1)


def kq(rows: int, cols: int, qtype: int, seed: int = 0) -> QuantTensor:
    return QuantTensor(torch.from_numpy(k_blocks(rows, cols, qtype, seed)), qtype, (rows, cols))


def reference(x: torch.Tensor, w: QuantTensor) -> torch.Tensor:
    return x.double() @ w.dequantize().double().T


@pytest.mark.parametrize("name", list(TYPES))
@pytest.mark.parametrize("rows,cols", [(1, 256), (7, 512), (33, 768), (130, 1024)])
@pytest.mark.parametrize("tokens", [1, 3, 8, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 5])
def test_quant_linear_matches_dequantize_then_matmul(kernels, name, rows, cols, tokens):
    w = kq(rows, cols, TYPES[name], seed=rows + cols)
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(tokens))
    want = reference(x, w)
    scale = want.abs().max().item() + 1e-6
    got = QuantLinear([w], kernels, Scratch())(x)
    assert got.dtype == torch.float32 and got.shape == (tokens, rows)
    assert (got.double() - want).abs().max().item() <= 2e-6 * scale * cols ** 0.5
    # bf16 x: widened exactly, against the weights as they are (fp32 out: to summation-order noise)
    want_b = x.bfloat16().double() @ w.dequantize().double().T
    got = torch.empty(tokens, rows)
    kernels.quant_linear(x.bfloat16(), w.data, w.qtype, got)
    assert (got.double() - want_b).abs().max().item() <= 2e-6 * scale * cols ** 0.5
    got16 = QuantLinear([w], kernels, Scratch())(x.bfloat16())
    assert got16.dtype == torch.bfloat16
    if tokens <= GEMV_MAX_ROWS:  # the kernel: one rounding of the output
        assert (got16.double() - want_b).abs().max().item() <= 2 ** -8 * scale
    else:  # the prefill GEMM meets the weights' bf16 copy
        want16 = x.bfloat16().double() @ w.dequantize().bfloat16().double().T
        assert (got16.double() - want16).abs().max().item() <= 2 ** -7 * scale


def assert_batch_invariant(kernels, x: torch.Tensor, w: QuantTensor, part: slice) -> None:
    """Each row of x alone, and the rows `part` together, give the bits all of x's rows give at once."""
    together = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype)
    kernels.quant_linear(x, w.data, w.kernel_type, together)
    for t in range(x.shape[0]):
        alone = torch.empty(1, w.shape[0], dtype=x.dtype)
        kernels.quant_linear(x[t:t + 1], w.data, w.kernel_type, alone)
        assert torch.equal(alone, together[t:t + 1]), (w.qtype, x.dtype, t)
    some = torch.empty(part.stop - part.start, w.shape[0], dtype=x.dtype)
    kernels.quant_linear(x[part], w.data, w.kernel_type, some)
    assert torch.equal(some, together[part])


@pytest.mark.parametrize("name", list(TYPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols", [256, 768])
def test_a_row_gets_the_same_bits_whatever_rows_share_its_pass(kernels, name, dtype, cols):
    """Batch invariance: greedy text must not depend on the batch shape a token was decoded in."""
    w = kq(37, cols, TYPES[name], seed=cols)
    x = torch.randn(GEMV_MAX_ROWS, cols, generator=torch.Generator().manual_seed(cols)).to(dtype)
    assert_batch_invariant(kernels, x, w, slice(3, 8))


def test_dequantize_kernel_is_exactly_the_gguf_packages(kernels):
    for name, qtype in TYPES.items():
        w = kq(19, 768, qtype, seed=qtype)
        want = w.dequantize()
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            out = torch.empty(19, 768, dtype=dtype)
            kernels.quant_dequantize(w.data, qtype, out)
            assert torch.equal(out, want.to(dtype)), (name, dtype)


def test_fused_parts_write_their_own_columns_and_prefill_chunks(kernels, monkeypatch):
    from nanoserve.layers import quant_linear
    parts = [kq(24, 512, Q4_K, 1), kq(16, 512, Q6_K, 2), kq(9, 512, Q4_K, 3)]
    bias = torch.randn(49)
    lin = QuantLinear(parts, kernels, Scratch(), bias)
    # the block kernel (column slices of one out), then dequantize + GEMM
    for tokens in (5, GEMV_MAX_ROWS + 1):
        x = torch.randn(tokens, 512)
        want = torch.cat([reference(x, p) for p in parts], dim=1) + bias.double()
        assert (lin(x).double() - want).abs().max().item() < 1e-4
    monkeypatch.setattr(quant_linear, "DEQUANT_CHUNK", 7 * 512)  # 7 rows at a time: chunks end mid-part
    x = torch.randn(GEMV_MAX_ROWS + 3, 512)
    want = torch.cat([reference(x, p) for p in parts], dim=1) + bias.double()
    assert (lin(x).double() - want).abs().max().item() < 1e-4


def test_embedding_dequantizes_the_rows_it_reads(kernels):
    table = kq(50, 256, Q6_K)
    ids = torch.tensor([3, 0, 49, 3])
    assert torch.equal(QuantEmbedding(table, kernels, torch.float32)(ids), table.dequantize()[ids])
    assert torch.equal(QuantEmbedding(table, kernels, torch.bfloat16)(ids),
                       table.dequantize()[ids].bfloat16())


def packed(w: QuantTensor, kernels) -> QuantTensor:
    p = w.packed_for(kernels)
    if not p.packed:
        pytest.skip("this build has no packed layout (AVX-512 only)")
    return p


def int8_rounding_bound(x: torch.Tensor, w: QuantTensor) -> torch.Tensor:
    """[tokens, rows]: the most that rounding x to int8 per 32-block (scale absmax / 127, to nearest)
    can move x W^T: half a step, absmax / 254, an element, times the weights' |sum| over the block."""
    xb = x.double().view(x.shape[0], -1, 32)
    wb = w.dequantize().double().abs().view(w.shape[0], -1, 32).sum(-1)
    return torch.einsum("tb,nb->tn", xb.abs().amax(-1) / 254, wb)


@pytest.mark.parametrize("name", list(TYPES))
@pytest.mark.parametrize("rows,cols", [(1, 256), (37, 768), (130, 1280)])
@pytest.mark.parametrize("tokens", [1, 5, 8, 13, 261])  # 13: a pass of 8 then 5; 261: two sweeps of 256
def test_packed_matches_dequantize_then_matmul(kernels, name, rows, cols, tokens):
    w = kq(rows, cols, TYPES[name], seed=rows + tokens)
    p = packed(w, kernels)
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(tokens))
    want = reference(x, w)
    lin = QuantLinear([p], kernels, Scratch())
    assert lin.max_kernel_rows >= tokens or kernels.gemm_prefill()
    got = lin(x)  # fp32: exact products, summation-order noise
    assert (got.double() - want).abs().max().item() <= 2e-6 * (want.abs().max().item() + 1e-6) * cols ** 0.5
    xb = x.bfloat16()
    want16 = reference(xb, w)
    got16 = lin(xb)
    if kernels.int8_activations(TYPES[name]) and tokens <= lin.max_kernel_rows:
        # int8 activations: within half a step an element, plus the output's bf16 rounding, every element
        bound = int8_rounding_bound(xb, w) + 2 ** -8 * want16.abs() + 1e-6
        assert ((got16.double() - want16).abs() <= bound).all()
        assert (got16.double() - want16).abs().max().item() > 0  # not exact: the activations were rounded
    else:
        assert (got16.double() - want16).abs().max().item() <= 2 ** -7 * want16.abs().max().item()


@pytest.mark.parametrize("name", list(TYPES))
def test_packed_int8_activations_are_the_rounded_blocks_exactly(kernels, name):
    """The integer path computes sum d_x dot(q_w, q_x) exactly: reproduce it from the int8 rounding."""
    if not kernels.int8_activations(TYPES[name]):
        pytest.skip("no int8 activation path in this build (AVX512_VNNI)")
    w = kq(21, 512, TYPES[name], seed=5)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(TYPES[name])).bfloat16()
    xb = x.float().view(3, -1, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    # the kernel's arithmetic, in fp32 (`127 / amax` would be 127 * (1 / amax): an ulp off at near-ties)
    xq = torch.round(xb * torch.full_like(amax, 127).div(amax)).clamp(-127, 127) * (amax / 127)
    want = xq.view(3, 512).double() @ w.dequantize().double().T
    out = torch.empty(3, 21)
    p = packed(w, kernels)
    kernels.quant_linear(x, p.data, p.kernel_type, out)
    assert (out.double() - want).abs().max().item() <= 1e-5 * want.abs().max().item()


@pytest.mark.parametrize("name", list(TYPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_rows_get_the_same_bits_whatever_rows_share_their_pass(kernels, name, dtype):
    p = packed(kq(37, 512, TYPES[name], seed=7), kernels)
    # 21 rows: fp32 Q6_K buffers its weights
    x = torch.randn(21, 512, generator=torch.Generator().manual_seed(3)).to(dtype)
    assert_batch_invariant(kernels, x, p, slice(5, 11))


@pytest.mark.parametrize("name", list(TYPES))
@pytest.mark.parametrize("rows,cols", [(1, 256), (37, 768), (48, 512)])
def test_packing_keeps_every_bit(kernels, name, rows, cols):
    """pack -> dequantize is the block dequantization exactly; quant_rows reads single rows of it."""
    w = kq(rows, cols, TYPES[name], seed=rows * cols)
    p = packed(w, kernels)
    per_block = {Q4_K: 148, Q6_K: 210}[TYPES[name]]
    assert tuple(p.data.shape) == (-(-rows // 16), cols // 256 * per_block * 16)
    want = w.dequantize()
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        out = torch.empty(rows, cols, dtype=dtype)
        kernels.quant_dequantize(p.data, p.kernel_type, out)
        assert torch.equal(out, want.to(dtype)), dtype
    ids = torch.tensor([rows - 1, 0, rows // 2, rows - 1])
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(QuantEmbedding(p, kernels, dtype)(ids), want[ids].to(dtype))
    with pytest.raises(RuntimeError, match="out of"):
        QuantEmbedding(p, kernels, torch.float32)(torch.tensor([rows]))


def test_packed_parts_stack_and_prefill_in_chunks(kernels, monkeypatch):
    from nanoserve.layers import quant_linear
    parts = [packed(kq(32, 512, Q4_K, 1), kernels), packed(kq(16, 512, Q6_K, 2), kernels),
             packed(kq(16, 512, Q4_K, 3), kernels)]
    lin = QuantLinear(parts, kernels, Scratch())
    assert len(lin.parts) == 3  # Q4_K, Q6_K, Q4_K: no two neighbours of one type
    x = torch.randn(9, 512)
    want = torch.cat([reference(x, w)
                      for w in (kq(32, 512, Q4_K, 1), kq(16, 512, Q6_K, 2), kq(16, 512, Q4_K, 3))], dim=1)
    assert (lin(x).double() - want).abs().max().item() < 1e-4
    assert len(QuantLinear(parts[:1] + parts[2:], kernels, Scratch()).parts) == 1
    # the GEMM path (as with AMX), 16 rows a chunk
    monkeypatch.setattr(quant_linear, "DEQUANT_CHUNK", 16 * 512)
    lin.max_kernel_rows = 4
    assert (lin(x).double() - want).abs().max().item() < 1e-4


def test_bad_shapes_and_types_are_refused(kernels):
    w = kq(4, 512, Q4_K)
    with pytest.raises(ValueError, match="block matrix"):
        QuantTensor(w.data[:, :-1], Q4_K, (4, 512))
    with pytest.raises(RuntimeError, match="needs"):
        kernels.quant_linear(torch.randn(1, 256), w.data, Q4_K, torch.empty(1, 4))
    with pytest.raises(RuntimeError, match="needs"):
        kernels.quant_linear(torch.randn(1, 512), w.data, Q6_K, torch.empty(1, 4))
    with pytest.raises(RuntimeError, match="multiple of 256"):
        kernels.quant_linear(torch.randn(1, 480), w.data, Q4_K, torch.empty(1, 4))
    with pytest.raises(RuntimeError, match="out must be"):
        kernels.quant_linear(torch.randn(2, 512), w.data, Q4_K, torch.empty(2, 5))
    with pytest.raises(RuntimeError, match="x must be"):
        kernels.quant_linear(torch.ones(1, 512, dtype=torch.int32), w.data, Q4_K, torch.empty(1, 4))
    with pytest.raises(RuntimeError, match="output dtype"):
        kernels.quant_dequantize(w.data, Q4_K, torch.empty(4, 512, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="no K-quant kernel"):
        kernels.kquants.quant_linear(torch.randn(1, 512), w.data, 13, torch.empty(1, 4))


def test_router_sends_each_type_to_its_module_and_forwards_the_rest(kernels):
    assert kernels.isa() == kernels.blocks.isa()  # any other attribute: the blocks module's
    assert kernels.packs(Q4_K) == kernels.kquants.packs() and kernels.packs() == kernels.blocks.packs()
    crippled = cpu_kernels.QuantKernels(kernels.blocks, None)
    assert not crippled.packs(Q6_K) and kq(16, 256, Q6_K).packed_for(crippled).packed is False
    w = kq(4, 256, Q6_K)
    with pytest.raises(RuntimeError, match="did not build"):
        crippled.quant_linear(torch.randn(1, 256), w.data, Q6_K, torch.empty(1, 4))
    with pytest.raises(AttributeError):
        crippled.no_such_function  # noqa: B018


def test_loader_keeps_k_quants_only_where_their_kernels_built(kernels, monkeypatch):
    assert cpu_kernels.keeps(Q4_K) and cpu_kernels.keeps(Q6_K) and not cpu_kernels.keeps(13)
    monkeypatch.setattr(cpu_kernels, "kquant", lambda: None)
    assert not cpu_kernels.keeps(Q4_K) and not cpu_kernels.keeps(Q6_K) and cpu_kernels.keeps(2)
    assert cpu_kernels.keeps(6)  # Q5_0, as Q4_0: kept, dequantized by the model where nothing computes on it


CHECK = """
import torch, numpy as np, sys
sys.path.insert(0, "tests")
from test_kquant_kernels import kq, reference, Q4_K, Q6_K
from gguf.quants import quantize
from nanoserve.kernels import cpu_kernels
from nanoserve.layers.quant_linear import Q5_0, QuantTensor
k = cpu_kernels.kquant()
print(k.isa())
for qt in (Q4_K, Q6_K, Q5_0):  # and Q5_0, the block type of 32 whose decoding differs most per ISA
    w = kq(9, 768, qt, seed=qt) if qt != Q5_0 else QuantTensor(torch.from_numpy(quantize(
        np.random.default_rng(qt).standard_normal((9, 768)).astype(np.float32), qt)), qt, (9, 768))
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        out = torch.empty(9, 768, dtype=dt)
        k.quant_dequantize(w.data, qt, out)
        assert torch.equal(out, w.dequantize().to(dt)), (qt, dt)
    for dt in (torch.float32, torch.bfloat16):
        x = torch.randn(GEMV, 768).to(dt)
        got = torch.empty(GEMV, 9, dtype=dt)
        k.quant_linear(x, w.data, qt, got)
        want = x.double() @ w.dequantize().double().T
        tol = 1e-4 if dt == torch.float32 else 2 ** -7 * want.abs().max().item()
        assert (got.double() - want).abs().max().item() < tol, (qt, dt)
        for t in range(GEMV):
            alone = torch.empty(1, 9, dtype=dt)
            k.quant_linear(x[t:t + 1], w.data, qt, alone)
            assert torch.equal(alone, got[t:t + 1]), (qt, dt, t)
    if k.packs():  # AVX-512 without VNNI: the packed fp32 path, bf16 x widened
        p = k.quant_pack(w.data, qt)
        out = torch.empty(9, 768)
        k.quant_dequantize(p, qt + 256, out)
        assert torch.equal(out, w.dequantize()), qt
        x = torch.randn(GEMV, 768)
        got = torch.empty(GEMV, 9)
        k.quant_linear(x.bfloat16(), p, qt + 256, got)
        want = x.bfloat16().double() @ w.dequantize().double().T
        assert (got.double() - want).abs().max().item() < (1e-4 if not k.int8_activations() else 1e-2), qt
""".replace("GEMV", str(GEMV_MAX_ROWS))


@pytest.mark.skipif(os.environ.get("NANOSERVE_TEST_ISAS") != "1",
                    reason="opt-in (NANOSERVE_TEST_ISAS=1): builds three more ISAs")
@pytest.mark.parametrize("march,isa", [("skylake-avx512", "avx512"), ("haswell", "avx2"),
                                       ("x86-64", "scalar")])
def test_the_other_instruction_sets_compute_the_same(kernels, march, isa):
    env = dict(os.environ, NANOSERVE_CPU_MARCH=march)
    r = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[0] == isa


# as a Q4_K_M file mixes them
LLAMA_TYPES = {"token_embd": Q4_K, "output": Q6_K, "attn_q": Q4_K, "attn_k": Q4_K, "attn_v": Q6_K,
               "attn_output": Q4_K, "ffn_gate": Q4_K, "ffn_up": Q4_K, "ffn_down": Q6_K}


@pytest.fixture(scope="module")
def k_pair(kernels, tmp_path_factory, embedded_dir):
    """A tiny random untied Llama GGUF of Q4_K/Q6_K matrices, as served from its blocks and as the fp32
    HF folder that --gguf-dequantize makes of it."""
    from gguf import GGMLQuantizationType as T, GGUFWriter
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, LlamaConfig

    from nanoserve import LLM
    from nanoserve.models.loader import GGUF_LINK, _gguf_weights
    from conftest import KV_GB
    tok = AutoTokenizer.from_pretrained(embedded_dir)
    hid, inter, heads, kv, layers = 256, 512, 4, 2, 2
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hid, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=256,
                      tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    kvd = kv * hid // heads
    shapes = {"token_embd": (len(tok), hid), "output": (len(tok), hid), "attn_q": (hid, hid),
              "attn_k": (kvd, hid), "attn_v": (kvd, hid), "attn_output": (hid, hid), "ffn_gate": (inter, hid),
              "ffn_up": (inter, hid), "ffn_down": (hid, inter)}
    root = tmp_path_factory.mktemp("kquant-llama")
    f = root / "tiny-q4_k_m.gguf"
    w = GGUFWriter(str(f), "llama")
    rng = np.random.default_rng(0)
    for i, (kind, qtype) in enumerate(LLAMA_TYPES.items()):
        for layer in ([None] if kind in ("token_embd", "output") else range(layers)):
            name = f"{kind}.weight" if layer is None else f"blk.{layer}.{kind}.weight"
            w.add_tensor(name, k_blocks(*shapes[kind], qtype, seed=i * 10 + (layer or 0)), raw_dtype=T(qtype))
    for name in ["output_norm.weight"] + [f"blk.{i}.{n}.weight" for i in range(layers)
                                          for n in ("attn_norm", "ffn_norm")]:
        w.add_tensor(name, rng.uniform(0.8, 1.2, hid).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    kept, dense = root / "kept", root / "dense"
    for d in (kept, dense):
        cfg.save_pretrained(d)
        tok.save_pretrained(d)
    (kept / GGUF_LINK).symlink_to(f)
    save_file(dict(_gguf_weights(f, cfg)), str(dense / "model.safetensors"))
    kw = dict(dtype="float32", kv_cache_gb=KV_GB, enable_prefix_caching=False)
    return LLM(str(kept), **kw), LLM(str(dense), **kw)


def test_a_q4_k_m_llama_is_served_from_its_blocks_like_its_dequantized_copy(k_pair):
    from nanoserve import SamplingParams
    model = k_pair[0].engine.model
    for layer in model.layers:
        assert {p.qtype for p in layer.qkv_lin.parts} == {Q4_K, Q6_K}  # parts of one type may be stacked
        assert {p.qtype for p in layer.gate_up_lin.parts} == {Q4_K} and layer.down_lin.parts[0].qtype == Q6_K
    assert model.embed_rows.table.qtype == Q4_K and model.lm_head_lin.parts[0].qtype == Q6_K
    assert (model.embed_rows.table.packed == model.lm_head_lin.parts[0].packed
            == cpu_kernels.quant().packs(Q4_K))
    prompts = ["The capital of France is", "def fibonacci(n):",
               "Once upon a time, in a land far away, there lived"]
    # all prompts in one prefill step (dequantize + GEMM), then one alone (the block kernel); fp32
    # summation-order noise measured here: at most ~1e-5 (AVX-512 EPYC)
    for batch in (prompts, prompts[:1]):
        a, b = (llm.generate(batch, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
                for llm in k_pair)
        for x, y in zip(a, b):
            for lx, ly in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:]):
                assert lx.token_id == ly.token_id and abs(lx.logprob - ly.logprob) < 5e-4
    # decode steps: 3 rows through the block kernel
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)
    a, b = (llm.generate(prompts, greedy) for llm in k_pair)
    for x, y in zip(a, b):
        for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            if lx.token_id != ly.token_id:  # only at a near-tie of the dequantized model
                top = sorted((c.logprob for c in ly.top), reverse=True)
                assert top[0] - top[1] < 1e-3
                break
            assert abs(lx.logprob - ly.logprob) < 5e-4
