"""One-command check of nanoserve's CUDA path on one GPU (H100/H200 class), no internet, < 8 min.

    python bench/gpu_check.py                   # correctness + speed, JSON to gpu_check.json
    python bench/gpu_check.py --cpu-smoke       # the same code paths on tiny shapes, on CPU

Sections
  correctness  a small random-weight Llama (LlamaConfig + save_pretrained, the tokenizer copied from
               the embedded SmolLM2 package, so nothing is downloaded), nanoserve vs HF transformers
               on the same device: exact greedy tokens in fp32 with the torch backend; with flash
               (flash_attn when it imports, else the pure-torch reference, said so) in bf16: prompt
               (prefill, varlen) and generated (decode, graphed) token logprobs teacher-forced
               against HF fp32, within a bf16 tolerance.
  speed        Llama-3-8B-shaped model with random bf16 weights made on the GPU (--load-format
               dummy): decode output tok/s at batch 1/32/128 graphed and eager, against the HBM
               roofline from a measured device copy bandwidth; prefill tok/s; share of decode
               steps that ran graphed. Without flash_attn: torch backend, eager only (graphs need
               the flash backend), and the JSON says what was skipped.
  (host tier)  bench/gpu_tier_check.py: exact device<->host round trip, tier copy GB/s vs a raw
               pinned copy, TTFT of 2k/8k/32k prefixes as device hit / host hit / recompute,
               others' decode rate during a host load, tier on vs off at 0% reuse.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nanoserve import LLM, SamplingParams  # noqa: E402
from nanoserve.layers.flash_attention import import_flash_attn  # noqa: E402
from nanoserve.layers.flash_ref import FlashReference  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_tier_check  # noqa: E402

GiB = 1 << 30


@dataclass
class Shapes:
    """Model shapes and workload sizes: real ones on a GPU, tiny ones for --cpu-smoke."""
    small: dict
    big: dict
    batches: tuple[int, ...]
    prompt_len: int
    decode_steps: int
    prefill_len: int
    prefill_seqs: int
    kv_cache_gb: float


GPU = Shapes(small=dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                        num_key_value_heads=2),
             big=dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192),
             batches=(1, 32, 128), prompt_len=512, decode_steps=64, prefill_len=2048, prefill_seqs=8,
             kv_cache_gb=40.0)
CPU_SMOKE = Shapes(small=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2),
                   big=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=1024, max_position_embeddings=1024),
                   batches=(1, 4), prompt_len=32, decode_steps=8, prefill_len=64, prefill_seqs=2, kv_cache_gb=0.05)


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def free() -> None:
    """Callers `del` their references first; this returns the memory."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def write_model(out: Path, overrides: dict, with_weights: bool) -> Path:
    """A Llama folder: config, the embedded model's tokenizer, and (small model) random fp32 weights."""
    import transformers
    from transformers import AutoTokenizer
    from nanoserve.models.loader import embedded_source, materialize
    tok = AutoTokenizer.from_pretrained(materialize(embedded_source()).path)
    kw = dict(vocab_size=len(tok), max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
              bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    cfg = transformers.LlamaConfig(**{**kw, **overrides})
    if with_weights:
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg).float()
        with torch.no_grad():  # larger than the default init: peaked logits, no greedy ties
            for name, p in model.named_parameters():
                if "norm" not in name:
                    p.normal_(0, 0.08 if p.dim() == 2 else 0.05)
        model.save_pretrained(out)
    else:
        cfg.save_pretrained(out)
    tok.save_pretrained(out)
    return out


