"""The engine's requests: what each holds, the tokens its sequences receive and why they finish, and the
counters of it all. The step hands it sampled tokens; the engine's callers add, abort and finish
through it."""
from __future__ import annotations

from dataclasses import dataclass, field

from nanoserve.engine.grammar import GrammarMatchers
from nanoserve.engine.requests import Request, request_output
from nanoserve.outputs import RequestOutput, TokenLogprob
from nanoserve.sampling_params import InvalidRequest
from nanoserve.scheduler import Scheduler
from nanoserve.sequence import Sequence


@dataclass
class EngineStats:
    """Monotonic counters for /metrics and benchmarks."""
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # by finish reason
    steps: int = 0


class RequestTable:
    def __init__(self, scheduler: Scheduler, grammars: GrammarMatchers) -> None:
        self.scheduler, self.grammars = scheduler, grammars
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()

    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise InvalidRequest(f"duplicate request id {req.request_id!r}", param="request_id")
        self.requests[req.request_id] = req
        self.grammars.add(req.seqs)
        self.stats.prompt_tokens += len(req.prompt_token_ids) * len(req.seqs)
        for seq in req.seqs:
            self.scheduler.add(seq)

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        for seq in req.seqs:
            if not seq.is_finished:
                self.finish_seq(seq, "abort")
        return self.output(req)

    def finish(self, request_id: str, indices: list[int], stop_reason: str) -> RequestOutput | None:
        """Finish these choices with reason "stop" (the output processor found their stop string)."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        for seq in req.seqs:
            if seq.index in indices and not seq.is_finished:
                seq.stop_reason = stop_reason
                self.finish_seq(seq, "stop")
        return self.output(req)

    def discard(self, request_id: str) -> None:
        """Forget a request whose abort failed, so that it cannot fail every later step."""
        self.requests.pop(request_id, None)

    def append(self, seq: Sequence, tok: int, lp: TokenLogprob | None, now: float) -> Request:
        """A sampled token into its sequence, which it may finish; returns the sequence's request."""
        req = self.requests[seq.request_id]
        seq.token_ids.append(tok)
        self.stats.generation_tokens += 1
        if seq.first_token_time is None:
            seq.first_token_time = now
        if lp is not None:
            seq.output_logprobs.append(lp)
        p = seq.params
        if (grammar_end := self.grammars.accept(seq, tok)) is not None:  # complete (or, a bug, refused)
            self.finish_seq(seq, grammar_end)
        elif tok in p.stop_token_ids:
            seq.stop_reason = tok
            self.finish_seq(seq, "stop")
        elif tok in seq.eos_token_ids and not p.ignore_eos:
            self.finish_seq(seq, "stop")
        elif seq.num_output_tokens >= seq.max_tokens:
            self.finish_seq(seq, "length")
        return req

    def finish_seq(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        self.scheduler.finish(seq)
        self.grammars.free(seq)
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1

    def output(self, req: Request) -> RequestOutput:
        out = request_output(req)
        if out.finished:
            del self.requests[req.request_id]
        return out
