"""The servers and engines a benchmark runs: nanoserve (this checkout or another one), vLLM-CPU and
llama.cpp's server, each started and stopped the same way for every comparison.

A server runs in its own process group (setsid), on 127.0.0.1 and a free port, logs to a file, is
ready when its health route answers, and is stopped by SIGTERM to the whole group, then SIGKILL to
what is left (vLLM's EngineCore and Worker processes outlive a killed parent otherwise). Each one
states the cores it computes on (`Server.cores`), and the tools print it beside their results.

vLLM-CPU lives in its own venv (/work/shared/peers.md): `--vllm-venv` or $VLLM_VENV. Its CPU binding
by default gives the model all cores but one and keeps that one for its scheduler; `--vllm-cores all`
binds the model to every core (VLLM_CPU_OMP_THREADS_BIND), the equal-cores control. llama.cpp's
`llama-server` binary: `--llama-server` or $LLAMA_SERVER (it serves the embedded GGUF as is).

    python bench/peers.py --check vllm          # start one, print its URL and cores, stop it
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from common import embedded_gguf, export_embedded_hf

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

    @property
    def vllm_python(self) -> str:
        return str(Path(self.vllm_venv) / "bin" / "python")


def add_peer_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("peers")
    g.add_argument("--vllm-venv", default=PeerConfig.vllm_venv, help="vLLM-CPU's venv (default: $VLLM_VENV)")
    g.add_argument("--vllm-cores", choices=["default", "all"], default="default",
                   help="vLLM's model on its default cores (all but one) or on all of them")
    g.add_argument("--llama-server", default=PeerConfig.llama_server, help="llama.cpp's llama-server binary")
    g.add_argument("--llamacpp-threads", type=int, default=1, help="llama-server -t / -tb")
    g.add_argument("--llamacpp-slots", type=int, default=32, help="llama-server -np (parallel requests)")


def peer_config(args: argparse.Namespace, dtype: str, kv_cache_gb: float = 1.0) -> PeerConfig:
    return PeerConfig(dtype, kv_cache_gb, args.vllm_venv, args.vllm_cores, args.llama_server,
                      args.llamacpp_threads, args.llamacpp_slots)


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
        deadline = time.monotonic() + startup_timeout  # a first vLLM start on a fresh machine compiles for minutes
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"{label} exited with {self.proc.returncode} during start-up; see {self.log.name}")
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
               "--dtype", cfg.dtype, "--kv-cache-gb", str(cfg.kv_cache_gb), "--log-level", "warning", *spec.flags]
        tree = spec.tree or nanoserve_tree()
        return Server(spec.label, cmd, port, f"{nanoserve_cores(spec.flags)} ({tree})", {"PYTHONPATH": str(tree)})
    if spec.kind == "vllm":
        env, cores = vllm_env(cfg)
        cmd = [cfg.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", export_embedded_hf(),
               "--dtype", cfg.dtype, "--max-model-len", "4096", "--host", "127.0.0.1", "--port", str(port),
               "--served-model-name", "smollm2", "--enable-prompt-tokens-details", "--disable-log-stats", *spec.flags]
        if num_blocks:
            cmd += ["--num-gpu-blocks-override", str(num_blocks)]
        return Server(spec.label, cmd, port, cores, env)
    n = str(cfg.llamacpp_threads)
    model = cfg.llamacpp_model or str(embedded_gguf())
    cmd = [cfg.llama_server, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t", n, "-tb", n,
           "-c", str(cfg.llamacpp_ctx), "-np", str(cfg.llamacpp_slots), "-a", "smollm2", *spec.flags]
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
        self.proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, start_new_session=True)
        self.startup = self._result()
        # stopped, the worker cannot see its stdin close: if this process dies without close() (SIGKILL,
        # an unhandled SIGTERM), the guard, outside the stopped group, sees its own stdin close instead
        self.guard = subprocess.Popen([sys.executable, "-c", GUARD, str(self.proc.pid)], stdin=subprocess.PIPE,
                                      start_new_session=True)
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
            self.proc.stdin.write(json.dumps({"prompts": prompt_token_ids, "max_tokens": max_tokens}) + "\n")
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
    llm.generate([{"prompt_token_ids": [100 + i for i in range(64)]}], SamplingParams(temperature=0.0, max_tokens=8),
                 use_tqdm=False)  # warm-up
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


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--vllm-worker":  # inside vLLM's venv: no nanoserve import
        _vllm_worker(sys.argv[2], sys.argv[3])
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", required=True, metavar="SPEC", help="a server spec (see ServerSpec) to start and stop")
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
