"""Host-tier measurements for bench/gpu_check.py (issue 8). Each section has gpu_check's signature
(shapes, device, flash, flash_name, tmp) -> dict; `SECTIONS` lists them in order, so gpu_check can
set `HOST_TIER_SECTIONS = gpu_tier_check.SECTIONS`. `run(report)` runs them all on their own.

  tier_round_trip   random blocks device -> host -> device through HostTier, every element compared
  tier_bandwidth    host<->device GB/s through HostTier (per-block copies on the copy stream) vs one
                    raw pinned copy of the same bytes
  tier_ttft         TTFT of a 2k / 8k / 32k-token prefix as a device hit, a host hit and a recompute
                    (Llama-3-8B-shaped, random bf16 weights)
  tier_overlap      other requests' decode steps/s while a long host load is in flight vs without
  tier_noreuse      output throughput with the host tier on vs off when nothing is reused
"""
from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nanoserve import LLM, SamplingParams  # noqa: E402
from nanoserve.kvcache.host_tier import HostTier  # noqa: E402

GiB = 1 << 30


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _smoke(device: str) -> bool:
    return device != "cuda"


def _llm(shapes, device: str, flash, tmp: Path, max_len: int, **kw) -> LLM:
    from bench.gpu_check import write_model  # late: gpu_check imports this module
    path = tmp / f"tier-big-{max_len}"
    if not path.exists():
        write_model(path, {**shapes.big, "max_position_embeddings": max_len}, with_weights=False)
    backend = dict(attention_backend="flash", flash_module=flash) if flash is not None else dict(attention_backend="torch")
    return LLM(str(path), device=device, dtype="bfloat16", load_format="dummy", **backend, **kw)


def tier_round_trip(shapes, device, flash, flash_name, tmp) -> dict:
    from tests.test_transfer import check_round_trip
    moved = 0
    for dtype in (torch.float32, torch.bfloat16):
        moved += check_round_trip(device, dtype, num_blocks=64)
    return dict(exact=True, bytes_each_way=moved)


def tier_bandwidth(shapes, device, flash, flash_name, tmp) -> dict:
    """Llama-3-8B block (32 layers x K/V x 256 tokens x 8 heads x 128, bf16 = 32 MiB)."""
    n, shape = (64, (32, 2, 256, 8, 128)) if not _smoke(device) else (8, (2, 2, 16, 2, 64))
    cache = torch.randn((n, *shape), dtype=torch.bfloat16, device=device)
    tier = HostTier(n, cache)
    nbytes = n * tier.block_bytes
    ids = list(range(n))
    res = {}
    for name, fn in (("save", lambda: tier.save([(b, bytes([b]) * 32, (None, (b,))) for b in ids])),
                     ("load", lambda: tier.load([tier.lookup(bytes([b]) * 32, (None, (b,))) for b in ids], ids))):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        res[f"tier_{name}_gb_s"] = nbytes / (time.perf_counter() - t0) / 1e9
    raw = torch.empty((n, *shape), dtype=torch.bfloat16, pin_memory=device == "cuda")
    for name, (dst, src) in (("d2h", (raw, cache)), ("h2d", (cache, raw))):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        _sync(device)
        res[f"raw_{name}_gb_s"] = nbytes / (time.perf_counter() - t0) / 1e9
    res["tier_vs_raw_save"] = res["tier_save_gb_s"] / res["raw_d2h_gb_s"]
    res["tier_vs_raw_load"] = res["tier_load_gb_s"] / res["raw_h2d_gb_s"]
    return res


def _ttft(llm: LLM, prompt: list[int]) -> tuple[float, int, int]:
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))[0]
    return (out.metrics["first_token"] - out.metrics["arrival"],
            out.num_device_cached_tokens, out.num_host_cached_tokens)


def _push_to_host(llm: LLM) -> None:
    """Save every cached device block to host and forget the device copies."""
    kv = llm.engine.kv
    kv.offload_watermark, saved = kv.num_blocks, kv.offload_watermark
    while kv.offload_cold_blocks():
        kv.drain_transfers()
    kv.drain_transfers()
    kv.offload_watermark = saved
    kv.pool.reset_cache()


def tier_ttft(shapes, device, flash, flash_name, tmp) -> dict:
    lens = (2048, 8192, 32768) if not _smoke(device) else (64, 128, 256)
    llm = _llm(shapes, device, flash, tmp, max_len=max(lens) + 512,
               kv_cache_gb=shapes.kv_cache_gb if not _smoke(device) else 0.05,
               host_cache_gb=12 if not _smoke(device) else 0.05, max_num_seqs=4,
               max_num_batched_tokens=8192 if not _smoke(device) else 64)
    vocab = llm.engine.model.vocab_size
    rng = random.Random(0)
    rows = []
    _ttft(llm, [rng.randrange(100, vocab) for _ in range(64)])  # warm-up
    for n in lens:
        doc = [rng.randrange(100, vocab) for _ in range(n)]
        recompute, _, _ = _ttft(llm, doc + [1])
        device_hit, dc, _ = _ttft(llm, doc + [2])
        _push_to_host(llm)
        host_hit, _, hc = _ttft(llm, doc + [3])
        rows.append(dict(prefix=n, recompute_ms=recompute * 1e3, device_hit_ms=device_hit * 1e3,
                         host_hit_ms=host_hit * 1e3, device_cached=dc, host_cached=hc))
    del llm
    return dict(rows=rows)


