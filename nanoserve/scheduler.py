"""Continuous batching: each step gives every running sequence its next tokens (a decode token or
the next prefill chunk) within a token budget, then admits waiting sequences FCFS. When blocks
run out, the most recently admitted sequence is preempted: its blocks go back to the cache and it
waits again at the head of the queue, so resuming it is a prefix hit rather than a full recompute.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from nanoserve.kvcache.manager import KVCacheManager
from nanoserve.sequence import Sequence, SeqStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens computed this step, starting at seq.num_computed_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    num_preempted: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.kv.allocate_slots(seq, n):
                victim = self.running.pop()
                self._preempt(victim)
                out.num_preempted += 1
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSeq(seq, n))
                budget -= n
                i += 1
        if out.num_preempted:
            return out  # memory is tight: admit nobody until the running set drains
        skipped: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.parent is not None and not (seq.parent.prompt_done or seq.parent.is_finished):
                skipped.append(self.waiting.popleft())  # n > 1: wait for the shared prompt's KV
                continue
            if not self.kv.admit(seq, budget):
                break
            self.waiting.popleft()
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        self.waiting.extendleft(reversed(skipped))
        return out

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a sequence wherever it is and release its blocks (finished, aborted or failed)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status = SeqStatus.FINISHED
