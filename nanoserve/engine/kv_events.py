"""The engine's KV-events publisher, as vLLM's ZMQ publisher behaves (--kv-events-config): the engine hands
each step's batch (kvcache/events.py), and an idle engine's, to a thread, which sends it on a PUB socket
framed (topic, 8-byte big-endian sequence number, msgpack batch) and keeps the last `buffer_steps` batches
for the replay socket: a ROUTER on `replay_endpoint` answering a request (identity, b"", start sequence,
8 bytes big-endian) with every kept batch from that number on, each (identity, b"", topic, sequence,
batch), then the end marker (identity, b"", b"", -1 as 8 signed bytes, b""). A subscriber that sees a gap
(PUB drops past its high-water mark and while nobody listens) asks for the missing batches; past what
the buffer keeps, it resynchronises from the next AllBlocksCleared. The step never waits on ZMQ: when the
thread is `max_queue_size` batches behind, a batch is dropped (logged), its number left as a gap."""
from __future__ import annotations

import logging
import queue
import threading
from collections import deque

import msgspec
import zmq

from nanoserve.config import KVEventsConfig
from nanoserve.kvcache.events import KVEventBatch, KVEventLog

log = logging.getLogger("nanoserve")

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
REPLAY_POLL_S = 0.05  # how soon an idle publisher answers a replay request


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard address (or ipc/inproc) binds, a host connects to a subscriber that binds."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    def __init__(self, config: KVEventsConfig, events: KVEventLog) -> None:
        self.events, self.config, self.seq, self.dropped = events, config, 0, 0
        self._queue: queue.Queue[tuple[int, KVEventBatch] | None] = queue.Queue(config.max_queue_size)
        self._ctx = zmq.Context()
        self._pub, self._replay = self._ctx.socket(zmq.PUB), None
        self._pub.set_hwm(config.hwm)
        self._pub.linger = 1000  # what close() leaves time to deliver
        try:
            (self._pub.bind if binds(config.endpoint) else self._pub.connect)(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.linger = 0
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            self._ctx.term()
            name = "replay_endpoint" if self._replay is not None else "endpoint"
            raise ValueError(f"--kv-events-config {name} {getattr(config, name)}: {e}") from None
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        log.info("KV events: publishing to %s%s", config.endpoint,
                 f", replay on {config.replay_endpoint}" if self._replay is not None else "")

    def flush(self) -> None:
        """Hand what the log holds, if anything, to the publisher thread (never blocks)."""
        batch = self.events.take()
        if batch is None:
            return
        try:
            self._queue.put_nowait((self.seq, batch))
        except queue.Full:
            if not self.dropped:
                log.warning("KV events: the publisher is %d batches behind; dropping (routers see a gap)",
                            self.config.max_queue_size)
            self.dropped += 1
        self.seq += 1

    def close(self) -> None:
        """Send what is queued (the last events of a shutdown), then stop."""
        self.flush()
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        self._ctx.term()

    def _run(self) -> None:
        encoder, topic = msgspec.msgpack.Encoder(), self.config.topic.encode()
        kept: deque[tuple[int, bytes]] = deque(maxlen=self.config.buffer_steps)
        try:
            while True:
                # a request is answered once what was handed over before it arrived is sent
                if self._replay is not None and self._replay.poll(0) and self._queue.empty():
                    self._answer_replay(topic, kept)
                try:
                    item = self._queue.get(timeout=REPLAY_POLL_S if self._replay is not None else None)
                except queue.Empty:
                    continue
                if item is None:
                    return
                seq, payload = item[0], encoder.encode(item[1])
                self._pub.getsockopt(zmq.EVENTS)  # take in new subscriptions first, else a new one misses this
                try:
                    self._pub.send_multipart((topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass  # nobody connected, or a subscriber this far behind: it sees the gap
                kept.append((seq, payload))
        except Exception:  # a bug: say so once, the engine keeps serving
            log.exception("KV events: the publisher thread failed; no more events are sent")
        finally:
            self._close_sockets()

    def _answer_replay(self, topic: bytes, kept: deque[tuple[int, bytes]]) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("KV events: a replay request of %d frames ignored (expected identity, b\"\", "
                        "8-byte start)", len(frames))
            return
        client, start = frames[0], int.from_bytes(frames[2], "big")
        for seq, payload in kept:
            if seq >= start:
                self._replay.send_multipart((client, b"", topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_OF_REPLAY, b""))

    def _close_sockets(self) -> None:
        self._pub.close()
        if self._replay is not None:
            self._replay.close()
