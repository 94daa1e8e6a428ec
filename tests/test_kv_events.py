"""KV events for routers (--kv-events-config): a subscriber that decodes with vLLM 0.32's own schema rebuilds,
from the stream alone, exactly the blocks each tier holds after a workload that evicts from every tier,
salted chains included, in both hash modes; the replay socket, the topic, an idle restarted replica's
announcement, and the flag's refusals."""
from __future__ import annotations

import threading
import time
from typing import Any

import msgspec
import pytest
import zmq

from nanoserve import LLM, SamplingParams
from tests.conftest import random_prompts


# vLLM 0.32's event types as vLLM declares them (vllm/distributed/kv_events.py), which its subscribers use
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


ExternalBlockHash = bytes | int


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


END_SEQ = (-1).to_bytes(8, "big", signed=True)
DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


def external(h: bytes, int_hashes: bool) -> ExternalBlockHash:
    """vLLM's maybe_convert_block_hash."""
    return int.from_bytes(h, byteorder="big") & ((1 << 64) - 1) if int_hashes else h


def replay(endpoint: str, start: int) -> tuple[list[tuple[bytes, int, bytes]], list[bytes]]:
    """Ask the replay socket for the batches from `start` on: (topic, seq, payload)s and the end marker."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    sock.send_multipart((b"", start.to_bytes(8, "big")))
    got = []
    try:
        while True:
            assert sock.poll(10_000), "no answer from the replay socket"
            frames = sock.recv_multipart()[1:]  # (the empty delimiter)
            if frames[1] == END_SEQ:
                return got, frames
            got.append((frames[0], int.from_bytes(frames[1], "big"), frames[2]))
    finally:
        sock.close(linger=0)
        ctx.term()


class Router:
    """A router's end: a bound SUB that nanoserve connects to, receiving on its own thread from the start, as a
    router does (a bound SUB only sends its subscription once its thread calls into the socket); what it
    missed (PUB drops while the connection comes up) it asks the replay socket for."""

    def __init__(self, replay_endpoint: str | None = None, topic: bytes = b"") -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.endpoint = f"tcp://127.0.0.1:{self.sub.bind_to_random_port('tcp://127.0.0.1')}"
        self.replay_endpoint = replay_endpoint
        self.frames: dict[int, tuple[bytes, bytes]] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._receive)
        self.thread.start()

    def _receive(self) -> None:
        while not self.stop.is_set():
            if self.sub.poll(50):
                topic, seq, payload = self.sub.recv_multipart()
                self.frames[int.from_bytes(seq, "big")] = (topic, payload)

    def batches(self, quiet_s: float = 1.0) -> list[tuple[bytes, int, KVEventBatch]]:
        """The stream in order, once nothing more has arrived for `quiet_s`, gaps filled by replay."""
        seen = -1
        while seen != len(self.frames):
            seen = len(self.frames)
            time.sleep(quiet_s)
        frames = dict(self.frames)
        if self.replay_endpoint and (not frames or len(frames) <= max(frames)):  # what went before it was up
            frames |= {seq: (topic, payload) for topic, seq, payload in replay(self.replay_endpoint, 0)[0]}
        return [(frames[s][0], s, DECODER.decode(frames[s][1])) for s in sorted(frames)]

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.sub.close(linger=0)
        self.ctx.term()


def stream_check(events: list, bs: int, int_hashes: bool) -> tuple[dict[str, set], dict[str, int], dict]:
    """Replay the events as a parent-checking router does; returns what each medium holds, how many blocks
    each removed, and the extra key of each salted chain's first block, by its first tokens."""
    held: dict[str, set] = {"GPU": set(), "CPU": set(), "STORAGE": set()}
    removed, ever, roots = {m: 0 for m in held}, set(), {}
    assert isinstance(events[0], AllBlocksCleared)  # a starting replica: forget what it held before
    for e in events[1:]:
        assert not isinstance(e, AllBlocksCleared)
        if isinstance(e, BlockStored):
            n = len(e.block_hashes)
            assert e.block_size == bs and len(e.token_ids) == bs * n and e.group_idx == 0
            assert e.lora_id is None and e.lora_name is None and len(e.extra_keys) == n
            assert all(isinstance(h, int) and 0 <= h < 1 << 64 if int_hashes else
                       isinstance(h, bytes) and len(h) == 32 for h in e.block_hashes)
            # a router that checks parents indexes every block: each parent was announced before
            assert e.parent_block_hash is None or e.parent_block_hash in ever
            if e.parent_block_hash is None:
                roots[tuple(e.token_ids[:bs])] = e.extra_keys[0]
            assert e.extra_keys[1:] == [None] * (n - 1)
            assert not held[e.medium] & set(e.block_hashes), "stored twice without a removal"
            held[e.medium] |= set(e.block_hashes)
            ever |= set(e.block_hashes)
        else:
            assert e.group_idx == 0 and set(e.block_hashes) <= held[e.medium], "removed a block never stored"
            held[e.medium] -= set(e.block_hashes)
            removed[e.medium] += len(e.block_hashes)
    return held, removed, roots


