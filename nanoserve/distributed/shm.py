"""Collectives through shared memory for the ranks of one CPU node.

gloo over loopback TCP costs ~0.5-1.2 ms per all-reduce on these machines; a 12-layer model makes
26 of them per step, which take 23 ms of a 63 ms step. Here each rank copies its
tensor into its own slot of a /dev/shm segment, publishes a sequence number, waits until every rank
has published it, and reads the slots: the sum (all-reduce, added in rank order, so every rank gets
the same bits) or the concatenation (the logits gather, rank 0 only).

Two slot sets alternate, so one wait per operation suffices: a rank starts writing set s % 2 for
operation s + 2 only after every rank has published s + 1, which each did after it had finished
reading operation s. A rank that dies leaves the others waiting: the waits give up at the deadline,
or as soon as the node's watchdog raises the abort flag. Tensors larger than a slot go through gloo."""
from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import torch

from nanoserve.distributed.channel import check_length

_LINE = 8  # int64s per cache line: each rank's flag on its own line
_SPINS = 2000  # polls with sched_yield before the waits start sleeping (oversubscribed cores)


def map_segment(path: Path, nbytes: int, create: bool) -> torch.Tensor:
    """A shared uint8 tensor over a /dev/shm file; `create` makes it (readable and writable by this
    user only; FileExistsError if the name is taken: never map a file someone else made) and
    allocates it (ENOSPC then, not SIGBUS on first touch, when /dev/shm is small)."""
    if create:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.fchmod(fd, 0o600)  # whatever the umask
            os.posix_fallocate(fd, 0, nbytes)
        finally:
            os.close(fd)
    return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)


def shm_supported() -> bool:
    """The waits below publish with plain stores and rely on x86's store ordering (TSO): data
    written before a flag is visible before it. Elsewhere: gloo."""
    return platform.machine().lower() in ("x86_64", "amd64")


def wait_until(ready, aborted, timeout_s: float | None, what: str = "answer") -> None:
    """Poll `ready()`: sched_yield for the first polls (a peer on another core answers within
    microseconds), then 0.1 ms sleeps (oversubscribed cores), 1 ms once a wait without deadline
    (an idle worker) has lasted a while. Raises on `aborted()` or after `timeout_s`."""
    polls, deadline = 0, None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        if aborted():
            raise RuntimeError("another tensor-parallel rank of this node failed (abort flag)")
        if ready():
            return
        polls += 1
        if polls < _SPINS:
            os.sched_yield()
        elif deadline is not None and time.monotonic() > deadline:
            raise RuntimeError(f"a tensor-parallel rank did not {what} within {timeout_s}s")
        else:
            time.sleep(0.001 if deadline is None and polls > _SPINS + 1000 else 0.0001)


class ShmCollectives:
    def __init__(self, path: Path, rank: int, size: int, slot_bytes: int, timeout_s: float,
                 create: bool) -> None:
        self.rank, self.size, self.slot_bytes, self.timeout_s = rank, size, slot_bytes, timeout_s
        header = (size + 1) * _LINE * 8
        self.buf = map_segment(path, header + 2 * size * slot_bytes, create)
        self.flags = self.buf[:header].view(torch.int64)[::_LINE]  # [size] sequence numbers, [size] abort
        self.data = self.buf[header:].view(2, size, slot_bytes)
        self.seq = 0

    def fits(self, t: torch.Tensor) -> bool:
        return t.numel() * t.element_size() <= self.slot_bytes

    def _exchange(self, t: torch.Tensor) -> torch.Tensor:
        """Publish `t` in this rank's slot; -> every rank's slot of this operation, [size, numel]."""
        self.seq += 1
        slots = self.data[self.seq % 2, :, :t.numel() * t.element_size()].view(t.dtype).view(self.size, -1)
        slots[self.rank].copy_(t.reshape(-1))
        self.flags[self.rank] = self.seq
        self._wait()
        return slots

    def _wait(self) -> None:
        wait_until(lambda: int(self.flags[:self.size].min()) >= self.seq, lambda: bool(self.flags[self.size]),
                   self.timeout_s, "reach the collective")

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        slots = self._exchange(t)
        flat = t.view(-1) if t.is_contiguous() else None
        out = flat if flat is not None else torch.empty(t.numel(), dtype=t.dtype)
        torch.add(slots[0], slots[1], out=out)
        for r in range(2, self.size):
            out.add_(slots[r])
        if flat is None:
            t.copy_(out.view(t.shape))
        return t

    def gather(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Rank 0: every rank's tensor, valid until its next collective; the others: None."""
        slots = self._exchange(t.contiguous())
        # views: a rank rewrites this set only after rank 0 has published its next operation
        return [slots[r].view(t.shape) for r in range(self.size)] if self.rank == 0 else None

    def abort(self) -> None:
        """Make every rank's current and future waits fail (a rank of the node died)."""
        self.flags[self.size] = 1


class ShmChannel:
    """The step messages (distributed/channel.py's job, bytes) through shared memory, for one CPU node:
    rank 0 writes an encoded message into one of two frames and publishes its sequence number; each
    rank reads it and publishes that it has. Rank 0 reuses a frame only once every rank has read
    the message before last in it. A message larger than a frame goes through `fallback` (gloo),
    which the frame says. An idle worker polls with growing sleeps (up to 1 ms): no deadline, since
    a server may be idle for hours; it dies with rank 0 (PR_SET_PDEATHSIG)."""

    def __init__(self, path: Path, rank: int, size: int, frame_bytes: int, timeout_s: float, create: bool,
                 fallback) -> None:
        self.rank, self.size, self.frame_bytes, self.fallback = rank, size, frame_bytes, fallback
        self.timeout_s = timeout_s
        header = (size + 2) * _LINE * 8
        self.buf = map_segment(path, header + 2 * frame_bytes, create).numpy()
        self.flags = self.buf[:header].view("int64")[::_LINE]  # [size] read seqs, written seq, abort
        self.frames = self.buf[header:].reshape(2, frame_bytes)
        self.seq = 0

    def send(self, data: bytes) -> None:
        self.seq += 1
        self._wait(lambda: int(self.flags[1:self.size].min()) >= self.seq - 2, idle=False)
        frame, n = self.frames[self.seq % 2], len(data)
        big = n + 8 > self.frame_bytes
        frame[:8].view("int64")[0] = -1 if big else n
        if not big:
            frame[8:8 + n] = memoryview(data)
        self.flags[self.size] = self.seq
        if big:
            self.fallback.send(data)

    def recv(self) -> bytes:
        """A message's bytes (a copy: the frame is rewritten once read); ValueError on a corrupt length."""
        self.seq += 1
        self._wait(lambda: int(self.flags[self.size]) >= self.seq, idle=True)
        frame = self.frames[self.seq % 2]
        n = int(frame[:8].view("int64")[0])
        data = (self.fallback.recv() if n == -1
                else frame[8:8 + check_length(n, self.frame_bytes - 8)].tobytes())
        self.flags[self.rank] = self.seq
        return data

    def _wait(self, ready, idle: bool) -> None:
        """`idle` (a worker waiting for work): no deadline; rank 0 waiting for a reader: timeout_s."""
        wait_until(ready, lambda: bool(self.flags[self.size + 1]), None if idle else self.timeout_s,
                   "read a step message")

    def abort(self) -> None:
        self.flags[self.size + 1] = 1