# ---- correctness --------------------------------------------------------------------------------
def correctness(shapes: Shapes, device: str, flash, flash_name: str, tmp: Path) -> dict:
    from transformers import AutoModelForCausalLM
    path = write_model(tmp / "small", shapes.small, with_weights=True)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (5, 37, 300, 600)]
    new = 16
    expected = []
    with torch.no_grad():
        for p in prompts:  # HF greedy, recomputed from scratch each token
            ids = list(p)
            for _ in range(new):
                ids.append(int(hf(torch.tensor([ids], device=device)).logits[0, -1].argmax()))
            expected.append(ids[len(p):])
    greedy = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    res: dict = {}
    llm = LLM(str(path), device=device, dtype="float32", attention_backend="torch", num_kv_blocks=64, block_size=16)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    res["torch_fp32_greedy_exact"] = got == expected
    log(f"torch backend fp32 greedy == HF: {res['torch_fp32_greedy_exact']}")
    del llm
    free()
    # flash in bf16: teacher-forced logprobs of prompt tokens (prefill) and of generated ones (decode)
    llm = LLM(str(path), device=device, dtype="bfloat16", attention_backend="flash", flash_module=flash,
              num_kv_blocks=16)
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    outs = llm.generate(prompts, params)
    worst, agree = 0.0, 0
    with torch.no_grad():
        for p, o, want in zip(prompts, outs, expected):
            seq = p + o.outputs[0].token_ids
            lp = torch.log_softmax(hf(torch.tensor([seq], device=device)).logits[0].float(), -1)
            ours = [x.logprob for x in o.prompt_logprobs[1:]] + [x.logprob for x in o.outputs[0].logprobs]
            ref = [float(lp[i - 1, seq[i]]) for i in range(1, len(seq))]
            worst = max(worst, max(abs(a - b) for a, b in zip(ours, ref)))
            agree += sum(a == b for a, b in zip(o.outputs[0].token_ids, want))
    runner = llm.engine.runner
    res.update(flash_impl=flash_name, flash_bf16_max_logprob_err=worst, flash_bf16_logprob_ok=worst < 0.1,
               flash_bf16_greedy_agreement=agree / (new * len(prompts)),
               flash_decode_steps_graphed=runner.steps_graphed, flash_steps_eager=runner.steps_eager)
    log(f"flash ({flash_name}) bf16: max |logprob - HF fp32| = {worst:.4f} (ok < 0.1: {worst < 0.1}), "
        f"greedy agreement {res['flash_bf16_greedy_agreement']:.2f}, graphed decode steps {runner.steps_graphed}")
    del llm, hf, runner
    free()
    return res


# ---- speed --------------------------------------------------------------------------------------
def copy_bandwidth(device: str) -> float:
    """Bytes/s of a large device-to-device copy (read + write counted)."""
    n = (4 * GiB if device == "cuda" else 256 << 20) // 2
    x = torch.empty(n, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    for _ in range(2):
        y.copy_(x)
    sync(device)
    t0 = time.perf_counter()
    reps = 10
    for _ in range(reps):
        y.copy_(x)
    sync(device)
    bw = 2 * x.numel() * x.element_size() * reps / (time.perf_counter() - t0)
    del x, y
    free()
    return bw


def decode_rate(llm: LLM, batch: int, shapes: Shapes) -> dict:
    """Prefill `batch` prompts, then time `decode_steps` pure-decode steps."""
    eng = llm.engine
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        eng.add_request(f"d{batch}-{i}", torch.randint(100, 1000, (shapes.prompt_len,), generator=g).tolist(),
                        SamplingParams(temperature=0, max_tokens=shapes.decode_steps + 2, ignore_eos=True))
    while any(len(s.token_ids) == s.num_prompt_tokens for s in eng.scheduler.running + list(eng.scheduler.waiting)):
        eng.step()
    r = eng.runner
    g0, e0 = r.steps_graphed, r.steps_eager
    t0 = time.perf_counter()
    for _ in range(shapes.decode_steps):
        eng.step()  # the sampler syncs every step
    el = time.perf_counter() - t0
    while eng.has_unfinished():
        eng.step()
    graphed = r.steps_graphed - g0
    return dict(batch=batch, tok_s=batch * shapes.decode_steps / el, step_ms=1000 * el / shapes.decode_steps,
                graphed_share=graphed / max(graphed + r.steps_eager - e0, 1))


def prefill_rate(llm: LLM, shapes: Shapes) -> float:
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(100, 1000, (shapes.prefill_len,), generator=g).tolist() for _ in range(shapes.prefill_seqs)]
    p = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate(prompts[:1], p)  # warm-up
    t0 = time.perf_counter()
    llm.generate(prompts, p)
    return shapes.prefill_len * shapes.prefill_seqs / (time.perf_counter() - t0)


def speed(shapes: Shapes, device: str, flash, flash_name: str, tmp: Path) -> dict:
    path = write_model(tmp / "big", shapes.big, with_weights=False)
    bw = copy_bandwidth(device)
    res: dict = dict(copy_bandwidth_gb_s=bw / 1e9, skipped=[])
    log(f"device copy bandwidth {bw / 1e9:.0f} GB/s")
    modes = [("graphed", False), ("eager", True)] if flash is not None and device == "cuda" else [("eager", True)]
    if len(modes) == 1:
        res["skipped"].append("CUDA graphs (need the flash backend on CUDA)")
    for mode, eager in modes:
        kw = dict(attention_backend="flash", flash_module=flash) if flash is not None else dict(attention_backend="torch")
        t0 = time.perf_counter()
        llm = LLM(str(path), device=device, dtype="bfloat16", load_format="dummy", enforce_eager=eager,
                  kv_cache_gb=shapes.kv_cache_gb, max_num_seqs=max(shapes.batches),
                  max_num_batched_tokens=max(shapes.prefill_len, 2048), enable_prefix_caching=False, **kw)
        log(f"{mode}: engine up in {time.perf_counter() - t0:.1f}s ({type(llm.engine.runner.attn).__name__})")
        m = llm.engine.model
        weight_bytes = sum(p.numel() * p.element_size() for p in m.parameters())
        kv_tok_bytes = llm.engine.layout.bytes_per_block // llm.engine.layout.block_size
        rows = []
        for b in shapes.batches:
            r = decode_rate(llm, b, shapes)
            ctx = shapes.prompt_len + shapes.decode_steps // 2
            r["roofline_tok_s"] = b * bw / (weight_bytes + b * ctx * kv_tok_bytes)
            r["of_roofline"] = r["tok_s"] / r["roofline_tok_s"]
            rows.append(r)
            log(f"{mode} decode batch {b}: {r['tok_s']:.0f} tok/s ({r['of_roofline']:.0%} of roofline "
                f"{r['roofline_tok_s']:.0f}), graphed share {r['graphed_share']:.0%}")
        res[mode] = dict(decode=rows, prefill_tok_s=prefill_rate(llm, shapes))
        log(f"{mode} prefill: {res[mode]['prefill_tok_s']:.0f} tok/s")
        del llm, m
        free()
    return res


