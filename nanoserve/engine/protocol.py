"""What the API side and the engine core share, with no model code behind it (the API process imports
this, never the model stack): errors, the engine snapshot, the metrics hooks, the loaded model's
metadata, validated requests, and the typed messages the two exchange over zmq.

Messages are dataclasses, msgpack-encoded by msgspec as [type name, fields] and decoded into their
typed form (msgspec is imported only there: the offline engine runs without it). Outputs travel as deltas (new
token ids and logprobs), so a long completion costs O(new tokens) per step on the wire, and no text
travels: the API side detokenizes and matches stop strings (output_processor.py) and sends `Finish`
for a choice whose stop string it found."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Union

from nanoserve.parallel.placement import CpuPlacement
from nanoserve.kvcache.report import TierReport
from nanoserve.outputs import RequestOutput, TokenLogprob
from nanoserve.sampling_params import InvalidRequest, SamplingParams


class EngineError(RuntimeError):
    """The engine failed while running a request (not the request's fault)."""


class EngineDead(RuntimeError):
    """The engine is not running (stopped or crashed)."""


class StepFailed(RuntimeError):
    """The engine step (LLMEngine.step, in the engine core) raised `cause`; `request_ids` are the requests
    it concerned (to fail, and only them)."""

    def __init__(self, request_ids: set[str], cause: Exception) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.request_ids, self.cause = request_ids, cause
        self.outputs: list[RequestOutput] = []  # of a step completed in the same turn (one step ahead)


class EngineStartError(RuntimeError):
    """The engine could not load the model (the message says why)."""


@dataclass
class EngineSnapshot:
    """A consistent view of the engine, taken on the engine loop (for /metrics)."""
    num_running: int = 0            # requests with a sequence in the running set
    num_waiting: int = 0            # requests waiting in the scheduler (+ sent, not yet seen)
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    steps: int = 0
    step_errors: int = 0
    invariant_violations: int = 0
    tiers: list[TierReport] = field(default_factory=list)
    time: float = 0.0


class MetricsObserver:
    """Hooks called as outputs arrive on the API side; the server plugs Prometheus histograms in here."""

    def on_first_token(self, ttft: float) -> None: ...
    def on_inter_token(self, itl: float) -> None: ...
    def on_finished(self, e2e: float) -> None: ...
    def on_step(self, kind: str, seconds: float) -> None: ...


@dataclass(frozen=True)
class ModelInfo:
    """What the engine reports about the loaded model (the start-up handshake)."""
    model_name: str
    source_path: str          # HF folder the tokenizer is read from (a GGUF is materialized first)
    vocab_size: int
    max_model_len: int
    max_token_chars: int      # longest text one token stands for (cheap prompt-length refusal)
    eos_token_ids: tuple[int, ...]


@dataclass
class PromptRequest:
    """A validated, tokenized request; `max_tokens` is resolved against the context length."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    arrival_time: float = field(default_factory=time.monotonic)  # CLOCK_MONOTONIC: system-wide


def make_prompt_request(info: ModelInfo, tokenize: Callable[[str, bool], list[int]], request_id: str,
                        prompt: str | list[int], params: SamplingParams,
                        add_special_tokens: bool = True) -> PromptRequest:
    """Validate and tokenize. Raises InvalidRequest naming the bad field."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequest("prompt must not be empty", param="prompt")
        if len(prompt) > info.max_model_len * info.max_token_chars:  # refused without tokenizing it
            raise InvalidRequest(
                f"This model's maximum context length is {info.max_model_len} tokens, and a prompt of "
                f"{len(prompt)} characters has more tokens than that.", param="prompt",
                code="context_length_exceeded")
        text, ids = prompt, tokenize(prompt, add_special_tokens)
    else:
        text, ids = None, list(prompt)
    check_token_ids(info, ids)
    n, limit = len(ids), info.max_model_len
    max_tokens = params.max_tokens if params.max_tokens is not None else limit - n
    if params.min_tokens > max(max_tokens, 0):
        raise InvalidRequest(f"min_tokens {params.min_tokens} exceeds the tokens left for the completion "
                             f"({max_tokens})", param="min_tokens")
    if n + max(max_tokens, 1) > limit:
        raise InvalidRequest(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{n + max_tokens} tokens ({n} in the prompt, {max_tokens} for the completion). "
            "Please reduce the length of the prompt or max_tokens.",
            param="prompt" if n >= limit else "max_tokens", code="context_length_exceeded")
    return PromptRequest(request_id, text, ids, params, max_tokens)


def check_token_ids(info: ModelInfo, ids: list[int]) -> None:
    if not ids:
        raise InvalidRequest("prompt must contain at least one token", param="prompt")
    vocab = info.vocab_size
    bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
    if bad:
        raise InvalidRequest(f"token id {bad[0]!r} is out of vocabulary (valid: 0..{vocab - 1})",
                             param="prompt")


def check_prompt_request(info: ModelInfo, req: PromptRequest) -> None:
    """The engine's guard on what it is sent (it trusts no client): ids in the vocabulary and the
    resolved length within the context."""
    check_token_ids(info, req.prompt_token_ids)
    if not 1 <= req.max_tokens or len(req.prompt_token_ids) + req.max_tokens > info.max_model_len:
        raise InvalidRequest(f"{len(req.prompt_token_ids)} prompt tokens + max_tokens {req.max_tokens} do "
                             f"not fit the context ({info.max_model_len})", param="max_tokens",
                             code="context_length_exceeded")


# ---- API -> engine -------------------------------------------------------------------------------
@dataclass
class Add:
    request: PromptRequest


@dataclass
class Abort:
    request_id: str


@dataclass
class Finish:
    """The API side found a stop string in these choices: finish them (reason "stop")."""
    request_id: str
    indices: list[int]
    stop_reason: str


@dataclass
class FailAll:
    """Abort everything in flight or queued; each request gets EngineDead(reason)."""
    reason: str


@dataclass
class SnapshotAsk:
    token: int


@dataclass
class Stop:
    """Abort what is running and stop the loop."""


ToEngine = Union[Add, Abort, Finish, FailAll, SnapshotAsk, Stop]


# ---- engine -> API -------------------------------------------------------------------------------
@dataclass
class Ready:
    info: ModelInfo
    placement: CpuPlacement  # as the engine process planned it: the API process takes its own part


@dataclass
class StartFailed:
    message: str


@dataclass
class ChoiceDelta:
    index: int
    token_ids: list[int]                    # new since the last delta
    logprobs: list[TokenLogprob] | None     # new since the last delta; None when not asked for
    finish_reason: str | None
    stop_reason: str | int | None


@dataclass
class OutputDelta:
    request_id: str
    finished: bool
    num_cached_tokens: int
    num_device_cached_tokens: int
    num_host_cached_tokens: int
    prompt_logprobs: list[TokenLogprob | None] | None  # in the first delta only
    metrics: dict[str, float] | None                   # in the last delta only
    choices: list[ChoiceDelta]


@dataclass
class RequestError:
    request_id: str
    kind: str                  # "engine" | "dead" | "invalid"
    message: str
    param: str | None = None
    code: str | None = None

    @classmethod
    def of(cls, request_id: str, e: BaseException) -> RequestError:
        kind = ("dead" if isinstance(e, EngineDead) else "invalid" if isinstance(e, InvalidRequest)
                else "engine")
        return cls(request_id, kind, str(e), getattr(e, "param", None), getattr(e, "code", None))

    def exception(self) -> Exception:
        if self.kind == "dead":
            return EngineDead(self.message)
        if self.kind == "invalid":
            return InvalidRequest(self.message, self.param, self.code)
        return EngineError(self.message)


@dataclass
class StepTime:
    kind: str                  # "decode" | "mixed"
    seconds: float


@dataclass
class SnapshotReply:
    token: int
    snapshot: EngineSnapshot


@dataclass
class Batch:
    """Everything one turn of the engine loop produced."""
    outputs: list[OutputDelta]
    errors: list[RequestError]
    steps: list[StepTime]
    snapshots: list[SnapshotReply]
    adds_seen: int
    num_running: int
    num_waiting: int


FromEngine = Union[Ready, StartFailed, Batch]


@dataclass
class _ChoiceSent:
    num_tokens: int = 0
    num_logprobs: int = 0


@dataclass
class DeltaEncoder:
    """Engine side, per request: encodes each cumulative RequestOutput against what was sent before."""
    sent: dict[int, _ChoiceSent] = field(default_factory=dict)
    first: bool = True

    def delta(self, out: RequestOutput) -> OutputDelta:
        choices = []
        for c in out.outputs:
            s = self.sent.setdefault(c.index, _ChoiceSent())
            lps = None if c.logprobs is None else c.logprobs[s.num_logprobs:]
            choices.append(ChoiceDelta(c.index, c.token_ids[s.num_tokens:], lps, c.finish_reason,
                                       c.stop_reason))
            s.num_tokens = len(c.token_ids)
            s.num_logprobs = len(c.logprobs or ())
        prompt_lps = out.prompt_logprobs if self.first else None
        self.first = False
        return OutputDelta(out.request_id, out.finished, out.num_cached_tokens, out.num_device_cached_tokens,
                           out.num_host_cached_tokens, prompt_lps, out.metrics if out.finished else None,
                           choices)


_TO_ENGINE = {cls.__name__: cls for cls in (Add, Abort, Finish, FailAll, SnapshotAsk, Stop)}
_FROM_ENGINE = {cls.__name__: cls for cls in (Ready, StartFailed, Batch)}


def encode(msg: ToEngine | FromEngine) -> bytes:
    import msgspec
    return msgspec.msgpack.encode((type(msg).__name__, msg))


def _decode(data: bytes, types: dict[str, type]):
    import msgspec
    name, raw = msgspec.msgpack.decode(data, type=tuple[str, msgspec.Raw])
    return msgspec.msgpack.decode(raw, type=types[name])


def decode_to_engine(data: bytes) -> ToEngine:
    return _decode(data, _TO_ENGINE)


def decode_from_engine(data: bytes) -> FromEngine:
    return _decode(data, _FROM_ENGINE)
