"""Start the real `nanoserve` server as a subprocess on 127.0.0.1 and talk to it over HTTP.

Used by tests/test_server_*.py through module-scoped fixtures: one server per module, because
loading the model costs ~10-20 s on this machine. Every server is checked, when it exits, to leave
no process behind (the engine-core process must die with it)."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def start_errors(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, list[list[str]]]:
    """Start the real CLI where it should refuse to start: its exit code, its stderr, and the error
    records there, each as its lines (a record runs until the next record's timestamp, uvicorn's level
    or a traceback not logged)."""
    cmd = [sys.executable, "-m", "nanoserve.server.cli", "--host", HOST, "--port", str(free_port()), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180,
                         env=dict(os.environ, **(env or {})))
    records = re.split(r"\n(?=\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ |[A-Z]+: |Traceback )", out.stderr.strip())
    errors = [r.splitlines() for r in records if re.match(r"(\S+ \S+ )?ERROR|Traceback ", r)]
    return out.returncode, out.stderr, errors


class ServerProcess:
    def __init__(self, *args: str, env: dict[str, str] | None = None, startup_timeout: float = 240.0) -> None:
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.base_url = self.url + "/v1"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="nanoserve-test-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "nanoserve.server.cli", "--host", HOST, "--port", str(self.port),
               "--kv-cache-gb", "0.25", "--log-level", "warning", *args]
        full_env = dict(os.environ, **(env or {}))
        full_env.setdefault("OMP_NUM_THREADS", "2")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=full_env)
        self._wait_healthy(startup_timeout)
        self.children = child_pids(self.proc.pid)  # the engine-core process, unless --no-engine-process

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} during start-up:\n"
                                   f"{self.logs()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)  # a start takes seconds: polled finely, a test waits at most 0.1 s past it
        self.stop()
        raise RuntimeError(f"server not healthy after {timeout}s:\n{self.logs()}")

    def logs(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()[-5000:]

    def client(self, api_key: str = "unused", **kw):
        import openai
        return openai.OpenAI(base_url=self.base_url, api_key=api_key, max_retries=0, timeout=120, **kw)

    def async_client(self, api_key: str = "unused", **kw):
        import openai
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=api_key, max_retries=0, timeout=120, **kw)

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """{(sample name, sorted labels without model_name): value} from /metrics."""
        text = httpx.get(self.url + "/metrics", timeout=30).text
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
                out[(s.name, labels)] = s.value
        return out

    def terminate(self, timeout: float = 90.0) -> int:
        """SIGTERM and wait; returns the exit code. Fails if a child process outlives the server."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.assert_no_orphans()
        return self.proc.returncode

    def assert_no_orphans(self, timeout: float = 15.0) -> None:
        left = wait_gone(getattr(self, "children", []), timeout)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        assert not left, f"processes {left} outlived the server:\n{self.logs()}"

    def stop(self) -> None:
        self.terminate()
        self.log.close()
        os.unlink(self.log.name)


def child_pids(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except (OSError, IndexError, ValueError):
                pass
    return out


def running(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (an orphan's zombie may never be reaped here)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """The pids still running after up to `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while (left := [p for p in pids if running(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def m(metrics: dict, name: str, **labels) -> float:
    """One sample's value (0 if absent)."""
    return metrics.get((name, tuple(sorted(labels.items()))), 0.0)


def assert_error(resp: httpx.Response, status: int, param: str | None = "?") -> dict:
    assert resp.status_code == status, (resp.status_code, resp.text)
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) >= {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    if param != "?":
        assert err["param"] == param, err
    return err


def stream_in_background(url: str, body: dict, got: dict, started: threading.Event) -> threading.Thread:
    """POST a streaming request from a thread; its SSE lines land in got["stream"], `started` is set
    at the first one."""
    def run():
        lines = []
        with httpx.stream("POST", url, json=dict(body, stream=True), timeout=120) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    started.set()
        got["stream"] = lines
    return threading.Thread(target=run)


def post_in_background(url: str, body: dict, got: dict) -> threading.Thread:
    """POST a non-streaming request from a thread; its response lands in got["plain"]."""
    def run():
        got["plain"] = httpx.post(url, json=body, timeout=120)
    return threading.Thread(target=run)
