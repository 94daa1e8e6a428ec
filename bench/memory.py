"""Where a nanoserve engine's resident memory goes, stage by stage: /proc/self/smaps_rollup (Rss, its
anonymous part, the rest file-backed: shared libraries, memory-mapped weights) after each step of
loading an in-process engine (the engine process of a server loads the same way, but never loads the
transformers tokenizer the offline LLM loads for its first generate), then after a batch-1 and a
batch-8 generate, then after llguidance's view of the vocabulary, which an engine builds on its first
constrained request.

    python bench/memory.py --kv-cache-gb 0.25                      # GGUF kept in its blocks
    python bench/memory.py --kv-cache-gb 0.25 --gguf-dequantize
    python bench/memory.py --kv-cache-gb 0.25 --stock-reader       # the gguf package's reader as it is

`--servers` measures whole servers instead, side by side in one run: `nanoserve` with the GGUF kept and
with --gguf-dequantize (and llama.cpp's llama-server where --llama-server finds one), each started fresh
--runs times (alternated), sent one 256-token completion of 32 tokens, then read: VmRSS summed over its
process group (the API process and the engine process for nanoserve), each process listed; medians.

    python bench/memory.py --servers --kv-cache-gb 0.25 [--llama-server PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field


def rollup() -> tuple[float, float]:
    """(Rss, anonymous) MB of this process."""
    got = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            key, value, *_ = line.split()
            if key in ("Rss:", "Anonymous:"):
                got[key] = int(value) / 1024
    return got["Rss:"], got["Anonymous:"]


@dataclass
class Stages:
    rows: list[tuple[str, float, float, float]] = field(default_factory=list)  # label, rss, anon, seconds
    last_t: float = field(default_factory=time.perf_counter)

    def mark(self, label: str) -> None:
        t = time.perf_counter()
        self.rows.append((label, *rollup(), t - self.last_t))
        self.last_t = t

    def table(self) -> str:
        lines = ["| stage | RSS MB | +RSS | anon MB | +anon | file MB | +file | s |", "|---" * 8 + "|"]
        prev = (0.0, 0.0)
        for label, rss, anon, s in self.rows:
            d_rss, d_anon = rss - prev[0], anon - prev[1]
            lines.append(f"| {label} | {rss:.1f} | {d_rss:+.1f} | {anon:.1f} | {d_anon:+.1f} | {rss - anon:.1f} | "
                         f"{d_rss - d_anon:+.1f} | {s:.2f} |")
            prev = (rss, anon)
        return "\n".join(lines)


def wrap(owner, name: str, label: str, stages: Stages) -> None:
    fn = getattr(owner, name)

    def marked(*a, **kw):
        out = fn(*a, **kw)
        stages.mark(label)
        return out
    setattr(owner, name, marked)


def group_rss(leader: int) -> list[tuple[int, float, str]]:
    """(pid, VmRSS MB, command) of every process in the leader's process group."""
    pids = subprocess.run(["pgrep", "-g", str(os.getpgid(leader))], capture_output=True, text=True).stdout.split()
    rows = []
    for pid in map(int, pids):
        try:
            with open(f"/proc/{pid}/status") as f:
                rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024
            with open(f"/proc/{pid}/cmdline") as f:
                cmd = f.read().replace("\0", " ")
        except (FileNotFoundError, StopIteration):  # gone, or a zombie
            continue
        rows.append((pid, rss, cmd))
    return rows


