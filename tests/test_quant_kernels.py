"""GGUF weights kept quantized (csrc/quant_blocks.cpp, quant_packed.cpp, layers/quant_linear.py) against
the gguf package's own dequantization followed by an fp32 matmul: per kept type (Q4_0, Q4_1, Q5_0, Q8_0),
ragged shapes (one block, odd row counts, row counts around the kernel's 8-row tiles and the GEMV/GEMM
switch), fp32 and bf16 activations; fused parts of different types (Q5_0 beside Q8_0, as Gemma 3's Q4_K_M
files have them); embedding rows.

The kernel dequantizes each block with the reference's own arithmetic, so the only difference is
summation order: fp32 results agree to ~1e-6 relative; with bf16 activations the weights are rounded to
bf16 first (as the prefill path's bf16 copy is), and results agree to one bf16 rounding."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from nanoserve.kernels import cpu_kernels
from nanoserve.layers.quant_linear import (GEMV_MAX_ROWS, PACKED_MAX_ROWS, Q4_0, Q4_1, Q4_K, Q5_0, Q6_K,
                                           Q8_0, QuantEmbedding, QuantLinear, QuantTensor, Scratch)
from tests.test_cpu_kernels import built_or_skip

TYPES = {"Q4_0": Q4_0, "Q4_1": Q4_1, "Q5_0": Q5_0, "Q8_0": Q8_0}


@pytest.fixture(scope="module")
def kernels():
    return built_or_skip(cpu_kernels.quant(), "GGUF weights are dequantized at load")


def quantized(rows: int, cols: int, qtype: int, seed: int = 0) -> QuantTensor:
    from gguf.quants import quantize
    g = np.random.default_rng(seed)
    w = g.standard_normal((rows, cols)).astype(np.float32) * 0.05
    w[:, :32] += 0.3  # blocks with a large offset (Q4_1's min) and mixed signs
    return QuantTensor(torch.from_numpy(quantize(w, qtype)), qtype, (rows, cols))


def reference(x: torch.Tensor, w: QuantTensor) -> torch.Tensor:
    return (x.double() @ w.dequantize().double().T)


def layouts(kernels) -> list[bool]:
    """Block layout always; the packed one where this build has it (AVX-512)."""
    return [False, True] if kernels.packs() else [False]


@pytest.mark.parametrize("name", list(TYPES))
@pytest.mark.parametrize("rows,cols", [(1, 32), (7, 96), (33, 576), (130, 1536)])
# 261: two sweeps of 256
@pytest.mark.parametrize("tokens", [1, 3, 8, 9, GEMV_MAX_ROWS + 5, PACKED_MAX_ROWS + 5, 261])
def test_quant_linear_matches_dequantize_then_matmul(kernels, name, rows, cols, tokens):
    w = quantized(rows, cols, TYPES[name], seed=rows + cols)
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(tokens))
    want = reference(x, w)
    scale = want.abs().max().item() + 1e-6
    for packed in layouts(kernels):
        ww = w.packed_for(kernels) if packed else w
        assert ww.packed == packed
        got = QuantLinear([ww], kernels, Scratch())(x)
        assert got.dtype == torch.float32 and got.shape == (tokens, rows)
        assert (got.double() - want).abs().max().item() <= 2e-6 * scale * cols ** 0.5, packed
        lin = QuantLinear([ww], kernels, Scratch())
        got16 = lin(x.bfloat16())
        assert got16.dtype == torch.bfloat16
        want16 = x.bfloat16().double() @ w.dequantize().double().T
        if packed and tokens <= lin.max_kernel_rows and kernels.int8_activations():
            # the packed kernel rounds each 32-activation block to int8: within half a step an element
            # + the output's bf16 rounding
            bound = int8_rounding_bound(x.bfloat16(), w) + 2 ** -8 * want16.abs()
            assert ((got16.double() - want16).abs() <= bound + 1e-6).all(), packed
            continue
        if not (packed and tokens <= lin.max_kernel_rows):
            # the block kernel and the GEMM meet the weights rounded to bf16 (the GEMM's bf16 copy)
            want16 = x.bfloat16().double() @ w.dequantize().bfloat16().double().T
        # one bf16 rounding of the output
        assert (got16.double() - want16).abs().max().item() <= 2 ** -7 * scale, packed


def int8_rounding_bound(x: torch.Tensor, w: QuantTensor) -> torch.Tensor:
    """[tokens, rows]: the most that rounding x to int8 per 32-block (scale absmax / 127) can move x W^T."""
    xb = x.double().view(x.shape[0], -1, 32)
    wb = w.dequantize().double().abs().view(w.shape[0], -1, 32).sum(-1)
    return torch.einsum("tb,nb->tn", xb.abs().amax(-1) / 254, wb)


def test_int8_activations_are_the_rounded_blocks_exactly(kernels):
    """The integer path computes exactly sum_b d_w d_x dot(q_w, q_x): reproduce it from the int8 rounding."""
    if not (kernels.packs() and kernels.int8_activations()):
        pytest.skip("no int8 activation path in this build (AVX512_VNNI)")
    w = quantized(48, 128, Q8_0, seed=9)
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(9)).bfloat16()
    xb = x.float().view(2, -1, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    # the activations the kernel sees: its arithmetic (x * (127 / absmax), rounded half to even) in fp32;
    # `127 / amax` on a tensor is 127 * (1 / amax) in torch, an ulp off the kernel's quotient at near-ties
    xq = torch.round(xb * torch.full_like(amax, 127).div(amax)).clamp(-127, 127) * (amax / 127)
    want = xq.view(2, 128).double() @ w.dequantize().double().T
    out = torch.empty(2, 48)
    kernels.quant_linear(x, w.packed_for(kernels).data, Q8_0 + 256, out)
    assert (out.double() - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    # not exact: rounded
    assert (out.double() - x.double() @ w.dequantize().double().T).abs().max().item() > 1e-4


@pytest.mark.parametrize("name", list(TYPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols", [96, 576])  # an odd and an even block count (the bf16 kernel pairs blocks)
def test_a_row_gets_the_same_bits_whatever_rows_share_its_pass(kernels, name, dtype, cols):
    """Batch invariance: greedy text must not depend on the batch shape a token was decoded in."""
    x = torch.randn(GEMV_MAX_ROWS, cols, generator=torch.Generator().manual_seed(cols)).to(dtype)
    for w in {quantized(37, cols, TYPES[name], seed=cols).packed_for(kernels) if p else
              quantized(37, cols, TYPES[name], seed=cols) for p in layouts(kernels)}:
        together = torch.empty(GEMV_MAX_ROWS, 37, dtype=dtype)
        kernels.quant_linear(x, w.data, w.kernel_type, together)
        for t in range(GEMV_MAX_ROWS):
            alone = torch.empty(1, 37, dtype=dtype)
            kernels.quant_linear(x[t:t + 1], w.data, w.kernel_type, alone)
            assert torch.equal(alone, together[t:t + 1]), (name, dtype, t, w.packed)


def test_dequantize_kernel_is_exactly_the_gguf_packages(kernels):
    for name, qtype in TYPES.items():
        w = quantized(19, 320, qtype)
        for ww in (w, w.packed_for(kernels)):  # the second is packed where the build packs
            out = torch.empty(19, 320)
            kernels.quant_dequantize(ww.data, ww.kernel_type, out)
            assert torch.equal(out, w.dequantize()), (name, ww.packed)


def test_fused_parts_of_different_types_write_their_own_columns(kernels):
    parts = [quantized(64, 192, Q4_1, 1), quantized(32, 192, Q8_0, 2), quantized(40, 192, Q4_0, 3)]
    bias = torch.randn(136)
    x = torch.randn(5, 192)
    want = torch.cat([reference(x, p) for p in parts], dim=1) + bias.double()
    for packed in layouts(kernels):
        pp = [p.packed_for(kernels) if packed else p for p in parts]
        for tokens in (5, PACKED_MAX_ROWS + 1):  # the kernel, then dequantize + GEMM (packed: as with AMX)
            xx = torch.randn(tokens, 192) if tokens != 5 else x
            ref = want if tokens == 5 else torch.cat([reference(xx, p) for p in parts], dim=1) + bias.double()
            lin = QuantLinear(pp, kernels, Scratch(), bias)
            lin.max_kernel_rows = min(lin.max_kernel_rows, PACKED_MAX_ROWS)
            got = lin(xx)
            assert (got.double() - ref).abs().max().item() < 1e-4


def q5_levels(w: QuantTensor) -> set[int]:
    """The 5-bit values (0..31) a Q5_0 matrix's blocks hold: qs's nibble | qh's bit j << 4."""
    b = w.data.numpy().reshape(-1, 22)
    qh = b[:, 2:6].copy().view(np.uint32)
    nibbles = np.concatenate([b[:, 6:] & 15, b[:, 6:] >> 4], axis=1)
    return set((nibbles | ((qh >> np.arange(32, dtype=np.uint32)) & 1) << 4).ravel().tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_groups_of_q5_0_beside_q8_0(kernels, dtype):
    """Gemma 3's Q4_K_M layers: a QKV of Q5_0, Q5_0, Q8_0 (three parts, each writing its columns) and a
    gate/up of Q5_0, Q5_0 (one stacked matrix; the fused GLU where packed), at decode and prefill sizes."""
    import torch.nn.functional as F
    q, k, v = quantized(64, 320, Q5_0, 1), quantized(32, 320, Q5_0, 2), quantized(32, 320, Q8_0, 3)
    gate, up = quantized(96, 320, Q5_0, 4), quantized(96, 320, Q5_0, 5)
    assert q5_levels(q) == set(range(32))  # every fifth bit, set and clear, is exercised
    for packed in layouts(kernels):
        lay = [w.packed_for(kernels) if packed else w for w in (q, k, v, gate, up)]
        qkv, gate_up = QuantLinear(lay[:3], kernels, Scratch()), QuantLinear(lay[3:], kernels, Scratch())
        assert [p.qtype for p in qkv.parts] == [Q5_0, Q5_0, Q8_0] and len(gate_up.parts) == 1
        assert gate_up.fused_glu == (packed and kernels.glu(gate_up.parts[0].kernel_type))
        for tokens in (1, 9, 261):
            x = torch.randn(tokens, 320, generator=torch.Generator().manual_seed(tokens)).to(dtype)
            kernel = tokens <= qkv.max_kernel_rows
            for lin, parts in ((qkv, (q, k, v)), (gate_up, (gate, up))):
                got = lin(x)
                assert got.dtype == dtype and got.shape == (tokens, lin.out_features)
                # the packed kernel computes on the exact weights, the block kernel and the GEMM on their
                # bf16 rounding (quant.h)
                exact = dtype == torch.float32 or (packed and kernel)
                ws = [w.dequantize() if exact else w.dequantize().bfloat16() for w in parts]
                want = torch.cat([x.double() @ w.double().T for w in ws], dim=1)
                scale = want.abs().max().item()
                if dtype == torch.float32:
                    assert (got.double() - want).abs().max().item() <= 2e-6 * scale * 320 ** 0.5
                elif packed and kernel and kernels.int8_activations():
                    bound = torch.cat([int8_rounding_bound(x, w) for w in parts], 1) + 2 ** -8 * want.abs()
                    assert ((got.double() - want).abs() <= bound + 1e-6).all()
                else:
                    assert (got.double() - want).abs().max().item() <= 2 ** -7 * scale
            if dtype == torch.float32:
                g = gate_up(x).double()
                want = F.silu(g[:, :96]) * g[:, 96:]
                assert ((gate_up.silu_mul(x).double() - want).abs() <= 1e-5 * want.abs() + 1e-6).all()


def test_parts_of_one_type_are_stacked_into_one_matrix(kernels):
    """A fused QKV of one type is one kernel call; packed parts stack only in whole groups of 16 rows."""
    parts = [quantized(64, 96, Q4_1, 1), quantized(32, 96, Q4_1, 2), quantized(32, 96, Q4_1, 3)]
    x = torch.randn(3, 96)
    want = torch.cat([reference(x, p) for p in parts], dim=1)
    for packed in layouts(kernels):
        lin = QuantLinear([p.packed_for(kernels) if packed else p for p in parts], kernels, Scratch())
        assert len(lin.parts) == 1 and lin.parts[0].shape == (128, 96) and lin.offsets == [0]
        assert (lin(x).double() - want).abs().max().item() < 1e-4
    if kernels.packs():
        ragged = [quantized(20, 96, Q4_1, 4).packed_for(kernels),
                  quantized(16, 96, Q4_1, 5).packed_for(kernels)]
        assert len(QuantLinear(ragged, kernels, Scratch()).parts) == 2  # 20 rows: not whole groups


def test_embedding_dequantizes_the_rows_it_reads(kernels):
    table = quantized(50, 64, Q8_0)
    ids = torch.tensor([3, 0, 49, 3])
    for t in (table, table.packed_for(kernels)):
        assert torch.equal(QuantEmbedding(t, kernels, torch.float32)(ids), table.dequantize()[ids])
        assert torch.equal(QuantEmbedding(t, kernels, torch.bfloat16)(ids),
                           table.dequantize()[ids].bfloat16())
    if kernels.packs():
        with pytest.raises(RuntimeError, match="out of"):
            QuantEmbedding(table.packed_for(kernels), kernels, torch.float32)(torch.tensor([50]))


def test_bad_shapes_are_refused(kernels):
    w = quantized(4, 64, Q4_1)
    with pytest.raises(ValueError, match="block matrix"):
        QuantTensor(w.data[:, :-1], Q4_1, (4, 64))
    with pytest.raises(RuntimeError, match="needs"):
        kernels.quant_linear(torch.randn(1, 96), w.data, Q4_1, torch.empty(1, 4))
    with pytest.raises(RuntimeError, match="no kernel"):
        kernels.quant_linear(torch.randn(1, 64), w.data, 13, torch.empty(1, 4))  # Q5_K


def test_prefill_of_a_large_weight_dequantizes_it_in_row_chunks(kernels, monkeypatch):
    from nanoserve.layers import quant_linear
    monkeypatch.setattr(quant_linear, "DEQUANT_CHUNK", 7 * 192)  # 7 rows at a time: chunks end mid-part
    parts = [quantized(30, 192, Q4_1, 4), quantized(12, 192, Q8_0, 5)]
    bias = torch.randn(42)
    x = torch.randn(PACKED_MAX_ROWS + 3, 192)  # beyond both kernels' row limits
    want = torch.cat([reference(x, p) for p in parts], dim=1) + bias.double()
    # packed (as with AMX): 16 rows at a time, the last chunk of a part shorter
    for packed in layouts(kernels):
        lin = QuantLinear([p.packed_for(kernels) if packed else p for p in parts], kernels, Scratch(), bias)
        lin.max_kernel_rows = min(lin.max_kernel_rows, PACKED_MAX_ROWS)
        got = lin(x)
        assert (got.double() - want).abs().max().item() < 1e-4, packed


def test_packed_layout_refuses_what_does_not_fit_it(kernels):
    if not kernels.packs():
        pytest.skip("this build has no packed layout (AVX-512 only)")
    w = quantized(20, 64, Q4_0).packed_for(kernels)
    # 20 rows padded to two groups, same bytes a row
    assert w.packed and tuple(w.data.shape) == (2, 2 * 18 * 16)
    with pytest.raises(ValueError, match="16 at a time"):
        w.rows(3, 19)
    with pytest.raises(ValueError, match="dequantized by its kernels"):
        w.dequantize()
    with pytest.raises(RuntimeError, match="outputs need"):  # 40 outputs need three groups, not two
        kernels.quant_linear(torch.randn(1, 64), w.data, w.kernel_type, torch.empty(1, 40))
    assert w.rows(16, 20).shape == (4, 64) and w.rows(16, 20).data.shape[0] == 1


def assert_unfused_glu_within_bound(x: torch.Tensor, gate: QuantTensor, up: QuantTensor,
                                    got: torch.Tensor) -> None:
    """The unfused path: gate and up each a GEMM on the weights rounded to the activation dtype (fp32
    sums, rounded once), then silu and the product each rounded: a few units of that dtype's rounding
    relative to |up| (|gate| + |silu(gate)|), plus the fp32 sums' own error."""
    import torch.nn.functional as F
    xd = x.double()
    g, u = (xd @ w.dequantize().to(x.dtype).double().T for w in (gate, up))
    want = F.silu(g) * u
    eps = torch.finfo(x.dtype).eps
    sums = (xd.abs() @ gate.dequantize().abs().double().T + xd.abs() @ up.dequantize().abs().double().T)
    bound = 2 * eps * u.abs() * (g.abs() + F.silu(g).abs()) + 1e-6 * sums * (u.abs() + g.abs() + 1)
    assert ((got.double() - want).abs() <= bound).all()


@pytest.mark.parametrize("name", [*TYPES, "Q4_K", "Q6_K"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("amx", ["0", "1"])  # the decisions of a CPU without AMX tiles, and of one with them
def test_gate_up_is_fused_into_silu_times_up(kernels, name, dtype, monkeypatch, amx):
    monkeypatch.setenv("NANOSERVE_CPU_AMX", amx)
    """A packed [gate; up] layer computes silu(gate) * up in one call: the fp32 product of the kernel's own
    gate and up sums (silu to ~1 ulp), rounded to the output dtype once; the unfused path where it cannot."""
    import torch.nn.functional as F

    from tests.test_kquant_kernels import kq
    qtype = TYPES.get(name) or {"Q4_K": Q4_K, "Q6_K": Q6_K}[name]
    if not kernels.packs(qtype):
        pytest.skip("the fused gate/up needs the packed layout (AVX-512)")
    make = quantized if name in TYPES else kq
    gate, up = make(48, 256, qtype, 1), make(48, 256, qtype, 2)
    lin = QuantLinear([gate.packed_for(kernels), up.packed_for(kernels)], kernels, Scratch())
    assert lin.fused_glu
    for tokens in (1, 9, 300):
        x = (torch.randn(tokens, 256) * 2).to(dtype)
        sums = torch.empty(tokens, 96)
        kernels.quant_linear(x, lin.parts[0].data, lin.parts[0].kernel_type, sums)
        want = F.silu(sums[:, :48].double()) * sums[:, 48:].double()
        fused32 = torch.empty(tokens, 48)
        kernels.quant_linear_glu(x, lin.parts[0].data, lin.parts[0].kernel_type, fused32)
        assert ((fused32.double() - want).abs() <= 1e-6 * want.abs() + 1e-9).all()
        got = lin.silu_mul(x)
        assert got.dtype == dtype
        if tokens <= lin.max_kernel_rows:
            assert torch.equal(got, fused32.to(dtype))
        else:  # AMX: dequantize + GEMM in the activation dtype, silu and the product rounded in it
            assert_unfused_glu_within_bound(x, gate, up, got)
    odd = QuantLinear([quantized(40, 96, Q4_1, 3).packed_for(kernels),
                       quantized(40, 96, Q4_1, 4).packed_for(kernels)], kernels, Scratch())
    assert not odd.fused_glu  # halves of 40 rows are not whole groups: silu and the product in torch
    x = torch.randn(3, 96)
    gate_up = odd(x)
    assert torch.equal(odd.silu_mul(x), F.silu(gate_up[:, :40]) * gate_up[:, 40:])
    with pytest.raises(RuntimeError, match="16 rows"):
        kernels.quant_linear_glu(x, odd.parts[0].data, odd.parts[0].kernel_type, torch.empty(3, 20))
