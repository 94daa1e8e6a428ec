"""The fused small ops (layers/triton_fused.py) on CPU under Triton's interpreter, against the torch ops
they replace, in fp32 and bf16: residual add + RMSNorm, SiLU·mul, RoPE with the K/V store into the flash
and Triton backends' caches (every element of the cache compared with the backend's own store), the
NANOSERVE_FUSED_OPS switch, and the engine's greedy tokens with the fused loop against the torch loop and
HF. Skipped where triton does not install.

Bounds (asserted by `_assert_within`): the residual, RoPE and the stored K/V are bit-for-bit the torch
ops'. RMSNorm sums its squares in fp32 in another order than torch, and SiLU's exp is another
implementation: fp32 outputs within a relative 2^-20 (measured: at most 3.3e-7, these shapes and Llama-8B's
up to 64 x 4096 and 32 x 14336), bf16 outputs the same or the adjacent bf16 value (1 ulp), on at most 1%
of the elements (measured: none here, 1 in 262k at 64 x 4096)."""
from __future__ import annotations

import os
import random

import pytest
import torch
import torch.nn.functional as F

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (see test_triton_attention.py)
pytest.importorskip("triton", reason="triton is not installed: the fused kernels cannot be interpreted")

from nanoserve import LLM, SamplingParams  # noqa: E402
from nanoserve.layers import triton_fused  # noqa: E402
from nanoserve.layers.attention import AttentionBatch  # noqa: E402
from nanoserve.layers.flash_attention import FlashAttention  # noqa: E402
from nanoserve.layers.rotary import RotaryEmbedding, rotate  # noqa: E402
from nanoserve.layers.triton_attention import TritonAttention  # noqa: E402
from nanoserve.models.fused_loop import fused_ops  # noqa: E402
from tests.conftest import hf_greedy  # noqa: E402
from tests.flash_ref import FlashReference  # noqa: E402
from tests.test_cuda_path import host_sync_errors  # noqa: E402
from tests.test_triton_attention import tiny  # noqa: E402, F401 - the module's tiny model, as a fixture

DTYPES = [torch.float32, torch.bfloat16]


def _assert_within(got: torch.Tensor, want: torch.Tensor) -> None:
    """The module docstring's bound for a reduction or an exp computed another way."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2 ** -20, atol=0)
        return
    g, w = got.view(torch.int16).int(), want.view(torch.int16).int()
    assert (g - w).abs().max() <= 1  # same sign: adjacent bit patterns are adjacent values
    assert (g != w).float().mean() <= 0.01


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, hidden", [(1, 64), (7, 96), (13, 576), (3, 4096)])  # 96, 576: not 2^k
@pytest.mark.parametrize("add", [True, False])
def test_add_rms_norm_matches_add_then_rms_norm(dtype, rows, hidden, add):
    torch.manual_seed(rows * hidden)
    residual = torch.randn(rows, hidden, dtype=dtype) * 3
    delta = torch.randn(rows, hidden, dtype=dtype) if add else None
    weight = torch.randn(hidden, dtype=dtype)
    want_res = residual.clone().add_(delta) if add else residual.clone()
    want = F.rms_norm(want_res, (hidden,), weight, 1e-5)
    got = triton_fused.add_rms_norm(residual, delta, weight, 1e-5)
    assert torch.equal(residual, want_res)  # updated in place, rounded as add_ rounds
    _assert_within(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, inter, scale", [(1, 64, 1.0), (9, 176, 4.0), (4, 1100, 10.0)])
def test_silu_mul_matches_silu_times_up(dtype, rows, inter, scale):
    """1100: two column tiles, the second partly masked; scale 10 reaches far into exp's range."""
    torch.manual_seed(inter)
    gate_up = torch.randn(rows, 2 * inter, dtype=dtype) * scale
    gate, up = gate_up.chunk(2, dim=-1)
    _assert_within(triton_fused.silu_mul(gate_up), F.silu(gate) * up)


