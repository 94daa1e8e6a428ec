"""The Triton paged backend on CPU, under Triton's interpreter (fp32): its kernels against the
torch backend on the flash tests' randomized batches (mixed decode / fresh prefill / chunk
continuation / prefix hit, shuffled and poisoned tables, GQA, head_dim 64/128) at 16-token
blocks, the padded (CUDA-graph) decode shape, and the whole engine against HF greedy; the key
chunks (decode by context length, prefill when its tiles are few) at a small chunk size against
an fp32 reference attention; per-layer sliding windows (head_dim up to 256) against a dense window
reference. Skipped where triton does not install."""
from __future__ import annotations

import os
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

# Triton reads the variable when it is imported and binds each kernel to the interpreter when the
# kernel is defined, so it is set before either, for the session; only the Triton backend reads it.
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="triton is not installed (pip install triton): the Triton backend's "
                                     "kernels cannot be interpreted on CPU")

from nanoserve import LLM, SamplingParams  # noqa: E402
from nanoserve.layers.attention import AttentionBatch  # noqa: E402
from nanoserve.layers.backend_choice import resolve_attention  # noqa: E402
from nanoserve.layers.triton_attention import TritonAttention  # noqa: E402
from tests.conftest import hf_greedy, make_tiny_model  # noqa: E402
from tests.test_cuda_path import host_sync_errors  # noqa: E402
from tests.test_flash_attention import _run_both, steps  # noqa: E402
from tests.test_sliding_window import (WINDOWS, Maker, check, dense_reference, make_step,  # noqa: E402
                                       run_backend)

