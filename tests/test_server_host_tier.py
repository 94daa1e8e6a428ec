"""The host tier through the real server: a prefix pushed off the device comes back from host,
reported in usage.prompt_tokens_details and in /metrics, with the same greedy text."""
from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from server_fixture import ServerProcess, m

DOCS = [f"Document {i}: " + " ".join(f"{w}{i}" for w in ("alpha", "beta", "gamma", "delta", "epsilon")) * 12
        for i in range(4)]


@pytest.fixture(scope="module")
def server():
    # device: 29 blocks of 16 tokens (~3.5 of these ~126-token documents); host: all of them
    s = ServerProcess("--kv-cache-gb", "0.01", "--host-cache-gb", "0.05", "--max-num-seqs", "1")
    yield s
    s.stop()


def test_prefix_returns_from_host(server):
    client = server.client()
    model = client.models.list().data[0].id
    ask = lambda doc: client.completions.create(model=model, prompt=doc + " Summary:",  # noqa: E731
                                                max_tokens=6, temperature=0)
    first = ask(DOCS[0])
    assert first.usage.prompt_tokens > 100
    for doc in DOCS[1:]:
        ask(doc)
    again = ask(DOCS[0])
    details = again.usage.prompt_tokens_details
    # every full block of the prompt is reused (the last token is always computed); the device
    # kept only the oldest of them, the rest came back from host
    assert details.cached_tokens == (first.usage.prompt_tokens - 1) // 16 * 16, details
    assert details.cached_tokens == details.device_cached_tokens + details.host_cached_tokens
    assert details.host_cached_tokens >= 32, details
    assert again.choices[0].text == first.choices[0].text
    metrics = server.metrics()
    assert m(metrics, "nanoserve:prefix_cache_hits_total", tier="host") >= details.host_cached_tokens
    assert m(metrics, "nanoserve:kv_transfer_bytes_total", tier="host", direction="in") > 0
    assert m(metrics, "nanoserve:kv_transfer_bytes_total", tier="host", direction="out") > 0
    assert m(metrics, "nanoserve:kv_cache_blocks", tier="host", state="total") > 0
    assert m(metrics, "nanoserve:kv_cache_blocks", tier="host", state="in_use") == 0
    assert m(metrics, "nanoserve:kv_cache_blocks", tier="device", state="in_use") == 0
    # the device evicted, and every eviction was of a block whose KV the host also held
    assert m(metrics, "nanoserve:kv_clean_evictions_total", tier="device") > 0
    assert m(metrics, "nanoserve:kv_lossy_evictions_total", tier="device") == 0
    for direction in ("in", "out"):  # reported, and every save and load landed
        key = ("nanoserve:kv_transfer_failures_total", (("direction", direction), ("tier", "host")))
        assert metrics[key] == 0, sorted(k for k in metrics if "failures" in k[0])


def test_soak_mixed_traffic_with_disconnects_leaves_nothing_behind(server):
    """Bounded soak: 48 requests, 6 at a time, streaming and not, a shared long prefix and unique
    prompts, a third of the clients leaving early (after the first chunk, or by timing out).
    Afterwards nothing runs or waits, no block is in use in either tier, and the engine's own
    invariant checks (run whenever it goes idle) never failed."""
    rng = random.Random(7)
    url = server.base_url + "/completions"

    def one(i: int) -> str:
        shared = rng.random() < 0.6
        prompt = (DOCS[i % 2] if shared else f"Unique {i}: " + " ".join(str(rng.random()) for _ in range(8)))
        body = {"prompt": prompt + f" Question {i}?", "max_tokens": rng.randint(1, 12), "temperature": 0.7,
                "seed": i, "ignore_eos": True}
        leave = rng.random() < 0.33
        if rng.random() < 0.5:
            with httpx.stream("POST", url, json=dict(body, stream=True), timeout=120) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if leave and line.startswith("data: {"):
                        return "left"  # closing the response disconnects mid-stream
                    if line == "data: [DONE]":
                        return "done"
            return "cut"
        try:
            r = httpx.post(url, json=body, timeout=0.05 if leave else 120)
            assert r.status_code == 200, r.text
            return "done"
        except httpx.TimeoutException:
            return "left"

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(one, range(48)))
    assert "cut" not in results and results.count("done") >= 16, results
    deadline = time.monotonic() + 120
    while True:  # disconnects are noticed asynchronously; wait for the engine to settle
        metrics = server.metrics()
        busy = [m(metrics, "nanoserve:num_requests_running"), m(metrics, "nanoserve:num_requests_waiting"),
                m(metrics, "nanoserve:kv_cache_blocks", tier="device", state="in_use"),
                m(metrics, "nanoserve:kv_cache_blocks", tier="host", state="in_use")]
        if busy == [0, 0, 0, 0] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert busy == [0, 0, 0, 0], busy
    assert m(metrics, "nanoserve:kv_invariant_violations_total") == 0
    assert m(metrics, "nanoserve:engine_step_errors_total") == 0
    assert m(metrics, "nanoserve:prefix_cache_hits_total", tier="device") > 0
    client = server.client()  # and it still serves
    assert client.completions.create(model=client.models.list().data[0].id, prompt="hi",
                                     max_tokens=2).usage.completion_tokens == 2


def test_a_restart_serves_the_prefix_from_disk(tmp_path):
    """--disk-cache-gb: a document asked, the server stopped with SIGTERM, a new one started on the same
    directory: the document's blocks come back from disk (fp32: the same greedy text), and the directory
    holds only files nobody else can read."""
    directory = tmp_path / "kv"
    flags = ("--dtype", "float32", "--kv-cache-gb", "0.02", "--host-cache-gb", "0.02", "--disk-cache-gb",
             "0.05", "--disk-cache-dir", str(directory), "--max-num-seqs", "1")
    answers, usages = [], []
    for _ in range(2):
        s = ServerProcess(*flags)
        try:
            client = s.client()
            out = client.completions.create(model=client.models.list().data[0].id, prompt=DOCS[0] + " Summary:",
                                            max_tokens=6, temperature=0)
            answers.append(out.choices[0].text)
            usages.append(out.usage)
            disk_hits = m(s.metrics(), "nanoserve:prefix_cache_hits_total", tier="disk")
        finally:
            code, logs = s.terminate(), s.logs()
            s.stop()
        assert code == 0, logs
    full_blocks = (usages[0].prompt_tokens - 1) // 16 * 16
    assert usages[0].prompt_tokens_details.cached_tokens == 0
    assert usages[1].prompt_tokens_details.cached_tokens == full_blocks == disk_hits
    assert answers[1] == answers[0]
    assert directory.stat().st_mode & 0o777 == 0o700
    assert {f.name: f.stat().st_mode & 0o777 for f in directory.iterdir()} == {
        "blocks.dat": 0o600, "index.bin": 0o600, "hash_key": 0o600}