@pytest.mark.parametrize("int_hashes", [True, False], ids=["int-hashes", "bytes-hashes"])
def test_a_router_rebuilds_every_tier_from_the_events(tiny_path, tmp_path, monkeypatch, int_hashes):
    if not int_hashes:
        monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    bs, salts = 4, [None] * 4 + ["tenant-a"] * 3 + ["tenant-b"] * 3
    prompts = random_prompts(10, 20, 60, seed=21)
    prompts[4] = prompts[7] = prompts[0]  # the same tokens under no salt and two salts: three chains
    replay_endpoint = f"ipc://{tmp_path}/replay"
    router = Router(replay_endpoint, topic=b"kv@replica-1")
    tiers = dict(dtype="float32", block_size=bs, num_kv_blocks=24, max_num_seqs=2, host_cache_gb=0.00008,
                 disk_cache_gb=0.00008, disk_cache_dir=str(tmp_path / "kv"))
    config = {"enable_kv_cache_events": True, "endpoint": router.endpoint, "replay_endpoint": replay_endpoint,
              "topic": "kv@replica-1"}
    try:
        with LLM(str(tiny_path("llama-gqa-tied")), kv_events_config=config, **tiers) as llm:
            params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, cache_salt=s) for s in salts]
            outs = llm.generate(prompts, params) + llm.generate(prompts[::-1], params[::-1])
            batches = router.batches()
            kv = llm.engine.kv
            tiers_now = {"GPU": kv.pool.index, "CPU": kv.host.pool.index, "STORAGE": kv.disk.pool.index}
            tiers_now = {m: {external(h, int_hashes) for h in index} for m, index in tiers_now.items()}
    finally:
        router.close()

    assert [seq for _, seq, _ in batches] == list(range(len(batches)))  # none lost
    assert {topic for topic, _, _ in batches} == {b"kv@replica-1"}
    assert {b.data_parallel_rank for _, _, b in batches} == {0}
    held, removed, roots = stream_check([e for _, _, b in batches for e in b.events], bs, int_hashes)
    assert held == tiers_now and all(held.values())
    assert all(removed.values())  # the workload evicted from every tier
    # a chain's first block is a prompt's; a salted one carries an id of its salt, never the salt
    first = {tuple(p[:bs]) for p in prompts}
    assert set(roots) <= first
    ids = {k[0] for k in roots.values() if k is not None}
    assert len(ids) == 2 and not ids & {"tenant-a", "tenant-b"} and len(set(map(len, ids))) == 1
    assert roots[tuple(prompts[1][:bs])] is None and roots[tuple(prompts[5][:bs])] is not None
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)

    # restarted on the same directory, and sent no request: it clears, then announces what its disk index
    # brought back, parents first (its shutdown also saved device-only KV, into a small disk)
    router = Router(replay_endpoint)
    try:
        with LLM(str(tiny_path("llama-gqa-tied")), kv_events_config=config | {"endpoint": router.endpoint,
                                                                               "topic": ""}, **tiers) as llm:
            restored = {external(h, int_hashes) for h in llm.engine.kv.disk.pool.index}
            restart = router.batches()
    finally:
        router.close()
    assert [seq for _, seq, _ in restart] == list(range(len(restart))) and restored
    events = [e for _, _, b in restart for e in b.events]
    assert isinstance(events[0], AllBlocksCleared) and {e.medium for e in events[1:]} == {"STORAGE"}
    stored = [h for e in events[1:] for h in e.block_hashes]
    assert sorted(stored, key=str) == sorted(restored, key=str)
    position = {h: i for i, h in enumerate(stored)}
    assert all(position[e.parent_block_hash] < position[e.block_hashes[0]] for e in events[1:]
               if e.parent_block_hash in position)
    assert {k[0] for e in events[1:] for k in e.extra_keys if k is not None} <= ids  # salts known again


