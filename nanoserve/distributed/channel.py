"""The step messages from rank 0 to the other tensor-parallel ranks, as bytes (parallel/messages.py
encodes and decodes them; nothing here unpickles), sent by torch.distributed broadcasts on a gloo
group, so one mechanism serves one node and several.

A message fits one fixed-size frame in the common case (a decode step's plan is a few KB), so
it costs one broadcast; a longer one (a long prefill's token rows) sends its tail in a second."""
from __future__ import annotations

import struct

import torch
import torch.distributed as dist

FRAME_BYTES = 16 << 10
MAX_MESSAGE_BYTES = 1 << 30  # a length past this is a corrupt frame, not a plan: fail, don't allocate it
_LEN = struct.Struct("<q")


def check_length(n: int, limit: int = MAX_MESSAGE_BYTES) -> int:
    if not 0 <= n <= limit:
        raise ValueError(f"corrupt tensor-parallel message frame: length {n} (valid: 0..{limit})")
    return n


class MessageChannel:
    def __init__(self, group: object, frame_bytes: int = FRAME_BYTES) -> None:
        self.group = group
        self.frame = torch.zeros(frame_bytes, dtype=torch.uint8)
        self.room = frame_bytes - _LEN.size

    def send(self, data: bytes) -> None:
        """Rank 0 only."""
        head = _LEN.pack(len(data)) + data[:self.room]
        self.frame[:len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        dist.broadcast(self.frame, src=0, group=self.group)
        if len(data) > self.room:
            dist.broadcast(torch.frombuffer(bytearray(data[self.room:]), dtype=torch.uint8), src=0,
                           group=self.group)

    def recv(self) -> bytes:
        """The other ranks: blocks until rank 0 sends (or its connection closes: RuntimeError; a
        corrupt length: ValueError)."""
        dist.broadcast(self.frame, src=0, group=self.group)
        frame = self.frame.numpy().tobytes()
        n = check_length(_LEN.unpack_from(frame)[0])
        data = frame[_LEN.size:_LEN.size + min(n, self.room)]
        if n > self.room:
            tail = torch.empty(n - self.room, dtype=torch.uint8)
            dist.broadcast(tail, src=0, group=self.group)
            data += tail.numpy().tobytes()
        return data
