"""llama.cpp's `llama-server` as a side of `latency.py --vs-dequantized`: the same GGUF file, started
through peers.py (own process group, 127.0.0.1, a free port) fresh for every run, and driven like
nanoserve's offline engine: `run(prompts, max_tokens)` sends every prompt (token ids) at once as a
`/completion` request (greedy, `ignore_eos`, `n_predict` = max_tokens, `cache_prompt: false`) and
returns the wall time until the last response and the server's CPU time (its process group's, from
/proc), so latency.py's measurements apply to it unchanged. Over HTTP: each time includes one
localhost round trip and JSON (about a millisecond), which the decode step's difference of two runs
cancels. A single request of more than one token is streamed, and the times its tokens arrive at
the client give batch-1 decode from the first to the last token (the server sends each token as
it is made; nanoserve's side stamps its engine steps in-process); the server's own
`timings.predicted_per_token_ms` is kept beside it as a check.

Its KV cache is the same number of tokens as nanoserve's `--kv-cache-gb` holds (f16 K/V, one unified
buffer for all slots: `-kvu -c TOKENS`), with as many slots (`-np`) as the largest batch; its host
prompt cache is off (`--cache-ram 0`: nanoserve's prefix cache is off in these runs too)."""
from __future__ import annotations

import json
import os
import shutil
import statistics
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from common import token_prompts
from peers import PeerConfig, Server, ServerSpec, start

FLAGS = ["-kvu", "--cache-ram", "0", "--no-webui"]


def find_llama_server(path: str) -> str | None:
    """The binary: a path or a name on $PATH; None when there is none."""
    found = shutil.which(path)
    return str(Path(found).resolve()) if found else None


@dataclass(frozen=True)
class GgufFacts:
    weight_bytes: int       # every tensor of the file: what a decode step streams
    kv_bytes_per_token: int  # K and V of every layer, 2 bytes an element (f16 / bf16)


def gguf_facts(path: Path) -> GgufFacts:
    from nanoserve.models.gguf_reader import WeightsReader
    r = WeightsReader(str(path))
    arch = r.fields["general.architecture"].contents()
    meta = lambda key: r.fields[f"{arch}.{key}"].contents()  # noqa: E731
    heads = meta("attention.head_count")
    kv_heads = meta("attention.head_count_kv") if f"{arch}.attention.head_count_kv" in r.fields else heads
    head_dim = meta("embedding_length") // heads
    return GgufFacts(sum(int(t.n_bytes) for t in r.tensors), meta("block_count") * kv_heads * head_dim * 2 * 2)


def group_pids(pgid: int) -> list[int]:
    pids = []
    for p in os.listdir("/proc"):
        try:
            if p.isdigit() and os.getpgid(int(p)) == pgid:
                pids.append(int(p))
        except OSError:
            pass
    return pids


def group_rss_mb(pgid: int) -> float:
    total = 0
    for pid in group_pids(pgid):
        with open(f"/proc/{pid}/status") as f:
            total += next((int(line.split()[1]) for line in f if line.startswith("VmRSS")), 0)
    return total / 1024


def group_cpu_s(pgid: int) -> float:
    total = 0
    for pid in group_pids(pgid):
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


