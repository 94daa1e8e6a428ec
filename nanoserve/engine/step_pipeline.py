"""A step as three moves: launch (plan it, start its forward), collect (wait for the forward, sample),
and the engine's completion (tokens into their sequences, stops, outputs). Serially, the three follow
each other. One step ahead (`--async-scheduling`, the default with CUDA), step N+1 is scheduled while
step N's kernels run, and launched as soon as N is sampled; N is completed while N+1 computes.

On CPU the forward runs in the caller's thread and one step ahead is off by default: its torch and C++
kernels keep every core busy through OpenMP, and host work beside them does not hide, it preempts them.
Measured on a 2-core EPYC (bf16, the embedded model, batch-1 decode): a forward of 5-7 ms took 24 ms with
a Python thread busy beside it, and 13 ms when run on a second thread at all (two OpenMP teams on two
cores: libgomp stops spinning and every parallel region waits on a futex). Serially, the host's share
of a decode step is 4-7% (bench/latency.py --one-ahead; docs/performance.md). One step ahead still runs on
CPU when asked (`--async-scheduling`): it is how the tests check what CUDA runs.

What a step one ahead cannot know yet is N's sampled tokens. The scheduler counts them (each sampling
sequence's `num_pending`); the plan of N+1 marks their rows (`StepPlan.placeholder_rows`) and takes them
from N's sampled tokens: on the device (CUDA, one rank: no host round trip), else on the host, where they
are anyway (CPU) or where the other tensor-parallel ranks must receive them with the plan.

A sequence that N finishes (EOS, stop token, grammar complete, abort) may already be in N+1: its row is
computed and dropped, and nothing of it reaches a client. A sequence whose pending token is its last
(`max_tokens`) is not scheduled again. Grammar masks need the token before: N+1's mask is built when N+1
is sampled, after N's token was accepted, so constrained requests run one step ahead like any other."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from nanoserve.engine.grammar import GrammarMatchers
from nanoserve.layers.sampler import Sampler, SampleResult
from nanoserve.parallel.ranks import Ranks
from nanoserve.runner.model_runner import ModelRunner
from nanoserve.runner.step_plan import PromptLogitRows, StepPlan
from nanoserve.scheduler import ScheduledSeq
from nanoserve.sequence import Sequence


@dataclass
class Launched:
    """A step whose forward has started."""
    scheduled: list[ScheduledSeq]
    starts: list[int]                 # each scheduled sequence's first position in it
    samplers: list[Sequence]          # the sequences it samples, in its logits' row order
    prompt_rows: list[PromptLogitRows]
    logits: torch.Tensor | None       # None on the other tensor-parallel ranks
    sample_rows: dict[int, int] = field(default_factory=dict)  # seq id -> row in `samplers`

    @property
    def request_ids(self) -> set[str]:
        return {s.seq.request_id for s in self.scheduled}


@dataclass
class Collected:
    """A step whose forward has returned and whose sequences have been sampled."""
    launched: Launched
    result: SampleResult | None       # None: nothing sampled (prefill chunks only)


class StepPipeline:
    def __init__(self, runner: ModelRunner, sampler: Sampler, grammars: GrammarMatchers, ranks: Ranks,
                 one_ahead: bool) -> None:
        self.runner, self.sampler, self.grammars = runner, sampler, grammars
        self.ranks, self.one_ahead = ranks, one_ahead
        self.busy_seconds = 0.0  # inside forwards (CPU: the compute; CUDA: the launches), for bench/
        # the placeholders on the device only where there is one: on CPU the tokens are host memory, and
        # the other ranks receive the plan with its tokens
        self.on_device = runner.device.type == "cuda" and ranks.followers is None

    def launch(self, scheduled: list[ScheduledSeq], prev: Collected | None) -> Launched:
        plan, samplers, prompt_rows = self.runner.plan(scheduled, prev.launched.sample_rows if prev else None)
        tokens = None
        if plan.placeholder_rows:
            if self.on_device:
                tokens = prev.result.tokens
            else:
                plan.resolve(prev.result.token_ids)
        starts = [s.seq.num_computed_tokens for s in scheduled]
        for s in scheduled:  # what scheduling sees from now on: these computed, their samples pending
            s.seq.num_computed_tokens += s.num_tokens
            s.seq.num_inflight_tokens += s.num_tokens
        for seq in samplers:
            seq.num_pending += 1
        if listener := self.runner.listener:
            self.ranks.guard(listener.before, plan)
        t0 = time.perf_counter()
        try:
            logits = self.ranks.guard(self._forward, plan, tokens)
        finally:
            self.busy_seconds += time.perf_counter() - t0
        return Launched(scheduled, starts, samplers, prompt_rows, logits,
                        {seq.seq_id: i for i, seq in enumerate(samplers)})

    def _forward(self, plan: StepPlan, tokens: torch.Tensor | None) -> torch.Tensor | None:
        logits = self.runner.execute(plan, tokens)
        if listener := self.runner.listener:
            listener.after()
        return logits

    def collect(self, launched: Launched) -> Collected:
        """Score prompt tokens, sample (on CUDA queued behind the forward's kernels)."""
        logits, samplers = launched.logits, launched.samplers
        row = len(samplers)
        for pr in launched.prompt_rows:
            targets = pr.seq.token_ids[pr.first_target:pr.first_target + pr.count]
            pr.seq.prompt_logprobs += self.sampler.prompt_logprobs(
                logits[row:row + pr.count], targets, pr.seq.params.prompt_logprobs)
            row += pr.count
        if not samplers:
            return Collected(launched, None)
        sampled = self.sampler(logits[:len(samplers)], samplers, self.grammars.bitmask(samplers))
        return Collected(launched, sampled)