def server_rss(spec, cfg, prompt: list[int]) -> list[tuple[int, float, str]]:
    """One fresh server: one completion served, then every process of its group."""
    from peers import start
    srv = start(spec, cfg)
    try:
        body = {"model": "smollm2" if spec.kind == "llamacpp" else None, "prompt": prompt, "max_tokens": 32}
        if spec.kind == "nanoserve":
            with urllib.request.urlopen(srv.base_url + "/models") as r:
                body["model"] = json.load(r)["data"][0]["id"]
        req = urllib.request.Request(srv.base_url + "/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            assert r.status == 200
        time.sleep(1)
        return group_rss(srv.proc.pid)
    finally:
        srv.stop()


def servers(args: argparse.Namespace) -> int:
    from common import alternated, auto_dtype, cpu_name, write_json
    from peers import PeerConfig, ServerSpec
    dtype = auto_dtype() if args.dtype == "auto" else args.dtype
    cfg = PeerConfig(dtype, args.kv_cache_gb, llama_server=args.llama_server, llamacpp_ctx=4096, llamacpp_slots=4)
    specs = ["kept=nanoserve", "dequantized=nanoserve --gguf-dequantize"]
    if os.access(args.llama_server, os.X_OK):
        specs.append("llamacpp")
    prompt = [random.Random(0).randrange(100, 40000) for _ in range(256)]
    totals: dict[str, list[float]] = {}
    print(f"{cpu_name()}; dtype {dtype}; kv-cache-gb {args.kv_cache_gb}")
    for run in range(args.runs):
        for spec in alternated(list(map(ServerSpec.parse, specs)), run):
            rows = server_rss(spec, cfg, prompt)
            totals.setdefault(spec.label, []).append(sum(r[1] for r in rows))
            print(f"run {run} {spec.label}: {totals[spec.label][-1]:.0f} MB over {len(rows)} process(es)")
            for pid, rss, cmd in rows:
                print(f"    {rss:7.0f} MB  {cmd[:90]}")
    med = {label: statistics.median(v) for label, v in totals.items()}
    for label, v in totals.items():
        print(f"{label}: median {med[label]:.0f} MB (runs {' / '.join(f'{x:.0f}' for x in v)})")
    ratios = [d / k for d, k in zip(totals["dequantized"], totals["kept"])]
    print(f"dequantized / kept: {med['dequantized'] / med['kept']:.2f}x (median / median; per run "
          f"{', '.join(f'{r:.2f}' for r in ratios)})")
    write_json(args.json, {"cpu": cpu_name(), "dtype": dtype, "kv_cache_gb": args.kv_cache_gb, "runs_mb": totals,
                           "median_mb": med, "ratio_dequantized_over_kept": med["dequantized"] / med["kept"]})
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--kv-cache-gb", type=float, default=0.25)
    ap.add_argument("--gguf-dequantize", action="store_true")
    ap.add_argument("--stock-reader", action="store_true",
                    help="load GGUF blocks with the gguf package's reader unchanged (every array element parsed, "
                         "no page released): the A/B of models/gguf_reader.py")
    ap.add_argument("--servers", action="store_true", help="whole servers' resident memory (see above)")
    ap.add_argument("--runs", type=int, default=3, help="--servers: fresh starts of each, alternated (medians)")
    ap.add_argument("--json", default=None, metavar="FILE", help="--servers: also write the result here")
    ap.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER", "llama-server"))
    args = ap.parse_args()
    if args.servers:
        return servers(args)
    stages = Stages()
    stages.mark("python")
    import torch  # noqa: F401
    stages.mark("import torch")
    import nanoserve.engine.llm_engine as le
    import nanoserve.parallel.shard as ms
    from nanoserve import LLM, SamplingParams
    from nanoserve.models.llama import LlamaModel
    stages.mark("import nanoserve")
    if args.stock_reader:
        from gguf import GGUFReader

        from nanoserve.models import gguf_reader
        gguf_reader.WeightsReader._get_field_parts = GGUFReader._get_field_parts
        gguf_reader.WeightsReader.release = lambda self, start, end: None
    for owner, name, label in [(le, "materialize", "materialize (cached folder)"),
                               (le, "load_config", "load_config"),
                               (le, "load_tokenizer", "load_tokenizer (offline LLM only)"),
                               (LlamaModel, "load_weights", "model + load_weights"),
                               (LlamaModel, "finalize", "finalize (layers, kernels)"),
                               (ms, "ModelRunner", "runner + KV cache")]:
        wrap(owner, name, label, stages)
    llm = LLM(args.model, dtype=args.dtype, kv_cache_gb=args.kv_cache_gb, gguf_dequantize=args.gguf_dequantize,
              enable_prefix_caching=False)
    stages.mark("rest of LLM()")
    rng = random.Random(0)
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    llm.generate([[rng.randrange(100, 40000) for _ in range(256)]], greedy)
    stages.mark("generate 1 x (256 + 32)")
    llm.generate([[rng.randrange(100, 40000) for _ in range(128)] for _ in range(8)], greedy)
    stages.mark("generate 8 x (128 + 32)")
    llm.engine.grammars.start().result()
    stages.mark("llguidance vocabulary (first constrained request)")
    print(f"{'dequantized' if args.gguf_dequantize else 'kept'}{', stock reader' if args.stock_reader else ''}; "
          f"kv-cache-gb {args.kv_cache_gb}")
    print(stages.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
