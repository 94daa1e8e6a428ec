"""Sliding-window attention (Gemma 3's local layers; HF's sliding mask: the query at position p sees keys
p - window < j <= p) in every CPU-testable backend against a dense float64 softmax with the window mask:
the torch path, the C++ kernels (fp32 tiles, and bf16 tiles: AMX or VDPBF16PS), flash-attn's API through
the stand-in tests/flash_ref.py (Triton: tests/test_triton_attention.py). Each step mixes decodes, fresh
prompts and chunks that start mid-sequence over cached context; the layers' windows mix global (0), 1,
shorter and longer than the contexts; GQA 1/3/4, head_dim 64/128/256; fp32 and bf16. The C++ kernels
must skip the keys wholly out of the window, not only mask them: those are NaN in their runs (read,
they would spread). A window of at least the context changes nothing, bit for bit."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from nanoserve.layers.attention import AttentionBackend, AttentionBatch, TorchAttention
from nanoserve.layers.flash_attention import FlashAttention
from tests.flash_ref import FlashReference, naive_attention
from tests.test_cpu_kernels import kernels  # noqa: F401 - the fixture (built kernels, or skip)

# (tokens cached, new tokens): decodes first (the backends attend them together), then prefill chunks
STEPS = {
    "mixed": [(300, 1), (5, 1), (0, 37), (200, 60), (512, 3)],
    "decode": [(1, 1), (16, 1), (399, 1), (40, 1)],
    "long": [(600, 20), (0, 300)],  # a chunk far past its window (tiles skipped); one longer than it
    "suffix": [(700, 5)],  # a short chunk over a long context: Triton splits its keys where unwindowed
}
WINDOWS = (0, 1, 16, 97, 1000)  # global, one key, a block, shorter than most contexts, longer than all
HEADS = [(4, 4, 64), (6, 2, 128), (4, 1, 256)]  # (query heads, KV heads, head_dim)
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}
KS = 256  # the C++ prefill packs keys in tiles of 256 from the first one any query of a chunk sees


def make_step(seqs: list[tuple[int, int]], h: int, kh: int, d: int, layers: int, dtype: torch.dtype,
              seed: int = 0) -> dict:
    """Random K/V of every position of every sequence and layer, and the new tokens' queries."""
    g = torch.Generator().manual_seed(seed)
    keys = [[torch.randn(c + n, kh, d, generator=g).to(dtype) for c, n in seqs] for _ in range(layers)]
    values = [[torch.randn(c + n, kh, d, generator=g).to(dtype) for c, n in seqs] for _ in range(layers)]
    q = torch.randn(sum(n for _, n in seqs), h, d, generator=g).to(dtype)
    return dict(seqs=seqs, keys=keys, values=values, q=q, h=h, kh=kh, d=d, layers=layers)


def dense_reference(step: dict, windows: tuple[int, ...]) -> list[torch.Tensor]:
    """Per layer [T, H, D] in float64: every new token against its sequence's keys, softmax with the
    window mask."""
    scale, outs = step["d"] ** -0.5, []
    for layer in range(step["layers"]):
        w, rows, at = windows[layer] if windows else 0, [], 0
        for s, (done, new) in enumerate(step["seqs"]):
            q = step["q"][at:at + new].double()
            k, v = step["keys"][layer][s].double(), step["values"][layer][s].double()
            g = step["h"] // step["kh"]
            scores = torch.einsum("ihd,jhd->hij", q, k.repeat_interleave(g, 1)) * scale
            p = torch.arange(done, done + new)[:, None]
            j = torch.arange(done + new)[None, :]
            seen = (j <= p) & ((j > p - w) if w else True)
            probs = scores.masked_fill(~seen, float("-inf")).softmax(-1)
            rows.append(torch.einsum("hij,jhd->ihd", probs, v.repeat_interleave(g, 1)))
            at += new
        outs.append(torch.cat(rows))
    return outs


def first_read(done: int, new: int, window: int) -> int:
    """The first position the C++ kernels may read for a sequence at a window-`window` layer: the decode
    kernel from the first visible key, the prefill one from the tile (KS keys) holding its first query's
    first visible key."""
    first = max(0, done - window + 1) if window else 0
    return first if new == 1 and done else first // KS * KS


@dataclass(frozen=True)
class Maker:
    """A backend class and how to build one: build(cache, windows, scratch block, table width)."""
    backend: type[AttentionBackend]
    build: Callable[[torch.Tensor, tuple[int, ...], int, int], AttentionBackend]


