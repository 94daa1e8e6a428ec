"""The engine core builds each arriving request on its intake thread (engine/intake.py): a prompt's chain
of block digests is computed there, not in the loop, and the loop's scheduler finds it done; the chain
is the one the cache publishes under (a repeated prompt hits)."""
from __future__ import annotations

import asyncio
import importlib
import threading

import pytest

from nanoserve.client.engine_client import EngineClient
from nanoserve.config import EngineConfig
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.kernels import cpu_kernels
from nanoserve.kvcache import prefix
from nanoserve.sampling_params import SamplingParams
from nanoserve.server.metrics import ServerMetrics
from nanoserve.kvcache.native import KVKernels

HASHED: list[tuple[str, int]] = []  # (thread name, blocks) per chain_links call in the engine below
KERNELS: list = []  # the engine's bookkeeping kernels (kvcache/native.py)
# the engine imports this file by name (make_engine), which is another module object than pytest's
RECORDER = "tests.test_engine_intake"


def recording_engine(config: EngineConfig) -> LLMEngine:
    """An LLMEngine whose prefix chains record which thread hashed how many blocks."""
    real = prefix.chain_links

    def recorded(parent, token_ids, block_size, salt, digests_of=None):
        HASHED.append((threading.current_thread().name, len(token_ids) // block_size))
        return real(parent, token_ids, block_size, salt, digests_of)
    prefix.chain_links = recorded  # this engine runs in the test's process (in_process below)
    try:
        engine = LLMEngine(config)
        KERNELS.append((engine.kv.chains.digests_of, engine.kv.pool.kernels))
    except BaseException:
        prefix.chain_links = real
        raise
    engine.close = _restoring(engine.close, real)
    return engine


def _restoring(close, real):
    def wrapped():
        prefix.chain_links = real
        close()
    return wrapped


@pytest.fixture
def aengine(tiny_path):
    importlib.import_module(RECORDER).HASHED.clear()
    importlib.import_module(RECORDER).KERNELS.clear()
    config = EngineConfig(model=str(tiny_path("llama-gqa-tied")), dtype="float32", num_kv_blocks=64,
                          block_size=16)
    client = EngineClient(config, ServerMetrics("tiny"), in_process=True,
                          make_engine="tests.test_engine_intake:recording_engine")
    client.start()
    yield client
    client.stop()


async def _run(aengine, rid: str, prompt: list[int]):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    req = aengine.frontend.make_request(rid, prompt, params)
    return [out async for out in aengine.generate(req)][-1]


def test_prompts_are_hashed_on_the_intake_thread_and_hit_the_cache(aengine) -> None:
    prompt = [(7 * i + 3) % 200 + 1 for i in range(16 * 9 + 5)]  # 9 full blocks before the last token

    async def go():
        first = await _run(aengine, "a", prompt)
        again = await _run(aengine, "b", prompt)
        others = await asyncio.gather(*(_run(aengine, f"c{i}", prompt[i:]) for i in range(1, 4)))
        return first, again, others
    first, again, others = asyncio.run(go())
    hashed = importlib.import_module(RECORDER).HASHED
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 9 * 16  # the loop's chain is the same
    assert all(o.finished for o in [first, again, *others])
    prompts = [(name, n) for name, n in hashed if n >= 8]  # the five prompts' chains (8 or 9 blocks)
    assert len(prompts) == 5 and {name for name, _ in prompts} == {"nanoserve-intake"}
    # the loop only extends chains by generated tokens' blocks (4 tokens: at most one block each)
    assert all(n <= 1 for name, n in hashed if name != "nanoserve-intake")
    # the C++ hashing and the pool's bookkeeping kernels where this install built them (make install does)
    built = cpu_kernels.built()
    assert importlib.import_module(RECORDER).KERNELS == [
        (built.chain_digests if built is not None else None, KVKernels.of(built))]
