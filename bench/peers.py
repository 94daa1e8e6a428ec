"""The servers and engines a benchmark runs: nanoserve (this checkout or another one), vLLM-CPU and
llama.cpp's server, each started and stopped the same way for every comparison, and what their
process groups hold (resident memory, CPU time).

A server runs in its own process group (setsid), on 127.0.0.1 and a free port, logs to a file, is
ready when its health route answers, and is stopped by SIGTERM to the whole group, then SIGKILL to
what is left (vLLM's EngineCore and Worker processes outlive a killed parent otherwise). Each one
states the cores it computes on (`Server.cores`), and the tools print it beside their results.

vLLM-CPU lives in its own venv (/work/shared/peers.md): `--vllm-venv` or $VLLM_VENV. Its CPU binding
by default gives the model all cores but one and keeps that one for its scheduler; `--vllm-cores all`
binds the model to every core (VLLM_CPU_OMP_THREADS_BIND), the equal-cores control. llama.cpp's
`llama-server` binary: `--llama-server` or $LLAMA_SERVER (it serves the embedded GGUF as is).

llama.cpp is also a side of `latency.py --vs-dequantized` (`LlamaServerSide`): the same GGUF file, a
fresh server per run, driven like nanoserve's offline engine. `run(prompts, max_tokens)` sends every
prompt (token ids) at once as a `/completion` request (greedy, `ignore_eos`, `n_predict` =
max_tokens, `cache_prompt: false`) and returns the wall time until the last response and the
process group's CPU time, so latency.py's measurements apply unchanged. Each time includes one
localhost round trip and JSON (about a millisecond), which the decode step's difference of two runs
cancels. A single request of more than one token is streamed, and its tokens' arrival times give
batch-1 decode from the first to the last token (the server sends each token as it is made);
the server's own `timings.predicted_per_token_ms` is kept beside it as a check. Its KV cache holds
as many tokens as nanoserve's `--kv-cache-gb` (f16 K/V, one unified buffer for all slots: `-kvu -c
TOKENS`), with as many slots (`-np`) as the largest batch; its host prompt cache is off
(`--cache-ram 0`: nanoserve's prefix cache is off in these runs too).

    python bench/peers.py --check vllm          # start one, print its URL and cores, stop it
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from common import embedded_gguf, export_embedded_hf, token_prompts

MARKER = "NANOSERVE_VLLM_RESULT "
KINDS = ("nanoserve", "vllm", "llamacpp")


@dataclass
class PeerConfig:
    """How every peer of a run is set up: the same dtype and KV budget for all."""
    dtype: str = "bfloat16"
    kv_cache_gb: float = 1.0
    vllm_venv: str = os.environ.get("VLLM_VENV", "/tmp/vllm-cpu")
    vllm_cores: str = "default"  # default: vLLM's own binding; all: its model on every core
    llama_server: str = os.environ.get("LLAMA_SERVER", "llama-server")
    llamacpp_threads: int = 1
    llamacpp_slots: int = 32
    llamacpp_model: str | None = None  # a GGUF file; default: the embedded one
    llamacpp_ctx: int = 16384  # KV tokens (-c)
    llamacpp_flags: tuple[str, ...] = ()

    @property
    def vllm_python(self) -> str:
        return str(Path(self.vllm_venv) / "bin" / "python")


def add_peer_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("peers")
    g.add_argument("--vllm-venv", default=PeerConfig.vllm_venv,
                   help="vLLM-CPU's venv (default: $VLLM_VENV)")
    g.add_argument("--vllm-cores", choices=["default", "all"], default="default",
                   help="vLLM's model on its default cores (all but one) or on all of them")
    g.add_argument("--llama-server", default=PeerConfig.llama_server, help="llama.cpp's llama-server binary")
    g.add_argument("--llamacpp-threads", type=int, default=1, help="llama-server -t / -tb")
    g.add_argument("--llamacpp-slots", type=int, default=32, help="llama-server -np (parallel requests)")
    g.add_argument("--llamacpp-ctx", type=int, default=16384, help="llama-server -c (KV tokens, all slots)")


def peer_config(args: argparse.Namespace, dtype: str, kv_cache_gb: float = 1.0) -> PeerConfig:
    return PeerConfig(dtype, kv_cache_gb, args.vllm_venv, args.vllm_cores, args.llama_server,
                      args.llamacpp_threads, args.llamacpp_slots, llamacpp_ctx=args.llamacpp_ctx)


@dataclass
class ServerSpec:
    """`LABEL=KIND[@TREE] [FLAGS...]`, or just KIND: e.g. `vllm`, `base=nanoserve@/tmp/base`,
    `b2048=nanoserve --max-num-batched-tokens 2048`. TREE: another checkout whose nanoserve runs."""
    label: str
    kind: str
    tree: Path | None = None
    flags: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, text: str) -> ServerSpec:
        head, *flags = shlex.split(text)
        label, _, what = head.rpartition("=")
        kind, _, tree = what.partition("@")
        if kind not in KINDS:
            raise ValueError(f"server kind must be one of {KINDS}, got {kind!r} in {text!r}")
        return cls(label or kind, kind, Path(tree).resolve() if tree else None, flags)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process group on 127.0.0.1; `base_url` is its OpenAI root (…/v1)."""

    def __init__(self, label: str, cmd: list[str], port: int, cores: str, env: dict | None = None,
                 health: str = "/health", startup_timeout: float = 900.0) -> None:
        self.label, self.cores = label, cores  # cores: where it computes, in words
        self.url = f"http://127.0.0.1:{port}"
        self.base_url = self.url + "/v1"
        self.log = tempfile.NamedTemporaryFile("w", prefix=f"bench-{label}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        # a first vLLM start on a fresh machine compiles for minutes
        deadline = time.monotonic() + startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"{label} exited with {self.proc.returncode} during start-up; "
                                   f"see {self.log.name}")
            try:
                with urllib.request.urlopen(self.url + health, timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{label} not healthy after {startup_timeout:.0f} s; see {self.log.name}")

    def stop(self) -> None:
        kill_group(self.proc)
        self.log.close()

    def processes(self) -> list[tuple[int, float, str]]:
        """(pid, VmRSS MB, command line) of every process of its group."""
        rows = []
        for pid in group_pids(self.proc.pid):
            try:
                with open(f"/proc/{pid}/status") as f:
                    rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024
                with open(f"/proc/{pid}/cmdline") as f:
                    cmd = f.read().replace("\0", " ").strip()
            except (FileNotFoundError, StopIteration):  # gone, or a zombie
                continue
            rows.append((pid, rss, cmd))
        return rows

    def rss_mb(self) -> float:
        return sum(rss for _, rss, _ in self.processes())

    def cpu_s(self) -> float:
        """User + system CPU seconds of its group's live processes."""
        total = 0
        for pid in group_pids(self.proc.pid):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except FileNotFoundError:
                continue
            total += int(fields[11]) + int(fields[12])  # utime, stime
        return total / os.sysconf("SC_CLK_TCK")


def group_pids(pgid: int) -> list[int]:
    pids = []
    for p in os.listdir("/proc"):
        try:
            if p.isdigit() and os.getpgid(int(p)) == pgid:
                pids.append(int(p))
        except OSError:
            pass
    return pids


def kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the process group, SIGKILL what is left after 20 s; returns when the group is gone."""
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            proc.poll()  # reap the leader so the group can empty
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


def nanoserve_tree() -> Path:
    """The checkout whose nanoserve this process runs (PYTHONPATH=<tree> picks another one)."""
    import nanoserve
    return Path(nanoserve.__file__).resolve().parents[1]


def nanoserve_cores(flags: list[str]) -> str:
    from nanoserve.parallel.placement import plan_placement
    threads = int(flags[flags.index("--cpu-threads") + 1]) if "--cpu-threads" in flags else None
    return plan_placement("cpu", threads, "--no-engine-process" not in flags).describe()


def vllm_env(cfg: PeerConfig) -> tuple[dict[str, str], str]:
    """vLLM-CPU's environment (KV budget, core binding) and its cores in words."""
    env = {"VLLM_CPU_KVCACHE_SPACE": str(max(1, round(cfg.kv_cache_gb)))}  # vLLM int()s it: whole GiB only
    if cfg.vllm_cores == "default":
        return env, "its default binding (model on all cores but one, that one for its scheduler)"
    env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{os.cpu_count() - 1}"
    return env, f"model bound to all cores (VLLM_CPU_OMP_THREADS_BIND={env['VLLM_CPU_OMP_THREADS_BIND']})"


def start(spec: ServerSpec, cfg: PeerConfig, num_blocks: int | None = None) -> Server:
    """`num_blocks` pins vLLM's KV to that many 128-token blocks (the device budget of a tier run)."""
    port = free_port()
    if spec.kind == "nanoserve":
        cmd = [sys.executable, "-m", "nanoserve.server.cli", "--host", "127.0.0.1", "--port", str(port),
               "--dtype", cfg.dtype, "--kv-cache-gb", str(cfg.kv_cache_gb), "--log-level", "warning",
               *spec.flags]
        tree = spec.tree or nanoserve_tree()
        return Server(spec.label, cmd, port, f"{nanoserve_cores(spec.flags)} ({tree})",
                      {"PYTHONPATH": str(tree)})
    if spec.kind == "vllm":
        env, cores = vllm_env(cfg)
        cmd = [cfg.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", export_embedded_hf(),
               "--dtype", cfg.dtype, "--max-model-len", "4096", "--host", "127.0.0.1", "--port", str(port),
               "--served-model-name", "smollm2", "--enable-prompt-tokens-details", "--disable-log-stats",
               *spec.flags]
        if num_blocks:
            cmd += ["--num-gpu-blocks-override", str(num_blocks)]
        return Server(spec.label, cmd, port, cores, env)
    n = str(cfg.llamacpp_threads)
    model = cfg.llamacpp_model or str(embedded_gguf())
    cmd = [cfg.llama_server, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t", n, "-tb", n,
           "-c", str(cfg.llamacpp_ctx), "-np", str(cfg.llamacpp_slots), "-a", "smollm2",
           *cfg.llamacpp_flags, *spec.flags]
    return Server(spec.label, cmd, port, f"{n} compute thread(s), quantized GGUF as shipped")


# waits for its stdin to close (the benchmark closing it, or dying), then lets the vLLM group run: a
# stopped group's worker would otherwise never read its own closed stdin and exit
GUARD = """
import os, signal, sys
sys.stdin.read()
try:
    os.killpg(int(sys.argv[1]), signal.SIGCONT)
except ProcessLookupError:
    pass
"""


class VllmOffline:
    """vLLM's offline `LLM` in its own venv, loaded once, one job per stdin line, so a benchmark can
    alternate nanoserve and vLLM runs (A B A B ...) without reloading either. This file is also the
    worker (`--vllm-worker`), so the two sides cannot drift apart. Between its jobs the worker's
    process group is stopped (SIGSTOP): idle, its processes still polled ~0.2 of a core (1.02
    core-seconds in 5 s), which slowed nanoserve's runs beside it by ~20% (7.73 s alone, 9.35 s
    beside it: 32 x 256 -> 128, the same tree).
    `with VllmOffline(cfg) as v: v.run(prompt_token_ids, max_tokens)` -> timing dict."""

    def __init__(self, cfg: PeerConfig) -> None:
        env, self.cores = vllm_env(cfg)
        cmd = [cfg.vllm_python, os.path.abspath(__file__), "--vllm-worker", export_embedded_hf(), cfg.dtype]
        self.proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, start_new_session=True)
        self.startup = self._result()
        # stopped, the worker cannot see its stdin close: if this process dies without close() (SIGKILL,
        # an unhandled SIGTERM), the guard, outside the stopped group, sees its own stdin close instead
        self.guard = subprocess.Popen([sys.executable, "-c", GUARD, str(self.proc.pid)],
                                      stdin=subprocess.PIPE, start_new_session=True)
        self._signal(signal.SIGSTOP)

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def _result(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(MARKER):
                return json.loads(line[len(MARKER):])
        raise RuntimeError(f"vLLM worker exited (rc={self.proc.wait()}); see its stderr")

    def run(self, prompt_token_ids: list[list[int]], max_tokens: int) -> dict:
        self._signal(signal.SIGCONT)
        try:
            self.proc.stdin.write(json.dumps({"prompts": prompt_token_ids, "max_tokens": max_tokens})
                                  + "\n")
            self.proc.stdin.flush()
            return self._result()
        finally:
            self._signal(signal.SIGSTOP)

    def __enter__(self) -> VllmOffline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._signal(signal.SIGCONT)
        self.guard.stdin.close()
        self.guard.wait()
        self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
        kill_group(self.proc)


def _vllm_worker(hf_dir: str, dtype: str) -> None:
    from vllm import LLM, SamplingParams  # only importable in the vLLM venv

    t0 = time.perf_counter()
    llm = LLM(model=hf_dir, dtype=dtype, max_model_len=4096, seed=0)
    llm.generate([{"prompt_token_ids": [100 + i for i in range(64)]}],
                 SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)  # warm-up
    print(MARKER + json.dumps({"startup_s": time.perf_counter() - t0}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": ids} for ids in job["prompts"]], params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        print(MARKER + json.dumps({"elapsed_s": elapsed,
                                   "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                                   "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs)}), flush=True)