BS = 16
TOL = {torch.float32: dict(atol=5e-5, rtol=5e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def _triton(cache, heads, scale, scratch):
    return TritonAttention(cache, heads, scale, max_seqs=8, max_blocks_per_seq=24, scratch_block=scratch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=steps(bs=BS, max_done=140))
def test_triton_backend_matches_torch_backend(dtype, case):
    """bf16: bf16 cache, K/V and output; the interpreter computes the dots in fp32 (on CUDA they
    are bf16 tensor-core dots with fp32 accumulation)."""
    outs, attn = _run_both(case, dtype, bs=BS, make=_triton)
    assert attn.decode_only == all(kind == "decode" for kind, _, _ in case["seqs"])
    for got, want in outs:
        torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


@settings(max_examples=6, deadline=None)
@given(case=steps(bs=BS, max_done=140).filter(lambda c: all(k == "decode" for k, _, _ in c["seqs"])),
       extra=st.integers(0, 3))
def test_triton_padded_decode_matches_torch_backend(case, extra):
    """The CUDA-graph shape: rows padded to a bucket (scratch block), the table's full width."""
    outs, attn = _run_both(case, torch.float32, pad_to=len(case["seqs"]) + extra, bs=BS, make=_triton)
    assert attn.block_table.shape == (len(case["seqs"]) + extra, 24)
    for got, want in outs:
        torch.testing.assert_close(got, want, **TOL[torch.float32])


def _step_vs_reference(seqs: list[tuple[int, int]], *, chunk: int, kv_heads: int = 2, group: int = 2,
                       pad_to: int | None = None, max_blocks: int | None = None) -> TritonAttention:
    """One step of (cached tokens, new tokens) sequences (pure decode when every row has one new
    token) through the Triton backend at `chunk` keys per program; every query against fp32
    causal softmax(q K^T) V over its keys gathered from the cache as it was, plus the new K/V."""
    d, seed = 32, sum(done + new for done, new in seqs)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    ctx = [done + new for done, new in seqs]
    need = [-(-c // BS) for c in ctx]
    scratch = sum(need)
    ids = list(range(scratch))
    rng.shuffle(ids)
    it = iter(ids)
    tables = [[next(it) for _ in range(k)] for k in need]
    cache = torch.randn(scratch + 1, 1, 2, BS, kv_heads, d)
    before = cache.clone()
    slots = [(t[p // BS], p % BS) for (done, new), t in zip(seqs, tables) for p in range(done, done + new)]
    tokens = pad_to or len(slots)
    slots += [(scratch, 0)] * (tokens - len(slots))
    decode = all(new == 1 for _, new in seqs)
    batch = AttentionBatch([new for _, new in seqs], ctx, tables, len(seqs) if decode else 0,
                           torch.tensor([b for b, _ in slots]), torch.tensor([o for _, o in slots]))
    attn = TritonAttention(cache, kv_heads * group, d ** -0.5, max_seqs=max(tokens, len(seqs)),
                           max_blocks_per_seq=max_blocks or max(need), scratch_block=scratch,
                           decode_chunk=chunk)
    attn.prepare(batch, pad_to=pad_to)
    q = torch.randn(tokens, kv_heads * group, d)
    k, v = torch.randn(tokens, kv_heads, d), torch.randn(tokens, kv_heads, d)
    got = attn.forward(q, k, v, 0)
    row = 0
    for (done, new), table in zip(seqs, tables):
        pos = torch.arange(done + new)
        kv = before[torch.tensor(table)[pos // BS], 0, :, pos % BS]  # [ctx, 2, kv_heads, d]
        kv[done:, 0], kv[done:, 1] = k[row:row + new], v[row:row + new]  # this step's tokens
        keys, vals = (kv[:, j].repeat_interleave(group, dim=1) for j in (0, 1))  # [ctx, heads, d]
        s = torch.einsum("qhd,chd->qhc", q[row:row + new], keys) * d ** -0.5
        s = s.masked_fill(pos[None, None, :] > done + torch.arange(new)[:, None, None], float("-inf"))
        want = torch.einsum("qhc,chd->qhd", s.softmax(-1), vals)
        torch.testing.assert_close(got[row:row + new], want, atol=2e-5, rtol=2e-5)
        row += new
    return attn


@pytest.mark.parametrize("ctx_lens, kv_heads, group", [
    ([300, 5, 64, 1, 128, 65], 2, 2),   # a long row (5 chunks of 64) among short ones, chunk edges, 1 token
    ([63, 192, 1, 129], 1, 3),          # either side of the edges; 3 query heads per KV head
    ([300], 1, 1),                      # one row alone: spread over `fill` programs, capped at the chunk
    ([100], 1, 1),                      # ...and shorter than fill * chunk: spread over fill programs
])
def test_decode_chunks_by_context_length(ctx_lens, kv_heads, group):
    attn = _step_vs_reference([(c - 1, 1) for c in ctx_lens], chunk=64, kv_heads=kv_heads, group=group)
    _, chunks = attn._decode_chunks(len(ctx_lens), kv_heads, max(ctx_lens))
    assert chunks >= -(-max(ctx_lens) // 64)  # the grid covers the longest row in 64-key chunks
    with pytest.raises(ValueError, match="multiple of the key tile"):
        TritonAttention(attn.kv_cache, attn.num_heads, attn.scale, max_seqs=1, max_blocks_per_seq=1,
                        scratch_block=0, decode_chunk=attn.block_n + 1)


def test_decode_graph_grid_with_short_rows():
    """The padded (graph) step: the grid comes from the full table width (40 blocks = 640 keys,
    10 chunks of 64), the rows are far shorter: most programs find nothing to do and exit."""
    attn = _step_vs_reference([(0, 1), (16, 1), (69, 1)], chunk=64, pad_to=4, max_blocks=40)
    assert attn.block_table.shape == (4, 40)
    assert attn._decode_chunks(4, 2, 40 * BS)[1] == 40 * BS // 64


@pytest.mark.parametrize("seqs, group", [
    ([(290, 3)], 3),                     # a short suffix over a long cached prefix: keys in chunks
    ([(300, 1), (250, 40), (0, 7)], 1),  # with a decode row, a chunk continuation and a fresh prefill
    ([(127, 1), (64, 64), (0, 1)], 1),   # at the chunk edges, one-token rows
    ([(10, 40)], 1),                     # a query tile reaching into a chunk its first rows cannot see
])
def test_prefill_key_chunks(seqs, group):
    """Few query tiles (one KV head; 4 'SMs' under the interpreter): the keys are split too."""
    attn = _step_vs_reference(seqs, chunk=32, kv_heads=1, group=group)
    chunks, per = attn._prefill_chunks(attn.num_heads, [new for _, new in seqs])
    longest = max(done + new for done, new in seqs)
    assert chunks > 1 and chunks * per >= longest and per % attn.block_n == 0


def _windowed(h: int) -> Maker:
    """The Triton backend at 64-key decode chunks (rows split by their window's keys)."""
    def build(cache, windows, scratch, width):
        return TritonAttention(cache, h, cache.shape[-1] ** -0.5, max_seqs=8, max_blocks_per_seq=width,
                               scratch_block=scratch, decode_chunk=64, windows=windows)
    return Maker(TritonAttention, build)


# tests/test_sliding_window.py's step kinds at about a third of their lengths (still past the windows 16 and
# 97, short of 1000), each with one head shape: the interpreter runs a 700-key step for a minute
TRITON_STEPS = {"mixed": ([(150, 1), (5, 1), (0, 37), (100, 30), (200, 3)], (4, 4, 64)),
                "decode": ([(1, 1), (16, 1), (199, 1), (40, 1)], (6, 2, 128)),
                "long": ([(250, 20), (0, 130)], (4, 1, 256)),
                "suffix": ([(300, 5)], (6, 2, 128))}


@pytest.mark.parametrize("steps", list(TRITON_STEPS))
def test_sliding_windows(steps):
    """The per-layer windows (0, 1, 16, 97, 1000) against the dense window reference; keys before each
    program's first query's window are NaN (never read). bf16 at head_dim 128, fp32 at the others."""
    seqs, (h, kh, d) = TRITON_STEPS[steps]
    dtype = torch.bfloat16 if d == 128 else torch.float32
    step = make_step(seqs, h, kh, d, len(WINDOWS), dtype)
    outs, attn = run_backend(_windowed(h), step, WINDOWS, bs=BS, poison=True)
    assert attn.decode_only == (steps == "decode")
    check(outs, dense_reference(step, WINDOWS), dtype)


def test_triton_choice(monkeypatch):
    cpu = torch.device("cpu")
    assert resolve_attention("triton", cpu, torch.float32, 0) == (TritonAttention, None, 16)
    assert resolve_attention("triton", cpu, torch.float32, 48)[2] == 48  # any block size
    assert resolve_attention("auto", cpu, torch.float32, 0)[0] is not TritonAttention  # auto: CUDA only
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        resolve_attention("triton", cpu, torch.float32, 0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, embedded_dir):
    return make_tiny_model(tmp_path_factory.mktemp("triton"), "llama-gqa-tied", embedded_dir)


def test_engine_triton_matches_hf(tiny):
    """fp32 greedy vs HF: chunked prefills sharing steps with decodes, a prefix-cache hit (the
    second round), and pure-decode steps on the padded path CUDA graphs replay."""
    rng = random.Random(5)
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (70, 9, 40)]
    prompts[2][:33] = prompts[0][:33]  # two full 16-token blocks shared with prompt 0
    expected = hf_greedy(tiny, prompts, 3)  # 3 tokens: decodes beside the last chunks, then padded
    llm = LLM(str(tiny), dtype="float32", attention_backend="triton", num_kv_blocks=40, max_num_seqs=4,
              max_num_batched_tokens=32)
    runner = llm.engine.runner
    assert isinstance(runner.attn, TritonAttention) and llm.engine.layout.block_size == BS
    runner.opts.padded_decode = True
    runner.buckets = [2, 4]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert outs[0].num_cached_tokens == 64 and outs[2].num_cached_tokens == 32
    assert runner.steps_padded > 0
    assert runner.graph_blocker(4, host_sync_errors) is None  # the decode forward never reads back
    llm.engine.check_invariants()
