"""Latency of the offline engine: cold TTFT at given prompt lengths, and the decode step at given
batch sizes and context lengths; optionally against vLLM-CPU or another checkout, and where the
time goes inside nanoserve's forward pass.

    python bench/latency.py --ttft-lens 1024,4000 --decode-batch 8,32 --decode-ctx 256
    python bench/latency.py --threads 1 --peer vllm --runs 3      # per core, against vLLM-CPU
    python bench/latency.py --threads 2 --base /tmp/base --decode-batch ''   # A/B of cold TTFT
    python bench/latency.py --threads 1 --breakdown --decode-batch ''        # where a prefill's time goes
    python bench/latency.py --one-ahead --base /tmp/base --ttft-lens '' --decode-batch 1,32
        # serial (CPU's default) vs one step ahead vs another checkout: decode tok/s, forward busy, host gap
    python bench/latency.py --load-stages --kv-cache-gb 0.25     # an engine's memory, stage by stage
    python bench/latency.py --tp-wire --decode-batch 1,32    # a tensor-parallel step message's codec
    python bench/latency.py --vs-dequantized --threads 2 --decode-batch 1 --ttft-lens 256 --offline 16 \
        --llama-server /tmp/llamacpp/build/bin/llama-server
        # a GGUF served from its blocks vs --gguf-dequantize vs llama.cpp's server, memory and bandwidth

Cold TTFT: one fresh prompt (random token ids, no prefix any side has seen) with max_tokens=1, timed
around generate; median of --prompts prompts per length and run. Decode step: --decode-steps K; the
time of generating a batch of fresh prompts with max_tokens 1+K minus that of another batch of the
same shape with max_tokens 1, over K: one decode step at context ctx..ctx+K, measured the same way
from outside any engine; the max_tokens=1 run is also reported (prefill of the batch + first token).
Runs alternate the sides (A B, B A, ...); every side gets the same prompts in a run; medians of --runs.

--threads N: N compute threads pinned to the last N cores (where vLLM's CPU binding puts its
worker, keeping the first for its scheduler); default: torch's own. vLLM-CPU keeps its own binding
(bench/peers.py, --vllm-cores). --base: every run of either side is a fresh process of this script
with that checkout's nanoserve; --one-ahead: a side of this checkout with NANOSERVE_ASYNC_SCHEDULING=1
(on CPU the default is serial), so that --one-ahead --base gives the three side by side. Decode rows
also give tok/s, the forwards' busy time per step (the step pipeline's clock around each forward:
embedding, the C++ layer loop, the LM head; a checkout without one shows none) and the host gap, the
step's share outside any forward. --breakdown: every call of each part of nanoserve's forward pass is
timed (the linear layers by projection, norms, RoPE, KV write, attention, all-reduce: by the C++
layer loop itself; the LM head; the rest is the model's Python, batch building, scheduling and sampling).
--tp-wire: encode + decode of the decode step that rank 0 sends to the other tensor-parallel ranks
(a batch of rows 16 blocks past --decode-ctx each), with the typed codec and with pickle (the
yardstick), median of 20,000; no model is loaded.
--vs-dequantized: the same GGUF (--model, default the embedded Q4_1 file) served from its blocks (the
default) and with --gguf-dequantize, each run of each side a fresh process (cold TTFT, a clean resident
set); also per side: resident memory (VmRSS after the run), the model's weight bytes, load time, and
with --offline N the output tok/s of N prompts of 128 tokens x 64 new ones in one generate call; the
machine's memory bandwidth (a 1 GiB torch copy on the same threads, best of 5, read + write bytes)
before the runs, and per batch-1 decode: weight bytes x tok/s / bandwidth. Batch-1 decode tok/s is
the one request's tokens after the first over the time from its first to its last token (nanoserve:
the engine steps that made them, stamped in-process; no prefill in it, unlike the decode step's
difference of two runs, which a loaded machine's prefill noise swamps), with K = --decode-steps.
With a llama-server binary (--llama-server PATH or $LLAMA_SERVER; the column is skipped with a note
when there is none, or when --model is not a .gguf file) llama.cpp is a third side on the same file
(peers.py's LlamaServerSide): a fresh server per run, -t/-tb = --threads on the cores this process is pinned
to, as many KV tokens as nanoserve's --kv-cache-gb holds (one unified buffer, slots for the largest
batch), its host prompt cache off; every prompt is a /completion request of token ids with
ignore_eos, n_predict and cache_prompt false, all sent at once, timed at the client: the same
measurements over HTTP (about 1 ms of localhost round trip in each TTFT, cancelled in the decode
step's difference); its batch-1 request is streamed and timed from the first to the last token as it
arrives (its own timings.predicted_per_token_ms is printed beside the table as a check); resident
memory is the VmRSS of its process group, CPU time the group's from /proc, weights the file's tensor
bytes (memory-mapped as nanoserve's are), load the time from its start to /health answering (it
includes the process start; nanoserve's load is the LLM() constructor in an imported process).
--write-gguf FILE writes a random-weight Llama GGUF (--gguf-size 1b|135m, --gguf-type
Q4_0|Q4_1|Q8_0|Q4_K_M) to serve with --model and exits.
--load-stages: where an engine's resident memory goes, stage by stage (/proc/self/smaps_rollup: Rss,
its anonymous part, the rest file-backed: shared libraries, memory-mapped weights) while an offline
engine loads (the engine process of a server loads the same way, but never loads the transformers
tokenizer the offline LLM loads for its first generate), then after a batch-1 and a batch-8 generate,
then after llguidance's view of the vocabulary, which an engine builds on its first constrained
request; with --gguf-dequantize for the dequantized model. The whole server's memory, side by side
with others: serve.py --memory.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from common import (ROOT, OtherTree, alternate, auto_dtype, child_argv, comparison_table, cpu_name,
                    embedded_gguf, random_kquant, token_prompts, write_json)
from peers import LlamaServerSide, VllmOffline, add_peer_args, find_llama_server, peer_config


def timed(fn, acc: dict[str, float], label: str):
    def wrapper(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            acc[label] += time.perf_counter() - t
    return wrapper


class Timed:
    """Proxy for an object whose listed methods add their time to `acc[label]`."""

    def __init__(self, target, acc: dict[str, float], labels: dict[str, str]) -> None:
        self._target, self._acc, self._labels = target, acc, labels

    def __getattr__(self, name: str):
        fn = getattr(self._target, name)
        return timed(fn, self._acc, self._labels[name]) if name in self._labels and callable(fn) else fn

    def __call__(self, *a, **kw):
        return self.__getattr__("__call__")(*a, **kw)


class Breakdown:
    """Times the parts of nanoserve's forward pass as production runs it: the C++ layer loop
    (`model.stack`) times each of its calls itself while `timing` is on (a clock read a call, a few
    microseconds a step); the LM head, the model's Python around it, batch building and the rest of the
    engine are timed here. A model without the stack (no C++ kernels) reports its layers as one part."""

    def __init__(self, llm) -> None:
        eng, self.acc = llm.engine, defaultdict(float)
        model, acc = eng.model, self.acc
        self.stack = model.stack
        if self.stack is not None:
            self.stack.timing = True
            model.stack = Timed(self.stack, acc, {"forward": "_stack"})
        else:
            model._layers = timed(model._layers, acc, "layers (torch loop)")
        model.lm_head_lin = Timed(model.lm_head_lin, acc, {"__call__": "lm head"})
        model.forward = timed(model.forward, acc, "_model")
        eng.runner.plan = timed(eng.runner.plan, acc, "_runner")
        eng.runner.execute = timed(eng.runner.execute, acc, "_runner")

    def parts(self, total: float) -> dict[str, float]:
        acc = self.acc
        parts = {k: v for k, v in acc.items() if not k.startswith("_")}
        if self.stack is not None:
            inner = self.stack.part_times()
            parts |= {k: v for k, v in inner.items() if v}
            parts["stack: between its calls"] = acc["_stack"] - sum(inner.values())
        layers = acc["_stack"] if self.stack is not None else parts.get("layers (torch loop)", 0.0)
        parts["model: other (embed, views, Python)"] = acc["_model"] - layers - parts.get("lm head", 0.0)
        parts["runner: batch building"] = acc["_runner"] - acc["_model"]
        parts["engine: schedule, sample, output"] = total - acc["_runner"]
        acc.clear()
        return parts


class Nanoserve:
    def __init__(self, args) -> None:
        import torch

        from nanoserve import LLM, SamplingParams
        batched = ({"max_num_batched_tokens": args.max_num_batched_tokens} if args.max_num_batched_tokens
                   else {})
        t0 = time.perf_counter()
        self.llm = LLM(args.model, dtype=args.dtype, enable_prefix_caching=False,
                       kv_cache_gb=args.kv_cache_gb, max_num_seqs=max(args.batches + [1, args.offline]),
                       gguf_dequantize=args.gguf_dequantize, **batched)
        self.load_s = time.perf_counter() - t0
        self.SamplingParams = SamplingParams
        self.breakdown = Breakdown(self.llm) if args.breakdown else None
        self.cores = f"{torch.get_num_threads()} compute thread(s) on cpus {sorted(os.sched_getaffinity(0))}"
        self.run(token_prompts(1, max(args.lens + [300]), seed=-3), 1)  # warm-up: kernel build, oneDNN JIT

    def memory(self) -> dict[str, float]:
        return {"resident memory (MB)": rollup()[0],
                "weights (MB)": weight_bytes(self.llm.engine.model) / 1e6, "load (s)": self.load_s}

    def run(self, prompts: list[list[int]], max_tokens: int) -> dict:
        params = self.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        engine, stamps = self.llm.engine, []
        step = engine.step

        def stamped():  # a step's outputs are the requests that got a token: when each token was made
            outs = step()
            if outs:
                stamps.append(time.perf_counter())
            return outs
        engine.step = stamped
        clock = getattr(engine, "pipeline", None)  # a checkout before issue 45 has none
        busy0 = clock.busy_seconds if clock else None
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            self.llm.generate(prompts, params)
        finally:
            del engine.step
        elapsed = time.perf_counter() - t0
        out = {"elapsed_s": elapsed, "cpu_s": time.process_time() - c0}
        if clock:
            out["busy_s"] = clock.busy_seconds - busy0
        if len(prompts) == 1 and max_tokens > 1:
            assert len(stamps) == max_tokens, (len(stamps), max_tokens)
            out["first_to_last_s"] = stamps[-1] - stamps[0]
        return out | ({"parts_s": self.breakdown.parts(elapsed)} if self.breakdown else {})


def weight_bytes(model) -> int:
    """Bytes of every tensor the model's weights live in: parameters, GGUF blocks and the dense layers'
    oneDNN copies (each once)."""
    tensors = {t.data_ptr(): t.numel() * t.element_size() for t in model.parameters() if t.numel()}
    lins = [lin for layer in model.layers for lin in vars(layer).values()
            if hasattr(lin, "parts") or hasattr(lin, "packed")]
    for lin in [*lins, model.lm_head_lin, getattr(model.embed_rows, "table", None)]:
        if getattr(lin, "copies_weight", False):  # an opaque oneDNN tensor of its own (no data pointer)
            tensors[id(lin.packed)] = lin.packed.numel() * lin.packed.element_size()
        for part in getattr(lin, "parts", [lin] if lin is not None and hasattr(lin, "qtype") else []):
            tensors[part.data.data_ptr()] = part.nbytes
    return sum(tensors.values())


def rollup() -> tuple[float, float]:
    """(Rss, anonymous) MB of this process."""
    got = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            key, value, *_ = line.split()
            if key in ("Rss:", "Anonymous:"):
                got[key] = int(value) / 1024
    return got["Rss:"], got["Anonymous:"]


def memory_bandwidth_gbs(threads: int | None) -> float:
    """Read + write GB/s of a 1 GiB tensor copy (torch's parallel copy on this process's threads)."""
    import torch
    src, dst = torch.ones(1 << 28), torch.empty(1 << 28)  # 1 GiB each: far past any cache
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * 4 / best / 1e9


def measure(side, args, r: int) -> dict:
    """One run of every measurement on one side: ms, and the parts (ms) with --breakdown."""
    if isinstance(side, OtherTree):
        return side.run_child("--one-run", str(r))
    if isinstance(side, LlamaServerSide):  # a fresh server, then this function on it
        return side.measure(lambda running: measure(running, args, r))
    out: dict = {what: {} for what in ("ttft_ms", "decode_step_ms", "prefill_ms", "parts_ms", "memory",
                                       "cpu_ms", "decode_stream_ms", "busy_ms")}
    for i, n in enumerate(args.lens):
        runs = [side.run(token_prompts(1, n, seed=1000 * r + 10 * i + k), 1) for k in range(args.prompts)]
        best = sorted(runs, key=lambda x: x["elapsed_s"])[len(runs) // 2]
        out["ttft_ms"][str(n)] = best["elapsed_s"] * 1e3
        if "cpu_s" in best:  # in-process sides (vLLM's worker reports wall time only)
            out["cpu_ms"][f"cold TTFT, {n} tokens"] = best["cpu_s"] * 1e3
        if "parts_s" in best:
            out["parts_ms"][f"ttft {n}"] = ({k: v * 1e3 for k, v in best["parts_s"].items()}
                                            | {"total": best["elapsed_s"] * 1e3})
    for b in args.batches:
        for c in args.contexts:
            key, seed = f"{b} x {c}", 5000 + 1000 * r + b + c
            one = side.run(token_prompts(b, c, seed), 1)
            more = side.run(token_prompts(b, c, seed + 500), 1 + args.decode_steps)
            out["decode_step_ms"][key] = (more["elapsed_s"] - one["elapsed_s"]) / args.decode_steps * 1e3
            if "cpu_s" in more:
                cpu = (more["cpu_s"] - one["cpu_s"]) / args.decode_steps
                out["cpu_ms"][f"decode step, {key}"] = cpu * 1e3
            out["prefill_ms"][key] = one["elapsed_s"] * 1e3
            if "busy_s" in more:  # the forwards' own time; the rest of the step is the host's gap
                out["busy_ms"][key] = (more["busy_s"] - one["busy_s"]) / args.decode_steps * 1e3
            if "first_to_last_s" in more:  # batch 1: its own tokens' times, no prefill in it
                out["decode_stream_ms"][key] = more["first_to_last_s"] / args.decode_steps * 1e3
            if "parts_s" in one:
                parts = {k: (more["parts_s"].get(k, 0) - v) / args.decode_steps * 1e3
                         for k, v in one["parts_s"].items()}
                out["parts_ms"][f"decode {key}"] = parts | {"total": out["decode_step_ms"][key]}
    if args.offline:
        new = 64
        t = side.run(token_prompts(args.offline, 128, seed=7000 + r), new)["elapsed_s"]
        out["memory"]["offline throughput (output tok/s)"] = args.offline * new / t
    if hasattr(side, "memory"):  # vLLM's offline worker reports none
        out["memory"] |= side.memory()
    return out


@dataclass(frozen=True)
class GgufSize:
    hidden: int
    inter: int
    layers: int
    heads: int
    kv_heads: int


# 1b: Llama-3.2-1B's shape with the embedded model's 49k vocabulary (its tokenizer is copied): 1.07B
GGUF_SIZES = {"1b": GgufSize(2048, 8192, 16, 32, 8), "135m": GgufSize(576, 1536, 30, 9, 3)}


def write_random_gguf(path: Path, size: GgufSize, qtype_name: str, seed: int = 0) -> None:
    """A Llama GGUF with random N(0, 0.02) weights in one block type (norms F32, embedding tied),
    the embedded model's tokenizer and chat template: nanoserve and llama.cpp both read it. One
    tensor is generated and quantized at a time (the 1b Q8_0 file is 1.1 GB). Q4_K_M mixes types as
    llama.cpp's does: Q6_K for the embedding and every other layer's attn_v and ffn_down, Q4_K elsewhere,
    with random super-blocks."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import quantize
    qtype = GGMLQuantizationType[qtype_name] if qtype_name != "Q4_K_M" else None
    rng = np.random.default_rng(seed)
    tok = GGUFReader(str(embedded_gguf()))
    vocab = len(tok.fields["tokenizer.ggml.tokens"].data)
    w = GGUFWriter(str(path), "llama")
    w.add_name(f"random-{size.layers}x{size.hidden}-{qtype_name}")
    w.add_block_count(size.layers)
    w.add_context_length(4096)
    w.add_embedding_length(size.hidden)
    w.add_feed_forward_length(size.inter)
    w.add_head_count(size.heads)
    w.add_head_count_kv(size.kv_heads)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_rope_dimension_count(size.hidden // size.heads)
    for key, f in tok.fields.items():
        if key.startswith("tokenizer."):
            sub = f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None
            w.add_key_value(key, f.contents(), f.types[0], sub)
    d, kv = size.hidden // size.heads, size.kv_heads * (size.hidden // size.heads)
    shapes = {"token_embd.weight": (vocab, size.hidden), "output_norm.weight": (size.hidden,)}
    h = size.hidden
    for i in range(size.layers):
        shapes |= {f"blk.{i}.{k}.weight": shape for k, shape in (
            ("attn_norm", (h,)), ("ffn_norm", (h,)), ("attn_q", (size.heads * d, h)), ("attn_k", (kv, h)),
            ("attn_v", (kv, h)), ("attn_output", (h, h)), ("ffn_gate", (size.inter, h)),
            ("ffn_up", (size.inter, h)), ("ffn_down", (h, size.inter)))}
    for name, shape in shapes.items():
        if len(shape) == 1:
            w.add_tensor(name, np.ones(shape, dtype=np.float32))
        elif qtype is None:  # Q4_K_M
            wide = name == "token_embd.weight" or (name.endswith(("attn_v.weight", "ffn_down.weight"))
                                                   and int(name.split(".")[1]) % 2 == 0)
            k = GGMLQuantizationType.Q6_K if wide else GGMLQuantizationType.Q4_K
            w.add_tensor(name, random_kquant(*shape, k, rng), raw_dtype=k)
        else:
            a = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
            w.add_tensor(name, quantize(a, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {path}: {path.stat().st_size / 1e9:.2f} GB")


def tp_wire(batches: list[int], ctx: int, reps: int = 20_000) -> None:
    import pickle

    from nanoserve.parallel.messages import Step, decode, encode
    from nanoserve.runner.step_plan import StepPlan

    def median_us(fn) -> float:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter_ns()
            fn()
            times.append(time.perf_counter_ns() - t0)
        return statistics.median(times) / 1000
    for b in batches:
        blocks = ctx // 16 + 1
        tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(b)]
        pos = [ctx - i % 5 for i in range(b)]
        step = Step(StepPlan([1000 + i for i in range(b)], pos, [t[p // 16] for t, p in zip(tables, pos)],
                             [p % 16 for p in pos], [], [1] * b, [p + 1 for p in pos], tables, b, None), [])
        assert decode(encode(step)) == step
        typed, pickled = len(encode(step)), len(pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL))
        t = median_us(lambda: decode(encode(step)))
        p = median_us(lambda: pickle.loads(pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)))
        print(f"batch {b}, {blocks}-block tables: typed {t:.1f} us ({typed} B), "
              f"pickle {p:.1f} us ({pickled} B); {cpu_name()}")


@dataclass
class Stages:
    """Resident memory after each stage of loading and first use (--load-stages)."""
    rows: list[tuple[str, float, float, float]] = field(default_factory=list)  # label, rss, anon, seconds
    last_t: float = field(default_factory=time.perf_counter)

    def mark(self, label: str) -> None:
        t = time.perf_counter()
        self.rows.append((label, *rollup(), t - self.last_t))
        self.last_t = t

    def wrap(self, owner, name: str, label: str) -> None:
        """Marks `label` whenever `owner.name` returns."""
        fn = getattr(owner, name)

        def marked(*a, **kw):
            out = fn(*a, **kw)
            self.mark(label)
            return out
        setattr(owner, name, marked)

    def table(self) -> str:
        lines = ["| stage | RSS MB | +RSS | anon MB | +anon | file MB | +file | s |", "|---" * 8 + "|"]
        prev = (0.0, 0.0)
        for label, rss, anon, s in self.rows:
            d_rss, d_anon = rss - prev[0], anon - prev[1]
            lines.append(f"| {label} | {rss:.1f} | {d_rss:+.1f} | {anon:.1f} | {d_anon:+.1f} | "
                         f"{rss - anon:.1f} | {d_rss - d_anon:+.1f} | {s:.2f} |")
            prev = (rss, anon)
        return "\n".join(lines)


def load_stages(args) -> dict:
    stages = Stages()
    stages.mark("python")
    import torch  # noqa: F401
    stages.mark("import torch")
    import nanoserve.engine.llm_engine as le
    import nanoserve.parallel.shard as shard
    from nanoserve import LLM, SamplingParams
    from nanoserve.models.llama import LlamaModel
    stages.mark("import nanoserve")
    for owner, name, label in [(le, "materialize", "materialize (cached folder)"),
                               (le, "load_config", "load_config"),
                               (le, "load_tokenizer", "load_tokenizer (offline LLM only)"),
                               (LlamaModel, "load_weights", "model + load_weights"),
                               (LlamaModel, "finalize", "finalize (layers, kernels)"),
                               (shard, "ModelRunner", "runner + KV cache")]:
        stages.wrap(owner, name, label)
    llm = LLM(args.model, dtype=args.dtype, kv_cache_gb=args.kv_cache_gb,
              gguf_dequantize=args.gguf_dequantize, enable_prefix_caching=False)
    stages.mark("rest of LLM()")
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    llm.generate(token_prompts(1, 256), greedy)
    stages.mark("generate 1 x (256 + 32)")
    llm.generate(token_prompts(8, 128, seed=1), greedy)
    stages.mark("generate 8 x (128 + 32)")
    llm.engine.grammars.start().result()
    stages.mark("llguidance vocabulary (first constrained request)")
    print(f"{cpu_name()}; {'dequantized' if args.gguf_dequantize else 'GGUF kept in its blocks'}; "
          f"dtype {args.dtype}; kv-cache-gb {args.kv_cache_gb}")
    print(stages.table())
    return {"cpu": cpu_name(), "args": vars(args), "stages": [
        dict(zip(("stage", "rss_mb", "anon_mb", "seconds"), row)) for row in stages.rows]}


def llama_side(args) -> LlamaServerSide | None:
    """llama.cpp's server on the same GGUF and threads, or None with a note."""
    gguf = Path(args.model) if args.model else embedded_gguf()
    binary = find_llama_server(args.llama_server)
    if binary is None or gguf.suffix != ".gguf" or not gguf.is_file():
        why = (f"no llama-server {args.llama_server!r} (--llama-server PATH or $LLAMA_SERVER)"
               if binary is None else f"--model {gguf} is not a .gguf file")
        print(f"llama.cpp column skipped: {why}", flush=True)
        return None
    slots = max(args.batches + [1, args.offline])
    # the most KV any step of the workload holds at once
    need = max([n + 1 for n in args.lens] + [args.offline * (128 + 64)]
               + [b * (c + args.decode_steps + 1) for b in args.batches for c in args.contexts])
    act_bytes = 4 if args.dtype == "float32" else 2
    return LlamaServerSide(binary, gguf, args.threads or os.cpu_count(), slots, args.kv_cache_gb, act_bytes,
                           need, max(args.lens + [300]))


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="nanoserve --model (default: the embedded SmolLM2-135M)")
    ap.add_argument("--dtype", default="auto", help="auto resolves here and every side uses it")
    ap.add_argument("--ttft-lens", default="256,1024,4000", help="cold TTFT prompt lengths ('' = none)")
    ap.add_argument("--prompts", type=int, default=1, help="fresh prompts per length and run (median)")
    ap.add_argument("--decode-batch", default="8", help="decode batch sizes ('' = none)")
    ap.add_argument("--decode-ctx", default="256", help="decode context lengths")
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: nanoserve's own")
    ap.add_argument("--threads", type=int, default=None, help="compute threads, pinned to the last cores")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--peer", choices=["vllm"], default=None, help="alternate with vLLM-CPU's offline LLM")
    ap.add_argument("--base", type=Path, default=None, help="alternate with this checkout's nanoserve")
    ap.add_argument("--one-ahead", action="store_true",
                    help="alternate with this checkout one step ahead (NANOSERVE_ASYNC_SCHEDULING=1)")
    ap.add_argument("--breakdown", action="store_true", help="time the parts of nanoserve's forward pass")
    ap.add_argument("--load-stages", action="store_true", help="an engine's memory by load stage, then exit")
    ap.add_argument("--tp-wire", action="store_true", help="time tensor parallelism's step messages, exit")
    ap.add_argument("--json", default=None, metavar="FILE")
    ap.add_argument("--one-run", type=int, default=None, help=argparse.SUPPRESS)  # child: one run, JSON out
    ap.add_argument("--gguf-dequantize", action="store_true", help="nanoserve --gguf-dequantize")
    ap.add_argument("--vs-dequantized", action="store_true",
                    help="a GGUF from its blocks vs --gguf-dequantize (vs llama.cpp)")
    ap.add_argument("--kv-cache-gb", type=float, default=1.0)
    ap.add_argument("--offline", type=int, default=0, metavar="N", help="offline throughput of N prompts")
    ap.add_argument("--write-gguf", type=Path, default=None, metavar="FILE",
                    help="write a random-weight GGUF, then exit")
    ap.add_argument("--gguf-size", choices=list(GGUF_SIZES), default="1b")
    ap.add_argument("--gguf-type", choices=["Q4_0", "Q4_1", "Q8_0", "Q4_K_M"], default="Q4_0")
    add_peer_args(ap)
    args = ap.parse_args()
    args.lens = [int(x) for x in args.ttft_lens.split(",") if x]
    args.batches = [int(x) for x in args.decode_batch.split(",") if x]
    args.contexts = [int(x) for x in args.decode_ctx.split(",") if x]
    return args


def report(args, sides: dict, runs: dict[str, list[dict]], bandwidth: float | None) -> dict:
    """The medians of every side as one table (and the breakdown's), as the JSON written."""
    whats = ("ttft_ms", "decode_step_ms", "prefill_ms", "memory", "cpu_ms", "decode_stream_ms", "busy_ms")
    med = {name: {what: {k: statistics.median(x[what][k] for x in rs) for k in rs[0].get(what, {})}
                  for what in whats} for name, rs in runs.items()}
    print(f"\n{cpu_name()}; dtype {args.dtype}; medians of {args.runs}")
    for name, side in sides.items():
        print(f"  {name}: {side.cores}")
    rows = {f"{title}, {k}{unit}": {n: med[n][what][k] for n in sides}
            for title, what, unit in (("cold TTFT", "ttft_ms", " tokens"),
                                      ("decode step", "decode_step_ms", ""),
                                      ("prefill + first token", "prefill_ms", ""))
            for k in med["nanoserve"][what]}
    for k in med["nanoserve"]["busy_ms"]:
        has = [n for n in sides if k in med[n]["busy_ms"]]
        rows[f"decode step {k}: forward busy"] = {n: med[n]["busy_ms"][k] if n in has else None
                                                   for n in sides}
        rows[f"decode step {k}: host gap (% of step)"] = {
            n: 100 * (1 - med[n]["busy_ms"][k] / med[n]["decode_step_ms"][k]) if n in has else None
            for n in sides}
        rows[f"decode step {k}: tok/s"] = {n: int(k.split()[0]) * 1e3 / med[n]["decode_step_ms"][k]
                                           for n in sides}
    if args.vs_dequantized:
        mem = {n: med[n]["memory"] for n in sides}
        for k in med["nanoserve"]["decode_stream_ms"]:  # batch 1, first to last token
            tok_s = {n: 1e3 / med[n]["decode_stream_ms"][k] for n in sides}
            rows[f"batch-1 decode tok/s, ctx {k[4:]}"] = tok_s
            rows[f"weights x tok/s / bandwidth (%), ctx {k[4:]}"] = {
                n: 100 * mem[n]["weights (MB)"] * tok_s[n] / 1e3 / bandwidth for n in sides}
        rows |= {k: {n: mem[n][k] for n in sides} for k in mem["nanoserve"]}
        # CPU time of the process: what each side costs when the cores are shared
        rows |= {f"{k}, CPU ms": {n: med[n]["cpu_ms"][k] for n in sides} for k in med["nanoserve"]["cpu_ms"]}
    if rows:
        print(comparison_table(rows, "measurement (ms unless named)"))
    own = [x["server_decode_ms_per_token"] for x in runs.get("llama.cpp", [])
           if "server_decode_ms_per_token" in x]
    if own:
        print(f"llama.cpp's own timings (predicted_per_token_ms of its batch-1 requests), median: "
              f"{statistics.median(own):.2f} ms/token = {1e3 / statistics.median(own):.1f} tok/s")
    parts = {}
    if args.breakdown and runs["nanoserve"][0]["parts_ms"]:
        rs = runs["nanoserve"]
        parts = {case: {k: statistics.median(x["parts_ms"][case][k] for x in rs)
                        for k in rs[0]["parts_ms"][case]} for case in rs[0]["parts_ms"]}
        cases = list(parts)
        print("\nnanoserve, where the time goes (ms, share of the total), medians\n| part | "
              + " | ".join(cases) + " |\n" + "|---" * (1 + len(cases)) + "|")
        for k in sorted(parts[cases[0]], key=lambda k: (k == "total", -parts[cases[0]][k])):
            cells = [f"{parts[c].get(k, 0):.1f} ({100 * parts[c].get(k, 0) / parts[c]['total']:.0f}%)"
                     for c in cases]
            print(f"| {k} | " + " | ".join(cells) + " |")
    return {"cpu": cpu_name(), "dtype": args.dtype, "args": vars(args), "memory_bandwidth_gbs": bandwidth,
            "cores": {k: s.cores for k, s in sides.items()}, "runs": runs, "medians": med, "parts_ms": parts}


def main() -> int:
    args = parse_args()
    if args.tp_wire:
        return tp_wire(args.batches, args.contexts[0]) or 0
    if args.write_gguf:
        return write_random_gguf(args.write_gguf, GGUF_SIZES[args.gguf_size], args.gguf_type) or 0
    if args.load_stages:  # before anything imports torch
        return write_json(args.json, load_stages(args)) or 0
    if args.dtype == "auto":
        args.dtype = auto_dtype()
    sides: dict = {}
    if args.peer == "vllm" and args.one_run is None:  # started before this process pins itself
        sides["vllm"] = VllmOffline(peer_config(args, args.dtype))
    bandwidth = None
    try:
        if args.threads:
            import torch
            os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[-args.threads:])
            torch.set_num_threads(args.threads)
        if args.one_run is not None:
            print(json.dumps(measure(Nanoserve(args), args, args.one_run)))
            return 0
        child = child_argv(sys.argv[1:], flags=("--vs-dequantized",))
        fresh = args.base or args.vs_dequantized or args.one_ahead
        sides = {"nanoserve": OtherTree(ROOT, "latency.py", child) if fresh else Nanoserve(args), **sides}
        if args.one_ahead:
            sides["one-ahead"] = OtherTree(ROOT, "latency.py", child, {"NANOSERVE_ASYNC_SCHEDULING": "1"})
        if args.base:
            sides["base"] = OtherTree(args.base.resolve(), "latency.py", child)
        if args.vs_dequantized:
            sides["dequantized"] = OtherTree(ROOT, "latency.py", [*child, "--gguf-dequantize"])
            if (peer := llama_side(args)) is not None:
                sides["llama.cpp"] = peer
            bandwidth = memory_bandwidth_gbs(args.threads)
            print(f"memory bandwidth: {bandwidth:.1f} GB/s (1 GiB copy, read + write)", flush=True)

        def one(name: str, r: int) -> dict:
            m = measure(sides[name], args, r)
            print(f"  run {r} {name:9s} " + "  ".join(f"{what} {k}: {v:.1f} ms"
                                                    for what in ("ttft_ms", "decode_step_ms")
                                                    for k, v in m[what].items()), flush=True)
            return m
        runs = alternate(list(sides), args.runs, one)
    finally:
        if "vllm" in sides:
            sides["vllm"].close()
    write_json(args.json, report(args, sides, runs, bandwidth))
    return 0


if __name__ == "__main__":
    sys.exit(main())