def test_replay_and_topic(tiny_path, tmp_path):
    """Batches a subscriber missed come back from the replay socket by sequence number, then the end marker;
    live batches go out under the topic, and a subscriber to another topic gets none."""
    pub, rep = f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay"
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub, "replay_endpoint": rep,
              "topic": "kv@a", "buffer_steps": 4}
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    ctx = zmq.Context()
    subs = {}
    try:
        with LLM(str(tiny_path("llama-gqa-tied")), dtype="float32", block_size=4, num_kv_blocks=32,
                 kv_events_config=config) as llm:
            for prompt in random_prompts(6, 9, 12, seed=3):  # a batch each (its blocks), nobody listening
                llm.generate([prompt], params)
            missed, end = replay(rep, 0)
            assert end == [b"", END_SEQ, b""]
            seqs = [s for _, s, _ in missed]
            assert len(seqs) == 4 and seqs == list(range(seqs[0], seqs[0] + 4)) and seqs[0] > 0  # the last 4
            assert {t for t, _, _ in missed} == {b"kv@a"}
            assert [s for _, s, _ in replay(rep, seqs[2])[0]] == seqs[2:]
            assert all(DECODER.decode(p).events for _, _, p in missed)
            for topic in (b"kv@b", b"kv@a"):
                subs[topic] = ctx.socket(zmq.SUB)
                subs[topic].setsockopt(zmq.SUBSCRIBE, topic)
                subs[topic].connect(pub)
            for i in range(50):  # until the subscription has reached the publisher
                llm.generate(random_prompts(1, 9, 12, seed=10 + i), params)
                if subs[b"kv@a"].poll(100):
                    break
            topic, seq, payload = subs[b"kv@a"].recv_multipart()
            assert topic == b"kv@a" and int.from_bytes(seq, "big") > seqs[-1]
            assert DECODER.decode(payload).events
            assert not subs[b"kv@b"].poll(200)
    finally:
        for s in subs.values():
            s.close(linger=0)
        ctx.term()


def test_kv_events_config_is_vllms_json_checked_before_the_model_loads(capsys, monkeypatch):
    from nanoserve.config import EngineConfig, KVEventsConfig
    from nanoserve.server.cli import build_parser, main
    from nanoserve.config import from_args
    parse = lambda *argv: from_args(EngineConfig, build_parser().parse_args(list(argv))).kv_events_config
    vllms = ('{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": '
             '"tcp://*:5558", "buffer_steps": 500, "hwm": 1000, "max_queue_size": 2000, "topic": "kv@pod-1"}')
    assert parse("--kv-events-config", vllms) == KVEventsConfig(True, "zmq", "tcp://*:5557", "tcp://*:5558", 500,
                                                               1000, 2000, "kv@pod-1")
    assert parse("--kv-events-config", '{"enable_kv_cache_events": true}').publisher == "zmq"  # vLLM's default
    assert parse("--kv-events-config", '{"enable_kv_cache_events": false, "publisher": "zmq"}') is None
    assert parse("--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "null"}') is None
    assert parse("--kv-events-endpoint", "tcp://*:6000").endpoint == "tcp://*:6000"  # the shorthand
    assert parse("--kv-events-endpoint", "tcp://*:6000", "--kv-events-config", '{"topic": "t"}') == \
        KVEventsConfig(True, "zmq", "tcp://*:6000", topic="t")
    for flag, bad, says in (("--kv-events-config", '{"enable_kv_cache_events": true, "port": 1}',
                             "--kv-events-config: unknown field 'port'"),
                            ("--kv-events-config", '{"publisher": "kafka"}',
                             '--kv-events-config publisher must be "null" or "zmq", got "kafka"'),
                            ("--kv-events-config", '{"hwm": "lots"}', "--kv-events-config hwm must be an integer"),
                            ("--kv-events-config", '{"endpoint": "127.0.0.1:5557"}',
                             "--kv-events-config endpoint must be tcp://"),
                            ("--kv-events-config", "{", "--kv-events-config is not JSON"),
                            ("--kv-events-endpoint", "127.0.0.1:5557", "--kv-events-endpoint must be tcp://")):
        with pytest.raises(SystemExit) as exit_:  # before any model is looked at
            main(["--model", "/nonexistent", flag, bad])
        assert exit_.value.code == 2 and says in capsys.readouterr().err.strip().splitlines()[-1]
    assert EngineConfig().kv_events_int_hashes is True  # vLLM's default
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    assert EngineConfig().kv_events_int_hashes is False
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "yes")
    with pytest.raises(ValueError, match=r"\$VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES must be 0 or 1"):
        EngineConfig()
