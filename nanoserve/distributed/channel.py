"""The step messages from rank 0 to the other tensor-parallel ranks: pickled, sent by
torch.distributed broadcasts on a gloo group, so one mechanism serves one node and several.

A message fits one fixed-size frame in the common case (a decode step's plan is a few KB), so
it costs one broadcast; a longer one (a long prefill's token rows) sends its tail in a second."""
from __future__ import annotations

import pickle
import struct

import torch
import torch.distributed as dist

FRAME_BYTES = 16 << 10
_LEN = struct.Struct("<q")


class MessageChannel:
    def __init__(self, group: object, frame_bytes: int = FRAME_BYTES) -> None:
        self.group = group
        self.frame = torch.zeros(frame_bytes, dtype=torch.uint8)
        self.room = frame_bytes - _LEN.size

    def send(self, msg: object) -> None:
        """Rank 0 only."""
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        head = _LEN.pack(len(data)) + data[:self.room]
        self.frame[:len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        dist.broadcast(self.frame, src=0, group=self.group)
        if len(data) > self.room:
            dist.broadcast(torch.frombuffer(bytearray(data[self.room:]), dtype=torch.uint8), src=0, group=self.group)

    def recv(self) -> object:
        """The other ranks: blocks until rank 0 sends (or its connection closes: RuntimeError)."""
        dist.broadcast(self.frame, src=0, group=self.group)
        frame = self.frame.numpy().tobytes()
        (n,) = _LEN.unpack_from(frame)
        data = frame[_LEN.size:_LEN.size + min(n, self.room)]
        if n > self.room:
            tail = torch.empty(n - self.room, dtype=torch.uint8)
            dist.broadcast(tail, src=0, group=self.group)
            data += tail.numpy().tobytes()
        return pickle.loads(data)
