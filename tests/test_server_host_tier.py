"""The host tier through the real server: a prefix pushed off the device comes back from host,
reported in usage.prompt_tokens_details and in /metrics, with the same greedy text."""
from __future__ import annotations

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
    ask = lambda doc: client.completions.create(model=model, prompt=doc + " Summary:", max_tokens=6,  # noqa: E731
                                                temperature=0)
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
