"""The engine client and the app under faults, on a tiny random Llama (fast to load): an exception
inside step() fails the affected requests with an error (HTTP 500 / an SSE error event followed by
[DONE]) and the engine core keeps serving; aborts free blocks; an idle engine core does not spin.
The core runs in a thread here (`in_process=True`: the same loop, zmq messages and output processing
as in its own process, over inproc://), so the fault can be injected by wrapping the real
LLMEngine.step."""
from __future__ import annotations

import asyncio
import json
import os
import time

import httpx
import pytest

from conftest import make_tiny_model
from nanoserve.config import EngineConfig
from nanoserve.engine.client import EngineClient
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.protocol import EngineError
from nanoserve.sampling_params import SamplingParams
from nanoserve.server.app import create_app
from nanoserve.server.metrics import ServerMetrics


class Flaky:
    """Wraps the real step(); raises on the calls listed in `fail_on` (1-based, counted from arm())."""

    def __init__(self, engine: LLMEngine) -> None:
        self.real, self.calls, self.fail_on = engine.step, 0, set()
        engine.step = self

    def arm(self, *fail_on: int) -> None:
        self.calls, self.fail_on = 0, set(fail_on)

    def __call__(self):
        self.calls += 1
        if self.calls in self.fail_on:
            raise RuntimeError("injected fault")
        return self.real()


@pytest.fixture(scope="module")
def setup(tmp_path_factory, embedded_dir):
    path = make_tiny_model(tmp_path_factory.mktemp("tiny-server"), "llama-gqa-tied", embedded_dir)
    made: list[LLMEngine] = []

    def make_engine(config: EngineConfig) -> LLMEngine:
        made.append(LLMEngine(config))
        return made[-1]
    aengine = EngineClient(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=64, block_size=16),
                           ServerMetrics("tiny"), in_process=True, make_engine=make_engine)
    aengine.start()
    engine = made[0]
    flaky = Flaky(engine)
    app = create_app(aengine, "tiny")
    yield engine, aengine, flaky, app
    aengine.stop()


async def _collect(aengine, engine, rid, prompt="hello world", **kw):
    req = aengine.frontend.make_request(rid, prompt, SamplingParams(temperature=0, ignore_eos=True, **kw))
    outs = []
    async for out in aengine.generate(req):
        outs.append(out)
    return outs


def test_step_error_fails_requests_and_engine_keeps_serving(setup):
    engine, aengine, flaky, _ = setup

    async def run():
        flaky.arm(3)
        results = await asyncio.gather(_collect(aengine, engine, "a", max_tokens=8),
                                       _collect(aengine, engine, "b", max_tokens=8), return_exceptions=True)
        assert all(isinstance(r, EngineError) for r in results), results
        assert "injected fault" in str(results[0])
        snap = await aengine.snapshot()
        assert snap.num_running == snap.num_waiting == 0
        assert snap.tiers[0].blocks_in_use == 0
        assert snap.step_errors >= 1
        outs = await _collect(aengine, engine, "c", max_tokens=5)
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 5
    asyncio.run(run())
    assert aengine.alive
    engine.check_invariants()


def test_leaving_early_aborts_and_frees_blocks(setup):
    engine, aengine, flaky, _ = setup
    flaky.arm()

    async def run():
        req = aengine.frontend.make_request("early", "a b c d e f g h i j k l m n o p q r s", SamplingParams(
            max_tokens=40, ignore_eos=True))
        gen = aengine.generate(req)
        first = await gen.__anext__()
        assert not first.finished
        await gen.aclose()  # what a client disconnect does
        for _ in range(100):
            snap = await aengine.snapshot()
            if snap.tiers[0].blocks_in_use == 0:
                break
            await asyncio.sleep(0.05)
        assert snap.tiers[0].blocks_in_use == 0 and snap.num_running == 0
        assert snap.finished.get("abort", 0) >= 1
    asyncio.run(run())
    engine.check_invariants()


def test_idle_engine_core_does_not_spin(setup):
    _, aengine, _, _ = setup
    tid = aengine._core_thread.native_id

    def cpu() -> float:
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    c0 = cpu()
    time.sleep(1.0)
    assert cpu() - c0 < 0.1


def _post(app, path, body):
    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post(path, json=body, timeout=60)
    return asyncio.run(run())


def test_error_after_stream_started_is_an_sse_error_event(setup):
    _, _, flaky, app = setup
    flaky.arm(3)  # tokens 1 and 2 stream, then the step fails
    r = _post(app, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10,
                                            "ignore_eos": True, "stream": True})
    assert r.status_code == 200
    events = [line[6:] for line in r.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])
    assert set(err) == {"error"} and err["error"]["type"] == "server_error"
    assert "injected fault" in err["error"]["message"]
    chunks = [json.loads(e) for e in events[:-2]]
    assert chunks and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks)


def test_error_before_response_is_http_500(setup):
    _, _, flaky, app = setup
    flaky.arm(2)
    r = _post(app, "/v1/completions", {"prompt": "hi", "max_tokens": 6, "ignore_eos": True})
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "server_error"
    flaky.arm()
    ok = _post(app, "/v1/completions", {"prompt": "hi", "max_tokens": 6, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 6


def test_failed_step_fails_only_its_requests_and_queued_ones_run(setup):
    """A request whose step raises fails alone; one still queued behind it (max_num_seqs = 1) is
    untouched and completes; the KV invariants hold afterwards."""
    engine, aengine, flaky, _ = setup
    flaky.arm()
    real_run = engine.runner.run

    def poisoned(scheduled):
        if any(s.seq.request_id == "poison" for s in scheduled):
            raise RuntimeError("poisoned batch")
        return real_run(scheduled)

    engine.runner.run = poisoned
    engine.scheduler.max_num_seqs = 1
    try:
        async def run():
            return await asyncio.gather(_collect(aengine, engine, "poison", max_tokens=8),
                                        _collect(aengine, engine, "queued", max_tokens=8), return_exceptions=True)
        bad, good = asyncio.run(run())
    finally:
        engine.runner.run = real_run
        engine.scheduler.max_num_seqs = 128
    assert isinstance(bad, EngineError) and "poisoned batch" in str(bad)
    assert not isinstance(good, BaseException), good
    assert good[-1].finished and len(good[-1].outputs[0].token_ids) == 8
    snap = asyncio.run(aengine.snapshot())
    assert snap.invariant_violations == 0 and snap.tiers[0].blocks_in_use == 0
