"""The engine client and the app under faults, on a tiny random Llama (fast to load): an exception
inside step() fails the affected requests with an error (HTTP 500 / an SSE error event followed by
[DONE]) and the engine core keeps serving; aborts free blocks; an idle engine core does not spin.
Both placements of the core: its own process (the default) and a thread (`--no-engine-process`);
faults come from tests/faulty_engine.py, armed through a file."""
from __future__ import annotations

import asyncio
import json
import os
import time

import httpx
import pytest

from nanoserve.config import EngineConfig
from nanoserve.client.engine_client import EngineClient
from nanoserve.engine.protocol import EngineError
from nanoserve.sampling_params import SamplingParams
from nanoserve.server.app import create_app
from nanoserve.server.metrics import ServerMetrics
from tests.faulty_engine import PLAN_ENV, FaultPlan


@pytest.fixture(scope="module", params=["process", "thread"])
def setup(request, tmp_path_factory, tiny_path):
    path = tiny_path("llama-gqa-tied")
    plan = FaultPlan(tmp_path_factory.mktemp(f"faults-{request.param}") / "plan.json")
    plan.arm()
    os.environ[PLAN_ENV] = str(plan.path)  # read by the engine (inherited by its process)
    aengine = EngineClient(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=64, block_size=16),
                           ServerMetrics("tiny"), in_process=request.param == "thread",
                           make_engine="tests.faulty_engine:make")
    aengine.start()
    app = create_app(aengine, "tiny")
    yield aengine, plan, app
    aengine.stop()
    del os.environ[PLAN_ENV]


async def _settled(aengine):
    """The snapshot once nothing runs and no block is held (aborts reach the engine asynchronously)."""
    for _ in range(100):
        snap = await aengine.snapshot()
        if snap.num_running == snap.num_waiting == 0 and snap.tiers[0].blocks_in_use == 0:
            break
        await asyncio.sleep(0.05)
    return snap


async def _collect(aengine, rid, prompt="hello world", **kw):
    req = aengine.frontend.make_request(rid, prompt, SamplingParams(temperature=0, ignore_eos=True, **kw))
    outs = []
    async for out in aengine.generate(req):
        outs.append(out)
    return outs


def test_step_error_fails_requests_and_engine_keeps_serving(setup):
    aengine, plan, _ = setup

    async def run():
        # the fault is armed once both requests run, so the failing step holds both whatever the
        # machine's speed (arming first let a loaded machine step "a" alone before "b" arrived)
        tasks = [asyncio.create_task(_collect(aengine, rid, max_tokens=200)) for rid in "ab"]
        while (await aengine.snapshot()).num_running < 2:
            await asyncio.sleep(0.01)
        plan.arm(1)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(r, EngineError) for r in results), results
        assert "injected fault" in str(results[0])
        snap = await _settled(aengine)
        assert snap.num_running == snap.num_waiting == 0 and snap.tiers[0].blocks_in_use == 0
        assert snap.step_errors >= 1 and snap.invariant_violations == 0
        outs = await _collect(aengine, "c", max_tokens=5)
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 5
    asyncio.run(run())
    assert aengine.alive


def test_leaving_early_aborts_and_frees_blocks(setup):
    aengine, plan, _ = setup
    plan.arm()

    async def run():
        req = aengine.frontend.make_request("early", "a b c d e f g h i j k l m n o p q r s", SamplingParams(
            max_tokens=40, ignore_eos=True))
        gen = aengine.generate(req)
        first = await gen.__anext__()
        assert not first.finished
        await gen.aclose()  # what a client disconnect does
        snap = await _settled(aengine)
        assert snap.tiers[0].blocks_in_use == 0 and snap.num_running == 0
        assert snap.finished.get("abort", 0) >= 1 and snap.invariant_violations == 0
    asyncio.run(run())


def test_idle_engine_core_does_not_spin(setup):
    aengine, _, _ = setup
    stat = (f"/proc/{aengine.proc.pid}/stat" if aengine.proc is not None
            else f"/proc/self/task/{aengine._core_thread.native_id}/stat")

    def cpu() -> float:  # the core's user + system time (the whole process: it runs nothing else)
        with open(stat) as f:
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
    _, plan, app = setup
    plan.arm(3)  # tokens 1 and 2 stream, then the step fails
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
    _, plan, app = setup
    plan.arm(2)
    r = _post(app, "/v1/completions", {"prompt": "hi", "max_tokens": 6, "ignore_eos": True})
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "server_error"
    plan.arm()
    ok = _post(app, "/v1/completions", {"prompt": "hi", "max_tokens": 6, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 6


def test_failed_step_fails_only_its_requests_and_queued_ones_run(setup):
    """A request whose step raises fails alone; one still queued behind it (max_num_seqs = 1) is
    untouched and completes; the KV invariants hold afterwards."""
    aengine, plan, _ = setup
    plan.arm(poison="poison", max_num_seqs=1)
    try:
        async def run():
            return await asyncio.gather(_collect(aengine, "poison", max_tokens=8),
                                        _collect(aengine, "queued", max_tokens=8), return_exceptions=True)
        bad, good = asyncio.run(run())
    finally:
        plan.arm()
    assert isinstance(bad, EngineError) and "poisoned batch" in str(bad)
    assert not isinstance(good, BaseException), good
    assert good[-1].finished and len(good[-1].outputs[0].token_ids) == 8
    snap = asyncio.run(_settled(aengine))
    assert snap.invariant_violations == 0 and snap.tiers[0].blocks_in_use == 0
