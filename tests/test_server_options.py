"""Server options that need their own server: API key (from NANOSERVE_API_KEY), --no-prefix-caching
and --max-queue with graceful SIGTERM on one server, --shutdown-timeout on another; plus `--help`."""
from __future__ import annotations

import dataclasses
import re
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from nanoserve.config import EngineConfig, ServerConfig, from_args
from nanoserve.server.cli import build_parser
from server_fixture import (HOST, ServerProcess, assert_error, free_port, m, post_in_background, start_errors,
                            stream_in_background)

KEY = "sk-test-1234"
LONG_PROMPT = ("The quick brown fox jumps over the lazy dog while the farmer watches from the porch and "
               "thinks about the harvest, the weather, and the price of grain at the market this autumn.")


def test_help_explains_every_flag():
    """Every configuration field with help text is a flag that --help shows, with that text."""
    out = subprocess.run([sys.executable, "-m", "nanoserve.server.cli", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0
    flagged = [f for cls in (EngineConfig, ServerConfig) for f in dataclasses.fields(cls)
               if "help" in f.metadata]
    assert len(flagged) >= 28
    for f in flagged:
        flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
        entry = re.search(rf"^  {re.escape(flag)}(?=[ ,\n])(.*?)(?=^  -|^\S|\Z)", out.stdout, re.M | re.S)
        assert entry is not None, flag
        assert f.metadata["help"].split(" (")[0] in " ".join(entry.group(1).split()), flag
    assert "NANOSERVE_API_KEY" in out.stdout


def test_prefix_caching_takes_vllm_flags_and_the_older_spelling():
    parser = build_parser()
    cases = {(): True, ("--enable-prefix-caching",): True, ("--no-enable-prefix-caching",): False,
             ("--no-prefix-caching",): False, ("--no-prefix-caching", "--enable-prefix-caching"): True}
    for argv, on in cases.items():
        assert from_args(EngineConfig, parser.parse_args(list(argv))).enable_prefix_caching is on, argv
    with pytest.raises(ValueError, match="drop --no-enable-prefix-caching"):
        from_args(EngineConfig, parser.parse_args(["--no-prefix-caching", "--host-cache-gb", "1"]))
    with pytest.raises(ValueError, match="--disk-cache-gb needs --host-cache-gb"):
        from_args(EngineConfig, parser.parse_args(["--disk-cache-gb", "1"]))
    with pytest.raises(ValueError, match="--disk-cache-gb is not supported with --tensor-parallel-size"):
        from_args(EngineConfig, parser.parse_args(["--host-cache-gb", "1", "--disk-cache-gb", "1", "-tp", "2"]))


@pytest.mark.parametrize("case", ["port taken", "host tier", "kv cache"])
def test_start_up_errors_are_printed_once_in_at_most_three_lines_before_the_model_loads(case):
    """Refused with exit code 2, the reason printed once (not by the engine and the API side both), and
    before the weights are read: the port by the API process, the memory budgets at the engine's start."""
    with socket.create_server((HOST, port := free_port())):  # taken while the server starts
        args, said = {"port taken": (["--port", str(port)], f"cannot listen on {HOST}:{port}"),
                      "host tier": (["--host-cache-gb", "100000"], "--host-cache-gb 100000 asks for"),
                      "kv cache": (["--device", "cpu", "--kv-cache-gb", "100000"],
                                   "--kv-cache-gb 100000 asks for"),
                      }[case]
        code, stderr, errors = start_errors(*args)
    assert code == 2, stderr
    [error] = errors
    assert len(error) <= 3 and said in error[0] and stderr.count(said) == 1, stderr
    assert "weights:" not in stderr


@pytest.fixture(scope="module")
def keyed():
    """One server for the option tests that leave it as they found it (one server start fewer);
    the last test here stops it. One sequence at a time, one waiting: the other tests send one
    request at a time."""
    # the SIGTERM test's stream must finish however slow the machine is (the default 30 s can run out on
    # a 2-core box at load 10)
    s = ServerProcess("--no-prefix-caching", "--served-model-name", "tiny", "--max-num-seqs", "1",
                      "--max-queue", "1", "--shutdown-timeout", "300", env={"NANOSERVE_API_KEY": KEY})
    yield s
    s.stop()


AUTH = {"Authorization": f"Bearer {KEY}"}


def test_api_key(keyed):
    assert_error(httpx.get(keyed.base_url + "/models"), 401)
    assert_error(httpx.get(keyed.base_url + "/models", headers={"Authorization": "Bearer nope"}), 401)
    assert_error(httpx.post(keyed.base_url + "/completions", json={"prompt": "hi"}), 401)
    assert_error(httpx.post(keyed.url + "/tokenize", json={"prompt": "hi"}), 401)
    assert httpx.get(keyed.url + "/health").status_code == 200
    assert httpx.get(keyed.url + "/metrics").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        keyed.client(api_key="wrong").models.list()
    c = keyed.client(api_key=KEY)
    assert [m.id for m in c.models.list().data] == ["tiny"]
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert r.model == "tiny" and r.usage.completion_tokens <= 3


def test_no_prefix_caching_reports_zero_cached(keyed):
    c = keyed.client(api_key=KEY)
    for _ in range(2):
        r = c.completions.create(model="tiny", prompt=LONG_PROMPT, max_tokens=2, temperature=0)
        assert r.usage.prompt_tokens > 32
        assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_auto_tool_choice_needs_the_flags(keyed):
    """Without --enable-auto-tool-choice, "auto" (explicit, or the default with tools) is a 400 naming
    tool_choice, as vLLM answers it (required and named choices need no parser: test_structured_server);
    "none" still works. The flag needs a parser."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {},
                                                                          "additionalProperties": False}}}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": [tool],
            "max_tokens": 8, "temperature": 0}
    for extra in ({}, {"tool_choice": "auto"}):
        err = assert_error(httpx.post(keyed.base_url + "/chat/completions", headers=AUTH,
                                      json={**body, **extra}, timeout=60), 400, "tool_choice")
        assert "--enable-auto-tool-choice" in err["message"]
    r = httpx.post(keyed.base_url + "/chat/completions", headers=AUTH, timeout=120,
                   json={**body, "tool_choice": "none", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2, r.text
    with pytest.raises(ValueError, match="--tool-call-parser"):
        ServerConfig(enable_auto_tool_choice=True)
    assert ServerConfig(enable_auto_tool_choice=True,
                        tool_call_parser="llama3_json").auto_tool_parser == "llama3_json"
    assert ServerConfig(tool_call_parser="hermes").auto_tool_parser is None


def test_max_queue_gives_503_with_retry_after(keyed):
    def one(i):
        return httpx.post(keyed.base_url + "/completions", timeout=120, headers=AUTH,
                          json={"prompt": f"Item {i}:", "max_tokens": 24, "ignore_eos": True,
                                "temperature": 0})
    with ThreadPoolExecutor(8) as ex:
        rs = list(ex.map(one, range(8)))
    codes = sorted(r.status_code for r in rs)
    assert set(codes) == {200, 503}, codes
    for r in rs:
        if r.status_code == 503:
            err = assert_error(r, 503)
            assert int(r.headers["retry-after"]) >= 1 and err["code"] == "server_overloaded"
        else:
            assert r.json()["usage"]["completion_tokens"] == 24
    # once the queue drains, requests are accepted again
    assert one(99).status_code == 200


def test_sigterm_finishes_in_flight_and_exits_0(keyed):
    """Runs last on this server: it stops it."""
    chunks: list[str] = []
    first = threading.Event()

    def stream():
        with httpx.stream("POST", keyed.base_url + "/completions", timeout=120, headers=AUTH,
                          json={"prompt": "Once upon a time", "max_tokens": 20, "ignore_eos": True,
                                "stream": True}) as r:
            for line in r.iter_lines():
                if line:
                    chunks.append(line)
                    first.set()

    t = threading.Thread(target=stream)
    t.start()
    assert first.wait(60)
    t0 = time.monotonic()
    code = keyed.terminate(timeout=330)
    t.join(30)
    assert code == 0, keyed.logs()
    assert chunks[-1] == "data: [DONE]"  # the in-flight request was allowed to finish
    assert any('"finish_reason": "length"' in c for c in chunks)
    assert time.monotonic() - t0 < 60
    with pytest.raises(httpx.ConnectError):
        httpx.get(keyed.url + "/health", timeout=5)


def test_sigterm_after_shutdown_timeout_fails_the_rest_cleanly():
    """With a short --shutdown-timeout, what cannot finish in time gets a JSON 503 (non-streaming)
    or an SSE error event then [DONE] (streaming); new requests meanwhile get 503; exit code 0."""
    s = ServerProcess("--shutdown-timeout", "1", "--max-num-seqs", "1")
    try:
        body = {"prompt": LONG_PROMPT, "max_tokens": 4000, "ignore_eos": True}
        got: dict[str, object] = {}
        started = threading.Event()

        url = s.base_url + "/completions"
        threads = [stream_in_background(url, body, got, started), post_in_background(url, body, got)]
        threads[0].start()
        assert started.wait(60)
        threads[1].start()
        deadline = time.monotonic() + 60  # the second request waits in the queue (max_num_seqs 1)
        while m(s.metrics(), "nanoserve:num_requests_waiting") < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        s.proc.send_signal(__import__("signal").SIGTERM)
        for t in threads:
            t.join(120)
        code = s.proc.wait(120)
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
    assert code == 0, s.logs()
    lines = got["stream"]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    err = __import__("json").loads(lines[-2][6:])
    assert set(err) == {"error"} and "shutting down" in err["error"]["message"]
    plain = got["plain"]
    assert plain.status_code == 503, plain.text
    assert_error(plain, 503)
