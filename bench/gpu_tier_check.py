"""Host-tier measurements for bench/gpu_check.py. Each section is
`(shapes, device, kw, tmp, put, write_model)`: `kw` picks the attention backend, `put(key, value)`
records a sub-result at once, `write_model(path, overrides, with_weights)` writes a random Llama.

  tier_round_trip   random blocks device -> host -> device through HostTier, every element compared
  tier_bandwidth    host<->device GB/s through HostTier (per-block copies on the copy stream) vs one
                    raw pinned copy of the same bytes
  tier_ttft         TTFT of an 8k / 32k-token prompt as a recompute, a device hit and a host hit
                    (Llama-3-8B-shaped, random bf16 weights), the three outputs compared
  tier_overlap      other requests' decode steps/s while a long host load is in flight vs without
  tier_noreuse      output throughput with the host tier on vs off when nothing is reused
Needs no test code (pytest, hypothesis) on the device.
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


def _llm(shapes, device: str, kw: dict, tmp: Path, write_model, max_len: int, **engine_kw) -> LLM:
    path = write_model(tmp / f"tier-big-{max_len}", {**shapes.big, "max_position_embeddings": max_len},
                       with_weights=False)
    return LLM(str(path), device=device, dtype="bfloat16", load_format="dummy", **kw, **engine_kw)


def check_round_trip(device: str, dtype: torch.dtype, num_blocks: int = 16,
                     block_shape: tuple[int, ...] = (4, 2, 8, 16, 64), seed: int = 0) -> int:
    """Save random blocks to host through the tier and load them back into other device blocks;
    every element must match and no other block may change. Returns the bytes moved each way.
    Lives here so the device needs no test code; tests/test_transfer.py runs it on CPU."""
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn((num_blocks, *block_shape), generator=g).to(dtype).to(device)
    original = cache.clone()
    tier = HostTier(num_blocks, cache)
    half = num_blocks // 2
    src = random.Random(seed).sample(range(num_blocks), half)
    if tier.save([(b, bytes([i]) * 32, (None, (i,))) for i, b in enumerate(src)]) != half:
        raise AssertionError("not every block was saved")
    host_ids = [tier.lookup(bytes([i]) * 32, (None, (i,))) for i in range(half)]
    for i, b in enumerate(src):
        if not torch.equal(tier.cache[host_ids[i]], original[b].cpu()):
            raise AssertionError(f"save of block {b} differs")
    dst = [b for b in range(num_blocks) if b not in src]
    cache[dst] = 0
    if not tier.load(host_ids, dst):
        raise AssertionError("load refused")
    for i, b in enumerate(src):
        if not torch.equal(cache[dst[i]], original[b]):
            raise AssertionError(f"load into block {dst[i]} differs")
        if not torch.equal(cache[b], original[b]):
            raise AssertionError(f"block {b} changed")
    return half * tier.block_bytes


def tier_round_trip(shapes, device, kw, tmp, put, write_model) -> None:
    moved = 0
    for dtype in (torch.float32, torch.bfloat16):
        moved += check_round_trip(device, dtype, num_blocks=64)
        put(f"exact_{str(dtype).removeprefix('torch.')}", True)
    put("exact", True)
    put("bytes_each_way", moved)


def tier_bandwidth(shapes, device, kw, tmp, put, write_model) -> None:
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
    for k, v in res.items():
        put(k, v)


def _first(llm: LLM, prompt: list[int]) -> dict:
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0))[0]
    c = out.outputs[0]
    return dict(ttft=out.metrics["first_token"] - out.metrics["arrival"], tokens=c.token_ids,
                logprobs=[x.logprob for x in c.logprobs], device_cached=out.num_device_cached_tokens,
                host_cached=out.num_host_cached_tokens)


def forget_device_cache(pool) -> None:
    """Unpublish every cached-free device block: a prefix saved to host is then on host only."""
    for block in pool.lru():
        pool.unpublish(block)


def _push_to_host(llm: LLM) -> None:
    """Save every cached device block to host and forget the device copies."""
    kv = llm.engine.kv
    kv.offload_watermark, saved = kv.num_blocks, kv.offload_watermark
    while kv.offload_cold_blocks():
        kv.drain_transfers()
    kv.drain_transfers()
    kv.offload_watermark = saved
    forget_device_cache(kv.pool)


def tier_ttft(shapes, device, kw, tmp, put, write_model) -> None:
    """The same prompt three times: computed from scratch (its non-final chunks sample nothing),
    from the device prefix cache, then, after every block went to host, from the host tier. KV
    moved exactly gives the same tokens; the logprob gap says how close the recomputed suffix is."""
    lens = shapes.ttft_lens
    llm = _llm(shapes, device, kw, tmp, write_model, max_len=max(lens) + 512,
               kv_cache_gb=shapes.kv_cache_gb if not _smoke(device) else 0.05,
               host_cache_gb=12 if not _smoke(device) else 0.05, max_num_seqs=4,
               max_num_batched_tokens=shapes.tier_batched)
    vocab = llm.engine.model.vocab_size
    rng = random.Random(0)
    _first(llm, [rng.randrange(3, vocab) for _ in range(64)])  # warm-up
    rows = []
    for n in lens:
        prompt = [rng.randrange(3, vocab) for _ in range(n)] + [7]
        recompute = _first(llm, prompt)
        device_hit = _first(llm, prompt)
        _push_to_host(llm)
        host_hit = _first(llm, prompt)
        gap = max(abs(a - b) for r in (device_hit, host_hit) for a, b in zip(r["logprobs"], recompute["logprobs"]))
        rows.append(dict(prefix=n, recompute_ms=recompute["ttft"] * 1e3, device_hit_ms=device_hit["ttft"] * 1e3,
                         host_hit_ms=host_hit["ttft"] * 1e3, device_cached=device_hit["device_cached"],
                         host_cached=host_hit["host_cached"], max_logprob_gap=gap,
                         outputs_match=recompute["tokens"] == device_hit["tokens"] == host_hit["tokens"]
                         and device_hit["device_cached"] > 0 and host_hit["host_cached"] > 0))
        put("rows", rows)
    del llm


def tier_overlap(shapes, device, kw, tmp, put, write_model) -> None:
    """16 requests decode; a long prefix is loaded from host meanwhile (several times)."""
    n_doc = max(shapes.ttft_lens)
    llm = _llm(shapes, device, kw, tmp, write_model, max_len=n_doc + 512,
               kv_cache_gb=shapes.kv_cache_gb if not _smoke(device) else 0.05,
               host_cache_gb=12 if not _smoke(device) else 0.05, max_num_seqs=32,
               max_num_batched_tokens=shapes.tier_batched)
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
    for k, v in res.items():
        put(k, v)
    del llm, eng


def tier_noreuse(shapes, device, kw, tmp, put, write_model) -> None:
    """Same unique prompts through two engines (tier off / on), rounds alternated."""
    n_req, p_len, o_len = (64, 1024, 64) if not _smoke(device) else (4, 64, 8)
    ekw = dict(kv_cache_gb=shapes.kv_cache_gb / 2 if not _smoke(device) else 0.02, max_num_seqs=32,
              max_num_batched_tokens=shapes.tier_batched)
    llms = {"off": _llm(shapes, device, kw, tmp, write_model, 2048, **ekw),
            "on": _llm(shapes, device, kw, tmp, write_model, 2048, host_cache_gb=8 if not _smoke(device) else 0.02,
                       **ekw)}
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
            put(f"seconds_{name}", times[name])
    ratios = sorted(off / on for off, on in zip(times["off"], times["on"]))
    del llms
    put("output_tok_s_off", n_req * o_len / min(times["off"]))
    put("output_tok_s_on", n_req * o_len / min(times["on"]))
    put("ratio_on_over_off_median", ratios[len(ratios) // 2])


SECTIONS = [tier_round_trip, tier_ttft, tier_bandwidth, tier_overlap, tier_noreuse]  # run: python bench/gpu_check.py
