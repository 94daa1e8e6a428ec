"""Messages between the API process and the engine-core process: msgpack over zmq PUSH/PULL.

API -> engine:  ["add", rid, prompt_token_ids, sampling params, arrival (monotonic, system-wide)]
                ["abort", rid] | ["finish", rid, choice indices, stop string] | ["fail_all", reason]
                | ["snapshot", token] | ["stop"]
engine -> API:  ["ready", ModelInfo] | ["failed", message]            (start-up handshake)
                ["batch", outputs, errors, records, snapshots, adds_seen, num_running, num_waiting]
                  output:   [rid, finished, cached, device_cached, host_cached, prompt_logprobs | None,
                             metrics | None, choices]
                  choice:   [index, new_token_ids, new_logprobs | None, finish_reason, stop_reason]
                  error:    [rid, kind ("engine" | "dead" | "invalid"), message, param, code]
                  record:   ["ttft", s] | ["itl", s] | ["e2e", rid, s] | ["step", kind, s]
                  snapshot: [token, EngineSnapshot fields]

Outputs travel as deltas (new token ids and logprobs) so a long completion costs O(new tokens) per
step on the wire, not O(all tokens). No text travels: the API process detokenizes and matches stop
strings (output_processor.py) and sends "finish" for a choice whose stop string it found.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import msgpack

from nanoserve.outputs import RequestOutput
from nanoserve.sampling_params import SamplingParams
from nanoserve.sequence import TokenLogprob


def pack(msg: list) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def unpack(data: bytes) -> list:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)  # logit_bias has int keys


def params_to_wire(p: SamplingParams) -> dict:
    return dataclasses.asdict(p)


def params_from_wire(d: dict) -> SamplingParams:
    return SamplingParams(**d)


def lps_to_wire(lps: list[TokenLogprob | None]) -> list:
    return [None if lp is None else [lp.token_id, lp.logprob, lp.top] for lp in lps]


def lps_from_wire(lps: list) -> list[TokenLogprob | None]:
    return [None if lp is None else TokenLogprob(lp[0], lp[1], [tuple(t) for t in lp[2]]) for lp in lps]


@dataclasses.dataclass
class ChoiceSent:
    """What the API process already has of one choice (engine side)."""
    num_tokens: int = 0
    num_logprobs: int = 0


def output_delta(out: RequestOutput, sent: dict[int, ChoiceSent], first: bool) -> list:
    """Encode `out` against what was sent before, and advance `sent`."""
    choices = []
    for c in out.outputs:
        s = sent.setdefault(c.index, ChoiceSent())
        new_lps = None
        if c.logprobs is not None:
            new_lps = lps_to_wire(c.logprobs[s.num_logprobs:])
            s.num_logprobs = len(c.logprobs)
        choices.append([c.index, c.token_ids[s.num_tokens:], new_lps, c.finish_reason, c.stop_reason])
        s.num_tokens = len(c.token_ids)
    prompt_lps = lps_to_wire(out.prompt_logprobs) if first and out.prompt_logprobs is not None else None
    return [out.request_id, out.finished, out.num_cached_tokens, out.num_device_cached_tokens,
            out.num_host_cached_tokens, prompt_lps, out.metrics if out.finished else None, choices]


def snapshot_to_wire(snap: Any) -> dict:
    return dataclasses.asdict(snap)


def snapshot_from_wire(d: dict) -> Any:
    from nanoserve.engine.async_engine import EngineSnapshot
    from nanoserve.kvcache.manager import TierReport
    return EngineSnapshot(**dict(d, tiers=[TierReport(**t) for t in d["tiers"]]))