# Host-tier sections (bench/gpu_tier_check.py), each (shapes, device, flash, flash_name, tmp) -> dict;
# main() runs them in order after correctness and speed.
HOST_TIER_SECTIONS: list = gpu_tier_check.SECTIONS


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU: exercises every code path here")
    ap.add_argument("--out", default="gpu_check.json", help="JSON results file")
    ap.add_argument("--skip", action="append", default=[],
                    choices=["correctness", "speed"] + [f.__name__ for f in gpu_tier_check.SECTIONS],
                    help="skip a section (repeatable)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.cpu_smoke:
        device, shapes = "cpu", CPU_SMOKE
    elif torch.cuda.is_available():
        device, shapes = "cuda", GPU
    else:
        print("no CUDA device: run with --cpu-smoke for the CPU smoke test", file=sys.stderr)
        return 2
    module = import_flash_attn()
    flash, flash_name = (module, f"flash_attn {getattr(module, '__version__', '?')}") if module else \
        (FlashReference(), "pure-torch reference (flash_attn not importable)")
    result: dict = dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
                        torch=torch.__version__, flash=flash_name, skipped=[])
    if module is None:
        result["skipped"].append("flash_attn kernels (not importable): flash correctness ran the reference; "
                                 "speed uses the torch backend, eager")
    log(f"device {result['device']}, torch {torch.__version__}, flash: {flash_name}")
    sections = [("correctness", lambda t: correctness(shapes, device, flash, flash_name, t)),
                ("speed", lambda t: speed(shapes, device, module, flash_name, t))]
    sections += [(f.__name__, lambda t, f=f: f(shapes, device, module, flash_name, t)) for f in HOST_TIER_SECTIONS]
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for name, run in sections:
            if name in args.skip:
                result["skipped"].append(f"section {name} (--skip)")
                continue
            t0 = time.perf_counter()
            try:  # one section failing must not cost the others' results on a scarce GPU
                result[name] = run(Path(tmp))
            except Exception as e:
                traceback.print_exc()
                result[name] = {"error": f"{type(e).__name__}: {e}"}
                result.setdefault("failed_sections", []).append(name)
            result[name]["seconds"] = time.perf_counter() - t0
            Path(args.out).write_text(json.dumps(result, indent=1))  # partial results survive a timeout
    result["seconds"] = time.perf_counter() - t_all
    Path(args.out).write_text(json.dumps(result, indent=1))
    print_table(result)
    ok = result.get("correctness", {}).get("torch_fp32_greedy_exact", True) and \
        result.get("correctness", {}).get("flash_bf16_logprob_ok", True) and not result.get("failed_sections")
    print(f"results in {args.out}; correctness {'OK' if ok else 'FAILED'}; took {result['seconds']:.0f}s")
    return 0 if ok else 1


def print_table(r: dict) -> None:
    print(f"\n{'mode':8} {'batch':>5} {'tok/s':>9} {'roofline':>9} {'of roof':>8} {'graphed':>8}")
    for mode in ("graphed", "eager"):
        for row in r.get("speed", {}).get(mode, {}).get("decode", []):
            print(f"{mode:8} {row['batch']:>5} {row['tok_s']:>9.0f} {row['roofline_tok_s']:>9.0f} "
                  f"{row['of_roofline']:>8.0%} {row['graphed_share']:>8.0%}")
        if mode in r.get("speed", {}):
            print(f"{mode:8} prefill {r['speed'][mode]['prefill_tok_s']:.0f} tok/s")
    for s in r["skipped"] + r.get("speed", {}).get("skipped", []):
        print(f"skipped: {s}")


if __name__ == "__main__":
    sys.exit(main())