def _batch(seqs: list[tuple[int, int]], bs: int, seed: int) -> tuple[AttentionBatch, list[int], int]:
    """(cached, new) tokens per sequence, decodes first; blocks shuffled -> (batch, positions, scratch)."""
    rng = random.Random(seed)
    ctx = [done + new for done, new in seqs]
    need = [-(-c // bs) for c in ctx]
    ids = list(range(sum(need)))
    rng.shuffle(ids)
    it = iter(ids)
    tables = [[next(it) for _ in range(k)] for k in need]
    pos = [p for done, new in seqs for p in range(done, done + new)]
    rows = [t for (done, new), t in zip(seqs, tables) for _ in range(new)]
    decodes = next((i for i, (_, new) in enumerate(seqs) if new != 1), len(seqs))
    batch = AttentionBatch([new for _, new in seqs], ctx, tables, decodes,
                           torch.tensor([t[p // bs] for t, p in zip(rows, pos)]),
                           torch.tensor([p % bs for p in pos]))
    return batch, pos, sum(need)


def _backend(kind: str, cache: torch.Tensor, heads: int, scratch: int) -> FlashAttention:
    kw = dict(max_seqs=8, max_blocks_per_seq=8, scratch_block=scratch)
    if kind == "flash":
        return FlashAttention(cache, heads, 0.125, flash=FlashReference(allow_fp32=True), **kw)
    return TritonAttention(cache, heads, 0.125, **kw)


@pytest.mark.parametrize("kind, bs", [("triton", 16), ("flash", 256)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim, heads, kv_heads", [(64, 4, 2), (128, 8, 1), (64, 3, 3)])
@pytest.mark.parametrize("seqs", [[(3, 1), (20, 1), (0, 5), (17, 6)],  # 13 tokens: decodes, prefills
                                  [(0, 1), (30, 1), (15, 1)]])         # pure decode, 3 rows
def test_rope_kv_is_rotate_plus_the_backends_own_store(kind, bs, dtype, head_dim, heads, kv_heads, seqs):
    """Layer 1 of 2: the fused op's Q, K, V and the whole cache (layer 0 and every untouched slot
    included) equal torch's rotate then the backend's own store, and so does the attention output."""
    torch.manual_seed(head_dim + heads)
    batch, pos, scratch = _batch(seqs, bs, seed=sum(new for _, new in seqs))
    t, d = len(pos), head_dim
    cos, sin = RotaryEmbedding(d, 512, 10000.0, None, dtype, torch.device("cpu")).cos_sin(torch.tensor(pos))
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, dtype=dtype)
    cache = torch.randn(scratch + 1, 2, 2, bs, kv_heads, d, dtype=dtype)
    ref_cache, fused_cache = cache.clone(), cache.clone()

    ref = _backend(kind, ref_cache, heads, scratch)
    ref.prepare(batch)
    qk = rotate(qkv[:, :(heads + kv_heads) * d].view(t, heads + kv_heads, d), cos, sin)
    want = ref.forward(qk[:, :heads], qk[:, heads:], qkv[:, (heads + kv_heads) * d:].view(t, kv_heads, d), 1)

    fused = _backend(kind, fused_cache, heads, scratch)
    fused.prepare(batch)
    q, k, v = triton_fused.rope_kv(qkv.clone(), cos, sin, heads, kv_heads, fused.kv_destination(1))
    got = fused.forward(q, k, v, 1, kv_written=True)

    assert torch.equal(q, qk[:, :heads]) and torch.equal(k, qk[:, heads:])
    assert torch.equal(fused_cache, ref_cache)
    assert not torch.equal(fused_cache, cache)  # the control: the step did store something
    assert torch.equal(got, want)


def test_rope_without_a_cache_rotates_in_place_and_refuses_bad_shapes():
    """The torch backend's case on CUDA: RoPE only, V untouched; misshapen inputs refused."""
    cos, sin = RotaryEmbedding(64, 64, 500000.0, None, torch.float32, torch.device("cpu")).cos_sin(
        torch.tensor([9, 0, 63]))
    qkv = torch.randn(3, 8 * 64)
    q, k, v = triton_fused.rope_kv(qkv.clone(), cos, sin, 4, 2)
    want = rotate(qkv[:, :6 * 64].view(3, 6, 64), cos, sin)
    assert torch.equal(q, want[:, :4]) and torch.equal(k, want[:, 4:])
    assert torch.equal(v, qkv[:, 6 * 64:].view(3, 2, 64))
    with pytest.raises(ValueError, match="rope_kv"):
        triton_fused.rope_kv(qkv[:, :-64], cos, sin, 4, 2)
    with pytest.raises(ValueError, match="silu_mul"):
        triton_fused.silu_mul(torch.randn(2, 7))
    with pytest.raises(ValueError, match="add_rms_norm"):
        triton_fused.add_rms_norm(torch.randn(2, 8), torch.randn(2, 4), torch.ones(8), 1e-5)


def test_switch(monkeypatch):
    """Default: CUDA with Triton; 0 off everywhere; 1 wherever Triton runs, refused where it does not."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv("NANOSERVE_FUSED_OPS", raising=False)
    assert fused_ops(cpu) is None and fused_ops(cuda) is triton_fused  # a decision only: nothing launches
    monkeypatch.setenv("NANOSERVE_FUSED_OPS", "0")
    assert fused_ops(cpu) is None and fused_ops(cuda) is None
    monkeypatch.setenv("NANOSERVE_FUSED_OPS", "1")
    assert fused_ops(cpu) is triton_fused
    monkeypatch.setenv("NANOSERVE_FUSED_OPS", "yes")
    with pytest.raises(ValueError, match="must be 0 or 1"):
        fused_ops(cuda)
    monkeypatch.setenv("NANOSERVE_FUSED_OPS", "1")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        fused_ops(cpu)


@pytest.mark.parametrize("backend", ["triton", "flash"])
def test_engine_fused_loop_gives_the_torch_loops_greedy_tokens(tiny, monkeypatch, backend):  # noqa: F811
    """fp32: chunked prefills sharing steps with decodes, a prefix-cache hit on the second round, padded
    decode steps (what CUDA graphs replay), with the fused ops: HF's tokens, as the unfused loop gives them
    (tests/test_triton_attention.py, test_flash_attention.py); the fused decode forward never reads back
    (capturable)."""
    rng = random.Random(5)
    first = 70 if backend == "triton" else 270  # flash's blocks are 256 tokens: one full block to hit
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (first, 9, 40)]
    prompts[2][:33] = prompts[0][:33]
    expected = hf_greedy(tiny, prompts, 3)  # 3 tokens: decodes beside the last chunks, then padded
    calls = {name: 0 for name in ("add_rms_norm", "silu_mul", "rope_kv")}
    for name in calls:
        def counted(*a, _f=getattr(triton_fused, name), _n=name, **kw):
            calls[_n] += 1
            return _f(*a, **kw)
        monkeypatch.setattr(triton_fused, name, counted)
    kw = dict(attention_backend="triton", num_kv_blocks=40) if backend == "triton" else dict(
        attention_backend="flash", flash_attn_module="tests.flash_ref:FP32_GRAPH_SAFE", num_kv_blocks=8)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    monkeypatch.setenv("NANOSERVE_FUSED_OPS", "1")
    llm = LLM(str(tiny), dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, **kw)
    runner = llm.engine.runner
    runner.opts.padded_decode, runner.buckets = True, [2, 4]
    for _ in range(2):  # a second round: prefix-cache hits
        outs = llm.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in outs] == expected
    assert outs[0].num_cached_tokens > 0  # the second round's first prompt: its full blocks from the cache
    assert runner.steps_padded > 0
    assert calls["rope_kv"] > 0 and calls["add_rms_norm"] == 2 * calls["rope_kv"]
    assert runner.graph_blocker(4, host_sync_errors) is None
    llm.engine.check_invariants()
