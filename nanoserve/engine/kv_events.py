"""The engine's KV-events publisher: each step's events (kvcache/events.py) as one batch on a ZMQ PUB
socket, framed as vLLM frames them: (topic, 8-byte big-endian sequence number, msgpack batch), the topic
empty. A subscriber that misses sequence numbers lost batches (PUB drops past its high-water mark and
while nothing is connected); vLLM's replay socket is not offered, so such a router resynchronises from
the next AllBlocksCleared, which a replica sends when it starts."""
from __future__ import annotations

import logging

import msgspec
import zmq

from nanoserve.kvcache.events import KVEventBatch, KVEventLog

log = logging.getLogger("nanoserve")

HIGH_WATER_MARK = 100_000  # batches queued for a slow subscriber before PUB drops


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard address (or ipc/inproc) binds, a host connects to a subscriber that binds."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    def __init__(self, endpoint: str, block_size: int) -> None:
        self.log = KVEventLog(block_size)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(HIGH_WATER_MARK)
        self._pub.linger = 1000  # what close() leaves time to deliver
        try:
            (self._pub.bind if binds(endpoint) else self._pub.connect)(endpoint)
        except zmq.ZMQError as e:
            self.close()
            raise ValueError(f"--kv-events-endpoint {endpoint}: {e}") from None
        self._encoder = msgspec.msgpack.Encoder()
        self.seq = 0
        log.info("KV events: publishing to %s", endpoint)

    def flush(self) -> None:
        """Send what the log holds, if anything (never blocks: past the high-water mark PUB drops)."""
        batch: KVEventBatch | None = self.log.take()
        if batch is None:
            return
        self._pub.getsockopt(zmq.EVENTS)  # take in new subscriptions first, else a new one misses this
        try:
            self._pub.send_multipart((b"", self.seq.to_bytes(8, "big"), self._encoder.encode(batch)),
                                     flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # nobody connected, or a subscriber this far behind: it sees the gap in sequence numbers
        self.seq += 1

    def close(self) -> None:
        self._pub.close()
        self._ctx.term()
