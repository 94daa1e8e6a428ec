"""The C++ paged prefill attention (kernels/cpu_kernels.py) against the torch path (SDPA) on
randomized batches: decodes, fresh prompts, continuations and prefix hits in one step, GQA 1/3/4,
head_dim 64/128/256, chunks and contexts on and off block and tile boundaries; fp32 tightly, bf16 with
and without bf16 tiles (`amx`: AMX where the CPU has it, else VDPBF16PS on AVX512_BF16) within bf16
tolerance. Also: the torch path's chunk over cached context takes the
lower-right causal bias (no materialised mask) where SDPA needs it to keep its efficient kernels."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from nanoserve.layers import attention as attention_mod
from nanoserve.layers.attention import AttentionBatch, TorchAttention
from tests.test_cpu_kernels import kernels  # noqa: F401 - the fixture (built kernels, or skip)


def _batch(seed: int, h: int, kh: int, d: int, dtype, bs: int = 16, layers: int = 2):
    """A random step: 0-2 decodes, then 1-4 prefill chunks, each fresh (context = chunk) or over
    cached context (prefix hit / later chunk). The cache holds random K/V for the cached part."""
    rnd = random.Random(seed)
    decodes = [rnd.randint(1, 150) for _ in range(rnd.randint(0, 2))]
    chunks = []
    for _ in range(rnd.randint(1, 4)):
        n = rnd.choice([1, 5, 16, 42, 43, 64, 65, 130, rnd.randint(1, 300)])
        chunks.append((n, n if rnd.random() < 0.4
                       else n + rnd.choice([1, 15, 16, 63, 64, rnd.randint(1, 400)])))
    lens = [1] * len(decodes) + [n for n, _ in chunks]
    ctxs = decodes + [c for _, c in chunks]
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-c // bs) for c in ctxs) + 3
    cache = torch.randn(num_blocks, layers, 2, kh, bs, d, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, blocks, offsets = [], [], []
    for n, c in zip(lens, ctxs):
        tables.append([perm.pop() for _ in range(-(-c // bs))])
        blocks += [tables[-1][p // bs] for p in range(c - n, c)]
        offsets += [p % bs for p in range(c - n, c)]
    t = sum(lens)
    # views of one fused QKV output, as the model passes them: rows strided, read in place
    q, k, v = torch.randn(t, h + 2 * kh, d, generator=g).to(dtype).split([h, kh, kh], dim=1)
    batch = AttentionBatch(lens, ctxs, tables, len(decodes), torch.tensor(blocks), torch.tensor(offsets))
    return cache, batch, q, k, v


def _run(kern, amx, seed, h, kh, d, dtype):
    cache, batch, q, k, v = _batch(seed, h, kh, d, dtype)
    attn = TorchAttention(cache, h, d ** -0.5, kern)
    attn.amx = amx
    attn.prepare(batch)
    assert (attn.pre_args is not None) == (kern is not None)
    return [attn.forward(q, k, v, layer) for layer in range(cache.shape[1])]


@pytest.mark.parametrize("h,kh,d", [(8, 8, 64), (9, 3, 64), (8, 2, 128), (12, 4, 128), (8, 2, 256)])
@pytest.mark.parametrize("dtype,amx", [(torch.float32, False), (torch.bfloat16, False),
                                       (torch.bfloat16, True)])
def test_prefill_kernel_matches_the_torch_path(kernels, h, kh, d, dtype, amx):
    tol = 2e-5 if dtype == torch.float32 else 3e-2  # bf16: SDPA rounds scores/probabilities differently
    for seed in range(4):
        want = _run(None, amx, seed, h, kh, d, dtype)
        got = _run(kernels, amx, seed, h, kh, d, dtype)
        for a, b in zip(want, got):
            assert a.dtype == b.dtype and a.shape == b.shape
            torch.testing.assert_close(b.float(), a.float(), atol=tol, rtol=tol)


def test_prefill_kernel_rejects_out_of_range_blocks(kernels):
    cache, batch, q, k, v = _batch(7, 9, 3, 64, torch.float32)
    attn = TorchAttention(cache, 9, 0.125, kernels)
    attn.prepare(batch)
    table, starts, lens, ctxs = attn.pre_args
    with pytest.raises(RuntimeError, match="out of range"):
        qp = q[batch.num_decodes:]
        kernels.paged_prefill_attention(qp, torch.empty_like(qp), cache, 0, table + cache.shape[0], starts,
                                        lens, ctxs, 0.125, True)


def test_continuation_uses_the_lower_right_causal_bias_not_a_mask(monkeypatch):
    """The torch path for a chunk over cached context: with `causal_bias` (chosen for every
    non-CPU device) SDPA gets a CausalBias over expanded heads, no materialised tensor mask, and the
    same result as the bool-mask path."""
    cache, batch, q, k, v = _batch(3, 9, 3, 64, torch.float32)
    assert any(c > n for n, c in zip(batch.query_lens[batch.num_decodes:],
                                     batch.context_lens[batch.num_decodes:]))
    assert TorchAttention(torch.empty(1, 1, 2, 3, 16, 64, device="meta"), 9, 0.125).causal_bias
    outs, masks = {}, []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        masks.append((attn_mask, q.shape[1] == k.shape[1]))
        return real(q, k, v, attn_mask=attn_mask, **kw)

    # the module's own `F` only: CausalBias recognises torch's function by identity
    monkeypatch.setattr(attention_mod, "F", SimpleNamespace(scaled_dot_product_attention=spy))
    for bias in (False, True):
        attn = TorchAttention(cache.clone(), 9, 0.125)
        assert attn.causal_bias is False  # a CPU cache: the bool mask with GQA
        attn.causal_bias = bias
        attn.prepare(batch)
        masks.clear()
        outs[bias] = attn.forward(q, k, v, 0)
        ctx_masks = [m for m, _ in masks if m is not None]
        assert ctx_masks, "no continuation reached SDPA"
        if bias:
            assert all(isinstance(m, torch.nn.attention.bias.CausalBias) for m in ctx_masks)
            assert all(same for m, same in masks if m is not None)  # KV heads expanded: no GQA flag
        else:
            assert all(isinstance(m, torch.Tensor) and m.dtype == torch.bool for m in ctx_masks)
    torch.testing.assert_close(outs[True], outs[False], atol=1e-5, rtol=1e-5)
