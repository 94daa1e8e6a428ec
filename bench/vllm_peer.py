"""vLLM (CPU build, in its own venv: see shared peers.md) as a benchmark peer, offline and served.

This file is both the parent-side API (stdlib only, plus nanoserve for the dtype) and, with
`--child`, the offline worker the vLLM interpreter runs, so the two sides cannot drift apart. The
worker loads the model once and then answers one job per stdin line, so a benchmark can alternate
nanoserve and vLLM runs (A B A B ...) without reloading either.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

VLLM_PYTHON = os.environ.get("NANOSERVE_VLLM_PYTHON", "/tmp/vllm-cpu/bin/python")
MARKER = "NANOSERVE_VLLM_RESULT "


def auto_dtype() -> str:
    """The dtype nanoserve's `--dtype auto` picks on this CPU; a peer runs in the same one (bf16 on an
    AVX2-only CPU would run emulated in vLLM and flatter us)."""
    import torch

    from nanoserve.config import EngineConfig
    return str(EngineConfig(dtype="auto").resolved_dtype(torch.device("cpu"))).removeprefix("torch.")


def cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        fields = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in f if ":" in line)}
    name = fields.get("model name", "unknown CPU")  # the last CPU's fields: all cores are alike here
    flags = set(fields.get("flags", "").split())
    feats = [f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f in flags]
    return f"{name}, {os.cpu_count()} cores ({' '.join(feats)})"


def _kv_env(kv_cache_gb: int) -> dict:
    # vLLM parses VLLM_CPU_KVCACHE_SPACE with int(): only whole GiB
    if kv_cache_gb < 1 or kv_cache_gb != int(kv_cache_gb):
        raise ValueError(f"kv_cache_gb must be a whole number of GiB >= 1, got {kv_cache_gb}")
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(int(kv_cache_gb))}


class VllmOffline:
    """`with VllmOffline(hf, "bfloat16") as v: v.run(prompt_token_ids, max_tokens)` -> timing dict."""

    def __init__(self, hf_dir: str, dtype: str, kv_cache_gb: int = 1) -> None:
        self.proc = subprocess.Popen([VLLM_PYTHON, os.path.abspath(__file__), "--child", hf_dir, dtype],
                                     env=_kv_env(kv_cache_gb), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, start_new_session=True)
        self.startup = self._result()

    def _result(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(MARKER):
                return json.loads(line[len(MARKER):])
        raise RuntimeError(f"vLLM worker exited (rc={self.proc.wait()}, python={VLLM_PYTHON}); see its stderr")

    def run(self, prompt_token_ids: list[list[int]], max_tokens: int) -> dict:
        self.proc.stdin.write(json.dumps({"prompts": prompt_token_ids, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        return self._result()

    def __enter__(self) -> VllmOffline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
        kill_group(self.proc)


class VllmServer:
    """The OpenAI server of vLLM-CPU on 127.0.0.1:`port`, in its own process group (its EngineCore can
    outlive a killed parent). `num_blocks` pins the device KV (vLLM's CPU blocks are 128 tokens)."""

    def __init__(self, hf_dir: str, dtype: str, port: int, kv_cache_gb: int = 1, num_blocks: int | None = None,
                 log_path: str = "/tmp/vllm_server.log") -> None:
        cmd = [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", hf_dir, "--dtype", dtype,
               "--max-model-len", "4096", "--host", "127.0.0.1", "--port", str(port),
               "--served-model-name", "smollm2", "--enable-prompt-tokens-details", "--disable-log-stats"]
        if num_blocks:
            cmd += ["--num-gpu-blocks-override", str(num_blocks)]
        self.url = f"http://127.0.0.1:{port}"
        self.base_url = self.url + "/v1"
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, env=_kv_env(kv_cache_gb), stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + 900  # a first start on a fresh machine compiles for minutes
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {self.proc.returncode}; see {log_path}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"vLLM server not healthy after 900 s; see {log_path}")

    def stop(self) -> None:
        kill_group(self.proc)
        self.log.close()


def kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the process group, SIGKILL what is left after 20 s."""
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                proc.poll()
                return
            proc.poll()  # reap the leader so the group can empty
            time.sleep(0.2)


def _child(hf_dir: str, dtype: str) -> None:
    from vllm import LLM, SamplingParams  # only importable in the vLLM venv

    t0 = time.perf_counter()
    llm = LLM(model=hf_dir, dtype=dtype, max_model_len=4096, seed=0)
    llm.generate([{"prompt_token_ids": [100 + i for i in range(64)]}], SamplingParams(temperature=0.0, max_tokens=8),
                 use_tqdm=False)  # warm-up
    print(MARKER + json.dumps({"startup_s": time.perf_counter() - t0}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)
        prompts = [{"prompt_token_ids": ids} for ids in job["prompts"]]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        out_toks = sum(len(o.outputs[0].token_ids) for o in outs)
        in_toks = sum(len(o.prompt_token_ids) for o in outs)
        print(MARKER + json.dumps({"elapsed_s": elapsed, "output_tokens": out_toks, "prompt_tokens": in_toks}),
              flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        _child(sys.argv[2], sys.argv[3])
    else:
        sys.exit("usage: run through bench/offline_throughput.py --peer vllm or bench/serve_vs_vllm.py")