def run_backend(make: Maker, step: dict, windows: tuple[int, ...], bs: int, poison: bool = False
                ) -> tuple[list[torch.Tensor], AttentionBackend]:
    """One step through the backend `make` builds over a cache holding every sequence's cached K/V (blocks
    in shuffled order); with `poison`, each window layer's positions that the kernels must never read are
    NaN."""
    seqs, layers, kh, d = step["seqs"], step["layers"], step["kh"], step["d"]
    backend, flash_layout = make.backend, make.backend is not TorchAttention
    need = [-(-(c + n) // bs) for c, n in seqs]
    nblocks = sum(need) + 2
    dtype = step["q"].dtype
    cache = torch.zeros(nblocks + 1, layers, 2, *backend.block_shape(bs, kh, d), dtype=dtype)
    perm = torch.randperm(nblocks, generator=torch.Generator().manual_seed(7)).tolist()
    tables = [[perm.pop() for _ in range(n)] for n in need]
    slot_b, slot_o, new_k, new_v = [], [], [[] for _ in range(layers)], [[] for _ in range(layers)]
    for s, (done, new) in enumerate(seqs):
        pos = torch.arange(done + new)
        blk, off = torch.tensor(tables[s])[pos // bs], pos % bs
        for layer in range(layers):
            for kv, src in ((0, step["keys"]), (1, step["values"])):
                rows = src[layer][s].clone()
                if poison and windows and windows[layer]:
                    rows[:first_read(done, new, windows[layer])] = float("nan")
                idx = (blk[:done], layer, kv) + ((off[:done],) if flash_layout else (slice(None), off[:done]))
                cache[idx] = rows[:done]
            new_k[layer].append(step["keys"][layer][s][done:])
            new_v[layer].append(step["values"][layer][s][done:])
        slot_b += blk[done:].tolist()
        slot_o += off[done:].tolist()
    nd = sum(1 for done, new in seqs if new == 1 and done)
    batch = AttentionBatch([n for _, n in seqs], [c + n for c, n in seqs], tables, nd, torch.tensor(slot_b),
                           torch.tensor(slot_o))
    attn = make.build(cache, windows, nblocks, max(need))
    attn.prepare(batch)
    outs = [attn.forward(step["q"], torch.cat(new_k[layer]), torch.cat(new_v[layer]), layer)
            for layer in range(layers)]
    return outs, attn


def torch_backend(h: int, kern=None, amx: bool = False) -> Maker:
    def build(cache, windows, scratch, width):
        attn = TorchAttention(cache, h, cache.shape[-1] ** -0.5, kern, windows=windows)
        assert (attn.kernels is None) == (kern is None)
        attn.amx = amx
        return attn
    return Maker(TorchAttention, build)


def flash_backend(h: int) -> Maker:
    def build(cache, windows, scratch, width):
        return FlashAttention(cache, h, cache.shape[-1] ** -0.5, flash=FlashReference(allow_fp32=True),
                              max_seqs=8, max_blocks_per_seq=width, scratch_block=scratch, windows=windows)
    return Maker(FlashAttention, build)


def check(outs: list[torch.Tensor], want: list[torch.Tensor], dtype: torch.dtype) -> None:
    for layer, (got, ref) in enumerate(zip(outs, want)):
        assert got.dtype == dtype and not got.isnan().any(), layer
        torch.testing.assert_close(got.double(), ref, atol=TOL[dtype], rtol=TOL[dtype], msg=f"layer {layer}")


def _case(h, kh, d, steps, dtype, seed=0) -> dict:
    return make_step(STEPS[steps], h, kh, d, len(WINDOWS), dtype, seed)


@pytest.mark.parametrize("h,kh,d", HEADS)
@pytest.mark.parametrize("steps", list(STEPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_path_matches_the_dense_window_reference(h, kh, d, steps, dtype):
    step = _case(h, kh, d, steps, dtype)
    check(run_backend(torch_backend(h), step, WINDOWS, bs=16)[0], dense_reference(step, WINDOWS), dtype)


@pytest.mark.parametrize("h,kh,d", HEADS)
@pytest.mark.parametrize("steps", list(STEPS))
@pytest.mark.parametrize("dtype,amx", [(torch.float32, False), (torch.bfloat16, False),
                                       (torch.bfloat16, True)])
def test_cpu_kernels_skip_what_the_window_hides(kernels, h, kh, d, steps, dtype, amx):
    """Blocks of 16 and 24 keys (windows ending inside a block); out-of-window keys NaN."""
    step = _case(h, kh, d, steps, dtype)
    want = dense_reference(step, WINDOWS)
    for bs in (16, 24):
        check(run_backend(torch_backend(h, kernels, amx), step, WINDOWS, bs=bs, poison=True)[0], want, dtype)


@pytest.mark.parametrize("h,kh,d", HEADS)
@pytest.mark.parametrize("steps", list(STEPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flash_backend_matches_the_dense_window_reference(h, kh, d, steps, dtype):
    step = _case(h, kh, d, steps, dtype)
    check(run_backend(flash_backend(h), step, WINDOWS, bs=256)[0], dense_reference(step, WINDOWS), dtype)


@pytest.mark.parametrize("name", ["torch", "kernels", "flash"])
def test_a_window_at_least_the_context_changes_nothing(kernels, name):
    h = 6
    make, bs = {"torch": (torch_backend(h), 16), "kernels": (torch_backend(h, kernels), 16),
                "flash": (flash_backend(h), 256)}[name]
    step = _case(h, 2, 128, "mixed", torch.float32)
    wide = tuple(max(c + n for c, n in step["seqs"]) + x for x in (0, 1, 5, 100, 4096))
    got = run_backend(make, step, wide, bs)[0]
    assert all(torch.equal(a, b) for a, b in zip(got, run_backend(make, step, (), bs)[0]))


def test_the_kernels_and_the_torch_path_agree_on_windows(kernels):
    """fp32, the C++ kernels against the torch path on one random mixed step per head shape."""
    for h, kh, d in HEADS:
        step = _case(h, kh, d, "mixed", torch.float32, seed=3)
        want = run_backend(torch_backend(h), step, WINDOWS, 16)[0]
        got = run_backend(torch_backend(h, kernels), step, WINDOWS, 16)[0]
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_kernel_step_carries_the_windows_and_head_dim_256_runs_the_kernels(kernels):
    assert 256 in kernels.head_dims
    h = 4
    step = _case(h, 1, 256, "mixed", torch.float32)
    _, attn = run_backend(torch_backend(h, kernels), step, WINDOWS, 16)
    assert attn.kernels is not None and attn.kernel_step().windows == WINDOWS
    _, attn = run_backend(torch_backend(h, kernels), step, (0,) * len(WINDOWS), 16)
    assert attn.windows == () and attn.kernel_step().windows == ()


def test_windows_must_name_every_layer():
    cache = torch.zeros(4, 3, 2, 2, 16, 64)
    with pytest.raises(ValueError, match="2 sliding windows for a cache of 3 layers"):
        TorchAttention(cache, 4, 0.125, windows=(0, 512))
    with pytest.raises(ValueError, match=">= 0"):
        TorchAttention(cache, 4, 0.125, windows=(0, -1, 4))
    assert TorchAttention(cache, 4, 0.125, windows=(None, 512, 0)).windows == (0, 512, 0)


@pytest.mark.parametrize("window", [1, 2, 5])
def test_the_flash_reference_window_is_upstreams(window):
    """window_size=(w - 1, 0), causal, bottom-right aligned: the naive oracle's window of w keys; and
    without causal, (left, right) bounds both sides."""
    torch.manual_seed(window)
    ref = FlashReference(allow_fp32=True)
    q, k, v = torch.randn(6, 4, 16), torch.randn(9, 2, 16), torch.randn(9, 2, 16)
    cu_q, cu_k = torch.tensor([0, 6], dtype=torch.int32), torch.tensor([0, 9], dtype=torch.int32)
    out = ref.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 9, causal=True, window_size=(window - 1, 0))
    torch.testing.assert_close(out.double(), naive_attention(q, k, v, window=window), atol=1e-5, rtol=1e-5)
    both = ref.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 9, window_size=(1, 1))
    for i in range(6):  # query i's diagonal key is i + 3: keys i + 2 .. i + 4
        lo, hi = i + 2, min(i + 4, 8)
        want = naive_attention(q[i:i + 1], k[lo:hi + 1], v[lo:hi + 1], causal=False)
        torch.testing.assert_close(both[i:i + 1].double(), want, atol=1e-5, rtol=1e-5)
