"""Host staging for a step's metadata: persistent device tensors filled from host twins (pinned on
CUDA) by async copies, so captured CUDA graphs replay with new contents at fixed addresses.

A pinned host buffer must not be rewritten while a copy that reads it is still queued: a step of
non-final prefill chunks samples nothing, so nothing else syncs between two steps. One event,
recorded after a step's last upload and waited on before the next step writes any host buffer,
orders the two (it allows one step of run-ahead and costs nothing when the sampler has synced).
"""
from __future__ import annotations

from typing import Callable, Protocol

import torch


class Event(Protocol):
    def record(self) -> None: ...
    def synchronize(self) -> None: ...


def _async_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src, non_blocking=True)


class Staging:
    """One per runner: makes the buffers and fences their reuse. On CPU the host twin *is* the
    device tensor (nothing to copy, nothing to wait for) unless `event` and `copy` are given:
    tests pass a fake stream that remembers which host buffers are still being read."""

    def __init__(self, device: torch.device, event: Event | None = None,
                 copy: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> None:
        self.device = device
        self.separate = device.type != "cpu" or event is not None
        self.event = event if event is not None else (torch.cuda.Event() if device.type == "cuda" else None)
        self.copy = copy or _async_copy
        self.pending = False

    def buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> Staged:
        return Staged(self, shape, dtype)

    def begin_writes(self) -> None:
        """Before a step writes any host buffer: wait until the previous step's copies have run."""
        if self.pending:
            self.event.synchronize()
            self.pending = False

    def end_uploads(self) -> None:
        """After a step's last upload."""
        if self.event is not None:
            self.event.record()
            self.pending = True


class Staged:
    """A persistent device tensor plus its host staging twin."""

    def __init__(self, staging: Staging, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.staging = staging
        self.dev = torch.zeros(shape, dtype=dtype, device=staging.device)
        self.host = torch.zeros(shape, dtype=dtype, pin_memory=staging.device.type == "cuda") \
            if staging.separate else self.dev
        self.np = self.host.numpy()

    def upload(self, n: int) -> torch.Tensor:
        """Copy the first n rows host -> device (async); returns the device view."""
        if self.host is not self.dev:
            self.staging.copy(self.dev[:n], self.host[:n])
        return self.dev[:n]
