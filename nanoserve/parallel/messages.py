"""The messages rank 0 sends the other tensor-parallel ranks, and their wire form.

Typed, never pickled: whoever can write into the shared-memory segment or reach a multi-node
deployment's ports could otherwise run code in every worker. A message is msgpack-encoded once on
rank 0 as [WIRE_VERSION, type name, fields] and decoded on each rank into its declared types
(msgspec checks every field: a list of ints is a list of ints). Bytes that are not such a message,
or of another version, raise MessageError: the rank stops with that error, nothing runs.

The messages are dataclasses, as engine/protocol.py's, so msgspec is imported only here, on first
use (the offline engine on one rank runs without it). Encode + decode of a decode Step, type checks
included, is below pickle's: `python bench/latency.py --tp-wire` (README, Tensor parallelism)."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal, Union

from nanoserve.runner.step_plan import StepPlan

WIRE_VERSION = 2  # bump on any change to a message's fields: nodes of two versions refuse each other


class MessageError(RuntimeError):
    """A step message that is not one: malformed, truncated, of another version, or unexpected."""


ConfigValue = Union[str, int, float, bool, None]


@dataclass
class Setup:
    config: dict[str, ConfigValue]  # EngineConfig fields: rank 0's, so every node runs the same settings
    model_name: str
    model_path: str       # the (materialized) model folder; other nodes need the same path
    dtype: Literal["float32", "bfloat16", "float16"]  # a torch attribute name: only these


@dataclass(frozen=True)
class CopyCommand:
    lane: Literal["save", "load"]  # device -> host, host -> device
    src_ids: list[int]
    dst_ids: list[int]


@dataclass
class Step:
    plan: StepPlan | None  # None: copies only (rank 0 waits for one and has no step to run)
    copies: list[CopyCommand]


@dataclass
class Stop:
    pass


Message = Union[Setup, Step, Stop]
_TYPES: dict[str, type] = {t.__name__: t for t in (Setup, Step, Stop)}


@functools.cache
def _codec():
    import msgspec
    return (msgspec, msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(tuple[int, str, msgspec.Raw]),
            {name: msgspec.msgpack.Decoder(t) for name, t in _TYPES.items()})


def encode(msg: Message) -> bytes:
    _, enc, _, _ = _codec()
    return enc.encode((WIRE_VERSION, type(msg).__name__, msg))


def decode(data: bytes | memoryview, expect: type | tuple[type, ...] = (Setup, Step, Stop)) -> Message:
    """-> the message, of one of the `expect` types; MessageError for anything else."""
    msgspec, _, envelope, decoders = _codec()
    try:
        version, name, body = envelope.decode(data)
    except msgspec.DecodeError as e:  # ValidationError is one
        raise MessageError(f"malformed tensor-parallel message ({len(data)} bytes): {e}") from None
    if version != WIRE_VERSION:
        raise MessageError(f"tensor-parallel message of wire version {version}; this rank speaks "
                           f"{WIRE_VERSION} (every node must run the same nanoserve)")
    if name not in decoders:
        raise MessageError(f"unknown tensor-parallel message type {name[:40]!r}")
    try:
        msg = decoders[name].decode(body)
    except msgspec.DecodeError as e:
        raise MessageError(f"malformed tensor-parallel {name} message: {e}") from None
    if not isinstance(msg, expect):
        raise MessageError(f"unexpected tensor-parallel message {name} here")
    return msg
