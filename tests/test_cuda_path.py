"""What CPU can check of the CUDA path: staging reuse ordered by an event (a fake stream that
remembers which pinned buffers are still being read), capture-safety detection before any capture,
plain varlen for fresh prefills, the graph table width, flash_attn import failures, and the
sampler's one host sync per step."""
from __future__ import annotations

import contextlib
import importlib
import random

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.layers import staging as staging_mod
from nanoserve.layers.attention import AttentionBatch, TorchAttention
from nanoserve.layers.backend_choice import resolve_attention
from nanoserve.layers.flash_attention import FlashAttention, import_flash_attn
from nanoserve.layers.sampler import Sampler
from nanoserve.sampling_params import SamplingParams as SP
from nanoserve.sequence import Sequence
from tests.conftest import hf_greedy, make_tiny_model
from tests.flash_ref import FlashReference

REF = "tests.flash_ref:FP32_GRAPH_SAFE"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, embedded_dir):
    return make_tiny_model(tmp_path_factory.mktemp("cuda-path"), "llama-gqa-tied", embedded_dir)


# ---- staging: a fake device whose copies stay queued until an event says they ran -------------
class FakeStream:
    """Copies run at once (so results are right) but count as queued until an event recorded
    after them is synchronized; copying from a host buffer whose last copy is still queued means
    that buffer was rewritten under a pending copy: the defect the fence prevents."""

    def __init__(self) -> None:
        self.queued: set[int] = set()
        self.copies = 0

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        key = src.untyped_storage().data_ptr()
        if key in self.queued:
            raise AssertionError("pinned staging rewritten while its previous copy was still queued")
        self.queued.add(key)
        self.copies += 1
        dst.copy_(src)


class FakeEvent:
    def __init__(self, stream: FakeStream) -> None:
        self.stream, self.marked = stream, set()

    def record(self) -> None:
        self.marked = set(self.stream.queued)

    def synchronize(self) -> None:
        self.stream.queued -= self.marked


def _fenced_llm(monkeypatch, tiny, stream: FakeStream, **kw) -> LLM:
    real = staging_mod.Staging
    monkeypatch.setattr("nanoserve.runner.model_runner.Staging",
                        lambda device: real(device, FakeEvent(stream), stream.copy))
    return LLM(str(tiny), dtype="float32", attention_backend="flash", flash_attn_module=REF, num_kv_blocks=8,
               max_num_batched_tokens=64, max_num_seqs=4, **kw)


def test_staging_reuse_waits_for_the_previous_steps_copies(monkeypatch, tiny):
    """A 300-token prompt at 64 tokens per step: four steps of non-final chunks sample nothing
    (nothing else would sync), then decode steps; outputs still match HF."""
    rng = random.Random(3)
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (300, 7)]
    stream = FakeStream()
    llm = _fenced_llm(monkeypatch, tiny, stream)
    out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert stream.copies > 20
    assert [o.outputs[0].token_ids for o in out] == hf_greedy(tiny, prompts, 5)


def test_fake_stream_catches_unfenced_reuse(monkeypatch, tiny):
    """The control: without the wait, the second step's upload hits a still-queued buffer."""
    stream = FakeStream()
    llm = _fenced_llm(monkeypatch, tiny, stream)
    monkeypatch.setattr(staging_mod.Staging, "begin_writes", lambda self: None)
    with pytest.raises(AssertionError, match="still queued"):
        llm.generate([list(range(100, 400))], SamplingParams(temperature=0, max_tokens=2))


# ---- capture safety ---------------------------------------------------------------------------
@contextlib.contextmanager
def host_sync_errors():
    """CPU stand-in for torch.cuda.set_sync_debug_mode("error"): every tensor -> host read raises."""
    def boom(*_a, **_k):
        raise RuntimeError("called a synchronizing CUDA operation")
    saved = {n: getattr(torch.Tensor, n) for n in ("tolist", "item", "__bool__")}
    for n in saved:
        setattr(torch.Tensor, n, boom)
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


@pytest.mark.parametrize("module,blocked", [(REF, None), ("tests.flash_ref:SYNCING", "syncs"),
                                            ("tests.flash_ref:FP32", "not graph-safe")])
def test_capture_safety_is_decided_before_any_capture(tiny, module, blocked):
    llm = LLM(str(tiny), dtype="float32", attention_backend="flash", flash_attn_module=module,
              num_kv_blocks=4, max_num_seqs=4)
    why = llm.engine.runner.graph_blocker(4, host_sync_errors)
    assert (why is None) if blocked is None else (blocked in why)
    # the runner stays usable after the check (no half-open state)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 2


def test_warmup_prefill_and_graph_width(tiny):
    llm = LLM(str(tiny), dtype="float32", attention_backend="flash", flash_attn_module=REF, num_kv_blocks=4,
              max_model_len=300, max_num_batched_tokens=128)
    runner = llm.engine.runner
    assert runner.attn.max_width == 2  # ceil(300 / 256), not the model's 512 positions
    logits = runner.warmup_prefill(128)
    assert logits.shape == (128, llm.engine.model.vocab_size) and torch.isfinite(logits).all()
    runner.opts.max_model_len = 50  # longer than max_model_len: split into sequences
    assert runner._warmup_lens(128) == [50, 50, 28]
    assert runner.warmup_prefill(128).shape[0] == 128