# ---- llama.cpp as a side of latency.py -------------------------------------------------------------
LLAMACPP_FLAGS = ("-kvu", "--cache-ram", "0", "--no-webui")


def find_llama_server(path: str) -> str | None:
    """The binary: a path or a name on $PATH; None when there is none."""
    found = shutil.which(path)
    return str(Path(found).resolve()) if found else None


@dataclass(frozen=True)
class GgufFacts:
    weight_bytes: int        # every tensor of the file: what a decode step streams
    kv_bytes_per_token: int  # K and V of every layer, 2 bytes an element (f16 / bf16)


def gguf_facts(path: Path) -> GgufFacts:
    from nanoserve.models.gguf_reader import WeightsReader
    r = WeightsReader(str(path))
    arch = r.fields["general.architecture"].contents()
    meta = lambda key: r.fields[f"{arch}.{key}"].contents()  # noqa: E731
    heads = meta("attention.head_count")
    kv_heads = meta("attention.head_count_kv") if f"{arch}.attention.head_count_kv" in r.fields else heads
    head_dim = meta("embedding_length") // heads
    kv = meta("block_count") * kv_heads * head_dim * 2 * 2
    return GgufFacts(sum(int(t.n_bytes) for t in r.tensors), kv)


class LlamaRunning:
    """One started llama-server with latency.py's side interface: run() and memory()."""

    def __init__(self, server: Server, load_s: float, weight_bytes: int) -> None:
        self.server, self.load_s, self.weight_bytes = server, load_s, weight_bytes
        self.decode_ms_per_token: list[float] = []  # the server's own timings, batch-1 requests

    def _one(self, ids: list[int], max_tokens: int, stream: bool) -> tuple[dict, list[float]]:
        """The final response and, streamed, the times its tokens arrived."""
        body = json.dumps({"prompt": ids, "n_predict": max_tokens, "ignore_eos": True,
                           "cache_prompt": False, "temperature": 0.0, "stream": stream,
                           "return_tokens": True}).encode()
        req = urllib.request.Request(self.server.url + "/completion", body,
                                     {"Content-Type": "application/json"})
        stamps: list[float] = []
        with urllib.request.urlopen(req, timeout=3600) as r:
            if not stream:
                out = json.load(r)
            for line in r if stream else ():
                if line.startswith(b"data: "):
                    out = json.loads(line[6:])
                    # a chunk may carry several tokens, and a token may come with none (a random-weight
                    # model's output: 32 chunks for 33 tokens): the final chunk then stamps the end
                    n = len(out.get("tokens") or ()) if not out["stop"] else int(len(stamps) < max_tokens)
                    stamps += [time.perf_counter()] * max(n, int(not out["stop"]))
        if (out["tokens_predicted"], out["tokens_evaluated"]) != (max_tokens, len(ids)) or \
                (stream and len(stamps) != max_tokens):
            got = f"{out['tokens_predicted']} / {out['tokens_evaluated']} ({len(stamps)} streamed)"
            raise RuntimeError(f"llama-server predicted / evaluated {got} tokens, "
                               f"asked {max_tokens} / {len(ids)}")
        return out, stamps

    def run(self, prompts: list[list[int]], max_tokens: int) -> dict:
        """All prompts at once; one prompt of more than one token is streamed, and then its first to
        last token's time is returned too (as nanoserve's side times its engine steps)."""
        stream = len(prompts) == 1 and max_tokens > 1
        c0, t0 = self.server.cpu_s(), time.perf_counter()
        with ThreadPoolExecutor(len(prompts)) as pool:
            outs = list(pool.map(lambda ids: self._one(ids, max_tokens, stream), prompts))
        res = {"elapsed_s": time.perf_counter() - t0, "cpu_s": self.server.cpu_s() - c0}
        if stream:
            (out, stamps), = outs
            self.decode_ms_per_token.append(out["timings"]["predicted_per_token_ms"])
            res["first_to_last_s"] = stamps[-1] - stamps[0]
        return res

    def memory(self) -> dict[str, float]:
        return {"resident memory (MB)": self.server.rss_mb(), "weights (MB)": self.weight_bytes / 1e6,
                "load (s)": self.load_s}


