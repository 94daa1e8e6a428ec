"""The engine core in its own process (EngineClient <-> engine/core.py over zmq ipc://), on a tiny random
Llama: outputs identical to the in-process engine (greedy, seeded sampling with n=2, logprobs, stop
strings), aborts free blocks, fail_all, metrics across the boundary; an engine process killed mid-
request fails its requests with a 5xx and stops the server with a non-zero code; no engine process
outlives the API process, even when the API process is SIGKILLed; --no-engine-process serves too."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import pytest

from nanoserve.config import EngineConfig
from nanoserve.client.engine_client import EngineClient
from nanoserve.parallel.placement import plan_placement
from nanoserve.engine.protocol import EngineDead, EngineError
from nanoserve.llm import LLM
from nanoserve.sampling_params import SamplingParams
from nanoserve.server.metrics import ServerMetrics
from server_fixture import ServerProcess, m, running, wait_gone, post_in_background, stream_in_background

PROMPTS = ["hello world", "The quick brown fox jumps over", "a b c d e f g"]


@pytest.fixture(scope="module")
def tiny(tiny_path):
    return tiny_path("llama-gqa-tied")


def _config(path) -> EngineConfig:
    return EngineConfig(model=str(path), dtype="float32", num_kv_blocks=64, block_size=16)


# What the shared engine process reports when it dies: the last test on it kills it
DIED: list[str] = []


@pytest.fixture(scope="module")
def client(tiny):
    c = EngineClient(_config(tiny), ServerMetrics("tiny"), log_level="warning", on_dead=DIED.append)
    c.start()
    yield c
    c.stop()
    assert not running(c.pid)


async def _collect(c: EngineClient, rid: str, prompt, params: SamplingParams):
    req = c.frontend.make_request(rid, prompt, params)
    return [out async for out in c.generate(req)]


def _params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2),
            SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=10, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)]  # + a stop string from its output


def _stop_in(text: str) -> str:
    """Two non-space characters of `text`, preferably from its second third on, that do not open it
    (the tiny model's words are random, so a fixed stop string might never appear)."""
    for k in [*range(len(text) // 3, len(text) - 1), *range(1, len(text) // 3)]:
        sub = text[k:k + 2]
        if sub == sub.strip() and len(sub) == 2 and text.index(sub) > 0:  # something comes before it
            return sub
    raise AssertionError(f"no stop string to pick from {text!r}")


def test_outputs_match_the_in_process_engine(client, tiny):
    llm = LLM(str(tiny), dtype="float32", num_kv_blocks=64, block_size=16)
    params = _params()
    plain = llm.generate([PROMPTS[2]], dataclasses.replace(params[2], stop=[]))[0].outputs[0].text
    params[2] = dataclasses.replace(params[2], stop=[_stop_in(plain), "@@@"])

    async def run():
        return await asyncio.gather(*(_collect(client, f"r{i}", p, sp)
                                      for i, (p, sp) in enumerate(zip(PROMPTS, params))))
    streams = asyncio.run(run())
    offline = llm.generate(PROMPTS, params)
    for outs, ref in zip(streams, offline):
        final = outs[-1]
        assert final.finished and all(not o.finished for o in outs[:-1])
        assert final.prompt_token_ids == ref.prompt_token_ids and final.prompt == ref.prompt
        for got, want in zip(final.outputs, ref.outputs, strict=True):
            assert got.token_ids == want.token_ids
            assert got.text == want.text and got.stream_text == want.text
            assert (got.finish_reason, got.stop_reason) == (want.finish_reason, want.stop_reason)
            if want.logprobs is not None:
                assert [(lp.token_id, [t for t, _ in lp.top]) for lp in got.logprobs] == \
                       [(lp.token_id, [t for t, _ in lp.top]) for lp in want.logprobs]
        # the streamed outputs grow monotonically to the final one
        for a, b in zip(outs, outs[1:]):
            for ca, cb in zip(a.outputs, b.outputs):
                assert cb.token_ids[:len(ca.token_ids)] == ca.token_ids
    assert streams[2][-1].outputs[0].finish_reason == "stop"  # the stop string case really stopped


def test_stop_string_found_by_the_api_finishes_the_sequence_in_the_engine(client, tiny):
    """The engine process never detokenizes; the API process finds the stop string and tells the
    engine, which stops generating a round trip later (not at max_tokens) and frees the blocks.
    With n=2 only the choice that matched is stopped."""
    ref = LLM(str(tiny), dtype="float32", num_kv_blocks=64, block_size=16).generate(
        ["hello world"], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].outputs[0]
    stop = _stop_in(ref.text)

    async def run():
        before = await client.snapshot()
        outs = await _collect(client, "stop-api", "hello world",
                              SamplingParams(temperature=0, max_tokens=400, ignore_eos=True, stop=[stop]))
        for _ in range(200):
            snap = await client.snapshot()
            if snap.num_running == 0 and snap.tiers[0].blocks_in_use == 0:
                break
            await asyncio.sleep(0.05)
        return before, outs[-1].outputs[0], snap
    before, got, snap = asyncio.run(run())
    assert (got.finish_reason, got.stop_reason) == ("stop", stop)
    assert got.text == ref.text[:ref.text.index(stop)]
    assert got.token_ids == ref.token_ids[:len(got.token_ids)]
    assert snap.tiers[0].blocks_in_use == 0 and snap.num_running == 0
    assert snap.finished.get("stop", 0) == before.finished.get("stop", 0) + 1
    # the engine learns of the stop a round trip later (a tiny model steps in about a millisecond),
    # but far before max_tokens
    assert snap.generation_tokens - before.generation_tokens <= len(got.token_ids) + 100

    # n=2: a stop string that occurs in one choice's text only; that choice stops, the other runs on
    n2 = dict(temperature=0.9, seed=3, n=2, max_tokens=60, ignore_eos=True)
    free = asyncio.run(_collect(client, "n2-free", "hello world", SamplingParams(**n2)))[-1].outputs
    texts = [c.text for c in free]
    pick = next(((i, sub) for i in (0, 1) for k in range(1, len(texts[i]) - 1)
                 if (sub := texts[i][k:k + 2]) not in texts[1 - i] and sub == sub.strip() and len(sub) == 2
                 and texts[i].index(sub) > 0), None)
    assert pick is not None, f"no stop string in one choice only: {texts!r}"
    stopped, stop2 = pick
    final = asyncio.run(_collect(client, "stop-n2", "hello world", SamplingParams(**n2, stop=[stop2])))[-1]
    got_s, got_o = final.outputs[stopped], final.outputs[1 - stopped]
    assert (got_s.finish_reason, got_s.stop_reason) == ("stop", stop2)
    assert got_s.text == texts[stopped][:texts[stopped].index(stop2)]
    assert (got_o.finish_reason, got_o.text) == ("length", texts[1 - stopped])


def test_leaving_early_aborts_and_frees_blocks(client):
    async def run():
        req = client.frontend.make_request("early", "a b c d e f g h i j k l m n o p q r s",
                                           SamplingParams(max_tokens=200, ignore_eos=True))
        gen = client.generate(req)
        assert not (await gen.__anext__()).finished
        await gen.aclose()  # what a client disconnect does
        for _ in range(200):
            snap = await client.snapshot()
            if snap.tiers[0].blocks_in_use == 0 and snap.num_running == 0:
                break
            await asyncio.sleep(0.05)
        return snap
    snap = asyncio.run(run())
    assert snap.tiers[0].blocks_in_use == 0 and snap.num_running == snap.num_waiting == 0
    assert snap.finished.get("abort", 0) >= 1 and snap.invariant_violations == 0
    assert client.num_running == client.num_waiting == 0


def test_fail_all_fails_in_flight_requests_with_engine_dead(client):
    async def run():
        task = asyncio.create_task(_collect(client, "long", "hello",
                                            SamplingParams(max_tokens=400, ignore_eos=True)))
        while client.num_running == 0:
            await asyncio.sleep(0.01)
        client.fail_all("draining took too long")
        with pytest.raises(EngineDead, match="draining took too long"):
            await task
        return await _collect(client, "after", "hello", SamplingParams(max_tokens=3, ignore_eos=True))
    outs = asyncio.run(run())
    assert len(outs[-1].outputs[0].token_ids) == 3 and client.alive


def test_request_the_engine_refuses_gets_an_answer(client):
    """A request the API did not validate (here: out-of-vocabulary ids) is refused by the engine
    process with InvalidRequest, promptly, even when the engine is idle."""
    from nanoserve.engine.protocol import PromptRequest
    from nanoserve.sampling_params import InvalidRequest

    async def run():
        bad = PromptRequest("bad", None, [client.frontend.vocab_size + 5], SamplingParams(max_tokens=2), 2)
        with pytest.raises(InvalidRequest, match="out of vocabulary"):
            await asyncio.wait_for(_drain(client.generate(bad)), 30)
    asyncio.run(run())
    assert client.num_waiting == 0


async def _drain(gen) -> None:
    async for _ in gen:
        pass


def test_metrics_cross_the_boundary(client):
    text = client.observer.render(asyncio.run(client.snapshot())).decode()
    decode = [l for l in text.splitlines()
              if l.startswith('nanoserve:engine_step_seconds_count{kind="decode"')]
    assert decode and float(decode[0].split()[-1]) > 0
    ttft = [l for l in text.splitlines() if l.startswith("nanoserve:time_to_first_token_seconds_count")]
    assert float(ttft[0].split()[-1]) >= 3


def test_killed_engine_fails_requests_and_reports_dead(client):
    """The module's engine process, killed mid-request (the last test on it: one engine start fewer)."""
    c = client

    async def run():
        task = asyncio.create_task(_collect(c, "x", "hello", SamplingParams(max_tokens=400, ignore_eos=True)))
        while c.num_running == 0:
            await asyncio.sleep(0.01)
        os.kill(c.pid, signal.SIGKILL)
        with pytest.raises(EngineError, match="engine process died"):
            await task
        with pytest.raises(EngineDead):
            await _collect(c, "y", "hello", SamplingParams(max_tokens=3))
        return await c.snapshot()  # the last one known, without hanging
    asyncio.run(run())
    deadline = time.monotonic() + 10  # on_dead is called on the receiver thread, after the failures
    while not DIED and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not c.alive and DIED and "exit code -9" in DIED[0]


def test_engine_dies_with_a_sigkilled_api_process(tiny):
    script = textwrap.dedent(f"""
        import sys, time
        from nanoserve.config import EngineConfig
        from nanoserve.client.engine_client import EngineClient
        c = EngineClient(EngineConfig(model={str(tiny)!r}, dtype="float32", num_kv_blocks=16),
                         log_level="warning")
        c.start()
        print(c.pid, flush=True)
        time.sleep(600)
    """)
    api = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        engine_pid = int(api.stdout.readline())
        assert running(engine_pid)
        api.kill()
        api.wait()
        assert wait_gone([engine_pid], 15) == []
    finally:
        if api.poll() is None:
            api.kill()


def test_placement():
    p = plan_placement("cpu", None, True, cpus=[0, 1, 2, 3])
    assert (p.api_cpus, p.engine_cpus, p.engine_threads) == ((0,), (1, 2, 3), 3)
    p = plan_placement("cpu", 2, False, cpus=[4, 5, 6])
    assert (p.api_cpus, p.engine_cpus, p.engine_threads) == (None, None, 2)
    p = plan_placement("cpu", 4, True, cpus=[0, 1, 2, 3])  # every core asked for: shared, not split
    assert (p.api_cpus, p.engine_cpus, p.engine_threads) == (None, None, 4)
    p = plan_placement("cpu", None, True, cpus=[3])
    assert (p.api_cpus, p.engine_cpus, p.engine_threads) == (None, None, 1)
    p = plan_placement("cpu", None, True, cpus=[0, 1])  # 2 cores: the engine computes on both, shared
    assert (p.api_cpus, p.engine_cpus, p.engine_threads) == (None, None, 2)
    p = plan_placement("cpu", None, False, cpus=[0, 1])  # in the API's process: one core kept for the API
    assert (p.api_cpus, p.engine_cpus, p.engine_threads) == (None, None, 1)
    assert plan_placement("cuda", None, True).engine_threads is None
    with pytest.raises(ValueError):
        plan_placement("cpu", 0, True)


# ---- the server (two start-ups) -------------------------------------------------------------

def test_server_engine_killed_mid_request_gives_5xx_and_exits_nonzero(tiny):
    s = ServerProcess("--model", str(tiny), "--dtype", "float32")
    try:
        (engine_pid,) = s.children
        got: dict[str, object] = {}
        started = threading.Event()
        body = {"prompt": "hello", "max_tokens": 450, "ignore_eos": True}

        url = s.base_url + "/completions"
        threads = [stream_in_background(url, body, got, started), post_in_background(url, body, got)]
        for t in threads:
            t.start()
        assert started.wait(60)
        deadline = time.monotonic() + 60
        while m(s.metrics(), "nanoserve:num_requests_running") < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(engine_pid, signal.SIGKILL)
        health = []
        while s.proc.poll() is None:  # unhealthy from the moment it knows, until it is gone
            try:
                health.append(httpx.get(s.url + "/health", timeout=5).status_code)
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
        for t in threads:
            t.join(60)
        code = s.proc.wait(60)
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
    assert code == 1, s.logs()
    assert "engine process died" in s.logs()
    after = health[health.index(503):] if 503 in health else []
    assert set(health) <= {200, 503} and set(after) <= {503}  # once it knows, never healthy again
    plain = got["plain"]
    assert plain.status_code == 500 and "engine process died" in plain.json()["error"]["message"]
    lines = got["stream"]
    assert lines[-1] == "data: [DONE]"
    err = json.loads(lines[-2][6:])
    assert err["error"]["type"] == "server_error" and "engine process died" in err["error"]["message"]
    s.assert_no_orphans()


def test_server_in_process_engine(tiny):
    s = ServerProcess("--model", str(tiny), "--dtype", "float32", "--no-engine-process", "--cpu-threads", "1")
    try:
        assert s.children == []  # the engine runs in a thread of the API process
        r = s.client().completions.create(model=s.client().models.list().data[0].id, prompt="hello",
                                          max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 5
        assert m(s.metrics(), "nanoserve:engine_step_seconds_count", kind="decode") >= 1
    finally:
        code = s.terminate()
        s.log.close()
    assert code == 0