# ---- fresh prefills use plain varlen ----------------------------------------------------------
class Spy(FlashReference):
    def __init__(self):
        super().__init__(allow_fp32=True)
        self.calls = []

    def flash_attn_varlen_func(self, q, k, v, *a, block_table=None, **kw):
        self.calls.append((block_table is not None, k.shape[0]))
        return super().flash_attn_varlen_func(q, k, v, *a, block_table=block_table, **kw)


@pytest.mark.parametrize("ctx_extra", [0, 5])
def test_fresh_prefill_uses_plain_varlen(ctx_extra):
    torch.manual_seed(0)
    bs, kh, h, d = 256, 2, 4, 64
    spy = Spy()
    flash_cache = torch.zeros(4, 1, 2, bs, kh, d)
    torch_cache = torch.zeros(4, 1, 2, kh, bs, d)
    qlens = [7, 3]
    ctx = [7 + ctx_extra, 3]  # ctx_extra > 0: the first sequence has cached (zero) context
    tables = [[2], [0]]
    slots = [(2, p) for p in range(ctx_extra, ctx[0])] + [(0, p) for p in range(3)]
    blk, off = torch.tensor([s[0] for s in slots]), torch.tensor([s[1] for s in slots])
    fa = FlashAttention(flash_cache, h, d ** -0.5, flash=spy, max_seqs=4, max_blocks_per_seq=2,
                        scratch_block=3)
    fa.prepare(AttentionBatch(qlens, ctx, tables, 0, blk, off))
    ref = TorchAttention(torch_cache, h, d ** -0.5)
    ref.prepare(AttentionBatch(qlens, ctx, tables, 0, blk, off))
    q, k, v = torch.randn(10, h, d), torch.randn(10, kh, d), torch.randn(10, kh, d)
    torch.testing.assert_close(fa.forward(q, k, v, 0), ref.forward(q, k, v, 0), atol=2e-5, rtol=2e-5)
    assert spy.calls == ([(False, 10)] if not ctx_extra else [(True, 4)])
    assert flash_cache[2, 0, 0, ctx_extra:ctx[0]].equal(k[:7])  # the store still happened


# ---- flash_attn import failures ---------------------------------------------------------------
def test_broken_flash_attn_build_means_unavailable(monkeypatch):
    real_import = importlib.import_module

    def fake(name, *a, **kw):
        if name == "flash_attn":
            raise RuntimeError("undefined symbol: _ZN3c10...")  # a build for another torch
        return real_import(name, *a, **kw)
    monkeypatch.setattr(importlib, "import_module", fake)
    module, why = import_flash_attn()
    assert module is None and "RuntimeError" in why
    assert resolve_attention("auto", torch.device("cpu"), torch.bfloat16, 0)[0] is TorchAttention
    with pytest.raises(ValueError, match="RuntimeError"):
        resolve_attention("flash", torch.device("cpu"), torch.bfloat16, 0)


# ---- sampler: one host sync per step ----------------------------------------------------------
def test_sampler_syncs_once_per_step(monkeypatch):
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    params = [SP(temperature=0, logprobs=3), SP(temperature=0.8, top_k=5, logprobs=1, seed=4),
              SP(temperature=1.0, top_p=0.9, min_p=0.05), SP(temperature=0, logprobs=0),
              SP(temperature=0.7, seed=9), SP(temperature=0)]
    seqs = []
    for i, p in enumerate(params):
        gen = torch.Generator().manual_seed(p.seed) if p.seed is not None else None
        seqs.append(Sequence(i, "r", 0, [1, 2, 3], p, 8, frozenset(), generator=gen))
    want = Sampler(seed=1)(logits.clone(), seqs)
    for s, p in zip(seqs, params):  # fresh generators: the same draws again
        s.generator = torch.Generator().manual_seed(p.seed) if p.seed is not None else None
    counts = {"n": 0}
    for name in ("tolist", "item", "__bool__"):
        orig = getattr(torch.Tensor, name)

        def counted(self, *a, _orig=orig, **kw):
            counts["n"] += 1
            return _orig(self, *a, **kw)
        monkeypatch.setattr(torch.Tensor, name, counted)
    got = Sampler(seed=1)(logits.clone(), seqs)
    assert counts["n"] == 1
    assert got.token_ids == want.token_ids and got.logprobs == want.logprobs
    assert torch.equal(got.tokens, want.tokens)
    lp = torch.log_softmax(logits, -1)
    assert got.logprobs[0].logprob == float(lp[0, got.token_ids[0]])
    assert [t for t, _ in got.logprobs[0].top] == lp[0].topk(3).indices.tolist()
    assert got.logprobs[2] is None and got.logprobs[3].top == []
    counts["n"] = 0
    rows = Sampler.prompt_logprobs(logits, [4, 5, 6, 7, 8, 9], 2)
    assert counts["n"] == 1 and [r.token_id for r in rows] == [4, 5, 6, 7, 8, 9]
    assert rows[1].logprob == float(lp[1, 5])
