"""The flash-attn backend on CPU, through the pure-torch reference of flash-attn 2.8's API:
the reference against dense attention, the backend against the torch backend on the same logical
cache, and the engine against HF transformers."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from nanoserve.layers.attention import AttentionBatch, TorchAttention
from nanoserve.layers.backend_choice import resolve_attention
from nanoserve.layers.flash_attention import FlashAttention
from tests.flash_ref import FlashReference, flash_attn_varlen_func, naive_attention

REF = FlashReference(allow_fp32=True)
I32 = dict(dtype=torch.int32)


# ---- the reference itself ---------------------------------------------------------------------
@pytest.mark.parametrize("sq,sk", [(5, 5), (2, 7), (6, 3), (1, 9)])
@pytest.mark.parametrize("h,hk", [(4, 4), (6, 2), (4, 1)])
def test_reference_varlen_matches_dense(sq, sk, h, hk):
    torch.manual_seed(sq * 10 + sk)
    q, k, v = torch.randn(sq, h, 16), torch.randn(sk, hk, 16), torch.randn(sk, hk, 16)
    # two sequences in one call, the second a copy: the varlen offsets must pick each one out
    qq, kk, vv = torch.cat([q, q]), torch.cat([k, k]), torch.cat([v, v])
    cu_q, cu_k = torch.tensor([0, sq, 2 * sq], **I32), torch.tensor([0, sk, 2 * sk], **I32)
    for causal in (True, False):
        out = REF.flash_attn_varlen_func(qq, kk, vv, cu_q, cu_k, sq, sk, causal=causal)
        want = naive_attention(q, k, v, causal=causal)
        torch.testing.assert_close(out[:sq].double(), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out[sq:].double(), want, atol=1e-5, rtol=1e-5)
    if sq > sk:  # bottom-right alignment: the first sq - sk rows see nothing and are exactly 0
        assert out is not None and REF.flash_attn_varlen_func(qq, kk, vv, cu_q, cu_k, sq, sk,
                                                              causal=True)[:sq - sk].eq(0).all()


def test_reference_paged_matches_dense():
    """Paged varlen and with_kvcache (with an in-place append) read the right pages, in any order."""
    torch.manual_seed(0)
    page, hk, h, d = 256, 2, 6, 32
    cache_k, cache_v = torch.randn(5, page, hk, d), torch.randn(5, page, hk, d)
    table = torch.tensor([[3, 0, 4, 1 << 30]], **I32)  # last column unused: poisoned
    n = 600
    k = cache_k[[3, 0, 4]].flatten(0, 1)[:n]
    v = cache_v[[3, 0, 4]].flatten(0, 1)[:n]
    q = torch.randn(4, h, d)
    out = REF.flash_attn_varlen_func(q, cache_k, cache_v, torch.tensor([0, 4], **I32),
                                     torch.tensor([0, n], **I32), 4, n, softmax_scale=0.3, causal=True,
                                     block_table=table)
    torch.testing.assert_close(out.double(), naive_attention(q, k, v, 0.3), atol=1e-5, rtol=1e-5)
    k_new, v_new = torch.randn(1, 1, hk, d), torch.randn(1, 1, hk, d)
    out = REF.flash_attn_with_kvcache(q[None, :1], cache_k, cache_v, k_new, v_new,
                                      cache_seqlens=torch.tensor([n], **I32), block_table=table, causal=True)
    assert torch.equal(cache_k[4, n - 512], k_new[0, 0]) and torch.equal(cache_v[4, n - 512], v_new[0, 0])
    k2, v2 = torch.cat([k, k_new[0]]), torch.cat([v, v_new[0]])
    torch.testing.assert_close(out[0].double(), naive_attention(q[:1], k2, v2), atol=1e-5, rtol=1e-5)


def test_reference_refuses_what_upstream_refuses():
    q, k, v = torch.randn(4, 2, 8), torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    cu = torch.tensor([0, 4], **I32)
    with pytest.raises(RuntimeError, match="fp16 and bf16"):
        flash_attn_varlen_func(q, k, v, cu, cu, 4, 4)  # the strict module-level function
    with pytest.raises(RuntimeError, match="int32"):
        REF.flash_attn_varlen_func(q, k, v, cu.long(), cu, 4, 4)
    with pytest.raises(RuntimeError, match="contiguous last dimension"):
        REF.flash_attn_varlen_func(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, cu, cu, 4, 4)
    with pytest.raises(RuntimeError, match="must divide"):
        REF.flash_attn_varlen_func(torch.randn(4, 3, 8), k, v, cu, cu, 4, 4)
    paged = torch.randn(2, 128, 2, 8)
    with pytest.raises(RuntimeError, match="divisible by 256"):
        REF.flash_attn_varlen_func(q, paged, paged, cu, cu, 4, 4, block_table=torch.zeros(1, 1, **I32))
    paged = torch.randn(2, 256, 2, 8)
    with pytest.raises(RuntimeError, match="block_table must have dtype"):
        REF.flash_attn_with_kvcache(q[None], paged, paged, cache_seqlens=torch.tensor([4], **I32),
                                    block_table=torch.zeros(1, 1, dtype=torch.long))
    with pytest.raises(RuntimeError, match="seqlens_k must have dtype int32"):
        REF.flash_attn_with_kvcache(q[None], paged, paged, cache_seqlens=torch.tensor([4]),
                                    block_table=torch.zeros(1, 1, **I32))
    with pytest.raises(RuntimeError, match="out of range"):
        REF.flash_attn_with_kvcache(q[None], paged, paged, cache_seqlens=torch.tensor([4], **I32),
                                    block_table=torch.tensor([[7]], **I32))


# ---- the backend against the torch backend ----------------------------------------------------
BS = 256
KINDS = ("decode", "fresh", "chunk", "prefix_hit")


@st.composite
def steps(draw, bs: int = BS, max_done: int = 700):
    """One step's sequences: (kind, tokens already in the cache, new tokens), plus shapes."""
    kinds = draw(st.lists(st.sampled_from(KINDS), min_size=1, max_size=5))
    if draw(st.booleans()):  # pure-decode steps go through with_kvcache: draw plenty of them
        kinds = ["decode"] * len(kinds)
    seqs = []
    for kind in kinds:
        if kind == "decode":
            done, new = draw(st.integers(1, max_done)), 1
        elif kind == "fresh":
            done, new = 0, draw(st.integers(1, max_done * 3 // 7))
        elif kind == "chunk":
            done, new = draw(st.integers(1, max_done * 5 // 7)), draw(st.integers(2, max_done * 2 // 7))
        else:
            done, new = bs * draw(st.integers(1, 2)), draw(st.integers(1, max_done // 7))
        seqs.append((kind, done, new))
    return dict(seqs=seqs, kv_heads=draw(st.sampled_from([1, 2])), ratio=draw(st.sampled_from([1, 3, 4])),
                head_dim=draw(st.sampled_from([64, 128])), seed=draw(st.integers(0, 2**16)),
                spare_blocks=draw(st.integers(0, 2)))


def _run_both(case: dict, dtype: torch.dtype, pad_to: int | None = None, bs: int = BS, make=None):
    """The backend under test (`make(cache, heads, scale, scratch)`, default: flash over the
    reference) and the torch backend on the same logical cache and batch."""
    rng = random.Random(case["seed"])
    torch.manual_seed(case["seed"])
    kh, d, layers = case["kv_heads"], case["head_dim"], 2
    h = kh * case["ratio"]
    seqs = sorted(case["seqs"], key=lambda s: s[0] != "decode")  # the runner's order
    need = [-(-(done + new) // bs) for _, done, new in seqs]
    n_blocks = sum(need) + 1 + sum(1 for _ in seqs) * case["spare_blocks"]
    ids = list(range(n_blocks - 1))
    rng.shuffle(ids)  # block ids in any order
    scratch = n_blocks - 1
    flash_cache = torch.zeros(n_blocks, layers, 2, bs, kh, d, dtype=dtype)
    torch_cache = torch.zeros(n_blocks, layers, 2, kh, bs, d, dtype=dtype)
    tables, it = [], iter(ids)
    for (_, done, _), k in zip(seqs, need):
        # spare blocks past those needed: valid ids of other data the backends must not read
        tables.append([next(it) for _ in range(k + case["spare_blocks"])])
        for p in range(done):  # the same earlier context in both layouts
            kv = torch.randn(layers, 2, kh, d).to(dtype)
            blk, off = tables[-1][p // bs], p % bs
            flash_cache[blk, :, :, off] = kv
            torch_cache[blk, :, :, :, off] = kv
    flash_cache[scratch].normal_()
    torch_cache[scratch].normal_()
    slots = [(t[p // bs], p % bs) for (_, done, new), t in zip(seqs, tables) for p in range(done, done + new)]
    qlens = [new for _, _, new in seqs]
    ctx = [done + new for _, done, new in seqs]
    nd = sum(1 for kind, done, _ in seqs if kind == "decode")
    rows = pad_to or len(slots)
    slots += [(scratch, 0)] * (rows - len(slots))
    blocks = torch.tensor([s[0] for s in slots])
    offs = torch.tensor([s[1] for s in slots])
    batch = AttentionBatch(qlens, ctx, tables, nd, blocks, offs)
    make = make or (lambda c, h, sc, scratch: FlashAttention(c, h, sc, flash=REF, max_seqs=8,
                                                             max_blocks_per_seq=6, scratch_block=scratch))
    flash = make(flash_cache, h, d ** -0.5, scratch)
    flash.tables.np.fill(1 << 30)  # poison every column not written by prepare
    flash.prepare(batch, pad_to=pad_to)
    ref = TorchAttention(torch_cache, h, d ** -0.5)
    n = sum(qlens)
    ref.prepare(AttentionBatch(qlens, ctx, tables, nd, blocks[:n], offs[:n]))
    outs = []
    for layer in range(layers):
        q, k, v = (torch.randn(rows, h, d).to(dtype), torch.randn(rows, kh, d).to(dtype),
                   torch.randn(rows, kh, d).to(dtype))
        got = flash.forward(q, k, v, layer)
        want = ref.forward(q[:n], k[:n], v[:n], layer)
        outs.append((got[:n], want))
    # the new K/V landed in the same logical places
    real = torch.arange(n_blocks - 1)
    torch.testing.assert_close(flash_cache[real], torch_cache[real].transpose(3, 4), atol=0, rtol=0)
    return outs, flash


TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=steps())
def test_flash_backend_matches_torch_backend(dtype, case):
    outs, flash = _run_both(case, dtype)
    assert flash.decode_only == all(kind == "decode" for kind, _, _ in case["seqs"])
    for got, want in outs:
        torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


@settings(max_examples=10, deadline=None)
@given(case=steps().filter(lambda c: all(kind == "decode" for kind, _, _ in c["seqs"])),
       extra=st.integers(0, 3))
def test_padded_decode_matches_torch_backend(case, extra):
    """The CUDA-graph shape: rows padded up to a bucket, full-width tables, padding in the scratch block."""
    outs, flash = _run_both(case, torch.float32, pad_to=len(case["seqs"]) + extra)
    assert flash.block_table.shape == (len(case["seqs"]) + extra, 6)
    for got, want in outs:
        torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_backend_choice_and_refusals():
    cpu = torch.device("cpu")
    assert resolve_attention("auto", cpu, torch.float32, 0)[0] is TorchAttention
    assert resolve_attention("torch", cpu, torch.float32, 0)[2] == 16
    fp32, bf16 = "tests.flash_ref:FP32", "tests.flash_ref:GRAPH_SAFE"
    assert resolve_attention("auto", cpu, torch.bfloat16, 0, fp32)[0] is TorchAttention  # auto: CUDA only
    backend, module, bs = resolve_attention("flash", cpu, torch.bfloat16, 0, fp32)
    assert (backend, type(module), bs) == (FlashAttention, FlashReference, 256) and module.allow_fp32
    with pytest.raises(ValueError, match="multiple of 256"):
        resolve_attention("flash", cpu, torch.bfloat16, 16, fp32)
    with pytest.raises(ValueError, match="fp16/bf16 only"):
        resolve_attention("flash", cpu, torch.float32, 0, bf16)
    with pytest.raises(ValueError, match="flash-attn package"):
        resolve_attention("flash", cpu, torch.bfloat16, 0)  # no flash_attn installed here


# ---- the engine against HF --------------------------------------------------------------------
# greedy tokens per prompt: the short prompts decode beside the long ones' chunks, then pure-decode steps
FLASH_TOKENS = 4


@pytest.fixture(scope="module")
def flash_case(embedded_dir):
    """HF greedy (fp32, its own KV cache: the prompts are long, recomputing per token is slow)."""
    from transformers import AutoModelForCausalLM
    rng = random.Random(7)
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (300, 23, 280, 5)]
    prompts[2][:262] = prompts[0][:262]  # shares one full 256-token block with prompt 0
    hf = AutoModelForCausalLM.from_pretrained(embedded_dir, dtype=torch.float32).eval()
    expected = []
    with torch.no_grad():
        for p in prompts:
            out = hf(torch.tensor([p]), use_cache=True)
            toks = [int(out.logits[0, -1].argmax())]
            for _ in range(FLASH_TOKENS - 1):
                out = hf(torch.tensor([toks[-1:]]), past_key_values=out.past_key_values, use_cache=True)
                toks.append(int(out.logits[0, -1].argmax()))
            expected.append(toks)
    return prompts, expected


def _flash_llm(**kw):
    from nanoserve import LLM
    return LLM(dtype="float32", attention_backend="flash", flash_attn_module="tests.flash_ref:FP32",
               num_kv_blocks=12, **kw)


def test_engine_flash_matches_hf(flash_case):
    from nanoserve import SamplingParams
    prompts, expected = flash_case
    params = SamplingParams(temperature=0, max_tokens=FLASH_TOKENS, ignore_eos=True)
    llm = _flash_llm()
    assert llm.engine.layout.block_size == 256 and isinstance(llm.engine.runner.attn, FlashAttention)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    outs = llm.generate(prompts, params)  # again: full 256-token blocks come from the prefix cache
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert [o.num_cached_tokens for o in outs] == [256, 0, 256, 0]
    llm.engine.check_invariants()


def test_engine_flash_chunked_and_padded_decode_match_hf(flash_case):
    """Small token budget: prefills are chunked and share steps with decodes (varlen), and
    pure-decode steps run the padded static-buffer path that CUDA graphs replay."""
    from nanoserve import SamplingParams
    prompts, expected = flash_case
    llm = _flash_llm(max_num_batched_tokens=96, max_num_seqs=4)
    runner = llm.engine.runner
    runner.opts.padded_decode = True  # what CUDA graph replay runs, eagerly
    runner.buckets = [2, 4]           # 1 -> 2 rows, 3 -> 4 rows: padded
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=FLASH_TOKENS, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert runner.steps_padded > 0 and runner.steps_graphed == 0  # no CUDA here: padded steps ran eager



def test_engine_flash_windowed_model_matches_hf(tiny_path):
    """Gemma 3's windowed layer (an 8-token window, shorter than the prompts) through flash-attn's
    window_size, chunked prefills beside decodes and padded decode steps, and from the prefix cache."""
    from nanoserve import LLM, SamplingParams
    from tests.conftest import hf_greedy, random_prompts
    path = tiny_path("gemma3-window")
    prompts = random_prompts(4, 20, 70, seed=3)
    expected = hf_greedy(path, prompts, 6)
    llm = LLM(str(path), dtype="float32", attention_backend="flash", flash_attn_module="tests.flash_ref:FP32",
              num_kv_blocks=12, max_num_batched_tokens=48, max_num_seqs=4)
    runner = llm.engine.runner
    assert runner.attn.window(0) == 8 and runner.attn.window(1) == 0
    runner.opts.padded_decode, runner.buckets = True, [2, 4]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    assert runner.steps_padded > 0
    llm.engine.check_invariants()
