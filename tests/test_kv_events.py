"""KV events for routers (--kv-events-endpoint): a subscriber that knows only vLLM's wire format rebuilds,
from the stream alone, exactly the blocks each tier of the engine holds, after a workload that evicts
from both tiers."""
from __future__ import annotations

import threading
import time

import msgspec
import pytest
import zmq

from nanoserve import LLM, SamplingParams
from tests.conftest import random_prompts


# vLLM's event types, as a subscriber declares them (vllm/distributed/kv_events.py, array-like form)
class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class Subscriber:
    """A router's end: binds, and receives on its own thread from the start, as a router does (a bound SUB
    only sends its subscription once its thread calls into the socket)."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.endpoint = f"tcp://127.0.0.1:{self.sub.bind_to_random_port('tcp://127.0.0.1')}"
        self.frames: list[list[bytes]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._receive)
        self.thread.start()

    def _receive(self) -> None:
        while not self.stop.is_set():
            if self.sub.poll(50):
                self.frames.append(self.sub.recv_multipart())

    def batches(self, quiet_s: float = 1.0) -> list[tuple[bytes, int, KVEventBatch]]:
        """What arrived, once nothing more has for `quiet_s`."""
        seen = -1
        while seen != len(self.frames):
            seen = len(self.frames)
            time.sleep(quiet_s)
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        return [(topic, int.from_bytes(seq, "big"), decoder.decode(payload))
                for topic, seq, payload in self.frames]

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.sub.close(linger=0)
        self.ctx.term()


@pytest.fixture
def subscriber():
    s = Subscriber()
    yield s
    s.close()


@pytest.mark.parametrize("disk", [False, True], ids=["device+host", "device+host+disk"])
def test_a_router_rebuilds_every_tier_from_the_events(tiny_path, subscriber, tmp_path, disk):
    bs = 4
    prompts = random_prompts(10, 20, 60, seed=21)
    tiers = dict(disk_cache_gb=0.00008, disk_cache_dir=str(tmp_path / "kv")) if disk else {}
    with LLM(str(tiny_path("llama-gqa-tied")), dtype="float32", block_size=bs, num_kv_blocks=24,
             max_num_seqs=2, host_cache_gb=0.00008, kv_events_endpoint=subscriber.endpoint, **tiers) as llm:
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        outs = llm.generate(prompts, params) + llm.generate(prompts[::-1], params)
        batches = subscriber.batches()
        kv = llm.engine.kv
        device, host = set(kv.pool.index), set(kv.host.pool.index)
        on_disk = set(kv.disk.pool.index) if disk else set()

    assert [seq for _, seq, _ in batches] == list(range(len(batches)))  # none lost
    assert {topic for topic, _, _ in batches} == {b""}
    events = [e for _, _, b in batches for e in b.events]
    assert isinstance(events[0], AllBlocksCleared)  # a starting replica: forget what it held before
    held: dict[str, set] = {"GPU": set(), "CPU": set(), "DISK": set()}
    removed = {"GPU": 0, "CPU": 0, "DISK": 0}
    texts = {tuple(p[:bs]) for p in prompts}
    for e in events:
        if isinstance(e, AllBlocksCleared):
            held = {m: set() for m in held}
        elif isinstance(e, BlockStored):
            assert e.block_size == bs and len(e.token_ids) == bs * len(e.block_hashes) and e.lora_id is None
            assert all(isinstance(h, bytes) and len(h) == 32 for h in e.block_hashes)
            if e.parent_block_hash is None:  # a chain's first block: a prompt's first tokens
                assert tuple(e.token_ids[:bs]) in texts
            assert not held[e.medium] & set(e.block_hashes), "stored twice without a removal"
            held[e.medium] |= set(e.block_hashes)
        else:
            assert set(e.block_hashes) <= held[e.medium], "removed a block never stored"
            held[e.medium] -= set(e.block_hashes)
            removed[e.medium] += len(e.block_hashes)
    assert removed["GPU"] > 0 and removed["CPU"] > 0  # the workload evicted from both tiers
    assert held == {"GPU": device, "CPU": host, "DISK": on_disk} and device and host
    assert bool(removed["DISK"]) is bool(on_disk) is disk  # (and from the disk, when it has one)
    if disk:  # restarted on the same directory: it clears, then announces what its disk index brought back
        # (the first engine's shutdown events may still be in flight: wait for them, then the new stream
        # is the one numbered from 0 again)
        first = len(subscriber.batches())
        with LLM(str(tiny_path("llama-gqa-tied")), dtype="float32", block_size=bs, num_kv_blocks=24,
                 max_num_seqs=2, host_cache_gb=0.00008, kv_events_endpoint=subscriber.endpoint,
                 **tiers) as llm:
            llm.engine.step()  # (events go out with a step)
            restored = set(llm.engine.kv.disk.pool.index)
            restart = subscriber.batches()[first:]
            events = [e for _, _, b in restart for e in b.events]
        assert [seq for _, seq, _ in restart] == list(range(len(restart)))
        # (what it restored: its shutdown also saved device-only KV, into a small disk)
        assert isinstance(events[0], AllBlocksCleared) and restored
        assert {h for e in events[1:] if isinstance(e, BlockStored) for h in e.block_hashes} == restored
        assert {e.medium for e in events[1:]} == {"DISK"}
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)


def test_kv_events_endpoint_is_a_server_flag_checked_before_the_model_loads():
    from nanoserve.config import EngineConfig
    from nanoserve.server.cli import build_parser
    args = vars(build_parser().parse_args(["--kv-events-endpoint", "tcp://*:5557"]))
    assert args["kv_events_endpoint"] == "tcp://*:5557"
    with pytest.raises(ValueError, match="--kv-events-endpoint must be tcp://"):
        EngineConfig(kv_events_endpoint="127.0.0.1:5557")
