"""Messages between the API process and the engine-core process: msgpack over zmq PUSH/PULL.

API -> engine:  ["add", rid, prompt_token_ids, sampling params, arrival (monotonic, system-wide)]
                ["abort", rid] | ["fail_all", reason] | ["snapshot", token] | ["stop"]
engine -> API:  ["ready", ModelInfo] | ["failed", message]            (start-up handshake)
                ["batch", outputs, errors, records, snapshots, adds_seen, num_running, num_waiting]
                  output:   [rid, finished, cached, device_cached, host_cached, prompt_logprobs | None,
                             metrics | None, choices]
                  choice:   [index, text_keep, text_add, stream_len, new_token_ids, new_logprobs | None,
                             finish_reason, stop_reason]
                  error:    [rid, kind ("engine" | "dead" | "invalid"), message, param, code]
                  record:   ["ttft", s] | ["itl", s] | ["e2e", rid, s] | ["step", kind, s]
                  snapshot: [token, EngineSnapshot fields]

Outputs travel as deltas (new token ids and logprobs, the text edit since the last send) so a long
completion costs O(new tokens) per step on the wire, not O(all tokens). Detokenization and stop
strings still run in the engine process (the text travels): moving them to the API process, as
vLLM V1's output processor does, is not done yet.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import msgpack

from nanoserve.outputs import CompletionOutput, RequestOutput
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
    text: str = ""
    num_tokens: int = 0
    num_logprobs: int = 0


def output_delta(out: RequestOutput, sent: dict[int, ChoiceSent], first: bool) -> list:
    """Encode `out` against what was sent before, and advance `sent`."""
    choices = []
    for c in out.outputs:
        s = sent.setdefault(c.index, ChoiceSent())
        keep = len(s.text) if c.text.startswith(s.text) else _common_prefix(s.text, c.text)
        new_lps = None
        if c.logprobs is not None:
            new_lps = lps_to_wire(c.logprobs[s.num_logprobs:])
            s.num_logprobs = len(c.logprobs)
        choices.append([c.index, keep, c.text[keep:], len(c.stream_text), c.token_ids[s.num_tokens:], new_lps,
                        c.finish_reason, c.stop_reason])
        s.text, s.num_tokens = c.text, len(c.token_ids)
    prompt_lps = lps_to_wire(out.prompt_logprobs) if first and out.prompt_logprobs is not None else None
    return [out.request_id, out.finished, out.num_cached_tokens, out.num_device_cached_tokens,
            out.num_host_cached_tokens, prompt_lps, out.metrics if out.finished else None, choices]


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclasses.dataclass
class OutputBuilder:
    """Rebuilds a request's cumulative RequestOutputs from deltas (API side)."""
    prompt: str | None
    prompt_token_ids: list[int]
    want_logprobs: bool
    choices: dict[int, CompletionOutput] = dataclasses.field(default_factory=dict)
    stream_len: dict[int, int] = dataclasses.field(default_factory=dict)
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def apply(self, d: list) -> RequestOutput:
        rid, finished, cached, dev, host, prompt_lps, metrics, choices = d
        if prompt_lps is not None:
            self.prompt_logprobs = lps_from_wire(prompt_lps)
        for index, keep, add, stream_len, ids, lps, finish, stop in choices:
            c = self.choices.get(index)
            if c is None:
                c = self.choices[index] = CompletionOutput(index, "", [], logprobs=[] if self.want_logprobs else None)
            c.text = c.text[:keep] + add
            c.token_ids.extend(ids)
            if lps is not None and c.logprobs is not None:
                c.logprobs.extend(lps_from_wire(lps))
            c.finish_reason, c.stop_reason = finish, stop
            self.stream_len[index] = stream_len
        # fresh objects per output: the consumer may keep an earlier one while we extend ours
        outs = [dataclasses.replace(c, token_ids=list(c.token_ids), stream_text=c.text[:self.stream_len[i]],
                                    logprobs=None if c.logprobs is None else list(c.logprobs))
                for i, c in sorted(self.choices.items())]
        return RequestOutput(rid, self.prompt, self.prompt_token_ids, outs, finished, cached, dev, host,
                             prompt_logprobs=self.prompt_logprobs, metrics=metrics or {})


def snapshot_to_wire(snap: Any) -> dict:
    return dataclasses.asdict(snap)


def snapshot_from_wire(d: dict) -> Any:
    from nanoserve.engine.async_engine import EngineSnapshot
    from nanoserve.kvcache.manager import TierReport
    return EngineSnapshot(**dict(d, tiers=[TierReport(**t) for t in d["tiers"]]))