def tier_overlap(shapes, device, flash, flash_name, tmp) -> dict:
    """16 requests decode; a long prefix is loaded from host meanwhile (several times)."""
    n_doc = 32768 if not _smoke(device) else 256
    llm = _llm(shapes, device, flash, tmp, max_len=n_doc + 512,
               kv_cache_gb=shapes.kv_cache_gb if not _smoke(device) else 0.05,
               host_cache_gb=12 if not _smoke(device) else 0.05, max_num_seqs=32,
               max_num_batched_tokens=8192 if not _smoke(device) else 64)
    eng, vocab = llm.engine, llm.engine.model.vocab_size
    rng = random.Random(1)
    doc = [rng.randrange(100, vocab) for _ in range(n_doc)]
    llm.generate([doc + [1]], SamplingParams(temperature=0, max_tokens=1))
    stats = {"loading": [0, 0.0], "none": [0, 0.0]}
    for i in range(16):
        eng.add_request(f"d{i}", [rng.randrange(100, vocab) for _ in range(32)],
                        SamplingParams(temperature=0, max_tokens=10_000 if not _smoke(device) else 200,
                                       ignore_eos=True))
    for _ in range(3):
        eng.step()  # prefills
    for k in range(4):
        _push_to_host(llm)
        eng.add_request(f"loader{k}", doc + [k + 2], SamplingParams(temperature=0, max_tokens=1))
        for _ in range(30):
            _sync(device)
            t0 = time.perf_counter()
            decoding = sum(1 for s in eng.scheduler.running if s.prompt_done)
            eng.step()
            _sync(device)
            row = stats["loading" if eng.scheduler.loading else "none"]
            row[0] += 1
            row[1] += time.perf_counter() - t0
            assert decoding
    for i in range(16):
        eng.abort(f"d{i}")
    while eng.has_unfinished():
        eng.step()
    res = {f"{k}_steps": v[0] for k, v in stats.items()}
    res.update({f"{k}_steps_per_s": v[0] / v[1] for k, v in stats.items() if v[0]})
    del llm, eng
    return res


def tier_noreuse(shapes, device, flash, flash_name, tmp) -> dict:
    """Same unique prompts through two engines (tier off / on), rounds alternated."""
    n_req, p_len, o_len = (64, 1024, 64) if not _smoke(device) else (4, 64, 8)
    kw = dict(kv_cache_gb=shapes.kv_cache_gb / 2 if not _smoke(device) else 0.02, max_num_seqs=32,
              max_num_batched_tokens=8192 if not _smoke(device) else 64)
    llms = {"off": _llm(shapes, device, flash, tmp, 2048, **kw),
            "on": _llm(shapes, device, flash, tmp, 2048, host_cache_gb=8 if not _smoke(device) else 0.02, **kw)}
    vocab = llms["off"].engine.model.vocab_size
    params = SamplingParams(temperature=0, max_tokens=o_len, ignore_eos=True)
    times: dict[str, list[float]] = {"off": [], "on": []}
    for rnd in range(3):
        rng = random.Random(100 + rnd)
        prompts = [[rng.randrange(100, vocab) for _ in range(p_len)] for _ in range(n_req)]
        for name, llm in llms.items():
            _sync(device)
            t0 = time.perf_counter()
            llm.generate(prompts, params)
            _sync(device)
            times[name].append(time.perf_counter() - t0)
    ratios = sorted(off / on for off, on in zip(times["off"], times["on"]))
    del llms
    return dict(output_tok_s_off=n_req * o_len / min(times["off"]), output_tok_s_on=n_req * o_len / min(times["on"]),
                ratio_on_over_off_median=ratios[len(ratios) // 2], ratios=ratios)


SECTIONS = [tier_round_trip, tier_bandwidth, tier_ttft, tier_overlap, tier_noreuse]


def run(report: dict) -> None:
    """Run every section on CUDA (or tiny shapes on CPU when there is none) into `report`."""
    import tempfile
    from bench.gpu_check import CPU_SMOKE, GPU
    from nanoserve.layers.flash_attention import import_flash_attn
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = GPU if device == "cuda" else CPU_SMOKE
    flash = import_flash_attn()
    with tempfile.TemporaryDirectory() as tmp:
        for f in SECTIONS:
            t0 = time.perf_counter()
            try:
                report[f.__name__] = f(shapes, device, flash, None, Path(tmp))
            except Exception as e:  # one failed section must not hide the others' numbers
                report[f.__name__] = dict(error=f"{type(e).__name__}: {e}")
            report[f.__name__]["seconds"] = time.perf_counter() - t0
            print(f.__name__, report[f.__name__], flush=True)


if __name__ == "__main__":
    out: dict = {}
    run(out)