class Running:
    """One started llama-server, with latency.py's side interface: run() and memory()."""

    def __init__(self, server: Server, load_s: float, weight_bytes: int) -> None:
        self.server, self.load_s, self.weight_bytes = server, load_s, weight_bytes
        self.decode_ms_per_token: list[float] = []  # the server's own timings, batch-1 requests

    def _one(self, ids: list[int], max_tokens: int, stream: bool) -> tuple[dict, list[float]]:
        """The final response and, streamed, the times its tokens arrived."""
        body = json.dumps({"prompt": ids, "n_predict": max_tokens, "ignore_eos": True, "cache_prompt": False,
                           "temperature": 0.0, "stream": stream, "return_tokens": True}).encode()
        req = urllib.request.Request(self.server.url + "/completion", body, {"Content-Type": "application/json"})
        stamps: list[float] = []
        with urllib.request.urlopen(req, timeout=3600) as r:
            if not stream:
                out = json.load(r)
            for line in r if stream else ():
                if line.startswith(b"data: "):
                    out = json.loads(line[6:])
                    # a chunk may carry several tokens, and a token may have none (seen on a random-weight
                    # model's output: 32 chunks for 33 tokens): the final chunk then stamps the end
                    n = len(out.get("tokens") or ()) if not out["stop"] else int(len(stamps) < max_tokens)
                    stamps += [time.perf_counter()] * max(n, int(not out["stop"]))
        if (out["tokens_predicted"], out["tokens_evaluated"]) != (max_tokens, len(ids)) or \
                (stream and len(stamps) != max_tokens):
            got = f"{out['tokens_predicted']} / {out['tokens_evaluated']} ({len(stamps)} streamed)"
            raise RuntimeError(f"llama-server predicted / evaluated {got} tokens, asked {max_tokens} / {len(ids)}")
        return out, stamps

    def run(self, prompts: list[list[int]], max_tokens: int) -> dict:
        """All prompts at once; one prompt of more than one token is streamed, and then its first to
        last token's time is returned too (as nanoserve's side times its engine steps)."""
        pgid, stream = self.server.proc.pid, len(prompts) == 1 and max_tokens > 1
        c0, t0 = group_cpu_s(pgid), time.perf_counter()
        with ThreadPoolExecutor(len(prompts)) as pool:
            outs = list(pool.map(lambda ids: self._one(ids, max_tokens, stream), prompts))
        res = {"elapsed_s": time.perf_counter() - t0, "cpu_s": group_cpu_s(pgid) - c0}
        if stream:
            (out, stamps), = outs
            self.decode_ms_per_token.append(out["timings"]["predicted_per_token_ms"])
            res["first_to_last_s"] = stamps[-1] - stamps[0]
        return res

    def memory(self) -> dict[str, float]:
        return {"resident memory (MB)": group_rss_mb(self.server.proc.pid), "weights (MB)": self.weight_bytes / 1e6,
                "load (s)": self.load_s}


class LlamaServerSide:
    """A fresh llama-server per run (cold TTFT, a clean resident set, as nanoserve's sides)."""

    def __init__(self, binary: str, gguf: Path, threads: int, slots: int, kv_cache_gb: float, act_bytes: int,
                 need_tokens: int, warmup_len: int) -> None:
        facts = gguf_facts(gguf)
        # nanoserve's KV holds kv_cache_gb of K/V in the activation dtype: the same tokens here (f16)
        tokens = int(kv_cache_gb * (1 << 30) // (facts.kv_bytes_per_token * act_bytes // 2))
        ctx = max(tokens, need_tokens)
        self.cfg = replace(PeerConfig(), llama_server=binary, llamacpp_threads=threads, llamacpp_slots=slots,
                           llamacpp_model=str(gguf), llamacpp_ctx=ctx)
        self.weight_bytes, self.warmup_len = facts.weight_bytes, warmup_len
        cpus = sorted(os.sched_getaffinity(0))
        same = "as many as nanoserve holds" if ctx == tokens else f"the workload's; nanoserve holds {tokens}"
        self.cores = (f"llama-server -t {threads} -tb {threads} on cpus {cpus} (inherited), -np {slots}, unified KV "
                      f"-c {ctx} tokens ({same}, {ctx * facts.kv_bytes_per_token / 1e6:.0f} MB f16), "
                      f"{' '.join(FLAGS)}; "
                      f"GGUF as is, over HTTP")

    def measure(self, measure_fn: Callable[[Running], dict]) -> dict:
        t0 = time.perf_counter()
        server = start(ServerSpec("llamacpp", "llamacpp", None, FLAGS), self.cfg)
        try:
            running = Running(server, time.perf_counter() - t0, self.weight_bytes)
            running.run(token_prompts(1, self.warmup_len, seed=-3), 1)  # nanoserve's warm-up
            out = measure_fn(running)
            if running.decode_ms_per_token:
                out["server_decode_ms_per_token"] = statistics.median(running.decode_ms_per_token)
            return out
        finally:
            server.stop()