class LlamaServerSide:
    """A fresh llama-server per run (cold TTFT, a clean resident set, as nanoserve's sides)."""

    def __init__(self, binary: str, gguf: Path, threads: int, slots: int, kv_cache_gb: float,
                 act_bytes: int, need_tokens: int, warmup_len: int) -> None:
        facts = gguf_facts(gguf)
        # nanoserve's KV holds kv_cache_gb of K/V in the activation dtype: the same tokens here (f16)
        tokens = int(kv_cache_gb * (1 << 30) // (facts.kv_bytes_per_token * act_bytes // 2))
        ctx = max(tokens, need_tokens)
        self.cfg = replace(PeerConfig(), llama_server=binary, llamacpp_threads=threads, llamacpp_slots=slots,
                           llamacpp_model=str(gguf), llamacpp_ctx=ctx, llamacpp_flags=LLAMACPP_FLAGS)
        self.weight_bytes, self.warmup_len = facts.weight_bytes, warmup_len
        cpus = sorted(os.sched_getaffinity(0))
        same = "as many as nanoserve holds" if ctx == tokens else f"the workload's; nanoserve holds {tokens}"
        kv_mb = ctx * facts.kv_bytes_per_token / 1e6
        self.cores = (f"llama-server -t {threads} -tb {threads} on cpus {cpus} (inherited), -np {slots}, "
                      f"unified KV -c {ctx} tokens ({same}, {kv_mb:.0f} MB f16), "
                      f"{' '.join(LLAMACPP_FLAGS)}; GGUF as is, over HTTP")

    def measure(self, measure_fn: Callable[[LlamaRunning], dict]) -> dict:
        t0 = time.perf_counter()
        server = start(ServerSpec("llamacpp", "llamacpp"), self.cfg)
        try:
            running = LlamaRunning(server, time.perf_counter() - t0, self.weight_bytes)
            running.run(token_prompts(1, self.warmup_len, seed=-3), 1)  # nanoserve's warm-up
            out = measure_fn(running)
            if running.decode_ms_per_token:
                out["server_decode_ms_per_token"] = statistics.median(running.decode_ms_per_token)
            return out
        finally:
            server.stop()


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--vllm-worker":  # inside vLLM's venv: no nanoserve import
        _vllm_worker(sys.argv[2], sys.argv[3])
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", required=True, metavar="SPEC",
                    help="a server spec (LABEL=KIND[@TREE] [FLAGS]) to start, describe and stop")
    ap.add_argument("--dtype", default="bfloat16")
    add_peer_args(ap)
    args = ap.parse_args()
    spec = ServerSpec.parse(args.check)
    server = start(spec, peer_config(args, args.dtype))
    print(f"{spec.label} up at {server.base_url}, process group {server.proc.pid}; {server.cores}; "
          f"log {server.log.name}")
    server.stop()
    print("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
