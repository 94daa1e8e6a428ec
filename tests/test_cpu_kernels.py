"""The C++ CPU kernels (nanoserve/kernels/cpu_kernels.py) against the torch path they replace
(prefill attention: tests/test_prefill_attention.py):
paged decode attention over random block tables (GQA ratios 1/3/4/10, head_dim 64/128/256, block sizes
5/16/24/32, contexts on and off block boundaries, fp32 and bf16), the fused residual-add + RMSNorm
(bit-exact with HF's LlamaRMSNorm in bf16), RoPE in place (bit-exact with rotate) and the KV slot
write; then the embedded model (head_dim 64, so the kernels run) gives the same greedy tokens in fp32
with the kernels and without them."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from nanoserve.kernels import cpu_kernels
from nanoserve.layers.attention import AttentionBatch, TorchAttention


def built_or_skip(module, without: str):
    """`module` (a kernel build), else a skip where the kernels are off ($NANOSERVE_CPU_KERNELS=0) or no
    toolchain is here (`without`: what runs instead), else a failure: a compiler and ninja are here, yet
    nothing built."""
    if module is not None:
        return module
    if os.environ.get("NANOSERVE_CPU_KERNELS") == "0":
        pytest.skip(f"$NANOSERVE_CPU_KERNELS=0: {without}")
    if shutil.which("g++") and shutil.which("ninja"):
        pytest.fail("a compiler and ninja are here, yet the CPU kernels did not build (see the log warning)")
    pytest.skip(f"no C++ toolchain: {without}")


@pytest.fixture(scope="module")
def kernels():
    return built_or_skip(cpu_kernels.load(), "the torch path runs (and is what every other test exercises)")


def _decode_case(dtype, h, kh, d, contexts, bs=16, layers=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-c // bs) for c in contexts) + 5
    cache = torch.randn(num_blocks, layers, 2, kh, bs, d, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, at = [], 0
    for c in contexts:
        n = -(-c // bs)
        tables.append(perm[at:at + n])
        at += n
    nd = len(contexts)
    # views of one fused QKV output, as the model passes them: rows strided, read in place
    q, k, v = torch.randn(nd, h + 2 * kh, d, generator=g).to(dtype).split([h, kh, kh], dim=1)
    pos = [c - 1 for c in contexts]  # each decode writes its token at the last position
    blocks = torch.tensor([t[p // bs] for t, p in zip(tables, pos)])
    offs = torch.tensor([p % bs for p in pos])
    batch = AttentionBatch([1] * nd, list(contexts), tables, nd, blocks, offs)
    return cache, batch, q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# GQA 10 (over 8: heads in two passes) with 24-token blocks (16-key groups that end inside a block), and
# 3 query heads of 128 dims (their p.V in one pass over all four 32-dim chunks)
@pytest.mark.parametrize("h,kh,d,bs", [(9, 3, 64, 16), (8, 8, 64, 16), (8, 2, 128, 16), (9, 3, 64, 5),
                                       (20, 2, 64, 24), (6, 2, 128, 32), (8, 2, 256, 16), (3, 3, 256, 24)])
def test_paged_decode_attention_matches_the_torch_path(kernels, dtype, h, kh, d, bs):
    contexts = [1, 15, 16, 17, 33, 300, 64]  # block edges: the kernel walks rows across blocks
    out = {}
    for name, kern in (("torch", None), ("kernel", kernels)):
        cache, batch, q, k, v = _decode_case(dtype, h, kh, d, contexts, bs=bs)
        attn = TorchAttention(cache, h, d ** -0.5, kern)
        assert (attn.kernels is None) == (kern is None)
        attn.prepare(batch)
        out[name] = [attn.forward(q, k, v, layer) for layer in range(cache.shape[1])]
        if kern is not None:  # without `out` the kernel returns a new tensor, the same values
            again = kern.paged_decode_attention(q, cache, 0, attn.dec_table, attn.dec_ctx, d ** -0.5)
            assert torch.equal(again, out[name][0])
    # the torch path rounds scores and probabilities to the dtype; the kernel keeps them in fp32
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for a, b in zip(out["torch"], out["kernel"]):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(b.float(), a.float(), atol=tol, rtol=tol)


def test_kernel_is_not_used_where_it_does_not_apply(kernels):
    cache = torch.zeros(4, 1, 2, 2, 16, 16)  # head_dim 16: the kernel is built for 64, 128 and 256
    assert TorchAttention(cache, 4, 0.25, kernels).kernels is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_is_hf_llama_rmsnorm_after_the_residual_add(kernels, dtype):
    g = torch.Generator().manual_seed(1)
    x, res, w = (torch.randn(*s, generator=g).to(dtype) for s in ((7, 576), (7, 576), (576,)))

    def hf(r):
        hs = r.float()
        return w * (hs * torch.rsqrt(hs.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)

    r = res.clone()
    out = kernels.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(r, res + x)  # the residual is updated in place, rounded as the eager add
    if dtype == torch.bfloat16:
        assert torch.equal(out, hf(res + x))
    else:
        torch.testing.assert_close(out, hf(res + x), atol=1e-6, rtol=1e-6)
    assert torch.equal(kernels.add_rms_norm(None, r, w, 1e-5), out)  # no delta: the norm alone
    assert torch.equal(r, res + x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_in_place_is_bit_exact_with_rotate(kernels, dtype):
    from nanoserve.layers.rotary import RotaryEmbedding, rotate
    h, hk, d, n = 9, 3, 64, 11
    rot = RotaryEmbedding(d, 512, 100000.0, None, dtype, torch.device("cpu"))
    cos, sin = rot.cos_sin(torch.tensor([0, 1, 5, 17, 100, 200, 201, 202, 300, 400, 511]))
    qkv = torch.randn(n, (h + 2 * hk) * d, generator=torch.Generator().manual_seed(2)).to(dtype)
    want = rotate(qkv[:, :(h + hk) * d].view(n, h + hk, d), cos, sin)
    got = qkv.clone()
    kernels.rope_(got, h + hk, d, cos, sin)
    assert torch.equal(got[:, :(h + hk) * d].view(n, h + hk, d), want)
    assert torch.equal(got[:, (h + hk) * d:], qkv[:, (h + hk) * d:])  # V untouched


def test_write_kv_fills_the_same_slots_as_index_put(kernels):
    cache, batch, q, k, v = _decode_case(torch.bfloat16, 9, 3, 64, [5, 16, 17, 40])
    # k, v as strided views, as in the model
    qkv = torch.cat([t.reshape(len(t), -1) for t in (q, k, v)], dim=1)
    kv_view, vv = qkv[:, 9 * 64:12 * 64].view(-1, 3, 64), qkv[:, 12 * 64:].view(-1, 3, 64)
    want = cache.clone()
    want[:, 1, 0][batch.slot_blocks, :, batch.slot_offsets] = k
    want[:, 1, 1][batch.slot_blocks, :, batch.slot_offsets] = v
    kernels.write_kv(kv_view, vv, cache, 1, batch.slot_blocks, batch.slot_offsets)
    assert torch.equal(cache, want)
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.write_kv(kv_view, vv, cache, 1, batch.slot_blocks + cache.shape[0], batch.slot_offsets)


def test_embedded_model_same_tokens_with_and_without_kernels(kernels):
    from nanoserve import LLM, SamplingParams
    llm = LLM(None, dtype="float32", kv_cache_gb=0.25, enable_prefix_caching=False)
    eng = llm.engine
    assert eng.model.kernels is kernels and eng.runner.attn.kernels is kernels
    # the long prompt spans several query and key tiles of the prefill kernel
    prompts = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,", ", ".join(map(str, range(90)))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    with_k = llm.generate(prompts, params)
    eng.model.kernels = eng.runner.attn.kernels = None
    without = llm.generate(prompts, params)
    for a, b in zip(with_k, without):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert abs(la.logprob - lb.logprob) < 1e-3



@pytest.mark.parametrize("attr", ["none", "swish", "mul"])
def test_linear_rows_is_each_threads_rows_through_the_same_onednn_call(kernels, attr):
    """Each thread's rows are one single-threaded oneDNN call: bit-exact with those calls made one by
    one, and within bf16 rounding of the fp32 matmul."""
    from nanoserve.layers.linear import Linear
    g = torch.Generator().manual_seed(0)
    lin = Linear((torch.randn(320, 96, generator=g) * 0.1).bfloat16(),
                 torch.randn(320, generator=g).bfloat16())
    if lin.packed is None:
        pytest.skip("no oneDNN packing in this torch build")
    x = torch.randn(1001, 96, generator=g).bfloat16()  # not a multiple of the thread count
    other = torch.randn(1001, 320, generator=g).bfloat16() if attr == "mul" else None

    def call(rows: slice) -> torch.Tensor:
        a = x[rows]
        return lin.times(a, other[rows]) if attr == "mul" else lin.silu(a) if attr == "swish" else lin(a)

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        with torch.inference_mode():  # as the engine calls it: the pool threads must run in it too
            got = kernels.linear_rows(x, lin.packed, lin.bias, 320, attr, other)
        torch.set_num_threads(1)
        parts = [call(slice(r, r + 334)) for r in range(0, 1001, 334)]
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got, torch.cat(parts))
    y = torch.nn.functional.linear(x.float(), lin.weight.float(), lin.bias.float())
    ref = torch.nn.functional.silu(y) if attr == "swish" else y * other.float() if attr == "mul" else y
    assert (got.float() - ref).abs().max() <= 0.02 * ref.abs().max()
